//! Every role's library entry: each builds its role from its options,
//! binds its listeners, prints one `ready` line on stdout and hands itself
//! to the one [`crate::supervisor::Supervisor`] (signals, reloads, drain).

pub mod gateway;
pub mod node_proxy;
pub mod onboard;
pub mod seed;
pub mod tunnel;

use std::path::PathBuf;

/// A `namespace/name` setting as an object key.
fn object_key(setting: &str, value: &str) -> anyhow::Result<seedlink_kube::translate::Key> {
    let (namespace, name) = seedlink_config::compile::split_object_name(value)
        .ok_or_else(|| anyhow::anyhow!("{setting}: {value:?} is not namespace/name"))?;
    Ok(seedlink_kube::translate::Key {
        namespace: namespace.into(),
        name: name.into(),
    })
}

use seedlink_net::handoff;
use tokio_util::sync::CancellationToken;

/// How a role gets its sockets and hands them on (`--upgrade-socket`,
/// `--take-over`).
#[derive(Debug, Clone, Default)]
pub struct Upgrade {
    /// Share ports with a running gateway (`SO_REUSEPORT`, the old way).
    pub reuse_port: bool,
    /// Offer the sockets on this Unix socket to a next binary.
    pub socket: Option<PathBuf>,
    /// Take the sockets from the process offering them at `socket` first.
    pub take_over: bool,
    /// How long a tunnel-server taking over waits for the agents to move
    /// before it takes the frontends.
    pub wait: std::time::Duration,
}

impl Upgrade {
    /// Takes the sockets offered at `socket` when taking over.
    pub async fn take(&self) -> anyhow::Result<Option<(Vec<handoff::Socket>, handoff::Taken)>> {
        match (&self.socket, self.take_over) {
            (Some(path), true) => {
                let path = path.clone();
                Ok(Some(
                    tokio::task::spawn_blocking(move || handoff::take(&path)).await??,
                ))
            }
            (None, true) => anyhow::bail!(
                "--take-over needs --upgrade-socket (where the running process offers its sockets)"
            ),
            _ => Ok(None),
        }
    }

    /// Tells the process we took over from that this one serves: it stops
    /// accepting and drains, and its offer file is gone once it answers.
    /// From here on this process serves: a failure only costs the next
    /// upgrade (this one then offers nothing, logged), never the service.
    pub async fn confirm(taken: handoff::Taken) -> bool {
        match tokio::task::spawn_blocking(move || taken.ready()).await {
            Ok(Ok(())) => {
                tracing::info!("upgrade: the previous process hands over and drains");
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "upgrade: the previous process did not confirm; it may still accept, and this one does not offer its sockets");
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "upgrade: confirming to the previous process failed");
                false
            }
        }
    }

    /// Offers what `source` gives at `--upgrade-socket` on a thread of its
    /// own, with `phases`; a drain for another reason (`stop`) withdraws
    /// the offer, so that its copies do not keep the sockets open. When a
    /// new process took over, `handed` runs (before it hears `done`: what it accepts from then on lands there) and the receiver says so (the
    /// supervisor then drains). `confirmed`: this process is the one
    /// serving (a take-over the old process did not confirm offers nothing).
    pub fn offer(
        &self,
        source: handoff::Source,
        phases: Box<dyn handoff::Phases + Send>,
        stop: CancellationToken,
        confirmed: bool,
        handed: Box<dyn FnOnce() + Send>,
    ) -> anyhow::Result<Option<tokio::sync::mpsc::Receiver<()>>> {
        let Some(path) = self.socket.clone().filter(|_| confirmed) else {
            return Ok(None);
        };
        let listener = match handoff::listen(&path) {
            Ok(l) => l,
            Err(e) if self.take_over => {
                tracing::error!(error = %e, "--upgrade-socket: cannot offer the sockets for the next upgrade");
                return Ok(None);
            }
            Err(e) => anyhow::bail!("--upgrade-socket {}: {e}", path.display()),
        };
        let offer = handoff::Offer::live(path, source);
        {
            let offer = offer.clone();
            tokio::spawn(async move {
                stop.cancelled().await;
                offer.withdraw();
            });
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let phases = Handed {
            phases,
            handed: std::sync::Mutex::new(Some(handed)),
        };
        let spawned = std::thread::Builder::new()
            .name("seedlink-upgrade".into())
            .spawn(move || match handoff::offer(listener, &offer, &phases) {
                Ok(true) => {
                    let _ = tx.blocking_send(());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "upgrade socket failed; no binary upgrade possible")
                }
            });
        match spawned {
            Ok(_) => Ok(Some(rx)),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the upgrade thread; no binary upgrade possible");
                Ok(None)
            }
        }
    }
}

/// `v` seconds from the command line, or an error naming the flag.
pub fn secs(v: f64, what: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .map_err(|_| anyhow::anyhow!("--{what}: {v} is not a valid number of seconds"))
}

/// Problems of a role's configuration, named as the user wrote them: a
/// key of the file given with `--config`, or the flag it came from.
pub fn problems(role: &str, from_file: bool, errors: &seedlink_config::Errors) -> anyhow::Error {
    let lines: Vec<String> = errors
        .0
        .iter()
        .map(|e| match (e.path.is_empty(), from_file) {
            (true, _) => e.message.clone(),
            (false, true) => format!("{}: {}", e.path, e.message),
            (false, false) => format!("--{}: {}", e.path.replace('_', "-"), e.message),
        })
        .collect();
    anyhow::anyhow!("invalid {role} configuration:\n{}", lines.join("\n"))
}

/// How long a start waits for the first Kubernetes snapshot before it
/// serves the file's control planes alone (the routes follow when the API
/// server answers). Readiness waits for the snapshot however long it
/// takes; this only spares direct clients an empty table at a normal
/// start. Short, so that the admin endpoint answers the kubelet's
/// liveness probe well within its failure threshold (3 x 10 s) when the
/// API server is unreachable.
pub const FIRST_SYNC: std::time::Duration = std::time::Duration::from_secs(10);

/// This replica's name in a status Lease: `POD_NAME` (set from the
/// downward API), else one unique to this process.
pub fn identity() -> String {
    std::env::var("POD_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| {
            // Without POD_NAME, the host name and a random part: a pid is 1
            // in every container, and two replicas with one identity would
            // both take the lease for their own.
            use std::hash::{BuildHasher, Hasher};
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default();
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            format!("seedlink-{host}-{:08x}", h.finish() as u32)
        })
}

/// A role's phases, and what it does once handed over (before the new
/// process hears `done`).
struct Handed {
    phases: Box<dyn handoff::Phases + Send>,
    handed: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl handoff::Phases for Handed {
    fn began(&self) {
        self.phases.began();
    }

    fn phase(&self, name: &str) -> String {
        self.phases.phase(name)
    }

    fn abort(&self) {
        self.phases.abort();
    }

    fn done(&self) {
        self.phases.done();
        let handed = self.handed.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handed {
            h();
        }
    }
}
