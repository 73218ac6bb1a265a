//! `seedlink tunnel-server` in a "seed" network namespace and `seedlink
//! tunnel-agent` in a "shoot" namespace whose services (Python's
//! http.server and a TCP echo server on the shoot's loopback) only the agent
//! can reach. Frontends: HTTP CONNECT over a Unix socket (a client shaped
//! like kube-apiserver's egress dialer), HTTP CONNECT over TCP+mTLS (curl
//! `-p -x` with client certificates) and gRPC over a Unix socket.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use seedlink_tunnel::proto::{Packet, PacketType, Payload};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const ECHO: &str = "import socket,threading
s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('127.0.0.1',7007));s.listen(64)
def h(c):
  while True:
    d=c.recv(65536)
    if not d: break
    c.sendall(d)
  c.close()
while True:
  c,_=s.accept();threading.Thread(target=h,args=(c,),daemon=True).start()";

fn ready_line(p: &mut Proc) -> serde_json::Value {
    let out = p.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("no ready line");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

/// kube-apiserver's HTTP-CONNECT dialer: CONNECT, `Host: 127.0.0.1`, the
/// answer must be exactly the 200 line and a blank line.
async fn kas_connect(uds: &str, target: &str) -> Result<UnixStream, String> {
    let mut s = UnixStream::connect(uds).await.map_err(|e| e.to_string())?;
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let want = b"HTTP/1.1 200 Connection Established\r\n\r\n";
    let mut got = vec![0u8; want.len()];
    let n = tokio::time::timeout(Duration::from_secs(15), s.read(&mut got))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|e| e.to_string())?;
    if got[..n] != want[..n.min(want.len())] || n == 0 {
        let mut rest = vec![0u8; 512];
        let m = s.read(&mut rest).await.unwrap_or(0);
        return Err(format!(
            "{}{}",
            String::from_utf8_lossy(&got[..n]),
            String::from_utf8_lossy(&rest[..m])
        ));
    }
    if n < want.len() {
        s.read_exact(&mut got[n..]).await.unwrap();
        assert_eq!(&got[..], want);
    }
    Ok(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frontends_reach_shoot_services_only_through_the_agent() {
    require("curl");
    require("python3");
    let (seed, shoot) = netns_pair("seed", "shoot", 41);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Seed PKI: the agent endpoint's and TCP frontend's server certificates;
    // its client certificate is kube-apiserver's. Shoot PKI: the cluster's
    // agent CA and the agent's client certificate.
    let seedpki =
        seedlink::demo::Pki::generate(&["tunnel.seedlink.test", "frontend.seedlink.test"]).unwrap();
    let shootpki = seedlink::demo::Pki::generate(&[]).unwrap();
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let seed_ca = w("seed-ca.pem", &seedpki.ca_pem);
    let tun_crt = w("tun.pem", &seedpki.servers[0].1.cert_pem);
    let tun_key = w("tun-key.pem", &seedpki.servers[0].1.key_pem);
    let fe_crt = w("fe.pem", &seedpki.servers[1].1.cert_pem);
    let fe_key = w("fe-key.pem", &seedpki.servers[1].1.key_pem);
    let kas_crt = w("kas.pem", &seedpki.client.cert_pem);
    let kas_key = w("kas-key.pem", &seedpki.client.key_pem);
    let agent_ca = w("agent-ca.pem", &shootpki.ca_pem);
    let agent_crt = w("agent.pem", &shootpki.client.cert_pem);
    let agent_key = w("agent-key.pem", &shootpki.client.key_pem);
    let uds = d.join("kas.sock").display().to_string();
    let grpc_uds = d.join("kas-grpc.sock").display().to_string();
    let fe_port = free_port();
    let cfg = w(
        "tunnel.yaml",
        &format!(
            "server_count: 1
agents: {{listen: '198.18.41.1:8132', cert: '{tun_crt}', key: '{tun_key}', keepalive: 2s, keepalive_timeout: 2s}}
admin: {{listen: '127.0.0.1:0'}}
dial_timeout: 5s
clusters:
  - name: shoot--dev--a
    agent_ca: '{agent_ca}'
    frontends:
      - {{name: uds, protocol: http-connect, unix: '{uds}'}}
      - {{name: grpc, protocol: grpc, unix: '{grpc_uds}'}}
      - {{name: tcp, protocol: http-connect, tcp: '127.0.0.1:{fe_port}', cert: '{fe_crt}', key: '{fe_key}', client_ca: '{seed_ca}'}}
"
        ),
    );
    let bin = env!("CARGO_BIN_EXE_seedlink");
    let mut server = Proc(
        seed.cmd(&[bin, "tunnel-server", "--config", &cfg])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let ready = ready_line(&mut server);
    assert_eq!(ready["event"], "ready", "{ready}");

    // The shoot's services, reachable only inside the shoot namespace.
    let _http = Proc(
        shoot
            .cmd(&[
                "python3",
                "-m",
                "http.server",
                "8000",
                "--bind",
                "127.0.0.1",
                "--directory",
            ])
            .arg(d)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::fs::write(d.join("hello.txt"), "hello from the shoot\n").unwrap();
    let _echo = Proc(shoot.cmd(&["python3", "-c", ECHO]).spawn().unwrap());

    let mut agent = Proc(
        shoot
            .cmd(&[
                bin,
                "tunnel-agent",
                "--server",
                "198.18.41.1:8132",
                "--server-name",
                "tunnel.seedlink.test",
            ])
            .args([
                "--ca-cert",
                &seed_ca,
                "--agent-cert",
                &agent_crt,
                "--agent-key",
                &agent_key,
            ])
            .args([
                "--agent-id",
                "agent-1",
                "--admin",
                "127.0.0.1:0",
                "--allow-port",
                "8000,7007",
            ])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let _ = ready_line(&mut agent);

    // HTTP CONNECT over the Unix socket, as kube-apiserver dials.
    let end = Instant::now() + Duration::from_secs(20);
    let mut s = loop {
        match kas_connect(&uds, "127.0.0.1:8000").await {
            Ok(s) => break s,
            Err(e) => {
                assert!(Instant::now() < end, "tunnel never worked: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    s.write_all(b"GET /hello.txt HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (body, _) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert!(
        String::from_utf8_lossy(&body).contains("hello from the shoot"),
        "{}",
        String::from_utf8_lossy(&body)
    );

    // The same services are not reachable from the seed itself.
    let direct = seed
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

    // TCP echo through the tunnel, several round trips.
    let mut e = kas_connect(&uds, "127.0.0.1:7007").await.unwrap();
    for i in 0..20u8 {
        let msg = vec![i; 1000 + usize::from(i) * 3000];
        e.write_all(&msg).await.unwrap();
        let mut back = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(10), e.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, msg);
    }
    drop(e);

    // A destination outside the agent's policy, and a refused port.
    let denied = kas_connect(&uds, "169.254.169.254:80")
        .await
        .err()
        .unwrap_or_default();
    assert!(
        denied.contains("502") && denied.contains("policy"),
        "{denied}"
    );
    let refused = kas_connect(&uds, "127.0.0.1:8000").await;
    assert!(refused.is_ok());
    let bad_port = kas_connect(&uds, "127.0.0.1:9")
        .await
        .err()
        .unwrap_or_default();
    assert!(bad_port.contains("502"), "{bad_port}");

    // curl -p -x over the TCP+mTLS frontend (run inside the seed namespace).
    let out = seed
        .cmd(&["curl", "-sS", "--max-time", "10", "-p", "-x"])
        .arg(format!("https://frontend.seedlink.test:{fe_port}"))
        .args([
            "--proxy-cacert",
            &seed_ca,
            "--proxy-cert",
            &kas_crt,
            "--proxy-key",
            &kas_key,
        ])
        .args([
            "--resolve",
            &format!("frontend.seedlink.test:{fe_port}:127.0.0.1"),
        ])
        .arg("http://127.0.0.1:8000/hello.txt")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("hello from the shoot"), "{text}");
    // Without a client certificate the frontend refuses.
    let out = seed
        .cmd(&["curl", "-sS", "--max-time", "10", "-p", "-x"])
        .arg(format!("https://frontend.seedlink.test:{fe_port}"))
        .args(["--proxy-cacert", &seed_ca])
        .args([
            "--resolve",
            &format!("frontend.seedlink.test:{fe_port}:127.0.0.1"),
        ])
        .arg("http://127.0.0.1:8000/hello.txt")
        .output()
        .unwrap();
    assert!(!out.status.success());

    // gRPC ProxyService over the Unix socket: DIAL_REQ, echo, CLOSE.
    let io = UnixStream::connect(&grpc_uds).await.unwrap();
    let h2 = seedlink_tunnel::grpc::H2Settings {
        keepalive: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(10),
    };
    let mut client = seedlink_tunnel::grpc::connect(io, "http://localhost".parse().unwrap(), h2)
        .await
        .unwrap();
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

    // The agent dies mid-connection: the frontend is closed within a second.
    let mut held = kas_connect(&uds, "127.0.0.1:7007").await.unwrap();
    held.write_all(b"x").await.unwrap();
    let mut one = [0u8; 1];
    held.read_exact(&mut one).await.unwrap();
    let _ = agent.0.kill();
    let t0 = Instant::now();
    let (_, _) = read_until_closed(&mut held, Duration::from_secs(5)).await;
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "frontend closed after {:?}",
        t0.elapsed()
    );
    // And with no agent, a dial is answered 500 at once.
    let t0 = Instant::now();
    let none = kas_connect(&uds, "127.0.0.1:8000")
        .await
        .err()
        .unwrap_or_default();
    assert!(
        none.contains("500") && none.contains("No agent available"),
        "{none}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
    let admin: std::net::SocketAddr = ready["admin"].as_str().unwrap().parse().unwrap();
    let _ = admin; // the admin endpoint lives in the seed namespace
}
