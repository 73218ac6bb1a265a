//! The reconnect storm: what a seed's entry goes through when a load
//! balancer fails over or the gateway is rolled, and every kubelet,
//! controller and kubectl of every shoot reconnects at once.
//!
//! Each wave, `--storm-clients` clients connect at the same moment, each
//! with a ClientHello for one of `--storm-cps` control planes, and hold
//! their connection once the backend's first byte is through; when all
//! are in (or refused, or given up on after 10 s), all close at once and
//! the next wave waits until the backend has seen every close. Waves
//! rotate over the proxies, `--storm-waves` per proxy. Meanwhile
//! `--storm-probes` established connections time echo round trips: their
//! p99 before the wave (quiet) and while it runs (storm).
//!
//! The overload phase runs one wave against each proxy started with a
//! cap of `--storm-cap` connections: who is refused, how fast, and who is
//! left hanging.
//!
//! Loopback only; every client, wave and wait is bounded.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::procstat::rss_kib;
use crate::proxy::Proxy;
use crate::scenario::{Opts, STORM_BACKEND, STORM_CAP, STORM_CPS};
use crate::workload::{
    dial, hello_for, percentile, src_ip, Backend, Conn, Target, ECHO, HELLO, IDLE_OPEN,
    ONE_AND_IDLE,
};

/// How long a client waits for its first byte before it counts as hung.
const HANG: Duration = Duration::from_secs(10);

/// Whether a refusal's reason was printed (once per run).
static FIRST_REFUSAL: AtomicBool = AtomicBool::new(false);

/// One wave against one proxy.
#[derive(Debug, Default, Clone)]
struct Wave {
    /// From the wave's start until the last client got its first byte, ms.
    all_in_ms: f64,
    connected: usize,
    refused: usize,
    hung: usize,
    /// p99 of the clients' connect-to-first-byte, ms.
    connect_p99_ms: f64,
    /// p99 of the time until a refused client learned it, ms.
    refusal_p99_ms: Option<f64>,
    /// The proxy's peak RSS during the wave, above its RSS before, MiB.
    peak_mib: f64,
    /// Established connections' echo p99 before the wave, µs.
    quiet_p99_us: f64,
    /// ... and while it ran, µs.
    storm_p99_us: f64,
    /// The probes' and their echo backend's threads: time spent waiting
    /// for a CPU (runnable, not running; `/proc/…/schedstat`) per round
    /// trip, quiet and in the storm, µs.
    runq_quiet_us: f64,
    runq_storm_us: f64,
}

/// The probes' thread and the echo backend's thread (Linux thread IDs).
static PROBE_TIDS: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Records the calling thread as one whose run-queue wait is measured.
fn watch_this_thread() {
    // `/proc/thread-self` links to `<pid>/task/<tid>`.
    let own = std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse::<i32>().ok());
    if let (Some(tid), Ok(mut t)) = (own, PROBE_TIDS.lock()) {
        t.push(tid);
    }
}

/// The watched threads' total run-queue wait so far, µs.
fn runq_wait_us() -> f64 {
    let tids = PROBE_TIDS.lock().map(|t| t.clone()).unwrap_or_default();
    tids.iter()
        .filter_map(|t| std::fs::read_to_string(format!("/proc/self/task/{t}/schedstat")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .sum::<f64>()
        / 1e3
}

/// How one client's attempt ended.
enum Attempt {
    Connected(Duration, Conn),
    Refused(Duration),
    Hung,
}

/// Runs the storm and the overload phase against `--proxies` and prints
/// both tables.
pub async fn run(opts: &Opts) -> anyhow::Result<()> {
    anyhow::ensure!(
        opts.storm_cap < opts.storm_clients,
        "--storm-cap must be below --storm-clients"
    );
    STORM_CPS.store(opts.storm_cps.max(1), Ordering::Relaxed);
    // The storm's clients and their backend stand for machines of their
    // own (shoots' nodes, kube-apiservers): they run at nice 10, so that
    // on this shared host they do not take the CPU the proxy and the
    // probes need, and what the probes time is the proxy's doing.
    let load = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("storm-load")
        .on_thread_start(|| {
            seedlink_net::lowprio::lower_this_thread(seedlink_net::lowprio::NICE);
        })
        .enable_all()
        .build()?;
    let backend = load.spawn(Backend::start_on(4)).await??.addr;
    let _ = STORM_BACKEND.set(backend);
    let r = storm_and_overload(opts, load.handle()).await;
    load.shutdown_background();
    r
}

/// The storm against every proxy, then the overload phase; prints both.
async fn storm_and_overload(opts: &Opts, load: &tokio::runtime::Handle) -> anyhow::Result<()> {
    // The probes' echo backend, on a thread of its own: the bench's own
    // control plane goes there.
    let probe_backend = echo_backend()?;
    let dir = tempfile::tempdir()?;
    let mut proxies = Vec::new();
    for (i, name) in opts.proxies.iter().enumerate() {
        let p = Proxy::start(name, opts, probe_backend, dir.path(), i).await?;
        eprintln!("bench: {name} on {} (pid {})", p.target(), p.pids()[0]);
        proxies.push((name.clone(), p));
    }
    let mut storm: BTreeMap<String, Vec<Wave>> = BTreeMap::new();
    let n = proxies.len();
    for w in 0..opts.storm_waves {
        for k in 0..n {
            let (name, p) = &proxies[(k + w) % n];
            let r = wave(opts, p, load).await?;
            eprintln!("bench: storm wave {} {name}: {r:?}", w + 1);
            storm.entry(name.clone()).or_default().push(r);
        }
    }
    drop(proxies);
    STORM_CAP.store(opts.storm_cap, Ordering::Relaxed);
    let mut overload = BTreeMap::new();
    for (i, name) in opts.proxies.iter().enumerate() {
        let p = Proxy::start(name, opts, probe_backend, dir.path(), 50 + i).await?;
        let r = wave(opts, &p, load).await?;
        eprintln!("bench: overload wave {name}: {r:?}");
        overload.insert(name.clone(), r);
    }
    STORM_CAP.store(0, Ordering::Relaxed);
    report(opts, &storm, &overload);
    Ok(())
}

/// One wave against `p`: probes, a quiet spell, the storm (its clients on
/// `load`), the close, and the wait until the backend saw every close.
async fn wave(opts: &Opts, p: &Proxy, load: &tokio::runtime::Handle) -> anyhow::Result<Wave> {
    let target = p.target();
    let pids = p.pids();
    let base = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let probes = probes(target.clone(), opts.storm_probes, base, stop.clone());
    // A quiet spell for the probes' baseline.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let wait0 = runq_wait_us();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let wait1 = runq_wait_us();
    let quiet = (
        base.elapsed().as_secs_f64() - 0.5,
        base.elapsed().as_secs_f64(),
    );
    let before = rss_kib(&pids);
    let peak = Arc::new(std::sync::Mutex::new(before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn(sample_rss(pids.clone(), peak.clone(), sampling.clone()));
    let t0 = Instant::now();
    let storm_from = base.elapsed().as_secs_f64();
    let clients: Vec<_> = (0..opts.storm_clients)
        .map(|i| {
            let target = target.clone();
            let cps = opts.storm_cps.max(1);
            load.spawn(async move { attempt(&target, i, cps).await })
        })
        .collect();
    let mut r = Wave::default();
    let (mut times, mut refusals, mut held) = (Vec::new(), Vec::new(), Vec::new());
    for c in clients {
        match c.await? {
            Attempt::Connected(t, conn) => {
                times.push(t.as_secs_f64() * 1e3);
                held.push(conn);
            }
            Attempt::Refused(t) => refusals.push(t.as_secs_f64() * 1e3),
            Attempt::Hung => r.hung += 1,
        }
    }
    // Every client has its answer (or gave up): the storm is over.
    r.all_in_ms = t0.elapsed().as_secs_f64() * 1e3;
    let storm_to = base.elapsed().as_secs_f64();
    let wait2 = runq_wait_us();
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.await;
    let peak = *peak.lock().map_err(|_| anyhow::anyhow!("rss sampler"))?;
    r.peak_mib = (peak - before).max(0.0) / 1024.0;
    (r.connected, r.refused) = (times.len(), refusals.len());
    r.connect_p99_ms = percentile(&mut times, 0.99);
    if !refusals.is_empty() {
        r.refusal_p99_ms = Some(percentile(&mut refusals, 0.99));
    }
    // The failover: every client closes at once.
    drop(held);
    stop.store(true, Ordering::Relaxed);
    let rtts = tokio::task::spawn_blocking(move || probes.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the probes' thread panicked"))??;
    let in_window = |(from, to): (f64, f64)| -> Vec<f64> {
        rtts.iter()
            .filter(|(at, _)| *at >= from && *at <= to)
            .map(|(_, rtt)| *rtt)
            .collect()
    };
    let (mut q, mut st) = (in_window(quiet), in_window((storm_from, storm_to)));
    r.runq_quiet_us = (wait1 - wait0) / q.len().max(1) as f64;
    r.runq_storm_us = (wait2 - wait1) / st.len().max(1) as f64;
    r.quiet_p99_us = percentile(&mut q, 0.99);
    r.storm_p99_us = percentile(&mut st, 0.99);
    settle().await;
    Ok(r)
}

/// One client: connect, the ClientHello for its control plane, and the
/// backend's first byte.
async fn attempt(target: &Target, i: usize, cps: usize) -> Attempt {
    let t = Instant::now();
    let went = tokio::time::timeout(HANG, async {
        let mut c = dial(target, Some(src_ip(i))).await?;
        let mut msg = hello_for(i % cps);
        msg.push(ONE_AND_IDLE);
        c.write_all(&msg).await?;
        let mut b = [0u8; 1];
        c.read_exact(&mut b).await?;
        anyhow::Ok(c)
    })
    .await;
    match went {
        Ok(Ok(c)) => Attempt::Connected(t.elapsed(), c),
        Ok(Err(e)) => {
            if !FIRST_REFUSAL.swap(true, Ordering::Relaxed) {
                eprintln!("bench: first refusal seen: {e:#}");
            }
            Attempt::Refused(t.elapsed())
        }
        Err(_) => Attempt::Hung,
    }
}

/// The echo backend of the bench's own control plane, on a thread of
/// its own.
fn echo_backend() -> anyhow::Result<SocketAddr> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("probe-backend".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let Ok(rt) = rt else {
                let _ = tx.send(Err(anyhow::anyhow!("probe backend runtime")));
                return;
            };
            watch_this_thread();
            rt.block_on(async {
                let _ = tx.send(Backend::start().await.map(|b| b.addr));
                std::future::pending::<()>().await;
            });
        })?;
    rx.recv()?
}

/// `n` established connections on a thread of their own (apart from the
/// storm's clients, so that what they time is the proxy's doing rather
/// than the load generator's), each timing echo round trips until `stop`.
fn probes(
    target: Target,
    n: usize,
    base: Instant,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<anyhow::Result<Vec<(f64, f64)>>> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        watch_this_thread();
        rt.block_on(async {
            let all: Vec<_> = (0..n)
                .map(|_| tokio::spawn(probe(target.clone(), base, stop.clone())))
                .collect();
            let mut out = Vec::new();
            for p in all {
                out.extend(p.await?);
            }
            Ok(out)
        })
    })
}

/// An established connection timing echo round trips every 2 ms until
/// `stop`: (seconds since `base` when sent, round trip in µs).
async fn probe(target: Target, base: Instant, stop: Arc<AtomicBool>) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    let Ok(mut c) = dial(&target, None).await else {
        return out;
    };
    let mut msg = HELLO.to_vec();
    msg.push(ECHO);
    if c.write_all(&msg).await.is_err() {
        return out;
    }
    let mut b = [0u8; 8];
    // Bounded: the wave itself is.
    for _ in 0..100_000 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let at = base.elapsed().as_secs_f64();
        let t = Instant::now();
        let echoed = tokio::time::timeout(HANG, async {
            c.write_all(b"12345678").await?;
            c.read_exact(&mut b).await
        })
        .await;
        if !matches!(echoed, Ok(Ok(_))) {
            break;
        }
        out.push((at, t.elapsed().as_secs_f64() * 1e6));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    out
}

/// Samples the proxy's RSS every 10 ms into `peak` while `on`.
async fn sample_rss(pids: Vec<u32>, peak: Arc<std::sync::Mutex<f64>>, on: Arc<AtomicBool>) {
    while on.load(Ordering::Relaxed) {
        let now = rss_kib(&pids);
        if let Ok(mut p) = peak.lock() {
            *p = p.max(now);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 60 s) until the backend saw every client's close.
async fn settle() {
    let end = Instant::now() + Duration::from_secs(60);
    while IDLE_OPEN.load(Ordering::Relaxed) > 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = IDLE_OPEN.load(Ordering::Relaxed);
    if left > 0 {
        eprintln!("bench: {left} backend connections still open 60 s after the wave");
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

type Row = (&'static str, fn(&[Wave]) -> String);

const STORM_ROWS: &[Row] = &[
    ("all clients in, ms (median wave)", |w| {
        format!("{:.0}", median(w.iter().map(|x| x.all_in_ms).collect()))
    }),
    ("connect-to-first-byte p99, ms (median wave)", |w| {
        format!(
            "{:.1}",
            median(w.iter().map(|x| x.connect_p99_ms).collect())
        )
    }),
    ("connected (all waves)", |w| {
        w.iter().map(|x| x.connected).sum::<usize>().to_string()
    }),
    ("refused (all waves)", |w| {
        w.iter().map(|x| x.refused).sum::<usize>().to_string()
    }),
    ("hung 10 s (all waves)", |w| {
        w.iter().map(|x| x.hung).sum::<usize>().to_string()
    }),
    ("peak RSS growth, MiB (median wave)", |w| {
        format!("{:.1}", median(w.iter().map(|x| x.peak_mib).collect()))
    }),
    ("established echo p99 quiet, µs", |w| {
        format!("{:.0}", median(w.iter().map(|x| x.quiet_p99_us).collect()))
    }),
    ("established echo p99 in the storm, µs", |w| {
        format!("{:.0}", median(w.iter().map(|x| x.storm_p99_us).collect()))
    }),
    (
        "probe threads' run-queue wait per round trip, quiet / storm, µs",
        |w| {
            format!(
                "{:.0} / {:.0}",
                median(w.iter().map(|x| x.runq_quiet_us).collect()),
                median(w.iter().map(|x| x.runq_storm_us).collect())
            )
        },
    ),
    ("storm p99 ÷ quiet p99", |w| {
        format!(
            "{:.2}×",
            median(
                w.iter()
                    .filter(|x| x.quiet_p99_us > 0.0)
                    .map(|x| x.storm_p99_us / x.quiet_p99_us)
                    .collect()
            )
        )
    }),
];

const OVERLOAD_ROWS: &[Row] = &[
    ("connected", |w| w[0].connected.to_string()),
    ("refused", |w| w[0].refused.to_string()),
    ("refusal p99, ms", |w| {
        w[0].refusal_p99_ms
            .map_or("–".into(), |v| format!("{v:.1}"))
    }),
    ("hung 10 s", |w| w[0].hung.to_string()),
    ("wave over (last answer or give-up), ms", |w| {
        format!("{:.0}", w[0].all_in_ms)
    }),
    ("established echo p99 quiet, µs", |w| {
        format!("{:.0}", w[0].quiet_p99_us)
    }),
    ("established echo p99 in the storm, µs", |w| {
        format!("{:.0}", w[0].storm_p99_us)
    }),
];

fn table(names: &[String], rows: &[Row], get: impl Fn(&str) -> Vec<Wave>) {
    print!("| metric |");
    for n in names {
        print!(" {n} |");
    }
    println!("\n|---|{}", "---|".repeat(names.len()));
    for (label, f) in rows {
        print!("| {label} |");
        for n in names {
            let w = get(n);
            if w.is_empty() {
                print!(" – |");
            } else {
                print!(" {} |", f(&w));
            }
        }
        println!();
    }
}

fn report(opts: &Opts, storm: &BTreeMap<String, Vec<Wave>>, overload: &BTreeMap<String, Wave>) {
    println!(
        "\n## seedlink-bench (storm scenario): {} clients at once per wave over {} control planes, {} waves per proxy ({} connections each), {} established connections timed, {} proxy threads\n",
        opts.storm_clients,
        opts.storm_cps,
        opts.storm_waves,
        opts.storm_clients * opts.storm_waves,
        opts.storm_probes,
        opts.threads
    );
    table(&opts.proxies, STORM_ROWS, |n| {
        storm.get(n).cloned().unwrap_or_default()
    });
    println!(
        "\n### Overload: {} clients at once against a cap of {} connections\n",
        opts.storm_clients, opts.storm_cap
    );
    table(&opts.proxies, OVERLOAD_ROWS, |n| {
        overload.get(n).cloned().into_iter().collect()
    });
}
