//! Per-cluster limits, so one noisy cluster cannot starve the others on a
//! shared server: concurrent tunneled connections (pending dials count),
//! a dial rate (token bucket) and agent streams. Refusals are typed
//! ([`Limited`]) and counted by the caller.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A cluster's limits (0 = unlimited).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Tunneled connections open or being dialled at once.
    pub max_connections: usize,
    /// New dials per second, sustained.
    pub dial_rate: f64,
    /// Dials allowed in a burst above the rate.
    pub dial_burst: f64,
    /// Agent streams at once.
    pub max_agents: usize,
    /// Bytes queued towards frontends across the cluster's connections.
    pub max_queued_bytes: usize,
}

impl From<crate::config::ClusterLimits> for Limits {
    fn from(c: crate::config::ClusterLimits) -> Limits {
        Limits {
            max_connections: c.max_connections,
            dial_rate: c.dial_rate,
            dial_burst: c.dial_burst,
            max_agents: c.max_agents,
            max_queued_bytes: c.max_queued_bytes,
        }
    }
}

impl Limits {
    /// No limit at all.
    pub const UNLIMITED: Limits = Limits {
        max_connections: 0,
        dial_rate: 0.0,
        dial_burst: 0.0,
        max_agents: 0,
        max_queued_bytes: 0,
    };
}

pub use crate::wire::dial_error::Limited;

struct Bucket {
    limits: Limits,
    tokens: f64,
    last: Instant,
}

/// The state behind one cluster's limits.
pub struct Gate {
    conns: Arc<AtomicUsize>,
    bucket: Mutex<Bucket>,
    /// Bytes queued across the cluster's connections, and the cap.
    queued: crate::stream::queue::Budget,
}

/// One admitted connection; dropping it frees its slot.
pub struct ConnPermit(Arc<AtomicUsize>);

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// A gate with full burst.
    pub fn new(limits: Limits) -> Gate {
        Gate {
            conns: Arc::new(AtomicUsize::new(0)),
            queued: crate::stream::queue::Budget::new(limits.max_queued_bytes),
            bucket: Mutex::new(Bucket {
                limits,
                tokens: limits.dial_burst.max(1.0),
                last: crate::stream::clock::now(),
            }),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        seedlink_net::sync::lock(&self.bucket, "dial bucket").limits
    }

    /// Replaces the limits (configuration reload); open connections stay.
    pub fn set(&self, limits: Limits) {
        let mut b = seedlink_net::sync::lock(&self.bucket, "dial bucket");
        b.tokens = b.tokens.min(limits.dial_burst.max(1.0));
        b.limits = limits;
        self.queued.set_limit(limits.max_queued_bytes);
    }

    /// The budget every connection's queue of this cluster shares.
    pub fn queue_budget(&self) -> crate::stream::queue::Budget {
        self.queued.clone()
    }

    /// Tunneled connections holding a permit.
    pub fn connections(&self) -> usize {
        self.conns.load(Ordering::Acquire)
    }

    /// Admits one new dial at `now`, or says which limit refuses it.
    pub fn admit(&self, now: Instant) -> Result<ConnPermit, Limited> {
        let mut b = seedlink_net::sync::lock(&self.bucket, "dial bucket");
        let l = b.limits;
        if l.max_connections > 0 && self.conns.load(Ordering::Acquire) >= l.max_connections {
            return Err(Limited::Connections);
        }
        if l.dial_rate > 0.0 {
            let burst = l.dial_burst.max(1.0);
            let dt = now.saturating_duration_since(b.last).as_secs_f64();
            b.tokens = (b.tokens + dt * l.dial_rate).min(burst);
            b.last = now;
            if b.tokens < 1.0 {
                return Err(Limited::DialRate);
            }
            b.tokens -= 1.0;
        }
        self.conns.fetch_add(1, Ordering::AcqRel);
        Ok(ConnPermit(self.conns.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limits(conns: usize, rate: f64, burst: f64) -> Limits {
        Limits {
            max_connections: conns,
            dial_rate: rate,
            dial_burst: burst,
            max_agents: 0,
            max_queued_bytes: 0,
        }
    }

    #[test]
    fn connections_are_capped_and_freed() {
        let g = Gate::new(limits(2, 0.0, 0.0));
        let t = Instant::now();
        let a = g.admit(t).ok();
        let b = g.admit(t).ok();
        assert!(a.is_some() && b.is_some());
        assert_eq!(g.admit(t).err(), Some(Limited::Connections));
        drop(a);
        assert!(g.admit(t).is_ok());
        assert_eq!(g.connections(), 1);
    }

    #[test]
    fn dial_rate_is_a_token_bucket() {
        let g = Gate::new(limits(0, 10.0, 5.0));
        let t = Instant::now();
        let mut held = Vec::new();
        for _ in 0..5 {
            held.push(g.admit(t).ok());
        }
        assert!(held.iter().all(Option::is_some));
        assert_eq!(g.admit(t).err(), Some(Limited::DialRate));
        // 100 ms later one token came back (10/s); not two.
        let t2 = t + Duration::from_millis(100);
        assert!(g.admit(t2).is_ok());
        assert_eq!(g.admit(t2).err(), Some(Limited::DialRate));
        // A long pause refills only up to the burst.
        let t3 = t2 + Duration::from_secs(60);
        for _ in 0..5 {
            assert!(g.admit(t3).is_ok());
        }
        assert_eq!(g.admit(t3).err(), Some(Limited::DialRate));
        // Lowered by a reload: takes effect at once.
        g.set(limits(0, 1.0, 1.0));
        let t4 = t3 + Duration::from_secs(10);
        assert!(g.admit(t4).is_ok());
        assert_eq!(g.admit(t4).err(), Some(Limited::DialRate));
    }

    #[test]
    fn the_default_dial_rate_is_never_the_bottleneck() {
        // Ten seconds at twice the highest dial rate measured through one
        // cluster: the default limits refuse nothing.
        let g = Gate::new(crate::config::ClusterLimits::default().into());
        let t = Instant::now();
        let rate = 2.0 * crate::config::MEASURED_DIALS_PER_SEC;
        for i in 0..(rate as u64 * 10) {
            let at = t + Duration::from_secs_f64(i as f64 / rate);
            assert!(g.admit(at).is_ok(), "dial {i} refused by the defaults");
        }
    }
}
