//! Rate-limited log lines: a token bucket in front of the per-connection
//! refusal lines, so a flood of bad connections cannot flood the log. What
//! the bucket drops is counted, never silently lost.

use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;

/// A token bucket of log lines.
pub struct LogLimiter {
    state: Mutex<(f64, Instant)>,
    rate: f64,
    burst: f64,
    /// Lines dropped because the bucket was empty.
    pub dropped: Counter,
}

impl LogLimiter {
    /// `rate` lines per second on average, `burst` at once.
    pub fn new(rate: f64, burst: f64) -> LogLimiter {
        LogLimiter {
            state: Mutex::new((burst, Instant::now())),
            rate,
            burst,
            dropped: Counter::default(),
        }
    }

    /// Whether a line may be written now; a refusal is counted in `dropped`.
    pub fn allow(&self) -> bool {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> bool {
        let mut s = crate::sync::lock(&self.state, "log limiter");
        let (tokens, last) = *s;
        let refilled = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.rate)
            .min(self.burst);
        if refilled >= 1.0 {
            *s = (refilled - 1.0, now);
            true
        } else {
            *s = (refilled, now);
            self.dropped.inc();
            false
        }
    }
}

impl Default for LogLimiter {
    /// 20 lines per second, 100 at once.
    fn default() -> Self {
        LogLimiter::new(20.0, 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_lines_are_dropped_and_counted_until_it_refills() {
        let l = LogLimiter::new(10.0, 5.0);
        let t0 = Instant::now();
        let passed = (0..20).filter(|_| l.allow_at(t0)).count();
        assert_eq!(passed, 5);
        assert_eq!(l.dropped.get(), 15);
        // Half a second later five more (10/s).
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!((0..20).filter(|_| l.allow_at(t1)).count(), 5);
    }
}
