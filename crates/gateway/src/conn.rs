//! One connection, top to bottom:
//! limits → PROXY header (if configured and the peer is trusted) →
//! the first message under one absolute deadline (a TLS ClientHello on `tls`
//! listeners, a CONNECT request head on `http-connect` listeners) → route
//! (by SNI, or by the destination header) → ACL → upstream connect →
//! (CONNECT: `200`) → replay the bytes read → copy until both sides end.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use seedlink_config::model::{InvalidRequest, Protocol, ProxyMode};
use seedlink_config::routes::canonical;
use seedlink_config::routes::{ControlPlane, Endpoint};
use seedlink_config::Snapshot;
use seedlink_net::copy::{write_all, Tally};
use seedlink_net::sockopt;
use seedlink_proto::{client_hello, connect_head, destination, proxy_header, Parse};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::{upstream, Gateway, ListenerCtx, SourceGuard};

/// Why a connection ended before being proxied; `reason()` is the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Timeout,
    Eof,
    ReadError,
    PerSourceLimit,
    UntrustedProxy,
    ProxyMissing,
    Proxy(proxy_header::Reject),
    Hello(client_hello::Reject),
    Head(connect_head::Reject),
    LbHealthCheck,
    /// Connected and closed without sending a byte: a TCP health check
    /// (kubelet `tcpSocket`, a LoadBalancer's TCP check, a node proxy's
    /// readiness probe).
    TcpProbe,
    NoSni,
    UnknownSni,
    UnknownDestination,
    /// A CONNECT whose destination goes to an in-process tunnel-server, on
    /// a listener that is not a `tunnel_frontend` or for a destination
    /// without a `tunnel_target`: answered like an unknown destination.
    TunnelNotAllowed,
    Connect(BadConnect),
    InnerProxyLocal,
    UnknownService,
    /// A `route_by_tlv` listener: the node proxy's header lacks the TLV.
    ClusterIdMissing,
    /// A `route_by_tlv` listener: no control plane has that cluster ID.
    UnknownClusterId,
    Unrecognized,
}

impl Refusal {
    fn reason(&self) -> &'static str {
        match self {
            Refusal::Timeout => "timeout",
            Refusal::Eof => "eof",
            Refusal::ReadError => "read_error",
            Refusal::PerSourceLimit => "per_source_limit",
            Refusal::UntrustedProxy => "proxy_untrusted_peer",
            Refusal::ProxyMissing => "proxy_missing",
            Refusal::Proxy(r) => r.reason(),
            Refusal::Hello(r) => r.reason(),
            Refusal::Head(r) => r.reason(),
            Refusal::LbHealthCheck => "lb_health_check",
            Refusal::TcpProbe => "tcp_probe",
            Refusal::NoSni => "no_sni",
            Refusal::UnknownSni => "unknown_sni",
            Refusal::UnknownDestination => "unknown_destination",
            Refusal::TunnelNotAllowed => "tunnel_not_allowed",
            Refusal::InnerProxyLocal => "proxy_no_destination",
            Refusal::UnknownService => "unknown_service_address",
            Refusal::ClusterIdMissing => "cluster_id_missing",
            Refusal::UnknownClusterId => "unknown_cluster_id",
            Refusal::Unrecognized => "unrecognized_protocol",
            Refusal::Connect(bad) => bad.reason(),
        }
    }
}

/// How a connection ended; `reason()` is the `outcome` label of
/// `connections_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Refused before it was routed.
    Refused(Refusal),
    /// Its control plane's ACL (or the global list) does not allow the client.
    AclDenied,
    /// No endpoint of its control plane could be reached.
    UpstreamUnavailable,
    /// Its control plane holds `max_connections_per_control_plane`.
    ControlPlaneLimit,
    /// Its source holds `max_routed_per_source`.
    SourceLimit,
    /// An in-process service took it over.
    HandedOver,
    /// Writing to the client failed before the copy started.
    ClientError,
    /// Writing to the upstream failed before the copy started.
    UpstreamError,
    /// The copy ended.
    Copied(Copied),
    /// An HTTP/2 connection ended (its streams are counted on their own).
    Http2(&'static str),
}

/// How a copy between client and upstream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copied {
    Ok,
    Reset,
    Error,
    /// Its control plane was removed and the grace period ended.
    ClosedRemoved,
    /// The drain deadline passed.
    ClosedDrain,
}

impl Outcome {
    fn reason(&self) -> &'static str {
        match self {
            Outcome::Refused(r) => r.reason(),
            Outcome::AclDenied => "acl_denied",
            Outcome::UpstreamUnavailable => "upstream_unavailable",
            Outcome::ControlPlaneLimit => "control_plane_limit",
            Outcome::SourceLimit => "source_limit",
            Outcome::HandedOver => "handed_over",
            Outcome::ClientError => "client_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Copied(Copied::Ok) => "ok",
            Outcome::Copied(Copied::Reset) => "reset",
            Outcome::Copied(Copied::Error) => "error",
            Outcome::Copied(Copied::ClosedRemoved) => "closed_removed",
            Outcome::Copied(Copied::ClosedDrain) => "closed_drain",
            Outcome::Http2(label) => label,
        }
    }
}

/// What `run` reports: the control plane (if routed) and how it ended.
type Ended = (Option<Arc<ControlPlane>>, Outcome);

/// The first message, per listener protocol.
enum Request {
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
struct Detected {
    client: SocketAddr,
    request: Request,
    /// Bytes to send upstream once connected: for TLS the ClientHello and
    /// whatever followed it, for CONNECT only what followed the head.
    replay: Vec<u8>,
}

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

/// Answers a CONNECT with 503 when its control plane has no usable
/// upstream (other requests are just closed by the caller).
async fn refuse_connect_unavailable(stream: &TcpStream, request: &Request) {
    if let Request::Connect(head) = request {
        respond_and_close(
            stream,
            status_line(head, "503 Service Unavailable").as_bytes(),
        )
        .await;
    }
}

async fn run(
    gw: &Arc<Gateway>,
    lctx: &Arc<ListenerCtx>,
    snap: &Arc<Snapshot>,
    stream: TcpStream,
    peer: SocketAddr,
) -> Ended {
    let peer = SocketAddr::new(canonical(peer.ip()), peer.port());
    let trusted = snap.trusted_lbs.contains(peer.ip());
    // Unrouted connections are capped per source. A trusted load balancer is
    // exempt as a peer; its clients are capped once the PROXY header names them.
    let mut guard = None;
    if !trusted {
        match gw
            .sources
            .enter(peer.ip(), snap.limits.max_unrouted_per_source)
        {
            Some(g) => guard = Some(g),
            None => return refuse(gw, lctx, peer, Refusal::PerSourceLimit),
        }
    }
    let deadline = Instant::now() + snap.timeouts.client_hello;
    // Boxed, as are the upstream dial and the refusal answers below: what is
    // only alive while a connection is set up or refused would otherwise be
    // part of every connection's future for its whole life, idle ones
    // included (the future is sized for its largest state; the copy loop
    // alone is what an idle connection needs).
    let detected = match tokio::time::timeout_at(
        deadline,
        Box::pin(detect(gw, lctx, snap, &stream, peer, trusted, &mut guard)),
    )
    .await
    {
        Ok(Ok(d)) => d,
        Ok(Err(r)) => return refuse(gw, lctx, peer, r),
        Err(_) => return refuse(gw, lctx, peer, Refusal::Timeout),
    };
    let client = detected.client;
    let stream_local = if snap.routes.scoped() {
        stream.local_addr().ok()
    } else {
        None
    };
    if matches!(detected.request, Request::Http2) {
        // An HTTP/2 connection stays unrouted (holding its per-source slot)
        // whenever it has no open stream.
        let Detected { replay, .. } = detected;
        // Boxed: the HTTP/2 server's future is ~2 KiB and would otherwise
        // be part of every connection's future, idle TLS passthrough
        // included (docs/PERFORMANCE.md, idle memory).
        let outcome = Box::pin(crate::h2conn::serve(
            gw.clone(),
            lctx.clone(),
            snap.clone(),
            stream,
            client,
            replay,
            guard,
        ))
        .await;
        return (None, Outcome::Http2(outcome));
    }
    drop(guard);

    // `tunnel_target`: for a CONNECT, what an in-process tunnel-server may
    // dial (the destination's configured target, never the request line).
    let (cp, endpoints, protocol, tunnel_target): (
        Arc<ControlPlane>,
        &[Endpoint],
        &str,
        Option<&str>,
    ) = match &detected.request {
        Request::Tls { sni, .. } => {
            // Names served on some addresses only (a Gateway of the class
            // with its own address) are looked up where the connection
            // arrived; the getsockname is paid only when such names exist.
            let cp = match stream_local {
                Some(local) => snap.routes.lookup_at(sni, local),
                None => snap.routes.lookup(sni),
            };
            let Some(cp) = cp else {
                tracing::debug!(listener = %lctx.spec.name, %peer, %client, %sni, "unknown SNI");
                return refuse(gw, lctx, client, Refusal::UnknownSni);
            };
            (cp.clone(), cp.endpoints.as_slice(), "tls-sni", None)
        }
        // Served above; kept exhaustive.
        Request::Http2 => return refuse(gw, lctx, client, Refusal::Unrecognized),
        Request::Legacy { destination } => {
            let Some(cp) = snap.routes.service(*destination) else {
                tracing::debug!(listener = %lctx.spec.name, %peer, %client, %destination, "unknown service address");
                return refuse(gw, lctx, client, Refusal::UnknownService);
            };
            (cp.clone(), cp.endpoints.as_slice(), "proxy-protocol", None)
        }
        Request::Cluster { id } => {
            let Some(cp) = snap.routes.cluster(id) else {
                tracing::debug!(listener = %lctx.spec.name, %peer, %client,
                    cluster_id = %String::from_utf8_lossy(id), "unknown cluster ID");
                return refuse(gw, lctx, client, Refusal::UnknownClusterId);
            };
            (cp.clone(), cp.endpoints.as_slice(), "proxy-tlv", None)
        }
        Request::Connect(head) => {
            let canonical = match check_connect(
                head,
                &lctx.spec.destination_header,
                lctx.spec.destination_regex.as_ref(),
            ) {
                Ok(c) => c,
                Err(bad) => {
                    return Box::pin(reject_connect(gw, lctx, &stream, client, head, bad)).await
                }
            };
            let Some(route) = snap.routes.destination(&canonical) else {
                if gw.metrics.refusal_log.allow() {
                    tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, %client, %peer,
                        reason = "unknown_destination", destination = %canonical, "connection refused");
                }
                respond_and_close(
                    &stream,
                    status_line(head, "503 Service Unavailable").as_bytes(),
                )
                .await;
                return refuse(gw, lctx, client, Refusal::UnknownDestination);
            };
            // A CONNECT reaches into a shoot only on a listener configured
            // as a tunnel frontend, and only to the destination's own
            // target (the request line is never dialled). Decided before
            // the ACL, with the answer of an unknown destination, so a
            // public listener tells nothing about tunnel destinations.
            let local =
                matches!(route.endpoints.as_slice(), [only] if only.address.starts_with("local:"));
            if local && (!lctx.spec.tunnel_frontend || route.tunnel_target.is_none()) {
                if gw.metrics.refusal_log.allow() {
                    tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, %client, %peer,
                        destination = %canonical, reason = "tunnel_not_allowed",
                        "a CONNECT to an in-process tunnel needs a tunnel_frontend listener and a destination tunnel_target");
                }
                respond_and_close(
                    &stream,
                    status_line(head, "503 Service Unavailable").as_bytes(),
                )
                .await;
                return refuse(gw, lctx, client, Refusal::TunnelNotAllowed);
            }
            (
                route.control_plane.clone(),
                route.endpoints.as_slice(),
                lctx.connect_protocol.as_str(),
                route
                    .tunnel_target
                    .as_deref()
                    .filter(|_| lctx.spec.tunnel_frontend),
            )
        }
    };
    if !gw.admit(snap, &cp, client) {
        if gw.metrics.refusal_log.allow() {
            tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, %client, %peer,
                control_plane = %cp.name, reason = "acl_denied", "connection refused");
        }
        if let Request::Connect(head) = &detected.request {
            // The answer of an unknown destination: an outsider learns
            // nothing about which destinations exist (logs and metrics
            // keep `acl_denied`).
            respond_and_close(
                &stream,
                status_line(head, "503 Service Unavailable").as_bytes(),
            )
            .await;
        }
        return (Some(cp), Outcome::AclDenied);
    }

    // An in-process service takes the connection over: no upstream socket,
    // no copy loop here.
    if let [only] = endpoints {
        if let Some(name) = only.address.strip_prefix("local:") {
            let Some(handler) = gw.local(name) else {
                tracing::warn!(listener = %lctx.spec.name, control_plane = %cp.name, local = name, "no in-process service of that name");
                refuse_connect_unavailable(&stream, &detected.request).await;
                return (Some(cp), Outcome::UpstreamUnavailable);
            };
            // A CONNECT reaches into a shoot only on a listener configured
            // as a tunnel frontend, and only to the destination's own
            // target: the request line is never dialled.
            // Checked above: a CONNECT here has its configured target.
            let connect_target = match &detected.request {
                Request::Connect(_) => tunnel_target.map(str::to_string),
                _ => None,
            };
            let _routed = lctx.metrics.routed(&gw.metrics, &cp.name, protocol);
            let Detected { replay, client, .. } = detected;
            handler(crate::Handoff {
                stream,
                replay,
                client,
                control_plane: cp.name.clone(),
                connect_target,
            });
            return (Some(cp), Outcome::HandedOver);
        }
    }
    // One tenant's clients cannot take every connection of the gateway.
    let Some(_routed_slot) = gw.enter_control_plane(snap, &cp.name) else {
        if gw.metrics.refusal_log.allow() {
            tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, %client, %peer,
                control_plane = %cp.name, reason = "control_plane_limit", "connection refused");
        }
        refuse_connect_unavailable(&stream, &detected.request).await;
        return (Some(cp), Outcome::ControlPlaneLimit);
    };
    let Ok(_source_slot) = gw.enter_routed_source(snap, client.ip()) else {
        if gw.metrics.refusal_log.allow() {
            tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, %client, %peer,
                control_plane = %cp.name, reason = "source_limit", "connection refused");
        }
        refuse_connect_unavailable(&stream, &detected.request).await;
        return (Some(cp), Outcome::SourceLimit);
    };
    let (upstream, _active, endpoint) = match Box::pin(upstream::connect(
        &cp.name,
        endpoints,
        &snap.upstream,
        snap.timeouts.upstream_connect,
        crate::keepalive(snap),
        &gw.metrics,
    ))
    .await
    {
        Ok(u) => u,
        Err(e) => {
            if gw.metrics.refusal_log.allow() {
                tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, %client, %peer,
                    control_plane = %cp.name, reason = "upstream_unavailable", error = %e, "connection failed");
            }
            refuse_connect_unavailable(&stream, &detected.request).await;
            return (Some(cp), Outcome::UpstreamUnavailable);
        }
    };
    let handles = lctx.metrics.cp(&gw.metrics, &cp.name);
    let up = Count {
        metric: &handles.to_upstream,
        local: 0.into(),
    };
    let down = Count {
        metric: &handles.to_client,
        local: 0.into(),
    };

    if let Request::Connect(head) = &detected.request {
        // Only now, with the upstream connected, does the client hear 200;
        // what it pipelined after the head goes upstream right after.
        let ok = if head.minor_version == 0 {
            "HTTP/1.0 200 Connection established\r\n\r\n"
        } else {
            "HTTP/1.1 200 Connection established\r\n\r\n"
        };
        if write_all(&stream, ok.as_bytes()).await.is_err() {
            return (Some(cp), Outcome::ClientError);
        }
    }
    let _routed = lctx.metrics.routed(&gw.metrics, &cp.name, protocol);
    if let Err(e) = write_all(&upstream, &detected.replay).await {
        tracing::debug!(control_plane = %cp.name, error = %e, "upstream write failed");
        sockopt::arm_reset(&stream);
        return (Some(cp), Outcome::UpstreamError);
    }
    up.add(detected.replay.len() as u64);
    match &detected.request {
        Request::Tls { sni, alpn } => {
            tracing::debug!(listener = %lctx.spec.name, %client, %peer, %sni,
            ?alpn, control_plane = %cp.name, %endpoint, "proxying")
        }
        Request::Connect(head) => tracing::debug!(listener = %lctx.spec.name, %client, %peer,
            target = %head.target, control_plane = %cp.name, %endpoint, "tunnelling"),
        Request::Http2 => {}
        Request::Legacy { destination } => {
            tracing::debug!(listener = %lctx.spec.name, %client, %peer,
            %destination, control_plane = %cp.name, %endpoint, "proxying legacy")
        }
        Request::Cluster { id } => {
            tracing::debug!(listener = %lctx.spec.name, %client, %peer,
            cluster_id = %String::from_utf8_lossy(id), control_plane = %cp.name, %endpoint, "proxying by cluster ID")
        }
    }
    drop(detected);
    let closer = gw.closer_for(&cp.name);
    let copied = tokio::select! {
        r = gw.copier.run(&stream, &upstream, &up, &down) => match r {
            Ok(()) => Copied::Ok,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Copied::Reset,
            Err(_) => Copied::Error,
        },
        () = closer.cancelled() => Copied::ClosedRemoved,
        () = gw.lifecycle.close_all.cancelled() => Copied::ClosedDrain,
    };
    let outcome = Outcome::Copied(copied);
    if matches!(copied, Copied::ClosedRemoved | Copied::ClosedDrain) {
        sockopt::arm_reset(&stream);
        sockopt::arm_reset(&upstream);
    }
    tracing::debug!(listener = %lctx.spec.name, %client, control_plane = %cp.name, outcome = outcome.reason(),
        bytes_up = up.local.into_inner(), bytes_down = down.local.into_inner(), "closed");
    (Some(cp), outcome)
}

fn refuse(gw: &Gateway, lctx: &ListenerCtx, who: SocketAddr, r: Refusal) -> Ended {
    let reason = r.reason();
    let probe = matches!(r, Refusal::LbHealthCheck | Refusal::TcpProbe);
    if !probe {
        lctx.metrics.detect_failure(&gw.metrics, reason);
    }
    // A load balancer's health check is not a refusal; everything else is
    // one line (rate-limited, the excess counted).
    if !probe && gw.metrics.refusal_log.allow() {
        tracing::warn!(target: "seedlink::refused", listener = %lctx.spec.name, client = %who, reason, "connection refused");
    }
    (None, Outcome::Refused(r))
}

/// Reads until a PROXY header (when configured) and a complete ClientHello
/// have arrived. The caller bounds it with the absolute deadline.
async fn detect<'g>(
    gw: &'g Gateway,
    lctx: &ListenerCtx,
    snap: &Snapshot,
    stream: &TcpStream,
    peer: SocketAddr,
    trusted: bool,
    guard: &mut Option<SourceGuard<'g>>,
) -> Result<Detected, Refusal> {
    let hello_cap = snap.limits.client_hello_max_bytes;
    let proxy_cap = snap.limits.proxy_header_max_bytes;
    // Empty until bytes arrive (see `read_more`).
    let mut buf: Vec<u8> = Vec::new();
    let mut client = peer;
    let mode = lctx.spec.proxy_protocol;

    if mode == ProxyMode::Required && !trusted {
        return Err(Refusal::UntrustedProxy);
    }
    // A health probe connects and closes without a byte: not a detection
    // failure, and not logged.
    match read_more(stream, &mut buf, proxy_cap.max(hello_cap)).await {
        Err(Refusal::Eof) => return Err(Refusal::TcpProbe),
        r => r?,
    }
    // On a legacy `proxy` listener a header from a peer that is not a
    // trusted LB is the node proxy's own (the inner one), read below.
    let may_be_inner = matches!(lctx.spec.protocol, Protocol::Proxy | Protocol::Auto);
    let outer = mode != ProxyMode::Off && (trusted || !may_be_inner);
    if outer {
        let header = loop {
            let present = match proxy_header::detect(&buf) {
                Parse::Done(()) => true,
                Parse::Invalid(()) => false,
                Parse::Incomplete => {
                    read_more(stream, &mut buf, proxy_cap).await?;
                    continue;
                }
            };
            if !present {
                if mode == ProxyMode::Required {
                    return Err(Refusal::ProxyMissing);
                }
                break None;
            }
            if !trusted {
                return Err(Refusal::UntrustedProxy);
            }
            match proxy_header::parse(&buf, proxy_cap) {
                Parse::Done(h) => break Some(h),
                Parse::Invalid(r) => return Err(Refusal::Proxy(r)),
                Parse::Incomplete => read_more(stream, &mut buf, proxy_cap).await?,
            }
        };
        if let Some(h) = header {
            buf.drain(..h.len);
            match h.addresses {
                proxy_header::Addresses::Proxied { source, .. } => {
                    client = SocketAddr::new(canonical(source.ip()), source.port());
                    match gw
                        .sources
                        .enter(client.ip(), snap.limits.max_unrouted_per_source)
                    {
                        Some(g) => *guard = Some(g),
                        None => return Err(Refusal::PerSourceLimit),
                    }
                }
                proxy_header::Addresses::Local => {
                    // A load balancer health check: it usually closes now.
                    if buf.is_empty()
                        && read_more(stream, &mut buf, hello_cap).await == Err(Refusal::Eof)
                    {
                        return Err(Refusal::LbHealthCheck);
                    }
                }
            }
        }
    }

    let protocol = match lctx.spec.protocol {
        Protocol::Auto => loop {
            match classify(&buf) {
                Parse::Done(p) => break p,
                Parse::Invalid(r) => return Err(r),
                Parse::Incomplete => read_more(stream, &mut buf, 64).await?,
            }
        },
        p => p,
    };
    if protocol == Protocol::Proxy {
        // The node proxy's header: its destination picks the control plane;
        // its source is not believed (the outer header or the peer is).
        loop {
            match proxy_header::parse(&buf, proxy_cap) {
                Parse::Done(h) => {
                    if let Some(ty) = lctx.spec.route_by_tlv {
                        let Some(id) = proxy_header::tlv(&buf, &h, ty).map(<[u8]>::to_vec) else {
                            return Err(Refusal::ClusterIdMissing);
                        };
                        let replay = buf.split_off(h.len);
                        return Ok(Detected {
                            client,
                            request: Request::Cluster { id },
                            replay,
                        });
                    }
                    let replay = buf.split_off(h.len);
                    return match h.addresses {
                        proxy_header::Addresses::Proxied { destination, .. } => Ok(Detected {
                            client,
                            request: Request::Legacy { destination },
                            replay,
                        }),
                        proxy_header::Addresses::Local => Err(Refusal::InnerProxyLocal),
                    };
                }
                Parse::Invalid(proxy_header::Reject::NotProxy) => {
                    return Err(Refusal::ProxyMissing)
                }
                Parse::Invalid(r) => return Err(Refusal::Proxy(r)),
                Parse::Incomplete => read_more(stream, &mut buf, proxy_cap).await?,
            }
        }
    }
    if protocol == Protocol::HttpConnect {
        // h2c with prior knowledge on the same listener.
        loop {
            let n = buf.len().min(H2_PREFACE.len());
            if buf[..n] != H2_PREFACE[..n] {
                break;
            }
            if n == H2_PREFACE.len() {
                return Ok(Detected {
                    client,
                    request: Request::Http2,
                    replay: buf,
                });
            }
            read_more(stream, &mut buf, H2_PREFACE.len()).await?;
        }
        let limits = connect_head::Limits::default();
        loop {
            match connect_head::parse(&buf, &limits) {
                Parse::Done(head) => {
                    let replay = buf.split_off(head.len);
                    return Ok(Detected {
                        client,
                        request: Request::Connect(head),
                        replay,
                    });
                }
                Parse::Invalid(r) => {
                    // A 400 for a broken head; nothing after it is read.
                    respond_and_close(stream, b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
                    return Err(Refusal::Head(r));
                }
                Parse::Incomplete => read_more(stream, &mut buf, limits.max_head_bytes).await?,
            }
        }
    }
    loop {
        match client_hello::parse(&buf, hello_cap) {
            Parse::Done(h) => {
                let Some(sni) = h.sni else {
                    return Err(Refusal::NoSni);
                };
                return Ok(Detected {
                    client,
                    request: Request::Tls { sni, alpn: h.alpn },
                    replay: buf,
                });
            }
            Parse::Invalid(r) => {
                if r == client_hello::Reject::NotTls
                    && mode == ProxyMode::Off
                    && matches!(proxy_header::detect(&buf), Parse::Done(()))
                {
                    return Err(Refusal::UntrustedProxy);
                }
                return Err(Refusal::Hello(r));
            }
            Parse::Incomplete => read_more(stream, &mut buf, hello_cap).await?,
        }
    }
}

/// Appends what the socket has (at least one byte) without letting `buf`
/// grow past `cap` plus one read. Nothing is allocated before bytes
/// arrive: a half-open connection (silent, or trickling a head) holds only
/// what it sent, not a read buffer, so an attack of many of them costs
/// little memory. Each read goes through a stack chunk (not held across an
/// await) and `buf` grows by what came.
async fn read_more(stream: &TcpStream, buf: &mut Vec<u8>, cap: usize) -> Result<(), Refusal> {
    const CHUNK: usize = 2048;
    let want = cap.saturating_sub(buf.len()).clamp(1, CHUNK);
    loop {
        if stream.readable().await.is_err() {
            return Err(Refusal::ReadError);
        }
        let mut chunk = [0u8; CHUNK];
        match stream.try_read(&mut chunk[..want]) {
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

/// Why a well-formed request head cannot be tunnelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BadConnect {
    NotConnect,
    FramingHeader,
    BadTarget,
    MissingDestination,
    DuplicateDestination,
    MalformedDestination,
}

impl BadConnect {
    fn reason(&self) -> &'static str {
        match self {
            BadConnect::NotConnect => "not_connect",
            BadConnect::FramingHeader => "framing_header_on_connect",
            BadConnect::BadTarget => "connect_target_malformed",
            BadConnect::MissingDestination => "destination_missing",
            BadConnect::DuplicateDestination => "destination_duplicated",
            BadConnect::MalformedDestination => "destination_malformed",
        }
    }
}

/// Checks a CONNECT head and returns the canonical destination it names.
/// The request-line target is never used for routing.
fn check_connect(
    head: &connect_head::Head,
    header: &str,
    guard: Option<&regex::Regex>,
) -> Result<String, BadConnect> {
    if head.method != "CONNECT" {
        return Err(BadConnect::NotConnect);
    }
    if head.values("content-length").next().is_some()
        || head.values("transfer-encoding").next().is_some()
    {
        return Err(BadConnect::FramingHeader);
    }
    // RFC 9110 §9.3.6: the target must be `host:port`, even though the
    // header, never the target, chooses the destination.
    if !connect_head::authority_form(&head.target) {
        return Err(BadConnect::BadTarget);
    }
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
async fn reject_connect(
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
fn status_line(head: &connect_head::Head, status: &str) -> String {
    let minor = if head.minor_version == 0 { 0 } else { 1 };
    format!("HTTP/1.{minor} {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
}

/// Gardener's redirect target `https://<host>:443<path>`; `None` when the
/// request names no usable host, or a host the gateway does not serve: the
/// client's Host is echoed only when it is one of the control planes' host
/// names, so the gateway is no open redirect to anywhere.
fn redirect_location(
    head: &connect_head::Head,
    routes: &seedlink_config::routes::RouteTable,
) -> Option<String> {
    let authority = match head.values("host").next() {
        Some(h) => h.to_string(),
        None if head.method == "CONNECT" => head.target.clone(),
        None => return None,
    };
    // Strip a port: `host:port` or `[v6]:port`.
    let host = match authority.rsplit_once(':') {
        Some((h, p))
            if p.bytes().all(|b| b.is_ascii_digit()) && (!h.contains(':') || h.ends_with(']')) =>
        {
            h
        }
        _ => authority.as_str(),
    };
    let valid = !host.is_empty()
        && host.len() <= 255
        && host.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'[' | b']' | b':')
        });
    if !valid || routes.lookup(host).is_none() {
        return None;
    }
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

/// Sends a final response and closes without losing it: half-close, then
/// read and discard (never parse) what the client already sent, bounded to
/// 64 KiB and one second. Closing with unread bytes would make the kernel
/// send RST, which can destroy the response before the client reads it.
async fn respond_and_close(stream: &TcpStream, response: &[u8]) {
    // Boxed: see `run`.
    Box::pin(respond_and_close_inner(stream, response)).await
}

async fn respond_and_close_inner(stream: &TcpStream, response: &[u8]) {
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

/// The HTTP/2 client connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Tells the protocol of an `auto` listener's connection from its first
/// bytes: a TLS record (0x16), a PROXY v1/v2 header (the legacy path), the
/// HTTP/2 preface, or an HTTP/1 request line (a token of uppercase letters
/// and a space). Bias: bytes that begin like a PROXY header or the HTTP/2
/// preface are waited for until they can be told apart; a request whose
/// method is literally `PROXY` is read as a PROXY header.
fn classify(buf: &[u8]) -> Parse<Protocol, Refusal> {
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
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if n == H2_PREFACE.len() {
            Parse::Done(Protocol::HttpConnect)
        } else {
            Parse::Incomplete
        };
    }
    // An HTTP/1 method: 1–20 uppercase letters, then a space.
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(
            serve <= 1536,
            "conn::serve's future is {serve} bytes (limit 1536): box what is only alive during setup or a refusal"
        );
    }
}
