//! The reverse-tunnel scenario: seedlink tunnel-server + tunnel-agent (TLS
//! between them, an HTTP CONNECT frontend on loopback, as kube-apiserver
//! dials) vs upstream Konnectivity (proxy-server + proxy-agent, mTLS between
//! them, its HTTP CONNECT frontend on a Unix socket, the only plain frontend
//! it offers), rathole (server + client, its default TCP transport without
//! TLS, a plain port forward) and bore (server + `bore local`, no TLS, one
//! new control connection per proxied connection). Both processes of each
//! count (CPU, RSS).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::proxy::Proxy;
use crate::scenario::Opts;

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
            // The IP too: upstream's agent verifies the address it dials.
            vec!["tunnel.bench".to_string(), "127.0.0.1".to_string()]
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
async fn until_through(addr: &crate::workload::Target, connect: bool) -> anyhow::Result<()> {
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

/// The directory of the upstream Konnectivity binaries: `KONNECTIVITY_BIN`,
/// or where scripts/install-peers unpacks them.
fn konnectivity_bin(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = match std::env::var("KONNECTIVITY_BIN") {
        Ok(d) => std::path::PathBuf::from(d),
        Err(_) => std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(".cache/seedlink/konnectivity-4f8517c1-linux-amd64"),
    };
    let p = dir.join(name);
    if !p.is_file() {
        bail!(
            "{} not found: run scripts/install-peers (it unpacks shared/konnectivity/) or set KONNECTIVITY_BIN",
            p.display()
        );
    }
    Ok(p)
}

/// Worker threads per tunnel process, the same for every target so that
/// CPU and wake-up figures compare: seedlink's and the Rust peers' tokio
/// runtimes (`TOKIO_WORKER_THREADS`, which `#[tokio::main]` honours) and
/// the Go peers' `GOMAXPROCS`. `BENCH_TUNNEL_THREADS`, default 1 (checked
/// by [`check_tunnel_threads`] before anything starts). With 1, seedlink's
/// tunnel roles run tokio's current-thread runtime (their default), while
/// `#[tokio::main]` in rathole and bore still builds the multi-thread
/// runtime: one worker plus the main thread, which runs whatever their
/// `main` awaits (bore's accept loops) — each design's own shape.
pub fn tunnel_threads() -> String {
    std::env::var("BENCH_TUNNEL_THREADS").unwrap_or_else(|_| "1".into())
}

/// Fails unless `BENCH_TUNNEL_THREADS` is unset or a positive integer: a
/// bad value would make tokio panic in the Rust peers, be ignored by Go
/// and fall back in seedlink, so the targets would run unequal.
pub fn check_tunnel_threads() -> anyhow::Result<()> {
    let v = tunnel_threads();
    v.parse::<std::num::NonZeroUsize>()
        .map_err(|_| anyhow::anyhow!("BENCH_TUNNEL_THREADS={v:?}: must be a positive integer"))?;
    Ok(())
}

/// Starts a Go program with `args`, its output discarded, on as many
/// threads as seedlink's tunnel processes get.
fn go_quiet(bin: std::path::PathBuf, args: &[String]) -> anyhow::Result<Child> {
    Ok(Command::new(bin)
        .args(args)
        .env("GOMAXPROCS", tunnel_threads())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?)
}

/// The first of `candidates` that is an executable on PATH or a path.
fn installed(candidates: &[&str]) -> Option<String> {
    candidates
        .iter()
        .find(|b| {
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {b}"))
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(|b| b.to_string())
}

/// Waits (20 s at most) until something accepts on `addr`.
async fn wait_listen(addr: &SocketAddr) -> anyhow::Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        if Instant::now() > end {
            bail!("nothing listens on {addr} after 20 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Starts `name` (seedlink, konnectivity, rathole or bore) forwarding to `backend`.
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
    let mut unix = None;
    let (server, agent, connect) = match name {
        "seedlink" | "seedlink-b" | "seedlink-grpc" => {
            // `seedlink-b`: a second build, for an interleaved A/B run;
            // `seedlink-grpc`: this build with its agent on gRPC (the
            // transport before issue 28's native one).
            let transport: &[&str] = match name {
                "seedlink-grpc" => &["--transport", "grpc"],
                _ => &[],
            };
            let bin = match name {
                "seedlink-b" => opts
                    .seedlink_b
                    .clone()
                    .ok_or_else(|| anyhow::anyhow!("seedlink-b needs --seedlink-b <binary>"))?,
                _ => opts.seedlink.clone(),
            };
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
            let mut s = Command::new(&bin)
                .args(["tunnel-server", "--config"])
                .arg(d.join("server.yaml"))
                .env("RUST_LOG", "error")
                .env(
                    "TOKIO_WORKER_THREADS",
                    tunnel_threads(),
                )
                .stdout(Stdio::piped())
                .spawn()?;
            ready(&mut s, "tunnel-server")?;
            let mut a = Command::new(&bin)
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
                .args(["--admin", "127.0.0.1:0", "--deny-cidr", "169.254.0.0/16"])
                .args(transport)
                .env("RUST_LOG", "error")
                .env(
                    "TOKIO_WORKER_THREADS",
                    tunnel_threads(),
                )
                .stdout(Stdio::piped())
                .spawn()?;
            ready(&mut a, "tunnel-agent")?;
            (s, a, true)
        }
        "konnectivity" => {
            pki(&d)?;
            let p = |f: &str| d.join(f).display().to_string();
            let uds = d.join("konnectivity.sock");
            let (health, admin) = (free_port()?, free_port()?);
            let s = go_quiet(
                konnectivity_bin("proxy-server")?,
                &[
                    "--mode=http-connect".to_string(),
                    format!("--uds-name={}", uds.display()),
                    "--server-port=0".into(),
                    format!("--agent-port={ctrl}"),
                    "--agent-bind-address=127.0.0.1".into(),
                    format!("--cluster-cert={}", p("server.pem")),
                    format!("--cluster-key={}", p("server-key.pem")),
                    format!("--cluster-ca-cert={}", p("ca.pem")),
                    "--server-id=bench".into(),
                    "--server-count=1".into(),
                    format!("--health-port={health}"),
                    "--health-bind-address=127.0.0.1".into(),
                    format!("--admin-port={admin}"),
                    "--admin-bind-address=127.0.0.1".into(),
                    "--proxy-strategies=default".into(),
                    "-v=0".into(),
                ],
            )?;
            let (ahealth, aadmin) = (free_port()?, free_port()?);
            let a = go_quiet(
                konnectivity_bin("proxy-agent")?,
                &[
                    "--proxy-server-host=127.0.0.1".to_string(),
                    format!("--proxy-server-port={ctrl}"),
                    format!("--ca-cert={}", p("ca.pem")),
                    format!("--agent-cert={}", p("agent.pem")),
                    format!("--agent-key={}", p("agent-key.pem")),
                    "--agent-id=bench".into(),
                    format!("--admin-server-port={aadmin}"),
                    format!("--health-server-port={ahealth}"),
                    "--sync-interval=200ms".into(),
                    "--sync-interval-cap=2s".into(),
                    "-v=0".into(),
                ],
            )?;
            unix = Some(uds);
            (s, a, true)
        }
        "bore" => {
            let bin = installed(&["bore", "/opt/bore/bin/bore"])
                .context("`bore` is not installed; run scripts/install-peers --bench")?;
            // bore's control port is fixed (7835), so every instance gets its
            // own loopback address; the public port is the frontend's.
            let ip = format!("127.0.2.{}", idx % 250 + 1);
            let addr_b: SocketAddr = format!("{ip}:{front}").parse()?;
            let s = Command::new(&bin)
                .args(["server", "--bind-addr", &ip, "--min-port", "1024"])
                .env("RUST_LOG", "error")
                .env("TOKIO_WORKER_THREADS", tunnel_threads())
                .stdout(Stdio::null())
                .spawn()?;
            wait_listen(&format!("{ip}:7835").parse()?).await?;
            let a = Command::new(&bin)
                .args(["local", &backend.port().to_string(), "--local-host"])
                .arg(backend.ip().to_string())
                .args(["--to", &ip, "--port", &front.to_string()])
                .env("RUST_LOG", "error")
                .env("TOKIO_WORKER_THREADS", tunnel_threads())
                .stdout(Stdio::null())
                .spawn()?;
            let mut p = Proxy::from_children(s, vec![a], addr_b, false);
            p.unix = None;
            until_through(&p.target(), false).await?;
            return Ok(p);
        }
        "rathole" => {
            let bin = installed(&["rathole", "/opt/rathole/bin/rathole"])
                .context("`rathole` is not installed; run scripts/install-peers --bench")?;
            std::fs::write(
                d.join("server.toml"),
                format!("[server]\nbind_addr = \"127.0.0.1:{ctrl}\"\n[server.services.bench]\ntoken = \"bench\"\nbind_addr = \"{addr}\"\n"),
            )?;
            std::fs::write(
                d.join("client.toml"),
                format!("[client]\nremote_addr = \"127.0.0.1:{ctrl}\"\n[client.services.bench]\ntoken = \"bench\"\nlocal_addr = \"{backend}\"\n"),
            )?;
            let s = Command::new(&bin)
                .arg(d.join("server.toml"))
                .env("RUST_LOG", "error")
                .env("TOKIO_WORKER_THREADS", tunnel_threads())
                .stdout(Stdio::null())
                .spawn()?;
            // The client retries with back-off if the server is not up
            // yet; wait for the control port instead of a fixed delay.
            wait_listen(&format!("127.0.0.1:{ctrl}").parse()?).await?;
            let a = Command::new(bin)
                .arg(d.join("client.toml"))
                .env("RUST_LOG", "error")
                .env("TOKIO_WORKER_THREADS", tunnel_threads())
                .stdout(Stdio::null())
                .spawn()?;
            (s, a, false)
        }
        other => bail!(
            "{other} is not a reverse tunnel; the tunnel scenario compares seedlink, konnectivity, rathole and bore"
        ),
    };
    let mut p = Proxy::from_children(server, vec![agent], addr, connect);
    p.unix = unix;
    p.keeps_pipelined = name.starts_with("seedlink");
    until_through(&p.target(), connect).await?;
    Ok(p)
}
