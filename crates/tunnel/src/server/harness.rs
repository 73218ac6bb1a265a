//! A deterministic driver of the server's agent-link state machine
//! ([`super::link::LinkMachine`]), for the fuzzer
//! (`fuzz/fuzz_targets/agent_packets.rs`) and unit tests: a link with three
//! pending dials and three established connections receives arbitrary
//! packets at times the caller chooses, and the invariants are checked after
//! every step. No runtime, sockets, channels or clocks are involved: the
//! connection ends and dial replies are plain numbers, time is a value the
//! harness advances, and every action the machine asks for is checked
//! against what the peers have seen. Advancing time fires the machine's
//! timers in order, as the driver's sleep until
//! [`LinkMachine::poll_timeout`] would.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::link::{Action, Actions, Handled, LinkMachine, Timers};
use crate::stream::flow::WINDOW;
use crate::wire::proto::{Packet, PacketType};

/// Dial IDs pending at the start.
pub const PENDING: [i64; 3] = [1001, 1002, 1003];
/// Connection IDs established at the start.
pub const OPEN: [i64; 3] = [1, 2, 3];
/// The timers of the link under test.
pub const TIMERS: Timers = Timers {
    stall: Duration::from_secs(10),
    unresponsive_after: Duration::from_secs(12),
};
/// The pending dials' deadline after the start.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(30);

/// The link under test and what its peers observed.
pub struct Harness {
    link: LinkMachine<u64, i64>,
    out: Actions<u64, i64>,
    /// The harness's clock.
    now: Instant,
    /// Dials answered so far (each at most once).
    answered: HashSet<i64>,
    /// Connection ends handed back (each at most once).
    released: HashSet<u64>,
    /// Window each open connection's sender holds (flow control).
    window: std::collections::HashMap<i64, i64>,
    /// Outcomes of every step so far.
    pub handled: Vec<Handled>,
}

impl Harness {
    /// A link (flow control on if `flow`) with [`PENDING`] dials and
    /// [`OPEN`] connections, its agent heard from at `start`.
    pub fn new(flow: bool, start: Instant) -> Harness {
        let mut h = Harness {
            link: LinkMachine::new(flow, TIMERS),
            out: Actions::new(),
            now: start,
            answered: HashSet::new(),
            released: HashSet::new(),
            window: std::collections::HashMap::new(),
            handled: Vec::new(),
        };
        h.link.heard(start);
        let deadline = start + DIAL_TIMEOUT;
        // Open connections: dialed and answered before the fuzzing starts.
        for (n, id) in OPEN.iter().enumerate() {
            let random = 900 + i64::try_from(n).unwrap_or(0);
            h.link
                .dial(random, "open:1", deadline, random, ends_of(*id), &mut h.out);
            h.link.on_packet(
                start,
                Packet::dial_rsp(random, *id, String::new()),
                &mut h.out,
            );
        }
        for id in PENDING {
            h.link
                .dial(id, "pending:1", deadline, id, ends_of(id), &mut h.out);
        }
        h.out.clear();
        if flow {
            for id in OPEN {
                h.window.insert(id, 0);
            }
        }
        h
    }

    /// Moves the clock by `by`, firing every timer that comes due on the
    /// way, in order (what the driver's sleep does).
    pub fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        while let Some(at) = self.link.poll_timeout().filter(|at| *at <= until) {
            self.now = self.now.max(at);
            let h = self.link.handle_timeout(self.now, &mut self.out);
            self.apply(h.unwrap_or(Handled::Ok));
            if let Some(h) = h {
                self.handled.push(h);
            }
            // Nothing is left due: the driver would spin otherwise.
            assert!(
                self.link.poll_timeout().is_none_or(|next| next > self.now),
                "a timer still due after handle_timeout"
            );
            self.check();
        }
        self.now = until;
    }

    /// The agent was heard from now.
    pub fn agent_heard(&mut self) {
        self.link.heard(self.now);
    }

    /// Feeds one packet now, then checks the invariants.
    pub fn step(&mut self, p: Packet) {
        let h = self.link.on_packet(self.now, p, &mut self.out);
        let h = self.apply(h);
        self.handled.push(h);
        self.check();
    }

    /// Simulates the frontend closing connection `id`.
    pub fn frontend_closes(&mut self, id: i64) {
        self.link.close(self.now, id, &mut self.out);
        self.apply(Handled::Ok);
        self.check();
    }

    /// Carries out the actions like the driver would, checking each; DATA
    /// never fits (the harness has no reader), so every delivery waits for
    /// room until its stall deadline, the stream reading nothing meanwhile.
    fn apply(&mut self, mut h: Handled) -> Handled {
        while let Some(a) = self.out.pop_front() {
            match a {
                Action::Send(p) => assert!(
                    matches!(p.kind(), Some(PacketType::CloseReq | PacketType::DialCls)),
                    "unexpected reply {p:?}"
                ),
                Action::Finish(_, p) => {
                    if let Some(p) = p {
                        assert_eq!(p.kind(), Some(PacketType::CloseReq), "{p:?}");
                    }
                }
                Action::Deliver(id, _) => {
                    assert!(self.link.conn(id).is_some(), "delivery to {id}, not open");
                    h = self.wait_out_the_stall(id);
                }
                Action::Reopen(id, n) => h = self.reopen(id, n).unwrap_or(h),
                Action::Answer(dial, r) => {
                    assert!(self.answered.insert(dial), "dial {dial} answered twice");
                    if let Ok(id) = r {
                        assert!(id != 0);
                        assert!(self.link.conn(id).is_some(), "answered {id} not open");
                    }
                }
                Action::End(c) | Action::Abort(c) => {
                    assert!(self.released.insert(c), "ends {c} released twice");
                }
            }
        }
        h
    }

    /// Connection `id`'s DATA did not fit: the clock runs until the stall
    /// deadline gives it up (firing the timers due before it too).
    fn wait_out_the_stall(&mut self, id: i64) -> Handled {
        self.link.blocked(self.now, id);
        let mut h = None;
        while self.link.waiting().is_some() {
            let Some(at) = self.link.poll_timeout() else {
                panic!("a connection waits for room with no stall deadline");
            };
            self.now = self.now.max(at);
            h = self.link.handle_timeout(self.now, &mut self.out).or(h);
        }
        assert_eq!(h, Some(Handled::Stalled));
        Handled::Stalled
    }

    /// What the driver's credit does with a reopened window: one beyond
    /// its size is a violation.
    fn reopen(&mut self, id: i64, n: i64) -> Option<Handled> {
        assert!(self.link.conn(id).is_some(), "window for {id}, not open");
        let w = self.window.entry(id).or_insert(0);
        let fits = n > 0
            && w.checked_add(n)
                .is_some_and(|v| v <= i64::try_from(WINDOW).unwrap_or(0));
        if fits {
            *w += n;
            return None;
        }
        Some(self.link.window_violated(self.now, id, &mut self.out))
    }

    /// The invariants of the state machine:
    /// - a connection is never both open and closing;
    /// - at most the initial connections plus the initial dials are open,
    ///   and closing;
    /// - an open connection's ends were never released;
    /// - no timer is left due, so no closed ID is kept past
    ///   [`super::link::CLOSING_TTL`] and the sweep's delay.
    pub fn check(&mut self) {
        let open: Vec<i64> = self.link.open().collect();
        for id in &open {
            assert!(
                !self.link.is_closing(*id),
                "connection {id} both open and closing"
            );
        }
        let most = OPEN.len() + PENDING.len();
        assert!(open.len() <= most, "{open:?}");
        assert!(
            self.link.closing() <= most,
            "closing: {}",
            self.link.closing()
        );
        for id in open {
            if let Some(c) = self.link.conn(id) {
                assert!(!self.released.contains(c), "open {id} was released");
            }
        }
        if let Some(at) = self.link.poll_timeout() {
            assert!(at > self.now, "a timer was left due at {at:?}");
        }
    }

    /// Ends the stream (the agent went away) and checks everything failed:
    /// every dial answered, every connection's ends released.
    pub fn agent_dies(mut self) {
        self.link.end(&mut self.out);
        self.apply(Handled::Ok);
        assert_eq!(self.link.load(), 0);
        assert_eq!(self.link.poll_timeout(), None);
        for id in PENDING {
            assert!(self.answered.contains(&id), "dial {id} never answered");
        }
        for id in OPEN {
            assert!(self.released.contains(&ends_of(id)), "{id} never released");
        }
    }
}

/// The number standing for connection `id`'s ends (dial IDs and connection
/// IDs differ, so each open or pending one has its own).
fn ends_of(id: i64) -> u64 {
    id.unsigned_abs()
}

/// Runs one fuzz input: `[flags, (op, advance-seconds, len, bytes…)*]`.
/// Bit 0 of `flags` turns flow control on. Every op first advances the
/// clock (firing the timers due), then: `0xff` is a frontend closing
/// connection `len - 8`; `0xfe` advances the clock `len` × 10 ms more;
/// `0xfd` is a read from the agent (it is heard from now); any other op
/// feeds the next `len` bytes decoded as a packet (undecodable ones are
/// skipped).
pub fn run_bytes(data: &[u8]) {
    use prost::Message;
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let mut h = Harness::new(flags & 1 == 1, Instant::now());
    while let [op, adv, len, tail @ ..] = rest {
        h.advance(Duration::from_secs(u64::from(*adv)));
        rest = tail;
        match *op {
            0xff => h.frontend_closes(i64::from(*len) - 8),
            0xfe => h.advance(Duration::from_millis(10 * u64::from(*len))),
            0xfd => h.agent_heard(),
            _ => {
                let n = usize::from(*len).min(tail.len());
                let (msg, next) = tail.split_at(n);
                if let Ok(p) = Packet::decode(msg) {
                    h.step(p);
                }
                rest = next;
            }
        }
    }
    h.agent_dies();
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn known_and_unknown_ids() {
        let mut h = Harness::new(true, Instant::now());
        h.step(Packet::dial_rsp(1001, 7, String::new()));
        h.step(Packet::dial_rsp(1001, 8, String::new())); // answered twice
        h.step(Packet::dial_rsp(4242, 9, String::new())); // never asked
        h.step(Packet::data(7, Bytes::from_static(b"x")));
        h.step(Packet::data(99, Bytes::from_static(b"x")));
        h.step(Packet::window_update(1, 1000));
        h.step(Packet::window_update(1, i64::try_from(WINDOW).unwrap_or(0))); // more than was used
        h.step(Packet::close_rsp(2, String::new()));
        h.frontend_closes(3);
        h.step(Packet::data(3, Bytes::from_static(b"late")));
        h.step(Packet::close_rsp(3, String::new()));
        h.step(Packet {
            r#type: 77,
            payload: None,
        });
        assert_eq!(
            h.handled,
            vec![
                Handled::Ok,
                Handled::Unrecognized,
                Handled::Unrecognized,
                Handled::Stalled,
                Handled::Unrecognized,
                Handled::Ok,
                Handled::Unexpected,
                Handled::Ok,
                Handled::Ok,
                Handled::Ok,
                Handled::Unexpected,
            ]
        );
        h.agent_dies();
    }

    #[test]
    fn timers_fire_in_order_as_the_clock_advances() {
        let t0 = Instant::now();
        let mut h = Harness::new(false, t0);
        // The agent keeps being heard from: the dials wait for their
        // deadline, then fail together.
        for _ in 0..3 {
            h.advance(Duration::from_secs(10));
            h.agent_heard();
        }
        assert!(h.handled.is_empty());
        assert_eq!(h.link.pending(), 0, "timed out at {DIAL_TIMEOUT:?}");
        h.frontend_closes(1);
        assert_eq!(h.link.closing(), 1);
        h.advance(super::super::link::CLOSING_TTL * 2);
        assert_eq!(h.link.closing(), 0);
        h.agent_dies();
    }

    #[test]
    fn a_silent_agent_fails_the_pending_dials() {
        let mut h = Harness::new(false, Instant::now());
        h.advance(TIMERS.unresponsive_after + Duration::from_secs(1));
        assert_eq!(h.link.pending(), 0);
        assert_eq!(h.answered.len(), PENDING.len());
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
                            rng.random_range(0xfd..=0xff),
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
