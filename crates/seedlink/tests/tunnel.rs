//! `seedlink tunnel-server` in a "seed" network namespace and `seedlink
//! tunnel-agent` in a "shoot" namespace whose services only the agent can
//! reach (see common/tunnel_env.rs). Frontends: HTTP CONNECT over a Unix
//! socket (a client shaped like kube-apiserver's egress dialer), HTTP
//! CONNECT over TCP+mTLS (curl `-p -x` with client certificates) and gRPC
//! over a Unix socket.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::time::{Duration, Instant};

use common::tunnel_env::*;
use common::*;
use futures_util::StreamExt;
use seedlink_tunnel::proto::{Packet, PacketType, Payload};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// curl -p -x over the TCP+mTLS frontend (inside the seed namespace); without
/// a client certificate the frontend refuses.
fn curl_reaches_the_shoot_through_the_mtls_frontend(env: &TunnelEnv) {
    let f = &env.files;
    let proxy = format!("https://frontend.seedlink.test:{}", env.fe_port);
    let resolve = format!("frontend.seedlink.test:{}:127.0.0.1", env.fe_port);
    let out = env
        .seed
        .cmd(&["curl", "-sS", "--max-time", "10", "-p", "-x", &proxy])
        .args([
            "--proxy-cacert",
            &f.seed_ca,
            "--proxy-cert",
            &f.kas_crt,
            "--proxy-key",
            &f.kas_key,
        ])
        .args(["--resolve", &resolve, "http://127.0.0.1:8000/hello.txt"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("hello from the shoot"), "{text}");
    // Without a client certificate the frontend refuses.
    let out = env
        .seed
        .cmd(&["curl", "-sS", "--max-time", "10", "-p", "-x", &proxy])
        .args([
            "--proxy-cacert",
            &f.seed_ca,
            "--resolve",
            &resolve,
            "http://127.0.0.1:8000/hello.txt",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// gRPC ProxyService over the Unix socket: DIAL_REQ, echo, CLOSE.
async fn grpc_proxy_service_dials_echoes_and_closes(env: &TunnelEnv) {
    let mut client = grpc_client(&env.grpc_uds).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Packet>(16);
    let out =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) });
    tx.send(Packet::dial_req("127.0.0.1:7007", 4242))
        .await
        .unwrap();
    let resp = seedlink_tunnel::grpc::open_stream(
        &mut client,
        seedlink_tunnel::proto::PROXY_PATH,
        out,
        &[],
    )
    .await
    .unwrap();
    let mut inbound = resp.into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), inbound.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let Some(Payload::DialResponse(r)) = first.payload else {
        panic!("{first:?}")
    };
    assert_eq!((r.random, r.error.as_str()), (4242, ""), "{r:?}");
    assert!(r.connect_id > 0);
    tx.send(Packet::data(
        r.connect_id,
        bytes::Bytes::from_static(b"ping over grpc"),
    ))
    .await
    .unwrap();
    let mut got = Vec::new();
    while got.len() < 14 {
        let p = tokio::time::timeout(Duration::from_secs(10), inbound.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Some(Payload::Data(dd)) = p.payload {
            assert_eq!(dd.connect_id, r.connect_id);
            got.extend_from_slice(&dd.data);
        }
    }
    assert_eq!(got, b"ping over grpc");
    tx.send(Packet::close_req(r.connect_id)).await.unwrap();
    let last = tokio::time::timeout(Duration::from_secs(10), inbound.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(last.kind(), Some(PacketType::CloseRsp), "{last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frontends_reach_shoot_services_only_through_the_agent() {
    let env = TunnelEnv::new(41);
    let ep = env.agent_endpoint(8132);
    let _server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let mut agent = env.agent(&ep, &["--agent-id", "agent-1", "--allow-port", "8000,7007"]);

    // HTTP CONNECT over the Unix socket, as kube-apiserver dials.
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    let body = fetch_hello(s).await;
    assert!(body.contains("hello from the shoot"), "{body}");

    // The same services are not reachable from the seed itself.
    let direct = env
        .seed
        .cmd(&[
            "curl",
            "-sS",
            "--max-time",
            "3",
            "http://127.0.0.1:8000/hello.txt",
        ])
        .output()
        .unwrap();
    assert!(
        !direct.status.success(),
        "the seed must not reach the shoot directly"
    );

    // TCP echo through the tunnel, several round trips of growing size.
    let mut e = kas_connect(&env.uds, "127.0.0.1:7007").await.unwrap();
    for i in 0..20usize {
        echo_rtt(&mut e, 1000 + i * 3000).await;
    }
    drop(e);

    // Bytes pipelined behind the CONNECT head, before the answer: they
    // reach the destination once the dial is confirmed, and the frontend
    // reads the answer before their echo.
    let mut p = tokio::net::UnixStream::connect(&env.uds).await.unwrap();
    p.write_all(b"CONNECT 127.0.0.1:7007 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\npipelined bytes")
        .await
        .unwrap();
    let want = b"HTTP/1.1 200 Connection Established\r\n\r\npipelined bytes";
    let mut got = Vec::new();
    while got.len() < want.len() {
        let mut b = [0u8; 256];
        match tokio::time::timeout(Duration::from_secs(15), p.read(&mut b)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&b[..n]),
            other => panic!(
                "pipelined CONNECT: {other:?} after {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want));
    drop(p);

    // A destination outside the agent's policy (link-local by default, and
    // a port not in --allow-port), and a port where nothing listens.
    for target in ["169.254.169.254:80", "127.0.0.1:7008"] {
        let denied = kas_connect(&env.uds, target)
            .await
            .err()
            .unwrap_or_default();
        assert!(
            denied.contains("502") && denied.contains("policy"),
            "{target}: {denied}"
        );
    }
    let refused = kas_connect(&env.uds, "127.0.0.1:9")
        .await
        .err()
        .unwrap_or_default();
    assert!(refused.contains("502"), "{refused}");
    // Not CONNECT: 405.
    let mut s = tokio::net::UnixStream::connect(&env.uds).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut s, Duration::from_secs(5)).await;
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 405"),
        "{answer:?}"
    );

    curl_reaches_the_shoot_through_the_mtls_frontend(&env);
    grpc_proxy_service_dials_echoes_and_closes(&env).await;

    // The agent dies mid-connection: the frontend is closed because its
    // stream ended, not by a keepalive (30 s) or idle deadline; the
    // 10 s bound only keeps a broken build from hanging.
    let mut held = kas_connect(&env.uds, "127.0.0.1:7007").await.unwrap();
    held.write_all(b"x").await.unwrap();
    let mut one = [0u8; 1];
    held.read_exact(&mut one).await.unwrap();
    let _ = agent.proc.0.kill();
    let (_, end) = read_until_closed(&mut held, Duration::from_secs(10)).await;
    assert!(
        !matches!(&end, Err(e) if e.kind() == std::io::ErrorKind::TimedOut),
        "the frontend stayed open after its agent died: {end:?}"
    );
    // And with no agent, a dial is answered 500 at once.
    let t0 = Instant::now();
    let none = kas_connect(&env.uds, "127.0.0.1:8000")
        .await
        .err()
        .unwrap_or_default();
    assert!(
        none.contains("500") && none.contains("No agent available"),
        "{none}"
    );
    // At once, not at the 10 s dial timeout.
    assert!(t0.elapsed() < Duration::from_secs(8));
}

/// An agent without a client certificate, authenticated by a projected
/// ServiceAccount token checked against the cluster issuer's public key;
/// a token for another audience is refused and counted; when the issuer's
/// key is rotated on disk, the agent whose token no longer verifies is
/// disconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_authenticated_by_a_serviceaccount_token() {
    let env = TunnelEnv::new(50);
    let ep = env.agent_endpoint(8132);
    let d = env.dir.path();
    let (yaml, issuer_key) = env.token_server_yaml(&ep);
    let keys = d.join("sa.pub");
    let server = env.server(&yaml, "server");
    let sign = |aud: &str| sign_token(&issuer_key, aud);
    let good = d.join("good.token");
    std::fs::write(&good, sign("system:konnectivity-server")).unwrap();
    let bad = d.join("bad.token");
    std::fs::write(&bad, sign("https://kubernetes.default.svc")).unwrap();

    let _agent = env.agent_bare(
        &ep,
        &["--service-account-token-path", good.to_str().unwrap()],
    );
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));

    let _wrong = env.agent_bare(
        &ep,
        &["--service-account-token-path", bad.to_str().unwrap()],
    );
    let admin = server.admin();
    eventually(
        "the bad token to be refused",
        Duration::from_secs(10),
        async || {
            env.server_metric(
                &admin,
                "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"bad_token\"}",
            ) >= 1.0
        },
    )
    .await;
    assert_eq!(
        env.server_metric(&admin, "seedlink_tunnel_server_agents{"),
        1.0
    );
    // Neither a certificate nor a token: refused.
    let _none = env.agent_bare(&ep, &[]);
    eventually( "the credential-less agent to be refused",Duration::from_secs(10), async || {
        env.server_metric(&admin, "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"no_credentials\"}") >= 1.0
    })
    .await;
    // The issuer's key is rotated on disk: the server reloads by itself and
    // disconnects the agent whose token the new key does not verify.
    let rotated = rcgen::KeyPair::generate().unwrap();
    std::fs::write(&keys, rotated.public_key_pem()).unwrap();
    eventually( "the old token's agent to be disconnected",Duration::from_secs(15), async || {
        env.server_metric(
            &admin,
            "seedlink_tunnel_server_agent_streams_total{cluster=\"shoot--dev--a\",reason=\"rekeyed\"}",
        ) >= 1.0
            && env.server_metric(&admin, "seedlink_tunnel_server_agents{") == 0.0
    })
    .await;
}

/// Agent tokens checked by TokenReview at the cluster's API server (a
/// stand-in for kube-apiserver's endpoint in the seed namespace): the right
/// ServiceAccount is let in and its answer cached (a second agent and every
/// re-sync stream cost no review), another ServiceAccount is refused, an
/// API server failure is counted as unavailable and not cached, and a token
/// of a foreign issuer is refused without being shown to the API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_tokens_checked_by_tokenreview() {
    let env = TunnelEnv::new(55);
    let ep = env.agent_endpoint(8132);
    let d = env.dir.path();
    let api = seedlink::demo::Pki::generate(&["127.0.0.1"]).unwrap();
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let api_ca = w("api-ca.pem", &api.ca_pem);
    let api_crt = w("api.pem", &api.servers[0].1.cert_pem);
    let api_key = w("api-key.pem", &api.servers[0].1.key_pem);
    let caller = w("caller.token", "caller-secret\n");
    let log = d.join("reviews.log");
    let signer = rcgen::KeyPair::generate().unwrap();
    let jwt = |iss: &str, sub: &str, n: u32| {
        let claims = serde_json::json!({
            "iss": iss, "aud": ["system:konnectivity-server"], "sub": sub, "jti": n,
            "exp": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 600,
        });
        let k = jsonwebtoken::EncodingKey::from_ec_pem(signer.serialize_pem().as_bytes()).unwrap();
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256),
            &claims,
            &k,
        )
        .unwrap()
    };
    let agent_sa = "system:serviceaccount:kube-system:konnectivity-agent";
    let good = jwt("https://issuer.shoot", agent_sa, 1);
    let other = jwt(
        "https://issuer.shoot",
        "system:serviceaccount:default:default",
        2,
    );
    let broken = jwt("https://issuer.shoot", agent_sa, 3);
    let foreign = jwt("https://issuer.elsewhere", agent_sa, 4);
    // Claims that pass every local check, a token its API server does not
    // know (revoked): the review refuses it.
    let revoked = jwt("https://issuer.shoot", agent_sa, 5);
    let table = serde_json::json!({
        &good: {"username": agent_sa, "audiences": ["system:konnectivity-server"]},
        &other: {"username": "system:serviceaccount:default:default",
                 "audiences": ["system:konnectivity-server"]},
        &broken: "error:500",
    });
    let table = w("table.json", &table.to_string());
    let _apiserver = spawn_until_up(env.seed.cmd(&[
        "python3",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/peers/tokenreview_apiserver.py"
        ),
        "6443",
        &api_crt,
        &api_key,
        "caller-secret",
        &table,
        log.to_str().unwrap(),
    ]));
    let yaml = env.server_yaml(&ep, "", "").replace(
        &format!("agent_ca: '{}'", env.files.agent_ca),
        &format!(
            "agent_token: {{issuer: 'https://issuer.shoot', review: {{url: 'https://127.0.0.1:6443', ca: '{api_ca}', token_file: '{caller}'}}}}"
        ),
    );
    let server = env.server(&yaml, "server");
    let admin = server.admin();
    let reviews_of = |t: &str| {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == t)
            .count()
    };
    let tok = |name: &str, t: &str| w(name, t);

    let good_path = tok("good.token", &good);
    let _a1 = env.agent_bare(&ep, &["--service-account-token-path", &good_path]);
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
    let _a2 = env.agent_bare(&ep, &["--service-account-token-path", &good_path]);
    eventually("the second agent", Duration::from_secs(10), async || {
        env.server_metric(&admin, "seedlink_tunnel_server_agents{") >= 2.0
    })
    .await;
    assert_eq!(reviews_of(&good), 1, "the acceptance is cached");
    assert!(
        env.server_metric(
            &admin,
            "seedlink_tunnel_server_token_reviews_total{cluster=\"shoot--dev--a\",reason=\"cached\"}"
        ) >= 1.0
    );

    let other_path = tok("other.token", &other);
    let _a3 = env.agent_bare(&ep, &["--service-account-token-path", &other_path]);
    let broken_path = tok("broken.token", &broken);
    let _a4 = env.agent_bare(&ep, &["--service-account-token-path", &broken_path]);
    let foreign_path = tok("foreign.token", &foreign);
    let _a5 = env.agent_bare(&ep, &["--service-account-token-path", &foreign_path]);
    let revoked_path = tok("revoked.token", &revoked);
    let _a6 = env.agent_bare(&ep, &["--service-account-token-path", &revoked_path]);
    eventually(
        "refusals to be counted",
        Duration::from_secs(15),
        async || {
            let m = |r: &str| {
                env.server_metric(
                    &admin,
                    &format!(
                        "seedlink_tunnel_server_agent_streams_total{{cluster=\"\",reason=\"{r}\"}}"
                    ),
                )
            };
            // other SA, foreign issuer, revoked; broken: API server failed.
            m("bad_token") >= 3.0 && m("token_review_unavailable") >= 1.0
        },
    )
    .await;
    // Another ServiceAccount's token says so in its claims: refused before
    // a review, so forged tokens cannot spend the cluster's review budget.
    assert_eq!(reviews_of(&other), 0);
    assert!(reviews_of(&revoked) >= 1);
    assert!(reviews_of(&broken) >= 1);
    assert_eq!(
        reviews_of(&foreign),
        0,
        "a foreign token never reaches this API server"
    );
    let r = |x: &str| {
        env.server_metric(
            &admin,
            &format!("seedlink_tunnel_server_token_reviews_total{{cluster=\"shoot--dev--a\",reason=\"{x}\"}}"),
        )
    };
    assert_eq!(r("accepted"), 1.0);
    assert!(r("refused") >= 1.0 && r("unavailable") >= 1.0);
    assert_eq!(
        env.server_metric(&admin, "seedlink_tunnel_server_agents{"),
        2.0
    );
}

/// Wire compatibility with an independent gRPC stack: Google's grpcio with
/// protoc-generated code from our .proto, as a kube-apiserver-like gRPC
/// frontend client (Unix socket) and as a proxy-agent-like agent (TLS with
/// a client certificate) in place of seedlink's own agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_frontend_and_grpcio_agent_interoperate() {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .status()
        .unwrap();
    assert!(
        ok.success(),
        "required test peer grpcio/grpcio-tools is not installed; run scripts/install-peers"
    );
    let env = TunnelEnv::new(53);
    let ep = env.agent_endpoint(8132);
    // Plus a gRPC frontend over TCP with mutual TLS.
    let f = &env.files;
    // The seed namespace is this test's own: a fixed port cannot collide.
    let grpc_port = 8095;
    let yaml = format!(
        "{}      - {{name: grpc-tcp, protocol: grpc, tcp: '127.0.0.1:{grpc_port}', cert: '{}', key: '{}', client_ca: '{}'}}\n",
        env.server_yaml(&ep, "", ""),
        f.fe_crt,
        f.fe_key,
        f.seed_ca
    );
    let server = env.server(&yaml, "server");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/peers/grpcio_konnectivity.py"
    );
    let mut agent = Proc(
        env.shoot
            .cmd(&["python3", script, "agent", &ep, "tunnel.seedlink.test"])
            .args([&f.seed_ca, &f.agent_crt, &f.agent_key])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let out = agent.0.stdout.take().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
    assert!(
        line.starts_with("connected ") && line.trim().ends_with(" 1"),
        "{line:?}"
    );
    assert!(
        line.contains(server.ready["server_id"].as_str().unwrap()),
        "{line}"
    );
    // Our HTTP CONNECT frontend through the grpcio agent.
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
    // The grpcio client through our gRPC frontend and the grpcio agent.
    let out = env
        .seed
        .cmd(&["python3", script, "client", &env.grpc_uds, "127.0.0.1:7007"])
        .output()
        .unwrap();
    assert_peer_ok(&out);
    // The grpcio client over TCP with its client certificate.
    let out = env
        .seed
        .cmd(&[
            "python3",
            script,
            "tls-client",
            &format!("127.0.0.1:{grpc_port}"),
            "frontend.seedlink.test",
        ])
        .args([&f.seed_ca, &f.kas_crt, &f.kas_key, "127.0.0.1:7007"])
        .output()
        .unwrap();
    assert_peer_ok(&out);
}

/// The agent reaches the tunnel-server through seedlink's SNI gateway (no
/// LoadBalancer of its own): the gateway routes the agent's TLS by its SNI
/// without terminating it, so the client certificate still decides the
/// cluster; the agent also offers an extra ALPN protocol. The agent reads
/// its configuration from a file (`--config`), which `check-config`
/// accepts as a tunnel-agent's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_reach_the_tunnel_server_through_the_sni_gateway() {
    let env = TunnelEnv::new(54);
    let ep = env.agent_endpoint(8132);
    let _server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let gw_addr = env.agent_endpoint(8443);
    let _gw = sni_gateway(&env, &gw_addr, &ep);
    let file = env.agent_file(&gw_addr, "alpn_proto: [konnectivity]\n");
    common::assert_valid_config(&file, "tunnel-agent");
    let agent = env.agent_from_file(&file);
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
    assert_eq!(
        env.agent_metric(
            &agent.admin(),
            "seedlink_tunnel_agent_open_server_connections"
        ),
        1.0
    );
}

/// `seedlink gateway` in the seed namespace: a TLS listener on `gw_addr`
/// sending `tunnel.seedlink.test` by SNI to the tunnel-server at `ep`.
fn sni_gateway(env: &TunnelEnv, gw_addr: &str, ep: &str) -> Proc {
    let cfg = env.dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '{gw_addr}', protocol: tls}}]
control_planes:
  - {{name: tunnel, hostnames: [tunnel.seedlink.test], endpoints: ['{ep}']}}
"
        ),
    )
    .unwrap();
    env.gateway(&cfg)
}

/// A grpcio peer run succeeded and said so (`OK …`); else its output.
fn assert_peer_ok(out: &std::process::Output) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && text.starts_with("OK "), "{text}");
}

/// Replica discovery does not look like failure: with `server_count: 2`
/// and one replica, the agent keeps probing (every 0.2 s here); each probe
/// reaches the replica it holds and is closed cleanly on both sides:
/// counted as `duplicate`, never as `stream_error`, and the agent's one
/// real stream is never replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_discovery_probes_close_cleanly_and_are_counted_as_duplicates() {
    let env = TunnelEnv::new(85);
    let ep = env.agent_endpoint(8132);
    let server = env.server(&env.server_yaml(&ep, "server_count: 2", ""), "server");
    let agent = env.agent(&ep, &[]);
    let admin = server.admin();
    let streams = |reason: &str| {
        env.server_metric(
            &admin,
            &format!(
                "seedlink_tunnel_server_agent_streams_total{{cluster=\"shoot--dev--a\",reason=\"{reason}\"}}"
            ),
        )
    };
    eventually(
        "five discovery probes",
        Duration::from_secs(20),
        async || streams("duplicate") >= 5.0,
    )
    .await;
    assert_eq!(streams("stream_error"), 0.0);
    assert_eq!(streams("closed"), 0.0);
    let a = agent.admin();
    assert_eq!(
        env.agent_metric(
            &a,
            "seedlink_tunnel_agent_server_connects_total{outcome=\"ok\"}"
        ),
        1.0
    );
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(10)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
}

/// GEP-11's private network: the shoot's only way out is a corporate HTTP
/// CONNECT proxy (tinyproxy, Basic auth). The agent cannot reach the
/// server directly (an iptables rule in the shoot rejects root's
/// connections to it; tinyproxy runs as nobody), joins through the proxy
/// with credentials from a file, and serves dials; wrong credentials are
/// counted as `egress_proxy_auth_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_leaves_through_a_corporate_egress_proxy() {
    let env = TunnelEnv::new(60);
    let ep = env.agent_endpoint(8132);
    let _server = env.server(&env.server_yaml(&ep, "", ""), "server");
    env.shoot.run(&[
        "iptables",
        "-A",
        "OUTPUT",
        "-p",
        "tcp",
        "-d",
        "198.18.60.1",
        "--dport",
        "8132",
        "-m",
        "owner",
        "--uid-owner",
        "0",
        "-j",
        "REJECT",
        "--reject-with",
        "tcp-reset",
    ]);
    let direct = env
        .shoot
        .cmd(&[
            "curl",
            "-sS",
            "--max-time",
            "3",
            "-k",
            &format!("https://{ep}/"),
        ])
        .output()
        .unwrap();
    // curl exit 7: could not connect (the reset).
    assert_eq!(
        direct.status.code(),
        Some(7),
        "the shoot reaches the server without the proxy: {direct:?}"
    );
    let d = env.dir.path();
    let conf = d.join("tinyproxy.conf");
    // tinyproxy runs as nobody: its log lives where nobody may write.
    let logs = d.join("tinyproxy-logs");
    std::fs::create_dir(&logs).unwrap();
    std::fs::set_permissions(&logs, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let log = logs.join("tinyproxy.log");
    std::fs::write(
        &conf,
        format!(
            "Port 3128\nListen 127.0.0.1\nTimeout 60\nUser nobody\nGroup nogroup\nMaxClients 50\n\
             Allow 127.0.0.1\nBasicAuth user s3cret-pw\nConnectPort 8132\nLogFile \"{}\"\nLogLevel Connect\n",
            log.display()
        ),
    )
    .unwrap();
    let _proxy = Proc(
        env.shoot
            .cmd(&[require("tinyproxy").to_str().unwrap(), "-d", "-c"])
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let good = d.join("proxy-creds");
    std::fs::write(&good, "user:s3cret-pw\n").unwrap();
    let bad = d.join("proxy-creds-bad");
    std::fs::write(&bad, "user:wrong\n").unwrap();

    let agent = env.agent(
        &ep,
        &[
            "--egress-proxy",
            "http://127.0.0.1:3128",
            "--egress-proxy-credentials-file",
            good.to_str().unwrap(),
        ],
    );
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(20)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));
    assert!(
        env.agent_metric(
            &agent.admin(),
            "seedlink_tunnel_agent_open_server_connections"
        ) >= 1.0
    );
    // The agent's stream went through the proxy.
    let seen = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        seen.contains("CONNECT") && seen.contains("198.18.60.1:8132"),
        "{seen}"
    );

    let refused = env.agent(
        &ep,
        &[
            "--egress-proxy",
            "http://127.0.0.1:3128",
            "--egress-proxy-credentials-file",
            bad.to_str().unwrap(),
        ],
    );
    eventually( "the refusal to be counted",Duration::from_secs(20), async || {
        env.agent_metric(
            &refused.admin(),
            "seedlink_tunnel_agent_server_connect_errors_total{outcome=\"egress_proxy_auth_failed\"}",
        ) >= 1.0
    })
    .await;
    assert_eq!(
        env.agent_metric(
            &refused.admin(),
            "seedlink_tunnel_agent_open_server_connections"
        ),
        0.0
    );
}

/// The corporate proxy on an https:// address (Squid's `https_port`, in
/// the shoot, Basic credentials): the agent speaks TLS to the proxy,
/// checked against the proxy's CA and its IP address, CONNECT inside it,
/// and its own TLS to the server inside that. It joins and serves dials;
/// an agent that trusts another CA refuses the proxy, counted as
/// `egress_proxy_tls_failed`, and never joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_leaves_through_an_https_egress_proxy() {
    let env = TunnelEnv::new(109);
    let ep = env.agent_endpoint(8132);
    let _server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let d = env.dir.path();
    let squid = common::squid::Squid::files(d, "127.0.0.1:3129".parse().unwrap(), &[8132]);
    let args = squid.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _proxy = Proc(
        env.shoot
            .cmd(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let creds = d.join("proxy-creds");
    std::fs::write(&creds, format!("user:{}\n", common::squid::PASSWORD)).unwrap();
    let through = |ca: &str| {
        env.agent(
            &ep,
            &[
                "--egress-proxy",
                "https://127.0.0.1:3129",
                "--egress-proxy-ca-file",
                ca,
                "--egress-proxy-credentials-file",
                creds.to_str().unwrap(),
            ],
        )
    };
    let agent = through(squid.ca.to_str().unwrap());
    let s = kas_connect_eventually(&env.uds, "127.0.0.1:8000", Duration::from_secs(60)).await;
    assert!(fetch_hello(s).await.contains("hello from the shoot"));

    let distrusting = through(&env.files.seed_ca);
    eventually("the refusal to be counted", Duration::from_secs(30), async || {
        env.agent_metric(
            &distrusting.admin(),
            "seedlink_tunnel_agent_server_connect_errors_total{outcome=\"egress_proxy_tls_failed\"}",
        ) >= 1.0
    })
    .await;
    assert_eq!(
        env.agent_metric(
            &distrusting.admin(),
            "seedlink_tunnel_agent_open_server_connections"
        ),
        0.0
    );
    // Squid logs a tunnel when it ends: the agent's went through it.
    drop(agent);
    eventually(
        "Squid to log the agent's tunnel",
        Duration::from_secs(30),
        async || squid.seen().contains(&format!("CONNECT {ep}")),
    )
    .await;
}

/// IPv6 end to end: the seed and the shoot also joined over IPv6
/// (`fd00:7::/64` on the veth pair) and every address used here an IPv6
/// one: the agent reaches the tunnel-server
/// through the gateway's SNI passthrough listening on IPv6, the
/// gateway's endpoint is the server's IPv6 address, and the agent dials
/// a pod's IPv6 address (a service on `fd00:8::5` in the shoot) for
/// kube-apiserver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_reach_the_server_and_ipv6_pods_over_ipv6_through_the_gateway() {
    let env = TunnelEnv::new(56);
    let dev = |ns: &common::Netns| -> String {
        let links = ns.run(&["ip", "-o", "link", "show", "type", "veth"]);
        let name = links.split(':').nth(1).unwrap_or_default().trim();
        name.split('@').next().unwrap_or_default().to_string()
    };
    let (seed_dev, shoot_dev) = (dev(&env.seed), dev(&env.shoot));
    env.seed.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00:7::1/64",
        "dev",
        &seed_dev,
        "nodad",
    ]);
    env.shoot.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00:7::2/64",
        "dev",
        &shoot_dev,
        "nodad",
    ]);
    env.shoot.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00:8::5/128",
        "dev",
        "lo",
        "nodad",
    ]);
    let pod = common::tunnel_env::spawn_until_up(env.shoot.cmd(&[
        "python3",
        "-c",
        "import http.server, socket, sys\n\
         class S(http.server.ThreadingHTTPServer): address_family = socket.AF_INET6\n\
         class H(http.server.BaseHTTPRequestHandler):\n  \
           def do_GET(self):\n    \
             b = b'hello from an ipv6 pod\\n'\n    \
             self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers(); self.wfile.write(b)\n  \
           def log_message(self, *a): pass\n\
         s = S(('fd00:8::5', 8001), H)\n\
         print('up', flush=True)\n\
         s.serve_forever()\n",
    ]));
    let ep = "[fd00:7::1]:8132";
    let _server = env.server(&env.server_yaml(ep, "", ""), "server");
    let gw_addr = "[fd00:7::1]:8443";
    let _gw = sni_gateway(&env, gw_addr, ep);
    let agent = env.agent(gw_addr, &[]);
    let s = kas_connect_eventually(&env.uds, "[fd00:8::5]:8001", Duration::from_secs(20)).await;
    let body = fetch_hello(s).await;
    assert!(body.contains("hello from an ipv6 pod"), "{body}");
    assert_eq!(
        env.agent_metric(
            &agent.admin(),
            "seedlink_tunnel_agent_open_server_connections"
        ),
        1.0
    );
    drop(pod);
}
