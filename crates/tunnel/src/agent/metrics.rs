//! The tunnel-agent's own metrics (`seedlink_agent_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// `outcome` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// What happened.
    pub outcome: String,
}

/// Agent metrics (`seedlink_tunnel_agent_`).
pub struct AgentMetrics {
    /// Registry for `/metrics`.
    pub registry: Registry,
    /// Open server streams.
    pub servers: Gauge,
    /// Server connection attempts by outcome.
    pub server_connects: Family<Outcome, Counter>,
    /// Failed server connection attempts by why (`ConnectError::reason`).
    pub connect_errors: Family<Outcome, Counter>,
    /// Dials by outcome.
    pub dials: Family<Outcome, Counter>,
    /// Open destination connections.
    pub endpoints: Gauge,
    /// Destination connections ended by outcome.
    pub endpoint_closes: Family<Outcome, Counter>,
    /// Packets from servers that referred to nothing known, or were unexpected.
    pub bad_packets: Family<Outcome, Counter>,
}

impl AgentMetrics {
    pub(super) fn new() -> AgentMetrics {
        let mut registry = Registry::with_prefix("seedlink_tunnel_agent");
        let m = AgentMetrics {
            registry: Registry::default(),
            servers: Gauge::default(),
            server_connects: Family::default(),
            connect_errors: Family::default(),
            dials: Family::default(),
            endpoints: Gauge::default(),
            endpoint_closes: Family::default(),
            bad_packets: Family::default(),
        };
        registry.register(
            "open_server_connections",
            "Open streams to server replicas",
            m.servers.clone(),
        );
        registry.register(
            "server_connects",
            "Connection attempts to the server by outcome",
            m.server_connects.clone(),
        );
        registry.register(
            "server_connect_errors",
            "Failed connection attempts to the server, by why (outcome)",
            m.connect_errors.clone(),
        );
        registry.register("dials", "Destination dials by outcome", m.dials.clone());
        registry.register(
            "open_endpoint_connections",
            "Open destination connections",
            m.endpoints.clone(),
        );
        registry.register(
            "endpoint_closes",
            "Destination connections ended, by outcome",
            m.endpoint_closes.clone(),
        );
        registry.register(
            "bad_packets",
            "Server packets that were unexpected or named unknown IDs",
            m.bad_packets.clone(),
        );
        AgentMetrics { registry, ..m }
    }

    pub(super) fn count(f: &Family<Outcome, Counter>, o: &str) {
        f.get_or_create(&Outcome {
            outcome: o.to_string(),
        })
        .inc();
    }
}
