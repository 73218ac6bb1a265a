//! The tunnel-server's configuration model for one cluster (its agents'
//! trust, its frontends, its limits) and what the server reports of it.
//! `seedlink-tunnel` parses and checks it (`seedlink_tunnel::config`
//! re-exports these types); they live here so that a crate that only
//! builds clusters, the Kubernetes source (`seedlink-kube`), does not pull
//! the tunnel runtime (tonic, the tunnel servers and agents) into its build.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::model::humantime_serde;

/// One cluster: its agents' trust, its frontends, its routing.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Name (a label on every metric).
    pub name: String,
    /// CA whose client certificates identify this cluster's agents.
    #[serde(default)]
    pub agent_ca: Option<PathBuf>,
    /// ServiceAccount tokens that identify this cluster's agents.
    #[serde(default)]
    pub agent_token: Option<TokenAuth>,
    /// Backend choice, tried in order: `destHost`, `cidr`, `defaultRoute`, `default`.
    #[serde(default = "default_strategies")]
    pub strategies: Vec<String>,
    /// Frontends for this cluster's kube-apiserver (besides those
    /// `frontend_templates` give every cluster; may be empty).
    #[serde(default)]
    pub frontends: Vec<Frontend>,
    /// Password that selects this cluster on a shared proxy frontend.
    #[serde(default)]
    pub proxy_password_file: Option<PathBuf>,
    /// A URI the client certificate must also carry (as a subject
    /// alternative name) to select this cluster on a shared mTLS frontend,
    /// besides its CN. The Kubernetes source sets it for a control plane's
    /// generated TunnelCluster ([`control_plane_uri`]), so a certificate
    /// issued for one object never selects a later object of the same
    /// namespace and name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend_client_uri: Option<String>,
    /// Limits, so one cluster cannot starve the others.
    #[serde(default)]
    pub limits: ClusterLimits,
    /// Destinations the tunnel-server dials itself, on the seed's network,
    /// instead of through the cluster's agents: webhooks and aggregated
    /// APIs that run beside the control plane. Everything else goes to the
    /// shoot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seed_destinations: Vec<SeedDestination>,
}

/// A destination in the seed (see [`Cluster::seed_destinations`]): the
/// host and ports kube-apiserver asks for, and where they are dialled.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SeedDestination {
    /// The host as kube-apiserver names it in its CONNECT, e.g.
    /// `webhook.shoot--dev--a.svc` (a webhook's `url`, or an APIService's
    /// ExternalName Service): a DNS name, matched without regard to case,
    /// and, for a name ending in `.svc`, with `.cluster.local` after it too.
    pub host: String,
    /// The ports it is dialled on (at least one).
    pub ports: Vec<u16>,
    /// The addresses dialled, at the asked port. Empty: `host` is looked up
    /// in the seed's DNS, or, with `service`, the Service is read from the
    /// API server.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<std::net::IpAddr>,
    /// `<namespace>/<name>` of a seed Service dialled at its ClusterIP, read
    /// from the API server (the Kubernetes source sets it for a
    /// TunnelCluster's `seedServices`, always in the object's own
    /// namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// The most seed destinations a cluster may have.
pub const MAX_SEED_DESTINATIONS: usize = 16;

impl SeedDestination {
    /// Whether `host` (lowercase, without a trailing dot) at `port` is
    /// this destination.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        if !self.ports.contains(&port) {
            return false;
        }
        let mine = self.host.trim_end_matches('.');
        if host.eq_ignore_ascii_case(mine) {
            return true;
        }
        let suffix = ".cluster.local";
        let cut = host.len().saturating_sub(suffix.len());
        mine.to_ascii_lowercase().ends_with(".svc")
            && host.is_char_boundary(cut)
            && host[cut..].eq_ignore_ascii_case(suffix)
            && host[..cut].eq_ignore_ascii_case(mine)
    }
}

/// The URI that binds kube-apiserver's client certificate to the
/// `SeedlinkControlPlane` whose UID is `uid` (see
/// [`Cluster::frontend_client_uri`]).
pub fn control_plane_uri(uid: &str) -> String {
    format!("urn:seedlink:control-plane:{uid}")
}

/// Whether the DER certificate `der` carries `uri` among its subject
/// alternative names (what [`Cluster::frontend_client_uri`] asks of a
/// client certificate). A certificate that does not parse carries none.
pub fn certificate_has_uri(der: &[u8], uri: &str) -> bool {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return false;
    };
    san.value
        .general_names
        .iter()
        .any(|n| matches!(n, GeneralName::URI(u) if *u == uri))
}

/// Per-cluster limits; 0 switches one off.
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterLimits {
    /// Tunneled connections open or being dialled at once.
    pub max_connections: usize,
    /// New dials per second, sustained.
    pub dial_rate: f64,
    /// Dials allowed in a burst above the rate.
    pub dial_burst: f64,
    /// Agent streams at once (an agent briefly holds a second stream while
    /// it looks for other replicas).
    pub max_agents: usize,
    /// Bytes queued towards frontends across all of the cluster's
    /// connections (each connection's own queue is `queue_bytes`, or two
    /// flow-control windows): past it, a connection with bytes queued
    /// waits for its own reader, as when its own queue is full.
    pub max_queued_bytes: usize,
}

/// Dials per second one tunnel-server completed through one cluster with
/// the limit off (loopback, 2 cores; docs/TUNNEL.md "Limits"). The default
/// dial rate is set well above it, so that the default is never what holds
/// a healthy cluster back; per-tenant fairness is a per-cluster setting.
pub const MEASURED_DIALS_PER_SEC: f64 = 8_500.0;

impl Default for ClusterLimits {
    fn default() -> Self {
        ClusterLimits {
            max_connections: 10_000,
            // ≈ 6× what one server does at most here: a backstop against a
            // runaway client, not a throttle.
            dial_rate: 50_000.0,
            dial_burst: 100_000.0,
            max_agents: 32,
            // 64 connections' full queues at the default `queue_bytes`;
            // without it, 10,000 connections × 4 MiB is 40 GiB.
            max_queued_bytes: 256 * 1024 * 1024,
        }
    }
}

/// Agent authentication by ServiceAccount token: checked locally against
/// the issuer's public keys (`keys`) or by a TokenReview at the cluster's
/// API server (`review`); exactly one of the two.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenAuth {
    /// The token issuer (`iss`), as the cluster's API server issues them.
    /// A token is only ever checked by the cluster with its issuer, so
    /// issuers are unique across clusters.
    pub issuer: String,
    /// The issuer's public keys (PEM; RSA or EC), the API server's
    /// `--service-account-key-file`.
    #[serde(default)]
    pub keys: Option<PathBuf>,
    /// Ask the cluster's API server instead (TokenReview).
    #[serde(default)]
    pub review: Option<TokenReview>,
    /// Required audience.
    #[serde(default = "default_audience")]
    pub audience: String,
    /// The agents' ServiceAccount, `<namespace>/<name>`.
    #[serde(default = "default_service_account")]
    pub service_account: String,
}

fn default_audience() -> String {
    "system:konnectivity-server".into()
}
fn default_service_account() -> String {
    "kube-system/konnectivity-agent".into()
}

/// A frontend.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Frontend {
    /// Name (a metric label).
    pub name: String,
    /// `http-connect` or `grpc`.
    pub protocol: FrontendProtocol,
    /// A Unix socket path (no TLS).
    #[serde(default)]
    pub unix: Option<PathBuf>,
    /// A TCP address: mTLS with `cert`, `key`, `client_ca`; plain TCP is
    /// accepted only on a loopback address.
    #[serde(default)]
    pub tcp: Option<SocketAddr>,
    /// Server certificate for `tcp`.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Its key.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// CA of the clients (kube-apiserver) for `tcp`.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

/// Frontend protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FrontendProtocol {
    /// HTTP/1.1 CONNECT (kube-apiserver `proxyProtocol: HTTPConnect`).
    HttpConnect,
    /// gRPC `ProxyService` (kube-apiserver `proxyProtocol: GRPC`).
    Grpc,
    /// An HTTP forward proxy (Prometheus `proxy_url`): absolute-form
    /// requests (`GET http://host:port/path`) and `CONNECT`.
    HttpProxy,
    /// A SOCKS5 proxy (RFC 1928 `CONNECT`): no authentication on a
    /// cluster's own frontend, username (the cluster) and password on a
    /// shared one.
    Socks5,
}

impl FrontendProtocol {
    /// A proxy protocol: on a shared frontend its credentials name the
    /// cluster (`http-proxy`, `socks5`).
    pub fn is_proxy(self) -> bool {
        matches!(self, FrontendProtocol::HttpProxy | FrontendProtocol::Socks5)
    }
}

fn default_strategies() -> Vec<String> {
    vec!["default".into()]
}

/// Known strategy names.
pub const STRATEGIES: &[&str] = &["default", "destHost", "defaultRoute", "cidr"];

/// A TokenReview client for one cluster's API server.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenReview {
    /// The API server, `https://host[:port]`.
    pub url: String,
    /// CA that issued the API server's certificate (PEM).
    pub ca: PathBuf,
    /// This server's own bearer token (its identity needs
    /// `system:auth-delegator`); read again for every review, so a rotated
    /// projected token is picked up.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Or a client certificate for the API server.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Its key.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// Deadline for one review (connect, TLS, request, answer).
    #[serde(default = "default_review_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// How long an accepted token is trusted without asking again (never
    /// beyond its `exp`); refusals are remembered for 5 s to blunt
    /// reconnect storms. 0 disables the cache.
    #[serde(default = "default_review_cache", with = "humantime_serde")]
    pub cache_ttl: Duration,
}

fn default_review_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_review_cache() -> Duration {
    Duration::from_secs(60)
}

/// What the status of a cluster reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterHealth {
    /// Agent streams connected now.
    pub agents: usize,
    /// When an agent stream last connected or (with none left) went away.
    pub agents_changed: Option<std::time::SystemTime>,
    /// Failed dials by reason since the cluster was added.
    pub dial_errors: Vec<(&'static str, u64)>,
}

/// Per-replica addresses from the replicas' EndpointSlices: `{ip}` is an
/// endpoint's address (an IPv6 one in brackets) and `{pod}` the pod it
/// names; a replica is known by its pod's name (which each server tells
/// its agents as `seedlink-pod`).
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaAddresses {
    /// `host:port` an agent connects to, e.g. `'{ip}:8091'` (pod addresses
    /// the shoot can reach) or `'{pod}.tunnel.example.com:443'`.
    pub address: String,
    /// The TLS server name there (e.g. `'{pod}.tunnel.example.com'`, for a
    /// gateway that routes each name to its replica); default: the
    /// agent's own `--server-name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

impl ReplicaAddresses {
    /// The address and server name of the replica at `ip` in pod `pod`.
    /// (In `server_name`, an IPv6 `{ip}` has no brackets: a TLS name is
    /// the bare address.)
    pub fn of(&self, ip: std::net::IpAddr, pod: &str) -> (String, String) {
        let bare = ip.to_string();
        let bracketed = match ip {
            std::net::IpAddr::V4(_) => bare.clone(),
            std::net::IpAddr::V6(_) => format!("[{bare}]"),
        };
        let fill = |t: &str, ip: &str| t.replace("{ip}", ip).replace("{pod}", pod);
        let name = self.server_name.as_deref().map(|t| fill(t, &bare));
        (fill(&self.address, &bracketed), name.unwrap_or_default())
    }
}

/// How the tunnel-server watches the Secrets and ConfigMaps that
/// TunnelClusters name (`kubernetes.trust_watch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrustWatch {
    /// One labelled watch per tenant namespace and kind, read through a
    /// RoleBinding in each: no grant on any other namespace's Secrets,
    /// but about one API-server connection per 90 tenant namespaces.
    #[default]
    Namespaces,
    /// One labelled watch of each kind across the cluster, read through a
    /// ClusterRoleBinding: two watches whatever the tenant count, at the
    /// price of a grant on every namespace's Secrets.
    Cluster,
}
