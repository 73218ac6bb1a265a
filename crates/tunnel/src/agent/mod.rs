//! `seedlink tunnel-agent`: dials out to the tunnel-server (TLS with SNI and
//! optional ALPN, so it can pass through seedlink's SNI gateway), keeps one
//! `AgentService/Connect` stream per server replica, and opens the
//! connections the server asks for, within a destination policy.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::StreamExt;
use ipnet::IpNet;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use crate::fair::FairQueue;
use crate::flow::{self, SendCredit};
use crate::grpc::{self, H2Settings};
use crate::proto::{Packet, AGENT_CONNECT_PATH};
use crate::queue::{self, PumpEnd, QueueTx};
use crate::readahead::ReadAhead;
use crate::{dialerr, tls};

/// Bytes read from a destination per DATA packet.
const CHUNK: usize = 32 * 1024;

/// Destinations denied unless an allow rule names them exactly: the agent's
/// own host (loopback, `0.0.0.0/8` and `::`, which Linux connects to
/// loopback), link-local (cloud metadata lives there) and well-known
/// metadata addresses. A dial request comes from the seed; nothing from
/// there should reach services bound to the agent's loopback.
pub const DEFAULT_DENY: &[&str] = &[
    "127.0.0.0/8",
    "0.0.0.0/8",
    "::1/128",
    "::/128",
    "169.254.0.0/16",
    "fe80::/10",
    "100.100.100.200/32",
    "fd00:ec2::254/128",
];

/// Why one connection attempt to a server failed; [`ConnectError::reason`]
/// is the `reason` label of `server_connect_errors_total`.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect failed.
    #[error("connecting to {server}: {error}")]
    Connect {
        /// `host:port`.
        server: String,
        /// Why.
        error: std::io::Error,
    },
    /// TCP connect took longer than the deadline.
    #[error("connecting to {0}: timed out")]
    ConnectTimeout(String),
    /// The TLS server name is not a valid name.
    #[error("server name {0:?} is not a valid TLS name")]
    ServerName(String),
    /// The TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    /// The TLS handshake took longer than the deadline.
    #[error("TLS handshake timed out")]
    TlsTimeout,
    /// The HTTP/2 handshake failed.
    #[error("HTTP/2 handshake: {0}")]
    Http2(hyper::Error),
    /// The ServiceAccount token could not be read.
    #[error("reading the token {path}: {error}")]
    Token {
        /// The file.
        path: String,
        /// Why.
        error: std::io::Error,
    },
    /// The egress proxy did not open a tunnel to the server.
    #[error("{0}")]
    EgressProxy(seedlink_net::egress::EgressError),
    /// The egress proxy did not answer in time.
    #[error("egress proxy did not answer")]
    EgressProxyTimeout,
    /// The server did not answer the stream in time.
    #[error("server did not answer")]
    NoAnswer,
    /// The server refused the stream (e.g. unknown certificate or token).
    #[error("server refused the stream: {0}")]
    Refused(String),
    /// The answer lacked `serverid`/`servercount` or had them twice.
    #[error("server answer: {0}")]
    BadAnswer(String),
    /// The lean transport's handshake failed.
    #[error("seedlink-tunnel/1 handshake: {0}")]
    Lean(crate::lean::WireError),
}

impl ConnectError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            ConnectError::Connect { .. } => "connect_error",
            ConnectError::ConnectTimeout(_) => "connect_timeout",
            ConnectError::ServerName(_) => "bad_server_name",
            ConnectError::Tls(_) => "tls_error",
            ConnectError::TlsTimeout => "tls_timeout",
            ConnectError::Http2(_) => "http2_error",
            ConnectError::Token { .. } => "token_unreadable",
            ConnectError::EgressProxy(e) => e.reason(),
            ConnectError::EgressProxyTimeout => "egress_proxy_timeout",
            ConnectError::NoAnswer => "no_answer",
            ConnectError::Refused(_) => "refused",
            ConnectError::BadAnswer(_) => "bad_answer",
            ConnectError::Lean(_) => "lean_error",
        }
    }

    /// The attempt waited out a deadline (packets unanswered: a partition
    /// or a frozen server) rather than being refused.
    pub fn timed_out(&self) -> bool {
        matches!(
            self,
            ConnectError::ConnectTimeout(_)
                | ConnectError::TlsTimeout
                | ConnectError::NoAnswer
                | ConnectError::EgressProxyTimeout
        )
    }
}

/// Agent options.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Server `host:port` (a LoadBalancer or the gateway).
    pub server: String,
    /// TLS server name (SNI); default: the host of `server`.
    pub server_name: String,
    /// CA of the server's certificate.
    pub ca: PathBuf,
    /// Client certificate and key (the cluster's agent identity).
    pub identity: Option<(PathBuf, PathBuf)>,
    /// ALPN protocols offered besides `h2` (to be routed by ALPN).
    pub alpn: Vec<String>,
    /// `agentid`.
    pub agent_id: String,
    /// `agentidentifiers` (URL query form).
    pub identifiers: String,
    /// A ServiceAccount token file sent as `authorization: Bearer`, re-read per connect.
    pub token_path: Option<PathBuf>,
    /// Allowed destination networks (empty: all but the denied).
    pub allow: Vec<IpNet>,
    /// Allowed destination ports (empty: all).
    pub allow_ports: Vec<u16>,
    /// Denied networks (checked first).
    pub deny: Vec<IpNet>,
    /// Deadline for a destination dial (and its name lookup).
    pub dial_timeout: Duration,
    /// First retry delay and the delay between replica-discovery dials.
    pub sync_interval: Duration,
    /// Largest retry delay.
    pub sync_interval_cap: Duration,
    /// HTTP/2 PING interval and timeout.
    pub keepalive: H2Settings,
    /// A destination that accepts no byte for this long is closed.
    pub stall_timeout: Duration,
    /// Per-connection queue budget towards a destination.
    pub queue_bytes: usize,
    /// Offer per-connection flow control (used when the server is seedlink).
    pub flow_control: bool,
    /// Offer the lean transport (`seedlink-tunnel/1`) before `h2`; it
    /// needs `flow_control`.
    pub lean: bool,
    /// Leave through this HTTP CONNECT proxy (a private network's only way
    /// out); the proxy resolves the server's name.
    pub egress: Option<seedlink_net::egress::EgressProxy>,
}

/// `outcome` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// What happened.
    pub outcome: String,
}

/// Agent metrics (`seedlink_tunnel_agent_`).
pub struct AgentMetrics {
    /// Registry for `/metrics`.
    pub registry: Registry,
    /// Open server streams.
    pub servers: Gauge,
    /// Server connection attempts by outcome.
    pub server_connects: Family<Outcome, Counter>,
    /// Failed server connection attempts by why (`ConnectError::reason`).
    pub connect_errors: Family<Outcome, Counter>,
    /// Dials by outcome.
    pub dials: Family<Outcome, Counter>,
    /// Open destination connections.
    pub endpoints: Gauge,
    /// Destination connections ended by outcome.
    pub endpoint_closes: Family<Outcome, Counter>,
    /// Packets from servers that referred to nothing known, or were unexpected.
    pub bad_packets: Family<Outcome, Counter>,
}

impl AgentMetrics {
    fn new() -> AgentMetrics {
        let mut registry = Registry::with_prefix("seedlink_tunnel_agent");
        let m = AgentMetrics {
            registry: Registry::default(),
            servers: Gauge::default(),
            server_connects: Family::default(),
            connect_errors: Family::default(),
            dials: Family::default(),
            endpoints: Gauge::default(),
            endpoint_closes: Family::default(),
            bad_packets: Family::default(),
        };
        registry.register(
            "open_server_connections",
            "Open streams to server replicas",
            m.servers.clone(),
        );
        registry.register(
            "server_connects",
            "Connection attempts to the server by outcome",
            m.server_connects.clone(),
        );
        registry.register(
            "server_connect_errors",
            "Failed connection attempts to the server, by why (outcome)",
            m.connect_errors.clone(),
        );
        registry.register("dials", "Destination dials by outcome", m.dials.clone());
        registry.register(
            "open_endpoint_connections",
            "Open destination connections",
            m.endpoints.clone(),
        );
        registry.register(
            "endpoint_closes",
            "Destination connections ended, by outcome",
            m.endpoint_closes.clone(),
        );
        registry.register(
            "bad_packets",
            "Server packets that were unexpected or named unknown IDs",
            m.bad_packets.clone(),
        );
        AgentMetrics { registry, ..m }
    }

    fn count(f: &Family<Outcome, Counter>, o: &str) {
        f.get_or_create(&Outcome {
            outcome: o.to_string(),
        })
        .inc();
    }
}

/// A running agent.
pub struct Agent {
    /// Options.
    pub opts: AgentOptions,
    /// Metrics.
    pub metrics: AgentMetrics,
    tls: TlsConnector,
    /// With the lean transport offered: the configuration for usertls.rs.
    user_tls: Option<Arc<rustls::ClientConfig>>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    known_count: AtomicI64,
    draining: AtomicBool,
    /// The PING interval in use (ms): `opts.keepalive`, doubled each time a
    /// server answers GOAWAY `too_many_pings` (as grpc-go's client does).
    keepalive_ms: std::sync::atomic::AtomicU64,
    /// A stream to a server ended: replica discovery resumes at once.
    session_lost: tokio::sync::Notify,
    /// Streams in a row that ended or were drained soon after they opened
    /// ([`STABLE`]): discovery backs off by them (a server that accepts
    /// and drops every stream is not dialled in a loop).
    flaps: std::sync::atomic::AtomicU32,
    /// Streams whose server said DRAIN and that still carry connections
    /// ([`MAX_DRAINING`] at most).
    draining_streams: std::sync::atomic::AtomicUsize,
    /// Cancelled to stop everything.
    pub shutdown: CancellationToken,
}

/// A stream that lasts this long was a stable one.
const STABLE: Duration = Duration::from_secs(10);
/// Draining streams an agent keeps at once: a server that says DRAIN on
/// every stream cannot make it hold streams (and sockets) without end.
const MAX_DRAINING: usize = 8;

/// What a server's answer says.
struct Answer {
    /// `serverid` (exactly one).
    server_id: String,
    /// `servercount` (exactly one).
    count: i64,
    /// It agreed to per-connection flow control.
    flow: bool,
    /// It will tell us when the number of replicas changes.
    replicas: bool,
}

/// What a server's answer says: `serverid`, `servercount` (exactly one
/// each) and the extensions it agreed to.
fn answer(meta: &tonic::metadata::MetadataMap) -> Result<Answer, ConnectError> {
    let one = |k: &str| -> Result<String, ConnectError> {
        let v: Vec<_> = meta.get_all(k).iter().collect();
        match v.as_slice() {
            [one] => one
                .to_str()
                .map(str::to_string)
                .map_err(|_| ConnectError::BadAnswer(format!("{k} is not ASCII"))),
            _ => Err(ConnectError::BadAnswer(format!(
                "expected one {k} header, got {}",
                v.len()
            ))),
        }
    };
    let server_id = one("serverid")?;
    let count: i64 = one("servercount")?
        .parse()
        .map_err(|_| ConnectError::BadAnswer("servercount is not a number".into()))?;
    let agreed = |h: &str, v: &str| meta.get(h).and_then(|x| x.to_str().ok()) == Some(v);
    Ok(Answer {
        server_id,
        count,
        flow: agreed(flow::HEADER, flow::VERSION),
        replicas: agreed(
            crate::proto::REPLICAS_HEADER,
            crate::proto::REPLICAS_VERSION,
        ),
    })
}

/// The wait before the next connection attempt after a failure, and the
/// delay after that. A refusal (the server is there but says no, or is
/// restarting) backs off ×1.5 up to `cap`. A timeout (a partition or a
/// frozen server: packets unanswered) does not grow the back-off: the
/// attempt itself already waited its deadline, and a grown back-off would
/// only delay the return after the network heals (measured 8.1 s with the
/// old rule); it waits `base` and tries again.
pub fn retry_delay(
    delay: Duration,
    timed_out: bool,
    base: Duration,
    cap: Duration,
) -> (Duration, Duration) {
    if timed_out {
        (base, base)
    } else {
        (delay, delay.mul_f64(1.5).min(cap))
    }
}

/// The wait before the next dial after `flaps` streams in a row that did
/// not last: none after a stable one, then `base` growing ×1.5 up to `cap`.
pub fn flap_delay(flaps: u32, base: Duration, cap: Duration) -> Duration {
    if flaps == 0 {
        return Duration::ZERO;
    }
    let grown = base.mul_f64(1.5f64.powi(i32::try_from(flaps - 1).unwrap_or(i32::MAX).min(64)));
    grown.min(cap)
}

/// Longest PING interval the back-off reaches.
const KEEPALIVE_CAP: Duration = Duration::from_secs(3600);

/// Replica discovery while a stream to every replica is held: a slow
/// re-check, only to notice a raised `servercount` (a replaced replica
/// ends its stream, which restarts discovery at once).
const HELD_RECHECK: Duration = Duration::from_secs(300);

pub mod config;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
pub mod link;

/// Destination to server: reads what the destination sends and sends it
/// as DATA, within the window when flow control is on. Returns how it
/// ended.
async fn upload(
    rd: tokio::net::tcp::OwnedReadHalf,
    s: &Session,
    id: i64,
    credit: Option<&SendCredit>,
) -> &'static str {
    loop {
        // No buffer while the destination is quiet: an idle connection
        // holds none.
        if rd.readable().await.is_err() {
            return "remote_closed";
        }
        let mut b = BytesMut::with_capacity(CHUNK);
        match rd.try_read_buf(&mut b) {
            Ok(0) => return "remote_closed",
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return "remote_closed",
            Ok(_) => {
                if let Err(end) = send_up(s, id, credit, b.freeze()).await {
                    return end;
                }
            }
        }
    }
}

/// Sends what the destination sent as DATA of connection `id`, within the
/// window: a server-side reader that stopped holds this connection back,
/// nothing else. How the connection ended if it did.
async fn send_up(
    s: &Session,
    id: i64,
    credit: Option<&SendCredit>,
    data: bytes::Bytes,
) -> Result<(), &'static str> {
    if let Some(c) = credit {
        c.take(data.len()).await.map_err(|_| "closed")?;
    }
    s.to_server
        .data(id, Packet::data(id, data))
        .await
        .map_err(|_| "server_gone")
}

/// Server to destination: writes the connection's queue, granting the
/// server more window as it drains (flow control), or within `stall` per
/// write without. Returns how it ended.
async fn download(
    mut qrx: queue::QueueRx,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    s: &Session,
    id: i64,
    stall: Duration,
) -> &'static str {
    let mut unacked = flow::Unacked::default();
    let deadline = (!s.flow).then_some(stall);
    let written = |n| {
        if s.flow {
            if let Some(k) = unacked.written(n) {
                s.send_soon(Packet::window_update(id, k));
            }
        }
    };
    match qrx.pump(&mut wr, deadline, written).await {
        PumpEnd::Finished | PumpEnd::Aborted => "closed",
        PumpEnd::Stalled => "stalled",
        PumpEnd::WriteError => "write_error",
    }
}

use link::{Action, Actions, Expired, SessionLink};

/// The server's packets on either transport.
type Inbound = std::pin::Pin<
    Box<
        dyn futures_util::Stream<Item = Result<Packet, Box<dyn std::error::Error + Send + Sync>>>
            + Send,
    >,
>;

/// A connection to a server, ready for the stream.
enum Channel {
    /// HTTP/2 (gRPC), with its GOAWAY sniffer.
    Grpc(grpc::Client, crate::goaway::Seen),
    /// The lean transport.
    Lean(Box<crate::usertls::UserTls<TcpStream>>),
}

/// Closes a stream's outbound queue when dropped, unless taken out: a
/// queue that is never closed would keep the request stream open forever.
struct CloseOnDrop(Option<Arc<FairQueue>>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(q) = self.0.take() {
            q.close();
        }
    }
}

/// Opens the `Connect` stream on `client`, its packets taken from `tx`;
/// the server must answer within `t`.
async fn open_connect(
    client: &mut grpc::Client,
    tx: &Arc<FairQueue>,
    meta: &[(&'static str, String)],
    t: Duration,
) -> Result<tonic::Response<tonic::Streaming<Packet>>, ConnectError> {
    let outbound =
        futures_util::stream::unfold(
            tx.clone(),
            |q| async move { q.next().await.map(|p| (p, q)) },
        );
    tokio::time::timeout(
        t,
        grpc::open_stream(client, AGENT_CONNECT_PATH, outbound, meta),
    )
    .await
    .map_err(|_| ConnectError::NoAnswer)?
    .map_err(|s| ConnectError::Refused(format!("{} {}", s.code(), s.message())))
}

/// Reads a duplicate stream until the server ends it (at most 5 s), after
/// our side ended it.
async fn drain_duplicate(mut inbound: Inbound) {
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = inbound.next().await {}
    })
    .await;
}

/// A connection's ends the session machine keeps.
struct ConnEnds {
    queue: QueueTx,
    cancel: CancellationToken,
    /// Window towards the server (flow control negotiated).
    credit: Option<SendCredit>,
}

impl ConnEnds {
    /// Resets the connection: its task stops, its writer resets.
    fn abort(self) {
        self.cancel.cancel();
        self.queue.abort();
    }
}

/// The machine and its reusable action buffer, behind the session's lock.
struct Locked {
    machine: SessionLink<ConnEnds, CancellationToken>,
    out: Actions<ConnEnds, CancellationToken>,
}

/// One stream to one server replica: the sans-IO [`SessionLink`] behind one
/// lock, and the IO it drives.
struct Session {
    server_id: String,
    /// The server said DRAIN: it is going away, so it no longer counts
    /// as held (the agent looks for a replica to replace it).
    draining: AtomicBool,
    to_server: Arc<FairQueue>,
    state: Mutex<Locked>,
    gone: CancellationToken,
    /// Cancelled to end the stream from this side.
    cut: CancellationToken,
    /// When it opened.
    since: std::time::Instant,
    /// Per-connection flow control negotiated.
    flow: bool,
}

/// What carrying out a call's actions produced for the caller.
#[derive(Default)]
struct Applied {
    /// Dials to start.
    dials: Vec<(i64, String, String, CancellationToken)>,
    /// DATA that did not fit its connection's queue.
    blocked: Option<(i64, bytes::Bytes, queue::Room)>,
    /// A WINDOW_UPDATE gave more than was used.
    bad_window: bool,
}

impl Session {
    fn send_soon(&self, p: Packet) {
        let _ = self.to_server.control(p);
    }

    fn new(
        server_id: String,
        to_server: Arc<FairQueue>,
        flow: bool,
        replicas: bool,
        stall: Duration,
    ) -> Session {
        let machine = SessionLink::new(flow, stall);
        Session {
            server_id,
            draining: AtomicBool::new(false),
            to_server,
            state: Mutex::new(Locked {
                machine: if replicas {
                    machine.with_replica_updates()
                } else {
                    machine
                },
                out: Actions::new(),
            }),
            gone: CancellationToken::new(),
            cut: CancellationToken::new(),
            since: std::time::Instant::now(),
            flow,
        }
    }

    /// Runs `f` on the machine under the lock, then carries out what it
    /// asked for; nothing here waits.
    fn with<T>(
        &self,
        f: impl FnOnce(
            &mut SessionLink<ConnEnds, CancellationToken>,
            &mut Actions<ConnEnds, CancellationToken>,
        ) -> T,
    ) -> (T, Applied) {
        let mut g = seedlink_net::sync::lock(&self.state, "agent session");
        let Locked { machine, out } = &mut *g;
        let r = f(machine, out);
        (r, self.apply(machine, out))
    }

    /// What waiting for room for connection `id`'s `data` saw: room (the
    /// bytes are queued; a connection closed meanwhile drops them), the
    /// writer gone, or progress (the stall deadline starts again). `true`
    /// when the wait is over.
    fn room_step(&self, id: i64, step: queue::Step, data: &bytes::Bytes) -> bool {
        let mut g = seedlink_net::sync::lock(&self.state, "agent session");
        match step {
            queue::Step::Room => {
                // Only the receive loop pushes, so the bytes fit.
                if let Some(e) = g.machine.conn(id) {
                    let _ = e.queue.push(data.clone());
                }
                g.machine.unblocked();
                true
            }
            queue::Step::Closed => {
                g.machine.unblocked();
                true
            }
            queue::Step::Progress => {
                g.machine.progress(Instant::now());
                false
            }
        }
    }

    /// Carries out the machine's actions; nothing here waits.
    fn apply(
        &self,
        machine: &mut SessionLink<ConnEnds, CancellationToken>,
        out: &mut Actions<ConnEnds, CancellationToken>,
    ) -> Applied {
        let mut applied = Applied::default();
        while let Some(a) = out.pop_front() {
            match a {
                Action::Send(p) => self.send_soon(p),
                Action::Finish(id, last) => self.to_server.finish(id, last),
                Action::Dial {
                    random,
                    address,
                    protocol,
                    cancel,
                } => applied.dials.push((random, address, protocol, cancel)),
                Action::Cancel(c) => c.cancel(),
                Action::Deliver(id, data) => {
                    if let Some((data, room)) = deliver(machine, id, data) {
                        machine.blocked(Instant::now(), id);
                        applied.blocked = Some((id, data, room));
                    }
                }
                Action::Reopen(id, n) => applied.bad_window |= !reopen(machine, id, n),
                Action::Close(e) => e.cancel.cancel(),
                Action::Abort(e) => e.abort(),
            }
        }
        applied
    }
}

/// Gives connection `id`'s sender `n` bytes more window; `false` when
/// that is more than it used (a connection without a window takes any).
fn reopen(machine: &SessionLink<ConnEnds, CancellationToken>, id: i64, n: i64) -> bool {
    machine
        .conn(id)
        .and_then(|e| e.credit.as_ref())
        .is_none_or(|c| c.give(n))
}

/// Queues DATA for connection `id`'s destination; what does not fit comes
/// back with a handle to wait for room.
fn deliver(
    machine: &SessionLink<ConnEnds, CancellationToken>,
    id: i64,
    data: bytes::Bytes,
) -> Option<(bytes::Bytes, queue::Room)> {
    let e = machine.conn(id)?;
    match e.queue.push(data) {
        Ok(()) | Err(queue::PushError::Closed) => None,
        Err(queue::PushError::Full(data)) => Some((data, e.queue.room())),
    }
}

/// Sleeps until `at`; forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

impl Agent {
    /// Builds the agent (reads the TLS files).
    pub fn new(opts: AgentOptions) -> Result<Arc<Agent>, crate::tls::TlsError> {
        let mut alpn = Vec::new();
        if opts.lean && opts.flow_control {
            alpn.push(crate::lean::ALPN.to_string());
        }
        alpn.push("h2".to_string());
        alpn.extend(opts.alpn.iter().cloned());
        let ident = opts
            .identity
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()));
        // Offering the lean transport, TLS runs in this process
        // (usertls.rs), which speaks TLS 1.3 only.
        let versions = if opts.lean && opts.flow_control {
            tls::Versions::UserTls13
        } else {
            tls::Versions::Default
        };
        let cfg = Arc::new(tls::client_config_for(&opts.ca, ident, &alpn, versions)?);
        let opts_keepalive = opts.keepalive.keepalive;
        Ok(Arc::new(Agent {
            opts,
            metrics: AgentMetrics::new(),
            user_tls: (versions == tls::Versions::UserTls13).then(|| cfg.clone()),
            tls: TlsConnector::from(cfg),
            sessions: Mutex::new(HashMap::new()),
            known_count: AtomicI64::new(1),
            draining: AtomicBool::new(false),
            keepalive_ms: std::sync::atomic::AtomicU64::new(
                u64::try_from(opts_keepalive.as_millis()).unwrap_or(u64::MAX),
            ),
            session_lost: tokio::sync::Notify::new(),
            flaps: std::sync::atomic::AtomicU32::new(0),
            draining_streams: std::sync::atomic::AtomicUsize::new(0),
            shutdown: CancellationToken::new(),
        }))
    }

    /// Streams open to server replicas.
    pub fn session_count(&self) -> usize {
        seedlink_net::sync::lock(&self.sessions, "agent sessions").len()
    }

    /// Streams to replicas that are not draining (what discovery counts).
    fn held_count(&self) -> usize {
        seedlink_net::sync::lock(&self.sessions, "agent sessions")
            .values()
            .filter(|s| !s.draining.load(Ordering::Acquire))
            .count()
    }

    /// Ready: a stream to every replica the servers say there are
    /// (`servercount`), none of them draining, and not draining itself.
    pub fn ready(&self) -> bool {
        !self.draining.load(Ordering::Acquire)
            && self.session_count() > 0
            && i64::try_from(self.held_count()).unwrap_or(i64::MAX) >= self.known_count()
    }

    /// The replicas the last answer said there are (`servercount`, at
    /// least 1).
    pub fn known_count(&self) -> i64 {
        self.known_count.load(Ordering::Acquire).max(1)
    }

    /// Streams to replicas that are not draining.
    pub fn held(&self) -> usize {
        self.held_count()
    }

    /// Keeps a stream to every server replica until shut down: connects,
    /// learns `serverid`/`servercount`, and keeps dialing (the address is
    /// usually a LoadBalancer) to find missing replicas. Failures back off
    /// exponentially (×1.5, capped) with ±10 % jitter. Once a stream to
    /// every replica is held, discovery pauses (a re-check every 5 min)
    /// until one of them ends.
    pub async fn run(self: &Arc<Self>) {
        let mut delay = self.opts.sync_interval;
        loop {
            if self.draining.load(Ordering::Acquire) {
                self.shutdown.cancelled().await;
                return;
            }
            // Streams that did not last: wait before the next, whatever
            // woke us.
            let pause = flap_delay(
                self.flaps.load(Ordering::Acquire),
                self.opts.sync_interval,
                self.opts.sync_interval_cap,
            );
            if !pause.is_zero() {
                let jitter = 0.9 + rand::random::<f64>() * 0.2;
                tokio::select! {
                    () = tokio::time::sleep(pause.mul_f64(jitter)) => {}
                    () = self.shutdown.cancelled() => return,
                }
            }
            let (wait, next) = self.attempt(delay).await;
            delay = next;
            let jitter = 0.9 + rand::random::<f64>() * 0.2;
            tokio::select! {
                () = tokio::time::sleep(wait.mul_f64(jitter)) => {}
                () = self.session_lost.notified() => {}
                () = self.shutdown.cancelled() => return,
            }
        }
    }

    /// One connection attempt, counted; the wait before the next and the
    /// back-off after that (`delay`: the back-off now).
    async fn attempt(self: &Arc<Self>, delay: Duration) -> (Duration, Duration) {
        match self.connect_once().await {
            Ok(new) => {
                let outcome = if new { "ok" } else { "duplicate" };
                AgentMetrics::count(&self.metrics.server_connects, outcome);
                (self.discovery_wait(), self.opts.sync_interval)
            }
            Err(e) => {
                tracing::warn!(server = %self.opts.server, reason = e.reason(), error = %e, "cannot connect to the tunnel server");
                AgentMetrics::count(&self.metrics.server_connects, "error");
                AgentMetrics::count(&self.metrics.connect_errors, e.reason());
                retry_delay(
                    delay,
                    e.timed_out(),
                    self.opts.sync_interval,
                    self.opts.sync_interval_cap,
                )
            }
        }
    }

    /// A server told us the number of replicas changed: one we do not
    /// hold yet is looked for at once.
    fn replicas_changed(&self, server_id: &str, count: i64) {
        let was = self.known_count.swap(count, Ordering::AcqRel);
        if was != count {
            tracing::info!(
                server_id,
                was,
                now = count,
                "the tunnel server replicas changed"
            );
        }
        if i64::try_from(self.held_count()).unwrap_or(i64::MAX) < count {
            self.session_lost.notify_one();
        }
    }

    /// How long to wait before the next discovery dial after a success.
    fn discovery_wait(&self) -> Duration {
        let have = i64::try_from(self.held_count()).unwrap_or(i64::MAX);
        if have >= self.known_count.load(Ordering::Acquire) {
            HELD_RECHECK.max(self.opts.sync_interval_cap)
        } else {
            self.opts.sync_interval
        }
    }

    /// The PING interval for the next connection.
    fn keepalive(&self) -> H2Settings {
        let ms = self.keepalive_ms.load(Ordering::Acquire);
        H2Settings {
            keepalive: Duration::from_millis(ms),
            ..self.opts.keepalive
        }
    }

    /// A server said `too_many_pings`: ping half as often from now on.
    fn slow_down_pings(&self, server_id: &str) {
        let cap = u64::try_from(KEEPALIVE_CAP.as_millis()).unwrap_or(u64::MAX);
        let old = self.keepalive_ms.load(Ordering::Acquire);
        let new = old.saturating_mul(2).min(cap);
        self.keepalive_ms.store(new, Ordering::Release);
        AgentMetrics::count(&self.metrics.server_connects, "too_many_pings");
        tracing::warn!(
            server_id,
            keepalive_ms = new,
            "server refused our ping rate (GOAWAY too_many_pings): PING interval doubled"
        );
    }

    /// TCP, TLS (SNI, ALPN, client certificate) and, unless the server
    /// agreed to the lean transport, HTTP/2 to the server, each step
    /// within `t`; the GOAWAY sniffer watches an HTTP/2 connection.
    async fn open_channel(&self, t: Duration) -> Result<Channel, ConnectError> {
        let server = &self.opts.server;
        let tcp = match &self.opts.egress {
            None => tokio::time::timeout(t, TcpStream::connect(server))
                .await
                .map_err(|_| ConnectError::ConnectTimeout(server.clone()))?
                .map_err(|error| ConnectError::Connect {
                    server: server.clone(),
                    error,
                })?,
            Some(egress) => tokio::time::timeout(t, egress.connect(server))
                .await
                .map_err(|_| ConnectError::EgressProxyTimeout)?
                .map_err(ConnectError::EgressProxy)?,
        };
        let _ = tcp.set_nodelay(true);
        let bad_name = || ConnectError::ServerName(self.opts.server_name.clone());
        let name = rustls::pki_types::ServerName::try_from(self.opts.server_name.clone())
            .map_err(|_| bad_name())?;
        let origin: http::Uri = format!("https://{}", self.opts.server_name)
            .parse()
            .map_err(|_| bad_name())?;
        let Some(cfg) = &self.user_tls else {
            let tls = tokio::time::timeout(t, self.tls.connect(name, ReadAhead::new(tcp)))
                .await
                .map_err(|_| ConnectError::TlsTimeout)?
                .map_err(ConnectError::Tls)?;
            return self.http2(tls, origin).await;
        };
        let tls = tokio::time::timeout(t, crate::usertls::connect(cfg.clone(), name, tcp))
            .await
            .map_err(|_| ConnectError::TlsTimeout)?
            .map_err(ConnectError::Tls)?;
        if tls.session().alpn.as_deref() == Some(crate::lean::ALPN.as_bytes()) {
            return Ok(Channel::Lean(Box::new(tls)));
        }
        self.http2(tls, origin).await
    }

    /// HTTP/2 on `tls`, with its GOAWAY sniffer.
    async fn http2<IO>(&self, tls: IO, origin: http::Uri) -> Result<Channel, ConnectError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (tls, goaway) = crate::goaway::sniff(tls);
        let client = grpc::connect(tls, origin, self.keepalive())
            .await
            .map_err(ConnectError::Http2)?;
        Ok(Channel::Grpc(client, goaway))
    }

    /// Opens the stream on `chan`, its packets taken from `tx`: the
    /// answer's metadata, the server's packets, and the GOAWAY sniffer of
    /// an HTTP/2 connection.
    async fn open_stream(
        &self,
        chan: Channel,
        tx: &Arc<FairQueue>,
        meta: &[(&'static str, String)],
        t: Duration,
    ) -> Result<
        (
            tonic::metadata::MetadataMap,
            Inbound,
            Option<crate::goaway::Seen>,
        ),
        ConnectError,
    > {
        match chan {
            Channel::Grpc(mut client, goaway) => {
                let resp = open_connect(&mut client, tx, meta, t).await?;
                let (answer, inbound, _) = resp.into_parts();
                Ok((
                    answer,
                    Box::pin(inbound.map(|r| r.map_err(Into::into))),
                    Some(goaway),
                ))
            }
            Channel::Lean(mut tls) => {
                let opened = tokio::time::timeout(t, crate::lean::open(&mut tls, meta))
                    .await
                    .map_err(|_| ConnectError::NoAnswer)?
                    .map_err(ConnectError::Lean)?;
                let answer = match opened {
                    crate::lean::Opened::Answer(m) => m,
                    crate::lean::Opened::Refused(s) => {
                        return Err(ConnectError::Refused(format!(
                            "{} {}",
                            s.code(),
                            s.message()
                        )))
                    }
                };
                // The writer ends when the queue is closed, or when the
                // server takes nothing for the keepalive interval and timeout.
                let (inbound, _writer) = crate::lean::start(*tls, tx.clone(), self.keepalive());
                Ok((
                    answer,
                    Box::pin(inbound.map(|r| r.map_err(Into::into))),
                    None,
                ))
            }
        }
    }

    /// The stream's request headers: `agentid`, `agentidentifiers`, the
    /// seedlink extensions asked for, and a ServiceAccount token (read anew
    /// for every connection: kubelet rotates it).
    fn request_metadata(&self) -> Result<Vec<(&'static str, String)>, ConnectError> {
        let mut meta = vec![("agentid", self.opts.agent_id.clone())];
        if !self.opts.identifiers.is_empty() {
            meta.push(("agentidentifiers", self.opts.identifiers.clone()));
        }
        if self.opts.flow_control {
            meta.push((flow::HEADER, flow::VERSION.to_string()));
        }
        meta.push((
            crate::proto::REPLICAS_HEADER,
            crate::proto::REPLICAS_VERSION.to_string(),
        ));
        if let Some(p) = &self.opts.token_path {
            let token = std::fs::read_to_string(p).map_err(|error| ConnectError::Token {
                path: p.display().to_string(),
                error,
            })?;
            meta.push(("authorization", format!("Bearer {}", token.trim())));
        }
        Ok(meta)
    }

    /// One connection attempt; `Ok(true)` for a new replica, `Ok(false)` for
    /// one we already have (closed again).
    async fn connect_once(self: &Arc<Self>) -> Result<bool, ConnectError> {
        let t = self.opts.dial_timeout.max(Duration::from_secs(5));
        let chan = self.open_channel(t).await?;
        let meta = self.request_metadata()?;
        let tx = FairQueue::new();
        // Until the stream is kept, any early return must end it: a queue
        // that is never closed would keep the request stream open forever.
        let mut guard = CloseOnDrop(Some(tx.clone()));
        let (answer, inbound, goaway) = self.open_stream(chan, &tx, &meta, t).await?;
        let (session, count) = self.session(&answer, tx)?;
        if !self.keep(&session) {
            // A replica we already hold: end our side cleanly and let the
            // server end its side, so neither counts an error.
            drop(guard);
            drain_duplicate(inbound).await;
            return Ok(false);
        }
        guard.0 = None;
        self.metrics.servers.inc();
        let server_id = &session.server_id;
        let flow = session.flow;
        tracing::info!(
            server_id,
            servercount = count,
            flow,
            "connected to tunnel server"
        );
        let agent = self.clone();
        tokio::spawn(async move {
            agent.serve_session(session.clone(), inbound).await;
            agent.session_ended(&session, goaway.and_then(|g| g.code()));
        });
        Ok(true)
    }

    /// The session a server's answer describes (`serverid`, the extensions
    /// it agreed to) over queue `tx`, and the replica count it gave (taken
    /// as the one known now).
    fn session(
        &self,
        meta: &tonic::metadata::MetadataMap,
        tx: Arc<FairQueue>,
    ) -> Result<(Arc<Session>, i64), ConnectError> {
        let Answer {
            server_id,
            count,
            flow: offered,
            replicas,
        } = answer(meta)?;
        self.known_count.store(count.max(1), Ordering::Release);
        let flow = self.opts.flow_control && offered;
        let stall = self.opts.stall_timeout;
        let session = Session::new(server_id, tx, flow, replicas, stall);
        Ok((Arc::new(session), count))
    }

    /// Lists a new stream under its server ID; `false` (not listed) when a
    /// stream to that replica is held already. A replica that drains does
    /// not count: its replacement may have kept the ID (a new process of
    /// the same pod), and the draining stream goes on serving what it
    /// carries, unlisted.
    fn keep(&self, session: &Arc<Session>) -> bool {
        let mut s = seedlink_net::sync::lock(&self.sessions, "agent sessions");
        match s.get(&session.server_id) {
            Some(held) if !held.draining.load(Ordering::Acquire) => false,
            _ => {
                s.insert(session.server_id.clone(), session.clone());
                true
            }
        }
    }

    /// A stream ended: forget it (only this stream: a replacement may hold
    /// its ID), slow pings down if the server said `too_many_pings`, resume
    /// discovery, and end what it carried.
    fn session_ended(&self, session: &Arc<Session>, goaway: Option<u32>) {
        let agent = self;
        self.count_flap(session);
        if session.draining.load(Ordering::Acquire) {
            self.draining_streams.fetch_sub(1, Ordering::AcqRel);
        }
        {
            let mut s = seedlink_net::sync::lock(&agent.sessions, "agent sessions");
            // Only this stream's entry (a replacement may hold the ID).
            if s.get(&session.server_id)
                .is_some_and(|x| Arc::ptr_eq(x, session))
            {
                s.remove(&session.server_id);
            }
        }
        // A GOAWAY too_many_pings slows our pings down for the next
        // connection.
        if goaway == Some(crate::goaway::ENHANCE_YOUR_CALM) {
            agent.slow_down_pings(&session.server_id);
        }
        agent.session_lost.notify_one();
        agent.metrics.servers.dec();
        session.gone.cancel();
        session.to_server.close();
        session.with(|m, out| m.end(out));
        tracing::warn!(server_id = %session.server_id, "stream to tunnel server ended");
    }

    async fn serve_session(self: &Arc<Self>, s: Arc<Session>, mut inbound: Inbound) {
        loop {
            let p = tokio::select! {
                () = s.cut.cancelled() => return,
                m = inbound.next() => match m {
                    Some(Ok(p)) => p,
                    Some(Err(e)) => {
                        tracing::info!(error = %e, "server stream failed");
                        return;
                    }
                    None => return,
                },
                () = self.shutdown.cancelled() => return,
            };
            let (h, applied) = s.with(|m, out| m.on_packet(p, out));
            self.handled(&s, h, applied.bad_window);
            for (random, address, protocol, cancel) in applied.dials {
                let (agent, s) = (self.clone(), s.clone());
                tokio::spawn(async move { agent.dial(s, address, protocol, random, cancel).await });
            }
            if let Some((id, data, room)) = applied.blocked {
                // Backpressure (the standard protocol has no per-connection
                // flow control): read nothing more from this server until
                // the destination makes room, as long as it keeps taking
                // bytes.
                if !self.wait_for_room(&s, id, data, room).await {
                    return;
                }
            }
        }
    }

    /// A stream ended or drained: a flap if it had not lasted [`STABLE`],
    /// else the streak is over.
    fn count_flap(&self, s: &Session) {
        if s.since.elapsed() < STABLE {
            self.flaps.fetch_add(1, Ordering::AcqRel);
        } else {
            self.flaps.store(0, Ordering::Release);
        }
    }

    /// What a packet from the server meant beyond its actions: DRAIN
    /// (look for a replica to replace it), REPLICAS, counters for bad
    /// packets and windows.
    fn handled(&self, s: &Session, h: link::Handled, bad_window: bool) {
        if h == link::Handled::ServerDraining && !s.draining.swap(true, Ordering::AcqRel) {
            tracing::info!(server_id = %s.server_id, "the tunnel server drains: looking for a replica to replace it");
            AgentMetrics::count(&self.metrics.server_connects, "server_draining");
            self.count_flap(s);
            let n = self.draining_streams.fetch_add(1, Ordering::AcqRel) + 1;
            if n > MAX_DRAINING {
                tracing::warn!(server_id = %s.server_id, "more draining streams than {MAX_DRAINING}: this one is ended");
                AgentMetrics::count(&self.metrics.server_connects, "too_many_draining");
                s.cut.cancel();
            }
            self.session_lost.notify_one();
        }
        if let link::Handled::Replicas(n) = h {
            self.replicas_changed(&s.server_id, n);
        }
        if let Some(label) = h.bad_label() {
            AgentMetrics::count(&self.metrics.bad_packets, label);
        }
        if bad_window {
            AgentMetrics::count(&self.metrics.bad_packets, "bad_window");
        }
    }

    /// Waits until connection `id`'s bytes fit its queue, then queues them,
    /// while its destination keeps taking bytes; the session machine's
    /// stall deadline ends the wait (resetting the connection). `false` on
    /// shutdown.
    async fn wait_for_room(
        &self,
        s: &Session,
        id: i64,
        data: bytes::Bytes,
        room: queue::Room,
    ) -> bool {
        loop {
            let due = seedlink_net::sync::lock(&s.state, "agent session")
                .machine
                .poll_timeout();
            let step = tokio::select! {
                step = room.step(data.len()) => step,
                () = sleep_until(due) => {
                    let now = Instant::now();
                    match s.with(|m, out| m.handle_timeout(now, out)).0 {
                        Expired::Nothing => continue,
                        Expired::Stalled { reset } => {
                            if reset {
                                AgentMetrics::count(&self.metrics.endpoint_closes, "stalled");
                            }
                            return true;
                        }
                    }
                }
                () = self.shutdown.cancelled() => return false,
            };
            if s.room_step(id, step, &data) {
                return true;
            }
        }
    }

    /// Whether the policy lets the agent connect to `addr`.
    pub fn allowed(&self, addr: &SocketAddr) -> bool {
        let ip = match addr.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        if self.opts.deny.iter().any(|n| n.contains(&ip))
            && !self
                .opts
                .allow
                .iter()
                .any(|n| n.prefix_len() == n.max_prefix_len() && n.contains(&ip))
        {
            return false;
        }
        (self.opts.allow.is_empty() || self.opts.allow.iter().any(|n| n.contains(&ip)))
            && (self.opts.allow_ports.is_empty() || self.opts.allow_ports.contains(&addr.port()))
    }

    async fn dial(
        self: Arc<Self>,
        s: Arc<Session>,
        address: String,
        protocol: String,
        random: i64,
        cancel: CancellationToken,
    ) {
        let Some(stream) = self.reach(&s, &address, &protocol, random, &cancel).await else {
            return;
        };
        let (ends, qrx) = self.conn_ends(s.flow);
        let (cancel, credit) = (ends.cancel.clone(), ends.credit.clone());
        let Some(id) = s.with(|m, out| m.connected(random, ends, out)).0 else {
            // Cancelled meanwhile, or the stream ended: the socket closes.
            AgentMetrics::count(&self.metrics.dials, "cancelled");
            return;
        };
        AgentMetrics::count(&self.metrics.dials, "ok");
        self.metrics.endpoints.inc();
        let (rd, wr) = stream.into_split();
        let outcome = tokio::select! {
            o = upload(rd, &s, id, credit.as_ref()) => o,
            o = download(qrx, wr, &s, id, self.opts.stall_timeout) => o,
            () = cancel.cancelled() => if s.gone.is_cancelled() { "server_gone" } else { "close_req" },
        };
        // Closed from this side: the server is told (unsolicited CLOSE_RSP)
        // unless its CLOSE_REQ closed it.
        s.with(|m, out| m.closed(id, out));
        if let Some(c) = credit {
            c.close();
        }
        self.metrics.endpoints.dec();
        AgentMetrics::count(&self.metrics.endpoint_closes, outcome);
    }

    /// Connects to the destination within the dial timeout (a deadline on
    /// this task's own lookup and connect, so it stays here: the failure's
    /// text and label come from how that IO ended). A failure is counted
    /// and answered to the server; `None` then, or when the server
    /// cancelled the dial or the stream ended.
    async fn reach(
        &self,
        s: &Session,
        address: &str,
        protocol: &str,
        random: i64,
        cancel: &CancellationToken,
    ) -> Option<TcpStream> {
        let outcome = tokio::select! {
            r = tokio::time::timeout(self.opts.dial_timeout, self.open(address, protocol)) => match r {
                Ok(r) => r,
                Err(_) => Err(dialerr::DialFailure::timeout(address)),
            },
            () = cancel.cancelled() => {
                AgentMetrics::count(&self.metrics.dials, "cancelled");
                return None;
            }
            () = s.gone.cancelled() => return None,
        };
        match outcome {
            Ok(stream) => Some(stream),
            Err(failure) => {
                AgentMetrics::count(&self.metrics.dials, failure.label());
                s.with(|m, out| m.dial_failed(random, failure.text, out));
                None
            }
        }
    }

    /// A new connection's ends and its destination's queue; with flow
    /// control (`flow`) the server never has more than a window in flight.
    fn conn_ends(&self, flow: bool) -> (ConnEnds, queue::QueueRx) {
        let budget = if flow {
            2 * flow::WINDOW
        } else {
            self.opts.queue_bytes
        };
        let (queue, qrx) = queue::queue(budget);
        let ends = ConnEnds {
            queue,
            cancel: CancellationToken::new(),
            credit: flow.then(SendCredit::new),
        };
        (ends, qrx)
    }

    /// Resolves (within policy) and connects.
    async fn open(&self, address: &str, protocol: &str) -> Result<TcpStream, dialerr::DialFailure> {
        use dialerr::DialFailure;
        if protocol != "tcp" {
            return Err(DialFailure::other(format!(
                "protocol {protocol:?} is not supported"
            )));
        }
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(address)
            .await
            .map_err(|e| DialFailure::other(format!("dial tcp {address}: lookup: {e}")))?
            .collect();
        let allowed: Vec<SocketAddr> = addrs.iter().copied().filter(|a| self.allowed(a)).collect();
        if allowed.is_empty() {
            return Err(DialFailure::forbidden(address));
        }
        let mut last = DialFailure::other(format!("dial tcp {address}: no address"));
        for a in allowed {
            match TcpStream::connect(a).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = DialFailure::io(address, &e),
            }
        }
        Err(last)
    }

    /// First SIGTERM: DRAIN to every server, no new connections to servers.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        let sessions: Vec<_> = seedlink_net::sync::lock(&self.sessions, "agent sessions")
            .values()
            .cloned()
            .collect();
        for s in sessions {
            s.send_soon(Packet::drain());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts every stream and drops (or drains) it at once
    /// is dialled less and less often, up to the cap; one stable stream
    /// ends the streak.
    #[test]
    fn streams_that_do_not_last_back_off() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(10));
        assert_eq!(flap_delay(0, base, cap), Duration::ZERO);
        assert_eq!(flap_delay(1, base, cap), base);
        assert_eq!(flap_delay(2, base, cap), Duration::from_millis(1500));
        assert_eq!(flap_delay(40, base, cap), cap);
        assert_eq!(flap_delay(u32::MAX, base, cap), cap);
        // Over 8 s of flapping, at most a handful of streams, not hundreds.
        let mut t = Duration::ZERO;
        let mut streams = 0;
        while t < Duration::from_secs(8) {
            streams += 1;
            t += flap_delay(streams, base, cap);
        }
        assert!(streams <= 6, "{streams}");
    }

    #[test]
    fn refusals_back_off_and_timeouts_do_not() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(30));
        let mut delay = base;
        let mut waits = Vec::new();
        for _ in 0..12 {
            let (wait, next) = retry_delay(delay, false, base, cap);
            waits.push(wait);
            delay = next;
        }
        assert_eq!(waits[0], base);
        assert!(waits.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(delay, cap, "refusals grow to the cap");
        // A partition: however long the back-off had grown, a timed-out
        // attempt is followed by the base wait, and so is the next.
        let (wait, next) = retry_delay(delay, true, base, cap);
        assert_eq!((wait, next), (base, base));
        let connect = ConnectError::ConnectTimeout("x:1".into());
        assert!(connect.timed_out() && ConnectError::TlsTimeout.timed_out());
        assert!(!ConnectError::Refused("no".into()).timed_out());
    }
}
