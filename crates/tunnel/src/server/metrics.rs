//! tunnel-server metrics: ours under `seedlink_tunnel_server_` with a
//! `cluster` label, and Konnectivity's names (`konnectivity_network_proxy_server_`,
//! summed over clusters) where the meaning is the same, so existing
//! dashboards keep working.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::link::Handled;
use prometheus_client::registry::Registry;

/// `cluster` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabel {
    /// Cluster name.
    pub cluster: String,
}

/// `cluster` and `reason`/`outcome` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterReason {
    /// Cluster name.
    pub cluster: String,
    /// Why.
    pub reason: String,
}

/// Konnectivity's `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// Why.
    pub reason: String,
}

/// Frontend connection labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FrontendLabels {
    /// Cluster name.
    pub cluster: String,
    /// Frontend name.
    pub frontend: String,
    /// How it ended.
    pub outcome: String,
}

/// All tunnel-server metrics.
pub struct Metrics {
    /// Registry for `/metrics`.
    pub registry: Registry,
    /// What parts started later add (the Kubernetes source).
    pub sections: seedlink_net::admin::Sections,
    /// The per-connection failure lines, rate-limited (the rest counted).
    pub refusal_log: seedlink_net::loglimit::LogLimiter,
    agents: Family<ClusterLabel, Gauge>,
    agent_streams: Family<ClusterReason, Counter>,
    agent_packets: Family<ClusterReason, Counter>,
    dials: Family<ClusterLabel, Counter>,
    dial_failures: Family<ClusterReason, Counter>,
    dial_seconds: Family<ClusterLabel, Histogram>,
    pending: Family<ClusterLabel, Gauge>,
    established: Family<ClusterLabel, Gauge>,
    frontend_conns: Family<FrontendLabels, Counter>,
    frontend_aborts: Family<ClusterReason, Counter>,
    /// TokenReviews by outcome (`reason` label: accepted, refused,
    /// unavailable, cached).
    pub token_reviews: Family<ClusterReason, Counter>,
    reloads: Family<Reason, Counter>,
    /// Live connection tasks (agent streams, frontends), set at scrape time.
    pub tasks: Gauge,
    k_backends: Gauge,
    k_pending: Gauge,
    k_established: Gauge,
    k_dial_failures: Family<Reason, Counter>,
    k_dial_seconds: Histogram,
    k_http: Gauge,
    k_grpc: Family<ServiceMethod, Gauge>,
}

/// Konnectivity's `service_method` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceMethod {
    /// `Proxy` (a gRPC frontend) or `Connect` (an agent stream).
    pub service_method: String,
}

/// An open connection, counted in a gauge until dropped.
pub struct Open(Gauge);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Konnectivity's `reason` value for one of ours, where the meaning is the
/// same (upstream: `no_agent`, `error_response`, `unrecognized_response`,
/// `send_rsp`, `backend_close`, `backend_dial_timeout`, `frontend_close`).
pub fn konnectivity_reason(ours: &str) -> &str {
    match ours {
        // The frontend went away before the dial finished.
        "dial_closed" => "frontend_close",
        // An agent answered with something the protocol does not allow.
        "protocol_error" => "unrecognized_response",
        same => same,
    }
}

fn dial_histogram() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Registers everything.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            registry: Registry::default(),
            sections: seedlink_net::admin::Sections::default(),
            agents: Family::default(),
            agent_streams: Family::default(),
            agent_packets: Family::default(),
            dials: Family::default(),
            dial_failures: Family::default(),
            dial_seconds: Family::new_with_constructor(dial_histogram),
            pending: Family::default(),
            established: Family::default(),
            frontend_conns: Family::default(),
            frontend_aborts: Family::default(),
            token_reviews: Family::default(),
            reloads: Family::default(),
            tasks: Gauge::default(),
            k_backends: Gauge::default(),
            k_pending: Gauge::default(),
            k_established: Gauge::default(),
            k_dial_failures: Family::default(),
            k_dial_seconds: dial_histogram(),
            k_http: Gauge::default(),
            k_grpc: Family::default(),
            refusal_log: seedlink_net::loglimit::LogLimiter::default(),
        };
        m.register_own(registry.sub_registry_with_prefix("seedlink_tunnel_server"));
        m.register_konnectivity(
            registry.sub_registry_with_prefix("konnectivity_network_proxy_server"),
        );
        Metrics { registry, ..m }
    }

    /// seedlink's own families.
    fn register_own(&self, r: &mut Registry) {
        let m = self;
        {
            r.register("agents", "Connected agent streams", m.agents.clone());
            r.register(
                "agent_streams",
                "Agent streams ended or refused, by reason",
                m.agent_streams.clone(),
            );
            r.register("agent_packets", "Packets from agents by how they were handled (ok, unrecognized, overflow, unexpected)", m.agent_packets.clone());
            r.register("dials", "Successful dials", m.dials.clone());
            r.register(
                "dial_failures",
                "Failed dials by reason",
                m.dial_failures.clone(),
            );
            r.register(
                "dial_duration_seconds",
                "Time from DIAL_REQ to DIAL_RSP",
                m.dial_seconds.clone(),
            );
            r.register(
                "pending_dials",
                "Dials waiting for an agent's answer",
                m.pending.clone(),
            );
            r.register(
                "established_connections",
                "Open tunneled connections",
                m.established.clone(),
            );
            r.register(
                "frontend_connections",
                "Finished frontend connections by outcome",
                m.frontend_conns.clone(),
            );
            r.register(
                "frontend_aborts",
                "Tunneled connections cut short (agent gone, connection aborted, frontend stalled), by how the frontend was told: reset (TCP RST) or eof (a Unix socket has no reset; the client sees an ordinary end)",
                m.frontend_aborts.clone(),
            );
            r.register(
                "config_reloads",
                "Configuration reloads by outcome (ok, error)",
                m.reloads.clone(),
            );
            r.register(
                "log_lines_dropped",
                "Failed-connection log lines not written because more than 20 per second (burst 100) came",
                m.refusal_log.dropped.clone(),
            );
            r.register(
                "token_reviews",
                "Agent token checks by TokenReview, by outcome (accepted, refused, unavailable, cached)",
                m.token_reviews.clone(),
            );
        }
    }

    /// The families upstream Konnectivity's server exports, for its
    /// dashboards.
    fn register_konnectivity(&self, r: &mut Registry) {
        let m = self;
        {
            r.register(
                "ready_backend_connections",
                "Connected agent streams (all clusters)",
                m.k_backends.clone(),
            );
            r.register(
                "pending_backend_dials",
                "Pending dials (all clusters)",
                m.k_pending.clone(),
            );
            r.register(
                "established_connections",
                "Established connections (all clusters)",
                m.k_established.clone(),
            );
            r.register(
                "dial_failure_count",
                "Dial failures by reason (all clusters)",
                m.k_dial_failures.clone(),
            );
            r.register(
                "dial_duration_seconds",
                "Time from DIAL_REQ to DIAL_RSP (all clusters)",
                m.k_dial_seconds.clone(),
            );
            r.register(
                "http_connections",
                "Open HTTP frontend connections (CONNECT and forward proxy)",
                m.k_http.clone(),
            );
            r.register(
                "grpc_connections",
                "Open gRPC streams: Proxy (frontends), Connect (agents)",
                m.k_grpc.clone(),
            );
        }
    }

    fn cl(c: &str) -> ClusterLabel {
        ClusterLabel {
            cluster: c.to_string(),
        }
    }

    /// An HTTP frontend connection is open until the guard drops.
    pub fn http_open(&self) -> Open {
        self.k_http.inc();
        Open(self.k_http.clone())
    }

    /// A gRPC stream (`Proxy` or `Connect`) is open until the guard drops.
    pub fn grpc_open(&self, service_method: &str) -> Open {
        let g = self
            .k_grpc
            .get_or_create(&ServiceMethod {
                service_method: service_method.into(),
            })
            .clone();
        g.inc();
        Open(g)
    }

    /// A configuration reload ended so.
    pub fn reload(&self, outcome: &str) {
        self.reloads
            .get_or_create(&Reason {
                reason: outcome.into(),
            })
            .inc();
    }

    /// An agent stream ended or was refused.
    pub fn agent_stream(&self, cluster: &str, reason: &str) {
        self.agent_streams
            .get_or_create(&ClusterReason {
                cluster: cluster.into(),
                reason: reason.into(),
            })
            .inc();
    }

    /// A tunneled connection was cut short; `signal` is `reset` or `eof`.
    pub fn frontend_abort(&self, cluster: &str, signal: &str) {
        self.frontend_aborts
            .get_or_create(&ClusterReason {
                cluster: cluster.into(),
                reason: signal.into(),
            })
            .inc();
    }

    /// A frontend connection ended with `outcome`.
    pub fn frontend_conn(&self, cluster: &str, frontend: &str, outcome: &str) {
        // Every frontend connection ends here: a failed one is one line
        // (a client that simply closed is not a failure).
        let normal = matches!(outcome, "ok" | "closed" | "frontend_gone" | "draining");
        if !normal && self.refusal_log.allow() {
            tracing::warn!(target: "seedlink::refused", %cluster, %frontend, reason = %outcome, "frontend connection failed");
        }
        self.frontend_conns
            .get_or_create(&FrontendLabels {
                cluster: cluster.into(),
                frontend: frontend.into(),
                outcome: outcome.into(),
            })
            .inc();
    }
}

/// One cluster's metric handles, resolved when the cluster is configured
/// (kept across reloads with the cluster): the per-packet and per-dial
/// paths build no label strings. Also keeps the all-cluster Konnectivity
/// gauges in step.
pub struct ClusterMetrics {
    agents: Gauge,
    pending: Gauge,
    established: Gauge,
    dials: Counter,
    dial_seconds: Histogram,
    /// `agent_packets_total` by [`Handled`] (ok, unrecognized, delayed,
    /// stalled, unexpected).
    packets: [Counter; 5],
    failures: std::sync::Mutex<std::collections::HashMap<&'static str, (Counter, Counter)>>,
    k_backends: Gauge,
    k_pending: Gauge,
    k_established: Gauge,
    k_dial_seconds: Histogram,
    k_connect: Gauge,
    /// Where dial-failure handles are resolved on first use.
    families: Option<FailureFamilies>,
}

/// The dial-failure families (per cluster, all clusters) and the cluster's name.
type FailureFamilies = (
    Family<ClusterReason, Counter>,
    Family<Reason, Counter>,
    String,
);

const HANDLED: [Handled; 5] = [
    Handled::Ok,
    Handled::Unrecognized,
    Handled::Full,
    Handled::Stalled,
    Handled::Unexpected,
];

impl ClusterMetrics {
    /// Handles that count but are exported nowhere (tests, harnesses).
    pub fn unregistered() -> ClusterMetrics {
        ClusterMetrics {
            agents: Gauge::default(),
            pending: Gauge::default(),
            established: Gauge::default(),
            dials: Counter::default(),
            dial_seconds: dial_histogram(),
            packets: Default::default(),
            failures: Default::default(),
            k_backends: Gauge::default(),
            k_pending: Gauge::default(),
            k_established: Gauge::default(),
            k_dial_seconds: dial_histogram(),
            k_connect: Gauge::default(),
            families: None,
        }
    }

    /// An agent stream came (+1) or went (-1).
    pub fn agent(&self, delta: i64) {
        self.agents.inc_by(delta);
        self.k_backends.inc_by(delta);
        self.k_connect.inc_by(delta);
    }

    /// A packet from an agent was handled so.
    pub fn packet(&self, h: Handled) {
        let i = HANDLED.iter().position(|x| *x == h).unwrap_or(4);
        self.packets[i].inc();
    }

    /// Pending dials changed.
    pub fn pending(&self, delta: i64) {
        self.pending.inc_by(delta);
        self.k_pending.inc_by(delta);
    }

    /// Established connections changed.
    pub fn established(&self, delta: i64) {
        self.established.inc_by(delta);
        self.k_established.inc_by(delta);
    }

    /// A dial succeeded after `took`.
    pub fn dial_ok(&self, took: Duration) {
        self.dials.inc();
        self.dial_seconds.observe(took.as_secs_f64());
        self.k_dial_seconds.observe(took.as_secs_f64());
    }

    /// Dials waiting for an agent's answer now.
    pub fn pending_now(&self) -> i64 {
        self.pending.get()
    }

    /// Tunneled connections open now.
    pub fn established_now(&self) -> i64 {
        self.established.get()
    }

    /// Failed dials so far, by reason (sorted).
    pub fn dial_failures(&self) -> Vec<(&'static str, u64)> {
        let f = seedlink_net::sync::lock(&self.failures, "cluster metrics");
        let mut out: Vec<(&'static str, u64)> = f.iter().map(|(r, (c, _))| (*r, c.get())).collect();
        out.sort_unstable();
        out
    }

    /// A dial failed (`reason`: [`super::DialError::reason`]).
    pub fn dial_failure(&self, reason: &'static str) {
        let mut f = seedlink_net::sync::lock(&self.failures, "cluster metrics");
        let (c, k) = f.entry(reason).or_insert_with(|| match &self.families {
            Some((per, all, cluster)) => (
                per.get_or_create(&ClusterReason {
                    cluster: cluster.clone(),
                    reason: reason.to_string(),
                })
                .clone(),
                all.get_or_create(&Reason {
                    reason: konnectivity_reason(reason).to_string(),
                })
                .clone(),
            ),
            None => (Counter::default(), Counter::default()),
        });
        c.inc();
        k.inc();
    }
}

impl Metrics {
    /// Cluster `name`'s handles.
    pub fn cluster(&self, name: &str) -> ClusterMetrics {
        let cl = Self::cl(name);
        let packets = HANDLED.map(|h| {
            self.agent_packets
                .get_or_create(&ClusterReason {
                    cluster: name.to_string(),
                    reason: h.label().to_string(),
                })
                .clone()
        });
        ClusterMetrics {
            agents: self.agents.get_or_create(&cl).clone(),
            pending: self.pending.get_or_create(&cl).clone(),
            established: self.established.get_or_create(&cl).clone(),
            dials: self.dials.get_or_create(&cl).clone(),
            dial_seconds: self.dial_seconds.get_or_create(&cl).clone(),
            packets,
            failures: Default::default(),
            k_backends: self.k_backends.clone(),
            k_pending: self.k_pending.clone(),
            k_established: self.k_established.clone(),
            k_dial_seconds: self.k_dial_seconds.clone(),
            k_connect: self
                .k_grpc
                .get_or_create(&ServiceMethod {
                    service_method: "Connect".into(),
                })
                .clone(),
            families: Some((
                self.dial_failures.clone(),
                self.k_dial_failures.clone(),
                name.to_string(),
            )),
        }
    }
}
