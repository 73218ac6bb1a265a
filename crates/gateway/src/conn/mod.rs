//! One connection, top to bottom:
//! limits → PROXY header (if configured and the peer is trusted) →
//! the first message under one absolute deadline (a TLS ClientHello on `tls`
//! listeners, a CONNECT request head on `http-connect` listeners) → route
//! (by SNI, or by the destination header) → ACL → upstream connect →
//! (CONNECT: `200`) → replay the bytes read → copy until both sides end.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use seedlink_config::routes::canonical;
use seedlink_config::routes::ControlPlane;
use seedlink_config::Snapshot;
use seedlink_net::copy::Tally;
use seedlink_net::sockopt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::state::{Gateway, ListenerCtx, SourceGuard};
use crate::upstream;

mod connect;
mod detect;
mod outcome;
mod route;

use detect::*;
use outcome::*;
use route::*;

/// Adds to a metric and to a local total, so the access log has byte counts.
struct Count<'a> {
    metric: &'a Counter,
    local: std::sync::atomic::AtomicU64,
}

impl Tally for Count<'_> {
    fn add(&self, n: u64) {
        self.metric.inc_by(n);
        self.local
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Serves one accepted connection. Never panics on input; every exit path
/// is counted exactly once.
pub async fn serve(gw: Arc<Gateway>, lctx: Arc<ListenerCtx>, stream: TcpStream, peer: SocketAddr) {
    let snap = gw.snapshot();
    let started = std::time::Instant::now();
    lctx.metrics.active.inc();
    let (cp, outcome) = run(&gw, &lctx, &snap, stream, peer).await;
    lctx.metrics.active.dec();
    lctx.metrics
        .duration
        .observe(started.elapsed().as_secs_f64());
    let cp = cp.as_ref().map_or("", |c| c.name.as_str());
    lctx.metrics.ended(&gw.metrics, cp, outcome.reason());
}

/// One connection as a table of contents: admit the source → detect the
/// first message (under one absolute deadline) → route → ACL → an
/// in-process service, or the limits → upstream connect → answer and
/// replay → copy. Each step returns what the next needs or how the
/// connection ended.
async fn run(
    gw: &Arc<Gateway>,
    lctx: &Arc<ListenerCtx>,
    snap: &Arc<Snapshot>,
    stream: TcpStream,
    peer: SocketAddr,
) -> Ended {
    let peer = SocketAddr::new(canonical(peer.ip()), peer.port());
    let trusted = snap.trusted_lbs.contains(peer.ip());
    let mut guard = match admit(gw, snap, peer, trusted) {
        Ok(g) => g,
        Err(r) => return refuse(gw, lctx, peer, r),
    };
    let deadline = Instant::now() + snap.timeouts.client_hello;
    // Boxed, as are the steps below that only run while a connection is
    // set up or refused: they would otherwise be part of every
    // connection's future for its whole life, idle ones included (the
    // future is sized for its largest state; the copy loop alone is what
    // an idle connection needs).
    let detect = Box::pin(detect(gw, lctx, snap, &stream, peer, trusted, &mut guard));
    let detected = match tokio::time::timeout_at(deadline, detect).await {
        Ok(Ok(d)) => d,
        Ok(Err(r)) => return refuse(gw, lctx, peer, r),
        Err(_) => return refuse(gw, lctx, peer, Refusal::Timeout),
    };
    if matches!(detected.request, Request::Http2) {
        return http2(gw, lctx, snap, stream, detected, guard).await;
    }
    drop(guard);
    // Boxed: routing, the ACL, the limits and the upstream dial are only
    // alive while the connection is set up; the copy is what stays.
    let ready = match Box::pin(setup(gw, lctx, snap, stream, peer, detected)).await {
        Ok(r) => r,
        Err(ended) => return ended,
    };
    copy(gw, lctx, ready).await
}

/// An HTTP/2 connection stays unrouted (holding its per-source slot)
/// whenever it has no open stream. Boxed: the HTTP/2 server's future is
/// ~2 KiB (docs/PERFORMANCE.md, idle memory).
async fn http2(
    gw: &Arc<Gateway>,
    lctx: &Arc<ListenerCtx>,
    snap: &Arc<Snapshot>,
    stream: TcpStream,
    detected: Detected,
    guard: Option<SourceGuard<'_>>,
) -> Ended {
    let (gw, lctx, snap) = (gw.clone(), lctx.clone(), snap.clone());
    let (client, prefix) = (detected.client, detected.replay);
    let h2 = crate::h2conn::serve(gw, lctx, snap, stream, client, prefix, guard);
    (None, Outcome::Http2(Box::pin(h2).await))
}

/// Routed, admitted, connected and replayed: what the copy holds for the
/// connection's life.
struct Ready<'g> {
    stream: TcpStream,
    upstream: TcpStream,
    cp: Arc<ControlPlane>,
    client: SocketAddr,
    /// Bytes already sent upstream (the replay).
    replayed: u64,
    _active: upstream::ActiveGuard,
    _routed: crate::metrics::Routed,
    _cp_slot: crate::state::RoutedGuard<'g>,
    _source_slot: Option<SourceGuard<'g>>,
}

/// Route → ACL → an in-process service, or the limits → upstream connect
/// → the CONNECT's 200 → the replay.
async fn setup<'g>(
    gw: &'g Arc<Gateway>,
    lctx: &Arc<ListenerCtx>,
    snap: &Arc<Snapshot>,
    stream: TcpStream,
    peer: SocketAddr,
    detected: Detected,
) -> Result<Ready<'g>, Ended> {
    let at = At {
        gw,
        lctx,
        snap,
        stream: &stream,
        peer,
        detected: &detected,
    };
    let route = at.route().await?;
    if !gw.admit(snap, &route.cp, detected.client) {
        return Err(at.unavailable(route.cp, Outcome::AclDenied, None).await);
    }
    if let Some(name) = route.local() {
        let handler = at.local_handler(&route, name).await?;
        return Err(hand_over(gw, lctx, route, handler, stream, detected));
    }
    let (cp_slot, source_slot) = at.slots(gw, &route).await?;
    let (upstream, active, endpoint) = at.connect(&route).await?;
    at.answer(&route.cp).await?;
    let routed = lctx
        .metrics
        .routed(&gw.metrics, &route.cp.name, route.protocol);
    let replayed = at.replay(&route.cp, &upstream, &endpoint).await?;
    Ok(Ready {
        client: detected.client,
        stream,
        upstream,
        cp: route.cp,
        replayed,
        _active: active,
        _routed: routed,
        _cp_slot: cp_slot,
        _source_slot: source_slot,
    })
}

/// Copies until both sides end, the control plane is removed (after its
/// grace period), or the drain deadline passes.
async fn copy(gw: &Gateway, lctx: &ListenerCtx, ready: Ready<'_>) -> Ended {
    let Ready {
        stream,
        upstream,
        cp,
        client,
        replayed,
        ..
    } = &ready;
    let handles = lctx.metrics.cp(&gw.metrics, &cp.name);
    let up = Count {
        metric: &handles.to_upstream,
        local: (*replayed).into(),
    };
    let down = Count {
        metric: &handles.to_client,
        local: 0.into(),
    };
    let closer = gw.closer_for(&cp.name);
    let copied = tokio::select! {
        r = gw.copier.run(stream, upstream, &up, &down) => match r {
            Ok(()) => Copied::Ok,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Copied::Reset,
            Err(_) => Copied::Error,
        },
        () = closer.cancelled() => Copied::ClosedRemoved,
        () = gw.lifecycle.close_all.cancelled() => Copied::ClosedDrain,
    };
    let outcome = Outcome::Copied(copied);
    if matches!(copied, Copied::ClosedRemoved | Copied::ClosedDrain) {
        sockopt::arm_reset(stream);
        sockopt::arm_reset(upstream);
    }
    tracing::debug!(listener = %lctx.spec.name, %client, control_plane = %cp.name,
        outcome = outcome.reason(), bytes_up = up.local.into_inner(),
        bytes_down = down.local.into_inner(), "closed");
    (Some(cp.clone()), outcome)
}

/// Caps unrouted connections per source. A trusted load balancer is exempt
/// as a peer; its clients are capped once the PROXY header names them.
fn admit<'g>(
    gw: &'g Gateway,
    snap: &Snapshot,
    peer: SocketAddr,
    trusted: bool,
) -> Result<Option<SourceGuard<'g>>, Refusal> {
    if trusted {
        return Ok(None);
    }
    gw.sources
        .enter(peer.ip(), snap.limits.max_unrouted_per_source)
        .map(Some)
        .ok_or(Refusal::PerSourceLimit)
}

#[cfg(test)]
mod tests {
    use super::connect::*;
    use super::detect::*;
    use super::*;
    use seedlink_config::model::Protocol;
    use seedlink_proto::{connect_head, proxy_header, Parse};

    #[test]
    fn destination_guard_applies_before_the_grammar() {
        let head = |v: &str| {
            let raw = format!("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {v}\r\n\r\n");
            match connect_head::parse(raw.as_bytes(), &connect_head::Limits::default()) {
                Parse::Done(h) => h,
                other => panic!("{other:?}"),
            }
        };
        let guard =
            seedlink_config::compile::destination_regex(r"outbound\|443\|\|kube-apiserver\..*")
                .unwrap();
        let ok = "outbound|443||kube-apiserver.ns.svc.cluster.local";
        let vpn = "outbound|1194||vpn-seed-server.ns.svc.cluster.local";
        let h = "x-gardener-destination";
        assert_eq!(
            check_connect(&head(ok), h, Some(&guard)),
            Ok(ok.to_string())
        );
        assert_eq!(
            check_connect(&head(vpn), h, Some(&guard)),
            Err(BadConnect::MalformedDestination)
        );
        assert_eq!(check_connect(&head(vpn), h, None), Ok(vpn.to_string()));
    }

    #[test]
    fn classify_first_bytes() {
        assert_eq!(classify(b"\x16\x03\x01"), Parse::Done(Protocol::Tls));
        assert_eq!(
            classify(b"CONNECT a:443 HTTP/1.1"),
            Parse::Done(Protocol::HttpConnect)
        );
        assert_eq!(
            classify(b"GET / HTTP/1.1"),
            Parse::Done(Protocol::HttpConnect)
        );
        assert_eq!(classify(b"PROXY TCP4 "), Parse::Done(Protocol::Proxy));
        assert_eq!(
            classify(&proxy_header::V2_SIGNATURE),
            Parse::Done(Protocol::Proxy)
        );
        assert_eq!(classify(H2_PREFACE), Parse::Done(Protocol::HttpConnect));
        // Ambiguous prefixes wait for more bytes.
        for p in [
            &b""[..],
            b"P",
            b"PR",
            b"PRO",
            b"PROX",
            b"PROXY",
            b"PRI * HTTP/2",
            b"\r\n\r\n",
            b"CONN",
        ] {
            assert_eq!(
                classify(p),
                Parse::Incomplete,
                "{:?}",
                String::from_utf8_lossy(p)
            );
        }
        assert_eq!(
            classify(b"POST / HTTP/1.1"),
            Parse::Done(Protocol::HttpConnect)
        );
        assert_eq!(classify(b"\x00\x01"), Parse::Invalid(Refusal::Unrecognized));
        assert_eq!(
            classify(b"get / HTTP/1.1"),
            Parse::Invalid(Refusal::Unrecognized)
        );
        assert_eq!(classify(&[b'A'; 30]), Parse::Invalid(Refusal::Unrecognized));
    }
}

#[cfg(test)]
mod future_size {
    /// The size of the future an async fn returns, without calling it.
    fn returned_size<A, B, C, D, R>(_f: fn(A, B, C, D) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// Every connection's task holds `serve`'s future for its whole life,
    /// so its size is most of what an idle connection costs (about 1.2 KiB
    /// of 2.4 KiB in the bench). It grew to 3 KiB once, unnoticed, through
    /// a stack buffer in a refusal path and the inline HTTP/2 server
    /// (docs/PERFORMANCE.md); this catches the next such growth.
    #[test]
    fn connection_future_stays_small() {
        let serve = returned_size(super::serve as fn(_, _, _, _) -> _);
        eprintln!("conn::serve's future: {serve} bytes");
        assert!(
            serve <= 1536,
            "conn::serve's future is {serve} bytes (limit 1536): box what is only alive during setup or a refusal"
        );
    }
}
