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
        "fault: {scenario:<22} {what}; settled in {:.1}s, fds {}, tasks {}, RSS {:.1} MiB",
        s.took.as_secs_f64(),
        s.fds,
        s.tasks,
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
/// Four clients downloading through `addr` in a loop until `done` is set;
/// each returns its transfers' endings.
fn download_loops(
    addr: SocketAddr,
    size: u64,
    limit: Duration,
    done: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<Vec<Ending>>> {
    (0..4)
        .map(|_| {
            let done = done.clone();
            tokio::spawn(async move {
                let mut endings = Vec::new();
                while done.load(Ordering::Acquire) == 0 {
                    endings.push(
                        download(
                            addr,
                            "outbound|443||ok.faults.svc.cluster.local",
                            size,
                            limit,
                        )
                        .await,
                    );
                }
                endings
            })
        })
        .collect()
}

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
limits: {{max_connections: {cap}, max_connections_per_control_plane: {cap}, max_unrouted_per_source: 100000}}
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
    let upgrade_dir = tempfile::tempdir().unwrap();
    let upgrade_socket = upgrade_dir.path().join("upgrade.sock");
    let upgrade_socket = upgrade_socket.to_str().unwrap();
    let gw = Gw::start_args(
        &gateway_yaml(&p, &b, false),
        &["--upgrade-socket", upgrade_socket],
    );
    let (auto, lb, admin) = (gw.listener("auto"), gw.listener("lb"), gw.admin);
    let oracle = Oracle::new(
        gw.pid(),
        metrics_fetcher(admin),
        &["seedlink_gateway_active_connections"],
    );
    let limit = Duration::from_secs(60);
    eprintln!("fault: profile {}", p.name);
    let t = Bed {
        p: &p,
        b: &b,
        gw: &gw,
        auto,
        lb,
        oracle: &oracle,
        limit,
    };
    dead_backends_get_an_error_answer(&t).await;
    a_reset_backend_resets_the_client(&t).await;
    a_reset_backend_resets_each_http2_stream(&t).await;
    a_stalled_backend_ends_in_the_clients_deadline(&t).await;
    a_slow_backend_delivers_every_byte_in_order(&t).await;
    an_lb_garbage_flood_is_closed_and_counted(&t).await;
    slow_loris_is_closed_at_the_first_message_deadline(&t).await;
    the_connection_cap_refuses_at_once_and_holds_the_held(&t).await;
    a_reload_storm_fails_no_transfer(&t).await;
    let gw = a_binary_upgrade_under_load_drops_nothing(&p, &b, gw, limit, upgrade_socket).await;
    a_drain_finishes_the_open_transfer_and_exits_0(&p, gw, limit).await;
    stop.cancel();
}

/// What the phases of `gateway_under_faults` share: the profile, the
/// backends, the running gateway and its listeners, the oracle.
#[derive(Clone, Copy)]
struct Bed<'a> {
    p: &'a Profile,
    b: &'a Backends,
    gw: &'a Gw,
    auto: SocketAddr,
    lb: SocketAddr,
    oracle: &'a Oracle,
    limit: Duration,
}

/// Backend refused and unreachable: every client gets an error answer.
async fn dead_backends_get_an_error_answer(t: &Bed<'_>) {
    let Bed {
        p,
        auto,
        oracle,
        limit,
        ..
    } = *t;
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
}

/// Backend reset mid-stream: the client is reset too, never a clean end.
async fn a_reset_backend_resets_the_client(t: &Bed<'_>) {
    let Bed {
        p,
        auto,
        oracle,
        limit,
        ..
    } = *t;
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
}

/// The same over HTTP/2 CONNECT (h2c, as Kubermatic's envoy-agent speaks
/// it): each stream ends in RST_STREAM, never in a clean END_STREAM.
async fn a_reset_backend_resets_each_http2_stream(t: &Bed<'_>) {
    let Bed {
        p,
        auto,
        oracle,
        limit,
        ..
    } = *t;
    // The same over HTTP/2 CONNECT (h2c on the auto listener, as
    // Kubermatic's envoy-agent speaks it): each stream ends in RST_STREAM,
    // never in a clean END_STREAM.
    let tcp = TcpStream::connect(auto).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut reset_streams = 0;
    for _ in 0..p.transfers.min(8) {
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri("reset.faults.svc.cluster.local:443")
            .body(())
            .unwrap();
        let mut c = client.clone().ready().await.unwrap();
        let (resp, _send) = c.send_request(req, false).unwrap();
        let resp = tokio::time::timeout(limit, resp).await.unwrap().unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut got = 0usize;
        loop {
            match tokio::time::timeout(limit, body.data()).await.unwrap() {
                Some(Ok(b)) => {
                    got += b.len();
                    let _ = body.flow_control().release_capacity(b.len());
                }
                Some(Err(e)) => {
                    assert!(e.is_reset(), "h2 backend-reset: {e}");
                    reset_streams += 1;
                    break;
                }
                None => panic!("h2 backend-reset: a clean END_STREAM after {got} bytes"),
            }
        }
    }
    drop(client);
    conn.abort();
    report(
        "backend-reset-h2",
        &format!("{reset_streams} HTTP/2 CONNECT streams ended in RST_STREAM"),
        &oracle.check("backend-reset-h2").await,
    );
}

/// Backend stalls mid-stream: the client sees no end, and closing it
/// frees everything.
async fn a_stalled_backend_ends_in_the_clients_deadline(t: &Bed<'_>) {
    let Bed {
        p, auto, oracle, ..
    } = *t;
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
}

/// Latency on the backend path: every byte arrives, in order.
async fn a_slow_backend_delivers_every_byte_in_order(t: &Bed<'_>) {
    let Bed {
        p,
        auto,
        oracle,
        limit,
        ..
    } = *t;
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
}

/// LB garbage flood: every bad connection is closed and counted, every
/// valid one echoes.
async fn an_lb_garbage_flood_is_closed_and_counted(t: &Bed<'_>) {
    let Bed {
        p, gw, lb, oracle, ..
    } = *t;
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
}

/// Slow-loris in every mode, with legitimate transfers alongside.
async fn slow_loris_is_closed_at_the_first_message_deadline(t: &Bed<'_>) {
    let Bed {
        p,
        auto,
        lb,
        oracle,
        limit,
        ..
    } = *t;
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
    // Each half-open connection is watched from its opening: how long the
    // gateway took to close it (its deadline is `client_hello`, 2 s).
    let mut watchers = Vec::new();
    for (_, addr, first) in &modes {
        for _ in 0..p.loris {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let opened = Instant::now();
            if !first.is_empty() {
                s.write_all(first).await.unwrap();
            }
            watchers.push(tokio::spawn(async move {
                let (_, r) = read_until_closed(&mut s, Duration::from_secs(30)).await;
                r.map(|()| opened.elapsed()).map_err(|e| e.to_string())
            }));
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
    assert_eq!(
        exact,
        legit.len(),
        "legitimate transfers during slow-loris: {:?}",
        legit
            .iter()
            .filter(|e| **e != Ending::Exact)
            .collect::<Vec<_>>()
    );
    let mut took = Vec::new();
    for w in watchers {
        took.push(
            w.await
                .unwrap()
                .unwrap_or_else(|e| panic!("a half-open connection was not closed: {e}")),
        );
    }
    took.sort();
    report(
        "slow-loris",
        &format!(
            "{} half-open connections in {} modes all closed by the gateway {:.2}-{:.2}s after opening (deadline 2 s); {exact} transfers byte-exact meanwhile",
            took.len(),
            modes.len(),
            took[0].as_secs_f64(),
            took[took.len() - 1].as_secs_f64()
        ),
        &oracle.check("slow-loris").await,
    );
}

/// The connection cap: as many more refused at once, the held ones still
/// echo.
async fn the_connection_cap_refuses_at_once_and_holds_the_held(t: &Bed<'_>) {
    let Bed {
        p,
        gw,
        auto,
        oracle,
        ..
    } = *t;
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
}

/// A reload storm under load: no transfer fails.
async fn a_reload_storm_fails_no_transfer(t: &Bed<'_>) {
    let Bed {
        p,
        b,
        gw,
        auto,
        oracle,
        limit,
        ..
    } = *t;
    // A reload storm under load: no transfer fails.
    let done = Arc::new(AtomicU64::new(0));
    let workers = download_loops(auto, p.size, limit, &done);
    let generation = |m: &str| sum_metric(m, "seedlink_gateway_config_generation");
    let g0 = generation(&gw.metrics().await);
    for i in 0..p.reloads {
        gw.write_config(&gateway_yaml(p, b, i % 2 == 0));
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
}

/// Binary upgrade under load: a new process takes the sockets over; every
/// transfer (on the old process, or on the new one) byte-exact, the old one
/// exits 0. The new process.
async fn a_binary_upgrade_under_load_drops_nothing(
    p: &Profile,
    b: &Backends,
    gw: Gw,
    limit: Duration,
    upgrade_socket: &str,
) -> Gw {
    let auto = gw.listener("auto");
    // Binary upgrade under load: a new process takes the sockets over;
    // every transfer (on the old process, or on the new one) byte-exact,
    // the old one exits 0.
    let done = Arc::new(AtomicU64::new(0));
    let workers = download_loops(auto, p.size, limit, &done);
    let mut old = gw;
    let gw = Gw::start_args(
        &gateway_yaml(p, b, false),
        &["--upgrade-socket", upgrade_socket, "--take-over"],
    );
    assert_eq!(gw.listener("auto"), auto, "the same listening socket");
    assert_eq!(
        old.wait_exit(Duration::from_secs(90)),
        Some(0),
        "the old gateway drains and exits 0"
    );
    done.store(1, Ordering::Release);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let (exact, _) = tally(&all);
    assert_eq!(exact, all.len(), "a transfer failed across the upgrade");
    eprintln!("fault: binary-upgrade         {exact} transfers byte-exact across the hand-over, old exit 0");
    gw
}

/// Drain: SIGTERM with a transfer open; it completes, new connections are
/// refused, the process exits 0.
async fn a_drain_finishes_the_open_transfer_and_exits_0(p: &Profile, gw: Gw, limit: Duration) {
    let auto = gw.listener("auto");
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
}

/// A tunnel-server and a seedlink agent on loopback (the agent dials the
/// server through a fault proxy, which partitions it), clients on the
/// server's Unix-socket frontend, targets in this process.
struct TunnelBed {
    dir: tempfile::TempDir,
    server_port: u16,
    uds: String,
    agent_args: Vec<String>,
}

impl TunnelBed {
    /// Files and configuration; the agent dials the server directly until
    /// [`TunnelBed::agent_dials`] says otherwise.
    fn new() -> TunnelBed {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let seed = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
        let shoot = seedlink::demo::Pki::generate(&[]).unwrap();
        let w = |name: &str, text: &str| {
            std::fs::write(d.join(name), text).unwrap();
            d.join(name).display().to_string()
        };
        let (seed_ca, tun_crt, tun_key) = (
            w("seed-ca.pem", &seed.ca_pem),
            w("tun.pem", &seed.servers[0].1.cert_pem),
            w("tun-key.pem", &seed.servers[0].1.key_pem),
        );
        let (agent_ca, agent_crt, agent_key) = (
            w("agent-ca.pem", &shoot.ca_pem),
            w("agent.pem", &shoot.client.cert_pem),
            w("agent-key.pem", &shoot.client.key_pem),
        );
        let server_port = free_port();
        let uds = d.join("kas.sock").display().to_string();
        std::fs::write(
            d.join("server.yaml"),
            format!(
                "agents: {{listen: '127.0.0.1:{server_port}', cert: '{tun_crt}', key: '{tun_key}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
dial_timeout: 10s
clusters:
  - name: shoot--faults
    agent_ca: '{agent_ca}'
    frontends:
      - {{name: uds, protocol: http-connect, unix: '{uds}'}}
"
            ),
        )
        .unwrap();
        let agent_args =
            seedlink_testkit::agent_cmd::AgentCmd::new(&format!("127.0.0.1:{server_port}"))
                .mtls(&seed_ca, &agent_crt, &agent_key)
                .fast_sync()
                .args(["--keepalive-time", "1"])
                .to_args();
        TunnelBed {
            dir,
            server_port,
            uds,
            agent_args,
        }
    }

    /// Agents started from now on dial `addr`.
    fn agent_dials(&mut self, addr: SocketAddr) {
        let at = self
            .agent_args
            .iter()
            .position(|a| a == "--server")
            .unwrap();
        self.agent_args[at + 1] = addr.to_string();
    }

    fn start(args: &[String]) -> common::tunnel_env::Started {
        let mut proc = Proc(
            std::process::Command::new(seedlink_bin())
                .args(args)
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let ready = common::tunnel_env::ready_line(&mut proc.0);
        assert_eq!(ready["event"], "ready", "{ready}");
        common::tunnel_env::Started { proc, ready }
    }

    /// Where servers offer their sockets to a next binary.
    fn upgrade_socket(&self) -> std::path::PathBuf {
        self.dir.path().join("upgrade.sock")
    }

    /// A tunnel-server offering its sockets for a binary upgrade.
    fn server(&self) -> common::tunnel_env::Started {
        self.server_with(&[])
    }

    fn server_with(&self, extra: &[&str]) -> common::tunnel_env::Started {
        let cfg = self.dir.path().join("server.yaml").display().to_string();
        let mut args: Vec<String> = ["tunnel-server", "--config", &cfg, "--drain", "60"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push("--upgrade-socket".into());
        args.push(self.upgrade_socket().display().to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start(&args)
    }

    /// A new binary taking the running server's sockets over.
    fn take_over(&self) -> common::tunnel_env::Started {
        self.server_with(&["--take-over", "--take-over-wait", "10"])
    }

    /// `n` downloads of `size` from `target` through the tunnel, each read
    /// to its first 64 KiB and left open.
    async fn half_read(&self, target: SocketAddr, n: usize) -> Vec<tokio::net::UnixStream> {
        let mut open = Vec::new();
        for _ in 0..n {
            let mut s = common::tunnel_env::kas_connect(&self.uds, &target.to_string())
                .await
                .unwrap();
            let mut first = vec![0u8; 64 * 1024];
            tokio::io::AsyncReadExt::read_exact(&mut s, &mut first)
                .await
                .unwrap();
            open.push(s);
        }
        open
    }

    /// Reads the rest of each half-read download: how many were exact.
    async fn finish(open: Vec<tokio::net::UnixStream>, size: u64) -> usize {
        let mut exact = 0;
        for mut s in open {
            let e = read_pattern_at(&mut s, 64 * 1024, size, Duration::from_secs(60)).await;
            assert_eq!(e, Ending::Exact, "a download across the event");
            exact += 1;
        }
        exact
    }

    /// Waits (bounded) for `server` to exit; its exit code.
    async fn exit_code(server: &mut common::tunnel_env::Started) -> Option<i32> {
        let t = Instant::now();
        loop {
            if let Some(st) = server.proc.0.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the old server did not exit after its last tunnel"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn agent(&self) -> common::tunnel_env::Started {
        Self::start(&self.agent_args)
    }

    fn oracle(server: &common::tunnel_env::Started) -> Oracle {
        Oracle::new(
            server.pid(),
            metrics_fetcher(server.admin().parse().unwrap()),
            &[
                "seedlink_tunnel_server_established_connections{",
                "seedlink_tunnel_server_pending_dials{",
            ],
        )
    }

    async fn agents(server: &common::tunnel_env::Started) -> f64 {
        let admin: SocketAddr = server.admin().parse().unwrap();
        sum_metric(
            &http_get(admin, "/metrics").await.1,
            "seedlink_tunnel_server_agents{",
        )
    }

    async fn wait_agents(server: &common::tunnel_env::Started, want: f64, what: &str) {
        let t = Instant::now();
        while Self::agents(server).await != want {
            assert!(t.elapsed() < Duration::from_secs(30), "{what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One download of a pattern transfer from `target` through the tunnel.
    async fn download(&self, target: SocketAddr, size: u64) -> Ending {
        tunnel_download(self.uds.clone(), target, size).await
    }
}

/// `p.transfers` tunnel downloads, 4 at a time, each byte-exact; how many.
async fn all_exact(bed: &TunnelBed, target: SocketAddr, p: &Profile) -> usize {
    let endings = fan(p.transfers, 4, |_| {
        tunnel_download(bed.uds.clone(), target, p.size)
    })
    .await;
    let (exact, _) = tally(&endings);
    assert_eq!(exact, endings.len(), "{endings:?}");
    exact
}

/// A pattern transfer from `target` through the Unix-socket frontend `uds`.
async fn tunnel_download(uds: String, target: SocketAddr, size: u64) -> Ending {
    match common::tunnel_env::kas_connect(&uds, &target.to_string()).await {
        Err(answer) => Ending::Error(answer),
        Ok(mut s) => read_pattern(&mut s, size, Duration::from_secs(60)).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_under_faults() {
    let p = profile();
    let stop = CancellationToken::new();
    let target = pattern_backend(p.size, &stop).await;
    // A transfer long enough to be cut mid-way (a few GiB at most).
    let endless = pattern_backend(4 << 30, &stop).await;
    // The agent's path to the server: a fault proxy (partitions).
    let mut bed = TunnelBed::new();
    let link = FaultProxy::start(
        format!("127.0.0.1:{}", bed.server_port).parse().unwrap(),
        Fault::Pass,
    )
    .await;
    bed.agent_dials(link.addr);
    let server = bed.server();
    let agent = bed.agent();
    TunnelBed::wait_agents(&server, 1.0, "the agent to connect").await;
    let oracle = TunnelBed::oracle(&server);
    eprintln!("fault: profile {} (tunnel)", p.name);
    let mut t = Tb {
        p,
        stop,
        target,
        endless,
        bed,
        link,
        server,
        agent,
        oracle,
    };
    baseline_transfers_are_exact(&mut t).await;
    a_killed_agent_cuts_its_downloads_and_each_counts_an_abort(&mut t).await;
    a_frozen_agent_gets_dials_answered_not_hanging(&mut t).await;
    a_partitioned_agent_is_dropped_and_returns_after_the_heal(&mut t).await;
    a_restarted_server_gets_its_agent_back(&mut t).await;
    a_rolling_update_and_a_binary_upgrade_finish_what_is_under_way(&mut t).await;
    t.stop.cancel();
}

/// What the phases of `tunnel_under_faults` share; a phase may replace the
/// server, the agent and the oracle.
/// Fields drop in order: the agent first, the bed last.
struct Tb {
    agent: common::tunnel_env::Started,
    oracle: Oracle,
    server: common::tunnel_env::Started,
    link: FaultProxy,
    bed: TunnelBed,
    endless: SocketAddr,
    target: SocketAddr,
    stop: CancellationToken,
    p: Profile,
}

/// Baseline: transfers through the tunnel are byte-exact.
async fn baseline_transfers_are_exact(t: &mut Tb) {
    let Tb { p, bed, oracle, .. } = t;
    let target = t.target;
    // Baseline: transfers through the tunnel are byte-exact.
    let exact = all_exact(bed, target, p).await;
    report(
        "tunnel-baseline",
        &format!("{exact} byte-exact transfers"),
        &oracle.check("tunnel-baseline").await,
    );
}

/// Agent killed under downloads: each ends at once; on the Unix socket (no
/// reset exists) the end is counted as an abort, one per transfer.
async fn a_killed_agent_cuts_its_downloads_and_each_counts_an_abort(t: &mut Tb) {
    let Tb {
        p,
        bed,
        server,
        agent,
        oracle,
        ..
    } = t;
    let target = t.target;
    let endless = t.endless;
    // Agent killed under downloads: each ends at once; on the Unix socket
    // (no reset exists) the end is counted as an abort, one per transfer.
    let aborts = |m: &str| {
        sum_metric(m, "seedlink_tunnel_server_frontend_aborts_total{cluster=\"shoot--faults\",reason=\"eof\"}")
    };
    let admin: SocketAddr = server.admin().parse().unwrap();
    let before = aborts(&http_get(admin, "/metrics").await.1);
    let mut cut = bed.half_read(endless, 4).await;
    signal(agent.pid(), "-9");
    let _ = agent.proc.0.wait();
    for s in &mut cut {
        let e = read_pattern_at(s, 64 * 1024, 4 << 30, Duration::from_secs(20)).await;
        assert!(
            matches!(e, Ending::Truncated { .. } | Ending::Error(_)),
            "a cut transfer: {e:?}"
        );
    }
    drop(cut);
    let t = Instant::now();
    while aborts(&http_get(admin, "/metrics").await.1) - before < 4.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the 4 aborts were not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let e = bed.download(target, p.size).await;
    assert!(
        matches!(&e, Ending::Error(a) if a.starts_with("HTTP/1.1 500")),
        "{e:?}"
    );
    report(
        "agent-killed",
        "4 downloads cut, each counted as an abort (eof on the Unix socket); the next dial answered 500",
        &oracle.check("agent-killed").await,
    );
    *agent = bed.agent();
    TunnelBed::wait_agents(server, 1.0, "the agent to return").await;
}

/// Agent frozen: dials are answered with an error, never left hanging; it
/// returns after SIGCONT.
async fn a_frozen_agent_gets_dials_answered_not_hanging(t: &mut Tb) {
    let Tb {
        p,
        bed,
        server,
        agent,
        oracle,
        ..
    } = t;
    let target = t.target;
    // Agent frozen: dials are answered with an error (503 unresponsive or,
    // once the keepalive dropped it, 500), never left hanging; it returns
    // after SIGCONT.
    signal(agent.pid(), "-STOP");
    let t0 = Instant::now();
    TunnelBed::wait_agents(server, 0.0, "the frozen agent to be dropped").await;
    let dropped = t0.elapsed();
    let e = bed.download(target, p.size).await;
    assert!(
        matches!(&e, Ending::Error(a) if a.starts_with("HTTP/1.1 50")),
        "{e:?}"
    );
    signal(agent.pid(), "-CONT");
    TunnelBed::wait_agents(server, 1.0, "the thawed agent to return").await;
    let back = t0.elapsed();
    let e = bed.download(target, p.size).await;
    assert_eq!(e, Ending::Exact);
    report(
        "agent-frozen",
        &format!(
            "dropped after {:.1}s, dials answered with an error meanwhile, back {:.1}s after the freeze (thawed at once)",
            dropped.as_secs_f64(),
            back.as_secs_f64()
        ),
        &oracle.check("agent-frozen").await,
    );
}

/// Agent partitioned: dropped by the keepalive; after the heal it is back
/// and transfers are exact.
async fn a_partitioned_agent_is_dropped_and_returns_after_the_heal(t: &mut Tb) {
    let Tb {
        p,
        bed,
        link,
        server,
        oracle,
        ..
    } = t;
    let target = t.target;
    // Agent partitioned (the proxy holds every byte): dropped by the
    // keepalive; after the heal it is back and transfers are exact.
    link.set(Fault::Blackhole);
    let t0 = Instant::now();
    TunnelBed::wait_agents(server, 0.0, "the partitioned agent to be dropped").await;
    let dropped = t0.elapsed();
    let e = bed.download(target, p.size).await;
    assert!(
        matches!(&e, Ending::Error(a) if a.starts_with("HTTP/1.1 50")),
        "{e:?}"
    );
    link.set(Fault::Pass);
    let healed = Instant::now();
    TunnelBed::wait_agents(server, 1.0, "the agent to return after the heal").await;
    let back = healed.elapsed();
    let e = bed.download(target, p.size).await;
    assert_eq!(e, Ending::Exact);
    report(
        "agent-partitioned",
        &format!(
            "dropped after {:.1}s, back {:.1}s after the heal",
            dropped.as_secs_f64(),
            back.as_secs_f64()
        ),
        &oracle.check("agent-partitioned").await,
    );
}

/// Server restarted (killed): the agent reconnects to the new one.
async fn a_restarted_server_gets_its_agent_back(t: &mut Tb) {
    let Tb {
        p,
        bed,
        server,
        oracle,
        ..
    } = t;
    let target = t.target;
    // Server restarted (killed): the agent reconnects to the new one.
    signal(server.pid(), "-9");
    let _ = server.proc.0.wait();
    let t0 = Instant::now();
    *server = bed.server();
    TunnelBed::wait_agents(server, 1.0, "the agent to reach the new server").await;
    let back = t0.elapsed();
    *oracle = TunnelBed::oracle(server);
    let exact = all_exact(bed, target, p).await;
    report(
        "server-restarted",
        &format!(
            "agent back {:.1}s after the restart began; {exact} transfers byte-exact",
            back.as_secs_f64()
        ),
        &oracle.check("server-restarted").await,
    );
}

/// A rolling update (the server drains while its replacement starts), then
/// a binary upgrade under a loop of dials: downloads under way finish
/// byte-exact through the old process, which exits 0; no dial fails.
async fn a_rolling_update_and_a_binary_upgrade_finish_what_is_under_way(t: &mut Tb) {
    let Tb {
        p,
        stop,
        bed,
        server,
        oracle,
        ..
    } = t;
    let target = t.target;
    // Rolling update in one place: the server drains (SIGTERM: DRAIN to
    // the agent) while its replacement starts; the agent moves at once,
    // downloads under way finish byte-exact through the draining server,
    // which then exits 0.
    let big = p.size.max(4 << 20);
    let sized = pattern_backend(big, stop).await;
    let open = bed.half_read(sized, 4).await;
    signal(server.pid(), "-TERM");
    // Its offer for a binary upgrade is withdrawn as it drains.
    let t = Instant::now();
    while bed.upgrade_socket().exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "the offer stays");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut old = std::mem::replace(server, bed.server());
    TunnelBed::wait_agents(server, 1.0, "the agent to move to the replacement").await;
    *oracle = TunnelBed::oracle(server);
    let exact = TunnelBed::finish(open, big).await;
    assert_eq!(TunnelBed::exit_code(&mut old).await, Some(0));
    let after = all_exact(bed, target, p).await;
    report(
        "server-rolling",
        &format!("{exact} downloads under way byte-exact through the draining server, old exit 0; {after} after"),
        &oracle.check("server-rolling").await,
    );

    // Binary upgrade: the new process takes the sockets (agents first,
    // then frontends) under a loop of dials; downloads under way finish
    // through the old process, which exits 0; no dial fails.
    let open = bed.half_read(sized, 4).await;
    let small = pattern_backend(64 * 1024, stop).await;
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let dials = CancellationToken::new();
    let dialer = {
        let (uds, ok, failed, dials) = (bed.uds.clone(), ok.clone(), failed.clone(), dials.clone());
        tokio::spawn(async move {
            for _ in 0..2_000 {
                if dials.is_cancelled() {
                    break;
                }
                match tunnel_download(uds.clone(), small, 64 * 1024).await {
                    Ending::Exact => ok.fetch_add(1, Ordering::Relaxed),
                    other => {
                        eprintln!("dial across the upgrade: {other:?}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        })
    };
    let mut old = std::mem::replace(server, bed.take_over());
    TunnelBed::wait_agents(server, 1.0, "the agent to move to the new process").await;
    let exact = TunnelBed::finish(open, big).await;
    assert_eq!(TunnelBed::exit_code(&mut old).await, Some(0));
    let seen = ok.load(Ordering::Relaxed);
    let t = Instant::now();
    while ok.load(Ordering::Relaxed) < seen + 10 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "dials through the new process"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    dials.cancel();
    dialer.await.unwrap();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "no dial fails across the upgrade ({ok} served)");
    *oracle = TunnelBed::oracle(server);
    let after = all_exact(bed, target, p).await;
    report(
        "server-binary-upgrade",
        &format!("{exact} downloads under way byte-exact through the old process, old exit 0; {ok} dials across it, 0 failed; {after} after"),
        &oracle.check("server-binary-upgrade").await,
    );
}
