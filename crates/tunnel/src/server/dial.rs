//! One dial through a cluster's agents, under one deadline: pick a link,
//! register the dial on it, await the agent's answer; the ends of the
//! tunnel it opens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::cluster::Cluster;
use super::cluster::ConnPermit;
use super::link_driver::{ConnEnds, LinkDriver};
use crate::stream::clock::now as clock_now;
use crate::stream::deadline::later;
use crate::stream::flow::{self, QueueRx, SendCredit, Unacked};
use crate::wire::dial_error::DialError;
use crate::wire::proto::Packet;

/// Settings every dial uses.
#[derive(Debug, Clone, Copy)]
pub struct DialSettings {
    /// Deadline for the agent's answer.
    pub timeout: Duration,
    /// Per-connection queue budget.
    pub queue_bytes: usize,
    /// Silence after which an agent is skipped (see [`activity`]).
    pub unresponsive_after: Duration,
    /// How long a dial finding no agent waits for one to join (within
    /// `timeout`).
    pub agent_wait: Duration,
}

/// One of a cluster's [`super::cluster::MAX_WAITING`] places for a dial
/// waiting for an agent, given back when dropped (also when the dial's
/// future is dropped mid-wait).
struct WaitSlot<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> WaitSlot<'a> {
    fn take(waiting: &'a std::sync::atomic::AtomicUsize) -> Option<WaitSlot<'a>> {
        let order = std::sync::atomic::Ordering::AcqRel;
        if waiting.fetch_add(1, order) >= super::cluster::MAX_WAITING {
            waiting.fetch_sub(1, order);
            return None;
        }
        Some(WaitSlot(waiting))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
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
    pub link: Arc<LinkDriver>,
    /// The agent's connection ID.
    pub connect_id: i64,
    /// Window towards the agent (flow control negotiated).
    pub credit: Option<SendCredit>,
    /// The cluster's connection slot, freed with the connection.
    pub(super) _permit: ConnPermit,
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
    let permit = cluster.gate.admit(clock_now()).map_err(|l| {
        cluster.metrics.dial_failure(l.reason());
        DialError::Limited(l)
    })?;
    let started = clock_now();
    let attempt = Attempt {
        cluster,
        address,
        settings: &settings,
        deadline: later(started, settings.timeout),
        cancel,
    };
    match attempt.with_retries().await {
        Ok(open) => {
            cluster.metrics.dial_ok(open.asked.elapsed());
            Ok(open.tunnel(permit))
        }
        Err(e) => {
            cluster.metrics.dial_failure(e.reason());
            Err(e)
        }
    }
}

/// One dial through the cluster's agents, under one deadline.
pub(super) struct Attempt<'a> {
    pub(super) cluster: &'a Cluster,
    pub(super) address: &'a str,
    pub(super) settings: &'a DialSettings,
    pub(super) deadline: Instant,
    pub(super) cancel: &'a CancellationToken,
}

/// A dial the agent accepted: the connection's link, ID and ends.
pub(super) struct Opened {
    /// When the first DIAL_REQ of the dial went out (after any wait for an
    /// agent): what `dial_duration_seconds` measures from.
    pub(super) asked: Instant,
    pub(super) link: Arc<LinkDriver>,
    pub(super) connect_id: i64,
    pub(super) credit: Option<SendCredit>,
    pub(super) rx: QueueRx,
}

impl Opened {
    pub(super) fn tunnel(self, permit: ConnPermit) -> Tunnel {
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
    pub(super) async fn with_retries(&self) -> Result<Opened, DialError> {
        let mut attempts = 0;
        let mut asked = None;
        loop {
            attempts += 1;
            let link = self.pick_or_wait().await?;
            let first = *asked.get_or_insert_with(Instant::now);
            match self
                .through(&link)
                .await
                .map(|o| Opened { asked: first, ..o })
            {
                Err(DialError::Unresponsive(_)) if attempts < 3 && clock_now() < self.deadline => {
                    tracing::info!(cluster = %self.cluster.name, agent = %link.agent_id, "agent went silent during a dial; trying another");
                }
                r => return r,
            }
        }
    }

    /// [`Attempt::pick`]; when the cluster has no agent that fits, waits
    /// for one to join, up to `agent_wait` and within the deadline (a
    /// replica that was just added or is replacing one gets dials before
    /// every agent has found it). Still none: `NoAgent`.
    pub(super) async fn pick_or_wait(&self) -> Result<Arc<LinkDriver>, DialError> {
        match self.pick() {
            Err(DialError::NoAgent) if !self.settings.agent_wait.is_zero() => {}
            r => return r,
        }
        let Some(_slot) = WaitSlot::take(&self.cluster.waiting) else {
            return Err(DialError::NoAgent);
        };
        self.wait_for_agent().await
    }

    /// The wait of [`Attempt::pick_or_wait`].
    async fn wait_for_agent(&self) -> Result<Arc<LinkDriver>, DialError> {
        let until = tokio::time::Instant::now() + self.settings.agent_wait;
        let until = until.min(tokio::time::Instant::from_std(self.deadline));
        loop {
            // Registered before the check, so a join between the check and
            // the wait is not missed.
            let joined = self.cluster.joined.notified();
            tokio::pin!(joined);
            joined.as_mut().enable();
            match self.pick() {
                Err(DialError::NoAgent) => {}
                r => return r,
            }
            tokio::select! {
                () = joined => {}
                () = tokio::time::sleep_until(until) => return Err(DialError::NoAgent),
                () = self.cancel.cancelled() => return Err(DialError::Cancelled),
                () = self.cluster.removed.cancelled() => return Err(DialError::NoAgent),
            }
        }
    }

    pub(super) fn pick(&self) -> Result<Arc<LinkDriver>, DialError> {
        let address = self.address;
        let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
        self.cluster.pick(host, self.settings.unresponsive_after)
    }

    /// A new connection's ends and its frontend's queue; `flow`: with flow
    /// control, whose agent never has more than a window in flight.
    pub(super) fn ends(&self, flow: bool) -> (ConnEnds, QueueRx) {
        let budget = if flow {
            2 * flow::WINDOW
        } else {
            self.settings.queue_bytes
        };
        let shared = Some(self.cluster.gate.queue_budget());
        let (queue, rx) = flow::queue_within(budget, shared);
        let credit = flow.then(SendCredit::new);
        (ConnEnds { queue, credit }, rx)
    }

    /// Registers the dial on `link` and waits for the answer; a dial still
    /// pending when the wait ends (cancel) is forgotten and the agent told
    /// (a timeout or silence did so already).
    pub(super) async fn through(&self, link: &Arc<LinkDriver>) -> Result<Opened, DialError> {
        let random = dial_id();
        let (reply_tx, reply_rx) = oneshot::channel();
        let (ends, rx) = self.ends(link.flow);
        let credit = ends.credit.clone();
        let now = clock_now();
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
            link.with(clock_now(), |m, out| m.dial_abandoned(random, out));
        }
        Ok(Opened {
            asked: clock_now(),
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
pub(super) async fn await_answer(
    link: &LinkDriver,
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
pub(super) const ANSWER_BACKSTOP: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use crate::wire::proto::Packet;

    use crate::server::testing::{cluster, LIVE, TIMERS};
    use crate::server::*;

    /// The driver half of the timers: a dial registered while the timer
    /// loop sleeps with nothing due wakes it, and the machine answers the
    /// dial with the timeout (the agent gets DIAL_REQ, then DIAL_CLS), at
    /// its deadline on the paused clock.
    #[tokio::test(start_paused = true)]
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
            timeout: Duration::from_secs(10),
            queue_bytes: 1 << 16,
            unresponsive_after: LIVE,
            agent_wait: Duration::ZERO,
        };
        let t0 = tokio::time::Instant::now();
        let r = dial(&c, "h:1", settings, &CancellationToken::new()).await;
        assert_eq!(r.err(), Some(DialError::Timeout));
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_secs(10) && waited < Duration::from_secs(11),
            "{waited:?}"
        );
        let kinds: Vec<_> = std::iter::from_fn(|| to_agent.try_next())
            .map(|p| p.kind())
            .collect();
        use crate::wire::proto::PacketType as T;
        assert_eq!(kinds, [Some(T::DialReq), Some(T::DialCls)]);
        assert_eq!(link.conn_count(), 0);
        timers.abort();
    }

    fn waiting(agent_wait: Duration) -> DialSettings {
        DialSettings {
            timeout: Duration::from_secs(10),
            queue_bytes: 1 << 16,
            unresponsive_after: LIVE,
            agent_wait,
        }
    }

    /// A dial that finds no agent waits for one to join, and the agent
    /// that joins gets it: the moment a replica is replaced, before the
    /// agents have found it.
    #[tokio::test(start_paused = true)]
    async fn a_dial_with_no_agent_waits_for_one_to_join() {
        let c = std::sync::Arc::new(cluster(&[Strategy::Default]));
        let dialing = {
            let c = c.clone();
            tokio::spawn(async move {
                let cancel = CancellationToken::new();
                dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel)
                    .await
                    .map(|t| t.tx.link.agent_id.clone())
            })
        };
        // The dial is waiting (paused time does not advance while it can).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!dialing.is_finished());
        let (link, to_agent) = attach(&c, "late".into(), Identifiers::default(), false, TIMERS);
        let req = loop {
            if let Some(p) = to_agent.try_next() {
                break p;
            }
            tokio::task::yield_now().await;
        };
        use crate::wire::proto::PacketType as T;
        assert_eq!(req.kind(), Some(T::DialReq));
        let Some(crate::wire::proto::Payload::DialRequest(d)) = req.payload else {
            panic!("not a dial request: {req:?}");
        };
        link.on_agent_packet(Packet::dial_rsp(d.random, 7, String::new()));
        assert_eq!(
            dialing.await.ok().and_then(Result::ok).as_deref(),
            Some("late")
        );
    }

    /// No agent joins: `no_agent` once the wait is over (not a timeout),
    /// and at once with no wait; a cancelled caller ends the wait.
    #[tokio::test(start_paused = true)]
    async fn a_dial_with_no_agent_fails_after_its_wait() {
        let c = cluster(&[Strategy::Default]);
        let cancel = CancellationToken::new();
        let t0 = tokio::time::Instant::now();
        let r = dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel).await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(4));
        let t0 = tokio::time::Instant::now();
        let r = dial(&c, "h:1", waiting(Duration::ZERO), &cancel).await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
        assert_eq!(t0.elapsed(), Duration::ZERO);
        cancel.cancel();
        let r = dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel).await;
        assert_eq!(r.err(), Some(DialError::Cancelled));
        // An agent that joins but does not fit the strategy leaves the
        // dial waiting out its time.
        let only_a = cluster(&[Strategy::DestHost]);
        let c = std::sync::Arc::new(only_a);
        let (_other, _) = attach(&c, "b".into(), Identifiers::default(), false, TIMERS);
        let r = dial(
            &c,
            "h:1",
            waiting(Duration::from_secs(3)),
            &CancellationToken::new(),
        )
        .await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
    }

    /// At most `MAX_WAITING` dials of a cluster wait for an agent; one more
    /// is answered `no_agent` at once, and a waiting dial whose caller
    /// goes away gives its place back.
    #[tokio::test(start_paused = true)]
    async fn waiting_dials_are_bounded_per_cluster() {
        use std::sync::atomic::Ordering;
        let c = std::sync::Arc::new(cluster(&[Strategy::Default]));
        let mut parked = Vec::new();
        for _ in 0..cluster::MAX_WAITING {
            let c = c.clone();
            parked.push(tokio::spawn(async move {
                let cancel = CancellationToken::new();
                dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel)
                    .await
                    .err()
            }));
        }
        while c.waiting.load(Ordering::Acquire) < cluster::MAX_WAITING {
            tokio::task::yield_now().await;
        }
        let t0 = tokio::time::Instant::now();
        let r = dial(
            &c,
            "h:1",
            waiting(Duration::from_secs(3)),
            &CancellationToken::new(),
        )
        .await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
        assert_eq!(t0.elapsed(), Duration::ZERO);
        let gone = parked.pop().unwrap();
        gone.abort();
        let _ = gone.await;
        assert_eq!(c.waiting.load(Ordering::Acquire), cluster::MAX_WAITING - 1);
        for p in parked {
            assert_eq!(p.await.unwrap(), Some(DialError::NoAgent));
        }
        assert_eq!(c.waiting.load(Ordering::Acquire), 0);
    }
}
