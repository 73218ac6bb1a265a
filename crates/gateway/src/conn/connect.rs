//! A CONNECT request the gateway will not carry: which rule it broke
//! (authority, destination header, redirect), and the HTTP answer it gets
//! before the connection closes.

use std::net::SocketAddr;

use seedlink_config::model::InvalidRequest;
use seedlink_net::copy::write_all;
use seedlink_proto::{connect_head, destination};
use tokio::net::TcpStream;

use super::outcome::*;
use crate::state::{Gateway, ListenerCtx};

/// A CONNECT with no body framing and an authority-form target (RFC 9110
/// §9.3.6: `host:port`, even though the header, never the target, chooses
/// the destination).
fn check_request_line(head: &connect_head::Head) -> Result<(), BadConnect> {
    if head.method != "CONNECT" {
        return Err(BadConnect::NotConnect);
    }
    if head.values("content-length").next().is_some()
        || head.values("transfer-encoding").next().is_some()
    {
        return Err(BadConnect::FramingHeader);
    }
    if !connect_head::authority_form(&head.target) {
        return Err(BadConnect::BadTarget);
    }
    Ok(())
}

/// Checks a CONNECT head and returns the canonical destination it names.
/// The request-line target is never used for routing.
pub(super) fn check_connect(
    head: &connect_head::Head,
    header: &str,
    guard: Option<&regex::Regex>,
) -> Result<String, BadConnect> {
    check_request_line(head)?;
    let mut values = head.values(header);
    let Some(value) = values.next() else {
        return Err(BadConnect::MissingDestination);
    };
    if values.next().is_some() {
        return Err(BadConnect::DuplicateDestination);
    }
    if guard.is_some_and(|re| !re.is_match(value)) {
        return Err(BadConnect::MalformedDestination);
    }
    destination::parse(value)
        .map(|d| d.canonical())
        .map_err(|_| BadConnect::MalformedDestination)
}

/// Answers an unusable request as configured; the connection then closes.
pub(super) async fn reject_connect(
    gw: &Gateway,
    lctx: &ListenerCtx,
    stream: &TcpStream,
    client: SocketAddr,
    head: &connect_head::Head,
    bad: BadConnect,
) -> Ended {
    let reply = match (bad, lctx.spec.on_invalid_request) {
        // Smuggling-shaped requests always get a plain 400.
        (BadConnect::FramingHeader | BadConnect::BadTarget, _) => {
            status_line(head, "400 Bad Request")
        }
        (_, InvalidRequest::Redirect) => match redirect_location(head, &gw.snapshot().routes) {
            Some(loc) => format!(
                "HTTP/1.1 301 Moved Permanently\r\nlocation: {loc}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            ),
            None => status_line(head, "400 Bad Request"),
        },
        (BadConnect::NotConnect, InvalidRequest::Status) => {
            status_line(head, "405 Method Not Allowed")
        }
        (_, InvalidRequest::Status) => status_line(head, "400 Bad Request"),
    };
    respond_and_close(stream, reply.as_bytes()).await;
    refuse(gw, lctx, client, Refusal::Connect(bad))
}

/// A bodiless response that closes the connection.
pub(super) fn status_line(head: &connect_head::Head, status: &str) -> String {
    let minor = if head.minor_version == 0 { 0 } else { 1 };
    format!("HTTP/1.{minor} {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
}

/// Gardener's redirect target `https://<host>:443<path>`; `None` when the
/// request names no usable host, or a host the gateway does not serve: the
/// client's Host is echoed only when it is one of the control planes' host
/// names, so the gateway is no open redirect to anywhere.
pub(super) fn redirect_location(
    head: &connect_head::Head,
    routes: &seedlink_config::routes::RouteTable,
) -> Option<String> {
    let authority = match head.values("host").next() {
        Some(h) => h.to_string(),
        None if head.method == "CONNECT" => head.target.clone(),
        None => return None,
    };
    let host = host_of(&authority)?;
    routes.lookup(host)?;
    let path = if head.method != "CONNECT"
        && head.target.starts_with('/')
        && !head.target.bytes().any(|b| b <= b' ' || b == 0x7f)
    {
        head.target.as_str()
    } else {
        "/"
    };
    Some(format!("https://{host}:443{path}"))
}

/// An authority's host, without its port (`host:port` or `[v6]:port`), if
/// it is made of host-name characters only.
pub(super) fn host_of(authority: &str) -> Option<&str> {
    let host = match authority.rsplit_once(':') {
        Some((h, p))
            if p.bytes().all(|b| b.is_ascii_digit()) && (!h.contains(':') || h.ends_with(']')) =>
        {
            h
        }
        _ => authority,
    };
    let valid = !host.is_empty()
        && host.len() <= 255
        && host.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'[' | b']' | b':')
        });
    valid.then_some(host)
}

/// Sends a final response and closes without losing it: half-close, then
/// read and discard (never parse) what the client already sent, bounded to
/// 64 KiB and one second. Closing with unread bytes would make the kernel
/// send RST, which can destroy the response before the client reads it.
pub(super) async fn respond_and_close(stream: &TcpStream, response: &[u8]) {
    // Boxed: see `run`.
    Box::pin(respond_and_close_inner(stream, response)).await
}

pub(super) async fn respond_and_close_inner(stream: &TcpStream, response: &[u8]) {
    if write_all(stream, response).await.is_err() {
        return;
    }
    let _ = socket2::SockRef::from(stream).shutdown(std::net::Shutdown::Write);
    let drain = async {
        // On the heap, allocated only when a refusal is answered: an array
        // here would live in every connection's future (the future of `run`
        // embeds this one) and cost each idle connection 4 KiB (it did:
        // 3.15 → 6.75 KiB per idle connection, docs/PERFORMANCE.md).
        let mut sink = vec![0u8; 4096];
        let mut total = 0usize;
        while total < 64 * 1024 {
            if stream.readable().await.is_err() {
                return;
            }
            match stream.try_read(&mut sink) {
                Ok(0) => return,
                Ok(n) => total += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), drain).await;
}
