//! `seedlink gateway` and `seedlink seed` (the gateway and the
//! tunnel-server in one process).

use std::path::PathBuf;
use std::sync::Arc;

use seedlink_gateway::Gateway;

use super::tunnel::{ServerRole, TunnelServerOptions};
use crate::supervisor::{BoxFut, Role, Supervisor};

/// The gateway as the supervisor sees it.
pub struct GatewayRole(pub Arc<Gateway>);

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

/// Runs `seedlink gateway` until drained; returns the exit code.
pub async fn run(config: PathBuf, reuse_port: bool) -> anyhow::Result<i32> {
    let gw = load(config)?;
    let supervisor = Supervisor::install()?;
    let bound = gw.bind(reuse_port)?;
    let mut ready = bound.describe();
    ready["event"] = "ready".into();
    gw.serve(bound)?;
    // One machine-readable line on stdout tells scripts and tests the bound
    // addresses (listeners may be configured with port 0).
    println!("{ready}");
    tracing::info!(addresses = %ready, "gateway serving");
    Ok(supervisor.run(vec![Arc::new(GatewayRole(gw))]).await)
}

/// Runs `seedlink seed`: agents' connections that the gateway routes to an
/// endpoint `local:tunnel-server` are handed to the tunnel-server in
/// process. On SIGTERM the gateway drains first, then the tunnel-server.
pub async fn seed(
    gw_config: PathBuf,
    tunnel: TunnelServerOptions,
    reuse_port: bool,
) -> anyhow::Result<i32> {
    let server = ServerRole::start(tunnel).await?;
    let gw = load(gw_config)?;
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
    println!("{ready}");
    let roles: Vec<Arc<dyn Role>> = vec![Arc::new(GatewayRole(gw)), Arc::new(server)];
    Ok(supervisor.run(roles).await)
}
