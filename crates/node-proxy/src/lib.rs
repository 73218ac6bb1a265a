//! `seedlink node-proxy`: runs on every shoot node (host network), listens
//! on the advertised kube-apiserver address and carries each connection to
//! the seed's gateway: HTTP/1.1 CONNECT with the destination header
//! (GEP-30), HTTP/2 CONNECT streams on one shared connection (Kubermatic's
//! strategy), or, in legacy mode, a PROXY protocol header (GEP-08).
//!
//! Nothing the client sends is forwarded before the gateway's `200`.

pub mod admin;
pub mod config;
pub mod health;
pub mod netif;
pub mod tunnel;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use seedlink_net::lifecycle::Lifecycle;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

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
    pub health: health::HealthCheck,
    /// The address clients connect to: the destination of a health check's
    /// PROXY header (the legacy port routes by it).
    pub advertised: SocketAddr,
}

/// A corporate egress proxy: connections to the gateway are opened with
/// `CONNECT <gateway> HTTP/1.1` through it (HyperShift's
/// `kubernetes-default-proxy` does the same).
pub use seedlink_net::egress::EgressProxy;

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
    fn new() -> Metrics {
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
    pub health: health::HealthState,
    /// The configuration it runs with, as `/config` shows it.
    pub config: std::sync::OnceLock<serde_json::Value>,
    resolver: tunnel::Resolver,
    h2: tunnel::H2Session,
    permits: Arc<Semaphore>,
    copier: seedlink_net::copy::Copier,
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
            resolver: tunnel::Resolver::new(
                opts.egress
                    .as_ref()
                    .map_or_else(|| opts.gateway.clone(), |e| e.address.clone()),
                opts.resolve_ttl,
            ),
            h2: tunnel::H2Session::default(),
            opts,
            metrics: Metrics::new(),
            lifecycle: Lifecycle::new(),
            address_ok: AtomicBool::new(!address_managed),
            gateway_ok: AtomicBool::new(false),
            health: health::HealthState::default(),
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

    /// Accepts on `listener` until draining, and probes the gateway.
    pub fn serve(
        self: &Arc<Self>,
        listener: TcpListener,
        admin: TcpListener,
        access: seedlink_net::admin::Access,
    ) {
        let np = self.clone();
        tokio::spawn(async move {
            let stop = np.lifecycle.stop_accepting.clone();
            seedlink_net::accept::accept_loop(&listener, &stop, |stream, peer| {
                np.accept(stream, peer)
            })
            .await;
        });
        let np = self.clone();
        tokio::spawn(async move { health::run(&np).await });
        let np = self.clone();
        tokio::spawn(async move { admin::serve(np, admin, access).await });
        self.lifecycle.serving();
    }

    fn accept(self: &Arc<Self>, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            self.count("refused_max_connections");
            drop(stream);
            return;
        };
        let np = self.clone();
        self.lifecycle.tasks.spawn(async move {
            np.metrics.active.inc();
            let outcome = tokio::select! {
                o = tunnel::carry(&np, stream, peer) => o,
                () = np.lifecycle.close_all.cancelled() => tunnel::Outcome::ClosedDrain,
            };
            np.metrics.active.dec();
            np.count(outcome.reason());
            drop(permit);
        });
    }

    fn count(&self, outcome: &str) {
        self.metrics
            .tunnels
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// A tunnel's start as a passive health result: with the `tcp` check,
    /// an opened tunnel is a success and an unreachable gateway (or egress
    /// proxy) a failure; refusals say nothing about reachability. Other
    /// checks ignore tunnels.
    pub fn observe(&self, result: Result<(), tunnel::Outcome>) {
        use tunnel::Outcome as O;
        let check = &self.opts.health;
        if check.kind != health::CheckKind::Tcp {
            return;
        }
        let healthy = match result {
            Ok(()) => self.health.record(check, Ok(())),
            Err(
                why @ (O::GatewayUnreachable
                | O::EgressProxyUnreachable
                | O::EgressProxyTimeout
                | O::EgressProxyClosed),
            ) => self.health.record(check, Err(why.reason())),
            Err(_) => return,
        };
        self.gateway_ok.store(healthy, Ordering::Release);
    }

    /// The shared HTTP/2 connection is up (opened now if needed).
    pub async fn h2_probe(&self) -> Result<(), tunnel::Outcome> {
        self.h2.probe(self).await
    }

    /// Keeps `iface` in place: checks now, then every `every`; readiness
    /// follows the result. Returns the first check's result, so a start-up
    /// failure (e.g. no `dummy` support) is reported at once.
    pub async fn manage_interface(
        self: &Arc<Self>,
        iface: netif::Interface,
        every: Duration,
    ) -> Result<(), netif::NetifError> {
        netif::ensure(&iface).await?;
        self.address_ok.store(true, Ordering::Release);
        let np = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = np.lifecycle.close_all.cancelled() => return,
                }
                match netif::ensure(&iface).await {
                    Ok(changed) => {
                        if changed {
                            tracing::warn!(address = %iface.address, link = %iface.name, "address was missing; put back");
                            np.metrics.address_reasserted.inc();
                        }
                        np.address_ok.store(true, Ordering::Release);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot keep the advertised address");
                        np.address_ok.store(false, Ordering::Release);
                    }
                }
            }
        });
        Ok(())
    }

    /// Drains: not ready, stop accepting, wait, close the rest.
    pub async fn drain(&self) -> usize {
        self.lifecycle.drain(self.opts.drain).await
    }
}
