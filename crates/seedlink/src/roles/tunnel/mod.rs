//! `seedlink tunnel-server` and `seedlink tunnel-agent`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use seedlink_tunnel::config::ServerConfig;
use seedlink_tunnel::server::run::TunnelServer;

use crate::supervisor::{BoxFut, Role, Supervisor};

mod agent;

pub use agent::{agent, AgentArgs};

/// Content hash of the configuration file and every file it names (a
/// missing file hashes as missing), but those the Kubernetes source
/// writes (see [`watched_files`]).
pub fn fingerprint(config: &std::path::Path, cfg: &ServerConfig) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in std::iter::once(config.to_path_buf()).chain(watched_files(cfg)) {
        p.hash(&mut h);
        std::fs::read(&p).ok().hash(&mut h);
    }
    h.finish()
}

/// The files `cfg` names but those this process writes itself (the
/// Kubernetes source's trust files, `seedlink_net::written`): the source
/// applies what it writes, so a watch on them would only apply
/// everything a second time (at a thousand tenants, a quarter of the CPU
/// of a change). Told apart by path, not by cluster: an operator's file
/// is watched whatever a TunnelCluster's name.
fn watched_files(cfg: &ServerConfig) -> Vec<PathBuf> {
    let mut files = cfg.files();
    files.retain(|p| seedlink_net::written::version(p).is_none());
    files
}

/// The configuration as it is on disk now, read and parsed once, with its
/// fingerprint; for a configuration that does not parse, the fingerprint is
/// a hash of its text (so a broken file is reported once, not on every
/// change of an unrelated file).
fn read_config(
    config: &std::path::Path,
    mut kubernetes: Vec<seedlink_tunnel::config::Cluster>,
    held: &HashMap<String, String>,
    refused: &std::collections::HashSet<String>,
) -> (
    u64,
    anyhow::Result<ServerConfig>,
    seedlink_tunnel::config::Refused,
) {
    let text = match std::fs::read_to_string(config) {
        Ok(t) => t,
        Err(e) => {
            let h = hash_of(&("unreadable", e.kind().to_string()));
            let e = anyhow::Error::from(e).context(format!("reading {}", config.display()));
            return (h, Err(e), Vec::new());
        }
    };
    let mut taken = seedlink_tunnel::config::keep_first_trust(&mut kubernetes, held, refused);
    match ServerConfig::parse_with(&text, kubernetes) {
        (Ok(cfg), mut refused) => {
            refused.append(&mut taken);
            (fingerprint(config, &cfg), Ok(cfg), refused)
        }
        (Err(e), _) => {
            let e = anyhow::Error::from(e).context(format!("{}", config.display()));
            (hash_of(&("unparsable", &text)), Err(e), Vec::new())
        }
    }
}

/// A content hash, for telling one unusable file from the next.
fn hash_of(v: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// What became of a configuration handed to the server.
enum Applied {
    /// Applied whole.
    Whole(ServerConfig),
    /// Its clusters were applied (so they hold their trust now), but some
    /// of them could not be served: these, with why.
    Partly(ServerConfig, Vec<(String, String)>),
    /// Nothing changed: the file (or a cluster, named) could not be used.
    Not(Vec<(String, String)>),
}

fn log_reloaded(r: &seedlink_tunnel::server::run::ReloadReport) {
    tracing::info!(
        added = ?r.added,
        removed = ?r.removed,
        agents_rekeyed = r.agents_rekeyed,
        started = ?r.frontends_started,
        stopped = ?r.frontends_stopped,
        "configuration reloaded"
    );
}

/// Applies `parsed`; logs what changed or why nothing did, and counts a
/// configuration that could not be read.
async fn apply(srv: &Arc<TunnelServer>, parsed: anyhow::Result<ServerConfig>) -> Applied {
    let cfg = match parsed {
        Ok(c) => c,
        Err(e) => {
            srv.metrics.reload("error");
            tracing::warn!(error = %format!("{e:#}"), "reload refused; the running configuration stays");
            return Applied::Not(Vec::new());
        }
    };
    match srv.reload(&cfg).await {
        Ok(r) => {
            log_reloaded(&r);
            Applied::Whole(cfg)
        }
        Err(e @ seedlink_tunnel::server::run::ServerError::FrontendsFailed(_)) => {
            tracing::warn!(error = %format!("{e:#}"), "reload applied, but frontends failed to start");
            Applied::Partly(cfg, e.clusters())
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "reload failed");
            Applied::Not(e.clusters())
        }
    }
}

/// What a tunnel-server is started with.
#[derive(Debug, Clone)]
pub struct TunnelServerOptions {
    /// Its configuration file.
    pub config: PathBuf,
    /// Drain deadline: open frontend connections may finish within it.
    pub drain: Duration,
}

/// A started tunnel-server as the supervisor sees it.
pub struct ServerRole {
    /// The server.
    pub srv: Arc<TunnelServer>,
    bound: seedlink_tunnel::server::run::Bound,
    opts: TunnelServerOptions,
    /// Fingerprint of the files the running configuration came from.
    seen: Mutex<u64>,
    /// Files the running configuration names (watched), but those the
    /// Kubernetes source writes ([`watched_files`]).
    files: Mutex<Vec<PathBuf>>,
    /// Clusters from TunnelClusters, added to the file's on every reload.
    kubernetes: Mutex<Vec<seedlink_tunnel::config::Cluster>>,
    /// Who holds each trust claim in the running configuration (an edit
    /// never moves trust from one cluster to another).
    held: Mutex<HashMap<String, String>>,
    /// Who holds each trust claim by the TunnelClusters' own statuses
    /// (state in the API server: fills what this process has not seen).
    status_held: Mutex<HashMap<String, String>>,
    /// The Kubernetes source, while it runs.
    source: Mutex<Option<seedlink_kube::source::Handle>>,
    /// One configuration change at a time (a file reload and a
    /// TunnelCluster change never interleave their rounds).
    applying: tokio::sync::Mutex<()>,
    /// A new process is taking the sockets over: reloads wait (a frontend
    /// rebound now would take its path from the new process's socket).
    frozen: std::sync::atomic::AtomicBool,
}

impl ServerRole {
    /// Reads the configuration (every file it names), binds every listener.
    /// With `handed` sockets (a binary upgrade) it serves on those that
    /// match, and its frontends wait for [`TunnelServer::open_frontends`].
    pub async fn start(
        opts: TunnelServerOptions,
        handed: Vec<seedlink_net::handoff::Socket>,
    ) -> anyhow::Result<ServerRole> {
        let text = std::fs::read_to_string(&opts.config)
            .with_context(|| format!("reading {}", opts.config.display()))?;
        let cfg =
            ServerConfig::parse(&text).with_context(|| format!("{}", opts.config.display()))?;
        let srv = TunnelServer::from_config(&cfg)?;
        let bound = srv.start_with(handed).await?;
        Ok(ServerRole {
            srv,
            bound,
            seen: Mutex::new(fingerprint(&opts.config, &cfg)),
            files: Mutex::new(watched_files(&cfg)),
            kubernetes: Mutex::new(Vec::new()),
            held: Mutex::new(seedlink_tunnel::config::trust_holders(&cfg)),
            status_held: Mutex::new(HashMap::new()),
            applying: tokio::sync::Mutex::new(()),
            source: Mutex::new(None),
            frozen: std::sync::atomic::AtomicBool::new(false),
            opts,
        })
    }

    /// Serves `clusters` from TunnelClusters besides the file's, through
    /// the same reload; returns those refused, with their problems.
    /// `status_held` says who holds which trust claim by the objects'
    /// statuses.
    pub async fn set_kubernetes(
        &self,
        clusters: Vec<seedlink_tunnel::config::Cluster>,
        status_held: HashMap<String, String>,
    ) -> seedlink_tunnel::config::Refused {
        *seedlink_net::sync::lock(&self.kubernetes, "tunnel kubernetes") = clusters.clone();
        *seedlink_net::sync::lock(&self.status_held, "tunnel status trust") = status_held;
        if self.frozen.load(std::sync::atomic::Ordering::Acquire) {
            tracing::info!("TunnelClusters changed during a binary upgrade: applied by the new process (or here, if it fails)");
            return Vec::new();
        }
        drop(clusters);
        let (refused, whole) = self.apply_with(true).await;
        if whole {
            // The configuration is complete: sockets handed over that no
            // frontend claimed are closed.
            self.srv.drop_unclaimed();
        }
        for (name, problems) in &refused {
            let text: Vec<String> = problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect();
            tracing::warn!(cluster = %name, problems = %text.join("; "), "cluster from Kubernetes refused; the others are served");
        }
        refused
    }

    /// The claims held now: the running configuration's, with the
    /// statuses' filling the gaps.
    fn holders(&self) -> HashMap<String, String> {
        let mut held = seedlink_net::sync::lock(&self.status_held, "tunnel status trust").clone();
        held.extend(seedlink_net::sync::lock(&self.held, "tunnel trust").clone());
        held
    }

    /// Reads the file, adds `kubernetes` and applies the result (unless
    /// it is what runs and `forced` is false). A TunnelCluster that cannot
    /// be served (its trust does not load, its frontend does not bind) is
    /// refused alone and the rest applied again without it: only the
    /// operator's file can fail a reload as a whole. Returns the refused
    /// TunnelClusters with why, and whether the rest was applied whole.
    async fn apply_with(&self, forced: bool) -> (seedlink_tunnel::config::Refused, bool) {
        let _one = self.applying.lock().await;
        // The latest TunnelClusters, read under the lock.
        let mut kubernetes =
            seedlink_net::sync::lock(&self.kubernetes, "tunnel kubernetes").clone();
        // TunnelClusters whose objects exist (their status says they hold
        // trust) but that are not among those to apply (refused before
        // the server saw them): they keep what they hold.
        let named: std::collections::HashSet<&str> =
            kubernetes.iter().map(|c| c.name.as_str()).collect();
        let refused_holders: std::collections::HashSet<String> =
            seedlink_net::sync::lock(&self.status_held, "tunnel status trust")
                .values()
                .filter(|n| !named.contains(n.as_str()))
                .cloned()
                .collect();
        drop(named);
        let mut failed: seedlink_tunnel::config::Refused = Vec::new();
        // Each round refuses at least one more cluster, or ends.
        loop {
            let (now, parsed, mut refused) = read_config(
                &self.opts.config,
                kubernetes.clone(),
                &self.holders(),
                &refused_holders,
            );
            let seen = *seedlink_net::sync::lock(&self.seen, "tunnel fingerprint");
            if !forced && now == seen && failed.is_empty() {
                return (refused, false);
            }
            *seedlink_net::sync::lock(&self.seen, "tunnel fingerprint") = now;
            let theirs = match apply(&self.srv, parsed).await {
                Applied::Whole(cfg) => {
                    self.applied(&cfg);
                    refused.append(&mut failed);
                    return (refused, true);
                }
                Applied::Partly(cfg, theirs) => {
                    self.applied(&cfg);
                    theirs
                }
                Applied::Not(theirs) => theirs,
            };
            let before = kubernetes.len();
            for (name, why) in theirs {
                if let Some(i) = kubernetes.iter().position(|c| c.name == name) {
                    kubernetes.remove(i);
                    failed.push((
                        name,
                        vec![seedlink_config::ConfigError::new(
                            String::new(),
                            format!("cannot be served: {why}"),
                        )],
                    ));
                }
            }
            if kubernetes.len() == before {
                // The operator's own part failed (logged): what is not
                // running is not served.
                return (self.not_running(kubernetes, failed), false);
            }
        }
    }

    /// Records what the running configuration is after `cfg` was applied
    /// (its clusters hold their trust from now on).
    fn applied(&self, cfg: &ServerConfig) {
        *seedlink_net::sync::lock(&self.files, "tunnel files") = watched_files(cfg);
        *seedlink_net::sync::lock(&self.held, "tunnel trust") =
            seedlink_tunnel::config::trust_holders(cfg);
    }

    /// The TunnelClusters among `kubernetes` that do not run, each with
    /// why, after a reload the operator's file failed.
    fn not_running(
        &self,
        kubernetes: Vec<seedlink_tunnel::config::Cluster>,
        mut failed: seedlink_tunnel::config::Refused,
    ) -> seedlink_tunnel::config::Refused {
        let running = self.srv.registry.clusters();
        failed.extend(
            kubernetes
                .into_iter()
                .filter(|c| !running.iter().any(|r| *r.name == *c.name))
                .map(|c| {
                    let why = seedlink_config::ConfigError::new(String::new(), "not applied: the tunnel-server's configuration could not be reloaded (see its log)");
                    (c.name, vec![why])
                }),
        );
        failed
    }

    /// Starts the Kubernetes source when the file has a `kubernetes`
    /// section, and waits (bounded) for its first snapshot.
    pub async fn start_kubernetes(self: &Arc<Self>) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.opts.config)
            .with_context(|| format!("reading {}", self.opts.config.display()))?;
        let cfg = ServerConfig::parse(&text)
            .with_context(|| format!("{}", self.opts.config.display()))?;
        let Some(k) = cfg.kubernetes else {
            return Ok(());
        };
        let lease = match k.write_status {
            false => None,
            true => Some(super::object_key("kubernetes.lease", &k.lease)?),
        };
        let clients =
            seedlink_kube::source::clients(k.watches_per_connection, k.max_api_connections)
                .await
                .map_err(|e| {
                    anyhow::anyhow!(
                        "kubernetes: no usable kubeconfig or in-cluster configuration: {e}"
                    )
                })?;
        self.look_up_services(clients.main());
        let replicas = k
            .replicas
            .as_deref()
            .map(|r| super::object_key("kubernetes.replicas", r))
            .transpose()?;
        let settings = seedlink_kube::source::TunnelSettings {
            replicas,
            replica_addresses: k.replica_addresses,
            trust_watch: k.trust_watch,
            lease,
            identity: super::identity(),
            trust_dir: k.trust_dir,
            socket_dir: k.socket_dir,
            bounds: seedlink_kube::tunnel::Bounds {
                max_limits: k.max_limits,
                review_cidrs: k.review_cidrs,
            },
            released_trust_hold: k.released_trust_hold,
        };
        let handle = seedlink_kube::source::start_tunnel(
            clients,
            settings,
            Arc::new(KubeSink(self.clone())),
        );
        self.srv
            .core
            .metrics
            .sections
            .add(Arc::new(handle.metrics()));
        let readiness = handle.readiness();
        self.srv
            .core
            .gates
            .add("kubernetes", Arc::new(move || readiness.why_not()));
        if handle.synced(super::FIRST_SYNC).await {
            tracing::info!("kubernetes: first TunnelCluster snapshot applied");
        } else {
            tracing::error!(waited = ?super::FIRST_SYNC, "kubernetes: no snapshot yet (API server unreachable?); serving the file's clusters and not ready until TunnelClusters are read");
        }
        *seedlink_net::sync::lock(&self.source, "tunnel source") = Some(handle);
        Ok(())
    }
}

impl ServerRole {
    /// What `seedlink seed`'s readiness asks of its tunnel-server half:
    /// not draining, and its Kubernetes source's first snapshot applied.
    /// Not agents: a seed is ready before its first shoot connects.
    pub fn readiness(&self) -> seedlink_net::lifecycle::Gate {
        let core = self.srv.core.clone();
        Arc::new(move || {
            if core.accepting.is_cancelled() {
                return Some("draining".to_string());
            }
            let unmet = core.gates.unmet();
            (!unmet.is_empty()).then(|| unmet.join("; "))
        })
    }
}

impl ServerRole {
    /// Seed Services (a TunnelCluster's `seedServices`) are read from the
    /// API server `client` serves.
    fn look_up_services(&self, client: &kube::Client) {
        let lookup = Arc::new(KubeServices(client.clone()));
        let services = seedlink_tunnel::server::services::Services::new(lookup);
        let _ = self.srv.core.services.set(Arc::new(services));
    }
}

/// Seed Services read from the API server (a TunnelCluster's
/// `seedServices`).
struct KubeServices(kube::Client);

impl seedlink_tunnel::server::services::ServiceLookup for KubeServices {
    fn cluster_ip<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        port: u16,
    ) -> seedlink_tunnel::server::services::BoxFuture<
        'a,
        Result<std::net::IpAddr, seedlink_tunnel::server::services::LookupError>,
    > {
        use seedlink_kube::seed_services::{seed_service_ip, SeedServiceError};
        use seedlink_tunnel::server::services::LookupError;
        Box::pin(async move {
            seed_service_ip(&self.0, namespace, name, port)
                .await
                .map_err(|e| match e {
                    SeedServiceError::Refused(why) => LookupError::Refused(why),
                    SeedServiceError::Unavailable => LookupError::Unavailable,
                })
        })
    }
}

/// The tunnel-server as the Kubernetes source's sink.
struct KubeSink(Arc<ServerRole>);

impl seedlink_kube::source::TunnelSink for KubeSink {
    fn apply(
        &self,
        clusters: Vec<seedlink_tunnel::config::Cluster>,
        status_held: HashMap<String, String>,
    ) -> seedlink_kube::source::BoxFuture<'_, seedlink_tunnel::config::Refused> {
        Box::pin(self.0.set_kubernetes(clusters, status_held))
    }

    fn trust(&self) -> HashMap<String, Vec<String>> {
        let mut by_cluster: HashMap<String, Vec<String>> = HashMap::new();
        for (claim, holder) in seedlink_net::sync::lock(&self.0.held, "tunnel trust").iter() {
            by_cluster
                .entry(holder.clone())
                .or_default()
                .push(claim.clone());
        }
        for claims in by_cluster.values_mut() {
            claims.sort();
            claims.dedup();
        }
        by_cluster
    }

    fn set_replicas(&self, count: u32, at: Vec<seedlink_kube::source::Replica>) {
        let at: Vec<_> = at
            .into_iter()
            .map(|r| seedlink_tunnel::proto::Replica {
                pod: r.pod,
                address: r.address,
                server_name: r.server_name,
            })
            .collect();
        let was = self.0.srv.set_replicas(count, at);
        if was != count {
            tracing::info!(
                was,
                now = count,
                "servercount follows the tunnel-server replicas"
            );
        }
    }

    fn health(&self) -> HashMap<String, seedlink_tunnel::server::ClusterHealth> {
        self.0
            .srv
            .registry
            .clusters()
            .iter()
            .fold(HashMap::new(), |mut by_name, c| {
                by_name
                    .entry(c.name.to_string())
                    .or_insert_with(|| c.health());
                by_name
            })
    }
}

impl ServerRole {
    /// The bound addresses, for the ready line.
    pub fn ready_line(&self) -> serde_json::Value {
        let frontends: serde_json::Map<String, serde_json::Value> = self
            .bound
            .frontends
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into()))
            .collect();
        serde_json::json!({
            "agents": self.bound.agents.to_string(),
            "admin": self.bound.admin.map(|a| a.to_string()),
            "frontends": frontends,
            "server_id": self.srv.server_id,
        })
    }
}

impl Role for ServerRole {
    fn name(&self) -> &'static str {
        "tunnel-server"
    }

    fn files(&self) -> Vec<PathBuf> {
        let mut f = vec![self.opts.config.clone()];
        f.extend(
            seedlink_net::sync::lock(&self.files, "tunnel files")
                .iter()
                .cloned(),
        );
        f
    }

    fn reload(&self, forced: bool) -> BoxFut<'_, ()> {
        Box::pin(async move {
            if self.frozen.load(std::sync::atomic::Ordering::Acquire) {
                tracing::info!("reload deferred: a binary upgrade is under way");
                return;
            }
            // Kubernetes touches files without changing them; contents
            // decide, unless SIGHUP asked. What this refuses reaches the
            // objects' status on the source's next pass.
            self.apply_with(forced).await;
        })
    }

    fn drain(&self) -> BoxFut<'_, ()> {
        let source = seedlink_net::sync::lock(&self.source, "tunnel source").take();
        Box::pin(async move {
            // The server stops accepting at once (a new process or another
            // replica takes what comes now) while the source releases a
            // held status lease (bounded), then drains.
            let source = async {
                if let Some(h) = source {
                    h.shutdown(Duration::from_secs(3)).await;
                }
            };
            tokio::join!(source, self.srv.stop(self.opts.drain));
        })
    }
}

/// Runs `seedlink tunnel-server` until drained; returns the exit code.
/// With `--take-over` it takes the running server's sockets in two phases
/// (`seedlink_tunnel::server::handover`): agents first, frontends once they
/// moved.
pub async fn server(opts: TunnelServerOptions, upgrade: super::Upgrade) -> anyhow::Result<i32> {
    let supervisor = Supervisor::install()?;
    let (handed, taken) = match upgrade.take().await? {
        Some((sockets, taken)) => (sockets, Some(taken)),
        None => (Vec::new(), None),
    };
    let role = Arc::new(ServerRole::start(opts, handed).await?);
    role.start_kubernetes().await?;
    if seedlink_net::sync::lock(&role.source, "tunnel source").is_none() {
        // The file is the whole configuration: every frontend is bound.
        role.srv.drop_unclaimed();
    }
    let confirmed = match taken {
        Some(taken) => take_agents_then_frontends(&role.srv, taken, upgrade.wait).await,
        None => true,
    };
    let mut armed = supervisor.arm(vec![role.clone()]);
    if upgrade.socket.is_some() {
        let (srv, srv2) = (role.srv.clone(), role.srv.clone());
        let handed = upgrade.offer(
            Box::new(move || srv.offered_sockets()),
            Box::new(Phases {
                role: role.clone(),
                rt: tokio::runtime::Handle::current(),
            }),
            role.srv.accepting.clone(),
            confirmed,
            Box::new(move || srv2.handed_over()),
        )?;
        if let Some(rx) = handed {
            armed = armed.drain_when_handed_over(rx);
        }
    }
    let mut ready = role.ready_line();
    ready["event"] = "ready".into();
    println!("{ready}");
    Ok(armed.run().await)
}

/// Waits (within `wait`) for the agents the previous process named to
/// connect here, and says which did not.
async fn wait_for_agents(srv: &TunnelServer, answer: &str, wait: Duration) {
    let missing = srv.wait_for_agents(answer, wait).await;
    if missing.is_empty() {
        tracing::info!("upgrade: every agent moved; taking the frontends");
    } else {
        tracing::warn!(?missing, waited = ?wait, "upgrade: agents that did not move in time (an upstream agent ignores DRAIN and moves when its stream ends); taking the frontends");
    }
}

/// The new process's side of a tunnel-server hand-over: asks the old one
/// to move its agents (phase `agents`), waits up to `wait` for them, takes
/// the frontends, and confirms. Whether the old process confirmed.
async fn take_agents_then_frontends(
    srv: &Arc<TunnelServer>,
    mut taken: seedlink_net::handoff::Taken,
    wait: Duration,
) -> bool {
    let asked = tokio::task::spawn_blocking(move || {
        let a = taken.phase("agents");
        (taken, a)
    })
    .await;
    srv.accept_agents();
    let Ok((taken, answer)) = asked else {
        tracing::error!("upgrade: asking the previous tunnel-server for its agents failed");
        srv.open_frontends();
        return false;
    };
    match answer {
        Ok(a) => wait_for_agents(srv, &a, wait).await,
        Err(e) => {
            tracing::warn!(error = %e, "upgrade: the previous tunnel-server did not hand its agents over; taking the frontends")
        }
    }
    srv.open_frontends();
    super::Upgrade::confirm(taken).await
}

/// The old process's side of the hand-over's phases.
struct Phases {
    role: Arc<ServerRole>,
    rt: tokio::runtime::Handle,
}

impl seedlink_net::handoff::Phases for Phases {
    fn began(&self) {
        self.role
            .frozen
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn phase(&self, name: &str) -> String {
        match name {
            "agents" => self.role.srv.hand_agents_over(),
            _ => "unknown".into(),
        }
    }

    fn abort(&self) {
        let _in_runtime = self.rt.enter();
        self.role.srv.resume_agents();
        let was = self
            .role
            .frozen
            .swap(false, std::sync::atomic::Ordering::AcqRel);
        if was {
            // What changed meanwhile is applied now.
            let role = self.role.clone();
            self.rt.spawn(async move {
                let kubernetes =
                    seedlink_net::sync::lock(&role.kubernetes, "tunnel kubernetes").clone();
                let held =
                    seedlink_net::sync::lock(&role.status_held, "tunnel status trust").clone();
                role.set_kubernetes(kubernetes, held).await;
                role.reload(true).await;
            });
        }
    }
}
