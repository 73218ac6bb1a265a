//! A one-node Kubernetes cluster in a network namespace of its own, every
//! part of it real and built from its Go module by scripts/build-kube-peers:
//! kube-apiserver and etcd, kube-controller-manager (Deployments,
//! ReplicaSets, EndpointSlices, ServiceAccounts, the root CA ConfigMap,
//! namespace deletion), kube-scheduler, a kubelet with containerd, runc and
//! the standard CNI plugins (each pod on a bridge), and, when asked,
//! kube-proxy (iptables mode: ClusterIP, NodePort and LoadBalancer
//! addresses) with a LoadBalancer stand-in ([`Cluster::serve_load_balancers`]).
//!
//! [`Cluster::start`] moves the calling thread into the namespace first, so
//! every process it starts, and every thread the caller starts afterwards,
//! lives there. Dropping the cluster kills every process in the namespace,
//! unmounts what the kubelet mounted and removes the namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::eventually_blocking;
use crate::kubeapi::{KubeApi, Options as ApiOptions};

/// The node's own address (the kubelet's, kube-apiserver's advertised one).
pub const NODE_IP: &str = "10.250.255.1";
/// The pods' subnet (the CNI bridge's).
pub const POD_SUBNET: &str = "10.244.0.0/24";
/// The `kubernetes` Service's ClusterIP (first of 10.96.0.0/16).
pub const API_SERVICE_IP: &str = "10.96.0.1";
/// The node's name.
pub const NODE_NAME: &str = "node-1";
/// The network name in the CNI configuration (libcni caches results
/// under it in /var/lib/cni/results).
const CNI_NETWORK: &str = "seedlink-node";

/// What to run besides the API server, the controller-manager, the
/// scheduler and the kubelet.
#[derive(Default)]
pub struct Options {
    /// Addresses put on the node's loopback besides [`NODE_IP`] (the
    /// LoadBalancer pool, a class's Gateway addresses).
    pub addresses: Vec<String>,
    /// Run kube-proxy.
    pub kube_proxy: bool,
    /// The name prefix of the namespace and the work directory.
    pub prefix: &'static str,
}

/// Runs `cmd`, panics with its output unless it succeeds, returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A process killed when the value is dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A peer binary of the kube cache (or any path): panics naming the script
/// that makes it when it is missing.
pub fn peer(dir: &Path, rel: &str) -> PathBuf {
    let p = dir.join(rel);
    assert!(
        p.exists(),
        "{} is missing: run scripts/install-peers (scripts/build-kube-peers builds it)",
        p.display()
    );
    p
}

pub use crate::kubeapi::helm;

/// Moves the calling thread into network namespace `name` (what it starts
/// from now on is there too).
#[allow(unsafe_code)]
pub fn enter(name: &str) {
    let f = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on a descriptor we own.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

fn netns_names() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Kills every process in network namespace `netns` but this one (a
/// node's containerd, its shims and containers outlive their parents) and
/// unmounts everything under `dir` (the kubelet's volumes), deepest first.
pub fn stop_node(netns: &str, dir: &Path) {
    for _ in 0..3 {
        let pids = Command::new("ip")
            .args(["netns", "pids", netns])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let own = std::process::id().to_string();
        let others: Vec<&str> = pids.split_whitespace().filter(|p| *p != own).collect();
        if others.is_empty() {
            break;
        }
        for pid in others {
            let _ = Command::new("kill").args(["-9", pid]).status();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let prefix = dir.display().to_string();
    let mut mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&prefix))
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in mounts {
        let _ = Command::new("umount").args(["-l", &m]).status();
    }
}

/// The namespace, and what the node leaves behind, removed however the
/// test ends: every process in it (containerd's shims and the containers
/// outlive containerd), every mount under the node's directory (the
/// kubelet's volumes), the namespace itself.
struct NodeGuard {
    netns: String,
    dir: PathBuf,
    /// The network namespaces that existed before (containerd names each
    /// pod's `cni-<uuid>` in /run/netns; those it leaves are removed).
    before: Vec<String>,
    /// When it started (containerd's loopback results written since are its).
    started: std::time::SystemTime,
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        stop_node(&self.netns, &self.dir);
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
        for pod in netns_names() {
            if pod.starts_with("cni-") && !self.before.contains(&pod) {
                let _ = Command::new("ip").args(["netns", "del", &pod]).status();
            }
        }
        for e in std::fs::read_dir("/var/lib/cni/results")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let since = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= self.started);
            if name.starts_with(&format!("{CNI_NETWORK}-"))
                || (name.starts_with("cni-loopback-") && since)
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
        // A failure's logs stay (its message names the directory).
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A kubelet's configuration for a test node: at `node_ip`, on the
/// containerd at `sock`, trusting client certificates of `client_ca` (the
/// API server's, for logs, exec and port-forward), serving with
/// `serving` (certificate and key files) or a self-signed pair; no cgroup
/// hierarchy of its own, no eviction (the machine is shared), no DNS.
pub fn kubelet_config(
    node_ip: &str,
    sock: &Path,
    client_ca: &Path,
    serving: Option<(&Path, &Path)>,
) -> String {
    let tls = serving.map_or_else(String::new, |(cert, key)| {
        format!(
            "tlsCertFile: {}\ntlsPrivateKeyFile: {}\n",
            cert.display(),
            key.display()
        )
    });
    format!(
        "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {node_ip}
port: 10250
readOnlyPort: 0
{tls}authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
containerRuntimeEndpoint: unix://{sock}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
evictionHard: {{memory.available: 1Mi, nodefs.available: 1%, imagefs.available: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: ''
maxPods: 110
syncFrequency: 5s
nodeStatusUpdateFrequency: 5s
fileCheckFrequency: 5s
",
        ca = client_ca.display(),
        sock = sock.display()
    )
}

/// The running cluster (see the module's docs).
pub struct Cluster {
    /// The API server (its admin kubeconfig, CA, URL).
    pub api: KubeApi,
    /// The work directory: every component's log, the node's state.
    pub dir: PathBuf,
    /// The network namespace's name.
    pub netns: String,
    sock: PathBuf,
    ctr: PathBuf,
    procs: Vec<Proc>,
    // Last: removes the namespace after every process above is stopped.
    _node: NodeGuard,
}

impl Cluster {
    /// Starts the cluster and waits until the node is Ready. Blocking.
    pub fn start(opts: Options) -> Cluster {
        let kube = crate::kubeapi::kube_dir();
        let kcm = peer(&kube, "bin/kube-controller-manager");
        let scheduler = peer(&kube, "bin/kube-scheduler");
        let kubelet = peer(&kube, "bin/kubelet");
        let busybox = peer(&kube, "images/busybox.oci.tar");
        for plugin in ["bridge", "host-local", "loopback"] {
            peer(Path::new("/usr/lib/cni"), plugin);
        }
        let (containerd, ctr) = (crate::require("containerd"), crate::require("ctr"));
        crate::require("runc");

        let prefix = if opts.prefix.is_empty() {
            "slnode"
        } else {
            opts.prefix
        };
        let netns = format!("{prefix}-{}", std::process::id());
        let dir = tempfile::Builder::new()
            .prefix(&format!("seedlink-{prefix}-"))
            .tempdir()
            .unwrap()
            .keep();
        run(Command::new("ip").args(["netns", "add", &netns]));
        let node = NodeGuard {
            netns: netns.clone(),
            dir: dir.clone(),
            before: netns_names(),
            started: std::time::SystemTime::now(),
        };
        enter(&netns);
        run(Command::new("ip").args(["link", "set", "lo", "up"]));
        for a in opts.addresses.iter().map(String::as_str).chain([NODE_IP]) {
            run(Command::new("ip").args(["addr", "add", &format!("{a}/32"), "dev", "lo"]));
        }
        // A route for the Services' ClusterIPs (a node's default route
        // carries them; kube-proxy's OUTPUT rules rewrite them first).
        run(Command::new("ip").args(["route", "add", "10.96.0.0/16", "dev", "lo"]));
        // Bridged pod-to-pod traffic through a Service passes iptables (what
        // br_netfilter's sysctl does on every node kube-proxy runs on).
        let _ = std::fs::write("/proc/sys/net/bridge/bridge-nf-call-iptables", "1");
        let _ = std::fs::write("/proc/sys/net/ipv4/ip_forward", "1");

        // Pods reach the API server on the node's address, through the
        // `kubernetes` Service (kube-proxy) or directly.
        let api = KubeApi::start_with(ApiOptions {
            crds: true,
            ips: vec![NODE_IP.parse().unwrap(), API_SERVICE_IP.parse().unwrap()],
            args: vec![
                "--bind-address=0.0.0.0".into(),
                format!("--advertise-address={NODE_IP}"),
                // logs, exec, port-forward: to the kubelet at its address,
                // as the admin (the kubelet trusts the cluster's CA).
                "--kubelet-preferred-address-types=InternalIP".into(),
            ],
            args_for: Some(std::sync::Arc::new(|_, ca: &Path| {
                let dir = ca.parent().unwrap_or(Path::new("/"));
                vec![
                    format!(
                        "--kubelet-client-certificate={}",
                        dir.join("admin.pem").display()
                    ),
                    format!(
                        "--kubelet-client-key={}",
                        dir.join("admin-key.pem").display()
                    ),
                ]
            })),
            ..ApiOptions::default()
        });
        let admin = api.admin_kubeconfig.display().to_string();
        let log = |n: &str| Stdio::from(std::fs::File::create(dir.join(n)).unwrap());
        let mut procs = Vec::new();
        procs.push(Proc(
            Command::new(&kcm)
                .arg(format!("--kubeconfig={admin}"))
                .arg(format!(
                    "--service-account-private-key-file={}",
                    api.dir.join("sa-key.pem").display()
                ))
                .arg(format!("--root-ca-file={}", api.ca.display()))
                .args([
                    "--leader-elect=false",
                    "--secure-port=0",
                    "--use-service-account-credentials=false",
                ])
                .stdout(log("kube-controller-manager.log"))
                .stderr(log("kube-controller-manager.log"))
                .spawn()
                .unwrap(),
        ));
        procs.push(Proc(
            Command::new(&scheduler)
                .arg(format!("--kubeconfig={admin}"))
                .args(["--leader-elect=false", "--secure-port=0"])
                .stdout(log("kube-scheduler.log"))
                .stderr(log("kube-scheduler.log"))
                .spawn()
                .unwrap(),
        ));

        // containerd with the standard CNI plugins: each pod on a bridge in
        // this namespace, at an address of POD_SUBNET.
        let d = dir.join("node");
        std::fs::create_dir_all(d.join("cni")).unwrap();
        std::fs::write(
            d.join("cni/10-pods.conflist"),
            serde_json::json!({
                "cniVersion": "0.4.0", "name": CNI_NETWORK,
                "plugins": [{"type": "bridge", "bridge": "pods0", "isGateway": true,
                             "isDefaultGateway": true, "ipMasq": false,
                             "hairpinMode": true,
                             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                                      "dataDir": d.join("ipam").display().to_string()}}]
            })
            .to_string(),
        )
        .unwrap();
        let sock = d.join("containerd.sock");
        std::fs::write(
            d.join("containerd.toml"),
            format!(
                "version = 2\nroot = \"{r}/root\"\nstate = \"{r}/state\"\n[grpc]\n  address = \"{s}\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"localhost/busybox:1\"\n  restrict_oom_score_adj = true\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"native\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/usr/lib/cni\"\n  conf_dir = \"{r}/cni\"\n",
                r = d.display(),
                s = sock.display()
            ),
        )
        .unwrap();
        procs.push(Proc(
            Command::new(&containerd)
                .arg("--config")
                .arg(d.join("containerd.toml"))
                .stdout(Stdio::null())
                .stderr(log("containerd.log"))
                .spawn()
                .unwrap(),
        ));
        let mut cluster = Cluster {
            api,
            dir: dir.clone(),
            netns,
            sock: sock.clone(),
            ctr,
            procs,
            _node: node,
        };
        eventually_blocking("containerd", Duration::from_secs(60), || {
            let o = cluster
                .ctr(&["images", "import", "--base-name", "localhost/busybox"])
                .arg(&busybox)
                .output()
                .unwrap();
            o.status
                .success()
                .then_some(())
                .ok_or_else(|| String::from_utf8_lossy(&o.stderr).into_owned())
        });

        std::fs::write(
            d.join("kubelet.yaml"),
            kubelet_config(NODE_IP, &sock, &cluster.api.ca, None),
        )
        .unwrap();
        cluster.procs.push(Proc(
            Command::new(&kubelet)
                .arg("--config")
                .arg(d.join("kubelet.yaml"))
                .arg(format!("--kubeconfig={admin}"))
                .args(["--hostname-override", NODE_NAME, "--node-ip", NODE_IP])
                .arg("--root-dir")
                .arg(d.join("kubelet"))
                .stdout(Stdio::null())
                .stderr(log("kubelet.log"))
                .spawn()
                .unwrap(),
        ));
        if opts.kube_proxy {
            let proxy = peer(&kube, "bin/kube-proxy");
            // iptables mode; the conntrack sysctls are left as the
            // namespace has them (0 skips kube-proxy's writes).
            std::fs::write(
                d.join("kube-proxy.yaml"),
                format!(
                    "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {admin}}}
hostnameOverride: {NODE_NAME}
mode: iptables
clusterCIDR: {POD_SUBNET}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"
                ),
            )
            .unwrap();
            cluster.procs.push(Proc(
                Command::new(&proxy)
                    .arg("--config")
                    .arg(d.join("kube-proxy.yaml"))
                    .stdout(Stdio::null())
                    .stderr(log("kube-proxy.log"))
                    .spawn()
                    .unwrap(),
            ));
        }
        eventually_blocking("the node is Ready", Duration::from_secs(180), || {
            let o = cluster.kubectl(&[
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ]);
            (String::from_utf8_lossy(&o.stdout).trim() == "True")
                .then_some(())
                .ok_or_else(|| String::from_utf8_lossy(&o.stderr).into_owned())
        });
        cluster
    }

    /// `ctr` on the node's containerd, in the kubelet's namespace.
    pub fn ctr(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.ctr);
        c.arg("--address")
            .arg(&self.sock)
            .args(["-n", "k8s.io"])
            .args(args);
        c
    }

    /// Imports an OCI archive into the node's image store (what a pull
    /// would leave there).
    pub fn import_image(&self, archive: &Path) {
        run(self.ctr(&["images", "import"]).arg(archive));
    }

    /// kubectl as the cluster's admin.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new(self.api.kube_dir.join("bin/kubectl"))
            .arg(format!(
                "--kubeconfig={}",
                self.api.admin_kubeconfig.display()
            ))
            .args(args)
            .output()
            .unwrap()
    }

    /// kubectl as the admin; panics with its stderr unless it succeeds.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let o = self.kubectl(args);
        assert!(
            o.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `kubectl apply` of `yaml`, as the admin.
    pub fn apply(&self, yaml: &str) {
        let f = self.dir.join("apply.yaml");
        std::fs::write(&f, yaml).unwrap();
        self.kubectl_ok(&["apply", "-f", &f.display().to_string()]);
    }

    /// A log file in the work directory, for a process the test starts.
    pub fn log(&self, name: &str) -> Stdio {
        Stdio::from(std::fs::File::create(self.dir.join(name)).unwrap())
    }

    /// Keeps a process running until the cluster is dropped.
    pub fn keep(&mut self, child: Child) {
        self.procs.push(Proc(child));
    }

    /// The LoadBalancer stand-in: gives each Service of type LoadBalancer
    /// the next address of `pool` (already on the node's loopback) in
    /// `status.loadBalancer.ingress`, which kube-proxy then routes to the
    /// Service's endpoints. That is what MetalLB does in layer-2 mode, and
    /// what a cloud's service controller does before its LB forwards to the
    /// nodes: assign an address and write it in the status; the data path
    /// from that address to the pods is kube-proxy's own rules. On one node
    /// in a namespace there is no neighbour to announce the address to.
    /// Runs until the cluster's process ends (a thread of its own).
    pub fn serve_load_balancers(&self, pool: Vec<String>) {
        let kubectl = self.api.kube_dir.join("bin/kubectl");
        let admin = self.api.admin_kubeconfig.clone();
        let netns = self.netns.clone();
        std::thread::spawn(move || {
            enter(&netns);
            let mut given: Vec<(String, String)> = Vec::new();
            loop {
                let o = Command::new(&kubectl)
                    .arg(format!("--kubeconfig={}", admin.display()))
                    .args([
                        "get",
                        "services",
                        "-A",
                        "-o",
                        "jsonpath={range .items[?(@.spec.type==\"LoadBalancer\")]}{.metadata.namespace}/{.metadata.name} {.status.loadBalancer.ingress[0].ip}{\"\\n\"}{end}",
                    ])
                    .output();
                let Ok(o) = o else { return };
                if !o.status.success() && !Path::new(&format!("/run/netns/{netns}")).exists() {
                    return;
                }
                for line in String::from_utf8_lossy(&o.stdout).lines() {
                    let mut f = line.split_whitespace();
                    let (Some(svc), None) = (f.next(), f.next()) else {
                        continue;
                    };
                    let ip = match given.iter().find(|(s, _)| s == svc) {
                        Some((_, ip)) => ip.clone(),
                        None => match pool.iter().find(|a| !given.iter().any(|(_, g)| g == *a)) {
                            Some(a) => {
                                given.push((svc.to_string(), a.clone()));
                                a.clone()
                            }
                            None => continue,
                        },
                    };
                    let (ns, name) = svc.split_once('/').unwrap_or_default();
                    let _ = Command::new(&kubectl)
                        .arg(format!("--kubeconfig={}", admin.display()))
                        .args(["-n", ns, "patch", "service", name, "--subresource=status"])
                        .args(["--type=merge", "-p"])
                        .arg(format!(
                            "{{\"status\":{{\"loadBalancer\":{{\"ingress\":[{{\"ip\":\"{ip}\"}}]}}}}}}"
                        ))
                        .output();
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
    }
}
