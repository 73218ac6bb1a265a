//! The reverse-tunnel scenario: seedlink tunnel-server + tunnel-agent (TLS
//! between them, an HTTP CONNECT frontend on loopback, as kube-apiserver
//! dials) vs rathole (server + client, its default TCP transport without
//! TLS, a plain port forward). Both processes of each count (CPU, RSS).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::peers::Proxy;
use crate::Opts;

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn ready(c: &mut Child, what: &str) -> anyhow::Result<()> {
    let out = c.stdout.take().context("stdout")?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    if !line.contains("ready") {
        bail!("{what} did not start: {line:?}");
    }
    Ok(())
}

/// Writes a CA, a server certificate for `tunnel.bench` and an agent client
/// certificate into `dir`.
fn pki(dir: &Path) -> anyhow::Result<()> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "bench CA");
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    std::fs::write(dir.join("ca.pem"), ca_cert.pem())?;
    for (name, client) in [("server", false), ("agent", true)] {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(if client {
            vec![]
        } else {
            vec!["tunnel.bench".to_string()]
        })?;
        p.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let cert = p.signed_by(&key, &issuer)?;
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem())?;
        std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem())?;
    }
    Ok(())
}

/// Waits until a connection through the tunnel reaches the backend.
async fn until_through(addr: SocketAddr, connect: bool) -> anyhow::Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if crate::workload::probe(addr, connect).await.is_ok() {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("no connection through the tunnel at {addr} within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts `name` (seedlink or rathole) forwarding to `backend`.
pub async fn start(
    name: &str,
    opts: &Opts,
    backend: SocketAddr,
    dir: &Path,
    idx: usize,
) -> anyhow::Result<Proxy> {
    let d = dir.join(format!("tunnel-{name}-{idx}"));
    std::fs::create_dir_all(&d)?;
    let (ctrl, front) = (free_port()?, free_port()?);
    let addr: SocketAddr = format!("127.0.0.1:{front}").parse()?;
    let (server, agent, connect) = match name {
        "seedlink" => {
            pki(&d)?;
            let p = |f: &str| d.join(f).display().to_string();
            std::fs::write(
                d.join("server.yaml"),
                format!(
                    "agents: {{listen: '127.0.0.1:{ctrl}', cert: '{}', key: '{}'}}
clusters:
  - name: bench
    agent_ca: '{}'
    frontends: [{{name: kas, protocol: http-connect, tcp: '{addr}'}}]
",
                    p("server.pem"),
                    p("server-key.pem"),
                    p("ca.pem")
                ),
            )?;
            let mut s = Command::new(&opts.seedlink)
                .args(["tunnel-server", "--config"])
                .arg(d.join("server.yaml"))
                .env("RUST_LOG", "error")
                .env(
                    "TOKIO_WORKER_THREADS",
                    std::env::var("BENCH_TUNNEL_THREADS").unwrap_or_else(|_| "1".into()),
                )
                .stdout(Stdio::piped())
                .spawn()?;
            ready(&mut s, "tunnel-server")?;
            let mut a = Command::new(&opts.seedlink)
                .args([
                    "tunnel-agent",
                    "--server",
                    &format!("127.0.0.1:{ctrl}"),
                    "--server-name",
                    "tunnel.bench",
                ])
                .args([
                    "--ca-cert",
                    &p("ca.pem"),
                    "--agent-cert",
                    &p("agent.pem"),
                    "--agent-key",
                    &p("agent-key.pem"),
                ])
                .args(["--admin", "127.0.0.1:0", "--allow-cidr", "127.0.0.0/8"])
                .env("RUST_LOG", "error")
                .env(
                    "TOKIO_WORKER_THREADS",
                    std::env::var("BENCH_TUNNEL_THREADS").unwrap_or_else(|_| "1".into()),
                )
                .stdout(Stdio::piped())
                .spawn()?;
            ready(&mut a, "tunnel-agent")?;
            (s, a, true)
        }
        "rathole" => {
            let bin = ["rathole", "/opt/rathole/bin/rathole"]
                .into_iter()
                .find(|b| {
                    Command::new("sh")
                        .arg("-c")
                        .arg(format!("command -v {b}"))
                        .output()
                        .is_ok_and(|o| o.status.success())
                })
                .context("`rathole` is not installed; run scripts/install-peers --bench")?;
            std::fs::write(
                d.join("server.toml"),
                format!("[server]\nbind_addr = \"127.0.0.1:{ctrl}\"\n[server.services.bench]\ntoken = \"bench\"\nbind_addr = \"{addr}\"\n"),
            )?;
            std::fs::write(
                d.join("client.toml"),
                format!("[client]\nremote_addr = \"127.0.0.1:{ctrl}\"\n[client.services.bench]\ntoken = \"bench\"\nlocal_addr = \"{backend}\"\n"),
            )?;
            let s = Command::new(bin)
                .arg(d.join("server.toml"))
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .spawn()?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let a = Command::new(bin)
                .arg(d.join("client.toml"))
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .spawn()?;
            (s, a, false)
        }
        other => bail!(
            "{other} is not a reverse tunnel; the tunnel scenario compares seedlink and rathole"
        ),
    };
    let p = Proxy::from_children(server, vec![agent], addr, connect);
    until_through(addr, connect).await?;
    Ok(p)
}
