//! A deterministic driver of the agent's session state machine
//! ([`super::link::SessionLink`]), for the fuzzer
//! (`fuzz/fuzz_targets/server_packets.rs`) and unit tests: arbitrary packets
//! from a server interleaved with the agent's own events (a dial completes or
//! fails, a destination closes or stalls), with the invariants checked after
//! every step. No runtime, sockets, channels or clocks are involved.

use std::collections::{HashMap, HashSet};

use super::link::{Action, Actions, Handled, SessionLink};
use crate::proto::{Packet, PacketType};

/// A cancel handle the harness can inspect.
#[derive(Debug, Default, Clone)]
pub struct Flag(std::rc::Rc<std::cell::Cell<bool>>);

/// The machine under test and what its peers observed.
pub struct Harness {
    link: SessionLink<u64, Flag>,
    out: Actions<u64, Flag>,
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
            link: SessionLink::new(flow),
            out: Actions::new(),
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

    /// Connection `id`'s destination stalls.
    pub fn conn_stalls(&mut self, id: i64) {
        self.link.stalled(id, &mut self.out);
        self.apply();
    }

    fn nth_dial(&self, n: usize) -> Option<i64> {
        (!self.dials.is_empty()).then(|| self.dials[n % self.dials.len()])
    }

    /// Carries out the actions like the driver would, checking each.
    fn apply(&mut self) {
        while let Some(a) = self.out.pop_front() {
            match a {
                Action::Send(p) => match p.kind() {
                    Some(PacketType::DialRsp) => {
                        if let Some(crate::proto::Payload::DialResponse(r)) = &p.payload {
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
                    }
                    Some(PacketType::CloseRsp) => {}
                    k => panic!("the agent sent {k:?}"),
                },
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
    /// are the ones it connected with; IDs are never reused.
    pub fn check(&self) {
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
        // Nothing is started after the end.
        self.link
            .on_packet(Packet::dial_req("h:1", 1), &mut self.out);
        assert!(self.out.is_empty());
    }
}

/// Runs one fuzz input: `[flags, (op, len, bytes…)*]`. Bit 0 of `flags`
/// turns flow control on. Ops `0xfc..=0xff` are the agent's own events on
/// dial or connection number `len` (connects, fails, ends, stalls); any
/// other op feeds the next `len` bytes decoded as a packet from the server
/// (undecodable ones are skipped).
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
                            rng.random_range(0xfc..=0xff),
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
