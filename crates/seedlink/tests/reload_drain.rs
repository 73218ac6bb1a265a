//! Live reload under load, removal grace, drain on SIGTERM, and the
//! configuration checker, against the real binary.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.reload.test";
const BETA: &str = "api.beta.reload.test";

async fn generation(gw: &Gw) -> u64 {
    let (_, body) = gw.get("/config").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["generation"].as_u64().unwrap()
}

async fn wait_generation(gw: &Gw, want: u64) {
    let what = format!("generation {want}");
    eventually(&what, Duration::from_secs(10), async || {
        generation(gw).await >= want
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_under_load_lose_no_connection() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[ALPHA, BETA]).unwrap());
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let b = demo_backend(&pki, 1, "beta", &stop).await;
    let echo = echo_backend(&stop).await;
    let config = |i: usize| -> String {
        // Valid variants: beta's ACL changes, gamma comes and goes, delta
        // (where a long-lived connection lives) changes its endpoint list.
        let mut y = format!(
            "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
control_planes:
  - {{name: alpha, hostnames: [{ALPHA}], endpoints: ['{a}']}}
  - {{name: beta, hostnames: [{BETA}], endpoints: ['{b}'], acl: {{allow: [127.0.0.0/8, '10.{i}.0.0/16']}}}}
  - {{name: delta, hostnames: [api.beta.example.com], endpoints: ['{echo}'{extra}]}}
",
            extra = if i % 2 == 1 { ", '127.0.0.1:9'" } else { "" }
        );
        if i % 3 != 2 {
            y.push_str(&format!(
                "  - {{name: gamma, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}\n"
            ));
        }
        y
    };
    let gw = Gw::start(&config(0));
    // Long-lived connections: gamma will be removed, delta changed.
    let mut gamma = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut gamma, HELLO_ALPHA).await.unwrap();
    let mut delta = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut delta, HELLO_BETA).await.unwrap();

    let done = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (pki, done, ok, failed, addr) = (
            pki.clone(),
            done.clone(),
            ok.clone(),
            failed.clone(),
            gw.tls,
        );
        workers.push(tokio::spawn(async move {
            let started = Instant::now();
            // Bounded: stops when reloads are done, after 2,000 requests per
            // worker, or after 90 s.
            for n in 0..2_000u32 {
                if done.load(Ordering::Acquire) || started.elapsed() > Duration::from_secs(90) {
                    break;
                }
                let host = if (n + w) % 2 == 0 { ALPHA } else { BETA };
                let cfg = pki.client_config(true, &[b"http/1.1"]).unwrap();
                match tokio::time::timeout(
                    Duration::from_secs(10),
                    seedlink::demo::https_get(addr, host, cfg),
                )
                .await
                {
                    Ok(Ok(body)) if body.contains("hello from") => {
                        ok.fetch_add(1, Ordering::Relaxed)
                    }
                    other => {
                        eprintln!("request to {host} failed: {other:?}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }

    let invalid = [
        "listeners: [ {name: tls".to_string(),
        config(1).replace("api.beta.example.com", ALPHA),
        config(1) + "surprise: true\n",
        config(1).replace("127.0.0.0/8", "127.0.0.300/8"),
        config(1).replace("'127.0.0.1:0'}]", "'127.0.0.1:1'}]"),
    ];
    let mut want_gen = 1;
    let mut failures = 0.0;
    for i in 1..=20usize {
        if i % 4 == 0 {
            gw.write_config(&invalid[i / 4 - 1]);
            if i % 8 == 0 {
                gw.signal("HUP");
            }
            failures += 1.0;
            gw.wait_metric(
                "seedlink_gateway_config_reloads_total{result=\"failure\"}",
                failures,
            )
            .await;
            failures = gw
                .metric("seedlink_gateway_config_reloads_total{result=\"failure\"}")
                .await;
            assert_eq!(
                generation(&gw).await,
                want_gen,
                "an invalid config must not be swapped in"
            );
        } else {
            gw.write_config(&config(i));
            if i % 2 == 0 {
                gw.signal("HUP");
            }
            want_gen += 1;
            wait_generation(&gw, want_gen).await;
        }
    }
    done.store(true, Ordering::Release);
    for w in workers {
        w.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("reload under load: {ok} requests ok, {failed} failed, generation {want_gen}");
    assert_eq!(failed, 0, "requests failed during reloads");
    assert!(ok >= 20, "the load loop made too few requests ({ok})");
    // Long-lived connections were never touched, even the removed and the changed one.
    echo_roundtrip(&mut gamma, b"gamma still open")
        .await
        .unwrap();
    echo_roundtrip(&mut delta, b"delta still open")
        .await
        .unwrap();
    assert!(
        gw.metric("seedlink_gateway_config_reloads_total{result=\"failure\"}")
            .await
            >= 5.0
    );
    assert_eq!(
        gw.metric("seedlink_gateway_config_generation").await,
        want_gen as f64
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_control_plane_is_closed_after_its_grace() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let base = format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
timeouts: {{removed_control_plane_grace: 300ms}}
control_planes:
  - {{name: keep, hostnames: [api.beta.example.com], endpoints: ['{echo}']}}
"
    );
    let gw = Gw::start(&format!(
        "{base}  - {{name: gone, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}\n"
    ));
    let mut gone = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut gone, HELLO_ALPHA).await.unwrap();
    let mut keep = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut keep, HELLO_BETA).await.unwrap();
    gw.write_config(&base);
    wait_generation(&gw, 2).await;
    let (_, r) = read_until_closed(&mut gone, Duration::from_secs(10)).await;
    assert!(r.is_err(), "closed by reset, not a clean end");
    gw.wait_metric("seedlink_gateway_connections_total{listener=\"tls\",control_plane=\"gone\",outcome=\"closed_removed\"}", 1.0)
        .await;
    echo_roundtrip(&mut keep, b"unaffected").await.unwrap();
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_then_exits_zero() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let yaml = format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
timeouts: {{drain: 30s}}
control_planes:
  - {{name: a, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
"
    );
    let mut gw = Gw::start(&yaml);
    assert_eq!(gw.get("/readyz").await.0, 200);
    let mut open = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut open, HELLO_ALPHA).await.unwrap();
    gw.signal("TERM");
    eventually("readiness false", Duration::from_secs(10), async || {
        gw.get("/readyz").await == (503, "draining\n".to_string())
    })
    .await;
    // Listeners close on the worker threads right after the phase changes;
    // from then on the kernel refuses new connections.
    eventually(
        "a draining gateway refuses",
        Duration::from_secs(10),
        async || TcpStream::connect(gw.tls).await.is_err(),
    )
    .await;
    echo_roundtrip(&mut open, b"still served while draining")
        .await
        .unwrap();
    drop(open);
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));

    // Deadline: a connection that never ends is closed, and the exit is 0.
    let mut gw = Gw::start(&yaml.replace("drain: 30s", "drain: 300ms"));
    let mut open = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut open, HELLO_ALPHA).await.unwrap();
    gw.signal("TERM");
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));
    let (_, r) = read_until_closed(&mut open, Duration::from_secs(5)).await;
    assert!(r.is_err(), "closed at the deadline by reset");

    // A second signal exits at once.
    let mut gw = Gw::start(&yaml);
    let mut open = TcpStream::connect(gw.tls).await.unwrap();
    echo_roundtrip(&mut open, HELLO_ALPHA).await.unwrap();
    gw.signal("TERM");
    eventually("readiness false", Duration::from_secs(10), async || {
        gw.get("/readyz").await.0 == 503
    })
    .await;
    gw.signal("TERM");
    assert_eq!(gw.wait_exit(Duration::from_secs(5)), Some(1));
    stop.cancel();
}

#[test]
fn check_config_lists_every_problem_and_gateway_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "listeners: [{name: lb, address: '0.0.0.0:1', proxy_protocol: required}]
always_allowed: [10.0.0.1/8]
control_planes:
  - {name: a, hostnames: ['a.*.com'], endpoints: ['nohost']}
",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .arg("check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "4 problem(s)",
        "listeners[lb].proxy_protocol",
        "always_allowed[0]",
        "hostnames[0]",
        "endpoints[0]",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
    }
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/gateway.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .arg("check-config")
        .arg(example)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Valid, but its admin endpoint is open to the network without a
    // token: accepted, never silently.
    let open = dir.path().join("open-admin.yaml");
    std::fs::write(
        &open,
        "admin: {listen: '0.0.0.0:9901'}
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes: [{name: a, hostnames: [a.example], endpoints: ['127.0.0.1:9']}]
",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .arg("check-config")
        .arg(&open)
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning") && err.contains("without a token_file"),
        "{err}"
    );
    // The gateway refuses to start on the bad file (required PROXY without trusted LBs).
    let out = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args(["gateway", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("fail closed"));
}

/// A second gateway on the same ports refuses to start (exit 1, a message
/// naming the listener and the flag) instead of silently sharing them by
/// SO_REUSEPORT; with `--reuse-port` it joins deliberately.
#[test]
fn a_second_gateway_on_the_same_ports_refuses_unless_asked_to_share() {
    let first = Gw::start(
        "admin: {listen: '127.0.0.1:0'}
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes: [{name: a, hostnames: [a.example], endpoints: ['127.0.0.1:9']}]
",
    );
    let port = first.listener("tls").port();
    let cfg = first.dir.path().join("second.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:{port}'}}]
control_planes: [{{name: a, hostnames: [a.example], endpoints: ['127.0.0.1:9']}}]
"
        ),
    )
    .unwrap();
    let mut second = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args(["gateway", "--config"])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = eventually_blocking(
        "the second gateway to exit (it must not run on a port in use)",
        Duration::from_secs(20),
        || second.try_wait().unwrap().ok_or("still running"),
    );
    let out = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("listener tls") && err.contains("--reuse-port"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "it must not report ready");
    // Asked to share: it starts and reports ready.
    let mut shared = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args(["gateway", "--reuse-port", "--config"])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = common::tunnel_env::ready_line(&mut shared);
    let _ = shared.kill();
    let _ = shared.wait();
    assert_eq!(ready["event"], "ready", "{ready}");
}

/// `check-config` validates a tunnel-server file too (told from its keys):
/// every problem with its path, including files that do not exist or do
/// not hold what they must; a valid file with real certificates passes.
#[test]
fn check_config_validates_a_tunnel_server_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pki = seedlink::demo::Pki::generate(&["tunnel.example"]).unwrap();
    std::fs::write(d.join("ca.pem"), &pki.ca_pem).unwrap();
    std::fs::write(d.join("tun.pem"), &pki.servers[0].1.cert_pem).unwrap();
    std::fs::write(d.join("tun-key.pem"), &pki.servers[0].1.key_pem).unwrap();
    std::fs::write(d.join("not-a-ca.pem"), "hello\n").unwrap();
    let p = |f: &str| d.join(f).display().to_string();
    let good = format!(
        "server_count: 2
agents: {{listen: '0.0.0.0:8132', cert: '{}', key: '{}'}}
clusters:
  - name: a
    agent_ca: '{}'
    frontends: [{{name: kas, protocol: http-connect, unix: /run/seedlink/a.sock}}]
",
        p("tun.pem"),
        p("tun-key.pem"),
        p("ca.pem")
    );
    let file = d.join("tunnel.yaml");
    std::fs::write(&file, &good).unwrap();
    let run = common::check_config;
    let out = run(&file);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("tunnel-server: 1 clusters"));
    // Files that are missing or hold the wrong thing, each named by its key.
    let bad_files = good
        .replace(&p("ca.pem"), &p("missing-ca.pem"))
        .replace(&p("tun-key.pem"), &p("not-a-ca.pem"));
    std::fs::write(&file, &bad_files).unwrap();
    let out = run(&file);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "2 problem(s)",
        "clusters[0] (a).agent_ca",
        "missing-ca.pem",
        "agents.key",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
    }
    // Semantic problems, all listed with their paths.
    let bad = good
        .replace("server_count: 2", "server_count: 0")
        .replace("name: kas", "name: kas, tcp: '0.0.0.0:8090'");
    std::fs::write(&file, &bad).unwrap();
    let out = run(&file);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("server_count"), "{err}");
    assert!(err.contains("clusters[0] (a).frontends[0] (kas)"), "{err}");
}

/// `check-config` validates the files of the tunnel-agent and the
/// node-proxy too (told from their keys): a broken file of each is refused
/// with every problem and its key, including a CA file that does not exist.
#[test]
fn check_config_validates_agent_and_node_proxy_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = common::check_config;
    let agent = d.join("agent.yaml");
    std::fs::write(
        &agent,
        "server: tunnel.example\nca_cert: /nonexistent/ca.pem\nagent_cert: /nonexistent/a.pem\n\
         sync_interval: 5s\nsync_interval_cap: 1s\n",
    )
    .unwrap();
    let out = run(&agent);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "4 problem(s)",
        "server: \"tunnel.example\" is not host:port",
        "ca_cert: /nonexistent/ca.pem",
        "agent_cert: agent_cert and agent_key go together",
        "sync_interval_cap: must be at least sync_interval",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
    }
    // An unknown key is refused with its line.
    std::fs::write(&agent, "server: a:1\nca_cert: /x\nflow_contrl: false\n").unwrap();
    let err = String::from_utf8_lossy(&run(&agent).stderr).into_owned();
    assert!(
        err.contains("flow_contrl") && err.contains("line 3"),
        "{err}"
    );
    let np = d.join("node-proxy.yaml");
    std::fs::write(
        &np,
        "address: 10.0.0.1\ngateway: seed.example\nlink_kind: tun\nmode: connect\n",
    )
    .unwrap();
    let out = run(&np);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "3 problem(s)",
        "gateway: \"seed.example\" is not host:port",
        "destination: needed in connect mode",
        "link_kind: \"tun\" is not dummy, bridge, existing or none",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
    }
}

/// A binary upgrade (`--upgrade-socket`, then the next binary with
/// `--take-over`): under a steady stream of new connections, none is
/// refused or reset, the new process serves on the very same sockets, a
/// long passthrough stream opened before stays byte-exact on the old
/// process while it drains, and the old process exits 0. Then the new one
/// offers its sockets in turn (a second upgrade works the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_upgrade_refuses_nothing_and_keeps_every_stream() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let yaml = format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
timeouts: {{drain: 30s}}
control_planes:
  - {{name: a, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
"
    );
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("upgrade.sock");
    let sock = sock.to_str().unwrap();
    let mut old = Gw::start_args(&yaml, &["--upgrade-socket", sock]);
    let mut long = TcpStream::connect(old.tls).await.unwrap();
    echo_roundtrip(&mut long, HELLO_ALPHA).await.unwrap();

    // New connections all through: each one's ClientHello must come back.
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load_stop = CancellationToken::new();
    // Four clients at once, so that connections are queued and in flight
    // at every moment of the hand-over.
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (ok, failed, load_stop, addr) =
                (ok.clone(), failed.clone(), load_stop.clone(), old.tls);
            tokio::spawn(async move {
                let end = Instant::now() + Duration::from_secs(60);
                for _ in 0..5_000 {
                    if load_stop.is_cancelled() || Instant::now() > end {
                        break;
                    }
                    let r = async {
                        let mut s = TcpStream::connect(addr).await?;
                        echo_roundtrip(&mut s, HELLO_ALPHA).await
                    };
                    match tokio::time::timeout(Duration::from_secs(10), r).await {
                        Ok(Ok(())) => ok.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    eventually("load", Duration::from_secs(10), async || {
        ok.load(Ordering::Relaxed) >= 20
    })
    .await;
    let before = ok.load(Ordering::Relaxed);
    let mut new = Gw::start_args(&yaml, &["--upgrade-socket", sock, "--take-over"]);
    assert_eq!(new.tls, old.tls, "the same listening socket");
    assert_eq!(new.admin, old.admin, "the same admin socket");
    // The old process drains: its stream is still served, byte-exact.
    let mut sent = Vec::new();
    for i in 0..64u32 {
        let chunk: Vec<u8> = (0..4096u32)
            .map(|j| (i.wrapping_mul(31) ^ j) as u8)
            .collect();
        echo_roundtrip(&mut long, &chunk).await.unwrap();
        sent.extend_from_slice(&chunk);
    }
    assert_eq!(sent.len(), 64 * 4096);
    drop(long);
    assert_eq!(
        old.wait_exit(Duration::from_secs(30)),
        Some(0),
        "the old gateway drains and exits 0"
    );
    eventually(
        "load after the upgrade",
        Duration::from_secs(10),
        async || ok.load(Ordering::Relaxed) >= before + 50,
    )
    .await;
    assert_eq!(new.get("/readyz").await.0, 200);
    // And again: the new process offers the sockets in turn.
    let mut third = Gw::start_args(&yaml, &["--upgrade-socket", sock, "--take-over"]);
    assert_eq!(third.tls, new.tls);
    assert_eq!(new.wait_exit(Duration::from_secs(30)), Some(0));
    let seen = ok.load(Ordering::Relaxed);
    eventually(
        "load after the second upgrade",
        Duration::from_secs(10),
        async || ok.load(Ordering::Relaxed) >= seen + 50,
    )
    .await;
    load_stop.cancel();
    for l in load {
        l.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("upgrade under load: {ok} connections served, {failed} failed");
    assert_eq!(
        failed, 0,
        "no connection refused or reset across two upgrades ({ok} served)"
    );
    assert_eq!(third.get("/readyz").await.0, 200);
    third.signal("TERM");
    assert_eq!(third.wait_exit(Duration::from_secs(30)), Some(0));
    stop.cancel();
}

/// The upgrade socket hands the listening sockets to the gateway's own
/// user only: the file is 0600, and even opened to everyone, another
/// user's process that asks gets nothing (peer credentials), while the
/// gateway serves on and can still be taken over by its own user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_take_the_listening_sockets() {
    use std::os::unix::fs::PermissionsExt;
    let setpriv = require("setpriv");
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let yaml = format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
control_planes:
  - {{name: a, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("upgrade.sock");
    let old = Gw::start_args(&yaml, &["--upgrade-socket", sock.to_str().unwrap()]);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = Command::new(setpriv)
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
        ])
        .arg(
            "import socket,sys\n\
             s=socket.socket(socket.AF_UNIX)\n\
             s.connect(sys.argv[1])\n\
             try:\n  s.sendall(b'seedlink-take\\n')\n  msg,anc,flags,addr=s.recvmsg(65536,4096)\n\
             except OSError:\n  msg,anc=b'',[]\n\
             print(len(msg),len(anc))\n",
        )
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0 0",
        "another user got something: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut s = TcpStream::connect(old.tls).await.unwrap();
    echo_roundtrip(&mut s, HELLO_ALPHA).await.unwrap();
    let mut old = old;
    let new = Gw::start_args(
        &yaml,
        &["--upgrade-socket", sock.to_str().unwrap(), "--take-over"],
    );
    assert_eq!(new.tls, old.tls);
    drop(s);
    assert_eq!(old.wait_exit(Duration::from_secs(30)), Some(0));
    stop.cancel();
}
