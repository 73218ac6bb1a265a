//! `seedlink seed`: the gateway and the tunnel-server in one process.

use std::path::PathBuf;
use std::sync::Arc;

use super::gateway;
use super::tunnel::{ServerRole, TunnelServerOptions};
use crate::supervisor::{Role, Supervisor};

/// Runs `seedlink seed`: agents' connections that the gateway routes to an
/// endpoint `local:tunnel-server` are handed to the tunnel-server in
/// process. On SIGTERM the gateway drains first, then the tunnel-server.
pub async fn seed(
    gw_config: PathBuf,
    tunnel: TunnelServerOptions,
    reuse_port: bool,
) -> anyhow::Result<i32> {
    let server = Arc::new(ServerRole::start(tunnel, Vec::new()).await?);
    let gw = gateway::load(gw_config)?;
    // Both halves' first snapshots at once: an unreachable API server
    // delays the start by one wait, not two.
    let ((), kube) = tokio::try_join!(server.start_kubernetes(), gateway::kubernetes(&gw))?;
    // One readiness for the pod: the gateway's, and the tunnel-server
    // half's own (its TunnelClusters read, not draining).
    gw.lifecycle.gates.add("tunnel-server", server.readiness());
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
    let roles: Vec<Arc<dyn Role>> = vec![gateway::GatewayWithSource::new(gw, kube), server];
    let armed = supervisor.arm(roles);
    println!("{ready}");
    Ok(armed.run().await)
}
