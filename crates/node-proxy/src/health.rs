//! Active upstream health checks: readiness follows whether the API server
//! behind the gateway answers, not only whether the gateway accepts TCP.
//!
//! HyperShift's node proxy (HAProxy) checks `GET /version` every 10 s with
//! fall/rise 3; the same is possible here, and lighter checks for modes or
//! clusters where an HTTP request cannot be made.

use std::sync::atomic::Ordering;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::proxy::{Mode, NodeProxy};
use crate::tunnel::{self, Outcome};

pub mod state;

pub use state::{client_config, CheckKind, HealthCheck, HealthState, DEFAULT_SERVER_NAME};

/// Runs the configured check once.
pub async fn check_once(np: &NodeProxy) -> Result<(), String> {
    let h = &np.opts.health;
    let run = async {
        match (h.kind, np.opts.mode) {
            (CheckKind::Tcp, Mode::Http2Connect) => np.h2.probe(np).await.map_err(reason),
            (CheckKind::Tcp, _) => tunnel::dial(np).await.map(drop).map_err(reason),
            (CheckKind::Tunnel, Mode::Http2Connect) => {
                tunnel::h2_open(np).await.map(drop).map_err(reason)
            }
            (_, Mode::Http2Connect) => {
                Err("mode_error: a tls or http check needs a mode over TCP".to_string())
            }
            (kind, _) => {
                let (gateway, leftover) = tunnel::open_for_check(np).await.map_err(reason)?;
                if kind == CheckKind::Tunnel {
                    return Ok(());
                }
                if !leftover.is_empty() {
                    return Err("api_server_spoke_first: bytes before the TLS handshake".into());
                }
                tls_and_http(h, kind, gateway).await
            }
        }
    };
    match tokio::time::timeout(h.timeout, run).await {
        Ok(r) => r,
        Err(_) => Err("timeout".into()),
    }
}

fn reason(o: Outcome) -> String {
    o.reason().to_string()
}

async fn tls_and_http(
    h: &HealthCheck,
    kind: CheckKind,
    gateway: seedlink_net::egress::EgressStream,
) -> Result<(), String> {
    let Some(tls) = &h.tls else {
        return Err("mode_error: no TLS settings for the check".into());
    };
    let name = ServerName::try_from(h.server_name.clone())
        .map_err(|_| format!("bad_server_name: {:?}", h.server_name))?;
    let mut tls = tokio_rustls::TlsConnector::from(tls.clone())
        .connect(name, gateway)
        .await
        .map_err(|e| format!("tls_handshake: {e}"))?;
    if kind == CheckKind::Tls {
        let _ = tls.shutdown().await;
        return Ok(());
    }
    let code = http_get(&mut tls, h).await;
    let _ = tls.shutdown().await;
    match code? {
        200..400 => Ok(()),
        code => Err(format!("http_status_{code}")),
    }
}

/// `GET` the check's path on `tls`: the answer's status code.
async fn http_get<S>(tls: &mut S, h: &HealthCheck) -> Result<u16, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: seedlink-node-proxy\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        h.path, h.server_name
    );
    tls.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("http_write: {e}"))?;
    response_status(tls).await
}

/// Reads an HTTP response's head (at most 16 KiB): its status code.
async fn response_status(tls: &mut (impl tokio::io::AsyncRead + Unpin)) -> Result<u16, String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => return Ok(resp.code.unwrap_or(0)),
            Ok(httparse::Status::Partial) => {}
            Err(e) => return Err(format!("http_bad_response: {e}")),
        }
        if buf.len() > 16 * 1024 {
            return Err("http_bad_response: head over 16 KiB".into());
        }
        match tls.read(&mut chunk).await {
            Ok(0) => return Err("http_closed".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("http_read: {e}")),
        }
    }
}

/// Checks every interval until the drain closes everything; readiness
/// follows the health.
pub async fn run(np: &NodeProxy) {
    let h = &np.opts.health;
    loop {
        let result = check_once(np).await;
        let label = match &result {
            Ok(()) => "ok",
            Err(why) => why.split(':').next().unwrap_or("error"),
        };
        np.metrics
            .health_checks
            .get_or_create(&crate::proxy::ResultLabels {
                result: label.to_string(),
            })
            .inc();
        let healthy = np
            .health
            .record(h, result.as_ref().map(|_| ()).map_err(|e| e.as_str()));
        np.gateway_ok.store(healthy, Ordering::Release);
        tokio::select! {
            () = tokio::time::sleep(h.interval) => {}
            () = np.lifecycle.close_all.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn first_result_decides_then_rise_and_fall_count() {
        let check = HealthCheck {
            rise: 2,
            fall: 3,
            ..HealthCheck::tcp()
        };
        let s = HealthState::default();
        assert_eq!(s.last(), "no check yet");
        assert!(!s.record(&check, Err("x")));
        assert!(!s.record(&check, Ok(())), "one success of two");
        assert!(s.record(&check, Ok(())));
        assert!(s.record(&check, Err("a")));
        assert!(s.record(&check, Err("b")));
        assert!(s.record(&check, Ok(())), "the run of failures is broken");
        assert!(s.record(&check, Err("a")));
        assert!(s.record(&check, Err("b")));
        assert!(!s.record(&check, Err("c")));
        assert_eq!(s.last(), "c");
        let fresh = HealthState::default();
        assert!(fresh.record(&check, Ok(())), "the first success decides");
    }
}
