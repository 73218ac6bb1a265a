//! Health, readiness and metrics of the node-proxy.

use std::sync::Arc;

use seedlink_net::admin::{self, Answer, JSON, METRICS, TEXT};
use tokio::net::TcpListener;

use crate::proxy::NodeProxy;

/// Connections the metrics endpoint serves at once.
pub const METRICS_SLOTS: usize = 32;
/// Of those, per source (an IPv4 address, an IPv6 /64).
pub const METRICS_PER_SOURCE: usize = 2;

/// Serves `/healthz`, `/readyz` (address present and gateway answering,
/// false while draining), `/metrics` and `/config` (its configuration).
pub async fn serve(np: Arc<NodeProxy>, listener: TcpListener, access: admin::Access) {
    admin::serve_with(
        listener,
        16,
        access,
        Arc::new(move |path: &str| route(&np, path)),
    )
    .await;
}

/// Serves `/metrics` and `/healthz` only (no token: they hold no
/// configuration), for scraping on the node's address. Any pod can reach
/// it, so one source holds at most 2 of its 32 connections: a pod that
/// keeps connecting cannot lock Prometheus out.
pub async fn serve_metrics(np: Arc<NodeProxy>, listener: TcpListener) {
    admin::serve_limited(
        listener,
        admin::Slots::with_per_source(METRICS_SLOTS, METRICS_PER_SOURCE),
        admin::Access::open(),
        Arc::new(move |path: &str| match path {
            "/healthz" | "/metrics" => route(&np, path),
            _ => (404, TEXT, "not found; try /metrics /healthz\n".to_string()),
        }),
    )
    .await;
}

/// Why `/readyz` says not ready: each condition it checks.
fn not_ready(np: &NodeProxy) -> String {
    format!(
        "not ready: address_ok={} gateway_ok={} health_check={} last_check={} phase={:?}\n",
        np.address_ok.load(std::sync::atomic::Ordering::Acquire),
        np.gateway_ok.load(std::sync::atomic::Ordering::Acquire),
        np.opts.health.kind.word(),
        np.health.last(),
        np.lifecycle.phase()
    )
}

fn route(np: &NodeProxy, path: &str) -> Answer {
    match path {
        "/healthz" => (200, TEXT, "ok\n".to_string()),
        "/readyz" if np.ready() => (200, TEXT, "ready\n".to_string()),
        "/readyz" => (503, TEXT, not_ready(np)),
        "/metrics" => (200, METRICS, admin::encode(&np.metrics.registry)),
        "/config" => {
            let body = serde_json::json!({"config": np.config.get()});
            (
                200,
                JSON,
                serde_json::to_string_pretty(&body).unwrap_or_default() + "\n",
            )
        }
        _ => (
            404,
            TEXT,
            "not found; try /healthz /readyz /metrics /config\n".to_string(),
        ),
    }
}
