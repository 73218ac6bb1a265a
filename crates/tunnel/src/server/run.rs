//! Building a tunnel-server from its configuration, running its listeners
//! (the agent endpoint, every cluster's frontends, shared proxy frontends,
//! the admin endpoint) and reloading it: a new configuration is first read
//! and checked completely (every file loaded) into a [`Plan`]; only then is
//! anything changed, so a bad reload changes nothing.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::accept::{self, Listening, Serve};
use super::cluster::rekey;
pub use super::core::{Core, Settings};
use super::diff::{diff, Changes};
use super::handover::{self, Sockets};
use super::metrics::Metrics;
pub use super::plan::{plan, FrontendFailure, Plan, ServerError};
use super::plan::{PlannedCluster, PlannedFrontend, Transport};
use super::{Cluster, Registry};
use crate::config::{Frontend, ServerConfig};
use crate::transport::grpc::H2Settings;

/// A listening frontend.
struct Running {
    cluster: Option<String>,
    cfg: Frontend,
    /// Swapped in place when only its certificate files changed.
    tls: Option<Arc<ArcSwap<TlsAcceptor>>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
    label: String,
    bound: String,
    /// A Unix socket's file (its inode), removed with the frontend only
    /// while it is still this socket's (another process may have bound the
    /// path since: a binary upgrade).
    unix_file: Option<(std::path::PathBuf, u64)>,
}

/// The handlers' shared state for `cfg`, with its clusters and agent TLS.
fn new_core(
    cfg: &ServerConfig,
    metrics: Metrics,
    clusters: Vec<Arc<Cluster>>,
    agent_tls: rustls::ServerConfig,
) -> Core {
    let settings = Settings {
        handshake_timeout: Duration::from_secs(10),
        dial_timeout: cfg.dial_timeout,
        agent_wait: cfg.agent_wait,
        stall_timeout: cfg.stall_timeout,
        queue_bytes: cfg.queue_bytes,
    };
    let max = cfg.agents.max_connections;
    let agent_slots = seedlink_net::admin::Slots::with_per_source(max, cfg.agents.max_per_source);
    let per_source = super::core::TOKEN_CHECKS_PER_SOURCE;
    let token_slots = seedlink_net::admin::Slots::with_per_source(max, per_source);
    let a = &cfg.agents;
    Core {
        registry: Registry::new(clusters),
        metrics,
        settings,
        agent_slots,
        pre_auth_slots: seedlink_net::admin::Slots::with_per_source(
            a.max_unauthenticated,
            a.max_unauthenticated_per_source,
        ),
        handshakes: seedlink_net::rate::PerSource::new(
            a.handshakes_per_source,
            2.0 * a.handshakes_per_source,
        ),
        over_rate: seedlink_net::rate::PerSource::new(
            a.handshakes_per_source,
            2.0 * a.handshakes_per_source,
        ),
        shut_out: seedlink_net::synblock::Blocklist::new(super::core::SHUT_OUT),
        gates: seedlink_net::lifecycle::Gates::default(),
        handshaker: seedlink_net::lowprio::runtime("agent-tls"),
        token_slots,
        server_id: cfg
            .server_id
            .clone()
            .filter(|id| !id.is_empty())
            .unwrap_or_else(random_id),
        pod: pod_name(),
        server_count: std::sync::atomic::AtomicU32::new(cfg.server_count),
        replica_addresses: ArcSwap::from_pointee(Vec::new()),
        agent_tls: ArcSwap::from_pointee(agent_tls),
        agent_h2: H2Settings {
            keepalive: cfg.agents.keepalive,
            keepalive_timeout: cfg.agents.keepalive_timeout,
        },
        shutdown: CancellationToken::new(),
        accepting: CancellationToken::new(),
        agents_moving: std::sync::atomic::AtomicBool::new(false),
        tasks: TaskTracker::new(),
        frontend_tasks: TaskTracker::new(),
        config: ArcSwap::from_pointee(super::core::ConfigView {
            config: serde_json::to_value(cfg).unwrap_or_default(),
            generation: 1,
            last_reload: None,
        }),
        services: std::sync::OnceLock::new(),
    }
}

/// What a reload changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReloadReport {
    /// Clusters added.
    pub added: Vec<String>,
    /// Clusters removed (their agent streams ended).
    pub removed: Vec<String>,
    /// Agent streams ended because their cluster no longer accepts their
    /// certificate.
    pub agents_rekeyed: usize,
    /// Frontends started (new or changed).
    pub frontends_started: Vec<String>,
    /// Frontends stopped (removed or changed).
    pub frontends_stopped: Vec<String>,
}

/// A configured tunnel-server: the [`Core`] its connection handlers share,
/// and what binding and reloading need. It dereferences to its core.
pub struct TunnelServer {
    /// What every connection handler shares.
    pub core: Arc<Core>,
    agent_listen: SocketAddr,
    admin_listen: Option<SocketAddr>,
    admin_token: Option<std::path::PathBuf>,
    /// What the server was built with, until `start` binds it.
    initial: Mutex<Option<Vec<PlannedFrontend>>>,
    running: tokio::sync::Mutex<Vec<Running>>,
    /// The settings a reload cannot change (they need a restart).
    fixed: Fixed,
    /// Its listening sockets as a binary upgrade sees them.
    pub(super) sockets: Sockets,
    /// What each cluster's trust was last read from (`plan_with`).
    plans: super::plan::PlanCache,
}

impl std::ops::Deref for TunnelServer {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Fixed {
    agents: (SocketAddr, Duration, Duration),
    admin: Option<SocketAddr>,
    server_id: Option<String>,
    server_count: u32,
    timeouts: (Duration, Duration, Duration, usize),
}

impl Fixed {
    fn of(cfg: &ServerConfig) -> Fixed {
        Fixed {
            agents: (
                cfg.agents.listen,
                cfg.agents.keepalive,
                cfg.agents.keepalive_timeout,
            ),
            admin: cfg.admin.as_ref().map(|a| a.listen),
            server_id: cfg.server_id.clone(),
            server_count: cfg.server_count,
            timeouts: (
                cfg.dial_timeout,
                cfg.agent_wait,
                cfg.stall_timeout,
                cfg.queue_bytes,
            ),
        }
    }
}

/// Where a started server listens.
#[derive(Debug, Clone)]
pub struct Bound {
    /// Agent endpoint.
    pub agents: SocketAddr,
    /// Admin endpoint.
    pub admin: Option<SocketAddr>,
    /// `(cluster/frontend, address or socket path)`.
    pub frontends: Vec<(String, String)>,
}

/// A random ID in UUID form.
/// The pod this process runs in (`POD_NAME`, a valid header value), by
/// which the replicas' EndpointSlices name it.
fn pod_name() -> Option<String> {
    std::env::var("POD_NAME")
        .ok()
        .filter(|n| !n.is_empty() && n.parse::<http::HeaderValue>().is_ok())
}

fn random_id() -> String {
    let b: [u8; 16] = rand::random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Binds frontend `label`'s Unix socket at `path`. A TunnelCluster's
/// socket lives in a directory of its own (docs/SECURITY.md), made here if
/// it is not there yet, never through a symlink; a file already there is
/// replaced (like upstream's `--delete-existing-uds-file`, default true).
fn bind_unix(label: &str, path: &std::path::Path) -> Result<UnixListener, ServerError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        socket_dir(label, dir)?;
    }
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path).map_err(ServerError::listen(format!(
        "{label}: listening on {}",
        path.display()
    )))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(
        ServerError::listen(format!("{label}: permissions of {}", path.display())),
    )?;
    Ok(l)
}

/// Creates a Unix socket's directory (0755) if missing; a directory that
/// is a symlink is refused.
fn socket_dir(label: &str, dir: &std::path::Path) -> Result<(), ServerError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(ServerError::listen(format!(
            "{label}: creating {}",
            dir.display()
        )))?;
    if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    let why = format!("{label}: {} is not a directory (a symlink?)", dir.display());
    Err(ServerError::listen(why)(std::io::Error::from(
        std::io::ErrorKind::InvalidInput,
    )))
}

impl TunnelServer {
    /// Builds the server (reads every certificate; nothing is bound yet).
    pub fn from_config(cfg: &ServerConfig) -> Result<Arc<TunnelServer>, ServerError> {
        let metrics = Metrics::new();
        let plans = super::plan::PlanCache::default();
        let p = super::plan::plan_with(cfg, &metrics, &plans)?;
        let clusters = p
            .clusters
            .into_iter()
            .map(|c| {
                Arc::new(Cluster::new(
                    &c.name,
                    c.conf,
                    c.limits,
                    metrics.cluster(&c.name),
                ))
            })
            .collect();
        let core = Arc::new(new_core(cfg, metrics, clusters, p.agent_tls));
        Ok(Arc::new(TunnelServer {
            sockets: Sockets::new(&core.accepting),
            core,
            agent_listen: cfg.agents.listen,
            admin_listen: cfg.admin.as_ref().map(|a| a.listen),
            admin_token: cfg.admin.as_ref().and_then(|a| a.token_file.clone()),
            initial: Mutex::new(Some(p.frontends)),
            running: tokio::sync::Mutex::new(Vec::new()),
            fixed: Fixed::of(cfg),
            plans,
        }))
    }

    /// Binds every listener and serves until [`TunnelServer::shutdown`].
    pub async fn start(self: &Arc<Self>) -> Result<Bound, ServerError> {
        self.start_with(Vec::new()).await
    }

    /// Like [`TunnelServer::start`], on the sockets a running process
    /// handed over where they match (a binary upgrade; docs/OPERATIONS.md):
    /// then frontends accept only after [`TunnelServer::open_frontends`].
    pub async fn start_with(
        self: &Arc<Self>,
        handed: Vec<seedlink_net::handoff::Socket>,
    ) -> Result<Bound, ServerError> {
        let taking_over = !handed.is_empty();
        if !taking_over {
            self.sockets.frontends_open.cancel();
        }
        self.sockets.set_handed(handed);
        let mut bound = Bound {
            agents: self.bind_agents(taking_over).await?,
            admin: None,
            frontends: Vec::new(),
        };
        let initial = seedlink_net::sync::lock(&self.initial, "initial frontends")
            .take()
            .unwrap_or_default();
        let mut running = self.running.lock().await;
        for f in initial {
            let r = self.listen(f).await?;
            bound.frontends.push((r.label.clone(), r.bound.clone()));
            running.push(r);
        }
        drop(running);
        bound.admin = self.start_admin().await?;
        Ok(bound)
    }

    /// The agent endpoint's socket (or the previous process's), and where
    /// it is bound. Taking over, agents are taken once the old process
    /// moves them (phase `agents`): until then it accepts them alone, so
    /// that none lands here while the old one still takes every dial.
    async fn bind_agents(self: &Arc<Self>, taking_over: bool) -> Result<SocketAddr, ServerError> {
        let at = format!("agents: listening on {}", self.agent_listen);
        let agents = self
            .sockets
            .tcp(handover::AGENTS, self.agent_listen)
            .await
            .map_err(ServerError::listen(at.clone()))?;
        let bound = agents.local_addr().map_err(ServerError::listen(at))?;
        if taking_over {
            *seedlink_net::sync::lock(&self.sockets.pending_agents, "pending agents") =
                Some(agents);
        } else {
            self.spawn_agent_accept(agents);
        }
        Ok(bound)
    }

    /// The admin endpoint, if configured: where it is bound.
    async fn start_admin(&self) -> Result<Option<SocketAddr>, ServerError> {
        let Some(a) = self.admin_listen else {
            return Ok(None);
        };
        let at = format!("admin: listening on {a}");
        let l = self
            .sockets
            .tcp(handover::ADMIN, a)
            .await
            .map_err(ServerError::listen(at.clone()))?;
        let bound = l.local_addr().map_err(ServerError::listen(at))?;
        let access = match &self.admin_token {
            None => seedlink_net::admin::Access::open(),
            Some(p) => seedlink_net::admin::Access::from_token_file(p).map_err(|e| {
                ServerError::Invalid {
                    at: format!("admin.token_file {}", p.display()),
                    why: e.to_string(),
                }
            })?,
        };
        let task = tokio::spawn(super::admin::serve(self.core.clone(), l, access));
        *seedlink_net::sync::lock(&self.sockets.admin_task, "admin task") = Some(task);
        Ok(Some(bound))
    }

    /// Accepts agent connections on `agents` until draining or a hand-over.
    pub(super) fn spawn_agent_accept(&self, agents: TcpListener) {
        let srv = self.core.clone();
        let stop = seedlink_net::sync::lock(&self.sockets.agent_accept, "agent accept").clone();
        tokio::spawn(async move {
            let accept = seedlink_net::accept::accept_loop(&agents, &stop, |tcp, peer| {
                srv.shut_out.release(&tcp);
                let Some(slots) = super::endpoint::enter(&srv, peer) else {
                    return;
                };
                let srv2 = srv.clone();
                srv.tasks.spawn(async move {
                    super::endpoint::serve_agent_conn(srv2, tcp, peer, slots).await;
                });
            });
            tokio::join!(accept, srv.shut_out.enforce(&agents, &stop));
        });
    }

    /// Binds one frontend and starts accepting on it.
    async fn listen(self: &Arc<Self>, f: PlannedFrontend) -> Result<Running, ServerError> {
        let label = format!(
            "{}/{}",
            f.cluster.as_deref().unwrap_or("shared"),
            f.cfg.name
        );
        let serve = Serve {
            cluster: self.frontend_cluster(f.cluster.as_deref(), &label)?,
            name: f.cfg.name.as_str().into(),
            proto: f.cfg.protocol,
            stop: self.accepting.child_token(),
        };
        let stop = serve.stop.clone();
        let (task, bound, tls) = self.bind_frontend(f.transport, &label, serve).await?;
        let unix_file = f.cfg.unix.as_ref().and_then(|p| {
            use std::os::unix::fs::MetadataExt;
            Some((p.clone(), std::fs::symlink_metadata(p).ok()?.ino()))
        });
        Ok(Running {
            cluster: f.cluster,
            cfg: f.cfg,
            tls,
            stop,
            task,
            label,
            bound,
            unix_file,
        })
    }

    /// The cluster named `name` (`None`: a shared frontend's).
    fn frontend_cluster(
        &self,
        name: Option<&str>,
        label: &str,
    ) -> Result<Option<Arc<Cluster>>, ServerError> {
        let Some(n) = name else { return Ok(None) };
        let found = self
            .registry
            .cluster(n)
            .ok_or_else(|| ServerError::Invalid {
                at: label.to_string(),
                why: format!("no cluster {n}"),
            })?;
        Ok(Some(found))
    }

    /// Binds (or takes over from the previous process) a frontend's socket
    /// and starts serving it: the task, where it is bound, and its
    /// swappable TLS acceptor if it has one.
    async fn bind_frontend(
        self: &Arc<Self>,
        transport: Transport,
        label: &str,
        serve: Serve,
    ) -> Result<Listening, ServerError> {
        let handed_name = handover::frontend(label);
        match transport {
            Transport::Unix(path) => {
                let l = match self
                    .sockets
                    .take_unix(&handed_name, &path)
                    .map_err(ServerError::listen(format!("{label}: taking over")))?
                {
                    Some(l) => l,
                    None => bind_unix(label, &path)?,
                };
                let fd = std::os::fd::AsFd::as_fd(&l)
                    .try_clone_to_owned()
                    .map_err(ServerError::listen(format!("{label}: duplicating")))?;
                self.sockets
                    .record(&handed_name, &path.display().to_string(), fd);
                Ok((
                    accept::spawn_unix(
                        self.core.clone(),
                        self.sockets.frontends_open.clone(),
                        l,
                        serve,
                    ),
                    path.display().to_string(),
                    None,
                ))
            }
            Transport::TcpPlain(addr) => {
                let (l, b) = self.tcp_listener(&handed_name, addr, label).await?;
                Ok((
                    accept::spawn_tcp(
                        self.core.clone(),
                        self.sockets.frontends_open.clone(),
                        l,
                        None,
                        serve,
                    ),
                    b,
                    None,
                ))
            }
            Transport::Tcp(addr, acceptor) => {
                let (l, b) = self.tcp_listener(&handed_name, addr, label).await?;
                let acc = Arc::new(ArcSwap::from_pointee(acceptor));
                Ok((
                    accept::spawn_tcp(
                        self.core.clone(),
                        self.sockets.frontends_open.clone(),
                        l,
                        Some(acc.clone()),
                        serve,
                    ),
                    b,
                    Some(acc),
                ))
            }
        }
    }

    /// A TCP listener on `addr` (or the previous process's), and where it
    /// is bound.
    async fn tcp_listener(
        &self,
        handed_name: &str,
        addr: SocketAddr,
        label: &str,
    ) -> Result<(TcpListener, String), ServerError> {
        let at = format!("{label}: listening on {addr}");
        let l = self
            .sockets
            .tcp(handed_name, addr)
            .await
            .map_err(ServerError::listen(at.clone()))?;
        let b = l.local_addr().map_err(ServerError::listen(at))?.to_string();
        Ok((l, b))
    }

    /// Applies a new configuration: clusters added, removed (their agent
    /// streams end, so their connections do) and updated in place (trust,
    /// strategies, limits, proxy password; agents whose certificate the new
    /// trust refuses are disconnected), frontends started, stopped or given
    /// new certificates, and a new agent endpoint certificate. Everything
    /// is read and checked before anything changes; other clusters' agents
    /// and connections are not touched. Settings outside `clusters` and
    /// `shared_frontends` (listen addresses, server ID, timeouts) need a
    /// restart: a change there is reported as an error and nothing is
    /// applied.
    pub async fn reload(self: &Arc<Self>, cfg: &ServerConfig) -> Result<ReloadReport, ServerError> {
        let result = self.reload_inner(cfg).await;
        self.metrics
            .reload(if result.is_ok() { "ok" } else { "error" });
        if result.is_err() {
            let mut view = (**self.config.load()).clone();
            view.last_reload = Some((std::time::SystemTime::now(), "failure"));
            self.config.store(Arc::new(view));
        }
        result
    }

    /// The configuration `/config` shows, one generation on.
    fn record_config(&self, cfg: &ServerConfig) {
        let previous = self.config.load();
        self.config.store(Arc::new(super::core::ConfigView {
            config: serde_json::to_value(cfg).unwrap_or_default(),
            generation: previous.generation + 1,
            last_reload: Some((std::time::SystemTime::now(), "success")),
        }));
    }

    async fn reload_inner(
        self: &Arc<Self>,
        cfg: &ServerConfig,
    ) -> Result<ReloadReport, ServerError> {
        if Fixed::of(cfg) != self.fixed {
            return Err(ServerError::NeedsRestart);
        }
        let p = super::plan::plan_with(cfg, &self.metrics, &self.plans)?;
        // One reload at a time (the lock also guards the frontend list).
        let mut running = self.running.lock().await;
        let old = self.registry.clusters();
        let changes = changes(&old, &running, &p);
        let mut report = ReloadReport {
            added: changes.clusters_added.clone(),
            removed: changes.clusters_removed.clone(),
            ..ReloadReport::default()
        };
        report.agents_rekeyed = self.apply_clusters(&old, p.clusters, &changes.clusters_removed);
        self.record_config(cfg);
        self.agent_tls.store(Arc::new(p.agent_tls));
        let errors = self
            .apply_frontends(&mut running, p.frontends, &changes, &mut report)
            .await;
        if errors.is_empty() {
            Ok(report)
        } else {
            Err(ServerError::FrontendsFailed(errors))
        }
    }

    /// Frontends: unchanged ones keep listening (new certificates are
    /// swapped in); removed or changed ones stop; new ones start. Returns
    /// why some could not start.
    async fn apply_frontends(
        self: &Arc<Self>,
        running: &mut Vec<Running>,
        planned: Vec<PlannedFrontend>,
        changes: &Changes,
        report: &mut ReloadReport,
    ) -> Vec<FrontendFailure> {
        let mut planned: Vec<Option<PlannedFrontend>> = planned.into_iter().map(Some).collect();
        let mut keep = Vec::new();
        for (i, r) in running.drain(..).enumerate() {
            match changes.frontends_kept.iter().find(|(k, _)| *k == i) {
                Some(&(_, j)) => {
                    if let (Some(slot), Some(f)) = (&r.tls, planned[j].take()) {
                        if let Transport::Tcp(_, acc) = f.transport {
                            slot.store(Arc::new(acc));
                        }
                    }
                    keep.push(r);
                }
                None => report.frontends_stopped.push(self.stop_frontend(r).await),
            }
        }
        let mut errors = Vec::new();
        for &j in &changes.frontends_started {
            let Some(f) = planned[j].take() else { continue };
            let cluster = f.cluster.clone();
            match self.listen(f).await {
                Ok(r) => {
                    report.frontends_started.push(r.label.clone());
                    keep.push(r);
                }
                Err(e) => errors.push(FrontendFailure {
                    cluster,
                    why: e.to_string(),
                }),
            }
        }
        *running = keep;
        errors
    }

    /// The planned clusters replace the running ones: a kept cluster gets
    /// its new trust and limits in place (agents its new trust refuses are
    /// disconnected: how many), a new one is added, a removed one ends its
    /// agent streams.
    fn apply_clusters(
        &self,
        old: &[Arc<Cluster>],
        planned: Vec<PlannedCluster>,
        removed: &[String],
    ) -> usize {
        let mut rekeyed = 0;
        let mut next = Vec::new();
        let by_name: std::collections::HashMap<&str, &Arc<Cluster>> =
            old.iter().map(|o| (&*o.name, o)).collect();
        for c in planned {
            match by_name.get(c.name.as_str()) {
                Some(&o) => {
                    rekeyed += update(o, c);
                    next.push(o.clone());
                }
                None => next.push(Arc::new(Cluster::new(
                    &c.name,
                    c.conf,
                    c.limits,
                    self.metrics.cluster(&c.name),
                ))),
            }
        }
        for o in old.iter().filter(|o| removed.iter().any(|n| *n == *o.name)) {
            o.removed.cancel();
        }
        self.registry.set(next);
        rekeyed
    }

    /// Stops a frontend (bounded), stops offering its socket, and removes
    /// its socket file if that is still its own; its label.
    async fn stop_frontend(&self, r: Running) -> String {
        r.stop.cancel();
        self.sockets.forget(&handover::frontend(&r.label));
        let _ = tokio::time::timeout(Duration::from_secs(5), r.task).await;
        if let Some((p, ino)) = &r.unix_file {
            use std::os::unix::fs::MetadataExt;
            if std::fs::symlink_metadata(p).is_ok_and(|m| m.ino() == *ino) {
                let _ = std::fs::remove_file(p);
            }
        }
        r.label
    }

    /// `(label, address)` of every listening frontend.
    pub async fn frontends(&self) -> Vec<(String, String)> {
        self.running
            .lock()
            .await
            .iter()
            .map(|r| (r.label.clone(), r.bound.clone()))
            .collect()
    }

    /// Drains: not ready, listeners closed (new frontends and agents are
    /// refused), DRAIN to every agent, open frontend connections may finish
    /// within `grace`; then every agent stream and remaining connection is
    /// ended.
    pub async fn stop(&self, grace: Duration) {
        self.accepting.cancel();
        // Our copies for a next process would keep the sockets open.
        self.sockets.clear();
        // Agents look for the replica that replaces this one at once (not
        // when their stream ends at the deadline), while this one serves
        // the connections it carries.
        for cluster in self.registry.clusters().iter() {
            for link in cluster.agents() {
                link.drain_notice();
            }
        }
        tokio::spawn(accept::end_idle_agent_streams(self.core.clone()));
        self.frontend_tasks.close();
        let _ = tokio::time::timeout(grace, self.frontend_tasks.wait()).await;
        self.shutdown.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.tasks.wait()).await;
    }
}

/// Running cluster `o` takes its planned settings `c`; its agents are
/// checked again only when its trust is new (read again: a plan reuses
/// what did not change). How many it disconnected.
fn update(o: &Arc<Cluster>, c: PlannedCluster) -> usize {
    let was = o.conf.load_full();
    let same = same_arc(&was.verifier, &c.conf.verifier) && same_arc(&was.token, &c.conf.token);
    o.conf.store(Arc::new(c.conf));
    o.gate.set(c.limits);
    if same {
        0
    } else {
        rekey(o)
    }
}

/// Whether `a` and `b` are both absent or the same allocation.
fn same_arc<T: ?Sized>(a: &Option<Arc<T>>, b: &Option<Arc<T>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        (None, None) => true,
        _ => false,
    }
}

/// What plan `p` changes in the running clusters and frontends.
fn changes(old: &[Arc<Cluster>], running: &[Running], p: &Plan) -> Changes {
    diff(
        &old.iter().map(|c| &*c.name).collect::<Vec<_>>(),
        &running
            .iter()
            .map(|r| (r.cluster.as_deref(), &r.cfg))
            .collect::<Vec<_>>(),
        &p.clusters
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        &p.frontends
            .iter()
            .map(|f| (f.cluster.as_deref(), &f.cfg))
            .collect::<Vec<_>>(),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// CAs linked by a signature give one cluster's agents a path to the
    /// other's trust: an agent CA that is not a root (here B's key
    /// certified by A) is refused in the configuration; a link the agent
    /// brings itself (a cross-certificate in its chain, in neither file)
    /// makes the certificate verify for both clusters, and it goes to
    /// neither.
    #[test]
    fn linked_cas_are_refused_and_an_ambiguous_agent_gets_no_cluster() {
        use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer};
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, pem: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).unwrap();
            p.display().to_string()
        };
        let ca_params = |cn: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            let mut dn = DistinguishedName::new();
            dn.push(DnType::CommonName, cn);
            p.distinguished_name = dn;
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p
        };
        let (ka, kb) = (
            rcgen::KeyPair::generate().unwrap(),
            rcgen::KeyPair::generate().unwrap(),
        );
        let ca_a = ca_params("tenant a").self_signed(&ka).unwrap();
        let ca_b = ca_params("tenant b").self_signed(&kb).unwrap();
        let issuer_a = Issuer::new(ca_params("tenant a"), &ka);
        // B's key, certified by A: everything B signs chains up to A.
        let cross = ca_params("tenant b").signed_by(&kb, &issuer_a).unwrap();
        let (a, b, linked) = (
            w("a.pem", ca_a.pem()),
            w("b.pem", ca_b.pem()),
            w("linked.pem", cross.pem()),
        );
        let server = rcgen::generate_simple_self_signed(vec!["tunnel".to_string()]).unwrap();
        let (crt, key) = (
            w("srv.pem", server.cert.pem()),
            w("srv-key.pem", server.signing_key.serialize_pem()),
        );
        let text = |ca_b: &str| {
            format!(
                "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'}}
clusters:
  - {{name: a, agent_ca: '{a}'}}
  - {{name: b, agent_ca: '{ca_b}'}}
"
            )
        };
        // An intermediate (here: B's key certified by A) is no anchor.
        let linked_cfg = crate::config::ServerConfig::parse(&text(&linked)).unwrap();
        let e: Vec<String> = linked_cfg
            .check_files()
            .iter()
            .map(|e| format!("{}: {}", e.path, e.message))
            .collect();
        assert!(
            e.iter()
                .any(|e| e.contains("agent_ca") && e.contains("not a self-signed CA")),
            "{e:?}"
        );
        let cfg = crate::config::ServerConfig::parse(&text(&b)).unwrap();

        // An agent of b presenting the cross-certificate after its leaf.
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["agent-b".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &Issuer::new(ca_params("tenant b"), &kb))
            .unwrap();
        let srv = TunnelServer::from_config(&cfg).unwrap();
        let alone = [leaf.der().clone()];
        assert_eq!(
            srv.registry
                .cluster_for_cert(&alone)
                .map(|c| c.name.to_string()),
            Ok("b".to_string())
        );
        let chained = [leaf.der().clone(), cross.der().clone()];
        assert!(matches!(
            srv.registry.cluster_for_cert(&chained),
            Err(crate::server::CertMatch::Ambiguous(..))
        ));
    }

    fn frontends(yaml: &str) -> Vec<Frontend> {
        let cfg = ServerConfig::parse(&format!(
            "agents: {{listen: '127.0.0.1:0', cert: c, key: k}}\n\
             clusters: [{{name: a, agent_ca: ca, frontends: [{yaml}]}}]\n"
        ))
        .unwrap();
        cfg.clusters[0].frontends.clone()
    }

    #[test]
    fn a_reload_keeps_what_is_unchanged_and_restarts_what_changed() {
        let old = frontends(
            "{name: x, protocol: http-connect, unix: /run/x.sock}, \
             {name: y, protocol: grpc, unix: /run/y.sock}, \
             {name: z, protocol: http-connect, unix: /run/z.sock}",
        );
        // x unchanged, y changed (another socket), z removed, w new.
        let new = frontends(
            "{name: w, protocol: http-connect, unix: /run/w.sock}, \
             {name: y, protocol: grpc, unix: /run/y2.sock}, \
             {name: x, protocol: http-connect, unix: /run/x.sock}",
        );
        let running: Vec<_> = old.iter().map(|f| (Some("a"), f)).collect();
        let planned: Vec<_> = new.iter().map(|f| (Some("a"), f)).collect();
        let c = diff(&["a", "gone"], &running, &["a", "new"], &planned);
        assert_eq!(c.clusters_added, ["new"]);
        assert_eq!(c.clusters_removed, ["gone"]);
        assert_eq!(c.frontends_kept, [(0, 2)]);
        assert_eq!(c.frontends_started, [0, 1]);
        // The same frontend under another cluster is another frontend.
        let moved: Vec<_> = old.iter().map(|f| (None, f)).collect();
        let c = diff(&["a"], &running, &["a"], &moved);
        assert!(c.frontends_kept.is_empty());
        assert_eq!(c.frontends_started, [0, 1, 2]);
        // Nothing changed: nothing restarts.
        let c = diff(&["a"], &running, &["a"], &running);
        assert_eq!(c.frontends_kept, [(0, 0), (1, 1), (2, 2)]);
        assert!(c.frontends_started.is_empty() && c.clusters_added.is_empty());
    }
}
