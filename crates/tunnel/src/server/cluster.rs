//! One cluster: its agents and settings, the choice of an agent for a
//! dial, agent streams joining and leaving it, and its limits, so that one
//! noisy cluster cannot starve the others on a shared server: concurrent
//! tunneled connections (pending dials count), a dial rate (token bucket)
//! and agent streams. Refusals are typed ([`Limited`]) and counted by the
//! caller.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use rustls::server::danger::ClientCertVerifier;
use seedlink_config::tunnel::ClusterHealth;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::link::Timers;
use super::link_driver::{Identifiers, LinkDriver, Strategy};
use super::metrics;
use crate::auth::tls;
use crate::auth::token::TokenValidator;
use crate::stream::flow::FairQueue;
use crate::wire::dial_error::DialError;
pub use crate::wire::dial_error::Limited;

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
    /// A URI the client certificate must carry, besides its CN, to select
    /// this cluster on a shared mTLS frontend.
    pub client_uri: Option<String>,
    /// Destinations dialled by the server itself, on the seed's network.
    pub seed: Vec<seedlink_config::tunnel::SeedDestination>,
}

/// One cluster's agents and settings.
pub struct Cluster {
    /// Name.
    pub name: Arc<str>,
    /// Trust, strategies, proxy password.
    pub conf: ArcSwap<ClusterConf>,
    /// Limits (connections, dial rate, agent streams).
    pub gate: Gate,
    /// Cancelled when the cluster is removed: its agent streams end.
    pub removed: CancellationToken,
    /// Its metric handles.
    pub metrics: metrics::ClusterMetrics,
    /// Open gRPC frontend connections: each may carry further dials (a
    /// draining server keeps this cluster's agent streams while any is
    /// open).
    pub grpc_frontends: std::sync::atomic::AtomicUsize,
    pub(super) agents: Mutex<Vec<Arc<LinkDriver>>>,
    /// Woken when an agent stream joins (dials waiting for an agent).
    pub(super) joined: Notify,
    /// Dials waiting for an agent now (at most [`MAX_WAITING`]).
    pub(super) waiting: std::sync::atomic::AtomicUsize,
    /// When an agent stream last came or went (for `TunnelCluster` status).
    pub(super) agents_changed: Mutex<Option<std::time::SystemTime>>,
    /// Until when (`seedlink_net::clock::now_ms`) its new agent streams are
    /// refused: one of its streams was cut for flooding (flood.rs).
    pub(super) flood_until_ms: std::sync::atomic::AtomicU64,
}

impl Cluster {
    /// A cluster with no agents yet.
    pub fn new(
        name: &str,
        conf: ClusterConf,
        limits: Limits,
        metrics: metrics::ClusterMetrics,
    ) -> Cluster {
        Cluster {
            name: name.into(),
            conf: ArcSwap::from_pointee(conf),
            gate: Gate::new(limits),
            removed: CancellationToken::new(),
            metrics,
            grpc_frontends: std::sync::atomic::AtomicUsize::new(0),
            agents: Mutex::new(Vec::new()),
            joined: Notify::new(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            agents_changed: Mutex::new(None),
            flood_until_ms: std::sync::atomic::AtomicU64::new(0),
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
        limits: Limits,
    ) -> Cluster {
        Cluster::new(
            name,
            ClusterConf {
                strategies,
                verifier,
                token: token.map(Arc::new),
                proxy_password: None,
                frontends: Vec::new(),
                client_uri: None,
                seed: Vec::new(),
            },
            limits,
            metrics::ClusterMetrics::unregistered(),
        )
    }

    /// Its agent streams now.
    pub fn agents(&self) -> Vec<Arc<LinkDriver>> {
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
    ) -> Result<Arc<LinkDriver>, DialError> {
        let agents = seedlink_net::sync::lock(&self.agents, "cluster agents");
        // One stream per agent and server: an agent that dials again to find
        // other replicas briefly has a second stream here, which it closes;
        // dials use its first (as upstream does). A stream its agent
        // drains does not count as first: the agent's replacement (a new
        // certificate) takes the dials while it finishes what it carries.
        let first = |a: &Arc<LinkDriver>| {
            !agents
                .iter()
                .any(|b| b.agent_id == a.agent_id && b.uid < a.uid && !b.draining())
        };
        let conf = self.conf.load();
        for s in &conf.strategies {
            let fit: Vec<&Arc<LinkDriver>> = agents
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
pub(super) fn choose<'a>(
    fit: &[&'a Arc<LinkDriver>],
    unresponsive_after: Duration,
) -> Result<&'a Arc<LinkDriver>, DialError> {
    let silence = |a: &Arc<LinkDriver>| a.activity.get().map(|x| x.silent_for());
    let responsive: Vec<&Arc<LinkDriver>> = fit
        .iter()
        .copied()
        .filter(|a| silence(a).is_none_or(|s| s <= unresponsive_after))
        .collect();
    if responsive.is_empty() {
        let shortest = fit.iter().filter_map(|a| silence(a)).min();
        return Err(DialError::Unresponsive(shortest.unwrap_or_default()));
    }
    let live: Vec<&Arc<LinkDriver>> = responsive
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

/// Dials of one cluster that may wait for an agent at once; more are
/// answered `no_agent` at once. Bounds the frontend sockets a cluster
/// without agents holds (each for `agent_wait` at most) and the work one
/// agent joining does (it wakes every waiting dial).
pub const MAX_WAITING: usize = 256;

/// Registers a new agent stream in `cluster`; the returned queue feeds the
/// stream to the agent. Its receive loop must drive
/// [`LinkDriver::next_timeout`].
pub fn attach(
    cluster: &Cluster,
    agent_id: String,
    ids: Identifiers,
    flow: bool,
    timers: Timers,
) -> (Arc<LinkDriver>, Arc<FairQueue>) {
    let tx = FairQueue::new();
    let link = Arc::new(LinkDriver::new(
        &cluster.name,
        agent_id,
        ids,
        flow,
        timers,
        tx.clone(),
    ));
    seedlink_net::sync::lock(&cluster.agents, "cluster agents").push(link.clone());
    *seedlink_net::sync::lock(&cluster.agents_changed, "cluster agents changed") =
        Some(std::time::SystemTime::now());
    cluster.joined.notify_waiters();
    (link, tx)
}

/// Removes an ended agent stream and fails everything that depended on it.
pub fn detach(cluster: &Cluster, link: &Arc<LinkDriver>) {
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

/// Checks every agent of a re-keyed cluster against its new trust: one
/// whose certificate the new CA refuses is disconnected at once (counted);
/// a token is checked again in the background (a TokenReview may take a
/// moment) and its agent disconnected if refused. Returns how many were
/// disconnected at once.
pub(super) fn rekey(cluster: &Arc<Cluster>) -> usize {
    let conf = cluster.conf.load_full();
    let mut kicked = 0;
    for link in cluster.agents() {
        let certs = link.certs.get().map(Vec::as_slice).unwrap_or(&[]);
        if !certs.is_empty() {
            let ok = conf
                .verifier
                .as_ref()
                .is_some_and(|v| tls::accepts(v.as_ref(), certs));
            if !ok {
                link.kick.cancel();
                kicked += 1;
                continue;
            }
        }
        // A certificate agent's token only if the cluster still checks
        // tokens; a token-only agent must still have a cluster that accepts
        // tokens.
        let Some(auth) = link.authorization.get().cloned() else {
            continue;
        };
        let token = conf.token.clone();
        if token.is_none() && !certs.is_empty() {
            continue;
        }
        tokio::spawn(recheck_token(cluster.name.clone(), link, token, auth));
    }
    kicked
}

/// Checks an agent's token again after its cluster was re-keyed: a
/// refused one ends its stream (counted `rekeyed`), as does any token when
/// the cluster no longer accepts tokens; an API server not reachable now
/// keeps the agent.
async fn recheck_token(
    cluster: Arc<str>,
    link: Arc<LinkDriver>,
    token: Option<Arc<TokenValidator>>,
    auth: String,
) {
    let refused = match token {
        Some(t) => match t.check(&auth).await {
            Ok(()) | Err(crate::auth::token::TokenError::Unavailable(_)) => false,
            Err(_) => true,
        },
        None => true,
    };
    if refused {
        tracing::info!(cluster = %cluster, agent = %link.agent_id, "agent's token refused after re-key");
        link.kick.cancel();
    }
}

/// A cluster's limits (0 = unlimited).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Tunneled connections open or being dialled at once.
    pub max_connections: usize,
    /// New dials per second, sustained.
    pub dial_rate: f64,
    /// Dials allowed in a burst above the rate.
    pub dial_burst: f64,
    /// Agent streams at once.
    pub max_agents: usize,
    /// Bytes queued towards frontends across the cluster's connections.
    pub max_queued_bytes: usize,
}

impl From<crate::config::ClusterLimits> for Limits {
    fn from(c: crate::config::ClusterLimits) -> Limits {
        Limits {
            max_connections: c.max_connections,
            dial_rate: c.dial_rate,
            dial_burst: c.dial_burst,
            max_agents: c.max_agents,
            max_queued_bytes: c.max_queued_bytes,
        }
    }
}

impl Limits {
    /// No limit at all.
    pub const UNLIMITED: Limits = Limits {
        max_connections: 0,
        dial_rate: 0.0,
        dial_burst: 0.0,
        max_agents: 0,
        max_queued_bytes: 0,
    };
}

struct Bucket {
    limits: Limits,
    tokens: f64,
    last: Instant,
}

/// The state behind one cluster's limits.
pub struct Gate {
    conns: Arc<AtomicUsize>,
    bucket: Mutex<Bucket>,
    /// Bytes queued across the cluster's connections, and the cap.
    queued: crate::stream::flow::Budget,
}

/// One admitted connection; dropping it frees its slot.
pub struct ConnPermit(Arc<AtomicUsize>);

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// A gate with full burst.
    pub fn new(limits: Limits) -> Gate {
        Gate {
            conns: Arc::new(AtomicUsize::new(0)),
            queued: crate::stream::flow::Budget::new(limits.max_queued_bytes),
            bucket: Mutex::new(Bucket {
                limits,
                tokens: limits.dial_burst.max(1.0),
                last: crate::stream::clock::now(),
            }),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        seedlink_net::sync::lock(&self.bucket, "dial bucket").limits
    }

    /// Replaces the limits (configuration reload); open connections stay.
    pub fn set(&self, limits: Limits) {
        let mut b = seedlink_net::sync::lock(&self.bucket, "dial bucket");
        b.tokens = b.tokens.min(limits.dial_burst.max(1.0));
        b.limits = limits;
        self.queued.set_limit(limits.max_queued_bytes);
    }

    /// The budget every connection's queue of this cluster shares.
    pub fn queue_budget(&self) -> crate::stream::flow::Budget {
        self.queued.clone()
    }

    /// Tunneled connections holding a permit.
    pub fn connections(&self) -> usize {
        self.conns.load(Ordering::Acquire)
    }

    /// Admits one new dial at `now`, or says which limit refuses it.
    pub fn admit(&self, now: Instant) -> Result<ConnPermit, Limited> {
        let mut b = seedlink_net::sync::lock(&self.bucket, "dial bucket");
        let l = b.limits;
        if l.max_connections > 0 && self.conns.load(Ordering::Acquire) >= l.max_connections {
            return Err(Limited::Connections);
        }
        if l.dial_rate > 0.0 {
            let burst = l.dial_burst.max(1.0);
            let dt = now.saturating_duration_since(b.last).as_secs_f64();
            b.tokens = (b.tokens + dt * l.dial_rate).min(burst);
            b.last = now;
            if b.tokens < 1.0 {
                return Err(Limited::DialRate);
            }
            b.tokens -= 1.0;
        }
        self.conns.fetch_add(1, Ordering::AcqRel);
        Ok(ConnPermit(self.conns.clone()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    use std::time::Duration;

    use crate::wire::proto::Packet;

    use crate::server::testing::{cluster, LIVE, TIMERS};
    use crate::server::*;

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

    #[test]
    fn an_agents_second_stream_takes_the_dials_once_its_first_drains() {
        let c = cluster(&[Strategy::Default]);
        let (old, _) = attach(&c, "agent".into(), Identifiers::default(), false, TIMERS);
        let (new, _) = attach(&c, "agent".into(), Identifiers::default(), false, TIMERS);
        // A second stream of the same agent (replica discovery): dials use
        // the first.
        for _ in 0..20 {
            assert!(Arc::ptr_eq(&c.pick("h", LIVE).unwrap(), &old));
        }
        // Its agent drains the first (a new certificate): the second
        // takes every dial; the first is used again only if it is alone.
        old.on_agent_packet(Packet::drain());
        for _ in 0..20 {
            assert!(Arc::ptr_eq(&c.pick("h", LIVE).unwrap(), &new));
        }
        detach(&c, &new);
        assert!(Arc::ptr_eq(&c.pick("h", LIVE).unwrap(), &old));
    }

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

    fn limits(conns: usize, rate: f64, burst: f64) -> Limits {
        Limits {
            max_connections: conns,
            dial_rate: rate,
            dial_burst: burst,
            max_agents: 0,
            max_queued_bytes: 0,
        }
    }

    #[test]
    fn connections_are_capped_and_freed() {
        let g = Gate::new(limits(2, 0.0, 0.0));
        let t = Instant::now();
        let a = g.admit(t).ok();
        let b = g.admit(t).ok();
        assert!(a.is_some() && b.is_some());
        assert_eq!(g.admit(t).err(), Some(Limited::Connections));
        drop(a);
        assert!(g.admit(t).is_ok());
        assert_eq!(g.connections(), 1);
    }

    #[test]
    fn dial_rate_is_a_token_bucket() {
        let g = Gate::new(limits(0, 10.0, 5.0));
        let t = Instant::now();
        let mut held = Vec::new();
        for _ in 0..5 {
            held.push(g.admit(t).ok());
        }
        assert!(held.iter().all(Option::is_some));
        assert_eq!(g.admit(t).err(), Some(Limited::DialRate));
        // 100 ms later one token came back (10/s); not two.
        let t2 = t + Duration::from_millis(100);
        assert!(g.admit(t2).is_ok());
        assert_eq!(g.admit(t2).err(), Some(Limited::DialRate));
        // A long pause refills only up to the burst.
        let t3 = t2 + Duration::from_secs(60);
        for _ in 0..5 {
            assert!(g.admit(t3).is_ok());
        }
        assert_eq!(g.admit(t3).err(), Some(Limited::DialRate));
        // Lowered by a reload: takes effect at once.
        g.set(limits(0, 1.0, 1.0));
        let t4 = t3 + Duration::from_secs(10);
        assert!(g.admit(t4).is_ok());
        assert_eq!(g.admit(t4).err(), Some(Limited::DialRate));
    }

    #[test]
    fn the_default_dial_rate_is_never_the_bottleneck() {
        // Ten seconds at twice the highest dial rate measured through one
        // cluster: the default limits refuse nothing.
        let g = Gate::new(crate::config::ClusterLimits::default().into());
        let t = Instant::now();
        let rate = 2.0 * crate::config::MEASURED_DIALS_PER_SEC;
        for i in 0..(rate as u64 * 10) {
            let at = t + Duration::from_secs_f64(i as f64 / rate);
            assert!(g.admit(at).is_ok(), "dial {i} refused by the defaults");
        }
    }
}
