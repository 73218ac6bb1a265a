//! A small admin HTTP endpoint shared by the node-proxy and the tunnel
//! roles: a route function from path to `(status, content type, body)`,
//! served over HTTP/1.1 with bounded connections and timeouts.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// An answer: status, content type, body.
pub type Answer = (u16, &'static str, String);

/// Plain-text content type.
pub const TEXT: &str = "text/plain; charset=utf-8";
/// Prometheus content type.
pub const METRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `route` on `listener` until the process ends, at most `slots`
/// connections at once (more are closed at accept).
pub async fn serve(
    listener: TcpListener,
    slots: usize,
    route: Arc<dyn Fn(&str) -> Answer + Send + Sync>,
) {
    let never = tokio_util::sync::CancellationToken::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(slots));
    crate::accept::accept_loop(&listener, &never, |stream, _| {
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            return;
        };
        let route = route.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (code, ctype, body) = route(req.uri().path());
                let mut r = Response::new(Full::new(Bytes::from(body)));
                *r.status_mut() = hyper::StatusCode::from_u16(code)
                    .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
                if let Ok(v) = ctype.parse() {
                    r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
                }
                async move { Ok::<_, Infallible>(r) }
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

/// Encodes a registry in the text format.
pub fn encode(registry: &prometheus_client::registry::Registry) -> String {
    use prometheus_client::metrics::counter::ConstCounter;
    // Every role's endpoint also says whether a bug poisoned a lock.
    let mut process = prometheus_client::registry::Registry::default();
    process.register(
        "seedlink_lock_poisoned",
        "Locks found poisoned (each is a bug: a thread panicked holding one)",
        ConstCounter::new(crate::sync::poisoned()),
    );
    let mut out = String::new();
    let mut tail = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err()
        || prometheus_client::encoding::text::encode(&mut tail, &process).is_err()
    {
        out.clear();
        return out;
    }
    // One exposition: the first `# EOF` goes.
    if let Some(body) = out.strip_suffix("# EOF\n") {
        let n = body.len();
        out.truncate(n);
    }
    out.push_str(&tail);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_exposition_carries_the_roles_metrics_and_the_poisoned_lock_count() {
        use prometheus_client::metrics::counter::Counter;
        let mut r = prometheus_client::registry::Registry::with_prefix("seedlink_test");
        let c: Counter = Counter::default();
        c.inc();
        r.register("things", "Things", c);
        let text = super::encode(&r);
        assert!(text.contains("seedlink_test_things_total 1\n"), "{text}");
        assert!(
            text.contains("# TYPE seedlink_lock_poisoned counter\n"),
            "{text}"
        );
        assert!(text.contains("\nseedlink_lock_poisoned_total "), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"));
    }
}
