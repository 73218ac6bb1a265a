//! `seedlink gateway` and `seedlink seed` (the gateway and the
//! tunnel-server in one process).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use seedlink_gateway::Gateway;

use super::{identity, FIRST_SYNC};
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
    /// The gateway and its Kubernetes source, as one role.
    pub fn new(gw: Arc<Gateway>, source: Option<seedlink_kube::source::Handle>) -> Arc<Self> {
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
        control_planes: Vec<Arc<seedlink_config::model::ControlPlane>>,
    ) -> Vec<(String, Vec<seedlink_config::ConfigError>)> {
        self.0.set_kubernetes(control_planes)
    }

    fn legacy_paths(&self) -> seedlink_kube::source::LegacyPaths {
        let snap = self.0.snapshot();
        let listeners = &snap.file.listeners;
        if !listeners.iter().any(|l| l.legacy) {
            return None;
        }
        seedlink_gateway::paths::legacy(&self.0.paths_in_use(None), listeners)
    }
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
    let settings = gateway_settings(&k, &snap)?;
    // Every watch of the gateway is on the main connection.
    let clients = seedlink_kube::source::clients(seedlink_kube::source::WATCHES_PER_CONNECTION, 1)
        .await
        .map_err(|e| {
            anyhow::anyhow!("kubernetes: no usable kubeconfig or in-cluster configuration: {e}")
        })?;
    let handle =
        seedlink_kube::source::start_gateway(clients, settings, Arc::new(KubeSink(gw.clone())));
    gw.metrics.sections.add(Arc::new(handle.metrics()));
    // Not ready before the first complete snapshot, however long the API
    // server takes: a pod started during an outage would otherwise join
    // the load balancer serving none of the routes.
    let readiness = handle.readiness();
    gw.lifecycle
        .gates
        .add("kubernetes", Arc::new(move || readiness.why_not()));
    if handle.synced(FIRST_SYNC).await {
        tracing::info!(
            control_planes = gw.snapshot().control_planes.len(),
            "kubernetes: first snapshot applied"
        );
    } else {
        tracing::error!(waited = ?FIRST_SYNC, "kubernetes: no snapshot yet (API server unreachable?); serving the file's control planes and not ready until the routes are read");
    }
    Ok(Some(handle))
}

/// The Kubernetes source's settings from the file's `kubernetes` section:
/// the named Gateway, the status Lease and Service (defaults in the
/// Gateway's namespace), the class and its addresses.
fn gateway_settings(
    k: &seedlink_config::model::KubernetesSource,
    snap: &seedlink_config::Snapshot,
) -> anyhow::Result<seedlink_kube::source::GatewaySettings> {
    let in_home = |ns: &String, name: &str| seedlink_kube::translate::Key {
        namespace: ns.clone(),
        name: name.into(),
    };
    let gateway = k
        .gateway
        .as_deref()
        .map(|g| super::object_key("kubernetes.gateway", g))
        .transpose()?;
    let home = gateway.as_ref().map(|g| g.namespace.clone());
    let lease = match (&k.lease, k.write_status, &home) {
        (_, false, _) => None,
        (Some(l), true, _) => Some(super::object_key("kubernetes.lease", l)?),
        (None, true, Some(ns)) => Some(in_home(ns, "seedlink-status")),
        (None, true, None) => {
            anyhow::bail!("kubernetes.lease: required without kubernetes.gateway")
        }
    };
    let service = match (&k.service, &home) {
        (Some(s), _) => Some(super::object_key("kubernetes.service", s)?),
        (None, Some(ns)) => Some(in_home(ns, "seedlink")),
        (None, None) => None,
    };
    let class = k.gateway_class.as_ref().map(|c| class_settings(c, snap));
    Ok(seedlink_kube::source::GatewaySettings {
        gateway,
        class,
        listeners: snap.file.listeners.iter().map(|l| l.name.clone()).collect(),
        lease,
        identity: identity(),
        slice_managers: k.endpointslice_managers.clone(),
        service,
    })
}

/// A class's addresses (validated by the configuration's compile step)
/// and the TLS listeners that receive its Gateways' connections.
fn class_settings(
    c: &seedlink_config::model::GatewayClassSource,
    snap: &seedlink_config::Snapshot,
) -> seedlink_kube::translate::ClassSettings {
    use seedlink_config::model::Protocol;
    seedlink_kube::translate::ClassSettings {
        name: c.name.clone(),
        addresses: c
            .addresses
            .iter()
            .filter_map(|a| a.parse().ok())
            .map(seedlink_config::routes::canonical)
            .collect(),
        receivers: snap
            .listeners
            .iter()
            .filter(|l| matches!(l.protocol, Protocol::Tls | Protocol::Auto))
            .map(|l| l.address)
            .collect(),
    }
}

/// The sockets a later upgrade takes over (at most one hand-over's worth).
fn offer(bound: &seedlink_gateway::Bound) -> anyhow::Result<Vec<seedlink_net::handoff::Socket>> {
    let o = bound.offer()?;
    if o.len() > seedlink_net::handoff::MAX_SOCKETS {
        anyhow::bail!(
            "--upgrade-socket: {} sockets to hand over (listeners x workers + admin), at most {}; lower `workers`",
            o.len(),
            seedlink_net::handoff::MAX_SOCKETS
        );
    }
    Ok(o)
}

/// Runs `seedlink gateway` until drained; returns the exit code.
pub async fn run(config: PathBuf, upgrade: super::Upgrade) -> anyhow::Result<i32> {
    let gw = load(config)?;
    let kube = kubernetes(&gw).await?;
    let supervisor = Supervisor::install()?;
    let (bound, taken) = match upgrade.take().await? {
        Some((sockets, taken)) => (gw.bind_handed(sockets)?, Some(taken)),
        None => (gw.bind(upgrade.reuse_port)?, None),
    };
    let offered = match &upgrade.socket {
        Some(_) => Some(offer(&bound)?),
        None => None,
    };
    let mut ready = bound.describe();
    ready["event"] = "ready".into();
    gw.serve(bound)?;
    let mut armed = supervisor.arm(vec![GatewayWithSource::new(gw.clone(), kube)]);
    // From here on this process serves: a failure only costs the next
    // upgrade (logged), never the service.
    let confirmed = match taken {
        Some(taken) => super::Upgrade::confirm(taken).await,
        None => true,
    };
    if let Some(sockets) = offered {
        let gw2 = gw.clone();
        let handed = upgrade.offer(
            seedlink_net::handoff::fixed(sockets),
            Box::new(()),
            gw.lifecycle.stop_accepting.clone(),
            confirmed,
            Box::new(move || gw2.handed_over()),
        )?;
        if let Some(rx) = handed {
            armed = armed.drain_when_handed_over(rx);
        }
    }
    // One machine-readable line on stdout tells scripts and tests the bound
    // addresses (listeners may be configured with port 0); by then the
    // sockets are offered for the next upgrade, if asked.
    println!("{ready}");
    tracing::info!(addresses = %ready, "gateway serving");
    Ok(armed.run().await)
}
