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
    agents: Family<ClusterLabel, Gauge>,
    agent_streams: Family<ClusterReason, Counter>,
    agent_packets: Family<ClusterReason, Counter>,
    dials: Family<ClusterLabel, Counter>,
    dial_failures: Family<ClusterReason, Counter>,
    dial_seconds: Family<ClusterLabel, Histogram>,
    pending: Family<ClusterLabel, Gauge>,
    established: Family<ClusterLabel, Gauge>,
    frontend_conns: Family<FrontendLabels, Counter>,
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
            agents: Family::default(),
            agent_streams: Family::default(),
            agent_packets: Family::default(),
            dials: Family::default(),
            dial_failures: Family::default(),
            dial_seconds: Family::new_with_constructor(dial_histogram),
            pending: Family::default(),
            established: Family::default(),
            frontend_conns: Family::default(),
            token_reviews: Family::default(),
            reloads: Family::default(),
            tasks: Gauge::default(),
            k_backends: Gauge::default(),
            k_pending: Gauge::default(),
            k_established: Gauge::default(),
            k_dial_failures: Family::default(),
        };
        {
            let r = registry.sub_registry_with_prefix("seedlink_tunnel_server");
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
                "config_reloads",
                "Configuration reloads by outcome (ok, error)",
                m.reloads.clone(),
            );
            r.register(
                "token_reviews",
                "Agent token checks by TokenReview, by outcome (accepted, refused, unavailable, cached)",
                m.token_reviews.clone(),
            );
        }
        {
            let r = registry.sub_registry_with_prefix("konnectivity_network_proxy_server");
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
        }
        Metrics { registry, ..m }
    }

    fn cl(c: &str) -> ClusterLabel {
        ClusterLabel {
            cluster: c.to_string(),
        }
    }

    /// An agent stream came (+1) or went (-1).
    pub fn agent(&self, cluster: &str, delta: i64) {
        self.agents.get_or_create(&Self::cl(cluster)).inc_by(delta);
        self.k_backends.inc_by(delta);
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

    /// A packet from an agent was handled so.
    pub fn agent_packet(&self, cluster: &str, outcome: &str) {
        self.agent_packets
            .get_or_create(&ClusterReason {
                cluster: cluster.into(),
                reason: outcome.into(),
            })
            .inc();
    }

    /// A dial succeeded after `took`.
    pub fn dial_ok(&self, cluster: &str, took: Duration) {
        self.dials.get_or_create(&Self::cl(cluster)).inc();
        self.dial_seconds
            .get_or_create(&Self::cl(cluster))
            .observe(took.as_secs_f64());
    }

    /// A dial failed.
    pub fn dial_failure(&self, cluster: &str, reason: &str) {
        self.dial_failures
            .get_or_create(&ClusterReason {
                cluster: cluster.into(),
                reason: reason.into(),
            })
            .inc();
        self.k_dial_failures
            .get_or_create(&Reason {
                reason: reason.into(),
            })
            .inc();
    }

    /// Pending dials changed.
    pub fn pending(&self, cluster: &str, delta: i64) {
        self.pending.get_or_create(&Self::cl(cluster)).inc_by(delta);
        self.k_pending.inc_by(delta);
    }

    /// Established connections changed.
    pub fn established(&self, cluster: &str, delta: i64) {
        self.established
            .get_or_create(&Self::cl(cluster))
            .inc_by(delta);
        self.k_established.inc_by(delta);
    }

    /// A frontend connection ended.
    pub fn frontend_conn(&self, cluster: &str, frontend: &str, outcome: &str) {
        self.frontend_conns
            .get_or_create(&FrontendLabels {
                cluster: cluster.into(),
                frontend: frontend.into(),
                outcome: outcome.into(),
            })
            .inc();
    }
}
