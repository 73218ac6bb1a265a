//! tunnel-server admin: `/healthz`, `/readyz` (at least one agent, not
//! shutting down; cluster, agent and draining-agent totals in the body, no
//! cluster names: probes need no token), `/metrics`, `/config` (the configuration in force), `/api/state` (every cluster's agents, tunnels,
//! dials and errors as JSON) and `/`, the live page over it.

use std::sync::Arc;

use tokio::net::TcpListener;

use super::core::Core;
use super::Cluster;
use seedlink_net::admin::{self, rfc3339, Answer, HTML, JSON, METRICS, PAGE, TEXT};

/// `/metrics`, with the task count taken now.
fn metrics(srv: &Core) -> Answer {
    srv.metrics
        .tasks
        .set(i64::try_from(srv.tasks.len() + srv.frontend_tasks.len()).unwrap_or(i64::MAX));
    (
        200,
        METRICS,
        srv.metrics.sections.encode_with(&[&srv.metrics.registry]),
    )
}

/// `/config`: the configuration in use and its generation.
fn config(srv: &Core) -> Answer {
    let view = srv.config.load();
    let body = serde_json::json!({
        "generation": view.generation,
        "config": view.config,
    });
    let text = serde_json::to_string_pretty(&body).unwrap_or_default();
    (200, JSON, text + "\n")
}

/// Serves the admin endpoint.
pub async fn serve(srv: Arc<Core>, listener: TcpListener, access: admin::Access) {
    let route = move |path: &str| -> Answer {
        match path {
            "/healthz" => (200, TEXT, "ok\n".into()),
            "/readyz" | "/ready" => readiness(&srv),
            "/metrics" => metrics(&srv),
            "/" => (200, HTML, PAGE.into()),
            "/config" => config(&srv),
            "/api/state" => (200, JSON, state(&srv).to_string()),
            _ => (
                404,
                TEXT,
                "not found; try / /api/state /config /healthz /readyz /metrics\n".into(),
            ),
        }
    };
    admin::serve_with(listener, 32, access, Arc::new(route)).await;
}

/// `/readyz`. Probes are answered without the admin token, so the body
/// names no tenant: totals only (per cluster: /api/state).
fn readiness(srv: &Core) -> Answer {
    let clusters = srv.registry.clusters();
    let (agents, draining) = clusters.iter().fold((0, 0), |(a, d), c| {
        (a + c.agent_count(), d + c.draining_count())
    });
    let body = format!(
        "clusters={} agents={agents} draining={draining}\n",
        clusters.len()
    );
    let unmet = srv.gates.unmet();
    if srv.ready() {
        (200, TEXT, body)
    } else if srv.accepting.is_cancelled() {
        (503, TEXT, format!("draining\n{body}"))
    } else if !unmet.is_empty() {
        (503, TEXT, format!("[-]{}\n{body}", unmet.join("\n[-]")))
    } else {
        (
            503,
            TEXT,
            format!("no connection to any proxy agent\n{body}"),
        )
    }
}

/// Every cluster's live state, as the page and scripts read it.
pub fn state(srv: &Core) -> serde_json::Value {
    let clusters: Vec<serde_json::Value> = srv
        .registry
        .clusters()
        .iter()
        .map(|c| cluster_state(c))
        .collect();
    serde_json::json!({
        "role": "tunnel-server",
        "process": {
            "version": env!("CARGO_PKG_VERSION"),
            "generation": srv.config.load().generation,
            "last_reload": srv.config.load().last_reload.map(|(t, r)| serde_json::json!({"at": rfc3339(t), "result": r})),
            "server_id": srv.server_id,
            "server_count": srv.server_count.load(std::sync::atomic::Ordering::Relaxed),
            "ready": srv.ready(),
            // A binary upgrade asked this process to move its agents to
            // the new one (false again if that one failed).
            "agents_moving": srv.agents_moving.load(std::sync::atomic::Ordering::Acquire),
        },
        "clusters": clusters,
        "sections": srv.metrics.sections.state().into_iter()
            .map(|(title, lines)| serde_json::json!({"title": title, "lines": lines}))
            .collect::<Vec<_>>(),
    })
}

/// One cluster's agents, tunnels, dials and errors.
fn cluster_state(c: &Cluster) -> serde_json::Value {
    let health = c.health();
    let agents: Vec<serde_json::Value> = c
        .agents()
        .iter()
        .map(|a| {
            serde_json::json!({
                "id": a.agent_id,
                "identifiers": a.ids.to_string(),
                "connected_since": rfc3339(a.since),
                "draining": a.draining(),
            })
        })
        .collect();
    let errors: serde_json::Map<String, serde_json::Value> = health
        .dial_errors
        .iter()
        .map(|(r, n)| ((*r).to_string(), (*n).into()))
        .collect();
    serde_json::json!({
        "name": &*c.name,
        "agents": agents,
        "agents_changed": health.agents_changed.map(rfc3339),
        "established": c.metrics.established_now(),
        "pending": c.metrics.pending_now(),
        "dial_errors": errors,
        "frontends": c.conf.load().frontends,
    })
}
