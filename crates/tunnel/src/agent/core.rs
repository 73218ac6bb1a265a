//! What every part of the agent shares: the [`Agent`] itself (its options,
//! TLS, metrics, and the streams it holds, one per server replica) and the
//! pacing rules of finding and keeping replicas. Like the server's
//! `core`, it uses no other part that uses it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ipnet::IpNet;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use super::link_driver::LinkDriver;
use super::metrics::AgentMetrics;
use crate::transport::grpc::H2Settings;

/// Agent options.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Server `host:port` (a LoadBalancer or the gateway).
    pub server: String,
    /// TLS server name (SNI); default: the host of `server`.
    pub server_name: String,
    /// CA of the server's certificate.
    pub ca: PathBuf,
    /// Client certificate and key (the cluster's agent identity).
    pub identity: Option<(PathBuf, PathBuf)>,
    /// ALPN protocols offered besides `h2` (to be routed by ALPN).
    pub alpn: Vec<String>,
    /// `agentid`.
    pub agent_id: String,
    /// `agentidentifiers` (URL query form).
    pub identifiers: String,
    /// A ServiceAccount token file sent as `authorization: Bearer`, re-read per connect.
    pub token_path: Option<PathBuf>,
    /// Allowed destination networks (empty: all but the denied).
    pub allow: Vec<IpNet>,
    /// Allowed destination ports (empty: all).
    pub allow_ports: Vec<u16>,
    /// Denied networks (checked first).
    pub deny: Vec<IpNet>,
    /// Deadline for a destination dial (and its name lookup).
    pub dial_timeout: Duration,
    /// First retry delay and the delay between replica-discovery dials.
    pub sync_interval: Duration,
    /// Largest retry delay.
    pub sync_interval_cap: Duration,
    /// HTTP/2 PING interval and timeout.
    pub keepalive: H2Settings,
    /// A destination that accepts no byte for this long is closed.
    pub stall_timeout: Duration,
    /// Per-connection queue budget towards a destination.
    pub queue_bytes: usize,
    /// Offer per-connection flow control (used when the server is seedlink).
    pub flow_control: bool,
    /// Offer the native transport (`seedlink-tunnel/1`) before `h2`; it
    /// needs `flow_control`.
    pub native: bool,
    /// Dial the replicas a seedlink server says where to reach directly,
    /// besides `server` (no load balancer needed in front of them).
    pub replica_addresses: bool,
    /// Leave through this HTTP CONNECT proxy (a private network's only way
    /// out); the proxy resolves the server's name.
    pub egress: Option<seedlink_net::egress::EgressProxy>,
}

/// A running agent.
pub struct Agent {
    /// Options.
    pub opts: AgentOptions,
    /// Metrics.
    pub metrics: AgentMetrics,
    pub(super) tls: TlsConnector,
    /// With the native transport offered: the configuration for usertls.rs.
    pub(super) user_tls: Option<Arc<rustls::ClientConfig>>,
    pub(super) sessions: Mutex<HashMap<String, Arc<LinkDriver>>>,
    /// Where the servers said each replica is reached (REPLICAS with
    /// addresses, checked, at most [`crate::wire::MAX_REPLICA_ADDRESSES`]).
    pub(super) replica_addresses: Mutex<Vec<crate::wire::proto::Replica>>,
    /// Turns through the replicas to dial (see [`Agent::target`]).
    pub(super) next_target: std::sync::atomic::AtomicUsize,
    pub(super) known_count: AtomicI64,
    pub(super) draining: AtomicBool,
    /// The PING interval in use (ms): `opts.keepalive`, doubled each time a
    /// server answers GOAWAY `too_many_pings` (as grpc-go's client does).
    pub(super) keepalive_ms: std::sync::atomic::AtomicU64,
    /// A stream to a server ended: replica discovery resumes at once.
    pub(super) session_lost: tokio::sync::Notify,
    /// A server said there are more replicas than held: discovery resumes
    /// soon (see `Agent::pause`).
    pub(super) replicas_told: tokio::sync::Notify,
    /// Streams in a row that ended or were drained soon after they opened
    /// ([`STABLE`]): discovery backs off by them (a server that accepts
    /// and drops every stream is not dialled in a loop).
    pub(super) flaps: std::sync::atomic::AtomicU32,
    /// Streams whose server said DRAIN and that still carry connections
    /// ([`MAX_DRAINING`] at most).
    pub(super) draining_streams: std::sync::atomic::AtomicUsize,
    /// Its client certificate and key, when it presents one: watched
    /// every [`IDENTITY_CHECK`] for a renewal.
    pub(super) identity: Option<Arc<crate::auth::tls::ReloadingIdentity>>,
    /// Cancelled to stop everything.
    pub shutdown: CancellationToken,
}

/// How often the agent looks whether its certificate files changed (a
/// renewal): then each stream is replaced by one presenting the new
/// certificate before the old one goes.
pub(super) const IDENTITY_CHECK: Duration = Duration::from_secs(5);

/// How long a stream the agent drains must carry nothing, behind its
/// replacement, before the agent ends it.
pub(super) const IDLE_BEFORE_CLOSE: Duration = Duration::from_secs(2);

/// Where one connection attempt goes: `--server`, or a replica's own
/// address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    /// `host:port`.
    pub(super) address: String,
    /// The TLS server name (SNI, and the name the certificate must have).
    pub(super) server_name: String,
}

/// The shortest PING interval a server's answer can set (its
/// `seedlink-keepalive-ms`).
pub(super) const SERVER_KEEPALIVE_FLOOR: Duration = Duration::from_secs(1);

/// A stream that lasts this long was a stable one.
pub(super) const STABLE: Duration = Duration::from_secs(10);

/// Draining streams an agent keeps at once: a server that says DRAIN on
/// every stream cannot make it hold streams (and sockets) without end.
pub(super) const MAX_DRAINING: usize = 8;

/// The wait before the next connection attempt after a failure, and the
/// delay after that. A refusal (the server is there but says no, or is
/// restarting) backs off ×1.5 up to `cap`. A timeout (a partition or a
/// frozen server: packets unanswered) does not grow the back-off: the
/// attempt itself already waited its deadline, and a grown back-off would
/// only delay the return after the network heals (measured 8.1 s with the
/// old rule); it waits `base` and tries again.
pub fn retry_delay(
    delay: Duration,
    timed_out: bool,
    base: Duration,
    cap: Duration,
) -> (Duration, Duration) {
    if timed_out {
        (base, base)
    } else {
        (delay, delay.mul_f64(1.5).min(cap))
    }
}

/// The wait before the next dial after `flaps` streams in a row that did
/// not last: none after a stable one, then `base` growing ×1.5 up to `cap`.
pub fn flap_delay(flaps: u32, base: Duration, cap: Duration) -> Duration {
    if flaps == 0 {
        return Duration::ZERO;
    }
    let grown = base.mul_f64(1.5f64.powi(i32::try_from(flaps - 1).unwrap_or(i32::MAX).min(64)));
    grown.min(cap)
}

/// Longest PING interval the back-off reaches.
pub(super) const KEEPALIVE_CAP: Duration = Duration::from_secs(3600);

/// Replica discovery while a stream to every replica is held: a slow
/// re-check, only to notice a raised `servercount` (a replaced replica
/// ends its stream, which restarts discovery at once).
pub(super) const HELD_RECHECK: Duration = Duration::from_secs(300);
