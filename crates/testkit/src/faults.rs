//! The fault suite's tools: a fault proxy of our own (no netem on this
//! kernel), a pattern backend and client that tell a byte-exact transfer
//! from a truncated one, and the oracle checked after every scenario.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the fault proxy does to the connections through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forwards everything.
    Pass,
    /// Holds every chunk this long before forwarding it.
    Latency(Duration),
    /// Resets both sides (RST) once this many bytes went upstream → client.
    ResetAfter(u64),
    /// Stops forwarding in both directions (connections stay open) once
    /// this many bytes went upstream → client.
    StallAfter(u64),
    /// New connections are accepted and never answered nor forwarded; open
    /// ones stop forwarding until the fault changes (a partition: what was
    /// held is delivered when it heals, as TCP's retransmissions would).
    Blackhole,
    /// The connections open when it is set go dead for good (from their
    /// next byte nothing is forwarded, and they are never closed: a
    /// connection a middlebox forgot); connections opened since pass.
    Orphan,
}

/// A TCP proxy on loopback that injects [`Fault`]s, switchable at run time.
pub struct FaultProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    mode: watch::Sender<Fault>,
    stop: CancellationToken,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
}

impl FaultProxy {
    /// Listens on 127.0.0.1:0 and forwards to `upstream` under `fault`.
    pub async fn start(upstream: SocketAddr, fault: Fault) -> FaultProxy {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        FaultProxy::start_with(l, None, upstream, fault)
    }

    /// Forwards what `l` accepts to `upstream` under `fault`, dialling
    /// from inside a network namespace with `dial` (else from here): a
    /// bridge between namespaces when `l` was bound in another one.
    pub fn start_with(
        l: TcpListener,
        dial: Option<crate::NetnsDialer>,
        upstream: SocketAddr,
        fault: Fault,
    ) -> FaultProxy {
        let addr = l.local_addr().unwrap();
        let (mode, rx) = watch::channel(fault);
        let stop = CancellationToken::new();
        let accepted = Arc::new(AtomicU64::new(0));
        let (st, acc) = (stop.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let (c, _) = tokio::select! {
                    r = l.accept() => match r { Ok(x) => x, Err(_) => continue },
                    () = st.cancelled() => return,
                };
                acc.fetch_add(1, Ordering::Relaxed);
                let (rx, st, dial) = (rx.clone(), st.clone(), dial.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        () = proxy_one(c, upstream, rx, dial) => {}
                        () = st.cancelled() => {}
                    }
                });
            }
        });
        FaultProxy {
            addr,
            mode,
            stop,
            accepted,
        }
    }

    /// Changes the fault (open connections follow it from their next chunk).
    pub fn set(&self, fault: Fault) {
        self.mode.send_replace(fault);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn proxy_one(
    client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<Fault>,
    dial: Option<crate::NetnsDialer>,
) {
    // A connection opened during a partition is held until the fault
    // changes or the client leaves; what it sent meanwhile is kept (up to
    // 1 MiB) and delivered when it heals, as TCP's retransmissions would.
    if *mode.borrow_and_update() == Fault::Blackhole {
        let mut held = Vec::new();
        let mut buf = [0u8; 4096];
        let mut c = client;
        loop {
            tokio::select! {
                r = c.read(&mut buf) => match r {
                    Ok(0) | Err(_) => return,
                    Ok(n) if held.len() + n > 1 << 20 => return,
                    Ok(n) => held.extend_from_slice(&buf[..n]),
                },
                r = mode.changed() => { if r.is_err() { return } break }
            }
        }
        return proxy_connected(c, upstream, mode, dial, held).await;
    }
    proxy_connected(client, upstream, mode, dial, Vec::new()).await;
}

async fn proxy_connected(
    client: TcpStream,
    upstream: SocketAddr,
    mode: watch::Receiver<Fault>,
    dial: Option<crate::NetnsDialer>,
    held: Vec<u8>,
) {
    let up = match &dial {
        Some(d) => d.connect(upstream).await,
        None => TcpStream::connect(upstream).await,
    };
    let Ok(mut up) = up else {
        // The backend refused: the client is reset, as it would be.
        seedlink_net::sockopt::arm_reset(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = up.set_nodelay(true);
    if !held.is_empty() && up.write_all(&held).await.is_err() {
        return;
    }
    let down_bytes = Arc::new(AtomicU64::new(0));
    let cut = CancellationToken::new();
    let (cr, cw) = client.into_split();
    let (ur, uw) = up.into_split();
    let young = *mode.borrow() == Fault::Orphan;
    let a = pump(
        cr,
        uw,
        mode.clone(),
        down_bytes.clone(),
        (false, young),
        cut.clone(),
    );
    let b = pump(ur, cw, mode, down_bytes, (true, young), cut.clone());
    tokio::join!(a, b);
}

/// Copies one direction under the fault; `down`: upstream → client (the
/// direction the byte thresholds count); `young`: opened while the fault
/// was [`Fault::Orphan`] (which passes it).
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Fault>,
    down_bytes: Arc<AtomicU64>,
    (down, young): (bool, bool),
    cut: CancellationToken,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            r = r.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    let _ = w.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            () = cut.cancelled() => {
                // No FIN before the RST a reset arms.
                w.forget();
                return;
            }
        };
        let chunk = &buf[..n];
        loop {
            let fault = *mode.borrow_and_update();
            match fault {
                Fault::Pass => break,
                Fault::Orphan if young => break,
                Fault::Orphan => {
                    // Dead for good: nothing more is forwarded, nothing
                    // is closed, until the scenario drops the proxy.
                    std::future::pending::<()>().await;
                }
                Fault::Latency(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                Fault::ResetAfter(limit) | Fault::StallAfter(limit) => {
                    let sent = down_bytes.load(Ordering::Relaxed);
                    let room = if down {
                        limit.saturating_sub(sent)
                    } else if sent >= limit {
                        0
                    } else {
                        u64::MAX
                    };
                    if chunk.len() as u64 <= room {
                        break;
                    }
                    if down && room > 0 {
                        let k = room as usize;
                        if w.write_all(&chunk[..k]).await.is_err() {
                            cut.cancel();
                            return;
                        }
                        down_bytes.fetch_add(room, Ordering::Relaxed);
                    }
                    if matches!(fault, Fault::ResetAfter(_)) {
                        // Both sockets (this reader's and this writer's)
                        // close with RST once every half is dropped.
                        seedlink_net::sockopt::arm_reset(r.as_ref());
                        seedlink_net::sockopt::arm_reset(w.as_ref());
                        cut.cancel();
                        w.forget();
                        return;
                    }
                    // Stalled until the scenario drops the proxy.
                    cut.cancelled().await;
                    w.forget();
                    return;
                }
                Fault::Blackhole => {
                    // Partition: hold the chunk until the fault changes.
                    tokio::select! {
                                r = mode.changed() => if r.is_err() { return },
                                () = cut.cancelled() => {
                        // No FIN before the RST a reset arms.
                        w.forget();
                        return;
                    }
                            }
                }
            }
        }
        if w.write_all(chunk).await.is_err() {
            cut.cancel();
            return;
        }
        if down {
            down_bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
    }
}

/// Byte `i` of every pattern transfer (not periodic at any power of two,
/// so a repeated or skipped block shows).
pub fn pattern(i: u64) -> u8 {
    ((i * 7 + i / 251) % 251) as u8
}

/// A backend that answers every connection with `size` pattern bytes and
/// then a clean end (FIN), after reading whatever the client sends first.
pub async fn pattern_backend(size: u64, stop: &CancellationToken) -> SocketAddr {
    super::tcp_server(stop, move |mut s| async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut at = 0u64;
        while at < size {
            let n = (size - at).min(buf.len() as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(at + k as u64);
            }
            if s.write_all(&buf[..n]).await.is_err() {
                return;
            }
            at += n as u64;
        }
        let _ = s.shutdown().await;
        // Drain until the client closes, so the FIN is not a reset.
        let _ = tokio::time::timeout(Duration::from_secs(30), async {
            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
        })
        .await;
    })
    .await
}

/// How a transfer ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Every byte, in order, then a clean end.
    Exact,
    /// An error the client can see (reset, refused, an error answer,
    /// a timeout with the connection still open).
    Error(String),
    /// A clean end before all bytes, or wrong bytes: the failure a client
    /// cannot tell from success. Never acceptable.
    Truncated { got: u64, want: u64 },
    /// Wrong bytes at this offset.
    Corrupt(u64),
}

impl Ending {
    /// Whether a client would know (Exact or a visible Error).
    pub fn is_honest(&self) -> bool {
        matches!(self, Ending::Exact | Ending::Error(_))
    }
}

/// Reads a pattern transfer of `want` bytes from `s` (already past any
/// proxy answer), checking each byte; at most `limit` in all.
pub async fn read_pattern<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    want: u64,
    limit: Duration,
) -> Ending {
    read_pattern_at(s, 0, want, limit).await
}

/// [`read_pattern`] of a transfer whose first `at` bytes were read already.
pub async fn read_pattern_at<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    at: u64,
    want: u64,
    limit: Duration,
) -> Ending {
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = at;
    let end = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(end, s.read(&mut buf)).await {
            Err(_) => return Ending::Error(format!("no end within {limit:?} after {got} bytes")),
            Ok(Err(e)) => return Ending::Error(format!("{:?} after {got} bytes", e.kind())),
            Ok(Ok(0)) => {
                return if got == want {
                    Ending::Exact
                } else {
                    Ending::Truncated { got, want }
                }
            }
            Ok(Ok(n)) => {
                for (k, b) in buf[..n].iter().enumerate() {
                    if *b != pattern(got + k as u64) {
                        return Ending::Corrupt(got + k as u64);
                    }
                }
                got += n as u64;
            }
        }
    }
}

/// Sends `CONNECT` for `dest` (a destination the gateway routes) and reads
/// the answer head; `Ok` on 200.
pub async fn gateway_connect(addr: SocketAddr, dest: &str) -> Result<TcpStream, String> {
    let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    s.write_all(
        format!("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {dest}\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut b)).await {
            Ok(Ok(1)) => head.push(b[0]),
            Ok(Ok(_)) => return Err(format!("closed after {:?}", String::from_utf8_lossy(&head))),
            Ok(Err(e)) => {
                return Err(format!(
                    "{} after {:?}",
                    e.kind(),
                    String::from_utf8_lossy(&head)
                ))
            }
            Err(_) => return Err("no answer within 20 s".into()),
        }
    }
    if head.starts_with(b"HTTP/1.1 200") {
        Ok(s)
    } else {
        Err(String::from_utf8_lossy(&head).into_owned())
    }
}

/// What the oracle measured of a process after a scenario.
#[derive(Debug, Clone)]
pub struct Settled {
    /// Open descriptors (pool pipes excluded).
    pub fds: usize,
    /// Tasks alive in its runtime.
    pub tasks: f64,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// How long it took to settle.
    pub took: Duration,
}

/// The checks after every scenario: the process lives, no panic, its
/// descriptors (minus pooled splice pipes), runtime tasks, CLOSE-WAIT
/// sockets and the named gauges are back to their baseline, and its RSS
/// within a bound.
pub struct Oracle {
    pid: u32,
    metrics: Box<dyn Fn() -> String + Send + Sync>,
    gauges: Vec<String>,
    base_fds: usize,
    base_tasks: f64,
    /// Resident memory at the baseline, KiB.
    pub base_rss_kib: u64,
    /// Descriptors allowed above the baseline (listeners re-bound, files).
    pub fd_slack: usize,
    /// RSS allowed above the baseline, KiB.
    pub rss_slack_kib: u64,
}

fn metric(text: &str, prefix: &str) -> f64 {
    super::sum_metric(text, prefix)
}

impl Oracle {
    /// Takes the baseline of process `pid`, whose `/metrics` `metrics`
    /// fetches; `gauges` (name prefixes) must return to their sum now.
    pub fn new(
        pid: u32,
        metrics: impl Fn() -> String + Send + Sync + 'static,
        gauges: &[&str],
    ) -> Oracle {
        let m = metrics();
        let base_fds = fds(pid) - pipe_fds(&m);
        let base_tasks = metric(&m, "seedlink_runtime_tasks ");
        assert!(base_tasks > 0.0, "no seedlink_runtime_tasks in the metrics");
        Oracle {
            pid,
            base_tasks,
            metrics: Box::new(metrics),
            gauges: gauges.iter().map(|g| (*g).to_string()).collect(),
            base_fds,
            base_rss_kib: rss_kib(pid),
            fd_slack: 4,
            rss_slack_kib: 20 * 1024,
        }
    }

    /// Waits (≤ 30 s) for the process to settle after `scenario`; panics
    /// naming what did not.
    pub async fn check(&self, scenario: &str) -> Settled {
        let t0 = Instant::now();
        loop {
            let alive = std::path::Path::new(&format!("/proc/{}", self.pid)).exists();
            assert!(alive, "{scenario}: the process is gone");
            let m = (self.metrics)();
            assert_eq!(
                metric(&m, "seedlink_panics_total"),
                0.0,
                "{scenario}: a panic (see the process's log)"
            );
            let fds_now = fds(self.pid).saturating_sub(pipe_fds(&m));
            let cw = close_wait(self.pid);
            let gauges: Vec<(String, f64)> = self
                .gauges
                .iter()
                .map(|g| (g.clone(), metric(&m, g)))
                .filter(|(_, v)| *v != 0.0)
                .collect();
            let rss = rss_kib(self.pid);
            let tasks = metric(&m, "seedlink_runtime_tasks ");
            let settled = fds_now <= self.base_fds + self.fd_slack
                && tasks <= self.base_tasks + 2.0
                && cw == 0
                && gauges.is_empty()
                && rss <= self.base_rss_kib + self.rss_slack_kib;
            if settled {
                return Settled {
                    fds: fds_now,
                    tasks,
                    rss_kib: rss,
                    took: t0.elapsed(),
                };
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{scenario}: not back to baseline after 30 s: fds {fds_now} (baseline {} + {}), \
                 tasks {tasks} (baseline {} + 2), CLOSE-WAIT {cw}, gauges not at 0 {gauges:?}, \
                 RSS {rss} KiB (baseline {} + {})",
                self.base_fds,
                self.fd_slack,
                self.base_tasks,
                self.base_rss_kib,
                self.rss_slack_kib
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Descriptors of the pool's splice pipes (`splice_pipes{state="open"}`,
/// two each): kept after a burst by design (docs/OPERATIONS.md).
fn pipe_fds(metrics: &str) -> usize {
    2 * metric(metrics, "seedlink_gateway_splice_pipes{state=\"open\"}") as usize
}

/// Open descriptors of `pid`.
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Resident memory of `pid`, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Sockets of `pid` in CLOSE-WAIT (the peer closed, the process did not):
/// its socket inodes matched against its namespace's TCP tables.
pub fn close_wait(pid: u32) -> usize {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| {
                let t = std::fs::read_link(e.ok()?.path()).ok()?;
                let t = t.to_string_lossy();
                Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
            })
            .collect()
        })
        .unwrap_or_default();
    let mut n = 0;
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for l in text.lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            // st is field 3 (0x08 = CLOSE_WAIT), the inode field 9.
            if f.len() > 9 && f[3] == "08" && inodes.contains(f[9]) {
                n += 1;
            }
        }
    }
    n
}
