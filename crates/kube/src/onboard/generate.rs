//! What one `SeedlinkControlPlane` becomes: the objects the controller
//! writes into its namespace, each owned by it. A pure function of the
//! object, the install's settings and the agent CA, so that what is
//! generated is tested without an API server.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use k8s_openapi::jiff::Timestamp;

use super::certs::Issued;
use super::rotation::CaState;

use crate::crd::SeedlinkControlPlane;
use crate::translate::Key;

/// The longest name a control plane may have (a label value's limit).
pub const MAX_NAME: usize = 63;

/// The label every generated object carries: the control plane it is for.
pub const CONTROL_PLANE_LABEL: &str = "seedlink.dev/control-plane";
/// The label that lets the tunnel-server read a Secret (docs/KUBERNETES.md).
pub const TRUST_LABEL: &str = "seedlink.dev/tunnel-trust";
/// The key of a CA certificate in a Secret.
pub const CA_KEY: &str = "ca.crt";

/// What the install tells the controller.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The Gateway routes attach to (`kubernetes.gateway` of the gateway's
    /// file).
    pub gateway: Key,
    /// The TLSRoute version the API server serves (`v1`, or `v1alpha2`
    /// on Gateway API before v1.5).
    pub route_version: String,
    /// The tunnel-server's ServiceAccount, which reads the trust Secrets.
    pub tunnel_reader: Key,
    /// The ClusterRole that lets it (bound per control plane whose
    /// TunnelCluster names a Secret).
    pub trust_role: String,
    /// The ClusterRole that lets it read ConfigMaps only (bound where the
    /// TunnelCluster names none: the tunnel-server then cannot read the
    /// namespace's Secrets).
    pub trust_role_config_maps: String,
}

/// One generated object, as applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: &'static str,
    /// The resource's plural (its URL path).
    pub plural: &'static str,
    /// `metadata.name` (in the control plane's namespace).
    pub name: String,
    /// The whole object.
    pub object: Value,
}

impl Generated {
    /// `Kind/name`, as status lists it.
    pub fn id(&self) -> String {
        format!("{}/{}", self.kind, self.name)
    }
}

/// Why a control plane cannot be generated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Refusal {
    /// A condition reason (CamelCase).
    pub reason: &'static str,
    /// For people.
    pub message: String,
}

/// The names of what a control plane `cp` generates.
pub struct Names {
    /// The TLSRoute, the SeedlinkPolicy and the TunnelCluster.
    pub route: String,
    /// The Secret with the agent CA's certificate and key (not labelled
    /// for the tunnel-server).
    pub agent_ca: String,
    /// The Secret with only the agent CA's certificate, labelled for the
    /// tunnel-server to read.
    pub trust: String,
    /// The agent's client certificate and key.
    pub agent: String,
    /// The RoleBinding that lets the tunnel-server read the trust Secret.
    pub trust_binding: String,
    /// kube-apiserver's egress selector file and flags (a ConfigMap).
    pub kube_apiserver: String,
    /// The shoot's side: the agent's files and credentials (a Secret).
    pub shoot: String,
    /// kube-apiserver's client certificate for the shared frontend, and
    /// the tunnel-server's CA (a Secret).
    pub kube_apiserver_tunnel: String,
    /// The shoot's side as manifests (a Secret whose every key is a
    /// manifest file: what a Gardener `ManagedResource` references).
    pub shoot_manifests: String,
}

impl Names {
    /// The names for the control plane called `cp`.
    pub fn of(cp: &str) -> Names {
        Names {
            route: cp.to_string(),
            agent_ca: format!("{cp}-agent-ca"),
            trust: format!("{cp}-agent-trust"),
            agent: format!("{cp}-agent"),
            trust_binding: format!("{cp}-seedlink-tunnel-trust"),
            kube_apiserver: format!("{cp}-kube-apiserver-egress"),
            shoot: format!("{cp}-shoot"),
            kube_apiserver_tunnel: format!("{cp}-kube-apiserver-tunnel"),
            shoot_manifests: format!("{cp}-shoot-manifests"),
        }
    }
}

/// The owner reference every generated object carries: deleting the
/// control plane deletes it (the garbage collector), and the controller
/// touches no object of the same name without it.
pub fn owner_reference(cp: &SeedlinkControlPlane) -> Result<Value, Refusal> {
    let uid = cp.metadata.uid.as_deref().ok_or_else(|| Refusal {
        reason: "NoUID",
        message: "the object has no metadata.uid yet".into(),
    })?;
    Ok(json!({
        "apiVersion": "seedlink.dev/v1alpha1",
        "kind": "SeedlinkControlPlane",
        "name": cp.metadata.name,
        "uid": uid,
        "controller": true,
        "blockOwnerDeletion": true
    }))
}

/// Whether `object`'s owner references name the control plane `uid` as
/// its controller.
pub fn owned_by(object: &Value, uid: &str) -> bool {
    object["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| {
            refs.iter()
                .any(|r| r["uid"] == uid && r["controller"] == true)
        })
}

/// The objects `cp` generates, in the order they are applied (what a
/// later one refers to comes first): the trust Secret and its
/// RoleBinding, the TunnelCluster, the TLSRoute and its SeedlinkPolicy.
/// `agent_ca_pem` is the agent CA's certificate (PEM).
pub fn objects(
    cp: &SeedlinkControlPlane,
    settings: &Settings,
    agent_ca_pem: &str,
) -> Result<Vec<Generated>, Refusal> {
    let b = Builder::of(cp)?;
    let mut out = Vec::new();
    let tunnel = cp.spec.tunnel.clone().unwrap_or(crate::crd::TunnelSpec {
        enabled: true,
        agent_token: None,
        revision: 0,
        rotation: 0,
        seed_services: Vec::new(),
    });
    if tunnel.enabled {
        out.extend(b.tunnel(&tunnel, settings, agent_ca_pem));
    }
    out.push(b.route(cp, settings));
    if let Some(policy) = policy_spec(cp, &b.names.route) {
        out.push(b.object(
            "policy.seedlink.dev/v1alpha1",
            "SeedlinkPolicy",
            &b.names.route,
            json!({}),
            json!({"spec": policy}),
        ));
    }
    Ok(out)
}

/// What every generated object of one control plane shares: its
/// namespace, labels and owner.
struct Builder {
    cp: String,
    ns: String,
    owner: Value,
    names: Names,
}

impl Builder {
    fn of(cp: &SeedlinkControlPlane) -> Result<Builder, Refusal> {
        let name = cp.metadata.name.clone().unwrap_or_default();
        // It is a label's value on everything generated.
        if name.len() > MAX_NAME {
            return Err(Refusal {
                reason: "NameTooLong",
                message: format!("the name has {} characters; at most {MAX_NAME} (it labels every generated object)", name.len()),
            });
        }
        Ok(Builder {
            owner: owner_reference(cp)?,
            ns: cp.metadata.namespace.clone().unwrap_or_default(),
            names: Names::of(&name),
            cp: name,
        })
    }

    /// The object `kind/name` with `body` (its fields besides `metadata`)
    /// and the extra `labels`.
    fn object(
        &self,
        api_version: &str,
        kind: &'static str,
        name: &str,
        labels: Value,
        body: Value,
    ) -> Generated {
        let mut all =
            json!({CONTROL_PLANE_LABEL: self.cp, "app.kubernetes.io/managed-by": "seedlink"});
        if let (Some(l), Some(e)) = (all.as_object_mut(), labels.as_object()) {
            l.extend(e.clone());
        }
        let mut object = json!({
            "apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": self.ns, "labels": all,
                         "ownerReferences": [self.owner]}
        });
        if let (Some(o), Some(b)) = (object.as_object_mut(), body.as_object()) {
            o.extend(b.clone());
        }
        Generated {
            api_version: api_version.to_string(),
            kind,
            plural: plural(kind),
            name: name.to_string(),
            object,
        }
    }

    /// The trust ConfigMap (a CA certificate is no secret), the
    /// RoleBinding that lets the tunnel-server read it (ConfigMaps only,
    /// unless the TunnelCluster names a Secret), and the TunnelCluster
    /// trusting it (or the agents' tokens).
    fn tunnel(
        &self,
        tunnel: &crate::crd::TunnelSpec,
        settings: &Settings,
        ca_pem: &str,
    ) -> Vec<Generated> {
        let n = &self.names;
        let trust = self.object(
            "v1",
            "ConfigMap",
            &n.trust,
            json!({TRUST_LABEL: "true"}),
            json!({"data": {CA_KEY: ca_pem}}),
        );
        let mut spec = match &tunnel.agent_token {
            Some(token) => json!({"agentToken": token}),
            None => json!({"agentCA": {"configMap": n.trust, "key": CA_KEY}}),
        };
        if !tunnel.seed_services.is_empty() {
            spec["seedServices"] = json!(tunnel.seed_services);
        }
        let role = trust_role_for(&spec, settings);
        let binding = self.object(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            &n.trust_binding,
            json!({}),
            json!({
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": settings.tunnel_reader.name,
                              "namespace": settings.tunnel_reader.namespace}]
            }),
        );
        let cluster = self.object(
            "tunnel.seedlink.dev/v1alpha1",
            "TunnelCluster",
            &n.route,
            json!({}),
            json!({"spec": spec}),
        );
        vec![trust, binding, cluster]
    }

    /// The TLSRoute: the host names to the kube-apiserver's Service,
    /// attached to the install's Gateway.
    fn route(&self, cp: &SeedlinkControlPlane, settings: &Settings) -> Generated {
        let api = &cp.spec.api_server;
        let route_api = format!("gateway.networking.k8s.io/{}", settings.route_version);
        self.object(&route_api, "TLSRoute", &self.names.route, json!({}), json!({
            "spec": {
                "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                "namespace": settings.gateway.namespace, "name": settings.gateway.name}],
                "hostnames": api.hostnames,
                "rules": [{"backendRefs": [{"name": api.service, "port": api.port}]}]
            }
        }))
    }
}

/// The ClusterRole the tunnel-server is bound to for a TunnelCluster of
/// `spec`: ConfigMaps only, unless it names a Secret.
fn trust_role_for<'s>(spec: &Value, settings: &'s Settings) -> &'s str {
    let names_secret = serde_json::from_value::<crate::crd::TunnelClusterSpec>(spec.clone())
        .map_or(true, |s| crate::tunnel::references(&s).0);
    if names_secret {
        &settings.trust_role
    } else {
        &settings.trust_role_config_maps
    }
}

/// What the `tunnel-config` renderer made for one control plane's tunnel
/// cluster: kube-apiserver's files and the shoot's, by file name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bundle {
    /// `egress-selector-configuration.yaml`, `kube-apiserver.args`.
    pub kube_apiserver: BTreeMap<String, String>,
    /// `agent.yaml`, `shoot-config.yaml`, the agents' arguments, the
    /// server's CA (`tunnel-ca.crt`).
    pub shoot: BTreeMap<String, String>,
}

/// The ConfigMap kube-apiserver mounts (its egress selector file and
/// flags) and the Secret the shoot's agent mounts (its files, its client
/// certificate `agent.crt` and key `agent.key`), both owned by `cp`.
pub fn bundle_objects(
    cp: &SeedlinkControlPlane,
    bundle: &Bundle,
    agent: &Issued,
) -> Result<Vec<Generated>, Refusal> {
    let b = Builder::of(cp)?;
    let kas = b.object(
        "v1",
        "ConfigMap",
        &b.names.kube_apiserver,
        json!({}),
        json!({"data": bundle.kube_apiserver}),
    );
    let mut files = bundle.shoot.clone();
    files.insert("agent.crt".into(), agent.cert_pem.clone());
    files.insert("agent.key".into(), agent.key_pem.clone());
    let shoot = b.object(
        "v1",
        "Secret",
        &b.names.shoot,
        json!({}),
        json!({"type": "Opaque", "data": secret_data(&json!(files))}),
    );
    Ok(vec![kas, shoot])
}

/// The agent CA's Secret `name` of `cp`: the CA that signs (`ca.crt`,
/// `ca.key`), the one it replaced while still trusted (`previous.crt`),
/// and in annotations its `notAfter`, until when the previous one is
/// trusted, and the `spec.tunnel.revision` it was made for.
pub fn ca_secret(
    cp: &SeedlinkControlPlane,
    name: &str,
    ca: &CaState,
) -> Result<Generated, Refusal> {
    let b = Builder::of(cp)?;
    // `previous.crt` and its end are written empty when there is none,
    // never left out: a key an apply leaves out may stay in the stored
    // Secret (kubernetes/kubernetes#108008) and come back as a previous CA.
    let (previous, until) = match &ca.previous {
        Some((pem, until)) => (pem.clone(), until.to_string()),
        None => (String::new(), String::new()),
    };
    let data = json!({CA_KEY: ca.current.cert_pem, "ca.key": ca.current.key_pem, "previous.crt": previous});
    let notes = json!({NOT_AFTER: ca.current.not_after.to_string(), REVISION: ca.revision.to_string(),
                       ROTATION: ca.rotation.to_string(),
                       PREVIOUS_UNTIL: until});
    let mut g = b.object(
        "v1",
        "Secret",
        name,
        json!({}),
        json!({"type": "Opaque", "data": secret_data(&data)}),
    );
    g.object["metadata"]["annotations"] = notes;
    Ok(g)
}

/// The agents' certificate Secret `name` of `cp` (`kubernetes.io/tls`),
/// with the CA that signed it (`ca.crt`) and its `notAfter`.
pub fn leaf_secret(
    cp: &SeedlinkControlPlane,
    name: &str,
    leaf: &Issued,
    signed_by: &str,
) -> Result<Generated, Refusal> {
    let data = json!({"tls.crt": leaf.cert_pem, "tls.key": leaf.key_pem, CA_KEY: signed_by});
    cert_secret(cp, name, "kubernetes.io/tls", &data, leaf.not_after)
}

/// A certificate's Secret `name` of `cp`: `data` (text), and its
/// `notAfter` in an annotation.
fn cert_secret(
    cp: &SeedlinkControlPlane,
    name: &str,
    type_: &str,
    data: &Value,
    not_after: Timestamp,
) -> Result<Generated, Refusal> {
    let b = Builder::of(cp)?;
    let mut g = b.object(
        "v1",
        "Secret",
        name,
        json!({}),
        json!({"type": type_, "data": secret_data(data)}),
    );
    g.object["metadata"]["annotations"] = json!({NOT_AFTER: not_after.to_string()});
    Ok(g)
}

/// In the shoot, the namespace and name of the agent's Deployment and of
/// the Secret it mounts.
pub const SHOOT_AGENT: (&str, &str) = ("kube-system", "seedlink-agent");

/// The shoot's side as manifests, in Secret `<name>-shoot-manifests` of
/// `cp`. Key `seedlink-agent.yaml`: a Secret with the agent's files and
/// credentials (`agent.yaml`, `agent.crt`, `agent.key`, `tunnel-ca.crt`)
/// and a Deployment of `seedlink tunnel-agent` (image `image`) mounting
/// it at `/etc/seedlink`, both [`SHOOT_AGENT`]. Key
/// `seedlink-node-proxy.yaml`, when the bundle has the node-proxy's
/// configuration: its ConfigMap and DaemonSet ([`SHOOT_NODE_PROXY`]).
/// Every key of that Secret is a manifest file, as a Gardener
/// `ManagedResource` expects of the Secrets it references; `kubectl apply
/// -f` takes each file as it is.
pub fn shoot_manifests(
    cp: &SeedlinkControlPlane,
    bundle: &Bundle,
    agent: &Issued,
    image: &str,
) -> Result<Generated, Refusal> {
    let b = Builder::of(cp)?;
    let (ns, name) = SHOOT_AGENT;
    let mut files = BTreeMap::new();
    for key in ["agent.yaml", "tunnel-ca.crt"] {
        if let Some(v) = bundle.shoot.get(key) {
            files.insert(key.to_string(), v.clone());
        }
    }
    files.insert("agent.crt".into(), agent.cert_pem.clone());
    files.insert("agent.key".into(), agent.key_pem.clone());
    let labels = json!({"app.kubernetes.io/name": name});
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "type": "Opaque", "data": secret_data(&json!(files)),
    });
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": agent_pod(image, name)},
        },
    });
    let mut data = json!({"seedlink-agent.yaml": manifests(&[secret, deployment])?});
    if let Some(np) = bundle.shoot.get("node-proxy.yaml") {
        data["seedlink-node-proxy.yaml"] = json!(manifests(&node_proxy(np, image)?)?);
    }
    Ok(b.object(
        "v1",
        "Secret",
        &b.names.shoot_manifests,
        json!({}),
        json!({"type": "Opaque", "data": secret_data(&data)}),
    ))
}

/// Objects as one multi-document YAML file.
fn manifests(objects: &[Value]) -> Result<String, Refusal> {
    Ok(objects
        .iter()
        .map(serde_norway::to_string)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Refusal {
            reason: "RenderFailed",
            message: format!("the shoot's manifests: {e}"),
        })?
        .join("---\n"))
}

/// In the shoot, the namespace and name of the node-proxy's DaemonSet and
/// of the ConfigMap it reads (not the shoot chart's `seedlink-node-proxy`,
/// so the two never take each other's objects).
pub const SHOOT_NODE_PROXY: (&str, &str) = ("kube-system", "seedlink-apiserver-proxy");

/// The node-proxy (GEP-08) on every node of the shoot: its configuration
/// `config` (rendered, no credentials: the client's TLS runs end to end
/// inside the tunnel) in a ConfigMap, and a DaemonSet of
/// `seedlink node-proxy` on the node's network, root with NET_ADMIN (its
/// address's link) and NET_BIND_SERVICE (port 443) only, probed on its
/// loopback admin port.
fn node_proxy(config: &str, image: &str) -> Result<[Value; 2], Refusal> {
    let (ns, name) = SHOOT_NODE_PROXY;
    let parsed: Value = serde_norway::from_str(config).map_err(|e| Refusal {
        reason: "RenderFailed",
        message: format!("the node-proxy's configuration: {e}"),
    })?;
    let (admin, metrics) = (
        listen_port(&parsed, "admin")?,
        listen_port(&parsed, "metrics")?,
    );
    let labels = json!({"app.kubernetes.io/name": name});
    let config_map = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "data": {"node-proxy.yaml": config},
    });
    let daemon_set = json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": {"labels": labels}, "spec": node_proxy_pod(image, name, admin, metrics)},
        },
    });
    Ok([config_map, daemon_set])
}

/// The port of the node-proxy's listen address `key` in its parsed file.
fn listen_port(parsed: &Value, key: &str) -> Result<u16, Refusal> {
    parsed[key]
        .as_str()
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| Refusal {
            reason: "RenderFailed",
            message: format!("the node-proxy's configuration has no {key} port"),
        })
}

/// The node-proxy's pod: on the node's network, root with NET_ADMIN and
/// NET_BIND_SERVICE only, its file from ConfigMap `config`, probed on
/// its loopback `admin` port, `/metrics` on `metrics`.
fn node_proxy_pod(image: &str, config: &str, admin: u16, metrics: u16) -> Value {
    let probe = |path: &str, period: u32| json!({"httpGet": {"host": "127.0.0.1", "path": path, "port": admin}, "periodSeconds": period});
    json!({
        "hostNetwork": true,
        "priorityClassName": "system-node-critical",
        "automountServiceAccountToken": false,
        "tolerations": [{"operator": "Exists"}],
        "terminationGracePeriodSeconds": 40,
        "containers": [{
            "name": "node-proxy",
            "image": image,
            "args": ["node-proxy", "--config", "/etc/seedlink/node-proxy.yaml"],
            "ports": [{"name": "metrics", "containerPort": metrics}],
            "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": false,
                                "readOnlyRootFilesystem": true,
                                "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
            "readinessProbe": probe("/readyz", 5),
            "livenessProbe": probe("/healthz", 10),
            "resources": {"requests": {"cpu": "20m", "memory": "16Mi"}},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/seedlink", "readOnly": true}],
        }],
        "volumes": [{"name": "config", "configMap": {"name": config}}],
    })
}

/// The agent's pod: non-root, read-only, its files from Secret `secret`,
/// its ID from the pod's name, probed on its admin port. It reads a
/// renewed certificate from the Secret volume without a restart.
fn agent_pod(image: &str, secret: &str) -> Value {
    json!({
        "automountServiceAccountToken": false,
        "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "tunnel-agent",
            "image": image,
            "args": ["tunnel-agent", "--config", "/etc/seedlink/agent.yaml"],
            "env": [{"name": "PROXY_AGENT_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "ports": [{"name": "admin", "containerPort": 8093}],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"}, "periodSeconds": 5},
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": "admin"}, "periodSeconds": 10},
            "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                "capabilities": {"drop": ["ALL"]}},
            "resources": {"requests": {"cpu": "20m", "memory": "16Mi"}},
            "volumeMounts": [{"name": "agent", "mountPath": "/etc/seedlink", "readOnly": true}],
        }],
        "volumes": [{"name": "agent", "secret": {"secretName": secret}}],
    })
}

/// kube-apiserver's Secret `name` of `cp` for the shared frontend, at the
/// paths the rendered egress file names (`/etc/kubernetes/tunnel`): the
/// tunnel-server's CA (`ca.crt`), its client certificate and key
/// (`client.crt`, `client.key`), and the CA that signed it
/// (`issuer.crt`, so that a new one is seen), with its `notAfter`.
pub fn kube_apiserver_tunnel_secret(
    cp: &SeedlinkControlPlane,
    name: &str,
    client: &Issued,
    server_ca: &str,
    issuer: &str,
) -> Result<Generated, Refusal> {
    let data = json!({CA_KEY: server_ca, "client.crt": client.cert_pem, "client.key": client.key_pem,
                      "issuer.crt": issuer});
    cert_secret(cp, name, "Opaque", &data, client.not_after)
}

/// The client certificate a kube-apiserver Secret holds, and its issuer.
pub fn kube_apiserver_client_from(v: &Value) -> (Issued, String) {
    let client = Issued {
        cert_pem: secret_text(v, "client.crt"),
        key_pem: secret_text(v, "client.key"),
        not_after: annotated_time(v, NOT_AFTER),
    };
    (client, secret_text(v, "issuer.crt"))
}

/// A Secret's `data` from text values: base64, as `ByteString` writes it.
/// Generated Secrets are written as `data`, not `stringData`: what a
/// server-side apply leaves out of `stringData` is not removed from `data`
/// (kubernetes/kubernetes#108008).
fn secret_data(text: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for (k, v) in text.as_object().into_iter().flatten() {
        let bytes = k8s_openapi::ByteString(v.as_str().unwrap_or_default().as_bytes().to_vec());
        out.insert(k.clone(), serde_json::to_value(bytes).unwrap_or_default());
    }
    Value::Object(out)
}

/// A Secret's `data` value (base64, as `ByteString` reads it) as text;
/// empty when absent or unreadable.
fn secret_text(v: &Value, key: &str) -> String {
    serde_json::from_value::<k8s_openapi::ByteString>(v["data"][key].clone())
        .ok()
        .and_then(|b| String::from_utf8(b.0).ok())
        .unwrap_or_default()
}

/// An annotation read as a time; the epoch (long past) when absent.
fn annotated_time(v: &Value, key: &str) -> Timestamp {
    v["metadata"]["annotations"][key]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// The CA state a CA Secret (as the API returns it) holds.
pub fn ca_state_from(v: &Value) -> CaState {
    let previous = secret_text(v, "previous.crt");
    CaState {
        current: Issued {
            cert_pem: secret_text(v, CA_KEY),
            key_pem: secret_text(v, "ca.key"),
            not_after: annotated_time(v, NOT_AFTER),
        },
        previous: (!previous.is_empty()).then(|| (previous, annotated_time(v, PREVIOUS_UNTIL))),
        revision: annotated_number(v, REVISION),
        rotation: annotated_number(v, ROTATION),
    }
}

/// A number in an annotation (0 when absent or not a number).
fn annotated_number(v: &Value, key: &str) -> u64 {
    v["metadata"]["annotations"][key]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// The agents' certificate a leaf Secret holds, and the CA that signed it.
pub fn leaf_from(v: &Value) -> (Issued, String) {
    let leaf = Issued {
        cert_pem: secret_text(v, "tls.crt"),
        key_pem: secret_text(v, "tls.key"),
        not_after: annotated_time(v, NOT_AFTER),
    };
    (leaf, secret_text(v, CA_KEY))
}

/// The annotation saying until when a CA Secret's previous CA is trusted.
pub const PREVIOUS_UNTIL: &str = "seedlink.dev/previous-until";
/// The annotation with the `spec.tunnel.revision` a CA was made for.
pub const REVISION: &str = "seedlink.dev/revision";
/// The annotation with the `spec.tunnel.rotation` a CA was made for.
pub const ROTATION: &str = "seedlink.dev/rotation";

/// The annotation with a certificate Secret's `notAfter` (RFC 3339).
pub const NOT_AFTER: &str = "seedlink.dev/not-after";

/// The plural of a kind the controller writes.
pub fn plural(kind: &str) -> &'static str {
    match kind {
        "Secret" => "secrets",
        "ConfigMap" => "configmaps",
        "RoleBinding" => "rolebindings",
        "TunnelCluster" => "tunnelclusters",
        "TLSRoute" => "tlsroutes",
        "SeedlinkPolicy" => "seedlinkpolicies",
        _ => "",
    }
}

/// The SeedlinkPolicy's spec, when the control plane says anything a
/// TLSRoute cannot (an ACL, node paths).
fn policy_spec(cp: &SeedlinkControlPlane, route: &str) -> Option<Value> {
    let nodes = cp.spec.nodes.clone().unwrap_or_default();
    let acl = cp.spec.allowed_source_cidrs.clone();
    if acl.is_none()
        && nodes.destinations.is_empty()
        && nodes.service_addresses.is_empty()
        && nodes.cluster_id.is_none()
    {
        return None;
    }
    let mut spec = json!({
        "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "name": route}]
    });
    let fields = [
        ("allowedSourceCIDRs", acl.map(|a| json!(a))),
        (
            "destinations",
            (!nodes.destinations.is_empty()).then(|| json!(nodes.destinations)),
        ),
        (
            "serviceAddresses",
            (!nodes.service_addresses.is_empty()).then(|| json!(nodes.service_addresses)),
        ),
        ("clusterID", nodes.cluster_id.map(|c| json!(c))),
    ];
    for (k, v) in fields {
        if let (Some(v), Some(m)) = (v, spec.as_object_mut()) {
            m.insert(k.into(), v);
        }
    }
    Some(spec)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn settings() -> Settings {
        Settings {
            gateway: Key {
                namespace: "seedlink-system".into(),
                name: "seedlink".into(),
            },
            route_version: "v1".into(),
            tunnel_reader: Key {
                namespace: "seedlink-system".into(),
                name: "seedlink".into(),
            },
            trust_role: "seedlink-tunnel-trust".into(),
            trust_role_config_maps: "seedlink-tunnel-trust-configmaps".into(),
        }
    }

    fn cp(spec: Value) -> SeedlinkControlPlane {
        serde_json::from_value(json!({
            "apiVersion": "seedlink.dev/v1alpha1", "kind": "SeedlinkControlPlane",
            "metadata": {"name": "kas", "namespace": "shoot--a", "uid": "u-1"},
            "spec": spec
        }))
        .unwrap()
    }

    fn minimal() -> Value {
        json!({"apiServer": {"service": "kube-apiserver", "hostnames": ["api.a.example"]}})
    }

    fn find<'a>(out: &'a [Generated], kind: &str) -> &'a Value {
        &out.iter().find(|g| g.kind == kind).unwrap().object
    }

    #[test]
    fn one_object_becomes_its_trust_tunnel_and_route_each_owned_by_it() {
        let out = objects(&cp(minimal()), &settings(), "CA PEM").unwrap();
        let ids: Vec<String> = out.iter().map(Generated::id).collect();
        assert_eq!(
            ids,
            [
                "ConfigMap/kas-agent-trust",
                "RoleBinding/kas-seedlink-tunnel-trust",
                "TunnelCluster/kas",
                "TLSRoute/kas"
            ]
        );
        for g in &out {
            assert!(owned_by(&g.object, "u-1"), "{}", g.id());
            assert!(!owned_by(&g.object, "u-2"));
            assert_eq!(g.object["metadata"]["namespace"], "shoot--a");
            assert_eq!(g.object["metadata"]["labels"][CONTROL_PLANE_LABEL], "kas");
            assert!(!g.plural.is_empty());
        }
        let trust = find(&out, "ConfigMap");
        assert_eq!(trust["metadata"]["labels"][TRUST_LABEL], "true");
        assert_eq!(trust["data"], json!({CA_KEY: "CA PEM"}));
        let tc = find(&out, "TunnelCluster");
        assert_eq!(
            tc["spec"]["agentCA"],
            json!({"configMap": "kas-agent-trust", "key": "ca.crt"})
        );
        // It names no Secret: the tunnel-server is granted ConfigMaps only.
        let rb = find(&out, "RoleBinding");
        assert_eq!(rb["roleRef"]["name"], "seedlink-tunnel-trust-configmaps");
        assert_eq!(rb["subjects"][0]["namespace"], "seedlink-system");
        let route = find(&out, "TLSRoute");
        assert_eq!(route["apiVersion"], "gateway.networking.k8s.io/v1");
        assert_eq!(route["spec"]["hostnames"], json!(["api.a.example"]));
        assert_eq!(
            route["spec"]["rules"][0]["backendRefs"][0],
            json!({"name": "kube-apiserver", "port": 443})
        );
        assert_eq!(route["spec"]["parentRefs"][0]["name"], "seedlink");
    }

    /// The control plane's seed Services pass to its TunnelCluster (its own
    /// namespace's, as the TunnelCluster's always are).
    #[test]
    fn seed_services_pass_to_the_tunnel_cluster() {
        let mut spec = minimal();
        spec["tunnel"] = json!({"seedServices": [{"name": "hooks", "ports": [443]}]});
        let out = objects(&cp(spec), &settings(), "CA PEM").unwrap();
        let tc = find(&out, "TunnelCluster");
        assert_eq!(
            tc["spec"]["seedServices"],
            json!([{"name": "hooks", "ports": [443]}])
        );
        let none = objects(&cp(minimal()), &settings(), "CA PEM").unwrap();
        assert!(find(&none, "TunnelCluster")["spec"]
            .get("seedServices")
            .is_none());
    }

    #[test]
    fn an_acl_and_node_paths_make_a_policy_and_a_tunnel_can_be_off() {
        let mut spec = minimal();
        spec["allowedSourceCIDRs"] = json!(["10.0.0.0/8"]);
        spec["nodes"] = json!({"destinations": ["kas.shoot--a"], "clusterID": "c-1"});
        spec["tunnel"] = json!({"enabled": false});
        let out = objects(&cp(spec), &settings(), "CA PEM").unwrap();
        let kinds: Vec<&str> = out.iter().map(|g| g.kind).collect();
        assert_eq!(kinds, ["TLSRoute", "SeedlinkPolicy"]);
        let p = find(&out, "SeedlinkPolicy");
        assert_eq!(p["spec"]["targetRefs"][0]["name"], "kas");
        assert_eq!(p["spec"]["allowedSourceCIDRs"], json!(["10.0.0.0/8"]));
        assert_eq!(p["spec"]["destinations"], json!(["kas.shoot--a"]));
        assert_eq!(p["spec"]["clusterID"], "c-1");
        assert!(p["spec"].get("serviceAddresses").is_none());
    }

    #[test]
    fn agents_by_token_trust_the_tokens_of_the_objects_own_namespace() {
        let mut spec = minimal();
        spec["tunnel"] = json!({"agentToken": {"issuer": "https://shoot", "keys": {"secret": "sa-keys", "key": "sa.pub"}}});
        let out = objects(&cp(spec), &settings(), "CA PEM").unwrap();
        let tc = find(&out, "TunnelCluster");
        assert!(tc["spec"].get("agentCA").is_none());
        assert_eq!(tc["spec"]["agentToken"]["keys"]["secret"], "sa-keys");
        assert_eq!(tc["metadata"]["namespace"], "shoot--a");
        // It names a Secret: the tunnel-server needs the Secrets grant.
        let rb = find(&out, "RoleBinding");
        assert_eq!(rb["roleRef"]["name"], "seedlink-tunnel-trust");
    }

    /// Whatever the spec says, nothing generated lands in or names another
    /// namespace than the object's, but for the install's Gateway and
    /// ServiceAccount: the spec has no field that could.
    #[test]
    fn nothing_generated_names_another_namespace() {
        let mut spec = minimal();
        spec["allowedSourceCIDRs"] = json!(["10.0.0.0/8"]);
        let out = objects(&cp(spec), &settings(), "CA PEM").unwrap();
        fn namespaces(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(ns)) = m.get("namespace") {
                        out.push(ns.clone());
                    }
                    m.values().for_each(|v| namespaces(v, out));
                }
                Value::Array(a) => a.iter().for_each(|v| namespaces(v, out)),
                _ => {}
            }
        }
        for g in &out {
            let mut nss = Vec::new();
            namespaces(&g.object, &mut nss);
            for ns in nss {
                assert!(
                    ns == "shoot--a" || ns == "seedlink-system",
                    "{}: {ns}",
                    g.id()
                );
            }
        }
        // A field naming a namespace is not part of the schema.
        let mut bad = minimal();
        bad["apiServer"]["namespace"] = json!("shoot--b");
        let crd =
            serde_json::to_value(<SeedlinkControlPlane as kube::CustomResourceExt>::crd()).unwrap();
        let props = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["apiServer"]["properties"];
        assert!(props.get("namespace").is_none());
    }

    #[test]
    fn the_rendered_files_go_to_kube_apiserver_and_to_the_shoot() {
        let bundle = Bundle {
            kube_apiserver: [("kube-apiserver.args".to_string(), "--x\n".to_string())].into(),
            shoot: [("agent.yaml".to_string(), "server: s:443\n".to_string())].into(),
        };
        let agent = Issued {
            cert_pem: "CERT".into(),
            key_pem: "KEY".into(),
            not_after: k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        };
        let out = bundle_objects(&cp(minimal()), &bundle, &agent).unwrap();
        let ids: Vec<String> = out.iter().map(Generated::id).collect();
        assert_eq!(
            ids,
            ["ConfigMap/kas-kube-apiserver-egress", "Secret/kas-shoot"]
        );
        assert_eq!(out[0].object["data"]["kube-apiserver.args"], "--x\n");
        assert!(
            out[0].object.get("data").is_some() && out[0].object["data"].get("agent.key").is_none(),
            "no key material in a ConfigMap"
        );
        let shoot = &out[1].object;
        assert_eq!(secret_text(shoot, "agent.yaml"), "server: s:443\n");
        assert_eq!(
            (
                secret_text(shoot, "agent.crt"),
                secret_text(shoot, "agent.key")
            ),
            ("CERT".to_string(), "KEY".to_string())
        );
        assert!(out.iter().all(|g| owned_by(&g.object, "u-1")));
    }

    /// What is written reads back the same, and a dropped previous CA is
    /// written as empty, so that it reads back as none.
    #[test]
    fn the_ca_secret_reads_back_and_a_dropped_previous_stays_dropped() {
        let at: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let issued = |n: &str| Issued {
            cert_pem: format!("{n}\n"),
            key_pem: format!("{n} key\n"),
            not_after: at,
        };
        let state = CaState {
            current: issued("ca2"),
            previous: Some(("ca1\n".into(), at)),
            revision: 4,
            rotation: 0,
        };
        let g = ca_secret(&cp(minimal()), "kas-agent-ca", &state).unwrap();
        assert_eq!(ca_state_from(&g.object), state);
        let dropped = CaState {
            previous: None,
            ..state
        };
        let g = ca_secret(&cp(minimal()), "kas-agent-ca", &dropped).unwrap();
        assert!(
            g.object["data"].get("previous.crt").is_some(),
            "written, empty"
        );
        assert_eq!(ca_state_from(&g.object), dropped);
        let leaf = issued("leaf");
        let g = leaf_secret(&cp(minimal()), "kas-agent", &leaf, "ca2\n").unwrap();
        assert_eq!(leaf_from(&g.object), (leaf, "ca2\n".to_string()));
    }

    #[test]
    fn a_name_too_long_for_a_label_is_refused_not_retried() {
        let mut c = cp(minimal());
        c.metadata.name = Some("a".repeat(64));
        assert_eq!(
            objects(&c, &settings(), "CA").unwrap_err().reason,
            "NameTooLong"
        );
        c.metadata.name = Some("a".repeat(63));
        assert!(objects(&c, &settings(), "CA").is_ok());
    }

    #[test]
    fn an_object_without_a_uid_is_not_generated() {
        let mut c = cp(minimal());
        c.metadata.uid = None;
        assert_eq!(objects(&c, &settings(), "CA").unwrap_err().reason, "NoUID");
    }

    #[test]
    fn the_shoot_manifests_are_an_agent_secret_and_deployment_in_one_file() {
        let c = cp(minimal());
        let bundle = Bundle {
            kube_apiserver: BTreeMap::new(),
            shoot: BTreeMap::from([
                ("agent.yaml".to_string(), "server: a:1\n".to_string()),
                ("tunnel-ca.crt".to_string(), "CA\n".to_string()),
                (
                    "shoot-config.yaml".to_string(),
                    "not in the manifests\n".to_string(),
                ),
            ]),
        };
        let agent = Issued {
            cert_pem: "CERT\n".into(),
            key_pem: "KEY\n".into(),
            not_after: k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        };
        let g = shoot_manifests(&c, &bundle, &agent, "registry.example/seedlink:1").unwrap();
        assert_eq!(g.name, "kas-shoot-manifests");
        let text = secret_text(&g.object, "seedlink-agent.yaml");
        let docs: Vec<Value> = text
            .split("---\n")
            .map(|d| serde_norway::from_str(d).unwrap())
            .collect();
        assert_eq!(docs.len(), 2, "{text}");
        assert_eq!(docs[0]["kind"], "Secret");
        let files: Vec<&String> = docs[0]["data"].as_object().unwrap().keys().collect();
        assert_eq!(
            files,
            ["agent.crt", "agent.key", "agent.yaml", "tunnel-ca.crt"]
        );
        assert_eq!(secret_text(&docs[0], "agent.key"), "KEY\n");
        let pod = &docs[1]["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["image"], "registry.example/seedlink:1");
        assert_eq!(
            pod["volumes"][0]["secret"]["secretName"],
            docs[0]["metadata"]["name"]
        );
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert!(g.object["data"]["seedlink-node-proxy.yaml"].is_null());
    }

    /// With the node-proxy's configuration in the bundle, its ConfigMap
    /// and DaemonSet are a second file, probed on the admin port the
    /// configuration names.
    #[test]
    fn the_node_proxy_is_a_second_file_of_the_shoot_manifests() {
        let c = cp(minimal());
        let np = "address: 10.250.255.254\ngateway: gw:8443\nadmin: 127.0.0.1:9912\nmetrics: '[::]:16911'\n";
        let bundle = Bundle {
            kube_apiserver: BTreeMap::new(),
            shoot: BTreeMap::from([
                ("agent.yaml".to_string(), "server: a:1\n".to_string()),
                ("node-proxy.yaml".to_string(), np.to_string()),
            ]),
        };
        let agent = Issued {
            cert_pem: "CERT\n".into(),
            key_pem: "KEY\n".into(),
            not_after: k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        };
        let g = shoot_manifests(&c, &bundle, &agent, "img:1").unwrap();
        let text = secret_text(&g.object, "seedlink-node-proxy.yaml");
        let docs: Vec<Value> = text
            .split("---\n")
            .map(|d| serde_norway::from_str(d).unwrap())
            .collect();
        assert_eq!(docs[0]["kind"], "ConfigMap");
        assert_eq!(docs[0]["data"]["node-proxy.yaml"], np);
        assert_eq!(docs[1]["kind"], "DaemonSet");
        assert_eq!(docs[1]["metadata"]["name"], "seedlink-apiserver-proxy");
        let pod = &docs[1]["spec"]["template"]["spec"];
        assert_eq!(pod["hostNetwork"], true);
        let c0 = &pod["containers"][0];
        assert_eq!(c0["readinessProbe"]["httpGet"]["port"], 9912);
        assert_eq!(c0["ports"][0]["containerPort"], 16911);
        assert_eq!(
            c0["securityContext"]["capabilities"]["add"],
            json!(["NET_ADMIN", "NET_BIND_SERVICE"])
        );
        // A configuration without its ports is refused, not guessed.
        let mut bad = bundle.clone();
        bad.shoot
            .insert("node-proxy.yaml".into(), "address: x\n".into());
        assert_eq!(
            shoot_manifests(&c, &bad, &agent, "img:1")
                .unwrap_err()
                .reason,
            "RenderFailed"
        );
    }
}
