//! One tunnel: connect to the gateway, announce the destination, wait for
//! the answer, then copy.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use h2::client::SendRequest;
use http::{Method, Request, StatusCode};
use seedlink_net::copy::{write_all, Transfer};
use seedlink_net::egress::EgressStream;
use seedlink_net::h2copy;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::proxy::{Mode, NodeProxy};

pub mod state;

use state::{H2Conn, StreamSlot};
pub use state::{H2Session, Resolver};

/// Largest gateway answer head accepted.
const MAX_RESPONSE_HEAD: usize = 8192;

/// How one tunnel ended; [`Outcome::reason`] is the `outcome` label of
/// `tunnels_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No address of the gateway could be connected.
    GatewayUnreachable,
    /// The gateway did not answer in time.
    GatewayTimeout,
    /// The connection to the gateway failed.
    GatewayError,
    /// A mode was carried by the wrong path (a bug).
    ModeError,
    /// Writing to the client failed.
    ClientError,
    /// Both directions ended normally.
    Ok,
    /// A side reset the connection.
    Reset,
    /// The copy failed.
    Error,
    /// The gateway answered 403 (ACL).
    GatewayForbidden,
    /// The gateway answered 503 (no usable upstream).
    GatewayUnavailable,
    /// The gateway answered 301.
    GatewayRedirect,
    /// The gateway answered another refusal.
    GatewayRefused,
    /// The gateway's answer was not HTTP.
    GatewayBadResponse,
    /// The gateway closed before answering.
    GatewayClosed,
    /// The configured header or authority cannot form a request.
    BadRequestOptions,
    /// The PROXY header could not be built.
    ProxyHeaderError,
    /// The drain deadline closed it.
    ClosedDrain,
    /// No address of the egress proxy could be connected.
    EgressProxyUnreachable,
    /// The egress proxy wants (other) credentials: 407 or 401.
    EgressProxyAuth,
    /// The egress proxy answered another refusal.
    EgressProxyRefused,
    /// The egress proxy's answer was not HTTP, or it sent bytes after it.
    EgressProxyBadResponse,
    /// The egress proxy closed before answering.
    EgressProxyClosed,
    /// The egress proxy did not answer in time.
    EgressProxyTimeout,
    /// TLS to an `https://` egress proxy failed.
    EgressProxyTls,
}

impl Outcome {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Outcome::GatewayUnreachable => "gateway_unreachable",
            Outcome::GatewayTimeout => "gateway_timeout",
            Outcome::GatewayError => "gateway_error",
            Outcome::ModeError => "mode_error",
            Outcome::ClientError => "client_error",
            Outcome::Ok => "ok",
            Outcome::Reset => "reset",
            Outcome::Error => "error",
            Outcome::GatewayForbidden => "gateway_forbidden",
            Outcome::GatewayUnavailable => "gateway_unavailable",
            Outcome::GatewayRedirect => "gateway_redirect",
            Outcome::GatewayRefused => "gateway_refused",
            Outcome::GatewayBadResponse => "gateway_bad_response",
            Outcome::GatewayClosed => "gateway_closed",
            Outcome::BadRequestOptions => "bad_request_options",
            Outcome::ProxyHeaderError => "proxy_header_error",
            Outcome::ClosedDrain => "closed_drain",
            Outcome::EgressProxyUnreachable => "egress_proxy_unreachable",
            Outcome::EgressProxyAuth => "egress_proxy_auth_failed",
            Outcome::EgressProxyRefused => "egress_proxy_refused",
            Outcome::EgressProxyBadResponse => "egress_proxy_bad_response",
            Outcome::EgressProxyClosed => "egress_proxy_closed",
            Outcome::EgressProxyTimeout => "egress_proxy_timeout",
            Outcome::EgressProxyTls => "egress_proxy_tls_failed",
        }
    }
}

/// Connects to the gateway: directly, or through the egress proxy's HTTP
/// CONNECT tunnel when one is configured (inside TLS to an `https://`
/// proxy).
pub async fn dial(np: &NodeProxy) -> Result<EgressStream, Outcome> {
    let connected = np
        .resolver
        .connect(
            np.opts.connect_timeout,
            &np.metrics.gateway_connect_failures,
        )
        .await;
    let log = || np.metrics.refusal_log.allow();
    let Some(egress) = &np.opts.egress else {
        return connected.map(EgressStream::Plain).map_err(|e| {
            if log() {
                tracing::warn!(target: "seedlink::refused", gateway = %np.opts.gateway, error = %e, "gateway unreachable");
            }
            Outcome::GatewayUnreachable
        });
    };
    let s = connected.map_err(|e| {
        if log() {
            tracing::warn!(target: "seedlink::refused", egress_proxy = %egress.address, error = %e, "egress proxy unreachable");
        }
        Outcome::EgressProxyUnreachable
    })?;
    let answer =
        tokio::time::timeout(np.opts.handshake_timeout, egress.over(s, &np.opts.gateway)).await;
    use seedlink_net::egress::EgressError as E;
    let why = match answer {
        Ok(Ok(s)) => return Ok(s),
        // 407 asks for credentials; tinyproxy answers wrong ones with 401.
        Ok(Err(E::Auth(_))) => Outcome::EgressProxyAuth,
        Ok(Err(E::Refused(_))) => Outcome::EgressProxyRefused,
        Ok(Err(E::BadResponse)) => Outcome::EgressProxyBadResponse,
        Ok(Err(E::Closed | E::Unreachable(..))) => Outcome::EgressProxyClosed,
        Ok(Err(E::Tls(..))) => Outcome::EgressProxyTls,
        Err(_) => Outcome::EgressProxyTimeout,
    };
    if np.metrics.refusal_log.allow() {
        tracing::warn!(target: "seedlink::refused", egress_proxy = %egress.address, reason = why.reason(), "egress proxy refused the tunnel to the gateway");
    }
    Err(why)
}

/// Opens a tunnel for a connection from `src` to `dst` as the mode says
/// (not [`Mode::Http2Connect`]): the gateway stream and bytes the gateway
/// already sent for the client.
async fn open(
    np: &NodeProxy,
    src: SocketAddr,
    dst: SocketAddr,
) -> Result<(EgressStream, Vec<u8>), Outcome> {
    let mut gateway = dial(np).await?;
    let leftover = match np.opts.mode {
        Mode::Connect => connect(np, &mut gateway).await?,
        Mode::ProxyV2 => {
            let header = proxy_v2(np, src, dst)?;
            send(&mut gateway, &header).await?;
            Vec::new()
        }
        // Carried as a stream on the shared connection by `h2_carry`.
        Mode::Http2Connect => return Err(Outcome::ModeError),
        Mode::ProxyV1 => {
            send(&mut gateway, proxy_v1(src, dst).as_bytes()).await?;
            Vec::new()
        }
    };
    Ok((gateway, leftover))
}

/// Sends the CONNECT and reads its answer, within the handshake deadline:
/// the bytes that came after the 200's head.
async fn connect(np: &NodeProxy, gateway: &mut EgressStream) -> Result<Vec<u8>, Outcome> {
    let (name, value) = &np.opts.header;
    let head = format!(
        "CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n{name}: {value}\r\n\r\n",
        a = np.opts.authority
    );
    match tokio::time::timeout(
        np.opts.handshake_timeout,
        exchange_head(gateway, head.as_bytes()),
    )
    .await
    {
        Ok(Ok((200, rest))) => Ok(rest),
        Ok(Ok((403, _))) => Err(Outcome::GatewayForbidden),
        Ok(Ok((503, _))) => Err(Outcome::GatewayUnavailable),
        Ok(Ok((301, _))) => Err(Outcome::GatewayRedirect),
        Ok(Ok(_)) => Err(Outcome::GatewayRefused),
        Ok(Err(why)) => Err(why),
        Err(_) => Err(Outcome::GatewayTimeout),
    }
}

/// A PROXY v2 header for `src` → `dst`, with the cluster-ID TLV if one is
/// configured.
fn proxy_v2(np: &NodeProxy, src: SocketAddr, dst: SocketAddr) -> Result<Vec<u8>, Outcome> {
    let mut b = ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | ppp::v2::Command::Proxy,
        ppp::v2::Protocol::Stream,
        (src, dst),
    );
    if let Some((kind, value)) = &np.opts.tlv {
        b = b
            .write_tlv(*kind, value)
            .map_err(|_| Outcome::ProxyHeaderError)?;
    }
    b.build().map_err(|_| Outcome::ProxyHeaderError)
}

/// A PROXY v1 line for `src` → `dst` (TCP6, v4-mapped, when the families
/// differ).
fn proxy_v1(src: SocketAddr, dst: SocketAddr) -> String {
    match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            ppp::v1::Addresses::new_tcp4(*s.ip(), *d.ip(), s.port(), d.port()).to_string()
        }
        (s, d) => {
            let v6 = |a: SocketAddr| match a {
                SocketAddr::V6(a) => *a.ip(),
                SocketAddr::V4(a) => a.ip().to_ipv6_mapped(),
            };
            ppp::v1::Addresses::new_tcp6(v6(s), v6(d), s.port(), d.port()).to_string()
        }
    }
}

/// A tunnel as a health check opens it: from the node-proxy's own end of
/// the gateway connection to the advertised address (which the legacy PROXY
/// port routes by).
pub async fn open_for_check(np: &NodeProxy) -> Result<(EgressStream, Vec<u8>), Outcome> {
    let src = SocketAddr::new(np.opts.advertised.ip(), 0);
    open(np, src, np.opts.advertised).await
}

/// A tunnel's start as a passive health result: with the `tcp` check,
/// an opened tunnel is a success and an unreachable gateway (or egress
/// proxy) a failure; refusals say nothing about reachability. Other
/// checks ignore tunnels.
fn observe(np: &NodeProxy, result: Result<(), Outcome>) {
    use Outcome as O;
    let check = &np.opts.health;
    if check.kind != crate::health::state::CheckKind::Tcp {
        return;
    }
    let healthy = match result {
        Ok(()) => np.health.record(check, Ok(())),
        Err(
            why @ (O::GatewayUnreachable
            | O::EgressProxyUnreachable
            | O::EgressProxyTimeout
            | O::EgressProxyClosed
            | O::EgressProxyTls),
        ) => np.health.record(check, Err(why.reason())),
        Err(_) => return,
    };
    np.gateway_ok.store(healthy, Ordering::Release);
}

/// A client's tunnel opening as a passive health result; a failure is
/// logged (rate-limited).
fn observed<T>(np: &NodeProxy, peer: SocketAddr, r: Result<T, Outcome>) -> Result<T, Outcome> {
    observe(np, r.as_ref().map(|_| ()).map_err(|why| *why));
    if let Err(why) = &r {
        if np.metrics.refusal_log.allow() {
            tracing::warn!(target: "seedlink::refused", %peer, reason = why.reason(), "tunnel failed");
        }
    }
    r
}

/// Carries one client connection; returns how it ended.
pub async fn carry(np: &NodeProxy, client: TcpStream, peer: SocketAddr) -> Outcome {
    let _ = client.set_nodelay(true);
    if np.opts.mode == Mode::Http2Connect {
        return h2_carry(np, client, peer).await;
    }
    let local = client.local_addr().unwrap_or(peer);
    let (gateway, leftover) = match observed(np, peer, open(np, peer, local).await) {
        Ok(pair) => pair,
        Err(why) => return why,
    };
    if !leftover.is_empty() && write_all(&client, &leftover).await.is_err() {
        return Outcome::ClientError;
    }
    let copied = match gateway {
        EgressStream::Plain(gateway) => {
            let t = Transfer::default();
            np.copier
                .run(&client, &gateway, &t.to_upstream, &t.to_client)
                .await
        }
        // Inside TLS to the proxy: copied through user space (no splice),
        // with the same bound on a half-closed connection.
        EgressStream::Tls(gateway) => {
            let half_closed = np.copier.half_closed();
            seedlink_net::copy::both_ways(client, gateway, half_closed).await
        }
    };
    match copied {
        Ok(()) => Outcome::Ok,
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => Outcome::Reset,
        Err(_) => Outcome::Error,
    }
}

/// Writes `bytes` to the gateway (and flushes them out of TLS to an
/// `https://` proxy).
async fn send<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> Result<(), Outcome> {
    stream
        .write_all(bytes)
        .await
        .map_err(|_| Outcome::GatewayError)?;
    stream.flush().await.map_err(|_| Outcome::GatewayError)
}

/// Sends an HTTP request head and reads the answer's head: its status and
/// any bytes that came after it, or why that failed.
async fn exchange_head<S>(stream: &mut S, head: &[u8]) -> Result<(u16, Vec<u8>), Outcome>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    send(stream, head).await?;
    let mut buf: Vec<u8> = Vec::with_capacity(256);
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                let code = resp.code.unwrap_or(0);
                return Ok((code, buf.split_off(n)));
            }
            Ok(httparse::Status::Partial) => {}
            Err(_) => return Err(Outcome::GatewayBadResponse),
        }
        if buf.len() >= MAX_RESPONSE_HEAD {
            return Err(Outcome::GatewayBadResponse);
        }
        let mut chunk = [0u8; 1024];
        match stream.read(&mut chunk).await {
            Ok(0) => return Err(Outcome::GatewayClosed),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => return Err(Outcome::GatewayError),
        }
    }
}

impl H2Session {
    /// Whether a connection is up (set up now if none is), within the
    /// handshake deadline.
    pub async fn probe(&self, np: &NodeProxy) -> Result<(), Outcome> {
        let up = async {
            let mut conns = self.conns.lock().await;
            conns.retain(|c| !c.task.is_finished());
            if conns.is_empty() {
                conns.push(open_h2(np).await?);
            }
            Ok::<(), Outcome>(())
        };
        tokio::time::timeout(np.opts.handshake_timeout, up)
            .await
            .unwrap_or(Err(Outcome::GatewayTimeout))
    }

    /// A stream slot on a live connection with room, connecting first if
    /// every connection is full or gone.
    async fn slot(&self, np: &NodeProxy) -> Result<(SendRequest<Bytes>, StreamSlot), Outcome> {
        let mut conns = self.conns.lock().await;
        conns.retain(|c| !c.task.is_finished());
        let room = conns
            .iter()
            .find(|c| c.streams.load(Ordering::Acquire) < c.send.current_max_send_streams().max(1));
        let conn = match room {
            Some(c) => c,
            None => {
                conns.push(open_h2(np).await?);
                conns.last().ok_or(Outcome::GatewayError)?
            }
        };
        conn.streams.fetch_add(1, Ordering::AcqRel);
        Ok((conn.send.clone(), StreamSlot(conn.streams.clone())))
    }
}

/// The HTTP/2 client settings towards the gateway: large windows, no push.
fn h2_builder() -> h2::client::Builder {
    let mut builder = h2::client::Builder::new();
    builder
        .initial_window_size(1024 * 1024)
        .initial_connection_window_size(16 * 1024 * 1024)
        .max_send_buffer_size(256 * 1024)
        .max_frame_size(h2copy::MAX_FRAME)
        .enable_push(false);
    builder
}

/// Opens one h2c connection to the gateway and spawns its driver, which
/// also pings it and gives it up when a pong is late.
async fn open_h2(np: &NodeProxy) -> Result<H2Conn, Outcome> {
    let tcp = dial(np).await?;
    let builder = h2_builder();
    let (send, mut conn) =
        match tokio::time::timeout(np.opts.handshake_timeout, builder.handshake(tcp)).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "HTTP/2 handshake with the gateway failed");
                return Err(Outcome::GatewayError);
            }
            Err(_) => return Err(Outcome::GatewayTimeout),
        };
    let keepalive = h2copy::keepalive(conn.ping_pong());
    let task = tokio::spawn(async move {
        tokio::select! {
            r = &mut conn => if let Err(e) = r {
                tracing::warn!(error = %e, "HTTP/2 connection to the gateway ended");
            },
            () = keepalive => tracing::warn!("HTTP/2 gateway connection missed a keepalive pong; reconnecting"),
        }
    });
    Ok(H2Conn {
        send,
        task,
        streams: Arc::new(AtomicUsize::new(0)),
    })
}

/// An open HTTP/2 tunnel: the answer's body, the request's body, and the
/// stream slot it holds.
pub type H2Tunnel = (h2::RecvStream, h2::SendStream<Bytes>, StreamSlotGuard);

/// Holds a stream slot on a shared connection while a tunnel lives.
pub struct StreamSlotGuard(#[allow(dead_code)] StreamSlot);

/// Opens a tunnel as a stream on the shared HTTP/2 connection: CONNECT with
/// the destination header, and the gateway's `200`.
pub async fn h2_open(np: &NodeProxy) -> Result<H2Tunnel, Outcome> {
    let opened = tokio::time::timeout(np.opts.handshake_timeout, async {
        let (send, slot) = np.h2.slot(np).await?;
        let mut send = send.ready().await.map_err(|_| Outcome::GatewayError)?;
        let (name, value) = &np.opts.header;
        let req = Request::builder()
            .method(Method::CONNECT)
            .uri(np.opts.authority.as_str())
            .header(name.as_str(), value.as_str())
            .body(())
            .map_err(|_| Outcome::BadRequestOptions)?;
        let (resp, stream) = send
            .send_request(req, false)
            .map_err(|_| Outcome::GatewayError)?;
        let resp = resp.await.map_err(|_| Outcome::GatewayError)?;
        match resp.status() {
            StatusCode::OK => Ok((resp.into_body(), stream, StreamSlotGuard(slot))),
            StatusCode::FORBIDDEN => Err(Outcome::GatewayForbidden),
            StatusCode::SERVICE_UNAVAILABLE => Err(Outcome::GatewayUnavailable),
            _ => Err(Outcome::GatewayRefused),
        }
    })
    .await;
    opened.unwrap_or(Err(Outcome::GatewayTimeout))
}

/// Carries one client connection as a stream on the shared HTTP/2
/// connection: CONNECT with the destination header, wait for `200`, copy.
async fn h2_carry(np: &NodeProxy, client: TcpStream, peer: SocketAddr) -> Outcome {
    let (recv, send, _slot) = match observed(np, peer, h2_open(np).await) {
        Ok(t) => t,
        Err(why) => return why,
    };
    tokio::join!(
        h2copy::stream_to_socket(recv, &client),
        h2copy::socket_to_stream(&client, send)
    );
    Outcome::Ok
}
