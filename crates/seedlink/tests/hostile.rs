//! The hostile-tenant suite: tenants that do not trust each other share one
//! gateway and one tunnel server, and an outsider reaches the public
//! listeners. Each test is one attack; each asserts that nothing crossed
//! and that the victim kept working. docs/SECURITY.md names the boundary
//! each test holds.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::time::Duration;

use common::tunnel_env::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const DEST_A: &str = "outbound|443||echo.shoot--a.svc.cluster.local";
const DEST_B: &str = "outbound|443||echo.shoot--b.svc.cluster.local";

async fn h2_client(addr: std::net::SocketAddr) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

/// An HTTP/2 CONNECT stream naming `dest` in the destination header; its
/// status, and the stream to keep open when it is 200.
async fn h2_connect(
    client: &h2::client::SendRequest<bytes::Bytes>,
    dest: &str,
) -> (u16, Option<(h2::RecvStream, h2::SendStream<bytes::Bytes>)>) {
    let mut c = client.clone().ready().await.unwrap();
    let req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri("ignored.example:443")
        .header("x-gardener-destination", dest)
        .body(())
        .unwrap();
    let (resp, send) = c.send_request(req, false).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("no answer within 10 s");
    match resp {
        Ok(r) if r.status() == 200 => (200, Some((r.into_body(), send))),
        Ok(r) => (r.status().as_u16(), None),
        // A stream the gateway reset: no status.
        Err(_) => (0, None),
    }
}

/// An HTTP/1 CONNECT on `addr` naming `dest`; the status line.
async fn h1_connect(addr: std::net::SocketAddr, target: &str, dest: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nX-Gardener-Destination: {dest}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 256];
    // A connection refused at the cap is closed (or reset) unanswered.
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

fn gateway_yaml(echo_a: std::net::SocketAddr, echo_b: std::net::SocketAddr, acl_a: &str) -> String {
    format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - name: t
    address: '127.0.0.1:0'
    protocol: http-connect
    on_invalid_request: status
    destination_regex: 'outbound\\|443\\|\\|echo\\.shoot--a\\.svc\\.cluster\\.local'
limits: {{max_connections: 4, max_connections_per_control_plane: 4}}
control_planes:
  - {{name: a, endpoints: ['{echo_a}'], destinations: [{{name: '{DEST_A}'}}], acl: {{allow: [{acl_a}]}}}}
  - {{name: b, endpoints: ['{echo_b}'], destinations: [{{name: '{DEST_B}'}}]}}
"
    )
}

/// HTTP/2 CONNECT gets every guard HTTP/1 CONNECT has, per stream: the
/// listener's destination guard, the ACL of the configuration current when
/// the stream opens (not when the connection did), and the connection
/// budget (each stream with an upstream socket takes a slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_connect_streams_get_every_guard_http1_gets() {
    let stop = CancellationToken::new();
    let echo_a = echo_backend(&stop).await;
    let echo_b = echo_backend(&stop).await;
    let gw = Gw::start(&gateway_yaml(echo_a, echo_b, "127.0.0.0/8"));
    let addr = gw.listener("t");

    // The guard refuses B's destination on this listener: HTTP/1 and
    // HTTP/2 alike.
    assert!(h1_connect(addr, "x:443", DEST_B).await.contains(" 400 "));
    let client = h2_client(addr).await;
    let (status, _) = h2_connect(&client, DEST_B).await;
    assert_eq!(status, 400, "HTTP/2 CONNECT skipped destination_regex");

    // A's tunnel works.
    let (status, open) = h2_connect(&client, DEST_A).await;
    assert_eq!(status, 200);
    let (mut body, mut send) = open.unwrap();
    send.send_data(bytes::Bytes::from_static(b"ping"), false)
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), body.data())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], b"ping");

    // The connection budget: the connection holds one slot, A's open
    // stream a second; with max_connections 4, two more streams fit and the
    // next is refused.
    let (s1, k1) = h2_connect(&client, DEST_A).await;
    let (s2, k2) = h2_connect(&client, DEST_A).await;
    assert_eq!((s1, s2), (200, 200));
    let (s3, _) = h2_connect(&client, DEST_A).await;
    assert_eq!(s3, 503, "a stream past max_connections was dialled");
    drop((k1, k2, body, send));

    // A's ACL changes to refuse this client: a new stream on the same,
    // older connection is decided on the new configuration, as is a new
    // HTTP/1 connection (retried while the closed streams give their
    // slots back).
    gw.write_config(&gateway_yaml(echo_a, echo_b, "10.0.0.0/8"));
    gw.wait_metric("seedlink_gateway_config_generation", 2.0)
        .await;
    eventually(
        "the ACL change to refuse",
        Duration::from_secs(10),
        async || {
            let (status, _) = h2_connect(&client, DEST_A).await;
            let h1 = h1_connect(addr, "x:443", DEST_A).await;
            // Refused with the answer of an unknown destination (503); the
            // ACL refusal shows in the metrics.
            let denied = gw
                .metric("seedlink_gateway_acl_denied_total{control_plane=\"a\"}")
                .await;
            ok_if(
                status == 503 && h1.contains(" 503 ") && denied >= 2.0,
                || format!("HTTP/2 {status}, HTTP/1 {h1:?}, denied {denied}"),
            )
        },
    )
    .await;
    stop.cancel();
}

/// Header lists are capped (60 KiB, as Envoy's): a 100 KiB header never
/// reaches routing, and the connection's other streams keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_header_lists_are_capped() {
    let stop = CancellationToken::new();
    let echo_a = echo_backend(&stop).await;
    let echo_b = echo_backend(&stop).await;
    let gw = Gw::start(&gateway_yaml(echo_a, echo_b, "127.0.0.0/8"));
    let addr = gw.listener("t");
    // Raw frames, so the client library's own checks do not stop it first.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let big = "a".repeat(100 * 1024);
    let mut enc = Vec::new();
    // HPACK: literal without indexing, new name (RFC 7541 §6.2.2), long
    // lengths in 7-bit prefix integers.
    let lit = |out: &mut Vec<u8>, name: &str, value: &str| {
        out.push(0x00);
        hpack_int(out, name.len(), 7, 0x00);
        out.extend_from_slice(name.as_bytes());
        hpack_int(out, value.len(), 7, 0x00);
        out.extend_from_slice(value.as_bytes());
    };
    lit(&mut enc, ":method", "CONNECT");
    lit(
        &mut enc,
        ":authority",
        "echo.shoot--a.svc.cluster.local:443",
    );
    lit(&mut enc, "x-gardener-destination", DEST_A);
    lit(&mut enc, "x-junk", &big);
    let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    wire.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // empty SETTINGS
                                                          // HEADERS (no END_HEADERS) then CONTINUATIONs of 16 KiB.
    let chunks: Vec<&[u8]> = enc.chunks(16 * 1024).collect();
    for (i, c) in chunks.iter().enumerate() {
        let kind = if i == 0 { 1 } else { 9 };
        let flags = if i + 1 == chunks.len() { 4 } else { 0 };
        let len = c.len();
        wire.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        wire.extend_from_slice(&1u32.to_be_bytes());
        wire.extend_from_slice(c);
    }
    let _ = s.write_all(&wire).await;
    // Whatever the gateway answers (a 431, RST_STREAM or GOAWAY), it never
    // dials: nothing is routed.
    let mut buf = vec![0u8; 64 * 1024];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    assert_eq!(
        gw.metric("seedlink_gateway_routed_total{listener=\"t\"")
            .await,
        0.0,
        "{}",
        gw.metrics().await
    );
    // A well-behaved client is served.
    let client = h2_client(addr).await;
    assert_eq!(h2_connect(&client, DEST_A).await.0, 200);
    stop.cancel();
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
fn hpack_int(out: &mut Vec<u8>, mut v: usize, n: u8, first: u8) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128 + 128) as u8);
        v /= 128;
    }
    out.push(v as u8);
}

/// `seedlink seed`: an outsider on the public CONNECT listener cannot reach
/// into a shoot, and on the internal listener the CONNECT's request-line
/// target is never dialled, only the destination's configured target. The
/// shoot's secret (an echo service on the agent's loopback, port 7007)
/// never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connect_target_never_steers_the_tunnel() {
    let env = TunnelEnv::new(100);
    let d = env.dir.path();
    let tunnel_cfg = d.join("tunnel.yaml");
    std::fs::write(&tunnel_cfg, env.server_yaml("127.0.0.1:0", "", "")).unwrap();
    let gw_cfg = d.join("gateway.yaml");
    std::fs::write(
        &gw_cfg,
        "admin: {listen: '127.0.0.1:0'}
listeners:
  - {name: tls, address: '0.0.0.0:8443', protocol: tls}
  - {name: public, address: '127.0.0.1:8131', protocol: http-connect}
  - {name: internal, address: '127.0.0.1:8132', protocol: http-connect, tunnel_frontend: true}
control_planes:
  - {name: tunnel, hostnames: [tunnel.seedlink.test], endpoints: ['local:tunnel-server']}
  - name: shoot--dev--a
    destinations:
      - {name: 'outbound|8000||web.shoot--dev--a.svc.cluster.local', tunnel_target: '127.0.0.1:8000'}
      - {name: 'outbound|7007||echo.shoot--dev--a.svc.cluster.local'}
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
    let _agent = env.agent(&env.agent_endpoint(8443), &[]);
    kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    // A raw CONNECT from inside the seed namespace; the answer's first line
    // and whatever followed within a moment.
    let connect = |port: u16, target: &str, dest: &str| {
        let script = format!(
            "import socket,sys\n\
             s=socket.create_connection(('127.0.0.1',{port}),timeout=10)\n\
             s.sendall(b'CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\nX-Gardener-Destination: {dest}\\r\\n\\r\\n')\n\
             head=b''\n\
             while b'\\r\\n\\r\\n' not in head:\n\
             \x20   c=s.recv(1)\n\
             \x20   if not c: break\n\
             \x20   head+=c\n\
             line=head.split(b'\\r\\n')[0].decode()\n\
             body=b''\n\
             if ' 200 ' in line:\n\
             \x20   s.sendall(b'GET /hello.txt HTTP/1.0\\r\\n\\r\\nSECRET-PROBE\\n')\n\
             \x20   s.settimeout(3)\n\
             \x20   try:\n\
             \x20       while True:\n\
             \x20           c=s.recv(65536)\n\
             \x20           if not c: break\n\
             \x20           body+=c\n\
             \x20   except Exception: pass\n\
             print(line)\n\
             print(body.decode(errors='replace'))\n"
        );
        let out = env.seed.cmd(&["python3", "-c", &script]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let web = "outbound|8000||web.shoot--dev--a.svc.cluster.local";
    // The public listener is no way into the shoot.
    let got = connect(8131, "127.0.0.1:8000", web);
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    // On the internal listener the request line points at the secret; the
    // configured target (the web server) answers.
    let got = connect(8132, "127.0.0.1:7007", web);
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("hello from the shoot"), "{got}");
    assert!(
        !got.contains("SECRET-PROBE"),
        "the echo service answered: {got}"
    );
    // A destination without a tunnel_target is answered like an unknown one.
    let got = connect(
        8132,
        "127.0.0.1:7007",
        "outbound|7007||echo.shoot--dev--a.svc.cluster.local",
    );
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(!got.contains("SECRET-PROBE"), "{got}");
}

/// The agent's default policy refuses its own host: loopback in every
/// spelling (v4, v4-mapped v6, `0.0.0.0`, `::1`, a name resolving to it).
/// Refused by policy, not by a failed connect: the service listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_its_own_loopback_by_default() {
    let env = TunnelEnv::new(101);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    // The agent's default deny list: no --deny-cidr.
    let _agent = env.agent_default_policy(&env.agent_endpoint(8132));
    let admin = server.admin();
    eventually("the agent connected", Duration::from_secs(20), async || {
        env.server_metric(
            &admin,
            "seedlink_tunnel_server_agents{cluster=\"shoot--dev--a\"}",
        ) >= 1.0
    })
    .await;
    // The probe answers without a token and names no tenant.
    let ready = TunnelEnv::admin_get(&env.seed, &admin, "/readyz");
    assert!(ready.contains("clusters=1 agents=1"), "{ready}");
    assert!(!ready.contains("shoot--dev--a"), "{ready}");
    for target in [
        "127.0.0.1:8000",
        "127.1.2.3:8000",
        "0.0.0.0:8000",
        "[::ffff:127.0.0.1]:8000",
        "[::1]:8000",
        "[::]:8000",
        "localhost:8000",
    ] {
        let e = kas_connect(&env.uds, target)
            .await
            .err()
            .unwrap_or_else(|| panic!("{target} was dialled"));
        assert!(
            e.contains("not allowed by the agent's policy"),
            "{target}: {e}"
        );
    }
}

/// An agent that sends DATA for connections that do not exist while it
/// reads nothing makes the server queue an answer for each: the queue is
/// bounded and that agent alone is cut off; the cluster's other agent, and
/// the server, keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_reads_nothing_cannot_grow_the_server() {
    let env = TunnelEnv::new(102);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let admin = server.admin();
    let _good = env.agent(&env.agent_endpoint(8132), &["--agent-id", "good"]);
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut echo, 64).await;
    let fake = FakeAgent {
        netns: env.seed.0.clone(),
        ca: env.files.seed_ca.clone(),
        cert: env.files.agent_crt.clone(),
        key: env.files.agent_key.clone(),
        endpoint: "127.0.0.1:8132".into(),
        agent_id: "flood".into(),
    };
    let sent = fake.flood_unknown_ids(200_000);
    assert!(sent > 0);
    // Cut off either for the answers it does not read (the control
    // queue's bound) or for the packets for nothing it has (the idle
    // budget, flood.rs), whichever comes first.
    let cut = |r: &str| {
        env.server_metric(
            &admin,
            &format!("seedlink_tunnel_server_agent_streams_total{{cluster=\"shoot--dev--a\",reason=\"{r}\"}}"),
        )
    };
    eventually(
        "the flooding agent was cut off",
        Duration::from_secs(30),
        async || cut("control_overflow") + cut("control_flood") >= 1.0,
    )
    .await;
    echo_rtt(&mut echo, 4096).await;
    let fresh = kas_connect(&env.uds, "127.0.0.1:8000").await.unwrap();
    assert!(fetch_hello(fresh).await.contains("hello from the shoot"));
}

/// A tenant's cluster that trusts another tenant's agent CA (a copy of the
/// file) would be handed that tenant's agents: `check-config` refuses the
/// file, naming both clusters, and a tunnel-server does not start on it.
#[test]
fn two_clusters_never_trust_the_same_agents() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let victim = seedlink::demo::Pki::generate(&[]).unwrap();
    let seed = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let (crt, key) = (
        w("tun.pem", &seed.servers[0].1.cert_pem),
        w("tun-key.pem", &seed.servers[0].1.key_pem),
    );
    let victim_ca = w("victim-ca.pem", &victim.ca_pem);
    let stolen = w("attacker-ca.pem", &victim.ca_pem);
    let cfg = d.join("tunnel.yaml");
    std::fs::write(
        &cfg,
        format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'}}
clusters:
  - {{name: victim, agent_ca: '{victim_ca}'}}
  - {{name: attacker, agent_ca: '{stolen}'}}
"
        ),
    )
    .unwrap();
    let out = check_config(&cfg);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("attacker") && said.contains("cluster \"victim\" trusts already"),
        "{said}"
    );
    let out = std::process::Command::new(seedlink_bin())
        .args(["tunnel-server", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success(), "the tunnel-server started");
}

/// One client that opens more admin connections than the endpoint has
/// slots (and sends nothing on them) cannot fail the kubelet's probes: an
/// address holds at most 16; a probe from another address is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_take_the_probes_slots() {
    let stop = CancellationToken::new();
    let echo_a = echo_backend(&stop).await;
    let echo_b = echo_backend(&stop).await;
    let gw = Gw::start(&gateway_yaml(echo_a, echo_b, "127.0.0.0/8"));
    let mut held = Vec::new();
    for _ in 0..80 {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        held.push(s.connect(gw.admin).await.unwrap());
    }
    // Queued behind all 80: the probe from the kubelet's address.
    let (code, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!((code, body.trim()), (200, "ready"));
    drop(held);
    stop.cancel();
}

/// The agent port faces every shoot and the internet: one source address
/// holds at most `agents.max_per_source` connections (the rest are closed
/// at accept and counted), and a connection that never speaks is closed at
/// the handshake deadline; the cluster's agent connects meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_port_caps_each_source_and_closes_the_silent() {
    let env = TunnelEnv::new(103);
    let server = env.server(
        &env.server_yaml("0.0.0.0:8132", "", "").replace(
            "keepalive_timeout: 1s}",
            "keepalive_timeout: 1s, max_per_source: 4}",
        ),
        "server",
    );
    let admin = server.admin();
    // Six silent connections from the seed side: four are held, two
    // closed at once.
    let script = "import socket,time\n\
        s=[socket.create_connection(('127.0.0.1',8132)) for _ in range(6)]\n\
        print('up',flush=True)\n\
        time.sleep(40)\n";
    let holder = spawn_until_up(env.seed.cmd(&["python3", "-c", script]));
    eventually(
        "two refused at the cap",
        Duration::from_secs(20),
        async || {
            env.server_metric(
            &admin,
            "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"connection_limit\"}",
        ) >= 2.0
        },
    )
    .await;
    // Another source (the shoot) is not affected.
    let _agent = env.agent(&env.agent_endpoint(8132), &[]);
    let c = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(c).await.contains("hello from the shoot"));
    // A client that completes TLS (with the cluster's certificate, even)
    // and opens no stream.
    let tls = format!(
        "import socket,ssl,time\n\
         c=ssl.create_default_context(cafile='{}')\n\
         c.load_cert_chain('{}','{}')\n\
         c.set_alpn_protocols(['h2'])\n\
         s=c.wrap_socket(socket.create_connection(('198.18.{}.1',8132)),server_hostname='tunnel.seedlink.test')\n\
         print('up',flush=True)\n\
         time.sleep(40)\n",
        env.files.seed_ca, env.files.agent_crt, env.files.agent_key, env.net
    );
    let quiet = spawn_until_up(env.shoot.cmd(&["python3", "-c", &tls]));
    // The silent four are closed at the handshake deadline (10 s), the
    // stream-less one at the same deadline after its handshake.
    let m = |r: &str| {
        env.server_metric(
            &admin,
            &format!("seedlink_tunnel_server_agent_streams_total{{cluster=\"\",reason=\"{r}\"}}"),
        )
    };
    eventually(
        "the silent agents to be closed",
        Duration::from_secs(40),
        async || {
            ok_if(m("tls_timeout") >= 4.0 && m("no_stream") >= 1.0, || {
                TunnelEnv::admin_get(&env.seed, &admin, "/metrics")
                    .lines()
                    .filter(|l| l.contains("agent_streams_total"))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
        },
    )
    .await;
    drop((holder, quiet));
}

/// A source that connects in a loop, far past its handshake rate, is shut
/// out at the agent port itself: its SYNs go unanswered (the kernel drops
/// them, so the host does no TCP handshake for it) until the hold ends,
/// while an agent from another source connects and carries traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_connecting_in_a_loop_is_shut_out_at_the_port() {
    let env = TunnelEnv::new(108);
    let server = env.server(
        &env.server_yaml("0.0.0.0:8132", "", "").replace(
            "keepalive_timeout: 1s}",
            "keepalive_timeout: 1s, handshakes_per_source: 5}",
        ),
        "server",
    );
    let admin = server.admin();
    // Bounded: at most 2,000 connections. Each one the server accepts and
    // closes; once shut out, a connect gets no answer (the SYN and its
    // retries at 1 s and 3 s are dropped; the 10 s hold outlasts them).
    let script = "import socket\n\
        def attempt(t):\n\
        \x20 s=socket.socket(); s.settimeout(t)\n\
        \x20 try:\n\
        \x20   s.connect(('127.0.0.1',8132)); return True\n\
        \x20 except socket.timeout: return False\n\
        \x20 finally: s.close()\n\
        n=next((i for i in range(2000) if not attempt(5)), None)\n\
        print('shut out after', n, flush=True)\n\
        back=any(attempt(5) for _ in range(30))\n\
        print('back' if back else 'never back', flush=True)\n";
    let seed = env.seed.cmd(&["python3", "-c", script]);
    let looping = tokio::task::spawn_blocking(move || {
        let mut seed = seed;
        seed.output()
    });
    // Meanwhile an agent from another source (the shoot) connects and
    // carries traffic.
    let _agent = env.agent(&env.agent_endpoint(8132), &[]);
    let c = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(60)).await;
    assert!(fetch_hello(c).await.contains("hello from the shoot"));
    let out = match looping.await {
        Ok(Ok(o)) => String::from_utf8_lossy(&o.stdout).into_owned(),
        other => panic!("the connecting loop: {other:?}"),
    };
    assert!(
        out.contains("shut out after") && !out.contains("after None"),
        "never shut out: {out}"
    );
    assert!(
        out.contains("\nback"),
        "the source must connect again after the hold: {out}"
    );
    let refused = env.server_metric(
        &admin,
        "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"handshake_rate\"}",
    );
    assert!(refused >= 5.0, "{refused}");
}

/// One tenant's clients cannot take the gateway's connections from the
/// others: past `max_connections_per_control_plane` its new connections
/// get 503 and are counted, while another tenant's still get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_control_plane_cannot_take_every_connection() {
    let stop = CancellationToken::new();
    let echo_a = echo_backend(&stop).await;
    let echo_b = echo_backend(&stop).await;
    let yaml = gateway_yaml(echo_a, echo_b, "127.0.0.0/8")
        .replace(
            "limits: {max_connections: 4, max_connections_per_control_plane: 4}",
            "limits: {max_connections: 10, max_connections_per_control_plane: 2}",
        )
        .replace("    destination_regex: 'outbound\\|443\\|\\|echo\\.shoot--a\\.svc\\.cluster\\.local'\n", "");
    let gw = Gw::start(&yaml);
    let addr = gw.listener("t");
    let open = |dest: &'static str| async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("CONNECT x:443 HTTP/1.1\r\nHost: x\r\nX-Gardener-Destination: {dest}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = vec![0u8; 128];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        (String::from_utf8_lossy(&buf[..n]).into_owned(), s)
    };
    let (a1, _k1) = open(DEST_A).await;
    let (a2, _k2) = open(DEST_A).await;
    assert!(a1.contains(" 200 ") && a2.contains(" 200 "), "{a1}{a2}");
    let (a3, _) = open(DEST_A).await;
    assert!(a3.starts_with("HTTP/1.1 503"), "{a3}");
    let (b1, mut kb) = open(DEST_B).await;
    assert!(b1.contains(" 200 "), "{b1}");
    echo_roundtrip(&mut kb, b"tenant b still served")
        .await
        .unwrap();
    gw.wait_metric(
        "seedlink_gateway_connections_total{listener=\"t\",control_plane=\"a\",outcome=\"control_plane_limit\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

/// With `max_routed_per_source`, one source (an IPv4 address, an IPv6
/// /64) holds at most that many routed connections: past it, 503 and
/// counted; another source is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_cannot_take_a_control_planes_connections() {
    let stop = CancellationToken::new();
    let echo_a = echo_backend(&stop).await;
    let echo_b = echo_backend(&stop).await;
    let yaml = gateway_yaml(echo_a, echo_b, "127.0.0.0/8")
        .replace(
            "limits: {max_connections: 4, max_connections_per_control_plane: 4}",
            "limits: {max_connections: 10, max_routed_per_source: 2}",
        )
        .replace("    destination_regex: 'outbound\\|443\\|\\|echo\\.shoot--a\\.svc\\.cluster\\.local'\n", "");
    assert!(yaml.contains("max_routed_per_source: 2"), "{yaml}");
    let gw = Gw::start(&yaml);
    let addr = gw.listener("t");
    let open = |from: &'static str| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        let mut s = sock.connect(addr).await.unwrap();
        s.write_all(
            format!(
                "CONNECT x:443 HTTP/1.1\r\nHost: x\r\nX-Gardener-Destination: {DEST_A}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = vec![0u8; 128];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        (String::from_utf8_lossy(&buf[..n]).into_owned(), s)
    };
    let (a1, _k1) = open("127.0.0.1").await;
    let (a2, _k2) = open("127.0.0.1").await;
    assert!(a1.contains(" 200 ") && a2.contains(" 200 "), "{a1}{a2}");
    let (a3, _) = open("127.0.0.1").await;
    assert!(a3.starts_with("HTTP/1.1 503"), "{a3}");
    let (other, mut k) = open("127.0.0.2").await;
    assert!(other.contains(" 200 "), "{other}");
    echo_roundtrip(&mut k, b"another source still served")
        .await
        .unwrap();
    gw.wait_metric(
        "seedlink_gateway_connections_total{listener=\"t\",control_plane=\"a\",outcome=\"source_limit\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

/// Input trickled a byte at a time is cut at the detection deadline, which
/// counts from the connection's start, whatever the pace: a PROXY header
/// from a trusted load balancer and a CONNECT head alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_are_cut_at_the_deadline() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
trusted_load_balancers: [127.0.0.1/32]
timeouts: {{client_hello: 2s}}
limits: {{proxy_header_max_bytes: 4096}}
listeners:
  - {{name: lb, address: '127.0.0.1:0', protocol: http-connect, proxy_protocol: required}}
  - {{name: direct, address: '127.0.0.1:0', protocol: http-connect}}
control_planes:
  - {{name: a, endpoints: ['{echo}'], destinations: [{{name: '{DEST_A}'}}]}}
"
    ));
    // A 4,000-byte PROXY v2 header (one big TLV) and a CONNECT head, each
    // sent a byte every 20 ms: 80 s and more to send whole.
    let mut proxy = b"\r\n\r\n\0\r\nQUIT\n\x21\x11".to_vec();
    let body_len: u16 = 12 + 3 + 3985;
    proxy.extend_from_slice(&body_len.to_be_bytes());
    proxy.extend_from_slice(&[127, 0, 0, 9, 127, 0, 0, 1, 0x30, 0x39, 0x01, 0xbb]);
    proxy.extend_from_slice(&[0xe0, 0x0f, 0x91]);
    proxy.extend(std::iter::repeat_n(b'x', 3985));
    let head = format!(
        "CONNECT x:443 HTTP/1.1\r\nHost: x\r\nX-Gardener-Destination: {DEST_A}\r\n{}\r\n",
        "X-Pad: y\r\n".repeat(300)
    );
    for (listener, bytes) in [("lb", proxy), ("direct", head.into_bytes())] {
        let mut s = TcpStream::connect(gw.listener(listener)).await.unwrap();
        let trickle = async {
            for b in &bytes {
                if s.write_all(&[*b]).await.is_err() {
                    return "cut";
                }
                let mut one = [0u8; 1];
                match tokio::time::timeout(Duration::from_millis(20), s.read(&mut one)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return "cut",
                    _ => {}
                }
            }
            "sent whole"
        };
        // Generous: the deadline is 2 s.
        let r = tokio::time::timeout(Duration::from_secs(30), trickle).await;
        assert_eq!(r, Ok("cut"), "{listener}: not cut within 30 s");
    }
    gw.wait_metric(
        "seedlink_gateway_detect_failures_total{listener=\"lb\",reason=\"timeout\"}",
        1.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_detect_failures_total{listener=\"direct\",reason=\"timeout\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

/// An agent ID is what a tenant's agent says it is: one that long only
/// inflates what the server keeps, reports and names in a binary upgrade's
/// answer. 256 bytes are accepted, 257 refused (`InvalidArgument`, counted
/// `bad_agent_id`), and the refusal touches nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_id_is_bounded() {
    let env = TunnelEnv::new(88);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let fake = |id: String| FakeAgent {
        netns: env.seed.0.clone(),
        ca: env.files.seed_ca.clone(),
        cert: env.files.agent_crt.clone(),
        key: env.files.agent_key.clone(),
        endpoint: "127.0.0.1:8132".into(),
        agent_id: id,
    };
    assert_eq!(fake("a".repeat(256)).refusal(), None);
    assert_eq!(
        fake("a".repeat(257)).refusal(),
        Some("InvalidArgument".to_string())
    );
    let refused = env.server_metric(
        &server.admin(),
        "seedlink_tunnel_server_agent_streams_total{cluster=\"shoot--dev--a\",reason=\"bad_agent_id\"}",
    );
    assert_eq!(refused, 1.0);
}

/// OpenSSL's client, a TLS stack nobody here wrote, asks the agent port
/// for a key update (`K` in `s_client`) and then talks under the new keys:
/// the record layer after rustls's handshake (usertls.rs) must follow it,
/// send its own update back, and go on (here: refuse an OPEN without flow
/// control, under the new keys both ways).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_port_follows_a_key_update_from_openssl() {
    let env = TunnelEnv::new(105);
    let _server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let _agent = env.agent(&env.agent_endpoint(8132), &[]);
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut echo, 64).await;
    let script = format!(
        "import subprocess,struct,sys\n\
         p=subprocess.Popen(['openssl','s_client','-brief','-tls1_3','-connect','198.18.{net}.1:8132',\n\
         \x20   '-servername','tunnel.seedlink.test','-CAfile','{ca}','-cert','{crt}','-key','{key}',\n\
         \x20   '-alpn','seedlink-tunnel/1'],stdin=subprocess.PIPE,stdout=subprocess.PIPE,stderr=subprocess.PIPE)\n\
         def wait_for(word):\n\
         \x20   seen=b''\n\
         \x20   while word not in seen:\n\
         \x20       line=p.stderr.readline()\n\
         \x20       if not line: sys.exit('s_client ended before '+word.decode()+': '+seen.decode(errors='replace'))\n\
         \x20       seen+=line\n\
         wait_for(b'CONNECTION ESTABLISHED')\n\
         p.stdin.write(b'K\\n'); p.stdin.flush()\n\
         wait_for(b'KEYUPDATE')\n\
         body=b'agentid:x\\n'\n\
         p.stdin.write(bytes([3])+struct.pack('>I',len(body))+body); p.stdin.flush()\n\
         out=p.stdout.read()\n\
         p.kill()\n\
         print(out[0] if out else 'closed', out[5:].decode(errors='replace'), flush=True)\n",
        ca = env.files.seed_ca,
        crt = env.files.agent_crt,
        key = env.files.agent_key,
        net = env.net
    );
    let out = env
        .shoot
        .cmd(&["timeout", "60", "python3", "-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // REFUSED (frame type 5), FAILED_PRECONDITION (9): the OPEN was read
    // under the client's new key, the answer under the server's.
    assert!(text.starts_with("5 9 "), "{text}");
    assert!(text.contains("flow control"), "{text}");
    echo_rtt(&mut echo, 4096).await;
}

/// A client that completes TLS with a cluster's certificate and agrees to
/// the native transport (`seedlink-tunnel/1`, Python's OpenSSL as the peer)
/// but sends no proper OPEN: an OPEN without flow control is refused
/// (FAILED_PRECONDITION), an OPEN naming a 300-byte agent ID is refused as
/// over gRPC (INVALID_ARGUMENT), and a frame announcing 4 GiB or metadata
/// that is not header lines closes the connection at once, nothing
/// allocated; each is counted, and the cluster's agent keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_transport_refuses_what_is_not_an_open() {
    let env = TunnelEnv::new(104);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let admin = server.admin();
    let _agent = env.agent(&env.agent_endpoint(8132), &[]);
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut echo, 64).await;
    let script = format!(
        "import socket,ssl,struct\n\
         c=ssl.create_default_context(cafile='{ca}')\n\
         c.load_cert_chain('{crt}','{key}')\n\
         c.set_alpn_protocols(['seedlink-tunnel/1'])\n\
         def conn():\n\
         \x20   s=c.wrap_socket(socket.create_connection(('198.18.{net}.1',8132)),server_hostname='tunnel.seedlink.test')\n\
         \x20   assert s.selected_alpn_protocol()=='seedlink-tunnel/1'\n\
         \x20   s.settimeout(20)\n\
         \x20   return s\n\
         def answer(s):\n\
         \x20   b=b''\n\
         \x20   while True:\n\
         \x20       x=s.recv(65536)\n\
         \x20       if not x: break\n\
         \x20       b+=x\n\
         \x20   return b[0] if b else 'closed', b[5:].decode(errors='replace')\n\
         def frame(t,body): return bytes([t])+struct.pack('>I',len(body))+body\n\
         for name,data in [('noflow',frame(3,b'agentid:x\\n')),\n\
         \x20                ('longid',frame(3,b'agentid:'+b'a'*300+b'\\nseedlink-flow-control:v1\\n')),\n\
         \x20                ('huge',bytes([0,255,255,255,255])),\n\
         \x20                ('bigpacket',bytes([0])+struct.pack('>I',4*1024*1024)),\n\
         \x20                ('nometa',frame(3,b'no header here\\n'))]:\n\
         \x20   s=conn(); s.sendall(data)\n\
         \x20   print(name, *answer(s), flush=True)\n\
         import os\n\
         s=conn()\n\
         raw=socket.socket(fileno=os.dup(s.fileno()))\n\
         raw.sendall(b'\\x17\\x03\\x03\\x00\\x20'+b'\\x00'*32)\n\
         print('badrecord', *answer(s), flush=True)\n",
        ca = env.files.seed_ca,
        crt = env.files.agent_crt,
        key = env.files.agent_key,
        net = env.net
    );
    let out = env.shoot.cmd(&["python3", "-c", &script]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_default()
            .to_string()
    };
    // REFUSED is frame type 5; its text starts with the gRPC code.
    assert!(line("noflow").starts_with("noflow 5 9 "), "{text}");
    assert!(line("noflow").contains("flow control"), "{text}");
    assert!(line("longid").starts_with("longid 5 3 "), "{text}");
    assert_eq!(line("huge"), "huge closed ", "{text}");
    // A PACKET (within its 4 MiB limit) before the OPEN: refused from its
    // head, nothing allocated or awaited (counted bad_open, not no_stream).
    assert_eq!(line("bigpacket"), "bigpacket closed ", "{text}");
    assert_eq!(line("nometa"), "nometa closed ", "{text}");
    let m = |r: &str| {
        env.server_metric(
            &admin,
            &format!("seedlink_tunnel_server_agent_streams_total{{cluster=\"\",reason=\"{r}\"}}"),
        )
    };
    assert!(m("bad_open") >= 4.0, "bad_open {}", m("bad_open"));
    // A forged record before the OPEN: said and counted by its reason.
    assert!(line("badrecord").starts_with("badrecord "), "{text}");
    eventually(
        "a bad record counted",
        Duration::from_secs(20),
        async || m("bad_record") >= 1.0,
    )
    .await;
    echo_rtt(&mut echo, 4096).await;
}

/// An agent with its own cluster's valid certificate floods packets that
/// move nothing, on gRPC (DRAIN, DIAL_CLS for dials it never had) and on
/// the native transport (DRAIN, PING): each stream is cut once past its
/// budget (`control_flood`; flood.rs), that agent only, and the cluster's
/// real agent keeps carrying traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_flooding_idle_packets_is_cut_off() {
    use seedlink_tunnel::proto::Packet;
    let env = TunnelEnv::new(106);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let admin = server.admin();
    let _good = env.agent(&env.agent_endpoint(8132), &["--agent-id", "good"]);
    let mut echo =
        kas_connect_eventually(&env.uds, "127.0.0.1:7007", Duration::from_secs(20)).await;
    echo_rtt(&mut echo, 64).await;
    let fake = |id: &str| FakeAgent {
        netns: env.seed.0.clone(),
        ca: env.files.seed_ca.clone(),
        cert: env.files.agent_crt.clone(),
        key: env.files.agent_key.clone(),
        endpoint: "127.0.0.1:8132".into(),
        agent_id: id.into(),
    };
    // Far more than a budget's burst: a stream never cut sends them all.
    let n = 200_000;
    let drains = fake("drain").flood(Packet::drain(), n);
    assert!(
        drains.is_some(),
        "a DRAIN flood was never cut off: {}",
        TunnelEnv::admin_get(&env.seed, &admin, "/metrics")
            .lines()
            .filter(|l| l.contains("agent_streams_total") || l.contains("agent_packets"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // A cut stream's cluster opens no new stream for a while (flood.rs's
    // cool-down; the agent backs off): the next flood waits it out.
    let cooled = async || fake("probe").refusal().is_none();
    eventually("the cool-down over", Duration::from_secs(60), cooled).await;
    let cls = fake("dialcls").flood(Packet::dial_cls(12345), n);
    assert!(cls.is_some(), "a DIAL_CLS flood was never cut off");
    let script = format!(
        "import socket,ssl,struct,time\n\
         c=ssl.create_default_context(cafile='{ca}')\n\
         c.load_cert_chain('{crt}','{key}')\n\
         c.set_alpn_protocols(['seedlink-tunnel/1'])\n\
         def frame(t,body): return bytes([t])+struct.pack('>I',len(body))+body\n\
         for name,f in [('drain',frame(0,b'\\x08\\x06')),('ping',frame(1,b''))]:\n\
         \x20   for attempt in range(120):\n\
         \x20       s=c.wrap_socket(socket.create_connection(('198.18.{net}.1',8132)),server_hostname='tunnel.seedlink.test')\n\
         \x20       s.settimeout(20)\n\
         \x20       s.sendall(frame(3,b'agentid:native-'+name.encode()+b'\\nseedlink-flow-control:v1\\n'))\n\
         \x20       if s.recv(5)[0]==4: break\n\
         \x20       s.close(); time.sleep(0.5)\n\
         \x20   batch=f*4096\n\
         \x20   sent=0\n\
         \x20   try:\n\
         \x20       while sent<{n}:\n\
         \x20           s.sendall(batch); sent+=4096\n\
         \x20       print(name,'never cut',flush=True)\n\
         \x20   except OSError:\n\
         \x20       print(name,'cut',flush=True)\n",
        ca = env.files.seed_ca,
        crt = env.files.agent_crt,
        key = env.files.agent_key,
        net = env.net,
        n = n * 10,
    );
    let out = env
        .shoot
        .cmd(&["timeout", "120", "python3", "-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("drain cut") && text.contains("ping cut"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = |r: &str| {
        env.server_metric(
            &admin,
            &format!("seedlink_tunnel_server_agent_streams_total{{cluster=\"shoot--dev--a\",reason=\"{r}\"}}"),
        )
    };
    // gRPC's two and the native two, each by its reason.
    assert!(
        m("control_flood") >= 4.0,
        "control_flood {}",
        m("control_flood")
    );
    echo_rtt(&mut echo, 4096).await;
    let fresh = kas_connect(&env.uds, "127.0.0.1:8000").await.unwrap();
    assert!(fetch_hello(fresh).await.contains("hello from the shoot"));
}

/// A client that opens a stream, is refused, and then keeps its
/// connection open without opening another holds an agent-port slot no
/// longer than the handshake deadline: the connection is closed
/// (`no_stream`), whoever the client is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_does_not_keep_its_connection() {
    let env = TunnelEnv::new(107);
    let server = env.server(&env.server_yaml("0.0.0.0:8132", "", ""), "server");
    let fake = FakeAgent {
        netns: env.seed.0.clone(),
        ca: env.files.seed_ca.clone(),
        cert: env.files.agent_crt.clone(),
        key: env.files.agent_key.clone(),
        endpoint: "127.0.0.1:8132".into(),
        // Over the 256-byte limit: refused InvalidArgument.
        agent_id: "x".repeat(300),
    };
    let (closed, code) = fake.refused_then_held(Duration::from_secs(60));
    assert_eq!(code.as_deref(), Some("3"), "refused InvalidArgument");
    assert!(closed, "the refused client's connection was never closed");
    let no_stream = env.server_metric(
        &server.admin(),
        "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"no_stream\"}",
    );
    assert!(no_stream >= 1.0, "no_stream {no_stream}");
}
