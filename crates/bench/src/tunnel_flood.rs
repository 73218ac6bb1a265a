//! The fairness scenario (`--scenario tunnel-flood`): one seedlink
//! tunnel-server on its default worker count with two clusters, a victim
//! and an attacker. The victim's agent (seedlink's own, in this process)
//! carries an echo connection whose round trips are measured while the
//! attacker, with its own cluster's valid certificate, floods the server
//! one way at a time: packets that move nothing on the native transport
//! (DRAIN, PING, DIAL_CLS for dials it never had, DATA for connections it
//! does not have; on one stream and on four), and TLS handshakes. Each
//! flood reconnects as soon as the server cuts it, as an attacker would.
//! Quiet and flooded phases alternate within every round; the table gives
//! the medians of each phase's p50 and p99 and the ratio to the quiet
//! p99. The attackers run on a thread and runtime of their own at the
//! lowest priority, so that their client-side work does not land on the
//! victim's measuring tasks nor take a core from the server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use prost::Message;
use seedlink_tunnel::agent::Agent;
use seedlink_tunnel::proto::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::scenario::Opts;
use crate::tunnel_scale::{admin_get, bench_agent, issue, metric_sum, pct, start_server, write};
use crate::workload::HELLO;

/// How long each phase measures the victim.
const PHASE: Duration = Duration::from_secs(3);

/// One way to flood.
#[derive(Clone, Copy, Debug)]
enum Flood {
    Quiet,
    /// Native frames that move nothing, on `streams` streams at once.
    Frames {
        what: &'static str,
        streams: usize,
    },
    /// TLS handshakes (with the attacker's certificate), closed at once.
    Handshakes,
}

const FLOODS: [Flood; 7] = [
    Flood::Quiet,
    Flood::Frames {
        what: "drain",
        streams: 1,
    },
    Flood::Frames {
        what: "drain",
        streams: 4,
    },
    Flood::Frames {
        what: "ping",
        streams: 1,
    },
    Flood::Frames {
        what: "dial-cls",
        streams: 4,
    },
    Flood::Frames {
        what: "unknown-data",
        streams: 4,
    },
    Flood::Handshakes,
];

impl Flood {
    fn label(self) -> String {
        match self {
            Flood::Quiet => "quiet".into(),
            Flood::Frames { what, streams } => format!("{what} × {streams} stream(s)"),
            Flood::Handshakes => "TLS handshakes × 4".into(),
        }
    }
}

/// A native frame: type, length, body.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&u32::try_from(body.len()).unwrap_or(0).to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// 4,096 frames of `what`, sent in one write.
fn batch(what: &str) -> Vec<u8> {
    let one = match what {
        "ping" => frame(1, &[]),
        "drain" => frame(0, &Packet::drain().encode_to_vec()),
        "dial-cls" => frame(0, &Packet::dial_cls(424_242).encode_to_vec()),
        _ => frame(0, &Packet::data(987_654, bytes_of(b"x")).encode_to_vec()),
    };
    one.repeat(4096)
}

fn bytes_of(b: &'static [u8]) -> bytes::Bytes {
    bytes::Bytes::from_static(b)
}

/// The attacker's identity and the server's address.
#[derive(Clone)]
struct Attacker {
    tls: Arc<rustls::ClientConfig>,
    server: SocketAddr,
}

impl Attacker {
    /// TLS to the agent port with the attacker's certificate, from a
    /// source address of its own (127.0.0.2; the victim's agent connects
    /// from 127.0.0.1), as an attacker elsewhere would.
    async fn tls(&self) -> anyhow::Result<seedlink_tunnel::usertls::UserTls<TcpStream>> {
        let sock = tokio::net::TcpSocket::new_v4()?;
        sock.bind(SocketAddr::from(([127, 0, 0, 2], 0)))?;
        let tcp = sock.connect(self.server).await?;
        let name = rustls::pki_types::ServerName::try_from("tunnel.bench")?;
        Ok(tokio::time::timeout(
            Duration::from_secs(10),
            seedlink_tunnel::usertls::connect(self.tls.clone(), name, tcp),
        )
        .await??)
    }

    /// One flooding stream: OPEN, then `batch` again and again until the
    /// server cuts it; the frames sent.
    async fn frames(&self, batch: &[u8], stop: &CancellationToken) -> anyhow::Result<u64> {
        let mut tls = self.tls().await?;
        let meta = [
            ("agentid", format!("flood-{}", rand_id())),
            ("seedlink-flow-control", "v1".to_string()),
        ];
        match seedlink_tunnel::native::open(&mut tls, &meta).await? {
            seedlink_tunnel::native::Opened::Answer(_) => {}
            seedlink_tunnel::native::Opened::Refused(s) => bail!("refused: {s}"),
        }
        let mut sent = 0;
        while !stop.is_cancelled() {
            if tls.write_all(batch).await.is_err() {
                break;
            }
            sent += 4096;
        }
        Ok(sent)
    }
}

/// `BENCH_FLOOD_RETRY_MS`: the attacker waits this long after a refusal
/// instead of retrying at once (to tell the cost of refused connections
/// from the rest).
fn retry_pause() -> Option<Duration> {
    std::env::var("BENCH_FLOOD_RETRY_MS")
        .ok()?
        .parse()
        .ok()
        .map(Duration::from_millis)
}

fn rand_id() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Runs `flood` on its own thread until `stop`; counts streams cut.
fn start_flood(
    attacker: Attacker,
    flood: Flood,
    stop: CancellationToken,
    cuts: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        lowest_priority();
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async move {
            let (what, n) = match flood {
                Flood::Quiet => return,
                Flood::Frames { what, streams } => (Some(what), streams),
                Flood::Handshakes => (None, 4),
            };
            let batch = Arc::new(what.map(batch).unwrap_or_default());
            let mut tasks = Vec::new();
            for _ in 0..n {
                let (a, stop, cuts, batch) =
                    (attacker.clone(), stop.clone(), cuts.clone(), batch.clone());
                tasks.push(tokio::spawn(async move {
                    while !stop.is_cancelled() {
                        let attempt = async {
                            match what {
                                Some(_) => a.frames(&batch, &stop).await.map(|_| ()),
                                None => a.tls().await.map(drop),
                            }
                        };
                        // A connect whose SYNs are dropped waits for the
                        // kernel's retries: the phase's end stops it.
                        let r = tokio::select! {
                            () = stop.cancelled() => break,
                            r = attempt => r,
                        };
                        if r.is_ok() {
                            cuts.fetch_add(1, Ordering::Relaxed);
                        } else if let Some(p) = retry_pause() {
                            tokio::time::sleep(p).await;
                        } else {
                            // Refused at accept (a rate or a cap): the
                            // attacker tries again at once.
                            tokio::task::yield_now().await;
                        }
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        });
    })
}

/// This thread at nice 19: on a two-core host the attacker's own client
/// would otherwise take a core from the server and the victim alike,
/// which measures the host, not the server's fairness (a real attacker's
/// client runs on its own machine). The server still gets every frame it
/// can take: the client only yields the CPU when others need it.
#[allow(unsafe_code)]
pub(crate) fn lowest_priority() {
    // SAFETY: gettid and setpriority take no pointers and change only
    // this thread's scheduling priority.
    let r = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, u32::try_from(tid).unwrap_or(0), 19)
    };
    if r != 0 {
        eprintln!("bench: cannot lower the attacker thread's priority");
    }
}

/// The server, the victim's agent and its socket.
struct Bed {
    child: Child,
    admin: String,
    victim_sock: PathBuf,
    agent: Arc<Agent>,
    attacker: Attacker,
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.agent.shutdown.cancel();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Bed {
    async fn start(opts: &Opts, dir: &Path) -> anyhow::Result<Bed> {
        let (server_ca, server) = issue("bench server CA", true)?;
        let ca_path = write(dir, "server-ca.pem", &server_ca)?;
        let crt = write(dir, "server.pem", &server.cert)?;
        let key = write(dir, "server-key.pem", &server.key)?;
        let mut yaml = format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'{extra}}}\nadmin: {{listen: '127.0.0.1:0'}}\nclusters:\n",
            extra = std::env::var("BENCH_AGENTS_EXTRA").unwrap_or_default()
        );
        let mut idents = Vec::new();
        for name in ["victim", "attacker"] {
            let (ca, client) = issue(&format!("{name} agents"), false)?;
            let ca = write(dir, &format!("{name}-ca.pem"), &ca)?;
            let c = PathBuf::from(write(dir, &format!("{name}.pem"), &client.cert)?);
            let k = PathBuf::from(write(dir, &format!("{name}-key.pem"), &client.key)?);
            idents.push((c, k));
            yaml.push_str(&format!(
                "  - {{name: {name}, agent_ca: '{ca}', frontends: [{{name: kas, protocol: http-connect, unix: '{}'}}]}}\n",
                dir.join(format!("{name}.sock")).display()
            ));
        }
        std::fs::write(dir.join("server.yaml"), yaml)?;
        // The default worker count: TOKIO_WORKER_THREADS is not set.
        let (child, admin, agents_at) =
            start_server(&opts.seedlink, &dir.join("server.yaml"), None).await?;
        let (vc, vk) = idents[0].clone();
        let agent = bench_agent(
            agents_at.to_string(),
            Path::new(&ca_path),
            (vc, vk),
            "victim".into(),
            (Duration::from_secs(1), Duration::from_secs(5)),
        )?;
        let run = agent.clone();
        tokio::spawn(async move { run.run().await });
        let end = Instant::now() + Duration::from_secs(30);
        while metric_sum(
            &admin_get(&admin, "/metrics").await.unwrap_or_default(),
            "seedlink_tunnel_server_agents{",
        ) < 1.0
        {
            if Instant::now() > end {
                bail!("the victim's agent did not connect within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (ac, ak) = idents[1].clone();
        let tls = seedlink_tunnel::tls::client_config_for(
            Path::new(&ca_path),
            Some((ac.as_path(), ak.as_path())),
            &[seedlink_tunnel::native::ALPN.to_string()],
            seedlink_tunnel::tls::Versions::UserTls13,
        )?;
        Ok(Bed {
            child,
            admin,
            victim_sock: dir.join("victim.sock"),
            agent,
            attacker: Attacker {
                tls: Arc::new(tls),
                server: agents_at,
            },
        })
    }
}

/// An echo connection through the victim's tunnel.
async fn victim_echo(sock: &Path, backend: SocketAddr) -> anyhow::Result<UnixStream> {
    let mut s = UnixStream::connect(sock).await?;
    s.write_all(format!("CONNECT {backend} HTTP/1.1\r\nHost: {backend}\r\n\r\n").as_bytes())
        .await?;
    let mut head = Vec::with_capacity(64);
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await?? == 0
            || head.len() > 1024
        {
            bail!(
                "victim's tunnel refused: {}",
                String::from_utf8_lossy(&head)
            );
        }
        head.push(b[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!(
            "victim's tunnel refused: {}",
            String::from_utf8_lossy(&head)
        );
    }
    let mut msg = HELLO.to_vec();
    msg.push(b'E');
    s.write_all(&msg).await?;
    Ok(s)
}

/// Round trips of 64 bytes on `s` for [`PHASE`]: µs each.
async fn round_trips(s: &mut UnixStream) -> anyhow::Result<Vec<f64>> {
    let msg = [b'r'; 64];
    let mut back = [0u8; 64];
    let mut out = Vec::new();
    let end = Instant::now() + PHASE;
    while Instant::now() < end {
        let t0 = Instant::now();
        s.write_all(&msg).await?;
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back)).await??;
        out.push(t0.elapsed().as_secs_f64() * 1e6);
        // Paced (a request every 2 ms at most), as an API client's
        // traffic is, not a busy loop of its own.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(out)
}

/// Runs the scenario and prints its table.
pub async fn run(opts: &Opts, backend: SocketAddr) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let bed = Bed::start(opts, dir.path()).await?;
    let mut echo = victim_echo(&bed.victim_sock, backend).await?;
    // Per flood: p50s, p99s, round trips per second, cuts per second.
    type Row = (Flood, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut rows: Vec<Row> = FLOODS
        .iter()
        .map(|f| (*f, Vec::new(), Vec::new(), Vec::new(), Vec::new()))
        .collect();
    for round in 0..opts.rounds {
        // Rotated order; every flood followed by a quiet settle.
        let n = rows.len();
        for k in (0..n).map(|i| (i + round) % n) {
            let flood = rows[k].0;
            let stop = CancellationToken::new();
            let cuts = Arc::new(AtomicU64::new(0));
            let t = start_flood(bed.attacker.clone(), flood, stop.clone(), cuts.clone());
            // Let the flood get going before measuring.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut rtt = round_trips(&mut echo).await?;
            stop.cancel();
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
            let count = rtt.len() as f64;
            let (p50, p99) = (pct(&mut rtt, 0.5), pct(&mut rtt, 0.99));
            let cut = cuts.load(Ordering::Relaxed) as f64 / PHASE.as_secs_f64();
            eprintln!(
                "bench: round {} {}: victim p50 {p50:.0} µs p99 {p99:.0} µs, {:.0} round trips/s, attacker streams cut {cut:.1}/s",
                round + 1,
                flood.label(),
                count / PHASE.as_secs_f64()
            );
            rows[k].1.push(p50);
            rows[k].2.push(p99);
            rows[k].3.push(count / PHASE.as_secs_f64());
            rows[k].4.push(cut);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let m = admin_get(&bed.admin, "/metrics").await.unwrap_or_default();
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        pct(&mut v, 0.5)
    };
    let quiet_p99 = med(&rows[0].2);
    println!(
        "\n## seedlink-bench (tunnel-flood): medians of {} rounds, {} s per phase, the server on its default worker count\n",
        opts.rounds,
        PHASE.as_secs()
    );
    println!("| attacker's flood | victim p50 µs | victim p99 µs | p99 ÷ quiet p99 | victim round trips/s | attacker streams (re)opened/s |");
    println!("|---|---|---|---|---|---|");
    for (flood, p50, p99, rate, cut) in &rows {
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.1} |",
            flood.label(),
            med(p50),
            med(p99),
            med(p99) / quiet_p99,
            med(rate),
            med(cut)
        );
    }
    println!(
        "\nstreams cut for their idle packets: {:.0}; refused at accept: handshake_rate {:.0}, shut_out {:.0}, connection_limit {:.0}, unauthenticated_limit {:.0}",
        metric_sum(&m, "seedlink_tunnel_server_agent_streams_total{cluster=\"attacker\",reason=\"control_flood\"}")
            + metric_sum(&m, "seedlink_tunnel_server_agent_streams_total{cluster=\"attacker\",reason=\"stream_error\"}"),
        metric_sum(&m, "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"handshake_rate\"}"),
        metric_sum(&m, "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"shut_out\"}"),
        metric_sum(&m, "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"connection_limit\"}"),
        metric_sum(&m, "seedlink_tunnel_server_agent_streams_total{cluster=\"\",reason=\"unauthenticated_limit\"}"),
    );
    Ok(())
}
