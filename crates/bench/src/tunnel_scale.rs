//! The many-clusters scenario (`--scenario tunnel-scale`): one seedlink
//! tunnel-server process with N clusters (each its own client CA and Unix
//! socket frontend) and two agents per cluster, simulated in this process
//! (seedlink's own `Agent`, one TLS + HTTP/2 stream each, as a real agent
//! holds). Measured: the server's RSS per idle agent stream, this process's
//! RSS per in-process agent, and CONNECT-to-first-byte latency of dials
//! spread over random clusters, against a one-cluster server measured the
//! same way in the same rounds.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use seedlink_tunnel::agent::{Agent, AgentOptions};
use seedlink_tunnel::grpc::H2Settings;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::scenario::Opts;
use crate::workload::HELLO;

/// PEM text of a certificate and its key.
pub(crate) struct Leaf {
    pub(crate) cert: String,
    pub(crate) key: String,
}

/// A CA and one certificate it issued (server or client).
pub(crate) fn issue(name: &str, server: bool) -> anyhow::Result<(String, Leaf)> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, name);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(if server {
        vec!["tunnel.bench".to_string()]
    } else {
        vec![]
    })?;
    p.extended_key_usages = vec![if server {
        ExtendedKeyUsagePurpose::ServerAuth
    } else {
        ExtendedKeyUsagePurpose::ClientAuth
    }];
    let cert = p.signed_by(&key, &issuer)?;
    Ok((
        ca_cert.pem(),
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        },
    ))
}

/// One server with `n` clusters and two in-process agents per cluster.
struct Bed {
    child: Child,
    admin: String,
    sockets: Vec<PathBuf>,
    agents: Vec<Arc<Agent>>,
    server_kib_per_agent: f64,
    bench_kib_per_agent: f64,
}

impl Drop for Bed {
    fn drop(&mut self) {
        for a in &self.agents {
            a.shutdown.cancel();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `seedlink tunnel-server` on `config` (on `workers` worker
/// threads, or its default) and reads its ready line: the process, its
/// admin address and its agent port.
pub(crate) async fn start_server(
    seedlink: &Path,
    config: &Path,
    workers: Option<&str>,
) -> anyhow::Result<(Child, String, SocketAddr)> {
    start_server_with(seedlink, config, workers, &[], None).await
}

/// [`start_server`] with more environment variables, and on CPU `cpu`
/// only when given (through `taskset`, which execs it: the same process).
pub(crate) async fn start_server_with(
    seedlink: &Path,
    config: &Path,
    workers: Option<&str>,
    env: &[(&str, std::ffi::OsString)],
    cpu: Option<u32>,
) -> anyhow::Result<(Child, String, SocketAddr)> {
    let mut cmd = match cpu {
        None => Command::new(seedlink),
        Some(c) => {
            let mut t = Command::new("taskset");
            t.args(["-c", &c.to_string()]).arg(seedlink);
            t
        }
    };
    cmd.args(["tunnel-server", "--config"])
        .arg(config)
        .env("RUST_LOG", "error")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped());
    match workers {
        Some(n) => cmd.env("TOKIO_WORKER_THREADS", n),
        None => cmd.env_remove("TOKIO_WORKER_THREADS"),
    };
    let mut child = cmd.spawn()?;
    let out = child.stdout.take().context("stdout")?;
    let read = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).map(|_| line)
    });
    let line = tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .context("tunnel-server ready line")???;
    let ready: serde_json::Value =
        serde_json::from_str(&line).with_context(|| format!("ready line {line:?}"))?;
    let admin = ready["admin"].as_str().context("admin")?.to_string();
    let agents_at: SocketAddr = ready["agents"].as_str().context("agents")?.parse()?;
    Ok((child, admin, agents_at))
}

/// A seedlink agent of this bench: to `server` (named `tunnel.bench`,
/// verified against `ca`) with `identity`, dialling loopback only; its
/// first reconnect delay and replica-discovery interval `sync`, its
/// largest `sync_cap`.
pub(crate) fn bench_agent(
    server: String,
    ca: &Path,
    identity: (PathBuf, PathBuf),
    agent_id: String,
    (sync, sync_cap): (Duration, Duration),
) -> anyhow::Result<Arc<Agent>> {
    Ok(Agent::new(AgentOptions {
        server,
        server_name: "tunnel.bench".into(),
        ca: ca.to_path_buf(),
        identity: Some(identity),
        alpn: Vec::new(),
        agent_id,
        identifiers: String::new(),
        token_path: None,
        allow: vec!["127.0.0.0/8".parse()?],
        allow_ports: Vec::new(),
        deny: Vec::new(),
        dial_timeout: Duration::from_secs(5),
        sync_interval: sync,
        sync_interval_cap: sync_cap,
        keepalive: H2Settings {
            keepalive: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
        },
        stall_timeout: Duration::from_secs(10),
        queue_bytes: 4 * 1024 * 1024,
        flow_control: true,
        native: true,
        replica_addresses: true,
        egress: None,
    })?)
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<String> {
    let p = dir.join(name);
    std::fs::write(&p, text)?;
    Ok(p.display().to_string())
}

pub(crate) async fn admin_get(admin: &str, path: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(admin).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out)).await??;
    Ok(out)
}

pub(crate) fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl Bed {
    async fn start(opts: &Opts, n: usize, dir: &Path) -> anyhow::Result<Bed> {
        std::fs::create_dir_all(dir)?;
        let (server_ca, server) = issue("bench server CA", true)?;
        let ca_path = write(dir, "server-ca.pem", &server_ca)?;
        let crt = write(dir, "server.pem", &server.cert)?;
        let key = write(dir, "server-key.pem", &server.key)?;
        let mut yaml = format!(
            // Every in-process agent connects from loopback: the per-source
            // cap (256 by default) would hold the bed below its size.
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}', max_per_source: 10000, max_unauthenticated: 10000, max_unauthenticated_per_source: 10000, handshakes_per_source: 0}}\nadmin: {{listen: '127.0.0.1:0'}}\nclusters:\n"
        );
        let mut idents = Vec::new();
        let mut sockets = Vec::new();
        for i in 0..n {
            let (ca, client) = issue(&format!("cluster {i} agents"), false)?;
            let ca = write(dir, &format!("ca-{i}.pem"), &ca)?;
            let c = PathBuf::from(write(dir, &format!("agent-{i}.pem"), &client.cert)?);
            let k = PathBuf::from(write(dir, &format!("agent-{i}-key.pem"), &client.key)?);
            idents.push((c, k));
            let sock = dir.join(format!("kas-{i}.sock"));
            yaml.push_str(&format!(
                "  - {{name: c{i}, agent_ca: '{ca}', frontends: [{{name: kas, protocol: http-connect, unix: '{}'}}]}}\n",
                sock.display()
            ));
            sockets.push(sock);
        }
        std::fs::write(dir.join("server.yaml"), yaml)?;
        let (child, admin, agents_at) =
            start_server(&opts.seedlink, &dir.join("server.yaml"), Some("1")).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let pid = child.id();
        let server_rss0 = crate::procstat::rss_kib(&[pid]);
        let me = std::process::id();
        let bench_rss0 = crate::procstat::rss_kib(&[me]);
        let mut agents = Vec::new();
        for (i, (c, k)) in idents.iter().enumerate() {
            for j in 0..2 {
                let a = bench_agent(
                    agents_at.to_string(),
                    Path::new(&ca_path),
                    (c.clone(), k.clone()),
                    format!("c{i}-a{j}"),
                    // Replica discovery off the measured path: once a minute.
                    (Duration::from_secs(60), Duration::from_secs(60)),
                )?;
                let run = a.clone();
                tokio::spawn(async move { run.run().await });
                agents.push(a);
            }
        }
        let want = (2 * n) as f64;
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let m = admin_get(&admin, "/metrics").await.unwrap_or_default();
            if metric_sum(&m, "seedlink_tunnel_server_agents{") >= want {
                break;
            }
            if Instant::now() > end {
                bail!(
                    "only {} of {want} agent streams after 60 s",
                    metric_sum(&m, "seedlink_tunnel_server_agents{")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Idle, not just connected: the server's trimming thread (every
        // 10 s) has returned what the 400 handshakes freed, as it does for
        // any server soon after agents connect.
        tokio::time::sleep(seedlink_net::memtrim::PERIOD + Duration::from_secs(2)).await;
        let server_kib_per_agent = (crate::procstat::rss_kib(&[pid]) - server_rss0) / want;
        let bench_kib_per_agent = (crate::procstat::rss_kib(&[me]) - bench_rss0) / want;
        Ok(Bed {
            child,
            admin,
            sockets,
            agents,
            server_kib_per_agent,
            bench_kib_per_agent,
        })
    }
}

/// CONNECT on `sock` to `target`, then the backend's first byte: µs.
pub(crate) async fn dial_once(sock: &Path, target: SocketAddr) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut s = UnixStream::connect(sock).await?;
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    let mut head = Vec::with_capacity(64);
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await?? == 0
            || head.len() > 1024
        {
            bail!("tunnel refused: {}", String::from_utf8_lossy(&head));
        }
        head.push(b[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("tunnel refused: {}", String::from_utf8_lossy(&head));
    }
    let mut msg = HELLO.to_vec();
    msg.push(b'C');
    s.write_all(&msg).await?;
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut b)).await??;
    Ok(t0.elapsed().as_secs_f64() * 1e6)
}

pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the scenario and prints its table.
pub async fn run(opts: &Opts, backend: SocketAddr) -> anyhow::Result<()> {
    let n = opts.clusters;
    let dir = tempfile::tempdir()?;
    let dials = opts.latency_conns.max(100);
    type Row = (usize, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut rows: Vec<Row> = [1usize, n]
        .iter()
        .map(|&size| (size, Vec::new(), Vec::new(), Vec::new(), Vec::new()))
        .collect();
    for round in 0..opts.rounds {
        // Alternate which size runs first.
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        for k in order {
            let size = rows[k].0;
            let bed = Bed::start(opts, size, &dir.path().join(format!("r{round}-n{size}"))).await?;
            let mut lat = Vec::with_capacity(dials);
            for i in 0..dials {
                // Spread over the clusters: a different tenant each time.
                let c = (i * 7919 + round) % bed.sockets.len();
                lat.push(dial_once(&bed.sockets[c], backend).await?);
            }
            let p50 = pct(&mut lat, 0.5);
            let p99 = pct(&mut lat, 0.99);
            eprintln!(
                "bench: round {} {size} clusters: server {:.1} KiB/agent, in-process agent {:.1} KiB, dial p50 {p50:.0} µs p99 {p99:.0} µs",
                round + 1,
                bed.server_kib_per_agent,
                bed.bench_kib_per_agent
            );
            let m = admin_get(&bed.admin, "/metrics").await.unwrap_or_default();
            let failed = metric_sum(&m, "seedlink_tunnel_server_dial_failures_total{");
            if failed > 0.0 {
                bail!("{failed} dials failed in the {size}-cluster run");
            }
            rows[k].1.push(bed.server_kib_per_agent);
            rows[k].2.push(p50);
            rows[k].3.push(p99);
            rows[k].4.push(bed.bench_kib_per_agent);
            drop(bed);
            // Let the stopped agents' tasks wind down before the next bed.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        pct(&mut v, 0.5)
    };
    println!(
        "\n## seedlink-bench (tunnel-scale): medians of {} rounds, {dials} dials each over random clusters, 2 agents per cluster\n",
        opts.rounds
    );
    println!(
        "| clusters | agent streams | server RSS KiB per idle agent | dial p50 µs | dial p99 µs |"
    );
    println!("|---|---|---|---|---|");
    for (size, kib, p50, p99, _) in &rows {
        println!(
            "| {size} | {} | {:.1} | {:.0} | {:.0} |",
            2 * size,
            med(kib),
            med(p50),
            med(p99)
        );
    }
    // This process's own growth per in-process agent is printed per round
    // (stderr) only: after the first round the allocator reuses what the
    // previous round's agents freed, so later figures understate it.
    let (one, many) = (&rows[0], &rows[1]);
    println!(
        "\n{n} clusters vs 1: dial p50 {:.2}×, p99 {:.2}×",
        med(&many.2) / med(&one.2),
        med(&many.3) / med(&one.3)
    );
    Ok(())
}
