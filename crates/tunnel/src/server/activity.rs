//! When an agent connection last delivered a byte.
//!
//! The server sends an HTTP/2 PING to every agent connection after each
//! `keepalive` interval without a read (hyper's keepalive), and a live agent
//! answers it within a round trip, so a connection that has delivered
//! nothing for longer than `keepalive` plus a grace is frozen or cut off.
//! hyper only acts on that after `keepalive + keepalive_timeout` (it closes
//! the connection); until then dials would be sent into the silence and
//! wait their whole timeout. [`Watched`] stamps every successful read on
//! the raw agent socket, and a dial consults the stamp to go to another
//! agent or fail at once ([`super::DialError::Unresponsive`]).
//!
//! Hand-written (a read stamp on [`ReadTap`]): hyper exposes neither its
//! PING acknowledgements nor its last-read time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::transport::tap::{OnRead, ReadTap};

/// The process's time origin for the stamps (an `Instant` cannot be
/// stored in an atomic; milliseconds since this one can).
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(crate::stream::clock::now)
}

/// Milliseconds since [`origin`], offset by about 50 days so that a stamp
/// can be moved into the past right after start (tests) without clamping.
fn now_ms() -> u64 {
    let since = crate::stream::clock::now().saturating_duration_since(origin());
    u64::try_from(since.as_millis())
        .unwrap_or(u64::MAX >> 1)
        .saturating_add(1 << 32)
}

/// The last read of one agent connection, shared by its streams.
#[derive(Debug)]
pub struct Activity {
    last_read_ms: AtomicU64,
}

impl Activity {
    /// Stamped now (a connection that just completed its handshake).
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            last_read_ms: AtomicU64::new(now_ms()),
        })
    }

    /// Stamps a read now.
    pub fn touch(&self) {
        self.last_read_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Moves the stamp `by` into the past (tests, instead of sleeping).
    #[cfg(test)]
    pub fn backdate(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.last_read_ms.fetch_sub(ms, Ordering::Relaxed);
    }

    /// How long since the connection last delivered a byte.
    pub fn silent_for(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.last_read_ms.load(Ordering::Relaxed)))
    }
}

/// The silence after which an agent counts as unresponsive: its PING
/// interval (a live agent's answer arrives well within it) plus a grace of
/// a fifth of the interval, at least one second, for a slow round trip.
pub fn unresponsive_after(keepalive: Duration) -> Duration {
    keepalive + (keepalive / 5).max(Duration::from_secs(1))
}

impl OnRead for Arc<Activity> {
    fn on_read(&mut self, _bytes: &[u8]) {
        self.touch();
    }
}

/// A transport that stamps [`Activity`] on every read that returns bytes.
pub type Watched<IO> = ReadTap<IO, Arc<Activity>>;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn grace_is_a_fifth_of_the_interval_and_at_least_a_second() {
        assert_eq!(
            unresponsive_after(Duration::from_secs(10)),
            Duration::from_secs(12)
        );
        assert_eq!(
            unresponsive_after(Duration::from_secs(2)),
            Duration::from_secs(3)
        );
    }

    #[tokio::test]
    async fn reads_stamp_and_silence_grows() {
        let (a, mut b) = tokio::io::duplex(64);
        let act = Activity::new();
        // Backdate the stamp instead of sleeping.
        act.backdate(Duration::from_secs(5));
        assert!(act.silent_for() >= Duration::from_secs(5));
        let mut w = Watched::new(a, act.clone());
        w.write_all(b"x").await.unwrap();
        assert!(
            act.silent_for() >= Duration::from_secs(5),
            "writes don't count"
        );
        b.write_all(b"y").await.unwrap();
        let mut buf = [0u8; 1];
        w.read_exact(&mut buf).await.unwrap();
        assert!(act.silent_for() < Duration::from_secs(5));
    }
}
