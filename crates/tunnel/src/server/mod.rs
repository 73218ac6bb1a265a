//! `seedlink tunnel-server`: agents of many clusters connect to one agent
//! endpoint; each cluster's frontends (kube-apiserver's egress dialer) dial
//! through that cluster's agents only.
//!
//! Every agent stream is an [`AgentLink`]. A dial picks a link of the
//! frontend's cluster, registers a pending dial under a fresh random ID *on
//! that link*, and waits (bounded) for the link's receive loop to resolve
//! it. Established connections live in the link's table too, so an agent
//! can only ever answer, feed or close what was sent to it.

pub mod admin;
pub mod agents;
pub mod frontend;
pub mod harness;
pub mod limits;
pub mod metrics;
pub mod run;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use ipnet::IpNet;
use rustls::server::danger::ClientCertVerifier;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::fair::FairQueue;
use crate::flow::{self, SendCredit, Unacked};
use crate::proto::Packet;
use crate::queue::{self, QueueRx, QueueTx};
use crate::token::{TokenError, TokenValidator};

/// What an agent says about itself (`agentidentifiers`).
#[derive(Debug, Clone, Default)]
pub struct Identifiers {
    /// `host=` values.
    pub hosts: Vec<String>,
    /// `ipv4=` / `ipv6=` values.
    pub ips: Vec<IpAddr>,
    /// `cidr=` values.
    pub cidrs: Vec<IpNet>,
    /// `default-route=true`.
    pub default_route: bool,
}

impl Identifiers {
    /// Parses the URL-query form; unknown keys and unparsable values are
    /// ignored (as upstream does), and reported back for logging.
    pub fn parse(s: &str) -> (Identifiers, Vec<String>) {
        let mut out = Identifiers::default();
        let mut ignored = Vec::new();
        for (k, v) in form_urlencoded::parse(s.as_bytes()) {
            match k.as_ref() {
                "host" => out.hosts.push(v.to_ascii_lowercase()),
                "ipv4" | "ipv6" => match v.parse() {
                    Ok(ip) => out.ips.push(ip),
                    Err(_) => ignored.push(format!("{k}={v}")),
                },
                "cidr" => match v.parse() {
                    Ok(n) => out.cidrs.push(n),
                    Err(_) => ignored.push(format!("{k}={v}")),
                },
                "default-route" => out.default_route = v.eq_ignore_ascii_case("true"),
                _ => ignored.push(k.to_string()),
            }
        }
        (out, ignored)
    }
}

/// How a backend is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Any agent of the cluster.
    Default,
    /// An agent whose `host`/`ipv4`/`ipv6` identifier equals the destination host.
    DestHost,
    /// An agent advertising `default-route=true`.
    DefaultRoute,
    /// An agent whose `cidr` identifier contains the destination IP.
    Cidr,
}

impl Strategy {
    /// From its configuration name.
    pub fn from_name(s: &str) -> Option<Strategy> {
        Some(match s {
            "default" => Strategy::Default,
            "destHost" => Strategy::DestHost,
            "defaultRoute" => Strategy::DefaultRoute,
            "cidr" => Strategy::Cidr,
            _ => return None,
        })
    }

    fn matches(self, ids: &Identifiers, host: &str) -> bool {
        match self {
            Strategy::Default => true,
            Strategy::DefaultRoute => ids.default_route,
            Strategy::DestHost => {
                let h = host.trim_start_matches('[').trim_end_matches(']');
                match h.parse::<IpAddr>() {
                    Ok(ip) => ids.ips.contains(&ip),
                    Err(_) => ids.hosts.iter().any(|x| x.eq_ignore_ascii_case(h)),
                }
            }
            Strategy::Cidr => {
                let h = host.trim_start_matches('[').trim_end_matches(']');
                h.parse::<IpAddr>()
                    .is_ok_and(|ip| ids.cidrs.iter().any(|n| n.contains(&ip)))
            }
        }
    }
}

/// Why a dial failed; mapped to HTTP statuses and gRPC errors in one place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialError {
    /// No agent of the cluster can take it.
    #[error("No agent available")]
    NoAgent,
    /// The agent did not answer within the dial timeout.
    #[error("timed out waiting for backend dial")]
    Timeout,
    /// The agent's stream ended while the dial was pending.
    #[error("backend connection closed")]
    AgentGone,
    /// The agent cancelled the dial (DIAL_CLS).
    #[error("dial closed by the agent")]
    Cancelled,
    /// The agent answered with an error.
    #[error("{0}")]
    Agent(String),
    /// The agent broke the protocol (a DIAL_RSP without connection ID).
    #[error("agent protocol error: {0}")]
    Protocol(&'static str),
    /// A limit of the cluster refused the dial.
    #[error("cluster limit reached: {}", .0.reason())]
    Limited(limits::Limited),
}

impl DialError {
    /// The HTTP status an HTTP-CONNECT frontend answers with (as upstream
    /// documents: 500 no agent, 502 other failures, 503 resource
    /// exhaustion at the agent, 504 timeouts).
    pub fn http_status(&self) -> u16 {
        match self {
            DialError::NoAgent => 500,
            DialError::Timeout => 504,
            DialError::Agent(text) => match crate::dialerr::classify(text) {
                crate::dialerr::Kind::Timeout => 504,
                crate::dialerr::Kind::Exhausted => 503,
                _ => 502,
            },
            DialError::AgentGone | DialError::Cancelled | DialError::Protocol(_) => 502,
            DialError::Limited(_) => 503,
        }
    }

    /// Label for `dial_failures_total{reason}` (Konnectivity's reasons where
    /// they mean the same).
    pub fn reason(&self) -> &'static str {
        match self {
            DialError::NoAgent => "no_agent",
            DialError::Timeout => "backend_dial_timeout",
            DialError::AgentGone => "backend_close",
            DialError::Cancelled => "dial_closed",
            DialError::Agent(_) => "error_response",
            DialError::Protocol(_) => "protocol_error",
            DialError::Limited(l) => l.reason(),
        }
    }
}

/// A dial waiting for its DIAL_RSP.
struct Pending {
    reply: oneshot::Sender<Result<i64, DialError>>,
    queue: QueueTx,
}

/// One agent stream.
pub struct AgentLink {
    /// Server-local unique number (logs, tie-breaks).
    pub uid: u64,
    /// The agent's `agentid`.
    pub agent_id: String,
    /// Its cluster (from its credentials).
    pub cluster: Arc<str>,
    /// Its identifiers.
    pub ids: Identifiers,
    to_agent: Arc<FairQueue>,
    draining: AtomicBool,
    pending: Mutex<HashMap<i64, Pending>>,
    conns: Mutex<HashMap<i64, QueueTx>>,
    /// Connections this side closed (CLOSE_REQ sent), until the agent's
    /// CLOSE_RSP: late DATA and the CLOSE_RSP for them are expected.
    closing: Mutex<HashMap<i64, std::time::Instant>>,
    /// Cancelled when the stream ends.
    pub gone: CancellationToken,
    /// Cancelled to end the stream from this side (its cluster was
    /// re-keyed and no longer accepts its certificate).
    pub kick: CancellationToken,
    /// The client certificate chain it authenticated with (empty: token).
    pub certs: std::sync::OnceLock<Vec<rustls::pki_types::CertificateDer<'static>>>,
    /// The `authorization` it presented (a ServiceAccount token), kept to
    /// check it again when its cluster is re-keyed.
    pub authorization: std::sync::OnceLock<String>,
    /// Per-connection flow control negotiated (seedlink agent).
    pub flow: bool,
    credits: Mutex<HashMap<i64, SendCredit>>,
}

impl AgentLink {
    fn conn_count(&self) -> usize {
        self.conns.lock().map(|c| c.len()).unwrap_or(0)
            + self.pending.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Whether the agent announced DRAIN.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Queues DATA of connection `id` for the agent, waiting while that
    /// connection has enough queued (backpressure to its frontend only).
    pub async fn send_data(&self, id: i64, data: Bytes) -> Result<(), DialError> {
        tokio::select! {
            r = self.to_agent.data(id, Packet::data(id, data)) => r.map_err(|_| DialError::AgentGone),
            () = self.gone.cancelled() => Err(DialError::AgentGone),
        }
    }

    /// Queues a control packet; never waits.
    fn send_soon(&self, p: Packet) {
        let _ = self.to_agent.control(p);
    }

    /// Forgets connection `id` (frontend side closed it) and tells the agent
    /// after the data already queued for it.
    pub fn close_conn(&self, id: i64) {
        if let Some(c) = self.credits.lock().ok().and_then(|mut c| c.remove(&id)) {
            c.close();
        }
        let had = self.conns.lock().ok().and_then(|mut c| c.remove(&id));
        if had.is_some() {
            self.closing_started(id, Instant::now());
        } else {
            self.to_agent.finish(id, None);
        }
    }

    /// Sends CLOSE_REQ for `id` (after its queued DATA) and remembers it
    /// until the CLOSE_RSP (or a minute, for agents that never answer).
    fn closing_started(&self, id: i64, now: Instant) {
        if let Ok(mut c) = self.closing.lock() {
            if c.len() >= 4096 {
                c.retain(|_, at| now.saturating_duration_since(*at) < Duration::from_secs(60));
            }
            c.insert(id, now);
        }
        self.to_agent.finish(id, Some(Packet::close_req(id)));
    }

    fn closing_done(&self, id: i64) -> bool {
        self.closing
            .lock()
            .ok()
            .and_then(|mut c| c.remove(&id))
            .is_some()
    }

    fn is_closing(&self, id: i64) -> bool {
        self.closing
            .lock()
            .map(|c| c.contains_key(&id))
            .unwrap_or(false)
    }

    /// The stream ended: fail every pending dial at once and abort every
    /// established connection.
    fn fail_all(&self) {
        self.gone.cancel();
        self.to_agent.close();
        if let Ok(mut p) = self.pending.lock() {
            for (_, d) in p.drain() {
                let _ = d.reply.send(Err(DialError::AgentGone));
                d.queue.abort();
            }
        }
        if let Ok(mut c) = self.conns.lock() {
            for (_, q) in c.drain() {
                q.abort();
            }
        }
        if let Ok(mut c) = self.credits.lock() {
            for (_, cr) in c.drain() {
                cr.close();
            }
        }
    }
}

/// What a configuration reload may change in a cluster (swapped as a
/// whole; a dial or handshake uses one consistent version).
pub struct ClusterConf {
    /// Backend choice, in order.
    pub strategies: Vec<Strategy>,
    /// Accepts this cluster's agent certificates.
    pub verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// Accepts this cluster's agent tokens.
    pub token: Option<Arc<TokenValidator>>,
    /// Password that selects this cluster on shared proxy frontends.
    pub proxy_password: Option<String>,
}

/// One cluster's agents and settings.
pub struct Cluster {
    /// Name.
    pub name: Arc<str>,
    /// Trust, strategies, proxy password.
    pub conf: ArcSwap<ClusterConf>,
    /// Limits (connections, dial rate, agent streams).
    pub gate: limits::Gate,
    /// Cancelled when the cluster is removed: its agent streams end.
    pub removed: CancellationToken,
    agents: Mutex<Vec<Arc<AgentLink>>>,
}

impl Cluster {
    /// A cluster with no agents yet.
    pub fn new(name: &str, conf: ClusterConf, limits: limits::Limits) -> Cluster {
        Cluster {
            name: name.into(),
            conf: ArcSwap::from_pointee(conf),
            gate: limits::Gate::new(limits),
            removed: CancellationToken::new(),
            agents: Mutex::new(Vec::new()),
        }
    }

    /// A cluster trusting `verifier` and `token`, with `strategies`.
    pub fn with_trust(
        name: &str,
        strategies: Vec<Strategy>,
        verifier: Option<Arc<dyn ClientCertVerifier>>,
        token: Option<TokenValidator>,
        limits: limits::Limits,
    ) -> Cluster {
        Cluster::new(
            name,
            ClusterConf {
                strategies,
                verifier,
                token: token.map(Arc::new),
                proxy_password: None,
            },
            limits,
        )
    }

    /// Its agent streams now.
    pub fn agents(&self) -> Vec<Arc<AgentLink>> {
        self.agents.lock().map(|a| a.clone()).unwrap_or_default()
    }

    /// Connected agent streams.
    pub fn agent_count(&self) -> usize {
        self.agents.lock().map(|a| a.len()).unwrap_or(0)
    }

    /// Agent streams whose agent sent DRAIN.
    pub fn draining_count(&self) -> usize {
        self.agents
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|l| l.draining.load(Ordering::Acquire))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Chooses an agent for `host`: strategies in order; within one, a
    /// non-draining agent if any, the less loaded of two random picks.
    pub fn pick(&self, host: &str) -> Option<Arc<AgentLink>> {
        let agents = self.agents.lock().ok()?;
        // One stream per agent and server: an agent that dials again to find
        // other replicas briefly has a second stream here, which it closes;
        // dials use its first (as upstream does).
        let first = |a: &Arc<AgentLink>| {
            !agents
                .iter()
                .any(|b| b.agent_id == a.agent_id && b.uid < a.uid)
        };
        let conf = self.conf.load();
        for s in &conf.strategies {
            let fit: Vec<&Arc<AgentLink>> = agents
                .iter()
                .filter(|a| first(a) && s.matches(&a.ids, host))
                .collect();
            if fit.is_empty() {
                continue;
            }
            let live: Vec<&Arc<AgentLink>> =
                fit.iter().copied().filter(|a| !a.draining()).collect();
            let pool = if live.is_empty() { fit } else { live };
            let a = pool[rand::random_range(0..pool.len())];
            let b = pool[rand::random_range(0..pool.len())];
            return Some(
                if b.conn_count() < a.conn_count() {
                    b
                } else {
                    a
                }
                .clone(),
            );
        }
        None
    }
}

/// Settings every dial uses.
#[derive(Debug, Clone, Copy)]
pub struct DialSettings {
    /// Deadline for the agent's answer.
    pub timeout: Duration,
    /// Per-connection queue budget.
    pub queue_bytes: usize,
}

/// An established tunneled connection, frontend side.
pub struct Tunnel {
    /// Towards the agent.
    pub tx: TunnelTx,
    /// Bytes from the agent.
    pub rx: QueueRx,
}

/// The sending half of a [`Tunnel`]; dropping it closes the connection
/// (CLOSE_REQ to the agent).
pub struct TunnelTx {
    /// The agent carrying it.
    pub link: Arc<AgentLink>,
    /// The agent's connection ID.
    pub connect_id: i64,
    /// Window towards the agent (flow control negotiated).
    pub credit: Option<SendCredit>,
    /// The cluster's connection slot, freed with the connection.
    _permit: limits::ConnPermit,
}

impl TunnelTx {
    /// Sends frontend bytes to the agent (within the connection's window
    /// when flow control is on).
    pub async fn send(&self, data: Bytes) -> Result<(), DialError> {
        if let Some(c) = &self.credit {
            tokio::select! {
                r = c.take(data.len()) => r.map_err(|()| DialError::AgentGone)?,
                () = self.link.gone.cancelled() => return Err(DialError::AgentGone),
            }
        }
        self.link.send_data(self.connect_id, data).await
    }

    /// The frontend wrote `n` bytes the agent sent: returns window to the
    /// agent when enough has gathered (flow control only).
    pub fn consumed(&self, unacked: &mut Unacked, n: usize) {
        if self.link.flow {
            if let Some(k) = unacked.written(n) {
                self.link
                    .send_soon(Packet::window_update(self.connect_id, k));
            }
        }
    }

    /// Closes now (CLOSE_REQ); bytes already queued from the agent are
    /// still delivered.
    pub fn close(&self) {
        self.link.close_conn(self.connect_id);
    }
}

impl Drop for TunnelTx {
    fn drop(&mut self) {
        self.close();
    }
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// A fresh dial ID: random (the thread-local generator is a CSPRNG),
/// positive, never 0.
pub fn dial_id() -> i64 {
    loop {
        let v = rand::random::<i64>() & i64::MAX;
        if v != 0 {
            return v;
        }
    }
}

/// Dials `address` through an agent of `cluster`, with a fresh dial ID.
/// `cancel` aborts a pending dial (the agent is sent DIAL_CLS).
pub async fn dial(
    cluster: &Cluster,
    address: &str,
    settings: DialSettings,
    cancel: &CancellationToken,
    metrics: &metrics::Metrics,
) -> Result<Tunnel, DialError> {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    let permit = match cluster.gate.admit(std::time::Instant::now()) {
        Ok(p) => p,
        Err(l) => {
            metrics.dial_failure(&cluster.name, l.reason());
            return Err(DialError::Limited(l));
        }
    };
    let Some(link) = cluster.pick(host) else {
        metrics.dial_failure(&cluster.name, DialError::NoAgent.reason());
        return Err(DialError::NoAgent);
    };
    let random = dial_id();
    let (reply_tx, reply_rx) = oneshot::channel();
    // With flow control the agent never has more than a window in flight.
    let budget = if link.flow {
        2 * flow::WINDOW
    } else {
        settings.queue_bytes
    };
    let (qtx, qrx) = queue::queue(budget);
    if let Ok(mut p) = link.pending.lock() {
        p.insert(
            random,
            Pending {
                reply: reply_tx,
                queue: qtx,
            },
        );
    }
    metrics.pending(&cluster.name, 1);
    let started = std::time::Instant::now();
    link.send_soon(Packet::dial_req(address, random));
    let outcome = tokio::select! {
        r = tokio::time::timeout(settings.timeout, reply_rx) => match r {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(DialError::AgentGone),
            Err(_) => Err(DialError::Timeout),
        },
        () = cancel.cancelled() => Err(DialError::Cancelled),
        () = link.gone.cancelled() => Err(DialError::AgentGone),
    };
    metrics.pending(&cluster.name, -1);
    match outcome {
        Ok(connect_id) => {
            metrics.dial_ok(&cluster.name, started.elapsed());
            let credit = link.flow.then(|| {
                let c = SendCredit::new();
                if let Ok(mut m) = link.credits.lock() {
                    m.insert(connect_id, c.clone());
                }
                c
            });
            Ok(Tunnel {
                tx: TunnelTx {
                    link,
                    connect_id,
                    credit,
                    _permit: permit,
                },
                rx: qrx,
            })
        }
        Err(e) => {
            // Still pending (timeout, cancel): forget it and tell the agent.
            let was_pending = link.pending.lock().ok().and_then(|mut p| p.remove(&random));
            if was_pending.is_some() && !link.gone.is_cancelled() {
                link.send_soon(Packet::dial_cls(random));
            }
            metrics.dial_failure(&cluster.name, e.reason());
            Err(e)
        }
    }
}

/// All clusters, by name; swapped as a whole by a reload.
#[derive(Default)]
pub struct Registry {
    clusters: ArcSwap<Vec<Arc<Cluster>>>,
}

impl Registry {
    /// A registry of `clusters`.
    pub fn new(clusters: Vec<Arc<Cluster>>) -> Registry {
        Registry {
            clusters: ArcSwap::from_pointee(clusters),
        }
    }

    /// The clusters now.
    pub fn clusters(&self) -> Arc<Vec<Arc<Cluster>>> {
        self.clusters.load_full()
    }

    /// Replaces the cluster list.
    pub fn set(&self, clusters: Vec<Arc<Cluster>>) {
        self.clusters.store(Arc::new(clusters));
    }

    /// A cluster by name.
    pub fn cluster(&self, name: &str) -> Option<Arc<Cluster>> {
        self.clusters
            .load()
            .iter()
            .find(|c| &*c.name == name)
            .cloned()
    }

    /// The cluster whose CA issued `certs`, the first in configuration order.
    pub fn cluster_for_cert(
        &self,
        certs: &[rustls::pki_types::CertificateDer<'_>],
    ) -> Option<Arc<Cluster>> {
        self.clusters
            .load()
            .iter()
            .find(|c| {
                c.conf
                    .load()
                    .verifier
                    .as_ref()
                    .is_some_and(|v| crate::tls::accepts(v.as_ref(), certs))
            })
            .cloned()
    }

    /// The cluster whose issuer the token in `authorization` claims, once
    /// that cluster accepted it; a token is never shown to another
    /// cluster's API server.
    pub async fn cluster_for_token(&self, authorization: &str) -> Result<Arc<Cluster>, TokenError> {
        let iss = crate::token::claimed_issuer(authorization)?;
        let found = self.clusters.load().iter().find_map(|c| {
            c.conf
                .load()
                .token
                .clone()
                .filter(|v| v.issuer() == iss)
                .map(|v| (c.clone(), v))
        });
        let Some((c, v)) = found else {
            return Err(TokenError::Invalid(format!(
                "no cluster has issuer {iss:?}"
            )));
        };
        v.check(authorization).await.map(|()| c)
    }

    /// The cluster a shared proxy request names with
    /// `Proxy-Authorization: Basic <cluster>:<password>`, if the password is
    /// that cluster's.
    pub fn cluster_for_proxy_credentials(&self, header: Option<&str>) -> Option<Arc<Cluster>> {
        use base64::Engine;
        let b64 = header?.trim().strip_prefix("Basic ")?.trim();
        let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (user, password) = text.split_once(':')?;
        let c = self.cluster(user)?;
        let conf = c.conf.load();
        let want = conf.proxy_password.as_deref()?;
        constant_time_eq(want.as_bytes(), password.as_bytes()).then(|| c.clone())
    }

    /// Whether any cluster has an agent.
    pub fn any_agent(&self) -> bool {
        self.clusters.load().iter().any(|c| c.agent_count() > 0)
    }
}

/// Compares secrets without an early exit (hand-written: four lines, not
/// worth a dependency).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Registers a new agent stream in `cluster`; the returned queue feeds the
/// stream to the agent.
pub fn attach(
    cluster: &Cluster,
    agent_id: String,
    ids: Identifiers,
    flow: bool,
) -> (Arc<AgentLink>, Arc<FairQueue>) {
    let tx = FairQueue::new();
    let link = Arc::new(AgentLink {
        uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
        agent_id,
        cluster: cluster.name.clone(),
        ids,
        to_agent: tx.clone(),
        draining: AtomicBool::new(false),
        pending: Mutex::new(HashMap::new()),
        conns: Mutex::new(HashMap::new()),
        closing: Mutex::new(HashMap::new()),
        gone: CancellationToken::new(),
        kick: CancellationToken::new(),
        certs: std::sync::OnceLock::new(),
        authorization: std::sync::OnceLock::new(),
        flow,
        credits: Mutex::new(HashMap::new()),
    });
    if let Ok(mut a) = cluster.agents.lock() {
        a.push(link.clone());
    }
    (link, tx)
}

/// Removes an ended agent stream and fails everything that depended on it.
pub fn detach(cluster: &Cluster, link: &Arc<AgentLink>) {
    if let Ok(mut a) = cluster.agents.lock() {
        a.retain(|x| !Arc::ptr_eq(x, link));
    }
    link.fail_all();
}

/// What the receive loop did with one packet from an agent (for counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// As expected.
    Ok,
    /// Referred to a dial or connection this agent does not have.
    Unrecognized,
    /// A connection's queue was full: the packet waits for room (see
    /// [`Blocked`]); the stream reads nothing else meanwhile.
    Full,
    /// A connection whose reader took nothing for the stall deadline while
    /// its packet waited: that connection was closed.
    Stalled,
    /// A packet kind an agent must not send, or an unknown kind.
    Unexpected,
}

impl Handled {
    /// The `reason` label of `agent_packets_total`.
    pub fn label(self) -> &'static str {
        match self {
            Handled::Ok => "ok",
            Handled::Unrecognized => "unrecognized",
            Handled::Full => "delayed",
            Handled::Stalled => "stalled",
            Handled::Unexpected => "unexpected",
        }
    }
}

/// DATA for a connection whose queue is full. The standard protocol has no
/// per-connection flow control, so the only lossless answer is to stop
/// reading the agent's stream until the reader makes room (HTTP/2 flow
/// control then holds the agent back); the caller awaits [`Blocked::resume`].
pub struct Blocked {
    connect_id: i64,
    data: Bytes,
    room: queue::Room,
}

impl Blocked {
    /// Waits for room while the reader makes progress, then queues the
    /// bytes; a reader that takes nothing for `stall` loses its connection
    /// (CLOSE_REQ to the agent), nothing else does.
    pub async fn resume(self, link: &AgentLink, stall: Duration) -> Handled {
        match self.room.wait(self.data.len(), stall).await {
            queue::WaitEnd::Room => {
                let pushed = link
                    .conns
                    .lock()
                    .ok()
                    .and_then(|c| c.get(&self.connect_id).map(|q| q.push(self.data)));
                match pushed {
                    Some(Ok(())) | None => Handled::Ok,
                    // Only this loop pushes, so room stays room; a reader
                    // that left meanwhile closes through its frontend.
                    Some(Err(_)) => Handled::Ok,
                }
            }
            // The frontend went away: its own close tells the agent.
            queue::WaitEnd::Closed => Handled::Ok,
            queue::WaitEnd::Stalled => self.stalled(link, Instant::now()),
        }
    }

    /// Gives up on the connection at `now` (deterministic, for the fuzzer).
    pub fn stalled(self, link: &AgentLink, now: Instant) -> Handled {
        let q = link
            .conns
            .lock()
            .ok()
            .and_then(|mut c| c.remove(&self.connect_id));
        if let Some(q) = q {
            q.abort();
            link.closing_started(self.connect_id, now);
        }
        Handled::Stalled
    }
}

/// Applies one packet from the agent of `link`. Never waits: DATA that does
/// not fit its connection's queue comes back as [`Blocked`] for the caller
/// to await.
/// It reads no clock (the fuzz harness drives time through
/// [`Blocked::stalled`]).
pub fn on_agent_packet(link: &AgentLink, p: Packet) -> (Handled, Option<Blocked>) {
    if let (Some(crate::proto::PacketType::Data), Some(crate::proto::Payload::Data(d))) =
        (p.kind(), &p.payload)
    {
        let connect_id = d.connect_id;
        let pushed = link.conns.lock().ok().and_then(|c| {
            c.get(&connect_id).map(|q| match q.push(d.data.clone()) {
                Err(queue::PushError::Full(data)) => Err(Some(Blocked {
                    connect_id,
                    data,
                    room: q.room(),
                })),
                Err(queue::PushError::Closed) => Err(None),
                Ok(()) => Ok(()),
            })
        });
        return match pushed {
            Some(Ok(())) | Some(Err(None)) => (Handled::Ok, None),
            Some(Err(Some(b))) => (Handled::Full, Some(b)),
            // In flight when this side closed it: dropped, expected.
            None if link.is_closing(connect_id) => (Handled::Ok, None),
            None => {
                link.send_soon(Packet::close_req(connect_id));
                (Handled::Unrecognized, None)
            }
        };
    }
    (on_control_packet(link, p), None)
}

/// Every packet but DATA.
fn on_control_packet(link: &AgentLink, p: Packet) -> Handled {
    use crate::proto::{PacketType as T, Payload};
    match (p.kind(), p.payload) {
        (Some(T::DialRsp), Some(Payload::DialResponse(r))) => {
            let pending = link
                .pending
                .lock()
                .ok()
                .and_then(|mut m| m.remove(&r.random));
            let Some(pending) = pending else {
                // Not a dial of this agent's (or already given up): make
                // sure the connection it opened does not leak.
                if r.connect_id != 0 && r.error.is_empty() {
                    link.send_soon(Packet::close_req(r.connect_id));
                }
                return Handled::Unrecognized;
            };
            if !r.error.is_empty() {
                let _ = pending.reply.send(Err(DialError::Agent(r.error)));
                return Handled::Ok;
            }
            if r.connect_id == 0 {
                let _ = pending
                    .reply
                    .send(Err(DialError::Protocol("DIAL_RSP without connectID")));
                return Handled::Unexpected;
            }
            // An ID still open or still closing is not a new connection.
            let dup = link.is_closing(r.connect_id)
                || link
                    .conns
                    .lock()
                    .map(|mut c| match c.entry(r.connect_id) {
                        std::collections::hash_map::Entry::Occupied(_) => true,
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(pending.queue);
                            false
                        }
                    })
                    .unwrap_or(true);
            if dup {
                return Handled::Unexpected;
            }
            if pending.reply.send(Ok(r.connect_id)).is_err() {
                // The frontend gave up in the meantime.
                link.close_conn(r.connect_id);
            }
            Handled::Ok
        }
        (Some(T::CloseRsp), Some(Payload::CloseResponse(c))) => {
            // Dropping the queue's sender ends the connection cleanly after
            // what is queued.
            let open = link
                .conns
                .lock()
                .ok()
                .and_then(|mut m| m.remove(&c.connect_id))
                .is_some();
            if open || link.closing_done(c.connect_id) {
                Handled::Ok
            } else {
                Handled::Unrecognized
            }
        }
        (Some(T::DialCls), Some(Payload::CloseDial(c))) => {
            match link
                .pending
                .lock()
                .ok()
                .and_then(|mut m| m.remove(&c.random))
            {
                Some(p) => {
                    let _ = p.reply.send(Err(DialError::Cancelled));
                    Handled::Ok
                }
                None => Handled::Unrecognized,
            }
        }
        (Some(T::WindowUpdate), Some(Payload::WindowUpdate(w))) if link.flow => {
            let credit = link
                .credits
                .lock()
                .ok()
                .and_then(|c| c.get(&w.connect_id).cloned());
            match credit {
                Some(c) if c.give(w.bytes) => Handled::Ok,
                Some(_) => {
                    // More window than was ever used: close that connection.
                    link.close_conn(w.connect_id);
                    Handled::Unexpected
                }
                None if link.is_closing(w.connect_id) => Handled::Ok,
                None => Handled::Unrecognized,
            }
        }
        (Some(T::Drain), _) => {
            link.draining.store(true, Ordering::Release);
            Handled::Ok
        }
        _ => Handled::Unexpected,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cluster(strategies: &[Strategy]) -> Cluster {
        Cluster::with_trust(
            "c",
            strategies.to_vec(),
            None,
            None,
            limits::Limits::UNLIMITED,
        )
    }

    #[test]
    fn identifiers_parse_like_upstream_and_report_what_they_ignore() {
        let (ids, ignored) = Identifiers::parse(
            "host=Node1&ipv4=10.0.0.5&ipv6=fd00::1&cidr=10.1.0.0/16&default-route=true&uid=x&ipv4=bad",
        );
        assert_eq!(ids.hosts, vec!["node1"]);
        assert_eq!(ids.ips.len(), 2);
        assert_eq!(ids.cidrs.len(), 1);
        assert!(ids.default_route);
        assert_eq!(ignored, vec!["uid".to_string(), "ipv4=bad".to_string()]);
    }

    #[test]
    fn strategies_pick_in_order_and_prefer_non_draining_agents() {
        let c = cluster(&[Strategy::DestHost, Strategy::Cidr, Strategy::DefaultRoute]);
        let (a, _) = attach(
            &c,
            "a".into(),
            Identifiers::parse("host=node-a&ipv4=10.0.0.5").0,
            false,
        );
        let (b, _) = attach(
            &c,
            "b".into(),
            Identifiers::parse("cidr=10.1.0.0/16").0,
            false,
        );
        let (d, _) = attach(
            &c,
            "d".into(),
            Identifiers::parse("default-route=true").0,
            false,
        );
        assert_eq!(c.pick("10.0.0.5").unwrap().agent_id, "a");
        assert_eq!(c.pick("NODE-A").unwrap().agent_id, "a");
        assert_eq!(c.pick("10.1.2.3").unwrap().agent_id, "b");
        assert_eq!(c.pick("192.168.1.1").unwrap().agent_id, "d");
        assert_eq!(c.pick("[fd00::1]").unwrap().agent_id, "d");
        // No `default` strategy: nothing matches without default-route.
        detach(&c, &d);
        assert!(c.pick("192.168.1.1").is_none());
        // A draining agent is used only when no other fits.
        let (a2, _) = attach(
            &c,
            "a2".into(),
            Identifiers::parse("ipv4=10.0.0.5").0,
            false,
        );
        a.draining.store(true, Ordering::Release);
        for _ in 0..20 {
            assert_eq!(c.pick("10.0.0.5").unwrap().agent_id, "a2");
        }
        a2.draining.store(true, Ordering::Release);
        assert!(c.pick("10.0.0.5").is_some());
        let _ = b;
    }

    #[test]
    fn only_an_agents_first_stream_takes_dials() {
        let c = cluster(&[Strategy::Default]);
        let (first, _) = attach(&c, "x".into(), Identifiers::default(), false);
        let (_second, _) = attach(&c, "x".into(), Identifiers::default(), false);
        for _ in 0..20 {
            assert_eq!(c.pick("h").unwrap().uid, first.uid);
        }
    }

    #[test]
    fn dial_errors_map_to_upstream_statuses() {
        assert_eq!(DialError::NoAgent.http_status(), 500);
        assert_eq!(DialError::Timeout.http_status(), 504);
        assert_eq!(DialError::AgentGone.http_status(), 502);
        assert_eq!(
            DialError::Agent("dial tcp 1.2.3.4:5: i/o timeout".into()).http_status(),
            504
        );
        assert_eq!(
            DialError::Agent("socket: too many open files".into()).http_status(),
            503
        );
        assert_eq!(
            DialError::Agent("connect: connection refused".into()).http_status(),
            502
        );
    }
}
