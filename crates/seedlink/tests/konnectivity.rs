//! Interop with the upstream Konnectivity binaries (apiserver-network-proxy
//! `proxy-server`, `proxy-agent`, `test-client`), located by
//! `scripts/install-peers` (`KONNECTIVITY_BIN`): upstream agents against
//! seedlink's tunnel-server, seedlink's agent against upstream servers, both
//! kinds of agent on one server. Runs in the seed/shoot namespaces of
//! `common::tunnel_env`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use seedlink_testkit as common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::tunnel_env::{kas_connect, kas_connect_eventually, Started, TunnelEnv};
use common::{eventually, require, signal, Netns, Proc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The directory of the upstream binaries; fails loudly when missing.
fn kbin(name: &str) -> PathBuf {
    let dir = std::env::var("KONNECTIVITY_BIN").ok().or_else(|| {
        let home = std::env::var("HOME").ok()?;
        let d = Path::new(&home).join(".cache/seedlink/konnectivity-4f8517c1-linux-amd64");
        d.is_dir().then(|| d.display().to_string())
    });
    let Some(dir) = dir else {
        panic!(
            "upstream Konnectivity binaries not found: run scripts/install-peers (it unpacks \
             shared/konnectivity/) or set KONNECTIVITY_BIN to a directory with {name}"
        );
    };
    let p = Path::new(&dir).join(name);
    assert!(
        p.is_file(),
        "{} is missing (KONNECTIVITY_BIN={dir})",
        p.display()
    );
    p
}

/// Lets `ns` resolve `tunnel.seedlink.test` to the seed end of the veth
/// (`ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts), so
/// upstream's agent verifies the server certificate by that name.
struct Hosts(PathBuf);

impl Hosts {
    fn new(ns: &Netns, lines: &str) -> Hosts {
        let dir = Path::new("/etc/netns").join(&ns.0);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hosts"), format!("127.0.0.1 localhost\n{lines}\n")).unwrap();
        Hosts(dir)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A big file of a known pattern in the shoot's HTTP directory, and its
/// SHA-256.
fn big_file(env: &TunnelEnv, name: &str, mib: usize) -> String {
    let mut data: Vec<u8> = (0..mib * 1024 * 1024)
        .map(|i| (i % 253) as u8 ^ (i >> 16) as u8)
        .collect();
    // Never a trailing newline (see `test_client`).
    if let Some(last) = data.last_mut() {
        *last = b'.';
    }
    std::fs::write(env.dir.path().join(name), &data).unwrap();
    sha256(&data)
}

fn sha256(data: &[u8]) -> String {
    let mut c = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = c.stdin.take().unwrap();
    let owned = data.to_vec();
    let w = std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(&owned);
    });
    let out = c.wait_with_output().unwrap();
    w.join().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A PUT sink in the shoot on 127.0.0.1:`port`: answers the SHA-256 of the
/// body; with `rate` > 0 it reads at most that many bytes per second (a
/// slow destination).
fn put_sink(ns: &Netns, port: u16, rate: usize) -> Proc {
    const SINK: &str = "import hashlib,http.server,sys,time
PORT=int(sys.argv[1]);RATE=int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
  def do_PUT(self):
    n=int(self.headers['Content-Length']);h=hashlib.sha256()
    while n>0:
      d=self.rfile.read(min(n,65536))
      if not d: break
      h.update(d);n-=len(d)
      if RATE: time.sleep(len(d)/RATE)
    b=h.hexdigest().encode();self.send_response(200);self.send_header('Content-Length',str(len(b)));self.end_headers();self.wfile.write(b)
  def log_message(self,*a): pass
s=http.server.ThreadingHTTPServer(('127.0.0.1',PORT),H);print('up',flush=True);s.serve_forever()";
    common::tunnel_env::spawn_until_up(ns.cmd(&[
        "python3",
        "-c",
        SINK,
        &port.to_string(),
        &rate.to_string(),
    ]))
}

/// Upstream `proxy-agent` in the shoot, dialing `host:port`.
fn upstream_agent(env: &TunnelEnv, port: u16, id: &str, creds: &[&str]) -> Proc {
    // Its admin and health ports (0 is refused) in the shoot namespace,
    // which only the test's own processes use.
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(18000);
    let admin = NEXT.fetch_add(2, std::sync::atomic::Ordering::Relaxed);
    let f = &env.files;
    Proc(
        env.shoot
            .cmd(&[kbin("proxy-agent").to_str().unwrap()])
            .args([
                "--proxy-server-host=tunnel.seedlink.test",
                &format!("--proxy-server-port={port}"),
                &format!("--ca-cert={}", f.seed_ca),
                &format!("--agent-id={id}"),
                &format!("--admin-server-port={admin}"),
                &format!("--health-server-port={}", admin + 1),
                "--sync-interval=200ms",
                "--sync-interval-cap=2s",
                "-v=0",
            ])
            .args(creds)
            .stdout(Stdio::null())
            .stderr(log_to(env, id))
            .spawn()
            .unwrap(),
    )
}

/// Upstream `test-client` in the seed: fetches `path` from the shoot's HTTP
/// server through a frontend; returns (exit ok, body, log). It writes the
/// body only into its klog line `HTML Response:\n<body>` (at `-v=4`), and
/// klog appends one `\n` to a message that does not end with one: bodies
/// compared byte for byte here never end with `\n` (see [`big_file`]).
fn test_client(ns: &Netns, args: &[&str], path: &str) -> (bool, Vec<u8>, String) {
    let out = ns
        .cmd(&[kbin("test-client").to_str().unwrap()])
        .args(args)
        .args([
            "--proxy-host=",
            "--proxy-port=0",
            "--request-host=127.0.0.1",
            "--request-port=8000",
            &format!("--request-path={path}"),
            "-v=4",
        ])
        .env("GODEBUG", "asyncpreemptoff=1")
        .output()
        .unwrap();
    const MARK: &[u8] = b"] HTML Response:\n";
    let err = &out.stderr;
    let body = err
        .windows(MARK.len())
        .position(|w| w == MARK)
        .map(|at| {
            let mut b = err[at + MARK.len()..].to_vec();
            if b.last() == Some(&b'\n') {
                b.pop();
            }
            b
        })
        .unwrap_or_default();
    let log = String::from_utf8_lossy(&err[..err.len().min(4096)]).into_owned();
    (out.status.success(), body, log)
}

/// curl in the seed through the seedlink mTLS CONNECT frontend.
fn curl_frontend(env: &TunnelEnv, extra: &[&str], url: &str) -> std::process::Output {
    let f = &env.files;
    let proxy = format!("https://frontend.seedlink.test:{}", env.fe_port);
    let resolve = format!("frontend.seedlink.test:{}:127.0.0.1", env.fe_port);
    env.seed
        .cmd(&["curl", "-sS", "--max-time", "120", "-p", "-x", &proxy])
        .args([
            "--proxy-cacert",
            &f.seed_ca,
            "--proxy-cert",
            &f.kas_crt,
            "--proxy-key",
            &f.kas_key,
            "--resolve",
            &resolve,
        ])
        .args(extra)
        .arg(url)
        .output()
        .unwrap()
}

async fn wait_agents(env: &TunnelEnv, server: &Started, n: f64) {
    let admin = server.admin();
    eventually("agents to connect", Duration::from_secs(30), async || {
        env.server_metric(&admin, "seedlink_tunnel_server_agents{") == n
    })
    .await;
}

/// Echoes one message over a held tunnel.
async fn echo_once(s: &mut tokio::net::UnixStream, msg: &[u8]) -> Result<(), String> {
    s.write_all(msg).await.map_err(|e| e.to_string())?;
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
        .await
        .map_err(|_| "no echo within 10 s".to_string())?
        .map_err(|e| e.to_string())?;
    if back != msg {
        return Err("echo differs".into());
    }
    Ok(())
}

/// Upstream `proxy-agent` (mTLS) → seedlink tunnel-server: 50 MB down
/// through upstream's `test-client` over the HTTP CONNECT and gRPC Unix
/// sockets and through curl over the mTLS CONNECT frontend, 50 MB up,
/// a 2 MiB/s reader of 12 MiB, all byte-exact; a closed port is a 502; a
/// tunnel held idle for 70 s still echoes. Before the backpressure fix the
/// downloads were cut after 0.7–36 MB (`agent_packets_total{reason="overflow"}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_agent_to_seedlink_server_loses_nothing() {
    require("sha256sum");
    let env = TunnelEnv::new(80);
    let _hosts = Hosts::new(
        &env.shoot,
        &format!("198.18.{}.1 tunnel.seedlink.test", env.net),
    );
    let _sink = put_sink(&env.shoot, 7011, 0);
    let big = big_file(&env, "big.bin", 50);
    let mid = big_file(&env, "mid.bin", 12);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let f = &env.files;
    let _agent = upstream_agent(
        &env,
        8132,
        "upstream-a",
        &[
            &format!("--agent-cert={}", f.agent_crt),
            &format!("--agent-key={}", f.agent_key),
        ],
    );
    wait_agents(&env, &server, 1.0).await;
    // A tunnel held idle across upstream's keepalive enforcement window.
    let mut held =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_once(&mut held, b"before").await.unwrap();
    let idle_since = std::time::Instant::now();

    for mode in ["http-connect", "grpc"] {
        let uds = if mode == "grpc" {
            &env.grpc_uds
        } else {
            &env.uds
        };
        let (ok, body, err) = test_client(
            &env.seed,
            &[&format!("--mode={mode}"), &format!("--proxy-uds={uds}")],
            "big.bin",
        );
        assert!(ok, "test-client {mode}: {err}");
        assert_eq!(body.len(), 50 << 20, "test-client {mode}: {err}");
        assert_eq!(sha256(&body), big, "test-client {mode}");
    }
    let out = curl_frontend(&env, &[], "http://127.0.0.1:8000/big.bin");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256(&out.stdout), big, "curl download");
    // Upload: 50 MB to the PUT sink, which answers the digest it saw.
    let up = env.dir.path().join("big.bin");
    let out = curl_frontend(
        &env,
        &["-T", up.to_str().unwrap()],
        "http://127.0.0.1:7011/up",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), big, "curl upload");
    // A slow reader (kubectl logs -f over a slow link) gets every byte.
    let out = curl_frontend(
        &env,
        &["--limit-rate", "2M"],
        "http://127.0.0.1:8000/mid.bin",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256(&out.stdout), mid, "2 MiB/s reader");
    // A closed port: the documented 502.
    let refused = kas_connect(&env.uds, "127.0.0.1:9")
        .await
        .err()
        .unwrap_or_default();
    assert!(refused.contains("502"), "{refused}");

    let admin = server.admin();
    for bad in ["overflow", "stalled", "unexpected"] {
        assert_eq!(
            env.server_metric(
                &admin,
                &format!("seedlink_tunnel_server_agent_packets_total{{cluster=\"shoot--dev--a\",reason=\"{bad}\"}}")
            ),
            0.0,
            "{bad}"
        );
    }
    // The held tunnel: idle for 70 s in all, then it still echoes.
    if let Some(rest) = Duration::from_secs(70).checked_sub(idle_since.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    echo_once(&mut held, b"after 70 s idle").await.unwrap();
}

/// Upstream `proxy-agent` authenticated by a ServiceAccount token (no client
/// certificate), checked by seedlink against the issuer's key: dials work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_agent_with_a_serviceaccount_token() {
    let env = TunnelEnv::new(81);
    let _hosts = Hosts::new(
        &env.shoot,
        &format!("198.18.{}.1 tunnel.seedlink.test", env.net),
    );
    let ep = env.agent_endpoint(8132);
    let d = env.dir.path();
    let (yaml, issuer_key) = env.token_server_yaml(&ep);
    let server = env.server(&yaml, "server");
    let token = common::tunnel_env::sign_token(&issuer_key, "system:konnectivity-server");
    let tok = d.join("agent.token");
    std::fs::write(&tok, token).unwrap();
    let _agent = upstream_agent(
        &env,
        8132,
        "upstream-token",
        &[&format!("--service-account-token-path={}", tok.display())],
    );
    wait_agents(&env, &server, 1.0).await;
    let (ok, body, err) = test_client(
        &env.seed,
        &["--mode=http-connect", &format!("--proxy-uds={}", env.uds)],
        "hello.txt",
    );
    assert!(ok, "{err}");
    assert!(
        String::from_utf8_lossy(&body).contains("hello from the shoot"),
        "{body:?} {err}"
    );
}

/// Upstream `proxy-server` in the seed, started in `mode` with its agent port
/// on the veth address and its frontend on a Unix socket.
fn upstream_server(
    env: &TunnelEnv,
    mode: &str,
    uds: &Path,
    agent_port: u16,
    id: &str,
    count: u32,
    health: u16,
) -> Proc {
    let f = &env.files;
    let p = Proc(
        env.seed
            .cmd(&[kbin("proxy-server").to_str().unwrap()])
            .args([
                &format!("--mode={mode}"),
                &format!("--uds-name={}", uds.display()),
                "--server-port=0",
                &format!("--agent-port={agent_port}"),
                &format!("--agent-bind-address=198.18.{}.1", env.net),
                &format!("--cluster-cert={}", f.tun_crt),
                &format!("--cluster-key={}", f.tun_key),
                &format!("--cluster-ca-cert={}", f.agent_ca),
                &format!("--server-id={id}"),
                &format!("--server-count={count}"),
                &format!("--health-port={health}"),
                "--health-bind-address=127.0.0.1",
                &format!("--admin-port={}", health + 1),
                "--admin-bind-address=127.0.0.1",
                "--proxy-strategies=default",
                "-v=0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    p
}

/// Polls upstream's `/readyz` (ready once ≥ 1 agent is connected).
async fn upstream_ready(ns: &Netns, health: u16) {
    let url = format!("http://127.0.0.1:{health}/readyz");
    eventually(
        "upstream proxy-server to see an agent",
        Duration::from_secs(30),
        async || {
            ns.cmd(&["curl", "-sf", "--max-time", "2", &url])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        },
    )
    .await;
}

/// seedlink `tunnel-agent` → upstream `proxy-server` in `http-connect` and in
/// `grpc` mode: upstream's test-client fetches 50 MB byte-exact through it,
/// and a tunnel held idle for 70 s (upstream enforces ≥ 30 s between agent
/// pings and answers faster ones with GOAWAY) still echoes; the agent made
/// one server connection and saw no stream end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seedlink_agent_to_upstream_servers() {
    require("sha256sum");
    let env = TunnelEnv::new(82);
    let big = big_file(&env, "big.bin", 50);
    let d = env.dir.path();
    let (hc_uds, grpc_uds) = (d.join("up-hc.sock"), d.join("up-grpc.sock"));
    // Health ports inside the seed namespace, which only this test uses.
    let (hp, gp) = (18092, 18094);
    let _hc = upstream_server(&env, "http-connect", &hc_uds, 8132, "up-hc", 1, hp);
    let _gr = upstream_server(&env, "grpc", &grpc_uds, 8133, "up-grpc", 1, gp);
    let a1 = env.agent(&env.agent_endpoint(8132), &[]);
    let a2 = env.agent(&env.agent_endpoint(8133), &[]);
    // An agent told to ping every 5 s: upstream answers GOAWAY
    // too_many_pings, the agent doubles its interval until upstream accepts it.
    let ep_port = 18096;
    let _ep = upstream_server(
        &env,
        "http-connect",
        &d.join("up-eager.sock"),
        8134,
        "up-eager",
        1,
        ep_port,
    );
    let eager = env.agent(
        &env.agent_endpoint(8134),
        &["--keepalive-time", "5", "--agent-id", "eager"],
    );
    upstream_ready(&env.seed, hp).await;
    upstream_ready(&env.seed, gp).await;
    let uds = hc_uds.display().to_string();
    let mut held = kas_connect_eventually(&uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_once(&mut held, b"before").await.unwrap();
    let idle_since = std::time::Instant::now();
    for (mode, sock) in [("http-connect", &hc_uds), ("grpc", &grpc_uds)] {
        let (ok, body, err) = test_client(
            &env.seed,
            &[
                &format!("--mode={mode}"),
                &format!("--proxy-uds={}", sock.display()),
            ],
            "big.bin",
        );
        assert!(ok, "test-client {mode}: {err}");
        assert_eq!(sha256(&body), big, "test-client {mode}: {err}");
    }
    if let Some(rest) = Duration::from_secs(70).checked_sub(idle_since.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    echo_once(&mut held, b"after 70 s idle").await.unwrap();
    let e = eager.admin();
    assert!(
        env.agent_metric(
            &e,
            "seedlink_tunnel_agent_server_connects_total{outcome=\"too_many_pings\"}"
        ) >= 1.0,
        "the eager agent never saw too_many_pings"
    );
    eventually(
        "the eager agent to be back",
        Duration::from_secs(20),
        async || env.agent_metric(&e, "seedlink_tunnel_agent_open_server_connections") == 1.0,
    )
    .await;
    for a in [&a1, &a2] {
        assert_eq!(
            env.agent_metric(
                &a.admin(),
                "seedlink_tunnel_agent_server_connects_total{outcome=\"ok\"}"
            ),
            1.0,
            "the agent's one stream was never lost"
        );
    }
}

/// Two upstream servers (`--server-count=2`, distinct IDs) behind HAProxy:
/// the seedlink agent holds a stream to each, closes the duplicates it
/// finds while looking, and stops looking once both are held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seedlink_agent_holds_a_stream_to_each_upstream_replica_behind_haproxy() {
    require("haproxy");
    let env = TunnelEnv::new(83);
    let d = env.dir.path();
    let (u1, u2) = (d.join("r1.sock"), d.join("r2.sock"));
    let (h1, h2) = (18092, 18094);
    let _r1 = upstream_server(&env, "http-connect", &u1, 8141, "replica-1", 2, h1);
    let _r2 = upstream_server(&env, "http-connect", &u2, 8142, "replica-2", 2, h2);
    let cfg = d.join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n  maxconn 200\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 1h\n  timeout server 1h\n\
             frontend agents\n  bind 198.18.{n}.1:8132\n  default_backend replicas\n\
             backend replicas\n  balance roundrobin\n  server r1 198.18.{n}.1:8141\n  server r2 198.18.{n}.1:8142\n",
            n = env.net
        ),
    )
    .unwrap();
    let _lb = Proc(
        env.seed
            .cmd(&["haproxy", "-db", "-f", cfg.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_tcp(&env.seed, &format!("198.18.{}.1:8132", env.net)).await;
    let agent = env.agent(&env.agent_endpoint(8132), &[]);
    upstream_ready(&env.seed, h1).await;
    upstream_ready(&env.seed, h2).await;
    let admin = agent.admin();
    eventually(
        "streams to both replicas",
        Duration::from_secs(30),
        async || env.agent_metric(&admin, "seedlink_tunnel_agent_open_server_connections") == 2.0,
    )
    .await;
    // Both replicas serve dials through their own socket.
    for u in [&u1, &u2] {
        let (ok, body, err) = test_client(
            &env.seed,
            &[
                "--mode=http-connect",
                &format!("--proxy-uds={}", u.display()),
            ],
            "hello.txt",
        );
        assert!(
            ok && String::from_utf8_lossy(&body).contains("hello"),
            "{err}"
        );
    }
    // Once both are held, discovery backs off: over 6 s (3× the agent's
    // 2 s sync cap here) at most one more probe is made.
    let probes = || {
        env.agent_metric(
            &admin,
            "seedlink_tunnel_agent_server_connects_total{outcome=\"duplicate\"}",
        ) + env.agent_metric(
            &admin,
            "seedlink_tunnel_agent_server_connects_total{outcome=\"ok\"}",
        )
    };
    let before = probes();
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        probes() - before <= 1.0,
        "discovery kept probing: {} → {}",
        before,
        probes()
    );
}

/// An upstream and a seedlink agent on one seedlink server both serve dials;
/// the seedlink agent allows only port 8000, so a dial to the echo port
/// tells which agent served it. SIGTERM to either agent sends DRAIN: the
/// server then sends every dial to the other one. And seedlink's agent
/// draining on an upstream server: upstream prefers the other agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_agents_serve_dials_and_drain_both_ways() {
    let env = TunnelEnv::new(84);
    let _hosts = Hosts::new(
        &env.shoot,
        &format!("198.18.{}.1 tunnel.seedlink.test", env.net),
    );
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let f = &env.files;
    let certs = [
        format!("--agent-cert={}", f.agent_crt),
        format!("--agent-key={}", f.agent_key),
    ];
    let creds: Vec<&str> = certs.iter().map(String::as_str).collect();
    let upstream = upstream_agent(&env, 8132, "upstream-a", &creds);
    let ours = env.agent(&ep, &["--allow-port", "8000", "--agent-id", "seedlink-a"]);
    wait_agents(&env, &server, 2.0).await;
    // Dials to the echo port: served only by the upstream agent.
    let echo_dials = |n: usize| {
        let uds = env.uds.clone();
        async move {
            let mut ok = 0;
            for _ in 0..n {
                if kas_connect(&uds, "127.0.0.1:7007").await.is_ok() {
                    ok += 1;
                }
            }
            ok
        }
    };
    let both = echo_dials(30).await;
    assert!(
        both > 0 && both < 30,
        "both agents take dials: {both}/30 via upstream"
    );
    // The upstream agent drains: every dial goes to ours (echo denied).
    signal(upstream.0.id(), "-TERM");
    let admin = server.admin();
    eventually(
        "the upstream agent's DRAIN",
        Duration::from_secs(15),
        async || {
            // Fresh probes until none reaches the upstream agent.
            futures_block(echo_dials(5)) == 0
        },
    )
    .await;
    assert_eq!(echo_dials(20).await, 0, "a draining agent got a dial");
    let s = kas_connect(&env.uds, "127.0.0.1:8000").await;
    assert!(s.is_ok(), "the non-draining agent serves: {:?}", s.err());
    let _ = admin;
    drop(ours);
    drop(upstream);

    // seedlink's agent on an upstream server, next to an upstream agent.
    let d = env.dir.path();
    let uds = d.join("up.sock");
    let hp = 18098;
    let _up = upstream_server(&env, "http-connect", &uds, 8150, "up", 1, hp);
    let ours = env.agent(
        &env.agent_endpoint(8150),
        &["--allow-port", "8000", "--agent-id", "seedlink-b"],
    );
    let _theirs = upstream_agent(&env, 8150, "upstream-b", &creds);
    upstream_ready(&env.seed, hp).await;
    let up = uds.display().to_string();
    eventually(
        "both agents on the upstream server",
        Duration::from_secs(20),
        async || {
            // A denied echo dial proves ours is connected; a served one, theirs.
            let (mut served, mut denied) = (0, 0);
            for _ in 0..10 {
                match futures_block(kas_connect(&up, "127.0.0.1:7007")) {
                    Ok(_) => served += 1,
                    Err(_) => denied += 1,
                }
            }
            served > 0 && denied > 0
        },
    )
    .await;
    signal(ours.pid(), "-TERM");
    eventually(
        "upstream to honour our DRAIN",
        Duration::from_secs(15),
        async || (0..10).all(|_| futures_block(kas_connect(&up, "127.0.0.1:7007")).is_ok()),
    )
    .await;
    let mut all = 0;
    for _ in 0..20 {
        if kas_connect(&up, "127.0.0.1:7007").await.is_ok() {
            all += 1;
        }
    }
    assert_eq!(
        all, 20,
        "upstream sent a dial to the draining seedlink agent"
    );
}

/// Runs a future to completion from a synchronous predicate (the test
/// runtime is multi-threaded, so blocking one worker is fine).
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// Where an upstream process logs: a file in the test directory, or the
/// test's stderr with `KONNECTIVITY_LOG=1`.
fn log_to(env: &TunnelEnv, name: &str) -> Stdio {
    if std::env::var_os("KONNECTIVITY_LOG").is_some() {
        return Stdio::inherit();
    }
    std::fs::File::create(env.dir.path().join(format!("{name}.log")))
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null())
}

/// Waits until something accepts TCP connections on `addr` inside `ns`.
async fn wait_tcp(ns: &Netns, addr: &str) {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let probe = format!("exec 3<>/dev/tcp/{host}/{port}");
    eventually("a listener", Duration::from_secs(20), async || {
        ns.cmd(&["bash", "-c", &probe])
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    })
    .await;
}

/// The agent side of the standard protocol: a seedlink agent with flow
/// control off (what it speaks to an upstream server) uploads 12 MiB to a
/// destination that reads 2 MiB/s: the agent's queue fills, its stream
/// waits for the destination instead of dropping, and every byte arrives.
/// Before, the agent closed the connection ("destination too slow: queue
/// overflow").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_destination_behind_the_agent_gets_every_byte() {
    require("sha256sum");
    let env = TunnelEnv::new(86);
    let _sink = put_sink(&env.shoot, 7012, 2 << 20);
    let mid = big_file(&env, "mid.bin", 12);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let agent = env.agent(&ep, &["--flow-control", "false"]);
    wait_agents(&env, &server, 1.0).await;
    let up = env.dir.path().join("mid.bin");
    let out = curl_frontend(
        &env,
        &["-T", up.to_str().unwrap()],
        "http://127.0.0.1:7012/up",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        mid,
        "upload to a slow destination"
    );
    let a = agent.admin();
    for bad in ["overflow", "stalled"] {
        assert_eq!(
            env.agent_metric(
                &a,
                &format!("seedlink_tunnel_agent_endpoint_closes_total{{outcome=\"{bad}\"}}")
            ),
            0.0,
            "{bad}"
        );
    }
}

/// A tunnel-server binary upgrade with an upstream agent, which ignores
/// DRAIN: run with `--sync-forever` against a server whose processes have
/// their own IDs (no `server_id` configured), it finds the new process by
/// itself, and the new process takes the frontends only once every cluster
/// has an agent there: no dial fails across the hand-over, and a tunnel
/// opened before it goes on through the old process, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_agent_follows_a_tunnel_server_binary_upgrade() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let env = TunnelEnv::new(63);
    let _hosts = Hosts::new(
        &env.shoot,
        &format!("198.18.{}.1 tunnel.seedlink.test", env.net),
    );
    let ep = env.agent_endpoint(8133);
    let upgrade = env.dir.path().join("upgrade.sock").display().to_string();
    let yaml = env.server_yaml(&ep, "", "");
    let old = env.server_with(&yaml, "server", &["--upgrade-socket", &upgrade]);
    let f = &env.files;
    let certs = [
        format!("--agent-cert={}", f.agent_crt),
        format!("--agent-key={}", f.agent_key),
        "--sync-forever".to_string(),
    ];
    let creds: Vec<&str> = certs.iter().map(String::as_str).collect();
    let _upstream = upstream_agent(&env, 8133, "upstream-a", &creds);
    wait_agents(&env, &old, 1.0).await;
    let mut long =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(10)).await;
    echo_once(&mut long, b"before").await.unwrap();

    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let stop = tokio_util::sync::CancellationToken::new();
    let dialer = {
        let (uds, ok, failed, stop) = (env.uds.clone(), ok.clone(), failed.clone(), stop.clone());
        tokio::spawn(async move {
            for _ in 0..5_000 {
                if stop.is_cancelled() {
                    break;
                }
                match kas_connect(&uds, "127.0.0.1:8000").await {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        eprintln!("dial across the upgrade failed: {e}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let new = env.server_with(
        &yaml,
        "server-next",
        &[
            "--upgrade-socket",
            &upgrade,
            "--take-over",
            "--take-over-wait",
            "15",
        ],
    );
    assert_ne!(new.ready["server_id"], old.ready["server_id"]);
    wait_agents(&env, &new, 1.0).await;
    let seen = ok.load(Ordering::Relaxed);
    eventually(
        "dials through the new process",
        Duration::from_secs(20),
        async || ok.load(Ordering::Relaxed) >= seen + 20,
    )
    .await;
    stop.cancel();
    dialer.await.unwrap();
    // The tunnel opened before goes on through the old process.
    let msg: Vec<u8> = (0..65_536).map(|j| (j % 251) as u8).collect();
    echo_once(&mut long, &msg).await.unwrap();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!(
        "upstream agent across a tunnel-server binary upgrade: {ok} dials served, {failed} failed"
    );
    assert_eq!(failed, 0, "no dial fails across the upgrade ({ok} served)");
}
