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

/// How a connection to a destination ended: the `outcome` of
/// `endpoint_closes_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnEnd {
    /// Its queue from the server finished: the server closed it, or it was
    /// aborted.
    Closed,
    /// The server's CLOSE_REQ.
    CloseReq,
    /// The stream to the server ended under it.
    ServerGone,
    /// The destination took nothing for the stall deadline.
    Stalled,
    /// Writing to the destination failed.
    WriteError,
    /// The destination closed (or its read failed).
    RemoteClosed,
}

impl ConnEnd {
    /// Every ending, in the order docs/TUNNEL.md lists them.
    pub const ALL: [ConnEnd; 6] = [
        ConnEnd::Closed,
        ConnEnd::CloseReq,
        ConnEnd::ServerGone,
        ConnEnd::Stalled,
        ConnEnd::WriteError,
        ConnEnd::RemoteClosed,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ConnEnd::Closed => "closed",
            ConnEnd::CloseReq => "close_req",
            ConnEnd::ServerGone => "server_gone",
            ConnEnd::Stalled => "stalled",
            ConnEnd::WriteError => "write_error",
            ConnEnd::RemoteClosed => "remote_closed",
        }
    }
}

/// What became of an attempt to connect to a server replica, or of a
/// stream it opened: the `outcome` of `server_connects_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerConnect {
    /// A stream to a replica not held before.
    Ok,
    /// A replica already held: the new stream is closed.
    Duplicate,
    /// The attempt failed (`server_connect_errors_total` says why).
    Error,
    /// The server refused the PING rate: the interval doubles.
    TooManyPings,
    /// The server drains the stream: a replacement is looked for.
    ServerDraining,
    /// More streams draining than the agent keeps: this one is ended.
    TooManyDraining,
    /// The agent's certificate files changed: the stream drains, a
    /// replacement presents the new certificate.
    CertificateChanged,
}

impl ServerConnect {
    /// Every outcome, in the order docs/TUNNEL.md lists them.
    pub const ALL: [ServerConnect; 7] = [
        ServerConnect::Ok,
        ServerConnect::Duplicate,
        ServerConnect::Error,
        ServerConnect::TooManyPings,
        ServerConnect::ServerDraining,
        ServerConnect::TooManyDraining,
        ServerConnect::CertificateChanged,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ServerConnect::Ok => "ok",
            ServerConnect::Duplicate => "duplicate",
            ServerConnect::Error => "error",
            ServerConnect::TooManyPings => "too_many_pings",
            ServerConnect::ServerDraining => "server_draining",
            ServerConnect::TooManyDraining => "too_many_draining",
            ServerConnect::CertificateChanged => "certificate_changed",
        }
    }
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

    /// Counts `n` bad packets (or parts of one) with outcome `o`.
    pub(super) fn bad_packets_add(&self, o: &str, n: u64) {
        self.bad_packets
            .get_or_create(&Outcome {
                outcome: o.to_string(),
            })
            .inc_by(n);
    }

    /// Counts a destination connection's end.
    pub(super) fn endpoint_closed(&self, end: ConnEnd) {
        AgentMetrics::count(&self.endpoint_closes, end.label());
    }

    /// Counts what became of a server connection or its stream.
    pub(super) fn server_connect(&self, outcome: ServerConnect) {
        AgentMetrics::count(&self.server_connects, outcome.label());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The list of `name{outcome}` labels docs/TUNNEL.md gives in its
    /// agent metrics paragraph.
    fn documented(name: &str) -> String {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/TUNNEL.md"))
                .unwrap();
        let at = doc.find(&format!("`{name}{{outcome}}` (")).unwrap();
        let rest = &doc[at..];
        rest[..rest.find(')').unwrap()].replace('\n', " ")
    }

    #[test]
    fn every_agent_ending_is_documented() {
        let closes = documented("endpoint_closes_total");
        for end in ConnEnd::ALL {
            assert!(
                closes.contains(&format!("`{}`", end.label())),
                "{end:?} in {closes}"
            );
        }
        let connects = documented("server_connects_total");
        for o in ServerConnect::ALL {
            assert!(
                connects.contains(&format!("`{}`", o.label())),
                "{o:?} in {connects}"
            );
        }
    }
}
