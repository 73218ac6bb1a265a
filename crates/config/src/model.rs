//! The configuration file as written. Values that need semantic checks
//! (addresses, CIDRs, host names) are kept as strings here so that
//! [`crate::compile`] can report every bad one, not just the first.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// The admin HTTP endpoint.
    #[serde(default)]
    pub admin: Admin,
    /// Listening sockets.
    pub listeners: Vec<Listener>,
    /// CIDRs of load balancers whose PROXY protocol headers are believed.
    #[serde(default)]
    pub trusted_load_balancers: Vec<String>,
    /// CIDRs allowed to reach every control plane, whatever its ACL.
    #[serde(default)]
    pub always_allowed: Vec<String>,
    /// Deadlines.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// Upstream connection behaviour.
    #[serde(default)]
    pub upstream: Upstream,
    /// The control planes reachable through the gateway.
    #[serde(default)]
    pub control_planes: Vec<ControlPlane>,
    /// More control planes from Kubernetes objects (docs/KUBERNETES.md).
    #[serde(default)]
    pub kubernetes: Option<KubernetesSource>,
    /// The paths each control plane still uses, kept across restarts, and
    /// the gate that refuses a configuration removing one of them.
    #[serde(default)]
    pub migration: Migration,
    /// The control planes the Kubernetes source produced; never read from
    /// the file. Compiled like `control_planes` (after them, so a file's
    /// host name wins a conflict), except that an empty endpoint list is
    /// allowed: a route whose pods are all gone still exists. Shown in
    /// the admin `/config` dump; a file that sets it is refused (unknown key).
    #[serde(
        skip_deserializing,
        default,
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "shared_list"
    )]
    pub from_kubernetes: Vec<std::sync::Arc<ControlPlane>>,
}

/// Shared (`Arc`): the source hands the same control plane from pass to
/// pass while its objects do not change, so passing, comparing (equal
/// when the same) and dropping one costs no copy.
fn shared_list<S: serde::Serializer>(
    list: &[std::sync::Arc<ControlPlane>],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(list.iter().map(|c| c.as_ref()))
}

/// Migration gates (docs/OPERATIONS.md, "Migrating without dropping a
/// shoot"): a path is a control plane reached through a listener by a
/// protocol (`routed_total`'s labels); one used within `window` is in use,
/// and a configuration that removes it (the listener, or the control
/// plane's routes of that kind) is refused unless it is named in `retire`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Migration {
    /// Where the last use of each path is kept, written every 30 s and at
    /// shutdown, read at start (a path used before a restart is still in
    /// use after it). Without it, the record lives in memory only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage_file: Option<String>,
    /// How long after its last use a path counts as in use.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// Paths removed on purpose, although in use: the force.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub retire: Vec<Retire>,
}

impl Default for Migration {
    fn default() -> Self {
        Migration {
            usage_file: None,
            window: Duration::from_secs(7 * 24 * 3600),
            retire: Vec::new(),
        }
    }
}

/// A path removed although in use: a control plane on a listener (`*`
/// for every control plane on it).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Retire {
    /// The listener's name.
    pub listener: String,
    /// The control plane, or `*`.
    pub control_plane: String,
}

impl Migration {
    /// Whether `retire` names `control_plane` on `listener`.
    pub fn retires(&self, listener: &str, control_plane: &str) -> bool {
        self.retire.iter().any(|r| {
            r.listener == listener && (r.control_plane == "*" || r.control_plane == control_plane)
        })
    }
}

/// Where the gateway's Kubernetes objects are.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSource {
    /// `namespace/name` of a Gateway whose TLSRoutes this gateway serves on
    /// every listener (its addresses are the Service's). At least one of
    /// `gateway` and `gateway_class`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Every Gateway of a GatewayClass, each served at an address of its
    /// own (a Gateway API implementation in full).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_class: Option<GatewayClassSource>,
    /// `namespace/name` of the Lease that elects the one replica writing
    /// status; default `<gateway namespace>/seedlink-status` (required
    /// without `gateway`).
    #[serde(default)]
    pub lease: Option<String>,
    /// Whether this replica takes part in writing status (default true).
    #[serde(default = "yes")]
    pub write_status: bool,
    /// `namespace/name` of the Service seedlink is exposed by (its
    /// LoadBalancer addresses become the Gateway's `status.addresses`);
    /// default `<gateway namespace>/seedlink`, the install's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// The `endpointslice.kubernetes.io/managed-by` values whose
    /// EndpointSlices name upstreams. Default: Kubernetes' own EndpointSlice
    /// controller only, which writes the addresses of the pods a Service
    /// selects in its own namespace; a slice written by hand (a tenant may
    /// write one for a Service without a selector) could name another
    /// namespace's pods and make the gateway their confused deputy (the
    /// CVE-2021-25740 class).
    #[serde(default = "default_slice_managers")]
    pub endpointslice_managers: Vec<String>,
}

/// The Gateways of one class, each at its own address.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayClassSource {
    /// The GatewayClass; its `controllerName` must be `seedlink.dev/gateway`.
    pub name: String,
    /// The addresses Gateways of the class are given, one each, oldest
    /// Gateway first (an address stays with its Gateway once its status
    /// shows it). Each must be one this gateway receives connections at: a
    /// TLS listener bound to it or to the unspecified address. A Gateway's
    /// routes are served only on connections to its address.
    pub addresses: Vec<String>,
}

/// The EndpointSlice manager the gateway trusts by default.
pub const ENDPOINTSLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";

fn default_slice_managers() -> Vec<String> {
    vec![ENDPOINTSLICE_CONTROLLER.to_string()]
}

fn yes() -> bool {
    true
}

/// The admin endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// `host:port` of the admin HTTP server.
    pub listen: String,
    /// A file holding a bearer token: then everything but the probes
    /// (`/healthz`, `/readyz`) needs `Authorization: Bearer <token>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            token_file: None,
            listen: "127.0.0.1:9901".into(),
        }
    }
}

/// One listening socket.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// `ip:port` to bind.
    pub address: String,
    /// What the listener speaks.
    #[serde(default)]
    pub protocol: Protocol,
    /// Whether a PROXY protocol header from the load balancer is expected.
    #[serde(default)]
    pub proxy_protocol: ProxyMode,
    /// `http-connect` only: the header that names the destination.
    #[serde(default = "default_destination_header")]
    pub destination_header: String,
    /// `http-connect` only: the answer to a request without a usable
    /// destination header, or that is not CONNECT.
    #[serde(default)]
    pub on_invalid_request: InvalidRequest,
    /// `http-connect` only: an extra guard, a regular expression (RE2
    /// syntax, full match, like Envoy's `safe_regex`) the destination header
    /// must match, e.g. Gardener's.
    #[serde(default)]
    pub destination_regex: Option<String>,
    /// `proxy` only: route by the value of this PROXY v2 TLV type in the
    /// node proxy's header, matched exactly against control planes'
    /// `cluster_id`, instead of by the header's destination address
    /// (HyperShift's node path uses type 0x20 carrying the cluster ID).
    #[serde(default)]
    pub route_by_tlv: Option<u8>,
    /// `http-connect`/`auto` only: CONNECTs on this listener may be handed
    /// to an in-process tunnel-server (a destination with a
    /// `tunnel_target` whose control plane's endpoint is `local:`), i.e.
    /// reach into a shoot's network. Off by default: an internet-facing
    /// listener must never be a way into the shoots (docs/SECURITY.md).
    #[serde(default)]
    pub tunnel_frontend: bool,
    /// A path a migration retires (GEP-08's PROXY port, the `Reversed-VPN`
    /// listener): each control plane from Kubernetes that used it within
    /// `migration.window` says so on its status.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub legacy: bool,
}

fn default_destination_header() -> String {
    "X-Gardener-Destination".into()
}

/// The answer to a CONNECT request without a usable destination header, or
/// to a method other than CONNECT.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InvalidRequest {
    /// Gardener's behaviour: `301` to `https://<host>:443<path>`.
    #[default]
    Redirect,
    /// `400` (header missing, duplicated or malformed) or `405` (method).
    Status,
}

/// Listener protocols.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// TLS passthrough routed by SNI.
    #[default]
    Tls,
    /// HTTP/1.x CONNECT routed by a destination header.
    HttpConnect,
    /// Legacy (GEP-08): a PROXY header from a node proxy whose destination
    /// address selects the control plane.
    Proxy,
    /// One port for all: the protocol is told from the first bytes.
    Auto,
}

/// PROXY protocol handling on a listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProxyMode {
    /// Never parsed; a PROXY header is treated as bad protocol input.
    #[default]
    Off,
    /// Every connection must come from a trusted load balancer and start
    /// with a PROXY header.
    Required,
    /// Parsed when present and the peer is trusted; connections without it
    /// are accepted as direct (Gardener's rollout mode).
    Optional,
}

/// Deadlines. Durations are written like `5s`, `250ms`, `2m`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// Absolute deadline to receive the PROXY header and the ClientHello.
    #[serde(with = "humantime_serde")]
    pub client_hello: Duration,
    /// Deadline for one upstream connect attempt.
    #[serde(with = "humantime_serde")]
    pub upstream_connect: Duration,
    /// How long draining waits for connections before closing them.
    #[serde(with = "humantime_serde")]
    pub drain: Duration,
    /// Once one side of a proxied connection has closed its sending half,
    /// how long the other may go without sending a byte before both are
    /// reset.
    #[serde(with = "humantime_serde")]
    pub half_closed: Duration,
    /// Open connections of a removed control plane are closed this long
    /// after the removal; unset means they run until they end.
    #[serde(with = "humantime_serde::option")]
    pub removed_control_plane_grace: Option<Duration>,
    /// TCP keepalive idle time, both sides.
    #[serde(with = "humantime_serde")]
    pub keepalive_time: Duration,
    /// TCP keepalive probe interval.
    #[serde(with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// TCP keepalive probes before giving up.
    pub keepalive_retries: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            client_hello: Duration::from_secs(5),
            upstream_connect: Duration::from_secs(5),
            drain: Duration::from_secs(30),
            half_closed: Duration::from_secs(60),
            removed_control_plane_grace: None,
            keepalive_time: Duration::from_secs(60),
            keepalive_interval: Duration::from_secs(15),
            keepalive_retries: 4,
        }
    }
}

/// Resource limits.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Concurrent connections; unset derives it from the open-file limit.
    pub max_connections: Option<u64>,
    /// Concurrent routed connections (and HTTP/2 streams) of one control
    /// plane, so one tenant cannot take the others' share of
    /// `max_connections`; unset: half of `max_connections`. Connections
    /// handed to an in-process service (`local:`) are bounded there.
    pub max_connections_per_control_plane: Option<u64>,
    /// Concurrent not-yet-routed connections per source (an IPv4 address,
    /// an IPv6 /64).
    pub max_unrouted_per_source: u32,
    /// Concurrent routed connections (and HTTP/2 streams) per source (an
    /// IPv4 address, an IPv6 /64); unset: no cap, as a shoot's nodes often
    /// share one NAT address (the per-control-plane cap bounds a tenant).
    pub max_routed_per_source: Option<u32>,
    /// Cap on the ClientHello size.
    pub client_hello_max_bytes: usize,
    /// Cap on a PROXY v2 header (fixed part, addresses and TLVs).
    pub proxy_header_max_bytes: usize,
    /// Pipes (two descriptors each) shared by all splice copies.
    pub splice_pipes: usize,
    /// How bytes are moved.
    pub copy: CopyMode,
    /// Worker threads (each a single-threaded event loop with its own
    /// `SO_REUSEPORT` accept socket); unset means one per CPU.
    pub workers: Option<usize>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: None,
            max_connections_per_control_plane: None,
            max_unrouted_per_source: 64,
            max_routed_per_source: None,
            client_hello_max_bytes: 16 * 1024,
            proxy_header_max_bytes: 536,
            splice_pipes: 256,
            copy: CopyMode::Splice,
            workers: None,
        }
    }
}

/// Copy implementation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopyMode {
    /// `splice(2)` on Linux, buffered elsewhere.
    #[default]
    Splice,
    /// Always through a user-space buffer.
    Buffered,
}

/// Upstream connection behaviour.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Upstream {
    /// Endpoint choice.
    pub balance: Balance,
    /// Endpoints tried per connection before giving up.
    pub connect_attempts: u32,
    /// First ejection after a failed connect; doubles per consecutive failure.
    #[serde(with = "humantime_serde")]
    pub eject_base: Duration,
    /// Longest ejection.
    #[serde(with = "humantime_serde")]
    pub eject_max: Duration,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            balance: Balance::LeastConnections,
            connect_attempts: 3,
            eject_base: Duration::from_secs(2),
            eject_max: Duration::from_secs(60),
        }
    }
}

/// Endpoint choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Balance {
    /// The endpoint with the fewest active connections.
    #[default]
    LeastConnections,
    /// The less loaded of two endpoints picked at random.
    PowerOfTwoChoices,
}

/// One control plane (one shoot's kube-apiserver).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ControlPlane {
    /// Unique name, e.g. the shoot namespace `shoot--project--name`.
    pub name: String,
    /// SNI host names: exact, or `*.` wildcards (Gateway API's: `*.example.com`
    /// matches any name ending in `.example.com`; the most specific wins).
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// Host names routed only where connections arrive at one address
    /// (`ip:port`). Such an address serves only the names given for it
    /// (never `hostnames`), and names at different addresses do not
    /// conflict. The Kubernetes source sets it for each Gateway of its class
    /// (`kubernetes.gateway_class`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub served_on: Vec<ServedOn>,
    /// `host:port` upstream endpoints.
    pub endpoints: Vec<String>,
    /// Client-IP allow-list; absent means every client is allowed.
    #[serde(default)]
    pub acl: Option<Acl>,
    /// Destinations reachable through `http-connect` listeners.
    #[serde(default)]
    pub destinations: Vec<DestinationCfg>,
    /// In-cluster service addresses (`ip:port`) that legacy node proxies put
    /// in the destination of their PROXY header (`proxy` listeners).
    #[serde(default)]
    pub service_addresses: Vec<String>,
    /// The cluster ID node proxies send in the PROXY v2 TLV a
    /// `route_by_tlv` listener routes by (HyperShift: the hosted cluster's
    /// ID). Matched exactly, byte for byte.
    #[serde(default)]
    pub cluster_id: Option<String>,
}

/// Host names served at one listening address only.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServedOn {
    /// `ip:port`, as connections arrive at it (a `tls` or `auto` listener
    /// must receive there).
    pub address: String,
    /// The names served there (exact or `*.` wildcards).
    pub hostnames: Vec<String>,
}

/// One destination of a control plane, named as CONNECT requests name it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DestinationCfg {
    /// `outbound|<port>||<fqdn>` or `<namespace>--kube-apiserver-socket`.
    pub name: String,
    /// `host:port` endpoints; absent means the control plane's endpoints.
    #[serde(default)]
    pub endpoints: Option<Vec<String>>,
    /// With a `local:` endpoint (`seedlink seed`): the one `host:port` the
    /// tunnel-server's agent dials in the shoot for a CONNECT naming this
    /// destination on a `tunnel_frontend` listener. The CONNECT's own
    /// request-line target is never dialled.
    #[serde(default)]
    pub tunnel_target: Option<String>,
}

/// A client-IP allow-list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Acl {
    /// Allowed client CIDRs (IPv4 and IPv6); a bare address means /32 or /128.
    pub allow: Vec<String>,
}

/// serde adapters for `humantime` durations (`5s`, `250ms`), shared by every role's configuration.
pub mod humantime_serde {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes a duration as `5s`.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    /// Reads `5s`, `250ms`, `1h`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}")))
    }

    /// The same for `Option<Duration>`.
    pub mod option {
        use super::*;

        /// Writes a duration as `5s`, or nothing.
        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => super::serialize(d, s),
                None => s.serialize_none(),
            }
        }

        /// Reads an optional duration.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            match Option::<String>::deserialize(d)? {
                None => Ok(None),
                Some(s) => humantime::parse_duration(&s)
                    .map(Some)
                    .map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}"))),
            }
        }
    }
}
