//! A per-stream budget of packets that move nothing: PINGs, DRAINs, empty
//! DATA, and packets naming a dial or connection the stream does not have
//! (or breaking the protocol). Each costs the receiving side a little, and
//! a stream that sends them without end would take a worker thread shared
//! with every other tenant; past the budget the stream is ended, hurting
//! its own cluster only. Legitimate agents send such packets rarely: a
//! PING per keepalive interval, one DRAIN, stray packets around closes.

use std::time::{Duration, Instant};

/// Idle packets a stream may send at once.
pub const BURST: u32 = 1_024;
/// And per second after that.
pub const PER_SECOND: u32 = 256;
/// After a stream of a cluster was cut for its idle packets, that
/// cluster's new streams are refused (`UNAVAILABLE`, the agent backs off)
/// for this long: reconnecting at once would give a flood a fresh budget
/// every time.
pub const COOLDOWN: std::time::Duration = std::time::Duration::from_secs(5);

/// One stream's budget: a token bucket over explicit time.
#[derive(Debug, Clone)]
pub struct Budget {
    tokens: u32,
    since: Instant,
}

impl Budget {
    /// A full budget at `now`.
    pub fn new(now: Instant) -> Budget {
        Budget {
            tokens: BURST,
            since: now,
        }
    }

    /// Spends one at `now`; `false` once the stream has spent more than
    /// its budget (then it is to be ended).
    pub fn spend(&mut self, now: Instant) -> bool {
        const NANOS: u128 = 1_000_000_000;
        let elapsed = now.saturating_duration_since(self.since).as_nanos();
        let earned = elapsed.saturating_mul(u128::from(PER_SECOND)) / NANOS;
        if earned > 0 {
            let whole = u32::try_from(earned).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(whole).min(BURST);
            // Only whole tokens are earned; the rest of the time counts
            // towards the next one (the time used is never rounded to 0).
            let used = earned * NANOS / u128::from(PER_SECOND);
            self.since = if self.tokens == BURST {
                now
            } else {
                self.since + Duration::from_nanos(u64::try_from(used).unwrap_or(u64::MAX))
            };
        }
        match self.tokens.checked_sub(1) {
            Some(t) => {
                self.tokens = t;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The burst, then the rate; a quiet stream earns the burst back, no
    /// more; a flood at one instant is cut after the burst.
    #[test]
    fn a_flood_is_cut_after_the_burst_and_the_rate_refills() {
        let t0 = Instant::now();
        let mut b = Budget::new(t0);
        assert_eq!(
            (0..BURST * 2).filter(|_| b.spend(t0)).count(),
            BURST as usize
        );
        assert!(!b.spend(t0));
        let t1 = t0 + Duration::from_millis(500);
        let n = (0..BURST).filter(|_| b.spend(t1)).count();
        assert_eq!(n, (PER_SECOND / 2) as usize);
        let t2 = t1 + Duration::from_secs(3600);
        assert_eq!(
            (0..BURST * 2).filter(|_| b.spend(t2)).count(),
            BURST as usize
        );
        // Sent 100 µs apart (ten times the rate), a flood is cut
        // once the burst is gone, whatever the step.
        let mut b = Budget::new(t0);
        let cut = (0..100_000u64)
            .position(|i| !b.spend(t0 + Duration::from_micros(i * 100)))
            .unwrap_or(usize::MAX);
        assert!(cut < 200_000 && cut > BURST as usize, "{cut}");
        // Spread out at the rate, a stream is never cut.
        let mut b = Budget::new(t0);
        for i in 0..(PER_SECOND * 20) {
            let at = t0 + Duration::from_micros(u64::from(i) * 1_000_000 / u64::from(PER_SECOND));
            assert!(b.spend(at), "packet {i}");
        }
    }
}
