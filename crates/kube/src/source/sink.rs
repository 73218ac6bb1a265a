//! What a source hands its output to: the gateway's control planes, the
//! tunnel-server's clusters.

use std::collections::HashMap;

use seedlink_config::model::ControlPlane;
use seedlink_config::ConfigError;

/// Where the gateway's control planes go.
pub trait GatewaySink: Send + Sync + 'static {
    /// Serves these control planes (besides the file's); returns those it
    /// refused, with its problems. Open connections are never touched.
    fn apply(
        &self,
        control_planes: Vec<std::sync::Arc<ControlPlane>>,
    ) -> Vec<(String, Vec<ConfigError>)>;
    /// Each control plane's legacy paths in use (`listener (protocol)`),
    /// by name; `None` when the gateway has no legacy listener.
    fn legacy_paths(&self) -> LegacyPaths {
        None
    }
}

/// Each control plane's legacy paths in use, by name; `None`: the gateway
/// has no legacy listener (its routes' status says nothing of them).
pub type LegacyPaths = Option<std::collections::BTreeMap<String, Vec<String>>>;

/// Where the tunnel-server's clusters go, and what it says of them.
pub trait TunnelSink: Send + Sync + 'static {
    /// Serves these clusters (besides the file's); returns those refused,
    /// with the problems.
    /// `status_held`: who holds each trust claim by the TunnelClusters'
    /// statuses (claim → cluster).
    fn apply(
        &self,
        clusters: Vec<seedlink_config::tunnel::Cluster>,
        status_held: HashMap<String, String>,
    ) -> BoxFuture<'_, seedlink_config::compile::Refused>;
    /// Each served cluster's agents and dial errors, by name (asked once
    /// per status sweep: one lookup per cluster would cost tenants²).
    fn health(&self) -> HashMap<String, seedlink_config::tunnel::ClusterHealth>;
    /// Each served cluster's trust claims (its `status.trust`), sorted,
    /// by name.
    fn trust(&self) -> HashMap<String, Vec<String>> {
        HashMap::new()
    }
    /// The tunnel-server replicas counted from their Service's
    /// EndpointSlices (`kubernetes.replicas`), and where each is reached
    /// (`kubernetes.replica_addresses`; empty when not set).
    fn set_replicas(&self, _count: u32, _at: Vec<Replica>) {}
}

/// One tunnel-server replica and where agents reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    /// Its pod's name.
    pub pod: String,
    /// `host:port`.
    pub address: String,
    /// The TLS server name there (empty: the agent's own).
    pub server_name: String,
}

/// A boxed future, for the object-safe [`TunnelSink`].
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
