//! The tunnel-server's binary upgrade: its listening sockets handed to a
//! new process (`seedlink_net::handoff`), in two phases so that no dial
//! finds a process without agents:
//! 1. the new process takes every socket and serves the agent endpoint;
//!    its frontends are bound (their accept queues shared) but it does not
//!    accept on them yet;
//! 2. phase `agents`: the old process stops accepting agents, sends DRAIN
//!    on every agent stream and names its agents; each seedlink agent opens
//!    a stream to the new process (the only one accepting agents now) while
//!    its old stream carries on what it has;
//! 3. once the new process holds those agents (or `--take-over-wait`
//!    passed), it accepts on its frontends and says `ready`; the old one
//!    stops accepting frontends and admin requests and drains its tunnels
//!    up to `--drain`.
//!
//! A new process that fails before `ready` makes the old one accept agents
//! again ([`TunnelServer::resume_agents`]).

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use seedlink_net::handoff::Socket;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::run::TunnelServer;
use crate::sync::lock;

/// The handed socket of the agent endpoint.
pub const AGENTS: &str = "agents";
/// The handed admin socket.
pub const ADMIN: &str = "admin";

/// The handed socket name of frontend `label` (`cluster/name`).
pub fn frontend(label: &str) -> String {
    format!("frontend:{label}")
}

/// A server's listening sockets as a hand-over sees them.
pub struct Sockets {
    /// Taken from the previous process and not yet claimed by a listener.
    handed: Mutex<Vec<Socket>>,
    /// Duplicates of this process's listening sockets, offered to the next
    /// one (dropped when draining: they would keep the sockets open).
    offered: Mutex<Vec<Socket>>,
    /// Cancelled once frontends may accept (at once, or after the agents
    /// moved in a hand-over).
    pub(super) frontends_open: CancellationToken,
    /// Stops the agent endpoint's accept loop (replaced when it resumes).
    pub(super) agent_accept: Mutex<CancellationToken>,
    /// The admin endpoint, ended when a new process took over.
    pub(super) admin_task: Mutex<Option<JoinHandle<()>>>,
    /// Taking over: the agent endpoint, accepted on once the old process
    /// moved its agents.
    pub(super) pending_agents: Mutex<Option<TcpListener>>,
}

impl Sockets {
    pub(super) fn new(accepting: &CancellationToken) -> Sockets {
        Sockets {
            handed: Mutex::new(Vec::new()),
            offered: Mutex::new(Vec::new()),
            frontends_open: CancellationToken::new(),
            agent_accept: Mutex::new(accepting.child_token()),
            admin_task: Mutex::new(None),
            pending_agents: Mutex::new(None),
        }
    }

    pub(super) fn set_handed(&self, sockets: Vec<Socket>) {
        *lock(&self.handed, "handed sockets") = sockets;
    }

    /// A TCP listener for `name` on `want`: the handed socket of that name
    /// and address (port 0: that IP) if there is one, else a new one.
    /// Offered on to the next process either way.
    pub(super) async fn tcp(&self, name: &str, want: SocketAddr) -> std::io::Result<TcpListener> {
        let handed = self.take(name, |fd| {
            let l = std::net::TcpListener::from(fd);
            let at = l.local_addr().ok()?;
            let same = if want.port() == 0 {
                at.ip() == want.ip()
            } else {
                at == want
            };
            same.then_some(l)
        });
        let l = match handed {
            Some(l) => {
                l.set_nonblocking(true)?;
                tracing::info!(socket = name, address = %want, "listener taken over from the running tunnel-server");
                TcpListener::from_std(l)?
            }
            None => TcpListener::bind(want).await?,
        };
        self.record(
            name,
            &l.local_addr()?.to_string(),
            l.as_fd().try_clone_to_owned()?,
        );
        Ok(l)
    }

    /// The handed Unix listener for `name` bound at `path`, if there is one.
    pub(super) fn take_unix(
        &self,
        name: &str,
        path: &Path,
    ) -> std::io::Result<Option<tokio::net::UnixListener>> {
        let handed = self.take(name, |fd| {
            let l = std::os::unix::net::UnixListener::from(fd);
            let at = l.local_addr().ok()?;
            (at.as_pathname() == Some(path)).then_some(l)
        });
        match handed {
            Some(l) => {
                l.set_nonblocking(true)?;
                tracing::info!(socket = name, path = %path.display(), "listener taken over from the running tunnel-server");
                Ok(Some(tokio::net::UnixListener::from_std(l)?))
            }
            None => Ok(None),
        }
    }

    /// The first handed socket named `name` that `fits` accepts.
    fn take<T>(&self, name: &str, fits: impl Fn(OwnedFd) -> Option<T>) -> Option<T> {
        let mut handed = lock(&self.handed, "handed sockets");
        let i = handed.iter().position(|s| s.name == name)?;
        let s = handed.remove(i);
        fits(s.fd)
    }

    /// Offers `fd` (a duplicate) as `name` to the next process.
    pub(super) fn record(&self, name: &str, address: &str, fd: OwnedFd) {
        let mut offered = lock(&self.offered, "offered sockets");
        offered.retain(|s| s.name != name);
        offered.push(Socket {
            name: name.to_string(),
            address: address.to_string(),
            fd,
        });
    }

    /// Stops offering `name` (its listener stopped).
    pub(super) fn forget(&self, name: &str) {
        lock(&self.offered, "offered sockets").retain(|s| s.name != name);
    }

    /// Duplicates of what is offered now.
    pub fn current(&self) -> std::io::Result<Vec<Socket>> {
        lock(&self.offered, "offered sockets")
            .iter()
            .map(|s| {
                Ok(Socket {
                    name: s.name.clone(),
                    address: s.address.clone(),
                    fd: s.fd.try_clone()?,
                })
            })
            .collect()
    }

    /// Closes the offered duplicates and the unclaimed handed sockets.
    pub(super) fn clear(&self) {
        lock(&self.offered, "offered sockets").clear();
        self.drop_unclaimed();
    }

    pub(super) fn drop_unclaimed(&self) {
        for s in lock(&self.handed, "handed sockets").drain(..) {
            tracing::info!(socket = %s.name, address = %s.address, "handed-over socket not in this configuration: closed");
        }
    }
}

/// An agent of a cluster, as phase `agents` names it.
type AgentKey = (String, String);

impl TunnelServer {
    /// Phase `agents` (old process): stops accepting agents, sends DRAIN on
    /// every agent stream (one registered later gets it too) and answers
    /// the agents that will move, as JSON `{"agents":[[cluster, id],..],
    /// "clusters":[..]}`: seedlink agents that do not drain themselves, and
    /// every cluster with an agent (an upstream agent ignores DRAIN: with
    /// `--sync-forever` it finds the new process by itself when that has
    /// its own server ID, else it moves when its stream here ends).
    pub fn hand_agents_over(&self) -> String {
        self.core.agents_moving.store(true, Ordering::Release);
        lock(&self.sockets.agent_accept, "agent accept").cancel();
        let mut moving: Vec<AgentKey> = Vec::new();
        let mut served: Vec<String> = Vec::new();
        for cluster in self.registry.clusters().iter() {
            if cluster.agent_count() > 0 {
                served.push(cluster.name.to_string());
            }
            for link in cluster.agents() {
                link.drain_notice();
                let key = (cluster.name.to_string(), link.agent_id.clone());
                let moves = link.replica_updates.load(Ordering::Acquire) && !link.draining();
                if moves && !moving.contains(&key) {
                    moving.push(key);
                }
            }
        }
        tracing::info!(
            agents = moving.len(),
            "upgrade: agents told to move to the new process"
        );
        serde_json::json!({ "agents": moving, "clusters": served }).to_string()
    }

    /// The new process failed after phase `agents`: accept agents again
    /// (on the socket still offered) and stop sending late streams DRAIN.
    pub fn resume_agents(self: &Arc<Self>) {
        if self.accepting.is_cancelled() || !self.core.agents_moving.swap(false, Ordering::AcqRel) {
            return;
        }
        let fd = lock(&self.sockets.offered, "offered sockets")
            .iter()
            .find(|s| s.name == AGENTS)
            .map(|s| s.fd.try_clone());
        let listener = fd.and_then(Result::ok).and_then(|fd| {
            let l = std::net::TcpListener::from(fd);
            l.set_nonblocking(true).ok()?;
            TcpListener::from_std(l).ok()
        });
        match listener {
            Some(l) => {
                *lock(&self.sockets.agent_accept, "agent accept") = self.accepting.child_token();
                self.spawn_agent_accept(l);
                tracing::warn!("upgrade: the new process failed; accepting agents again");
            }
            None => {
                tracing::error!("upgrade: the new process failed and the agent socket cannot be used again; agents reconnect when this process restarts")
            }
        }
    }

    /// New process: waits (up to `within`) until it holds a stream of each
    /// agent the old process named (its answer to phase `agents`) and at
    /// least one agent of each cluster it named; returns what did not come
    /// (`cluster/agent`, or `cluster` for a cluster without any agent).
    pub async fn wait_for_agents(&self, answer: &str, within: Duration) -> Vec<String> {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(answer) else {
            // Nothing known to wait for: the whole wait, to be safe.
            tokio::time::sleep(within).await;
            return vec!["(the previous process's answer could not be read)".into()];
        };
        let wanted: Vec<AgentKey> = serde_json::from_value(v["agents"].clone()).unwrap_or_default();
        let served: Vec<String> = serde_json::from_value(v["clusters"].clone()).unwrap_or_default();
        let missing = || -> Vec<String> {
            let clusters = self.registry.clusters();
            let find = |c: &str| clusters.iter().find(|x| *x.name == *c).cloned();
            let agents = wanted
                .iter()
                .filter(|(c, id)| {
                    !find(c).is_some_and(|x| x.agents().iter().any(|l| l.agent_id == *id))
                })
                .map(|(c, id)| format!("{c}/{id}"));
            let empty = served
                .iter()
                .filter(|c| find(c).is_none_or(|x| x.agent_count() == 0))
                .cloned();
            agents.chain(empty).collect()
        };
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let m = missing();
            if m.is_empty() || tokio::time::Instant::now() >= deadline {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// New process: accepts agents from now on (the old process moved
    /// them, or failed to).
    pub fn accept_agents(&self) {
        let pending = lock(&self.sockets.pending_agents, "pending agents").take();
        if let Some(l) = pending {
            self.spawn_agent_accept(l);
        }
    }

    /// New process: frontends (and agents, if not yet) accept from now on.
    pub fn open_frontends(&self) {
        self.accept_agents();
        self.sockets.frontends_open.cancel();
    }

    /// Closes the handed sockets no listener claimed: once the
    /// configuration is complete (the Kubernetes source's first snapshot
    /// applied, if there is one).
    pub fn drop_unclaimed(&self) {
        self.sockets.drop_unclaimed();
    }

    /// Old process, once the new one is ready: frontends stop accepting at
    /// once (the new one takes every connection from now on), and so does
    /// the admin endpoint (the new one answers probes); the drain that
    /// follows carries the rest.
    pub fn handed_over(&self) {
        self.accepting.cancel();
        if let Some(t) = lock(&self.sockets.admin_task, "admin task").take() {
            t.abort();
        }
    }

    /// Duplicates of every listening socket, for the next process.
    pub fn offered_sockets(&self) -> std::io::Result<Vec<Socket>> {
        self.sockets.current()
    }
}
