//! What every connection handler of a tunnel-server shares: the clusters
//! and their agents, metrics, settings, and the shutdown signals. The agent
//! endpoint (`agents`), the frontends (`frontend`) and the admin endpoint
//! (`admin`) take an `Arc<Core>`; only `run` (binding and reloading) builds
//! one, so the handlers never depend on `run` or on each other.

use arc_swap::ArcSwap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::metrics::Metrics;
use super::{DialSettings, Registry};
use crate::transport::grpc::H2Settings;

/// Timeouts and budgets.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// TLS handshake, request head, first gRPC packet.
    pub handshake_timeout: Duration,
    /// Agent's answer to a dial.
    pub dial_timeout: Duration,
    /// A dial finding no agent waits this long for one (within its
    /// deadline).
    pub agent_wait: Duration,
    /// No progress writing to a frontend.
    pub stall_timeout: Duration,
    /// Per-connection queue budget.
    pub queue_bytes: usize,
}

/// Token checks one source (an IPv4 address, an IPv6 /64) may have under
/// way at once: an agent needs one; a TokenReview'd cluster has 8 review
/// slots, so one address can hold at most a quarter of them.
pub const TOKEN_CHECKS_PER_SOURCE: usize = 2;

/// How long a source that connects at more than twice its handshake rate
/// is shut out at the agent port.
pub const SHUT_OUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The shared state of a running tunnel-server.
pub struct Core {
    /// Clusters and their agents.
    pub registry: Registry,
    /// Metrics.
    pub metrics: Metrics,
    /// Timeouts and budgets.
    pub settings: Settings,
    /// Agent connections: at most so many at once and per source address.
    pub agent_slots: seedlink_net::admin::Slots,
    /// Unauthenticated agent connections (before TLS names a cluster or a
    /// stream is admitted): at most so many at once and per source, so
    /// that anonymous peers never hold the slots agents need.
    pub pre_auth_slots: seedlink_net::admin::Slots,
    /// TLS handshakes per source and second.
    pub handshakes: seedlink_net::rate::PerSource,
    /// Connections refused for `handshakes` a source may still make before
    /// it is shut out at the agent port (`shut_out`).
    pub over_rate: seedlink_net::rate::PerSource,
    /// Sources shut out at the agent port: the kernel drops their SYNs
    /// for [`SHUT_OUT`] (`seedlink_net::synblock`).
    pub shut_out: seedlink_net::synblock::Blocklist,
    /// What readiness waits for besides agents: a Kubernetes source's
    /// first snapshot.
    pub gates: seedlink_net::lifecycle::Gates,
    /// Where agent TLS handshakes run: a thread at a lower priority
    /// (`seedlink_net::lowprio`), so that a flood of handshakes delays
    /// handshakes, not established tunnels; `None`: on the workers.
    pub handshaker: Option<tokio::runtime::Handle>,
    /// Token checks under way per source ([`TOKEN_CHECKS_PER_SOURCE`]), so
    /// that one address sending forged tokens cannot hold every review
    /// slot of the cluster whose issuer they name.
    pub token_slots: seedlink_net::admin::Slots,
    /// `serverid` sent to agents.
    pub server_id: String,
    /// The pod this process runs in (`POD_NAME`), told to seedlink agents
    /// (`seedlink-pod`): REPLICAS entries name replicas by it.
    pub pod: Option<String>,
    /// `servercount` sent to agents: the configured `server_count`, or the
    /// replicas counted from their Service's EndpointSlices
    /// (`kubernetes.replicas`) once read.
    pub server_count: std::sync::atomic::AtomicU32,
    /// Where each replica is reached, told to agents that asked with
    /// `servercount` (`kubernetes.replica_addresses`; empty: not known).
    pub replica_addresses: ArcSwap<Vec<crate::wire::proto::Replica>>,
    /// TLS for the agent endpoint (replaced by a reload).
    pub agent_tls: ArcSwap<rustls::ServerConfig>,
    /// HTTP/2 keepalive towards agents.
    pub agent_h2: H2Settings,
    /// Cancelled on shutdown: ends agent streams and frontend connections.
    pub shutdown: CancellationToken,
    /// Cancelled when draining starts: listeners stop accepting.
    pub accepting: CancellationToken,
    /// Agents are moving to a new process (a binary upgrade): a stream
    /// registered now gets DRAIN at once.
    pub agents_moving: std::sync::atomic::AtomicBool,
    /// Agent connection tasks.
    pub tasks: TaskTracker,
    /// Frontend connection tasks (a drain waits for these).
    pub frontend_tasks: TaskTracker,
    /// The configuration in force, for `/config` (it names files only:
    /// no secret is inline), with its generation and last reload.
    pub config: ArcSwap<ConfigView>,
    /// Where seed Services are looked up (set by the Kubernetes source;
    /// unset, a seed destination naming a Service is refused).
    pub services: std::sync::OnceLock<std::sync::Arc<super::services::Services>>,
}

/// What `/config` and the live page show of the configuration.
#[derive(Debug, Clone)]
pub struct ConfigView {
    /// The configuration in force (Kubernetes clusters included).
    pub config: serde_json::Value,
    /// 1 at start, +1 per applied reload.
    pub generation: u64,
    /// When the last reload ended and how (`success`, `failure`).
    pub last_reload: Option<(std::time::SystemTime, &'static str)>,
}

impl Core {
    /// Settings for one dial.
    pub fn dial_settings(&self) -> DialSettings {
        DialSettings {
            timeout: self.settings.dial_timeout,
            agent_wait: self.settings.agent_wait,
            queue_bytes: self.settings.queue_bytes,
            unresponsive_after: super::activity::unresponsive_after(self.agent_h2.keepalive),
        }
    }

    /// Sets `servercount` and where each replica is reached (the replicas
    /// were counted again); a change is told to every agent that asked
    /// (REPLICAS), so that one holding every replica it knew of joins a
    /// new one at once. Returns the old count.
    pub fn set_replicas(&self, count: u32, addresses: Vec<crate::wire::proto::Replica>) -> u32 {
        let count = count.max(1);
        let was = self
            .server_count
            .swap(count, std::sync::atomic::Ordering::AcqRel);
        let moved = **self.replica_addresses.load() != addresses;
        if moved {
            self.replica_addresses.store(std::sync::Arc::new(addresses));
        }
        if was != count || moved {
            let packet = self.replicas_packet();
            for cluster in self.registry.clusters().iter() {
                for link in cluster.agents() {
                    link.replicas_notice(&packet);
                }
            }
        }
        was
    }

    /// REPLICAS as it stands: the count and where each replica is reached.
    pub fn replicas_packet(&self) -> crate::wire::proto::Packet {
        crate::wire::proto::Packet::replicas_at(
            i64::from(self.server_count.load(std::sync::atomic::Ordering::Acquire)),
            self.replica_addresses.load().to_vec(),
        )
    }

    /// Ready: not draining and at least one agent connected.
    pub fn ready(&self) -> bool {
        !self.accepting.is_cancelled() && self.registry.any_agent() && self.gates.unmet().is_empty()
    }
}
