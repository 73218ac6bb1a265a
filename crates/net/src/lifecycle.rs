//! Process lifecycle: the phase readiness reports, and connection draining.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Where the process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Listeners are being set up; not ready.
    Starting = 0,
    /// Accepting connections; ready.
    Serving = 1,
    /// Stopped accepting, waiting for connections to finish; not ready.
    Draining = 2,
}

/// A condition readiness waits for besides the phase: `None` when met,
/// else why not (shown on the unauthenticated probe: no tenant's names).
pub type Gate = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// The conditions readiness waits for, by name.
#[derive(Clone, Default)]
pub struct Gates(Arc<std::sync::Mutex<Vec<(String, Gate)>>>);

impl Gates {
    /// Adds `gate` under `name`.
    pub fn add(&self, name: &str, gate: Gate) {
        crate::sync::lock(&self.0, "readiness gates").push((name.to_string(), gate));
    }

    /// The unmet conditions, each as `name: why`.
    pub fn unmet(&self) -> Vec<String> {
        let gates: Vec<(String, Gate)> = crate::sync::lock(&self.0, "readiness gates").clone();
        gates
            .iter()
            .filter_map(|(name, g)| g().map(|why| format!("{name}: {why}")))
            .collect()
    }
}

/// Shared lifecycle state: phase, the stop-accepting signal, the signal that
/// closes remaining connections, and the tracker of connection tasks.
#[derive(Clone)]
pub struct Lifecycle {
    phase: Arc<AtomicU8>,
    /// What readiness waits for besides `Serving` (a Kubernetes source's
    /// first snapshot, the other half of `seedlink seed`).
    pub gates: Gates,
    /// Fired when listeners must stop accepting.
    pub stop_accepting: CancellationToken,
    /// Fired when remaining connections must be closed.
    pub close_all: CancellationToken,
    /// Every connection task is spawned on this tracker.
    pub tasks: TaskTracker,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self::new()
    }
}

impl Lifecycle {
    /// A lifecycle in the `Starting` phase.
    pub fn new() -> Lifecycle {
        Lifecycle {
            phase: Arc::new(AtomicU8::new(Phase::Starting as u8)),
            gates: Gates::default(),
            stop_accepting: CancellationToken::new(),
            close_all: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Starting,
            1 => Phase::Serving,
            _ => Phase::Draining,
        }
    }

    /// Marks the process ready.
    pub fn serving(&self) {
        let _ = self.phase.compare_exchange(
            Phase::Starting as u8,
            Phase::Serving as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Stops accepting, waits up to `deadline` for connections to finish,
    /// then closes the rest and waits for their tasks. Returns the number of
    /// connections that had to be closed at the deadline.
    pub async fn drain(&self, deadline: Duration) -> usize {
        self.phase.store(Phase::Draining as u8, Ordering::Release);
        self.stop_accepting.cancel();
        self.tasks.close();
        if tokio::time::timeout(deadline, self.tasks.wait())
            .await
            .is_ok()
        {
            return 0;
        }
        let left = self.tasks.len();
        self.close_all.cancel();
        // Closing is immediate; the bound only guards against a task that
        // ignores the signal.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tasks.wait()).await;
        left
    }
}
