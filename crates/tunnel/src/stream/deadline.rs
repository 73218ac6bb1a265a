//! Deadline arithmetic that cannot panic. `Instant + Duration` panics when
//! the sum leaves the clock's range, and the durations come from
//! configuration files (humantime parses "300000000000y"); the link
//! machines and the dial path compute every deadline here instead. Pure:
//! the machines use it and stay sans-IO.

use std::time::{Duration, Instant};

/// Far enough to never come in a process's life, near enough to add to
/// any instant a clock returns.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `at + d`, or a far future when that leaves the clock's range.
pub fn later(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(FAR))
        .unwrap_or(at)
}

/// An instant as long before `now` as the clock allows (at most [`FAR`]).
pub fn earliest(now: Instant) -> Instant {
    now.checked_sub(FAR)
        .or_else(|| now.checked_sub(Duration::from_secs(3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_duration_gives_a_far_future_not_a_panic() {
        let now = Instant::now();
        assert_eq!(
            later(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        let far = later(now, Duration::MAX);
        assert!(far > now + Duration::from_secs(10 * 365 * 24 * 3600));
        assert!(earliest(now) < now);
    }
}
