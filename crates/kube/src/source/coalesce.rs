//! Bursts of "changed" turned into one wake-up.

use std::fmt::Debug;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Turns a stream of "changed" into one wake-up per burst.
pub(super) struct Coalescer {
    pub(super) changed: mpsc::Receiver<()>,
    pub(super) stop: CancellationToken,
}

impl Coalescer {
    /// Waits for the next burst to settle (200 ms quiet, at most 2 s after
    /// its first event), or for the status tick.
    pub(super) async fn next(&mut self) -> Wake {
        let burst = tokio::select! {
            c = self.changed.recv() => c.is_some(),
            () = tokio::time::sleep(STATUS_EVERY) => false,
            () = self.stop.cancelled() => return Wake::Stop,
        };
        if !burst {
            return Wake::Tick;
        }
        let deadline = tokio::time::Instant::now() + MAX_DELAY;
        loop {
            let quiet = tokio::time::Instant::now() + QUIET;
            tokio::select! {
                c = self.changed.recv() => if c.is_none() { return Wake::Changed },
                () = tokio::time::sleep_until(quiet.min(deadline)) => return Wake::Changed,
                () = self.stop.cancelled() => return Wake::Stop,
            }
            if tokio::time::Instant::now() >= deadline {
                return Wake::Changed;
            }
        }
    }
}

/// Why the loop woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    /// Objects changed: translate and apply.
    Changed,
    /// Only time passed: write status (health moves without events).
    Tick,
    /// Stopped.
    Stop,
}

/// Quiet time after the last event before a snapshot is built.
pub const QUIET: Duration = Duration::from_millis(200);
/// Longest wait after the first event of a burst.
pub const MAX_DELAY: Duration = Duration::from_secs(2);
/// How often the status leader compares status with what it should be
/// (besides after every snapshot).
pub const STATUS_EVERY: Duration = Duration::from_secs(10);
