//! Process signals and configuration watching for a serving gateway.
//!
//! | signal | effect |
//! |---|---|
//! | SIGHUP | re-read the configuration file (also done on file change) |
//! | SIGTERM, SIGINT | drain: not ready, stop accepting, wait up to `timeouts.drain`, close the rest, exit 0 |
//! | second SIGTERM/SIGINT | exit 1 at once |

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::Gateway;

/// Signal handlers and the configuration watcher, installed before the
/// gateway reports ready so that no signal or file change is missed.
pub struct Supervisor {
    gw: Arc<Gateway>,
    hup: Signal,
    term: Signal,
    int: Signal,
    _watch: Option<seedlink_config::watch::FileWatch>,
    changes: tokio::sync::mpsc::Receiver<()>,
}

impl Supervisor {
    /// Installs SIGHUP/SIGTERM/SIGINT handlers and watches the configuration
    /// file (if any). Must be called inside a tokio runtime.
    pub fn install(gw: Arc<Gateway>) -> std::io::Result<Supervisor> {
        let hup = signal(SignalKind::hangup())?;
        let term = signal(SignalKind::terminate())?;
        let int = signal(SignalKind::interrupt())?;
        let (watch, changes) = match gw.config_path.as_deref() {
            Some(p) => match seedlink_config::watch::watch(p) {
                Ok((w, rx)) => (Some(w), rx),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch the configuration file; reload with SIGHUP");
                    (None, tokio::sync::mpsc::channel(1).1)
                }
            },
            None => (None, tokio::sync::mpsc::channel(1).1),
        };
        Ok(Supervisor {
            gw,
            hup,
            term,
            int,
            _watch: watch,
            changes,
        })
    }

    /// Runs until the gateway has drained after SIGTERM/SIGINT, reloading on
    /// SIGHUP and on configuration file changes. Returns the exit code.
    pub async fn run(mut self) -> i32 {
        let gw = self.gw.clone();
        loop {
            tokio::select! {
                _ = self.hup.recv() => {
                    let _ = gw.reload();
                }
                Some(()) = self.changes.recv() => {
                    // Editors write in several steps; let the burst settle.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    while self.changes.try_recv().is_ok() {}
                    let _ = gw.reload();
                }
                _ = self.term.recv() => break,
                _ = self.int.recv() => break,
            }
        }
        tracing::info!(deadline = ?gw.snapshot().timeouts.drain, open = gw.lifecycle.tasks.len(), "draining");
        let drain = gw.drain();
        tokio::pin!(drain);
        tokio::select! {
            closed = &mut drain => {
                tracing::info!(closed_at_deadline = closed, "drained; exiting");
                0
            }
            _ = self.term.recv() => {
                tracing::warn!("second signal; exiting now");
                1
            }
            _ = self.int.recv() => {
                tracing::warn!("second signal; exiting now");
                1
            }
        }
    }
}
