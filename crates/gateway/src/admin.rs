//! The admin HTTP endpoint: `/healthz`, `/readyz`, `/metrics`, `/config`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use seedlink_net::lifecycle::Phase;
use tokio::net::TcpListener;

use crate::Gateway;

/// Admin connections served at once; more are closed at accept.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Serves the admin endpoint until the process exits (it stays up while
/// draining so probes and scrapes see the drain).
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    let never = tokio_util::sync::CancellationToken::new();
    seedlink_net::accept::accept_loop(&listener, &never, |stream, _peer| {
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            return;
        };
        let gw = gw.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let gw = gw.clone();
                async move { Ok::<_, Infallible>(route(&gw, &req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
            drop(slot);
        });
    })
    .await;
}

fn route(gw: &Gateway, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => match gw.lifecycle.phase() {
            Phase::Serving => text(StatusCode::OK, "ready\n"),
            Phase::Starting => text(StatusCode::SERVICE_UNAVAILABLE, "starting\n"),
            Phase::Draining => text(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        },
        "/metrics" => {
            let mut r = Response::new(Full::new(Bytes::from(gw.metrics.encode())));
            if let Ok(v) = "application/openmetrics-text; version=1.0.0; charset=utf-8".parse() {
                r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
            }
            r
        }
        "/config" => {
            let snap = gw.snapshot();
            let body = serde_json::json!({
                "generation": gw.generation(),
                "max_connections": gw.max_connections(),
                "config": snap.file,
            });
            let mut r = Response::new(Full::new(Bytes::from(
                serde_json::to_string_pretty(&body).unwrap_or_default() + "\n",
            )));
            if let Ok(v) = "application/json".parse() {
                r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
            }
            r
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /healthz /readyz /metrics /config\n",
        ),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r
}
