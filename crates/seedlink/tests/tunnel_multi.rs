//! One `seedlink tunnel-server` for several clusters: each cluster's
//! "shoot" is its own network namespace (services answering with the
//! cluster's name), its agents carry its own client CA, and its frontend is
//! its own Unix socket. Every frontend must reach exactly its own cluster's
//! services, and an agent of one cluster must not be able to touch another
//! cluster's dials or connections, whatever it claims to be.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::time::Duration;

use common::tunnel_env::*;
use common::*;
use seedlink_tunnel::proto::Packet;
use tokio::io::AsyncReadExt;

/// A cluster beyond the test bed's own (`shoot--dev--a`): its namespace,
/// linked to the seed, its services and its agents' PKI.
struct Tenant {
    name: String,
    ns: Netns,
    net: u8,
    ca: String,
    crt: String,
    key: String,
    _services: Vec<Proc>,
}

impl Tenant {
    fn new(env: &TunnelEnv, name: &str, net: u8) -> Tenant {
        let ns = Netns::new(name);
        netns_link(&env.seed, &ns, net);
        let d = env.dir.path().join(name);
        let services = shoot_services(&ns, &d, &format!("hello from {name}"));
        let pki = seedlink::demo::Pki::generate(&[]).unwrap();
        let w = |f: &str, text: &str| {
            std::fs::write(d.join(f), text).unwrap();
            d.join(f).display().to_string()
        };
        Tenant {
            name: name.to_string(),
            ca: w("agent-ca.pem", &pki.ca_pem),
            crt: w("agent.pem", &pki.client.cert_pem),
            key: w("agent-key.pem", &pki.client.key_pem),
            ns,
            net,
            _services: services,
        }
    }

    fn endpoint(&self) -> String {
        format!("198.18.{}.1:8132", self.net)
    }

    fn yaml(&self, env: &TunnelEnv) -> String {
        self.yaml_with(env, "")
    }

    /// The cluster's configuration with `extra` lines (4-space indented).
    fn yaml_with(&self, env: &TunnelEnv, extra: &str) -> String {
        format!(
            "  - name: {n}
    agent_ca: '{ca}'
{extra}    frontends:
      - {{name: uds, protocol: http-connect, unix: '{d}/kas-{n}.sock'}}
",
            n = self.name,
            ca = self.ca,
            d = env.dir.path().display()
        )
    }

    fn uds(&self, env: &TunnelEnv) -> String {
        format!("{}/kas-{}.sock", env.dir.path().display(), self.name)
    }

    fn agent(&self, env: &TunnelEnv, extra: &[&str]) -> Started {
        let mut args = vec!["--agent-cert", &self.crt, "--agent-key", &self.key];
        args.extend_from_slice(extra);
        env.agent_in(&self.ns, &self.endpoint(), &args)
    }
}

const A: &str = "shoot--dev--a";

async fn hello_via(uds: &str) -> String {
    let s = kas_connect_eventually(uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    fetch_hello(s).await
}

/// Three clusters with two agents each on one server; cluster A also has
/// an agent that copies B's agent ID and identifiers. Every frontend reaches
/// only its own cluster's services; B's and C's agents get exactly their
/// own clusters' dials; a hostile agent of A (A's certificate, B's agent
/// ID) sends DATA/CLOSE for B's connection IDs and answers guessed dial IDs:
/// all refused and counted, B's open connection untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_clusters_each_reach_only_their_own_shoot() {
    let env = TunnelEnv::new(56);
    let b = Tenant::new(&env, "b", 57);
    let c = Tenant::new(&env, "c", 58);
    let yaml = format!(
        "{}{}{}",
        env.server_yaml("0.0.0.0:8132", "", ""),
        b.yaml(&env),
        c.yaml(&env)
    );
    let server = env.server(&yaml, "server");
    let admin = server.admin();
    let ep_a = env.agent_endpoint(8132);
    let ids = ["--agent-identifiers", "host=kas.b"];
    let _a: Vec<_> = (0..2)
        .map(|i| env.agent(&ep_a, &["--agent-id", &format!("a{i}")]))
        .collect();
    // Copies B's first agent's ID and identifiers.
    let _copycat = env.agent(&ep_a, &["--agent-id", "b0", ids[0], ids[1]]);
    let b_agents: Vec<_> = (0..2)
        .map(|i| b.agent(&env, &["--agent-id", &format!("b{i}"), ids[0], ids[1]]))
        .collect();
    let c_agents: Vec<_> = (0..2)
        .map(|i| c.agent(&env, &["--agent-id", &format!("c{i}")]))
        .collect();
    let agents_of = |cl: &str| {
        env.server_metric(
            &admin,
            &format!("seedlink_tunnel_server_agents{{cluster=\"{cl}\"}}"),
        )
    };
    eventually("all agents", Duration::from_secs(20), async || {
        agents_of(A) == 3.0 && agents_of("b") == 2.0 && agents_of("c") == 2.0
    })
    .await;

    const N: usize = 12;
    for _ in 0..N {
        assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
        let hb = hello_via(&b.uds(&env)).await;
        assert!(hb.contains("hello from b"), "{hb}");
        let hc = hello_via(&c.uds(&env)).await;
        assert!(hc.contains("hello from c"), "{hc}");
    }
    // B's and C's agents answered exactly their clusters' dials.
    let dials = |agents: &[Started], ns: &Netns| -> f64 {
        agents
            .iter()
            .map(|a| {
                sum_metric(
                    &TunnelEnv::admin_get(ns, &a.admin(), "/metrics"),
                    "seedlink_tunnel_agent_dials_total{outcome=\"ok\"}",
                )
            })
            .sum()
    };
    assert_eq!(dials(&b_agents, &b.ns), N as f64);
    assert_eq!(dials(&c_agents, &c.ns), N as f64);
    for cl in [A, "b", "c"] {
        assert_eq!(
            env.server_metric(
                &admin,
                &format!("seedlink_tunnel_server_dials_total{{cluster=\"{cl}\"}}")
            ),
            N as f64,
            "{cl}"
        );
    }

    // A hostile agent of A, claiming to be b0, while a B connection is open.
    let mut echo = kas_connect(&b.uds(&env), "127.0.0.1:7007").await.unwrap();
    echo_rtt(&mut echo, 64).await;
    let fake = FakeAgent {
        netns: env.seed.0.clone(),
        ca: env.files.seed_ca.clone(),
        cert: env.files.agent_crt.clone(),
        key: env.files.agent_key.clone(),
        endpoint: ep_a.clone(),
        agent_id: "b0".into(),
    };
    let mut script = Vec::new();
    for id in 1..=40i64 {
        script.push(Packet::data(id, bytes::Bytes::from_static(b"INJECTED")));
        script.push(Packet::close_rsp(id, String::new()));
        script.push(Packet::dial_rsp(id * 104_729, id, String::new()));
    }
    fake.run(script, false);
    echo_rtt(&mut echo, 64).await;
    let mut extra = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_millis(300), echo.read(&mut extra)).await;
    assert!(r.is_err(), "bytes injected into B's connection: {r:?}");
    echo_rtt(&mut echo, 4096).await;
    let packets = |cl: &str, reason: &str| {
        env.server_metric(
            &admin,
            &format!(
                "seedlink_tunnel_server_agent_packets_total{{cluster=\"{cl}\",reason=\"{reason}\"}}"
            ),
        )
    };
    assert!(
        packets(A, "unrecognized") >= 120.0,
        "{}",
        packets(A, "unrecognized")
    );
    assert_eq!(packets("b", "unrecognized"), 0.0);
    // B still works, through B's agents only.
    assert!(hello_via(&b.uds(&env)).await.contains("hello from b"));
    assert_eq!(dials(&b_agents, &b.ns), N as f64 + 2.0);
}

/// Limits per cluster: B may hold 3 connections, C may dial 5 at once and
/// then one per 2 s and have one agent stream. B and C hitting their
/// limits is answered 503 and counted, and does not touch A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cluster_limits_refuse_and_count_without_touching_others() {
    let env = TunnelEnv::new(59);
    let b = Tenant::new(&env, "b", 60);
    let c = Tenant::new(&env, "c", 61);
    let yaml = format!(
        "{}{}{}",
        env.server_yaml("0.0.0.0:8132", "", ""),
        b.yaml_with(&env, "    limits: {max_connections: 3}\n"),
        c.yaml_with(
            &env,
            "    limits: {dial_rate: 0.5, dial_burst: 5, max_agents: 1}\n"
        )
    );
    let server = env.server(&yaml, "server");
    let admin = server.admin();
    let _a = env.agent(&env.agent_endpoint(8132), &[]);
    let _b = b.agent(&env, &[]);
    let _c: Vec<_> = (0..2)
        .map(|i| c.agent(&env, &["--agent-id", &format!("c{i}")]))
        .collect();
    let m = |name: &str| env.server_metric(&admin, name);
    eventually( "agents, one of C's refused",Duration::from_secs(20), async || {
        m("seedlink_tunnel_server_agents{cluster=\"shoot--dev--a\"}") == 1.0
            && m("seedlink_tunnel_server_agents{cluster=\"b\"}") == 1.0
            && m("seedlink_tunnel_server_agents{cluster=\"c\"}") == 1.0
            && m("seedlink_tunnel_server_agent_streams_total{cluster=\"c\",reason=\"limit_agents\"}") >= 1.0
    })
    .await;

    // B: three connections, the fourth refused; A unaffected; a slot frees.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            kas_connect_eventually(&b.uds(&env), "127.0.0.1:7007", Duration::from_secs(20)).await,
        );
    }
    let refused = kas_connect(&b.uds(&env), "127.0.0.1:7007").await.err();
    assert!(
        refused
            .as_deref()
            .is_some_and(|r| r.starts_with("HTTP/1.1 503")),
        "{refused:?}"
    );
    assert_eq!(
        m("seedlink_tunnel_server_dial_failures_total{cluster=\"b\",reason=\"limit_connections\"}"),
        1.0
    );
    for _ in 0..5 {
        assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    }
    for s in &mut held {
        echo_rtt(s, 64).await;
    }
    drop(held.pop());
    eventually("B's slot to free", Duration::from_secs(5), async || {
        m("seedlink_tunnel_server_established_connections{cluster=\"b\"}") == 2.0
    })
    .await;
    let mut again = kas_connect(&b.uds(&env), "127.0.0.1:7007").await.unwrap();
    echo_rtt(&mut again, 64).await;

    // C: a burst of 12 dials; the bucket holds 5 (+1 per 2 s).
    let mut ok = 0;
    let mut limited = 0;
    for _ in 0..12 {
        match kas_connect(&c.uds(&env), "127.0.0.1:8000").await {
            Ok(s) => {
                assert!(fetch_hello(s).await.contains("hello from c"));
                ok += 1;
            }
            Err(e) if e.starts_with("HTTP/1.1 503") => limited += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        (5..=8).contains(&ok) && ok + limited == 12,
        "{ok} ok, {limited} limited"
    );
    assert_eq!(
        m("seedlink_tunnel_server_dial_failures_total{cluster=\"c\",reason=\"limit_dial_rate\"}"),
        f64::from(limited)
    );
    // A never saw a refusal.
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    assert_eq!(
        m("seedlink_tunnel_server_dial_failures_total{cluster=\"shoot--dev--a\""),
        0.0
    );
}

/// A server where cluster A has the frontend `own` and proxy password
/// `secret-a`, B (its own frontend only) `secret-b`, and `shared` is the one
/// shared frontend; both clusters' agents connected and serving.
async fn proxy_clusters(
    env: &TunnelEnv,
    b: &Tenant,
    own: &str,
    shared: &str,
) -> (Started, [Started; 2]) {
    let d = env.dir.path();
    std::fs::write(d.join("pw-a"), "secret-a\n").unwrap();
    std::fs::write(d.join("pw-b"), "secret-b\n").unwrap();
    let yaml = format!(
        "{}      - {own}\n    proxy_password_file: '{}'\n{}shared_frontends:\n  - {shared}\n",
        env.server_yaml("0.0.0.0:8132", "", ""),
        d.join("pw-a").display(),
        b.yaml_with(
            env,
            &format!("    proxy_password_file: '{}'\n", d.join("pw-b").display())
        ),
    );
    let server = env.server(&yaml, "server");
    let a = env.agent(&env.agent_endpoint(8132), &[]);
    let bb = b.agent(env, &[]);
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    assert!(hello_via(&b.uds(env)).await.contains("hello from b"));
    (server, [a, bb])
}

/// Prometheus (the Debian package) scrapes shoot targets through the
/// tunnel server's forward-proxy frontends: a shared one where the proxy
/// credentials (`http://<cluster>:<password>@…` in `proxy_url`) choose the
/// cluster, and a per-cluster listener. Its own API shows `up == 1` for
/// targets only the agents can reach (with each cluster's own values),
/// `up == 0` for a destination the agent's policy forbids (link-local) and
/// for a wrong password. curl reaches the same through both request forms
/// (absolute-form GET and CONNECT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_shoots_through_the_proxy_frontends() {
    let prometheus = require("prometheus");
    let env = TunnelEnv::new(62);
    let b = Tenant::new(&env, "b", 63);
    let d = env.dir.path();
    std::fs::write(d.join("metrics"), "shoot_value 1\n").unwrap();
    std::fs::write(d.join("b").join("metrics"), "shoot_value 2\n").unwrap();
    let (server, _agents) = proxy_clusters(
        &env,
        &b,
        "{name: prom, protocol: http-proxy, tcp: '127.0.0.1:3129'}",
        "{name: shared, protocol: http-proxy, tcp: '0.0.0.0:3128'}",
    )
    .await;

    // curl, absolute-form GET and CONNECT (-p), through the shared frontend.
    let curl = |args: &[&str]| {
        let out = env
            .seed
            .cmd(&["curl", "-s", "--max-time", "10"])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let via_b = "http://b:secret-b@127.0.0.1:3128";
    assert!(curl(&["-x", via_b, "http://127.0.0.1:8000/hello.txt"]).contains("hello from b"));
    assert!(curl(&["-p", "-x", via_b, "http://127.0.0.1:8000/hello.txt"]).contains("hello from b"));
    assert!(curl(&[
        "-x",
        "http://127.0.0.1:3129",
        "http://127.0.0.1:8000/hello.txt"
    ])
    .contains("hello from the shoot"));
    let denied = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-x",
        "http://b:wrong@127.0.0.1:3128",
        "http://127.0.0.1:8000/hello.txt",
    ]);
    assert_eq!(denied, "407");

    let cfg = d.join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: a
    proxy_url: 'http://shoot--dev--a:secret-a@127.0.0.1:3128'
    static_configs: [{{targets: ['127.0.0.1:8000', '169.254.169.254:80']}}]
  - job_name: b
    proxy_url: '{via_b}'
    static_configs: [{{targets: ['127.0.0.1:8000']}}]
  - job_name: a-listener
    proxy_url: 'http://127.0.0.1:3129'
    static_configs: [{{targets: ['127.0.0.1:8000']}}]
  - job_name: wrong-password
    proxy_url: 'http://b:wrong@127.0.0.1:3128'
    static_configs: [{{targets: ['127.0.0.1:8000']}}]
"
        ),
    )
    .unwrap();
    let _prom = Proc(
        env.seed
            .cmd(&[prometheus.to_str().unwrap(), "--config.file"])
            .arg(&cfg)
            .arg("--storage.tsdb.path")
            .arg(d.join("tsdb"))
            .args(["--web.listen-address", "127.0.0.1:9090"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let query = |q: &str| -> Vec<(String, String, f64)> {
        let text = TunnelEnv::admin_get(
            &env.seed,
            "127.0.0.1:9090",
            &format!("/api/v1/query?query={q}"),
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        v["data"]["result"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|s| {
                        (
                            s["metric"]["job"].as_str().unwrap_or("").to_string(),
                            s["metric"]["instance"].as_str().unwrap_or("").to_string(),
                            s["value"][1]
                                .as_str()
                                .and_then(|x| x.parse().ok())
                                .unwrap_or(-1.0),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let want_up = [
        ("a", "127.0.0.1:8000", 1.0),
        ("a", "169.254.169.254:80", 0.0),
        ("b", "127.0.0.1:8000", 1.0),
        ("a-listener", "127.0.0.1:8000", 1.0),
        ("wrong-password", "127.0.0.1:8000", 0.0),
    ];
    let last = eventually(
        "Prometheus `up` as expected",
        Duration::from_secs(40),
        async || {
            let now = query("up");
            let all = want_up
                .iter()
                .all(|(j, i, v)| now.iter().any(|(lj, li, lv)| lj == j && li == i && lv == v));
            if all {
                Ok(now)
            } else {
                Err(format!("{now:?}"))
            }
        },
    )
    .await;
    assert_eq!(last.len(), want_up.len(), "{last:?}");
    // Each cluster's own value: the right shoot was scraped.
    let values = query("shoot_value");
    for (job, want) in [("a", 1.0), ("b", 2.0), ("a-listener", 1.0)] {
        assert!(
            values
                .iter()
                .any(|(j, i, v)| j == job && i == "127.0.0.1:8000" && *v == want),
            "{job}: {values:?}"
        );
    }
    let m = |name: &str| env.server_metric(&server.admin(), name);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"b\",frontend=\"shared\",outcome=\"ok\"}") >= 2.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"\",frontend=\"shared\",outcome=\"proxy_auth_required\"}") >= 1.0);
}

/// `seedlink tunnel-config` output is usable as is: the agent arguments it
/// writes for cluster B start an agent that joins B, and the Unix socket its
/// EgressSelectorConfiguration names reaches B's shoot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_config_output_drives_a_real_agent() {
    let env = TunnelEnv::new(64);
    let b = Tenant::new(&env, "b", 65);
    let yaml = format!(
        "{}{}",
        env.server_yaml("0.0.0.0:8132", "", ""),
        b.yaml(&env)
    );
    let _server = env.server(&yaml, "server");
    let cfg = env.dir.path().join("server.yaml");
    let out = env.dir.path().join("generated");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args(["tunnel-config", "--config"])
        .arg(&cfg)
        .args(["--cluster", "b", "--agent-server", &b.endpoint()])
        .args(["--server-name", "tunnel.seedlink.test"])
        .args(["--agent-ca-cert", &env.files.seed_ca])
        .args(["--agent-cert", &b.crt, "--agent-key", &b.key, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let egress: serde_json::Value = serde_norway::from_str(
        &std::fs::read_to_string(out.join("egress-selector-configuration.yaml")).unwrap(),
    )
    .unwrap();
    let conn = &egress["egressSelections"][0]["connection"];
    assert_eq!(conn["proxyProtocol"], "HTTPConnect");
    let uds = conn["transport"]["uds"]["udsName"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(uds, b.uds(&env));
    let args = std::fs::read_to_string(out.join("tunnel-agent.args")).unwrap();
    let mut agent = Proc(
        b.ns.cmd(&[env!("CARGO_BIN_EXE_seedlink"), "tunnel-agent"])
            .args(args.lines())
            .args(["--admin", "127.0.0.1:0"])
            .args(["--deny-cidr", seedlink_testkit::SHOOT_LOOPBACK_DENY])
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let ready = ready_line(&mut agent.0);
    assert_eq!(ready["event"], "ready", "{ready}");
    assert!(hello_via(&uds).await.contains("hello from b"));
}

/// Writes `text` to `path` atomically (a reader never sees half a file).
fn write_atomic(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Reloads while cluster A is under load: C is added (SIGHUP), B's agent
/// CA is rotated (the file changes on disk; the server notices by itself),
/// C is removed (SIGHUP). A's load sees no failure at all and a connection
/// A held open through every step still echoes; B's agent with the old
/// certificate is disconnected and one with the new certificate serves B;
/// C's agents are disconnected and its socket is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_adds_rekeys_and_removes_clusters_under_load() {
    let env = TunnelEnv::new(66);
    let b = Tenant::new(&env, "b", 67);
    let c = Tenant::new(&env, "c", 68);
    let base = env.server_yaml("0.0.0.0:8132", "", "");
    let server = env.server(&format!("{base}{}", b.yaml(&env)), "server");
    let cfg_path = env.dir.path().join("server.yaml");
    let admin = server.admin();
    let m = |name: &str| env.server_metric(&admin, name);
    let _a = env.agent(&env.agent_endpoint(8132), &[]);
    let _b_old = b.agent(&env, &["--agent-id", "b-old"]);
    assert!(hello_via(&b.uds(&env)).await.contains("hello from b"));
    let mut held =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut held, 64).await;

    // Load on A for the whole test.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (uds, stop) = (env.uds.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match kas_connect(&uds, "127.0.0.1:7007").await {
                    Ok(mut s) => {
                        echo_rtt(&mut s, 256).await;
                        ok += 1;
                    }
                    Err(e) => failed.push(e),
                }
            }
            (ok, failed)
        })
    };
    let reloads = |want: f64| {
        let m = &m;
        async move {
            eventually("a reload", Duration::from_secs(15), async || {
                m("seedlink_tunnel_server_config_reloads_total{reason=\"ok\"}") >= want
            })
            .await;
        }
    };

    // 1. Add C (SIGHUP).
    write_atomic(
        &cfg_path,
        &format!("{base}{}{}", b.yaml(&env), c.yaml(&env)),
    );
    signal_hup(server.pid());
    reloads(1.0).await;
    let _c = c.agent(&env, &[]);
    assert!(hello_via(&c.uds(&env)).await.contains("hello from c"));

    // 2. Rotate B's CA on disk: noticed without a signal.
    let fresh = seedlink::demo::Pki::generate(&[]).unwrap();
    let bd = env.dir.path().join("b");
    std::fs::write(bd.join("agent2.pem"), &fresh.client.cert_pem).unwrap();
    std::fs::write(bd.join("agent2-key.pem"), &fresh.client.key_pem).unwrap();
    write_atomic(&bd.join("agent-ca.pem"), &fresh.ca_pem);
    reloads(2.0).await;
    eventually(
        "B's old agent to be disconnected",
        Duration::from_secs(10),
        async || {
            m("seedlink_tunnel_server_agent_streams_total{cluster=\"b\",reason=\"rekeyed\"}") >= 1.0
                && m("seedlink_tunnel_server_agents{cluster=\"b\"}") == 0.0
        },
    )
    .await;
    let new_crt = bd.join("agent2.pem").display().to_string();
    let new_key = bd.join("agent2-key.pem").display().to_string();
    let _b_new = env.agent_in(
        &b.ns,
        &b.endpoint(),
        &[
            "--agent-cert",
            &new_crt,
            "--agent-key",
            &new_key,
            "--agent-id",
            "b-new",
        ],
    );
    assert!(hello_via(&b.uds(&env)).await.contains("hello from b"));

    // 3. Remove C (SIGHUP).
    write_atomic(&cfg_path, &format!("{base}{}", b.yaml(&env)));
    signal_hup(server.pid());
    reloads(3.0).await;
    eventually( "C's agent to be disconnected",Duration::from_secs(10), async || {
        m("seedlink_tunnel_server_agent_streams_total{cluster=\"c\",reason=\"cluster_removed\"}")
            >= 1.0
    })
    .await;
    assert!(
        !std::path::Path::new(&c.uds(&env)).exists(),
        "C's socket is gone"
    );
    assert!(kas_connect(&c.uds(&env), "127.0.0.1:8000").await.is_err());

    // A never noticed.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = load.await.unwrap();
    assert!(
        failed.is_empty(),
        "A's load failed {} times: {failed:?}",
        failed.len()
    );
    assert!(ok >= 20, "only {ok} A connections under load");
    echo_rtt(&mut held, 4096).await;
    assert!(hello_via(&b.uds(&env)).await.contains("hello from b"));
    assert_eq!(
        m("seedlink_tunnel_server_config_reloads_total{reason=\"error\"}"),
        0.0
    );
}

/// A broken configuration is refused and the running one stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_reload_changes_nothing() {
    let env = TunnelEnv::new(69);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let cfg_path = env.dir.path().join("server.yaml");
    let admin = server.admin();
    let _a = env.agent(&env.agent_endpoint(8132), &[]);
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    let good = std::fs::read_to_string(&cfg_path).unwrap();
    // A CA file that does not exist: the whole reload is refused.
    write_atomic(
        &cfg_path,
        &good.replace(&env.files.agent_ca, "/nonexistent/ca.pem"),
    );
    signal_hup(server.pid());
    eventually("the refused reload", Duration::from_secs(15), async || {
        env.server_metric(
            &admin,
            "seedlink_tunnel_server_config_reloads_total{reason=\"error\"}",
        ) >= 1.0
    })
    .await;
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    assert_eq!(
        env.server_metric(&admin, "seedlink_tunnel_server_agents{"),
        1.0
    );
}

fn signal_hup(pid: u32) {
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// Cluster A's two agents reach the tunnel-server through the shared SNI
/// gateway (its only way in), cluster B's agent directly. Killing the
/// gateway ends A's agent streams and nothing of B's (B's open connection
/// keeps echoing through every step); a restarted gateway brings
/// A's agents back within their back-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_through_the_gateway_come_back_after_it_restarts() {
    let env = TunnelEnv::new(70);
    let b = Tenant::new(&env, "b", 71);
    // The agent endpoint listens everywhere in the seed: A's shoot only
    // reaches the gateway (its agents are given no other address), B's
    // agent dials the endpoint on B's link directly.
    let yaml = format!(
        "{}{}",
        env.server_yaml("0.0.0.0:8132", "", ""),
        b.yaml(&env)
    );
    let server = env.server(&yaml, "server");
    let admin = server.admin();
    let m = |name: &str| env.server_metric(&admin, name);
    let cfg = env.dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '{}', protocol: tls}}]
control_planes:
  - {{name: tunnel, hostnames: [tunnel.seedlink.test], endpoints: ['127.0.0.1:8132']}}
",
            env.agent_endpoint(8443)
        ),
    )
    .unwrap();
    let gw = env.gateway(&cfg);
    let _a: Vec<_> = (0..2)
        .map(|i| env.agent(&env.agent_endpoint(8443), &["--agent-id", &format!("a{i}")]))
        .collect();
    let _b = b.agent(&env, &[]);
    eventually("all agents", Duration::from_secs(20), async || {
        m("seedlink_tunnel_server_agents{cluster=\"shoot--dev--a\"}") == 2.0
            && m("seedlink_tunnel_server_agents{cluster=\"b\"}") == 1.0
    })
    .await;
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    let mut b_echo =
        kas_connect_eventually(&b.uds(&env), "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut b_echo, 64).await;

    drop(gw); // SIGKILL
    eventually(
        "A's agent streams to end",
        Duration::from_secs(20),
        async || m("seedlink_tunnel_server_agents{cluster=\"shoot--dev--a\"}") == 0.0,
    )
    .await;
    echo_rtt(&mut b_echo, 4096).await;
    assert_eq!(m("seedlink_tunnel_server_agents{cluster=\"b\"}"), 1.0);

    let t0 = std::time::Instant::now();
    let _gw = env.gateway(&cfg);
    // The agents' back-off is capped at 2 s in the test bed.
    eventually("A's agents back", Duration::from_secs(10), async || {
        m("seedlink_tunnel_server_agents{cluster=\"shoot--dev--a\"}") == 2.0
    })
    .await;
    let back = t0.elapsed();
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    // B's connection opened before the gateway died still echoes: B's
    // agent stream never ended (its replica-discovery streams, which it
    // closes itself, are not disruptions).
    echo_rtt(&mut b_echo, 64).await;
    assert_eq!(m("seedlink_tunnel_server_agents{cluster=\"b\"}"), 1.0);
    eprintln!("A's agents were back {back:?} after the gateway restarted");
}

/// A CA and client certificates (PEM cert, PEM key) with the given CNs
/// and, where given, a URI SAN.
fn client_certs(cns: &[(&str, Option<&str>)]) -> (String, Vec<(String, String)>) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "kube-apiserver clients");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let leaves = cns
        .iter()
        .map(|(cn, uri)| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(DnType::CommonName, *cn);
            if let Some(u) = uri {
                p.subject_alt_names = vec![rcgen::SanType::URI((*u).try_into().unwrap())];
            }
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            (
                p.signed_by(&key, &issuer).unwrap().pem(),
                key.serialize_pem(),
            )
        })
        .collect();
    (ca_cert.pem(), leaves)
}

/// One shared TCP+mTLS CONNECT frontend for every cluster: the client
/// certificate's CN names the cluster (curl `-p -x` with each cluster's
/// certificate reaches that cluster's shoot); a certificate naming no
/// cluster is refused and counted. A cluster bound to a URI (as a
/// control plane's generated one is to its object's UID) is selected only
/// by a certificate that carries it: one made for an earlier object of the
/// same name, or with no URI, is refused. Frontend templates give every
/// cluster its Unix socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_mtls_frontend_picks_the_cluster_by_client_certificate() {
    let env = TunnelEnv::new(72);
    let b = Tenant::new(&env, "b", 73);
    let d = env.dir.path();
    let (ca, leaves) = client_certs(&[
        ("shoot--dev--a", None),
        ("b", Some("urn:seedlink:control-plane:u-b")),
        ("nope", None),
        ("b", None),
        ("b", Some("urn:seedlink:control-plane:u-old")),
    ]);
    std::fs::write(d.join("kas-clients-ca.pem"), ca).unwrap();
    for (i, (c, k)) in leaves.iter().enumerate() {
        std::fs::write(d.join(format!("kas{i}.pem")), c).unwrap();
        std::fs::write(d.join(format!("kas{i}-key.pem")), k).unwrap();
    }
    let f = &env.files;
    // B has no frontends of its own: the template gives it a socket.
    let b_yaml = b
        .yaml_with(
            &env,
            "    frontend_client_uri: 'urn:seedlink:control-plane:u-b'\n",
        )
        .replace(
            &format!(
                "      - {{name: uds, protocol: http-connect, unix: '{}/kas-b.sock'}}\n",
                d.display()
            ),
            "",
        )
        .replace("    frontends:\n", "    frontends: []\n");
    let yaml = format!(
        "{}{b_yaml}shared_frontends:\n  - {{name: shared, protocol: http-connect, tcp: '127.0.0.1:8444', cert: '{}', key: '{}', client_ca: '{}'}}\nfrontend_templates:\n  - {{name: kas-t, protocol: http-connect, unix: '{}/t-{{cluster}}.sock'}}\n",
        env.server_yaml("0.0.0.0:8132", "", ""),
        f.fe_crt,
        f.fe_key,
        d.join("kas-clients-ca.pem").display(),
        d.display()
    );
    let server = env.server(&yaml, "server");
    let _a = env.agent(&env.agent_endpoint(8132), &[]);
    let _b = b.agent(&env, &[]);
    let t_b = format!("{}/t-b.sock", d.display());
    assert!(hello_via(&t_b).await.contains("hello from b"));
    assert!(hello_via(&format!("{}/t-shoot--dev--a.sock", d.display()))
        .await
        .contains("hello from the shoot"));
    let curl = |i: usize| {
        let out = env
            .seed
            .cmd(&["curl", "-s", "--max-time", "10", "-p", "-x"])
            .arg("https://frontend.seedlink.test:8444")
            .args(["--resolve", "frontend.seedlink.test:8444:127.0.0.1"])
            .args(["--proxy-cacert", &f.seed_ca])
            .arg("--proxy-cert")
            .arg(d.join(format!("kas{i}.pem")))
            .arg("--proxy-key")
            .arg(d.join(format!("kas{i}-key.pem")))
            .arg("http://127.0.0.1:8000/hello.txt")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(curl(0).contains("hello from the shoot"), "{}", curl(0));
    assert!(curl(1).contains("hello from b"), "{}", curl(1));
    for refused in 2..=4 {
        assert!(!curl(refused).contains("hello"), "{refused}");
    }
    let m = |name: &str| env.server_metric(&server.admin(), name);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"\",frontend=\"shared\",outcome=\"unknown_cluster\"}") >= 3.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"b\",frontend=\"shared\",outcome=\"ok\"}") >= 1.0);
}

/// `seedlink seed`: gateway and tunnel-server in one process. The agent
/// endpoint listens only on the seed's loopback (no shoot can reach it);
/// agents of two clusters dial the gateway's port, whose SNI route has the
/// endpoint `local:tunnel-server`, and the gateway hands their connections
/// over in-process: both clusters' sockets reach their own shoots. A CONNECT
/// on the gateway's http-connect listener whose destination belongs to
/// control plane `b` (endpoint `local:tunnel-server`) is served by cluster
/// b's tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_hands_agent_connections_over_in_process() {
    let env = TunnelEnv::new(74);
    let b = Tenant::new(&env, "b", 75);
    let d = env.dir.path();
    let tunnel_cfg = d.join("tunnel.yaml");
    std::fs::write(
        &tunnel_cfg,
        format!("{}{}", env.server_yaml("127.0.0.1:0", "", ""), b.yaml(&env)),
    )
    .unwrap();
    let gw_cfg = d.join("gateway.yaml");
    std::fs::write(
        &gw_cfg,
        "admin: {listen: '127.0.0.1:0'}
listeners:
  - {name: tls, address: '0.0.0.0:8443', protocol: tls}
  - {name: connect, address: '127.0.0.1:8131', protocol: http-connect, tunnel_frontend: true}
control_planes:
  - {name: tunnel, hostnames: [tunnel.seedlink.test], endpoints: ['local:tunnel-server']}
  - name: b
    destinations: [{name: 'outbound|8000||shoot.b.svc.cluster.local', tunnel_target: '127.0.0.1:8000'}]
    endpoints: ['local:tunnel-server']
    acl: {allow: [127.0.0.0/8]}
",
    )
    .unwrap();
    let mut seed = Proc(
        env.seed
            .cmd(&[env!("CARGO_BIN_EXE_seedlink"), "seed", "--gateway"])
            .arg(&gw_cfg)
            .arg("--tunnel")
            .arg(&tunnel_cfg)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let ready = ready_line(&mut seed.0);
    assert_eq!(ready["event"], "ready", "{ready}");
    let agents_at = ready["tunnel"]["agents"].as_str().unwrap().to_string();
    assert!(agents_at.starts_with("127.0.0.1:"), "{agents_at}");
    let _a = env.agent(&env.agent_endpoint(8443), &[]);
    let _b = env.agent_in(
        &b.ns,
        &format!("198.18.{}.1:8443", b.net),
        &["--agent-cert", &b.crt, "--agent-key", &b.key],
    );
    assert!(hello_via(&env.uds).await.contains("hello from the shoot"));
    assert!(hello_via(&b.uds(&env)).await.contains("hello from b"));
    let gw_admin = ready["admin"].as_str().unwrap().to_string();
    let routed = sum_metric(
        &TunnelEnv::admin_get(&env.seed, &gw_admin, "/metrics"),
        "seedlink_gateway_routed_total{listener=\"tls\",protocol=\"tls-sni\",control_plane=\"tunnel\"}",
    );
    assert!(routed >= 2.0, "{routed}");
    // A CONNECT on the gateway's http-connect listener, routed by its
    // destination header to control plane `b`, is answered by cluster b's
    // tunnel: the target is dialled by b's agent in b's shoot.
    let via_gateway = |dest: &str| {
        let out = env
            .seed
            .cmd(&[
                "curl",
                "-s",
                "--max-time",
                "10",
                "-p",
                "-x",
                "http://127.0.0.1:8131",
            ])
            .args(["--proxy-header", &format!("X-Gardener-Destination: {dest}")])
            .arg("http://127.0.0.1:8000/hello.txt")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let body = via_gateway("outbound|8000||shoot.b.svc.cluster.local");
    assert!(body.contains("hello from b"), "{body:?}");
    let tunnel_admin = ready["tunnel"]["admin"].as_str().unwrap().to_string();
    eventually( "the gateway CONNECT counted",Duration::from_secs(10), async || {
        env.server_metric(
            &tunnel_admin,
            "seedlink_tunnel_server_frontend_connections_total{cluster=\"b\",frontend=\"gateway\",outcome=\"ok\"}",
        ) >= 1.0
    })
    .await;
    for cl in ["shoot--dev--a", "b"] {
        assert_eq!(
            env.server_metric(
                &tunnel_admin,
                &format!("seedlink_tunnel_server_agents{{cluster=\"{cl}\"}}")
            ),
            1.0,
            "{cl}"
        );
    }
}

/// `/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over `/etc/hosts`
/// for processes in that namespace: names only the shoot can resolve.
struct ShootHosts(std::path::PathBuf);

impl ShootHosts {
    fn new(ns: &Netns, lines: &str) -> ShootHosts {
        let dir = std::path::PathBuf::from("/etc/netns").join(&ns.0);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hosts"), format!("127.0.0.1 localhost\n{lines}")).unwrap();
        ShootHosts(dir)
    }
}

impl Drop for ShootHosts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The SOCKS5 frontends: a cluster's own (no authentication) and a shared
/// one where the username names the cluster. Host names are resolved by
/// the agent, in the shoot: `web.shoot.internal` exists only in the shoots'
/// hosts files, so curl `--socks5-hostname` reaches it while `--socks5`
/// (resolving in the seed) cannot. The agent's policy applies to the
/// resolved address: `meta.shoot.internal` is link-local and refused as
/// "not allowed by ruleset". PySocks, a SOCKS client library, connects by
/// name and by IPv4 address through the shared frontend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socks5_frontends_resolve_in_the_shoot_and_apply_the_policy() {
    let env = TunnelEnv::new(76);
    let b = Tenant::new(&env, "b", 77);
    let hosts = "127.0.0.1 web.shoot.internal\n169.254.169.254 meta.shoot.internal\n";
    let _ha = ShootHosts::new(&env.shoot, hosts);
    let _hb = ShootHosts::new(&b.ns, hosts);
    let (server, _agents) = proxy_clusters(
        &env,
        &b,
        "{name: socks, protocol: socks5, tcp: '127.0.0.1:1080'}",
        "{name: shared-socks, protocol: socks5, tcp: '0.0.0.0:1081'}",
    )
    .await;

    let curl = |args: &[&str]| {
        let out = env
            .seed
            .cmd(&["curl", "-sS", "--max-time", "10"])
            .args(args)
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let url = "http://web.shoot.internal:8000/hello.txt";
    // A's own frontend, no authentication; the name resolved in the shoot.
    let out = curl(&["--socks5-hostname", "127.0.0.1:1080", url]);
    assert!(out.contains("hello from the shoot"), "{out}");
    // Resolving in the seed fails: the name does not exist there.
    let out = curl(&["--socks5", "127.0.0.1:1080", url]);
    assert!(!out.contains("hello from"), "{out}");
    // The shared frontend: the username chooses the cluster.
    let out = curl(&["-x", "socks5h://b:secret-b@127.0.0.1:1081", url]);
    assert!(out.contains("hello from b"), "{out}");
    let out = curl(&["-x", "socks5h://shoot--dev--a:secret-a@127.0.0.1:1081", url]);
    assert!(out.contains("hello from the shoot"), "{out}");
    let out = curl(&["-x", "socks5h://b:wrong@127.0.0.1:1081", url]);
    assert!(
        !out.contains("hello from") && out.contains("curl: ("),
        "{out}"
    );
    // No credentials offered to the shared frontend: no acceptable method.
    let out = curl(&["--socks5-hostname", "127.0.0.1:1081", url]);
    assert!(
        !out.contains("hello from") && out.contains("curl: ("),
        "{out}"
    );
    // The policy applies after resolution: link-local is refused with
    // reply 2, "connection not allowed by ruleset" (curl prints the code).
    let out = curl(&[
        "--socks5-hostname",
        "127.0.0.1:1080",
        "http://meta.shoot.internal/",
    ]);
    assert!(out.contains("meta.shoot.internal. (2)"), "{out}");
    // A name nobody resolves: reply 4, host unreachable.
    let out = curl(&[
        "--socks5-hostname",
        "127.0.0.1:1080",
        "http://nowhere.invalid:8000/",
    ]);
    assert!(
        !out.contains("hello from") && out.contains("nowhere.invalid. (4)"),
        "{out}"
    );

    // PySocks: by name (remote DNS) and by IPv4 address.
    let py = "import socks, sys
for host in ('web.shoot.internal', '127.0.0.1'):
    s = socks.socksocket()
    s.settimeout(10)
    s.set_proxy(socks.SOCKS5, '127.0.0.1', 1081, rdns=True, username='b', password='secret-b')
    s.connect((host, 8000))
    s.sendall(b'GET /hello.txt HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')
    data = b''
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    print(host, data.decode().splitlines()[-1])
";
    let out = env.seed.cmd(&["python3", "-c", py]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("web.shoot.internal hello from b")
            && text.contains("127.0.0.1 hello from b"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Requests this frontend does not serve get their RFC 1928 answers:
    // BIND → 7 (command not supported), address type 9 → 8, SOCKS4 and a
    // client offering only username/password to a no-auth frontend are
    // closed (the latter after "no acceptable methods", 0xFF).
    let raw = "import socket
def ask(b):
    s = socket.create_connection(('127.0.0.1', 1080), timeout=10)
    s.sendall(b)
    out = b''
    while True:
        c = s.recv(64)
        if not c:
            break
        out += c
    return out.hex() or '-'
print(ask(b'\\x05\\x01\\x00\\x05\\x02\\x00\\x01\\x7f\\x00\\x00\\x01\\x1f\\x40'))
print(ask(b'\\x05\\x01\\x00\\x05\\x01\\x00\\x09'))
print(ask(b'\\x04\\x01\\x00\\x50\\x7f\\x00\\x00\\x01\\x00'))
print(ask(b'\\x05\\x01\\x02'))
";
    let out = env.seed.cmd(&["python3", "-c", raw]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        [
            "050005070001000000000000",
            "050005080001000000000000",
            "-",
            "05ff"
        ],
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let m = |name: &str| env.server_metric(&server.admin(), name);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"shoot--dev--a\",frontend=\"socks\",outcome=\"socks_command_not_supported\"}") >= 1.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"\",frontend=\"socks\",outcome=\"not_socks5\"}") >= 1.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"b\",frontend=\"shared-socks\",outcome=\"ok\"}") >= 3.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"\",frontend=\"shared-socks\",outcome=\"proxy_auth_required\"}") >= 1.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"\",frontend=\"shared-socks\",outcome=\"socks_no_method\"}") >= 1.0);
    assert!(m("seedlink_tunnel_server_frontend_connections_total{cluster=\"shoot--dev--a\",frontend=\"socks\",outcome=\"error_response\"}") >= 2.0);
}
