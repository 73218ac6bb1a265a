//! Health, readiness and metrics of the node-proxy.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::NodeProxy;

/// Serves `/healthz`, `/readyz` (address present and gateway answering,
/// false while draining) and `/metrics`.
pub async fn serve(np: Arc<NodeProxy>, listener: TcpListener) {
    let never = tokio_util::sync::CancellationToken::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(16));
    seedlink_net::accept::accept_loop(&listener, &never, |stream, _| {
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            return;
        };
        let np = np.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let np = np.clone();
                async move { Ok::<_, Infallible>(route(&np, req.uri().path())) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), svc);
            let _ = tokio::time::timeout(Duration::from_secs(30), conn).await;
            drop(slot);
        });
    })
    .await;
}

fn route(np: &NodeProxy, path: &str) -> Response<Full<Bytes>> {
    let (status, body) = match path {
        "/healthz" => (StatusCode::OK, "ok\n".to_string()),
        "/readyz" if np.ready() => (StatusCode::OK, "ready\n".to_string()),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: address_ok={} gateway_ok={} phase={:?}\n",
                np.address_ok.load(std::sync::atomic::Ordering::Acquire),
                np.gateway_ok.load(std::sync::atomic::Ordering::Acquire),
                np.lifecycle.phase()
            ),
        ),
        "/metrics" => {
            let mut out = String::new();
            let _ = prometheus_client::encoding::text::encode(&mut out, &np.metrics.registry);
            (StatusCode::OK, out)
        }
        _ => (StatusCode::NOT_FOUND, "not found\n".to_string()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}
