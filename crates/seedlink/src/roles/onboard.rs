//! `seedlink onboard`: the onboarding controller. Every replica watches
//! `SeedlinkControlPlane`s; the one holding the Lease generates and writes
//! (docs/KUBERNETES.md, "Onboarding a control plane"). It runs under a
//! ServiceAccount of its own: it writes Secrets, RoleBindings and routes in
//! tenant namespaces, which the data plane's pods never may.

use std::path::Path;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use seedlink_config::onboard::{namespaced, OnboardConfig};
use seedlink_kube::leader::{self, Leadership};
use seedlink_kube::onboard::controller::{self, Context};
use seedlink_kube::onboard::generate::Settings;
use seedlink_kube::translate::Key;

/// `namespace/name` (checked when the file was read) as a [`Key`].
fn key(v: &str) -> Key {
    let (ns, name) = namespaced(v).unwrap_or_default();
    Key {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// Reads and checks the file.
fn load(path: &Path) -> anyhow::Result<OnboardConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    OnboardConfig::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Runs the controller until SIGTERM or SIGINT.
pub async fn run(config: &Path) -> anyhow::Result<i32> {
    let c = load(config)?;
    let client = seedlink_kube::source::client()
        .await
        .context("kubernetes client")?;
    let lease = key(&c.lease);
    let route_version = seedlink_kube::source::served_route_version(&client)
        .await
        .map_or_else(|| "v1".to_string(), |ar| ar.version);
    let stop = CancellationToken::new();
    let me = Leadership::default();
    let identity = super::identity();
    let campaign = tokio::spawn(leader::campaign(
        client.clone(),
        lease.namespace,
        lease.name,
        identity.clone(),
        me.clone(),
        stop.clone(),
    ));
    let ctx = Context {
        recorder: kube::runtime::events::Recorder::new(
            client.clone(),
            controller::reporter(&identity),
        ),
        client,
        settings: Settings {
            gateway: key(&c.gateway),
            route_version,
            tunnel_reader: key(&c.tunnel_reader),
            trust_role: c.trust_role,
        },
        leadership: me,
        namespace_label: c.namespace_label,
    };
    let running = tokio::spawn(controller::run(ctx, stop.clone()));
    println!(
        "{}",
        serde_json::json!({"event": "ready", "role": "onboard"})
    );
    shutdown_signal().await;
    stop.cancel();
    let _ = running.await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), campaign).await;
    Ok(0)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
