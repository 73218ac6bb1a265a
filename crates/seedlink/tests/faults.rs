//! The fault suite: an operator's worst day, bounded and on loopback (the
//! tunnel part in network namespaces), with the oracle of
//! `seedlink_testkit::faults` checked after every scenario: the process
//! lives and never panicked; descriptors (pooled splice pipes aside),
//! CLOSE-WAIT sockets and connection gauges are back to their baseline;
//! RSS is within 20 MiB of it; every transfer was byte-exact or ended with
//! an error the client sees, never a clean end that hides a truncation.
//!
//! `SEEDLINK_FAULTS=long` runs the long profile (more connections, longer
//! floods; docs/TESTING.md); the default short profile is part of the
//! README's test command. Each scenario prints one `fault:` line of figures
//! (docs/OPERATIONS.md quotes the long run's). No timing is asserted except
//! generous deadlines.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::faults::*;
use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Sizes of one profile.
#[derive(Debug, Clone, Copy)]
struct Profile {
    name: &'static str,
    /// Transfers per backend scenario.
    transfers: usize,
    /// Bytes per transfer.
    size: u64,
    /// Garbage connections in the LB flood (a tenth more are valid).
    flood: usize,
    /// Half-open connections per slow-loris mode.
    loris: usize,
    /// Connections held at the cap (the cap is this plus what the suite
    /// itself keeps open), and as many refused beyond it.
    cap: usize,
    /// Configuration reloads under load.
    reloads: usize,
}

impl Profile {
    /// The gateway's `limits.max_connections`: room for every half-open
    /// connection of the slow-loris scenario, and what the cap scenario
    /// holds before it refuses `cap` more.
    fn max_connections(&self) -> usize {
        (5 * self.loris).max(self.cap) + 200
    }
}

fn profile() -> Profile {
    match std::env::var("SEEDLINK_FAULTS").as_deref() {
        Ok("long") => Profile {
            name: "long",
            transfers: 200,
            size: 16 << 20,
            flood: 20_000,
            loris: 1_500,
            cap: 3_000,
            reloads: 100,
        },
        _ => Profile {
            name: "short",
            transfers: 12,
            size: 2 << 20,
            flood: 400,
            loris: 40,
            cap: 150,
            reloads: 10,
        },
    }
}

fn report(scenario: &str, what: &str, s: &Settled) {
    eprintln!(
        "fault: {scenario:<22} {what}; settled in {:.1}s, fds {}, RSS {:.1} MiB",
        s.took.as_secs_f64(),
        s.fds,
        s.rss_kib as f64 / 1024.0
    );
}

/// Runs `n` jobs, at most `width` at a time; returns their results.
async fn fan<T, F, Fut>(n: usize, width: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let sem = Arc::new(tokio::sync::Semaphore::new(width));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let fut = f(i);
        tasks.push(tokio::spawn(async move {
            let r = fut.await;
            drop(permit);
            r
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Downloads a pattern transfer through the gateway's CONNECT to `dest`.
async fn download(addr: SocketAddr, dest: &'static str, size: u64, limit: Duration) -> Ending {
    match gateway_connect(addr, dest).await {
        Err(answer) => Ending::Error(answer),
        Ok(mut s) => read_pattern(&mut s, size, limit).await,
    }
}

fn tally(endings: &[Ending]) -> (usize, usize) {
    for e in endings {
        assert!(e.is_honest(), "a transfer ended dishonestly: {e:?}");
    }
    let exact = endings.iter().filter(|e| **e == Ending::Exact).count();
    (exact, endings.len() - exact)
}

/// A listener whose accept queue is full and never served: SYNs to it are
/// dropped, so a connect hangs as to an unreachable host.
fn unreachable_backend() -> (
    SocketAddr,
    Vec<std::net::TcpStream>,
    tokio::net::TcpListener,
) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(0).unwrap();
    let addr = l.local_addr().unwrap();
    // Fill the queue (a backlog of 0 still queues one or two).
    let mut fillers = Vec::new();
    for _ in 0..3 {
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500));
        if let Ok(s) = s {
            fillers.push(s);
        }
    }
    (addr, fillers, l)
}

fn gateway_yaml(p: &Profile, b: &Backends, extra_cp: bool) -> String {
    let mut y = format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: auto, address: '127.0.0.1:0', protocol: auto}}
  - {{name: lb, address: '127.0.0.1:0', protocol: tls, proxy_protocol: required}}
trusted_load_balancers: [127.0.0.0/8]
timeouts: {{client_hello: 2s, upstream_connect: 1s, half_closed: 2s}}
limits: {{max_connections: {cap}, max_unrouted_per_source: 100000}}
control_planes:
  - {{name: ok, endpoints: ['{ok}'], destinations: [{{name: 'outbound|443||ok.faults.svc.cluster.local'}}]}}
  - {{name: refused, endpoints: ['{refused}'], destinations: [{{name: 'outbound|443||refused.faults.svc.cluster.local'}}]}}
  - {{name: unreachable, endpoints: ['{unreachable}'], destinations: [{{name: 'outbound|443||unreachable.faults.svc.cluster.local'}}]}}
  - {{name: reset, endpoints: ['{reset}'], destinations: [{{name: 'outbound|443||reset.faults.svc.cluster.local'}}]}}
  - {{name: stall, endpoints: ['{stall}'], destinations: [{{name: 'outbound|443||stall.faults.svc.cluster.local'}}]}}
  - {{name: slow, endpoints: ['{slow}'], destinations: [{{name: 'outbound|443||slow.faults.svc.cluster.local'}}]}}
  - {{name: echo, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
",
        cap = p.max_connections(),
        ok = b.ok,
        refused = b.refused,
        unreachable = b.unreachable,
        reset = b.reset,
        stall = b.stall,
        slow = b.slow,
        echo = b.echo,
    );
    if extra_cp {
        y.push_str(&format!(
            "  - {{name: extra, hostnames: [api.beta.example.com], endpoints: ['{}'], acl: {{allow: [127.0.0.0/8]}}}}\n",
            b.echo
        ));
    }
    y
}

struct Backends {
    ok: SocketAddr,
    refused: SocketAddr,
    unreachable: SocketAddr,
    reset: SocketAddr,
    stall: SocketAddr,
    slow: SocketAddr,
    echo: SocketAddr,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_under_faults() {
    let p = profile();
    let stop = CancellationToken::new();
    let pattern = pattern_backend(p.size, &stop).await;
    let refused = {
        // A port that was just free: connects are refused.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (unreachable, _fillers, _full) = unreachable_backend();
    let reset = FaultProxy::start(pattern, Fault::ResetAfter(p.size / 2)).await;
    let stall = FaultProxy::start(pattern, Fault::StallAfter(p.size / 2)).await;
    let slow = FaultProxy::start(pattern, Fault::Latency(Duration::from_millis(2))).await;
    // The fault proxy's own faults, seen directly (no gateway between).
    let mut direct = TcpStream::connect(reset.addr).await.unwrap();
    let e = read_pattern(&mut direct, p.size, Duration::from_secs(20)).await;
    assert!(
        matches!(&e, Ending::Error(t) if t.contains("ConnectionReset")),
        "{e:?}"
    );
    let b = Backends {
        ok: pattern,
        refused,
        unreachable,
        reset: reset.addr,
        stall: stall.addr,
        slow: slow.addr,
        echo: echo_backend(&stop).await,
    };
    let gw = Gw::start(&gateway_yaml(&p, &b, false));
    let (auto, lb, admin) = (gw.listener("auto"), gw.listener("lb"), gw.admin);
    let metrics = move || {
        // The oracle runs outside the runtime's async context.
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(http_get(admin, "/metrics"))
                .1
        })
        .join()
        .unwrap()
    };
    let oracle = Oracle::new(gw.pid(), metrics, &["seedlink_gateway_active_connections"]);
    let limit = Duration::from_secs(60);
    eprintln!("fault: profile {}", p.name);

    // Backend refused and unreachable: every client gets an error answer.
    for (scenario, dest) in [
        (
            "backend-refused",
            "outbound|443||refused.faults.svc.cluster.local",
        ),
        (
            "backend-unreachable",
            "outbound|443||unreachable.faults.svc.cluster.local",
        ),
    ] {
        let t0 = Instant::now();
        let endings = fan(p.transfers, 8, |_| download(auto, dest, p.size, limit)).await;
        let (exact, errors) = tally(&endings);
        assert_eq!(exact, 0, "{scenario}: a transfer through a dead backend");
        let sample = endings.first().cloned();
        report(
            scenario,
            &format!(
                "{errors} errors answered in {:.1}s in all ({sample:?})",
                t0.elapsed().as_secs_f64()
            ),
            &oracle.check(scenario).await,
        );
    }

    // Backend reset mid-stream: the client is reset too, never a clean end.
    let endings = fan(p.transfers, 8, |_| {
        download(
            auto,
            "outbound|443||reset.faults.svc.cluster.local",
            p.size,
            limit,
        )
    })
    .await;
    let (exact, errors) = tally(&endings);
    assert_eq!(exact, 0);
    for e in &endings {
        assert!(
            matches!(e, Ending::Error(t) if t.contains("ConnectionReset")),
            "backend-reset: {e:?}"
        );
    }
    report(
        "backend-reset",
        &format!("{errors}/{} ended in ECONNRESET", endings.len()),
        &oracle.check("backend-reset").await,
    );

    // Backend stalls mid-stream: the client sees no end (its own deadline
    // is the error), and closing it frees everything.
    let endings = fan(p.transfers.min(8), 8, |_| {
        download(
            auto,
            "outbound|443||stall.faults.svc.cluster.local",
            p.size,
            Duration::from_secs(3),
        )
    })
    .await;
    let (exact, errors) = tally(&endings);
    assert_eq!(exact, 0);
    report(
        "backend-stall",
        &format!("{errors} transfers stalled and were abandoned by their clients"),
        &oracle.check("backend-stall").await,
    );

    // Latency on the backend path: every byte arrives, in order.
    let endings = fan(p.transfers, 8, |_| {
        download(
            auto,
            "outbound|443||slow.faults.svc.cluster.local",
            p.size,
            limit,
        )
    })
    .await;
    let (exact, _) = tally(&endings);
    assert_eq!(exact, endings.len(), "backend-latency: {endings:?}");
    report(
        "backend-latency",
        &format!("{exact} byte-exact transfers of {} MiB", p.size >> 20),
        &oracle.check("backend-latency").await,
    );

    // LB garbage flood: garbage, broken and truncated PROXY headers, and a
    // tenth valid traffic. Every bad connection is closed and counted; every
    // valid one echoes.
    let refusals =
        |m: &str| sum_metric(m, "seedlink_gateway_detect_failures_total{listener=\"lb\"");
    let before = refusals(&gw.metrics().await);
    let t0 = Instant::now();
    let valid = p.flood / 10;
    let results = fan(p.flood + valid, 64, move |i| async move {
        let mut s = TcpStream::connect(lb).await.unwrap();
        if i % 11 == 10 {
            s.write_all(b"PROXY TCP4 10.9.0.1 10.9.0.2 4000 443\r\n")
                .await
                .unwrap();
            return echo_roundtrip(&mut s, HELLO_ALPHA)
                .await
                .map(|()| true)
                .map_err(|e| e.to_string());
        }
        let bad: Vec<u8> = match i % 3 {
            0 => (0..200).map(|k| (k * 37 + i) as u8).collect(),
            1 => b"PROXY TCP4 not-an-address 10.0.0.2 1 2\r\n".to_vec(),
            _ => b"PROXY TCP4 10.0.0.1 10.0.".to_vec(),
        };
        let _ = s.write_all(&bad).await;
        if i % 3 == 2 {
            // Truncated: the client leaves mid-header.
            drop(s);
            return Ok(false);
        }
        let (data, _) = read_until_closed(&mut s, Duration::from_secs(20)).await;
        if data.is_empty() {
            Ok(false)
        } else {
            Err(format!("a bad header got {} bytes back", data.len()))
        }
    })
    .await;
    let served = results.iter().filter(|r| matches!(r, Ok(true))).count();
    for r in &results {
        assert!(r.is_ok(), "lb-flood: {r:?}");
    }
    let bad = results.len() - served;
    let mut counted = 0.0;
    for _ in 0..100 {
        counted = refusals(&gw.metrics().await) - before;
        if counted >= bad as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served, results.len() / 11, "every valid connection served");
    assert_eq!(counted, bad as f64, "every bad connection counted once");
    report(
        "lb-garbage-flood",
        &format!(
            "{bad} bad connections refused and counted, {served} valid served, {:.0} conn/s",
            results.len() as f64 / t0.elapsed().as_secs_f64()
        ),
        &oracle.check("lb-garbage-flood").await,
    );

    // Slow-loris in every mode, with legitimate transfers alongside.
    let h2 = {
        let mut v = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        v.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        v
    };
    let modes: Vec<(&str, SocketAddr, Vec<u8>)> = vec![
        ("silent", auto, vec![]),
        ("hello-trickle", auto, HELLO_ALPHA[..40].to_vec()),
        (
            "connect-trickle",
            auto,
            b"CONNECT x:443 HTTP/1.1\r\nX-Gard".to_vec(),
        ),
        (
            "proxy-trickle",
            lb,
            b"PROXY TCP4 10.0.0.1 10.0.0.2 1 2".to_vec(),
        ),
        ("h2-streamless", auto, h2),
    ];
    let t0 = Instant::now();
    let mut held = Vec::new();
    for (_, addr, first) in &modes {
        for _ in 0..p.loris {
            let mut s = TcpStream::connect(addr).await.unwrap();
            if !first.is_empty() {
                s.write_all(first).await.unwrap();
            }
            held.push(s);
        }
    }
    let legit = fan(p.transfers, 8, |_| {
        download(
            auto,
            "outbound|443||ok.faults.svc.cluster.local",
            p.size,
            limit,
        )
    })
    .await;
    let (exact, _) = tally(&legit);
    assert_eq!(exact, legit.len(), "legitimate transfers during slow-loris");
    let closed = fan(held.len(), held.len(), {
        let held = Arc::new(tokio::sync::Mutex::new(held));
        move |_| {
            let held = held.clone();
            async move {
                let mut s = held.lock().await.pop().unwrap();
                let (_, r) = read_until_closed(&mut s, Duration::from_secs(20)).await;
                r.is_ok()
            }
        }
    })
    .await;
    assert!(
        closed.iter().all(|c| *c),
        "a half-open connection was not closed"
    );
    report(
        "slow-loris",
        &format!(
            "{} half-open connections in {} modes all closed by the gateway within {:.1}s; {exact} transfers byte-exact meanwhile",
            closed.len(),
            modes.len(),
            t0.elapsed().as_secs_f64()
        ),
        &oracle.check("slow-loris").await,
    );

    // The connection cap: `cap` connections held, as many more refused at
    // once, the held ones still echo.
    let cap = p.max_connections();
    let refused_before = gw.metric("seedlink_gateway_refused_total{").await;
    let mut held = Vec::new();
    for _ in 0..cap {
        let mut s = TcpStream::connect(auto).await.unwrap();
        echo_roundtrip(&mut s, HELLO_ALPHA).await.unwrap();
        held.push(s);
    }
    let extra = fan(p.cap, 64, move |_| async move {
        let mut s = TcpStream::connect(auto).await.unwrap();
        let _ = s.write_all(HELLO_ALPHA).await;
        let (data, _) = read_until_closed(&mut s, Duration::from_secs(20)).await;
        data.is_empty()
    })
    .await;
    assert!(
        extra.iter().all(|e| *e),
        "a connection past the cap was served"
    );
    for s in held.iter_mut().step_by(7) {
        echo_roundtrip(s, b"still here").await.unwrap();
    }
    let refused_n = gw.metric("seedlink_gateway_refused_total{").await - refused_before;
    assert_eq!(refused_n, p.cap as f64, "refusals at the cap");
    drop(held);
    report(
        "connection-cap",
        &format!(
            "{cap} held, {} refused past the cap, the held ones echo",
            p.cap
        ),
        &oracle.check("connection-cap").await,
    );

    // A reload storm under load: no transfer fails.
    let done = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let done = done.clone();
            tokio::spawn(async move {
                let mut endings = Vec::new();
                while done.load(Ordering::Acquire) == 0 {
                    endings.push(
                        download(
                            auto,
                            "outbound|443||ok.faults.svc.cluster.local",
                            p.size,
                            limit,
                        )
                        .await,
                    );
                }
                endings
            })
        })
        .collect();
    let generation = |m: &str| sum_metric(m, "seedlink_gateway_config_generation");
    let g0 = generation(&gw.metrics().await);
    for i in 0..p.reloads {
        gw.write_config(&gateway_yaml(&p, &b, i % 2 == 0));
        gw.signal("HUP");
        let want = g0 + (i + 1) as f64;
        let t = Instant::now();
        while generation(&gw.metrics().await) < want {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "reload {i} not applied"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    done.store(1, Ordering::Release);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let (exact, _) = tally(&all);
    assert_eq!(exact, all.len(), "a transfer failed during reloads");
    report(
        "reload-storm",
        &format!(
            "{} reloads, {exact} transfers byte-exact meanwhile",
            p.reloads
        ),
        &oracle.check("reload-storm").await,
    );

    // Drain: SIGTERM with a transfer open; it completes, new connections
    // are refused, the process exits 0.
    let mut open = gateway_connect(auto, "outbound|443||slow.faults.svc.cluster.local")
        .await
        .unwrap();
    let mut echo = TcpStream::connect(auto).await.unwrap();
    echo_roundtrip(&mut echo, HELLO_ALPHA).await.unwrap();
    let mut gw = gw;
    gw.signal("TERM");
    let t = Instant::now();
    while gw.get("/readyz").await.0 != 503 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "readiness never went false"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The listeners close right after the phase changes.
    while TcpStream::connect(auto).await.is_ok() {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "a draining gateway accepts"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    echo_roundtrip(&mut echo, b"served while draining")
        .await
        .unwrap();
    drop(echo);
    let ending = read_pattern(&mut open, p.size, limit).await;
    assert_eq!(ending, Ending::Exact, "the open transfer during the drain");
    drop(open);
    assert_eq!(gw.wait_exit(Duration::from_secs(60)), Some(0));
    eprintln!(
        "fault: drain                  the open transfer completed, new ones refused, exit 0"
    );
    stop.cancel();
}
