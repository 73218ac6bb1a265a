//! `seedlink gateway` and `seedlink seed` (the gateway and the
//! tunnel-server in one process).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use seedlink_gateway::Gateway;

use super::tunnel::{ServerRole, TunnelServerOptions};
use crate::supervisor::{BoxFut, Role, Supervisor};

/// The gateway as the supervisor sees it.
pub struct GatewayRole(pub Arc<Gateway>);

/// The gateway with its Kubernetes source: draining first stops the source
/// and releases a held status lease (so another replica writes status at
/// once, not after this one's drain), then drains the gateway.
pub struct GatewayWithSource {
    role: GatewayRole,
    source: std::sync::Mutex<Option<seedlink_kube::source::Handle>>,
}

impl GatewayWithSource {
    fn new(gw: Arc<Gateway>, source: Option<seedlink_kube::source::Handle>) -> Arc<Self> {
        Arc::new(GatewayWithSource {
            role: GatewayRole(gw),
            source: std::sync::Mutex::new(source),
        })
    }
}

impl Role for GatewayWithSource {
    fn name(&self) -> &'static str {
        self.role.name()
    }

    fn files(&self) -> Vec<PathBuf> {
        self.role.files()
    }

    fn reload(&self, forced: bool) -> BoxFut<'_, ()> {
        self.role.reload(forced)
    }

    fn drain(&self) -> BoxFut<'_, ()> {
        let source = seedlink_net::sync::lock(&self.source, "gateway source").take();
        Box::pin(async move {
            if let Some(h) = source {
                h.shutdown(Duration::from_secs(3)).await;
            }
            self.role.drain().await;
        })
    }
}

impl Role for GatewayRole {
    fn name(&self) -> &'static str {
        "gateway"
    }

    fn files(&self) -> Vec<PathBuf> {
        self.0
            .config_path()
            .map(|p| p.to_path_buf())
            .into_iter()
            .collect()
    }

    fn reload(&self, _forced: bool) -> BoxFut<'_, ()> {
        // The gateway compiles the file and swaps only a valid snapshot; it
        // logs and counts the outcome.
        let _ = self.0.reload();
        Box::pin(async {})
    }

    fn drain(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let gw = &self.0;
            tracing::info!(deadline = ?gw.snapshot().timeouts.drain, open = gw.lifecycle.tasks.len(), "gateway draining");
            let closed = gw.drain().await;
            tracing::info!(closed_at_deadline = closed, "gateway drained");
        })
    }
}

/// A gateway from its configuration file (every problem logged).
pub fn load(config: PathBuf) -> anyhow::Result<Arc<Gateway>> {
    let snapshot = match seedlink_config::load(&config, None) {
        Ok(s) => s,
        Err(errors) => {
            for e in &errors.0 {
                tracing::error!(path = %e.path, problem = %e.message, "invalid configuration");
            }
            anyhow::bail!(
                "{}: invalid configuration ({} problem(s))",
                config.display(),
                errors.0.len()
            );
        }
    };
    Ok(Gateway::new(snapshot, Some(config)))
}

/// The gateway as the Kubernetes source's sink.
struct KubeSink(Arc<Gateway>);

impl seedlink_kube::source::GatewaySink for KubeSink {
    fn apply(
        &self,
        control_planes: Vec<seedlink_config::model::ControlPlane>,
    ) -> Vec<(String, Vec<seedlink_config::ConfigError>)> {
        self.0.set_kubernetes(control_planes)
    }
}

/// How long a start waits for the first Kubernetes snapshot before it
/// serves the file's control planes alone (the routes follow when the API
/// server answers).
pub const FIRST_SYNC: Duration = Duration::from_secs(30);

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

/// Starts the Kubernetes source when the file has a `kubernetes` section,
/// and waits (bounded) for its first snapshot.
pub async fn kubernetes(
    gw: &Arc<Gateway>,
) -> anyhow::Result<Option<seedlink_kube::source::Handle>> {
    let snap = gw.snapshot();
    let Some(k) = snap.file.kubernetes.clone() else {
        return Ok(None);
    };
    let split = |s: &str| {
        seedlink_config::compile::split_object_name(s).map(|(namespace, name)| {
            seedlink_kube::translate::Key {
                namespace: namespace.into(),
                name: name.into(),
            }
        })
    };
    let gateway = match &k.gateway {
        Some(g) => Some(
            split(g).ok_or_else(|| anyhow::anyhow!("kubernetes.gateway: not namespace/name"))?,
        ),
        None => None,
    };
    let home = gateway.as_ref().map(|g| g.namespace.clone());
    let lease = match (&k.lease, k.write_status, &home) {
        (_, false, _) => None,
        (Some(l), true, _) => {
            Some(split(l).ok_or_else(|| anyhow::anyhow!("kubernetes.lease: not namespace/name"))?)
        }
        (None, true, Some(ns)) => Some(seedlink_kube::translate::Key {
            namespace: ns.clone(),
            name: "seedlink-status".into(),
        }),
        (None, true, None) => {
            anyhow::bail!("kubernetes.lease: required without kubernetes.gateway")
        }
    };
    let service = match (&k.service, &home) {
        (Some(s), _) => Some(
            split(s).ok_or_else(|| anyhow::anyhow!("kubernetes.service: not namespace/name"))?,
        ),
        (None, Some(ns)) => Some(seedlink_kube::translate::Key {
            namespace: ns.clone(),
            name: "seedlink".into(),
        }),
        (None, None) => None,
    };
    let class = k
        .gateway_class
        .as_ref()
        .map(|c| seedlink_kube::translate::ClassSettings {
            name: c.name.clone(),
            // Validated by the configuration's compile step.
            addresses: c
                .addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .map(seedlink_config::routes::canonical)
                .collect(),
            receivers: snap
                .listeners
                .iter()
                .filter(|l| {
                    matches!(
                        l.protocol,
                        seedlink_config::model::Protocol::Tls
                            | seedlink_config::model::Protocol::Auto
                    )
                })
                .map(|l| l.address)
                .collect(),
        });
    let client = kube::Client::try_default().await.map_err(|e| {
        anyhow::anyhow!("kubernetes: no usable kubeconfig or in-cluster configuration: {e}")
    })?;
    let identity = identity();
    let settings = seedlink_kube::source::GatewaySettings {
        gateway,
        class,
        listeners: snap.file.listeners.iter().map(|l| l.name.clone()).collect(),
        lease,
        identity,
        slice_managers: k.endpointslice_managers.clone(),
        service,
    };
    let handle =
        seedlink_kube::source::start_gateway(client, settings, Arc::new(KubeSink(gw.clone())));
    if handle.synced(FIRST_SYNC).await {
        tracing::info!(
            control_planes = gw.snapshot().control_planes.len(),
            "kubernetes: first snapshot applied"
        );
    } else {
        tracing::error!(waited = ?FIRST_SYNC, "kubernetes: no snapshot yet (API server unreachable?); serving the file's control planes, routes follow when it answers");
    }
    Ok(Some(handle))
}

/// How `seedlink gateway` gets its sockets and hands them on.
#[derive(Debug, Clone, Default)]
pub struct Upgrade {
    /// Share ports with a running gateway (`SO_REUSEPORT`, the old way).
    pub reuse_port: bool,
    /// Offer the sockets on this Unix socket to a next binary
    /// (`--upgrade-socket`).
    pub socket: Option<PathBuf>,
    /// Take the sockets from the gateway offering them at `socket` first
    /// (`--take-over`).
    pub take_over: bool,
}

/// Runs `seedlink gateway` until drained; returns the exit code.
pub async fn run(config: PathBuf, upgrade: Upgrade) -> anyhow::Result<i32> {
    let gw = load(config)?;
    let kube = kubernetes(&gw).await?;
    let supervisor = Supervisor::install()?;
    let (bound, taken) = match (&upgrade.socket, upgrade.take_over) {
        (Some(path), true) => {
            let path = path.clone();
            let (sockets, taken) =
                tokio::task::spawn_blocking(move || seedlink_net::handoff::take(&path)).await??;
            (gw.bind_handed(sockets)?, Some(taken))
        }
        (None, true) => anyhow::bail!(
            "--take-over needs --upgrade-socket (where the running gateway offers its sockets)"
        ),
        _ => (gw.bind(upgrade.reuse_port)?, None),
    };
    let offered = match &upgrade.socket {
        Some(_) => Some(bound.offer()?),
        None => None,
    };
    if let Some(o) = offered
        .as_ref()
        .filter(|o| o.len() > seedlink_net::handoff::MAX_SOCKETS)
    {
        anyhow::bail!(
            "--upgrade-socket: {} sockets to hand over (listeners x workers + admin), at most {}; lower `workers`",
            o.len(),
            seedlink_net::handoff::MAX_SOCKETS
        );
    }
    let mut ready = bound.describe();
    ready["event"] = "ready".into();
    gw.serve(bound)?;
    let mut armed = supervisor.arm(vec![GatewayWithSource::new(gw.clone(), kube)]);
    // From here on this process serves: a failure only costs the next
    // upgrade (logged), never the service.
    let mut confirmed = true;
    if let Some(taken) = taken {
        // The old gateway stops accepting and drains; its offer file is
        // gone once it answers.
        match tokio::task::spawn_blocking(move || taken.ready()).await {
            Ok(Ok(())) => tracing::info!("upgrade: the previous gateway hands over and drains"),
            Ok(Err(e)) => {
                confirmed = false;
                tracing::warn!(error = %e, "upgrade: the previous gateway did not confirm; it may still accept, and this one does not offer its sockets");
            }
            Err(e) => {
                confirmed = false;
                tracing::warn!(error = %e, "upgrade: confirming to the previous gateway failed");
            }
        }
    }
    let listener = match (&upgrade.socket, confirmed) {
        (Some(path), true) => match seedlink_net::handoff::listen(path) {
            Ok(l) => Some(l),
            Err(e) if upgrade.take_over => {
                tracing::error!(error = %e, "--upgrade-socket: cannot offer the sockets for the next upgrade");
                None
            }
            Err(e) => anyhow::bail!("--upgrade-socket {}: {e}", path.display()),
        },
        _ => None,
    };
    if let (Some(path), Some(sockets), Some(listener)) = (upgrade.socket, offered, listener) {
        let offer = seedlink_net::handoff::Offer::new(path, sockets);
        // A drain for any other reason withdraws the offer: its copies of
        // the listening sockets must not keep them open.
        {
            let (offer, stop) = (offer.clone(), gw.lifecycle.stop_accepting.clone());
            tokio::spawn(async move {
                stop.cancelled().await;
                offer.withdraw();
            });
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let gw = gw.clone();
        let spawned = std::thread::Builder::new()
            .name("seedlink-upgrade".into())
            .spawn(move || match seedlink_net::handoff::offer(listener, &offer) {
                Ok(true) => {
                    gw.handed_over();
                    let _ = tx.blocking_send(());
                }
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, "upgrade socket failed; no binary upgrade possible"),
            });
        match spawned {
            Ok(_) => armed = armed.drain_when_handed_over(rx),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the upgrade thread; no binary upgrade possible")
            }
        }
    }
    // One machine-readable line on stdout tells scripts and tests the bound
    // addresses (listeners may be configured with port 0); by then the
    // sockets are offered for the next upgrade, if asked.
    println!("{ready}");
    tracing::info!(addresses = %ready, "gateway serving");
    Ok(armed.run().await)
}

/// Runs `seedlink seed`: agents' connections that the gateway routes to an
/// endpoint `local:tunnel-server` are handed to the tunnel-server in
/// process. On SIGTERM the gateway drains first, then the tunnel-server.
pub async fn seed(
    gw_config: PathBuf,
    tunnel: TunnelServerOptions,
    reuse_port: bool,
) -> anyhow::Result<i32> {
    let server = Arc::new(ServerRole::start(tunnel).await?);
    server.start_kubernetes().await?;
    let gw = load(gw_config)?;
    let kube = kubernetes(&gw).await?;
    {
        let srv = server.srv.clone();
        // Agents' TLS is taken over as is; a CONNECT is answered by the
        // cluster named like the control plane it was routed to.
        gw.set_local(
            "tunnel-server",
            Arc::new(move |h: seedlink_gateway::Handoff| match h.connect_target {
                None => srv.hand_over(h.stream, h.replay, h.client),
                Some(target) => srv.connect_handoff(h.stream, h.replay, &h.control_plane, target),
            }),
        );
    }
    let supervisor = Supervisor::install()?;
    let bound = gw.bind(reuse_port)?;
    let mut ready = bound.describe();
    gw.serve(bound)?;
    ready["event"] = "ready".into();
    ready["tunnel"] = server.ready_line();
    let roles: Vec<Arc<dyn Role>> = vec![GatewayWithSource::new(gw, kube), server];
    let armed = supervisor.arm(roles);
    println!("{ready}");
    Ok(armed.run().await)
}
