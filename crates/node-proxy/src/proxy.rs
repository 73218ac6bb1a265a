//! A running node-proxy's model and shared state: how it carries
//! connections (`Mode`, `Options`), its metrics, and `NodeProxy`, which the
//! connection path (`tunnel`), the checks (`health`) and the admin endpoint
//! take. What it does is in the crate root (`serve`, `accept`, `drain`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use seedlink_net::egress::EgressProxy;
use seedlink_net::lifecycle::Lifecycle;
use tokio::sync::Semaphore;

use crate::health::state::{HealthCheck, HealthState};
use crate::tunnel::state::{H2Session, Resolver};

/// How connections are carried to the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// HTTP/1.1 CONNECT with the destination header (GEP-30).
    Connect,
    /// A PROXY protocol v2 header, then the bytes (GEP-08 legacy port).
    ProxyV2,
    /// A PROXY protocol v1 header, then the bytes.
    ProxyV1,
    /// HTTP/2 CONNECT (h2c with prior knowledge): every tunnel is a stream
    /// on one shared connection to the gateway, with h2 flow control.
    Http2Connect,
}

/// Everything the node-proxy needs to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// `host:port` of the gateway; a DNS name (a trailing dot is fine) is
    /// re-resolved every `resolve_ttl`.
    pub gateway: String,
    /// How connections are carried.
    pub mode: Mode,
    /// Header name and value naming the destination (CONNECT mode).
    pub header: (String, String),
    /// Request target of the CONNECT (logged by the gateway, not used).
    pub authority: String,
    /// TCP connect deadline per gateway address.
    pub connect_timeout: Duration,
    /// Deadline for the gateway's answer to CONNECT.
    pub handshake_timeout: Duration,
    /// How long a resolution of the gateway name is reused.
    pub resolve_ttl: Duration,
    /// Concurrent tunnels; more are accepted and closed at once.
    pub max_connections: usize,
    /// How long a drain waits for tunnels to end.
    pub drain: Duration,
    /// A TLV (type, value) added to every PROXY v2 header: HyperShift's
    /// cluster ID (type 0x20) that a shared ingress routes by.
    pub tlv: Option<(u8, Vec<u8>)>,
    /// An HTTP CONNECT forward proxy every gateway connection goes through.
    pub egress: Option<EgressProxy>,
    /// The health check readiness follows.
    pub health: HealthCheck,
    /// The address clients connect to: the destination of a health check's
    /// PROXY header (the legacy port routes by it).
    pub advertised: SocketAddr,
}

/// Labels with a check result.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or why the check failed.
    pub result: String,
}

/// Labels with an outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// How the tunnel ended.
    pub outcome: String,
}

/// Metrics of the node-proxy.
pub struct Metrics {
    /// Registry served on `/metrics`.
    pub registry: Registry,
    /// The per-tunnel failure lines, rate-limited (the rest counted).
    pub refusal_log: seedlink_net::loglimit::LogLimiter,
    /// Finished tunnels by outcome.
    pub tunnels: Family<OutcomeLabels, Counter>,
    /// Open tunnels.
    pub active: Gauge,
    /// Failed connects to gateway addresses.
    pub gateway_connect_failures: Counter,
    /// Times the address had to be put back on the interface.
    pub address_reasserted: Counter,
    /// Health checks by result.
    pub health_checks: Family<ResultLabels, Counter>,
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::with_prefix("seedlink_node_proxy");
        let tunnels = Family::<OutcomeLabels, Counter>::default();
        let active = Gauge::default();
        let gateway_connect_failures = Counter::default();
        let address_reasserted = Counter::default();
        registry.register("tunnels", "Finished tunnels by outcome", tunnels.clone());
        registry.register("active_tunnels", "Open tunnels", active.clone());
        registry.register(
            "gateway_connect_failures",
            "Failed TCP connects to a gateway address",
            gateway_connect_failures.clone(),
        );
        registry.register(
            "address_reasserted",
            "Times the advertised address was missing and put back",
            address_reasserted.clone(),
        );
        let health_checks = Family::<ResultLabels, Counter>::default();
        registry.register(
            "health_checks",
            "Upstream health checks by result (ok, or why they failed)",
            health_checks.clone(),
        );
        let refusal_log = seedlink_net::loglimit::LogLimiter::default();
        registry.register(
            "log_lines_dropped",
            "Failed-tunnel log lines not written because more than 20 per second (burst 100) came",
            refusal_log.dropped.clone(),
        );
        Metrics {
            registry,
            tunnels,
            active,
            gateway_connect_failures,
            address_reasserted,
            refusal_log,
            health_checks,
        }
    }
}

/// Shared state of a running node-proxy.
pub struct NodeProxy {
    /// Configuration.
    pub opts: Options,
    /// Metrics.
    pub metrics: Metrics,
    /// Phase and drain.
    pub lifecycle: Lifecycle,
    /// The advertised address is on its interface (or not managed).
    pub address_ok: AtomicBool,
    /// The upstream passed its health check (rise and fall applied).
    pub gateway_ok: AtomicBool,
    /// The health check's results.
    pub health: HealthState,
    /// The configuration it runs with, as `/config` shows it.
    pub config: std::sync::OnceLock<serde_json::Value>,
    pub(crate) resolver: Resolver,
    pub(crate) h2: H2Session,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) copier: seedlink_net::copy::Copier,
}

impl NodeProxy {
    /// A node-proxy with `opts`; `address_managed` says whether readiness
    /// must wait for the interface manager to confirm the address.
    pub fn new(opts: Options, address_managed: bool) -> Arc<NodeProxy> {
        Arc::new(NodeProxy {
            permits: Arc::new(Semaphore::new(
                opts.max_connections.clamp(1, Semaphore::MAX_PERMITS),
            )),
            // With an egress proxy, the proxy is dialled and resolves the
            // gateway's name itself.
            resolver: Resolver::new(
                opts.egress
                    .as_ref()
                    .map_or_else(|| opts.gateway.clone(), |e| e.address.clone()),
                opts.resolve_ttl,
            ),
            h2: H2Session::default(),
            opts,
            metrics: Metrics::new(),
            lifecycle: Lifecycle::new(),
            address_ok: AtomicBool::new(!address_managed),
            gateway_ok: AtomicBool::new(false),
            health: HealthState::default(),
            config: std::sync::OnceLock::new(),
            copier: seedlink_net::copy::Copier::new(seedlink_net::copy::CopyMode::Splice, 64),
        })
    }

    /// Ready when the address is in place and the gateway answered.
    pub fn ready(&self) -> bool {
        self.lifecycle.phase() == seedlink_net::lifecycle::Phase::Serving
            && self.address_ok.load(Ordering::Acquire)
            && self.gateway_ok.load(Ordering::Acquire)
    }

    pub(crate) fn count(&self, outcome: &str) {
        self.metrics
            .tunnels
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }
}
