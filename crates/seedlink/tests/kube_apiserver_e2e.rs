//! kube-apiserver's own egress through the tunnel, end to end with the real
//! consumer: a shoot's kube-apiserver (v1.35, etcd, RBAC; from the test
//! kit) runs in the "seed" (this process's namespace) with the
//! EgressSelectorConfiguration and flags `seedlink tunnel-config` renders,
//! unmodified; `seedlink tunnel-server` runs next to it; `seedlink
//! tunnel-agent` runs in a "shoot" network namespace with a ServiceAccount
//! token that kube-apiserver issued (audience `system:konnectivity-server`)
//! and the tunnel-server checks by TokenReview at it. The shoot's workloads
//! (tests/peers/shoot_apps.py) sit on addresses only the shoot can reach:
//! a pod IP, a node IP, and a Service ClusterIP translated by an iptables
//! DNAT rule like kube-proxy's. Driven by kubectl (v1.35, built from its
//! module):
//! - a validating admission webhook (Service reference, both failure
//!   policies),
//! - an aggregated API (APIService),
//! - the service proxy and the node proxy,
//! - `kubectl logs`, `exec` and `port-forward` to a real kubelet (with
//!   containerd and runc), and the same paths against a kubelet API served
//!   by tests/peers/shoot_apps.py for streams that never end,
//!
//! each again with the agent killed.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use seedlink_testkit as common;

use common::kubeapi::{self, KubeApi, Options};
use common::tunnel_env::{ready_line, spawn_until_up, Started};
use common::{eventually, free_port, netns_to_host, require, seedlink_bin, Gw, Netns, Proc};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NET: u8 = 110;
const CLUSTER: &str = "shoot--e2e--a";
const POD_IP: &str = "10.244.1.5";
const NODE_IP: &str = "10.250.0.10";
const SVC_IP: &str = "10.97.0.50";
const TUNNEL_NAME: &str = "tunnel.seedlink.test";
const API_NAME: &str = "api.shoot-e2e.seedlink.test";
/// The `kubernetes` Service's ClusterIP (the first of the service range).
const KUBERNETES_V4: &str = "10.97.0.1";
/// The same on IPv6 (a DNAT rule like kube-proxy's; the API server itself
/// runs single-stack IPv4).
const KUBERNETES_V6: &str = "fd00:97::1";
/// GEP-08: the address kube-apiserver advertises, served by the
/// node-proxy on every node.
const ADVERTISE_V4: &str = "10.1.2.3";
const ADVERTISE_V6: &str = "fd00:1:2::3";
const DEST: &str = "outbound|443||kube-apiserver.shoot--e2e--a.svc.cluster.local";
/// A webhook and an aggregated API in the seed, beside the control plane:
/// the shoot's ExternalName Service `seed-hooks` names this host, which
/// kube-apiserver asks its `cluster` egress for and the tunnel-server
/// dials in the seed (on this namespace's loopback), not through the
/// agent. (A webhook given by `url` goes through the `controlplane`
/// egress instead: kube-apiserver dials it itself.)
const SEED_HOOKS: &str = "seed-hooks.shoot--e2e--a.svc";

/// How kube-apiserver reaches the tunnel-server.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Egress {
    /// HTTPConnect over the cluster's own Unix socket.
    ConnectUds,
    /// gRPC over the cluster's own Unix socket (KKP's and Kamaji's
    /// sidecar mode).
    GrpcUds,
    /// HTTPConnect over TCP with mTLS to a frontend shared by every
    /// cluster, the client certificate's CN naming the cluster (GEP-11's
    /// `tcp: https://proxy-server:8131`, the install's shared frontend).
    SharedMtls(u16),
}

/// Every file the test bed writes.
struct Files {
    egress: Egress,
    dir: PathBuf,
    seed_ca: PathBuf,
    reviewer_token: PathBuf,
    agent_token: PathBuf,
    apps_ca_pem: String,
    /// The seed webhook's port (on 127.0.0.1).
    seed_hooks: u16,
}

impl Files {
    fn new(dir: &Path) -> Files {
        Files::with(dir, Egress::ConnectUds)
    }

    fn with(dir: &Path, egress: Egress) -> Files {
        let w = |name: &str, text: &str| {
            std::fs::write(dir.join(name), text).unwrap();
            dir.join(name)
        };
        let tunnel = seedlink::demo::Pki::generate(&[TUNNEL_NAME]).unwrap();
        let apps = seedlink::demo::Pki::generate(&[
            "shoot-apps.shoot-system.svc",
            "seed-hooks.shoot-system.svc",
        ])
        .unwrap();
        let kubelet = seedlink::demo::Pki::generate(&[NODE_IP]).unwrap();
        w("tun.pem", &tunnel.servers[0].1.cert_pem);
        w("tun-key.pem", &tunnel.servers[0].1.key_pem);
        w("apps.pem", &apps.servers[0].1.cert_pem);
        w("apps-key.pem", &apps.servers[0].1.key_pem);
        w("seed-hooks.pem", &apps.servers[1].1.cert_pem);
        w("seed-hooks-key.pem", &apps.servers[1].1.key_pem);
        w("kubelet-ca.pem", &kubelet.ca_pem);
        w("kubelet.pem", &kubelet.servers[0].1.cert_pem);
        w("kubelet-key.pem", &kubelet.servers[0].1.key_pem);
        w("kas-kubelet.pem", &kubelet.client.cert_pem);
        w("kas-kubelet-key.pem", &kubelet.client.key_pem);
        // The shared frontend's certificate and kube-apiserver's client
        // certificate for it (CN: the cluster), from one CA.
        let fe = seedlink::demo::Pki::generate_with_client(&["127.0.0.1"], CLUSTER).unwrap();
        w("fe-ca.pem", &fe.ca_pem);
        w("fe.pem", &fe.servers[0].1.cert_pem);
        w("fe-key.pem", &fe.servers[0].1.key_pem);
        w("kas-fe.pem", &fe.client.cert_pem);
        w("kas-fe-key.pem", &fe.client.key_pem);
        Files {
            egress,
            dir: dir.to_path_buf(),
            seed_ca: w("seed-ca.pem", &tunnel.ca_pem),
            // Replaced once the API server issues them.
            reviewer_token: w("reviewer.token", "not-issued-yet"),
            agent_token: w("agent.token", "not-issued-yet"),
            apps_ca_pem: apps.ca_pem,
            seed_hooks: free_port(),
        }
    }

    fn p(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The tunnel-server's configuration: one cluster trusting the shoot
    /// API server's tokens (TokenReview there), one HTTP CONNECT socket.
    fn server_yaml(&self, agents: &str, kas_url: &str, kas_ca: &Path) -> String {
        let (frontends, shared) = match self.egress {
            Egress::ConnectUds => (
                format!("      - {{name: kas, protocol: http-connect, unix: '{}'}}\n", self.p("kas.sock")),
                String::new(),
            ),
            Egress::GrpcUds => (
                format!("      - {{name: kas-grpc, protocol: grpc, unix: '{}'}}\n", self.p("kas-grpc.sock")),
                String::new(),
            ),
            Egress::SharedMtls(port) => (
                String::new(),
                format!(
                    "shared_frontends:\n  - {{name: kas-mtls, protocol: http-connect, tcp: '127.0.0.1:{port}', cert: '{}', key: '{}', client_ca: '{}'}}\n",
                    self.p("fe.pem"),
                    self.p("fe-key.pem"),
                    self.p("fe-ca.pem")
                ),
            ),
        };
        let frontends = match frontends.is_empty() {
            true => "    frontends: []\n".to_string(),
            false => format!("    frontends:\n{frontends}"),
        };
        format!(
            "agents: {{listen: '{agents}', cert: '{}', key: '{}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
dial_timeout: 10s
clusters:
  - name: {CLUSTER}
    agent_token:
      issuer: 'https://kubernetes.default.svc'
      review: {{url: '{kas_url}', ca: '{}', token_file: '{}'}}
    seed_destinations:
      - {{host: '{SEED_HOOKS}', ports: [{}], addresses: ['127.0.0.1']}}
{frontends}{shared}",
            self.p("tun.pem"),
            self.p("tun-key.pem"),
            kas_ca.display(),
            self.reviewer_token.display(),
            self.seed_hooks,
        )
    }
}

/// `seedlink tunnel-config` for the cluster, written into `out`; the
/// kube-apiserver flags it rendered.
fn render(
    files: &Files,
    agents: &str,
    version: &str,
    advertise: Option<&str>,
    out: &Path,
) -> Vec<String> {
    render_with(files, agents, version, advertise, out, &[])
}

/// [`render`] with more `tunnel-config` arguments.
fn render_with(
    files: &Files,
    agents: &str,
    version: &str,
    advertise: Option<&str>,
    out: &Path,
    extra: &[&str],
) -> Vec<String> {
    let mut cmd = Command::new(seedlink_bin());
    cmd.arg("tunnel-config").args(extra);
    if let Egress::SharedMtls(port) = files.egress {
        // As on a seed: the frontend listens on every address of the pod,
        // kube-apiserver reaches it through a Service.
        cmd.args(["--frontend", "kas-mtls", "--frontend-address"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--kas-ca")
            .arg(files.p("fe-ca.pem"))
            .arg("--kas-cert")
            .arg(files.p("kas-fe.pem"))
            .arg("--kas-key")
            .arg(files.p("kas-fe-key.pem"));
    }
    if let Some(a) = advertise {
        cmd.args(["--advertise-address", a]);
    }
    let st = cmd
        .arg("--config")
        .arg(files.dir.join("server.yaml"))
        .args(["--cluster", CLUSTER, "--agent-server", agents])
        .args(["--server-name", TUNNEL_NAME, "--agent-ca-cert"])
        .arg(&files.seed_ca)
        .arg("--agent-token")
        .arg(&files.agent_token)
        .args(["--egress-api-version", version, "--egress-file"])
        .arg(out.join("egress-selector-configuration.yaml"))
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "tunnel-config: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    lines(&out.join("kube-apiserver.args"))
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The shoot's kube-apiserver: the rendered egress flags, its kubelet
/// client credentials, a service range of its own. The server
/// configuration is written (with the URL and CA the API server will
/// have) and rendered before it starts, as an operator would.
async fn shoot_apiserver(
    files: &Arc<Files>,
    agents: &str,
    version: &str,
    advertise: Option<&str>,
) -> KubeApi {
    let f = files.clone();
    let agents = agents.to_string();
    let version = version.to_string();
    let advertise = advertise.map(str::to_string);
    let opts = Options {
        args: vec![
            format!("--kubelet-certificate-authority={}", f.p("kubelet-ca.pem")),
            format!("--kubelet-client-certificate={}", f.p("kas-kubelet.pem")),
            format!("--kubelet-client-key={}", f.p("kas-kubelet-key.pem")),
            "--kubelet-preferred-address-types=InternalIP".into(),
            "--service-cluster-ip-range=10.97.0.0/16".into(),
        ],
        args_for: Some(Arc::new(move |url: &str, ca: &Path| {
            std::fs::write(f.dir.join("server.yaml"), f.server_yaml(&agents, url, ca)).unwrap();
            render(
                &f,
                &agents,
                &version,
                advertise.as_deref(),
                &f.dir.join(format!("rendered-{version}")),
            )
        })),
        // The gateway's SNI name, and the `kubernetes` Service's addresses
        // in-cluster clients dial (IPv4 and IPv6).
        names: vec![API_NAME.into(), KUBERNETES_V4.into(), KUBERNETES_V6.into()],
        ..Options::default()
    };
    tokio::task::spawn_blocking(move || KubeApi::start_with(opts))
        .await
        .unwrap()
}

/// The service proxy's and the node proxy's paths to the shoot's greetings.
const SVC_PROXY: &str = "/api/v1/namespaces/shoot-system/services/https:shoot-apps:443/proxy/hello";
const NODE_PROXY: &str = "/api/v1/nodes/shoot-node-1/proxy/hello";

/// kube-apiserver's service proxy (to the endpoint) and node proxy (to the
/// kubelet port) answer with what only the shoot's workloads say.
fn proxies_reach_the_shoot(api: &KubeApi, what: &str) {
    for (path, want) in [
        (SVC_PROXY, "hello from the shoot's service"),
        (NODE_PROXY, "hello from the shoot's kubelet"),
    ] {
        let o = kubectl(api, &["get", "--raw", path]);
        assert!(text(&o).contains(want), "{what}: {}", text(&o));
    }
}

fn kubectl(api: &KubeApi, args: &[&str]) -> Output {
    kubectl_in(api, args, "")
}

/// kubectl as the cluster's admin, `stdin` piped in; bounded by
/// `--request-timeout`.
fn kubectl_in(api: &KubeApi, args: &[&str], stdin: &str) -> Output {
    let mut c = Command::new(api.kube_dir.join("bin/kubectl"))
        .arg("--kubeconfig")
        .arg(&api.admin_kubeconfig)
        .arg("--request-timeout=30s")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all_sync(stdin.as_bytes());
    c.wait_with_output().unwrap()
}

trait WriteAllSync {
    fn write_all_sync(self, b: &[u8]);
}

impl WriteAllSync for std::process::ChildStdin {
    fn write_all_sync(mut self, b: &[u8]) {
        use std::io::Write;
        let _ = self.write_all(b);
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The credentials the shoot's API server issues, written where the
/// tunnel-server and the agent read them: the tunnel-server's own (a
/// reviewer bound to system:auth-delegator) and the agent's (audience
/// system:konnectivity-server), as projected tokens would be.
async fn issue_credentials(api: &KubeApi, files: &Files) {
    let c = api.client().await.unwrap();
    for o in [
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "konnectivity-agent", "namespace": "kube-system"}}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "seedlink-tunnel", "namespace": "kube-system"}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "seedlink-tunnel-reviews"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": "system:auth-delegator"},
               "subjects": [{"kind": "ServiceAccount", "name": "seedlink-tunnel",
                             "namespace": "kube-system"}]}),
    ] {
        kubeapi::apply(&c, o).await;
    }
    std::fs::write(
        &files.reviewer_token,
        api.token(&c, "kube-system", "seedlink-tunnel").await,
    )
    .unwrap();
    std::fs::write(
        &files.agent_token,
        api.token_for(
            &c,
            "kube-system",
            "konnectivity-agent",
            "system:konnectivity-server",
        )
        .await,
    )
    .unwrap();
}

/// A ConfigMap that the webhooks select with `webhook: <policy>`.
fn configmap(name: &str, policy: &str) -> String {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": "work", "labels": {"webhook": policy}}})
    .to_string()
}

/// The shoot's objects: the Service in front of the apps pod (ClusterIP,
/// Endpoints and EndpointSlice written by hand: no controllers run; the
/// service proxy only goes to an address whose targetRef is a pod with
/// that IP), the webhooks, the APIService, the node and the pod on it that
/// serves it all.
async fn shoot_objects(api: &KubeApi, files: &Files) {
    let c = api.client().await.unwrap();
    // base64, as k8s-openapi serializes bytes.
    let ca = serde_json::to_value(k8s_openapi::ByteString(
        files.apps_ca_pem.as_bytes().to_vec(),
    ))
    .unwrap();
    let svc_ref = json!({"name": "shoot-apps", "namespace": "shoot-system", "port": 443});
    let webhooks: Vec<Value> = ["Fail", "Ignore"]
        .iter()
        .map(|p| {
            json!({
                "name": format!("{}.demo.seedlink.test", p.to_lowercase()),
                "failurePolicy": p,
                "objectSelector": {"matchLabels": {"webhook": p.to_lowercase()}},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"],
                           "operations": ["CREATE"], "resources": ["configmaps"]}],
                "clientConfig": {"service": {"name": "shoot-apps", "namespace": "shoot-system",
                                             "path": "/validate", "port": 443},
                                 "caBundle": ca},
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            })
        })
        .collect();
    for o in [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shoot-system"}}),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "work"}}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "default", "namespace": "work"}}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "default", "namespace": "shoot-system"}}),
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "shoot-apps", "namespace": "shoot-system"},
               "spec": {"clusterIP": SVC_IP,
                        "ports": [{"name": "https", "port": 443, "targetPort": 8443}]}}),
        json!({"apiVersion": "v1", "kind": "Endpoints",
               "metadata": {"name": "shoot-apps", "namespace": "shoot-system"},
               "subsets": [{"addresses": [{"ip": POD_IP, "targetRef": {
                                "kind": "Pod", "namespace": "shoot-system", "name": "shoot-apps-0"}}],
                            "ports": [{"name": "https", "port": 8443}]}]}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "shoot-apps-1", "namespace": "shoot-system",
                            "labels": {"kubernetes.io/service-name": "shoot-apps"}},
               "addressType": "IPv4",
               "endpoints": [{"addresses": [POD_IP], "conditions": {"ready": true}}],
               "ports": [{"name": "https", "port": 8443, "protocol": "TCP"}]}),
        json!({"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "ValidatingWebhookConfiguration",
               "metadata": {"name": "shoot-webhook"},
               "webhooks": webhooks}),
        json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
               "metadata": {"name": "v1.demo.seedlink.test"},
               "spec": {"group": "demo.seedlink.test", "version": "v1", "service": svc_ref,
                        "caBundle": ca, "groupPriorityMinimum": 1000, "versionPriority": 15}}),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "shoot-node-1"}}),
    ] {
        kubeapi::apply(&c, o).await;
    }
    for (ns, name) in [("work", "web-0"), ("shoot-system", "shoot-apps-0")] {
        kubeapi::apply(
            &c,
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": ns},
                   "spec": {"nodeName": "shoot-node-1", "automountServiceAccountToken": false,
                            "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}),
        )
        .await;
        kubeapi::patch_status(
            &c,
            "v1",
            "Pod",
            ns,
            name,
            json!({"status": {"phase": "Running", "podIP": POD_IP, "podIPs": [{"ip": POD_IP}]}}),
        )
        .await
        .unwrap();
    }
    // What a kubelet would report: its address and port, the pod running.
    kubeapi::patch_status(
        &c,
        "v1",
        "Node",
        "",
        "shoot-node-1",
        json!({"status": {
            "addresses": [{"type": "InternalIP", "address": NODE_IP}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}}}}),
    )
    .await
    .unwrap();
}

/// The shoot: a namespace joined to this one only by `198.18.<NET>.0/24`,
/// the pod and node addresses on its loopback, kube-proxy's DNAT for the
/// Service, and the workloads.
fn shoot(files: &Files) -> (Netns, Proc) {
    shoot_on(files, NET)
}

fn shoot_on(files: &Files, net: u8) -> (Netns, Proc) {
    shoot_with(files, net, true)
}

/// The shoot on `net`; `fake_kubelet`: shoot_apps.py serves the kubelet's
/// API at the node address (else a real kubelet will).
fn shoot_with(files: &Files, net: u8, fake_kubelet: bool) -> (Netns, Proc) {
    require("iptables");
    require("python3");
    let ns = Netns::new("kshoot");
    netns_to_host(&ns, net);
    for a in [POD_IP, NODE_IP] {
        ns.run(&["ip", "addr", "add", &format!("{a}/32"), "dev", "lo"]);
    }
    // A node routes the service range somewhere (its default route); the
    // DNAT below rewrites the address before a packet would leave.
    ns.run(&[
        "ip",
        "route",
        "add",
        "10.97.0.0/16",
        "via",
        &format!("198.18.{net}.1"),
    ]);
    ns.run(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "OUTPUT",
        "-d",
        &format!("{SVC_IP}/32"),
        "-p",
        "tcp",
        "--dport",
        "443",
        "-j",
        "DNAT",
        "--to-destination",
        &format!("{POD_IP}:8443"),
    ]);
    let apps = spawn_until_up(ns.cmd(&[
        "python3",
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/shoot_apps.py"),
        &format!("{POD_IP}:8443"),
        &files.p("apps.pem"),
        &files.p("apps-key.pem"),
        &if fake_kubelet {
            format!("{NODE_IP}:10250")
        } else {
            "none".into()
        },
        &files.p("kubelet.pem"),
        &files.p("kubelet-key.pem"),
        &files.p("kubelet-ca.pem"),
    ]));
    (ns, apps)
}

/// A free address for the tunnel-server's agents on the seed side of
/// the shoot's link (`198.18.<net>.1`).
fn agents_address(net: u8) -> String {
    let l = std::net::TcpListener::bind(format!("198.18.{net}.1:0")).unwrap();
    l.local_addr().unwrap().to_string()
}

/// `seedlink tunnel-server` with the configuration the test bed wrote.
fn tunnel_server(files: &Files) -> Started {
    start(
        Command::new(seedlink_bin())
            .args(["tunnel-server", "--config"])
            .arg(files.dir.join("server.yaml")),
    )
}

fn start(cmd: &mut Command) -> Started {
    let mut proc = Proc(
        cmd.env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let ready = ready_line(&mut proc.0);
    assert_eq!(ready["event"], "ready", "{ready}");
    Started { proc, ready }
}

/// The agent with exactly the arguments `tunnel-config` wrote.
fn agent(ns: &Netns, rendered: &Path) -> Started {
    start(
        ns.cmd(&[seedlink_bin(), "tunnel-agent"])
            .args(lines(&rendered.join("tunnel-agent.args")))
            .args(["--admin", "127.0.0.1:0"]),
    )
}

/// A raw upgrade through kube-apiserver (as kubectl's SPDY path does):
/// POST `path` with `Upgrade: SPDY/3.1` as the admin, over TLS. The
/// stream after the answer's head, and the head.
async fn upgrade(
    api: &KubeApi,
    path: &str,
) -> (
    tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    String,
) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&api.ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let certs: Vec<_> = CertificateDer::pem_file_iter(api.dir.join("admin.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(api.dir.join("admin-key.pem")).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(certs, key)
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(api.addr).await.unwrap();
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\n\
             Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: portforward.k8s.io\r\n\
             X-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut b))
            .await
            .expect("an answer within 30 s")
            .unwrap();
        assert!(n == 1, "closed before the head: {head:?}");
        head.push(b[0]);
    }
    (s, String::from_utf8_lossy(&head).into_owned())
}

/// Sends `msg` and reads it back (the kubelet side echoes).
async fn echo<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(s: &mut S, msg: &[u8]) {
    s.write_all(msg).await.unwrap();
    let mut got = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut got))
        .await
        .expect("the echo within 30 s")
        .unwrap();
    assert_eq!(got, msg);
}

/// The webhook (through the Service's ClusterIP, DNAT in the shoot) and
/// the aggregated API answer with what only the shoot's workloads say.
async fn the_webhook_and_the_aggregated_api_answer_from_the_shoot(api: &KubeApi) {
    eventually("the webhook admits", Duration::from_secs(60), async || {
        let o = kubectl_in(api, &["create", "-f", "-"], &configmap("allowed-1", "fail"));
        o.status.success().then_some(()).ok_or_else(|| text(&o))
    })
    .await;
    let o = kubectl_in(api, &["create", "-f", "-"], &configmap("deny-1", "fail"));
    assert!(!o.status.success());
    assert!(
        text(&o).contains("denied by the shoot's webhook"),
        "{}",
        text(&o)
    );

    // The aggregated API.
    eventually(
        "the APIService is available",
        Duration::from_secs(90),
        async || {
            let o = kubectl(
                api,
                &[
                    "get",
                    "apiservice",
                    "v1.demo.seedlink.test",
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Available\")].status}",
                ],
            );
            (text(&o).trim() == "True")
                .then_some(())
                .ok_or_else(|| text(&o))
        },
    )
    .await;
    let o = kubectl(
        api,
        &["get", "--raw", "/apis/demo.seedlink.test/v1/greetings"],
    );
    assert!(text(&o).contains("hello-from-the-shoot"), "{}", text(&o));
    let o = kubectl(api, &["get", "greetings.demo.seedlink.test", "-o", "name"]);
    assert!(text(&o).contains("hello-from-the-shoot"), "{}", text(&o));
}

/// The seed's webhook: the same app as the shoot's, on this namespace's
/// loopback, saying "the seed's" (a name only the tunnel-server's seed
/// path reaches).
fn seed_hooks(files: &Files) -> Proc {
    let mut cmd = Command::new("python3");
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/peers/shoot_apps.py"
    ))
    .arg(format!("127.0.0.1:{}", files.seed_hooks))
    .args([files.p("seed-hooks.pem"), files.p("seed-hooks-key.pem")])
    .args(["none", "-", "-", "-"])
    .env("APPS_WHO", "the seed's")
    .env("APPS_GROUP", "seed.seedlink.test")
    .env("APPS_PLACE", "the-seed");
    spawn_until_up(cmd)
}

/// A ConfigMap in `work` with `labels`.
fn labelled_configmap(name: &str, labels: Value) -> String {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": "work", "labels": labels}})
    .to_string()
}

/// A webhook and an aggregated API in the seed (the shoot's ExternalName
/// Service `seed-hooks` names `SEED_HOOKS`) beside the shoot's, under the
/// one `cluster` egress selector: an object both webhooks select passes
/// both; one the seed's selects alone is denied by the seed's; the seed's
/// API answers.
async fn a_seed_webhook_answers_beside_the_shoots(api: &KubeApi, files: &Files) {
    let c = api.client().await.unwrap();
    let ca = serde_json::to_value(k8s_openapi::ByteString(
        files.apps_ca_pem.as_bytes().to_vec(),
    ))
    .unwrap();
    let port = files.seed_hooks;
    let svc = json!({"name": "seed-hooks", "namespace": "shoot-system", "port": port});
    for o in [
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "seed-hooks", "namespace": "shoot-system"},
               "spec": {"type": "ExternalName", "externalName": SEED_HOOKS,
                        "ports": [{"name": "https", "port": port}]}}),
        json!({"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "ValidatingWebhookConfiguration",
               "metadata": {"name": "seed-webhook"},
               "webhooks": [{
                   "name": "seed.demo.seedlink.test",
                   "failurePolicy": "Fail",
                   "objectSelector": {"matchLabels": {"seed-hook": "yes"}},
                   "rules": [{"apiGroups": [""], "apiVersions": ["v1"],
                              "operations": ["CREATE"], "resources": ["configmaps"]}],
                   "clientConfig": {"service": {"name": "seed-hooks", "namespace": "shoot-system",
                                                "path": "/validate", "port": port},
                                    "caBundle": ca},
                   "sideEffects": "None",
                   "admissionReviewVersions": ["v1"],
                   "timeoutSeconds": 10}]}),
        json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
               "metadata": {"name": "v1.seed.seedlink.test"},
               "spec": {"group": "seed.seedlink.test", "version": "v1", "service": svc,
                        "caBundle": ca, "groupPriorityMinimum": 1000, "versionPriority": 15}}),
    ] {
        kubeapi::apply(&c, o).await;
    }
    let both = json!({"webhook": "fail", "seed-hook": "yes"});
    eventually("both webhooks admit", Duration::from_secs(60), async || {
        let o = kubectl_in(
            api,
            &["create", "-f", "-"],
            &labelled_configmap("both-1", both.clone()),
        );
        o.status.success().then_some(()).ok_or_else(|| text(&o))
    })
    .await;
    the_seed_webhook_denies(api, "deny-seed-1");
    eventually(
        "the seed's API answers",
        Duration::from_secs(90),
        async || {
            let o = kubectl(
                api,
                &["get", "--raw", "/apis/seed.seedlink.test/v1/greetings"],
            );
            text(&o)
                .contains("hello-from-the-seed")
                .then_some(())
                .ok_or_else(|| text(&o))
        },
    )
    .await;
}

/// The seed's webhook denies `name` (selected by it alone).
fn the_seed_webhook_denies(api: &KubeApi, name: &str) {
    let o = kubectl_in(
        api,
        &["create", "-f", "-"],
        &labelled_configmap(name, json!({"seed-hook": "yes"})),
    );
    assert!(
        !o.status.success() && text(&o).contains("denied by the seed's webhook"),
        "{}",
        text(&o)
    );
}

/// No agent: the Fail webhook refuses, the Ignore one admits; every other
/// path answers an error instead of hanging.
fn without_an_agent_every_path_answers_an_error(api: &KubeApi) {
    let o = kubectl_in(
        api,
        &["create", "-f", "-"],
        &configmap("unchecked-1", "fail"),
    );
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("failed calling webhook"), "{}", text(&o));
    let o = kubectl_in(
        api,
        &["create", "-f", "-"],
        &configmap("unchecked-2", "ignore"),
    );
    assert!(o.status.success(), "{}", text(&o));
    for path in [
        SVC_PROXY,
        NODE_PROXY,
        "/apis/demo.seedlink.test/v1/greetings",
    ] {
        let o = kubectl(api, &["get", "--raw", path]);
        assert!(!o.status.success(), "{path}: {}", text(&o));
    }
    let o = kubectl(api, &["logs", "-n", "work", "web-0", "-c", "app"]);
    assert!(!o.status.success(), "{}", text(&o));
}

/// The agent joined with the token kube-apiserver issued, checked by a
/// TokenReview there (the reviewer's identity is in the audit log).
fn the_agent_joined_with_a_reviewed_token(api: &KubeApi) {
    let reviews = api
        .audit()
        .iter()
        .filter(|e| {
            e["objectRef"]["resource"] == "tokenreviews"
                && e["user"]["username"] == "system:serviceaccount:kube-system:seedlink-tunnel"
        })
        .count();
    assert!(reviews >= 1, "no TokenReview by the tunnel-server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_apiserver_reaches_the_shoot_only_through_the_tunnel() {
    let dir = tempfile::tempdir().unwrap();
    let files = Arc::new(Files::new(dir.path()));
    let (ns, _apps) = shoot(&files);
    let agents = agents_address(NET);
    let api = shoot_apiserver(&files, &agents, "v1beta1", None).await;
    let rendered = files.dir.join("rendered-v1beta1");

    // What was rendered is what runs: every egress entry, loaded by the
    // real kube-apiserver.
    let egress: Value = serde_norway::from_str(
        &std::fs::read_to_string(rendered.join("egress-selector-configuration.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(egress["egressSelections"].as_array().unwrap().len(), 3);

    issue_credentials(&api, &files).await;
    shoot_objects(&api, &files).await;

    let server = tunnel_server(&files);
    let mut agent_proc = agent(&ns, &rendered);

    // The shoot's addresses exist only inside the shoot's namespace (no
    // route leads there from here; a connect is not dialed here to prove
    // it, since this machine's default route answers any address): every
    // answer below carries what only the shoot's workloads say.

    the_webhook_and_the_aggregated_api_answer_from_the_shoot(&api).await;
    let _seed_hooks = seed_hooks(&files);
    a_seed_webhook_answers_beside_the_shoots(&api, &files).await;

    // The service proxy (to the endpoint) and the node proxy (to the
    // kubelet port).
    proxies_reach_the_shoot(&api, "");

    // kubectl logs, through the kubelet API.
    let o = kubectl(&api, &["logs", "-n", "work", "web-0", "-c", "app"]);
    assert!(
        text(&o).contains("log line from the shoot's kubelet"),
        "{}",
        text(&o)
    );

    // Upgraded streams: port-forward and exec reach the kubelet through
    // kube-apiserver's own dialer, bytes both ways.
    let (mut pf, head) = upgrade(&api, "/api/v1/namespaces/work/pods/web-0/portforward").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    for i in 0..10usize {
        echo(&mut pf, &vec![b'a' + i as u8; 1000 + i * 7000]).await;
    }
    let (mut ex, head) = upgrade(
        &api,
        "/api/v1/namespaces/work/pods/web-0/exec?container=app&command=sh&stdin=true&stdout=true",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    echo(&mut ex, b"echo through exec\n").await;

    // The agent killed mid-stream. Through the node proxy (kube-apiserver's
    // reverse proxy) the client sees an error, not a clean end; `kubectl
    // logs -f` ends (kube-apiserver's log streamer ends a log whose source
    // broke off as it ends a finished one, whatever the egress: a kubelet
    // that dies looks the same); the open upgraded stream ends.
    let followers = [
        vec!["logs", "-f", "-n", "work", "web-0", "-c", "app"],
        vec![
            "get",
            "--raw",
            "/api/v1/nodes/shoot-node-1/proxy/containerLogs/work/web-0/app?follow=true",
        ],
    ]
    .map(|args| {
        let mut c = Command::new(api.kube_dir.join("bin/kubectl"))
            .arg("--kubeconfig")
            .arg(&api.admin_kubeconfig)
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Read on a thread: three lines first (told by `None`), then the
        // rest and the exit; every wait on it is bounded.
        let out = c.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let what = format!("{args:?}");
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut lines = std::io::BufReader::new(out).lines();
            for _ in 0..3 {
                let l = lines.next().and_then(Result::ok).unwrap_or_default();
                assert!(l.starts_with("follow "), "{what}: {l:?}");
            }
            let _ = tx.send(None);
            let rest: Vec<String> = lines.map_while(Result::ok).collect();
            let _ = tx.send(Some((c.wait_with_output(), rest.join("\n"))));
        });
        assert!(rx
            .recv_timeout(Duration::from_secs(60))
            .expect("three lines within 60 s")
            .is_none());
        rx
    });
    agent_proc.proc.0.kill().unwrap();
    agent_proc.proc.0.wait().unwrap();
    let mut ended = Vec::new();
    for rx in followers {
        let (done, rest) = rx
            .recv_timeout(Duration::from_secs(90))
            .expect("a follower still running 90 s after the agent died")
            .unwrap();
        let done = done.unwrap();
        // What arrived is the stream, in order, cut off.
        assert!(rest.lines().all(|l| l.starts_with("follow ")), "{rest:?}");
        ended.push(done);
    }
    assert!(
        !ended[1].status.success(),
        "the node proxy's stream ended cleanly: {}",
        text(&ended[1])
    );
    for (what, stream) in [("port-forward", &mut pf), ("exec", &mut ex)] {
        let mut rest = Vec::new();
        let end =
            tokio::time::timeout(Duration::from_secs(90), stream.read_to_end(&mut rest)).await;
        assert!(end.is_ok(), "the {what} stream outlived its agent");
    }

    without_an_agent_every_path_answers_an_error(&api);
    // The seed's webhook needs no agent.
    the_seed_webhook_denies(&api, "deny-seed-2");

    // The agent back: everything works again.
    let _agent = agent(&ns, &rendered);
    eventually("the webhook is back", Duration::from_secs(60), async || {
        let o = kubectl_in(&api, &["create", "-f", "-"], &configmap("deny-2", "fail"));
        text(&o)
            .contains("denied by the shoot's webhook")
            .then_some(())
            .ok_or_else(|| text(&o))
    })
    .await;
    let o = kubectl(&api, &["logs", "-n", "work", "web-0", "-c", "app"]);
    assert!(o.status.success(), "{}", text(&o));

    the_agent_joined_with_a_reviewed_token(&api);
    drop(server);
}

/// The other EgressSelectorConfiguration version kube-apiserver reads,
/// rendered and loaded: the service proxy goes through the tunnel with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_v1alpha1_egress_selector_is_loaded_too() {
    let dir = tempfile::tempdir().unwrap();
    let files = Arc::new(Files::new(dir.path()));
    let (ns, _apps) = shoot_on(&files, NET + 1);
    let agents = agents_address(NET + 1);
    let api = shoot_apiserver(&files, &agents, "v1alpha1", None).await;
    let rendered = files.dir.join("rendered-v1alpha1");
    let egress =
        std::fs::read_to_string(rendered.join("egress-selector-configuration.yaml")).unwrap();
    assert!(egress.contains("apiserver.k8s.io/v1alpha1"), "{egress}");
    issue_credentials(&api, &files).await;
    shoot_objects(&api, &files).await;
    let _server = tunnel_server(&files);
    let _agent = agent(&ns, &rendered);
    let svc = SVC_PROXY;
    eventually("the service proxy", Duration::from_secs(60), async || {
        let o = kubectl(&api, &["get", "--raw", svc]);
        text(&o)
            .contains("hello from the shoot's service")
            .then_some(())
            .ok_or_else(|| text(&o))
    })
    .await;
}

/// kube-apiserver's egress over the two other transports it has: gRPC
/// over a Unix socket (the sidecar mode) and HTTPConnect over TCP with
/// mTLS to a frontend shared by every cluster, whose client certificate
/// names the cluster. Each rendered by `tunnel-config`, loaded by the
/// real kube-apiserver, and carrying a webhook, the service proxy and the
/// node proxy into the shoot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_apiserver_egress_over_grpc_and_the_shared_mtls_frontend() {
    for (i, egress) in [Egress::GrpcUds, Egress::SharedMtls(free_port())]
        .into_iter()
        .enumerate()
    {
        let net = NET + 4 + i as u8;
        let dir = tempfile::tempdir().unwrap();
        let files = Arc::new(Files::with(dir.path(), egress));
        let (ns, _apps) = shoot_on(&files, net);
        let agents = agents_address(net);
        let api = shoot_apiserver(&files, &agents, "v1beta1", None).await;
        let rendered = files.dir.join("rendered-v1beta1");
        let selector =
            std::fs::read_to_string(rendered.join("egress-selector-configuration.yaml")).unwrap();
        match egress {
            Egress::GrpcUds => assert!(selector.contains("proxyProtocol: GRPC"), "{selector}"),
            _ => assert!(
                selector.contains("https://127.0.0.1:")
                    && selector.contains(&format!("CN {CLUSTER}")),
                "{selector}"
            ),
        }
        issue_credentials(&api, &files).await;
        shoot_objects(&api, &files).await;
        let _server = tunnel_server(&files);
        let _agent = agent(&ns, &rendered);
        eventually(
            &format!("{egress:?}: the webhook admits"),
            Duration::from_secs(60),
            async || {
                let o = kubectl_in(
                    &api,
                    &["create", "-f", "-"],
                    &configmap("allowed-1", "fail"),
                );
                o.status.success().then_some(()).ok_or_else(|| text(&o))
            },
        )
        .await;
        let o = kubectl_in(&api, &["create", "-f", "-"], &configmap("deny-1", "fail"));
        assert!(
            text(&o).contains("denied by the shoot's webhook"),
            "{egress:?}: {}",
            text(&o)
        );
        proxies_reach_the_shoot(&api, &format!("{egress:?}"));
    }
}

/// A kubeconfig for `server` (SNI `name` when given) with the admin's
/// client certificate, or a bearer token.
fn kubeconfig(api: &KubeApi, path: &Path, server: &str, name: Option<&str>, token: Option<&str>) {
    let sni = name.map_or(String::new(), |n| format!("\n    tls-server-name: {n}"));
    let user = match token {
        Some(t) => format!("token: {t}"),
        None => format!(
            "client-certificate: {}\n    client-key: {}",
            api.dir.join("admin.pem").display(),
            api.dir.join("admin-key.pem").display()
        ),
    };
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority: {}{sni}\nusers:\n- name: u\n  user:\n    {user}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
            api.ca.display()
        ),
    )
    .unwrap();
}

/// GEP-08: the `default/kubernetes` EndpointSlice's first endpoint, once it
/// is the advertised address.
async fn advertised_endpoint(api: &KubeApi) -> String {
    let mut endpoint = None;
    eventually("default/kubernetes", Duration::from_secs(30), async || {
        let o = kubectl(
            api,
            &[
                "get",
                "endpointslice",
                "-n",
                "default",
                "kubernetes",
                "-o",
                "jsonpath={.endpoints[0].addresses[0]}:{.ports[0].port}",
            ],
        );
        let t = String::from_utf8_lossy(&o.stdout).to_string();
        (t.starts_with(ADVERTISE_V4))
            .then(|| endpoint = Some(t.clone()))
            .ok_or(text(&o))
    })
    .await;
    endpoint.unwrap()
}

/// kube-proxy's rule for the `kubernetes` Service on the node: its ClusterIP
/// to the endpoint kube-apiserver advertises (`ip`:`p`, and the same on
/// IPv6); the service ranges routed, as on a node.
fn route_the_kubernetes_service(node: &Netns, ip: &str, p: &str) {
    for (cmd, svc, target) in [
        ("iptables", KUBERNETES_V4, format!("{ip}:{p}")),
        ("ip6tables", KUBERNETES_V6, format!("[{ADVERTISE_V6}]:{p}")),
    ] {
        node.run(&[
            cmd,
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-d",
            svc,
            "-p",
            "tcp",
            "--dport",
            "443",
            "-j",
            "DNAT",
            "--to-destination",
            &target,
        ]);
    }
    node.run(&["ip", "-6", "route", "add", "fd00:97::/108", "dev", "lo"]);
}

/// kubectl with a client certificate through the gateway's SNI
/// passthrough: the API server sees the certificate (mTLS end to end).
fn kubectl_passes_through_with_its_certificate(api: &KubeApi, files: &Files, gw: &Gw) {
    let kc = files.dir.join("via-gateway.kubeconfig");
    let via_gateway = format!("https://{}", gw.listener("tls"));
    kubeconfig(api, &kc, &via_gateway, Some(API_NAME), None);
    let o = Command::new(api.kube_dir.join("bin/kubectl"))
        .arg("--kubeconfig")
        .arg(&kc)
        .args([
            "auth",
            "whoami",
            "-o",
            "jsonpath={.status.userInfo.username}",
        ])
        .output()
        .unwrap();
    assert_eq!(text(&o).trim(), "test-admin", "{}", text(&o));
}

/// GEP-08 and GEP-30 with the real consumer: kubectl (client certificate)
/// through the gateway's SNI passthrough to the shoot's kube-apiserver; and
/// an in-cluster client in the shoot (its ServiceAccount token) dialing the
/// `kubernetes` ClusterIP, which a DNAT rule like kube-proxy's sends to the
/// address kube-apiserver advertises (`--advertise-address` as
/// `tunnel-config` renders it; the DNAT target read from the real
/// `default/kubernetes` EndpointSlice), where the node-proxy carries it to
/// the gateway by CONNECT + `X-Gardener-Destination`, then by HTTP/2
/// CONNECT; IPv4 and IPv6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_and_in_cluster_clients_reach_their_api_server_through_the_gateway() {
    let net = NET + 2;
    let dir = tempfile::tempdir().unwrap();
    let files = Arc::new(Files::new(dir.path()));
    let (node, _apps) = shoot_on(&files, net);
    let agents = agents_address(net);
    let api = shoot_apiserver(&files, &agents, "v1beta1", Some(ADVERTISE_V4)).await;
    let rendered = files.dir.join("rendered-v1beta1");
    assert!(lines(&rendered.join("kube-apiserver.args"))
        .contains(&format!("--advertise-address={ADVERTISE_V4}")));
    let port = api.addr.port();

    // GEP-08: `default/kubernetes` points at the advertised address.
    let c = api.client().await.unwrap();
    let endpoint = advertised_endpoint(&api).await;
    assert_eq!(endpoint, format!("{ADVERTISE_V4}:{port}"));

    // The gateway: SNI passthrough for kubectl, CONNECT for node-proxies
    // (reachable from the shoot's nodes).
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: tls, address: '127.0.0.1:0'}}
  - {{name: connect, address: '198.18.{net}.1:0', protocol: http-connect}}
control_planes:
  - name: shoot--e2e--a
    hostnames: [{API_NAME}]
    endpoints: ['{}']
    destinations: [{{name: '{DEST}'}}]
",
        api.addr
    ));

    kubectl_passes_through_with_its_certificate(&api, &files, &gw);

    // The in-cluster client's identity and the node's plumbing.
    for o in [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "apps"}}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "reader", "namespace": "apps"}}),
    ] {
        kubeapi::apply(&c, o).await;
    }
    let token = api.token(&c, "apps", "reader").await;
    let (ip, p) = endpoint.rsplit_once(':').unwrap();
    route_the_kubernetes_service(&node, ip, p);

    let connect = gw.listener("connect");
    // The node-proxy's configuration as `tunnel-config` renders it for the
    // shoot, now that the gateway's address is known (the kube-apiserver
    // flags it renders again are the ones running). One line is added:
    // this kernel has no dummy links.
    let shoot_out = files.dir.join("rendered-shoot");
    let again = render_with(
        &files,
        &agents,
        "v1beta1",
        Some(ADVERTISE_V4),
        &shoot_out,
        &[
            "--gateway",
            &connect.to_string(),
            "--destination",
            DEST,
            "--kube-apiserver-port",
            p,
        ],
    );
    // The same flags (but the file's own path) and the same egress file.
    assert_eq!(
        again[1..],
        lines(&rendered.join("kube-apiserver.args"))[1..]
    );
    let egress =
        |d: &Path| std::fs::read_to_string(d.join("egress-selector-configuration.yaml")).unwrap();
    assert_eq!(egress(&shoot_out), egress(&rendered));
    let np_yaml = files.dir.join("node-proxy.yaml");
    std::fs::write(
        &np_yaml,
        std::fs::read_to_string(shoot_out.join("node-proxy.yaml"))
            .unwrap()
            .replace("link_kind: dummy", "link_kind: bridge")
            .replace("interface: apiserver-proxy", "interface: sl-apiproxy"),
    )
    .unwrap();
    for mode in ["connect", "http2-connect"] {
        for (address, svc) in [
            (ADVERTISE_V4, KUBERNETES_V4.to_string()),
            (ADVERTISE_V6, format!("[{KUBERNETES_V6}]")),
        ] {
            let mut cmd = node.cmd(&[seedlink_bin(), "node-proxy"]);
            if mode == "connect" && address == ADVERTISE_V4 {
                // The rendered file.
                cmd.arg("--config").arg(&np_yaml);
            } else {
                cmd.args(["--address", address, "--port", p])
                    .args(["--link-kind", "bridge", "--interface", "sl-apiproxy"])
                    .args(["--gateway", &connect.to_string(), "--mode", mode])
                    .args(["--destination", DEST, "--admin", "127.0.0.1:0"]);
            }
            let np = start(&mut cmd);
            let kc = files.dir.join(format!("pod-{mode}-{address}.kubeconfig"));
            kubeconfig(&api, &kc, &format!("https://{svc}:443"), None, Some(&token));
            let o = node
                .cmd(&[
                    api.kube_dir.join("bin/kubectl").to_str().unwrap(),
                    "--kubeconfig",
                ])
                .arg(&kc)
                .args(["--request-timeout=20s", "auth", "whoami"])
                .args(["-o", "jsonpath={.status.userInfo.username}"])
                .output()
                .unwrap();
            assert_eq!(
                text(&o).trim(),
                "system:serviceaccount:apps:reader",
                "{mode} {address}: {}",
                text(&o)
            );
            drop(np);
        }
    }
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"connect\",protocol=\"http2-connect\",control_plane=\"shoot--e2e--a\"}",
        2.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"connect\",protocol=\"http-connect:x-gardener-destination\",control_plane=\"shoot--e2e--a\"}",
        2.0,
    )
    .await;
}

/// A shoot node's containerd and kubelet, stopped in this order (the
/// fields drop in order: the kubelet, containerd, then what they left).
struct KubeletNode {
    _kubelet: Proc,
    _containerd: Proc,
    _cleanup: NodeCleanup,
    /// The node's directory (its logs).
    dir: PathBuf,
}

/// `args` run in `node`'s network namespace only: `ip netns exec` would
/// also remount /sys, hiding the cgroup mounts runc and the kubelet need.
fn in_node(node: &Netns, args: &[&str]) -> Command {
    let mut c = Command::new(require("nsenter"));
    c.arg(format!("--net=/run/netns/{}", node.0)).args(args);
    c
}

/// containerd in the node's namespace (a hostNetwork pod's containers
/// share it) with the image imported: the process and its socket.
async fn containerd_on(node: &Netns, d: &Path, image: &Path) -> (Proc, PathBuf) {
    let ctr = require("ctr");
    let sock = d.join("containerd.sock");
    std::fs::write(
        d.join("containerd.toml"),
        format!(
            "version = 2\nroot = \"{r}/root\"\nstate = \"{r}/state\"\n[grpc]\n  address = \"{s}\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"localhost/busybox:1\"\n  restrict_oom_score_adj = true\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"native\"\n",
            r = d.display(),
            s = sock.display()
        ),
    )
    .unwrap();
    let containerd = Proc(
        in_node(node, &["containerd", "--config"])
            .arg(d.join("containerd.toml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("containerd.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually("containerd", Duration::from_secs(30), async || {
        let o = Command::new(&ctr)
            .arg("--address")
            .arg(&sock)
            .args(["-n", "k8s.io", "images", "import"])
            .args(["--base-name", "localhost/busybox"])
            .arg(image)
            .output()
            .unwrap();
        o.status.success().then_some(()).ok_or_else(|| text(&o))
    })
    .await;
    (containerd, sock)
}

/// The node: containerd, then the kubelet serving the node's address with
/// the certificate kube-apiserver verifies, trusting kube-apiserver's
/// client certificate, and registering through the gateway `gw`.
async fn kubelet_node(api: &KubeApi, files: &Files, node: &Netns, gw: &Gw) -> KubeletNode {
    let (kubelet_bin, image) = node_peers();
    require("containerd");
    require("runc");
    let d = files.dir.join("node");
    std::fs::create_dir_all(&d).unwrap();
    let cleanup = NodeCleanup {
        netns: node.0.clone(),
        dir: d.clone(),
    };
    let (containerd, sock) = containerd_on(node, &d, &image).await;
    let kc = d.join("kubelet.kubeconfig");
    let via_gateway = format!("https://{}", gw.listener("tls"));
    kubeconfig(api, &kc, &via_gateway, Some(API_NAME), None);
    let (cert, key, ca) = (
        files.p("kubelet.pem"),
        files.p("kubelet-key.pem"),
        files.p("kubelet-ca.pem"),
    );
    std::fs::write(
        d.join("kubelet.yaml"),
        seedlink_testkit::cluster::kubelet_config(
            NODE_IP,
            &sock,
            Path::new(&ca),
            Some((Path::new(&cert), Path::new(&key))),
        ),
    )
    .unwrap();
    let kubelet = Proc(
        in_node(node, &[kubelet_bin.to_str().unwrap(), "--config"])
            .arg(d.join("kubelet.yaml"))
            .arg("--kubeconfig")
            .arg(&kc)
            .args(["--hostname-override", "shoot-node-1", "--node-ip", NODE_IP])
            .arg("--root-dir")
            .arg(d.join("kubelet"))
            .args(["-v", "2"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("kubelet.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually("the node registers", Duration::from_secs(120), async || {
        let o = kubectl(api, &["get", "node", "shoot-node-1", "-o", "name"]);
        o.status
            .success()
            .then_some(())
            .ok_or_else(|| format!("{}\n{}", text(&o), tail(&d.join("kubelet.log"))))
    })
    .await;
    KubeletNode {
        _kubelet: kubelet,
        _containerd: containerd,
        _cleanup: cleanup,
        dir: d,
    }
}

/// `work/web-0` on the node: a container that logs a numbered line every
/// 100 ms, and an echo server on port 8080; running.
async fn the_pod_runs(api: &KubeApi, node: &KubeletNode) {
    let c = api.client().await.unwrap();
    for o in [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "work"}}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "default", "namespace": "work"}}),
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "web-0", "namespace": "work"},
               "spec": {"nodeName": "shoot-node-1", "hostNetwork": true,
                        "automountServiceAccountToken": false,
                        "containers": [
                            {"name": "app", "image": "localhost/busybox:1",
                             "imagePullPolicy": "Never",
                             "command": ["/bin/sh", "-c",
                                         "i=0; while true; do echo line $i; i=$((i+1)); sleep 0.1; done"]},
                            {"name": "echo", "image": "localhost/busybox:1",
                             "imagePullPolicy": "Never",
                             "command": ["/bin/nc", "-ll", "-p", "8080", "-e", "/bin/cat"]}]}}),
    ] {
        kubeapi::apply(&c, o).await;
    }
    let phase = [
        "get",
        "pod",
        "-n",
        "work",
        "web-0",
        "-o",
        "jsonpath={.status.phase}",
    ];
    eventually("the pod runs", Duration::from_secs(40), async || {
        let o = kubectl(api, &phase);
        (text(&o).trim() == "Running")
            .then_some(())
            .ok_or_else(|| format!("{}\n{}", text(&o), tail(&node.dir.join("kubelet.log"))))
    })
    .await;
}

/// `kubectl logs` and `exec` (with 100 kB on stdin), and the node proxy to
/// the kubelet's own API: kube-apiserver dials the kubelet through the
/// tunnel.
async fn logs_exec_and_the_node_proxy_go_through_the_tunnel(api: &KubeApi) {
    eventually("kubectl logs", Duration::from_secs(30), async || {
        let o = kubectl(api, &["logs", "-n", "work", "web-0", "-c", "app"]);
        text(&o)
            .contains("line 1")
            .then_some(())
            .ok_or_else(|| text(&o))
    })
    .await;
    let exec = ["exec", "-n", "work", "web-0", "-c", "app", "--"];
    let o = kubectl(
        api,
        &[&exec[..], &["echo", "exec through the tunnel"]].concat(),
    );
    assert_eq!(text(&o).trim(), "exec through the tunnel", "{}", text(&o));
    let stdin = [
        "exec", "-i", "-n", "work", "web-0", "-c", "app", "--", "wc", "-c",
    ];
    let o = kubectl_in(api, &stdin, &"x".repeat(100_000));
    assert_eq!(text(&o).trim(), "100000", "{}", text(&o));
    let healthz = "/api/v1/nodes/shoot-node-1/proxy/healthz";
    let o = kubectl(api, &["get", "--raw", healthz]);
    assert_eq!(text(&o).trim(), "ok", "{}", text(&o));
}

/// `kubectl port-forward` to the pod's echo server, through the tunnel,
/// with five messages of up to 81 kB echoed: the port-forward and its
/// local port.
async fn port_forward_goes_through_the_tunnel(api: &KubeApi) -> (Proc, u16) {
    let local = free_port();
    let mut pf = Proc(
        Command::new(api.kube_dir.join("bin/kubectl"))
            .arg("--kubeconfig")
            .arg(&api.admin_kubeconfig)
            .args(["port-forward", "-n", "work", "pod/web-0"])
            .arg(format!("{local}:8080"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(pf.0.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("Forwarding from"), "{line:?}");
    }
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", local))
        .await
        .unwrap();
    for i in 0..5usize {
        echo(&mut s, &vec![b'0' + i as u8; 1000 + i * 20_000]).await;
    }
    (pf, local)
}

/// A following `kubectl logs -f`: a receiver that first gets `None` after
/// three lines, then the lines and how kubectl exited.
type Followed =
    std::sync::mpsc::Receiver<Option<(Vec<String>, std::io::Result<std::process::ExitStatus>)>>;

fn follow_the_logs(api: &KubeApi) -> Followed {
    let mut follow = Command::new(api.kube_dir.join("bin/kubectl"))
        .arg("--kubeconfig")
        .arg(&api.admin_kubeconfig)
        .args([
            "logs", "-f", "-n", "work", "web-0", "-c", "app", "--tail", "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = follow.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut lines = Vec::new();
        for l in std::io::BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            lines.push(l);
            if lines.len() == 3 {
                let _ = tx.send(None);
            }
        }
        let _ = tx.send(Some((lines, follow.wait())));
    });
    rx
}

/// The agent killed under a following `kubectl logs -f` and an open
/// port-forward (on `local`): both end (no hang), and what arrived is the
/// log in order; then, with no agent, exec fails with an error.
async fn the_agent_dies_under_a_follow_and_a_forward(
    api: &KubeApi,
    mut agent: Started,
    local: u16,
) {
    let follow = follow_the_logs(api);
    assert!(follow
        .recv_timeout(Duration::from_secs(60))
        .expect("three log lines within 60 s")
        .is_none());
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", local))
        .await
        .unwrap();
    echo(&mut s, b"before the agent goes").await;
    agent.proc.0.kill().unwrap();
    agent.proc.0.wait().unwrap();
    let (lines, _) = follow
        .recv_timeout(Duration::from_secs(90))
        .expect("kubectl logs -f still running 90 s after the agent died")
        .unwrap();
    let numbers: Vec<u64> = lines
        .iter()
        .map(|l| l.strip_prefix("line ").unwrap().parse().unwrap())
        .collect();
    assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{lines:?}");
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(90), s.read_to_end(&mut rest)).await;
    assert!(
        end.is_ok(),
        "the port-forward connection outlived the agent"
    );
    let o = kubectl(
        api,
        &["exec", "-n", "work", "web-0", "-c", "app", "--", "true"],
    );
    assert!(!o.status.success(), "{}", text(&o));
}

/// A real kubelet (v1.35, from its module) on the shoot's node, with
/// containerd and runc (Debian's) and a busybox image built locally:
/// `kubectl logs`, `exec` and `port-forward` go from kube-apiserver through
/// the tunnel to it, with kubectl's own protocols end to end. The kubelet
/// reaches its API server through the gateway (SNI passthrough), as a
/// shoot's kubelets reach theirs through the seed's load balancer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_kubelet_serves_logs_exec_and_port_forward_through_the_tunnel() {
    let net = NET + 3;
    let dir = tempfile::tempdir().unwrap();
    let files = Arc::new(Files::new(dir.path()));
    let (node, _apps) = shoot_with(&files, net, false);
    let agents = agents_address(net);
    let api = shoot_apiserver(&files, &agents, "v1beta1", None).await;
    let rendered = files.dir.join("rendered-v1beta1");
    issue_credentials(&api, &files).await;
    let _server = tunnel_server(&files);
    // The agent from the agent.yaml `tunnel-config` rendered.
    let agent = start(
        node.cmd(&[seedlink_bin(), "tunnel-agent", "--config"])
            .arg(rendered.join("agent.yaml")),
    );
    // The seed's load balancer for the kubelet's own API calls.
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '198.18.{net}.1:0'}}]
control_planes:
  - {{name: shoot--e2e--a, hostnames: [{API_NAME}], endpoints: ['{}']}}
",
        api.addr
    ));
    let kubelet = kubelet_node(&api, &files, &node, &gw).await;
    the_pod_runs(&api, &kubelet).await;
    logs_exec_and_the_node_proxy_go_through_the_tunnel(&api).await;
    let (_pf, local) = port_forward_goes_through_the_tunnel(&api).await;
    the_agent_dies_under_a_follow_and_a_forward(&api, agent, local).await;
}

/// The kubelet binary and the node image scripts/build-kube-peers made.
fn node_peers() -> (PathBuf, PathBuf) {
    let (kubelet, image) = match (
        std::env::var("SEEDLINK_KUBELET"),
        std::env::var("SEEDLINK_NODE_IMAGE"),
    ) {
        (Ok(k), Ok(i)) => (PathBuf::from(k), PathBuf::from(i)),
        _ => {
            let dir = kubeapi::kube_dir();
            (dir.join("bin/kubelet"), dir.join("images/busybox.oci.tar"))
        }
    };
    for p in [&kubelet, &image] {
        assert!(
            p.exists(),
            "{} is missing: scripts/build-kube-peers builds it (scripts/install-peers runs it)",
            p.display()
        );
    }
    (kubelet, image)
}

/// The last lines of a log file (what a failure message shows).
fn tail(p: &Path) -> String {
    let t = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = t.lines().filter(|l| !l.contains("flags.go")).collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// What a node leaves behind, removed when the test ends however it ends:
/// every process in its network namespace (containerd's shims and the
/// containers outlive containerd, and would keep the namespace and its
/// veth, with the seed-side address, alive), then every mount under its
/// directory (the kubelet's and containerd's, made in this mount
/// namespace).
struct NodeCleanup {
    netns: String,
    dir: PathBuf,
}

impl Drop for NodeCleanup {
    fn drop(&mut self) {
        seedlink_testkit::cluster::stop_node(&self.netns, &self.dir);
    }
}

/// The control plane's name the spreading test reaches its replicas by.
const SPREAD_NAME: &str = "api.spread.seedlink.test";

/// The `--goaway-chance` flag `tunnel-config` renders at `chance`, for a
/// cluster of a minimal server configuration.
fn rendered_goaway(chance: f64) -> String {
    let cfg = seedlink_tunnel::config::ServerConfig::parse(
        "agents: {listen: '127.0.0.1:8132', cert: c.pem, key: k.pem}
clusters:
  - {name: a, agent_ca: ca.pem, frontends: [{name: uds, protocol: http-connect, unix: /run/seedlink/a.sock}]}
",
    )
    .unwrap();
    let opts = seedlink::egress::Options {
        goaway_chance: chance,
        ..seedlink::egress::Options::new("a")
    };
    let r = seedlink::egress::render(&cfg, &opts).unwrap();
    let mut flags = r.kube_apiserver_args.into_iter();
    flags
        .find(|a| a.starts_with("--goaway-chance="))
        .expect("no --goaway-chance rendered")
}

/// The bearer token every replica of the spreading test takes (a static
/// token file): kube-apiserver ends an unauthenticated client's HTTP/2
/// connection after each request (its mitigation of HTTP/2 floods), so
/// the client must be one that authenticates, as controllers are.
const SPREAD_TOKEN: &str = "spread-token";

/// Three kube-apiserver replicas with `flags`, each advertising
/// 10.1.2.<i> (what `/api` tells a client: which one answered) and
/// taking [`SPREAD_TOKEN`], behind one gateway as one control plane by
/// SNI passthrough; with curl's pins of their keys.
async fn replicas_behind_the_gateway(flags: &[String]) -> (Vec<KubeApi>, Gw, String) {
    let tokens = tempfile::tempdir().unwrap();
    let token_file = tokens.path().join("tokens.csv");
    std::fs::write(&token_file, format!("{SPREAD_TOKEN},spread,spread-uid\n")).unwrap();
    let starts = (1..=3).map(|i| {
        let mut args = flags.to_vec();
        args.push(format!("--advertise-address=10.1.2.{i}"));
        args.push(format!("--token-auth-file={}", token_file.display()));
        tokio::task::spawn_blocking(move || {
            KubeApi::start_with(Options {
                args,
                names: vec![SPREAD_NAME.into()],
                ..Default::default()
            })
        })
    });
    let apis: Vec<KubeApi> = futures_util::future::join_all(starts)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let pins: Vec<String> = apis
        .iter()
        .map(|a| pin_of(&a.dir.join("apiserver.pem")))
        .collect();
    let endpoints: Vec<String> = apis.iter().map(|a| format!("'{}'", a.addr)).collect();
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
control_planes:
  - {{name: spread, hostnames: [{SPREAD_NAME}], endpoints: [{}]}}
",
        endpoints.join(", ")
    ));
    (apis, gw, pins.join(";"))
}

/// curl's `--pinnedpubkey` for the certificate in `pem`: the SHA-256 of
/// its public key (openssl computes it).
fn pin_of(pem: &Path) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg("openssl x509 -in \"$1\" -pubkey -noout | openssl pkey -pubin -outform der | openssl dgst -sha256 -binary | openssl base64 -A")
        .arg("pin")
        .arg(pem)
        .output()
        .unwrap();
    assert!(out.status.success(), "openssl: {}", text(&out));
    format!("sha256//{}", String::from_utf8_lossy(&out.stdout).trim())
}

/// `n` requests from one curl (HTTP/2, one connection for as long as the
/// server keeps it) through the gateway: how many each replica answered,
/// by its advertised address.
fn answered_by(gw: &Gw, pins: &str, n: usize) -> std::collections::BTreeMap<String, usize> {
    let port = gw.tls.port();
    let url = format!("https://{SPREAD_NAME}:{port}/api");
    // Each replica's serving certificate is pinned, not chained: the
    // test kit's three CAs have the same subject, and OpenSSL, looking an
    // issuer up by name, checks a certificate against the wrong one.
    let out = Command::new("curl")
        .args([
            "--http2",
            "-sS",
            "--fail",
            "--insecure",
            "--pinnedpubkey",
            pins,
        ])
        .args(["--resolve", &format!("{SPREAD_NAME}:{port}:127.0.0.1")])
        .args(["-H", &format!("Authorization: Bearer {SPREAD_TOKEN}")])
        .args(std::iter::repeat_n(&url, n))
        .output()
        .unwrap();
    assert!(out.status.success(), "curl: {}", text(&out));
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut by = std::collections::BTreeMap::new();
    for v in serde_json::Deserializer::from_str(&body).into_iter::<Value>() {
        let v = v.unwrap();
        let at = v["serverAddressByClientCIDRs"][0]["serverAddress"]
            .as_str()
            .unwrap_or_else(|| panic!("no serverAddress in {v}"));
        let host = at.rsplit_once(':').map_or(at, |(h, _)| h).to_string();
        *by.entry(host).or_insert(0) += 1;
    }
    by
}

/// gardener#8810: behind the gateway's passthrough an HTTP/2 client stays
/// on the replica its connection reached. With the `--goaway-chance`
/// `tunnel-config` renders (here at kube-apiserver's highest, 0.02, so
/// that 600 requests see about 12), kube-apiserver tells the client now
/// and then to reconnect, and its requests spread over the three
/// replicas; without it, all 600 go to one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goaway_chance_spreads_one_http2_client_over_the_replicas() {
    require("curl");
    const N: usize = 600;
    let flag = rendered_goaway(0.02);
    assert_eq!(flag, "--goaway-chance=0.02");
    let flag_shown = flag.clone();
    require("openssl");
    let (apis, gw, pins) = replicas_behind_the_gateway(&[flag]).await;
    let by = answered_by(&gw, &pins, N);
    assert_eq!(by.values().sum::<usize>(), N, "{by:?}");
    assert!(by.len() >= 2, "one replica answered everything: {by:?}");
    eprintln!("with {flag_shown}: answered by {by:?}");
    drop((apis, gw));
    let (apis, gw, pins) = replicas_behind_the_gateway(&[]).await;
    let by = answered_by(&gw, &pins, N);
    assert_eq!(by.values().sum::<usize>(), N, "{by:?}");
    assert_eq!(by.len(), 1, "without the flag, still spread: {by:?}");
    eprintln!("without it: answered by {by:?}");
    drop((apis, gw));
}
