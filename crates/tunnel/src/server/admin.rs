//! tunnel-server admin: `/healthz`, `/readyz` (at least one agent, not
//! shutting down; per-cluster agent and draining-agent counts in the
//! body), `/metrics`.

use std::sync::Arc;

use tokio::net::TcpListener;

use super::core::Core;
use seedlink_net::admin::{self, Answer, METRICS, TEXT};

/// Serves the admin endpoint.
pub async fn serve(srv: Arc<Core>, listener: TcpListener) {
    let route = move |path: &str| -> Answer {
        match path {
            "/healthz" => (200, TEXT, "ok\n".into()),
            "/readyz" | "/ready" => {
                let mut body = String::new();
                for c in srv.registry.clusters().iter() {
                    body.push_str(&format!(
                        "cluster {} agents={} draining={}\n",
                        c.name,
                        c.agent_count(),
                        c.draining_count()
                    ));
                }
                if srv.ready() {
                    (200, TEXT, body)
                } else if srv.accepting.is_cancelled() {
                    (503, TEXT, format!("draining\n{body}"))
                } else {
                    (
                        503,
                        TEXT,
                        format!("no connection to any proxy agent\n{body}"),
                    )
                }
            }
            "/metrics" => {
                srv.metrics.tasks.set(
                    i64::try_from(srv.tasks.len() + srv.frontend_tasks.len()).unwrap_or(i64::MAX),
                );
                (200, METRICS, admin::encode(&srv.metrics.registry))
            }
            _ => (
                404,
                TEXT,
                "not found; try /healthz /readyz /metrics\n".into(),
            ),
        }
    };
    admin::serve(listener, 32, Arc::new(route)).await;
}
