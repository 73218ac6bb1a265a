//! The reverse-tunnel part of `seedlink quickstart`: one tunnel-server for
//! two clusters, one tunnel-agent per cluster (each with its own client CA)
//! in this process, and a demo "shoot pod" per cluster that only that
//! cluster's agent lets anyone reach, through the tunnel.

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
    /// The first cluster's kube-apiserver-facing Unix socket (HTTP CONNECT).
    pub uds: PathBuf,
    /// The first cluster's TCP+mTLS frontend.
    pub tcp: String,
    /// The first cluster's demo pod (reachable through its agent).
    pub pod: SocketAddr,
    /// The second cluster on the same server: name, socket, pod.
    pub second: (String, PathBuf, SocketAddr),
    /// Keeps the server alive.
    pub server: Arc<TunnelServer>,
    /// Keep the agents alive.
    pub agents: Vec<Arc<Agent>>,
}

/// Answers every request with one line, like a pod's HTTP endpoint.
async fn serve_pod(l: TcpListener, cluster: String, stop: CancellationToken) {
    loop {
        let (mut s, _) = tokio::select! {
            a = l.accept() => match a { Ok(x) => x, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        let body = format!("hello from a pod of {cluster}, reached through the reverse tunnel\n");
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
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

/// An agent for the demo, allowed to reach only `allow`.
fn demo_agent(
    server: SocketAddr,
    host: &str,
    ca: &Path,
    identity: (PathBuf, PathBuf),
    id: &str,
    allow: &str,
) -> anyhow::Result<Arc<Agent>> {
    let agent = Agent::new(AgentOptions {
        server: server.to_string(),
        server_name: host.to_string(),
        ca: ca.to_path_buf(),
        identity: Some(identity),
        alpn: Vec::new(),
        agent_id: id.into(),
        identifiers: String::new(),
        token_path: None,
        allow: vec![allow.parse()?],
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
        native: true,
        replica_addresses: true,
        egress: None,
    })?;
    {
        let agent = agent.clone();
        tokio::spawn(async move { agent.run().await });
    }
    Ok(agent)
}

/// Starts the pods (127.0.0.3 for `clusters[0]`, 127.0.0.4 for
/// `clusters[1]`), one tunnel-server for both clusters (agent endpoint on
/// loopback, frontends in `dir`) and one agent per cluster, each allowed to
/// reach only its own pod.
pub async fn start(
    pki: &Pki,
    tunnel_host_index: usize,
    clusters: [&str; 2],
    dir: &Path,
    stop: &CancellationToken,
) -> anyhow::Result<TunnelDemo> {
    let pods = start_pods(clusters, stop).await?;
    let (host, leaf) = &pki.servers[tunnel_host_index];
    let f = DemoFiles::write(pki, leaf, dir, clusters)?;
    let cfg = ServerConfig::parse(&server_yaml(clusters, &f))?;
    let server = TunnelServer::from_config(&cfg)?;
    let bound = server.start().await?;
    let tcp = bound
        .frontends
        .iter()
        .find(|(k, _)| k.ends_with("/kas-tcp"))
        .map(|(_, v)| v.clone())
        .context("tcp frontend")?;
    let agents = vec![
        demo_agent(
            bound.agents,
            host,
            &f.ca,
            f.agent,
            "quickstart-agent",
            "127.0.0.3/32",
        )?,
        demo_agent(
            bound.agents,
            host,
            &f.ca,
            f.agent2,
            "quickstart-agent-2",
            "127.0.0.4/32",
        )?,
    ];
    agents_connected(&server).await?;
    Ok(TunnelDemo {
        uds: f.uds,
        tcp,
        pod: pods[0],
        second: (clusters[1].to_string(), f.uds2, pods[1]),
        server,
        agents,
    })
}

/// The demo's files: the server's certificate and CA, each cluster's agent
/// identity (the second cluster's agents have their own CA), and where the
/// frontends' sockets go.
struct DemoFiles {
    ca: PathBuf,
    crt: PathBuf,
    key: PathBuf,
    agent: (PathBuf, PathBuf),
    ca2: PathBuf,
    agent2: (PathBuf, PathBuf),
    uds: PathBuf,
    uds2: PathBuf,
}

impl DemoFiles {
    fn write(
        pki: &Pki,
        leaf: &crate::demo::Leaf,
        dir: &Path,
        clusters: [&str; 2],
    ) -> anyhow::Result<DemoFiles> {
        let w = |name: &str, text: &str| -> anyhow::Result<PathBuf> {
            let p = dir.join(name);
            std::fs::write(&p, text)?;
            Ok(p)
        };
        let other = Pki::generate(&[])?;
        Ok(DemoFiles {
            ca: w("tunnel-ca.pem", &pki.ca_pem)?,
            crt: w("tunnel.pem", &leaf.cert_pem)?,
            key: w("tunnel-key.pem", &leaf.key_pem)?,
            agent: (
                w("agent.pem", &pki.client.cert_pem)?,
                w("agent-key.pem", &pki.client.key_pem)?,
            ),
            ca2: w("agent2-ca.pem", &other.ca_pem)?,
            agent2: (
                w("agent2.pem", &other.client.cert_pem)?,
                w("agent2-key.pem", &other.client.key_pem)?,
            ),
            uds: dir.join("kube-apiserver-egress.sock"),
            uds2: dir.join(format!("kube-apiserver-egress-{}.sock", clusters[1])),
        })
    }
}

/// The demo tunnel-server's file: two clusters, each with its own agent CA
/// and a Unix-socket frontend, the first also a TCP+mTLS one.
fn server_yaml(clusters: [&str; 2], f: &DemoFiles) -> String {
    format!(
        "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'}}
clusters:
  - name: {c1}
    agent_ca: '{ca}'
    frontends:
      - {{name: kas, protocol: http-connect, unix: '{uds}'}}
      - {{name: kas-tcp, protocol: http-connect, tcp: '127.0.0.1:0', cert: '{crt}', key: '{key}', client_ca: '{ca}'}}
  - name: {c2}
    agent_ca: '{ca2}'
    frontends:
      - {{name: kas, protocol: http-connect, unix: '{uds2}'}}
",
        c1 = clusters[0],
        c2 = clusters[1],
        crt = f.crt.display(),
        key = f.key.display(),
        ca = f.ca.display(),
        ca2 = f.ca2.display(),
        uds = f.uds.display(),
        uds2 = f.uds2.display()
    )
}

/// The demo pods: 127.0.0.3 for `clusters[0]`, 127.0.0.4 for
/// `clusters[1]`; their addresses.
async fn start_pods(
    clusters: [&str; 2],
    stop: &CancellationToken,
) -> anyhow::Result<Vec<SocketAddr>> {
    let mut pods = Vec::new();
    for (ip, c) in [("127.0.0.3", clusters[0]), ("127.0.0.4", clusters[1])] {
        let l = TcpListener::bind((ip, 0))
            .await
            .with_context(|| format!("binding the demo pod on {ip}"))?;
        pods.push(l.local_addr()?);
        tokio::spawn(serve_pod(l, c.to_string(), stop.clone()));
    }
    Ok(pods)
}

/// Waits (10 s at most) until every cluster of `server` has an agent
/// stream.
async fn agents_connected(server: &TunnelServer) -> anyhow::Result<()> {
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    while server
        .registry
        .clusters()
        .iter()
        .any(|c| c.agent_count() == 0)
    {
        if tokio::time::Instant::now() > end {
            anyhow::bail!("the demo tunnel-agents did not connect within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
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
