//! What a started source gives its caller: the handle that stops it and
//! its readiness.

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::metrics::SourceMetrics;
use super::watches::WatchErrors;
use crate::leader::Leadership;

/// A running source.
pub struct Handle {
    /// True once the first complete snapshot was applied.
    pub(super) synced: watch::Receiver<bool>,
    /// The watches' last errors, by kind.
    pub(super) errors: WatchErrors,
    /// Whether this replica writes status.
    pub leadership: Leadership,
    /// Stops the source's tasks.
    pub(super) stop: CancellationToken,
    /// The lease campaign (which releases a held lease when it stops).
    pub(super) campaign: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The source's metrics.
    pub(super) metrics: SourceMetrics,
}

/// Whether a source's first snapshot is applied, and if not, why.
#[derive(Clone)]
pub struct Readiness {
    synced: watch::Receiver<bool>,
    errors: WatchErrors,
}

impl Readiness {
    /// `None` once the first snapshot is applied (for good: an outage
    /// later keeps the last snapshot served); before, why not.
    pub fn why_not(&self) -> Option<String> {
        if *self.synced.borrow() {
            return None;
        }
        Some(match self.errors.describe() {
            Some(e) => format!("no complete snapshot from the API server yet; last errors: {e}"),
            None => "no complete snapshot from the API server yet (listing)".to_string(),
        })
    }
}

impl Handle {
    /// The source's metrics and live-page summary, to add to its role's
    /// admin endpoints.
    pub fn metrics(&self) -> SourceMetrics {
        self.metrics.clone()
    }

    /// Waits until every kind was listed once and the first snapshot was
    /// applied, at most `timeout`. Whether that happened.
    pub async fn synced(&self, timeout: Duration) -> bool {
        let mut rx = self.synced.clone();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// What readiness asks of this source: its first snapshot applied.
    pub fn readiness(&self) -> Readiness {
        Readiness {
            synced: self.synced.clone(),
            errors: self.errors.clone(),
        }
    }

    /// Stops the watches and the status writer.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Stops, and waits (at most `limit`) until a held status lease was
    /// released, so that another replica writes status at once.
    pub async fn shutdown(&self, limit: Duration) {
        self.stop.cancel();
        let task = seedlink_net::sync::lock(&self.campaign, "lease campaign").take();
        if let Some(task) = task {
            let _ = tokio::time::timeout(limit, task).await;
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
