//! A tunnel test bed: a "seed" and a "shoot" network namespace joined by a
//! veth pair (`198.18.<net>.1` / `.2`), certificates for both sides, the
//! shoot's services on its own loopback (Python `http.server` on 8000 with
//! `hello.txt`, a TCP echo server on 7007, a "firehose" on 7008 that sends
//! until the reader stops, a SYN sink on 7009 whose backlog is full so
//! connects hang, and 8 MiB of a known pattern on 7010), and helpers to run `seedlink tunnel-server` in the seed
//! and `seedlink tunnel-agent` in the shoot.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::{netns_pair, require, Netns, Proc};

pub use crate::{enter_netns, ready_line};

const SERVICES: &str = "import socket,threading,time
def srv(port, backlog):
  s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('127.0.0.1',port));s.listen(backlog);return s
def echo(c):
  while True:
    d=c.recv(65536)
    if not d: break
    c.sendall(d)
  c.close()
def fire(c):
  b=b'x'*65536
  try:
    while True: c.sendall(b)
  except Exception: c.close()
def loop(s,f):
  while True:
    c,_=s.accept();threading.Thread(target=f,args=(c,),daemon=True).start()
PATTERN=bytes(i%251 for i in range(8*1024*1024))
def pattern(c):
  try: c.sendall(PATTERN)
  except Exception: pass
  c.close()
e=srv(7007,512);f=srv(7008,64);sink=srv(7009,0);pat=srv(7010,64)
threading.Thread(target=loop,args=(pat,pattern),daemon=True).start()
held=[]
for _ in range(8):
  try:
    x=socket.socket();x.setblocking(False);x.connect_ex(('127.0.0.1',7009));held.append(x)
  except Exception: pass
threading.Thread(target=loop,args=(f,fire),daemon=True).start()
print('up',flush=True)
loop(e,echo)";

/// PEM files of both sides.
pub struct Files {
    pub seed_ca: String,
    pub tun_crt: String,
    pub tun_key: String,
    pub fe_crt: String,
    pub fe_key: String,
    pub kas_crt: String,
    pub kas_key: String,
    pub agent_ca: String,
    pub agent_crt: String,
    pub agent_key: String,
}

/// The test bed.
pub struct TunnelEnv {
    pub net: u8,
    pub seed: Netns,
    pub shoot: Netns,
    pub dir: tempfile::TempDir,
    pub files: Files,
    pub uds: String,
    pub grpc_uds: String,
    pub fe_port: u16,
    _services: Vec<Proc>,
}

/// A started process and what its ready line said.
pub struct Started {
    pub proc: Proc,
    pub ready: serde_json::Value,
}

impl Started {
    pub fn admin(&self) -> String {
        self.ready["admin"].as_str().unwrap_or_default().to_string()
    }

    pub fn pid(&self) -> u32 {
        self.proc.0.id()
    }
}

/// Open file descriptors of a process.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

impl TunnelEnv {
    pub fn new(net: u8) -> TunnelEnv {
        require("curl");
        require("python3");
        let (seed, shoot) = netns_pair("seed", "shoot", net);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let seedpki =
            seedlink::demo::Pki::generate(&["tunnel.seedlink.test", "frontend.seedlink.test"])
                .unwrap();
        let shootpki = seedlink::demo::Pki::generate(&[]).unwrap();
        let w = |name: &str, text: &str| {
            std::fs::write(d.join(name), text).unwrap();
            d.join(name).display().to_string()
        };
        let files = Files {
            seed_ca: w("seed-ca.pem", &seedpki.ca_pem),
            tun_crt: w("tun.pem", &seedpki.servers[0].1.cert_pem),
            tun_key: w("tun-key.pem", &seedpki.servers[0].1.key_pem),
            fe_crt: w("fe.pem", &seedpki.servers[1].1.cert_pem),
            fe_key: w("fe-key.pem", &seedpki.servers[1].1.key_pem),
            kas_crt: w("kas.pem", &seedpki.client.cert_pem),
            kas_key: w("kas-key.pem", &seedpki.client.key_pem),
            agent_ca: w("agent-ca.pem", &shootpki.ca_pem),
            agent_crt: w("agent.pem", &shootpki.client.cert_pem),
            agent_key: w("agent-key.pem", &shootpki.client.key_pem),
        };
        let services = shoot_services(&shoot, &d, "hello from the shoot");
        TunnelEnv {
            net,
            uds: d.join("kas.sock").display().to_string(),
            grpc_uds: d.join("kas-grpc.sock").display().to_string(),
            // Inside the seed namespace, which only this test bed uses: a
            // fixed port cannot collide with another test.
            fe_port: 8090,
            seed,
            shoot,
            dir,
            files,
            _services: services,
        }
    }

    /// The seed-side address agents dial.
    pub fn agent_endpoint(&self, port: u16) -> String {
        format!("198.18.{}.1:{port}", self.net)
    }

    /// A server configuration; `extra` is appended at top level, `sockets`
    /// suffixes the socket names (for a second replica).
    pub fn server_yaml(&self, listen: &str, extra: &str, sockets: &str) -> String {
        let f = &self.files;
        let dir = self.dir.path().display();
        let fe = if sockets.is_empty() {
            format!(
                "      - {{name: tcp, protocol: http-connect, tcp: '127.0.0.1:{}', cert: '{}', key: '{}', client_ca: '{}'}}\n",
                self.fe_port, f.fe_crt, f.fe_key, f.seed_ca
            )
        } else {
            String::new()
        };
        format!(
            "agents: {{listen: '{listen}', cert: '{}', key: '{}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
dial_timeout: 10s
stall_timeout: 2s
{extra}
clusters:
  - name: shoot--dev--a
    agent_ca: '{}'
    frontends:
      - {{name: uds, protocol: http-connect, unix: '{dir}/kas{sockets}.sock'}}
      - {{name: grpc, protocol: grpc, unix: '{dir}/kas-grpc{sockets}.sock'}}
{fe}",
            f.tun_crt, f.tun_key, f.agent_ca
        )
    }

    /// Starts `seedlink tunnel-server` in the seed namespace.
    pub fn server(&self, yaml: &str, name: &str) -> Started {
        self.server_with(yaml, name, &[])
    }

    /// Starts `seedlink tunnel-server` with extra arguments.
    pub fn server_with(&self, yaml: &str, name: &str, extra: &[&str]) -> Started {
        let cfg = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&cfg, yaml).unwrap();
        let mut proc = Proc(
            self.seed
                .cmd(&[super::seedlink_bin(), "tunnel-server", "--config"])
                .arg(&cfg)
                .args(extra)
                .env(
                    "RUST_LOG",
                    std::env::var("SERVER_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let ready = ready_line(&mut proc.0);
        assert_eq!(ready["event"], "ready", "{ready}");
        Started { proc, ready }
    }

    /// Starts `seedlink tunnel-agent` in the shoot namespace, dialing
    /// `server`, with the cluster's client certificate.
    pub fn agent(&self, server: &str, extra: &[&str]) -> Started {
        let f = &self.files;
        let mut args = vec!["--agent-cert", &f.agent_crt, "--agent-key", &f.agent_key];
        args.extend_from_slice(extra);
        self.agent_bare(server, &args)
    }

    /// Starts `seedlink tunnel-agent` with only `extra` as credentials.
    pub fn agent_bare(&self, server: &str, extra: &[&str]) -> Started {
        self.agent_in(&self.shoot, server, extra)
    }

    /// Starts `seedlink tunnel-agent` in namespace `ns` with only `extra`
    /// as credentials.
    pub fn agent_in(&self, ns: &Netns, server: &str, extra: &[&str]) -> Started {
        self.agent_policy(ns, server, extra, true)
    }

    /// Starts `seedlink tunnel-agent` with the cluster's client certificate
    /// and the agent's default destination policy (which denies loopback).
    pub fn agent_default_policy(&self, server: &str) -> Started {
        let f = &self.files;
        let creds = ["--agent-cert", &f.agent_crt, "--agent-key", &f.agent_key];
        self.agent_policy(&self.shoot, server, &creds, false)
    }

    fn agent_policy(&self, ns: &Netns, server: &str, extra: &[&str], loopback: bool) -> Started {
        let f = &self.files;
        let mut args = vec![
            "tunnel-agent",
            "--server",
            server,
            "--server-name",
            "tunnel.seedlink.test",
            "--ca-cert",
            &f.seed_ca,
            "--admin",
            "127.0.0.1:0",
            "--sync-interval",
            "0.2",
        ];
        // The test shoots serve on their own loopback, which the agent's
        // default policy denies.
        if loopback && !extra.contains(&"--deny-cidr") {
            args.extend_from_slice(&["--deny-cidr", crate::SHOOT_LOOPBACK_DENY]);
        }
        // A 2 s back-off cap unless the test sets its own.
        if !extra.contains(&"--sync-interval-cap") {
            args.extend_from_slice(&["--sync-interval-cap", "2"]);
        }
        args.extend_from_slice(extra);
        start(ns, &args)
    }

    /// An agent configuration file (`tunnel-agent --config`) with the same
    /// settings as [`TunnelEnv::agent`]'s flags; `extra` is appended.
    pub fn agent_file(&self, server: &str, extra: &str) -> std::path::PathBuf {
        let f = &self.files;
        let path = self.dir.path().join("agent.yaml");
        std::fs::write(
            &path,
            format!(
                "server: '{server}'\nserver_name: tunnel.seedlink.test\nca_cert: '{}'\n\
                 agent_cert: '{}'\nagent_key: '{}'\nadmin: '127.0.0.1:0'\n\
                 sync_interval: 200ms\nsync_interval_cap: 2s\n\
                 deny_cidr: [{}]\n{extra}",
                f.seed_ca,
                f.agent_crt,
                f.agent_key,
                crate::SHOOT_LOOPBACK_DENY
            ),
        )
        .unwrap();
        path
    }

    /// Starts `seedlink tunnel-agent --config file` in the shoot namespace.
    pub fn agent_from_file(&self, file: &std::path::Path) -> Started {
        start_with_config(&self.shoot, "tunnel-agent", file)
    }

    /// `GET path` on an admin endpoint inside `ns`.
    pub fn admin_get(ns: &Netns, admin: &str, path: &str) -> String {
        let out = ns
            .cmd(&[
                "curl",
                "-s",
                "--max-time",
                "5",
                &format!("http://{admin}{path}"),
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts `seedlink gateway` with `cfg` in the seed namespace and waits
    /// for its ready line.
    pub fn gateway(&self, cfg: &std::path::Path) -> Proc {
        let gw = start_with_config(&self.seed, "gateway", cfg);
        assert_eq!(gw.ready["event"], "ready", "{}", gw.ready);
        gw.proc
    }

    /// Sum of the samples of `prefix` on the seed-side admin `admin`.
    pub fn server_metric(&self, admin: &str, prefix: &str) -> f64 {
        super::sum_metric(&Self::admin_get(&self.seed, admin, "/metrics"), prefix)
    }

    /// Sum of the samples of `prefix` on the shoot-side admin `admin`.
    pub fn agent_metric(&self, admin: &str, prefix: &str) -> f64 {
        super::sum_metric(&Self::admin_get(&self.shoot, admin, "/metrics"), prefix)
    }

    /// A server configuration whose cluster trusts ServiceAccount tokens of
    /// issuer `https://issuer.shoot` (key written to `sa.pub`) instead of an
    /// agent CA; returns it with the issuer's key.
    pub fn token_server_yaml(&self, listen: &str) -> (String, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let keys = self.dir.path().join("sa.pub");
        std::fs::write(&keys, key.public_key_pem()).unwrap();
        let yaml = self.server_yaml(listen, "", "").replace(
            &format!("agent_ca: '{}'", self.files.agent_ca),
            &format!(
                "agent_token: {{issuer: 'https://issuer.shoot', keys: '{}'}}",
                keys.display()
            ),
        );
        (yaml, key)
    }

    pub fn socket(&self, suffix: &str) -> PathBuf {
        self.dir.path().join(format!("kas{suffix}.sock"))
    }
}

/// kube-apiserver's HTTP-CONNECT dialer: `CONNECT`, `Host: 127.0.0.1`; the
/// answer must be exactly the 200 line and an empty line. On failure, the
/// answer text.
pub async fn kas_connect(uds: &str, target: &str) -> Result<UnixStream, String> {
    let mut s = UnixStream::connect(uds).await.map_err(|e| e.to_string())?;
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let want = b"HTTP/1.1 200 Connection Established\r\n\r\n";
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    // Byte by byte, so nothing after the answer is consumed.
    while got.len() < want.len() {
        match tokio::time::timeout(Duration::from_secs(15), s.read(&mut b)).await {
            Ok(Ok(1)) => got.push(b[0]),
            _ => break,
        }
        if !want.starts_with(&got) {
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
            got.extend_from_slice(&rest);
            return Err(String::from_utf8_lossy(&got).into_owned());
        }
    }
    if got != want {
        return Err(format!(
            "incomplete answer: {:?}",
            String::from_utf8_lossy(&got)
        ));
    }
    Ok(s)
}

/// Retries [`kas_connect`] until it works (agents connect asynchronously).
pub async fn kas_connect_eventually(uds: &str, target: &str, limit: Duration) -> UnixStream {
    crate::eventually("a tunnel", limit, async || kas_connect(uds, target).await).await
}

/// One echo round trip of `n` bytes; returns its duration.
pub async fn echo_rtt(s: &mut UnixStream, n: usize) -> Duration {
    let msg = vec![b'e'; n];
    let t0 = std::time::Instant::now();
    s.write_all(&msg).await.unwrap();
    let mut back = vec![0u8; n];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
        .await
        .expect("echo timed out")
        .unwrap();
    assert_eq!(back, msg);
    t0.elapsed()
}

/// Checks a connection is usable end to end by fetching `hello.txt`.
pub async fn fetch_hello(mut s: UnixStream) -> String {
    s.write_all(b"GET /hello.txt HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (body, _) = super::read_until_closed(&mut s, Duration::from_secs(10)).await;
    String::from_utf8_lossy(&body).into_owned()
}

/// A gRPC `ProxyService` client over a Unix socket.
pub async fn grpc_client(path: &str) -> seedlink_tunnel::grpc::Client {
    let io = UnixStream::connect(path).await.unwrap();
    let h2 = seedlink_tunnel::grpc::H2Settings {
        keepalive: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(10),
    };
    seedlink_tunnel::grpc::connect(io, "http://localhost".parse().unwrap(), h2)
        .await
        .unwrap()
}

/// Starts the shoot's services in `ns` (see the module comment); `hello`
/// is the content of `hello.txt`, served from `dir`.
pub fn shoot_services(ns: &Netns, dir: &std::path::Path, hello: &str) -> Vec<Proc> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("hello.txt"), format!("{hello}\n")).unwrap();
    let http = Proc(
        ns.cmd(&[
            "python3",
            "-m",
            "http.server",
            "8000",
            "--bind",
            "127.0.0.1",
            "--directory",
        ])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let svc = spawn_until_up(ns.cmd(&["python3", "-c", SERVICES]));
    vec![http, svc]
}

/// Starts a helper that prints `up` on stdout once it listens, and waits
/// for that line.
pub fn spawn_until_up(mut cmd: std::process::Command) -> Proc {
    let mut p = Proc(cmd.stdout(Stdio::piped()).spawn().unwrap());
    let out = p.0.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "up");
    p
}

/// A gRPC client over an agent's TLS connection to the tunnel-server.
async fn grpc_over(
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
) -> seedlink_tunnel::grpc::Client {
    let h2 = seedlink_tunnel::grpc::H2Settings {
        keepalive: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(10),
    };
    seedlink_tunnel::grpc::connect(tls, "https://tunnel.seedlink.test".parse().unwrap(), h2)
        .await
        .unwrap()
}

/// An agent written for the tests: a valid cluster certificate, hostile
/// packets. It runs on a thread that joined the seed namespace, where the
/// agent endpoint is routable.
pub struct FakeAgent {
    pub netns: String,
    pub ca: String,
    pub cert: String,
    pub key: String,
    pub endpoint: String,
    pub agent_id: String,
}

/// An agent's `Connect` request as `h2` sends it, for `agentid` `id`.
fn connect_request(id: String) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!(
            "https://tunnel.seedlink.test{}",
            seedlink_tunnel::proto::AGENT_CONNECT_PATH
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("agentid", id)
        .body(())
        .unwrap_or_default()
}

impl FakeAgent {
    /// Runs `f` with an open agent stream (the packet sender and what the
    /// server sends), on a thread that joined the agent's namespace.
    fn with_stream<F, Fut>(&self, f: F)
    where
        F: FnOnce(
                tokio::sync::mpsc::Sender<seedlink_tunnel::proto::Packet>,
                tonic::Streaming<seedlink_tunnel::proto::Packet>,
            ) -> Fut
            + Send
            + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        use seedlink_tunnel::proto::Packet;
        self.on_tls(move |tls, id| async move {
            let mut client = grpc_over(tls).await;
            let (tx, rx) = tokio::sync::mpsc::channel::<Packet>(64);
            let out = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|p| (p, rx))
            });
            let resp = seedlink_tunnel::grpc::open_stream(
                &mut client,
                seedlink_tunnel::proto::AGENT_CONNECT_PATH,
                out,
                &[("agentid", id)],
            )
            .await
            .unwrap();
            assert!(resp.metadata().get("serverid").is_some());
            f(tx, resp.into_inner()).await;
        });
    }

    /// Opens a stream as `agent_id` and closes it: the server's refusal,
    /// its gRPC code's name (`None`: accepted).
    pub fn refusal(&self) -> Option<String> {
        use seedlink_tunnel::proto::Packet;
        self.on_tls(move |tls, id| async move {
            let mut client = grpc_over(tls).await;
            let out = futures_util::stream::empty::<Packet>();
            seedlink_tunnel::grpc::open_stream(
                &mut client,
                seedlink_tunnel::proto::AGENT_CONNECT_PATH,
                out,
                &[("agentid", id)],
            )
            .await
            .err()
            .map(|s| format!("{:?}", s.code()))
        })
    }

    /// Connects as `agent_id`, sends `script` (then a 5 MiB DATA if
    /// `oversized`), and disconnects.
    pub fn run(&self, script: Vec<seedlink_tunnel::proto::Packet>, oversized: bool) {
        use futures_util::StreamExt;
        use seedlink_tunnel::proto::Packet;
        self.with_stream(move |tx, mut inbound| async move {
            for p in script {
                tx.send(p).await.unwrap();
            }
            if oversized {
                let big = bytes::Bytes::from(vec![0u8; 5 * 1024 * 1024]);
                let _ = tx.send(Packet::data(1, big)).await;
            }
            // Read what the server answers (CLOSE_REQs) for a moment.
            let linger = if oversized { 300 } else { 20 };
            let _ = tokio::time::timeout(Duration::from_millis(linger), async {
                while let Some(Ok(_)) = inbound.next().await {}
            })
            .await;
        });
    }

    /// Sends DATA for `n` connections the server never heard of (each is
    /// answered with a CLOSE_REQ) while reading nothing the server sends,
    /// stopping early once the server stops taking packets. Speaks gRPC
    /// over the `h2` crate directly, with a 1 KiB receive window, so the
    /// server's answers back up after a few dozen. Returns how many it
    /// sent.
    pub fn flood_unknown_ids(&self, n: i64) -> i64 {
        use prost::Message;
        use seedlink_tunnel::proto::Packet;
        self.on_tls(move |tls, id| async move {
            let (client, conn) = h2::client::Builder::new()
                .initial_window_size(1024)
                .initial_connection_window_size(1024)
                .handshake::<_, bytes::Bytes>(tls)
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut client = client.ready().await.unwrap();
            let req = connect_request(id);
            let (resp, mut send) = client.send_request(req, false).unwrap();
            // The answer's headers come at once; its body is never read.
            let _resp = tokio::time::timeout(Duration::from_secs(10), resp).await;
            let mut sent = 0;
            for id in 1..=n {
                let p = Packet::data(id, bytes::Bytes::from_static(b"x"));
                let body = p.encode_to_vec();
                let mut msg = vec![0u8];
                msg.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
                msg.extend_from_slice(&body);
                send.reserve_capacity(msg.len());
                // Bounded: a server that stopped reading ends the flood.
                let room = tokio::time::timeout(
                    Duration::from_secs(10),
                    std::future::poll_fn(|cx| send.poll_capacity(cx)),
                )
                .await;
                match room {
                    Ok(Some(Ok(_))) => {}
                    _ => break,
                }
                if send.send_data(bytes::Bytes::from(msg), false).is_err() {
                    break;
                }
                sent = id;
            }
            sent
        })
    }

    /// Opens a stream as `agent_id` (to be refused), then holds the
    /// connection without opening another: whether the server closed it
    /// within `wait`, and the refusal's gRPC status code.
    pub fn refused_then_held(&self, wait: Duration) -> (bool, Option<String>) {
        self.on_tls(move |tls, id| async move {
            let (client, conn) = h2::client::handshake(tls).await.unwrap();
            let conn = tokio::spawn(conn);
            let mut client = client.ready().await.unwrap();
            let req = connect_request(id);
            let (resp, _send) = client.send_request(req, false).unwrap();
            let code = match tokio::time::timeout(Duration::from_secs(10), resp).await {
                Ok(Ok(r)) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                _ => None,
            };
            let closed = tokio::time::timeout(wait, conn).await.is_ok();
            drop(client);
            (closed, code)
        })
    }

    /// Sends `p` again and again on one accepted stream (gRPC) until the
    /// server ends the stream or `n` were sent; how many went before it
    /// did (`None`: it never did).
    pub fn flood(&self, p: seedlink_tunnel::proto::Packet, n: u64) -> Option<u64> {
        use futures_util::StreamExt;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        self.with_stream(move |tx, mut inbound| async move {
            let mut sent = 0u64;
            let ended = async { while let Some(Ok(_)) = inbound.next().await {} };
            tokio::pin!(ended);
            let cut = loop {
                if sent == n {
                    break None;
                }
                tokio::select! {
                    biased;
                    () = &mut ended => break Some(sent),
                    r = tx.send(p.clone()) => {
                        if r.is_err() {
                            break Some(sent);
                        }
                        sent += 1;
                    }
                }
            };
            // Bounded: the stream's end, once the last packets went out.
            let cut = match cut {
                Some(s) => Some(s),
                None => tokio::time::timeout(Duration::from_secs(20), &mut ended)
                    .await
                    .ok()
                    .map(|()| sent),
            };
            let _ = done_tx.send(cut);
        });
        done_rx.recv().ok().flatten()
    }

    /// Runs `f` on a thread that joined the agent's namespace, with a TLS
    /// connection to the agent endpoint made with the cluster's client
    /// certificate (ALPN h2) and the agent ID to present.
    fn on_tls<F, Fut, T>(&self, f: F) -> T
    where
        F: FnOnce(tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String) -> Fut
            + Send
            + 'static,
        Fut: std::future::Future<Output = T>,
        T: Send + 'static,
    {
        let (netns, ca, cert, key, ep, id) = (
            self.netns.clone(),
            self.ca.clone(),
            self.cert.clone(),
            self.key.clone(),
            self.endpoint.clone(),
            self.agent_id.clone(),
        );
        std::thread::spawn(move || {
            enter_netns(&netns);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let cfg = seedlink_tunnel::tls::client_config(
                    std::path::Path::new(&ca),
                    Some((std::path::Path::new(&cert), std::path::Path::new(&key))),
                    &["h2".to_string()],
                )
                .unwrap();
                let tcp = tokio::net::TcpStream::connect(&ep).await.unwrap();
                let name = rustls::pki_types::ServerName::try_from("tunnel.seedlink.test").unwrap();
                let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
                    .connect(name, tcp)
                    .await
                    .unwrap();
                f(tls, id).await
            })
        })
        .join()
        .unwrap()
    }
}

/// A ServiceAccount token of `https://issuer.shoot` for
/// `kube-system/konnectivity-agent` with audience `aud`, valid 10 minutes.
pub fn sign_token(key: &rcgen::KeyPair, aud: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = serde_json::json!({
        "iss": "https://issuer.shoot", "aud": [aud], "exp": now + 600,
        "sub": "system:serviceaccount:kube-system:konnectivity-agent",
    });
    let k = jsonwebtoken::EncodingKey::from_ec_pem(key.serialize_pem().as_bytes()).unwrap();
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256),
        &claims,
        &k,
    )
    .unwrap()
}

/// Starts `seedlink ROLE --config FILE` in `ns` and waits for its ready line.
fn start_with_config(ns: &Netns, role: &str, file: &std::path::Path) -> Started {
    start(ns, &[role, "--config", &file.display().to_string()])
}

/// Starts `seedlink ARGS…` in `ns` (warnings logged) and waits for its
/// ready line.
fn start(ns: &Netns, args: &[&str]) -> Started {
    let mut proc = Proc(
        ns.cmd(&[super::seedlink_bin()])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let ready = ready_line(&mut proc.0);
    Started { proc, ready }
}

/// Echoes 1000, 20,000, 65,536 and 1000 patterned bytes over a held tunnel
/// and checks each comes back byte-exact (within 10 s each).
pub async fn echo_exact(s: &mut UnixStream) {
    for n in [1000, 20_000, 65_536, 1000] {
        let msg: Vec<u8> = (0..n).map(|j| (j % 251) as u8).collect();
        s.write_all(&msg).await.unwrap();
        let mut back = vec![0u8; n];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
            .await
            .expect("the long stream stalled")
            .unwrap();
        assert_eq!(back, msg);
    }
}

/// Waits (up to 30 s) for `p` to exit; its exit code.
pub async fn exit_code(p: &mut Proc, what: &str) -> Option<i32> {
    let what = format!("{what} to exit");
    crate::eventually(&what, Duration::from_secs(30), async || {
        p.0.try_wait().unwrap().map(|st| st.code()).ok_or("running")
    })
    .await
}

/// A loop of dials through the tunnel: each an HTTP CONNECT over the Unix
/// socket `target(n)` to the shoot's hello server, read to its answer,
/// 20 ms apart, at most 20,000 or 240 s, until stopped.
pub struct Dials {
    ok: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Dials {
    /// Starts the loop.
    pub fn start(target: impl Fn(usize) -> String + Send + 'static) -> Dials {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let (ok2, failed2, stop2) = (ok.clone(), failed.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let end = std::time::Instant::now() + Duration::from_secs(240);
            for n in 0..20_000usize {
                if stop2.load(Ordering::Relaxed) || std::time::Instant::now() > end {
                    break;
                }
                let uds = target(n);
                let r = tokio::time::timeout(Duration::from_secs(10), async {
                    let s = kas_connect(&uds, "127.0.0.1:8000").await?;
                    Ok::<_, String>(fetch_hello(s).await)
                })
                .await;
                match r {
                    Ok(Ok(body)) if body.contains("hello") => ok2.fetch_add(1, Ordering::Relaxed),
                    other => {
                        eprintln!("dial through {uds} failed: {other:?}");
                        failed2.fetch_add(1, Ordering::Relaxed)
                    }
                };
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Dials {
            ok,
            failed,
            stop,
            task,
        }
    }

    /// Dials served so far.
    pub fn ok(&self) -> u64 {
        self.ok.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits (up to 20 s) for `n` more dials to be served.
    pub async fn more(&self, n: u64, what: &str) {
        let seen = self.ok();
        crate::eventually(what, Duration::from_secs(20), async || {
            self.ok() >= seen + n
        })
        .await;
    }

    /// Stops the loop: (served, failed).
    pub async fn stop(self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// The agents' load balancer: HAProxy in TCP mode bound at `bind`,
/// round-robin over `servers` (health checked every 200 ms when `check`: a
/// replica that stopped accepting is skipped), in namespace `ns` or this
/// one. Its configuration is written into `dir`.
pub fn haproxy_lb(
    ns: Option<&Netns>,
    dir: &std::path::Path,
    bind: &str,
    servers: &[String],
    check: bool,
) -> Proc {
    let haproxy = require("haproxy");
    let checks = if check {
        " check inter 200ms fall 1 rise 1"
    } else {
        ""
    };
    let servers: String = servers
        .iter()
        .enumerate()
        .map(|(i, a)| format!("  server r{i} {a}{checks}\n"))
        .collect();
    let cfg = dir.join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 120s\n  timeout server 120s\n\
             frontend lb\n  bind {bind}\n  default_backend replicas\nbackend replicas\n  balance roundrobin\n{servers}"
        ),
    )
    .unwrap();
    let args = [
        haproxy.to_str().unwrap(),
        "-db",
        "-f",
        cfg.to_str().unwrap(),
    ];
    let mut cmd = match ns {
        Some(ns) => ns.cmd(&args),
        None => {
            let mut c = std::process::Command::new(args[0]);
            c.args(&args[1..]);
            c
        }
    };
    Proc(cmd.stdout(Stdio::null()).spawn().unwrap())
}
