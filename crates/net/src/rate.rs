//! A rate per source address (an IPv4 address, an IPv6 /64): a token
//! bucket each, for work an anonymous peer can ask for, such as a TLS
//! handshake. Hand-written: a few lines over a map, where a keyed limiter
//! crate would add a dependency tree for the same arithmetic.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Instant;

/// Sources remembered at most; past it, sources whose bucket has filled
/// up again are forgotten (they would start full anyway), and if none
/// has, the map is cleared: memory stays bounded whatever the number of
/// sources, at worst giving some a fresh burst.
const MAX_SOURCES: usize = 65_536;

/// A token bucket per source: `rate` per second, at most `burst` at once.
pub struct PerSource {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl PerSource {
    /// `rate` per second and `burst` per source (`rate` ≤ 0: unlimited).
    pub fn new(rate: f64, burst: f64) -> PerSource {
        PerSource {
            rate,
            burst: burst.max(1.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `ip` at `now`: whether it had one.
    pub fn allow(&self, ip: IpAddr, now: Instant) -> bool {
        if self.rate <= 0.0 || !self.rate.is_finite() {
            return true;
        }
        let key = crate::admin::source_key(ip);
        let mut m = crate::sync::lock(&self.buckets, "rate per source");
        if m.len() >= MAX_SOURCES && !m.contains_key(&key) {
            let (rate, burst) = (self.rate, self.burst);
            m.retain(|_, (tokens, at)| {
                *tokens + now.saturating_duration_since(*at).as_secs_f64() * rate < burst
            });
            if m.len() >= MAX_SOURCES {
                m.clear();
            }
        }
        let (tokens, at) = m.entry(key).or_insert((self.burst, now));
        let refill = now.saturating_duration_since(*at).as_secs_f64() * self.rate;
        *tokens = (*tokens + refill).min(self.burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    /// A burst, then the rate; each source (an IPv6 /64) on its own.
    #[test]
    fn each_source_gets_its_burst_then_its_rate() {
        let r = PerSource::new(2.0, 3.0);
        let t0 = Instant::now();
        let a = ip("10.0.0.1");
        assert_eq!((0..5).filter(|_| r.allow(a, t0)).count(), 3);
        // Another source is not affected; an address in the same /64 is
        // the same source.
        assert!(r.allow(ip("10.0.0.2"), t0));
        let v6 = ip("2001:db8::1");
        assert_eq!((0..5).filter(|_| r.allow(v6, t0)).count(), 3);
        assert!(!r.allow(ip("2001:db8::ffff"), t0));
        // Half a second gives one token back at 2/s; a long wait only
        // refills to the burst.
        assert!(r.allow(a, t0 + Duration::from_millis(500)));
        assert!(!r.allow(a, t0 + Duration::from_millis(500)));
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..10).filter(|_| r.allow(a, later)).count(), 3);
    }

    #[test]
    fn a_rate_of_zero_is_unlimited_and_memory_stays_bounded() {
        let off = PerSource::new(0.0, 1.0);
        assert!((0..100).all(|_| off.allow(ip("10.0.0.1"), Instant::now())));
        let r = PerSource::new(1.0, 1.0);
        let t0 = Instant::now();
        for i in 0..(MAX_SOURCES as u32 + 10) {
            r.allow(IpAddr::from(i.to_be_bytes()), t0);
        }
        let kept = crate::sync::lock(&r.buckets, "test").len();
        assert!(kept <= MAX_SOURCES, "{kept}");
    }
}
