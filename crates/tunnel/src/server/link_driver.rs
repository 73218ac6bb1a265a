//! One agent stream's driver: the sans-IO [`LinkMachine`] behind one lock,
//! and the IO it drives (the fair queue towards the agent, the frontends'
//! queues); the wait of a connection whose bytes do not fit; and what the
//! agent behind the stream says about itself ([`Identifiers`]), with the
//! strategies that pick a stream for a destination by it.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use ipnet::IpNet;
use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;

use super::activity;
use super::link::{Action, Actions, Handled, LinkMachine};
use crate::stream::clock::now as clock_now;
use crate::stream::deadline::earliest;
use crate::stream::flow::{self, FairQueue, QueueTx, SendCredit};
use crate::wire::dial_error::DialError;
use crate::wire::proto::Packet;

/// A connection's ends the link machine keeps: the queue towards its
/// frontend and, with flow control, its sending window.
pub struct ConnEnds {
    pub(super) queue: QueueTx,
    pub(super) credit: Option<SendCredit>,
}

impl ConnEnds {
    pub(super) fn end(self) {
        if let Some(c) = &self.credit {
            c.close();
        }
    }

    pub(super) fn abort(self) {
        if let Some(c) = &self.credit {
            c.close();
        }
        self.queue.abort();
    }
}

/// How a pending dial is answered.
pub(super) type Reply = oneshot::Sender<Result<i64, DialError>>;

/// The machine and its reusable action buffer, behind the link's one lock.
pub(super) struct Locked {
    pub(super) machine: LinkMachine<ConnEnds, Reply>,
    pub(super) out: Actions<ConnEnds, Reply>,
}

/// One agent stream: the sans-IO [`LinkMachine`] behind one lock, and the IO
/// it drives (the fair queue towards the agent, the frontends' queues).
pub struct LinkDriver {
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
    pub(super) to_agent: Arc<FairQueue>,
    pub(super) state: Mutex<Locked>,
    /// Told when the machine's next timer moved earlier (the receive loop
    /// sleeps until it).
    pub(super) timer: Notify,
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
pub(super) struct Applied {
    pub(super) blocked: Option<Blocked>,
    pub(super) violation: bool,
}

impl LinkDriver {
    /// A new link of `cluster` for `agent_id`, sending through `to_agent`.
    pub fn new(
        cluster: &Arc<str>,
        agent_id: String,
        ids: Identifiers,
        flow: bool,
        timers: super::link::Timers,
        to_agent: Arc<FairQueue>,
    ) -> LinkDriver {
        LinkDriver {
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            agent_id,
            cluster: cluster.clone(),
            ids,
            since: std::time::SystemTime::now(),
            to_agent,
            state: Mutex::new(Locked {
                machine: LinkMachine::new(flow, timers),
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
        }
    }

    /// Runs `f` on the machine under the lock, then carries out what it
    /// asked for. Nothing here waits: queue pushes and sends never block.
    /// A timer that moved earlier wakes the receive loop's sleep.
    pub(super) fn with<T>(
        &self,
        now: Instant,
        f: impl FnOnce(&mut LinkMachine<ConnEnds, Reply>, &mut Actions<ConnEnds, Reply>) -> T,
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
    pub(super) fn heard_at(&self, now: Instant) -> Option<Instant> {
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
        let now = clock_now();
        let heard = self.heard_at(now);
        self.with(now, |m, out| {
            if let Some(h) = heard {
                m.heard(h);
            }
            m.handle_timeout(now, out)
        })
        .0
    }

    pub(super) fn apply(
        &self,
        now: Instant,
        machine: &mut LinkMachine<ConnEnds, Reply>,
        out: &mut Actions<ConnEnds, Reply>,
    ) -> Applied {
        let mut applied = Applied::default();
        while let Some(a) = out.pop_front() {
            match a {
                Action::Send(p) => self.send_soon(p),
                Action::Finish(id, last) => self.finish(id, last),
                Action::Deliver(id, data) => match deliver(machine, id, data) {
                    Delivered::Queued => {}
                    Delivered::Blocked(b) => {
                        machine.blocked(now, id);
                        applied.blocked = Some(b);
                    }
                    Delivered::Overrun => {
                        machine.window_violated(now, id, out);
                        applied.violation = true;
                    }
                },
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

    /// Tells the agent the replicas now (`packet`: REPLICAS), if it asked
    /// to be told.
    pub fn replicas_notice(&self, packet: &Packet) {
        if self.replica_updates.load(Ordering::Acquire) {
            self.send_soon(packet.clone());
        }
    }

    /// Ends connection `id`'s lane after its queued data, then `last`.
    pub(super) fn finish(&self, id: i64, last: Option<Packet>) {
        self.to_agent.finish(id, last);
        if self.to_agent.overflowed() {
            // The receive loop ends the stream (control_overflow).
            self.kick.cancel();
        }
    }

    /// Queues a control packet; never waits.
    pub(super) fn send_soon(&self, p: Packet) {
        if self.to_agent.control(p).is_err() && self.to_agent.overflowed() {
            self.kick.cancel();
        }
    }

    /// Forgets connection `id` (frontend side closed it) and tells the agent
    /// after the data already queued for it.
    pub fn close_conn(&self, id: i64) {
        let now = clock_now();
        self.with(now, |m, out| m.close(now, id, out));
    }

    /// Applies one packet from the agent. Never waits: DATA that does not
    /// fit its connection's queue comes back as [`Blocked`] for the caller
    /// to await.
    pub fn on_agent_packet(&self, p: Packet) -> (Handled, Option<Blocked>) {
        let now = clock_now();
        let (h, applied) = self.with(now, |m, out| m.on_packet(now, p, out));
        match (applied.blocked, applied.violation) {
            (Some(b), _) => (Handled::Full, Some(b)),
            (None, true) => (Handled::Unexpected, None),
            (None, false) => (h, None),
        }
    }

    /// The stream ended: fail every pending dial at once and abort every
    /// established connection.
    pub(super) fn fail_all(&self) {
        self.gone.cancel();
        self.with(clock_now(), |m, out| m.end(out));
        self.to_agent.close();
    }
}

/// Gives connection `id`'s sender `n` bytes more window; `false` when
/// that is more than it used (a connection without a window takes any).
pub(super) fn reopen(machine: &LinkMachine<ConnEnds, Reply>, id: i64, n: i64) -> bool {
    machine
        .conn(id)
        .and_then(|c| c.credit.as_ref())
        .is_none_or(|c| c.give(n))
}

/// What became of DATA for a connection.
pub(super) enum Delivered {
    /// Queued for the frontend (or dropped: the connection is gone, and
    /// its own close tells the agent).
    Queued,
    /// It does not fit for now: the receive loop waits for room.
    Blocked(Blocked),
    /// More than the connection's window (flow control agreed): the agent
    /// broke the protocol, and that connection is closed rather than the
    /// whole stream held for it.
    Overrun,
}

/// Queues DATA for connection `id`'s frontend; what does not fit comes
/// back to wait for room. A reader that left closes through its frontend.
pub(super) fn deliver(machine: &LinkMachine<ConnEnds, Reply>, id: i64, data: Bytes) -> Delivered {
    let Some(c) = machine.conn(id) else {
        return Delivered::Queued;
    };
    // With flow control, an agent has at most a window unacknowledged and
    // credit goes back only once bytes left the queue: beyond the queue's
    // own limit (two windows) it sent what it had no credit for. Only a
    // full *shared* budget is a reason to wait.
    if c.credit.is_some() && c.queue.over_own_limit(data.len()) {
        return Delivered::Overrun;
    }
    match c.queue.push(data) {
        Ok(()) | Err(flow::PushError::Closed) => Delivered::Queued,
        Err(flow::PushError::Full(data)) => Delivered::Blocked(Blocked {
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
    pub(super) connect_id: i64,
    pub(super) data: Bytes,
    pub(super) room: flow::Room,
}

impl Blocked {
    /// Waits for room while the reader makes progress, then queues the
    /// bytes; a reader that takes nothing for the stall deadline loses its
    /// connection (CLOSE_REQ to the agent), nothing else does. The deadline
    /// is the link machine's: every progress restarts it, and the link's
    /// timers go on firing meanwhile.
    pub async fn resume(mut self, link: &LinkDriver) -> Handled {
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
            let now = clock_now();
            match step {
                flow::Step::Room => match self.push(link) {
                    Some(data) => self.data = data,
                    None => break,
                },
                flow::Step::Progress => {}
                // The frontend went away: its own close tells the agent.
                flow::Step::Closed => break,
            }
            link.with(now, |m, _| m.progress(now));
        }
        link.with(clock_now(), |m, _| m.unblocked());
        Handled::Ok
    }

    /// Queues the bytes if they fit; hands them back if not. Only this
    /// receive loop pushes into this queue, but another agent stream of the
    /// cluster may take the shared budget first: then it waits again, never
    /// drops. A connection closed meanwhile drops them (its own close tells
    /// the agent).
    pub(super) fn push(&mut self, link: &LinkDriver) -> Option<Bytes> {
        let g = seedlink_net::sync::lock(&link.state, "agent link");
        let c = g.machine.conn(self.connect_id)?;
        match c.queue.push(std::mem::take(&mut self.data)) {
            Ok(()) | Err(flow::PushError::Closed) => None,
            Err(flow::PushError::Full(data)) => Some(data),
        }
    }
}

pub(super) static NEXT_UID: AtomicU64 = AtomicU64::new(1);

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

    pub(super) fn matches(self, ids: &Identifiers, host: &str) -> bool {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use tokio::sync::oneshot;

    use crate::server::link::Timers;
    use crate::server::testing::{cluster, LIVE, TIMERS};
    use crate::server::*;
    use crate::stream::flow;
    use crate::wire::proto::Packet;

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
        let (qtx, _reader) = flow::queue(4);
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

    /// Four bytes of DATA.
    fn four() -> Packet {
        Packet::data(1, Bytes::from_static(b"1234"))
    }

    /// A link (with or without flow control) whose connection 1 has a
    /// 4-byte queue nobody reads, already holding four bytes; and what
    /// must stay alive meanwhile (the queue's reader, the dialer).
    fn with_four_queued(
        c: &Cluster,
        flow: bool,
        timers: Timers,
    ) -> (std::sync::Arc<LinkDriver>, impl Sized) {
        let (link, to_agent) = attach(c, "a".into(), Identifiers::default(), flow, timers);
        let (qtx, reader) = flow::queue(4);
        let ends = ConnEnds {
            queue: qtx,
            credit: flow.then(crate::stream::flow::SendCredit::new),
        };
        let (reply, answer) = oneshot::channel();
        let now = Instant::now();
        link.with(now, |m, out| {
            m.dial(7, "h:1", now + LIVE, reply, ends, out);
        });
        link.on_agent_packet(Packet::dial_rsp(7, 1, String::new()));
        assert!(link.on_agent_packet(four()).1.is_none());
        (link, (to_agent, reader, answer))
    }

    /// A reader that takes nothing: the wait for room ends at the
    /// machine's stall deadline, with that connection reset (paused clock:
    /// thirty virtual seconds, exactly).
    #[tokio::test(start_paused = true)]
    async fn a_wait_for_room_ends_at_the_stall_deadline() {
        let c = cluster(&[Strategy::Default]);
        let timers = Timers {
            stall: Duration::from_secs(30),
            ..TIMERS
        };
        let (link, _keep) = with_four_queued(&c, false, timers);
        let (h, blocked) = link.on_agent_packet(four());
        assert_eq!(h, Handled::Full);
        let Some(b) = blocked else {
            panic!("the second chunk does not fit")
        };
        let t0 = tokio::time::Instant::now();
        assert_eq!(b.resume(&link).await, Handled::Stalled);
        // Virtual time: the wait ends at the stall deadline, not before.
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_secs(30) && waited < Duration::from_secs(31),
            "{waited:?}"
        );
        assert_eq!(link.conn_count(), 0);
    }

    /// With flow control agreed, DATA beyond the connection's own limit is
    /// more than the agent had credit for: that connection is closed at
    /// once, and the stream is not held waiting for room.
    #[tokio::test]
    async fn an_overrun_window_closes_its_connection_and_holds_nothing() {
        let c = cluster(&[Strategy::Default]);
        let (link, _keep) = with_four_queued(&c, true, TIMERS);
        let (h, blocked) = link.on_agent_packet(four());
        assert_eq!(h, Handled::Unexpected);
        assert!(blocked.is_none(), "nothing to wait for");
        assert_eq!(link.conn_count(), 0);
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
}
