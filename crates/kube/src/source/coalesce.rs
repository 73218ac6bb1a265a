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
    /// Waits for the next burst to settle (200 ms quiet, at most 500 ms after
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
/// Longest wait after the first event of a burst: what a change waits at
/// most while other tenants keep changing (their events never leave
/// [`QUIET`] time), before its pass.
pub const MAX_DELAY: Duration = Duration::from_millis(500);
/// How often the status leader compares status with what it should be
/// (besides after every snapshot).
pub const STATUS_EVERY: Duration = Duration::from_secs(10);

/// What writes status from a source's passes (the routes', policies' and
/// Gateways', or the TunnelClusters').
pub(super) trait StatusTask: Send + 'static {
    /// What a pass hands it.
    type Pass: Send + Sync + 'static;
    /// Writes the status `pass` calls for (what changed; within the shared
    /// budget, so it may take a while).
    fn write(&mut self, pass: &Self::Pass) -> impl std::future::Future<Output = ()> + Send;
}

/// Runs `task` apart from the passes: it writes from the latest pass
/// handed to the returned sender, after each new one and every
/// [`STATUS_EVERY`] (health moves without events). Status writes wait
/// for their budget; here they never hold up the next pass, so a change
/// is served while a cold start's thousands of statuses are still being
/// written. A pass handed over while one is being written replaces any
/// that waited: status is written from the newest objects, none lost.
pub(super) fn follow_passes<T: StatusTask>(
    mut task: T,
    stop: CancellationToken,
) -> tokio::sync::watch::Sender<Option<std::sync::Arc<T::Pass>>> {
    let (tx, mut rx) = tokio::sync::watch::channel::<Option<std::sync::Arc<T::Pass>>>(None);
    tokio::spawn(async move {
        loop {
            let pass = rx.borrow_and_update().clone();
            if let Some(p) = pass {
                tokio::select! {
                    () = task.write(&p) => {}
                    () = stop.cancelled() => return,
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = tokio::time::sleep(STATUS_EVERY) => {}
                () = stop.cancelled() => return,
            }
        }
    });
    tx
}
