//! seedlink's own resources: `SeedlinkPolicy` (what a TLSRoute cannot say,
//! attached to it by `targetRefs` as Gateway API policy attachment,
//! GEP-713), `TunnelCluster` (one reverse-tunnel cluster, its trust from
//! Secrets/ConfigMaps, its health in status) and `SeedlinkControlPlane`
//! (one hosted control plane, from which the onboarding controller
//! generates the rest: `crate::onboard`). The CRDs shipped in
//! `deploy/crds/` are generated from these types (`seedlink crds`), and a
//! test compares them.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The controller name seedlink writes into route and policy status.
pub const CONTROLLER_NAME: &str = "seedlink.dev/gateway";

/// Client-IP ACL, CONNECT destinations and legacy service addresses of the
/// control planes that the targeted TLSRoutes define.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "policy.seedlink.dev",
    version = "v1alpha1",
    kind = "SeedlinkPolicy",
    plural = "seedlinkpolicies",
    namespaced,
    status = "PolicyStatus",
    category = "seedlink",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.ancestors[*].conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SeedlinkPolicySpec {
    /// The TLSRoutes (in this namespace) the policy applies to.
    #[schemars(length(min = 1, max = 16))]
    pub target_refs: Vec<LocalPolicyTargetRef>,
    /// Client CIDRs allowed to reach the control plane (a bare address
    /// means /32 or /128); absent means every client.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "allowedSourceCIDRs"
    )]
    #[schemars(length(max = 256), inner(length(max = 64)))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.all(c, isCIDR(c) || isIP(c))",
        "message": "each entry must be a CIDR (10.0.0.0/8) or an IP address"
    }]))]
    pub allowed_source_cidrs: Option<Vec<String>>,
    /// Names reachable through the gateway's `http-connect` listeners
    /// (`outbound|443||kube-apiserver.<ns>.svc.cluster.local` or
    /// `<ns>--kube-apiserver-socket`); they lead to the route's backends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destinations: Vec<String>,
    /// In-cluster service addresses (`ip:port`) that GEP-08 node proxies
    /// put in their PROXY header (`proxy` listeners).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_addresses: Vec<String>,
    /// The hosted cluster's ID (HyperShift's `HostedCluster.spec.clusterID`)
    /// that node proxies send in a PROXY v2 TLV; a `proxy` listener with
    /// `route_by_tlv` routes by it.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "clusterID")]
    pub cluster_id: Option<String>,
}

/// A target in the policy's namespace (GEP-713 `LocalPolicyTargetReference`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct LocalPolicyTargetRef {
    /// `gateway.networking.k8s.io`.
    #[schemars(extend("enum" = ["gateway.networking.k8s.io"]))]
    pub group: String,
    /// `TLSRoute`.
    #[schemars(extend("enum" = ["TLSRoute"]))]
    pub kind: String,
    /// The route's name.
    pub name: String,
}

/// GEP-713 policy status: one entry per ancestor (the route targeted).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct PolicyStatus {
    /// Per target.
    #[serde(default)]
    pub ancestors: Vec<PolicyAncestorStatus>,
}

/// The policy's status for one target.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyAncestorStatus {
    /// The target.
    pub ancestor_ref: AncestorRef,
    /// `seedlink.dev/gateway`.
    pub controller_name: String,
    /// `Accepted`.
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// A reference to a policy's ancestor.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct AncestorRef {
    /// API group.
    pub group: String,
    /// Kind.
    pub kind: String,
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
}

/// One reverse-tunnel cluster: whose agents it accepts, where its
/// kube-apiserver reaches it, and (in status) whether it works.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "tunnel.seedlink.dev",
    version = "v1alpha1",
    kind = "TunnelCluster",
    plural = "tunnelclusters",
    namespaced,
    status = "TunnelClusterStatus",
    category = "seedlink",
    printcolumn = r#"{"name":"Agents","type":"integer","jsonPath":".status.agents"}"#,
    printcolumn = r#"{"name":"Last agent","type":"date","jsonPath":".status.lastAgentSeen"}"#,
    printcolumn = r#"{"name":"Connected","type":"string","jsonPath":".status.conditions[?(@.type==\"AgentsConnected\")].status"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.agentCA) || has(self.agentToken)",
    "message": "agentCA or agentToken is required: the cluster must know its agents"
}]))]
pub struct TunnelClusterSpec {
    /// CA bundle (PEM) whose client certificates identify the agents.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "agentCA")]
    pub agent_ca: Option<KeyRef>,
    /// ServiceAccount tokens that identify the agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_token: Option<AgentToken>,
    /// Backend choice, in order: `destHost`, `cidr`, `defaultRoute`, `default`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4), inner(length(max = 16)))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.all(s, s in ['destHost', 'cidr', 'defaultRoute', 'default'])",
        "message": "strategies are destHost, cidr, defaultRoute and default"
    }]))]
    pub strategies: Vec<String>,
    /// Frontends for the cluster's kube-apiserver (besides the server's
    /// frontend templates).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frontends: Vec<FrontendSpec>,
    /// Per-cluster limits; absent fields keep the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsSpec>,
    /// Services of this object's own namespace, in the seed, that
    /// kube-apiserver reaches through its `cluster` egress (webhooks and
    /// aggregated APIs beside the control plane): the tunnel-server dials
    /// them itself at their ClusterIP, not through the agents. Asked for as
    /// `<name>.<namespace>.svc[.cluster.local]` at one of `ports`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub seed_services: Vec<SeedServiceSpec>,
}

/// A Service of the TunnelCluster's own namespace dialled in the seed.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SeedServiceSpec {
    /// The Service's name (there is no namespace field: always the
    /// object's own).
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// The Service ports kube-apiserver asks for.
    #[schemars(length(min = 1, max = 16), inner(range(min = 1, max = 65535)))]
    pub ports: Vec<u16>,
}

/// One key of a Secret or a ConfigMap in the resource's namespace; exactly
/// one of `secret` and `configMap`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.secret) != has(self.configMap)",
    "message": "exactly one of secret and configMap"
}]))]
pub struct KeyRef {
    /// A Secret's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// A ConfigMap's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<String>,
    /// The key, e.g. `ca.crt`.
    pub key: String,
}

/// Agent authentication by ServiceAccount token, checked locally against
/// the issuer's public keys (`keys`) or by a TokenReview at the shoot's
/// kube-apiserver (`review`); exactly one of the two.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.keys) != has(self.review)",
    "message": "exactly one of keys (a local check) and review (a TokenReview)"
}]))]
pub struct AgentToken {
    /// The token issuer (`iss`).
    pub issuer: String,
    /// The issuer's public keys (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<KeyRef>,
    /// Ask the shoot's kube-apiserver (TokenReview) instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review: Option<TokenReviewSpec>,
    /// Required audience (default `system:konnectivity-server`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// The agents' ServiceAccount `<namespace>/<name>` (default
    /// `kube-system/konnectivity-agent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
}

/// Where and as whom the tunnel-server asks a TokenReview.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenReviewSpec {
    /// The shoot's kube-apiserver, `https://<service>.<this namespace>.svc[:port]`
    /// (or an address the operator allows, `kubernetes.review_cidrs`).
    #[schemars(regex(pattern = r"^https://"), length(max = 253))]
    pub url: String,
    /// The CA of its serving certificate (PEM).
    pub ca: KeyRef,
    /// A Secret of this namespace holding the tunnel-server's credentials
    /// there (allowed `system:auth-delegator`): `token` (a bearer token),
    /// or `tls.crt` and `tls.key`.
    #[schemars(
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        length(max = 253)
    )]
    pub credentials: String,
}

/// A frontend of the cluster.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.unix) != has(self.tcp)", "message": "exactly one of unix and tcp"},
    {"rule": "!has(self.tls) || has(self.tcp)", "message": "tls only applies to tcp"}
]))]
pub struct FrontendSpec {
    /// Name (a metric label).
    #[schemars(regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), length(max = 63))]
    pub name: String,
    /// `http-connect`, `grpc`, `http-proxy` or `socks5`.
    #[schemars(extend("enum" = ["http-connect", "grpc", "http-proxy", "socks5"]))]
    pub protocol: String,
    /// A Unix socket path (no TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix: Option<String>,
    /// A TCP `ip:port`: mTLS with `tls`, or plain on loopback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<String>,
    /// For `tcp`: a `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`) and
    /// the clients' CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<FrontendTls>,
}

/// TLS of a TCP frontend.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FrontendTls {
    /// Secret with `tls.crt` and `tls.key`.
    pub secret: String,
    /// The clients' (kube-apiserver's) CA.
    #[serde(rename = "clientCA")]
    pub client_ca: KeyRef,
}

/// Per-cluster limits.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LimitsSpec {
    /// Tunneled connections at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u64>,
    /// New dials per second, sustained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dial_rate: Option<f64>,
    /// Dials allowed in a burst above the rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dial_burst: Option<f64>,
    /// Agent streams at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_agents: Option<u64>,
    /// Bytes queued towards kube-apiserver across the cluster's
    /// connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued_bytes: Option<u64>,
}

/// What the tunnel-server sees of the cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelClusterStatus {
    /// `Ready` (trust loaded, frontends listening) and `AgentsConnected`.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Agent streams connected to the replica writing status.
    #[serde(default)]
    pub agents: u64,
    /// When an agent was last connected (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_agent_seen: Option<String>,
    /// Failed dials by reason since the server started.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub dial_errors: std::collections::BTreeMap<String, u64>,
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The trust this cluster holds (`sha256:<hex>` of each agent CA key
    /// and token key it trusts, and of `issuer <its token issuer>`),
    /// written while it is served and kept while it is refused. Another
    /// TunnelCluster claiming one of these is refused, whatever the ages,
    /// on every replica and after restarts. Only seedlink writes status.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trust: Vec<String>,
    /// Claims this cluster trusted and no longer does (a revoked agent CA,
    /// a removed token key), still reserved to it until `until`: agents
    /// that still present the old certificate cannot be taken by another
    /// cluster that starts to trust it. Held like `trust`; at most
    /// [`RELEASED_MAX`] entries, the earliest to end dropped first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub released: Vec<ReleasedClaim>,
}

/// The most released claims a TunnelCluster's status keeps.
pub const RELEASED_MAX: usize = 32;

/// A claim a TunnelCluster no longer trusts, reserved to it for a while.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleasedClaim {
    /// `sha256:<hex>`, as in `trust`.
    pub claim: String,
    /// When the reservation ends (RFC 3339).
    pub until: String,
}

/// One hosted control plane as seedlink carries it: where its
/// kube-apiserver is, who may reach it, and how its nodes' agents connect.
/// Everything it generates lives in its own namespace and is owned by it.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "seedlink.dev",
    version = "v1alpha1",
    kind = "SeedlinkControlPlane",
    plural = "seedlinkcontrolplanes",
    shortname = "slcp",
    namespaced,
    status = "ControlPlaneStatus",
    category = "seedlink",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Agents","type":"integer","jsonPath":".status.agents"}"#,
    printcolumn = r#"{"name":"Certificates expire","type":"date","jsonPath":".status.certificatesNotAfter"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SeedlinkControlPlaneSpec {
    /// The control plane's kube-apiserver.
    pub api_server: ApiServer,
    /// Client CIDRs allowed to reach the kube-apiserver through the
    /// gateway (a bare address means /32 or /128); absent means every
    /// client.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "allowedSourceCIDRs"
    )]
    #[schemars(length(max = 256), inner(length(max = 64)))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.all(c, isCIDR(c) || isIP(c))",
        "message": "each entry must be a CIDR (10.0.0.0/8) or an IP address"
    }]))]
    pub allowed_source_cidrs: Option<Vec<String>>,
    /// The reverse tunnel for kube-apiserver's egress (to nodes, pods and
    /// services); absent means on, agents identified by a client
    /// certificate seedlink issues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<TunnelSpec>,
    /// The nodes' path to this kube-apiserver through the gateway's
    /// `http-connect` and `proxy` listeners (GEP-08, GEP-30, HyperShift).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeAccess>,
}

/// Where the kube-apiserver is and the names clients ask for.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiServer {
    /// The kube-apiserver's Service, in this namespace.
    #[schemars(regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), length(max = 63))]
    pub service: String,
    /// Its port (default 443).
    #[serde(default = "https_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// The host names clients reach it by through the gateway (TLS SNI),
    /// external and internal alike.
    #[schemars(length(min = 1, max = 16), inner(length(max = 253)))]
    pub hostnames: Vec<String>,
}

fn https_port() -> u16 {
    443
}

/// The tunnel: on or off, and how agents prove whose they are.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelSpec {
    /// Whether kube-apiserver's egress goes through the tunnel (default
    /// true).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// ServiceAccount tokens of the shoot identify the agents instead of a
    /// client certificate seedlink issues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_token: Option<AgentToken>,
    /// Raise it to revoke the agents' credentials: a new agent CA and
    /// certificate at once, the old CA no longer trusted, so the agents
    /// still presenting its certificates are disconnected (default 0).
    #[serde(default)]
    pub revision: u64,
    /// Raise it to rotate the agent CA now, with overlap: the old CA stays
    /// trusted for one certificate validity and the agents get a
    /// certificate from the new one in the next pass (default 0).
    #[serde(default)]
    pub rotation: u64,
    /// Services of this namespace in the seed that kube-apiserver reaches
    /// through its `cluster` egress (webhooks and aggregated APIs beside
    /// the control plane), dialled by the tunnel-server itself: the
    /// TunnelCluster's `seedServices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub seed_services: Vec<SeedServiceSpec>,
}

fn yes() -> bool {
    true
}

/// The nodes' path to their kube-apiserver through the gateway.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeAccess {
    /// Names node proxies send with HTTP CONNECT (GEP-30's
    /// `X-Gardener-Destination`, Istio's `outbound|443||…`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub destinations: Vec<String>,
    /// In-cluster service addresses (`ip:port`) GEP-08 node proxies put in
    /// their PROXY header.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub service_addresses: Vec<String>,
    /// The hosted cluster's ID (HyperShift's `HostedCluster.spec.clusterID`),
    /// sent by node proxies in a PROXY v2 TLV.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "clusterID")]
    pub cluster_id: Option<String>,
}

/// What the controller made and whether it works.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneStatus {
    /// `Ready`, and one per piece: `Generated` (the objects written),
    /// `RouteAccepted` (the TLSRoute's status), `TunnelReady` (the
    /// TunnelCluster's), `CertificatesReady`.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Agent streams connected (from the TunnelCluster's status).
    #[serde(default)]
    pub agents: u64,
    /// When the first of the issued certificates expires (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificates_not_after: Option<String>,
    /// The objects generated, `Kind/name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generated: Vec<String>,
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The CRDs as shipped: generated from the types, with integer formats
/// as Kubernetes knows them (`int64`; schemars writes `uint64`, which no
/// Kubernetes client understands, and these values fit).
pub fn crds(
) -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    fn formats(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                if m.get("format").and_then(|f| f.as_str()) == Some("uint64") {
                    m.insert("format".into(), "int64".into());
                }
                m.values_mut().for_each(formats);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(formats),
            _ => {}
        }
    }
    [
        SeedlinkPolicy::crd(),
        TunnelCluster::crd(),
        SeedlinkControlPlane::crd(),
    ]
    .into_iter()
    .map(|crd| {
        let mut v = serde_json::to_value(&crd).unwrap_or_default();
        formats(&mut v);
        serde_json::from_value(v).unwrap_or(crd)
    })
    .collect()
}

/// The CRDs as one multi-document YAML, as shipped in `deploy/crds/`.
pub fn crds_yaml() -> Result<String, serde_norway::Error> {
    let mut out =
        String::from("# Generated by `seedlink crds` from crates/kube/src/crd.rs; do not edit.\n");
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(&crd)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_yaml_reads_back_as_the_same_crds() {
        let text = crds_yaml().unwrap();
        let docs: Vec<serde_json::Value> = text
            .split("\n---\n")
            .skip(1)
            .map(|d| serde_norway::from_str(d).unwrap())
            .collect();
        let crds = crds();
        assert_eq!(docs.len(), crds.len());
        for (doc, crd) in docs.iter().zip(&crds) {
            assert_eq!(doc, &serde_json::to_value(crd).unwrap());
        }
    }
}
