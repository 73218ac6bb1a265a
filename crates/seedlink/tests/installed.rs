//! seedlink installed as a seed operator installs it: `helm install
//! charts/seedlink` on a real one-node cluster (testkit `cluster`: kube-apiserver,
//! etcd, kube-controller-manager, kube-scheduler, a kubelet with containerd
//! and CNI, kube-proxy, a LoadBalancer stand-in), the image scripts/image
//! builds imported into the node's containerd, the prerequisites the chart
//! does not make created as NOTES.txt says. seedlink runs as the chart's
//! pods, in-cluster, with its own ServiceAccount's projected token.
//!
//! The traffic: a hosted shoot kube-apiserver (a pod) reached by kubectl
//! through the Service's LoadBalancer address by SNI, client certificate end
//! to end; its egress through the tunnel-server pods and the shoot chart's
//! agent pods (node proxy, `kubectl logs`, `exec`, `port-forward` to the
//! node's kubelet, a validating webhook); the shoot chart's node-proxy
//! (GEP-08); a second control plane with a tunnel-server sidecar (egress
//! over gRPC, then HTTPConnect, on a Unix socket). Day 2 runs under a loop
//! of kubectl requests, each on a new connection, and counts every failure:
//! a third control plane onboarded with one `SeedlinkControlPlane` and
//! deleted again (installed/onboarding.rs), a rollout restart, a `helm upgrade` to a new image reference, scaling
//! while the API server is unreachable from new pods, the status leader's
//! pod deleted (another pod takes the lease and still writes status), a
//! node drain with the PDB, and `helm uninstall` (what is left is listed and
//! must be what the docs say).
//! The figures (install to Ready, each step's requests and failures) are
//! printed; docs/KUBERNETES.md keeps the last run's.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use seedlink_testkit::cluster::{helm, run, Cluster, Options, NODE_IP, NODE_NAME, POD_SUBNET};
use seedlink_testkit::eventually_blocking;
use seedlink_testkit::kubeapi::repo_root;

#[path = "installed/onboarding.rs"]
mod onboarding;
use onboarding::{GREEDY_NS, ONBOARDED_NS};

/// The LoadBalancer pool (on the node's loopback).
const LB_POOL: [&str; 2] = ["10.250.1.1", "10.250.1.2"];
const NS: &str = "seedlink-system";
/// The hosted control plane's namespace (as Gardener names a shoot's).
const SHOOT_NS: &str = "shoot--dev--a";
/// Its API server's public host name (in its serving certificate).
const API_HOST: &str = "api.dev-a.seed.test";
/// The admin endpoints' token (the Secret the test makes).
/// The shoot's TunnelCluster (`<namespace>.<name>`), the CN of its
/// kube-apiserver's client certificate on the shared frontend.
const TUNNEL_CLUSTER: &str = "shoot--dev--a.tunnel";
/// Through the shoot's kube-apiserver's node proxy to the echo pod: its
/// egress, the tunnel-server's shared frontend, an agent.
const VIA_TUNNEL: &str = "/api/v1/nodes/http:shoot-node:3000/proxy/hello";
/// The address the shoot's node-proxy serves its `kubernetes` endpoint on
/// (the chart's default; kube-apiserver would advertise it).
const NODE_PROXY: &str = "10.250.255.254:443";
/// The second shoot: its control plane with a tunnel-server of its own as
/// a sidecar (KKP's and Kamaji's way), kube-apiserver's egress on a Unix
/// socket between the two containers, its agents through the gateway by
/// SNI.
const SIDECAR_NS: &str = "shoot--dev--b";
const SIDECAR_API_HOST: &str = "api.dev-b.seed.test";
const SIDECAR_TUNNEL_HOST: &str = "tunnel.dev-b.seed.test";
/// Where the second shoot's agents run (a second release of the shoot chart).
const SIDECAR_AGENTS_NS: &str = "shoot-b-agents";
const ADMIN_TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The image scripts/image builds from the binary under test, as an OCI
/// archive in `dir`.
fn image_archive(dir: &Path) -> PathBuf {
    let archive = dir.join("seedlink.oci.tar");
    run(Command::new(repo_root().join("scripts/image"))
        .args([
            "--binary",
            env!("CARGO_BIN_EXE_seedlink"),
            "--rm",
            "--archive",
        ])
        .arg(&archive)
        .current_dir(repo_root()));
    archive
}

/// The Secrets the chart expects, made as NOTES.txt says: the agents'
/// endpoint certificate (with openssl), the CA of the kube-apiservers'
/// client certificates (`kubeApiserverClientCA`), an admin token.
fn prerequisites(c: &Cluster) -> PathBuf {
    let d = c.dir.join("secrets");
    // A seed CA: it issues the tunnel-server's certificate (the agents'
    // endpoint and the shared frontend).
    openssl(
        &d,
        "ca
leaf tls /CN=seedlink DNS:seedlink,DNS:seedlink-internal.seedlink-system.svc
",
    );
    // The CA of kube-apiservers' client certificates for the shared
    // frontend (CN: the cluster): the first shoot's is issued here, the
    // onboarding controller issues the others with it.
    openssl(
        &d.join("kas-ca"),
        &format!("ca\nleaf kas /CN={TUNNEL_CLUSTER} DNS:kas\n"),
    );
    let kas_ca = d.join("kas-ca");
    c.kubectl_ok(&["create", "namespace", NS]);
    c.kubectl_ok(&[
        "-n",
        NS,
        "create",
        "secret",
        "generic",
        "seedlink-tunnel-tls",
        &format!("--from-file={}", d.join("tls.crt").display()),
        &format!("--from-file={}", d.join("tls.key").display()),
        &format!("--from-file={}", d.join("ca.crt").display()),
    ]);
    c.kubectl_ok(&[
        "-n",
        NS,
        "create",
        "secret",
        "generic",
        "seedlink-admin-token",
        &format!("--from-literal=token={ADMIN_TOKEN}"),
    ]);
    c.kubectl_ok(&[
        "-n",
        NS,
        "create",
        "secret",
        "tls",
        "seedlink-kas-client-ca",
        &format!("--cert={}", kas_ca.join("ca.crt").display()),
        &format!("--key={}", kas_ca.join("ca.key").display()),
    ]);
    d
}

/// A shell script of openssl in `dir`, with two functions: `ca` makes
/// ca.crt and ca.key, `leaf <name> <subject> <SANs>` a certificate that CA
/// issues (`<name>.crt`, `<name>.key`). As an operator makes them.
fn openssl(dir: &Path, script: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let prelude = r#"set -e
ca() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=ca -keyout ca.key -out ca.crt
}
leaf() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr"
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt"
}
"#;
    run(Command::new("sh")
        .args(["-c", &format!("{prelude}{script}")])
        .current_dir(dir));
}

/// A shoot's control plane as a hosting platform runs it: kube-apiserver
/// and etcd in a pod of its own namespace (the image scripts/build-kube-peers
/// builds), behind a Service with a selector, its PKI made with openssl
/// (a CA, the serving certificate for [`API_HOST`], an admin client
/// certificate). Returns the directory with `ca.crt`, `admin.crt`, `admin.key`.
fn shoot_control_plane(c: &Cluster, seed: &Path, egress: &str) -> PathBuf {
    let d = control_plane_secrets(c, SHOOT_NS, API_HOST, "shoot-pki");
    c.kubectl_ok(&[
        "label",
        "namespace",
        SHOOT_NS,
        "seedlink.dev/gateway-access=true",
    ]);
    // Its egress: the file `seedlink tunnel-config` rendered, and the
    // client certificate the shared frontend names the cluster by.
    let f = c.dir.join("egress-selector-configuration.yaml");
    std::fs::write(&f, egress).unwrap();
    c.kubectl_ok(&[
        "-n",
        SHOOT_NS,
        "create",
        "configmap",
        "kube-apiserver-egress",
        &format!("--from-file={}", f.display()),
    ]);
    kube_apiserver_tunnel_secret(c, SHOOT_NS, seed);
    kube_apiserver_pod(
        c,
        SHOOT_NS,
        API_HOST,
        "kube-apiserver-egress",
        "kube-apiserver-tunnel",
    );
    d
}

/// A control plane's PKI made with openssl in `dir` (a CA, the serving
/// certificate for `host`, an admin client certificate, a webhook's
/// serving certificate, the ServiceAccount key pair), and its Secrets in
/// namespace `ns` (made here): `kube-apiserver-pki`, and
/// `kube-apiserver-kubelet-client`, a client certificate the node's
/// kubelet trusts (here the cluster's own), for logs, exec, port-forward.
fn control_plane_secrets(c: &Cluster, ns: &str, host: &str, dir: &str) -> PathBuf {
    let d = c.dir.join(dir);
    openssl(
        &d,
        &format!(
            "ca
leaf tls /CN=kube-apiserver DNS:{host},DNS:kubernetes.default.svc,IP:10.96.0.1
leaf admin /O=system:masters/CN=admin DNS:admin
leaf apps /CN=shoot-apps DNS:shoot-apps.webhooked.svc
openssl ecparam -name prime256v1 -genkey -noout -out sa.pem
openssl pkcs8 -topk8 -nocrypt -in sa.pem -out sa.key
openssl ec -in sa.key -pubout -out sa.pub
"
        ),
    );
    c.kubectl_ok(&["create", "namespace", ns]);
    c.kubectl_ok(&[
        "-n",
        ns,
        "create",
        "secret",
        "generic",
        "kube-apiserver-kubelet-client",
        &format!(
            "--from-file=client.crt={}",
            c.api.dir.join("admin.pem").display()
        ),
        &format!(
            "--from-file=client.key={}",
            c.api.dir.join("admin-key.pem").display()
        ),
    ]);
    let mut create = [
        "-n",
        ns,
        "create",
        "secret",
        "generic",
        "kube-apiserver-pki",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    for f in ["ca.crt", "tls.crt", "tls.key", "sa.key", "sa.pub"] {
        create.push(format!("--from-file={}", d.join(f).display()));
    }
    let refs: Vec<&str> = create.iter().map(String::as_str).collect();
    c.kubectl_ok(&refs);
    d
}

/// Secret `kube-apiserver-tunnel` in `ns`: the seed's CA, and the client
/// certificate the kube-apiservers' CA issued (`kas-ca/kas.crt` in
/// `seed`), whose CN names the TunnelCluster on the shared frontend.
fn kube_apiserver_tunnel_secret(c: &Cluster, ns: &str, seed: &Path) {
    let leaf = "kas-ca/kas";
    c.kubectl_ok(&[
        "-n",
        ns,
        "create",
        "secret",
        "generic",
        "kube-apiserver-tunnel",
        &format!("--from-file=ca.crt={}", seed.join("ca.crt").display()),
        &format!(
            "--from-file=client.crt={}",
            seed.join(format!("{leaf}.crt")).display()
        ),
        &format!(
            "--from-file=client.key={}",
            seed.join(format!("{leaf}.key")).display()
        ),
    ]);
}

/// kube-apiserver and etcd as a Deployment `kube-apiserver` in `ns`, and
/// the Service in front of it: the Secrets of [`control_plane_secrets`]
/// mounted, the egress selector file from ConfigMap `egress`, the files
/// for the shared frontend from Secret `tunnel`. Waits for the rollout.
fn kube_apiserver_pod(c: &Cluster, ns: &str, host: &str, egress: &str, tunnel: &str) {
    // No cluster DNS here: the pod's hosts file names the Service the
    // rendered file dials (its certificate's name).
    let internal = jsonpath(
        c,
        &["-n", NS, "get", "service", "seedlink-internal"],
        "{.spec.clusterIP}",
    );
    c.apply(&format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: kube-apiserver, namespace: {ns}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: kube-apiserver}}}}
  template:
    metadata: {{labels: {{app: kube-apiserver}}}}
    spec:
      hostAliases: [{{ip: "{internal}", hostnames: [seedlink-internal.seedlink-system.svc]}}]
      containers:
      - name: etcd
        image: localhost/kube-control-plane:1
        command: [/usr/local/bin/etcd, --data-dir=/var/lib/etcd/data,
                  --listen-client-urls=http://127.0.0.1:2379, --advertise-client-urls=http://127.0.0.1:2379,
                  --listen-peer-urls=http://127.0.0.1:2380, --initial-advertise-peer-urls=http://127.0.0.1:2380,
                  --initial-cluster=default=http://127.0.0.1:2380, --listen-metrics-urls=http://127.0.0.1:2381]
        volumeMounts: [{{name: etcd, mountPath: /var/lib/etcd}}]
      - name: kube-apiserver
        image: localhost/kube-control-plane:1
        command: [/usr/local/bin/kube-apiserver, --etcd-servers=http://127.0.0.1:2379,
                  --secure-port=6443, --tls-cert-file=/pki/tls.crt, --tls-private-key-file=/pki/tls.key,
                  --client-ca-file=/pki/ca.crt, --service-account-issuer=https://{host},
                  --service-account-key-file=/pki/sa.pub, --service-account-signing-key-file=/pki/sa.key,
                  --service-cluster-ip-range=10.96.0.0/16, --authorization-mode=RBAC,
                  --cert-dir=/tmp,
                  --kubelet-client-certificate=/kubelet/client.crt, --kubelet-client-key=/kubelet/client.key,
                  --kubelet-preferred-address-types=InternalIP,
                  --egress-selector-config-file=/etc/kubernetes/egress/egress-selector-configuration.yaml]
        ports: [{{name: https, containerPort: 6443}}]
        readinessProbe:
          httpGet: {{path: /readyz, port: https, scheme: HTTPS}}
          periodSeconds: 2
        volumeMounts: [{{name: pki, mountPath: /pki, readOnly: true}}, {{name: tmp, mountPath: /tmp}},
                       {{name: egress, mountPath: /etc/kubernetes/egress, readOnly: true}},
                       {{name: tunnel, mountPath: /etc/kubernetes/tunnel, readOnly: true}},
                       {{name: kubelet, mountPath: /kubelet, readOnly: true}}]
      volumes:
      - {{name: kubelet, secret: {{secretName: kube-apiserver-kubelet-client}}}}
      - {{name: egress, configMap: {{name: {egress}}}}}
      - {{name: tunnel, secret: {{secretName: {tunnel}}}}}
      - {{name: pki, secret: {{secretName: kube-apiserver-pki}}}}
      - {{name: etcd, emptyDir: {{}}}}
      - {{name: tmp, emptyDir: {{}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: kube-apiserver, namespace: {ns}}}
spec:
  selector: {{app: kube-apiserver}}
  ports: [{{name: https, port: 443, targetPort: https}}]
"#
    ));
    c.kubectl_ok(&[
        "-n",
        ns,
        "rollout",
        "status",
        "deployment/kube-apiserver",
        "--timeout=600s",
    ]);
}

/// kube-apiserver's egress for the shoot's TunnelCluster over the shared
/// mTLS frontend, as an operator renders it: `seedlink tunnel-config` run
/// in a seedlink pod (`kubectl exec`), from the configuration the pod
/// runs. The first document of its output is the EgressSelectorConfiguration.
fn egress_from_the_pod(c: &Cluster, lb: &str) -> String {
    let agents = format!("{lb}:8091");
    let out = c.kubectl_ok(&[
        "-n",
        NS,
        "exec",
        "deployment/seedlink",
        "--",
        "seedlink",
        "tunnel-config",
        "--config",
        "/etc/seedlink/config/tunnel.yaml",
        "--cluster",
        TUNNEL_CLUSTER,
        "--frontend",
        "kas",
        "--frontend-address",
        "seedlink-internal.seedlink-system.svc:8090",
        "--agent-server",
        &agents,
        "--server-name",
        "seedlink",
    ]);
    let egress = out.split("\n---\n").next().unwrap_or_default().to_string();
    assert!(
        egress.contains("kind: EgressSelectorConfiguration")
            && egress.contains("https://seedlink-internal.seedlink-system.svc:8090"),
        "tunnel-config printed:\n{out}"
    );
    egress
}

/// The shoot's side of the tunnel as a platform installs it: the
/// TunnelCluster trusting the shoot's ServiceAccount tokens (here the
/// cluster plays the shoot too: its issuer and key), the trust ConfigMap
/// labelled and readable by seedlink, then `helm install charts/seedlink-shoot`
/// in kube-system with the seed's agent endpoint (the LoadBalancer
/// address) and CA. Waits until the agents are Ready and the
/// TunnelCluster says AgentsConnected.
fn shoot_side(c: &Cluster, lb: &str, seed: &Path) {
    c.kubectl_ok(&[
        "-n",
        SHOOT_NS,
        "create",
        "configmap",
        "shoot-issuer",
        &format!("--from-file=sa.pub={}", c.api.dir.join("sa.pub").display()),
    ]);
    c.kubectl_ok(&[
        "-n",
        SHOOT_NS,
        "label",
        "configmap",
        "shoot-issuer",
        "seedlink.dev/tunnel-trust=true",
    ]);
    c.kubectl_ok(&[
        "-n",
        SHOOT_NS,
        "create",
        "rolebinding",
        "seedlink-tunnel-trust",
        "--clusterrole=seedlink-tunnel-trust",
        &format!("--serviceaccount={NS}:seedlink"),
    ]);
    c.apply(&format!(
        "apiVersion: tunnel.seedlink.dev/v1alpha1
kind: TunnelCluster
metadata: {{name: tunnel, namespace: {SHOOT_NS}}}
spec:
  agentToken: {{issuer: '{}', keys: {{configMap: shoot-issuer, key: sa.pub}}}}
",
        c.api.issuer
    ));
    let chart = repo_root().join("charts/seedlink-shoot");
    helm_cmd(
        c,
        &[
            "install",
            "seedlink-shoot",
            &chart.display().to_string(),
            "--namespace",
            "kube-system",
            "--set",
            &format!("agent.server={lb}:8091"),
            "--set",
            "agent.serverName=seedlink",
            "--set-file",
            &format!("agent.caBundle={}", seed.join("ca.crt").display()),
            "--set",
            &format!("nodeProxy.gateway={lb}:8443"),
            // This kernel has no dummy link type.
            "--set",
            "nodeProxy.linkKind=bridge",
        ],
    );
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "rollout",
        "status",
        "deployment/seedlink-tunnel-agent",
        "--timeout=600s",
    ]);
    eventually_blocking(
        "the TunnelCluster's agents connected",
        Duration::from_secs(120),
        || {
            let s = jsonpath(
                c,
                &["-n", SHOOT_NS, "get", "tunnelcluster", "tunnel"],
                "{.status.conditions[?(@.type==\"AgentsConnected\")].status}",
            );
            (s == "True").then_some(()).ok_or(s)
        },
    );
}

/// A workload in the shoot's network (the echo server of the Gateway API
/// suite, as a pod), and the shoot's kube-apiserver told of it as a node
/// (written through the gateway).
fn echo_in_the_shoot(c: &Cluster, kubeconfig: &Path) -> String {
    c.import_image(&seedlink_testkit::cluster::peer(
        &c.api.kube_dir,
        "images/echo-basic.oci.tar",
    ));
    c.kubectl_ok(&["create", "namespace", "shoot-workload"]);
    c.apply(
        "apiVersion: apps/v1
kind: Deployment
metadata: {name: echo, namespace: shoot-workload}
spec:
  selector: {matchLabels: {app: echo}}
  template:
    metadata: {labels: {app: echo}}
    spec:
      containers:
      - {name: echo, image: 'localhost/echo-basic:built', ports: [{containerPort: 3000}]}
",
    );
    c.kubectl_ok(&[
        "-n",
        "shoot-workload",
        "rollout",
        "status",
        "deployment/echo",
        "--timeout=600s",
    ]);
    let ip = jsonpath(
        c,
        &["-n", "shoot-workload", "get", "pods", "-l", "app=echo"],
        "{.items[0].status.podIP}",
    );
    shoot_node(c, kubeconfig, &ip);
    ip
}

/// A node of the shoot as its kube-apiserver (through `kubeconfig`) knows
/// it (that API server runs no kubelet): the node proxy dials its
/// InternalIP, here the echo pod's, through the egress.
fn shoot_node(c: &Cluster, kubeconfig: &Path, ip: &str) {
    let kubectl = |args: &[&str]| {
        run(Command::new(c.api.kube_dir.join("bin/kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args))
    };
    let f = c.dir.join("shoot-node.yaml");
    std::fs::write(
        &f,
        "apiVersion: v1\nkind: Node\nmetadata: {name: shoot-node}\n",
    )
    .unwrap();
    kubectl(&["apply", "-f", &f.display().to_string()]);
    kubectl(&[
        "patch",
        "node",
        "shoot-node",
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!(
            "{{\"status\":{{\"addresses\":[{{\"type\":\"InternalIP\",\"address\":\"{ip}\"}}]}}}}"
        ),
    ]);
}

/// Waits until the shoot's kube-apiserver behind `kubeconfig` reaches the
/// echo pod through its node proxy: its egress, a tunnel-server, an agent.
fn reaches_through_the_tunnel(kubectl: &Path, kubeconfig: &Path, what: &str) {
    eventually_blocking(what, Duration::from_secs(120), || {
        let o = Command::new(kubectl)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["get", "--raw", VIA_TUNNEL])
            .output()
            .unwrap();
        let body = String::from_utf8_lossy(&o.stdout).into_owned();
        let echoed =
            serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["path"] == "/hello");
        echoed
            .then_some(())
            .ok_or_else(|| format!("{body}{}", String::from_utf8_lossy(&o.stderr)))
    });
}

/// The per-control-plane sidecar install (KKP's and Kamaji's topology): a
/// second shoot's kube-apiserver pod carries `seedlink tunnel-server` as a
/// sidecar serving only that cluster, and kube-apiserver's egress reaches it
/// on a Unix socket in a shared emptyDir, over `transport` (`grpc` or
/// `http`: the frontend's name). An init container renders the egress file
/// from the sidecar's own configuration (`seedlink tunnel-config --out`), so
/// the two cannot disagree. The agents (a second release of the shoot chart,
/// agent only) reach the sidecar through the seed's gateway by SNI, on the
/// load balancer's TLS port, as Kamaji's agents reach theirs through the
/// control plane's one address. Returns the shoot's admin kubeconfig
/// through the gateway.
fn sidecar_control_plane(c: &Cluster, lb: &str, seed: &Path, transport: &str) -> PathBuf {
    let d = c.dir.join("shoot-b-pki");
    openssl(
        &d,
        &format!(
            "ca
leaf tls /CN=kube-apiserver DNS:{SIDECAR_API_HOST},DNS:kubernetes.default.svc,IP:10.100.0.1
leaf admin /O=system:masters/CN=admin DNS:admin
openssl ecparam -name prime256v1 -genkey -noout -out sa.pem
openssl pkcs8 -topk8 -nocrypt -in sa.pem -out sa.key
openssl ec -in sa.key -pubout -out sa.pub
"
        ),
    );
    // The sidecar's agent endpoint certificate, from the seed's CA (which
    // the agents already trust).
    openssl(
        seed,
        &format!("leaf sidecar /CN={SIDECAR_TUNNEL_HOST} DNS:{SIDECAR_TUNNEL_HOST}\n"),
    );
    c.kubectl_ok(&["create", "namespace", SIDECAR_NS]);
    c.kubectl_ok(&[
        "label",
        "namespace",
        SIDECAR_NS,
        "seedlink.dev/gateway-access=true",
    ]);
    let mut create: Vec<String> = [
        "-n",
        SIDECAR_NS,
        "create",
        "secret",
        "generic",
        "kube-apiserver-pki",
    ]
    .map(String::from)
    .to_vec();
    for f in ["ca.crt", "tls.crt", "tls.key", "sa.key", "sa.pub"] {
        create.push(format!("--from-file={}", d.join(f).display()));
    }
    c.kubectl_ok(&create.iter().map(String::as_str).collect::<Vec<_>>());
    c.kubectl_ok(&[
        "-n",
        SIDECAR_NS,
        "create",
        "secret",
        "tls",
        "tunnel-sidecar-tls",
        &format!("--cert={}", seed.join("sidecar.crt").display()),
        &format!("--key={}", seed.join("sidecar.key").display()),
    ]);
    // The sidecar serves this one cluster; its agents are the shoot's, with
    // their projected tokens (here this cluster plays the shoot: its
    // issuer and key).
    let sa_pub = std::fs::read_to_string(c.api.dir.join("sa.pub")).unwrap();
    let sa_pub: String = sa_pub.lines().map(|l| format!("    {l}\n")).collect();
    let image = format!("localhost/seedlink:{}", env!("CARGO_PKG_VERSION"));
    c.apply(&format!(
        r#"apiVersion: v1
kind: ConfigMap
metadata: {{name: tunnel-sidecar, namespace: {SIDECAR_NS}}}
data:
  tunnel.yaml: |
    agents: {{listen: '0.0.0.0:8132', cert: /etc/seedlink/tls/tls.crt, key: /etc/seedlink/tls/tls.key}}
    admin: {{listen: '127.0.0.1:8133'}}
    clusters:
      - name: {SIDECAR_NS}
        agent_token:
          issuer: '{issuer}'
          keys: /etc/seedlink/sidecar/sa.pub
          service_account: {SIDECAR_AGENTS_NS}/konnectivity-agent
        frontends:
          - {{name: grpc, protocol: grpc, unix: /run/konnectivity/grpc.sock}}
          - {{name: http, protocol: http-connect, unix: /run/konnectivity/http.sock}}
  sa.pub: |
{sa_pub}---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: kube-apiserver, namespace: {SIDECAR_NS}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: kube-apiserver}}}}
  template:
    metadata: {{labels: {{app: kube-apiserver}}}}
    spec:
      initContainers:
      - name: egress
        image: {image}
        args: [tunnel-config, --config, /etc/seedlink/sidecar/tunnel.yaml, --cluster, {SIDECAR_NS},
               --frontend, $(EGRESS_FRONTEND), --agent-server, '{lb}:443', --server-name, {SIDECAR_TUNNEL_HOST},
               --out, /etc/kubernetes/egress]
        env: [{{name: EGRESS_FRONTEND, value: {transport}}}]
        volumeMounts: [{{name: sidecar, mountPath: /etc/seedlink/sidecar, readOnly: true}},
                       {{name: sidecar-tls, mountPath: /etc/seedlink/tls, readOnly: true}},
                       {{name: egress, mountPath: /etc/kubernetes/egress}}]
      containers:
      - name: etcd
        image: localhost/kube-control-plane:1
        command: [/usr/local/bin/etcd, --data-dir=/var/lib/etcd/data,
                  --listen-client-urls=http://127.0.0.1:2379, --advertise-client-urls=http://127.0.0.1:2379,
                  --listen-peer-urls=http://127.0.0.1:2380, --initial-advertise-peer-urls=http://127.0.0.1:2380,
                  --initial-cluster=default=http://127.0.0.1:2380, --listen-metrics-urls=http://127.0.0.1:2381]
        volumeMounts: [{{name: etcd, mountPath: /var/lib/etcd}}]
      - name: kube-apiserver
        image: localhost/kube-control-plane:1
        command: [/usr/local/bin/kube-apiserver, --etcd-servers=http://127.0.0.1:2379,
                  --secure-port=6443, --tls-cert-file=/pki/tls.crt, --tls-private-key-file=/pki/tls.key,
                  --client-ca-file=/pki/ca.crt, --service-account-issuer=https://{SIDECAR_API_HOST},
                  --service-account-key-file=/pki/sa.pub, --service-account-signing-key-file=/pki/sa.key,
                  --service-cluster-ip-range=10.100.0.0/16, --authorization-mode=RBAC,
                  --cert-dir=/tmp,
                  --egress-selector-config-file=/etc/kubernetes/egress/egress-selector-configuration.yaml]
        ports: [{{name: https, containerPort: 6443}}]
        readinessProbe:
          httpGet: {{path: /readyz, port: https, scheme: HTTPS}}
          periodSeconds: 2
        volumeMounts: [{{name: pki, mountPath: /pki, readOnly: true}}, {{name: tmp, mountPath: /tmp}},
                       {{name: egress, mountPath: /etc/kubernetes/egress, readOnly: true}},
                       {{name: konnectivity, mountPath: /run/konnectivity}}]
      - name: tunnel-server
        image: {image}
        args: [tunnel-server, --config, /etc/seedlink/sidecar/tunnel.yaml]
        ports: [{{name: agents, containerPort: 8132}}]
        volumeMounts: [{{name: sidecar, mountPath: /etc/seedlink/sidecar, readOnly: true}},
                       {{name: sidecar-tls, mountPath: /etc/seedlink/tls, readOnly: true}},
                       {{name: konnectivity, mountPath: /run/konnectivity}}]
      volumes:
      - {{name: sidecar, configMap: {{name: tunnel-sidecar}}}}
      - {{name: sidecar-tls, secret: {{secretName: tunnel-sidecar-tls}}}}
      - {{name: pki, secret: {{secretName: kube-apiserver-pki}}}}
      - {{name: egress, emptyDir: {{}}}}
      - {{name: konnectivity, emptyDir: {{}}}}
      - {{name: etcd, emptyDir: {{}}}}
      - {{name: tmp, emptyDir: {{}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: kube-apiserver, namespace: {SIDECAR_NS}}}
spec:
  selector: {{app: kube-apiserver}}
  ports: [{{name: https, port: 443, targetPort: https}}, {{name: agents, port: 8132, targetPort: agents}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: TLSRoute
metadata: {{name: api, namespace: {SIDECAR_NS}}}
spec:
  parentRefs: [{{name: seedlink, namespace: {NS}}}]
  hostnames: [{SIDECAR_API_HOST}]
  rules: [{{backendRefs: [{{name: kube-apiserver, port: 443}}]}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: TLSRoute
metadata: {{name: agents, namespace: {SIDECAR_NS}}}
spec:
  parentRefs: [{{name: seedlink, namespace: {NS}}}]
  hostnames: [{SIDECAR_TUNNEL_HOST}]
  rules: [{{backendRefs: [{{name: kube-apiserver, port: 8132}}]}}]
"#,
        issuer = c.api.issuer,
    ));
    c.kubectl_ok(&[
        "-n",
        SIDECAR_NS,
        "rollout",
        "status",
        "deployment/kube-apiserver",
        "--timeout=600s",
    ]);
    // The agents: the shoot chart again, agent only, in a namespace of its
    // own, to the sidecar through the gateway by SNI.
    let chart = repo_root().join("charts/seedlink-shoot");
    helm_cmd(
        c,
        &[
            "install",
            "seedlink-shoot-b",
            &chart.display().to_string(),
            "--namespace",
            SIDECAR_AGENTS_NS,
            "--create-namespace",
            "--set",
            "nodeProxy.enabled=false",
            "--set",
            &format!("agent.server={lb}:443"),
            "--set",
            &format!("agent.serverName={SIDECAR_TUNNEL_HOST}"),
            "--set-file",
            &format!("agent.caBundle={}", seed.join("ca.crt").display()),
        ],
    );
    c.kubectl_ok(&[
        "-n",
        SIDECAR_AGENTS_NS,
        "rollout",
        "status",
        "deployment/seedlink-tunnel-agent",
        "--timeout=600s",
    ]);
    shoot_kubeconfig(c, "shoot-b", &format!("{lb}:443"), SIDECAR_API_HOST, &d)
}

/// The sidecar's kube-apiserver moved to the other Unix-socket transport:
/// the init container's frontend changed, the pod rolled (its etcd is an
/// emptyDir: the node object is made again by the caller).
fn sidecar_transport(c: &Cluster, transport: &str) {
    c.kubectl_ok(&[
        "-n",
        SIDECAR_NS,
        "set",
        "env",
        "deployment/kube-apiserver",
        "-c",
        "egress",
        &format!("EGRESS_FRONTEND={transport}"),
    ]);
    c.kubectl_ok(&[
        "-n",
        SIDECAR_NS,
        "rollout",
        "status",
        "deployment/kube-apiserver",
        "--timeout=600s",
    ]);
}

/// The egress file the sidecar pod's init container wrote, as
/// kube-apiserver reads it (the image has no shell: read from the node,
/// in the kubelet's emptyDir of the pod that is not being deleted).
fn sidecar_egress_file(c: &Cluster) -> String {
    let pods = jsonpath(
        c,
        &["-n", SIDECAR_NS, "get", "pods", "-l", "app=kube-apiserver"],
        "{range .items[*]}{.metadata.uid} {.metadata.deletionTimestamp}{\"\\n\"}{end}",
    );
    let uid = pods
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.contains(' '))
        .unwrap_or_else(|| panic!("no live kube-apiserver pod: {pods:?}"));
    let f = c
        .dir
        .join("node/kubelet/pods")
        .join(uid)
        .join("volumes/kubernetes.io~empty-dir/egress/egress-selector-configuration.yaml");
    std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
}

/// What kube-apiserver dials in a shoot besides the node proxy, through
/// the egress, the tunnel-server pods and an agent pod, with a real
/// kubelet and kubectl: `kubectl logs`, `exec` and `port-forward` to pods
/// on the node (the shoot's API server is told of the node and of the
/// pods the kubelet runs, as the shoot's own control plane would be), and
/// a validating webhook in the shoot's network. Each is checked to have
/// gone through kube-apiserver's egress dialer (its own metric).
fn kubelet_and_webhook_through_the_tunnel(
    c: &Cluster,
    kubectl: &Path,
    kubeconfig: &Path,
    pki: &Path,
) {
    let shoot = |args: &[&str]| {
        Command::new(kubectl)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .output()
            .unwrap()
    };
    let shoot_ok = |args: &[&str]| {
        let o = shoot(args);
        assert!(
            o.status.success(),
            "shoot kubectl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let dials = || {
        let m = shoot_ok(&["get", "--raw", "/metrics"]);
        m.lines()
            .filter(|l| l.starts_with("apiserver_egress_dialer_dial_start_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    // A shell on the node, for exec.
    c.apply(
        "apiVersion: v1
kind: Pod
metadata: {name: shell, namespace: shoot-workload}
spec:
  containers:
  - {name: shell, image: 'localhost/busybox:1', imagePullPolicy: Never, command: [sleep, '3600']}
",
    );
    c.kubectl_ok(&[
        "-n",
        "shoot-workload",
        "wait",
        "--for=condition=Ready",
        "pod/shell",
        "--timeout=300s",
    ]);
    let echo = jsonpath(
        c,
        &["-n", "shoot-workload", "get", "pods", "-l", "app=echo"],
        "{.items[0].metadata.name}",
    );
    // The shoot's API server told of the node and its pods (it runs no
    // controller-manager: the namespace's ServiceAccount is made here).
    let f = c.dir.join("shoot-objects.yaml");
    std::fs::write(
        &f,
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: shoot-workload}}\n---\n\
             apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: default, namespace: shoot-workload}}\n---\n\
             apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}}}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {{name: {echo}, namespace: shoot-workload}}\n\
             spec: {{nodeName: {NODE_NAME}, automountServiceAccountToken: false, containers: [{{name: echo, image: x}}]}}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {{name: shell, namespace: shoot-workload}}\n\
             spec: {{nodeName: {NODE_NAME}, automountServiceAccountToken: false, containers: [{{name: shell, image: x}}]}}\n"
        ),
    )
    .unwrap();
    shoot_ok(&["apply", "-f", &f.display().to_string()]);
    shoot_ok(&[
        "patch",
        "node",
        NODE_NAME,
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!(
            "{{\"status\":{{\"addresses\":[{{\"type\":\"InternalIP\",\"address\":\"{NODE_IP}\"}}],\
             \"daemonEndpoints\":{{\"kubeletEndpoint\":{{\"Port\":10250}}}}}}}}"
        ),
    ]);
    for pod in [echo.as_str(), "shell"] {
        shoot_ok(&[
            "-n",
            "shoot-workload",
            "patch",
            "pod",
            pod,
            "--subresource=status",
            "--type=merge",
            "-p",
            "{\"status\":{\"phase\":\"Running\"}}",
        ]);
    }

    // logs: what the kubelet has of the echo container, as the seed's own
    // API server reads it.
    let before = dials();
    let want = c.kubectl_ok(&["-n", "shoot-workload", "logs", &echo, "-c", "echo"]);
    let got = shoot_ok(&["-n", "shoot-workload", "logs", &echo, "-c", "echo"]);
    assert!(
        !got.is_empty() && want.starts_with(got.lines().next().unwrap_or_default()),
        "shoot logs {got:?}, kubelet's {want:?}"
    );
    // exec, with stdin.
    let mut child = Command::new(kubectl)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "-n",
            "shoot-workload",
            "exec",
            "-i",
            "shell",
            "-c",
            "shell",
            "--",
            "cat",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"through the tunnel\n").unwrap();
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "through the tunnel\n",
        "exec: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // port-forward to the echo server's port.
    let mut pf = Command::new(kubectl)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "-n",
            "shoot-workload",
            "port-forward",
            &format!("pod/{echo}"),
            ":3000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its stdout stays open until it ends (it writes a line per address,
    // and per connection).
    let mut pf_out = std::io::BufReader::new(pf.stdout.take().unwrap());
    let port = {
        use std::io::BufRead;
        let mut line = String::new();
        pf_out.read_line(&mut line).unwrap();
        // "Forwarding from 127.0.0.1:PORT -> 3000"
        line.split_whitespace()
            .nth(2)
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or_else(|| panic!("port-forward said {line:?}"))
    };
    let body = run(Command::new("curl").args([
        "-sS",
        "--max-time",
        "30",
        &format!("http://127.0.0.1:{port}/forwarded"),
    ]));
    let _ = pf.kill();
    let _ = pf.wait();
    drop(pf_out);
    assert!(
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["path"] == "/forwarded"),
        "through port-forward: {body}"
    );
    let after = dials();
    assert!(
        after >= before + 3.0,
        "kube-apiserver's egress dials: {before} before logs, exec and port-forward, {after} after"
    );

    // A validating webhook in the shoot's network, by Service: a Service
    // of the cluster (kube-proxy's ClusterIP, to shoot_apps.py on the
    // node's address), and the same Service in the shoot's API server
    // (its ClusterIP, which only the shoot's network routes; both use
    // 10.96.0.0/16). failurePolicy Fail: it decides, through the tunnel.
    let mut apps = Command::new("ip")
        .args(["netns", "exec", &c.netns, "python3"])
        .arg(repo_root().join("crates/seedlink/tests/peers/shoot_apps.py"))
        .arg(format!("{NODE_IP}:8444"))
        .arg(pki.join("apps.crt"))
        .arg(pki.join("apps.key"))
        .args(["none", "-", "-", "-"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(apps.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "up", "shoot_apps.py did not start");
    }
    c.apply(&format!(
        "apiVersion: v1
kind: Service
metadata: {{name: shoot-apps, namespace: shoot-workload}}
spec:
  ports: [{{name: https, port: 443, targetPort: 8444}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: shoot-apps
  namespace: shoot-workload
  labels: {{kubernetes.io/service-name: shoot-apps}}
addressType: IPv4
ports: [{{name: https, port: 8444, protocol: TCP}}]
endpoints: [{{addresses: ['{NODE_IP}'], conditions: {{ready: true}}}}]
"
    ));
    let service_ip = jsonpath(
        c,
        &["-n", "shoot-workload", "get", "service", "shoot-apps"],
        "{.spec.clusterIP}",
    );
    let ca = run(Command::new("openssl")
        .args(["base64", "-A", "-in"])
        .arg(pki.join("ca.crt")));
    let ca = ca.trim();
    let f = c.dir.join("shoot-webhook.yaml");
    std::fs::write(
        &f,
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: webhooked, labels: {{webhooked: 'true'}}}}\n---\n\
             apiVersion: v1\nkind: Service\nmetadata: {{name: shoot-apps, namespace: webhooked}}\n\
             spec: {{clusterIP: '{service_ip}', ports: [{{name: https, port: 443}}]}}\n---\n\
             apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingWebhookConfiguration\n\
             metadata: {{name: shoot-webhook}}\nwebhooks:\n\
             - name: validate.shoot-apps.test\n  admissionReviewVersions: [v1]\n  sideEffects: None\n  failurePolicy: Fail\n  timeoutSeconds: 10\n\
             \x20 namespaceSelector: {{matchLabels: {{webhooked: 'true'}}}}\n\
             \x20 rules: [{{apiGroups: [''], apiVersions: [v1], operations: [CREATE], resources: [configmaps]}}]\n\
             \x20 clientConfig: {{service: {{namespace: webhooked, name: shoot-apps, port: 443, path: /validate}}, caBundle: {ca}}}\n"
        ),
    )
    .unwrap();
    shoot_ok(&["apply", "-f", &f.display().to_string()]);
    let before = dials();
    // The webhook's configuration reaches the API server's cache in a
    // moment: until then a create is not reviewed.
    let denied = eventually_blocking("the webhook denies", Duration::from_secs(60), || {
        let o = shoot(&["-n", "webhooked", "create", "configmap", "deny-me"]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        if o.status.success() {
            shoot_ok(&["-n", "webhooked", "delete", "configmap", "deny-me"]);
        }
        err.contains("denied by the shoot's webhook")
            .then_some(err.clone())
            .ok_or(err)
    });
    shoot_ok(&["-n", "webhooked", "create", "configmap", "allow-me"]);
    let after = dials();
    let _ = apps.kill();
    let _ = apps.wait();
    // At least one dial: kube-apiserver's webhook client keeps its
    // connection alive, so the refused and the admitted call may share one
    // dial through the egress (both did, once, in a fresh-clone run).
    assert!(
        after > before,
        "kube-apiserver's egress dials: {before} before the webhook, {after} after"
    );
    eprintln!(
        "installed: the shoot's webhook through the tunnel: {}",
        denied.trim()
    );
}

fn helm_cmd(c: &Cluster, args: &[&str]) -> String {
    run(Command::new(helm())
        .env("KUBECONFIG", &c.api.admin_kubeconfig)
        .env("HELM_CACHE_HOME", c.dir.join("helm/cache"))
        .env("HELM_CONFIG_HOME", c.dir.join("helm/config"))
        .env("HELM_DATA_HOME", c.dir.join("helm/data"))
        .args(args))
}

/// Every pod of the Deployment Ready, the rollout complete.
fn rolled_out(c: &Cluster) {
    c.kubectl_ok(&[
        "-n",
        NS,
        "rollout",
        "status",
        "deployment/seedlink",
        "--timeout=600s",
    ]);
}

/// The shoot's admin kubeconfig through the load balancer's address, by
/// SNI, client certificate end to end.
fn through_gateway(c: &Cluster, lb: &str, pki: &Path) -> PathBuf {
    shoot_kubeconfig(c, "through-gateway", &format!("{lb}:443"), API_HOST, pki)
}

/// The shoot's admin kubeconfig for `server`, asking for `name`.
fn shoot_kubeconfig(c: &Cluster, file: &str, server: &str, name: &str, pki: &Path) -> PathBuf {
    let p = c.dir.join(format!("{file}.kubeconfig"));
    std::fs::write(
        &p,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: shoot\n  cluster:\n    server: https://{server}\n    tls-server-name: {name}\n    certificate-authority: {ca}\nusers:\n- name: admin\n  user:\n    client-certificate: {crt}\n    client-key: {key}\ncontexts:\n- name: shoot\n  context: {{cluster: shoot, user: admin}}\ncurrent-context: shoot\n",
            ca = pki.join("ca.crt").display(),
            crt = pki.join("admin.crt").display(),
            key = pki.join("admin.key").display(),
        ),
    )
    .unwrap();
    p
}

/// A loop of kubectl requests through the gateway, each on its own
/// connection (a new kubectl process), counting what fails.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    errors: Arc<std::sync::Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Load {
    /// Asks each `(kubeconfig, path)` in turn.
    fn start(kubectl: PathBuf, asks: Vec<(PathBuf, &'static str)>, netns: String) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, n, f, e) = (stop.clone(), sent.clone(), failed.clone(), errors.clone());
        let thread = std::thread::spawn(move || {
            seedlink_testkit::cluster::enter(&netns);
            // Bounded: at most an hour of requests.
            let end = Instant::now() + Duration::from_secs(3600);
            while !s.load(Ordering::Relaxed) && Instant::now() < end {
                // Each kubectl its own connection: to the shoot's API
                // server by SNI, and on through its egress and the tunnel.
                let i = n.load(Ordering::Relaxed) as usize % asks.len();
                let (kubeconfig, path) = &asks[i];
                let o = Command::new(&kubectl)
                    .arg(format!("--kubeconfig={}", kubeconfig.display()))
                    .args(["get", "--raw", path, "--request-timeout=20s"])
                    .output();
                n.fetch_add(1, Ordering::Relaxed);
                let ok = o
                    .as_ref()
                    .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"{"));
                if !ok {
                    f.fetch_add(1, Ordering::Relaxed);
                    let why = o.map_or_else(
                        |e| e.to_string(),
                        |o| String::from_utf8_lossy(&o.stderr).into_owned(),
                    );
                    e.lock()
                        .unwrap()
                        .push(format!("{}{path}: {why}", kubeconfig.display()));
                }
            }
        });
        Load {
            stop,
            sent,
            failed,
            errors,
            thread: Some(thread),
        }
    }

    /// (requests, failures) so far.
    fn counts(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// Waits for `more` requests past the current count (the loop is
    /// running through whatever just happened).
    fn wait_for(&self, more: u64) {
        let want = self.counts().0 + more;
        eventually_blocking(
            "requests through the gateway",
            Duration::from_secs(120),
            || (self.counts().0 >= want).then_some(()).ok_or("not yet"),
        );
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One day-2 step under the load: its requests and failures.
fn step(name: &str, load: &Load, figures: &mut Vec<String>, action: impl FnOnce()) {
    let (sent0, failed0) = load.counts();
    let t = Instant::now();
    action();
    load.wait_for(5);
    let (sent, failed) = load.counts();
    let line = format!(
        "{name}: {} requests, {} failed, {:.1} s",
        sent - sent0,
        failed - failed0,
        t.elapsed().as_secs_f64()
    );
    eprintln!("installed: {line}");
    figures.push(line);
}

fn jsonpath(c: &Cluster, args: &[&str], path: &str) -> String {
    let mut a: Vec<&str> = args.to_vec();
    let p = format!("jsonpath={path}");
    a.extend(["-o", &p]);
    let o = c.kubectl(&a);
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// Waits until kubectl with `kubeconfig` reads the shoot's kube-system
/// namespace (`what` names the path in a failure).
fn reaches_the_shoot(kubectl: &Path, kubeconfig: &Path, what: &str) {
    eventually_blocking(what, Duration::from_secs(120), || {
        let o = Command::new(kubectl)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["get", "namespace", "kube-system", "-o", "name"])
            .output()
            .unwrap();
        (String::from_utf8_lossy(&o.stdout).trim() == "namespace/kube-system")
            .then_some(())
            .ok_or_else(|| String::from_utf8_lossy(&o.stderr).into_owned())
    });
}

/// A TLSRoute `name` in the shoot's namespace: `host` to its API server.
fn route(c: &Cluster, name: &str, host: &str) {
    c.apply(&format!(
        "apiVersion: gateway.networking.k8s.io/v1
kind: TLSRoute
metadata: {{name: {name}, namespace: {SHOOT_NS}}}
spec:
  parentRefs: [{{name: seedlink, namespace: {NS}}}]
  hostnames: [{host}]
  rules: [{{backendRefs: [{{name: kube-apiserver, port: 443}}]}}]
"
    ));
}

/// The Accepted condition's status on route `name` (written by the pods).
fn accepted(c: &Cluster, name: &str) -> String {
    jsonpath(
        c,
        &["-n", SHOOT_NS, "get", "tlsroute", name],
        "{.status.parents[0].conditions[?(@.type==\"Accepted\")].status}",
    )
}

/// seedlink's pods: (name, pod IP, Ready) of those not being deleted.
fn pods(c: &Cluster) -> Vec<(String, String, bool)> {
    let out = jsonpath(
        c,
        &["-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=seedlink"],
        "{range .items[*]}{.metadata.name} {.status.podIP} {.status.conditions[?(@.type==\"Ready\")].status} {.metadata.deletionTimestamp}{\"\\n\"}{end}",
    );
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                [name, ip, ready] => Some((name.to_string(), ip.to_string(), *ready == "True")),
                _ => None,
            }
        })
        .collect()
}

/// GET `path` on a pod's port with curl: (HTTP status, body).
fn pod_get(ip: &str, port: u16, path: &str) -> (String, String) {
    let o = Command::new("curl")
        .args(["-s", "-m", "10", "-w", "\n%{http_code}"])
        .args(["-H", &format!("Authorization: Bearer {ADMIN_TOKEN}")])
        .arg(format!("http://{ip}:{port}{path}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.to_string(), body.to_string())
}

/// Every Ready pod's tunnel `servercount` is `n`.
fn server_counts_are(c: &Cluster, n: u64) {
    eventually_blocking(
        &format!("servercount {n} on every pod"),
        Duration::from_secs(120),
        || {
            let counts: Vec<String> = pods(c)
                .iter()
                .filter(|p| p.2)
                .map(|(_, ip, _)| {
                    let (_, body) = pod_get(ip, 8095, "/api/state");
                    serde_json::from_str::<serde_json::Value>(&body)
                        .map(|v| v["process"]["server_count"].to_string())
                        .unwrap_or(body)
                })
                .collect();
            (counts.len() as u64 == n && counts.iter().all(|x| *x == n.to_string()))
                .then_some(())
                .ok_or(format!("{counts:?}"))
        },
    );
}

/// Every Ready pod holds a stream from each of the shoot's two agents
/// (each agent connects to `servercount` replicas).
fn agents_on_every_pod(c: &Cluster, replicas: usize) {
    eventually_blocking(
        &format!("two agents on each of {replicas} pods"),
        Duration::from_secs(180),
        || {
            let agents: Vec<usize> = pods(c)
                .iter()
                .filter(|p| p.2)
                .map(|(_, ip, _)| {
                    let (_, body) = pod_get(ip, 8095, "/api/state");
                    serde_json::from_str::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| {
                            v["clusters"].as_array()?.iter().find_map(|k| {
                                (k["name"] == TUNNEL_CLUSTER)
                                    .then(|| k["agents"].as_array().map_or(0, Vec::len))
                            })
                        })
                        .unwrap_or(0)
                })
                .collect();
            (agents.len() == replicas && agents.iter().all(|a| *a == 2))
                .then_some(())
                .ok_or(format!("{agents:?}"))
        },
    );
}

fn lease_holder(c: &Cluster) -> String {
    jsonpath(
        c,
        &["-n", NS, "get", "lease", "seedlink-status"],
        "{.spec.holderIdentity}",
    )
}

/// Everything of the kinds an install touches, by kind/namespace/name.
fn inventory(c: &Cluster) -> Vec<String> {
    let kinds = "deployments,replicasets,pods,services,endpointslices,configmaps,secrets,\
                 serviceaccounts,roles,rolebindings,clusterroles,clusterrolebindings,leases,\
                 networkpolicies,poddisruptionbudgets,horizontalpodautoscalers,\
                 gatewayclasses,gateways,tlsroutes,customresourcedefinitions";
    let o = c.kubectl_ok(&[
        "get",
        kinds,
        "-A",
        "-o",
        "jsonpath={range .items[*]}{.kind}/{.metadata.namespace}/{.metadata.name}{\"\\n\"}{end}",
    ]);
    let mut v: Vec<String> = o.lines().map(str::to_string).collect();
    v.sort();
    v
}

/// In-cluster clients to their own API server (GEP-08) through the shoot
/// chart's node-proxy; returns the shoot's kubeconfig through it.
fn node_proxy_path(c: &Cluster, kubectl: &Path, pki: &Path) -> PathBuf {
    // In-cluster clients to their own API server (GEP-08): the shoot
    // chart's node-proxy serves the `kubernetes` address on the node and
    // carries each connection to the gateway's CONNECT listener, which
    // routes its destination header to the shoot's kube-apiserver.
    // The node-proxy is not Ready while the gateway knows no control plane
    // by the destination it names: its check opens a tunnel as a client's.
    let np = eventually_blocking(
        "the node-proxy's check ran",
        Duration::from_secs(120),
        || {
            let (code, body) = pod_get("127.0.0.1", 9911, "/readyz");
            (code == "503" && body.contains("health_check=tunnel") && body.contains("last_check="))
                .then_some(body.clone())
                .ok_or(format!("{code} {body}"))
        },
    );
    eprintln!(
        "installed: node-proxy before its destination exists: {}",
        np.trim()
    );
    // The destination the node-proxy names, on the shoot's route.
    c.apply(&format!(
        "apiVersion: policy.seedlink.dev/v1alpha1
kind: SeedlinkPolicy
metadata: {{name: api, namespace: {SHOOT_NS}}}
spec:
  targetRefs: [{{group: gateway.networking.k8s.io, kind: TLSRoute, name: api}}]
  destinations: ['outbound|443||kube-apiserver.{SHOOT_NS}.svc.cluster.local']
"
    ));
    eventually_blocking(
        "the node-proxy turns Ready",
        Duration::from_secs(120),
        || {
            let (code, body) = pod_get("127.0.0.1", 9911, "/readyz");
            (code == "200")
                .then_some(())
                .ok_or(format!("{code} {body}"))
        },
    );
    let node_proxy = shoot_kubeconfig(c, "node-proxy", NODE_PROXY, "kubernetes.default.svc", pki);
    reaches_the_shoot(
        kubectl,
        &node_proxy,
        "the shoot's kube-apiserver through its node-proxy",
    );
    node_proxy
}

/// The sidecar install's egress over both Unix-socket transports.
fn sidecar_paths(c: &Cluster, lb: &str, seed: &Path, kubectl: &Path, echo: &str) {
    // The per-control-plane sidecar install: kube-apiserver's egress over
    // gRPC on a Unix socket to a tunnel-server in its own pod, then over
    // HTTPConnect on the other socket, to agents from a second release of
    // the shoot chart.
    let shoot_b = sidecar_control_plane(c, lb, seed, "grpc");
    reaches_the_shoot(kubectl, &shoot_b, "the sidecar shoot through the gateway");
    let egress_file = sidecar_egress_file(c);
    assert!(
        egress_file.contains("proxyProtocol: GRPC")
            && egress_file.contains("/run/konnectivity/grpc.sock"),
        "{egress_file}"
    );
    shoot_node(c, &shoot_b, echo);
    reaches_through_the_tunnel(
        kubectl,
        &shoot_b,
        "the sidecar shoot's kube-apiserver through gRPC on a Unix socket",
    );
    sidecar_transport(c, "http");
    let egress_file = sidecar_egress_file(c);
    assert!(
        egress_file.contains("proxyProtocol: HTTPConnect")
            && egress_file.contains("/run/konnectivity/http.sock"),
        "{egress_file}"
    );
    reaches_the_shoot(kubectl, &shoot_b, "the sidecar shoot, rolled");
    shoot_node(c, &shoot_b, echo);
    reaches_through_the_tunnel(
        kubectl,
        &shoot_b,
        "the sidecar shoot's kube-apiserver through HTTPConnect on a Unix socket",
    );
}

/// Day 2: `kubectl rollout restart`.
fn day2_rollout_restart(c: &Cluster, load: &Load, figures: &mut Vec<String>) {
    step("kubectl rollout restart", load, figures, || {
        c.kubectl_ok(&["-n", NS, "rollout", "restart", "deployment/seedlink"]);
        rolled_out(c);
    });
}

/// Day 2: `helm upgrade` to a new image reference.
fn day2_helm_upgrade(c: &Cluster, load: &Load, figures: &mut Vec<String>, chart: &str) {
    // A new image reference (the same binary under a second tag, as a
    // registry would hold a new version).
    run(&mut c.ctr(&[
        "images",
        "tag",
        "--force",
        &format!("localhost/seedlink:{}", env!("CARGO_PKG_VERSION")),
        "localhost/seedlink:next",
    ]));
    step("helm upgrade to a new image", load, figures, || {
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
                "image.tag=next",
            ],
        );
        rolled_out(c);
    });
    let image = jsonpath(
        c,
        &["-n", NS, "get", "deployment", "seedlink"],
        "{.spec.template.spec.containers[0].image}",
    );
    assert_eq!(image, "localhost/seedlink:next");
}

/// Day 2: scaling to 3 while new pods cannot reach the API server, then
/// back to 2.
fn day2_scale_with_the_api_server_unreachable(c: &Cluster, load: &Load, figures: &mut Vec<String>) {
    // The API server unreachable from the pods while the Deployment grows
    // to three: the new pod runs but stays unready, its /readyz saying why,
    // while the Ready ones keep serving what they last read. Reachable
    // again, it becomes Ready, and every pod's tunnel tells its agents
    // `servercount` 3; then back to 2.
    let port = c.api.addr.port().to_string();
    // New connections only: the Ready pods' watches stay up, as they do
    // when a partition leaves established connections alone.
    let partition = format!(
        "INPUT -s {POD_SUBNET} -d {NODE_IP} -p tcp --dport {port} -m conntrack --ctstate NEW \
         -j REJECT --reject-with tcp-reset"
    );
    let partition: Vec<&str> = partition.split_whitespace().collect();
    server_counts_are(c, 2);
    let mut why = String::new();
    step(
        "scaled to 3 with the API server unreachable from the pods",
        load,
        figures,
        || {
            let before: Vec<String> = pods(c).into_iter().map(|p| p.0).collect();
            run(Command::new("iptables").arg("-I").args(&partition));
            c.kubectl_ok(&["-n", NS, "scale", "deployment/seedlink", "--replicas=3"]);
            why = eventually_blocking(
                "the new pod runs, unready, saying why",
                Duration::from_secs(180),
                || {
                    let new = pods(c).into_iter().find(|p| !before.contains(&p.0));
                    let Some((name, ip, ready)) = new.filter(|p| !p.1.is_empty()) else {
                        return Err("no new pod with an address yet".to_string());
                    };
                    assert!(!ready, "{name} became Ready without the API server");
                    let (code, body) = pod_get(&ip, 9901, "/readyz");
                    (code == "503" && body.contains("[-]kubernetes"))
                        .then_some(body.clone())
                        .ok_or(format!("{code} {body}"))
                },
            );
            let ready = pods(c).iter().filter(|p| p.2).count();
            assert_eq!(ready, 2, "the Ready pods stay Ready through the outage");
            run(Command::new("iptables").arg("-D").args(&partition));
            rolled_out(c);
        },
    );
    eprintln!(
        "installed: the unready pod's /readyz: {}",
        why.trim().replace('\n', " | ")
    );
    server_counts_are(c, 3);
    agents_on_every_pod(c, 3);
    step(
        "scaled back to 2, until the third pod has drained",
        load,
        figures,
        || {
            c.kubectl_ok(&["-n", NS, "scale", "deployment/seedlink", "--replicas=2"]);
            rolled_out(c);
            eventually_blocking("the third pod ends", Duration::from_secs(300), || {
                let all = jsonpath(
                    c,
                    &[
                        "-n",
                        NS,
                        "get",
                        "pods",
                        "-l",
                        "app.kubernetes.io/name=seedlink",
                    ],
                    "{.items[*].metadata.name}",
                );
                (all.split_whitespace().count() == 2)
                    .then_some(())
                    .ok_or(all)
            });
        },
    );
    server_counts_are(c, 2);
}

/// Day 2: the status leader's pod deleted.
fn day2_leader_pod_deleted(c: &Cluster, load: &Load, figures: &mut Vec<String>) {
    // The status leader's pod deleted: another takes the lease, and a new
    // route's status is still written.
    let holder = eventually_blocking("a status leader", Duration::from_secs(60), || {
        let h = lease_holder(c);
        (!h.is_empty()).then_some(h).ok_or("none")
    });
    let mut takeover = Duration::ZERO;
    step(
        "the status leader's pod deleted, until it has drained",
        load,
        figures,
        || {
            let t = Instant::now();
            c.kubectl_ok(&["-n", NS, "delete", "pod", &holder, "--wait=false"]);
            eventually_blocking(
                "another pod takes the lease",
                Duration::from_secs(120),
                || {
                    let h = lease_holder(c);
                    (!h.is_empty() && h != holder).then_some(()).ok_or(h)
                },
            );
            takeover = t.elapsed();
            rolled_out(c);
            route(c, "after-takeover", "after.example");
            eventually_blocking(
                "the new leader writes status",
                Duration::from_secs(120),
                || {
                    let s = accepted(c, "after-takeover");
                    (s == "True").then_some(()).ok_or(s)
                },
            );
            eventually_blocking(
                "the old leader's pod ends",
                Duration::from_secs(300),
                || {
                    let o = c.kubectl(&["-n", NS, "get", "pod", &holder, "-o", "name"]);
                    (!o.status.success()).then_some(()).ok_or("still there")
                },
            );
        },
    );
    figures.push(format!(
        "status lease taken over {:.1} s after the leader's pod was deleted \
         (it leads through its 15 s preStop sleep and releases the lease as it drains)",
        takeover.as_secs_f64()
    ));
}

/// Day 2: the node drained with the PodDisruptionBudget in place.
fn day2_node_drained(c: &Cluster, load: &Load, figures: &mut Vec<String>) {
    // The node drained with the PodDisruptionBudget in place (one node:
    // the evicted pod's successor cannot be scheduled while it is
    // cordoned). One pod is evicted and drains; the PDB refuses the other
    // eviction for as long as the drain tries, so one replica serves
    // throughout; uncordoned, the successor starts.
    let mut refused = String::new();
    step(
        "the node drained with the PDB in place, then uncordoned",
        load,
        figures,
        || {
            let before: Vec<String> = pods(c).into_iter().map(|p| p.0).collect();
            let o = c.kubectl(&[
                "drain",
                NODE_NAME,
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--pod-selector=app.kubernetes.io/name=seedlink",
                "--timeout=30s",
            ]);
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert!(
                !o.status.success() && err.contains("disruption budget"),
                "the PDB let the drain evict every pod: {err}"
            );
            refused = err
                .lines()
                .find(|l| l.contains("disruption budget"))
                .unwrap_or_default()
                .to_string();
            let now = pods(c);
            let kept: Vec<&String> = now
                .iter()
                .filter(|p| p.2 && before.contains(&p.0))
                .map(|p| &p.0)
                .collect();
            assert_eq!(kept.len(), 1, "one replica stays Ready: {now:?}");
            c.kubectl_ok(&["uncordon", NODE_NAME]);
            rolled_out(c);
        },
    );
    eprintln!("installed: the drain was refused: {}", refused.trim());
}

/// `helm uninstall` of the three releases leaves only what existed before
/// (and what the docs list).
fn uninstall_leaves_nothing(c: &Cluster, before: &[String]) {
    // Uninstall: what is left is the CRDs the chart installed (Helm never
    // deletes crds/) and the Secrets the operator made, both there before.
    for ns in [SHOOT_NS, "shoot-workload", SIDECAR_NS, SIDECAR_AGENTS_NS] {
        c.kubectl_ok(&["delete", "namespace", ns, "--wait=false"]);
    }
    helm_cmd(
        c,
        &[
            "uninstall",
            "seedlink-shoot",
            "--namespace",
            "kube-system",
            "--wait",
        ],
    );
    helm_cmd(
        c,
        &[
            "uninstall",
            "seedlink-shoot-b",
            "--namespace",
            SIDECAR_AGENTS_NS,
            "--wait",
        ],
    );
    helm_cmd(c, &["uninstall", "seedlink", "--namespace", NS, "--wait"]);
    // Until the last pod has drained and ended (nothing of seedlink runs
    // that could write an object back).
    eventually_blocking("seedlink's pods end", Duration::from_secs(300), || {
        let pods = jsonpath(
            c,
            &["get", "pods", "-A", "-l", "app.kubernetes.io/name"],
            "{.items[*].metadata.name}",
        );
        pods.is_empty().then_some(()).ok_or(pods)
    });
    let after = inventory(c);
    let left: Vec<&String> = after.iter().filter(|o| !before.contains(o)).collect();
    eprintln!("installed: left after helm uninstall: {left:?}");
    let allowed = |o: &str| {
        // The node's heartbeat, and the shoot's namespace being deleted.
        o == "Lease/kube-node-lease/node-1"
            || o.contains(&format!("/{SHOOT_NS}/"))
            || o.contains("/shoot-workload/")
            || o.contains(&format!("/{SIDECAR_NS}/"))
            || o.contains(&format!("/{SIDECAR_AGENTS_NS}/"))
            || [ONBOARDED_NS, GREEDY_NS]
                .iter()
                .any(|ns| o.contains(&format!("/{ns}/")))
    };
    let unexpected: Vec<&&String> = left.iter().filter(|o| !allowed(o)).collect();
    assert!(
        unexpected.is_empty(),
        "helm uninstall left {unexpected:?} (all that is new: {left:?})"
    );
}

#[test]
fn helm_install_on_a_real_cluster_carries_kubectl_through_the_pods_and_day_2() {
    let c = Cluster::start(Options {
        addresses: LB_POOL.iter().map(|a| a.to_string()).collect(),
        kube_proxy: true,
        prefix: "slinst",
    });
    c.serve_load_balancers(LB_POOL.iter().map(|a| a.to_string()).collect());
    let t = Instant::now();
    let archive = image_archive(&c.dir);
    eprintln!(
        "installed: image built in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    c.import_image(&archive);
    c.import_image(&seedlink_testkit::cluster::peer(
        &c.api.kube_dir,
        "images/control-plane.oci.tar",
    ));
    let seed = prerequisites(&c);
    let before = inventory(&c);

    // The install, as docs/KUBERNETES.md gives it, and the time to Ready.
    let chart = repo_root().join("charts/seedlink");
    let chart = chart.display().to_string();
    let t = Instant::now();
    let out = helm_cmd(
        &c,
        &[
            "install",
            "seedlink",
            &chart,
            "--namespace",
            NS,
            "--set",
            "kubeApiserverClientCA=seedlink-kas-client-ca",
        ],
    );
    assert!(
        out.contains("rollout status deployment/seedlink"),
        "NOTES: {out}"
    );
    rolled_out(&c);
    let to_ready = t.elapsed();
    let mut figures = vec![format!(
        "helm install to every pod Ready: {:.1} s",
        to_ready.as_secs_f64()
    )];
    eprintln!("installed: {}", figures[0]);

    // Pods run with the chart's ServiceAccount and its projected token.
    let sa = jsonpath(
        &c,
        &[
            "-n",
            NS,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=seedlink",
        ],
        "{.items[*].spec.serviceAccountName}",
    );
    assert_eq!(sa, "seedlink seedlink", "pods' ServiceAccounts");

    // The load balancer's address, and the cluster's own API server behind
    // it by SNI.
    let lb = eventually_blocking(
        "the Service's LoadBalancer address",
        Duration::from_secs(60),
        || {
            let ip = jsonpath(
                &c,
                &["-n", NS, "get", "service", "seedlink"],
                "{.status.loadBalancer.ingress[0].ip}",
            );
            (!ip.is_empty()).then_some(ip).ok_or("none yet")
        },
    );
    let egress = egress_from_the_pod(&c, &lb);
    let pki = shoot_control_plane(&c, &seed, &egress);
    route(&c, "api", API_HOST);
    let kubeconfig = through_gateway(&c, &lb, &pki);
    let kubectl = c.api.kube_dir.join("bin/kubectl");
    reaches_the_shoot(&kubectl, &kubeconfig, "kubectl through the gateway");
    // The route's status, written by the pods.
    assert_eq!(accepted(&c, "api"), "True");

    // The shoot's side from its chart, and the shoot kube-apiserver's
    // egress through the tunnel-server pods to the agents' pods: its
    // service proxy reaches a pod of the shoot's network.
    shoot_side(&c, &lb, &seed);
    let echo = echo_in_the_shoot(&c, &kubeconfig);
    reaches_through_the_tunnel(
        &kubectl,
        &kubeconfig,
        "the shoot's kube-apiserver through the tunnel",
    );

    kubelet_and_webhook_through_the_tunnel(&c, &kubectl, &kubeconfig, &pki);

    let node_proxy = node_proxy_path(&c, &kubectl, &pki);
    sidecar_paths(&c, &lb, &seed, &kubectl, &echo);

    let asks = vec![
        (kubeconfig.clone(), "/version"),
        (kubeconfig.clone(), VIA_TUNNEL),
        (node_proxy, "/version"),
    ];
    let load = Load::start(kubectl.clone(), asks, c.netns.clone());
    load.wait_for(3);
    step(
        "a third control plane onboarded with one object, then deleted",
        &load,
        &mut figures,
        || onboarding::onboarding(&c, &chart, &lb, &kubectl, &echo),
    );
    day2_rollout_restart(&c, &load, &mut figures);
    day2_helm_upgrade(&c, &load, &mut figures, &chart);
    day2_scale_with_the_api_server_unreachable(&c, &load, &mut figures);
    day2_leader_pod_deleted(&c, &load, &mut figures);
    day2_node_drained(&c, &load, &mut figures);
    let (sent, failed) = load.counts();
    let errors = load.errors.lock().unwrap().clone();
    drop(load);
    eprintln!("installed: day 2: {sent} requests, {failed} failed");
    for f in &figures {
        eprintln!("installed: {f}");
    }
    assert_eq!(
        failed,
        0,
        "requests failed through day 2 ({sent} sent): {errors:?}\nlogs in {}",
        c.dir.display()
    );

    uninstall_leaves_nothing(&c, &before);
}
