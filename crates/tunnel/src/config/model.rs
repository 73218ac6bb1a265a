//! The tunnel-server's file as types: the server's own settings, the agent
//! endpoint, the admin endpoint, and the clusters (whose model is
//! seedlink-config's `tunnel`). Defaults live beside their fields.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use seedlink_config::model::humantime_serde;
use seedlink_config::tunnel::{Cluster, ClusterLimits, Frontend};
use seedlink_config::ConfigError;
use serde::Deserialize;

/// The whole file.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// This replica's ID, sent to agents as `serverid` (default: random,
    /// one per process).
    #[serde(default)]
    pub server_id: Option<String>,
    /// Replicas behind the agents' address, sent as `servercount`.
    #[serde(default = "one")]
    pub server_count: u32,
    /// The agent endpoint.
    pub agents: AgentEndpoint,
    /// Admin endpoint: `/healthz`, `/readyz`, `/metrics`.
    #[serde(default)]
    pub admin: Option<Admin>,
    /// Deadline for an agent's answer to a dial.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub dial_timeout: Duration,
    /// How long a dial that finds no agent of its cluster waits for one to
    /// join (within `dial_timeout`) before it is answered `no_agent`; `0s`
    /// answers at once. Covers the moment a replica is replaced, when the
    /// agents are still finding its successor.
    #[serde(default = "agent_wait_default", with = "humantime_serde")]
    pub agent_wait: Duration,
    /// A tunneled connection whose frontend (or destination) accepts no byte
    /// for this long is closed; only that connection.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Bytes queued per tunneled connection towards a slow frontend before
    /// that connection is closed (standard Konnectivity protocol only).
    #[serde(default = "queue_default")]
    pub queue_bytes: usize,
    /// The clusters served.
    pub clusters: Vec<Cluster>,
    /// Frontends shared by all clusters, where each connection names its
    /// cluster: `http-proxy` by proxy credentials (`Proxy-Authorization:
    /// Basic <cluster>:<password>`, the cluster's `proxy_password_file`);
    /// `http-connect` and `grpc` (TCP with mTLS only) by the client
    /// certificate, whose subject CN is the cluster's name.
    #[serde(default)]
    pub shared_frontends: Vec<Frontend>,
    /// Frontends every cluster gets, with `{cluster}` in the Unix socket
    /// path replaced by the cluster's name (e.g.
    /// `/run/seedlink/{cluster}.sock`), so adding a cluster to the list is
    /// enough to give its kube-apiserver a socket.
    #[serde(default)]
    pub frontend_templates: Vec<Frontend>,
    /// More clusters from `TunnelCluster` objects (docs/KUBERNETES.md).
    #[serde(default)]
    pub kubernetes: Option<Kubernetes>,
}

/// Where the tunnel-server's Kubernetes objects are.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Kubernetes {
    /// `namespace/name` of the Lease electing the replica that writes
    /// `TunnelCluster` status.
    pub lease: String,
    /// `namespace/name` of the Service that selects the tunnel-server
    /// replicas: `servercount` (what agents hold a stream to each of)
    /// follows its EndpointSlices (the replicas serving and not
    /// terminating), so scaling needs no configuration change;
    /// `server_count` holds until they are read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<String>,
    /// Whether this replica takes part in writing status (default true).
    #[serde(default = "yes")]
    pub write_status: bool,
    /// Where the keys of the Secrets and ConfigMaps that clusters name are
    /// written for the server to read (a private directory; default
    /// `/tmp/seedlink-trust`, an `emptyDir` under a read-only root).
    #[serde(default = "default_trust_dir")]
    pub trust_dir: PathBuf,
    /// Where TunnelClusters' Unix-socket frontends are created: a
    /// TunnelCluster names only the file, which goes in
    /// `<socket_dir>/<namespace>.<name>/` (default `/run/seedlink`).
    #[serde(default = "default_socket_dir")]
    pub socket_dir: PathBuf,
    /// The most a TunnelCluster may have: its own `limits` can lower each
    /// of these, never raise it (absent or 0 there means this ceiling).
    /// Default: the built-in defaults.
    #[serde(default)]
    pub max_limits: ClusterLimits,
    /// Addresses (CIDRs) a TunnelCluster's `agentToken.review.url` may
    /// name besides a Service of its own namespace (default none: a
    /// tenant's shoot API servers run as Services beside their
    /// TunnelClusters).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub review_cidrs: Vec<ipnet::IpNet>,
    /// How long an agent CA, token key or issuer that a TunnelCluster
    /// stops trusting (a revocation) stays reserved to it, so that no
    /// other cluster can take the agents still presenting the old
    /// credentials (default 365 days, the onboarding controller's agent
    /// certificate validity; set it to at least your agents' certificate
    /// validity). Deleting the TunnelCluster releases its claims at once.
    #[serde(default = "released_trust_hold_default", with = "humantime_serde")]
    pub released_trust_hold: Duration,
    /// How many of the per-namespace watches (one per tenant namespace
    /// and kind its TunnelClusters name) share one HTTP/2 connection to
    /// the API server (default 90, below kube-apiserver's default cap of
    /// 100 concurrent streams per connection; raise it only to what your
    /// API server's `--http2-max-streams-per-connection` allows).
    #[serde(default = "watches_per_connection_default")]
    pub watches_per_connection: usize,
    /// The most HTTP/2 connections to the API server (default 10, at
    /// least 1): the main one, and those the per-namespace trust watches
    /// share. The namespaces past `(max_api_connections - 1) ×
    /// watches_per_connection` watches have their labelled trust listed
    /// again on a pace instead (each at least every 10 s, all together at
    /// most 20 lists a second): a change there is seen within
    /// `max(10 s, namespaces past / 20)` seconds instead of at once.
    #[serde(default = "max_api_connections_default")]
    pub max_api_connections: usize,
    /// How the labelled Secrets and ConfigMaps are watched: `namespaces`
    /// (default: one watch per tenant namespace and kind, through a
    /// RoleBinding in each) or `cluster` (one watch of each kind across
    /// the cluster, through a ClusterRoleBinding: the API-server
    /// connections stay at two whatever the tenant count, one without
    /// `replicas`). Only the
    /// namespaces whose TunnelClusters name a kind are read either way.
    #[serde(default)]
    pub trust_watch: seedlink_config::tunnel::TrustWatch,
    /// Where agents reach each replica by itself, told to seedlink agents
    /// with the replica count (REPLICAS), so that they hold a stream to
    /// every replica without a load balancer in front (needs `replicas`).
    /// Default none: agents find replicas through their `--server` address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_addresses: Option<seedlink_config::tunnel::ReplicaAddresses>,
}

fn watches_per_connection_default() -> usize {
    90
}

fn max_api_connections_default() -> usize {
    10
}

fn released_trust_hold_default() -> Duration {
    Duration::from_secs(365 * 24 * 3600)
}

fn default_socket_dir() -> PathBuf {
    PathBuf::from("/run/seedlink")
}

fn yes() -> bool {
    true
}

fn default_trust_dir() -> PathBuf {
    PathBuf::from("/tmp/seedlink-trust")
}

/// Clusters left out of a parse, each with its problems.
pub type Refused = Vec<(String, Vec<ConfigError>)>;

/// Where agents connect.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentEndpoint {
    /// Listen address (Konnectivity's conventional port is 8132 or 8091).
    pub listen: SocketAddr,
    /// Server certificate (PEM).
    pub cert: PathBuf,
    /// Its key (PEM).
    pub key: PathBuf,
    /// HTTP/2 PING interval towards agents; a frozen agent is detected
    /// within this plus `keepalive_timeout`.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub keepalive: Duration,
    /// How long a PING may go unanswered.
    #[serde(default = "five_s", with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// Agent connections at once (this port faces every shoot, and the
    /// internet); more are closed at accept and counted.
    #[serde(default = "agent_connections")]
    pub max_connections: usize,
    /// Agent connections at once from one source address (a shoot's agents
    /// usually leave through one NAT address, or the gateway's clients').
    #[serde(default = "agent_connections_per_source")]
    pub max_per_source: usize,
    /// Of `max_connections`, how many may be unauthenticated at once: not
    /// yet past TLS, or past it without a cluster's certificate and no
    /// stream admitted yet. The rest are kept for agents of known
    /// clusters, whatever anonymous peers do.
    #[serde(default = "unauthenticated_connections")]
    pub max_unauthenticated: usize,
    /// Unauthenticated connections at once from one source (an IPv4
    /// address, an IPv6 /64).
    #[serde(default = "unauthenticated_per_source")]
    pub max_unauthenticated_per_source: usize,
    /// TLS handshakes per second one source may start (a burst of twice
    /// as many); past it a connection is closed at accept
    /// (`handshake_rate`). 0: unlimited.
    #[serde(default = "handshakes_per_source")]
    pub handshakes_per_source: f64,
}

fn agent_connections() -> usize {
    10_000
}

fn unauthenticated_connections() -> usize {
    1_024
}

fn unauthenticated_per_source() -> usize {
    16
}

fn handshakes_per_source() -> f64 {
    50.0
}

fn agent_connections_per_source() -> usize {
    256
}

/// The admin endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// Listen address.
    pub listen: SocketAddr,
    /// A file holding a bearer token: then everything but the probes
    /// needs `Authorization: Bearer <token>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
}

fn one() -> u32 {
    1
}

fn agent_wait_default() -> Duration {
    Duration::from_secs(3)
}

fn ten_s() -> Duration {
    Duration::from_secs(10)
}

fn five_s() -> Duration {
    Duration::from_secs(5)
}

fn queue_default() -> usize {
    4 * 1024 * 1024
}

impl ServerConfig {
    /// Cluster `name` as the file's templates serve one it does not list
    /// (a TunnelCluster from the Kubernetes source): no trust of its own
    /// here (the object holds it), the templated frontends.
    pub fn templated(&self, name: &str) -> Cluster {
        let frontends = self
            .frontend_templates
            .iter()
            .map(|t| {
                let mut f = t.clone();
                f.unix = t
                    .unix
                    .as_ref()
                    .map(|p| PathBuf::from(p.to_string_lossy().replace("{cluster}", name)));
                f
            })
            .collect();
        Cluster {
            name: name.to_string(),
            agent_ca: None,
            agent_token: None,
            strategies: Vec::new(),
            frontends,
            proxy_password_file: None,
            frontend_client_uri: None,
            seed_destinations: Vec::new(),
            limits: ClusterLimits::default(),
        }
    }
}
