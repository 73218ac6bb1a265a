//! One agent stream as the tunnel-server sees it, as a state machine with no
//! IO: which dials wait for the agent's answer, which connections are open,
//! which this side closed and still expects a CLOSE_RSP for, and whether the
//! agent announced DRAIN. Every input is a method; everything the peers
//! should observe comes out as an [`Action`] for the driver
//! (`server::AgentLink`) to carry out. No locks, channels, sockets or clock
//! are inside: a method that needs the time takes `now`, so tests and the
//! fuzzer (`server::harness`) drive it deterministically.
//!
//! The machine is generic over what it stores: `C`, one connection's ends
//! (in the server: its queue towards the frontend and its sending window),
//! and `R`, the reply handle of a pending dial. It never calls either; it
//! only hands them back in actions.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::dialerror::DialError;
use crate::proto::{Packet, PacketType as T, Payload};

/// How long a connection this side closed is remembered waiting for the
/// agent's CLOSE_RSP (agents that never answer): late packets for it are
/// expected within this time, unrecognized after it.
pub const CLOSING_TTL: Duration = Duration::from_secs(60);
/// Size of the closing set from which expired entries are pruned in bulk
/// (below it, an expired entry is forgotten when a packet refers to it).
pub const CLOSING_PRUNE_AT: usize = 4096;

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
    /// [`ServerLink::conn`]).
    Deliver(i64, Bytes),
    /// The agent reopened `n` bytes of connection `id`'s sending window. A
    /// window that grows beyond its size is a violation the driver reports
    /// back with [`ServerLink::window_violated`].
    Reopen(i64, i64),
    /// Answer a dial. With `Ok(id)` the connection is open; if the dialer is
    /// gone by now, the driver closes it with [`ServerLink::close`].
    Answer(R, Result<i64, DialError>),
    /// The connection ended normally: its frontend gets what is queued,
    /// then the end.
    End(C),
    /// The connection ended abnormally: its frontend is reset.
    Abort(C),
}

/// A queue of actions; the driver keeps one and drains it after each call.
pub type Actions<C, R> = VecDeque<Action<C, R>>;

/// The server's state of one agent stream.
#[derive(Debug)]
pub struct ServerLink<C, R> {
    flow: bool,
    draining: bool,
    ended: bool,
    pending: HashMap<i64, (R, C)>,
    conns: HashMap<i64, C>,
    /// Connections this side closed (CLOSE_REQ sent), until the agent's
    /// CLOSE_RSP: late DATA and the CLOSE_RSP for them are expected.
    closing: HashMap<i64, Instant>,
}

impl<C, R> ServerLink<C, R> {
    /// A new stream; `flow`: per-connection flow control was negotiated.
    pub fn new(flow: bool) -> ServerLink<C, R> {
        ServerLink {
            flow,
            draining: false,
            ended: false,
            pending: HashMap::new(),
            conns: HashMap::new(),
            closing: HashMap::new(),
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

    /// Whether the stream ended ([`ServerLink::end`]).
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

    /// A frontend dials `address` under the fresh dial ID `random`; `ends`
    /// become the connection's when the agent accepts.
    pub fn dial(&mut self, random: i64, address: &str, reply: R, ends: C, out: &mut Actions<C, R>) {
        if self.ended {
            out.push_back(Action::Answer(reply, Err(DialError::AgentGone)));
            return;
        }
        if let Some((old, _)) = self.pending.insert(random, (reply, ends)) {
            // Dial IDs are random 63-bit numbers; a repeat is a bug upstream
            // of this machine, and the older dial must not hang.
            out.push_back(Action::Answer(
                old,
                Err(DialError::Protocol("dial ID reused")),
            ));
        }
        out.push_back(Action::Send(Packet::dial_req(address, random)));
    }

    /// The dialer stopped waiting for `random` (timeout, cancel): the agent
    /// is told with DIAL_CLS if it had not answered yet.
    pub fn dial_abandoned(&mut self, random: i64, out: &mut Actions<C, R>) {
        if self.pending.remove(&random).is_some() && !self.ended {
            out.push_back(Action::Send(Packet::dial_cls(random)));
        }
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

    /// Connection `id`'s frontend took nothing for the stall deadline while
    /// its bytes waited: that connection is reset, nothing else.
    pub fn stalled(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) -> Handled {
        if let Some(c) = self.conns.remove(&id) {
            out.push_back(Action::Abort(c));
            self.start_closing(now, id, out);
        }
        Handled::Stalled
    }

    /// A [`Action::Reopen`] gave connection `id` more window than it used:
    /// that connection is closed.
    pub fn window_violated(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) -> Handled {
        self.close(now, id, out);
        Handled::Unexpected
    }

    /// Whether `id` was closed by this side within [`CLOSING_TTL`] before
    /// `now` (late packets for it are expected); an expired entry is
    /// forgotten here.
    fn recently_closed(&mut self, now: Instant, id: i64) -> bool {
        match self.closing.get(&id) {
            Some(at) if now.saturating_duration_since(*at) < CLOSING_TTL => true,
            Some(_) => {
                self.closing.remove(&id);
                false
            }
            None => false,
        }
    }

    fn start_closing(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) {
        if self.closing.len() >= CLOSING_PRUNE_AT {
            self.closing
                .retain(|_, at| now.saturating_duration_since(*at) < CLOSING_TTL);
        }
        self.closing.insert(id, now);
        out.push_back(Action::Finish(id, Some(Packet::close_req(id))));
    }

    /// The stream ended: every pending dial fails and every connection is
    /// reset. Later dials fail at once.
    pub fn end(&mut self, out: &mut Actions<C, R>) {
        self.ended = true;
        for (_, (reply, ends)) in self.pending.drain() {
            out.push_back(Action::Answer(reply, Err(DialError::AgentGone)));
            out.push_back(Action::Abort(ends));
        }
        for (_, c) in self.conns.drain() {
            out.push_back(Action::Abort(c));
        }
        self.closing.clear();
    }

    /// One packet from the agent at `now`.
    pub fn on_packet(&mut self, now: Instant, p: Packet, out: &mut Actions<C, R>) -> Handled {
        match (p.kind(), p.payload) {
            (Some(T::Data), Some(Payload::Data(d))) => {
                if self.conns.contains_key(&d.connect_id) {
                    out.push_back(Action::Deliver(d.connect_id, d.data));
                    Handled::Ok
                } else if self.recently_closed(now, d.connect_id) {
                    // In flight when this side closed it: dropped, expected.
                    Handled::Ok
                } else {
                    out.push_back(Action::Send(Packet::close_req(d.connect_id)));
                    Handled::Unrecognized
                }
            }
            (Some(T::DialRsp), Some(Payload::DialResponse(r))) => {
                let Some((reply, ends)) = self.pending.remove(&r.random) else {
                    // Not a dial of this agent's (or already given up): make
                    // sure the connection it opened does not leak.
                    if r.connect_id != 0 && r.error.is_empty() {
                        out.push_back(Action::Send(Packet::close_req(r.connect_id)));
                    }
                    return Handled::Unrecognized;
                };
                if !r.error.is_empty() {
                    out.push_back(Action::Answer(reply, Err(DialError::Agent(r.error))));
                    return Handled::Ok;
                }
                if r.connect_id == 0 {
                    out.push_back(Action::Answer(
                        reply,
                        Err(DialError::Protocol("DIAL_RSP without connectID")),
                    ));
                    return Handled::Unexpected;
                }
                // An ID still open or still closing is not a new connection.
                if self.conns.contains_key(&r.connect_id)
                    || self.closing.contains_key(&r.connect_id)
                {
                    out.push_back(Action::Answer(
                        reply,
                        Err(DialError::Protocol("DIAL_RSP with a connectID in use")),
                    ));
                    return Handled::Unexpected;
                }
                self.conns.insert(r.connect_id, ends);
                out.push_back(Action::Answer(reply, Ok(r.connect_id)));
                Handled::Ok
            }
            (Some(T::CloseRsp), Some(Payload::CloseResponse(c))) => {
                if let Some(ends) = self.conns.remove(&c.connect_id) {
                    out.push_back(Action::End(ends));
                    Handled::Ok
                } else if self.recently_closed(now, c.connect_id) {
                    self.closing.remove(&c.connect_id);
                    Handled::Ok
                } else {
                    Handled::Unrecognized
                }
            }
            (Some(T::DialCls), Some(Payload::CloseDial(c))) => match self.pending.remove(&c.random)
            {
                Some((reply, _)) => {
                    out.push_back(Action::Answer(reply, Err(DialError::Cancelled)));
                    Handled::Ok
                }
                None => Handled::Unrecognized,
            },
            (Some(T::WindowUpdate), Some(Payload::WindowUpdate(w))) if self.flow => {
                if self.conns.contains_key(&w.connect_id) {
                    out.push_back(Action::Reopen(w.connect_id, w.bytes));
                    Handled::Ok
                } else if self.recently_closed(now, w.connect_id) {
                    Handled::Ok
                } else {
                    Handled::Unrecognized
                }
            }
            (Some(T::Drain), _) => {
                self.draining = true;
                Handled::Ok
            }
            _ => Handled::Unexpected,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    type Link = ServerLink<&'static str, u32>;

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
        let mut l = Link::new(false);
        let mut out = Actions::new();
        l.dial(7, "10.0.0.1:22", 1, "c1", &mut out);
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
        l.dial(8, "h:1", 2, "c2", &mut out);
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
        let mut l = Link::new(false);
        let mut out = Actions::new();
        for (r, c) in [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")] {
            l.dial(r, "h:1", u32::try_from(r).unwrap(), c, &mut out);
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
        l.dial(6, "h:1", 6, "f", &mut out);
        out.clear();
        l.dial_abandoned(6, &mut out);
        l.dial_abandoned(6, &mut out);
        assert_eq!(sent(&mut out), ["send Some(DialCls)"]);
    }

    #[test]
    fn windows_drain_and_unknown_kinds() {
        let t0 = Instant::now();
        let mut out = Actions::new();
        let mut plain = Link::new(false);
        assert_eq!(
            plain.on_packet(t0, Packet::window_update(1, 5), &mut out),
            Handled::Unexpected
        );
        let mut l = Link::new(true);
        l.dial(1, "h:1", 1, "a", &mut out);
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
        let mut l = Link::new(false);
        let mut out = Actions::new();
        l.dial(1, "h:1", 1, "a", &mut out);
        l.dial(2, "h:1", 2, "b", &mut out);
        l.dial(3, "h:1", 3, "c", &mut out);
        l.on_packet(t0, Packet::dial_rsp(1, 10, String::new()), &mut out);
        l.on_packet(t0, Packet::dial_rsp(2, 20, String::new()), &mut out);
        out.clear();
        assert_eq!(l.stalled(t0, 10, &mut out), Handled::Stalled);
        assert_eq!(sent(&mut out), ["abort a", "finish 10 Some(CloseReq)"]);
        l.end(&mut out);
        let mut got = sent(&mut out);
        got.sort();
        assert_eq!(got, ["abort b", "abort c", "answer 3 Err(AgentGone)"]);
        l.dial(4, "h:1", 4, "d", &mut out);
        assert_eq!(sent(&mut out), ["answer 4 Err(AgentGone)"]);
        assert!(l.ended());
    }

    #[test]
    fn closed_ids_are_forgotten_after_their_ttl_once_the_set_is_large() {
        let t0 = Instant::now();
        let mut l = Link::new(false);
        let mut out = Actions::new();
        for id in 1..=i64::try_from(CLOSING_PRUNE_AT).unwrap() {
            l.close_for_test(t0, id, &mut out);
        }
        assert_eq!(l.closing(), CLOSING_PRUNE_AT);
        // Within the TTL nothing is forgotten...
        l.close_for_test(t0 + CLOSING_TTL / 2, 100_000, &mut out);
        assert_eq!(l.closing(), CLOSING_PRUNE_AT + 1);
        // ...after it, the old entries are, and their late packets are
        // unrecognized again.
        l.close_for_test(t0 + CLOSING_TTL, 100_001, &mut out);
        assert_eq!(l.closing(), 2);
        out.clear();
        let h = l.on_packet(
            t0 + CLOSING_TTL,
            Packet::close_rsp(1, String::new()),
            &mut out,
        );
        assert_eq!(h, Handled::Unrecognized);
    }

    #[test]
    fn a_late_packet_is_expected_within_the_ttl_only() {
        let t0 = Instant::now();
        let mut l = Link::new(false);
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

    impl<C, R> ServerLink<C, R> {
        /// Closes an open connection `id` without dialing it first.
        fn close_for_test(&mut self, now: Instant, id: i64, out: &mut Actions<C, R>) {
            self.start_closing(now, id, out);
        }
    }
}
