//! The replica-restart scenario (`--scenario tunnel-restart`): two seedlink
//! tunnel-server replicas, A and B, each serving --clusters clusters (a
//! client CA and a Unix-socket frontend each), and two agents per cluster,
//! each holding a stream to both replicas, as a seedlink agent does when
//! the servers advertise their addresses (here two in-process `Agent`s per
//! agent, one per replica, with the same agent ID and certificate, and the
//! agent's default reconnect back-off).
//!
//! Each round kills A (SIGKILL: a node lost or an OOM kill, the worst
//! case; a rollout drains first) and starts it again on the same agent
//! port, and measures from the kill:
//! - until the new A prints its ready line;
//! - until every agent's stream to it is back (its `agents` gauge);
//! - until every cluster is dialable through it (one dial through each
//!   cluster's frontend, failures tried again).
//!
//! Meanwhile dials go through B's frontends, 100 a second spread over the clusters: the
//! other replica's tenants. Their p50 and p99 during the recovery are
//! compared with the same dials before the kill (quiet).
//!
//! On this host the agents' client side would take the cores the servers
//! need: the agents of A run on a thread of their own at nice 19 (in a
//! seed their TLS handshakes are the shoots' nodes' work), those of B on
//! another thread at normal priority (they carry the measured dials).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use seedlink_tunnel::agent::Agent;
use tokio_util::sync::CancellationToken;

use crate::scenario::Opts;
use crate::tunnel_scale::{
    admin_get, bench_agent, dial_once, issue, metric_sum, pct, start_server, write,
};

/// How long anything here waits for seedlink (a bound, not a figure).
const WAIT: Duration = Duration::from_secs(120);
/// Dials through B before the kill, per round.
const QUIET_DIALS: usize = 400;
/// The pace of the dials through B: what kube-apiservers' logs, exec,
/// port-forwards and webhooks ask of one replica, not a load of its own
/// (an open loop would take the cores the recovery needs).
const DIALS_PER_SEC: u32 = 100;

/// What the servers and agents are made of: the server's files, and each
/// cluster's CA and agent certificate files.
struct Pki {
    server_ca: PathBuf,
    server: (String, String),
    clusters: Vec<(String, PathBuf, PathBuf)>,
}

impl Pki {
    fn issue(n: usize, dir: &Path) -> anyhow::Result<Pki> {
        let (ca, server) = issue("bench server CA", true)?;
        let server_ca = PathBuf::from(write(dir, "server-ca.pem", &ca)?);
        let server = (
            write(dir, "server.pem", &server.cert)?,
            write(dir, "server-key.pem", &server.key)?,
        );
        let mut clusters = Vec::with_capacity(n);
        for i in 0..n {
            let (ca, client) = issue(&format!("cluster {i} agents"), false)?;
            clusters.push((
                write(dir, &format!("ca-{i}.pem"), &ca)?,
                PathBuf::from(write(dir, &format!("agent-{i}.pem"), &client.cert)?),
                PathBuf::from(write(dir, &format!("agent-{i}-key.pem"), &client.key)?),
            ));
        }
        Ok(Pki {
            server_ca,
            server,
            clusters,
        })
    }
}

/// One replica's process, its admin address and its clusters' sockets.
struct Replica {
    child: Child,
    admin: String,
    sockets: Vec<PathBuf>,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Replica {
    /// Starts replica `name` (its sockets under `name`) on agent port
    /// `port`.
    async fn start(
        opts: &Opts,
        pki: &Pki,
        dir: &Path,
        name: &str,
        port: u16,
    ) -> anyhow::Result<Replica> {
        let (crt, key) = &pki.server;
        let mut yaml = format!(
            // Every in-process agent connects from loopback: the
            // per-source caps would hold the bed below its size. The
            // server-wide ones are the defaults (1,024 unauthenticated at
            // once: a reconnecting crowd past it is refused at accept and
            // backs off).
            "agents: {{listen: '127.0.0.1:{port}', cert: '{crt}', key: '{key}', max_per_source: 10000, max_unauthenticated_per_source: 1024, handshakes_per_source: 0}}\nadmin: {{listen: '127.0.0.1:0'}}\nclusters:\n"
        );
        let mut sockets = Vec::with_capacity(pki.clusters.len());
        for (i, (ca, _, _)) in pki.clusters.iter().enumerate() {
            let sock = dir.join(format!("{name}-{i}.sock"));
            yaml.push_str(&format!(
                "  - {{name: c{i}, agent_ca: '{ca}', frontends: [{{name: kas, protocol: http-connect, unix: '{}'}}]}}\n",
                sock.display()
            ));
            sockets.push(sock);
        }
        let config = dir.join(format!("{name}.yaml"));
        std::fs::write(&config, yaml)?;
        let (child, admin, _) = start_server(&opts.seedlink, &config, None).await?;
        Ok(Replica {
            child,
            admin,
            sockets,
        })
    }

    /// The agent streams it holds.
    async fn agents(&self) -> f64 {
        let m = admin_get(&self.admin, "/metrics").await.unwrap_or_default();
        metric_sum(&m, "seedlink_tunnel_server_agents{")
    }

    /// Waits until it holds `want` agent streams.
    async fn wait_agents(&self, want: f64) -> anyhow::Result<()> {
        let end = Instant::now() + WAIT;
        while self.agents().await < want {
            if Instant::now() > end {
                bail!("only {} of {want} agent streams", self.agents().await);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Dials once through every cluster's frontend, each failure tried
    /// again until it succeeds.
    async fn dial_every_cluster(&self, backend: SocketAddr) -> anyhow::Result<()> {
        let end = Instant::now() + WAIT;
        for sock in &self.sockets {
            while dial_once(sock, backend).await.is_err() {
                if Instant::now() > end {
                    bail!("{} not dialable", sock.display());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }
}

/// An agent's stream to the replica at `server`, with the agent's
/// default back-off: a lost stream is dialled again at once, then after
/// 1 s growing ×1.5 up to 10 s.
fn agent(pki: &Pki, i: usize, j: usize, server: SocketAddr) -> anyhow::Result<Arc<Agent>> {
    let (_, cert, key) = &pki.clusters[i];
    bench_agent(
        server.to_string(),
        &pki.server_ca,
        (cert.clone(), key.clone()),
        format!("c{i}-a{j}"),
        (Duration::from_secs(1), Duration::from_secs(10)),
    )
}

/// Runs every agent's stream to `server` on a thread of its own (at nice
/// 19 when `low`) until `stop`.
fn run_agents(
    pki: &Arc<Pki>,
    server: SocketAddr,
    low: bool,
    stop: CancellationToken,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let mut agents = Vec::with_capacity(2 * pki.clusters.len());
    for i in 0..pki.clusters.len() {
        for j in 0..2 {
            agents.push(agent(pki, i, j, server)?);
        }
    }
    Ok(std::thread::spawn(move || {
        if low {
            crate::tunnel_flood::lowest_priority();
        }
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            eprintln!("bench: no runtime for the agents");
            return;
        };
        rt.block_on(async move {
            for a in &agents {
                let run = a.clone();
                tokio::spawn(async move { run.run().await });
            }
            stop.cancelled().await;
            for a in &agents {
                a.shutdown.cancel();
            }
        });
    }))
}

/// A free loopback port (for a replica that must come back on its own).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Dials through `sockets`, spread over the clusters, [`DIALS_PER_SEC`]
/// a second, until `stop` or `most` dials: the latencies (µs).
async fn dial_loop(
    sockets: Vec<PathBuf>,
    backend: SocketAddr,
    most: usize,
    stop: CancellationToken,
) -> anyhow::Result<Vec<f64>> {
    let mut lat = Vec::new();
    let mut k = 0usize;
    let mut tick = tokio::time::interval(Duration::from_secs(1) / DIALS_PER_SEC);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while lat.len() < most && !stop.is_cancelled() {
        tick.tick().await;
        k += 1;
        let c = (k * 7919) % sockets.len();
        lat.push(dial_once(&sockets[c], backend).await?);
    }
    Ok(lat)
}

/// One restart's figures (seconds from the kill; µs for dials).
struct Round {
    up: f64,
    back: f64,
    dialable: f64,
    quiet: (f64, f64),
    during: (f64, f64),
    during_dials: usize,
}

/// Kills `a` and starts it again: the new replica and the figures.
async fn restart(
    opts: &Opts,
    pki: &Pki,
    dir: &Path,
    (a, port, round): (Replica, u16, usize),
    b: &Replica,
    backend: SocketAddr,
) -> anyhow::Result<(Replica, Round)> {
    let want = (2 * pki.clusters.len()) as f64;
    let mut quiet = dial_loop(
        b.sockets.clone(),
        backend,
        QUIET_DIALS,
        CancellationToken::new(),
    )
    .await?;
    let stop = CancellationToken::new();
    let _during = stop.clone().drop_guard();
    let during = tokio::spawn(dial_loop(
        b.sockets.clone(),
        backend,
        usize::MAX,
        stop.clone(),
    ));
    let killed = Instant::now();
    drop(a);
    let a = Replica::start(opts, pki, dir, &format!("a{round}"), port).await?;
    let up = killed.elapsed().as_secs_f64();
    a.wait_agents(want).await?;
    let back = killed.elapsed().as_secs_f64();
    a.dial_every_cluster(backend).await?;
    let dialable = killed.elapsed().as_secs_f64();
    stop.cancel();
    let mut during = during.await??;
    let round = Round {
        up,
        back,
        dialable,
        quiet: (pct(&mut quiet, 0.5), pct(&mut quiet, 0.99)),
        during: (pct(&mut during, 0.5), pct(&mut during, 0.99)),
        during_dials: during.len(),
    };
    Ok((a, round))
}

/// Runs the scenario and prints its table.
pub async fn run(opts: &Opts, backend: SocketAddr) -> anyhow::Result<()> {
    let rounds = restarts(opts, backend).await?;
    print(opts.clusters, &rounds);
    Ok(())
}

/// Starts the bed and restarts A `opts.rounds` times: each restart's
/// figures.
async fn restarts(opts: &Opts, backend: SocketAddr) -> anyhow::Result<Vec<Round>> {
    let n = opts.clusters;
    anyhow::ensure!(n > 0, "--clusters: at least 1");
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    let pki = Arc::new(Pki::issue(n, dir.path())?);
    eprintln!(
        "bench: {n} clusters' certificates in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let (port_a, port_b) = (free_port()?, free_port()?);
    let mut a = Replica::start(opts, &pki, dir.path(), "a", port_a).await?;
    let b = Replica::start(opts, &pki, dir.path(), "b", port_b).await?;
    let stop = CancellationToken::new();
    // The agents stop however this ends.
    let _agents = stop.clone().drop_guard();
    let at = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    let threads = [
        run_agents(&pki, at(port_a), true, stop.clone())?,
        run_agents(&pki, at(port_b), false, stop.clone())?,
    ];
    let want = (2 * n) as f64;
    a.wait_agents(want).await.context("replica A")?;
    b.wait_agents(want).await.context("replica B")?;
    eprintln!(
        "bench: {} agent streams on each replica after {:.1} s",
        2 * n,
        started.elapsed().as_secs_f64()
    );
    let mut rounds = Vec::new();
    for r in 0..opts.rounds {
        let (next, round) = restart(opts, &pki, dir.path(), (a, port_a, r), &b, backend).await?;
        a = next;
        eprintln!(
            "bench: round {}: up {:.2} s, agents back {:.2} s, every cluster dialable {:.2} s; B's dials p99 quiet {:.0} µs, during {:.0} µs ({} dials)",
            r + 1,
            round.up,
            round.back,
            round.dialable,
            round.quiet.1,
            round.during.1,
            round.during_dials
        );
        rounds.push(round);
    }
    stop.cancel();
    for t in threads {
        let _ = t.join();
    }
    Ok(rounds)
}

fn print(n: usize, rounds: &[Round]) {
    let med = |f: &dyn Fn(&Round) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        pct(&mut v, 0.5)
    };
    println!(
        "\n## seedlink-bench (tunnel-restart): medians of {} restarts, {n} clusters, 2 agents each holding a stream to both replicas\n",
        rounds.len()
    );
    println!("| agents | replica A killed → ready | → every agent back | → every cluster dialable | B's dial p50 quiet / during | B's dial p99 quiet / during | p99 ratio |");
    println!("|---|---|---|---|---|---|---|");
    let (q99, d99) = (med(&|r| r.quiet.1), med(&|r| r.during.1));
    println!(
        "| {} | {:.2} s | {:.2} s | {:.2} s | {:.0} / {:.0} µs | {:.0} / {:.0} µs | {:.2}× |",
        2 * n,
        med(&|r| r.up),
        med(&|r| r.back),
        med(&|r| r.dialable),
        med(&|r| r.quiet.0),
        med(&|r| r.during.0),
        q99,
        d99,
        d99 / q99
    );
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    /// The CI profile of this bench: 50 clusters, one restart, the debug
    /// build. What it asserts is behaviour (every agent's stream back to
    /// the restarted replica and every cluster dialable through it within
    /// the bench's wait, and the other replica's dials never failing); its
    /// figures are printed, not judged (docs/PERFORMANCE.md has the
    /// release build's at 1,000 clusters).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_replica_gets_every_agent_back() {
        let opts = crate::scenario::Opts::parse_from([
            "seedlink-bench",
            "--scenario",
            "tunnel-restart",
            "--clusters",
            "50",
            "--rounds",
            "1",
            "--seedlink",
            seedlink_testkit::seedlink_bin(),
        ]);
        let backend = crate::workload::Backend::start().await.unwrap();
        let rounds = super::restarts(&opts, backend.addr).await.unwrap();
        super::print(opts.clusters, &rounds);
        assert_eq!(rounds.len(), 1);
        assert!(rounds[0].during_dials > 0);
    }
}
