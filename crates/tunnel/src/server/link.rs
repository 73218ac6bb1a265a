//! One agent stream as the tunnel-server sees it, as a state machine with no
//! IO: which dials wait for the agent's answer, which connections are open,
//! which this side closed and still expects a CLOSE_RSP for, and whether the
//! agent announced DRAIN. Every input is a method; everything the peers
//! should observe comes out as an [`Action`] for the driver
//! (`server::link_driver::LinkDriver`) to carry out. No locks, channels, sockets or clock
//! are inside: a method that needs the time takes `now`, so tests and the
//! fuzzer (`server::harness`) drive it deterministically.
//!
//! The machine owns its timers, as quinn-proto's connection does: it records
//! each deadline (a dial's, the stall deadline of a connection waiting for
//! room, when the agent would count as silent, when closed IDs may be
//! forgotten), [`LinkMachine::poll_timeout`] says when it next wants to be
//! called, and [`LinkMachine::handle_timeout`] decides what expired and emits
//! the actions. The driver only sleeps until that instant.
//!
//! The machine is generic over what it stores: `C`, one connection's ends
//! (in the server: its queue towards the frontend and its sending window),
//! and `R`, the reply handle of a pending dial. It never calls either; it
//! only hands them back in actions.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::stream::deadline::later;
use crate::wire::dial_error::DialError;
use crate::wire::proto::{Packet, PacketType as T, Payload};

/// How long a connection this side closed is remembered waiting for the
/// agent's CLOSE_RSP (agents that never answer): late packets for it are
/// expected within this time, unrecognized after it.
pub const CLOSING_TTL: Duration = Duration::from_secs(60);
/// How long after the oldest closed ID expires the machine asks to forget
/// the expired ones: one wake-up sweeps every ID that expired within it, so
/// a stream closing many connections is not woken for each.
pub const CLOSING_SWEEP: Duration = Duration::from_secs(1);
/// How long after an agent would pass its silence limit a dial waiting for
/// it looks again (the old per-dial wake-up's slack).
pub const SILENCE_SLACK: Duration = Duration::from_millis(50);

/// The durations the machine's timers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    /// A connection whose reader takes nothing for this long while its
    /// bytes wait for room is reset.
    pub stall: Duration,
    /// An agent heard from no longer than this ago is responsive; past it,
    /// the dials waiting for it fail ([`DialError::Unresponsive`]).
    pub unresponsive_after: Duration,
}

/// What the link did with one packet from the agent (for counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// As expected.
    Ok,
    /// Referred to a dial or connection this agent does not have.
    Unrecognized,
    /// A connection's queue was full: the packet waits for room; the stream
    /// reads nothing else meanwhile.
    Full,
    /// A connection whose reader took nothing for the stall deadline while
    /// its packet waited: that connection was closed.
    Stalled,
    /// A packet kind an agent must not send, an unknown kind, or a protocol
    /// violation (a reused connection ID, more window than was used).
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

/// What the driver must do, in order.
#[derive(Debug)]
pub enum Action<C, R> {
    /// Send this control packet to the agent now (ahead of queued data).
    Send(Packet),
    /// End connection `id`'s data lane towards the agent after the data
    /// already queued for it, then send the packet if any.
    Finish(i64, Option<Packet>),
    /// Queue these bytes for connection `id`'s frontend (its ends are
    /// [`LinkMachine::conn`]). Bytes that do not fit are reported back with
    /// [`LinkMachine::blocked`].
    Deliver(i64, Bytes),
    /// The agent reopened `n` bytes of connection `id`'s sending window. A
    /// window that grows beyond its size is a violation the driver reports
    /// back with [`LinkMachine::window_violated`].
    Reopen(i64, i64),
    /// Answer a dial. With `Ok(id)` the connection is open; if the dialer is
    /// gone by now, the driver closes it with [`LinkMachine::close`].
    Answer(R, Result<i64, DialError>),
    /// The connection ended normally: its frontend gets what is queued,
    /// then the end.
    End(C),
    /// The connection ended abnormally: its frontend is reset.
    Abort(C),
}

/// A queue of actions; the driver keeps one and drains it after each call.
pub type Actions<C, R> = VecDeque<Action<C, R>>;

/// A dial waiting for the agent's answer.
#[derive(Debug)]
struct Dial<C, R> {
    reply: R,
    ends: C,
    deadline: Instant,
}

/// The server's state of one agent stream.
#[derive(Debug)]
pub struct LinkMachine<C, R> {
    flow: bool,
    draining: bool,
    ended: bool,
    timers: Timers,
    pending: HashMap<i64, Dial<C, R>>,
    /// The pending dials by deadline, earliest first.
    deadlines: BTreeSet<(Instant, i64)>,
    conns: HashMap<i64, C>,
    /// Connections this side closed (CLOSE_REQ sent), until the agent's
    /// CLOSE_RSP: late DATA and the CLOSE_RSP for them are expected.
    closing: HashMap<i64, Instant>,
    /// The same entries by when they were closed, oldest first.
    closed_at: BTreeSet<(Instant, i64)>,
    /// The connection whose bytes wait for room, and its stall deadline.
    waiting: Option<(i64, Instant)>,
    /// When the agent was last heard from (unset: its silence is not
    /// tracked).
    heard: Option<Instant>,
}

impl<C, R> LinkMachine<C, R> {
    /// A new stream; `flow`: per-connection flow control was negotiated.
    pub fn new(flow: bool, timers: Timers) -> LinkMachine<C, R> {
        LinkMachine {
            flow,
            draining: false,
            ended: false,
            timers,
            pending: HashMap::new(),
            deadlines: BTreeSet::new(),
            conns: HashMap::new(),
            closing: HashMap::new(),
            closed_at: BTreeSet::new(),
            waiting: None,
            heard: None,
        }
    }

    /// Whether per-connection flow control was negotiated.
    pub fn flow(&self) -> bool {
        self.flow
    }

    /// Whether the agent announced DRAIN.
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// Whether the stream ended ([`LinkMachine::end`]).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Open connections plus pending dials (the load that picks an agent).
    pub fn load(&self) -> usize {
        self.conns.len() + self.pending.len()
    }

    /// Open connections.
    pub fn open(&self) -> impl Iterator<Item = i64> + '_ {
        self.conns.keys().copied()
    }

    /// Pending dials.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Connections closed by this side, awaiting the agent's CLOSE_RSP.
    pub fn closing(&self) -> usize {
        self.closing.len()
    }

    /// Whether `id` is closed by this side and awaiting its CLOSE_RSP.
    pub fn is_closing(&self, id: i64) -> bool {
        self.closing.contains_key(&id)
    }

    /// An open connection's ends.
    pub fn conn(&self, id: i64) -> Option<&C> {
        self.conns.get(&id)
    }

    /// The connection whose bytes wait for room, if any.
    pub fn waiting(&self) -> Option<i64> {
        self.waiting.map(|(id, _)| id)
    }

    /// A frontend dials `address` under the fresh dial ID `random`; `ends`
    /// become the connection's when the agent accepts. Unanswered at
    /// `deadline`, the dial fails with [`DialError::Timeout`].
    pub fn dial(
        &mut self,
        random: i64,
        address: &str,
        deadline: Instant,
        reply: R,
        ends: C,
        out: &mut Actions<C, R>,
    ) {
        if self.ended {
            out.push_back(Action::Answer(reply, Err(DialError::AgentGone)));
            return;
        }
        let dial = Dial {
            reply,
            ends,
            deadline,
        };
        if let Some(old) = self.pending.insert(random, dial) {
            // Dial IDs are random 63-bit numbers; a repeat is a bug upstream
            // of this machine, and the older dial must not hang.
            self.deadlines.remove(&(old.deadline, random));
            out.push_back(Action::Answer(
                old.reply,
                Err(DialError::Protocol("dial ID reused")),
            ));
        }
        self.deadlines.insert((deadline, random));
        out.push_back(Action::Send(Packet::dial_req(address, random)));
    }

    /// Takes pending dial `random` out of the tables.
    fn take_dial(&mut self, random: i64) -> Option<Dial<C, R>> {
        let d = self.pending.remove(&random)?;
        self.deadlines.remove(&(d.deadline, random));
        Some(d)
    }

    /// The dialer stopped waiting for `random` (cancel, its own end): the
    /// agent is told with DIAL_CLS if it had not answered yet.
    pub fn dial_abandoned(&mut self, random: i64, out: &mut Actions<C, R>) {
        if self.take_dial(random).is_some() && !self.ended {
            out.push_back(Action::Send(Packet::dial_cls(random)));
        }
    }

    /// The agent was last heard from at `at` (the driver's read stamp of its
    /// connection). Dials wait for an agent silent up to
    /// [`Timers::unresponsive_after`]; past it, they fail.
    pub fn heard(&mut self, at: Instant) {
        self.heard = Some(at);
    }

    /// The frontend closed connection `id`: CLOSE_REQ after its queued data.
    pub fn close(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) {
        match self.conns.remove(&id) {
            Some(c) => {
                out.push_back(Action::End(c));
                self.start_closing(now, id, out);
            }
            None => out.push_back(Action::Finish(id, None)),
        }
    }

    /// A [`Action::Deliver`] to connection `id` did not fit its queue at
    /// `now`: the stream reads nothing else until it does. Its reader must
    /// take something within [`Timers::stall`] (see [`LinkMachine::progress`])
    /// or the connection is reset.
    pub fn blocked(&mut self, now: Instant, id: i64) {
        self.waiting = Some((id, later(now, self.timers.stall)));
    }

    /// The waiting connection's reader took bytes at `now` (or the shared
    /// budget moved): its stall deadline starts again.
    pub fn progress(&mut self, now: Instant) {
        if let Some((_, deadline)) = &mut self.waiting {
            *deadline = later(now, self.timers.stall);
        }
    }

    /// The waiting bytes went into their queue, or their reader left: the
    /// stream reads again.
    pub fn unblocked(&mut self) {
        self.waiting = None;
    }

    /// A [`Action::Reopen`] gave connection `id` more window than it used:
    /// that connection is closed.
    pub fn window_violated(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) -> Handled {
        self.close(now, id, out);
        Handled::Unexpected
    }

    /// When the machine next wants [`LinkMachine::handle_timeout`]: the
    /// earliest of a pending dial's deadline, the waiting connection's stall
    /// deadline, the instant the agent (if tracked and dials wait for it)
    /// would pass its silence limit, and the closing-set sweep. `None` when
    /// nothing waits.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let dial = self.deadlines.first().map(|(at, _)| *at);
        let stall = self.waiting.map(|(_, at)| at);
        let silence = self
            .heard
            .filter(|_| !self.pending.is_empty())
            .map(|h| later(later(h, self.timers.unresponsive_after), SILENCE_SLACK));
        let sweep = self
            .closed_at
            .first()
            .map(|(at, _)| later(*at, CLOSING_TTL + CLOSING_SWEEP));
        [dial, stall, silence, sweep].into_iter().flatten().min()
    }

    /// Carries out every timer due at `now`: dials past their deadline fail
    /// with [`DialError::Timeout`] (DIAL_CLS to the agent); with the agent
    /// silent past its limit, the other pending dials fail with
    /// [`DialError::Unresponsive`]; the waiting connection past its stall
    /// deadline is reset; closed IDs older than [`CLOSING_TTL`] are
    /// forgotten. Returns [`Handled::Stalled`] when the waiting connection
    /// was given up (the driver stops waiting and counts it).
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Actions<C, R>) -> Option<Handled> {
        self.expire_dials(now, out);
        self.fail_if_silent(now, out);
        self.sweep_closing(now);
        self.expire_stall(now, out)
    }

    /// Dials whose deadline is `now` or earlier fail with a timeout.
    fn expire_dials(&mut self, now: Instant, out: &mut Actions<C, R>) {
        while self.deadlines.first().is_some_and(|(at, _)| *at <= now) {
            let Some((_, random)) = self.deadlines.pop_first() else {
                break;
            };
            if let Some(d) = self.pending.remove(&random) {
                out.push_back(Action::Answer(d.reply, Err(DialError::Timeout)));
                out.push_back(Action::Send(Packet::dial_cls(random)));
            }
        }
    }

    /// With the agent silent past its limit at `now`, every pending dial
    /// fails (the dialer may try another agent).
    fn fail_if_silent(&mut self, now: Instant, out: &mut Actions<C, R>) {
        let Some(heard) = self.heard else { return };
        let silent = now.saturating_duration_since(heard);
        if silent <= self.timers.unresponsive_after {
            return;
        }
        self.deadlines.clear();
        for (random, d) in self.pending.drain() {
            out.push_back(Action::Answer(
                d.reply,
                Err(DialError::Unresponsive(silent)),
            ));
            out.push_back(Action::Send(Packet::dial_cls(random)));
        }
    }

    /// Forgets the closed IDs whose [`CLOSING_TTL`] ended by `now`.
    fn sweep_closing(&mut self, now: Instant) {
        while self
            .closed_at
            .first()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= CLOSING_TTL)
        {
            if let Some((_, id)) = self.closed_at.pop_first() {
                self.closing.remove(&id);
            }
        }
    }

    /// The waiting connection past its stall deadline at `now` is reset,
    /// nothing else.
    fn expire_stall(&mut self, now: Instant, out: &mut Actions<C, R>) -> Option<Handled> {
        let (id, deadline) = self.waiting?;
        if deadline > now {
            return None;
        }
        self.waiting = None;
        if let Some(c) = self.conns.remove(&id) {
            out.push_back(Action::Abort(c));
            self.start_closing(now, id, out);
        }
        Some(Handled::Stalled)
    }

    /// Whether `id` was closed by this side within [`CLOSING_TTL`] before
    /// `now` (late packets for it are expected); an expired entry is
    /// forgotten here.
    fn recently_closed(&mut self, now: Instant, id: i64) -> bool {
        match self.closing.get(&id) {
            Some(at) if now.saturating_duration_since(*at) < CLOSING_TTL => true,
            Some(_) => {
                self.forget_closing(id);
                false
            }
            None => false,
        }
    }

    fn forget_closing(&mut self, id: i64) {
        if let Some(at) = self.closing.remove(&id) {
            self.closed_at.remove(&(at, id));
        }
    }

    fn start_closing(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) {
        self.forget_closing(id);
        self.closing.insert(id, now);
        self.closed_at.insert((now, id));
        out.push_back(Action::Finish(id, Some(Packet::close_req(id))));
    }

    /// The stream ended: every pending dial fails and every connection is
    /// reset. Later dials fail at once; no timer is left.
    pub fn end(&mut self, out: &mut Actions<C, R>) {
        self.ended = true;
        self.deadlines.clear();
        for (_, d) in self.pending.drain() {
            out.push_back(Action::Answer(d.reply, Err(DialError::AgentGone)));
            out.push_back(Action::Abort(d.ends));
        }
        for (_, c) in self.conns.drain() {
            out.push_back(Action::Abort(c));
        }
        self.closing.clear();
        self.closed_at.clear();
        self.waiting = None;
    }

    /// One packet from the agent at `now`.
    pub fn on_packet(&mut self, now: Instant, p: Packet, out: &mut Actions<C, R>) -> Handled {
        match (p.kind(), p.payload) {
            (Some(T::Data), Some(Payload::Data(d))) => self.on_data(now, d.connect_id, d.data, out),
            (Some(T::DialRsp), Some(Payload::DialResponse(r))) => {
                self.on_dial_rsp(r.random, r.connect_id, r.error, out)
            }
            (Some(T::CloseRsp), Some(Payload::CloseResponse(c))) => {
                self.on_close_rsp(now, c.connect_id, out)
            }
            (Some(T::DialCls), Some(Payload::CloseDial(c))) => self.on_dial_cls(c.random, out),
            (Some(T::WindowUpdate), Some(Payload::WindowUpdate(w))) if self.flow => {
                self.on_window(now, w.connect_id, w.bytes, out)
            }
            (Some(T::Drain), _) => {
                self.draining = true;
                Handled::Ok
            }
            _ => Handled::Unexpected,
        }
    }

    /// DATA for connection `id`.
    fn on_data(&mut self, now: Instant, id: i64, data: Bytes, out: &mut Actions<C, R>) -> Handled {
        if self.conns.contains_key(&id) {
            out.push_back(Action::Deliver(id, data));
            Handled::Ok
        } else if self.recently_closed(now, id) {
            // In flight when this side closed it: dropped, expected.
            Handled::Ok
        } else {
            out.push_back(Action::Send(Packet::close_req(id)));
            Handled::Unrecognized
        }
    }

    /// The agent's answer to dial `random`: connection `id`, or `error`.
    fn on_dial_rsp(
        &mut self,
        random: i64,
        id: i64,
        error: String,
        out: &mut Actions<C, R>,
    ) -> Handled {
        let Some(Dial { reply, ends, .. }) = self.take_dial(random) else {
            // Not a dial of this agent's (or already given up): make sure
            // the connection it opened does not leak.
            if id != 0 && error.is_empty() {
                out.push_back(Action::Send(Packet::close_req(id)));
            }
            return Handled::Unrecognized;
        };
        let refused = if !error.is_empty() {
            Some((DialError::Agent(error), Handled::Ok))
        } else if id == 0 {
            let e = DialError::Protocol("DIAL_RSP without connectID");
            Some((e, Handled::Unexpected))
        } else if self.conns.contains_key(&id) || self.closing.contains_key(&id) {
            // An ID still open or still closing is not a new connection.
            let e = DialError::Protocol("DIAL_RSP with a connectID in use");
            Some((e, Handled::Unexpected))
        } else {
            None
        };
        if let Some((e, h)) = refused {
            out.push_back(Action::Answer(reply, Err(e)));
            return h;
        }
        self.conns.insert(id, ends);
        out.push_back(Action::Answer(reply, Ok(id)));
        Handled::Ok
    }

    /// CLOSE_RSP for connection `id`.
    fn on_close_rsp(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) -> Handled {
        if let Some(ends) = self.conns.remove(&id) {
            out.push_back(Action::End(ends));
            Handled::Ok
        } else if self.recently_closed(now, id) {
            self.forget_closing(id);
            Handled::Ok
        } else {
            Handled::Unrecognized
        }
    }

    /// The agent cancelled dial `random`.
    fn on_dial_cls(&mut self, random: i64, out: &mut Actions<C, R>) -> Handled {
        match self.take_dial(random) {
            Some(d) => {
                out.push_back(Action::Answer(d.reply, Err(DialError::Cancelled)));
                Handled::Ok
            }
            None => Handled::Unrecognized,
        }
    }

    /// WINDOW_UPDATE of `n` bytes for connection `id` (flow control).
    fn on_window(&mut self, now: Instant, id: i64, n: i64, out: &mut Actions<C, R>) -> Handled {
        if self.conns.contains_key(&id) {
            out.push_back(Action::Reopen(id, n));
            Handled::Ok
        } else if self.recently_closed(now, id) {
            Handled::Ok
        } else {
            Handled::Unrecognized
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    type Link = LinkMachine<&'static str, u32>;

    const STALL: Duration = Duration::from_secs(10);
    const SILENCE: Duration = Duration::from_secs(12);
    const TIMERS: Timers = Timers {
        stall: STALL,
        unresponsive_after: SILENCE,
    };
    /// A dial's deadline after `t0` in these tests.
    const DIAL: Duration = Duration::from_secs(30);

    fn sent(out: &mut Actions<&'static str, u32>) -> Vec<String> {
        out.drain(..)
            .map(|a| match a {
                Action::Send(p) => format!("send {:?}", p.kind()),
                Action::Finish(id, p) => format!("finish {id} {:?}", p.and_then(|p| p.kind())),
                Action::Deliver(id, b) => format!("deliver {id} {}", b.len()),
                Action::Reopen(id, n) => format!("reopen {id} {n}"),
                Action::Answer(r, res) => format!("answer {r} {res:?}"),
                Action::End(c) => format!("end {c}"),
                Action::Abort(c) => format!("abort {c}"),
            })
            .collect()
    }

    #[test]
    fn a_dial_opens_carries_data_and_closes_both_ways() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.dial(7, "10.0.0.1:22", t0 + DIAL, 1, "c1", &mut out);
        assert_eq!(sent(&mut out), ["send Some(DialReq)"]);
        assert_eq!(l.load(), 1);
        let h = l.on_packet(t0, Packet::dial_rsp(7, 3, String::new()), &mut out);
        assert_eq!(h, Handled::Ok);
        assert_eq!(sent(&mut out), ["answer 1 Ok(3)"]);
        let h = l.on_packet(t0, Packet::data(3, Bytes::from_static(b"hi")), &mut out);
        assert_eq!(
            (h, sent(&mut out)),
            (Handled::Ok, vec!["deliver 3 2".into()])
        );
        // The frontend closes: CLOSE_REQ after queued data; late data is
        // expected until the CLOSE_RSP, not after.
        l.close(t0, 3, &mut out);
        assert_eq!(sent(&mut out), ["end c1", "finish 3 Some(CloseReq)"]);
        let h = l.on_packet(t0, Packet::data(3, Bytes::from_static(b"late")), &mut out);
        assert_eq!((h, out.len()), (Handled::Ok, 0));
        assert_eq!(
            l.on_packet(t0, Packet::close_rsp(3, String::new()), &mut out),
            Handled::Ok
        );
        assert_eq!(
            l.on_packet(t0, Packet::close_rsp(3, String::new()), &mut out),
            Handled::Unrecognized
        );
        let h = l.on_packet(t0, Packet::data(3, Bytes::from_static(b"x")), &mut out);
        assert_eq!(
            (h, sent(&mut out)),
            (Handled::Unrecognized, vec!["send Some(CloseReq)".into()])
        );
        // The agent closes a connection: the frontend gets the end.
        l.dial(8, "h:1", t0 + DIAL, 2, "c2", &mut out);
        l.on_packet(t0, Packet::dial_rsp(8, 4, String::new()), &mut out);
        out.clear();
        assert_eq!(
            l.on_packet(t0, Packet::close_rsp(4, String::new()), &mut out),
            Handled::Ok
        );
        assert_eq!(sent(&mut out), ["end c2"]);
        assert_eq!(l.load(), 0);
    }

    #[test]
    fn dial_answers_errors_cancels_and_reused_ids() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        for (r, c) in [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")] {
            l.dial(r, "h:1", t0 + DIAL, u32::try_from(r).unwrap(), c, &mut out);
        }
        out.clear();
        l.on_packet(
            t0,
            Packet::dial_rsp(1, 0, "connection refused".into()),
            &mut out,
        );
        assert_eq!(
            l.on_packet(t0, Packet::dial_rsp(2, 0, String::new()), &mut out),
            Handled::Unexpected
        );
        assert_eq!(l.on_packet(t0, Packet::dial_cls(3), &mut out), Handled::Ok);
        l.on_packet(t0, Packet::dial_rsp(4, 9, String::new()), &mut out);
        // The same connection ID again is not a new connection.
        assert_eq!(
            l.on_packet(t0, Packet::dial_rsp(5, 9, String::new()), &mut out),
            Handled::Unexpected
        );
        assert_eq!(
            sent(&mut out),
            [
                "answer 1 Err(Agent(\"connection refused\"))",
                "answer 2 Err(Protocol(\"DIAL_RSP without connectID\"))",
                "answer 3 Err(Cancelled)",
                "answer 4 Ok(9)",
                "answer 5 Err(Protocol(\"DIAL_RSP with a connectID in use\"))",
            ]
        );
        // An answer to a dial nobody made: its connection is closed.
        assert_eq!(
            l.on_packet(t0, Packet::dial_rsp(42, 11, String::new()), &mut out),
            Handled::Unrecognized
        );
        assert_eq!(sent(&mut out), ["send Some(CloseReq)"]);
        // A dial given up is cancelled at the agent once.
        l.dial(6, "h:1", t0 + DIAL, 6, "f", &mut out);
        out.clear();
        l.dial_abandoned(6, &mut out);
        l.dial_abandoned(6, &mut out);
        assert_eq!(sent(&mut out), ["send Some(DialCls)"]);
    }

    #[test]
    fn windows_drain_and_unknown_kinds() {
        let t0 = Instant::now();
        let mut out = Actions::new();
        let mut plain = Link::new(false, TIMERS);
        assert_eq!(
            plain.on_packet(t0, Packet::window_update(1, 5), &mut out),
            Handled::Unexpected
        );
        let mut l = Link::new(true, TIMERS);
        l.dial(1, "h:1", t0 + DIAL, 1, "a", &mut out);
        l.on_packet(t0, Packet::dial_rsp(1, 5, String::new()), &mut out);
        out.clear();
        assert_eq!(
            l.on_packet(t0, Packet::window_update(5, 1000), &mut out),
            Handled::Ok
        );
        assert_eq!(sent(&mut out), ["reopen 5 1000"]);
        assert_eq!(l.window_violated(t0, 5, &mut out), Handled::Unexpected);
        assert_eq!(sent(&mut out), ["end a", "finish 5 Some(CloseReq)"]);
        assert_eq!(
            l.on_packet(t0, Packet::window_update(5, 1), &mut out),
            Handled::Ok
        );
        assert_eq!(
            l.on_packet(t0, Packet::window_update(6, 1), &mut out),
            Handled::Unrecognized
        );
        assert!(!l.draining());
        assert_eq!(l.on_packet(t0, Packet::drain(), &mut out), Handled::Ok);
        assert!(l.draining());
        let odd = Packet {
            r#type: 77,
            payload: None,
        };
        assert_eq!(l.on_packet(t0, odd, &mut out), Handled::Unexpected);
        assert!(out.is_empty());
    }

    #[test]
    fn a_stalled_connection_is_reset_alone_and_the_end_fails_everything() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.dial(1, "h:1", t0 + DIAL, 1, "a", &mut out);
        l.dial(2, "h:1", t0 + DIAL, 2, "b", &mut out);
        l.dial(3, "h:1", t0 + DIAL, 3, "c", &mut out);
        l.on_packet(t0, Packet::dial_rsp(1, 10, String::new()), &mut out);
        l.on_packet(t0, Packet::dial_rsp(2, 20, String::new()), &mut out);
        out.clear();
        l.blocked(t0, 10);
        assert_eq!(
            l.handle_timeout(t0 + STALL, &mut out),
            Some(Handled::Stalled)
        );
        assert_eq!(sent(&mut out), ["abort a", "finish 10 Some(CloseReq)"]);
        assert_eq!(l.waiting(), None);
        l.end(&mut out);
        let mut got = sent(&mut out);
        got.sort();
        assert_eq!(got, ["abort b", "abort c", "answer 3 Err(AgentGone)"]);
        l.dial(4, "h:1", t0 + DIAL, 4, "d", &mut out);
        assert_eq!(sent(&mut out), ["answer 4 Err(AgentGone)"]);
        assert!(l.ended());
        assert_eq!(l.poll_timeout(), None, "no timer after the end");
    }

    #[test]
    fn a_dial_times_out_exactly_at_its_deadline() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.dial(1, "h:1", t0 + Duration::from_secs(5), 1, "a", &mut out);
        l.dial(2, "h:1", t0 + Duration::from_secs(9), 2, "b", &mut out);
        out.clear();
        assert_eq!(l.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        // Not before its deadline...
        let just_before = t0 + Duration::from_secs(5) - Duration::from_nanos(1);
        assert_eq!(l.handle_timeout(just_before, &mut out), None);
        assert!(out.is_empty());
        assert_eq!(l.pending(), 2);
        // ...exactly at it: the dialer gets the timeout, the agent DIAL_CLS.
        let h = l.handle_timeout(t0 + Duration::from_secs(5), &mut out);
        assert_eq!(h, None);
        assert_eq!(
            sent(&mut out),
            ["answer 1 Err(Timeout)", "send Some(DialCls)"]
        );
        assert_eq!(l.poll_timeout(), Some(t0 + Duration::from_secs(9)));
        // A late answer to it is unrecognized and its connection closed.
        let rsp = Packet::dial_rsp(1, 7, String::new());
        assert_eq!(l.on_packet(t0, rsp, &mut out), Handled::Unrecognized);
        assert_eq!(sent(&mut out), ["send Some(CloseReq)"]);
        // An answered dial leaves no timer.
        l.on_packet(t0, Packet::dial_rsp(2, 8, String::new()), &mut out);
        assert_eq!(sent(&mut out), ["answer 2 Ok(8)"]);
        assert_eq!(l.poll_timeout(), None);
    }

    #[test]
    fn a_stall_resets_at_its_deadline_and_progress_moves_it() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.dial(1, "h:1", t0 + DIAL * 10, 1, "a", &mut out);
        l.on_packet(t0, Packet::dial_rsp(1, 10, String::new()), &mut out);
        out.clear();
        assert_eq!(l.poll_timeout(), None);
        l.blocked(t0, 10);
        assert_eq!(
            (l.waiting(), l.poll_timeout()),
            (Some(10), Some(t0 + STALL))
        );
        assert_eq!(l.handle_timeout(t0 + STALL / 2, &mut out), None);
        // The reader takes something: the deadline starts again.
        let t1 = t0 + STALL / 2;
        l.progress(t1);
        assert_eq!(l.poll_timeout(), Some(t1 + STALL));
        let before = t1 + STALL - Duration::from_nanos(1);
        assert_eq!(l.handle_timeout(before, &mut out), None);
        assert!(out.is_empty());
        assert_eq!(
            l.handle_timeout(t1 + STALL, &mut out),
            Some(Handled::Stalled)
        );
        assert_eq!(sent(&mut out), ["abort a", "finish 10 Some(CloseReq)"]);
        // Room came instead: nothing is reset, no timer is left.
        l.dial(2, "h:1", t0 + DIAL * 10, 2, "b", &mut out);
        l.on_packet(t0, Packet::dial_rsp(2, 20, String::new()), &mut out);
        out.clear();
        l.blocked(t0, 20);
        l.unblocked();
        assert_eq!(l.handle_timeout(t0 + STALL * 2, &mut out), None);
        assert!(out.is_empty());
        assert!(l.conn(20).is_some());
    }

    #[test]
    fn a_connection_closed_meanwhile_still_ends_the_wait_at_the_stall_deadline() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.dial(1, "h:1", t0 + DIAL, 1, "a", &mut out);
        l.on_packet(t0, Packet::dial_rsp(1, 10, String::new()), &mut out);
        l.blocked(t0, 10);
        l.close(t0, 10, &mut out);
        out.clear();
        // Counted as before (the driver stops waiting); nothing to reset.
        assert_eq!(
            l.handle_timeout(t0 + STALL, &mut out),
            Some(Handled::Stalled)
        );
        assert!(out.is_empty());
    }

    #[test]
    fn a_silent_agent_fails_its_pending_dials_after_the_limit_only() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.heard(t0);
        // Nothing waits for the agent: its silence wakes nobody.
        assert_eq!(l.poll_timeout(), None);
        l.dial(1, "h:1", t0 + DIAL, 1, "a", &mut out);
        out.clear();
        let look = t0 + SILENCE + SILENCE_SLACK;
        assert_eq!(l.poll_timeout(), Some(look));
        // Exactly at the limit is not past it.
        assert_eq!(l.handle_timeout(t0 + SILENCE, &mut out), None);
        assert!(out.is_empty());
        // Heard from meanwhile: the look is later.
        let t1 = t0 + Duration::from_secs(4);
        l.heard(t1);
        assert_eq!(l.handle_timeout(look, &mut out), None);
        assert!(out.is_empty());
        assert_eq!(l.poll_timeout(), Some(t1 + SILENCE + SILENCE_SLACK));
        l.handle_timeout(t1 + SILENCE + SILENCE_SLACK, &mut out);
        assert_eq!(
            sent(&mut out),
            ["answer 1 Err(Unresponsive(12.05s))", "send Some(DialCls)"]
        );
        assert_eq!(l.poll_timeout(), None);
        // The deadline comes first when it is sooner.
        l.dial(2, "h:1", t1 + Duration::from_secs(1), 2, "b", &mut out);
        assert_eq!(l.poll_timeout(), Some(t1 + Duration::from_secs(1)));
    }

    #[test]
    fn poll_timeout_is_the_earliest_deadline() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        assert_eq!(l.poll_timeout(), None);
        l.dial(1, "h:1", t0 + DIAL, 1, "a", &mut out);
        l.on_packet(t0, Packet::dial_rsp(1, 10, String::new()), &mut out);
        l.dial(2, "h:1", t0 + Duration::from_secs(20), 2, "b", &mut out);
        assert_eq!(l.poll_timeout(), Some(t0 + Duration::from_secs(20)));
        l.close_for_test(t0, 99, &mut out);
        assert_eq!(l.poll_timeout(), Some(t0 + Duration::from_secs(20)));
        l.blocked(t0, 10);
        assert_eq!(l.poll_timeout(), Some(t0 + STALL));
        l.unblocked();
        l.dial_abandoned(2, &mut out);
        assert_eq!(l.poll_timeout(), Some(t0 + CLOSING_TTL + CLOSING_SWEEP));
    }

    #[test]
    fn closed_ids_expire_after_closing_ttl() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        for id in 1..=100 {
            l.close_for_test(t0, id, &mut out);
        }
        let t1 = t0 + Duration::from_millis(400);
        l.close_for_test(t1, 100_000, &mut out);
        assert_eq!(l.closing(), 101);
        // One wake-up for the whole batch, a sweep after the oldest expired.
        let wake = t0 + CLOSING_TTL + CLOSING_SWEEP;
        assert_eq!(l.poll_timeout(), Some(wake));
        // Within the TTL nothing is forgotten...
        l.handle_timeout(t0 + CLOSING_TTL - Duration::from_nanos(1), &mut out);
        assert_eq!(l.closing(), 101);
        // ...after it, everything that expired is, and late packets for
        // those IDs are unrecognized again.
        l.handle_timeout(wake, &mut out);
        assert_eq!(l.closing(), 0);
        assert!(!l.is_closing(1));
        assert_eq!(l.poll_timeout(), None);
        out.clear();
        let h = l.on_packet(wake, Packet::close_rsp(1, String::new()), &mut out);
        assert_eq!(h, Handled::Unrecognized);
        // An entry younger than the TTL stays at a sweep.
        l.close_for_test(wake, 5, &mut out);
        l.close_for_test(wake + CLOSING_TTL / 2, 6, &mut out);
        l.handle_timeout(wake + CLOSING_TTL, &mut out);
        assert!(!l.is_closing(5) && l.is_closing(6));
        assert_eq!(
            l.poll_timeout(),
            Some(wake + CLOSING_TTL / 2 + CLOSING_TTL + CLOSING_SWEEP)
        );
    }

    #[test]
    fn a_late_packet_is_expected_within_the_ttl_only() {
        let t0 = Instant::now();
        let mut l = Link::new(false, TIMERS);
        let mut out = Actions::new();
        l.close_for_test(t0, 1, &mut out);
        l.close_for_test(t0, 2, &mut out);
        out.clear();
        let late = |b: &'static [u8]| Packet::data(1, Bytes::from_static(b));
        assert_eq!(
            l.on_packet(t0 + CLOSING_TTL / 2, late(b"a"), &mut out),
            Handled::Ok
        );
        assert!(out.is_empty());
        assert_eq!(
            l.on_packet(t0 + CLOSING_TTL, late(b"b"), &mut out),
            Handled::Unrecognized
        );
        assert_eq!(sent(&mut out), ["send Some(CloseReq)"]);
        assert_eq!(l.closing(), 1);
        let rsp = Packet::close_rsp(2, String::new());
        assert_eq!(
            l.on_packet(t0 + CLOSING_TTL * 2, rsp, &mut out),
            Handled::Unrecognized
        );
        assert_eq!(l.closing(), 0);
    }

    impl<C, R> LinkMachine<C, R> {
        /// Closes an open connection `id` without dialing it first.
        fn close_for_test(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) {
            self.start_closing(now, id, out);
        }
    }
}
