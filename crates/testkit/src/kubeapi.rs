//! A real kube-apiserver with etcd on loopback, started once per test
//! binary (`KubeApi::shared`), with RBAC on, a temporary PKI (serving
//! certificate, ServiceAccount signing key, an admin client certificate),
//! the Gateway API CRDs as released and seedlink's own CRDs installed. Each
//! test works in namespaces of its own (`KubeApi::namespace`).
//!
//! The binaries come from `scripts/build-kube-peers` (run by
//! `scripts/install-peers`): `$SEEDLINK_KUBE_DIR`, else the directory
//! recorded in `~/.cache/seedlink/kube-peers`. A missing binary fails the
//! test with how to build it.
//!
//! The API server runs with `--watch-cache=false`: watches then go to etcd,
//! so compacting etcd (`KubeApi::compact`) makes a resumed watch answer
//! `410 Gone` for real, which the watch cache would otherwise hide.
//! Everything else is the API server's defaults.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{pinned_kind, Scope};
use serde_json::{json, Value};

/// The field manager the tests apply objects with.
pub const TEST_MANAGER: &str = "seedlink-tests";

/// The running API server of this test binary.
pub struct KubeApi {
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// Its address.
    pub addr: SocketAddr,
    /// The cluster CA (PEM file).
    pub ca: PathBuf,
    /// The admin kubeconfig (system:masters).
    pub admin_kubeconfig: PathBuf,
    /// The directory of the binaries and the Gateway API CRDs.
    pub kube_dir: PathBuf,
    /// Its data, logs and PKI.
    pub dir: PathBuf,
    /// The ServiceAccount issuer (`--service-account-issuer`).
    pub issuer: String,
    etcd_url: String,
    /// Dropped with the value: the thread that started the processes
    /// ends, and they die with it (PR_SET_PDEATHSIG).
    _stop: Option<std::sync::mpsc::Sender<()>>,
}

/// Flags computed from the API server's URL and CA file, before it starts.
pub type ArgsFor = std::sync::Arc<dyn Fn(&str, &Path) -> Vec<String> + Send + Sync>;

/// How [`KubeApi::start_with`] starts an API server of a test's own.
#[derive(Clone, Default)]
pub struct Options {
    /// Flags after the defaults (a flag given here replaces the default).
    pub args: Vec<String>,
    /// More flags, from the URL and CA the API server will have (for
    /// files that must name it, written before it starts).
    pub args_for: Option<ArgsFor>,
    /// Install the Gateway API and seedlink CRDs (the shared one does).
    pub crds: bool,
    /// More DNS names in the serving certificate.
    pub names: Vec<String>,
    /// More IP addresses in the serving certificate (the node's, the
    /// `kubernetes` Service's, for pods that reach it).
    pub ips: Vec<std::net::IpAddr>,
}

/// A peer the project's scripts built into the cache: `$env` if set, else
/// the path recorded in `~/.cache/seedlink/<pointer>` (where
/// scripts/install-peers writes it).
pub fn cached_peer(env: &str, pointer: &str) -> (PathBuf, PathBuf) {
    if let Ok(p) = std::env::var(env) {
        return (PathBuf::from(p), PathBuf::from(format!("${env}")));
    }
    let cache = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache")
        });
    let file = cache.join("seedlink").join(pointer);
    let p = std::fs::read_to_string(&file).unwrap_or_default();
    (PathBuf::from(p.trim()), file)
}

/// Where scripts/build-kube-peers put kube-apiserver, etcd and the CRDs.
pub fn kube_dir() -> PathBuf {
    let (dir, from) = cached_peer("SEEDLINK_KUBE_DIR", "kube-peers");
    for b in ["kube-apiserver", "etcd"] {
        assert!(
            dir.join("bin").join(b).exists(),
            "{b} is missing (looked in {:?} from {}): build it with scripts/build-kube-peers \
             (scripts/install-peers does), or set SEEDLINK_KUBE_DIR",
            dir.join("bin"),
            from.display()
        );
    }
    dir
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

/// Children of this thread die with the test binary (PR_SET_PDEATHSIG
/// fires when the spawning thread ends, so a thread that never ends spawns
/// them).
#[allow(unsafe_code)]
fn spawn_for_life(mut cmd: Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn()
}

struct Pki {
    ca_pem: String,
    server: (String, String),
    admin: (String, String),
    sa_key: String,
    sa_pub: String,
}

fn pki(names: &[String], ips: &[std::net::IpAddr]) -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
        SanType,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "test kubernetes CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, &ca_key);
    let key = KeyPair::generate().unwrap();
    let mut srv = CertificateParams::new(
        vec![
            "localhost".to_string(),
            "kubernetes".to_string(),
            "kubernetes.default.svc".to_string(),
        ]
        .into_iter()
        .chain(names.iter().cloned())
        .collect::<Vec<_>>(),
    )
    .unwrap();
    srv.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    for ip in ips {
        srv.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    let srv_cert = srv.signed_by(&key, &issuer).unwrap();
    let admin_key = KeyPair::generate().unwrap();
    let mut admin = CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "system:masters");
    dn.push(DnType::CommonName, "test-admin");
    admin.distinguished_name = dn;
    let admin_cert = admin.signed_by(&admin_key, &issuer).unwrap();
    let sa = KeyPair::generate().unwrap();
    Pki {
        ca_pem: ca_cert.pem(),
        server: (srv_cert.pem(), key.serialize_pem()),
        admin: (admin_cert.pem(), admin_key.serialize_pem()),
        sa_key: sa.serialize_pem(),
        sa_pub: sa.public_key_pem(),
    }
}

/// A kubeconfig for `server` (the API server, or a proxy in front of it)
/// with a bearer token.
pub fn token_kubeconfig(dir: &Path, name: &str, server: &str, ca: &Path, token: &str) -> PathBuf {
    let p = dir.join(format!("{name}.kubeconfig"));
    std::fs::write(
        &p,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context: {{cluster: test, user: u}}\ncurrent-context: test\n",
            ca.display()
        ),
    )
    .unwrap();
    p
}

impl KubeApi {
    /// The API server of this test binary, started on first use.
    pub fn shared() -> &'static KubeApi {
        static API: OnceLock<KubeApi> = OnceLock::new();
        API.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            // The processes' parent thread lives as long as the binary.
            std::thread::spawn(move || {
                let _ = tx.send(KubeApi::start(Options {
                    crds: true,
                    ..Options::default()
                }));
                loop {
                    std::thread::park();
                }
            });
            rx.recv().unwrap()
        })
    }

    /// An API server of the caller's own (etcd too), stopped when the value
    /// is dropped. Blocking: call it from `spawn_blocking` in async tests.
    pub fn start_with(opts: Options) -> KubeApi {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let _ = tx.send(KubeApi::start(opts));
            // Until the KubeApi is dropped (its sender with it).
            let _ = stopped.recv();
        });
        let mut api = rx.recv().expect("kube-apiserver did not start (see above)");
        api._stop = Some(stop);
        api
    }

    fn start(opts: Options) -> KubeApi {
        let kube_dir = kube_dir();
        // The data outlives the test binary (its processes are killed with
        // it, so nothing cleans up): the directories of binaries that are
        // gone are removed here.
        let tmp = std::env::temp_dir();
        for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name
                .strip_prefix("kubeapi-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("kubeapi-{}-", std::process::id()))
            .tempdir()
            .unwrap()
            .keep();
        let pki = pki(&opts.names, &opts.ips);
        let w = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let ca = w("ca.pem", &pki.ca_pem);
        let srv_crt = w("apiserver.pem", &pki.server.0);
        let srv_key = w("apiserver-key.pem", &pki.server.1);
        let admin_crt = w("admin.pem", &pki.admin.0);
        let admin_key = w("admin-key.pem", &pki.admin.1);
        let sa_key = w("sa-key.pem", &pki.sa_key);
        let sa_pub = w("sa.pub", &pki.sa_pub);
        // Every write, with who made it: what a test asks "who wrote the
        // status?" of.
        let audit_policy = w(
            "audit-policy.yaml",
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n  verbs: [create, update, patch, delete]\n- level: Metadata\n  verbs: [list]\n  resources: [{group: gateway.networking.k8s.io, resources: [tlsroutes]}]\n- level: None\n",
        );
        let log = |name: &str| Stdio::from(std::fs::File::create(dir.join(name)).unwrap());
        // etcd takes no port 0: free ports, tried a few times.
        let mut etcd_url = String::new();
        for attempt in 0..5 {
            let (client, peer) = (free_port(), free_port());
            etcd_url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let mut cmd = Command::new(kube_dir.join("bin/etcd"));
            cmd.args([
                "--name",
                "test",
                "--data-dir",
                &dir.join(format!("etcd-{attempt}")).display().to_string(),
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &format!("test={peer_url}"),
                // A test's data is thrown away: no fsync.
                "--unsafe-no-fsync",
            ])
            .stdout(log("etcd.log"))
            .stderr(log("etcd.log"));
            let mut child = spawn_for_life(cmd).unwrap();
            if wait_tcp(client, &mut child, Duration::from_secs(30)) {
                break;
            }
            assert!(
                attempt < 4,
                "etcd did not start: see {}",
                dir.join("etcd.log").display()
            );
        }
        let mut up = None;
        for _ in 0..5 {
            let port = free_port();
            let computed = opts
                .args_for
                .as_ref()
                .map(|f| f(&format!("https://127.0.0.1:{port}"), &ca))
                .unwrap_or_default();
            let defaults = [
                &format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                &format!("--secure-port={port}"),
                &format!("--tls-cert-file={}", srv_crt.display()),
                &format!("--tls-private-key-file={}", srv_key.display()),
                &format!("--client-ca-file={}", ca.display()),
                "--service-account-issuer=https://kubernetes.default.svc",
                &format!("--service-account-key-file={}", sa_pub.display()),
                &format!("--service-account-signing-key-file={}", sa_key.display()),
                "--api-audiences=https://kubernetes.default.svc",
                "--authorization-mode=RBAC",
                "--service-cluster-ip-range=10.96.0.0/16",
                &format!("--cert-dir={}", dir.join("certs").display()),
                "--watch-cache=false",
                &format!("--audit-policy-file={}", audit_policy.display()),
                &format!("--audit-log-path={}", dir.join("audit.log").display()),
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
            ];
            // A flag the caller gives replaces the default (some, such as
            // --service-account-issuer, are lists that refuse a repeat).
            let extra: Vec<&String> = opts.args.iter().chain(&computed).collect();
            let flag = |a: &str| a.split('=').next().unwrap_or_default().to_string();
            let given: std::collections::HashSet<String> = extra.iter().map(|a| flag(a)).collect();
            let mut cmd = Command::new(kube_dir.join("bin/kube-apiserver"));
            cmd.args(
                defaults
                    .iter()
                    .filter(|a| !given.contains(&flag(a)))
                    .map(|a| a.to_string()),
            )
            .args(extra)
            .stdout(log("kube-apiserver.log"))
            .stderr(log("kube-apiserver.log"));
            let mut child = spawn_for_life(cmd).unwrap();
            if wait_tcp(port, &mut child, Duration::from_secs(60)) {
                up = Some(port);
                break;
            }
        }
        let port = up.unwrap_or_else(|| {
            panic!(
                "kube-apiserver did not start: see {}",
                dir.join("kube-apiserver.log").display()
            )
        });
        let url = format!("https://127.0.0.1:{port}");
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        std::fs::write(
            &admin_kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    certificate-authority: {}\nusers:\n- name: admin\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: test\n  context: {{cluster: test, user: admin}}\ncurrent-context: test\n",
                ca.display(),
                admin_crt.display(),
                admin_key.display()
            ),
        )
        .unwrap();
        let api = KubeApi {
            url,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            ca,
            admin_kubeconfig,
            kube_dir,
            dir,
            issuer: "https://kubernetes.default.svc".into(),
            etcd_url,
            _stop: None,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(api.bootstrap(opts.crds));
        api
    }

    /// Waits for /readyz, then installs the CRDs (if asked) and waits until
    /// they serve.
    async fn bootstrap(&self, crds: bool) {
        let log = self.dir.join("kube-apiserver.log");
        let what = format!("kube-apiserver ready (its log: {})", log.display());
        let client = crate::eventually(&what, Duration::from_secs(60), async || {
            let c = self.client().await.map_err(|e| e.to_string())?;
            let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
            match c.request_text(req).await {
                Ok(t) if t.trim() == "ok" => Ok(c),
                Ok(t) => Err(t),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
        if !crds {
            return;
        }
        let mut crds = Vec::new();
        let gw = self.kube_dir.join("crds/gateway-api");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&gw)
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (scripts/build-kube-peers fetches them)",
                    gw.display()
                )
            })
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        files.push(repo_root().join("deploy/crds/seedlink.yaml"));
        for f in files {
            for doc in yaml_docs(&std::fs::read_to_string(&f).unwrap()) {
                if doc["kind"] == "CustomResourceDefinition" {
                    crds.push(doc["metadata"]["name"].as_str().unwrap().to_string());
                    apply(&client, doc).await;
                }
            }
        }
        let api: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
            Api::all(client.clone());
        for name in crds {
            let what = format!("CRD {name} established");
            crate::eventually(&what, Duration::from_secs(30), async || {
                api.get(&name)
                    .await
                    .ok()
                    .and_then(|c| c.status)
                    .is_some_and(|s| {
                        s.conditions
                            .iter()
                            .flatten()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    })
            })
            .await;
        }
    }

    /// An admin client (on the caller's runtime).
    pub async fn client(&self) -> Result<kube::Client, kube::Error> {
        let kc = kube::config::Kubeconfig::read_from(&self.admin_kubeconfig)
            .map_err(kube::Error::InferKubeconfig)?;
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(kube::Error::InferKubeconfig)?;
        kube::Client::try_from(cfg)
    }

    /// A fresh namespace `<prefix>-<n>`, created, with `labels`.
    pub async fn namespace(&self, client: &kube::Client, prefix: &str, labels: Value) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        apply(
            client,
            json!({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": name, "labels": labels}}),
        )
        .await;
        name
    }

    /// Installs seedlink's RBAC as deploy/kustomize/seed/rbac.yaml has it,
    /// into `namespace` (cluster-scoped names get `-<namespace>`), and
    /// returns a token of its ServiceAccount (`seedlink`).
    pub async fn install_rbac(&self, client: &kube::Client, namespace: &str) -> String {
        let text =
            std::fs::read_to_string(repo_root().join("deploy/kustomize/seed/rbac.yaml")).unwrap();
        for doc in yaml_docs(&text) {
            apply(client, into_namespace(doc, namespace)).await;
        }
        self.token(client, namespace, "seedlink").await
    }

    /// Installs the onboarding controller's ServiceAccount and RBAC as the
    /// chart renders them (`helm template --set onboarding.enabled=true`),
    /// named as [`KubeApi::install_rbac`] names the install's (so its
    /// `bind` names `seedlink-tunnel-trust-<namespace>`), and returns a
    /// token of its ServiceAccount (`seedlink-onboard`).
    pub async fn install_onboarding_rbac(&self, client: &kube::Client, namespace: &str) -> String {
        let docs = helm_template("seedlink", namespace, &["--set", "onboarding.enabled=true"]);
        let rbac = [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ];
        for doc in docs {
            let name = doc["metadata"]["name"].as_str().unwrap_or_default();
            if rbac.contains(&doc["kind"].as_str().unwrap_or_default())
                && name.starts_with("seedlink-onboard")
            {
                apply(client, into_namespace(doc, namespace)).await;
            }
        }
        self.token(client, namespace, "seedlink-onboard").await
    }

    /// A token of ServiceAccount `namespace/name` (TokenRequest, 1 h).
    pub async fn token(&self, client: &kube::Client, namespace: &str, name: &str) -> String {
        self.token_for(client, namespace, name, "https://kubernetes.default.svc")
            .await
    }

    /// A token of ServiceAccount `namespace/name` for `audience`
    /// (TokenRequest, 1 h), as a projected token volume gets it.
    pub async fn token_for(
        &self,
        client: &kube::Client,
        namespace: &str,
        name: &str,
        audience: &str,
    ) -> String {
        use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
        use k8s_openapi::api::core::v1::ServiceAccount;
        let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![audience.into()],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        api.create_token_request(name, &Default::default(), &req)
            .await
            .unwrap()
            .status
            .unwrap()
            .token
    }

    /// A kubeconfig with `token` for this API server, or for `via` (a
    /// proxy in front of it) when given.
    pub fn kubeconfig(
        &self,
        dir: &Path,
        name: &str,
        token: &str,
        via: Option<SocketAddr>,
    ) -> PathBuf {
        let server = via.map_or_else(|| self.url.clone(), |a| format!("https://{a}"));
        token_kubeconfig(dir, name, &server, &self.ca, token)
    }

    /// The audit log's entries so far: every create, update, patch and
    /// delete (and every list of TLSRoutes: a client's re-list shows) with
    /// its `user.username`, `verb` and `objectRef`.
    pub fn audit(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Compacts etcd past every revision a client has seen: two writes of
    /// a key outside Kubernetes' prefix first, then a compaction at the
    /// current revision, so that every watch resumed from an earlier
    /// resourceVersion gets `410 Gone`.
    pub async fn compact(&self) {
        // base64("/seedlink-tests/bump")
        let bump = json!({"key": "L3NlZWRsaW5rLXRlc3RzL2J1bXA=", "value": "MQ=="});
        for _ in 0..2 {
            etcd_post(&self.etcd_url, "/v3/kv/put", &bump).await;
        }
        let rev = etcd_post(&self.etcd_url, "/v3/kv/range", &json!({"key": "AA=="})).await;
        let rev = rev["header"]["revision"].as_str().unwrap().to_string();
        let out = etcd_post(
            &self.etcd_url,
            "/v3/kv/compaction",
            &json!({"revision": rev, "physical": true}),
        )
        .await;
        // etcd's gateway answers an error as {"code": .., "message": ..}.
        assert!(
            out.get("code").is_none() && out.get("error").is_none() && out["header"].is_object(),
            "compaction: {out}"
        );
    }
}

/// An install's object moved into `namespace`: namespaced objects go
/// there, cluster-scoped names (and the ClusterRoles they refer to or
/// `bind`) get `-<namespace>`, ServiceAccount subjects are the
/// namespace's.
fn into_namespace(mut doc: Value, namespace: &str) -> Value {
    let suffixed = |n: &str| format!("{n}-{namespace}");
    let kind = doc["kind"].as_str().unwrap_or_default().to_string();
    match kind.as_str() {
        "ClusterRole" | "ClusterRoleBinding" => {
            let n = suffixed(doc["metadata"]["name"].as_str().unwrap_or_default());
            doc["metadata"]["name"] = n.into();
        }
        _ => doc["metadata"]["namespace"] = namespace.into(),
    }
    if doc["roleRef"]["kind"] == "ClusterRole" {
        let r = suffixed(doc["roleRef"]["name"].as_str().unwrap_or_default());
        doc["roleRef"]["name"] = r.into();
    }
    if let Some(rules) = doc.get_mut("rules").and_then(|r| r.as_array_mut()) {
        for rule in rules {
            if rule["resources"] == json!(["clusterroles"]) {
                if let Some(names) = rule.get_mut("resourceNames").and_then(|n| n.as_array_mut()) {
                    for n in names {
                        *n = suffixed(n.as_str().unwrap_or_default()).into();
                    }
                }
            }
        }
    }
    if let Some(subjects) = doc.get_mut("subjects").and_then(|s| s.as_array_mut()) {
        for s in subjects {
            if s["kind"] == "ServiceAccount" {
                s["namespace"] = namespace.into();
            }
        }
    }
    doc
}

/// Helm, built from its Go module by scripts/install-peers.
pub fn helm() -> PathBuf {
    let (helm, from) = cached_peer("SEEDLINK_HELM", "helm");
    assert!(
        helm.is_file(),
        "helm is missing (looked in {}): scripts/install-peers builds it from its Go module, or set SEEDLINK_HELM",
        from.display()
    );
    helm
}

/// `helm template` of chart `charts/<chart>` in `namespace` with `args`
/// (for the Kubernetes the tests run: scripts/build-kube-peers), as
/// objects.
pub fn helm_template(chart: &str, namespace: &str, args: &[&str]) -> Vec<Value> {
    let out = std::process::Command::new(helm())
        .args(["template", "seedlink"])
        .arg(repo_root().join("charts").join(chart))
        .args(["--namespace", namespace, "--kube-version", "v1.35.4"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_docs(&String::from_utf8_lossy(&out.stdout))
}

/// The repository's root (crates/testkit/../..).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The documents of a multi-document YAML text, as JSON.
pub fn yaml_docs(text: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_norway::Deserializer::from_str(text)
        .filter_map(|d| Value::deserialize(d).ok())
        .filter(|v| !v.is_null())
        .collect()
}

/// Server-side applies `object` as the tests' field manager (forced).
pub async fn apply(client: &kube::Client, object: Value) -> Value {
    let (api, name) = dynamic(client, &object).await;
    let pp = PatchParams::apply(TEST_MANAGER).force();
    match api.patch(&name, &pp, &Patch::Apply(&object)).await {
        Ok(o) => serde_json::to_value(o).unwrap(),
        Err(e) => panic!("apply {} {name}: {e}", object["kind"]),
    }
}

/// Server-side applies `object`; the API server's refusal, if any.
pub async fn try_apply(client: &kube::Client, object: Value) -> Result<Value, kube::Error> {
    let (api, name) = dynamic(client, &object).await;
    let pp = PatchParams::apply(TEST_MANAGER).force();
    api.patch(&name, &pp, &Patch::Apply(&object))
        .await
        .map(|o| serde_json::to_value(o).unwrap())
}

/// The object `api_version`/`kind` `namespace/name`, if it exists.
pub async fn get(
    client: &kube::Client,
    api_version: &str,
    kind: &str,
    namespace: &str,
    name: &str,
) -> Option<Value> {
    let (api, name) = api_for(client, api_version, kind, namespace, name).await;
    api.get_opt(&name)
        .await
        .ok()
        .flatten()
        .map(|o| serde_json::to_value(o).unwrap())
}

/// Every object of `kind` in `namespace`.
pub async fn list(
    client: &kube::Client,
    api_version: &str,
    kind: &str,
    namespace: &str,
) -> Vec<Value> {
    let (api, _) = api_for(client, api_version, kind, namespace, "x").await;
    api.list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|o| serde_json::to_value(o).unwrap())
        .collect()
}

/// Merge-patches the `status` of an object (as another controller would).
pub async fn patch_status(
    client: &kube::Client,
    api_version: &str,
    kind: &str,
    namespace: &str,
    name: &str,
    patch: Value,
) -> Result<Value, kube::Error> {
    let (api, name) = api_for(client, api_version, kind, namespace, name).await;
    let pp = PatchParams {
        field_manager: Some("other-controller".into()),
        ..PatchParams::default()
    };
    api.patch_status(&name, &pp, &Patch::Merge(&patch))
        .await
        .map(|o| serde_json::to_value(o).unwrap())
}

/// Deletes the object; whether it existed.
pub async fn delete(
    client: &kube::Client,
    api_version: &str,
    kind: &str,
    namespace: &str,
    name: &str,
) -> bool {
    let (api, name) = api_for(client, api_version, kind, namespace, name).await;
    api.delete(&name, &DeleteParams::default()).await.is_ok()
}

/// The dynamic API of `api_version`/`kind` for object `namespace/name`.
async fn api_for(
    client: &kube::Client,
    api_version: &str,
    kind: &str,
    namespace: &str,
    name: &str,
) -> (Api<DynamicObject>, String) {
    let probe = json!({"apiVersion": api_version, "kind": kind,
                       "metadata": {"name": name, "namespace": namespace}});
    dynamic(client, &probe).await
}

async fn dynamic(client: &kube::Client, object: &Value) -> (Api<DynamicObject>, String) {
    let api_version = object["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, object["kind"].as_str().unwrap());
    let (ar, caps) = pinned_kind(client, &gvk)
        .await
        .unwrap_or_else(|e| panic!("{api_version} {}: {e}", gvk.kind));
    let name = object["metadata"]["name"].as_str().unwrap().to_string();
    let api = match (caps.scope, object["metadata"]["namespace"].as_str()) {
        (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &ar),
        (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), &ar),
        (Scope::Cluster, _) => Api::all_with(client.clone(), &ar),
    };
    (api, name)
}

async fn etcd_post(base: &str, path: &str, body: &Value) -> Value {
    use http_body_util::BodyExt;
    let addr = base.trim_start_matches("http://").to_string();
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(path)
        .header("host", addr)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// Whether `port` accepts within `limit` while `child` runs.
fn wait_tcp(port: u16, child: &mut Child, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    false
}
