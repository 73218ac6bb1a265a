//! The reverse-tunnel part of `seedlink quickstart`: a tunnel-server and a
//! tunnel-agent in this process, and a demo "shoot pod" that only the
//! agent's policy lets anyone reach, through the tunnel.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use seedlink_tunnel::agent::{Agent, AgentOptions, DEFAULT_DENY};
use seedlink_tunnel::config::ServerConfig;
use seedlink_tunnel::grpc::H2Settings;
use seedlink_tunnel::server::run::TunnelServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::demo::Pki;

/// What the quickstart prints and checks.
pub struct TunnelDemo {
    /// The kube-apiserver-facing Unix socket (HTTP CONNECT).
    pub uds: PathBuf,
    /// The TCP+mTLS frontend.
    pub tcp: String,
    /// The demo pod's address (reachable through the tunnel).
    pub pod: SocketAddr,
    /// Keeps the server alive.
    pub server: Arc<TunnelServer>,
    /// Keeps the agent alive.
    pub agent: Arc<Agent>,
}

/// Answers every request with one line, like a pod's HTTP endpoint.
async fn serve_pod(l: TcpListener, stop: CancellationToken) {
    loop {
        let (mut s, _) = tokio::select! {
            a = l.accept() => match a { Ok(x) => x, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
            let body = "hello from a shoot pod, reached through the reverse tunnel\n";
            let _ = s
                .write_all(
                    format!(
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        });
    }
}

/// Starts the pod on 127.0.0.3, the tunnel-server (agent endpoint on
/// loopback, frontends in `dir`) and an agent allowed to reach only
/// 127.0.0.3.
pub async fn start(
    pki: &Pki,
    tunnel_host_index: usize,
    cluster: &str,
    dir: &Path,
    stop: &CancellationToken,
) -> anyhow::Result<TunnelDemo> {
    let pod_l = TcpListener::bind("127.0.0.3:0")
        .await
        .context("binding the demo pod on 127.0.0.3")?;
    let pod = pod_l.local_addr()?;
    tokio::spawn(serve_pod(pod_l, stop.clone()));
    let (host, leaf) = &pki.servers[tunnel_host_index];
    let w = |name: &str, text: &str| -> anyhow::Result<PathBuf> {
        let p = dir.join(name);
        std::fs::write(&p, text)?;
        Ok(p)
    };
    let ca = w("tunnel-ca.pem", &pki.ca_pem)?;
    let crt = w("tunnel.pem", &leaf.cert_pem)?;
    let key = w("tunnel-key.pem", &leaf.key_pem)?;
    let agent_crt = w("agent.pem", &pki.client.cert_pem)?;
    let agent_key = w("agent-key.pem", &pki.client.key_pem)?;
    let uds = dir.join("kube-apiserver-egress.sock");
    let yaml = format!(
        "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'}}
clusters:
  - name: {cluster}
    agent_ca: '{ca}'
    frontends:
      - {{name: kas, protocol: http-connect, unix: '{uds}'}}
      - {{name: kas-tcp, protocol: http-connect, tcp: '127.0.0.1:0', cert: '{crt}', key: '{key}', client_ca: '{ca}'}}
",
        crt = crt.display(),
        key = key.display(),
        ca = ca.display(),
        uds = uds.display()
    );
    let cfg = ServerConfig::parse(&yaml)?;
    let server = TunnelServer::from_config(&cfg)?;
    let bound = server.start().await?;
    let tcp = bound
        .frontends
        .iter()
        .find(|(k, _)| k.ends_with("/kas-tcp"))
        .map(|(_, v)| v.clone())
        .context("tcp frontend")?;
    let agent = Agent::new(AgentOptions {
        server: bound.agents.to_string(),
        server_name: host.clone(),
        ca,
        identity: Some((agent_crt, agent_key)),
        alpn: Vec::new(),
        agent_id: "quickstart-agent".into(),
        identifiers: String::new(),
        token_path: None,
        allow: vec!["127.0.0.3/32".parse()?],
        allow_ports: Vec::new(),
        deny: DEFAULT_DENY.iter().filter_map(|s| s.parse().ok()).collect(),
        dial_timeout: Duration::from_secs(5),
        sync_interval: Duration::from_millis(200),
        sync_interval_cap: Duration::from_secs(10),
        keepalive: H2Settings {
            keepalive: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
        },
        stall_timeout: Duration::from_secs(10),
        queue_bytes: 4 * 1024 * 1024,
        flow_control: true,
    })?;
    {
        let agent = agent.clone();
        tokio::spawn(async move { agent.run().await });
    }
    // Wait (bounded) for the agent's stream.
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    while !server.ready() {
        if tokio::time::Instant::now() > end {
            anyhow::bail!("the demo tunnel-agent did not connect within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(TunnelDemo {
        uds,
        tcp,
        pod,
        server,
        agent,
    })
}

/// kube-apiserver's way through the tunnel: CONNECT over the Unix socket,
/// then an HTTP GET; returns the answer (or why it failed).
pub async fn get_through(uds: &Path, target: SocketAddr) -> anyhow::Result<String> {
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut s = UnixStream::connect(uds).await?;
        s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await?;
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).await? == 0 || head.len() > 4096 {
                anyhow::bail!("tunnel refused: {}", String::from_utf8_lossy(&head).trim());
            }
            head.push(b[0]);
        }
        if !head.starts_with(b"HTTP/1.1 200 ") {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            anyhow::bail!(
                "{}{}",
                String::from_utf8_lossy(&head).trim(),
                String::from_utf8_lossy(&rest)
            );
        }
        s.write_all(b"GET / HTTP/1.0\r\nHost: pod\r\n\r\n").await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    })
    .await
    .context("timed out")?
}
