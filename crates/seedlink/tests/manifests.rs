//! The install manifests render with a real `kubectl kustomize`, and every
//! rendered object reads strictly as its Kubernetes type: read with
//! k8s-openapi (or the Gateway API types), written back, it must equal
//! what was rendered, so a misspelt or misplaced field cannot ship. The
//! configuration files inside the ConfigMaps are valid for their roles, and
//! the properties the docs promise (non-root, read-only root, probes, the
//! preStop delay, the token audience, the node proxy's capabilities, RBAC
//! for everything the source watches) are checked on the objects, and a
//! real kube-apiserver accepts every object.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `kubectl kustomize deploy/kustomize/<name>`, as JSON objects.
fn render(name: &str) -> Vec<Value> {
    let kubectl = common::require("kubectl");
    let dir = root().join("deploy/kustomize").join(name);
    let out = std::process::Command::new(kubectl)
        .arg("kustomize")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<Value> = text
        .split("\n---\n")
        .filter(|d| !d.trim().is_empty() && d.trim() != "---")
        .map(|d| serde_norway::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect();
    assert!(!docs.is_empty(), "{name} rendered nothing");
    docs
}

fn roundtrip<T: serde::de::DeserializeOwned + serde::Serialize>(v: &Value) -> Result<(), String> {
    let typed: T = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    match first_difference(v, &back, String::new()) {
        None => Ok(()),
        Some(at) => Err(format!(
            "at {at}: not what the type writes back (an unknown or misplaced field?)"
        )),
    }
}

/// Where two JSON values first differ; numbers compare by value (a schema's
/// `minimum: 0` is the float `0.0` in k8s-openapi).
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys()) {
                let (Some(p), Some(q)) = (x.get(k), y.get(k)) else {
                    return Some(format!("{at}.{k}"));
                };
                if let Some(d) = first_difference(p, q, format!("{at}.{k}")) {
                    return Some(d);
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) => {
            if x.len() != y.len() {
                return Some(format!("{at}[] (length)"));
            }
            x.iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (p, q))| first_difference(p, q, format!("{at}[{i}]")))
        }
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => None,
        _ if a == b => None,
        _ => Some(at),
    }
}

/// A Prometheus Operator ServiceMonitor, the fields used here (no Rust
/// crate of the field has its type; unknown fields are refused).
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
#[allow(non_snake_case)]
struct ServiceMonitor {
    apiVersion: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct ServiceMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    endpoints: Vec<ServiceMonitorEndpoint>,
}

#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct ServiceMonitorEndpoint {
    port: String,
    path: String,
    interval: String,
    authorization: SafeAuthorization,
}

/// The Prometheus Operator's `SafeAuthorization`: a bearer token from a
/// Secret key.
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct SafeAuthorization {
    credentials: k8s_openapi::api::core::v1::SecretKeySelector,
}

/// A Prometheus Operator PrometheusRule, the fields used here (unknown
/// fields are refused).
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
#[allow(non_snake_case)]
struct PrometheusRule {
    apiVersion: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: RuleSpec,
}

#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    alert: String,
    expr: String,
    #[serde(default, rename = "for", skip_serializing_if = "Option::is_none")]
    for_: Option<String>,
    labels: std::collections::BTreeMap<String, String>,
    annotations: std::collections::BTreeMap<String, String>,
}

/// Every object strictly as its type; the configuration files valid.
fn check_strictly(docs: &[Value]) {
    use k8s_openapi::api::{apps, core, policy, rbac};
    let mut problems = Vec::new();
    for d in docs {
        let id = format!(
            "{} {}",
            d["kind"].as_str().unwrap_or("?"),
            d["metadata"]["name"].as_str().unwrap_or("?")
        );
        let r = match (d["apiVersion"].as_str().unwrap_or(""), d["kind"].as_str().unwrap_or("")) {
            ("v1", "Namespace") => roundtrip::<core::v1::Namespace>(d),
            ("v1", "ServiceAccount") => roundtrip::<core::v1::ServiceAccount>(d),
            ("v1", "ConfigMap") => roundtrip::<core::v1::ConfigMap>(d).and_then(|()| check_configs(d)),
            ("v1", "Service") => roundtrip::<core::v1::Service>(d),
            ("apps/v1", "Deployment") => roundtrip::<apps::v1::Deployment>(d),
            ("apps/v1", "DaemonSet") => roundtrip::<apps::v1::DaemonSet>(d),
            ("policy/v1", "PodDisruptionBudget") => roundtrip::<policy::v1::PodDisruptionBudget>(d),
            ("coordination.k8s.io/v1", "Lease") => roundtrip::<k8s_openapi::api::coordination::v1::Lease>(d),
            ("networking.k8s.io/v1", "NetworkPolicy") => {
                roundtrip::<k8s_openapi::api::networking::v1::NetworkPolicy>(d)
            }
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => roundtrip::<rbac::v1::ClusterRole>(d),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => roundtrip::<rbac::v1::ClusterRoleBinding>(d),
            ("rbac.authorization.k8s.io/v1", "Role") => roundtrip::<rbac::v1::Role>(d),
            ("rbac.authorization.k8s.io/v1", "RoleBinding") => roundtrip::<rbac::v1::RoleBinding>(d),
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => roundtrip::<
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
            >(d),
            ("gateway.networking.k8s.io/v1", "GatewayClass") => roundtrip::<gateway_api::gatewayclasses::GatewayClass>(d),
            ("gateway.networking.k8s.io/v1", "Gateway") => roundtrip::<gateway_api::gateways::Gateway>(d),
            ("monitoring.coreos.com/v1", "ServiceMonitor") => roundtrip::<ServiceMonitor>(d),
            ("monitoring.coreos.com/v1", "PrometheusRule") => roundtrip::<PrometheusRule>(d),
            (v, k) => Err(format!("no type known for {v} {k}")),
        };
        if let Err(e) = r {
            problems.push(format!("{id}: {e}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Each `*.yaml` key of a ConfigMap is a valid file of its role.
fn check_configs(cm: &Value) -> Result<(), String> {
    let Some(data) = cm["data"].as_object() else {
        return Ok(());
    };
    for (key, text) in data {
        let text = text.as_str().unwrap_or("");
        let r = match key.as_str() {
            "gateway.yaml" => seedlink_config::compile::parse(text)
                .and_then(|f| seedlink_config::compile(f, None).map(|_| ()))
                .map_err(|e| e.to_string()),
            "tunnel.yaml" => seedlink_tunnel::config::ServerConfig::parse(text)
                .map(|_| ())
                .map_err(|e| format!("{e:#}")),
            "agent.yaml" => seedlink_tunnel::agent::config::AgentConfig::parse(text)
                .map_err(|e| e.to_string())
                .and_then(|c| errors(c.check_values())),
            "node-proxy.yaml" => seedlink_node_proxy::config::NodeProxyConfig::parse(text)
                .map_err(|e| e.to_string())
                .and_then(|c| errors(c.check())),
            "onboard.yaml" => seedlink_config::onboard::OnboardConfig::parse(text)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            k if k.ends_with(".yaml") => Err(format!("{k}: no check for this file")),
            _ => Ok(()),
        };
        r.map_err(|e| format!("{key}: {e}"))?;
    }
    Ok(())
}

fn errors(e: Vec<seedlink_config::ConfigError>) -> Result<(), String> {
    if e.is_empty() {
        Ok(())
    } else {
        Err(e
            .iter()
            .map(|e| format!("{}: {}", e.path, e.message))
            .collect::<Vec<_>>()
            .join("; "))
    }
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn the_seed_install_renders_and_every_object_reads_strictly() {
    let docs = render("seed");
    check_strictly(&docs);
    // The CRDs shipped are the generated ones.
    let crds: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "CustomResourceDefinition")
        .collect();
    assert_eq!(crds.len(), 3);
    let generated = seedlink_kube::crd::crds_yaml().unwrap();
    for crd in crds {
        let name = crd["metadata"]["name"].as_str().unwrap();
        assert!(generated.contains(name), "{name}");
    }
    for d in &docs {
        if d["kind"] != "CustomResourceDefinition"
            && d["kind"] != "Namespace"
            && !d["kind"].as_str().unwrap().starts_with("Cluster")
            && d["kind"] != "GatewayClass"
        {
            assert_eq!(
                d["metadata"]["namespace"], "seedlink-system",
                "{}",
                d["metadata"]["name"]
            );
        }
    }
    let dep = find(&docs, "Deployment", "seedlink");
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["args"][0], "seed");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert!(
        c["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_i64()
            .unwrap()
            >= 10
    );
    assert_eq!(c["env"][0]["name"], "POD_NAME");
    assert!(pod["affinity"]["podAntiAffinity"].is_object());
    // Every file the arguments name is in the ConfigMap mounted there.
    let cm = find(&docs, "ConfigMap", "seedlink-config");
    for f in ["gateway.yaml", "tunnel.yaml"] {
        assert!(cm["data"][f].is_string(), "{f}");
        assert!(c["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a.as_str() == Some(&format!("/etc/seedlink/config/{f}"))));
        // Admin binds the pod address, so it asks for a token, read from
        // the Secret mounted where the file says (docs/SECURITY.md).
        let cfg: serde_norway::Value =
            serde_norway::from_str(cm["data"][f].as_str().unwrap()).unwrap();
        let token = cfg["admin"]["token_file"].as_str().unwrap_or_default();
        assert_eq!(token, "/etc/seedlink/admin/token", "{f}");
        // Agents hold a stream to every replica only if the tunnel knows
        // how many there are: `server_count` is the Deployment's replicas
        // (otherwise about half of kube-apiserver's dials find no agent).
        if f == "tunnel.yaml" {
            assert_eq!(
                cfg["server_count"].as_u64(),
                dep["spec"]["replicas"].as_u64(),
                "tunnel.yaml server_count vs the Deployment's replicas"
            );
        }
    }
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/etc/seedlink/admin")
        .expect("admin token mount");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "seedlink-admin-token");
    assert_eq!(
        find(&docs, "Service", "seedlink")["spec"]["type"],
        "LoadBalancer"
    );
    assert_eq!(
        find(&docs, "PodDisruptionBudget", "seedlink")["spec"]["minAvailable"],
        1
    );
    // RBAC: list and watch on every kind the source watches, patch on the
    // status it writes, the Leases in its namespace only.
    let rules = find(&docs, "ClusterRole", "seedlink")["rules"]
        .as_array()
        .unwrap()
        .clone();
    let allows = |resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r["resources"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x == resource)
                && r["verbs"].as_array().unwrap().iter().any(|x| x == verb)
        })
    };
    for r in [
        "tlsroutes",
        "seedlinkpolicies",
        "tunnelclusters",
        "services",
        "endpointslices",
        "referencegrants",
        "namespaces",
    ] {
        assert!(allows(r, "list") && allows(r, "watch"), "{r}");
    }
    // No cluster-wide Secret or ConfigMap access: a ClusterRole for them,
    // bound per shoot namespace, and no ClusterRoleBinding of it.
    for r in ["secrets", "configmaps"] {
        assert!(!allows(r, "list") && !allows(r, "get"), "{r} cluster-wide");
    }
    let trust = find(&docs, "ClusterRole", "seedlink-tunnel-trust")["rules"].clone();
    assert!(trust.to_string().contains("secrets") && trust.to_string().contains("configmaps"));
    assert!(!docs
        .iter()
        .any(|d| d["kind"] == "ClusterRoleBinding"
            && d["roleRef"]["name"] == "seedlink-tunnel-trust"));
    for r in [
        "tlsroutes/status",
        "seedlinkpolicies/status",
        "tunnelclusters/status",
    ] {
        assert!(allows(r, "patch"), "{r}");
    }
    assert!(allows("events", "create"));
    assert!(
        !allows("leases", "update"),
        "Leases belong in the namespaced Role"
    );
    let role = find(&docs, "Role", "seedlink-leases");
    assert_eq!(role["rules"][0]["resources"][0], "leases");
}

#[test]
fn the_seed_install_with_a_service_monitor_renders_strictly() {
    let docs = render("seed-monitoring");
    check_strictly(&docs);
    let sm = find(&docs, "ServiceMonitor", "seedlink");
    let endpoints = sm["spec"]["endpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 2);
    // The admin endpoints want a token: Prometheus sends the one the pod
    // reads.
    for e in endpoints {
        assert_eq!(
            e["authorization"]["credentials"]["name"],
            "seedlink-admin-token"
        );
    }
}

/// The shipped alerts: valid for Prometheus (`promtool check rules`), and
/// each fires when it should and stays quiet otherwise (`promtool test
/// rules` with tests/peers/rules-test.yaml).
#[test]
fn the_shipped_alert_rules_pass_promtool() {
    let promtool = common::require("promtool");
    let docs = render("seed-monitoring");
    let rule = find(&docs, "PrometheusRule", "seedlink");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_norway::to_string(&rule["spec"]).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        root().join("crates/seedlink/tests/peers/rules-test.yaml"),
        dir.path().join("rules-test.yaml"),
    )
    .unwrap();
    for args in [
        ["check", "rules", "rules.yaml"],
        ["test", "rules", "rules-test.yaml"],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Every metric an alert names is one the binaries export (their
/// `/metrics`, read from a running gateway, tunnel-server and node-proxy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_name_is_exported() {
    use common::{http_get, node_proxy, seedlink_bin, tunnel_env::ready_line, Gw, Proc};
    let docs = render("seed-monitoring");
    let rule = find(&docs, "PrometheusRule", "seedlink");
    let mut names = std::collections::BTreeSet::new();
    for g in rule["spec"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            let expr = r["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(i) = rest.find("seedlink_") {
                let n: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + n.len()..];
                names.insert(n);
            }
        }
    }
    assert!(names.len() >= 8, "{names:?}");

    let gw = Gw::start("admin: {listen: '127.0.0.1:0'}\nlisteners: [{name: tls, address: '127.0.0.1:0'}]\ncontrol_planes: []\n");
    let dir = tempfile::tempdir().unwrap();
    let pki = seedlink::demo::Pki::generate(&["tunnel.test"]).unwrap();
    let w = |n: &str, t: &str| {
        std::fs::write(dir.path().join(n), t).unwrap();
        dir.path().join(n).display().to_string()
    };
    let (crt, key, ca) = (
        w("t.pem", &pki.servers[0].1.cert_pem),
        w("t-key.pem", &pki.servers[0].1.key_pem),
        w("ca.pem", &pki.ca_pem),
    );
    let cfg = w(
        "tunnel.yaml",
        &format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'}}\nadmin: {{listen: '127.0.0.1:0'}}\nclusters:\n  - {{name: a, agent_ca: '{ca}', frontends: [{{name: kas, protocol: http-connect, unix: '{}/a.sock'}}]}}\n",
            dir.path().display()
        ),
    );
    let mut server = std::process::Command::new(seedlink_bin())
        .args(["tunnel-server", "--config", &cfg])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready = ready_line(&mut server);
    let _server = Proc(server);
    let tunnel_admin: std::net::SocketAddr = ready["admin"].as_str().unwrap().parse().unwrap();
    let dead = common::free_port();
    let np = node_proxy(&[
        "--link-kind",
        "none",
        "--address",
        "127.0.0.70",
        "--gateway",
        &format!("127.0.0.1:{dead}"),
        "--destination",
        "outbound|443||kube-apiserver.shoot--a.svc.cluster.local",
    ]);
    let mut exported = String::new();
    for admin in [gw.admin, tunnel_admin, np.admin] {
        let (code, body) = http_get(admin, "/metrics").await;
        assert_eq!(code, 200);
        exported.push_str(&body);
    }
    // The onboarding controller's, as its /metrics encodes them (it needs
    // an API server to start; tests/kubernetes.rs scrapes the running one).
    exported.push_str(&seedlink_net::admin::encode(
        &seedlink_kube::onboard::metrics::registry(&[], false, Default::default()),
    ));
    // The Kubernetes source's, as a gateway or tunnel-server running one
    // adds them (tests/kubernetes.rs scrapes those).
    exported.push_str(&seedlink_net::admin::encode(
        seedlink_net::admin::Section::registry(&seedlink_kube::source::SourceMetrics::new(
            "tunnel",
        )),
    ));
    for n in names {
        // OpenMetrics: a counter's family is named without `_total`.
        let family = n.strip_suffix("_total").unwrap_or(&n);
        assert!(
            exported.contains(&format!("# TYPE {family} ")),
            "an alert names {n}, which no binary exports"
        );
    }
}

#[test]
fn the_shoot_install_renders_and_every_object_reads_strictly() {
    let docs = render("shoot");
    check_strictly(&docs);
    let ds = find(&docs, "DaemonSet", "seedlink-node-proxy");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    let caps = &pod["containers"][0]["securityContext"]["capabilities"];
    assert_eq!(caps["drop"], json!(["ALL"]));
    assert_eq!(caps["add"], json!(["NET_ADMIN", "NET_BIND_SERVICE"]));
    let agent = find(&docs, "Deployment", "seedlink-tunnel-agent");
    let spec = &agent["spec"]["template"]["spec"];
    assert_eq!(spec["serviceAccountName"], "konnectivity-agent");
    let token = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "token")
        .unwrap();
    assert_eq!(
        token["projected"]["sources"][0]["serviceAccountToken"]["audience"],
        "system:konnectivity-server"
    );
    // The agent reads the token where the volume puts it.
    let cm = find(&docs, "ConfigMap", "seedlink-shoot");
    assert!(cm["data"]["agent.yaml"]
        .as_str()
        .unwrap()
        .contains("/var/run/secrets/tokens/konnectivity-agent-token"));
}

/// The manifests run the image scripts/image builds:
/// `localhost/seedlink:<version>`, the version the binary reports.
#[test]
fn the_manifests_use_the_image_scripts_image_builds() {
    let script = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/image"),
    )
    .unwrap();
    assert!(script.contains("tag=\"localhost/seedlink:$version\""));
    let want = format!("localhost/seedlink:{}", env!("CARGO_PKG_VERSION"));
    for install in ["seed", "shoot"] {
        for doc in render(install) {
            for c in doc["spec"]["template"]["spec"]["containers"]
                .as_array()
                .into_iter()
                .flatten()
            {
                assert_eq!(
                    c["image"],
                    want.as_str(),
                    "{install}: {}",
                    doc["metadata"]["name"]
                );
            }
        }
    }
}

/// Every object of the seed and shoot installs is accepted by a real
/// kube-apiserver (server-side apply, RBAC on, the CRDs installed): the
/// API server's own validation, defaulting and admission, not only the
/// Rust types, check what ships.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_api_server_accepts_every_object_of_the_installs() {
    use common::kubeapi::{self, KubeApi};
    let api = KubeApi::shared();
    let client = api.client().await.unwrap();
    for install in ["seed", "seed-class", "shoot"] {
        let docs = render(install);
        // Namespaces first (the rendered order does not promise it).
        let (namespaces, rest): (Vec<Value>, Vec<Value>) =
            docs.into_iter().partition(|d| d["kind"] == "Namespace");
        for ns in namespaces {
            kubeapi::apply(&client, ns).await;
        }
        for doc in rest {
            if let Some(ns) = doc["metadata"]["namespace"].as_str() {
                kubeapi::apply(
                    &client,
                    serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": ns}}),
                )
                .await;
            }
            let what = format!("{install}: {} {}", doc["kind"], doc["metadata"]["name"]);
            if let Err(e) = kubeapi::try_apply(&client, doc).await {
                panic!("{what} refused by the API server: {e}");
            }
        }
    }
}

/// seedlink's CRDs validate on the real API server: a TunnelCluster or
/// SeedlinkPolicy that breaks a rule is refused with the rule's message
/// (CEL: exactly one of secret/configMap and of unix/tcp, a known agent
/// trust, strategies, CIDRs; enums; a pattern), and a valid one is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_refuses_invalid_seedlink_objects_with_the_crds_messages() {
    use common::kubeapi::{self, KubeApi};
    use serde_json::json;
    let api = KubeApi::shared();
    let client = api.client().await.unwrap();
    let ns = api.namespace(&client, "crds", json!({})).await;
    let tunnel = |spec: Value| {
        json!({"apiVersion": "tunnel.seedlink.dev/v1alpha1", "kind": "TunnelCluster",
               "metadata": {"name": "t", "namespace": ns}, "spec": spec})
    };
    let policy = |spec: Value| {
        json!({"apiVersion": "policy.seedlink.dev/v1alpha1", "kind": "SeedlinkPolicy",
               "metadata": {"name": "p", "namespace": ns}, "spec": spec})
    };
    let target = json!([{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "name": "r"}]);
    let refused = [
        (tunnel(json!({})), "agentCA or agentToken is required"),
        (
            tunnel(json!({"agentCA": {"secret": "s", "configMap": "c", "key": "ca.crt"}})),
            "exactly one of secret and configMap",
        ),
        (
            tunnel(json!({"agentCA": {"key": "ca.crt"}})),
            "exactly one of secret and configMap",
        ),
        (
            tunnel(json!({"agentCA": {"secret": "s", "key": "ca.crt"},
                          "strategies": ["nearest"]})),
            "strategies are destHost, cidr, defaultRoute and default",
        ),
        (
            tunnel(json!({"agentCA": {"secret": "s", "key": "ca.crt"},
                          "frontends": [{"name": "kas", "protocol": "http-connect",
                                         "unix": "kas.sock", "tcp": "127.0.0.1:8090"}]})),
            "exactly one of unix and tcp",
        ),
        (
            tunnel(json!({"agentCA": {"secret": "s", "key": "ca.crt"},
                          "frontends": [{"name": "kas", "protocol": "ftp", "unix": "kas.sock"}]})),
            "Unsupported value: \"ftp\"",
        ),
        (
            tunnel(json!({"agentCA": {"secret": "s", "key": "ca.crt"},
                          "frontends": [{"name": "Kas!", "protocol": "grpc", "unix": "kas.sock"}]})),
            "should match",
        ),
        (
            policy(json!({"targetRefs": target, "allowedSourceCIDRs": ["10.0.0.0/33"]})),
            "each entry must be a CIDR",
        ),
        (
            policy(json!({"targetRefs": [{"group": "x", "kind": "TLSRoute", "name": "r"}]})),
            "Unsupported value: \"x\"",
        ),
        (
            policy(json!({"targetRefs": []})),
            "should have at least 1 items",
        ),
    ];
    for (object, message) in refused {
        match kubeapi::try_apply(&client, object.clone()).await {
            Ok(_) => panic!("accepted: {}", object["spec"]),
            Err(e) => assert!(
                e.to_string().contains(message),
                "{}: {e} (wanted {message:?})",
                object["spec"]
            ),
        }
    }
    kubeapi::apply(
        &client,
        tunnel(json!({"agentCA": {"secret": "s", "key": "ca.crt"},
                      "strategies": ["destHost", "default"],
                      "frontends": [{"name": "kas", "protocol": "http-connect", "unix": "kas.sock"}],
                      "limits": {"maxConnections": 10, "maxQueuedBytes": 1048576}})),
    )
    .await;
    kubeapi::apply(
        &client,
        policy(json!({"targetRefs": target, "allowedSourceCIDRs": ["10.0.0.0/8", "192.0.2.7", "2001:db8::/32"]})),
    )
    .await;
}

use common::cluster::helm;

fn helm_template(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["--include-crds"];
    all.extend_from_slice(args);
    helm_template_in("seedlink", "seedlink-system", &all)
}

/// `helm template` of chart `charts/<chart>` in `namespace` with `args`.
fn helm_template_in(chart: &str, namespace: &str, args: &[&str]) -> Vec<Value> {
    common::kubeapi::helm_template(chart, namespace, args)
}

/// The Helm chart (what Gardener ControllerDeployments and KKP's installer
/// consume) passes `helm lint --strict`, and with its defaults renders
/// exactly the objects of the kustomize seed install (but the Namespace,
/// which `helm install --create-namespace` makes): one install, two
/// packagings that cannot drift. `replicas` moves the tunnel's
/// `server_count` with it; its CRDs are the shipped ones, its version the
/// binary's.
#[test]
fn the_helm_chart_lints_and_renders_the_kustomize_install() {
    helm_lint("seedlink");
    let key = |d: &Value| {
        format!(
            "{} {} {}",
            d["apiVersion"].as_str().unwrap_or(""),
            d["kind"].as_str().unwrap_or(""),
            d["metadata"]["name"].as_str().unwrap_or("")
        )
    };
    let chart: std::collections::BTreeMap<String, Value> = helm_template(&[])
        .into_iter()
        .map(|mut d| {
            // The chart rolls the pods when the configuration changes.
            if let Some(meta) = d
                .pointer_mut("/spec/template/metadata")
                .and_then(|m| m.as_object_mut())
            {
                let annotations = meta.get_mut("annotations").and_then(|a| a.as_object_mut());
                if let Some(a) = annotations {
                    assert!(a.remove("checksum/config").is_some());
                    if a.is_empty() {
                        meta.remove("annotations");
                    }
                }
            }
            (key(&d), d)
        })
        .collect();
    let kustomize: std::collections::BTreeMap<String, Value> = render("seed")
        .into_iter()
        .filter(|d| d["kind"] != "Namespace")
        .map(|mut d| {
            // Kustomize 2 does not know GatewayClass is cluster-scoped and
            // gives it a namespace (which the API server drops).
            if d["kind"] == "GatewayClass" {
                if let Some(m) = d["metadata"].as_object_mut() {
                    m.remove("namespace");
                }
            }
            (key(&d), d)
        })
        .collect();
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        kustomize.keys().collect::<Vec<_>>()
    );
    // The configuration files inside the ConfigMap compare as YAML (their
    // comments may differ).
    let parsed = |d: &Value| {
        let mut d = d.clone();
        let config_map = d["kind"] == "ConfigMap";
        if let Some(data) = d["data"].as_object_mut().filter(|_| config_map) {
            for v in data.values_mut() {
                if let Some(text) = v.as_str() {
                    *v = serde_norway::from_str::<Value>(text).unwrap_or(Value::Null);
                }
            }
        }
        d
    };
    for (k, want) in &kustomize {
        if let Some(at) = first_difference(&parsed(&chart[k]), &parsed(want), String::new()) {
            panic!("{k}: the chart differs from kustomize at {at}");
        }
    }
    let three = helm_template(&["--set", "replicas=3"]);
    let dep = three.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(dep["spec"]["replicas"], 3);
    let cm = three.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    let tunnel: serde_norway::Value =
        serde_norway::from_str(cm["data"]["tunnel.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(tunnel["server_count"].as_u64(), Some(3));
    // One replica: no PodDisruptionBudget (it would block every drain).
    let one = helm_template(&["--set", "replicas=1"]);
    assert!(!one.iter().any(|d| d["kind"] == "PodDisruptionBudget"));
    chart_version_is_the_binarys("seedlink");
    assert_eq!(
        std::fs::read_to_string(root().join("charts/seedlink/crds/seedlink.yaml")).unwrap(),
        std::fs::read_to_string(root().join("deploy/crds/seedlink.yaml")).unwrap(),
        "charts/seedlink/crds/seedlink.yaml is stale: copy deploy/crds/seedlink.yaml"
    );
}

/// `helm template` with `args`: the refusal's text if helm refuses.
fn helm_refuses(args: &[&str]) -> String {
    let out = std::process::Command::new(helm())
        .args(["template", "seedlink"])
        .arg(root().join("charts/seedlink"))
        .args([
            "--namespace",
            "seedlink-system",
            "--kube-version",
            "v1.35.4",
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "helm accepted {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind)
}

/// The gateway's configuration file as rendered into the ConfigMap.
fn gateway_file(docs: &[Value]) -> serde_norway::Value {
    let cm = kind(docs, "ConfigMap").unwrap();
    serde_norway::from_str(cm["data"]["gateway.yaml"].as_str().unwrap()).unwrap()
}

/// Class mode in the chart: the GatewayClass, the gateway file's
/// `gateway_class` (checked by seedlink's own parser), the pods on the
/// node's network, and exactly the RBAC of the kustomize class install
/// (`deploy/kustomize/seed-class`), which the Gateway API conformance run
/// runs under. Without addresses, or with a malformed class name, the
/// install is refused.
#[test]
fn class_mode_renders_the_class_and_its_rbac() {
    let d = helm_template(&[
        "--set",
        "classMode.enabled=true",
        "--set",
        "classMode.addresses={10.0.0.7,10.0.0.8}",
        "--set",
        "hostNetwork=true",
        "--set",
        "networkPolicy.enabled=false",
    ]);
    let cm = kind(&d, "ConfigMap").unwrap();
    check_configs(cm).unwrap();
    let gw = gateway_file(&d);
    assert_eq!(gw["kubernetes"]["gateway_class"]["name"], "seedlink-class");
    assert_eq!(
        gw["kubernetes"]["gateway_class"]["addresses"],
        serde_norway::from_str::<serde_norway::Value>("[10.0.0.7, 10.0.0.8]").unwrap()
    );
    assert_eq!(gw["kubernetes"]["gateway"], "seedlink-system/seedlink");
    let classes: Vec<&Value> = d
        .iter()
        .filter(|d| d["kind"] == "GatewayClass")
        .map(|d| &d["metadata"]["name"])
        .collect();
    assert_eq!(classes, ["seedlink", "seedlink-class"]);
    let pod = &kind(&d, "Deployment").unwrap()["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    // Node ports: one replica per node, and no surge pod in a rollout.
    let dep = kind(&d, "Deployment").unwrap();
    assert_eq!(dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"], 0);
    assert!(
        pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            .is_array()
    );
    let named = |docs: &[Value], k: &str| -> Value {
        let mut v = docs
            .iter()
            .find(|d| d["kind"] == k && d["metadata"]["name"] == "seedlink-gateway-class")
            .unwrap_or_else(|| panic!("no {k} seedlink-gateway-class"))
            .clone();
        // Kustomize gives cluster-scoped objects no namespace either way.
        if let Some(m) = v["metadata"].as_object_mut() {
            m.remove("namespace");
        }
        v
    };
    let kustomize = render("seed-class");
    for k in ["ClusterRole", "ClusterRoleBinding"] {
        assert_eq!(
            named(&d, k),
            named(&kustomize, k),
            "{k} differs from kustomize's"
        );
    }
    // Off (the default): none of it.
    let off = helm_template(&[]);
    assert!(!off
        .iter()
        .any(|d| d["metadata"]["name"] == "seedlink-gateway-class"));
    assert!(gateway_file(&off)["kubernetes"]["gateway_class"].is_null());
    let why = helm_refuses(&["--set", "classMode.enabled=true"]);
    assert!(why.contains("classMode.addresses"), "{why}");
    let why = helm_refuses(&["--set", "classMode.className=Not_A_Name"]);
    assert!(why.contains("className"), "{why}");
    // Not the install's own class, and addresses that are IP addresses.
    let why = helm_refuses(&["--set", "classMode.className=seedlink"]);
    assert!(why.contains("className"), "{why}");
    let why = helm_refuses(&[
        "--set",
        "classMode.enabled=true",
        "--set",
        "classMode.addresses={gw.example.com}",
    ]);
    assert!(why.contains("addresses"), "{why}");
    // A NetworkPolicy would not cover pods on the node's network.
    let why = helm_refuses(&["--set", "hostNetwork=true"]);
    assert!(why.contains("networkPolicy.enabled=false"), "{why}");
}

/// The image values: registry, pull secrets, pull policy.
#[test]
fn the_image_values_render() {
    // Image: registry, pull secrets, pull policy.
    let d = helm_template(&[
        "--set",
        "image.registry=registry.example.com",
        "--set",
        "image.pullPolicy=Always",
        "--set",
        "image.pullSecrets[0]=regcred",
    ]);
    let pod = &kind(&d, "Deployment").unwrap()["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(
        c["image"],
        format!(
            "registry.example.com/localhost/seedlink:{}",
            env!("CARGO_PKG_VERSION")
        )
    );
    assert_eq!(c["imagePullPolicy"], "Always");
    assert_eq!(pod["imagePullSecrets"][0]["name"], "regcred");
}

/// The Service values: the load balancer's settings.
#[test]
fn the_service_values_render() {
    // Service: the load balancer's settings.
    let d = helm_template(&[
        "--set-string",
        "service.annotations.service\\.beta\\.kubernetes\\.io/aws-load-balancer-internal=true",
        "--set",
        "service.loadBalancerClass=example.com/lb",
        "--set",
        "service.loadBalancerSourceRanges[0]=192.0.2.0/24",
        "--set",
        "service.externalTrafficPolicy=Cluster",
        "--set",
        "service.ports.tls=6443",
    ]);
    let svc = d
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "seedlink")
        .unwrap();
    assert_eq!(
        svc["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"],
        "true"
    );
    assert_eq!(svc["spec"]["loadBalancerClass"], "example.com/lb");
    assert_eq!(svc["spec"]["loadBalancerSourceRanges"][0], "192.0.2.0/24");
    assert_eq!(svc["spec"]["externalTrafficPolicy"], "Cluster");
    assert_eq!(svc["spec"]["ports"][0]["port"], 6443);
}

/// The gateway values: PROXY protocol with the load balancers it trusts,
/// limits; the rendered file is one seedlink reads, and PROXY protocol
/// without anyone to trust fails the install, saying why.
#[test]
fn the_gateway_values_render_a_file_seedlink_reads() {
    // Gateway: PROXY protocol with the load balancers it trusts, limits.
    let d = helm_template(&[
        "--set",
        "gateway.proxyProtocol=required",
        "--set",
        "gateway.trustedLoadBalancers[0]=10.250.0.0/16",
        "--set",
        "gateway.maxConnections=5000",
        "--set",
        "gateway.maxConnectionsPerControlPlane=500",
    ]);
    let g = gateway_file(&d);
    for l in g["listeners"].as_sequence().unwrap() {
        assert_eq!(l["proxy_protocol"].as_str(), Some("required"), "{l:?}");
    }
    assert_eq!(
        g["trusted_load_balancers"][0].as_str(),
        Some("10.250.0.0/16")
    );
    assert_eq!(g["limits"]["max_connections"].as_u64(), Some(5000));
    assert_eq!(
        g["limits"]["max_connections_per_control_plane"].as_u64(),
        Some(500)
    );
    // The rendered file is one seedlink reads.
    let text = kind(&d, "ConfigMap").unwrap()["data"]["gateway.yaml"]
        .as_str()
        .unwrap()
        .to_string();
    let read = seedlink_config::compile::parse(&text)
        .and_then(|f| seedlink_config::compile(f, None).map(|_| ()));
    if let Err(e) = read {
        panic!("the rendered gateway.yaml: {e}");
    }
    // PROXY protocol without anyone to trust fails the install, saying why.
    let why = helm_refuses(&["--set", "gateway.proxyProtocol=optional"]);
    assert!(why.contains("gateway.trustedLoadBalancers"), "{why}");
}

/// The scheduling values.
#[test]
fn the_scheduling_values_render() {
    // Scheduling.
    let d = helm_template(&[
        "--set",
        "priorityClassName=system-cluster-critical",
        "--set",
        "nodeSelector.pool=seed",
        "--set",
        "tolerations[0].key=dedicated",
        "--set",
        "tolerations[0].operator=Exists",
        "--set-json",
        "affinity={}",
        "--set-json",
        "topologySpreadConstraints=[]",
    ]);
    let pod = &kind(&d, "Deployment").unwrap()["spec"]["template"]["spec"];
    assert_eq!(pod["priorityClassName"], "system-cluster-critical");
    assert_eq!(pod["nodeSelector"]["pool"], "seed");
    assert_eq!(pod["tolerations"][0]["key"], "dedicated");
    assert!(
        pod.get("affinity").is_none() && pod.get("topologySpreadConstraints").is_none(),
        "{pod}"
    );
}

/// Autoscaling: an HPA, no fixed replicas, a PDB even at replicas=1.
#[test]
fn the_autoscaling_values_render_an_hpa_and_a_pdb() {
    // Autoscaling: an HPA, no fixed replicas, a PDB even at replicas=1.
    let d = helm_template(&["--set", "autoscaling.enabled=true", "--set", "replicas=1"]);
    let hpa = kind(&d, "HorizontalPodAutoscaler").unwrap();
    assert_eq!(hpa["spec"]["maxReplicas"], 6);
    assert!(kind(&d, "Deployment").unwrap()["spec"]
        .get("replicas")
        .is_none());
    assert_eq!(
        kind(&d, "PodDisruptionBudget").unwrap()["spec"]["minAvailable"],
        1
    );
    let d = helm_template(&["--set", "podDisruptionBudget.enabled=false"]);
    assert!(kind(&d, "PodDisruptionBudget").is_none());
}

/// NetworkPolicy: the in-cluster ports only from the peers named.
#[test]
fn the_network_policy_admits_only_the_peers_named() {
    // NetworkPolicy: the in-cluster ports only from the peers named.
    let d = helm_template(&[
        "--set",
        "networkPolicy.internalFrom[0].namespaceSelector.matchLabels.gardener\\.cloud/role=shoot",
    ]);
    let np = kind(&d, "NetworkPolicy").unwrap();
    let rules = np["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2);
    assert!(rules[0].get("from").is_none());
    assert_eq!(
        rules[1]["from"][0]["namespaceSelector"]["matchLabels"]["gardener.cloud/role"],
        "shoot"
    );
    assert_eq!(rules[1]["ports"][0]["port"], 8090);
    let d = helm_template(&["--set", "networkPolicy.enabled=false"]);
    assert!(kind(&d, "NetworkPolicy").is_none());
}

/// Monitoring: both admin endpoints scraped with the admin token; alerts,
/// the same objects as the kustomize seed-monitoring install.
#[test]
fn monitoring_scrapes_both_admin_endpoints_with_the_token() {
    // Monitoring: both admin endpoints scraped with the admin token; alerts.
    let d = helm_template(&[
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
    ]);
    // The same objects as the kustomize seed-monitoring install, whose
    // rules promtool checks and whose metrics the binaries export.
    let shipped = render("seed-monitoring");
    for k in ["ServiceMonitor", "PrometheusRule"] {
        let want = shipped.iter().find(|d| d["kind"] == k).unwrap();
        let got = kind(&d, k).unwrap();
        assert_eq!(got["spec"], want["spec"], "{k}");
        assert_eq!(got["metadata"]["namespace"], "seedlink-system");
    }
    for f in ["servicemonitor.yaml", "prometheusrule.yaml"] {
        assert_eq!(
            std::fs::read_to_string(root().join("charts/seedlink/files").join(f)).unwrap(),
            std::fs::read_to_string(root().join("deploy/kustomize/seed-monitoring").join(f))
                .unwrap(),
            "charts/seedlink/files/{f} is stale: copy deploy/kustomize/seed-monitoring/{f}"
        );
    }
}

/// values.schema.json refuses a misspelt value, a wrong type, a value out
/// of range.
#[test]
fn the_schema_refuses_misspelt_wrong_and_out_of_range_values() {
    // The schema: a misspelt value, a wrong type, a value out of range.
    for bad in [
        "replica=3",
        "service.type=Ingress",
        "autoscaling.targetCPUUtilizationPercentage=0",
    ] {
        let why = helm_refuses(&["--set", bad]);
        assert!(why.contains("schema"), "{bad}: {why}");
    }
}

/// What the chart does not create is checked at install against the real
/// API server (`--dry-run=server`, so `lookup` reads it): a
/// missing Secret, or one without a key the pods mount, fails the install
/// saying what to create; with both Secrets the install goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_checks_the_prerequisites_it_does_not_create() {
    use common::kubeapi::{self, KubeApi};
    use serde_json::json;
    let api = KubeApi::shared();
    let client = api.client().await.unwrap();
    let ns = format!("chart-prereq-{}", std::process::id());
    kubeapi::apply(
        &client,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
    )
    .await;
    let install = || {
        // `template` rather than `install`: the same lookups against the
        // API server, without the release-ownership checks of the
        // cluster-scoped objects other tests of this API server applied.
        std::process::Command::new(helm())
            .args(["template", "seedlink"])
            .arg(root().join("charts/seedlink"))
            .args(["--namespace", &ns, "--dry-run=server", "--skip-crds"])
            .args(["--kube-version", "v1.35.4"])
            .env("KUBECONFIG", &api.admin_kubeconfig)
            .output()
            .unwrap()
    };
    let secret = |name: &str, keys: &[&str]| {
        let data: serde_json::Map<String, Value> = keys
            .iter()
            .map(|k| (k.to_string(), json!("eA==")))
            .collect();
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": name, "namespace": ns}, "data": data})
    };
    let refused = |want: &str| {
        let o = install();
        let said = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success() && said.contains(want), "{want}: {said}");
    };
    refused("seedlink-admin-token is missing");
    kubeapi::apply(&client, secret("seedlink-admin-token", &["token"])).await;
    refused("seedlink-tunnel-tls is missing");
    kubeapi::apply(
        &client,
        secret("seedlink-tunnel-tls", &["tls.crt", "tls.key"]),
    )
    .await;
    refused("has no key ca.crt");
    kubeapi::apply(
        &client,
        secret("seedlink-tunnel-tls", &["tls.crt", "tls.key", "ca.crt"]),
    )
    .await;
    let o = install();
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    kubeapi::delete(&client, "v1", "Namespace", "", &ns).await;
}

/// The shoot side as a chart (what a platform applies in each shoot):
/// `helm lint --strict` passes; with its defaults it renders exactly the
/// kustomize shoot install's objects (ConfigMap files compared as YAML);
/// its values reach the files, which the node-proxy and the agent read;
/// its schema refuses a mode the node-proxy does not have.
#[test]
fn the_shoot_chart_renders_the_kustomize_shoot_install_and_its_values() {
    helm_lint("seedlink-shoot");
    let key = |d: &Value| {
        format!(
            "{} {}",
            d["kind"].as_str().unwrap_or(""),
            d["metadata"]["name"].as_str().unwrap_or("")
        )
    };
    let parsed = |d: &Value| {
        let mut d = d.clone();
        let config_map = d["kind"] == "ConfigMap";
        if let Some(data) = d["data"].as_object_mut().filter(|_| config_map) {
            for v in data.values_mut() {
                if let Some(text) = v.as_str() {
                    *v = serde_norway::from_str::<Value>(text).unwrap_or(Value::Null);
                }
            }
        }
        d
    };
    let chart: std::collections::BTreeMap<String, Value> =
        helm_template_in("seedlink-shoot", "kube-system", &[])
            .iter()
            .map(|d| (key(d), parsed(d)))
            .collect();
    let kustomize: std::collections::BTreeMap<String, Value> = render("shoot")
        .iter()
        .map(|d| (key(d), parsed(d)))
        .collect();
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        kustomize.keys().collect::<Vec<_>>()
    );
    for (k, want) in &kustomize {
        if let Some(at) = first_difference(&chart[k], want, String::new()) {
            panic!("{k}: the shoot chart differs from kustomize at {at}");
        }
    }
    let d = helm_template_in(
        "seedlink-shoot",
        "kube-system",
        &[
            "--set",
            "nodeProxy.mode=http2-connect",
            "--set",
            "nodeProxy.gateway=gw.seed.example.net:8443",
            "--set",
            "agent.server=tunnel.seed.example.net:443",
            "--set",
            "agent.caBundle=-----BEGIN CERTIFICATE-----",
            "--set",
            "image.registry=registry.example.com",
        ],
    );
    let cm = d
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-shoot")
        .unwrap();
    check_configs(cm).unwrap();
    let np: Value =
        serde_norway::from_str(cm["data"]["node-proxy.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(np["mode"], "http2-connect");
    assert_eq!(np["gateway"], "gw.seed.example.net:8443");
    let agent: Value = serde_norway::from_str(cm["data"]["agent.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(agent["server"], "tunnel.seed.example.net:443");
    let ca = d
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-tunnel-ca")
        .unwrap();
    assert!(ca["data"]["ca.crt"]
        .as_str()
        .unwrap()
        .starts_with("-----BEGIN CERTIFICATE-----"));
    let ds = d.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"][0]["image"],
        format!(
            "registry.example.com/localhost/seedlink:{}",
            env!("CARGO_PKG_VERSION")
        )
    );
    let bad = std::process::Command::new(helm())
        .args(["template", "s"])
        .arg(root().join("charts/seedlink-shoot"))
        .args(["--kube-version", "v1.35.4", "--set", "nodeProxy.mode=h2"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("schema"));
    // The agent alone (a second tunnel for the same shoot, or in-cluster
    // clients served another way): no node-proxy, no node-proxy file.
    let agent_only = helm_template_in(
        "seedlink-shoot",
        "shoot-b-agents",
        &["--set", "nodeProxy.enabled=false"],
    );
    assert!(!agent_only.iter().any(|d| d["kind"] == "DaemonSet"));
    let cm = agent_only
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-shoot")
        .unwrap();
    assert!(cm["data"]["node-proxy.yaml"].is_null());
    check_configs(cm).unwrap();
    assert!(agent_only.iter().any(|d| d["kind"] == "Deployment"));
    chart_version_is_the_binarys("seedlink-shoot");
}

/// A chart's version and appVersion are the binary's.
fn chart_version_is_the_binarys(chart: &str) {
    let chart_yaml: serde_norway::Value = serde_norway::from_str(
        &std::fs::read_to_string(root().join("charts").join(chart).join("Chart.yaml")).unwrap(),
    )
    .unwrap();
    for k in ["version", "appVersion"] {
        assert_eq!(
            chart_yaml[k].as_str(),
            Some(env!("CARGO_PKG_VERSION")),
            "{chart} {k}"
        );
    }
}

/// `helm lint --strict` passes for chart `charts/<chart>`.
fn helm_lint(chart: &str) {
    let lint = std::process::Command::new(helm())
        .args(["lint", "--strict", "--kube-version", "v1.35.4"])
        .arg(root().join("charts").join(chart))
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "helm lint {chart}: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
}

/// `onboarding.nodeProxy.*` reach the controller's file (the node-proxy
/// in the shoot manifests), which reads strictly.
#[test]
fn the_onboarding_controllers_node_proxy_settings_reach_its_file() {
    let with_node_proxy = helm_template(&[
        "--set",
        "onboarding.enabled=true",
        "--set",
        "onboarding.agentServer=tunnel.seed.example:443",
        "--set",
        "onboarding.nodeProxy.gateway=gw.seed.example:8443",
        "--set",
        "onboarding.nodeProxy.linkKind=bridge",
        "--set",
        "onboarding.nodeProxy.proxyGateway=gw.seed.example:8132",
    ]);
    check_strictly(&with_node_proxy);
    let cm = with_node_proxy
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-onboard-config")
        .unwrap();
    let file: Value = serde_norway::from_str(cm["data"]["onboard.yaml"].as_str().unwrap()).unwrap();
    let np = &file["render"]["node_proxy"];
    assert_eq!(
        (
            &np["gateway"],
            &np["link_kind"],
            &np["address"],
            &np["admin_port"]
        ),
        (
            &json!("gw.seed.example:8443"),
            &json!("bridge"),
            &json!("10.250.255.254"),
            &json!(9911)
        ),
        "{np}"
    );
    assert_eq!(np["proxy_gateway"], "gw.seed.example:8132", "{np}");
}

/// `onboarding.enabled=true` adds the onboarding controller under a
/// ServiceAccount of its own, every object reading strictly and its file
/// a valid one; its ClusterRole may `bind` only the trust role, and the
/// data plane's ServiceAccount gains nothing (its ClusterRole writes no
/// Secret, route or RoleBinding either way).
#[test]
fn the_onboarding_controller_renders_under_its_own_service_account() {
    let docs = helm_template(&[
        "--set",
        "onboarding.enabled=true",
        "--set",
        "onboarding.agentServer=tunnel.seed.example:443",
    ]);
    check_strictly(&docs);
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    let dep = find("Deployment", "seedlink-onboard");
    assert_eq!(
        dep["spec"]["template"]["spec"]["serviceAccountName"],
        "seedlink-onboard"
    );
    let args = &dep["spec"]["template"]["spec"]["containers"][0]["args"];
    assert_eq!(args[0], "onboard");
    // It reads the tunnel-server's file and CA, never its key.
    let volumes = dep["spec"]["template"]["spec"]["volumes"].to_string();
    assert!(
        volumes.contains("ca.crt") && !volumes.contains("tls.key"),
        "{volumes}"
    );
    let cm = find("ConfigMap", "seedlink-onboard-config");
    let file: Value = serde_norway::from_str(cm["data"]["onboard.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(file["render"]["agent_server"], "tunnel.seed.example:443");
    assert!(file["render"]["node_proxy"].is_null(), "{file}");
    let role = find("ClusterRole", "seedlink-onboard");
    let binds: Vec<&Value> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["verbs"].as_array().unwrap().iter().any(|v| v == "bind"))
        .collect();
    assert_eq!(binds.len(), 1);
    assert_eq!(
        binds[0]["resourceNames"],
        json!(["seedlink-tunnel-trust", "seedlink-tunnel-trust-configmaps"])
    );
    let data_plane = find("ClusterRole", "seedlink");
    for rule in data_plane["rules"].as_array().unwrap() {
        let writes = rule["verbs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == "create" || v == "update" || v == "bind");
        let resources = rule["resources"].to_string();
        assert!(
            !(writes
                && (resources.contains("secrets")
                    || resources.contains("rolebindings")
                    || resources.contains("tlsroutes"))),
            "{rule}"
        );
    }
    let binding = find("ClusterRoleBinding", "seedlink-onboard");
    assert_eq!(binding["subjects"][0]["name"], "seedlink-onboard");
    // Its Lease is the install's (helm uninstall removes it); its admin
    // endpoint answers the probes, and /metrics with the token.
    find("Lease", "seedlink-onboard");
    assert_eq!(file["admin"]["token_file"], "/etc/seedlink/admin/token");
    let container = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    // With a CA for kube-apiservers' client certificates: the data
    // plane's pods mount its certificate alone, this controller its key.
    let with_ca = helm_template(&[
        "--set",
        "onboarding.enabled=true",
        "--set",
        "onboarding.agentServer=tunnel.seed.example:443",
        "--set",
        "kubeApiserverClientCA=seedlink-kas-client-ca",
    ]);
    check_strictly(&with_ca);
    let mounted = |name: &str| {
        let d = with_ca
            .iter()
            .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == name)
            .unwrap();
        d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "kas-client-ca")
            .map(|v| v["secret"]["items"].to_string())
            .unwrap_or_default()
    };
    assert!(
        mounted("seedlink").contains("tls.crt") && !mounted("seedlink").contains("tls.key"),
        "{}",
        mounted("seedlink")
    );
    assert!(mounted("seedlink-onboard").contains("tls.key"));
    let cm = with_ca
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-onboard-config")
        .unwrap();
    let file: Value = serde_norway::from_str(cm["data"]["onboard.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(
        file["render"]["kube_apiserver_client_ca"]["key"],
        "/etc/seedlink/kas-client-ca/tls.key"
    );
    let monitored = helm_template(&[
        "--set",
        "onboarding.enabled=true",
        "--set",
        "monitoring.serviceMonitor.enabled=true",
    ]);
    check_strictly(&monitored);
    let sm = monitored
        .iter()
        .find(|d| d["kind"] == "ServiceMonitor" && d["metadata"]["name"] == "seedlink-onboard")
        .expect("the onboarding controller's ServiceMonitor");
    assert_eq!(
        sm["spec"]["endpoints"][0]["authorization"]["credentials"]["name"],
        "seedlink-admin-token"
    );
    // Off by default: none of it.
    let default = helm_template(&[]);
    assert!(!default.iter().any(|d| d["metadata"]["name"]
        .as_str()
        .is_some_and(|n| n.starts_with("seedlink-onboard"))));
}

/// `tunnelReplicaAddress` and `tunnelReplicaServerName` become the tunnel
/// file's `kubernetes.replica_addresses` (checked like every file the
/// chart renders); unset, there is none.
#[test]
fn replica_addresses_are_rendered_when_set() {
    let tunnel_file = |docs: &[Value]| -> Value {
        let cm = docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-config")
            .unwrap();
        serde_norway::from_str(cm["data"]["tunnel.yaml"].as_str().unwrap()).unwrap()
    };
    let docs = helm_template(&[
        "--set-json",
        r#"tunnelReplicaAddress="{pod}.tunnel.example.com:443""#,
        "--set-json",
        r#"tunnelReplicaServerName="{pod}.tunnel.example.com""#,
    ]);
    check_strictly(&docs);
    let file = tunnel_file(&docs);
    assert_eq!(
        file["kubernetes"]["replica_addresses"],
        json!({"address": "{pod}.tunnel.example.com:443", "server_name": "{pod}.tunnel.example.com"})
    );
    let file = tunnel_file(&helm_template(&[]));
    assert!(
        file["kubernetes"].get("replica_addresses").is_none(),
        "{file}"
    );
}

/// `tunnelTrustWatch=cluster` becomes the tunnel file's
/// `kubernetes.trust_watch` and binds `seedlink-tunnel-trust` to the
/// ServiceAccount cluster-wide; by default the trust is watched per
/// namespace and bound nowhere by the chart.
#[test]
fn a_cluster_wide_trust_watch_is_bound_cluster_wide() {
    let rendered = |set: &[&str]| -> (Value, bool) {
        let docs = helm_template(set);
        check_strictly(&docs);
        let cm = docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-config")
            .unwrap();
        let file: Value =
            serde_norway::from_str(cm["data"]["tunnel.yaml"].as_str().unwrap()).unwrap();
        let bound = docs.iter().any(|d| {
            d["kind"] == "ClusterRoleBinding"
                && d["roleRef"]["name"] == "seedlink-tunnel-trust"
                && d["subjects"][0]["name"] == "seedlink"
        });
        (file["kubernetes"]["trust_watch"].clone(), bound)
    };
    assert_eq!(rendered(&[]), (json!("namespaces"), false));
    assert_eq!(
        rendered(&["--set", "tunnelTrustWatch=cluster"]),
        (json!("cluster"), true)
    );
}

/// `kubeApiserverClientCATrust` is what the shared frontend trusts for
/// kube-apiservers' client certificates (a rotation's overlap), mounted
/// alone into the data plane's pods.
#[test]
fn a_client_ca_trust_bundle_is_what_the_shared_frontend_trusts() {
    let docs = helm_template(&[
        "--set",
        "kubeApiserverClientCA=seedlink-kas-client-ca",
        "--set",
        "kubeApiserverClientCATrust=seedlink-kas-client-trust",
    ]);
    check_strictly(&docs);
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "seedlink-config")
        .unwrap();
    let file: Value = serde_norway::from_str(cm["data"]["tunnel.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(
        file["shared_frontends"][0]["client_ca"],
        "/etc/seedlink/kas-client-trust/ca.crt"
    );
    let dep = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "seedlink")
        .unwrap();
    let volume = dep["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kas-client-trust")
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "seedlink-kas-client-trust");
    assert_eq!(volume["secret"]["items"][0]["key"], "ca.crt");
}
