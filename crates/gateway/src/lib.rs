//! `seedlink gateway`: one shared entry for every control plane.
//!
//! A [`Gateway`] holds the configuration snapshot in force (swapped
//! atomically on reload), the metrics, the copy engine and the lifecycle.
//! [`Gateway::bind`] opens the sockets, [`Gateway::serve`] runs the accept
//! loops and the admin endpoint; [`Gateway::reload`] and [`Gateway::drain`]
//! are what the process supervisor (`seedlink::supervisor`) calls on
//! SIGHUP, file changes and SIGTERM.

pub mod admin;
mod conn;
mod h2conn;
pub mod metrics;
pub mod paths;
pub mod state;
pub mod upstream;

use state::{keepalive, Sources};
pub use state::{Gateway, Handoff, ListenerCtx, LocalHandler};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use seedlink_config::compile::{diff, restart_only_changes, ConfigError, ListenerSpec};
use seedlink_config::{Errors, Snapshot};
use seedlink_net::copy::{Copier, CopyMode};
use seedlink_net::lifecycle::Lifecycle;
use seedlink_net::sockopt::Keepalive;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::metrics::{ReasonLabels, ResultLabels};

/// Descriptors kept free for the process itself (logs, admin, watcher, DNS).
const FD_RESERVE: u64 = 128;

/// Sockets bound for a gateway, before serving.
pub struct Bound {
    /// Listener sockets in configuration order: one `SO_REUSEPORT` socket
    /// per worker thread, all on the same address.
    pub listeners: Vec<(ListenerSpec, Vec<std::net::TcpListener>)>,
    /// The admin socket.
    pub admin: std::net::TcpListener,
    /// Who may read it (the token file is read when binding).
    pub admin_access: seedlink_net::admin::Access,
}

impl Bound {
    /// Duplicates of every listening socket (each worker's) and the admin
    /// socket, named for [`seedlink_net::handoff`]: what a new process
    /// takes over in a binary upgrade.
    pub fn offer(&self) -> std::io::Result<Vec<seedlink_net::handoff::Socket>> {
        let mut out = Vec::new();
        let mut add = |name: &str, l: &std::net::TcpListener| -> std::io::Result<()> {
            out.push(seedlink_net::handoff::Socket {
                name: name.to_string(),
                address: l.local_addr()?.to_string(),
                fd: std::os::fd::OwnedFd::from(l.try_clone()?),
            });
            Ok(())
        };
        for (spec, socks) in &self.listeners {
            for l in socks {
                add(&format!("{LISTENER_SOCKET}{}", spec.name), l)?;
            }
        }
        add(ADMIN_SOCKET, &self.admin)?;
        Ok(out)
    }

    /// The actual addresses (useful when configured with port 0), as a JSON
    /// object `{"listeners": {name: addr}, "admin": addr}`.
    pub fn describe(&self) -> serde_json::Value {
        let listeners: serde_json::Map<String, serde_json::Value> = self
            .listeners
            .iter()
            .map(|(s, l)| {
                let addr = l
                    .first()
                    .and_then(|l| l.local_addr().ok())
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                (s.name.clone(), serde_json::Value::String(addr))
            })
            .collect();
        serde_json::json!({
            "listeners": listeners,
            "admin": self.admin.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        })
    }
}

impl Gateway {
    /// The configuration file it re-reads on reload, if any.
    pub fn config_path(&self) -> Option<&std::path::Path> {
        self.config_path.as_deref()
    }

    /// A gateway for `snapshot`; `config_path` is re-read on reload.
    pub fn new(snapshot: Snapshot, config_path: Option<PathBuf>) -> Arc<Gateway> {
        let max_connections = max_connections(&snapshot);
        let mode = match snapshot.limits.copy {
            seedlink_config::model::CopyMode::Splice => CopyMode::Splice,
            seedlink_config::model::CopyMode::Buffered => CopyMode::Buffered,
        };
        let workers = snapshot
            .limits
            .workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let metrics = metrics::Metrics::new();
        metrics.config_generation.set(1);
        metrics
            .max_connections
            .set(i64::try_from(max_connections).unwrap_or(i64::MAX));
        let usage = paths::Usage::open(snapshot.file.migration.usage_file.as_deref());
        let copier = Copier::new(mode, snapshot.limits.splice_pipes);
        copier.set_half_closed(snapshot.timeouts.half_closed);
        Arc::new(Gateway {
            snapshot: ArcSwap::from_pointee(snapshot),
            generation: AtomicU64::new(1),
            config_path,
            metrics,
            copier,
            lifecycle: Lifecycle::new(),
            permits: Arc::new(Semaphore::new(
                usize::try_from(max_connections)
                    .unwrap_or(usize::MAX)
                    .min(Semaphore::MAX_PERMITS),
            )),
            max_connections,
            workers,
            sources: Sources::default(),
            routed_sources: Sources::default(),
            routed: Mutex::new(HashMap::new()),
            closers: Mutex::new(HashMap::new()),
            kubernetes: Mutex::new(Vec::new()),
            refused_logged: Mutex::new(Vec::new()),
            last_reload: Mutex::new(None),
            handed_over: CancellationToken::new(),
            locals: Mutex::new(HashMap::new()),
            state_index: Mutex::new(None),
            usage,
        })
    }

    /// Registers the in-process service that `local:<name>` endpoints hand
    /// connections to.
    pub fn set_local(&self, name: &str, handler: LocalHandler) {
        seedlink_net::sync::lock(&self.locals, "local handlers").insert(name.to_string(), handler);
    }

    /// The in-process service `name`, if registered.
    pub fn local(&self, name: &str) -> Option<LocalHandler> {
        seedlink_net::sync::lock(&self.locals, "local handlers")
            .get(name)
            .cloned()
    }

    /// The snapshot in force.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// The configuration generation in force (1 = initial).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The concurrent-connection cap in force.
    pub fn max_connections(&self) -> u64 {
        self.max_connections
    }

    /// Worker threads serving connections.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Like [`Gateway::bind`], taking the sockets a running gateway handed
    /// over (a binary upgrade) where they match: a listener whose name and
    /// address (unless configured with port 0) are the handed socket's
    /// serves on those very sockets, their accept queues included; the
    /// admin the same. What does not match is bound as usual, and handed
    /// sockets nothing uses are closed here (the old process closes its
    /// copies as it drains).
    pub fn bind_handed(
        &self,
        handed: Vec<seedlink_net::handoff::Socket>,
    ) -> std::io::Result<Bound> {
        let snap = self.snapshot();
        let ka = keepalive(&snap);
        let mut handed = Handed(handed);
        let mut listeners = Vec::new();
        for spec in &snap.listeners {
            let socks = self.listener_handed(spec, &mut handed, ka)?;
            listeners.push((spec.clone(), socks));
        }
        let admin = match handed.take(Some(ADMIN_SOCKET), snap.admin).pop() {
            Some(a) => a,
            None => bind_admin(snap.admin)?,
        };
        for h in &handed.0 {
            tracing::info!(socket = %h.name, address = %h.address, "handed-over socket not in this configuration: closed");
        }
        Ok(Bound {
            listeners,
            admin,
            admin_access: admin_access(&snap)?,
        })
    }

    /// One listener's sockets: those handed over for it, tuned to this
    /// configuration, or new ones; then one per worker.
    fn listener_handed(
        &self,
        spec: &ListenerSpec,
        handed: &mut Handed,
        ka: Keepalive,
    ) -> std::io::Result<Vec<std::net::TcpListener>> {
        let ctx = listener_error(spec);
        let mut socks = handed.take(
            Some(&format!("{LISTENER_SOCKET}{}", spec.name)),
            spec.address,
        );
        if socks.is_empty() {
            socks = handed.take(None, spec.address);
        }
        // The keepalive and no-delay settings accepted sockets inherit
        // are this configuration's.
        for l in &socks {
            seedlink_net::sockopt::tune_listener(socket2::SockRef::from(l), ka).map_err(ctx)?;
        }
        if socks.is_empty() {
            if spec.address.port() != 0 {
                probe_exclusive(spec.address).map_err(ctx)?;
            }
            socks.push(bind_tcp(spec.address, true, Some(ka)).map_err(ctx)?);
        } else {
            tracing::info!(listener = %spec.name, sockets = socks.len(), "listener taken over from the running gateway");
        }
        let actual = socks[0].local_addr().map_err(ctx)?;
        // More workers than sockets handed over: the others join them
        // (they are SO_REUSEPORT sockets).
        while socks.len() < self.workers {
            socks.push(bind_tcp(actual, true, Some(ka)).map_err(ctx)?);
        }
        Ok(socks)
    }

    /// This process's sockets now serve a new process too: the admin
    /// endpoint stops accepting here (its probes must reach the new one),
    /// then the drain runs as on SIGTERM.
    pub fn handed_over(&self) {
        self.handed_over.cancel();
    }

    /// Binds every listener (one `SO_REUSEPORT` socket per worker) and the
    /// admin socket of the current snapshot. Needs no runtime. Unless
    /// `share_ports`, a listener port that another process already holds is
    /// an error: `SO_REUSEPORT` would otherwise split the traffic silently
    /// between two gateways that may run different configurations.
    pub fn bind(&self, share_ports: bool) -> std::io::Result<Bound> {
        let snap = self.snapshot();
        let ka = keepalive(&snap);
        let mut listeners = Vec::new();
        for spec in &snap.listeners {
            let ctx = listener_error(spec);
            if !share_ports && spec.address.port() != 0 {
                probe_exclusive(spec.address).map_err(ctx)?;
            }
            let first = bind_tcp(spec.address, true, Some(ka)).map_err(ctx)?;
            // With port 0 the kernel picked a port; the others join it.
            let actual = first.local_addr().map_err(ctx)?;
            let mut socks = vec![first];
            for _ in 1..self.workers {
                socks.push(bind_tcp(actual, true, Some(ka)).map_err(ctx)?);
            }
            listeners.push((spec.clone(), socks));
        }
        let admin = bind_admin(snap.admin)?;
        Ok(Bound {
            listeners,
            admin,
            admin_access: admin_access(&snap)?,
        })
    }

    /// Starts one worker thread per configured worker, each a single-threaded
    /// runtime with its own accept socket per listener (the kernel spreads
    /// connections with `SO_REUSEPORT`; a connection never changes thread,
    /// so the data path has no cross-thread wake-ups). The admin server runs
    /// on the caller's runtime. Then reports ready.
    pub fn serve(self: &Arc<Self>, bound: Bound) -> std::io::Result<()> {
        self.warn_removed_in_use();
        self.keep_usage();
        let mut per_worker: Vec<Vec<(Arc<ListenerCtx>, std::net::TcpListener)>> =
            (0..self.workers).map(|_| Vec::new()).collect();
        for (spec, socks) in bound.listeners {
            let metrics = self.metrics.listener(&spec.name);
            let connect_protocol = format!("http-connect:{}", spec.destination_header);
            let lctx = Arc::new(ListenerCtx {
                spec,
                metrics,
                connect_protocol,
            });
            // Sockets handed over by another process may outnumber the
            // workers: a worker then accepts on several.
            let n = per_worker.len().max(1);
            for (w, sock) in socks.into_iter().enumerate() {
                per_worker[w % n].push((lctx.clone(), sock));
            }
        }
        for (w, mine) in per_worker.into_iter().enumerate() {
            let gw = self.clone();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            std::thread::Builder::new()
                .name(format!("seedlink-worker-{w}"))
                .spawn(move || rt.block_on(gw.worker(mine)))?;
        }
        let admin = TcpListener::from_std(bound.admin)?;
        let gw = self.clone();
        let access = bound.admin_access.clone();
        let stop = self.handed_over.clone();
        tokio::spawn(async move { admin::serve(gw, admin, access, stop).await });
        self.lifecycle.serving();
        Ok(())
    }

    async fn worker(self: Arc<Self>, mine: Vec<(Arc<ListenerCtx>, std::net::TcpListener)>) {
        tokio::spawn(timer_tick(self.lifecycle.close_all.clone()));
        let mut loops = Vec::new();
        for (lctx, sock) in mine {
            let listener = match TcpListener::from_std(sock) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(listener = %lctx.spec.name, error = %e, "cannot register listener");
                    continue;
                }
            };
            let gw = self.clone();
            loops.push(tokio::spawn(async move {
                let stop = gw.lifecycle.stop_accepting.clone();
                seedlink_net::accept::accept_loop(&listener, &stop, |stream, peer| {
                    gw.accept(&lctx, stream, peer);
                })
                .await;
            }));
        }
        for l in loops {
            let _ = l.await;
        }
        // Keep driving this thread's connections until the drain ends.
        self.lifecycle.tasks.wait().await;
    }

    fn accept(
        self: &Arc<Self>,
        lctx: &Arc<ListenerCtx>,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
    ) {
        // At the cap: accept and close at once, counted; never queue.
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            self.metrics
                .refused
                .get_or_create(&ReasonLabels {
                    listener: lctx.spec.name.clone(),
                    reason: "max_connections".into(),
                })
                .inc();
            drop(stream);
            return;
        };
        let gw = self.clone();
        let lctx = lctx.clone();
        self.lifecycle.tasks.spawn(async move {
            conn::serve(gw, lctx, stream, peer).await;
            drop(permit);
        });
    }

    /// Re-reads the configuration file and swaps it in if it is valid and
    /// changes nothing that needs a restart. On failure the snapshot in force
    /// stays and the reasons are returned (and logged, and counted).
    pub fn reload(self: &Arc<Self>) -> Result<u64, Errors> {
        self.reload_admitting().0
    }

    /// When the last reload ended and how.
    pub fn last_reload(&self) -> Option<(std::time::SystemTime, &'static str)> {
        *seedlink_net::sync::lock(&self.last_reload, "last reload")
    }

    /// Serves `control_planes` from the Kubernetes source besides the
    /// file's, through the same reload (validation, diff, atomic swap; open
    /// connections untouched). Each is admitted on its own: those refused
    /// are returned with their problems, and the rest are served. Nothing
    /// is refused if the file itself is invalid: then nothing changes.
    pub fn set_kubernetes(
        self: &Arc<Self>,
        control_planes: Vec<Arc<seedlink_config::model::ControlPlane>>,
    ) -> seedlink_config::compile::Refused {
        *seedlink_net::sync::lock(&self.kubernetes, "kubernetes") = control_planes;
        match self.reload_admitting() {
            (Ok(_), refused) => refused,
            (Err(e), _) => {
                // The file itself is invalid: nothing changed. What is not
                // served in the running snapshot, as given, is not served.
                let running = self.snapshot();
                let given = seedlink_net::sync::lock(&self.kubernetes, "kubernetes").clone();
                given
                    .into_iter()
                    .filter(|c| !running.file.from_kubernetes.contains(c))
                    .map(|c| {
                        let why = ConfigError {
                            path: String::new(),
                            message: format!(
                                "not applied: the gateway's configuration file is invalid ({})",
                                e.to_string().replace('\n', "; ")
                            ),
                        };
                        (c.name.clone(), vec![why])
                    })
                    .collect()
            }
        }
    }

    fn reload_admitting(
        self: &Arc<Self>,
    ) -> (Result<u64, Errors>, seedlink_config::compile::Refused) {
        let (result, refused) = match self.try_reload() {
            Ok((g, r)) => (Ok(g), r),
            Err(e) => (Err(e), Vec::new()),
        };
        self.log_refusals(&refused);
        let label = if result.is_ok() { "success" } else { "failure" };
        *seedlink_net::sync::lock(&self.last_reload, "last reload") =
            Some((std::time::SystemTime::now(), label));
        self.metrics
            .reloads
            .get_or_create(&ResultLabels {
                result: label.into(),
            })
            .inc();
        match &result {
            Ok(g) => tracing::info!(generation = g, "configuration reloaded"),
            Err(e) => tracing::error!(problems = %e.to_string().replace('\n', "; "),
                generation = self.generation(), "configuration rejected; keeping the one in force"),
        }
        (result, refused)
    }

    /// Logs each refused control plane once, not on every later snapshot.
    fn log_refusals(&self, refused: &seedlink_config::compile::Refused) {
        let now: Vec<(String, String)> = refused
            .iter()
            .map(|(name, problems)| {
                let text: Vec<String> = problems
                    .iter()
                    .map(|p| format!("{}: {}", p.path, p.message))
                    .collect();
                (name.clone(), text.join("; "))
            })
            .collect();
        let mut logged = seedlink_net::sync::lock(&self.refused_logged, "refused");
        for (name, text) in now.iter().filter(|r| !logged.contains(r)) {
            tracing::warn!(control_plane = %name, problems = %text, "control plane from Kubernetes refused; the others are served");
        }
        *logged = now;
    }

    fn try_reload(self: &Arc<Self>) -> Result<(u64, seedlink_config::compile::Refused), Errors> {
        let Some(path) = &self.config_path else {
            return Err(one_error("no configuration file to reload"));
        };
        let old = self.snapshot();
        let text = std::fs::read_to_string(path)
            .map_err(|e| one_error(&format!("cannot read {}: {e}", path.display())))?;
        let mut file = seedlink_config::compile::parse(&text)?;
        file.from_kubernetes = seedlink_net::sync::lock(&self.kubernetes, "kubernetes").clone();
        let (new, refused) = seedlink_config::compile::compile_admitting(file, Some(&old));
        let new = new?;
        if new.file == old.file {
            // Watchers and SIGHUP often report the same write twice.
            tracing::debug!("configuration unchanged");
            return Ok((self.generation(), refused));
        }
        let gated = self.removed_in_use(&old.file, &new.file);
        if !gated.is_empty() {
            return Err(Errors(gated));
        }
        let fixed = restart_only_changes(&old.file, &new.file);
        if !fixed.is_empty() {
            return Err(Errors(
                fixed
                    .into_iter()
                    .map(|k| {
                        ConfigError::new(
                            k.to_string(),
                            "cannot change on reload; restart the gateway to apply",
                        )
                    })
                    .collect(),
            ));
        }
        Ok((self.swap_in(&old, new), refused))
    }

    /// The paths in use that `new` removes and `old` still has, unless
    /// retired (the migration gate, `paths.rs`).
    fn removed_in_use(
        &self,
        old: &seedlink_config::model::ConfigFile,
        new: &seedlink_config::model::ConfigFile,
    ) -> Vec<ConfigError> {
        let now = metrics::unix_now();
        let since = now.saturating_sub(new.migration.window.as_secs());
        let in_use = self.usage.now(&self.metrics.listeners());
        let removed = paths::removed(&in_use, since, Some(old), new);
        for (cp, listener, protocol) in &removed {
            tracing::warn!(control_plane = %cp, %listener, %protocol, "the new file removes a path still in use");
        }
        paths::problems(&removed, new, false)
    }

    /// Keeps the record of the paths in use: written every 30 s while the
    /// gateway runs, within a second of a path's first connection, and at
    /// drain, so a restart keeps the window.
    pub fn keep_usage(self: &Arc<Self>) {
        let gw = Arc::downgrade(self);
        let new_path = self.metrics.new_path.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(std::time::Duration::from_secs(30)) => {}
                    () = new_path.notified() => {
                        // More first connections come together (a restart
                        // of many shoots): one write for them.
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                }
                let Some(gw) = gw.upgrade() else { return };
                gw.save_usage();
            }
        });
    }

    /// Says which paths in use the configuration it starts with removes
    /// (a listener goes only with a restart, which the gate cannot refuse;
    /// `check-config` can, before it).
    fn warn_removed_in_use(&self) {
        let now = metrics::unix_now();
        let file = &self.snapshot().file;
        let since = now.saturating_sub(file.migration.window.as_secs());
        let in_use = self.usage.now(&self.metrics.listeners());
        for (cp, listener, protocol) in paths::removed(&in_use, since, None, file) {
            tracing::error!(control_plane = %cp, %listener, %protocol, "started without a path still in use");
        }
    }

    /// Writes the record of the paths in use now (a failure is logged).
    pub fn save_usage(&self) {
        let now = metrics::unix_now();
        let window = self.snapshot().file.migration.window.as_secs();
        let in_use = self.usage.now(&self.metrics.listeners());
        if let Err(e) = self.usage.save(&in_use, now.saturating_sub(window)) {
            tracing::warn!(error = %e, "migration.usage_file not written");
        }
    }

    /// The paths in use (within the window) by control plane: listener,
    /// protocol, last use (Unix seconds).
    pub fn paths_in_use(&self, only: Option<&str>) -> paths::LastUse {
        let since =
            metrics::unix_now().saturating_sub(self.snapshot().file.migration.window.as_secs());
        let mut all = self.usage.now_of(&self.metrics.listeners(), only);
        all.retain(|_, last| *last >= since);
        all
    }

    /// Puts `new` in force in place of `old` (open connections untouched;
    /// those of removed control planes retire) and returns its generation.
    fn swap_in(self: &Arc<Self>, old: &Snapshot, new: Snapshot) -> u64 {
        let d = diff(&old.file, &new.file);
        self.copier.set_half_closed(new.timeouts.half_closed);
        let grace = new.timeouts.removed_control_plane_grace;
        self.snapshot.store(Arc::new(new));
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.metrics
            .config_generation
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
        tracing::info!(added = ?d.added, removed = ?d.removed, changed = ?d.changed, "routes updated");
        for name in d.removed {
            self.retire(name, grace);
        }
        generation
    }

    /// A control plane was removed: its open connections continue; with a
    /// grace period they are closed when it ends, unless it came back.
    fn retire(self: &Arc<Self>, name: String, grace: Option<Duration>) {
        let Some(grace) = grace else {
            seedlink_net::sync::lock(&self.closers, "closers").remove(&name);
            return;
        };
        let gw = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(grace) => {}
                () = gw.lifecycle.close_all.cancelled() => return,
            }
            if gw.snapshot().control_planes.contains_key(name.as_str()) {
                return;
            }
            let token = seedlink_net::sync::lock(&gw.closers, "closers").remove(&name);
            if let Some(t) = token {
                tracing::info!(control_plane = %name, "closing connections of a removed control plane");
                t.cancel();
            }
        });
    }

    /// Drains: not ready, stop accepting, wait up to the configured deadline,
    /// then close what is left. Returns how many connections were closed.
    pub async fn drain(&self) -> usize {
        let deadline = self.snapshot().timeouts.drain;
        let closed = self.lifecycle.drain(deadline).await;
        self.save_usage();
        closed
    }
}

/// Who may read the admin endpoint (its token file is read when binding).
fn admin_access(snap: &Snapshot) -> std::io::Result<seedlink_net::admin::Access> {
    match &snap.file.admin.token_file {
        None => Ok(seedlink_net::admin::Access::open()),
        Some(f) => seedlink_net::admin::Access::from_token_file(std::path::Path::new(f))
            .map_err(|e| std::io::Error::new(e.kind(), format!("admin.token_file {f}: {e}"))),
    }
}

/// tokio's timer wakes the event loop (an eventfd write, then an extra
/// epoll_wait and read) whenever a new timer expires earlier than any
/// pending one. Every connection arms a deadline; this short periodic tick,
/// until `stop`, keeps an earlier timer pending so those deadlines never
/// cause that wake-up: three fewer system calls per connection for twenty
/// idle wake-ups a second.
async fn timer_tick(stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
    }
}

/// The concurrent-connection cap: configured, or derived from the open-file
/// limit (raised to its hard limit first) less the reserve and the pipes.
fn max_connections(snapshot: &Snapshot) -> u64 {
    let nofile = seedlink_net::sockopt::raise_nofile_limit();
    let pipes = snapshot.limits.splice_pipes;
    let derived = nofile.saturating_sub(FD_RESERVE + 2 * pipes as u64) / 2;
    let max = snapshot.limits.max_connections.unwrap_or(derived).max(1);
    tracing::info!(
        max_connections = max,
        nofile,
        splice_pipes = pipes,
        "limits"
    );
    max
}

/// The admin socket's name in a hand-over.
const ADMIN_SOCKET: &str = "admin";

/// What a listener's name is prefixed with in a hand-over (a listener may
/// be called `admin`).
const LISTENER_SOCKET: &str = "listener-";

/// Sockets a running gateway handed over, not yet taken by a listener.
struct Handed(Vec<seedlink_net::handoff::Socket>);

impl Handed {
    /// Takes the sockets named `name` on `want` (port 0: on its IP); with
    /// no name, those of a listener renamed on the same address and port.
    fn take(&mut self, name: Option<&str>, want: SocketAddr) -> Vec<std::net::TcpListener> {
        let (got, rest): (Vec<_>, Vec<_>) = self.0.drain(..).partition(|h| {
            let same_addr = h.address.parse::<SocketAddr>().is_ok_and(|a| {
                if want.port() == 0 {
                    a.ip() == want.ip()
                } else {
                    a == want
                }
            });
            same_addr
                && match name {
                    Some(n) => h.name == n,
                    None => h.name.starts_with(LISTENER_SOCKET) && want.port() != 0,
                }
        });
        self.0 = rest;
        got.into_iter()
            .map(|h| std::net::TcpListener::from(h.fd))
            .collect()
    }
}

/// Names the listener in a socket error.
fn listener_error(spec: &ListenerSpec) -> impl Fn(std::io::Error) -> std::io::Error + Copy + '_ {
    move |e| {
        std::io::Error::new(
            e.kind(),
            format!("listener {} on {}: {e}", spec.name, spec.address),
        )
    }
}

/// Binds the admin socket.
fn bind_admin(at: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    bind_tcp(at, false, None)
        .map_err(|e| std::io::Error::new(e.kind(), format!("admin on {at}: {e}")))
}

fn one_error(msg: &str) -> Errors {
    Errors(vec![ConfigError::new(String::new(), msg)])
}

/// Fails if another socket already listens on `addr`: a socket without
/// `SO_REUSEPORT` cannot bind where one is (`SO_REUSEADDR` only covers
/// connections in TIME_WAIT). The probe is closed before the real sockets
/// bind.
fn probe_exclusive(addr: SocketAddr) -> std::io::Result<()> {
    use socket2::{Domain, Socket, Type};
    let sock = Socket::new(
        Domain::for_address(addr),
        Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    match sock.bind(&addr.into()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(std::io::Error::new(
            e.kind(),
            "address already in use by another process (a second gateway?); \
             to upgrade a running gateway take its sockets over (--upgrade-socket with --take-over), \
             or share the port deliberately with --reuse-port",
        )),
        Err(e) => Err(e),
    }
}

/// Binds a listening socket. With `ka` (a proxy listener), keepalive and
/// `TCP_NODELAY` are set on it so that accepted sockets inherit them, and
/// accept is deferred until the client's first bytes.
fn bind_tcp(
    addr: SocketAddr,
    reuse_port: bool,
    ka: Option<Keepalive>,
) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let sock = Socket::new(
        Domain::for_address(addr),
        Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    if let Some(ka) = ka {
        seedlink_net::sockopt::tune_listener(socket2::SockRef::from(&sock), ka)?;
    }
    sock.set_reuse_address(true)?;
    #[cfg(unix)]
    if reuse_port {
        sock.set_reuse_port(true)?;
    }
    #[cfg(not(unix))]
    let _ = reuse_port;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(4096)?;
    Ok(sock.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use seedlink_net::admin::source_key;

    /// A source is an IPv4 address or an IPv6 /64; v4-mapped addresses
    /// count as their IPv4 address.
    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_slash_64s() {
        let k = |s: &str| source_key(s.parse().unwrap());
        assert_eq!(k("2001:db8:1:2:aaaa::1"), k("2001:db8:1:2:bbbb::2"));
        assert_ne!(k("2001:db8:1:2::1"), k("2001:db8:1:3::1"));
        assert_eq!(k("::ffff:192.0.2.7"), k("192.0.2.7"));
        assert_ne!(k("192.0.2.7"), k("192.0.2.8"));
        let sources = Sources::default();
        let _a = sources.enter("2001:db8::1".parse().unwrap(), 1).unwrap();
        assert!(sources
            .enter("2001:db8::ffff".parse().unwrap(), 1)
            .is_none());
        assert!(sources
            .enter("2001:db8:0:1::1".parse().unwrap(), 1)
            .is_some());
    }

    /// Accepted sockets inherit keepalive and no-delay from the listener,
    /// which is why the per-connection path does not set them.
    #[tokio::test]
    async fn accepted_sockets_inherit_keepalive_and_nodelay() {
        let ka = Keepalive {
            time: Duration::from_secs(61),
            interval: Duration::from_secs(16),
            retries: 5,
        };
        let l = bind_tcp("127.0.0.1:0".parse().unwrap(), true, Some(ka)).unwrap();
        let l = TcpListener::from_std(l).unwrap();
        let addr = l.local_addr().unwrap();
        let (_c, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
        let (s, _) = accepted.unwrap();
        let sock = socket2::SockRef::from(&s);
        assert!(sock.nodelay().unwrap());
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.keepalive_time().unwrap(), Duration::from_secs(61));
        assert_eq!(sock.keepalive_interval().unwrap(), Duration::from_secs(16));
        assert_eq!(sock.keepalive_retries().unwrap(), 5);
    }
}
