//! A deterministic driver of the agent's session state machine
//! ([`super::link::LinkMachine`]), for the fuzzer
//! (`fuzz/fuzz_targets/server_packets.rs`) and unit tests: arbitrary packets
//! from a server interleaved with the agent's own events (a dial completes or
//! fails, a destination closes, blocks, makes progress or stalls, time
//! passes), with the invariants checked after every step. No runtime,
//! sockets or channels are involved, and time is a value the harness
//! advances: advancing it fires the machine's stall timer as the driver's
//! sleep until [`LinkMachine::poll_timeout`] would.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::link::{Action, Actions, Expired, Handled, LinkMachine};
use crate::wire::proto::{Packet, PacketType};

/// A cancel handle the harness can inspect.
#[derive(Debug, Default, Clone)]
pub struct Flag(std::rc::Rc<std::cell::Cell<bool>>);

/// The stall deadline of the machine under test.
pub const STALL: Duration = Duration::from_secs(10);

/// The machine under test and what its peers observed.
pub struct Harness {
    link: LinkMachine<u64, Flag>,
    out: Actions<u64, Flag>,
    /// The harness's clock.
    now: Instant,
    /// Connections reset for a stall.
    pub stalled: Vec<i64>,
    /// Dials started, in order (the server's dial IDs).
    dials: Vec<i64>,
    /// Connections answered per dial ID (never more than dials started
    /// with that ID).
    connected: HashMap<i64, usize>,
    /// Connection IDs handed out.
    ids: HashSet<i64>,
    /// Connection ends released (closed or aborted).
    released: HashSet<u64>,
    /// Connection ends by connection ID.
    ends: HashMap<i64, u64>,
    next_ends: u64,
    /// Outcomes of every packet so far.
    pub handled: Vec<Handled>,
}

impl Harness {
    /// A new stream, flow control on if `flow`.
    pub fn new(flow: bool) -> Harness {
        Harness {
            link: LinkMachine::new(flow, STALL),
            out: Actions::new(),
            now: Instant::now(),
            stalled: Vec::new(),
            dials: Vec::new(),
            connected: HashMap::new(),
            ids: HashSet::new(),
            released: HashSet::new(),
            ends: HashMap::new(),
            next_ends: 1,
            handled: Vec::new(),
        }
    }

    /// Feeds one packet from the server.
    pub fn packet(&mut self, p: Packet) {
        let h = self.link.on_packet(p, &mut self.out);
        self.handled.push(h);
        self.apply();
    }

    /// The `n`-th dial started so far (modulo their count) connects.
    pub fn dial_connects(&mut self, n: usize) {
        let Some(random) = self.nth_dial(n) else {
            return;
        };
        let ends = self.next_ends;
        self.next_ends += 1;
        if let Some(id) = self.link.connected(random, ends, &mut self.out) {
            assert!(self.ids.insert(id), "connection ID {id} handed out twice");
            assert!(id > 0);
            self.ends.insert(id, ends);
        }
        self.apply();
    }

    /// The `n`-th dial fails.
    pub fn dial_fails(&mut self, n: usize) {
        if let Some(random) = self.nth_dial(n) {
            self.link
                .dial_failed(random, "refused".into(), &mut self.out);
            self.apply();
        }
    }

    /// Connection `id`'s task ends at this side.
    pub fn conn_ends(&mut self, id: i64) {
        self.link.closed(id, &mut self.out);
        self.apply();
    }

    /// Connection `id`'s DATA does not fit its queue: the stream waits
    /// for room (if it is open and nothing waits already, as in the
    /// driver).
    pub fn conn_blocks(&mut self, id: i64) {
        if self.link.conn(id).is_some() && self.link.waiting().is_none() {
            self.link.blocked(self.now, id);
        }
        self.check();
    }

    /// The waiting connection's destination takes bytes.
    pub fn progress(&mut self) {
        self.link.progress(self.now);
        self.check();
    }

    /// The waiting bytes fit now.
    pub fn room(&mut self) {
        self.link.unblocked();
        self.check();
    }

    /// Connection `id`'s destination stalls: the clock runs past its stall
    /// deadline.
    pub fn conn_stalls(&mut self, id: i64) {
        self.conn_blocks(id);
        self.advance(STALL);
    }

    /// Moves the clock by `by`, firing the timers due on the way.
    pub fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        while let Some(at) = self.link.poll_timeout().filter(|at| *at <= until) {
            self.now = self.now.max(at);
            let id = self.link.waiting();
            match self.link.handle_timeout(self.now, &mut self.out) {
                Expired::Nothing => panic!("a timer due at {at:?} did nothing"),
                Expired::Stalled { reset } => {
                    let open = id.is_some_and(|id| self.ends.contains_key(&id));
                    if let (true, Some(id)) = (reset, id) {
                        self.stalled.push(id);
                    }
                    assert!(!reset || open, "reset a connection never opened");
                }
            }
            self.apply();
        }
        self.now = until;
    }

    fn nth_dial(&self, n: usize) -> Option<i64> {
        (!self.dials.is_empty()).then(|| self.dials[n % self.dials.len()])
    }

    /// A packet the agent sent: a DIAL_RSP never names more connections
    /// for a dial ID than dials were started with it; CLOSE_RSP; nothing
    /// else.
    fn sent(&mut self, p: &Packet) {
        match (p.kind(), &p.payload) {
            (Some(PacketType::DialRsp), Some(crate::wire::proto::Payload::DialResponse(r))) => {
                if r.connect_id != 0 {
                    let n = self.connected.entry(r.random).or_insert(0);
                    *n += 1;
                    let started = self.dials.iter().filter(|d| **d == r.random).count();
                    assert!(
                        *n <= started,
                        "dial {} answered with more connections than asked",
                        r.random
                    );
                }
            }
            (Some(PacketType::DialRsp | PacketType::CloseRsp), _) => {}
            (k, _) => panic!("the agent sent {k:?}"),
        }
    }

    /// Carries out the actions like the driver would, checking each.
    fn apply(&mut self) {
        while let Some(a) = self.out.pop_front() {
            match a {
                Action::Send(p) => self.sent(&p),
                Action::Finish(_, p) => {
                    if let Some(p) = p {
                        assert_eq!(p.kind(), Some(PacketType::CloseRsp), "{p:?}");
                    }
                }
                Action::Dial { random, cancel, .. } => {
                    assert!(!cancel.0.get(), "a fresh dial is not cancelled");
                    self.dials.push(random);
                }
                Action::Cancel(c) => c.0.set(true),
                Action::Deliver(id, _) | Action::Reopen(id, _) => {
                    assert!(self.link.conn(id).is_some(), "{id} is not open");
                }
                Action::Close(c) | Action::Abort(c) => {
                    assert!(self.released.insert(c), "ends {c} released twice");
                }
            }
        }
        self.check();
    }

    /// The invariants: an open connection's ends were never released and
    /// are the ones it connected with; IDs are never reused; a waiting
    /// connection has a stall deadline, and no timer is left due.
    pub fn check(&self) {
        assert_eq!(
            self.link.waiting().is_some(),
            self.link.poll_timeout().is_some()
        );
        if let Some(at) = self.link.poll_timeout() {
            assert!(at > self.now, "a timer was left due");
        }
        for id in self.link.open() {
            let ends = self.link.conn(id).copied();
            assert_eq!(ends, self.ends.get(&id).copied(), "ends of {id}");
            if let Some(e) = ends {
                assert!(!self.released.contains(&e), "open {id} was released");
            }
        }
    }

    /// The stream ends: every open connection is released.
    pub fn stream_ends(mut self) {
        let open: Vec<i64> = self.link.open().collect();
        self.link.end(&mut self.out);
        self.apply();
        for id in open {
            if let Some(e) = self.ends.get(&id) {
                assert!(self.released.contains(e), "{id} not released at the end");
            }
        }
        assert_eq!(self.link.open().count(), 0);
        assert_eq!(self.link.pending(), 0);
        assert_eq!(self.link.poll_timeout(), None);
        // Nothing is started after the end.
        self.link
            .on_packet(Packet::dial_req("h:1", 1), &mut self.out);
        assert!(self.out.is_empty());
    }
}

/// Runs one fuzz input: `[flags, (op, len, bytes…)*]`. Bit 0 of `flags`
/// turns flow control on. Ops `0xfc..=0xff` are the agent's own events on
/// dial or connection number `len` (connects, fails, ends, stalls); `0xfb`
/// blocks connection `len` (its DATA does not fit), `0xfa` is progress of
/// the waiting destination, `0xf9` room for it, `0xf8` advances the clock
/// `len` × 100 ms; any other op feeds the next `len` bytes decoded as a
/// packet from the server (undecodable ones are skipped).
pub fn run_bytes(data: &[u8]) {
    use prost::Message;
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let mut h = Harness::new(flags & 1 == 1);
    while let [op, len, tail @ ..] = rest {
        match *op {
            0xff => h.dial_connects(usize::from(*len)),
            0xfe => h.dial_fails(usize::from(*len)),
            0xfd => h.conn_ends(i64::from(*len)),
            0xfc => h.conn_stalls(i64::from(*len)),
            0xfb => h.conn_blocks(i64::from(*len)),
            0xfa => h.progress(),
            0xf9 => h.room(),
            0xf8 => h.advance(Duration::from_millis(100 * u64::from(*len))),
            _ => {
                let n = usize::from(*len).min(tail.len());
                let (msg, next) = tail.split_at(n);
                if let Ok(p) = Packet::decode(msg) {
                    h.packet(p);
                }
                rest = next;
                continue;
            }
        }
        rest = tail;
    }
    h.stream_ends();
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use prost::Message;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn a_scripted_session() {
        let mut h = Harness::new(true);
        h.packet(Packet::dial_req("a:1", 10));
        h.packet(Packet::dial_req("b:1", 11));
        h.dial_connects(0);
        h.dial_connects(0); // completes twice: the second is not wanted
        h.dial_fails(1);
        h.packet(Packet::data(1, Bytes::from_static(b"x")));
        h.packet(Packet::data(2, Bytes::from_static(b"x")));
        h.packet(Packet::window_update(1, 100));
        h.packet(Packet::close_req(1));
        h.packet(Packet::close_req(1));
        h.conn_ends(1);
        h.packet(Packet::drain());
        assert_eq!(
            h.handled,
            vec![
                Handled::Ok,
                Handled::Ok,
                Handled::Ok,
                Handled::UnknownConnectId,
                Handled::Ok,
                Handled::Ok,
                Handled::UnknownConnectId,
                Handled::ServerDraining,
            ]
        );
        // A third dial connects as connection 2, which blocks; its
        // destination keeps taking bytes for a while, then stops: reset at
        // the stall deadline after the last progress.
        h.packet(Packet::dial_req("c:1", 12));
        h.dial_connects(2);
        // Connection 2 blocks; its destination keeps taking bytes for a
        // while, then stops: reset at the stall deadline after the last.
        h.conn_blocks(2);
        h.advance(STALL / 2);
        h.progress();
        h.advance(STALL - Duration::from_millis(1));
        assert!(h.stalled.is_empty());
        h.advance(Duration::from_millis(1));
        assert_eq!(h.stalled, [2]);
        h.stream_ends();
    }

    /// Not coverage-guided (that needs nightly; see docs/TESTING.md), but a
    /// seeded run of structured random inputs through the fuzz entry point,
    /// so CI exercises it on every change.
    #[test]
    fn seeded_random_sessions_keep_the_invariants() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xa9e);
        let ids = [0i64, 1, 2, 3, 4, 7, 10, 11, -1, i64::MAX];
        for _ in 0..3000 {
            let mut input = vec![rng.random::<u8>()];
            for _ in 0..rng.random_range(1..50) {
                let id = ids[rng.random_range(0..ids.len())];
                let p = match rng.random_range(0..10) {
                    0 | 1 => Packet::dial_req("h:1", id),
                    2 => Packet::data(id, Bytes::from_static(b"data")),
                    3 => Packet::close_req(id),
                    4 => Packet::dial_cls(id),
                    5 => Packet::window_update(id, ids[rng.random_range(0..ids.len())]),
                    6 => Packet {
                        r#type: rng.random_range(0..200),
                        payload: None,
                    },
                    _ => {
                        input.extend_from_slice(&[
                            rng.random_range(0xf8..=0xff),
                            rng.random_range(0..6),
                        ]);
                        continue;
                    }
                };
                let bytes = p.encode_to_vec();
                input.extend_from_slice(&[0, u8::try_from(bytes.len()).unwrap_or(0)]);
                input.extend_from_slice(&bytes);
            }
            run_bytes(&input);
            let raw: Vec<u8> = (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect();
            run_bytes(&raw);
        }
    }
}
