//! A third control plane onboarded with one object (docs/KUBERNETES.md,
//! "Onboarding a control plane"), on the real cluster, under the load
//! through the first: the onboarding controller enabled on the running
//! install (`helm upgrade`), one `SeedlinkControlPlane`, and from what it
//! generates alone kube-apiserver's egress and the shoot's agents. Its API
//! server by SNI through the gateway; its node proxy, `kubectl logs`,
//! `exec`, `port-forward` and a webhook through the tunnel to the agent the
//! bundle runs; another tenant refused the names and the host it holds;
//! deleting the object removes everything generated (the garbage
//! collector, by the ownerReferences).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use seedlink_testkit::eventually_blocking;

use super::{
    control_plane_secrets, helm_cmd, jsonpath, kube_apiserver_pod,
    kubelet_and_webhook_through_the_tunnel, pod_get, reaches_the_shoot, reaches_through_the_tunnel,
    shoot_kubeconfig, shoot_node, Cluster, NS,
};

/// The onboarded control plane's namespace, and its object's name.
pub const ONBOARDED_NS: &str = "shoot--dev--c";
pub const ONBOARDED: &str = "api";
/// Its API server's public host name.
const ONBOARDED_HOST: &str = "api.dev-c.seed.test";
/// Another tenant, which asks for what the onboarded one and the first hold.
pub const GREEDY_NS: &str = "shoot--dev--x";
/// The destination its node-proxies name (GEP-30's form), on its
/// generated SeedlinkPolicy.
const ONBOARDED_DESTINATION: &str = "outbound|443||kube-apiserver.shoot--dev--c.svc.cluster.local";
/// Where its generated node-proxy serves `kubernetes` (another address
/// than the shoot chart's node-proxy on the same node), and its admin
/// port.
const ONBOARDED_NODE_PROXY: (&str, u16) = ("10.250.255.253", 443);
const ONBOARDED_NODE_PROXY_ADMIN: u16 = 9912;

/// What the controller generates for [`ONBOARDED`], by kind and name.
const GENERATED: [(&str, &str); 11] = [
    ("tlsroute", "api"),
    ("seedlinkpolicy", "api"),
    ("tunnelcluster", "api"),
    ("configmap", "api-agent-trust"),
    ("secret", "api-agent-ca"),
    ("secret", "api-agent"),
    ("secret", "api-shoot"),
    ("secret", "api-shoot-manifests"),
    ("configmap", "api-kube-apiserver-egress"),
    ("secret", "api-kube-apiserver-tunnel"),
    ("rolebinding", "api-seedlink-tunnel-trust"),
];

/// The whole onboarding, under the load (the step's caller counts it).
pub fn onboarding(c: &Cluster, chart: &str, lb: &str, kubectl: &Path, echo: &str) {
    enable_onboarding(c, chart, lb);
    let pki = onboarded_control_plane(c);
    let kubeconfig = shoot_kubeconfig(c, "onboarded", &format!("{lb}:443"), ONBOARDED_HOST, &pki);
    reaches_the_shoot(kubectl, &kubeconfig, "the onboarded API server by SNI");
    condition_is(c, ONBOARDED_NS, ONBOARDED, "RouteAccepted", "True");
    dns_as_external_dns_reads_it(c, lb);
    let manifests = agents_from_the_bundle(c);
    let node_proxy = node_proxy_from_the_bundle(c, kubectl, &pki);
    condition_is(c, ONBOARDED_NS, ONBOARDED, "TunnelReady", "True");
    shoot_node(c, &kubeconfig, echo);
    reaches_through_the_tunnel(kubectl, &kubeconfig, "the onboarded API server's egress");
    kubelet_and_webhook_through_the_tunnel(c, kubectl, &kubeconfig, &pki);
    condition_is(c, ONBOARDED_NS, ONBOARDED, "Ready", "True");
    rotated_under_a_dial_loop(c, kubectl, &kubeconfig, &manifests);
    the_expiry_metric(c);
    another_tenant_is_refused(c);
    deleting_removes_everything(c, kubectl, &kubeconfig);
    for f in [manifests, node_proxy] {
        c.kubectl_ok(&["delete", "-f", &f.display().to_string(), "--wait=false"]);
    }
}

/// `helm upgrade --reuse-values` with the onboarding controller on, told
/// where agents reach the tunnel-server (the load balancer) and where
/// kube-apiserver reaches its shared frontend (the internal Service). Its
/// pod runs under its own ServiceAccount.
fn enable_onboarding(c: &Cluster, chart: &str, lb: &str) {
    helm_cmd(
        c,
        &[
            "upgrade",
            "seedlink",
            chart,
            "--namespace",
            NS,
            "--reuse-values",
            "--set",
            "onboarding.enabled=true",
            "--set",
            &format!("onboarding.agentServer={lb}:8091"),
            "--set",
            "onboarding.serverName=seedlink",
            "--set",
            "onboarding.frontendAddress=seedlink-internal.seedlink-system.svc:8090",
            // The shoot's node-proxy, beside the shoot chart's on the same
            // node (as during a migration): its own address, link and
            // ports. This kernel has no dummy link type.
            "--set",
            &format!("onboarding.nodeProxy.gateway={lb}:8443"),
            "--set",
            &format!("onboarding.nodeProxy.address={}", ONBOARDED_NODE_PROXY.0),
            "--set",
            "onboarding.nodeProxy.linkKind=bridge",
            "--set",
            "onboarding.nodeProxy.interface=apiserver-prx2",
            "--set",
            &format!("onboarding.nodeProxy.adminPort={ONBOARDED_NODE_PROXY_ADMIN}"),
            "--set",
            "onboarding.nodeProxy.metricsPort=16911",
        ],
    );
    rolled_out_or_explained(c, "seedlink-onboard");
    let sa = jsonpath(
        c,
        &[
            "-n",
            NS,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=seedlink-onboard",
        ],
        "{.items[*].spec.serviceAccountName}",
    );
    assert_eq!(
        sa, "seedlink-onboard",
        "the onboarding pod's ServiceAccount"
    );
}

/// Waits for `deployment`'s rollout; if it does not finish, fails with
/// what its pods say: their status, events and logs.
fn rolled_out_or_explained(c: &Cluster, deployment: &str) {
    let at = format!("deployment/{deployment}");
    let o = c.kubectl(&["-n", NS, "rollout", "status", &at, "--timeout=600s"]);
    if o.status.success() {
        return;
    }
    let selector = format!("app.kubernetes.io/name={deployment}");
    let pods = c.kubectl(&["-n", NS, "describe", "pods", "-l", &selector]);
    let logs = c.kubectl(&["-n", NS, "logs", "-l", &selector, "--tail=100", "--prefix"]);
    panic!(
        "{at} did not roll out: {}\n--- pods\n{}\n--- logs\n{}{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&pods.stdout),
        String::from_utf8_lossy(&logs.stdout),
        String::from_utf8_lossy(&logs.stderr),
    );
}

/// The platform's part (the namespace, kube-apiserver's own PKI), then the
/// one object, then kube-apiserver mounting what the controller generated:
/// the egress ConfigMap, and its client certificate for the shared
/// frontend with the tunnel-server's CA. The namespace is not labelled for
/// the Gateway: the controller does it.
fn onboarded_control_plane(c: &Cluster) -> PathBuf {
    let pki = control_plane_secrets(c, ONBOARDED_NS, ONBOARDED_HOST, "shoot-c-pki");
    c.apply(&format!(
        "apiVersion: seedlink.dev/v1alpha1
kind: SeedlinkControlPlane
metadata: {{name: {ONBOARDED}, namespace: {ONBOARDED_NS}}}
spec:
  apiServer: {{service: kube-apiserver, hostnames: [{ONBOARDED_HOST}]}}
  nodes: {{destinations: ['{ONBOARDED_DESTINATION}']}}
"
    ));
    condition_is(c, ONBOARDED_NS, ONBOARDED, "Generated", "True");
    let generated = jsonpath(
        c,
        &["-n", ONBOARDED_NS, "get", "seedlinkcontrolplane", ONBOARDED],
        "{.status.generated}",
    );
    for (kind, name) in GENERATED.iter().filter(|(k, _)| *k != "secret") {
        assert!(
            generated.to_lowercase().contains(&format!("{kind}/{name}")),
            "status.generated: {generated}"
        );
    }
    kube_apiserver_pod(
        c,
        ONBOARDED_NS,
        ONBOARDED_HOST,
        &format!("{ONBOARDED}-kube-apiserver-egress"),
        &format!("{ONBOARDED}-kube-apiserver-tunnel"),
    );
    pki
}

/// The records external-dns's `gateway-tlsroute` source makes of the
/// generated route, read by its documented input (docs/sources/gateway.md
/// of external-dns): the route's `spec.hostnames`, narrowed by a TLS
/// listener of a Gateway in its `status.parents` whose `Accepted` is
/// True, pointing at that Gateway's `status.addresses`. Here: the host
/// name at the load balancer's address.
fn dns_as_external_dns_reads_it(c: &Cluster, lb: &str) {
    let json = |args: &[&str]| -> serde_json::Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&c.kubectl_ok(&a)).unwrap_or_default()
    };
    let route = json(&["-n", ONBOARDED_NS, "get", "tlsroute", ONBOARDED]);
    assert_eq!(
        route["spec"]["hostnames"],
        serde_json::json!([ONBOARDED_HOST]),
        "{route}"
    );
    let parents = route["status"]["parents"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let accepted = parents.iter().any(|p| {
        p["parentRef"]["name"] == "seedlink"
            && p["parentRef"]["namespace"] == NS
            && p["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Accepted" && c["status"] == "True")
    });
    assert!(accepted, "the route's status.parents: {parents:?}");
    let gw = json(&["-n", NS, "get", "gateway", "seedlink"]);
    let tls = gw["spec"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["protocol"] == "TLS")
        .cloned()
        .unwrap_or_default();
    // No listener hostname: the route's names are taken whole.
    assert!(tls["hostname"].is_null(), "the TLS listener: {tls}");
    let targets: Vec<&str> = gw["status"]["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["value"].as_str())
        .collect();
    assert!(
        targets.contains(&lb),
        "Gateway status.addresses: {targets:?}"
    );
    eprintln!("installed: DNS as external-dns's gateway-tlsroute reads it: {ONBOARDED_HOST} -> {targets:?}");
}

/// The shoot's side as a platform applies it: the generated manifests
/// (`Secret/api-shoot-manifests`, key `seedlink-agent.yaml`, what a
/// Gardener ManagedResource references) applied as they are with kubectl
/// (here the seed plays the shoot: into its kube-system). Returns the
/// file, to delete them again.
fn agents_from_the_bundle(c: &Cluster) -> PathBuf {
    let encoded = jsonpath(
        c,
        &[
            "-n",
            ONBOARDED_NS,
            "get",
            "secret",
            &format!("{ONBOARDED}-shoot-manifests"),
        ],
        "{.data.seedlink-agent\\.yaml}",
    );
    let f = c.dir.join("shoot-c-manifests.yaml");
    let text = super::run(
        Command::new("sh").args(["-c", &format!("printf '%s' '{encoded}' | base64 -d")]),
    );
    assert!(text.contains("kind: Deployment"), "the manifests: {text}");
    std::fs::write(&f, &text).unwrap();
    c.kubectl_ok(&["apply", "-f", &f.display().to_string()]);
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "rollout",
        "status",
        "deployment/seedlink-agent",
        "--timeout=600s",
    ]);
    f
}

/// The text under `key` of the onboarded object's Secret or ConfigMap
/// `name` (`data`, decoded for a Secret).
fn generated_text(c: &Cluster, kind: &str, name: &str, key: &str) -> String {
    let key = key.replace('.', "\\.");
    let got = jsonpath(
        c,
        &["-n", ONBOARDED_NS, "get", kind, name],
        &format!("{{.data.{key}}}"),
    );
    if kind != "secret" {
        return got;
    }
    super::run(Command::new("sh").args(["-c", &format!("printf '%s' '{got}' | base64 -d")]))
}

/// The agent CA rotated on demand (`spec.tunnel.rotation`) under a loop of
/// dials through the onboarded control plane's own tunnel: the trust names
/// both CAs, the new one signs the agents' certificate, the platform
/// applies the shoot's bundle again (as a ManagedResource would), the
/// kubelet updates the agents' files and each agent replaces its streams
/// without a restart. No dial fails.
fn rotated_under_a_dial_loop(c: &Cluster, kubectl: &Path, kubeconfig: &Path, manifests: &Path) {
    let asks = vec![(kubeconfig.to_path_buf(), super::VIA_TUNNEL)];
    let load = super::Load::start(kubectl.to_path_buf(), asks, c.netns.clone());
    load.wait_for(3);
    let ca_secret = format!("{ONBOARDED}-agent-ca");
    let before = generated_text(c, "secret", &ca_secret, "ca.crt");
    let rotate = r#"{"spec":{"tunnel":{"rotation":1}}}"#;
    let cp = [
        "-n",
        ONBOARDED_NS,
        "patch",
        "seedlinkcontrolplane",
        ONBOARDED,
    ];
    c.kubectl_ok(&[&cp[..], &["--type=merge", "-p", rotate]].concat());
    eventually_blocking(
        "the new CA signs the agents' certificate",
        Duration::from_secs(120),
        || {
            let ca = generated_text(c, "secret", &ca_secret, "ca.crt");
            let signer = generated_text(c, "secret", &format!("{ONBOARDED}-agent"), "ca.crt");
            let trust = generated_text(
                c,
                "configmap",
                &format!("{ONBOARDED}-agent-trust"),
                "ca.crt",
            );
            let both = trust.contains(ca.trim()) && trust.contains(before.trim());
            (ca != before && signer == ca && both)
                .then_some(())
                .ok_or("not yet")
        },
    );
    let text = generated_text(
        c,
        "secret",
        &format!("{ONBOARDED}-shoot-manifests"),
        "seedlink-agent.yaml",
    );
    std::fs::write(manifests, &text).unwrap();
    c.kubectl_ok(&["apply", "-f", &manifests.display().to_string()]);
    eventually_blocking(
        "each agent replaces its streams",
        Duration::from_secs(300),
        || {
            let logs = c.kubectl_ok(&[
                "-n",
                "kube-system",
                "logs",
                "-l",
                "app.kubernetes.io/name=seedlink-agent",
                "--tail=-1",
                "--prefix",
            ]);
            let changed = logs
                .lines()
                .filter(|l| l.contains("client certificate changed"));
            let pods: std::collections::HashSet<&str> =
                changed.filter_map(|l| l.split(']').next()).collect();
            (pods.len() >= 2).then_some(()).ok_or(logs)
        },
    );
    load.wait_for(10);
    let (sent, failed) = load.counts();
    eprintln!("installed: agent CA rotated under a loop of dials through the onboarded tunnel: {sent} dials, {failed} failed");
    assert_eq!(failed, 0, "{:?}", load.errors.lock().unwrap());
}

/// In-cluster clients of the onboarded shoot (GEP-08) through the
/// node-proxy from its generated manifests (key
/// `seedlink-node-proxy.yaml`, applied as it is): it serves `kubernetes`
/// on its address on the node and carries each connection to the
/// gateway's CONNECT listener, which routes the object's destination (its
/// generated SeedlinkPolicy) to the onboarded kube-apiserver. Returns the
/// file, to delete it again.
fn node_proxy_from_the_bundle(c: &Cluster, kubectl: &Path, pki: &Path) -> PathBuf {
    let encoded = jsonpath(
        c,
        &[
            "-n",
            ONBOARDED_NS,
            "get",
            "secret",
            &format!("{ONBOARDED}-shoot-manifests"),
        ],
        "{.data.seedlink-node-proxy\\.yaml}",
    );
    let f = c.dir.join("shoot-c-node-proxy.yaml");
    let text = super::run(
        Command::new("sh").args(["-c", &format!("printf '%s' '{encoded}' | base64 -d")]),
    );
    assert!(text.contains("kind: DaemonSet"), "the manifests: {text}");
    std::fs::write(&f, &text).unwrap();
    c.kubectl_ok(&["apply", "-f", &f.display().to_string()]);
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "rollout",
        "status",
        "daemonset/seedlink-apiserver-proxy",
        "--timeout=600s",
    ]);
    // Ready (its probe, what the rollout waited for) means a tunnel like
    // a client's got through to the onboarded API server.
    let (_, config) = pod_get("127.0.0.1", ONBOARDED_NODE_PROXY_ADMIN, "/config");
    assert!(
        config.contains(ONBOARDED_DESTINATION),
        "the generated node-proxy's /config: {config}"
    );
    let (address, port) = ONBOARDED_NODE_PROXY;
    let kubeconfig = shoot_kubeconfig(
        c,
        "onboarded-node-proxy",
        &format!("{address}:{port}"),
        "kubernetes.default.svc",
        pki,
    );
    reaches_the_shoot(
        kubectl,
        &kubeconfig,
        "the onboarded API server through its generated node-proxy",
    );
    f
}

/// The controller's pod exports the certificates' expiry of the onboarded
/// control plane on `/metrics`, with the admin token only.
fn the_expiry_metric(c: &Cluster) {
    let ip = jsonpath(
        c,
        &[
            "-n",
            NS,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=seedlink-onboard",
        ],
        "{.items[0].status.podIP}",
    );
    let anonymous = super::run(
        Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "10"])
            .arg(format!("http://{ip}:8094/metrics")),
    );
    assert_eq!(anonymous, "401", "/metrics without the token");
    let series = format!(
        "seedlink_onboard_certificates_not_after_seconds{{namespace=\"{ONBOARDED_NS}\",name=\"{ONBOARDED}\"}}"
    );
    eventually_blocking("the expiry metric", Duration::from_secs(60), || {
        let (code, body) = pod_get(&ip, 8094, "/metrics");
        (code == "200" && body.contains(&series))
            .then_some(())
            .ok_or(format!("{code}: {body}"))
    });
}

/// Another tenant's objects take nothing: one named `tunnel` in the first
/// shoot's namespace, whose TunnelCluster of that name is hand-written, is
/// refused (`NameTaken`) and leaves it alone; one in a namespace of its own
/// asking for the onboarded host name is refused by the gateway (its
/// RouteAccepted says why). Both say so on their status.
fn another_tenant_is_refused(c: &Cluster) {
    let first = super::SHOOT_NS;
    let before = jsonpath(
        c,
        &["-n", first, "get", "tunnelcluster", "tunnel"],
        "{.metadata.generation} {.metadata.ownerReferences}",
    );
    c.kubectl_ok(&["create", "namespace", GREEDY_NS]);
    c.apply(&format!(
        "apiVersion: v1
kind: Service
metadata: {{name: kube-apiserver, namespace: {GREEDY_NS}}}
spec: {{ports: [{{name: https, port: 443}}]}}
---
apiVersion: seedlink.dev/v1alpha1
kind: SeedlinkControlPlane
metadata: {{name: api, namespace: {GREEDY_NS}}}
spec:
  apiServer: {{service: kube-apiserver, hostnames: [{ONBOARDED_HOST}]}}
  tunnel: {{enabled: false}}
---
apiVersion: seedlink.dev/v1alpha1
kind: SeedlinkControlPlane
metadata: {{name: tunnel, namespace: {first}}}
spec:
  apiServer: {{service: kube-apiserver, hostnames: [api.dev-a-2.seed.test]}}
"
    ));
    let (_, reason) = condition_is(c, first, "tunnel", "Ready", "False");
    assert_eq!(reason, "NameTaken");
    let (_, reason) = condition_is(c, GREEDY_NS, "api", "RouteAccepted", "False");
    let message = jsonpath(
        c,
        &["-n", GREEDY_NS, "get", "seedlinkcontrolplane", "api"],
        "{.status.conditions[?(@.type==\"RouteAccepted\")].message}",
    );
    eprintln!(
        "installed: a second claim on the onboarded host name: RouteAccepted False, {reason}: {message}"
    );
    let after = jsonpath(
        c,
        &["-n", first, "get", "tunnelcluster", "tunnel"],
        "{.metadata.generation} {.metadata.ownerReferences}",
    );
    assert_eq!(before, after, "the first shoot's TunnelCluster was written");
    c.kubectl_ok(&["-n", first, "delete", "seedlinkcontrolplane", "tunnel"]);
    c.kubectl_ok(&["delete", "namespace", GREEDY_NS, "--wait=false"]);
}

/// Deleting the object: the garbage collector removes everything the
/// controller generated, and the gateway no longer serves its host name.
fn deleting_removes_everything(c: &Cluster, kubectl: &Path, kubeconfig: &Path) {
    c.kubectl_ok(&[
        "-n",
        ONBOARDED_NS,
        "delete",
        "seedlinkcontrolplane",
        ONBOARDED,
    ]);
    eventually_blocking(
        "everything generated is gone",
        Duration::from_secs(180),
        || {
            let left: Vec<String> = GENERATED
                .iter()
                .filter(|(kind, name)| {
                    c.kubectl(&["-n", ONBOARDED_NS, "get", kind, name, "-o", "name"])
                        .status
                        .success()
                })
                .map(|(kind, name)| format!("{kind}/{name}"))
                .collect();
            left.is_empty().then_some(()).ok_or(left.join(", "))
        },
    );
    eventually_blocking(
        "the host name is no longer served",
        Duration::from_secs(60),
        || {
            let o = Command::new(kubectl)
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .args(["get", "--raw", "/version", "--request-timeout=10s"])
                .output()
                .map_err(|e| e.to_string())?;
            (!o.status.success())
                .then_some(())
                .ok_or_else(|| "still served".to_string())
        },
    );
}

/// Waits until the object's condition `type_` has status `want`; returns
/// (status, reason).
fn condition_is(c: &Cluster, ns: &str, name: &str, type_: &str, want: &str) -> (String, String) {
    eventually_blocking(
        &format!("{ns}/{name}: {type_}={want}"),
        Duration::from_secs(180),
        || {
            let got = jsonpath(
                c,
                &["-n", ns, "get", "seedlinkcontrolplane", name],
                &format!(
                    "{{.status.conditions[?(@.type==\"{type_}\")].status}} {{.status.conditions[?(@.type==\"{type_}\")].reason}}"
                ),
            );
            let (status, reason) = got.split_once(' ').unwrap_or((&got, ""));
            (status == want)
                .then(|| (status.to_string(), reason.to_string()))
                .ok_or(got.clone())
        },
    )
}
