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
//! again (`TunnelServer::resume_agents`, in `server::upgrade`).

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;

use seedlink_net::handoff::Socket;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use seedlink_net::sync::lock;

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
    pub(super) handed: Mutex<Vec<Socket>>,
    /// Duplicates of this process's listening sockets, offered to the next
    /// one (dropped when draining: they would keep the sockets open).
    pub(super) offered: Mutex<Vec<Socket>>,
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
