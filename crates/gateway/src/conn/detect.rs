//! The first bytes of a connection under one absolute deadline: the LB's
//! PROXY header (only from trusted peers), an LB health check, the inner
//! PROXY header, then the protocol (TLS ClientHello, CONNECT head, HTTP/2
//! preface) and what it names.

use std::net::SocketAddr;

use seedlink_config::model::{Protocol, ProxyMode};
use seedlink_config::routes::canonical;
use seedlink_config::Snapshot;
use seedlink_proto::{client_hello, connect_head, proxy_header, Parse};
use tokio::net::TcpStream;

use super::connect::*;
use super::outcome::*;
use crate::state::{Gateway, ListenerCtx, SourceGuard};

/// The first message, per listener protocol.
pub(super) enum Request {
    Tls {
        sni: String,
        alpn: Vec<String>,
    },
    Connect(connect_head::Head),
    /// HTTP/2 with prior knowledge: streams carry CONNECT tunnels.
    Http2,
    /// Legacy GEP-08 path: the node proxy's PROXY header named this address.
    Legacy {
        destination: SocketAddr,
    },
    /// HyperShift's node path: a TLV of the node proxy's PROXY header named
    /// the cluster; TLS follows untouched.
    Cluster {
        id: Vec<u8>,
    },
}

/// What detection learned.
pub(super) struct Detected {
    pub(super) client: SocketAddr,
    pub(super) request: Request,
    /// Bytes to send upstream once connected: for TLS the ClientHello and
    /// whatever followed it, for CONNECT only what followed the head.
    pub(super) replay: Vec<u8>,
}

/// Reads until a PROXY header (when configured) and the first message have
/// arrived: a TLS ClientHello, a CONNECT head or the HTTP/2 preface, or the
/// node proxy's own PROXY header. The caller bounds it with the absolute
/// deadline.
pub(super) async fn detect<'g>(
    gw: &'g Gateway,
    lctx: &ListenerCtx,
    snap: &Snapshot,
    stream: &TcpStream,
    peer: SocketAddr,
    trusted: bool,
    guard: &mut Option<SourceGuard<'g>>,
) -> Result<Detected, Refusal> {
    let limits = &snap.limits;
    if lctx.spec.proxy_protocol == ProxyMode::Required && !trusted {
        return Err(Refusal::UntrustedProxy);
    }
    let mut r = Reader {
        stream,
        buf: Vec::new(),
    };
    // A health probe connects and closes without a byte: not a detection
    // failure, and not logged.
    let first = limits
        .proxy_header_max_bytes
        .max(limits.client_hello_max_bytes);
    match read_more(stream, &mut r.buf, first).await {
        Err(Refusal::Eof) => return Err(Refusal::TcpProbe),
        x => x?,
    }
    let client = outer_proxy_header(gw, lctx, snap, &mut r, peer, trusted, guard).await?;
    let protocol = match lctx.spec.protocol {
        Protocol::Auto => r.until(64, classify).await??,
        p => p,
    };
    let request = match protocol {
        Protocol::Proxy => inner_proxy_header(lctx, &mut r, limits.proxy_header_max_bytes).await?,
        Protocol::HttpConnect => connect_or_http2(&mut r).await?,
        _ => client_hello(lctx, &mut r, limits.client_hello_max_bytes).await?,
    };
    Ok(Detected {
        client,
        request,
        replay: r.buf,
    })
}

/// The bytes of a connection read so far, and more on demand.
pub(super) struct Reader<'s> {
    pub(super) stream: &'s TcpStream,
    /// Empty until bytes arrive (see `read_more`).
    pub(super) buf: Vec<u8>,
}

impl Reader<'_> {
    /// Reads until `parse` decides on what is buffered (never more than
    /// `cap` plus one read): what it parsed, or why it refused.
    pub(super) async fn until<T, R>(
        &mut self,
        cap: usize,
        parse: impl Fn(&[u8]) -> Parse<T, R>,
    ) -> Result<Result<T, R>, Refusal> {
        loop {
            match parse(&self.buf) {
                Parse::Done(t) => return Ok(Ok(t)),
                Parse::Invalid(r) => return Ok(Err(r)),
                Parse::Incomplete => read_more(self.stream, &mut self.buf, cap).await?,
            }
        }
    }

    /// Drops the first `n` bytes (a header consumed).
    pub(super) fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
    }
}

/// The load balancer's PROXY header, when the listener expects one and
/// the peer may send it: the client it names (capped per source from now
/// on), or the peer. On a legacy `proxy` listener a header from a peer that
/// is not a trusted LB is the node proxy's own (the inner one), read later.
pub(super) async fn outer_proxy_header<'g>(
    gw: &'g Gateway,
    lctx: &ListenerCtx,
    snap: &Snapshot,
    r: &mut Reader<'_>,
    peer: SocketAddr,
    trusted: bool,
    guard: &mut Option<SourceGuard<'g>>,
) -> Result<SocketAddr, Refusal> {
    let (mode, cap) = (lctx.spec.proxy_protocol, snap.limits.proxy_header_max_bytes);
    let may_be_inner = matches!(lctx.spec.protocol, Protocol::Proxy | Protocol::Auto);
    if mode == ProxyMode::Off || (!trusted && may_be_inner) {
        return Ok(peer);
    }
    if r.until(cap, proxy_header::detect).await?.is_err() {
        return match mode {
            ProxyMode::Required => Err(Refusal::ProxyMissing),
            _ => Ok(peer),
        };
    }
    if !trusted {
        return Err(Refusal::UntrustedProxy);
    }
    let h = r
        .until(cap, |b| proxy_header::parse(b, cap))
        .await?
        .map_err(Refusal::Proxy)?;
    r.consume(h.len);
    match h.addresses {
        proxy_header::Addresses::Proxied { source, .. } => {
            let client = SocketAddr::new(canonical(source.ip()), source.port());
            let cap = snap.limits.max_unrouted_per_source;
            *guard = Some(
                gw.sources
                    .enter(client.ip(), cap)
                    .ok_or(Refusal::PerSourceLimit)?,
            );
            Ok(client)
        }
        proxy_header::Addresses::Local => {
            lb_health_check(r, snap).await?;
            Ok(peer)
        }
    }
}

/// A `LOCAL` PROXY header is a load balancer's health check: it usually
/// closes now, which ends the connection as such.
pub(super) async fn lb_health_check(r: &mut Reader<'_>, snap: &Snapshot) -> Result<(), Refusal> {
    if r.buf.is_empty()
        && read_more(r.stream, &mut r.buf, snap.limits.client_hello_max_bytes).await
            == Err(Refusal::Eof)
    {
        return Err(Refusal::LbHealthCheck);
    }
    Ok(())
}

/// The node proxy's PROXY header: its destination (or, on a `route_by_tlv`
/// listener, its cluster-ID TLV) picks the control plane; its source is not
/// believed (the outer header or the peer is). What follows it is the
/// replay.
pub(super) async fn inner_proxy_header(
    lctx: &ListenerCtx,
    r: &mut Reader<'_>,
    cap: usize,
) -> Result<Request, Refusal> {
    let h = match r.until(cap, |b| proxy_header::parse(b, cap)).await? {
        Ok(h) => h,
        Err(proxy_header::Reject::NotProxy) => return Err(Refusal::ProxyMissing),
        Err(rej) => return Err(Refusal::Proxy(rej)),
    };
    let request = match (lctx.spec.route_by_tlv, &h.addresses) {
        (Some(ty), _) => {
            let Some(id) = proxy_header::tlv(&r.buf, &h, ty).map(<[u8]>::to_vec) else {
                return Err(Refusal::ClusterIdMissing);
            };
            Request::Cluster { id }
        }
        (None, proxy_header::Addresses::Proxied { destination, .. }) => Request::Legacy {
            destination: *destination,
        },
        (None, proxy_header::Addresses::Local) => return Err(Refusal::InnerProxyLocal),
    };
    r.consume(h.len);
    Ok(request)
}

/// Whether `b` is (so far) HTTP/2's connection preface.
fn h2_preface(b: &[u8]) -> Parse<(), ()> {
    let n = b.len().min(H2_PREFACE.len());
    match (b[..n] == H2_PREFACE[..n], n == H2_PREFACE.len()) {
        (false, _) => Parse::Invalid(()),
        (true, true) => Parse::Done(()),
        (true, false) => Parse::Incomplete,
    }
}

/// An `http-connect` listener's request: HTTP/2 with prior knowledge (the
/// preface and all after it is the replay), or a CONNECT head (what
/// followed it is the replay; a broken head is answered 400 and nothing
/// after it is read).
pub(super) async fn connect_or_http2(r: &mut Reader<'_>) -> Result<Request, Refusal> {
    if r.until(H2_PREFACE.len(), h2_preface).await?.is_ok() {
        return Ok(Request::Http2);
    }
    let limits = connect_head::Limits::default();
    match r
        .until(limits.max_head_bytes, |b| connect_head::parse(b, &limits))
        .await?
    {
        Ok(head) => {
            r.consume(head.len);
            Ok(Request::Connect(head))
        }
        Err(rej) => {
            respond_and_close(
                r.stream,
                b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            )
            .await;
            Err(Refusal::Head(rej))
        }
    }
}

/// A TLS ClientHello with a server name (the whole of it, and whatever
/// followed, is the replay). Bytes that are not TLS but a PROXY header on a
/// listener that takes none are an untrusted PROXY header.
pub(super) async fn client_hello(
    lctx: &ListenerCtx,
    r: &mut Reader<'_>,
    cap: usize,
) -> Result<Request, Refusal> {
    match r.until(cap, |b| client_hello::parse(b, cap)).await? {
        Ok(h) => {
            let sni = h.sni.ok_or(Refusal::NoSni)?;
            Ok(Request::Tls { sni, alpn: h.alpn })
        }
        Err(client_hello::Reject::NotTls)
            if lctx.spec.proxy_protocol == ProxyMode::Off
                && matches!(proxy_header::detect(&r.buf), Parse::Done(())) =>
        {
            Err(Refusal::UntrustedProxy)
        }
        Err(rej) => Err(Refusal::Hello(rej)),
    }
}

/// Appends what the socket has (at least one byte) without letting `buf`
/// grow past `cap` plus one read. Nothing is allocated before bytes
/// arrive: a half-open connection (silent, or trickling a head) holds only
/// what it sent, not a read buffer, so an attack of many of them costs
/// little memory. Each read goes through a stack chunk (not held across an
/// await) and `buf` grows by what came.
pub(super) async fn read_more(
    stream: &TcpStream,
    buf: &mut Vec<u8>,
    cap: usize,
) -> Result<(), Refusal> {
    const CHUNK: usize = 2048;
    let want = cap.saturating_sub(buf.len()).clamp(1, CHUNK);
    loop {
        if stream.readable().await.is_err() {
            return Err(Refusal::ReadError);
        }
        let mut chunk = [0u8; CHUNK];
        // A short read clears the readiness: the copy that follows does
        // not begin with a read that finds nothing.
        let read = || stream.try_read(&mut chunk[..want]);
        match seedlink_net::copy::read_drained(stream, want, read) {
            Ok(0) => return Err(Refusal::Eof),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Err(Refusal::ReadError),
        }
    }
}

/// The HTTP/2 client connection preface.
pub(super) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Tells the protocol of an `auto` listener's connection from its first
/// bytes: a TLS record (0x16), a PROXY v1/v2 header (the legacy path), the
/// HTTP/2 preface, or an HTTP/1 request line (a token of uppercase letters
/// and a space). Bias: bytes that begin like a PROXY header or the HTTP/2
/// preface are waited for until they can be told apart; a request whose
/// method is literally `PROXY` is read as a PROXY header.
pub(super) fn classify(buf: &[u8]) -> Parse<Protocol, Refusal> {
    let Some(&first) = buf.first() else {
        return Parse::Incomplete;
    };
    if first == 0x16 {
        return Parse::Done(Protocol::Tls);
    }
    match proxy_header::detect(buf) {
        Parse::Done(()) => return Parse::Done(Protocol::Proxy),
        Parse::Incomplete => return Parse::Incomplete,
        Parse::Invalid(()) => {}
    }
    match h2_preface(buf) {
        Parse::Done(()) => Parse::Done(Protocol::HttpConnect),
        Parse::Incomplete => Parse::Incomplete,
        Parse::Invalid(()) => http1_method(buf),
    }
}

/// Whether `b` starts an HTTP/1 request: 1–20 uppercase letters, then a
/// space.
fn http1_method(buf: &[u8]) -> Parse<Protocol, Refusal> {
    for (i, &b) in buf.iter().enumerate().take(21) {
        match b {
            b'A'..=b'Z' => {}
            b' ' if i > 0 => return Parse::Done(Protocol::HttpConnect),
            _ => return Parse::Invalid(Refusal::Unrecognized),
        }
    }
    if buf.len() > 20 {
        Parse::Invalid(Refusal::Unrecognized)
    } else {
        Parse::Incomplete
    }
}
