//! One stream to one server replica as the tunnel-agent sees it, as a state
//! machine with no IO: which dials the server asked for are in progress,
//! which connections are open and their IDs. Every input is a method;
//! everything the peers should observe comes out as an [`Action`] for the
//! driver (`agent::link_driver::LinkDriver`) to carry out. No locks, channels, sockets or
//! clock are inside, so tests and the fuzzer (`agent::harness`) drive it
//! deterministically.
//!
//! Its one timer is the stall deadline of a connection whose bytes wait for
//! room, kept quinn-style like the server's: [`LinkMachine::blocked`] and
//! [`LinkMachine::progress`] set it, [`LinkMachine::poll_timeout`] says when
//! it is due and [`LinkMachine::handle_timeout`] resets the connection. The
//! dial deadline stays with the dial task (agent `Agent::dial`): it bounds
//! that task's own name lookup and connect, and its failure text and metric
//! label come from how that IO ended.
//!
//! Generic over `C`, one connection's ends (in the agent: its queue towards
//! the destination, its cancel handle and its sending window), and `P`, a
//! dial's cancel handle, created by the machine with `P::default()` and
//! handed to the dialer in [`Action::Dial`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::stream::deadline::later;
use crate::wire::proto::{Packet, PacketType as T, Payload};

/// What the agent did with one packet from the server (for counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// As expected.
    Ok,
    /// Named a connection this stream does not have (answered with an
    /// error CLOSE_RSP).
    UnknownConnectId,
    /// A packet kind a server must not send, or an unknown kind.
    Unexpected,
    /// DRAIN: the server is going away; it takes no new dials from its
    /// frontends once they moved, and its open connections go on.
    ServerDraining,
    /// REPLICAS (negotiated): the servers are this many replicas now.
    Replicas(i64),
}

impl Handled {
    /// The `outcome` label of `bad_packets_total`, if the packet was bad.
    pub fn bad_label(self) -> Option<&'static str> {
        match self {
            Handled::Ok | Handled::ServerDraining | Handled::Replicas(_) => None,
            Handled::UnknownConnectId => Some("unknown_connect_id"),
            Handled::Unexpected => Some("unexpected"),
        }
    }
}

/// What the driver must do, in order.
#[derive(Debug)]
pub enum Action<C, P> {
    /// Send this control packet to the server now.
    Send(Packet),
    /// End connection `id`'s data lane towards the server after the data
    /// already queued for it, then send the packet if any.
    Finish(i64, Option<Packet>),
    /// Dial `address` for the server's dial `random`; `cancel` stops it.
    Dial {
        /// The server's dial ID.
        random: i64,
        /// `host:port`.
        address: String,
        /// `tcp` is the only one supported.
        protocol: String,
        /// Cancelled by DIAL_CLS.
        cancel: P,
    },
    /// The server cancelled a dial in progress.
    Cancel(P),
    /// Queue these bytes for connection `id`'s destination (its ends are
    /// [`LinkMachine::conn`]).
    Deliver(i64, Bytes),
    /// The server reopened `n` bytes of connection `id`'s sending window.
    Reopen(i64, i64),
    /// The server closed the connection: stop it; what is queued towards the
    /// destination is still written.
    Close(C),
    /// Reset the connection.
    Abort(C),
}

/// A queue of actions; the driver keeps one and drains it after each call.
pub type Actions<C, P> = VecDeque<Action<C, P>>;

/// What [`LinkMachine::handle_timeout`] found due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// Nothing.
    Nothing,
    /// The waiting connection's destination took nothing for the stall
    /// deadline: the wait is over. `reset`: the connection was still open
    /// and is reset now.
    Stalled {
        /// It was open (and is reset).
        reset: bool,
    },
}

/// The agent's state of one stream to a server.
#[derive(Debug)]
pub struct LinkMachine<C, P> {
    flow: bool,
    /// REPLICAS packets negotiated.
    replicas: bool,
    ended: bool,
    next_id: i64,
    pending: HashMap<i64, P>,
    conns: HashMap<i64, C>,
    /// A connection whose destination takes nothing this long while its
    /// bytes wait is reset.
    stall: Duration,
    /// The connection whose bytes wait for room, and its stall deadline.
    waiting: Option<(i64, Instant)>,
}

impl<C, P: Default + Clone> LinkMachine<C, P> {
    /// A new stream; `flow`: per-connection flow control was negotiated;
    /// `stall`: the stall deadline of a connection waiting for room.
    pub fn new(flow: bool, stall: Duration) -> LinkMachine<C, P> {
        LinkMachine {
            flow,
            replicas: false,
            ended: false,
            next_id: 1,
            pending: HashMap::new(),
            conns: HashMap::new(),
            stall,
            waiting: None,
        }
    }

    /// REPLICAS packets were negotiated: they are taken, not unexpected.
    pub fn with_replica_updates(mut self) -> LinkMachine<C, P> {
        self.replicas = true;
        self
    }

    /// Whether per-connection flow control was negotiated.
    pub fn flow(&self) -> bool {
        self.flow
    }

    /// Open connections.
    pub fn open(&self) -> impl Iterator<Item = i64> + '_ {
        self.conns.keys().copied()
    }

    /// Dials in progress.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// An open connection's ends.
    pub fn conn(&self, id: i64) -> Option<&C> {
        self.conns.get(&id)
    }

    /// One packet from the server.
    pub fn on_packet(&mut self, p: Packet, out: &mut Actions<C, P>) -> Handled {
        match (p.kind(), p.payload) {
            (Some(T::DialReq), Some(Payload::DialRequest(d))) => {
                self.on_dial_req(d.random, d.address, d.protocol, out)
            }
            (Some(T::Data), Some(Payload::Data(d))) => self.on_data(d.connect_id, d.data, out),
            (Some(T::CloseReq), Some(Payload::CloseRequest(c))) => {
                self.on_close_req(c.connect_id, out)
            }
            (Some(T::WindowUpdate), Some(Payload::WindowUpdate(w))) if self.flow => {
                self.on_window_update(w.connect_id, w.bytes, out)
            }
            (Some(T::DialCls), Some(Payload::CloseDial(c))) => self.on_dial_cls(c.random, out),
            // Nothing changes on this stream: dials it still sends are
            // served, open connections go on; the driver looks for a
            // replica to replace it.
            (Some(T::Drain), _) => Handled::ServerDraining,
            (Some(T::Replicas), Some(Payload::Replicas(r))) if self.replicas && r.count > 0 => {
                Handled::Replicas(r.count)
            }
            _ => Handled::Unexpected,
        }
    }

    /// More window for connection `id`; a connection closed meanwhile needs
    /// none.
    fn on_window_update(&mut self, id: i64, n: i64, out: &mut Actions<C, P>) -> Handled {
        if self.conns.contains_key(&id) {
            out.push_back(Action::Reopen(id, n));
        }
        Handled::Ok
    }

    /// The server gave up a dial: cancel it if it is still in progress.
    fn on_dial_cls(&mut self, random: i64, out: &mut Actions<C, P>) -> Handled {
        if let Some(p) = self.pending.remove(&random) {
            out.push_back(Action::Cancel(p));
        }
        Handled::Ok
    }

    /// The server asks for a dial of `address` under its dial ID `random`.
    fn on_dial_req(
        &mut self,
        random: i64,
        address: String,
        protocol: String,
        out: &mut Actions<C, P>,
    ) -> Handled {
        if self.ended {
            return Handled::Ok;
        }
        let cancel = P::default();
        // A repeated dial ID replaces the earlier dial's entry: the first
        // answer wins and the other is cancelled when it completes (as
        // upstream's agent does).
        self.pending.insert(random, cancel.clone());
        out.push_back(Action::Dial {
            random,
            address,
            protocol,
            cancel,
        });
        Handled::Ok
    }

    /// DATA for connection `id`.
    fn on_data(&mut self, id: i64, data: Bytes, out: &mut Actions<C, P>) -> Handled {
        if self.conns.contains_key(&id) {
            out.push_back(Action::Deliver(id, data));
            return Handled::Ok;
        }
        let text = "unrecognized connectID".into();
        out.push_back(Action::Send(Packet::close_rsp(id, text)));
        Handled::UnknownConnectId
    }

    /// The server closes connection `id`.
    fn on_close_req(&mut self, id: i64, out: &mut Actions<C, P>) -> Handled {
        let Some(ends) = self.conns.remove(&id) else {
            let text = "Unknown connectID".into();
            out.push_back(Action::Send(Packet::close_rsp(id, text)));
            return Handled::UnknownConnectId;
        };
        out.push_back(Action::Close(ends));
        let rsp = Packet::close_rsp(id, String::new());
        out.push_back(Action::Finish(id, Some(rsp)));
        Handled::Ok
    }

    /// The dial for `random` failed with `text` (sent to the server).
    pub fn dial_failed(&mut self, random: i64, text: String, out: &mut Actions<C, P>) {
        self.pending.remove(&random);
        if !self.ended {
            out.push_back(Action::Send(Packet::dial_rsp(random, 0, text)));
        }
    }

    /// The dial for `random` connected: if the server still wants it, the
    /// connection gets the next ID and `ends` are kept under it; `None`
    /// when it was cancelled meanwhile (the caller closes the socket).
    pub fn connected(&mut self, random: i64, ends: C, out: &mut Actions<C, P>) -> Option<i64> {
        if self.pending.remove(&random).is_none() || self.ended {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.conns.insert(id, ends);
        out.push_back(Action::Send(Packet::dial_rsp(random, id, String::new())));
        Some(id)
    }

    /// Connection `id`'s task ended (the destination closed, a write failed,
    /// or the server's CLOSE_REQ already removed it).
    pub fn closed(&mut self, id: i64, out: &mut Actions<C, P>) {
        if self.conns.remove(&id).is_some() {
            // Unsolicited CLOSE_RSP: the server learns of the close.
            out.push_back(Action::Finish(
                id,
                Some(Packet::close_rsp(id, String::new())),
            ));
        }
        out.push_back(Action::Finish(id, None));
    }

    /// A [`Action::Deliver`] to connection `id` did not fit its queue at
    /// `now`: the stream reads nothing else until it does. Its destination
    /// must take something within the stall deadline (see
    /// [`LinkMachine::progress`]) or the connection is reset.
    pub fn blocked(&mut self, now: Instant, id: i64) {
        self.waiting = Some((id, later(now, self.stall)));
    }

    /// The waiting connection's destination took bytes at `now`: its stall
    /// deadline starts again.
    pub fn progress(&mut self, now: Instant) {
        if let Some((_, deadline)) = &mut self.waiting {
            *deadline = later(now, self.stall);
        }
    }

    /// The waiting bytes went into their queue, or the connection's writer
    /// left: the stream reads again.
    pub fn unblocked(&mut self) {
        self.waiting = None;
    }

    /// The connection whose bytes wait for room, if any.
    pub fn waiting(&self) -> Option<i64> {
        self.waiting.map(|(id, _)| id)
    }

    /// When the machine next wants [`LinkMachine::handle_timeout`]: the
    /// waiting connection's stall deadline; `None` when nothing waits.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.waiting.map(|(_, at)| at)
    }

    /// Carries out the timer due at `now`: the waiting connection past its
    /// stall deadline is reset (CLOSE_RSP with the reason to the server),
    /// nothing else.
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Actions<C, P>) -> Expired {
        match self.waiting {
            Some((id, at)) if at <= now => {
                self.waiting = None;
                Expired::Stalled {
                    reset: self.reset_stalled(id, out),
                }
            }
            _ => Expired::Nothing,
        }
    }

    /// Connection `id`'s destination took nothing for the stall deadline
    /// while its bytes waited: that connection is reset, nothing else.
    /// Returns whether it was open.
    fn reset_stalled(&mut self, id: i64, out: &mut Actions<C, P>) -> bool {
        let Some(ends) = self.conns.remove(&id) else {
            return false;
        };
        out.push_back(Action::Abort(ends));
        out.push_back(Action::Finish(
            id,
            Some(Packet::close_rsp(
                id,
                "destination stalled: no byte accepted within the stall deadline".into(),
            )),
        ));
        true
    }

    /// The stream ended: every connection is reset; dials in progress are
    /// forgotten (their tasks see the stream end) and later ones refused.
    pub fn end(&mut self, out: &mut Actions<C, P>) {
        self.ended = true;
        self.pending.clear();
        self.waiting = None;
        for (_, ends) in self.conns.drain() {
            out.push_back(Action::Abort(ends));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A cancel handle that remembers whether it was used.
    #[derive(Debug, Default, Clone)]
    struct Flag(std::rc::Rc<std::cell::Cell<bool>>);

    type Link = LinkMachine<&'static str, Flag>;

    const STALL: Duration = Duration::from_secs(10);

    fn names(out: &mut Actions<&'static str, Flag>) -> Vec<String> {
        out.drain(..)
            .map(|a| match a {
                Action::Send(p) => format!("send {:?}", p.kind()),
                Action::Finish(id, p) => format!("finish {id} {:?}", p.and_then(|p| p.kind())),
                Action::Dial {
                    random, address, ..
                } => format!("dial {random} {address}"),
                Action::Cancel(_) => "cancel".into(),
                Action::Deliver(id, b) => format!("deliver {id} {}", b.len()),
                Action::Reopen(id, n) => format!("reopen {id} {n}"),
                Action::Close(c) => format!("close {c}"),
                Action::Abort(c) => format!("abort {c}"),
            })
            .collect()
    }

    #[test]
    fn a_dial_connects_carries_data_and_closes_both_ways() {
        let mut l = Link::new(true, STALL);
        let mut out = Actions::new();
        assert_eq!(
            l.on_packet(Packet::dial_req("10.0.0.1:22", 7), &mut out),
            Handled::Ok
        );
        assert_eq!(names(&mut out), ["dial 7 10.0.0.1:22"]);
        assert_eq!(l.connected(7, "a", &mut out), Some(1));
        assert_eq!(names(&mut out), ["send Some(DialRsp)"]);
        l.on_packet(Packet::data(1, Bytes::from_static(b"hi")), &mut out);
        l.on_packet(Packet::window_update(1, 4096), &mut out);
        assert_eq!(names(&mut out), ["deliver 1 2", "reopen 1 4096"]);
        // The server closes it.
        assert_eq!(l.on_packet(Packet::close_req(1), &mut out), Handled::Ok);
        assert_eq!(names(&mut out), ["close a", "finish 1 Some(CloseRsp)"]);
        // Its task then ends: nothing more to tell the server.
        l.closed(1, &mut out);
        assert_eq!(names(&mut out), ["finish 1 None"]);
        // The destination closes the next one: the server is told.
        l.on_packet(Packet::dial_req("h:1", 8), &mut out);
        out.clear();
        assert_eq!(l.connected(8, "b", &mut out), Some(2));
        out.clear();
        l.closed(2, &mut out);
        assert_eq!(
            names(&mut out),
            ["finish 2 Some(CloseRsp)", "finish 2 None"]
        );
    }

    #[test]
    fn cancelled_and_failed_dials_and_unknown_ids() {
        let mut l = Link::new(false, STALL);
        let mut out = Actions::new();
        l.on_packet(Packet::dial_req("h:1", 1), &mut out);
        let Some(Action::Dial { cancel, .. }) = out.pop_front() else {
            panic!("no dial")
        };
        l.on_packet(Packet::dial_cls(1), &mut out);
        let Some(Action::Cancel(c)) = out.pop_front() else {
            panic!("no cancel")
        };
        assert!(
            std::rc::Rc::ptr_eq(&c.0, &cancel.0),
            "the dial's own handle"
        );
        // The dial completes anyway: not wanted any more.
        assert_eq!(l.connected(1, "a", &mut out), None);
        l.on_packet(Packet::dial_req("h:1", 2), &mut out);
        out.clear();
        l.dial_failed(2, "connection refused".into(), &mut out);
        assert_eq!(names(&mut out), ["send Some(DialRsp)"]);
        assert_eq!(
            l.on_packet(Packet::data(9, Bytes::new()), &mut out),
            Handled::UnknownConnectId
        );
        assert_eq!(
            l.on_packet(Packet::close_req(9), &mut out),
            Handled::UnknownConnectId
        );
        assert_eq!(
            names(&mut out),
            ["send Some(CloseRsp)", "send Some(CloseRsp)"]
        );
        // Window updates without flow control, and unknown kinds.
        assert_eq!(
            l.on_packet(Packet::window_update(1, 1), &mut out),
            Handled::Unexpected
        );
        assert_eq!(l.pending(), 0);
        // DRAIN from the server changes nothing on the stream (the driver
        // looks for a replica) and is not a bad packet.
        assert_eq!(
            l.on_packet(Packet::drain(), &mut out),
            Handled::ServerDraining
        );
        assert_eq!(Handled::ServerDraining.bad_label(), None);
        assert!(names(&mut out).is_empty());
    }

    #[test]
    fn replica_counts_are_taken_only_when_negotiated() {
        let mut out = Actions::new();
        let mut plain = Link::new(false, STALL);
        assert_eq!(
            plain.on_packet(Packet::replicas(3), &mut out),
            Handled::Unexpected
        );
        let mut l = Link::new(false, STALL).with_replica_updates();
        assert_eq!(
            l.on_packet(Packet::replicas(3), &mut out),
            Handled::Replicas(3)
        );
        assert_eq!(Handled::Replicas(3).bad_label(), None);
        for bad in [0, -1] {
            assert_eq!(
                l.on_packet(Packet::replicas(bad), &mut out),
                Handled::Unexpected
            );
        }
        assert!(names(&mut out).is_empty());
    }

    #[test]
    fn progress_moves_the_stall_deadline_and_room_clears_it() {
        let mut l = Link::new(false, STALL);
        let mut out = Actions::new();
        l.on_packet(Packet::dial_req("h:1", 1), &mut out);
        l.connected(1, "a", &mut out);
        out.clear();
        let t0 = Instant::now();
        l.blocked(t0, 1);
        let t1 = t0 + STALL / 2;
        l.progress(t1);
        assert_eq!(l.poll_timeout(), Some(t1 + STALL));
        assert_eq!(l.handle_timeout(t0 + STALL, &mut out), Expired::Nothing);
        l.unblocked();
        assert_eq!(l.poll_timeout(), None);
        assert_eq!(l.handle_timeout(t1 + STALL, &mut out), Expired::Nothing);
        assert!(out.is_empty());
        assert!(l.conn(1).is_some());
    }

    #[test]
    fn a_stall_resets_one_connection_and_the_end_resets_all() {
        let mut l = Link::new(false, STALL);
        let mut out = Actions::new();
        for (r, c) in [(1, "a"), (2, "b"), (3, "c")] {
            l.on_packet(Packet::dial_req("h:1", r), &mut out);
            l.connected(r, c, &mut out);
        }
        l.on_packet(Packet::dial_req("h:1", 4), &mut out);
        out.clear();
        let t0 = Instant::now();
        assert_eq!(l.poll_timeout(), None);
        l.blocked(t0, 2);
        assert_eq!(l.poll_timeout(), Some(t0 + STALL));
        let before = t0 + STALL - Duration::from_nanos(1);
        assert_eq!(l.handle_timeout(before, &mut out), Expired::Nothing);
        assert!(out.is_empty());
        let reset = Expired::Stalled { reset: true };
        assert_eq!(l.handle_timeout(t0 + STALL, &mut out), reset);
        assert_eq!(names(&mut out), ["abort b", "finish 2 Some(CloseRsp)"]);
        assert_eq!((l.waiting(), l.poll_timeout()), (None, None));
        // Closed meanwhile: the wait still ends, nothing is reset.
        l.blocked(t0, 2);
        let gone = Expired::Stalled { reset: false };
        assert_eq!(l.handle_timeout(t0 + STALL, &mut out), gone);
        assert!(out.is_empty());
        l.end(&mut out);
        let mut got = names(&mut out);
        got.sort();
        assert_eq!(got, ["abort a", "abort c"]);
        // After the end the pending dial is not answered and new ones are
        // not started.
        assert_eq!(l.connected(4, "d", &mut out), None);
        l.on_packet(Packet::dial_req("h:1", 5), &mut out);
        l.dial_failed(5, "x".into(), &mut out);
        assert!(out.is_empty());
        assert_eq!(l.open().count(), 0);
    }
}
