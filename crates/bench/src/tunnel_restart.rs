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
//! With `--source kubernetes` the replicas read their clusters from a real
//! kube-apiserver (the test kit's, watch cache on) instead of a file: each
//! cluster a namespace with its TunnelCluster, the trust ConfigMap of its
//! agents' CA and the RoleBinding that lets the install read it; each
//! replica runs as the install's ServiceAccount and watches the trust per
//! namespace (the default), and a restarted replica starts with an empty
//! `trust_dir`, as a new pod does. Its restart then includes reading every
//! TunnelCluster and its trust before it knows any agent.
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
use futures_util::StreamExt;
use seedlink_testkit::kubeapi::KubeApi;
use seedlink_tunnel::agent::Agent;
use tokio_util::sync::CancellationToken;

use crate::kube_scale::{self, SYS};
use crate::scenario::Opts;
use crate::tunnel_scale::{
    admin_get, bench_agent, dial_once, issue, metric_sum, pct, start_server_with, write,
};

/// How long anything here waits for seedlink (a bound, not a figure).
const WAIT: Duration = Duration::from_secs(120);
/// Dials through B before the kill, per round (ten seconds of them: the
/// p99 of a thousand).
const QUIET_DIALS: usize = 1000;
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

/// Where the replicas read their clusters (`--source`).
enum Source {
    /// A `clusters` list in each replica's file.
    File,
    /// TunnelClusters on this API server, read with this ServiceAccount
    /// token.
    Kubernetes { api: Box<KubeApi>, token: String },
}

impl Source {
    /// `--source`: for `kubernetes`, an API server holding every
    /// cluster's objects.
    async fn of(opts: &Opts, pki: &Pki) -> anyhow::Result<Source> {
        match opts.source.as_str() {
            "file" => Ok(Source::File),
            "kubernetes" => kube_source(pki).await,
            other => bail!("--source {other:?}: use file or kubernetes"),
        }
    }
}

/// An API server with cluster `i`'s namespace holding its TunnelCluster,
/// its agents' CA as the trust ConfigMap and the RoleBinding to read it,
/// and the install's RBAC: the source and the install's token.
async fn kube_source(pki: &Pki) -> anyhow::Result<Source> {
    let started = Instant::now();
    let api = kube_scale::api_server().await?;
    let client = api.client().await?;
    let sys =
        serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYS}});
    kube_scale::apply(&client, sys).await?;
    let token = api.install_rbac(&client, SYS).await;
    let cas: Vec<String> = pki.clusters.iter().map(|(ca, _, _)| ca.clone()).collect();
    let written: Vec<anyhow::Result<()>> = futures_util::stream::iter(cas.into_iter().enumerate())
        .map(|(i, ca)| write_cluster(client.clone(), i, ca))
        .buffer_unordered(16)
        .collect()
        .await;
    written.into_iter().collect::<anyhow::Result<()>>()?;
    eprintln!(
        "bench: {} TunnelClusters written in {:.1} s",
        pki.clusters.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(Source::Kubernetes {
        api: Box::new(api),
        token,
    })
}

/// Cluster `i`'s namespace, RoleBinding, trust (the CA at `ca`) and
/// TunnelCluster.
async fn write_cluster(client: kube::Client, i: usize, ca: String) -> anyhow::Result<()> {
    let ns = kube_scale::ns(i);
    let ca = std::fs::read_to_string(ca)?;
    let namespace =
        serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
    for o in [
        namespace,
        kube_scale::trust_binding(&ns),
        kube_scale::trust_of(&ns, &ca),
        kube_scale::tunnel_cluster(&ns),
    ] {
        kube_scale::apply(&client, o).await?;
    }
    Ok(())
}

/// What every replica is started from.
struct Bed {
    pki: Arc<Pki>,
    dir: PathBuf,
    source: Source,
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
    async fn start(opts: &Opts, bed: &Bed, name: &str, port: u16) -> anyhow::Result<Replica> {
        let (pki, dir) = (&bed.pki, bed.dir.as_path());
        let (crt, key) = &pki.server;
        let mut yaml = format!(
            // Every in-process agent connects from loopback: the
            // per-source caps would hold the bed below its size. The
            // server-wide ones are the defaults (1,024 unauthenticated at
            // once: a reconnecting crowd past it is refused at accept and
            // backs off).
            "agents: {{listen: '127.0.0.1:{port}', cert: '{crt}', key: '{key}', max_per_source: 10000, max_unauthenticated_per_source: 1024, handshakes_per_source: 0}}\nadmin: {{listen: '127.0.0.1:0'}}\n"
        );
        if let Source::Kubernetes { api, token } = &bed.source {
            return Replica::start_kube(opts, bed, name, yaml, (api, token)).await;
        }
        yaml.push_str("clusters:\n");
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
        let cpu = opts.restarted_cpu.filter(|_| name.starts_with('a'));
        let (child, admin, _) = start_server_with(&opts.seedlink, &config, None, &[], cpu).await?;
        Ok(Replica {
            child,
            admin,
            sockets,
        })
    }

    /// [`Replica::start`] with the clusters from the API server: the
    /// frontends from a template, a `trust_dir` of its own (empty, as a
    /// new pod's), and pod name `tunnel-<first letter of name>`.
    async fn start_kube(
        opts: &Opts,
        bed: &Bed,
        name: &str,
        mut yaml: String,
        (api, token): (&KubeApi, &str),
    ) -> anyhow::Result<Replica> {
        let dir = bed.dir.as_path();
        yaml.push_str(&format!(
            "clusters: []\nfrontend_templates:\n  - {{name: kas, protocol: http-connect, unix: '{d}/{name}-{{cluster}}.sock'}}\nkubernetes: {{lease: {SYS}/seedlink-tunnel-status, trust_dir: '{d}/{name}-trust'}}\n",
            d = dir.display()
        ));
        let sockets = (0..bed.pki.clusters.len())
            .map(|i| dir.join(format!("{name}-{}.tunnel.sock", kube_scale::ns(i))))
            .collect();
        let config = dir.join(format!("{name}.yaml"));
        std::fs::write(&config, yaml)?;
        let pod = format!("tunnel-{}", name.chars().next().unwrap_or('x'));
        let env = [
            ("KUBECONFIG", api.kubeconfig(dir, name, token, None).into()),
            ("POD_NAME", pod.into()),
        ];
        let cpu = opts.restarted_cpu.filter(|_| name.starts_with('a'));
        let (child, admin, _) = start_server_with(&opts.seedlink, &config, None, &env, cpu).await?;
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
/// 19 when `low`, on CPU `cpu` only when given) until `stop`.
fn run_agents(
    pki: &Arc<Pki>,
    server: SocketAddr,
    (low, cpu): (bool, Option<u32>),
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
        if let Some(cpu) = cpu {
            pin_thread(cpu);
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

/// Keeps this thread (and the threads it starts) on CPU `cpu`.
fn pin_thread(cpu: u32) {
    if !set_cpus(0, |c| c == cpu) {
        eprintln!("bench: cannot keep the agents' thread on CPU {cpu}");
    }
}

/// Keeps every thread of this process (and what they start: the other
/// replica, the API server) off CPU `cpu`, on the others.
fn keep_off(cpu: u32) -> anyhow::Result<()> {
    anyhow::ensure!(set_cpus(0, |c| c != cpu), "cannot keep off CPU {cpu}");
    for task in std::fs::read_dir("/proc/self/task")? {
        let tid = task?.file_name().to_string_lossy().parse::<libc::pid_t>()?;
        // A thread that ended meanwhile cannot be placed, nor need be.
        let _ = set_cpus(tid, |c| c != cpu);
    }
    Ok(())
}

/// Places thread `tid` (0: this one) on the CPUs `on` admits (of the
/// first 64): whether it could.
#[allow(unsafe_code)]
fn set_cpus(tid: libc::pid_t, on: impl Fn(u32) -> bool) -> bool {
    let online = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: the set is a plain bitmask on this stack, CPU_SET writes
    // within it (every index is below 64 < CPU_SETSIZE), and
    // sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in (0..online.min(64)).filter(|&c| on(c as u32)) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
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
    bed: &Bed,
    (a, port, round): (Replica, u16, usize),
    b: &Replica,
    backend: SocketAddr,
) -> anyhow::Result<(Replica, Round)> {
    let want = (2 * bed.pki.clusters.len()) as f64;
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
    let a = Replica::start(opts, bed, &format!("a{round}"), port).await?;
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
    print(opts.clusters, &opts.source, &rounds);
    Ok(())
}

/// Starts the bed and restarts A `opts.rounds` times: each restart's
/// figures.
async fn restarts(opts: &Opts, backend: SocketAddr) -> anyhow::Result<Vec<Round>> {
    let n = opts.clusters;
    anyhow::ensure!(n > 0, "--clusters: at least 1");
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    if let Some(cpu) = opts.restarted_cpu {
        keep_off(cpu)?;
    }
    let pki = Arc::new(Pki::issue(n, dir.path())?);
    eprintln!(
        "bench: {n} clusters' certificates in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let bed = Bed {
        source: Source::of(opts, &pki).await?,
        pki: pki.clone(),
        dir: dir.path().to_path_buf(),
    };
    let (port_a, port_b) = (free_port()?, free_port()?);
    let mut a = Replica::start(opts, &bed, "a", port_a).await?;
    let b = Replica::start(opts, &bed, "b", port_b).await?;
    let stop = CancellationToken::new();
    // The agents stop however this ends.
    let _agents = stop.clone().drop_guard();
    let at = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    let threads = [
        run_agents(&pki, at(port_a), (true, opts.restarted_cpu), stop.clone())?,
        run_agents(&pki, at(port_b), (false, None), stop.clone())?,
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
        let (next, round) = restart(opts, &bed, (a, port_a, r), &b, backend).await?;
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

fn print(n: usize, source: &str, rounds: &[Round]) {
    let med = |f: &dyn Fn(&Round) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        pct(&mut v, 0.5)
    };
    println!(
        "\n## seedlink-bench (tunnel-restart): medians of {} restarts, {n} clusters (from {source}), 2 agents each holding a stream to both replicas\n",
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
        one_restart("file", 50).await;
    }

    /// One restart of a replica serving `clusters` clusters from
    /// `source`: the figures printed, behaviour asserted.
    async fn one_restart(source: &str, clusters: usize) {
        let clusters = clusters.to_string();
        let opts = crate::scenario::Opts::parse_from([
            "seedlink-bench",
            "--scenario",
            "tunnel-restart",
            "--source",
            source,
            "--clusters",
            &clusters,
            "--rounds",
            "1",
            "--seedlink",
            seedlink_testkit::seedlink_bin(),
        ]);
        let backend = crate::workload::Backend::start().await.unwrap();
        let rounds = super::restarts(&opts, backend.addr).await.unwrap();
        super::print(opts.clusters, &opts.source, &rounds);
        assert_eq!(rounds.len(), 1);
        assert!(rounds[0].during_dials > 0);
    }

    /// The same with the clusters from a real kube-apiserver (20
    /// TunnelClusters with their trust, per-namespace trust watches): the
    /// restarted replica reads them all again, then every agent's stream
    /// comes back and every cluster is dialable through it, while the
    /// other replica's dials never fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_replica_reading_kubernetes_gets_every_agent_back() {
        one_restart("kubernetes", 20).await;
    }
}
