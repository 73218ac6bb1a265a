//! Tunnel faults: a frozen agent, a restarted server, two replicas behind
//! HAProxy, a dial cancelled while the agent is still connecting, 1,000
//! open/close cycles without leaks, a frontend that stops reading, and a
//! malicious agent.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::tunnel_env::*;
use common::*;
use seedlink_tunnel::proto::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const AGENTS: &str = "seedlink_tunnel_server_agents{";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_agent_is_dropped_by_keepalive_and_comes_back() {
    let env = TunnelEnv::new(42);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let agent = env.agent(&ep, &["--keepalive-time", "1"]);
    let mut held =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut held, 10).await;

    // SIGSTOP: the agent answers no PING (1 s interval, 1 s timeout).
    let pid = agent.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let t0 = Instant::now();
    let _ = read_until_closed(&mut held, Duration::from_secs(10)).await;
    let took = t0.elapsed();
    // Keepalive 1 s + timeout 1 s; generous slack for a busy machine.
    assert!(
        took < Duration::from_secs(8),
        "frozen agent noticed after {took:?}"
    );
    assert_eq!(env.server_metric(&server.admin(), AGENTS), 0.0);

    // SIGCONT: the agent finds its stream dead and reconnects.
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(15)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_returns_after_a_server_restart() {
    let env = TunnelEnv::new(43);
    let ep = env.agent_endpoint(8132);
    let yaml = env.server_yaml(&ep, "", "");
    let server = env.server(&yaml, "server");
    let agent = env.agent(&ep, &[]);
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello"));
    drop(server);
    // The agent notices and fails to reconnect (backing off, cap 2 s in the
    // test bed) while the server is down.
    let errors = "seedlink_tunnel_agent_server_connects_total{outcome=\"error\"}";
    eventually("reconnects to fail", Duration::from_secs(20), async || {
        env.agent_metric(&agent.admin(), errors) >= 2.0
    })
    .await;
    let t0 = Instant::now();
    let server = env.server(&yaml, "server");
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(10)).await;
    let took = t0.elapsed();
    assert!(fetch_hello(s).await.contains("hello"));
    // Back within the back-off cap (2 s) plus jitter and the TLS dial,
    // with generous slack.
    assert!(took < Duration::from_secs(10), "agent back after {took:?}");
    assert_eq!(env.server_metric(&server.admin(), AGENTS), 1.0);
    assert!(
        env.agent_metric(
            &agent.admin(),
            "seedlink_tunnel_agent_server_connects_total{outcome=\"error\"}"
        ) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_holds_a_stream_to_each_replica_behind_haproxy() {
    let env = TunnelEnv::new(44);
    let (a, b) = (env.agent_endpoint(8141), env.agent_endpoint(8142));
    let s1 = env.server(
        &env.server_yaml(&a, "server_id: replica-1\nserver_count: 2", "-1"),
        "s1",
    );
    let s2 = env.server(
        &env.server_yaml(&b, "server_id: replica-2\nserver_count: 2", "-2"),
        "s2",
    );
    let lb = env.agent_endpoint(8132);
    let _lb = haproxy_lb(Some(&env.seed), env.dir.path(), &lb, &[a, b], false);
    let agent = env.agent(&lb, &[]);
    eventually(
        "a stream to both replicas",
        Duration::from_secs(15),
        async || {
            env.server_metric(&s1.admin(), AGENTS) == 1.0
                && env.server_metric(&s2.admin(), AGENTS) == 1.0
        },
    )
    .await;
    for sock in ["-1", "-2"] {
        let path = env.socket(sock).display().to_string();
        let s = kas_connect_eventually(&path, "127.0.0.1:8000", Duration::from_secs(5)).await;
        assert!(fetch_hello(s).await.contains("hello"), "via replica {sock}");
    }
    // Ready means a stream to every replica the servers say there are.
    let ready = TunnelEnv::admin_get(&env.shoot, &agent.admin(), "/readyz");
    assert!(ready.contains("server streams: 2 of 2"), "{ready}");
    assert_eq!(
        env.agent_metric(
            &agent.admin(),
            "seedlink_tunnel_agent_open_server_connections"
        ),
        2.0
    );
    // One replica gone: no longer ready (one of two), still serving.
    drop(s2);
    eventually(
        "unready with a replica gone",
        Duration::from_secs(15),
        async || {
            let r = TunnelEnv::admin_get(&env.shoot, &agent.admin(), "/readyz");
            r.contains("failed") && r.contains("1 of 2")
        },
    )
    .await;
    drop(s1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_cancelled_while_the_agent_connects_is_cancelled_on_the_agent() {
    let env = TunnelEnv::new(45);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let agent = env.agent(&ep, &["--dial-timeout", "20"]);
    let _ = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    // 127.0.0.1:7009 has a full backlog: the agent's connect hangs.
    let mut s = tokio::net::UnixStream::connect(&env.uds).await.unwrap();
    s.write_all(b"CONNECT 127.0.0.1:7009 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    eventually(
        "the dial to be pending",
        Duration::from_secs(10),
        async || env.server_metric(&server.admin(), "seedlink_tunnel_server_pending_dials{") == 1.0,
    )
    .await;
    drop(s); // kube-apiserver gives up
    eventually(
        "the agent to cancel its dial",
        Duration::from_secs(5),
        async || {
            env.agent_metric(
                &agent.admin(),
                "seedlink_tunnel_agent_dials_total{outcome=\"cancelled\"}",
            ) == 1.0
        },
    )
    .await;
    assert_eq!(
        env.server_metric(&server.admin(), "seedlink_tunnel_server_pending_dials{"),
        0.0
    );
    assert_eq!(
        env.server_metric(&server.admin(), "seedlink_tunnel_server_dial_failures_total{cluster=\"shoot--dev--a\",reason=\"dial_closed\"}"),
        1.0
    );
    // A dial pending when the agent dies fails at once (502), not at the
    // dial timeout.
    let pending = tokio::spawn({
        let uds = env.uds.clone();
        async move {
            let t = kas_connect(&uds, "127.0.0.1:7009")
                .await
                .err()
                .unwrap_or_default();
            (t, Instant::now())
        }
    });
    eventually(
        "the dial to be pending",
        Duration::from_secs(5),
        async || env.server_metric(&server.admin(), "seedlink_tunnel_server_pending_dials{") == 1.0,
    )
    .await;
    let mut agent = agent;
    let killed = Instant::now();
    let _ = agent.proc.0.kill();
    let (answer, at) = pending.await.unwrap();
    assert!(answer.contains("502"), "{answer}");
    // At once, not at the 10 s dial timeout.
    assert!(
        at.duration_since(killed) < Duration::from_secs(5),
        "answered after {:?}",
        at.duration_since(killed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_open_close_cycles_leave_nothing_behind() {
    let env = TunnelEnv::new(46);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let agent = env.agent(&ep, &[]);
    let _ = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    let settle = || async {
        eventually(
            "connections to drain",
            Duration::from_secs(10),
            async || {
                env.server_metric(
                    &server.admin(),
                    "seedlink_tunnel_server_established_connections{",
                ) == 0.0
                    && env.agent_metric(
                        &agent.admin(),
                        "seedlink_tunnel_agent_open_endpoint_connections",
                    ) == 0.0
            },
        )
        .await;
    };
    settle().await;
    let (srv_fds, agent_fds) = (fd_count(server.pid()), fd_count(agent.pid()));
    let tasks = env.server_metric(&server.admin(), "seedlink_tunnel_server_tasks");
    let mut workers = Vec::new();
    for w in 0..8 {
        let uds = env.uds.clone();
        workers.push(tokio::spawn(async move {
            for _ in 0..125 {
                let mut s = kas_connect(&uds, "127.0.0.1:7007")
                    .await
                    .unwrap_or_else(|e| panic!("worker {w}: {e}"));
                echo_rtt(&mut s, 100).await;
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    settle().await;
    let ok = env.server_metric(&server.admin(), "seedlink_tunnel_server_dials_total{");
    assert!(ok >= 1000.0, "{ok}");
    eventually(
        "fds and tasks back to their start values",
        Duration::from_secs(10),
        async || {
            fd_count(server.pid()) <= srv_fds
                && fd_count(agent.pid()) <= agent_fds
                && env.server_metric(&server.admin(), "seedlink_tunnel_server_tasks") <= tasks
        },
    )
    .await;
    assert_eq!(
        env.server_metric(&server.admin(), "seedlink_tunnel_server_pending_dials{"),
        0.0
    );
    assert_eq!(
        env.server_metric(&server.admin(), "seedlink_tunnel_server_agent_packets_total{cluster=\"shoot--dev--a\",reason=\"unrecognized\"}"),
        0.0
    );
}

/// Echo round trips on one connection for 3 s while another connection of
/// the same agent stream has a frontend that stopped reading a fast
/// stream. Returns the slowest round trip beside the stalled reader (the
/// latency figures themselves are the benchmark's, not the test's) and the
/// stalled connection.
async fn echo_beside_a_stalled_reader(
    env: &TunnelEnv,
    target: &str,
) -> (Duration, tokio::net::UnixStream) {
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    for _ in 0..20 {
        echo_rtt(&mut echo, 1024).await;
    }
    let stalled = kas_connect(&env.uds, target).await.unwrap();
    let mut slowest = Duration::ZERO;
    let mut n = 0;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        slowest = slowest.max(echo_rtt(&mut echo, 1024).await);
        n += 1;
    }
    eprintln!("{target}: {n} echo round trips beside a stalled reader, slowest {slowest:?}");
    assert!(n >= 2, "the echo connection stopped making round trips");
    (slowest, stalled)
}

/// Plain Konnectivity protocol (flow control off): a full queue pauses the
/// agent stream (backpressure, nothing dropped) while its reader makes
/// progress; a reader that takes nothing for the stall deadline (2 s here)
/// loses its connection, alone, and the other connection on the stream
/// then runs freely. The pause is bounded by the stall deadline: no echo
/// round trip takes longer than that plus slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_frontend_is_closed_alone_over_the_standard_protocol() {
    let env = TunnelEnv::new(47);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "queue_bytes: 1048576", ""), "server");
    let _agent = env.agent(&ep, &["--flow-control", "false"]);
    let (slowest, stalled) = echo_beside_a_stalled_reader(&env, "127.0.0.1:7008").await;
    assert!(
        slowest < Duration::from_secs(8),
        "a pause outlived the stall deadline: {slowest:?}"
    );
    let m = |o: &str| {
        env.server_metric(
            &server.admin(),
            &format!("seedlink_tunnel_server_frontend_connections_total{{cluster=\"shoot--dev--a\",frontend=\"uds\",outcome=\"{o}\"}}"),
        )
    };
    eventually(
        "the stalled connection to close",
        Duration::from_secs(10),
        async || m("stalled") + m("aborted") >= 1.0,
    )
    .await;
    assert_eq!(
        m("stalled") + m("aborted"),
        1.0,
        "the stalled connection alone is closed"
    );
    drop(stalled);
}

/// seedlink agent and server negotiate per-connection flow control: the
/// stalled connection is held back, not closed, and when its reader
/// returns every byte arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_frontend_resumes_losslessly_with_flow_control() {
    let env = TunnelEnv::new(49);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let _agent = env.agent(&ep, &[]);
    let (slowest, mut stalled) = echo_beside_a_stalled_reader(&env, "127.0.0.1:7010").await;
    eprintln!("slowest round trip beside the held-back reader: {slowest:?}");
    // Flow control holds back only the stalled connection: the echo went
    // on for longer than the stall deadline (2 s) and the server never
    // found the stream's queue full, so it closed nothing as stalled. (The
    // window arithmetic itself is unit-tested in the link machines.)
    let closed_as = |o: &str| {
        env.server_metric(
            &server.admin(),
            &format!("seedlink_tunnel_server_frontend_connections_total{{cluster=\"shoot--dev--a\",frontend=\"uds\",outcome=\"{o}\"}}"),
        )
    };
    assert_eq!(
        closed_as("stalled") + closed_as("aborted"),
        0.0,
        "flow control closed a reader"
    );
    // The reader returns: 8 MiB of the pattern, complete and in order.
    let (got, end) = read_until_closed(&mut stalled, Duration::from_secs(20)).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(got.len(), 8 * 1024 * 1024);
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, b)| usize::from(*b) == i % 251),
        "corrupted stream"
    );
    let closed = env.server_metric(&server.admin(), "seedlink_tunnel_server_frontend_connections_total{cluster=\"shoot--dev--a\",frontend=\"uds\",outcome=\"stalled\"}");
    assert_eq!(closed, 0.0);
}

/// An agent of the same cluster that misbehaves: it copies the real
/// agent's ID, sends DATA and CLOSE for connection IDs it does not own
/// (including the real connection's), answers dials it never got, sends
/// unknown packet types and an oversized message, and reconnects in a
/// storm. The real agent's connection sees none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malicious_agent_cannot_touch_other_agents_connections() {
    let env = TunnelEnv::new(48);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let _agent = env.agent(&ep, &["--agent-id", "real"]);
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut echo, 64).await;

    let f = &env.files;
    let fake = FakeAgent {
        netns: env.seed.0.clone(),
        ca: f.seed_ca.clone(),
        cert: f.agent_crt.clone(),
        key: f.agent_key.clone(),
        endpoint: ep.clone(),
        agent_id: "real".into(),
    };
    // Packets: DATA and CLOSE_RSP for the real connection's ID (1) and
    // others, a DIAL_RSP for a dial it never got, an unknown type, then an
    // oversized DATA (over the 4 MiB message limit).
    let mut script = Vec::new();
    for id in 1..=20i64 {
        script.push(Packet::data(id, bytes::Bytes::from_static(b"INJECTED")));
        script.push(Packet::close_rsp(id, String::new()));
        script.push(Packet::dial_rsp(id * 7919, id, String::new()));
    }
    script.push(Packet {
        r#type: 42,
        payload: None,
    });
    fake.run(script, true);
    // A reconnect storm.
    for _ in 0..50 {
        fake.run(Vec::new(), false);
    }
    // The real connection is intact and nothing was injected into it.
    echo_rtt(&mut echo, 64).await;
    let mut extra = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_millis(300), echo.read(&mut extra)).await;
    assert!(r.is_err(), "unexpected bytes on the real connection: {r:?}");
    echo_rtt(&mut echo, 4096).await;
    let unrec = env.server_metric(&server.admin(), "seedlink_tunnel_server_agent_packets_total{cluster=\"shoot--dev--a\",reason=\"unrecognized\"}");
    assert!(unrec >= 60.0, "{unrec}");
    let unexpected = env.server_metric(&server.admin(), "seedlink_tunnel_server_agent_packets_total{cluster=\"shoot--dev--a\",reason=\"unexpected\"}");
    assert!(unexpected >= 1.0, "{unexpected}");
    eventually(
        "only the real agent to remain",
        Duration::from_secs(10),
        async || env.server_metric(&server.admin(), AGENTS) == 1.0,
    )
    .await;
    // New dials still work (they may only land on the real agent now).
    let s = kas_connect(&env.uds, "127.0.0.1:8000").await.unwrap();
    assert!(fetch_hello(s).await.contains("hello"));
}

/// SIGTERM on the server: not ready, new frontends refused, an open
/// tunneled connection keeps working until it ends; then the server exits 0
/// well before the drain deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_drain_lets_open_connections_finish() {
    let env = TunnelEnv::new(51);
    let ep = env.agent_endpoint(8132);
    let mut server = env.server_with(&env.server_yaml(&ep, "", ""), "server", &["--drain", "20"]);
    let _agent = env.agent(&ep, &[]);
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut echo, 100).await;
    signal(server.pid(), "-TERM");
    let admin = server.admin();
    eventually("readiness to drop", Duration::from_secs(5), async || {
        TunnelEnv::admin_get(&env.seed, &admin, "/readyz").starts_with("draining")
    })
    .await;
    assert!(
        kas_connect(&env.uds, "127.0.0.1:8000").await.is_err(),
        "new frontends are refused while draining"
    );
    for _ in 0..10 {
        echo_rtt(&mut echo, 1000).await;
    }
    let t0 = Instant::now();
    drop(echo);
    let code = loop {
        if let Some(st) = server.proc.0.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "server did not exit after its last connection"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, Some(0));
}

/// SIGTERM on one of two agents: it sends DRAIN, the server sends new dials
/// to the other agent; the draining agent exits at its drain deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_agent_gets_no_new_dials() {
    let env = TunnelEnv::new(52);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let mut a = env.agent(&ep, &["--agent-id", "a", "--drain", "3"]);
    let b = env.agent(&ep, &["--agent-id", "b"]);
    eventually("two agents", Duration::from_secs(15), async || {
        env.server_metric(&server.admin(), "seedlink_tunnel_server_agents{") == 2.0
    })
    .await;
    signal(a.pid(), "-TERM");
    eventually("the DRAIN to arrive", Duration::from_secs(5), async || {
        TunnelEnv::admin_get(&env.shoot, &a.admin(), "/readyz").contains("failed")
    })
    .await;
    let admin = server.admin();
    eventually(
        "the server to mark it draining",
        Duration::from_secs(5),
        async || TunnelEnv::admin_get(&env.seed, &admin, "/readyz").contains("draining=1"),
    )
    .await;
    let ok = "seedlink_tunnel_agent_dials_total{outcome=\"ok\"}";
    let (a0, b0) = (
        env.agent_metric(&a.admin(), ok),
        env.agent_metric(&b.admin(), ok),
    );
    for _ in 0..20 {
        let s = kas_connect(&env.uds, "127.0.0.1:8000").await.unwrap();
        assert!(fetch_hello(s).await.contains("hello"));
    }
    assert_eq!(
        env.agent_metric(&a.admin(), ok),
        a0,
        "the draining agent got dials"
    );
    assert_eq!(env.agent_metric(&b.admin(), ok), b0 + 20.0);
    let t0 = Instant::now();
    let code = loop {
        if let Some(st) = a.proc.0.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "agent did not exit at its drain deadline"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, Some(0));
}

/// An agent killed (`kill -9`) under two endless downloads: the one over a
/// TCP frontend ends in a reset (the client sees ECONNRESET, not a clean
/// end that would make a cut-off `kubectl cp` look finished); the one over
/// the Unix socket, where no reset exists, ends and is counted apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_resets_tcp_frontends_and_counts_unix_ends() {
    let env = TunnelEnv::new(78);
    let ep = env.agent_endpoint(8132);
    let yaml = format!(
        "{}      - {{name: plain, protocol: http-connect, tcp: '127.0.0.1:8095'}}\n",
        env.server_yaml(&ep, "", "")
    );
    let server = env.server(&yaml, "server");
    let agent = env.agent(&ep, &[]);
    let mut unix =
        kas_connect_eventually(&env.uds, "127.0.0.1:7008", Duration::from_secs(20)).await;
    let mut buf = vec![0u8; 65536];
    unix.read_exact(&mut buf).await.unwrap();
    // A Python client on the TCP frontend: prints `reading` once bytes
    // flow, then how the download ended.
    let py = "import socket, sys
s = socket.create_connection(('127.0.0.1', 8095), timeout=30)
s.sendall(b'CONNECT 127.0.0.1:7008 HTTP/1.1\\r\\nHost: 127.0.0.1:7008\\r\\n\\r\\n')
head = b''
while b'\\r\\n\\r\\n' not in head:
    head += s.recv(1)
assert head.startswith(b'HTTP/1.1 200'), head
s.recv(65536)
print('reading', flush=True)
try:
    while s.recv(65536):
        pass
    print('eof', flush=True)
except ConnectionResetError:
    print('reset', flush=True)
";
    let mut client = Proc(
        env.seed
            .cmd(&["python3", "-c", py])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(client.0.stdout.take().unwrap()));
    assert_eq!(lines.next().unwrap().unwrap(), "reading");
    assert!(std::process::Command::new("kill")
        .args(["-9", &agent.pid().to_string()])
        .status()
        .unwrap()
        .success());
    let ended = tokio::task::spawn_blocking(move || lines.next().map(|l| l.unwrap()))
        .await
        .unwrap();
    assert_eq!(
        ended.as_deref(),
        Some("reset"),
        "the TCP frontend's download"
    );
    let _ = read_until_closed(&mut unix, Duration::from_secs(10)).await;
    let m = |signal: &str| {
        env.server_metric(
            &server.admin(),
            &format!("seedlink_tunnel_server_frontend_aborts_total{{cluster=\"shoot--dev--a\",reason=\"{signal}\"}}"),
        )
    };
    eventually("both aborts counted", Duration::from_secs(10), async || {
        m("reset") >= 1.0 && m("eof") >= 1.0
    })
    .await;
    assert_eq!((m("reset"), m("eof")), (1.0, 1.0));
    drop(client);
}

/// A partition (iptables DROP in the shoot namespace: packets unanswered)
/// of 20 s, long enough for a growing back-off to reach a large cap: once
/// the network heals the idle agent is back within a few seconds, because
/// timed out attempts do not grow the back-off, and because on the native
/// transport it pings at the server's interval (1 s here) instead of its
/// own default 60 s, so it noticed the dead stream when the server did.
/// The heal time is printed (a figure for docs/TUNNEL.md), the bound
/// asserted is generous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_partition_heals_the_agent_is_back_within_seconds() {
    require("iptables");
    let env = TunnelEnv::new(79);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let agent = env.agent(&ep, &["--sync-interval-cap", "60"]);
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
    let rule = ["OUTPUT", "-d", "198.18.79.1", "-j", "DROP"];
    let ipt = |op: &str| {
        let mut args = vec!["iptables", op];
        args.extend_from_slice(&rule);
        env.shoot.run(&args);
    };
    ipt("-A");
    eventually(
        "the server to drop the agent",
        Duration::from_secs(15),
        async || env.server_metric(&server.admin(), AGENTS) == 0.0,
    )
    .await;
    // The idle agent notices too, within the partition: at its own 60 s
    // PING interval it would not have yet.
    eventually(
        "the idle agent to notice its stream is dead",
        Duration::from_secs(15),
        async || {
            env.agent_metric(
                &agent.admin(),
                "seedlink_tunnel_agent_open_server_connections",
            ) == 0.0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(20)).await; // the partition itself
    ipt("-D");
    let healed = Instant::now();
    eventually("the agent to return", Duration::from_secs(20), async || {
        env.server_metric(&server.admin(), AGENTS) >= 1.0
    })
    .await;
    eprintln!(
        "agent back {:?} after the partition healed",
        healed.elapsed()
    );
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(10)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
}

/// Two agents, one frozen (SIGSTOP) with the server's PING interval at 2 s
/// and its PING timeout at 60 s, so the connection stays open long after
/// the agent stopped answering: every dial still succeeds (one sent to the
/// frozen agent is taken back once it has been silent past the interval
/// and goes to the other). With both frozen, a dial is answered at once
/// with 503 "agent unresponsive" instead of waiting its 40 s timeout, while
/// both streams are still counted as connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dials_avoid_a_frozen_agent_and_fail_fast_when_all_are() {
    let env = TunnelEnv::new(87);
    let ep = env.agent_endpoint(8132);
    let yaml = env
        .server_yaml(&ep, "", "")
        .replace(
            "keepalive: 1s, keepalive_timeout: 1s",
            "keepalive: 2s, keepalive_timeout: 60s",
        )
        .replace("dial_timeout: 10s", "dial_timeout: 40s");
    assert!(yaml.contains("keepalive_timeout: 60s") && yaml.contains("dial_timeout: 40s"));
    let server = env.server(&yaml, "server");
    let a = env.agent(&ep, &["--agent-id", "a"]);
    let b = env.agent(&ep, &["--agent-id", "b"]);
    eventually("two agents", Duration::from_secs(15), async || {
        env.server_metric(&server.admin(), AGENTS) == 2.0
    })
    .await;
    let ok = "seedlink_tunnel_agent_dials_total{outcome=\"ok\"}";
    let b0 = env.agent_metric(&b.admin(), ok);
    signal(a.pid(), "-STOP");
    for i in 0..20 {
        let s = kas_connect(&env.uds, "127.0.0.1:8000")
            .await
            .unwrap_or_else(|e| panic!("dial {i} with one agent frozen: {e}"));
        assert!(fetch_hello(s).await.contains("hello from the shoot"));
    }
    assert_eq!(
        env.agent_metric(&b.admin(), ok),
        b0 + 20.0,
        "every dial ended on the live agent"
    );

    signal(b.pid(), "-STOP");
    let answer = match kas_connect(&env.uds, "127.0.0.1:8000").await {
        Ok(_) => panic!("a dial succeeded with both agents frozen"),
        Err(e) => e,
    };
    assert!(
        answer.starts_with("HTTP/1.1 503") && answer.contains("agent unresponsive"),
        "{answer}"
    );
    assert_eq!(
        env.server_metric(&server.admin(), AGENTS),
        2.0,
        "the failure came before the keepalive closed the streams"
    );
    assert!(
        env.server_metric(
            &server.admin(),
            "seedlink_tunnel_server_dial_failures_total{cluster=\"shoot--dev--a\",reason=\"agent_unresponsive\"}"
        ) >= 1.0
    );

    signal(a.pid(), "-CONT");
    signal(b.pid(), "-CONT");
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(15)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
}

/// A rolling restart of three tunnel-server replicas, one at a time, as a
/// Deployment does it with readiness and a preStop: each old replica
/// leaves the frontends' endpoints, gets SIGTERM (it sends DRAIN to its
/// agents) and its replacement starts. Under a steady loop of dials
/// through the replicas in the endpoints: no dial fails; the agent joins
/// each replacement while the old replica still drains (DRAIN makes it
/// look at once, instead of when the old stream ends); a long echo stream
/// through each old replica stays byte-exact until it ends, and then the
/// old replica exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_fails_no_dial_and_keeps_open_tunnels() {
    use std::sync::{Arc, Mutex};
    let env = TunnelEnv::new(58);
    let old_ep: Vec<String> = (0..3).map(|i| env.agent_endpoint(8141 + i)).collect();
    let new_ep: Vec<String> = (0..3).map(|i| env.agent_endpoint(8144 + i)).collect();
    let start = |ep: &str, id: &str, sock: &str| {
        env.server_with(
            &env.server_yaml(ep, &format!("server_id: {id}\nserver_count: 3"), sock),
            &format!("server{sock}"),
            &["--drain", "60"],
        )
    };
    let mut old: Vec<Option<Started>> = (0..3)
        .map(|i| Some(start(&old_ep[i], &format!("old-{i}"), &format!("-old-{i}"))))
        .collect();
    // The agents' load balancer, with every replica old and new, health
    // checked (a replica that stopped accepting is skipped).
    let lb = env.agent_endpoint(8132);
    let replicas: Vec<String> = old_ep.iter().chain(&new_ep).cloned().collect();
    let _lb = haproxy_lb(Some(&env.seed), env.dir.path(), &lb, &replicas, true);
    let _agent = env.agent(&lb, &[]);
    eventually(
        "a stream to every replica",
        Duration::from_secs(30),
        async || {
            old.iter()
                .flatten()
                .all(|s| env.server_metric(&s.admin(), AGENTS) == 1.0)
        },
    )
    .await;

    // The frontends' endpoints (what kube-proxy would send kube-apiserver's
    // dials to): ready replicas only, updated by the test as a Deployment's
    // readiness and preStop would.
    let sock = |s: &str| env.socket(s).display().to_string();
    let endpoints: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(
        (0..3).map(|i| sock(&format!("-old-{i}"))).collect(),
    ));
    let dials = {
        let endpoints = endpoints.clone();
        Dials::start(move |n| {
            let e = endpoints.lock().unwrap();
            e[n % e.len()].clone()
        })
    };

    for i in 0..3 {
        let old_sock = sock(&format!("-old-{i}"));
        let mut long =
            kas_connect_eventually(&old_sock, "127.0.0.1:7007", Duration::from_secs(10)).await;
        echo_rtt(&mut long, 1000).await;
        // Out of the endpoints first (readiness, preStop), then SIGTERM.
        endpoints.lock().unwrap().retain(|e| *e != old_sock);
        let mut leaving = old[i].take().unwrap();
        signal(leaving.pid(), "-TERM");
        // The second replacement keeps its predecessor's server ID (a
        // StatefulSet pod's name): it is a replacement, not a duplicate.
        let id = if i == 1 {
            format!("old-{i}")
        } else {
            format!("new-{i}")
        };
        let replacement = start(&new_ep[i], &id, &format!("-new-{i}"));
        eventually(
            "the agent joins the replacement",
            Duration::from_secs(20),
            async || env.server_metric(&replacement.admin(), AGENTS) == 1.0,
        )
        .await;
        assert!(
            leaving.proc.0.try_wait().unwrap().is_none(),
            "the agent joined while the old replica still drains"
        );
        endpoints.lock().unwrap().push(sock(&format!("-new-{i}")));
        // The old replica's tunnel still carries its stream, byte-exact.
        echo_exact(&mut long).await;
        drop(long);
        let what = "the old replica, after its last tunnel,";
        assert_eq!(exit_code(&mut leaving.proc, what).await, Some(0));
        old.push(Some(replacement));
    }
    // A few more dials through the new replicas only.
    dials.more(30, "dials through the new replicas").await;
    let (ok, failed) = dials.stop().await;
    eprintln!("rolling restart of 3 replicas: {ok} dials served, {failed} failed");
    assert_eq!(
        failed, 0,
        "no dial fails during the rolling restart ({ok} served)"
    );
}

/// A binary upgrade of the tunnel-server (issue 26, item 4): two upgrades
/// in a row by socket hand-over under a steady loop of dials through the
/// Unix frontend. The agent moves to each new process first (DRAIN), then
/// the new process takes the frontends; a tunnel opened before stays
/// byte-exact through the old process while it drains, and the old process
/// exits 0 once its last tunnel ended. No dial fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_server_binary_upgrade_fails_no_dial_and_keeps_open_tunnels() {
    let env = TunnelEnv::new(57);
    let ep = env.agent_endpoint(8151);
    let upgrade = env.dir.path().join("upgrade.sock").display().to_string();
    // The same server ID in every process (a pod's name).
    let yaml = env.server_yaml(&ep, "server_id: tunnel-0", "");
    let mut current = env.server_with(
        &yaml,
        "server",
        &["--drain", "60", "--upgrade-socket", &upgrade],
    );
    let agent = env.agent(&ep, &[]);
    eventually("the agent connects", Duration::from_secs(30), async || {
        env.server_metric(&current.admin(), AGENTS) == 1.0
    })
    .await;

    let dials = {
        let uds = env.uds.clone();
        Dials::start(move |_| uds.clone())
    };

    for round in 0..2 {
        let mut long =
            kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(10)).await;
        echo_rtt(&mut long, 1000).await;
        dials.more(10, "dials before the upgrade").await;
        // The new process says ready once the agent moved and it took the
        // frontends.
        let next = env.server_with(
            &yaml,
            &format!("server-next-{round}"),
            &[
                "--drain",
                "60",
                "--upgrade-socket",
                &upgrade,
                "--take-over",
                "--take-over-wait",
                "10",
            ],
        );
        assert_eq!(next.ready["agents"], current.ready["agents"]);
        let mut old = std::mem::replace(&mut current, next);
        eventually(
            "the agent holds the new process",
            Duration::from_secs(20),
            async || env.server_metric(&current.admin(), AGENTS) == 1.0,
        )
        .await;
        assert!(
            old.proc.0.try_wait().unwrap().is_none(),
            "the old process drains while its tunnel is open"
        );
        // The old process's tunnel still carries its stream, byte-exact.
        echo_exact(&mut long).await;
        drop(long);
        let what = "the old process, after its last tunnel,";
        assert_eq!(exit_code(&mut old.proc, what).await, Some(0));
    }
    dials.more(30, "dials through the last process").await;
    let (ok, failed) = dials.stop().await;
    drop(agent);
    eprintln!("two tunnel-server binary upgrades: {ok} dials served, {failed} failed");
    assert_eq!(failed, 0, "no dial fails across the upgrades ({ok} served)");
}

/// A new tunnel-server process that dies after the old one moved its
/// agents out (phase `agents`) leaves the old one serving: it accepts
/// agents again, and the agent, told to move, comes back to it (ready
/// again) instead of waiting for a process that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_server_upgrade_that_fails_midway_leaves_the_old_one_serving() {
    let env = TunnelEnv::new(61);
    let ep = env.agent_endpoint(8152);
    let upgrade = env.dir.path().join("upgrade.sock").display().to_string();
    let yaml = env.server_yaml(&ep, "server_id: tunnel-0", "");
    let old = env.server_with(
        &yaml,
        "server",
        &["--drain", "60", "--upgrade-socket", &upgrade],
    );
    let agent = env.agent(&ep, &[]);
    let agent_ready = || TunnelEnv::admin_get(&env.shoot, &agent.admin(), "/readyz");
    eventually("the agent is ready", Duration::from_secs(30), async || {
        agent_ready().starts_with("server streams: 1 of 1")
    })
    .await;
    let moving = || {
        let state = TunnelEnv::admin_get(&env.seed, &old.admin(), "/api/state");
        serde_json::from_str::<serde_json::Value>(&state)
            .map(|v| v["process"]["agents_moving"].clone())
            .unwrap_or_default()
    };
    // The agent is frozen, so it cannot move: the new process waits for
    // it, and is killed while it waits.
    signal(agent.pid(), "-STOP");
    let cfg = env.dir.path().join("server-next.yaml");
    std::fs::write(&cfg, &yaml).unwrap();
    let mut next = Proc(
        env.seed
            .cmd(&[seedlink_bin(), "tunnel-server", "--config"])
            .arg(&cfg)
            .args(["--upgrade-socket", &upgrade, "--take-over"])
            .args(["--take-over-wait", "90"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Only the old process can say so (the admin socket is shared).
    eventually(
        "the old process moves its agents",
        Duration::from_secs(20),
        async || moving() == true,
    )
    .await;
    signal(next.0.id(), "-KILL");
    let _ = next.0.wait();
    eventually(
        "the old process takes agents again",
        Duration::from_secs(20),
        async || moving() == false,
    )
    .await;
    signal(agent.pid(), "-CONT");
    eventually(
        "the agent is back and ready",
        Duration::from_secs(30),
        async || agent_ready().starts_with("server streams: 1 of 1"),
    )
    .await;
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(10)).await;
    assert!(fetch_hello(s).await.contains("hello"));
}
