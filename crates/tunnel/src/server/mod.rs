//! `seedlink tunnel-server`: agents of many clusters connect to one agent
//! endpoint; each cluster's frontends (kube-apiserver's egress dialer) dial
//! through that cluster's agents only.
//!
//! Every agent stream is an [`AgentLink`]. A dial picks a link of the
//! frontend's cluster, registers a pending dial under a fresh random ID *on
//! that link*, and waits (bounded) for the link's receive loop to resolve
//! it. Established connections live in the link's table too, so an agent
//! can only ever answer, feed or close what was sent to it.

pub mod activity;
pub mod admin;
pub mod agents;
pub mod core;
pub mod dialerror;
pub mod frontend;
pub mod handover;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
pub mod limits;
pub mod link;
pub mod metrics;
pub mod run;
pub mod socks;
pub mod upgrade;

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use ipnet::IpNet;
use rustls::server::danger::ClientCertVerifier;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

pub use self::dialerror::DialError;
pub use self::link::Handled;
use self::link::{Action, Actions, ServerLink};
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

impl std::fmt::Display for Identifiers {
    /// The URL-query form the agent sent (canonical order).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = self.hosts.iter().map(|h| format!("host={h}")).collect();
        parts.extend(self.ips.iter().map(|ip| match ip {
            IpAddr::V4(_) => format!("ipv4={ip}"),
            IpAddr::V6(_) => format!("ipv6={ip}"),
        }));
        parts.extend(self.cidrs.iter().map(|c| format!("cidr={c}")));
        if self.default_route {
            parts.push("default-route=true".into());
        }
        write!(f, "{}", parts.join("&"))
    }
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

/// A connection's ends the link machine keeps: the queue towards its
/// frontend and, with flow control, its sending window.
pub struct ConnEnds {
    queue: QueueTx,
    credit: Option<SendCredit>,
}

impl ConnEnds {
    fn end(self) {
        if let Some(c) = &self.credit {
            c.close();
        }
    }

    fn abort(self) {
        if let Some(c) = &self.credit {
            c.close();
        }
        self.queue.abort();
    }
}

/// How a pending dial is answered.
type Reply = oneshot::Sender<Result<i64, DialError>>;

/// The machine and its reusable action buffer, behind the link's one lock.
struct Locked {
    machine: ServerLink<ConnEnds, Reply>,
    out: Actions<ConnEnds, Reply>,
}

/// One agent stream: the sans-IO [`ServerLink`] behind one lock, and the IO
/// it drives (the fair queue towards the agent, the frontends' queues).
pub struct AgentLink {
    /// Server-local unique number (logs, tie-breaks).
    pub uid: u64,
    /// The agent's `agentid`.
    pub agent_id: String,
    /// Its cluster (from its credentials).
    pub cluster: Arc<str>,
    /// Its identifiers.
    pub ids: Identifiers,
    /// When its stream was attached.
    pub since: std::time::SystemTime,
    to_agent: Arc<FairQueue>,
    state: Mutex<Locked>,
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
    /// The agent asked to be told when the number of replicas changes
    /// (REPLICAS packets, seedlink agent).
    pub replica_updates: std::sync::atomic::AtomicBool,
    /// When its connection last delivered a byte (unset: never judged
    /// unresponsive).
    pub activity: std::sync::OnceLock<Arc<activity::Activity>>,
}

/// What the driver saw while carrying out the machine's actions.
#[derive(Default)]
struct Applied {
    blocked: Option<Blocked>,
    violation: bool,
}

impl AgentLink {
    /// Runs `f` on the machine under the lock, then carries out what it
    /// asked for. Nothing here waits: queue pushes and sends never block.
    fn with<T>(
        &self,
        now: Instant,
        f: impl FnOnce(&mut ServerLink<ConnEnds, Reply>, &mut Actions<ConnEnds, Reply>) -> T,
    ) -> (T, Applied) {
        let mut g = seedlink_net::sync::lock(&self.state, "agent link");
        let Locked { machine, out } = &mut *g;
        let r = f(machine, out);
        let applied = self.apply(now, machine, out);
        (r, applied)
    }

    fn apply(
        &self,
        now: Instant,
        machine: &mut ServerLink<ConnEnds, Reply>,
        out: &mut Actions<ConnEnds, Reply>,
    ) -> Applied {
        let mut applied = Applied::default();
        while let Some(a) = out.pop_front() {
            match a {
                Action::Send(p) => {
                    if self.to_agent.control(p).is_err() && self.to_agent.overflowed() {
                        // The receive loop ends the stream (control_overflow).
                        self.kick.cancel();
                    }
                }
                Action::Finish(id, last) => {
                    self.to_agent.finish(id, last);
                    if self.to_agent.overflowed() {
                        self.kick.cancel();
                    }
                }
                Action::Deliver(id, data) => {
                    if let Some(c) = machine.conn(id) {
                        match c.queue.push(data) {
                            // A reader that left closes through its frontend.
                            Ok(()) | Err(queue::PushError::Closed) => {}
                            Err(queue::PushError::Full(data)) => {
                                applied.blocked = Some(Blocked {
                                    connect_id: id,
                                    data,
                                    room: c.queue.room(),
                                });
                            }
                        }
                    }
                }
                Action::Reopen(id, n) => {
                    let fits = machine
                        .conn(id)
                        .and_then(|c| c.credit.as_ref())
                        .is_none_or(|c| c.give(n));
                    if !fits {
                        machine.window_violated(now, id, out);
                        applied.violation = true;
                    }
                }
                Action::Answer(reply, result) => {
                    if let Err(Ok(id)) = reply.send(result) {
                        // The dialer gave up in the meantime.
                        machine.close(now, id, out);
                    }
                }
                Action::End(c) => c.end(),
                Action::Abort(c) => c.abort(),
            }
        }
        applied
    }

    /// Open connections plus pending dials.
    pub fn conn_count(&self) -> usize {
        seedlink_net::sync::lock(&self.state, "agent link")
            .machine
            .load()
    }

    /// Whether the agent announced DRAIN.
    pub fn draining(&self) -> bool {
        seedlink_net::sync::lock(&self.state, "agent link")
            .machine
            .draining()
    }

    /// Queues DATA of connection `id` for the agent, waiting while that
    /// connection has enough queued (backpressure to its frontend only).
    pub async fn send_data(&self, id: i64, data: Bytes) -> Result<(), DialError> {
        tokio::select! {
            r = self.to_agent.data(id, Packet::data(id, data)) => r.map_err(|_| DialError::AgentGone),
            () = self.gone.cancelled() => Err(DialError::AgentGone),
        }
    }

    /// Tells the agent this server is going away (DRAIN): a seedlink agent
    /// then looks for a replica to replace it while this stream carries on
    /// what it has; an upstream agent ignores the packet.
    pub fn drain_notice(&self) {
        self.send_soon(Packet::drain());
    }

    /// Tells the agent the number of replicas now, if it asked to be told.
    pub fn replicas_notice(&self, count: u32) {
        if self.replica_updates.load(Ordering::Acquire) {
            self.send_soon(Packet::replicas(i64::from(count)));
        }
    }

    /// Queues a control packet; never waits.
    fn send_soon(&self, p: Packet) {
        if self.to_agent.control(p).is_err() && self.to_agent.overflowed() {
            self.kick.cancel();
        }
    }

    /// Forgets connection `id` (frontend side closed it) and tells the agent
    /// after the data already queued for it.
    pub fn close_conn(&self, id: i64) {
        let now = Instant::now();
        self.with(now, |m, out| m.close(now, id, out));
    }

    /// Applies one packet from the agent. Never waits: DATA that does not
    /// fit its connection's queue comes back as [`Blocked`] for the caller
    /// to await.
    pub fn on_agent_packet(&self, p: Packet) -> (Handled, Option<Blocked>) {
        let now = Instant::now();
        let (h, applied) = self.with(now, |m, out| m.on_packet(now, p, out));
        match (applied.blocked, applied.violation) {
            (Some(b), _) => (Handled::Full, Some(b)),
            (None, true) => (Handled::Unexpected, None),
            (None, false) => (h, None),
        }
    }

    /// The stream ended: fail every pending dial at once and abort every
    /// established connection.
    fn fail_all(&self) {
        self.gone.cancel();
        self.with(Instant::now(), |m, out| m.end(out));
        self.to_agent.close();
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
    /// Its own frontends, `name (protocol, where)`, for the admin views.
    pub frontends: Vec<String>,
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
    /// Its metric handles.
    pub metrics: metrics::ClusterMetrics,
    /// Open gRPC frontend connections: each may carry further dials (a
    /// draining server keeps this cluster's agent streams while any is
    /// open).
    pub grpc_frontends: std::sync::atomic::AtomicUsize,
    agents: Mutex<Vec<Arc<AgentLink>>>,
    /// When an agent stream last came or went (for `TunnelCluster` status).
    agents_changed: Mutex<Option<std::time::SystemTime>>,
}

/// What the status of a cluster reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterHealth {
    /// Agent streams connected now.
    pub agents: usize,
    /// When an agent stream last connected or (with none left) went away.
    pub agents_changed: Option<std::time::SystemTime>,
    /// Failed dials by reason since the cluster was added.
    pub dial_errors: Vec<(&'static str, u64)>,
}

impl Cluster {
    /// A cluster with no agents yet.
    pub fn new(
        name: &str,
        conf: ClusterConf,
        limits: limits::Limits,
        metrics: metrics::ClusterMetrics,
    ) -> Cluster {
        Cluster {
            name: name.into(),
            conf: ArcSwap::from_pointee(conf),
            gate: limits::Gate::new(limits),
            removed: CancellationToken::new(),
            metrics,
            grpc_frontends: std::sync::atomic::AtomicUsize::new(0),
            agents: Mutex::new(Vec::new()),
            agents_changed: Mutex::new(None),
        }
    }

    /// Agents, when they last changed, and dial errors.
    pub fn health(&self) -> ClusterHealth {
        ClusterHealth {
            agents: self.agent_count(),
            agents_changed: *seedlink_net::sync::lock(
                &self.agents_changed,
                "cluster agents changed",
            ),
            dial_errors: self.metrics.dial_failures(),
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
                frontends: Vec::new(),
            },
            limits,
            metrics::ClusterMetrics::unregistered(),
        )
    }

    /// Its agent streams now.
    pub fn agents(&self) -> Vec<Arc<AgentLink>> {
        seedlink_net::sync::lock(&self.agents, "cluster agents").clone()
    }

    /// Connected agent streams.
    pub fn agent_count(&self) -> usize {
        seedlink_net::sync::lock(&self.agents, "cluster agents").len()
    }

    /// Agent streams whose agent sent DRAIN.
    pub fn draining_count(&self) -> usize {
        self.agents().iter().filter(|l| l.draining()).count()
    }

    /// Chooses an agent for `host`: strategies in order; within one, a
    /// responsive agent (one whose connection delivered a byte within
    /// `unresponsive_after`), a non-draining one among those if any, the
    /// less loaded of two random picks. When every agent that fits has
    /// been silent longer, the dial fails at once with the shortest
    /// silence instead of waiting its timeout on a frozen agent.
    pub fn pick(
        &self,
        host: &str,
        unresponsive_after: Duration,
    ) -> Result<Arc<AgentLink>, DialError> {
        let agents = seedlink_net::sync::lock(&self.agents, "cluster agents");
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
            let silence = |a: &Arc<AgentLink>| a.activity.get().map(|x| x.silent_for());
            let responsive: Vec<&Arc<AgentLink>> = fit
                .iter()
                .copied()
                .filter(|a| silence(a).is_none_or(|s| s <= unresponsive_after))
                .collect();
            if responsive.is_empty() {
                let shortest = fit
                    .iter()
                    .filter_map(|a| silence(a))
                    .min()
                    .unwrap_or_default();
                return Err(DialError::Unresponsive(shortest));
            }
            let fit = responsive;
            let live: Vec<&Arc<AgentLink>> =
                fit.iter().copied().filter(|a| !a.draining()).collect();
            let pool = if live.is_empty() { fit } else { live };
            let a = pool[rand::random_range(0..pool.len())];
            let b = pool[rand::random_range(0..pool.len())];
            return Ok(if b.conn_count() < a.conn_count() {
                b
            } else {
                a
            }
            .clone());
        }
        Err(DialError::NoAgent)
    }
}

/// Settings every dial uses.
#[derive(Debug, Clone, Copy)]
pub struct DialSettings {
    /// Deadline for the agent's answer.
    pub timeout: Duration,
    /// Per-connection queue budget.
    pub queue_bytes: usize,
    /// Silence after which an agent is skipped (see [`activity`]).
    pub unresponsive_after: Duration,
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
) -> Result<Tunnel, DialError> {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    let permit = match cluster.gate.admit(std::time::Instant::now()) {
        Ok(p) => p,
        Err(l) => {
            cluster.metrics.dial_failure(l.reason());
            return Err(DialError::Limited(l));
        }
    };
    let started = Instant::now();
    let deadline = tokio::time::Instant::from_std(started + settings.timeout);
    // A dial whose agent goes silent while it waits is taken back and sent
    // to another agent; a bounded number of times (each retry skips every
    // silent agent, so more would only find the same ones).
    let mut attempts = 0;
    loop {
        attempts += 1;
        let link = match cluster.pick(host, settings.unresponsive_after) {
            Ok(l) => l,
            Err(e) => {
                cluster.metrics.dial_failure(e.reason());
                return Err(e);
            }
        };
        let random = dial_id();
        let (reply_tx, reply_rx) = oneshot::channel();
        // With flow control the agent never has more than a window in flight.
        let budget = if link.flow {
            2 * flow::WINDOW
        } else {
            settings.queue_bytes
        };
        let (qtx, qrx) = queue::queue_within(budget, Some(cluster.gate.queue_budget()));
        let credit = link.flow.then(SendCredit::new);
        let ends = ConnEnds {
            queue: qtx,
            credit: credit.clone(),
        };
        link.with(Instant::now(), |m, out| {
            m.dial(random, address, reply_tx, ends, out)
        });
        cluster.metrics.pending(1);
        let outcome = await_answer(&link, reply_rx, &settings, deadline, cancel).await;
        cluster.metrics.pending(-1);
        match outcome {
            Ok(connect_id) => {
                cluster.metrics.dial_ok(started.elapsed());
                return Ok(Tunnel {
                    tx: TunnelTx {
                        link,
                        connect_id,
                        credit,
                        _permit: permit,
                    },
                    rx: qrx,
                });
            }
            Err(e) => {
                // Still pending (timeout, cancel, silence): forget it and
                // tell the agent.
                link.with(Instant::now(), |m, out| m.dial_abandoned(random, out));
                if matches!(e, DialError::Unresponsive(_))
                    && attempts < 3
                    && tokio::time::Instant::now() < deadline
                {
                    tracing::info!(cluster = %cluster.name, agent = %link.agent_id, "agent went silent during a dial; trying another");
                    continue;
                }
                cluster.metrics.dial_failure(e.reason());
                return Err(e);
            }
        }
    }
}

/// The agent's answer to a dial, or why none came: the deadline, the
/// caller's cancel, the agent's silence or its end.
async fn await_answer(
    link: &AgentLink,
    mut reply: oneshot::Receiver<Result<i64, DialError>>,
    settings: &DialSettings,
    deadline: tokio::time::Instant,
    cancel: &CancellationToken,
) -> Result<i64, DialError> {
    loop {
        let silent = link.activity.get().map(|a| a.silent_for());
        let wake = dial_wake(
            silent,
            settings.unresponsive_after,
            tokio::time::Instant::now(),
            deadline,
        )?;
        tokio::select! {
            r = &mut reply => return r.unwrap_or(Err(DialError::AgentGone)),
            () = tokio::time::sleep_until(wake) => {
                if tokio::time::Instant::now() >= deadline {
                    return Err(DialError::Timeout);
                }
            }
            () = cancel.cancelled() => return Err(DialError::Cancelled),
            () = link.gone.cancelled() => return Err(DialError::AgentGone),
        }
    }
}

/// When a dial waiting for an agent's answer looks again: when the agent,
/// silent for `silent` now, would pass `unresponsive_after` (if it is
/// heard from before, the wait is recomputed), or at the deadline if that
/// is sooner or the agent's activity is not tracked. `Err` when the agent
/// is past the limit already.
fn dial_wake(
    silent: Option<Duration>,
    unresponsive_after: Duration,
    now: tokio::time::Instant,
    deadline: tokio::time::Instant,
) -> Result<tokio::time::Instant, DialError> {
    match silent {
        Some(s) if s > unresponsive_after => Err(DialError::Unresponsive(s)),
        Some(s) => Ok((now + (unresponsive_after - s) + Duration::from_millis(50)).min(deadline)),
        None => Ok(deadline),
    }
}

/// Why an agent certificate got no cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertMatch {
    /// No cluster's CA verifies it.
    None,
    /// Two clusters' CAs verify it (their names).
    Ambiguous(Arc<str>, Arc<str>),
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

    /// The one cluster whose CA verifies `certs`. A chain that verifies
    /// for two clusters (one CA cross-signed by another, or a chain the
    /// agent presents through an intermediate that links them) is refused
    /// rather than given to whichever comes first: otherwise one tenant's
    /// agent could serve another tenant's traffic. The configuration check
    /// already refuses shared keys and direct cross-signing; this holds at
    /// any depth. Every cluster's verifier is asked (one signature check
    /// each, at agent connection time only).
    pub fn cluster_for_cert(
        &self,
        certs: &[rustls::pki_types::CertificateDer<'_>],
    ) -> Result<Arc<Cluster>, CertMatch> {
        let clusters = self.clusters.load();
        let mut found = clusters.iter().filter(|c| {
            c.conf
                .load()
                .verifier
                .as_ref()
                .is_some_and(|v| crate::tls::accepts(v.as_ref(), certs))
        });
        match (found.next(), found.next()) {
            (Some(c), None) => Ok(c.clone()),
            (None, _) => Err(CertMatch::None),
            (Some(a), Some(b)) => Err(CertMatch::Ambiguous(a.name.clone(), b.name.clone())),
        }
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
        self.cluster_for_credentials(user, password)
    }

    /// The cluster `user` names, if `password` is its proxy password.
    pub fn cluster_for_credentials(&self, user: &str, password: &str) -> Option<Arc<Cluster>> {
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
        since: std::time::SystemTime::now(),
        to_agent: tx.clone(),
        state: Mutex::new(Locked {
            machine: ServerLink::new(flow),
            out: Actions::new(),
        }),
        gone: CancellationToken::new(),
        kick: CancellationToken::new(),
        certs: std::sync::OnceLock::new(),
        authorization: std::sync::OnceLock::new(),
        flow,
        replica_updates: std::sync::atomic::AtomicBool::new(false),
        activity: std::sync::OnceLock::new(),
    });
    seedlink_net::sync::lock(&cluster.agents, "cluster agents").push(link.clone());
    *seedlink_net::sync::lock(&cluster.agents_changed, "cluster agents changed") =
        Some(std::time::SystemTime::now());
    (link, tx)
}

/// Removes an ended agent stream and fails everything that depended on it.
pub fn detach(cluster: &Cluster, link: &Arc<AgentLink>) {
    let left = {
        let mut agents = seedlink_net::sync::lock(&cluster.agents, "cluster agents");
        agents.retain(|x| !Arc::ptr_eq(x, link));
        agents.len()
    };
    if left == 0 {
        *seedlink_net::sync::lock(&cluster.agents_changed, "cluster agents changed") =
            Some(std::time::SystemTime::now());
    }
    link.fail_all();
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
    pub async fn resume(mut self, link: &AgentLink, stall: Duration) -> Handled {
        loop {
            match self.room.wait(self.data.len(), stall).await {
                queue::WaitEnd::Room => {
                    // Only this receive loop pushes into this queue, but
                    // another agent stream of the cluster may take the
                    // shared budget first: then wait again, never drop.
                    let g = seedlink_net::sync::lock(&link.state, "agent link");
                    let Some(c) = g.machine.conn(self.connect_id) else {
                        // Closed meanwhile: its own close tells the agent.
                        return Handled::Ok;
                    };
                    match c.queue.push(self.data) {
                        Ok(()) | Err(queue::PushError::Closed) => return Handled::Ok,
                        Err(queue::PushError::Full(data)) => self.data = data,
                    }
                }
                // The frontend went away: its own close tells the agent.
                queue::WaitEnd::Closed => return Handled::Ok,
                queue::WaitEnd::Stalled => return self.stalled(link, Instant::now()),
            }
        }
    }

    /// Gives up on the connection at `now`.
    pub fn stalled(self, link: &AgentLink, now: Instant) -> Handled {
        link.with(now, |m, out| m.stalled(now, self.connect_id, out))
            .0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    #[test]
    fn a_dial_looks_again_when_its_agent_would_pass_the_silence_limit() {
        let now = tokio::time::Instant::now();
        let deadline = now + Duration::from_secs(10);
        let limit = Duration::from_secs(3);
        let s = dial_wake;
        // Heard from 1 s ago: look again when 3 s (plus slack) have passed.
        assert_eq!(
            s(Some(Duration::from_secs(1)), limit, now, deadline).ok(),
            Some(now + Duration::from_millis(2050))
        );
        // The deadline comes first.
        let soon = now + Duration::from_millis(500);
        assert_eq!(s(Some(Duration::ZERO), limit, now, soon).ok(), Some(soon));
        // Activity not tracked: only the deadline.
        assert_eq!(s(None, limit, now, deadline).ok(), Some(deadline));
        // Exactly at the limit is not past it; beyond is.
        assert!(s(Some(limit), limit, now, deadline).is_ok());
        assert!(matches!(
            s(Some(limit + Duration::from_millis(1)), limit, now, deadline),
            Err(DialError::Unresponsive(_))
        ));
    }

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
        assert_eq!(c.pick("10.0.0.5", LIVE).unwrap().agent_id, "a");
        assert_eq!(c.pick("NODE-A", LIVE).unwrap().agent_id, "a");
        assert_eq!(c.pick("10.1.2.3", LIVE).unwrap().agent_id, "b");
        assert_eq!(c.pick("192.168.1.1", LIVE).unwrap().agent_id, "d");
        assert_eq!(c.pick("[fd00::1]", LIVE).unwrap().agent_id, "d");
        // No `default` strategy: nothing matches without default-route.
        detach(&c, &d);
        assert_eq!(c.pick("192.168.1.1", LIVE).err(), Some(DialError::NoAgent));
        // A draining agent is used only when no other fits.
        let (a2, _) = attach(
            &c,
            "a2".into(),
            Identifiers::parse("ipv4=10.0.0.5").0,
            false,
        );
        a.on_agent_packet(Packet::drain());
        for _ in 0..20 {
            assert_eq!(c.pick("10.0.0.5", LIVE).unwrap().agent_id, "a2");
        }
        a2.on_agent_packet(Packet::drain());
        assert!(c.pick("10.0.0.5", LIVE).is_ok());
        let _ = b;
    }

    const LIVE: Duration = Duration::from_secs(12);

    #[test]
    fn a_silent_agent_is_skipped_and_alone_fails_the_dial_at_once() {
        let c = cluster(&[Strategy::Default]);
        let (frozen, _) = attach(&c, "frozen".into(), Identifiers::default(), false);
        let stamp = activity::Activity::new();
        stamp.backdate(Duration::from_secs(30));
        let _ = frozen.activity.set(stamp);
        match c.pick("h", LIVE) {
            Err(DialError::Unresponsive(s)) => assert!(s >= Duration::from_secs(30)),
            other => panic!(
                "expected Unresponsive, got {:?}",
                other.map(|l| l.agent_id.clone())
            ),
        }
        assert_eq!(
            DialError::Unresponsive(Duration::from_secs(30)).http_status(),
            503
        );
        // A live agent (stamped now, or never stamped) takes every dial.
        let (live, _) = attach(&c, "live".into(), Identifiers::default(), false);
        let _ = live.activity.set(activity::Activity::new());
        for _ in 0..20 {
            assert_eq!(
                c.pick("h", LIVE)
                    .map(|l| l.agent_id.clone())
                    .ok()
                    .as_deref(),
                Some("live")
            );
        }
    }

    #[test]
    fn only_an_agents_first_stream_takes_dials() {
        let c = cluster(&[Strategy::Default]);
        let (first, _) = attach(&c, "x".into(), Identifiers::default(), false);
        let (_second, _) = attach(&c, "x".into(), Identifiers::default(), false);
        for _ in 0..20 {
            assert_eq!(c.pick("h", LIVE).unwrap().uid, first.uid);
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
