//! Process signals and configuration watching for a serving gateway.
//!
//! | signal | effect |
//! |---|---|
//! | SIGHUP | re-read the configuration file (also done on file change) |
//! | SIGTERM, SIGINT | drain: not ready, stop accepting, wait up to `timeouts.drain`, close the rest, exit 0 |
//! | second SIGTERM/SIGINT | exit 1 at once |

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

use crate::Gateway;

/// Runs until the gateway has drained after SIGTERM/SIGINT, reloading on
/// SIGHUP and on configuration file changes. Returns the process exit code.
pub async fn run_until_stopped(gw: Arc<Gateway>) -> std::io::Result<i32> {
    let mut hup = signal(SignalKind::hangup())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;

    let (_watch, mut changes) = match gw.config_path.as_deref() {
        Some(p) => match seedlink_config::watch::watch(p) {
            Ok((w, rx)) => (Some(w), rx),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the configuration file; reload with SIGHUP");
                (None, tokio::sync::mpsc::channel(1).1)
            }
        },
        None => (None, tokio::sync::mpsc::channel(1).1),
    };

    loop {
        tokio::select! {
            _ = hup.recv() => {
                let _ = gw.reload();
            }
            Some(()) = changes.recv() => {
                // Editors write in several steps; let the burst settle.
                tokio::time::sleep(Duration::from_millis(100)).await;
                while changes.try_recv().is_ok() {}
                let _ = gw.reload();
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    tracing::info!(deadline = ?gw.snapshot().timeouts.drain, open = gw.lifecycle.tasks.len(), "draining");
    let drain = gw.drain();
    tokio::pin!(drain);
    tokio::select! {
        closed = &mut drain => {
            tracing::info!(closed_at_deadline = closed, "drained; exiting");
            Ok(0)
        }
        _ = term.recv() => {
            tracing::warn!("second signal; exiting now");
            Ok(1)
        }
        _ = int.recv() => {
            tracing::warn!("second signal; exiting now");
            Ok(1)
        }
    }
}
