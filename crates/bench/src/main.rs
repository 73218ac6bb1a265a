//! `seedlink-bench`: runs seedlink's gateway side by side with HAProxy
//! (`req_ssl_sni`), nginx stream (`ssl_preread`) and Envoy (`tls_inspector` +
//! `tcp_proxy`) on loopback, interleaved and repeated, and prints medians and
//! ratios. See docs/PERFORMANCE.md.
//!
//! Every proxy routes a real captured ClientHello by SNI to the same
//! in-process backend, which then serves one of three scripted exchanges:
//! bulk download, one byte then close, one byte then stay idle.

mod cipher;
mod kube_scale;
mod peers;
mod procstat;
mod proxy;
mod scenario;
mod storm;
mod tunnel;
mod tunnel_flood;
mod tunnel_restart;
mod tunnel_scale;
mod workload;

use scenario::{Opts, Sample, CONNECT_TARGET, TUNNEL_SCENARIO};

use std::collections::BTreeMap;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let mut opts = Opts::parse();
    if opts.streams.is_none() {
        opts.streams = Some(if opts.scenario == "node-proxy-h2" {
            16
        } else {
            0
        });
    }
    if let (Some(listen), Some(to)) = (opts.forward_listen, opts.forward_to) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.threads.max(1))
            .enable_all()
            .build()?;
        return rt.block_on(forward(listen, to, &opts.forward_copy));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // On a worker thread, not in `block_on`'s: a task there is woken by
    // the worker that polls the event loop directly, where `block_on`'s
    // thread would be woken by that worker through a futex first (a second
    // wake-up per event on every latency figure).
    rt.block_on(async { tokio::spawn(run(opts)).await? })
}

/// The bare forwarder: accept, connect to `to`, copy both ways with
/// seedlink's copy loop. No parsing, no limits, no metrics: the floor a
/// proxy's data path is measured against.
async fn forward(
    listen: std::net::SocketAddr,
    to: std::net::SocketAddr,
    copy: &str,
) -> anyhow::Result<()> {
    use seedlink_net::copy::{Copier, CopyMode};
    use std::sync::atomic::AtomicU64;
    let mode = match copy {
        "splice" => CopyMode::Splice,
        "buffered" => CopyMode::Buffered,
        other => anyhow::bail!("--forward-copy {other:?}: use splice or buffered"),
    };
    let copier = std::sync::Arc::new(Copier::new(mode, 4096));
    let l = tokio::net::TcpListener::bind(listen).await?;
    loop {
        let (c, _) = match l.accept().await {
            Ok(a) => a,
            Err(e) => {
                eprintln!("forwarder: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let copier = copier.clone();
        tokio::spawn(async move {
            let _ = c.set_nodelay(true);
            let Ok(u) = tokio::net::TcpStream::connect(to).await else {
                return;
            };
            let _ = u.set_nodelay(true);
            let (a, b) = (AtomicU64::new(0), AtomicU64::new(0));
            let _ = copier.run(&c, &u, &a, &b).await;
        });
    }
}

async fn run(opts: Opts) -> anyhow::Result<()> {
    raise_nofile();
    tunnel::check_tunnel_threads()?;
    // Pinning means "server on one CPU, agent on the other": only the
    // tunnel scenario has that pair.
    anyhow::ensure!(
        opts.tunnel_cpus.is_none() || opts.scenario == "tunnel",
        "--tunnel-cpus applies only to --scenario tunnel (a server and its agent)"
    );
    anyhow::ensure!(
        opts.restarted_cpu.is_none() || opts.scenario == "tunnel-restart",
        "--restarted-cpu applies only to --scenario tunnel-restart"
    );
    match opts.scenario.as_str() {
        "sni" | "node-proxy" | "node-proxy-h2" => {}
        "proxy-sni" => scenario::set_proxy_v2(),
        "tunnel" => {
            scenario::set_tunnel_destination();
            let _ = TUNNEL_SCENARIO.set(());
        }
        "connect" => scenario::set_tunnel_destination(),
        "tunnel-scale" | "tunnel-flood" | "tunnel-restart" | "storm" => {}
        "cipher" => return cipher::run(),
        "kube-scale" => return kube_scale::run(&opts).await,
        other => {
            anyhow::bail!("--scenario {other:?}: use sni, proxy-sni, storm, connect, node-proxy, node-proxy-h2, tunnel, tunnel-scale, tunnel-flood, tunnel-restart, kube-scale or cipher")
        }
    }
    let backend = workload::Backend::start().await?;
    if opts.scenario == "tunnel-scale" {
        return tunnel_scale::run(&opts, backend.addr).await;
    }
    if opts.scenario == "tunnel-restart" {
        return tunnel_restart::run(&opts, backend.addr).await;
    }
    if opts.scenario == "tunnel-flood" {
        return tunnel_flood::run(&opts, backend.addr).await;
    }
    if opts.scenario == "storm" {
        return storm::run(&opts).await;
    }
    let _ = CONNECT_TARGET.set(backend.addr.to_string());
    let dir = tempfile::tempdir()?;
    // node-proxy scenario: one seedlink gateway (not measured) that every
    // node proxy tunnels to; the measured proxy is the node proxy.
    let _gateway = if opts.scenario.starts_with("node-proxy") {
        let g =
            proxy::Proxy::start_gateway_for_node_proxies(&opts, backend.addr, dir.path()).await?;
        eprintln!("bench: gateway for node proxies on {}", g.addr);
        Some(g)
    } else {
        None
    };
    let mut targets: Vec<(String, Option<proxy::Proxy>)> = vec![("direct".into(), None)];
    for (i, name) in opts.proxies.iter().enumerate() {
        let p = proxy::Proxy::start(name, &opts, backend.addr, dir.path(), i)
            .await
            .map_err(|e| anyhow::anyhow!("starting {name}: {e:#}"))?;
        if let Some(cpus) = &opts.tunnel_cpus {
            p.pin(cpus)?;
        }
        eprintln!(
            "bench: {name} listening on {} (pid {})",
            p.target(),
            p.pids()[0]
        );
        for pid in p.pids() {
            eprintln!(
                "bench: {name} pid {pid}: {} threads",
                procstat::threads(pid).map_or("?".into(), |n| n.to_string())
            );
        }
        targets.push((name.clone(), Some(p)));
    }
    let mut samples: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    for round in 0..opts.rounds {
        // Rotate the order each round so no target always runs first.
        let n = targets.len();
        for k in 0..n {
            let (name, proxy) = &targets[(k + round) % n];
            let addr = proxy
                .as_ref()
                .map_or(workload::Target::Tcp(backend.addr), |p| p.target());
            let pids = proxy.as_ref().map(|p| p.pids()).unwrap_or_default();
            let connect = proxy.as_ref().is_some_and(|p| p.connect);
            let pipelined = proxy.as_ref().is_some_and(|p| p.keeps_pipelined);
            let mut s =
                workload::measure(&opts, &addr, &pids, proxy.is_some(), connect, pipelined).await?;
            if proxy.is_some() {
                let fresh =
                    proxy::Proxy::start(name, &opts, backend.addr, dir.path(), 100 + round * n + k)
                        .await?;
                match workload::idle(
                    &fresh.target(),
                    &fresh.pids(),
                    opts.idle_conns,
                    fresh.connect,
                )
                .await
                {
                    Ok(kib) => s.idle_kib = Some(kib),
                    Err(e) => eprintln!("bench: idle run of {name} failed: {e:#}"),
                }
            }
            eprintln!("bench: round {} {name}: {s:?}", round + 1);
            samples.entry(name.clone()).or_default().push(s);
        }
    }
    let names: Vec<String> = targets.iter().map(|t| t.0.clone()).collect();
    report(&opts, &names, &samples);
    drop(targets);
    Ok(())
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

type Metric = (&'static str, fn(&Sample) -> Option<f64>, bool);

const METRICS: &[Metric] = &[
    ("bulk Gbit/s", |s| s.gbps, true),
    ("proxy CPU s/GB", |s| s.cpu_s_per_gb, false),
    ("upload Gbit/s", |s| s.up_gbps, true),
    ("upload CPU s/GB", |s| s.up_cpu_s_per_gb, false),
    ("many-streams bulk Gbit/s", |s| s.streams_gbps, true),
    ("many-streams CPU s/GB", |s| s.streams_cpu_s_per_gb, false),
    ("new conn/s", |s| s.conn_rate, true),
    ("proxy CPU µs/conn", |s| s.cpu_us_per_conn, false),
    ("p50 under load µs", |s| s.rate_p50_us, false),
    ("p99 under load µs", |s| s.rate_p99_us, false),
    ("single-conn p50 µs", |s| s.single_p50_us, false),
    (
        "single-conn p50 µs to the CONNECT answer",
        |s| s.answer_p50_us,
        false,
    ),
    ("single-conn wake-ups/conn", |s| s.single_wakeups, false),
    (
        "single-conn p50 µs, CONNECT pipelined",
        |s| s.pipelined_p50_us,
        false,
    ),
    ("idle RSS KiB/conn", |s| s.idle_kib, false),
    ("head-of-line p99 ratio", |s| s.hol_p99_ratio, false),
];

fn report(opts: &Opts, names: &[String], samples: &BTreeMap<String, Vec<Sample>>) {
    let med = |name: &str, f: fn(&Sample) -> Option<f64>| {
        median(
            samples
                .get(name)
                .map(|v| v.iter().filter_map(f).collect())
                .unwrap_or_default(),
        )
    };
    let threads = if opts.scenario == "tunnel" {
        format!(
            "{} worker threads per tunnel process",
            tunnel::tunnel_threads()
        )
    } else {
        format!("{} proxy threads", opts.threads)
    };
    println!(
        "\n## seedlink-bench ({} scenario): medians of {} interleaved rounds ({} MiB bulk, {} streams, {} s × {} clients rate, {} idle conns, {threads})\n",
        opts.scenario, opts.rounds, opts.bulk_mib, opts.streams.unwrap_or(0), opts.rate_secs, opts.rate_concurrency, opts.idle_conns
    );
    print!("| metric |");
    for n in names {
        print!(" {n} |");
    }
    println!();
    println!("|---|{}", "---|".repeat(names.len()));
    // Rows no target measured (the many-streams rows outside the h2
    // scenario, upload outside the tunnel) are left out.
    let measured = |f: fn(&Sample) -> Option<f64>| names.iter().any(|n| med(n, f).is_some());
    for (label, f, _) in METRICS.iter().filter(|m| measured(m.1)) {
        print!("| {label} |");
        for n in names {
            match med(n, *f) {
                Some(v) => print!(" {} |", fmt(v)),
                None => print!(" – |"),
            }
        }
        println!();
    }
    println!("\n### Ratios to direct (throughput and rate: higher is better; latency: lower is better)\n");
    print!("| metric |");
    for n in names.iter().skip(1) {
        print!(" {n} |");
    }
    println!();
    println!("|---|{}", "---|".repeat(names.len() - 1));
    for (label, f, _) in METRICS.iter().filter(|m| {
        measured(m.1)
            && !matches!(
                m.0,
                "proxy CPU s/GB"
                    | "upload CPU s/GB"
                    | "many-streams CPU s/GB"
                    | "proxy CPU µs/conn"
                    | "idle RSS KiB/conn"
            )
    }) {
        print!("| {label} |");
        for n in names.iter().skip(1) {
            match (med(n, *f), med("direct", *f)) {
                (Some(v), Some(d)) if d > 0.0 => print!(" {:.2}× |", v / d),
                _ => print!(" – |"),
            }
        }
        println!();
    }
    if names.iter().any(|n| n == "seedlink") {
        println!("\n### seedlink relative to each peer (>1 means seedlink is better)\n");
        let peers: Vec<&String> = names
            .iter()
            .filter(|n| *n != "direct" && *n != "seedlink")
            .collect();
        print!("| metric |");
        for p in &peers {
            print!(" vs {p} |");
        }
        println!();
        println!("|---|{}", "---|".repeat(peers.len()));
        for (label, f, higher_better) in METRICS.iter().filter(|m| measured(m.1)) {
            print!("| {label} |");
            for p in &peers {
                match (med("seedlink", *f), med(p, *f)) {
                    (Some(s), Some(o)) if s > 0.0 && o > 0.0 => {
                        let r = if *higher_better { s / o } else { o / s };
                        print!(" {r:.2}× |");
                    }
                    _ => print!(" – |"),
                }
            }
            println!();
        }
    }
    if opts.json {
        let mut out = serde_json::Map::new();
        for n in names {
            let mut m = serde_json::Map::new();
            for (label, f, _) in METRICS {
                m.insert(
                    label.to_string(),
                    med(n, *f).map_or(serde_json::Value::Null, |v| v.into()),
                );
            }
            out.insert(n.clone(), m.into());
        }
        println!("\n{}", serde_json::Value::Object(out));
    }
}

fn fmt(v: f64) -> String {
    if v.is_infinite() {
        "stalled".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[allow(unsafe_code)]
fn raise_nofile() {
    // The bench holds both ends of every idle connection.
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a valid local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}
