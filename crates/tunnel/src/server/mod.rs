//! `seedlink tunnel-server`: agents of many clusters connect to one agent
//! endpoint; each cluster's frontends (kube-apiserver's egress dialer) dial
//! through that cluster's agents only.
//!
//! Every agent stream is an [`AgentLink`]. A dial picks a link of the
//! frontend's cluster, registers a pending dial under a fresh random ID *on
//! that link*, and waits (bounded) for the link's receive loop to resolve
//! it. Established connections live in the link's table too, so an agent
//! can only ever answer, feed or close what was sent to it.
//!
//! The link's timers (a dial's deadline, an agent gone silent under a
//! waiting dial, the stall deadline of a connection waiting for room, the
//! closed IDs' expiry) are the machine's ([`link::ServerLink::poll_timeout`],
//! [`link::ServerLink::handle_timeout`]); the link's receive loop
//! (`agents::receive`) sleeps until the next one with
//! [`AgentLink::next_timeout`]. Timers around IO stay with the IO: the TLS
//! handshake deadline, the first-stream deadline, a frontend write's stall.

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
use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;

pub use self::dialerror::DialError;
pub use self::link::Handled;
use self::link::{Action, Actions, ServerLink, Timers};
use crate::deadline::{earliest, later};
use crate::fair::FairQueue;
use crate::flow::{self, SendCredit, Unacked};
use crate::proto::Packet;
use crate::queue::{self, QueueRx, QueueTx};
use crate::token::{TokenError, TokenValidator};
pub use seedlink_config::tunnel::ClusterHealth;

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
    /// Told when the machine's next timer moved earlier (the receive loop
    /// sleeps until it).
    timer: Notify,
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
    /// A timer that moved earlier wakes the receive loop's sleep.
    fn with<T>(
        &self,
        now: Instant,
        f: impl FnOnce(&mut ServerLink<ConnEnds, Reply>, &mut Actions<ConnEnds, Reply>) -> T,
    ) -> (T, Applied) {
        let mut g = seedlink_net::sync::lock(&self.state, "agent link");
        let Locked { machine, out } = &mut *g;
        let before = machine.poll_timeout();
        let r = f(machine, out);
        let applied = self.apply(now, machine, out);
        let after = machine.poll_timeout();
        drop(g);
        if after.is_some_and(|a| before.is_none_or(|b| a < b)) {
            // Every sleeper: the receive loop may hold two timer futures at
            // once (its own, and the one `Blocked::resume` polls while the
            // first waits), and only the one being polled must not miss it.
            self.timer.notify_waiters();
        }
        (r, applied)
    }

    /// When the agent's connection last delivered a byte, as seen at `now`
    /// (unset: not tracked).
    fn heard_at(&self, now: Instant) -> Option<Instant> {
        let silent = self.activity.get()?.silent_for();
        // A silence longer than the clock goes back: as long ago as it can
        // be (fails closed: the agent counts as silent).
        Some(now.checked_sub(silent).unwrap_or_else(|| earliest(now)))
    }

    /// Sleeps until the machine's next timer (a timer set meanwhile wakes
    /// it earlier), then lets the machine handle what is due: it answers
    /// dials that timed out or whose agent went silent, resets a stalled
    /// connection, forgets expired closed IDs. Returns
    /// [`Handled::Stalled`] when the connection waiting for room was given
    /// up. The one driver of the timers is the link's receive loop.
    pub async fn next_timeout(&self) -> Option<Handled> {
        loop {
            let notified = self.timer.notified();
            let due = seedlink_net::sync::lock(&self.state, "agent link")
                .machine
                .poll_timeout();
            let Some(at) = due else {
                notified.await;
                continue;
            };
            tokio::select! {
                () = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => break,
                () = notified => {}
            }
        }
        let now = Instant::now();
        let heard = self.heard_at(now);
        self.with(now, |m, out| {
            if let Some(h) = heard {
                m.heard(h);
            }
            m.handle_timeout(now, out)
        })
        .0
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
                Action::Send(p) => self.send_soon(p),
                Action::Finish(id, last) => self.finish(id, last),
                Action::Deliver(id, data) => {
                    if let Some(b) = deliver(machine, id, data) {
                        machine.blocked(now, id);
                        applied.blocked = Some(b);
                    }
                }
                Action::Reopen(id, n) if !reopen(machine, id, n) => {
                    machine.window_violated(now, id, out);
                    applied.violation = true;
                }
                Action::Reopen(..) => {}
                // The dialer gave up in the meantime.
                Action::Answer(reply, result) => {
                    if let Err(Ok(id)) = reply.send(result) {
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

    /// Ends connection `id`'s lane after its queued data, then `last`.
    fn finish(&self, id: i64, last: Option<Packet>) {
        self.to_agent.finish(id, last);
        if self.to_agent.overflowed() {
            // The receive loop ends the stream (control_overflow).
            self.kick.cancel();
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
            if !fit.is_empty() {
                return choose(&fit, unresponsive_after).cloned();
            }
        }
        Err(DialError::NoAgent)
    }
}

/// Chooses among the agents that `fit` a strategy: a responsive one, a
/// non-draining one among those if any, the less loaded of two random
/// picks; the shortest silence when none is responsive.
fn choose<'a>(
    fit: &[&'a Arc<AgentLink>],
    unresponsive_after: Duration,
) -> Result<&'a Arc<AgentLink>, DialError> {
    let silence = |a: &Arc<AgentLink>| a.activity.get().map(|x| x.silent_for());
    let responsive: Vec<&Arc<AgentLink>> = fit
        .iter()
        .copied()
        .filter(|a| silence(a).is_none_or(|s| s <= unresponsive_after))
        .collect();
    if responsive.is_empty() {
        let shortest = fit.iter().filter_map(|a| silence(a)).min();
        return Err(DialError::Unresponsive(shortest.unwrap_or_default()));
    }
    let live: Vec<&Arc<AgentLink>> = responsive
        .iter()
        .copied()
        .filter(|a| !a.draining())
        .collect();
    let pool = if live.is_empty() { responsive } else { live };
    let a = pool[rand::random_range(0..pool.len())];
    let b = pool[rand::random_range(0..pool.len())];
    Ok(if b.conn_count() < a.conn_count() {
        b
    } else {
        a
    })
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
    let permit = cluster.gate.admit(Instant::now()).map_err(|l| {
        cluster.metrics.dial_failure(l.reason());
        DialError::Limited(l)
    })?;
    let started = Instant::now();
    let attempt = Attempt {
        cluster,
        address,
        settings: &settings,
        deadline: later(started, settings.timeout),
        cancel,
    };
    match attempt.with_retries().await {
        Ok(open) => {
            cluster.metrics.dial_ok(started.elapsed());
            Ok(open.tunnel(permit))
        }
        Err(e) => {
            cluster.metrics.dial_failure(e.reason());
            Err(e)
        }
    }
}

/// One dial through the cluster's agents, under one deadline.
struct Attempt<'a> {
    cluster: &'a Cluster,
    address: &'a str,
    settings: &'a DialSettings,
    deadline: Instant,
    cancel: &'a CancellationToken,
}

/// A dial the agent accepted: the connection's link, ID and ends.
struct Opened {
    link: Arc<AgentLink>,
    connect_id: i64,
    credit: Option<SendCredit>,
    rx: QueueRx,
}

impl Opened {
    fn tunnel(self, permit: limits::ConnPermit) -> Tunnel {
        Tunnel {
            tx: TunnelTx {
                link: self.link,
                connect_id: self.connect_id,
                credit: self.credit,
                _permit: permit,
            },
            rx: self.rx,
        }
    }
}

impl Attempt<'_> {
    /// A dial whose agent goes silent while it waits is taken back and sent
    /// to another agent; a bounded number of times (each retry skips every
    /// silent agent, so more would only find the same ones).
    async fn with_retries(&self) -> Result<Opened, DialError> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let link = self.pick()?;
            match self.through(&link).await {
                Err(DialError::Unresponsive(_))
                    if attempts < 3 && Instant::now() < self.deadline =>
                {
                    tracing::info!(cluster = %self.cluster.name, agent = %link.agent_id, "agent went silent during a dial; trying another");
                }
                r => return r,
            }
        }
    }

    fn pick(&self) -> Result<Arc<AgentLink>, DialError> {
        let address = self.address;
        let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
        self.cluster.pick(host, self.settings.unresponsive_after)
    }

    /// A new connection's ends and its frontend's queue; `flow`: with flow
    /// control, whose agent never has more than a window in flight.
    fn ends(&self, flow: bool) -> (ConnEnds, QueueRx) {
        let budget = if flow {
            2 * flow::WINDOW
        } else {
            self.settings.queue_bytes
        };
        let shared = Some(self.cluster.gate.queue_budget());
        let (queue, rx) = queue::queue_within(budget, shared);
        let credit = flow.then(SendCredit::new);
        (ConnEnds { queue, credit }, rx)
    }

    /// Registers the dial on `link` and waits for the answer; a dial still
    /// pending when the wait ends (cancel) is forgotten and the agent told
    /// (a timeout or silence did so already).
    async fn through(&self, link: &Arc<AgentLink>) -> Result<Opened, DialError> {
        let random = dial_id();
        let (reply_tx, reply_rx) = oneshot::channel();
        let (ends, rx) = self.ends(link.flow);
        let credit = ends.credit.clone();
        let now = Instant::now();
        let heard = link.heard_at(now);
        link.with(now, |m, out| {
            if let Some(h) = heard {
                m.heard(h);
            }
            m.dial(random, self.address, self.deadline, reply_tx, ends, out)
        });
        self.cluster.metrics.pending(1);
        let outcome = await_answer(link, reply_rx, self.cancel, self.deadline).await;
        self.cluster.metrics.pending(-1);
        if outcome.is_err() {
            link.with(Instant::now(), |m, out| m.dial_abandoned(random, out));
        }
        Ok(Opened {
            link: link.clone(),
            connect_id: outcome?,
            credit,
            rx,
        })
    }
}

/// The agent's answer to a dial, or why none came: the caller's cancel or
/// the agent's end. The deadline and the agent's silence are the link
/// machine's timers: they answer the dial with the error. A backstop
/// [`ANSWER_BACKSTOP`] after the deadline answers it here should the
/// link's receive loop, which drives those timers, be gone without ending
/// the link (a bug): no dial waits forever.
async fn await_answer(
    link: &AgentLink,
    mut reply: oneshot::Receiver<Result<i64, DialError>>,
    cancel: &CancellationToken,
    deadline: Instant,
) -> Result<i64, DialError> {
    let backstop = tokio::time::Instant::from_std(later(deadline, ANSWER_BACKSTOP));
    tokio::select! {
        r = &mut reply => r.unwrap_or(Err(DialError::AgentGone)),
        () = cancel.cancelled() => Err(DialError::Cancelled),
        () = link.gone.cancelled() => Err(DialError::AgentGone),
        () = tokio::time::sleep_until(backstop) => {
            tracing::error!("a dial outlived its deadline: the link's timers did not run (a bug); answered as a timeout");
            Err(DialError::Timeout)
        }
    }
}

/// How long after its deadline a dial is answered by [`await_answer`]
/// itself, should the link machine's timer not have answered it.
const ANSWER_BACKSTOP: Duration = Duration::from_secs(1);

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
/// stream to the agent. Its receive loop must drive
/// [`AgentLink::next_timeout`].
pub fn attach(
    cluster: &Cluster,
    agent_id: String,
    ids: Identifiers,
    flow: bool,
    timers: Timers,
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
            machine: ServerLink::new(flow, timers),
            out: Actions::new(),
        }),
        timer: Notify::new(),
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

/// Gives connection `id`'s sender `n` bytes more window; `false` when
/// that is more than it used (a connection without a window takes any).
fn reopen(machine: &ServerLink<ConnEnds, Reply>, id: i64, n: i64) -> bool {
    machine
        .conn(id)
        .and_then(|c| c.credit.as_ref())
        .is_none_or(|c| c.give(n))
}

/// Queues DATA for connection `id`'s frontend; what does not fit comes
/// back to wait for room. A reader that left closes through its frontend.
fn deliver(machine: &ServerLink<ConnEnds, Reply>, id: i64, data: Bytes) -> Option<Blocked> {
    let c = machine.conn(id)?;
    match c.queue.push(data) {
        Ok(()) | Err(queue::PushError::Closed) => None,
        Err(queue::PushError::Full(data)) => Some(Blocked {
            connect_id: id,
            data,
            room: c.queue.room(),
        }),
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
    /// bytes; a reader that takes nothing for the stall deadline loses its
    /// connection (CLOSE_REQ to the agent), nothing else does. The deadline
    /// is the link machine's: every progress restarts it, and the link's
    /// timers go on firing meanwhile.
    pub async fn resume(mut self, link: &AgentLink) -> Handled {
        let timer = link.next_timeout();
        tokio::pin!(timer);
        loop {
            let step = tokio::select! {
                step = self.room.step(self.data.len()) => step,
                h = &mut timer => match h {
                    Some(h) => return h,
                    None => {
                        timer.set(link.next_timeout());
                        continue;
                    }
                },
            };
            let now = Instant::now();
            match step {
                queue::Step::Room => match self.push(link) {
                    Some(data) => self.data = data,
                    None => break,
                },
                queue::Step::Progress => {}
                // The frontend went away: its own close tells the agent.
                queue::Step::Closed => break,
            }
            link.with(now, |m, _| m.progress(now));
        }
        link.with(Instant::now(), |m, _| m.unblocked());
        Handled::Ok
    }

    /// Queues the bytes if they fit; hands them back if not. Only this
    /// receive loop pushes into this queue, but another agent stream of the
    /// cluster may take the shared budget first: then it waits again, never
    /// drops. A connection closed meanwhile drops them (its own close tells
    /// the agent).
    fn push(&mut self, link: &AgentLink) -> Option<Bytes> {
        let g = seedlink_net::sync::lock(&link.state, "agent link");
        let c = g.machine.conn(self.connect_id)?;
        match c.queue.push(std::mem::take(&mut self.data)) {
            Ok(()) | Err(queue::PushError::Closed) => None,
            Err(queue::PushError::Full(data)) => Some(data),
        }
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
            TIMERS,
        );
        let (b, _) = attach(
            &c,
            "b".into(),
            Identifiers::parse("cidr=10.1.0.0/16").0,
            false,
            TIMERS,
        );
        let (d, _) = attach(
            &c,
            "d".into(),
            Identifiers::parse("default-route=true").0,
            false,
            TIMERS,
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
            TIMERS,
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
    const TIMERS: Timers = Timers {
        stall: Duration::from_secs(10),
        unresponsive_after: LIVE,
    };

    #[test]
    fn a_silent_agent_is_skipped_and_alone_fails_the_dial_at_once() {
        let c = cluster(&[Strategy::Default]);
        let (frozen, _) = attach(&c, "frozen".into(), Identifiers::default(), false, TIMERS);
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
        let (live, _) = attach(&c, "live".into(), Identifiers::default(), false, TIMERS);
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
        let (first, _) = attach(&c, "x".into(), Identifiers::default(), false, TIMERS);
        let (_second, _) = attach(&c, "x".into(), Identifiers::default(), false, TIMERS);
        for _ in 0..20 {
            assert_eq!(c.pick("h", LIVE).unwrap().uid, first.uid);
        }
    }

    /// The driver half of the timers: a dial registered while the timer
    /// loop sleeps with nothing due wakes it, and the machine answers the
    /// dial with the timeout (the agent gets DIAL_REQ, then DIAL_CLS).
    #[tokio::test]
    async fn the_timer_loop_answers_a_dial_at_its_deadline() {
        let c = cluster(&[Strategy::Default]);
        let (link, to_agent) = attach(&c, "a".into(), Identifiers::default(), false, TIMERS);
        let timers = {
            let link = link.clone();
            tokio::spawn(async move {
                loop {
                    link.next_timeout().await;
                }
            })
        };
        tokio::task::yield_now().await;
        let settings = DialSettings {
            timeout: Duration::from_millis(50),
            queue_bytes: 1 << 16,
            unresponsive_after: LIVE,
        };
        let r = dial(&c, "h:1", settings, &CancellationToken::new()).await;
        assert_eq!(r.err(), Some(DialError::Timeout));
        let kinds: Vec<_> = std::iter::from_fn(|| to_agent.try_next())
            .map(|p| p.kind())
            .collect();
        use crate::proto::PacketType as T;
        assert_eq!(kinds, [Some(T::DialReq), Some(T::DialCls)]);
        assert_eq!(link.conn_count(), 0);
        timers.abort();
    }

    /// The receive loop holds two timer futures while a connection waits
    /// for room (its own, idle, and the one the wait polls): a dial whose
    /// deadline comes before the waiting one's wakes the one being polled,
    /// which answers it. (With a wake-up for the oldest sleeper only, the
    /// polled one slept on to the stall deadline, an hour here.)
    #[tokio::test]
    async fn an_earlier_timer_wakes_every_sleeper() {
        let c = cluster(&[Strategy::Default]);
        let timers = Timers {
            stall: Duration::from_secs(3600),
            ..TIMERS
        };
        let (link, _to_agent) = attach(&c, "a".into(), Identifiers::default(), false, timers);
        let now = Instant::now();
        link.with(now, |m, _| m.blocked(now, 99));
        let outer = link.next_timeout();
        tokio::pin!(outer);
        let inner = link.next_timeout();
        tokio::pin!(inner);
        for f in [&mut outer, &mut inner] {
            tokio::select! {
                biased;
                _ = f => panic!("nothing is due yet"),
                () = std::future::ready(()) => {}
            }
        }
        let (qtx, _reader) = queue::queue(4);
        let ends = ConnEnds {
            queue: qtx,
            credit: None,
        };
        let (reply, answer) = oneshot::channel();
        link.with(Instant::now(), |m, out| {
            m.dial(7, "h:1", Instant::now(), reply, ends, out);
        });
        // A bound that only stops a broken build.
        let woke = tokio::time::timeout(Duration::from_secs(30), &mut inner).await;
        assert_eq!(
            woke.ok(),
            Some(None),
            "the polled sleeper woke and handled the dial"
        );
        assert_eq!(answer.await.ok(), Some(Err(DialError::Timeout)));
    }

    /// A reader that takes nothing: the wait for room ends at the
    /// machine's stall deadline, with that connection reset.
    #[tokio::test]
    async fn a_wait_for_room_ends_at_the_stall_deadline() {
        let c = cluster(&[Strategy::Default]);
        let timers = Timers {
            stall: Duration::from_millis(50),
            ..TIMERS
        };
        let (link, _to_agent) = attach(&c, "a".into(), Identifiers::default(), false, timers);
        let (qtx, _reader) = queue::queue(4);
        let ends = ConnEnds {
            queue: qtx,
            credit: None,
        };
        let (reply, _answer) = oneshot::channel();
        let now = Instant::now();
        link.with(now, |m, out| {
            m.dial(7, "h:1", now + LIVE, reply, ends, out);
        });
        link.on_agent_packet(Packet::dial_rsp(7, 1, String::new()));
        let four = || Packet::data(1, Bytes::from_static(b"1234"));
        assert!(link.on_agent_packet(four()).1.is_none());
        let (h, blocked) = link.on_agent_packet(four());
        assert_eq!(h, Handled::Full);
        let Some(b) = blocked else {
            panic!("the second chunk does not fit")
        };
        assert_eq!(b.resume(&link).await, Handled::Stalled);
        assert_eq!(link.conn_count(), 0);
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
