//! The one supervisor of a seedlink process, whatever roles it runs: it owns
//! the signals, the configuration watcher and the order of the drain. A
//! role (gateway, tunnel-server, tunnel-agent, node-proxy; `seed` runs two)
//! only says which files it reads, how it reloads and how it drains.
//!
//! | event | effect |
//! |---|---|
//! | SIGHUP | every role re-reads its configuration |
//! | a watched file changes | every role reloads; a role whose inputs did not really change does nothing |
//! | SIGTERM, SIGINT | drain: each role in turn stops being ready, stops accepting, lets open work finish within its deadline, closes the rest; exit 0 |
//! | second SIGTERM/SIGINT | exit 1 at once |
//!
//! Files are watched by their directories with inotify (see
//! `seedlink_config::watch`), never polled; the watch is renewed when a
//! reload names other files (a new certificate path), without losing a
//! change seen meanwhile.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;

/// A boxed future, for the object-safe [`Role`].
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the supervisor needs of a running role.
pub trait Role: Send + Sync {
    /// Its name, for logs.
    fn name(&self) -> &'static str;
    /// The files whose change reloads it: its configuration and every file
    /// that names (certificates, keys, CAs, secrets). Empty: none.
    fn files(&self) -> Vec<PathBuf>;
    /// Re-reads its configuration; `forced` (SIGHUP) reloads even if the
    /// files look unchanged. Logs and counts the outcome itself; a bad
    /// configuration changes nothing.
    fn reload(&self, forced: bool) -> BoxFut<'_, ()>;
    /// Drains within its own deadline, then ends its work.
    fn drain(&self) -> BoxFut<'_, ()>;
}

/// The installed signal handlers; install before reporting ready so that
/// no signal is missed.
pub struct Supervisor {
    hup: Signal,
    term: Signal,
    int: Signal,
}

/// The watch and its events; without a watch (it could not be set up, or
/// no role has files) the channel never yields.
struct Watch {
    files: Vec<PathBuf>,
    _watch: Option<seedlink_config::watch::FileWatch>,
    changes: mpsc::Receiver<()>,
}

impl Watch {
    fn files_of(roles: &[Arc<dyn Role>]) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = roles.iter().flat_map(|r| r.files()).collect();
        files.sort();
        files.dedup();
        files
    }

    fn new(files: Vec<PathBuf>) -> Watch {
        if files.is_empty() {
            return Watch {
                files,
                _watch: None,
                changes: mpsc::channel(1).1,
            };
        }
        match seedlink_config::watch::watch_all(&files) {
            Ok((w, changes)) => Watch {
                files,
                _watch: Some(w),
                changes,
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the configuration files; reload with SIGHUP");
                Watch {
                    files,
                    _watch: None,
                    changes: mpsc::channel(1).1,
                }
            }
        }
    }

    /// Whether a change was seen and not yet acted on (consumes it).
    fn take_pending(&mut self) -> bool {
        let mut seen = false;
        while self.changes.try_recv().is_ok() {
            seen = true;
        }
        seen
    }
}

impl Supervisor {
    /// Installs the SIGHUP, SIGTERM and SIGINT handlers. Must be called
    /// inside a tokio runtime.
    pub fn install() -> std::io::Result<Supervisor> {
        Ok(Supervisor {
            hup: signal(SignalKind::hangup())?,
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Starts watching the files of `roles`. Call it before reporting
    /// ready: a file changed after the ready line must not be missed (a
    /// watch set up later did miss one in CI).
    pub fn arm(self, roles: Vec<Arc<dyn Role>>) -> Armed {
        let watch = Watch::new(Watch::files_of(&roles));
        Armed {
            sup: self,
            roles,
            watch,
            handed_over: None,
        }
    }
}

/// A supervisor whose watch is set up, ready to [`Armed::run`].
pub struct Armed {
    sup: Supervisor,
    roles: Vec<Arc<dyn Role>>,
    watch: Watch,
    /// Says when a new process took the sockets over (a binary upgrade):
    /// then the roles drain as on SIGTERM.
    handed_over: Option<mpsc::Receiver<()>>,
}

impl Armed {
    /// Drains, as on SIGTERM, when `rx` says the sockets were handed over.
    pub fn drain_when_handed_over(mut self, rx: mpsc::Receiver<()>) -> Armed {
        self.handed_over = Some(rx);
        self
    }

    /// Serves the roles until SIGTERM/SIGINT, then drains them in order.
    /// Returns the exit code: 0 after a drain, 1 on a second signal.
    pub async fn run(self) -> i32 {
        let Armed {
            sup: mut this,
            roles,
            mut watch,
            mut handed_over,
        } = self;
        // A change seen while the watch was being renewed: reload again
        // without waiting for another event.
        let mut again = false;
        loop {
            let forced = if std::mem::take(&mut again) {
                false
            } else {
                match this.next(&mut watch, &mut handed_over).await {
                    Some(forced) => forced,
                    None => break,
                }
            };
            if forced {
                tracing::info!("SIGHUP: reloading");
            }
            for r in &roles {
                r.reload(forced).await;
            }
            // A reload may name other files: a new watch starts before the
            // old one stops, and what the old one saw meanwhile is not
            // lost. Changes during the reload stay queued on an unchanged
            // watch and reload once more.
            let files = Watch::files_of(&roles);
            if files != watch.files {
                let renewed = Watch::new(files);
                again = watch.take_pending();
                watch = renewed;
            }
        }
        for r in &roles {
            tracing::info!(role = r.name(), "draining");
            tokio::select! {
                () = r.drain() => tracing::info!(role = r.name(), "drained"),
                _ = this.term.recv() => return second_signal(),
                _ = this.int.recv() => return second_signal(),
            }
        }
        0
    }
}

impl Supervisor {
    /// Waits for the next thing to do: reload (`Some(true)` when SIGHUP
    /// forces it, `Some(false)` after a file changed), or drain (`None`: a
    /// signal, or the sockets were handed over).
    async fn next(
        &mut self,
        watch: &mut Watch,
        handed_over: &mut Option<mpsc::Receiver<()>>,
    ) -> Option<bool> {
        tokio::select! {
            _ = self.hup.recv() => Some(true),
            Some(()) = watch.changes.recv() => {
                // Editors and kubelet write in several steps; let the burst
                // settle, then reload once.
                tokio::time::sleep(Duration::from_millis(100)).await;
                watch.take_pending();
                Some(false)
            }
            _ = self.term.recv() => None,
            _ = self.int.recv() => None,
            Some(()) = async {
                match handed_over.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                tracing::info!("sockets handed over to a new process: draining");
                None
            }
        }
    }
}

fn second_signal() -> i32 {
    tracing::warn!("second signal; exiting now");
    1
}
