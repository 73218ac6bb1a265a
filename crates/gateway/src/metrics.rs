//! The gateway's Prometheus metrics.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of finished connections.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnLabels {
    /// Listener name.
    pub listener: String,
    /// Control plane name; empty when the connection was never routed.
    pub control_plane: String,
    /// How it ended (`ok`, `reset`, `acl_denied`, `unknown_sni`, ...).
    pub outcome: String,
}

/// Labels with a listener and a reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Listener name.
    pub listener: String,
    /// Stable reason code.
    pub reason: String,
}

/// Labels with a listener only.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// Listener name.
    pub listener: String,
}

/// Labels of byte counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByteLabels {
    /// Listener name.
    pub listener: String,
    /// Control plane name.
    pub control_plane: String,
    /// `to_upstream` or `to_client`.
    pub direction: String,
}

/// Labels with a control plane only.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CpLabels {
    /// Control plane name.
    pub control_plane: String,
}

/// Labels of upstream endpoint events.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// Control plane name.
    pub control_plane: String,
    /// Endpoint as configured.
    pub endpoint: String,
}

/// Labels of routed connections, for migration telemetry.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoutedLabels {
    /// Listener name.
    pub listener: String,
    /// `tls-sni` or `http-connect:<destination header>`.
    pub protocol: String,
    /// Control plane name.
    pub control_plane: String,
}

/// Labels of reloads.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `success` or `failure`.
    pub result: String,
}

/// `control_plane` and `state` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointStateLabels {
    /// Control plane.
    pub control_plane: String,
    /// `up` or `ejected`.
    pub state: String,
}

/// A `state` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// The state.
    pub state: String,
}

/// Every metric the gateway exports.
pub struct Metrics {
    /// The registry served on `/metrics`.
    pub registry: Registry,
    /// What parts started later add (the Kubernetes source).
    pub sections: seedlink_net::admin::Sections,
    /// Finished connections.
    pub connections: Family<ConnLabels, Counter>,
    /// Open connections.
    pub active: Family<ListenerLabels, Gauge>,
    /// Connections routed, by listener, protocol and control plane.
    pub routed: Family<RoutedLabels, Counter>,
    /// Routed connections open now, by listener, protocol and control plane.
    pub routed_active: Family<RoutedLabels, Gauge>,
    /// Bytes moved.
    pub bytes: Family<ByteLabels, Counter>,
    /// Connections rejected while detecting the protocol.
    pub detect_failures: Family<ReasonLabels, Counter>,
    /// Connections refused before detection (limits).
    pub refused: Family<ReasonLabels, Counter>,
    /// ACL denials.
    pub acl_denied: Family<CpLabels, Counter>,
    /// Failed upstream connect attempts.
    pub upstream_connect_failures: Family<EndpointLabels, Counter>,
    /// Endpoint ejections.
    pub upstream_ejections: Family<EndpointLabels, Counter>,
    /// Configuration reloads.
    pub reloads: Family<ResultLabels, Counter>,
    /// Generation of the configuration in force (1 = initial).
    pub config_generation: Gauge,
    /// Maximum concurrent connections in force.
    pub max_connections: Gauge,
    /// Time to connect to an upstream endpoint (successful attempts).
    pub upstream_connect_seconds: prometheus_client::metrics::histogram::Histogram,
    /// How long connections lasted, by listener.
    pub connection_seconds:
        Family<ListenerLabels, prometheus_client::metrics::histogram::Histogram>,
    /// The per-connection refusal lines, rate-limited; what it drops is
    /// counted as `log_lines_dropped`.
    pub refusal_log: seedlink_net::loglimit::LogLimiter,
    /// The serving listeners' handles, which `api/state` reads one control
    /// plane's counters from without encoding every control plane's.
    listeners: RwLock<Vec<Arc<ListenerMetrics>>>,
    /// Told when a path (control plane, listener, protocol) routes its
    /// first connection: the record of paths in use is written soon after.
    pub new_path: Arc<tokio::sync::Notify>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric under the `seedlink_gateway_` prefix.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("seedlink_gateway");
        let m = Metrics {
            connections: Family::default(),
            active: Family::default(),
            routed: Family::default(),
            routed_active: Family::default(),
            bytes: Family::default(),
            detect_failures: Family::default(),
            refused: Family::default(),
            acl_denied: Family::default(),
            upstream_connect_failures: Family::default(),
            upstream_ejections: Family::default(),
            reloads: Family::default(),
            config_generation: Gauge::default(),
            max_connections: Gauge::default(),
            refusal_log: seedlink_net::loglimit::LogLimiter::default(),
            new_path: Arc::default(),
            upstream_connect_seconds: prometheus_client::metrics::histogram::Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            connection_seconds: Family::new_with_constructor(|| {
                prometheus_client::metrics::histogram::Histogram::new([
                    0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 14400.0, 86400.0,
                ])
            }),
            registry: Registry::default(),
            sections: seedlink_net::admin::Sections::default(),
            listeners: RwLock::new(Vec::new()),
        };
        m.register_connections(&mut registry);
        m.register_upstreams_and_config(&mut registry);
        Metrics { registry, ..m }
    }

    /// Handles for serving `listener`, kept for [`Metrics::listeners`]:
    /// the same ones for the same name (two sets would each count the
    /// same counters in `api/state`).
    pub fn listener(&self, listener: &str) -> Arc<ListenerMetrics> {
        let mut all = seedlink_net::sync::write(&self.listeners, "listener metrics");
        if let Some(l) = all.iter().find(|l| l.listener == listener) {
            return l.clone();
        }
        let l = Arc::new(ListenerMetrics::new(self, listener));
        all.push(l.clone());
        l
    }

    /// The handles of every listener made by [`Metrics::listener`].
    pub fn listeners(&self) -> Vec<Arc<ListenerMetrics>> {
        seedlink_net::sync::read(&self.listeners, "listener metrics").clone()
    }

    /// The families about client connections.
    fn register_connections(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "connections",
            "Finished connections by listener, control plane and outcome",
            m.connections.clone(),
        );
        registry.register(
            "active_connections",
            "Open connections by listener",
            m.active.clone(),
        );
        registry.register(
            "routed",
            "Connections routed, by listener, protocol (tls-sni, http-connect:<header>) and control plane",
            m.routed.clone(),
        );
        registry.register(
            "routed_active_connections",
            "Routed connections open now, by listener, protocol and control plane",
            m.routed_active.clone(),
        );
        registry.register(
            "bytes",
            "Bytes moved by listener, control plane and direction",
            m.bytes.clone(),
        );
        registry.register(
            "detect_failures",
            "Connections closed during PROXY/ClientHello detection, by reason",
            m.detect_failures.clone(),
        );
        registry.register(
            "refused",
            "Connections closed at accept because of a limit, by reason",
            m.refused.clone(),
        );
        registry.register(
            "connection_duration_seconds",
            "How long connections lasted, by listener",
            m.connection_seconds.clone(),
        );
        registry.register(
            "log_lines_dropped",
            "Refused-connection log lines not written because more than 20 per second (burst 100) came",
            m.refusal_log.dropped.clone(),
        );
    }

    /// The families about upstreams, ACLs and the configuration.
    fn register_upstreams_and_config(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "acl_denied",
            "Connections denied by a control plane's ACL",
            m.acl_denied.clone(),
        );
        registry.register(
            "upstream_connect_failures",
            "Failed upstream connect attempts",
            m.upstream_connect_failures.clone(),
        );
        registry.register(
            "upstream_ejections",
            "Upstream endpoints ejected after a failed connect",
            m.upstream_ejections.clone(),
        );
        registry.register(
            "config_reloads",
            "Configuration reloads by result",
            m.reloads.clone(),
        );
        registry.register(
            "config_generation",
            "Generation of the configuration in force",
            m.config_generation.clone(),
        );
        registry.register(
            "max_connections",
            "Concurrent connection cap in force",
            m.max_connections.clone(),
        );
        registry.register(
            "upstream_connect_duration_seconds",
            "Time to connect to an upstream endpoint (successful attempts)",
            m.upstream_connect_seconds.clone(),
        );
    }

    /// Renders the OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        // With the process, build and lock metrics every role exports.
        self.sections.encode_with(&[&self.registry])
    }

    /// The exposition with the per-control-plane gauges of `snap`: every
    /// configured control plane from the start (zero-valued), its open
    /// connections and its upstream endpoints by state (`up`, `ejected`);
    /// and the splice pipe pool, `pipes` = (open, idle).
    pub fn encode_with(&self, snap: &seedlink_config::Snapshot, pipes: (usize, usize)) -> String {
        use std::sync::atomic::Ordering;
        let mut live = Registry::with_prefix("seedlink_gateway");
        let active: Family<CpLabels, Gauge> = Family::default();
        let endpoints: Family<EndpointStateLabels, Gauge> = Family::default();
        let now = seedlink_net::clock::now_ms();
        for (name, cp) in &snap.control_planes {
            let open: u32 = cp
                .endpoints
                .iter()
                .map(|e| e.state.active.load(Ordering::Relaxed))
                .sum();
            active
                .get_or_create(&CpLabels {
                    control_plane: name.to_string(),
                })
                .set(i64::from(open));
            let ejected = cp.endpoints.iter().filter(|e| e.ejected(now)).count();
            for (state, n) in [("up", cp.endpoints.len() - ejected), ("ejected", ejected)] {
                endpoints
                    .get_or_create(&EndpointStateLabels {
                        control_plane: name.to_string(),
                        state: state.into(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        live.register(
            "control_plane_active_connections",
            "Open connections by control plane (every configured one, from the start)",
            active,
        );
        live.register(
            "upstream_endpoints",
            "Upstream endpoints by control plane and state (up, ejected)",
            endpoints,
        );
        let pool: Family<StateLabels, Gauge> = Family::default();
        for (state, n) in [("open", pipes.0), ("idle", pipes.1)] {
            pool.get_or_create(&StateLabels {
                state: state.into(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        live.register(
            "splice_pipes",
            "Splice pipes by state: open (each holds 2 file descriptors; the pool keeps them after a burst, up to limits.splice_pipes) and, of those, idle in the pool",
            pool,
        );
        self.sections.encode_with(&[&self.registry, &live])
    }
}

/// One listener's metric handles, resolved when the listener is set up; a
/// control plane's are resolved on its first connection through the
/// listener and kept, so serving a connection builds no label strings.
pub struct ListenerMetrics {
    listener: String,
    /// Open connections.
    pub active: Gauge,
    /// How long its connections lasted.
    pub duration: prometheus_client::metrics::histogram::Histogram,
    detect: Mutex<HashMap<&'static str, Counter>>,
    per_cp: RwLock<HashMap<String, Arc<CpMetrics>>>,
}

/// A routed connection, counted as open until dropped.
pub struct Routed(Gauge);

impl Drop for Routed {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One control plane's handles on one listener.
pub struct CpMetrics {
    /// Bytes towards the upstream.
    pub to_upstream: Counter,
    /// Bytes towards the client.
    pub to_client: Counter,
    ends: Mutex<HashMap<&'static str, Counter>>,
    routed: Mutex<HashMap<String, RoutedBy>>,
}

/// Connections routed by one protocol: how many, and how many are open
/// (the migration gate's record reads the count, `paths.rs`).
type RoutedBy = (Counter, Gauge);

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl CpMetrics {
    /// Ended connections by outcome.
    pub fn ends(&self) -> Vec<(&'static str, u64)> {
        let ends = seedlink_net::sync::lock(&self.ends, "metric handles");
        ends.iter().map(|(o, c)| (*o, c.get())).collect()
    }

    /// Routed connections by protocol: how many, and how many are open.
    pub fn routed(&self) -> Vec<(String, u64, i64)> {
        let routed = seedlink_net::sync::lock(&self.routed, "metric handles");
        routed
            .iter()
            .map(|(p, (count, open))| (p.clone(), count.get(), open.get()))
            .collect()
    }
}

impl ListenerMetrics {
    /// Handles for `listener`.
    pub fn new(m: &Metrics, listener: &str) -> ListenerMetrics {
        ListenerMetrics {
            listener: listener.to_string(),
            active: m
                .active
                .get_or_create(&ListenerLabels {
                    listener: listener.to_string(),
                })
                .clone(),
            duration: m
                .connection_seconds
                .get_or_create(&ListenerLabels {
                    listener: listener.to_string(),
                })
                .clone(),
            detect: Mutex::new(HashMap::new()),
            per_cp: RwLock::new(HashMap::new()),
        }
    }

    /// The listener's name.
    pub fn name(&self) -> &str {
        &self.listener
    }

    /// Calls `f` with each control plane's handles on this listener, or
    /// with `only`'s alone when given (nothing when it has none). The
    /// handles are taken out first: a connection's first routing to a
    /// control plane (which adds its handles) never waits for `f`.
    pub fn each_cp(&self, only: Option<&str>, mut f: impl FnMut(&str, &CpMetrics)) {
        let taken: Vec<(String, Arc<CpMetrics>)> = {
            let per_cp = seedlink_net::sync::read(&self.per_cp, "metric handles");
            match only {
                Some(name) => per_cp
                    .get(name)
                    .map(|h| (name.to_string(), h.clone()))
                    .into_iter()
                    .collect(),
                None => per_cp.iter().map(|(n, h)| (n.clone(), h.clone())).collect(),
            }
        };
        for (name, h) in &taken {
            f(name, h)
        }
    }

    /// Control plane `cp`'s handles on this listener (`""`: never routed).
    pub fn cp(&self, m: &Metrics, cp: &str) -> Arc<CpMetrics> {
        if let Some(h) = seedlink_net::sync::read(&self.per_cp, "metric handles").get(cp) {
            return h.clone();
        }
        let bytes = |direction: &str| {
            m.bytes
                .get_or_create(&ByteLabels {
                    listener: self.listener.clone(),
                    control_plane: cp.to_string(),
                    direction: direction.to_string(),
                })
                .clone()
        };
        let h = Arc::new(CpMetrics {
            to_upstream: bytes("to_upstream"),
            to_client: bytes("to_client"),
            ends: Mutex::new(HashMap::new()),
            routed: Mutex::new(HashMap::new()),
        });
        seedlink_net::sync::write(&self.per_cp, "metric handles")
            .entry(cp.to_string())
            .or_insert(h)
            .clone()
    }

    /// A connection ended with `outcome` (`cp` empty: never routed).
    pub fn ended(&self, m: &Metrics, cp: &str, outcome: &'static str) {
        let h = self.cp(m, cp);
        let mut ends = seedlink_net::sync::lock(&h.ends, "metric handles");
        ends.entry(outcome)
            .or_insert_with(|| {
                m.connections
                    .get_or_create(&ConnLabels {
                        listener: self.listener.clone(),
                        control_plane: cp.to_string(),
                        outcome: outcome.to_string(),
                    })
                    .clone()
            })
            .inc();
    }

    /// A connection to `cp` was routed by `protocol`.
    pub fn routed(&self, m: &Metrics, cp: &str, protocol: &str) -> Routed {
        let h = self.cp(m, cp);
        let mut routed = seedlink_net::sync::lock(&h.routed, "metric handles");
        // Looked up by `&str` first: no allocation once the path is known.
        if let Some((count, open)) = routed.get(protocol) {
            count.inc();
            open.inc();
            return Routed(open.clone());
        }
        let (count, open) = routed.entry(protocol.to_string()).or_insert_with(|| {
            let labels = RoutedLabels {
                listener: self.listener.clone(),
                protocol: protocol.to_string(),
                control_plane: cp.to_string(),
            };
            m.new_path.notify_one();
            (
                m.routed.get_or_create(&labels).clone(),
                m.routed_active.get_or_create(&labels).clone(),
            )
        });
        count.inc();
        open.inc();
        Routed(open.clone())
    }

    /// A connection was refused while detecting its protocol.
    pub fn detect_failure(&self, m: &Metrics, reason: &'static str) {
        seedlink_net::sync::lock(&self.detect, "metric handles")
            .entry(reason)
            .or_insert_with(|| {
                m.detect_failures
                    .get_or_create(&ReasonLabels {
                        listener: self.listener.clone(),
                        reason: reason.to_string(),
                    })
                    .clone()
            })
            .inc();
    }
}
