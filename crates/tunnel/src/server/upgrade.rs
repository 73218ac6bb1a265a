//! The tunnel-server's side of a binary upgrade (`server::handover`
//! holds the sockets and the protocol's names): phase `agents` from the
//! old process's side, and the new process's wait for its agents before
//! it opens its frontends. Kept apart from `handover` so that `run`, which
//! uses the socket set, and these methods, which use the running server,
//! make no cycle.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use seedlink_net::handoff::Socket;
use seedlink_net::sync::lock;

use tokio::net::TcpListener;

use super::accept;
use super::core::Core;
use super::frontend::FrontendEnd;
use super::handover::AGENTS;
use super::run::TunnelServer;
use super::Cluster;
use std::net::SocketAddr;

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
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let m = self.missing(&wanted, &served);
            if m.is_empty() || tokio::time::Instant::now() >= deadline {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The agents in `wanted` not connected here, and the clusters in
    /// `served` with no agent here, as `cluster/agent` and `cluster`.
    fn missing(&self, wanted: &[AgentKey], served: &[String]) -> Vec<String> {
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

impl TunnelServer {
    /// Takes over an agent connection another part of this process accepted
    /// and already read from (the SNI gateway under `seedlink seed`):
    /// `replay` holds those bytes (the agent's ClientHello). Refused once
    /// draining.
    pub fn hand_over(
        self: &Arc<Self>,
        tcp: tokio::net::TcpStream,
        replay: Vec<u8>,
        peer: SocketAddr,
    ) {
        if self.accepting.is_cancelled() {
            return;
        }
        let Some(slots) = super::endpoint::enter(&self.core, peer) else {
            return;
        };
        let _ = tcp.set_nodelay(true);
        let io = seedlink_net::prefixed::Prefixed::new(replay, tcp);
        let core = self.core.clone();
        self.tasks.spawn(async move {
            super::endpoint::serve_agent_io(core, io, peer, slots).await;
        });
    }

    /// Takes over a CONNECT another part of this process read (the
    /// gateway's `http-connect` listener under `seedlink seed`, routed to a
    /// control plane named like a cluster): dials `target` through that
    /// cluster's agents and answers the CONNECT itself; `leftover` is what
    /// the client sent after the head. Counted as frontend `gateway`.
    pub fn connect_handoff(
        self: &Arc<Self>,
        tcp: tokio::net::TcpStream,
        leftover: Vec<u8>,
        cluster: &str,
        target: String,
    ) {
        let srv = self.core.clone();
        let cluster = self.registry.cluster(cluster);
        let name = cluster
            .as_ref()
            .map(|c| c.name.to_string())
            .unwrap_or_default();
        self.frontend_tasks.spawn(async move {
            let outcome = serve_handoff(&srv, cluster, tcp, leftover, &target).await;
            srv.metrics
                .frontend_conn(&name, "gateway", outcome.reason());
        });
    }
}

/// A CONNECT the gateway handed over: carried to `cluster`'s agents, or
/// refused with 503 when the cluster is unknown or this server drains.
async fn serve_handoff(
    srv: &Core,
    cluster: Option<Arc<Cluster>>,
    tcp: tokio::net::TcpStream,
    leftover: Vec<u8>,
    target: &str,
) -> FrontendEnd {
    let _ = tcp.set_nodelay(true);
    match cluster {
        Some(c) if !srv.accepting.is_cancelled() => {
            let leftover = bytes::BytesMut::from(&leftover[..]);
            super::frontend::connect_method(srv, &c, tcp, target, leftover).await
        }
        other => {
            accept::refuse_handoff(tcp).await;
            if other.is_some() {
                FrontendEnd::Draining
            } else {
                FrontendEnd::UnknownCluster
            }
        }
    }
}
