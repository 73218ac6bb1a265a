//! `seedlink tunnel-server` and `seedlink tunnel-agent`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use seedlink_tunnel::agent::config::AgentConfig;
use seedlink_tunnel::agent::Agent;
use seedlink_tunnel::config::ServerConfig;
use seedlink_tunnel::server::run::TunnelServer;

use super::secs;
use crate::supervisor::{BoxFut, Role, Supervisor};

/// `seedlink tunnel-agent` options.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// Read the whole configuration from this YAML file instead of flags
    /// (keys are the flags' names with `_`; see docs/TUNNEL.md).
    #[arg(long, conflicts_with_all = ["server", "server_name", "ca_cert", "agent_cert", "agent_key",
        "alpn_proto", "agent_id", "agent_identifiers", "service_account_token_path", "allow_cidr",
        "allow_port", "deny_cidr", "dial_timeout", "sync_interval", "sync_interval_cap",
        "keepalive_time", "admin", "admin_token_file", "flow_control", "transport", "drain", "egress_proxy",
        "egress_proxy_credentials_file"])]
    pub config: Option<PathBuf>,
    /// The tunnel server (or the gateway in front of it), `host:port`.
    #[arg(long, required_unless_present = "config")]
    pub server: Option<String>,
    /// TLS server name (SNI); default: the host of --server.
    #[arg(long)]
    pub server_name: Option<String>,
    /// CA certificate of the server (PEM).
    #[arg(long, required_unless_present = "config")]
    pub ca_cert: Option<PathBuf>,
    /// Client certificate (PEM); it decides the agent's cluster.
    #[arg(long, requires = "agent_key")]
    pub agent_cert: Option<PathBuf>,
    /// Its key (PEM).
    #[arg(long, requires = "agent_cert")]
    pub agent_key: Option<PathBuf>,
    /// Extra ALPN protocols to offer (comma-separated), for routing by ALPN.
    #[arg(long, value_delimiter = ',')]
    pub alpn_proto: Vec<String>,
    /// Agent ID (default: env PROXY_AGENT_ID or a random ID). The
    /// environment is read by the configuration, not as this flag, so that
    /// it also names the agent started with --config (a pod's name in a
    /// shared ConfigMap's agent).
    #[arg(long)]
    pub agent_id: Option<String>,
    /// Agent identifiers, URL query form: host=…&ipv4=…&cidr=…&default-route=true.
    #[arg(long, default_value = "")]
    pub agent_identifiers: String,
    /// ServiceAccount token file, sent as `authorization: Bearer`.
    #[arg(long)]
    pub service_account_token_path: Option<PathBuf>,
    /// Allowed destination networks (comma-separated CIDRs; default: all but the denied).
    #[arg(long, value_delimiter = ',')]
    pub allow_cidr: Vec<ipnet::IpNet>,
    /// Allowed destination ports (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub allow_port: Vec<u16>,
    /// Denied destination networks (default: link-local and cloud metadata addresses).
    #[arg(long, value_delimiter = ',')]
    pub deny_cidr: Option<Vec<ipnet::IpNet>>,
    /// Destination dial timeout, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub dial_timeout: f64,
    /// First reconnect delay and replica-discovery interval, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub sync_interval: f64,
    /// Largest reconnect delay, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub sync_interval_cap: f64,
    /// HTTP/2 PING interval towards the server, seconds. Upstream's
    /// proxy-server refuses pings closer than 30 s (GOAWAY `too_many_pings`),
    /// so the default is twice that; a server that still says so doubles it.
    #[arg(long, default_value_t = 60.0)]
    pub keepalive_time: f64,
    /// Admin endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:8093")]
    pub admin: std::net::SocketAddr,
    /// A file holding a bearer token the admin endpoint requires for
    /// everything but `/healthz` and `/readyz`.
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// Offer per-connection flow control to the server (used only when the
    /// server is seedlink; `false` forces the plain Konnectivity protocol).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub flow_control: bool,
    /// The transport to a seedlink server: `auto` (the native
    /// `seedlink-tunnel/1` when the server offers it, else gRPC) or `grpc`.
    #[arg(long, default_value = "auto")]
    pub transport: seedlink_tunnel::agent::config::Transport,
    /// Drain deadline after the first SIGTERM, seconds.
    #[arg(long, default_value_t = 30.0)]
    pub drain: f64,
    /// Reach the server through this HTTP CONNECT forward proxy,
    /// `http://host:port` (a corporate egress proxy; it resolves the
    /// server's name).
    #[arg(long)]
    pub egress_proxy: Option<String>,
    /// A file holding `user:password` for the egress proxy (Basic).
    #[arg(long, requires = "egress_proxy")]
    pub egress_proxy_credentials_file: Option<PathBuf>,
}

/// Content hash of the configuration file and every file it names (a
/// missing file hashes as missing).
pub fn fingerprint(config: &std::path::Path, cfg: &ServerConfig) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in std::iter::once(config.to_path_buf()).chain(cfg.files()) {
        p.hash(&mut h);
        std::fs::read(&p).ok().hash(&mut h);
    }
    h.finish()
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
    use std::hash::{Hash, Hasher};
    let text = match std::fs::read_to_string(config) {
        Ok(t) => t,
        Err(e) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ("unreadable", e.kind().to_string()).hash(&mut h);
            let e = anyhow::Error::from(e).context(format!("reading {}", config.display()));
            return (h.finish(), Err(e), Vec::new());
        }
    };
    let mut taken = seedlink_tunnel::config::keep_first_trust(&mut kubernetes, held, refused);
    match ServerConfig::parse_with(&text, kubernetes) {
        (Ok(cfg), mut refused) => {
            refused.append(&mut taken);
            (fingerprint(config, &cfg), Ok(cfg), refused)
        }
        (Err(e), _) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ("unparsable", &text).hash(&mut h);
            let e = anyhow::Error::from(e).context(format!("{}", config.display()));
            (h.finish(), Err(e), Vec::new())
        }
    }
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
            tracing::info!(
                added = ?r.added,
                removed = ?r.removed,
                agents_rekeyed = r.agents_rekeyed,
                started = ?r.frontends_started,
                stopped = ?r.frontends_stopped,
                "configuration reloaded"
            );
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
    /// Files the running configuration names (watched).
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
            files: Mutex::new(cfg.files()),
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
        let refused_holders: std::collections::HashSet<String> =
            seedlink_net::sync::lock(&self.status_held, "tunnel status trust")
                .values()
                .filter(|n| !kubernetes.iter().any(|c| &c.name == *n))
                .cloned()
                .collect();
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
                        vec![seedlink_config::ConfigError {
                            path: String::new(),
                            message: format!("cannot be served: {why}"),
                        }],
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
        *seedlink_net::sync::lock(&self.files, "tunnel files") = cfg.files();
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
                    let why = seedlink_config::ConfigError {
                        path: String::new(),
                        message: "not applied: the tunnel-server's configuration could not be reloaded (see its log)".into(),
                    };
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
        let client = seedlink_kube::source::client().await.map_err(|e| {
            anyhow::anyhow!("kubernetes: no usable kubeconfig or in-cluster configuration: {e}")
        })?;
        let replicas = k
            .replicas
            .as_deref()
            .map(|r| super::object_key("kubernetes.replicas", r))
            .transpose()?;
        let settings = seedlink_kube::source::TunnelSettings {
            replicas,
            lease,
            identity: super::identity(),
            trust_dir: k.trust_dir,
            socket_dir: k.socket_dir,
            max_limits: k.max_limits,
        };
        let handle =
            seedlink_kube::source::start_tunnel(client, settings, Arc::new(KubeSink(self.clone())));
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

    fn trust(&self, cluster: &str) -> Vec<String> {
        seedlink_net::sync::lock(&self.0.held, "tunnel trust")
            .iter()
            .filter(|(_, holder)| holder.as_str() == cluster)
            .map(|(claim, _)| claim.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    fn set_server_count(&self, replicas: u32) {
        let was = self.0.srv.set_server_count(replicas);
        if was != replicas {
            tracing::info!(
                was,
                now = replicas,
                "servercount follows the tunnel-server replicas"
            );
        }
    }

    fn health(&self, cluster: &str) -> Option<seedlink_tunnel::server::ClusterHealth> {
        self.0
            .srv
            .registry
            .clusters()
            .iter()
            .find(|c| &*c.name == cluster)
            .map(|c| c.health())
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
        Ok(a) => {
            let missing = srv.wait_for_agents(&a, wait).await;
            if missing.is_empty() {
                tracing::info!("upgrade: every agent moved; taking the frontends");
            } else {
                tracing::warn!(?missing, waited = ?wait, "upgrade: agents that did not move in time (an upstream agent ignores DRAIN and moves when its stream ends); taking the frontends");
            }
        }
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

/// A running agent as the supervisor sees it.
struct AgentRole {
    agent: Arc<Agent>,
    drain: Duration,
}

impl Role for AgentRole {
    fn name(&self) -> &'static str {
        "tunnel-agent"
    }

    fn files(&self) -> Vec<PathBuf> {
        // The token is read again on every connection to a server; the
        // flags and certificates are read at start (a restart applies them).
        Vec::new()
    }

    fn reload(&self, forced: bool) -> BoxFut<'_, ()> {
        if forced {
            tracing::info!("SIGHUP ignored: the tunnel-agent reads its token on every connection, its flags and certificates at start (restart to change them)");
        }
        Box::pin(async {})
    }

    fn drain(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            tracing::info!("draining: DRAIN sent to every server");
            self.agent.drain();
            // Servers stop sending new dials; open connections may finish
            // within the deadline.
            tokio::time::sleep(self.drain).await;
            self.agent.shutdown.cancel();
        })
    }
}

impl AgentArgs {
    /// The configuration these flags (or the `--config` file) describe.
    pub fn model(&self) -> anyhow::Result<AgentConfig> {
        if let Some(path) = &self.config {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            return AgentConfig::parse(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()));
        }
        Ok(AgentConfig {
            server: self.server.clone().unwrap_or_default(),
            server_name: self.server_name.clone(),
            ca_cert: self.ca_cert.clone().unwrap_or_default(),
            agent_cert: self.agent_cert.clone(),
            agent_key: self.agent_key.clone(),
            alpn_proto: self.alpn_proto.clone(),
            agent_id: self.agent_id.clone(),
            agent_identifiers: self.agent_identifiers.clone(),
            service_account_token_path: self.service_account_token_path.clone(),
            allow_cidr: self.allow_cidr.clone(),
            allow_port: self.allow_port.clone(),
            deny_cidr: self.deny_cidr.clone(),
            dial_timeout: secs(self.dial_timeout, "dial-timeout")?,
            sync_interval: secs(self.sync_interval, "sync-interval")?,
            sync_interval_cap: secs(self.sync_interval_cap, "sync-interval-cap")?,
            keepalive_time: secs(self.keepalive_time, "keepalive-time")?,
            admin: self.admin,
            admin_token_file: self.admin_token_file.clone(),
            flow_control: self.flow_control,
            transport: self.transport,
            drain: secs(self.drain, "drain")?,
            egress_proxy: self.egress_proxy.clone(),
            egress_proxy_credentials_file: self.egress_proxy_credentials_file.clone(),
        })
    }
}

/// The agent's admin endpoint: probes, its configuration (which names
/// the token file; no secret is inline) and metrics.
fn agent_admin(
    agent: Arc<Agent>,
    cfg: &AgentConfig,
) -> Arc<dyn Fn(&str) -> seedlink_net::admin::Answer + Send + Sync> {
    let config = serde_json::to_string_pretty(&serde_json::json!({"config": cfg}))
        .unwrap_or_default()
        + "\n";
    Arc::new(move |path: &str| -> seedlink_net::admin::Answer {
        use seedlink_net::admin::{encode, JSON, METRICS, TEXT};
        match path {
            "/healthz" => (200, TEXT, "ok\n".into()),
            "/config" => (200, JSON, config.clone()),
            "/readyz" | "/ready" => {
                let body = format!(
                    "server streams: {} of {} replicas ({} in all)\n",
                    agent.held(),
                    agent.known_count(),
                    agent.session_count()
                );
                if agent.ready() {
                    (200, TEXT, body)
                } else {
                    (503, TEXT, format!("[-]server-connected failed\n{body}"))
                }
            }
            "/metrics" => (200, METRICS, encode(&agent.metrics.registry)),
            _ => (
                404,
                TEXT,
                "not found; try /healthz /readyz /metrics /config\n".into(),
            ),
        }
    })
}

/// Runs the tunnel agent until drained; returns the exit code.
pub async fn agent(a: AgentArgs) -> anyhow::Result<i32> {
    let supervisor = Supervisor::install()?;
    let cfg = a.model()?;
    let opts = cfg
        .options(std::env::var("PROXY_AGENT_ID").ok())
        .map_err(|e| super::problems("tunnel-agent", a.config.is_some(), &e))?;
    let agent = Agent::new(opts)?;
    let admin = tokio::net::TcpListener::bind(cfg.admin)
        .await
        .with_context(|| format!("admin {}", cfg.admin))?;
    let admin_addr = admin.local_addr()?;
    let access = match &cfg.admin_token_file {
        None => seedlink_net::admin::Access::open(),
        Some(p) => seedlink_net::admin::Access::from_token_file(p)
            .with_context(|| format!("admin_token_file {}", p.display()))?,
    };
    let route = agent_admin(agent.clone(), &cfg);
    tokio::spawn(seedlink_net::admin::serve_with(admin, 32, access, route));
    {
        let agent = agent.clone();
        tokio::spawn(async move { agent.run().await });
    }
    let ready = serde_json::json!({"event": "ready", "admin": admin_addr.to_string(), "agent_id": agent.opts.agent_id});
    let role = AgentRole {
        agent,
        drain: cfg.drain,
    };
    let armed = supervisor.arm(vec![Arc::new(role)]);
    println!("{ready}");
    Ok(armed.run().await)
}
