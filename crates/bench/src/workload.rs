//! The backend and the four measurements.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream, UnixStream};
use tokio_util::either::Either;

use crate::procstat::{cpu_seconds, rss_kib, wakeups, wakeups_since};
use crate::scenario::{Opts, Sample};

/// A real ClientHello (openssl s_client) with SNI `api.alpha.example.com`.
pub const HELLO: &[u8] = include_bytes!("../../proto/testdata/openssl_client_hello.bin");

const BULK: u8 = b'B';
const ONE_AND_CLOSE: u8 = b'C';
pub(crate) const ONE_AND_IDLE: u8 = b'I';
pub(crate) const ECHO: u8 = b'E';

/// Backend connections now open that were asked for one byte then idle
/// (the storm scenario waits for its clients' close to reach the backend).
pub(crate) static IDLE_OPEN: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Where [`HELLO`]'s server name starts, and its length.
/// Found once: the backend checks every connection's hello against it.
fn sni_span() -> (usize, usize) {
    static SPAN: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *SPAN.get_or_init(|| {
        let name = crate::scenario::SNI.as_bytes();
        // The capture spells it `api.Alpha.example.com`.
        let at = HELLO
            .windows(name.len())
            .position(|w| w.eq_ignore_ascii_case(name))
            .unwrap_or(0);
        (at, name.len())
    })
}

/// [`HELLO`] asking for [`crate::scenario::storm_name`]`(i)`.
pub(crate) fn hello_for(i: usize) -> Vec<u8> {
    let (at, len) = sni_span();
    let mut h = HELLO.to_vec();
    h[at..at + len].copy_from_slice(&crate::scenario::storm_name(i).as_bytes()[..len]);
    h
}

/// Whether `got` is [`HELLO`], its server name aside.
fn is_hello(got: &[u8]) -> bool {
    let (at, len) = sni_span();
    got.len() == HELLO.len() && got[..at] == HELLO[..at] && got[at + len..] == HELLO[at + len..]
}
const UPLOAD: u8 = b'U';

/// Where a target listens: TCP on loopback, or a Unix socket (upstream
/// Konnectivity's plain frontend is only offered on a Unix socket).
#[derive(Debug, Clone)]
pub enum Target {
    /// A loopback TCP address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(Arc<std::path::Path>),
    /// A loopback TCP address; every connection first sends a PROXY v2
    /// header naming the client's real addresses.
    TcpProxyV2(SocketAddr),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(a) => write!(f, "{a}"),
            Target::TcpProxyV2(a) => write!(f, "{a} (PROXY v2)"),
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A PROXY protocol v2 header (PROXY command, TCP over IPv4) for a
/// connection from `src` to `dst`, as a load balancer sends it.
fn proxy_v2_header(src: SocketAddr, dst: SocketAddr) -> anyhow::Result<Vec<u8>> {
    let (SocketAddr::V4(s), SocketAddr::V4(d)) = (src, dst) else {
        bail!("the PROXY scenario runs over IPv4 loopback");
    };
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, 0x11, 0, 12]);
    h.extend_from_slice(&s.ip().octets());
    h.extend_from_slice(&d.ip().octets());
    h.extend_from_slice(&s.port().to_be_bytes());
    h.extend_from_slice(&d.port().to_be_bytes());
    Ok(h)
}

/// A client connection to a target.
pub(crate) type Conn = Either<TcpStream, UnixStream>;

/// Connects to `t`, over TCP from `src` when given, with a 10 s bound.
pub(crate) async fn dial(t: &Target, src: Option<IpAddr>) -> anyhow::Result<Conn> {
    let c = match t {
        Target::Tcp(addr) | Target::TcpProxyV2(addr) => {
            let sock = TcpSocket::new_v4()?;
            if let Some(src) = src {
                sock.bind(SocketAddr::new(src, 0))?;
            }
            let mut c =
                tokio::time::timeout(Duration::from_secs(10), sock.connect(*addr)).await??;
            c.set_nodelay(true)?;
            if matches!(t, Target::TcpProxyV2(_)) {
                c.write_all(&proxy_v2_header(c.local_addr()?, *addr)?)
                    .await?;
            }
            Either::Left(c)
        }
        Target::Unix(path) => Either::Right(
            tokio::time::timeout(Duration::from_secs(10), UnixStream::connect(path)).await??,
        ),
    };
    Ok(c)
}

/// The in-process backend every proxy forwards to.
pub struct Backend {
    /// Its address.
    pub addr: SocketAddr,
}

impl Backend {
    /// Starts the backend on an ephemeral loopback port. Its accept queue
    /// holds 4,096 (as every proxy's does in the bench): a storm's
    /// upstream connections must not be lost to the backend's.
    pub async fn start() -> anyhow::Result<Backend> {
        Backend::start_on(1).await
    }

    /// [`Backend::start`] with `sockets` `SO_REUSEPORT` sockets on one
    /// port (4,096 each): the storm's thousands of upstream connections
    /// at once, which a kube-apiserver per control plane would take, must
    /// not overflow one accept queue.
    pub async fn start_on(sockets: usize) -> anyhow::Result<Backend> {
        let mut addr: SocketAddr = "127.0.0.1:0".parse()?;
        for _ in 0..sockets.max(1) {
            let sock = TcpSocket::new_v4()?;
            sock.set_reuseport(true)?;
            sock.bind(addr)?;
            let l = sock.listen(4096)?;
            addr = l.local_addr()?;
            tokio::spawn(async move {
                loop {
                    let Ok((s, _)) = l.accept().await else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    tokio::spawn(async move {
                        let _ = serve(s).await;
                    });
                }
            });
        }
        Ok(Backend { addr })
    }
}

/// Reads the hello and a command byte (plus 8 length bytes for bulk), then
/// plays its part.
async fn serve(mut s: TcpStream) -> anyhow::Result<()> {
    s.set_nodelay(true)?;
    let mut head = vec![0u8; HELLO.len() + 1];
    s.read_exact(&mut head).await?;
    if !is_hello(&head[..HELLO.len()]) {
        bail!("backend received something other than the hello");
    }
    match head[HELLO.len()] {
        BULK => {
            let mut len = [0u8; 8];
            s.read_exact(&mut len).await?;
            let mut left = u64::from_be_bytes(len);
            let chunk = vec![0x5au8; 256 * 1024];
            while left > 0 {
                let n = usize::try_from(left.min(chunk.len() as u64))?;
                s.write_all(&chunk[..n]).await?;
                left -= n as u64;
            }
            s.shutdown().await?;
            let mut sink = [0u8; 64];
            while s.read(&mut sink).await? > 0 {}
        }
        ONE_AND_CLOSE => {
            s.write_all(b"x").await?;
            s.shutdown().await?;
            let mut sink = [0u8; 64];
            while s.read(&mut sink).await? > 0 {}
        }
        ONE_AND_IDLE => {
            IDLE_OPEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let r = async {
                s.write_all(b"x").await?;
                let mut sink = [0u8; 64];
                while s.read(&mut sink).await? > 0 {}
                anyhow::Ok(())
            }
            .await;
            IDLE_OPEN.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            r?;
        }
        ECHO => {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).await?;
            }
        }
        UPLOAD => {
            let mut len = [0u8; 8];
            s.read_exact(&mut len).await?;
            let mut left = u64::from_be_bytes(len);
            let mut buf = vec![0u8; 256 * 1024];
            while left > 0 {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    bail!("upload: the client's bytes ended {left} early");
                }
                left = left.saturating_sub(n as u64);
            }
            s.write_all(b"k").await?;
            s.shutdown().await?;
            let mut sink = [0u8; 64];
            while s.read(&mut sink).await? > 0 {}
        }
        _ => bail!("unknown command"),
    }
    Ok(())
}

/// Runs the bulk, rate and latency workloads against `addr`; `pids` are the proxy's processes
/// (empty for the direct baseline); `pipelined`: the latency run is repeated
/// with the CONNECT pipelined (a frontend that keeps bytes sent before its
/// answer).
pub async fn measure(
    opts: &Opts,
    addr: &Target,
    pids: &[u32],
    proxied: bool,
    connect: bool,
    pipelined: bool,
) -> anyhow::Result<Sample> {
    let mut s = Sample::default();
    // Bulk download.
    let bytes = opts.bulk_mib * 1024 * 1024;
    let cpu0 = cpu_seconds(pids);
    let per0: Vec<f64> = pids.iter().map(|p| cpu_seconds(&[*p])).collect();
    let t0 = Instant::now();
    let tunnel = proxied && connect;
    let got = bulk(addr, bytes, tunnel).await.context("bulk")?;
    per_process("download", pids, &per0);
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pids) - cpu0;
    if got != bytes {
        bail!("bulk: received {got} of {bytes} bytes");
    }
    s.gbps = Some(bytes as f64 * 8.0 / secs / 1e9);
    if proxied {
        s.cpu_s_per_gb = Some(cpu / (bytes as f64 / 1e9));
    }
    // Bulk upload (the tunnel scenario: client → frontend → server → agent
    // → destination, the direction of `kubectl cp` into a pod).
    if crate::scenario::TUNNEL_SCENARIO.get().is_some() {
        let cpu0 = cpu_seconds(pids);
        let t0 = Instant::now();
        let per0: Vec<f64> = pids.iter().map(|p| cpu_seconds(&[*p])).collect();
        upload(addr, bytes, tunnel).await.context("upload")?;
        per_process("upload", pids, &per0);
        let secs = t0.elapsed().as_secs_f64();
        s.up_gbps = Some(bytes as f64 * 8.0 / secs / 1e9);
        if proxied {
            s.up_cpu_s_per_gb = Some((cpu_seconds(pids) - cpu0) / (bytes as f64 / 1e9));
        }
    }
    // Many concurrent bulk downloads (streams on one h2 connection in the
    // node-proxy-h2 scenario).
    let streams = opts.streams.unwrap_or(0);
    if streams > 0 {
        let each = bytes / streams as u64;
        let cpu0 = cpu_seconds(pids);
        let t0 = Instant::now();
        let runs: Vec<_> = (0..streams)
            .map(|_| {
                let addr = addr.clone();
                tokio::spawn(async move { bulk(&addr, each, tunnel).await })
            })
            .collect();
        let mut got = 0;
        for r in runs {
            got += r.await.context("stream task")?.context("stream bulk")?;
        }
        let secs = t0.elapsed().as_secs_f64();
        if got != each * streams as u64 {
            bail!(
                "many-streams bulk: received {got} of {} bytes",
                each * streams as u64
            );
        }
        s.streams_gbps = Some(got as f64 * 8.0 / secs / 1e9);
        if proxied {
            s.streams_cpu_s_per_gb = Some((cpu_seconds(pids) - cpu0) / (got as f64 / 1e9));
        }
    }
    // Connection rate under concurrency.
    let cpu0 = cpu_seconds(pids);
    let t0 = Instant::now();
    let (rate, p50, p99) = rate(
        addr.clone(),
        opts.rate_concurrency,
        Duration::from_secs_f64(opts.rate_secs),
        tunnel,
    )
    .await?;
    let conns = rate * t0.elapsed().as_secs_f64();
    if proxied && conns > 0.0 {
        s.cpu_us_per_conn = Some((cpu_seconds(pids) - cpu0) * 1e6 / conns);
    }
    s.conn_rate = Some(rate);
    s.rate_p50_us = Some(p50);
    s.rate_p99_us = Some(p99);
    // Single-connection latency.
    let mut lat = Vec::with_capacity(opts.latency_conns);
    let woken0 = wakeups(pids);
    let mut answers = Vec::new();
    for i in 0..opts.latency_conns {
        let (us, answer) = one_conn_timed(addr, src_ip(i), tunnel).await?;
        lat.push(us);
        answers.extend(answer);
    }
    if !answers.is_empty() {
        s.answer_p50_us = Some(percentile(&mut answers, 0.50));
    }
    if proxied && opts.latency_conns > 0 {
        s.single_wakeups =
            Some(wakeups_since(&woken0, &wakeups(pids)) as f64 / opts.latency_conns as f64);
    }
    s.single_p50_us = Some(percentile(&mut lat, 0.50));
    if tunnel && pipelined {
        let mut lat = Vec::with_capacity(opts.latency_conns);
        for i in 0..opts.latency_conns {
            lat.push(one_conn_pipelined(addr, src_ip(i)).await?);
        }
        s.pipelined_p50_us = Some(percentile(&mut lat, 0.50));
    }
    if crate::scenario::TUNNEL_SCENARIO.get().is_some() {
        s.hol_p99_ratio = Some(hol(addr, tunnel).await.context("head-of-line run")?);
    }
    Ok(s)
}

/// Prints each process's CPU seconds since `before` (a tunnel's server and
/// agent, separately), when the target has more than one process.
fn per_process(what: &str, pids: &[u32], before: &[f64]) {
    if pids.len() > 1 {
        let used: Vec<String> = pids
            .iter()
            .zip(before)
            .map(|(p, c)| format!("pid {p}: {:.2}", cpu_seconds(&[*p]) - c))
            .collect();
        eprintln!("bench: {what} CPU s per process: {}", used.join(", "));
    }
}

/// Opens a connection, and if `connect`, its tunnel; sends the hello and `cmd`.
async fn open(addr: &Target, connect: bool, cmd: &[u8]) -> anyhow::Result<Conn> {
    let mut c = dial(addr, None).await?;
    if connect {
        open_tunnel(&mut c).await?;
    }
    let mut msg = HELLO.to_vec();
    msg.extend_from_slice(cmd);
    c.write_all(&msg).await?;
    Ok(c)
}

/// Reachability probe: one byte through.
pub async fn probe(addr: &Target, connect: bool) -> anyhow::Result<()> {
    let mut c = open(addr, connect, &[ONE_AND_CLOSE]).await?;
    let mut b = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(2), c.read_exact(&mut b)).await??;
    if b[0] != b'x' {
        bail!("probe: expected the destination's `x`, got {:?}", b[0]);
    }
    Ok(())
}

/// Head-of-line figure: p99 of 1 KiB echo round trips while another
/// connection through the same tunnel has a 4 GiB download its reader
/// never reads, divided by the p99 without it.
async fn hol(addr: &Target, connect: bool) -> anyhow::Result<f64> {
    async fn rtts(c: &mut Conn, for_: Duration, min: usize) -> anyhow::Result<Vec<f64>> {
        let msg = [7u8; 1024];
        let mut back = [0u8; 1024];
        let mut v = Vec::new();
        let t = Instant::now();
        while t.elapsed() < for_ || v.len() < min {
            let t0 = Instant::now();
            c.write_all(&msg).await?;
            tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut back)).await??;
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        Ok(v)
    }
    let mut echo = open(addr, connect, &[ECHO]).await?;
    let mut idle = rtts(&mut echo, Duration::from_secs(1), 200).await?;
    let mut cmd = vec![BULK];
    cmd.extend_from_slice(&(4u64 << 30).to_be_bytes());
    let stalled = open(addr, connect, &cmd).await?;
    let busy = rtts(&mut echo, Duration::from_secs(3), 200).await;
    drop(stalled);
    let mut busy = match busy {
        Ok(v) => v,
        Err(e) => {
            // No answer within 10 s: the stalled reader blocked its
            // neighbour (upstream Konnectivity has no per-connection flow
            // control). Reported as an infinite ratio, not a failed run.
            eprintln!("bench: head-of-line: the echo stalled beside a stalled reader ({e:#})");
            return Ok(f64::INFINITY);
        }
    };
    let (pi, pb) = (percentile(&mut idle, 0.99), percentile(&mut busy, 0.99));
    eprintln!("bench: head-of-line: echo p99 {pi:.0} µs idle, {pb:.0} µs beside a stalled reader");
    Ok(pb / pi.max(1.0))
}

/// Uploads `bytes` to the backend and waits for its acknowledgement.
async fn upload(addr: &Target, bytes: u64, tunnel: bool) -> anyhow::Result<()> {
    let mut c = dial(addr, None).await?;
    if tunnel {
        open_tunnel(&mut c).await?;
    }
    let mut msg = HELLO.to_vec();
    msg.push(UPLOAD);
    msg.extend_from_slice(&bytes.to_be_bytes());
    c.write_all(&msg).await?;
    let chunk = vec![0xa5u8; 256 * 1024];
    let mut left = bytes;
    while left > 0 {
        let n = usize::try_from(left.min(chunk.len() as u64))?;
        tokio::time::timeout(Duration::from_secs(30), c.write_all(&chunk[..n])).await??;
        left -= n as u64;
    }
    let mut ack = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(30), c.read_exact(&mut ack)).await??;
    if ack != *b"k" {
        bail!("upload: the backend answered {ack:?}");
    }
    Ok(())
}

async fn bulk(addr: &Target, bytes: u64, tunnel: bool) -> anyhow::Result<u64> {
    let mut c = dial(addr, None).await?;
    if tunnel {
        open_tunnel(&mut c).await?;
    }
    let mut msg = HELLO.to_vec();
    msg.push(BULK);
    msg.extend_from_slice(&bytes.to_be_bytes());
    c.write_all(&msg).await?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0u64;
    loop {
        let n = tokio::time::timeout(Duration::from_secs(30), c.read(&mut buf)).await??;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    Ok(got)
}

/// Spreads clients over 127.0.0.2–127.0.0.201 so the rate runs do not
/// exhaust one source address's ephemeral ports.
pub(crate) fn src_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        127,
        0,
        0,
        2 + u8::try_from(i % 200).unwrap_or(0),
    ))
}

/// One connection: connect, send the hello, wait for the first byte, close.
/// Returns connect-to-first-byte in µs.
async fn one_conn(addr: &Target, src: IpAddr, tunnel: bool) -> anyhow::Result<f64> {
    Ok(one_conn_timed(addr, src, tunnel).await?.0)
}

/// [`one_conn`], with the time to the CONNECT's answer (when `tunnel`), µs.
async fn one_conn_timed(
    addr: &Target,
    src: IpAddr,
    tunnel: bool,
) -> anyhow::Result<(f64, Option<f64>)> {
    let t0 = Instant::now();
    let mut c = dial(addr, Some(src)).await?;
    let mut answered = None;
    if tunnel {
        open_tunnel(&mut c).await?;
        answered = Some(t0.elapsed().as_secs_f64() * 1e6);
    }
    let mut msg = HELLO.to_vec();
    msg.push(ONE_AND_CLOSE);
    c.write_all(&msg).await?;
    let mut b = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut b)).await??;
    let us = t0.elapsed().as_secs_f64() * 1e6;
    if b[0] != b'x' {
        bail!("expected the destination's `x`, got {:?}", b[0]);
    }
    // Wait for the backend's close to come through, then close. Through a
    // CONNECT tunnel the close is not always relayed (Envoy keeps the
    // tunnel open), so there the client closes right after the byte.
    if !tunnel && !crate::scenario::node_proxy_scenario() {
        let mut sink = [0u8; 16];
        let _ = tokio::time::timeout(Duration::from_secs(10), c.read(&mut sink)).await;
    }
    Ok((us, answered))
}

/// [`one_conn`] with the CONNECT pipelined: the request head and the
/// first bytes in one write, before the answer. kube-apiserver never does
/// this (it waits for the 200); the figure shows what the client's round
/// trip for the answer costs, as a floor of a CONNECT tunnel's latency.
async fn one_conn_pipelined(addr: &Target, src: IpAddr) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut c = dial(addr, Some(src)).await?;
    let mut msg = connect_head()
        .ok_or_else(|| anyhow::anyhow!("pipelined CONNECT outside a tunnel scenario"))?
        .into_bytes();
    msg.extend_from_slice(HELLO);
    msg.push(ONE_AND_CLOSE);
    c.write_all(&msg).await?;
    // The destination's byte may come in the answer's read.
    let mut got = read_answer(&mut c).await?;
    if got.is_empty() {
        let mut b = [0u8; 1];
        tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut b)).await??;
        got.push(b[0]);
    }
    if got != b"x" {
        bail!("pipelined CONNECT: expected the destination's `x`, got {got:?}");
    }
    Ok(t0.elapsed().as_secs_f64() * 1e6)
}

async fn rate(
    addr: Target,
    conc: usize,
    dur: Duration,
    tunnel: bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..conc {
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u32;
            let mut i = w;
            while start.elapsed() < dur {
                match one_conn(&addr, src_ip(i), tunnel).await {
                    Ok(us) => lat.push(us),
                    Err(_) => errors += 1,
                }
                i += conc;
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        all.extend(l);
        errors += e;
    }
    let secs = start.elapsed().as_secs_f64();
    if errors > 0 && all.is_empty() {
        bail!("every connection of the rate run failed ({errors})");
    }
    if errors > 0 {
        eprintln!(
            "bench: {errors} failed connections during the rate run ({} succeeded)",
            all.len()
        );
    }
    let n = all.len() as f64;
    Ok((
        n / secs,
        percentile(&mut all, 0.50),
        percentile(&mut all, 0.99),
    ))
}

/// RSS growth per idle proxied connection. Run against a freshly started
/// proxy: memory that an allocator keeps after earlier runs would otherwise
/// hide the growth.
pub async fn idle(addr: &Target, pids: &[u32], n: usize, tunnel: bool) -> anyhow::Result<f64> {
    // Let memory from the previous runs settle before the baseline.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(pids);
    let held = Arc::new(tokio::sync::Mutex::new(Vec::with_capacity(n)));
    let mut tasks = Vec::new();
    let per = n.div_ceil(8);
    for w in 0..8 {
        let held = held.clone();
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            for i in (w * per)..((w + 1) * per).min(n) {
                let mut c = dial(&addr, Some(src_ip(i))).await?;
                if tunnel {
                    open_tunnel(&mut c).await?;
                }
                let mut msg = HELLO.to_vec();
                msg.push(ONE_AND_IDLE);
                c.write_all(&msg).await?;
                let mut b = [0u8; 1];
                tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut b)).await??;
                held.lock().await.push(c);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let mut failed = 0;
    for t in tasks {
        if let Err(e) = t.await? {
            eprintln!("bench: idle connection failed: {e:#}");
            failed += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib(pids);
    let opened = held.lock().await.len();
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    if opened == 0 || failed > 0 {
        bail!("idle run: only {opened} of {n} connections opened");
    }
    Ok((after - before) / opened as f64)
}

pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

/// CONNECT scenario: asks the proxy for a tunnel to the backend (the
/// destination header names it) and waits for `200` before the workload's
/// own bytes, as node proxies do.
async fn open_tunnel(c: &mut Conn) -> anyhow::Result<()> {
    let Some(head) = connect_head() else {
        return Ok(());
    };
    c.write_all(head.as_bytes()).await?;
    // Nothing may follow the answer before the client sends (kube-apiserver
    // fails such a tunnel: "unexpected extra data").
    let extra = read_answer(c).await?;
    if !extra.is_empty() {
        bail!("{} bytes after the CONNECT answer", extra.len());
    }
    Ok(())
}

/// The CONNECT request head for the backend, in scenarios that tunnel.
fn connect_head() -> Option<String> {
    let dest = crate::scenario::tunnel_destination()?;
    let target = crate::scenario::CONNECT_TARGET
        .get()
        .map_or("backend:443", String::as_str);
    Some(format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nX-Gardener-Destination: {dest}\r\n\r\n"
    ))
}

/// Reads the proxy's answer to a CONNECT as kube-apiserver does (Go's
/// `http.ReadResponse` over a `bufio.Reader`: as much as the socket has
/// per read, not a byte at a time) under one deadline; fails unless it is
/// 200. Returns the bytes that came after the answer's head.
async fn read_answer(c: &mut Conn) -> anyhow::Result<Vec<u8>> {
    let mut got = Vec::with_capacity(256);
    let read = async {
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                return Ok(end + 4);
            }
            if got.len() > 4096 {
                bail!("CONNECT answer too long");
            }
            if c.read_buf(&mut got).await? == 0 {
                bail!("proxy closed during CONNECT");
            }
        }
    };
    let end = tokio::time::timeout(Duration::from_secs(10), read).await??;
    if !got.starts_with(b"HTTP/1.1 200") && !got.starts_with(b"HTTP/1.0 200") {
        bail!("CONNECT refused: {}", String::from_utf8_lossy(&got[..end]));
    }
    Ok(got.split_off(end))
}
