//! A tenant's object stands alone: TunnelClusters written by hostile
//! tenants on the real kube-apiserver of the test kit (RBAC from the
//! install, seedlink as its ServiceAccount) never block, delay or change
//! another tenant's served state, never move a claim on trust, and never
//! stop the server from starting. Two attacks from the hostile review
//! (an unbindable frontend that froze the record of who holds trust; a
//! frontend on the operator's address that failed every reload), and a
//! generative test: random sequences of tenants' creates, edits and
//! deletes, with restarts of the server between some steps, a victim
//! tenant checked unchanged and served after every step.
//! `SEEDLINK_ISOLATION_STEPS` and `SEEDLINK_ISOLATION_SEED` set the
//! generative run's length and seed (docs/TESTING.md).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::path::PathBuf;
use std::time::Duration;

use common::kubeapi::{self, KubeApi};
use common::tunnel_env::{echo_rtt, kas_connect, ready_line};
use common::*;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

const TUNNELS: &str = "tunnel.seedlink.dev/v1alpha1";
const WAIT: Duration = Duration::from_secs(40);

/// The tests of this binary share one API server, and a tunnel-server
/// reads every TunnelCluster in it: one test at a time, each removing the
/// TunnelClusters of the tests before it first.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// The tenant namespaces made so far.
static TENANTS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// One seed: an install namespace with the install's RBAC, a tunnel-server
/// run as seedlink's ServiceAccount from a file with an operator's shared
/// frontend, and tenants' TunnelClusters.
struct Seed {
    client: kube::Client,
    prefix: String,
    sys: String,
    kubeconfig: PathBuf,
    dir: tempfile::TempDir,
    /// The agent port (fixed, so agents find a restarted server).
    agents: String,
    /// The operator's shared mTLS frontend's address.
    shared: String,
    pki: seedlink::demo::Pki,
    server: Option<Proc>,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl Seed {
    async fn new(prefix: &str) -> Seed {
        let turn = ONE_AT_A_TIME.lock().await;
        let api = KubeApi::shared();
        let client = api.client().await.unwrap();
        let before = TENANTS.lock().unwrap().clone();
        for ns in before {
            kubeapi::delete(&client, TUNNELS, "TunnelCluster", &ns, "tunnel").await;
        }
        let prefix = format!("{prefix}{}", std::process::id());
        let sys = format!("{prefix}-system");
        kubeapi::apply(
            &client,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": sys}}),
        )
        .await;
        let token = api.install_rbac(&client, &sys).await;
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = api.kubeconfig(dir.path(), "tunnel-server", &token, None);
        let pki = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
        let mut seed = Seed {
            client,
            prefix,
            sys,
            kubeconfig,
            agents: format!("127.0.0.1:{}", free_port()),
            shared: format!("127.0.0.1:{}", free_port()),
            pki,
            dir,
            server: None,
            _turn: turn,
        };
        seed.write_config();
        seed
    }

    fn file(&self, name: &str, text: &str) -> String {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    fn write_config(&mut self) {
        let ca = self.file("seed-ca.pem", &self.pki.ca_pem);
        let crt = self.file("tun.pem", &self.pki.servers[0].1.cert_pem);
        let key = self.file("tun-key.pem", &self.pki.servers[0].1.key_pem);
        let d = self.dir.path().display().to_string();
        self.file(
            "tunnel.yaml",
            &format!(
                "agents: {{listen: '{agents}', cert: '{crt}', key: '{key}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
clusters: []
frontend_templates:
  - {{name: uds, protocol: http-connect, unix: '{d}/{{cluster}}.sock'}}
shared_frontends:
  - {{name: operator, protocol: http-connect, tcp: '{shared}', cert: '{crt}', key: '{key}', client_ca: '{ca}'}}
kubernetes: {{lease: {sys}/seedlink-tunnel-status, trust_dir: '{d}/trust'}}
",
                agents = self.agents,
                shared = self.shared,
                sys = self.sys,
            ),
        );
    }

    /// Starts (or restarts) the tunnel-server; waits for its ready line.
    fn start(&mut self) {
        self.server = None;
        let mut child = std::process::Command::new(seedlink_bin())
            .args(["tunnel-server", "--config"])
            .arg(self.dir.path().join("tunnel.yaml"))
            .env("KUBECONFIG", &self.kubeconfig)
            .env("POD_NAME", "tunnel-0")
            .env(
                "RUST_LOG",
                std::env::var("SERVER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let ready = ready_line(&mut child);
        assert_eq!(ready["event"], "ready", "{ready}");
        self.server = Some(Proc(child));
    }

    /// A tenant namespace with seedlink's trust RoleBinding; its name.
    async fn tenant(&self, short: &str) -> String {
        let ns = format!("{}-{short}", self.prefix);
        TENANTS.lock().unwrap().push(ns.clone());
        self.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
            .await;
        self.apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "seedlink-tunnel-trust", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": format!("seedlink-tunnel-trust-{}", self.sys)},
            "subjects": [{"kind": "ServiceAccount", "name": "seedlink", "namespace": self.sys}]
        }))
        .await;
        ns
    }

    /// Secret `name` in `ns` holding `pem` as its `ca.crt`, labelled as trust.
    async fn ca_secret(&self, ns: &str, name: &str, pem: &str) {
        self.apply(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": ns,
                         "labels": {"seedlink.dev/tunnel-trust": "true"}},
            "stringData": {"ca.crt": pem}
        }))
        .await;
    }

    /// The TunnelCluster `tunnel` in `ns` with `spec` (replaced whole).
    async fn tunnel_cluster(&self, ns: &str, spec: Value) {
        // Server-side apply: what the spec no longer names goes.
        self.apply(json!({
            "apiVersion": TUNNELS, "kind": "TunnelCluster",
            "metadata": {"name": "tunnel", "namespace": ns},
            "spec": spec
        }))
        .await;
    }

    async fn apply(&self, object: Value) -> Value {
        kubeapi::apply(&self.client, object).await
    }

    async fn get(&self, ns: &str) -> Option<Value> {
        kubeapi::get(&self.client, TUNNELS, "TunnelCluster", ns, "tunnel").await
    }

    async fn delete(&self, ns: &str) {
        kubeapi::delete(&self.client, TUNNELS, "TunnelCluster", ns, "tunnel").await;
    }

    /// `Ready` of `ns`'s TunnelCluster for its current generation:
    /// (status, reason, message).
    async fn ready(&self, ns: &str) -> Option<(String, String, String)> {
        let o = self.get(ns).await?;
        let c = o["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Ready")?
            .clone();
        if c["observedGeneration"] != o["metadata"]["generation"] {
            return None;
        }
        let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
        Some((s("status"), s("reason"), s("message")))
    }

    /// Waits until `ns`'s TunnelCluster is refused for its current spec;
    /// the message.
    async fn refused(&self, ns: &str) -> String {
        eventually(&format!("{ns} refused"), WAIT, async || {
            match self.ready(ns).await {
                Some((s, _, m)) if s == "False" => Ok(m),
                other => Err(format!("{other:?}")),
            }
        })
        .await
    }

    /// Waits until `ns`'s TunnelCluster is served for its current spec,
    /// with its trust in status; that trust.
    async fn served(&self, ns: &str) -> Vec<String> {
        eventually(&format!("{ns} served"), WAIT, async || {
            let ready = self.ready(ns).await;
            let trust = self.trust(ns).await;
            match ready {
                Some((s, ..)) if s == "True" && !trust.is_empty() => Ok(trust),
                other => Err(format!("{other:?}, trust {trust:?}")),
            }
        })
        .await
    }

    async fn trust(&self, ns: &str) -> Vec<String> {
        let o = self.get(ns).await.unwrap_or_default();
        o["status"]["trust"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The Unix socket of `ns`'s cluster.
    fn socket(&self, ns: &str) -> String {
        self.dir
            .path()
            .join(format!("{ns}.tunnel.sock"))
            .display()
            .to_string()
    }
}

/// A tenant with its own agent CA and a running agent.
struct Victim {
    ns: String,
    pki: seedlink::demo::Pki,
    _agent: Option<Proc>,
}

impl Victim {
    async fn onboard(seed: &Seed, short: &str) -> Victim {
        let ns = seed.tenant(short).await;
        let pki = seedlink::demo::Pki::generate(&[]).unwrap();
        seed.ca_secret(&ns, "agent-ca", &pki.ca_pem).await;
        seed.tunnel_cluster(
            &ns,
            json!({"agentCA": {"secret": "agent-ca", "key": "ca.crt"}}),
        )
        .await;
        Victim {
            ns,
            pki,
            _agent: None,
        }
    }

    /// Starts its agent against `seed`'s agent port.
    fn start_agent(&mut self, seed: &Seed) {
        let ca = seed.file("seed-ca.pem", &seed.pki.ca_pem);
        let crt = seed.file(&format!("{}.pem", self.ns), &self.pki.client.cert_pem);
        let key = seed.file(&format!("{}-key.pem", self.ns), &self.pki.client.key_pem);
        let mut child = common::agent_cmd::AgentCmd::new(&seed.agents)
            .mtls(&ca, &crt, &key)
            .fast_sync()
            .command()
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let ready = ready_line(&mut child);
        assert_eq!(ready["event"], "ready", "{ready}");
        self._agent = Some(Proc(child));
    }

    /// Its tunnel carries traffic: a CONNECT through its own socket,
    /// dialled by its own agent (only its agent's certificate lands in its
    /// cluster), echoes.
    async fn carries_traffic(&self, seed: &Seed, echo: std::net::SocketAddr) {
        let sock = seed.socket(&self.ns);
        let mut s = eventually(&format!("{} tunnel", self.ns), WAIT, async || {
            kas_connect(&sock, &echo.to_string()).await
        })
        .await;
        echo_rtt(&mut s, 1000).await;
    }
}

/// A tenant's seed path (webhooks and aggregated APIs beside its control
/// plane, dialled by the tunnel-server in the seed) reaches its own
/// namespace's Services only. A's TunnelCluster names seed Service
/// `hooks`: pinned to A's namespace (the spec has no namespace field).
/// - A's kube-apiserver asking for B's seed Service by name is sent to A's
///   shoot (no agent there: `No agent available`), never dialled in the
///   seed;
/// - A's own `hooks` made an ExternalName Service that names B's is
///   refused as ExternalName (the Service is read from the API server as
///   seedlink's ServiceAccount, never resolved by DNS);
/// - a seed Service named with a dot (another namespace) is refused
///   `InvalidSpec` alone, and B stays served;
/// - the lookup gives B's Service's ClusterIP only at a port it serves,
///   and refuses a headless Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_seed_path_reaches_its_own_namespace_only() {
    let mut seed = Seed::new("seedpath").await;
    seed.start();
    let a = Victim::onboard(&seed, "a").await;
    let b = Victim::onboard(&seed, "b").await;
    let service = |ns: &str, name: &str, spec: Value| {
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": ns}, "spec": spec})
    };
    let https = json!([{"name": "https", "port": 443, "protocol": "TCP"}]);
    seed.apply(service(
        &b.ns,
        "hooks",
        json!({"selector": {"app": "hooks"}, "ports": https}),
    ))
    .await;
    seed.apply(service(
        &b.ns,
        "headless",
        json!({"clusterIP": "None", "selector": {"app": "hooks"}, "ports": https}),
    ))
    .await;
    let b_hooks = format!("hooks.{}.svc.cluster.local", b.ns);
    seed.apply(service(
        &a.ns,
        "hooks",
        json!({"type": "ExternalName", "externalName": b_hooks, "ports": https}),
    ))
    .await;
    let agent_ca = json!({"secret": "agent-ca", "key": "ca.crt"});
    seed.tunnel_cluster(
        &a.ns,
        json!({"agentCA": agent_ca, "seedServices": [{"name": "hooks", "ports": [443]}]}),
    )
    .await;
    seed.served(&a.ns).await;
    let sock = seed.socket(&a.ns);
    let to_b = kas_connect(&sock, &format!("hooks.{}.svc:443", b.ns))
        .await
        .err()
        .unwrap_or_default();
    assert!(
        to_b.starts_with("HTTP/1.1 500") && to_b.contains("No agent available"),
        "{to_b}"
    );
    let own = kas_connect(&sock, &format!("hooks.{}.svc:443", a.ns))
        .await
        .err()
        .unwrap_or_default();
    assert!(
        own.starts_with("HTTP/1.1 502") && own.contains("ExternalName"),
        "{own}"
    );
    // Another namespace by a dotted name: refused alone.
    seed.tunnel_cluster(
        &a.ns,
        json!({"agentCA": agent_ca, "seedServices": [{"name": format!("hooks.{}", b.ns), "ports": [443]}]}),
    )
    .await;
    let why = seed.refused(&a.ns).await;
    assert!(why.contains("seedServices"), "{why}");
    seed.served(&b.ns).await;
    // The lookup, on the real API server.
    let ip = seedlink_kube::seed_services::seed_service_ip(&seed.client, &b.ns, "hooks", 443)
        .await
        .unwrap();
    let svc = kubeapi::get(&seed.client, "v1", "Service", &b.ns, "hooks")
        .await
        .unwrap();
    assert_eq!(svc["spec"]["clusterIP"], ip.to_string());
    let e = seedlink_kube::seed_services::seed_service_ip(&seed.client, &b.ns, "hooks", 80)
        .await
        .unwrap_err();
    assert!(format!("{e:?}").contains("no TCP port 80"), "{e:?}");
    let e = seedlink_kube::seed_services::seed_service_ip(&seed.client, &b.ns, "headless", 443)
        .await
        .unwrap_err();
    assert!(format!("{e:?}").contains("headless"), "{e:?}");
    let e = seedlink_kube::seed_services::seed_service_ip(&seed.client, &b.ns, "none", 443)
        .await
        .unwrap_err();
    assert!(format!("{e:?}").contains("no such Service"), "{e:?}");
}

/// Finding 1 of the hostile review: an older tenant gives its
/// TunnelCluster a TCP frontend that validates but cannot bind (the
/// address is in use). That tenant alone is refused (its status says
/// why); a tenant onboarded afterwards is served and holds its trust; the
/// older tenant then claims the newer one's (public) CA: refused, and the
/// victim's agent stays in the victim's cluster, also after the server
/// restarts (who holds the trust is read back from status).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbindable_frontend_never_moves_trust() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let mut seed = Seed::new("iso-a").await;
    seed.start();
    let attacker = Victim::onboard(&seed, "evil").await;
    seed.served(&attacker.ns).await;
    // An address in use: the frontend passes every check and fails to bind.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let in_use = taken.local_addr().unwrap().to_string();
    let evil_spec = |ca: &str| {
        json!({
            "agentCA": {"secret": ca, "key": "ca.crt"},
            "frontends": [{"name": "kas", "protocol": "http-connect", "tcp": in_use}]
        })
    };
    seed.tunnel_cluster(&attacker.ns, evil_spec("agent-ca"))
        .await;
    let why = seed.refused(&attacker.ns).await;
    assert!(
        why.contains("cannot be served") && why.contains(&in_use),
        "{why}"
    );
    // A victim onboarded now is served, with its trust in status.
    let mut victim = Victim::onboard(&seed, "victim").await;
    let victim_trust = seed.served(&victim.ns).await;
    victim.start_agent(&seed);
    victim.carries_traffic(&seed, echo).await;
    // The attacker copies the victim's public CA into its own agentCA.
    seed.ca_secret(&attacker.ns, "stolen", &victim.pki.ca_pem)
        .await;
    seed.tunnel_cluster(&attacker.ns, evil_spec("stolen")).await;
    let why = seed.refused(&attacker.ns).await;
    assert!(why.contains("trusts a key"), "{why}");
    victim.carries_traffic(&seed, echo).await;
    assert_eq!(seed.served(&victim.ns).await, victim_trust);
    // Without the unbindable frontend, still refused; and after a
    // restart of the server, the same decision.
    seed.tunnel_cluster(
        &attacker.ns,
        json!({"agentCA": {"secret": "stolen", "key": "ca.crt"}}),
    )
    .await;
    seed.refused(&attacker.ns).await;
    seed.start();
    victim.carries_traffic(&seed, echo).await;
    assert_eq!(seed.served(&victim.ns).await, victim_trust);
    let why = seed.refused(&attacker.ns).await;
    assert!(why.contains("trusts a key"), "{why}");
    drop(taken);
    stop.cancel();
}

/// A victim whose TunnelCluster is refused for a while (its Secret gone,
/// as during a rotation) keeps the trust it held: an older tenant that
/// claims the victim's CA meanwhile is refused, and the victim is served
/// again with the same trust once its Secret is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_holder_keeps_its_trust() {
    let mut seed = Seed::new("iso-c").await;
    seed.start();
    let attacker = Victim::onboard(&seed, "evil").await;
    seed.served(&attacker.ns).await;
    let victim = Victim::onboard(&seed, "victim").await;
    let victim_trust = seed.served(&victim.ns).await;
    kubeapi::delete(&seed.client, "v1", "Secret", &victim.ns, "agent-ca").await;
    let why = seed.refused(&victim.ns).await;
    assert!(why.contains("not found"), "{why}");
    assert_eq!(
        seed.trust(&victim.ns).await,
        victim_trust,
        "kept while refused"
    );
    seed.ca_secret(&attacker.ns, "stolen", &victim.pki.ca_pem)
        .await;
    seed.tunnel_cluster(
        &attacker.ns,
        json!({"agentCA": {"secret": "stolen", "key": "ca.crt"}}),
    )
    .await;
    let why = seed.refused(&attacker.ns).await;
    assert!(why.contains("holds"), "{why}");
    seed.start();
    let why = seed.refused(&attacker.ns).await;
    assert!(why.contains("holds"), "after a restart: {why}");
    seed.ca_secret(&victim.ns, "agent-ca", &victim.pki.ca_pem)
        .await;
    assert_eq!(seed.served(&victim.ns).await, victim_trust);
    seed.refused(&attacker.ns).await;
}

/// A revocation does not free the old agent CA for another tenant: the
/// victim's cluster trusts a new CA, its agents may still present the old
/// one's certificates (the shoot has not got the new ones yet), and a
/// cluster that starts to trust the old CA would receive them. The claim
/// stays reserved to the victim (`status.released`), on every replica and
/// after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_agent_ca_stays_reserved_to_its_cluster() {
    let mut seed = Seed::new("iso-r").await;
    seed.start();
    let victim = Victim::onboard(&seed, "victim").await;
    let old = seed.served(&victim.ns).await;
    let next = seedlink::demo::Pki::generate(&[]).unwrap();
    seed.ca_secret(&victim.ns, "agent-ca", &next.ca_pem).await;
    let released = eventually("the old CA released", WAIT, async || {
        let o = seed.get(&victim.ns).await.unwrap_or_default();
        let trust = seed.trust(&victim.ns).await;
        let released: Vec<String> = o["status"]["released"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|r| r["claim"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        match trust != old && !trust.is_empty() && !released.is_empty() {
            true => Ok(released),
            false => Err(format!("old {old:?} status {}", o["status"])),
        }
    })
    .await;
    assert_eq!(released, old, "every claim of the old trust is reserved");
    let attacker = seed.tenant("evil").await;
    seed.ca_secret(&attacker, "stolen", &victim.pki.ca_pem)
        .await;
    seed.tunnel_cluster(
        &attacker,
        json!({"agentCA": {"secret": "stolen", "key": "ca.crt"}}),
    )
    .await;
    let why = seed.refused(&attacker).await;
    assert!(why.contains("holds"), "{why}");
    seed.start();
    let why = seed.refused(&attacker).await;
    assert!(why.contains("holds"), "after a restart: {why}");
    seed.served(&victim.ns).await;
}

/// Finding 2 of the hostile review: a TunnelCluster frontend on the
/// operator's shared frontend's address is refused alone (the file always
/// wins); another tenant onboarded afterwards is served, and after a
/// restart every valid tenant is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_on_the_operators_address_is_refused_alone() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let mut seed = Seed::new("iso-b").await;
    seed.start();
    let mut early = Victim::onboard(&seed, "early").await;
    seed.served(&early.ns).await;
    early.start_agent(&seed);
    let attacker = Victim::onboard(&seed, "evil").await;
    seed.tunnel_cluster(
        &attacker.ns,
        json!({
            "agentCA": {"secret": "agent-ca", "key": "ca.crt"},
            "frontends": [{"name": "kas", "protocol": "http-connect", "tcp": seed.shared}]
        }),
    )
    .await;
    let why = seed.refused(&attacker.ns).await;
    assert!(why.contains("address used twice"), "{why}");
    let mut late = Victim::onboard(&seed, "late").await;
    seed.served(&late.ns).await;
    late.start_agent(&seed);
    for v in [&early, &late] {
        v.carries_traffic(&seed, echo).await;
    }
    seed.start();
    for v in [&early, &late] {
        seed.served(&v.ns).await;
        v.carries_traffic(&seed, echo).await;
    }
    seed.refused(&attacker.ns).await;
    stop.cancel();
}

/// What a hostile tenant does to its own objects in one step.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// A valid TunnelCluster with its own CA.
    Valid,
    /// Its agentCA is the victim's CA (a copy of the public certificate).
    Steal,
    /// Its own CA and the victim's in one bundle.
    StealInBundle,
    /// A frontend on an address in use.
    Unbindable,
    /// A frontend on the operator's shared frontend's address.
    OperatorsAddress,
    /// A frontend socket outside its own directory (past the API
    /// server's schema, refused by seedlink).
    Invalid,
    /// Its agentCA names a Secret that does not exist.
    MissingSecret,
    /// Its own CA Secret is deleted.
    DeleteSecret,
    /// The TunnelCluster is deleted (and later created again: a reused name).
    Delete,
    /// The tunnel-server restarts.
    Restart,
}

const STEPS: [Step; 10] = [
    Step::Valid,
    Step::Steal,
    Step::StealInBundle,
    Step::Unbindable,
    Step::OperatorsAddress,
    Step::Invalid,
    Step::MissingSecret,
    Step::DeleteSecret,
    Step::Delete,
    Step::Restart,
];

/// Random sequences of hostile tenants' creates, edits and deletes (invalid
/// objects, collisions with the operator's file and with the victim's
/// trust, unbindable frontends, overlapping trust, reused names, deleted
/// Secrets) with restarts between some steps: after every step the victim
/// is served, its trust in status unchanged, its agent connected to its own
/// cluster and its traffic flowing, and no attacker that claims the
/// victim's CA is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_objects_stand_alone_through_random_steps() {
    let (steps, mut rng) = common::generative::run("isolation", 30);
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let mut seed = Seed::new("iso-g").await;
    seed.start();
    // Two attackers first (older objects), then the victim.
    let attackers = [
        Victim::onboard(&seed, "evil1").await,
        Victim::onboard(&seed, "evil2").await,
    ];
    for a in &attackers {
        seed.ca_secret(&a.ns, "stolen", "").await;
    }
    let mut victim = Victim::onboard(&seed, "victim").await;
    let victim_trust = seed.served(&victim.ns).await;
    victim.start_agent(&seed);
    victim.carries_traffic(&seed, echo).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let in_use = taken.local_addr().unwrap().to_string();
    let own = json!({"secret": "agent-ca", "key": "ca.crt"});
    for i in 0..steps {
        let step = STEPS[rng.next(STEPS.len())];
        let a = &attackers[rng.next(attackers.len())];
        eprintln!("isolation step {i}: {} {step:?}", a.ns);
        let with_frontend = |addr: &str| json!({"agentCA": own, "frontends": [{"name": "kas", "protocol": "http-connect", "tcp": addr}]});
        match step {
            Step::Valid => {
                seed.ca_secret(&a.ns, "agent-ca", &a.pki.ca_pem).await;
                seed.tunnel_cluster(&a.ns, json!({"agentCA": own})).await;
            }
            Step::Steal => {
                seed.ca_secret(&a.ns, "stolen", &victim.pki.ca_pem).await;
                seed.tunnel_cluster(&a.ns, json!({"agentCA": {"secret": "stolen", "key": "ca.crt"}}))
                    .await;
            }
            Step::StealInBundle => {
                let bundle = format!("{}{}", a.pki.ca_pem, victim.pki.ca_pem);
                seed.ca_secret(&a.ns, "stolen", &bundle).await;
                seed.tunnel_cluster(&a.ns, json!({"agentCA": {"secret": "stolen", "key": "ca.crt"}}))
                    .await;
            }
            Step::Unbindable => seed.tunnel_cluster(&a.ns, with_frontend(&in_use)).await,
            Step::OperatorsAddress => {
                let shared = seed.shared.clone();
                seed.tunnel_cluster(&a.ns, with_frontend(&shared)).await
            }
            Step::Invalid => {
                seed.tunnel_cluster(
                    &a.ns,
                    json!({"agentCA": own, "frontends": [{"name": "x", "protocol": "http-connect", "unix": "../victim.sock"}]}),
                )
                .await
            }
            Step::MissingSecret => {
                seed.tunnel_cluster(&a.ns, json!({"agentCA": {"secret": "nothing", "key": "ca.crt"}}))
                    .await
            }
            Step::DeleteSecret => {
                kubeapi::delete(&seed.client, "v1", "Secret", &a.ns, "agent-ca").await;
            }
            Step::Delete => seed.delete(&a.ns).await,
            Step::Restart => seed.start(),
        }
        // The victim: served, its trust unchanged, its traffic flowing.
        assert_eq!(
            seed.served(&victim.ns).await,
            victim_trust,
            "step {i} {step:?}"
        );
        victim.carries_traffic(&seed, echo).await;
        // An attacker whose spec claims the victim's CA is never served.
        if matches!(step, Step::Steal | Step::StealInBundle) {
            let why = seed.refused(&a.ns).await;
            assert!(why.contains("trusts a key"), "step {i}: {why}");
        }
    }
    drop(taken);
    stop.cancel();
}
