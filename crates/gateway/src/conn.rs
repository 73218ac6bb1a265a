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

use crate::state::{Gateway, ListenerCtx, SourceGuard};
use crate::upstream;

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
    Http2(crate::h2conn::H2End),
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
            Outcome::Http2(end) => end.reason(),
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

/// Where a detected connection goes.
struct Route<'s> {
    cp: Arc<ControlPlane>,
    endpoints: &'s [Endpoint],
    /// The `protocol` label of the routed counters.
    protocol: &'s str,
    /// For a CONNECT on a tunnel frontend, what an in-process tunnel-server
    /// may dial: the destination's configured target, never the request
    /// line.
    tunnel_target: Option<&'s str>,
}

impl<'s> Route<'s> {
    /// Every endpoint of `cp`.
    fn to(cp: &'s Arc<ControlPlane>, protocol: &'s str) -> Route<'s> {
        Route {
            cp: cp.clone(),
            endpoints: cp.endpoints.as_slice(),
            protocol,
            tunnel_target: None,
        }
    }

    /// The in-process service's name when the only endpoint is
    /// `local:<name>`.
    fn local(&self) -> Option<&'s str> {
        match self.endpoints {
            [only] => only.address.strip_prefix("local:"),
            _ => None,
        }
    }
}

/// A detected connection, and what every step after detection reads
/// (`'s`: the gateway and its snapshot, which routes borrow from; `'a`: the
/// connection).
struct At<'a, 's> {
    gw: &'s Arc<Gateway>,
    lctx: &'s Arc<ListenerCtx>,
    snap: &'s Arc<Snapshot>,
    stream: &'a TcpStream,
    peer: SocketAddr,
    detected: &'a Detected,
}

impl<'s> At<'_, 's> {
    /// The one refusal line after detection (rate-limited; the excess is
    /// counted).
    fn log_refused(
        &self,
        reason: &str,
        cp: Option<&str>,
        destination: Option<&str>,
        error: Option<&str>,
    ) {
        if self.gw.metrics.refusal_log.allow() {
            tracing::warn!(target: "seedlink::refused", listener = %self.lctx.spec.name,
                client = %self.detected.client, peer = %self.peer, control_plane = cp,
                destination, reason, error, "connection refused");
        }
    }

    /// A CONNECT is answered 503, the answer of an unknown destination (an
    /// outsider learns nothing about which destinations exist); other
    /// requests are just closed.
    async fn answer_unavailable(&self) {
        if let Request::Connect(head) = &self.detected.request {
            respond_and_close(
                self.stream,
                status_line(head, "503 Service Unavailable").as_bytes(),
            )
            .await;
        }
    }

    /// Routed, but its ACL, a limit or the upstream says no: logged under
    /// the outcome's reason, a CONNECT hears 503.
    async fn unavailable(
        &self,
        cp: Arc<ControlPlane>,
        outcome: Outcome,
        error: Option<&str>,
    ) -> Ended {
        self.log_refused(outcome.reason(), Some(&cp.name), None, error);
        self.answer_unavailable().await;
        (Some(cp), outcome)
    }

    /// The control plane and endpoints of the request: by SNI (where the
    /// connection arrived, for names served on some addresses only; the
    /// getsockname is paid only when such names exist), by the node proxy's
    /// destination or cluster ID, or by a CONNECT's destination header.
    async fn route(&self) -> Result<Route<'s>, Ended> {
        let (gw, lctx, snap) = (self.gw, self.lctx, self.snap);
        let (client, peer) = (self.detected.client, self.peer);
        match &self.detected.request {
            Request::Tls { sni, .. } => {
                let local = snap.routes.scoped().then(|| self.stream.local_addr().ok());
                let cp = match local.flatten() {
                    Some(at) => snap.routes.lookup_at(sni, at),
                    None => snap.routes.lookup(sni),
                };
                let Some(cp) = cp else {
                    tracing::debug!(listener = %lctx.spec.name, %peer, %client, %sni, "unknown SNI");
                    return Err(refuse(gw, lctx, client, Refusal::UnknownSni));
                };
                Ok(Route::to(cp, "tls-sni"))
            }
            // Served before routing; kept exhaustive.
            Request::Http2 => Err(refuse(gw, lctx, client, Refusal::Unrecognized)),
            Request::Legacy { destination } => {
                let Some(cp) = snap.routes.service(*destination) else {
                    tracing::debug!(listener = %lctx.spec.name, %peer, %client, %destination, "unknown service address");
                    return Err(refuse(gw, lctx, client, Refusal::UnknownService));
                };
                Ok(Route::to(cp, "proxy-protocol"))
            }
            Request::Cluster { id } => {
                let Some(cp) = snap.routes.cluster(id) else {
                    tracing::debug!(listener = %lctx.spec.name, %peer, %client,
                        cluster_id = %String::from_utf8_lossy(id), "unknown cluster ID");
                    return Err(refuse(gw, lctx, client, Refusal::UnknownClusterId));
                };
                Ok(Route::to(cp, "proxy-tlv"))
            }
            Request::Connect(head) => self.route_connect(head).await,
        }
    }

    /// A CONNECT's route: its destination header (checked; the request
    /// line is never used), answered like an unknown destination when it
    /// reaches into a shoot from a listener that is not a tunnel frontend.
    async fn route_connect(&self, head: &connect_head::Head) -> Result<Route<'s>, Ended> {
        let (gw, lctx, snap) = (self.gw, self.lctx, self.snap);
        let client = self.detected.client;
        let spec = &lctx.spec;
        let canonical = match check_connect(
            head,
            &spec.destination_header,
            spec.destination_regex.as_ref(),
        ) {
            Ok(c) => c,
            Err(bad) => {
                return Err(
                    Box::pin(reject_connect(gw, lctx, self.stream, client, head, bad)).await,
                )
            }
        };
        let Some(route) = snap.routes.destination(&canonical) else {
            return Err(self
                .unknown_destination(&canonical, Refusal::UnknownDestination)
                .await);
        };
        // A CONNECT reaches into a shoot only on a listener configured as a
        // tunnel frontend, and only to the destination's own target.
        // Decided before the ACL, with the answer of an unknown
        // destination, so a public listener tells nothing about tunnel
        // destinations.
        let local =
            matches!(route.endpoints.as_slice(), [only] if only.address.starts_with("local:"));
        if local && (!spec.tunnel_frontend || route.tunnel_target.is_none()) {
            return Err(self
                .unknown_destination(&canonical, Refusal::TunnelNotAllowed)
                .await);
        }
        Ok(Route {
            cp: route.control_plane.clone(),
            endpoints: route.endpoints.as_slice(),
            protocol: lctx.connect_protocol.as_str(),
            tunnel_target: route
                .tunnel_target
                .as_deref()
                .filter(|_| spec.tunnel_frontend),
        })
    }

    /// Answered like a destination that does not exist.
    async fn unknown_destination(&self, canonical: &str, refusal: Refusal) -> Ended {
        self.log_refused(refusal.reason(), None, Some(canonical), None);
        self.answer_unavailable().await;
        refuse(self.gw, self.lctx, self.detected.client, refusal)
    }

    /// The in-process service `name` a route hands connections to.
    async fn local_handler(
        &self,
        route: &Route<'s>,
        name: &str,
    ) -> Result<crate::state::LocalHandler, Ended> {
        match self.gw.local(name) {
            Some(handler) => Ok(handler),
            None => {
                tracing::warn!(listener = %self.lctx.spec.name, control_plane = %route.cp.name, local = name, "no in-process service of that name");
                let out = Outcome::UpstreamUnavailable;
                Err(self.unavailable(route.cp.clone(), out, None).await)
            }
        }
    }

    /// The control plane's and the client's slots among routed
    /// connections: one tenant's clients cannot take every connection of
    /// the gateway.
    async fn slots<'g>(
        &self,
        gw: &'g Gateway,
        route: &Route<'s>,
    ) -> Result<(crate::state::RoutedGuard<'g>, Option<SourceGuard<'g>>), Ended> {
        let snap = self.snap;
        let Some(cp_slot) = gw.enter_control_plane(snap, &route.cp.name) else {
            let out = Outcome::ControlPlaneLimit;
            return Err(self.unavailable(route.cp.clone(), out, None).await);
        };
        let Ok(source_slot) = gw.enter_routed_source(snap, self.detected.client.ip()) else {
            let out = Outcome::SourceLimit;
            return Err(self.unavailable(route.cp.clone(), out, None).await);
        };
        Ok((cp_slot, source_slot))
    }

    /// Connects to one of the route's endpoints.
    async fn connect(
        &self,
        route: &Route<'s>,
    ) -> Result<(TcpStream, upstream::ActiveGuard, String), Ended> {
        let snap = self.snap;
        match upstream::connect(
            &route.cp.name,
            route.endpoints,
            &snap.upstream,
            snap.timeouts.upstream_connect,
            crate::state::keepalive(snap),
            &self.gw.metrics,
        )
        .await
        {
            Ok(u) => Ok(u),
            Err(e) => {
                let (e, out) = (e.to_string(), Outcome::UpstreamUnavailable);
                Err(self.unavailable(route.cp.clone(), out, Some(&e)).await)
            }
        }
    }

    /// Connected upstream: a CONNECT hears 200 only now (what it
    /// pipelined after the head goes upstream right after).
    async fn answer(&self, cp: &Arc<ControlPlane>) -> Result<(), Ended> {
        let Request::Connect(head) = &self.detected.request else {
            return Ok(());
        };
        let ok = if head.minor_version == 0 {
            "HTTP/1.0 200 Connection established\r\n\r\n"
        } else {
            "HTTP/1.1 200 Connection established\r\n\r\n"
        };
        write_all(self.stream, ok.as_bytes())
            .await
            .map_err(|_| (Some(cp.clone()), Outcome::ClientError))
    }

    /// Sends the bytes read so far upstream; how many.
    async fn replay(
        &self,
        cp: &Arc<ControlPlane>,
        upstream: &TcpStream,
        endpoint: &str,
    ) -> Result<u64, Ended> {
        let replay = &self.detected.replay;
        if let Err(e) = write_all(upstream, replay).await {
            tracing::debug!(control_plane = %cp.name, error = %e, "upstream write failed");
            sockopt::arm_reset(self.stream);
            return Err((Some(cp.clone()), Outcome::UpstreamError));
        }
        let n = replay.len() as u64;
        self.lctx
            .metrics
            .cp(&self.gw.metrics, &cp.name)
            .to_upstream
            .inc_by(n);
        self.log_proxying(&cp.name, endpoint);
        Ok(n)
    }

    /// The debug line of a connection that starts its copy.
    fn log_proxying(&self, cp: &str, endpoint: &str) {
        let (listener, client, peer) = (&self.lctx.spec.name, self.detected.client, self.peer);
        match &self.detected.request {
            Request::Tls { sni, alpn } => tracing::debug!(%listener, %client, %peer, %sni,
                ?alpn, control_plane = cp, endpoint, "proxying"),
            Request::Connect(head) => tracing::debug!(%listener, %client, %peer,
                target = %head.target, control_plane = cp, endpoint, "tunnelling"),
            Request::Http2 => {}
            Request::Legacy { destination } => tracing::debug!(%listener, %client, %peer,
                %destination, control_plane = cp, endpoint, "proxying legacy"),
            Request::Cluster { id } => tracing::debug!(%listener, %client, %peer,
                cluster_id = %String::from_utf8_lossy(id), control_plane = cp, endpoint,
                "proxying by cluster ID"),
        }
    }
}

/// An in-process service takes the connection over: no upstream socket, no
/// copy loop here. A CONNECT carries its destination's configured target
/// (never the request line).
fn hand_over(
    gw: &Gateway,
    lctx: &ListenerCtx,
    route: Route<'_>,
    handler: crate::state::LocalHandler,
    stream: TcpStream,
    detected: Detected,
) -> Ended {
    let connect_target = match &detected.request {
        Request::Connect(_) => route.tunnel_target.map(str::to_string),
        _ => None,
    };
    let _routed = lctx
        .metrics
        .routed(&gw.metrics, &route.cp.name, route.protocol);
    handler(crate::state::Handoff {
        stream,
        replay: detected.replay,
        client: detected.client,
        control_plane: route.cp.name.clone(),
        connect_target,
    });
    (Some(route.cp), Outcome::HandedOver)
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

/// Reads until a PROXY header (when configured) and the first message have
/// arrived: a TLS ClientHello, a CONNECT head or the HTTP/2 preface, or the
/// node proxy's own PROXY header. The caller bounds it with the absolute
/// deadline.
async fn detect<'g>(
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
struct Reader<'s> {
    stream: &'s TcpStream,
    /// Empty until bytes arrive (see `read_more`).
    buf: Vec<u8>,
}

impl Reader<'_> {
    /// Reads until `parse` decides on what is buffered (never more than
    /// `cap` plus one read): what it parsed, or why it refused.
    async fn until<T, R>(
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
    fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
    }
}

/// The load balancer's PROXY header, when the listener expects one and
/// the peer may send it: the client it names (capped per source from now
/// on), or the peer. On a legacy `proxy` listener a header from a peer that
/// is not a trusted LB is the node proxy's own (the inner one), read later.
async fn outer_proxy_header<'g>(
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
async fn lb_health_check(r: &mut Reader<'_>, snap: &Snapshot) -> Result<(), Refusal> {
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
async fn inner_proxy_header(
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

/// An `http-connect` listener's request: HTTP/2 with prior knowledge (the
/// preface and all after it is the replay), or a CONNECT head (what
/// followed it is the replay; a broken head is answered 400 and nothing
/// after it is read).
async fn connect_or_http2(r: &mut Reader<'_>) -> Result<Request, Refusal> {
    let preface = |b: &[u8]| {
        let n = b.len().min(H2_PREFACE.len());
        match (b[..n] == H2_PREFACE[..n], n == H2_PREFACE.len()) {
            (false, _) => Parse::Invalid(()),
            (true, true) => Parse::Done(()),
            (true, false) => Parse::Incomplete,
        }
    };
    if r.until(H2_PREFACE.len(), preface).await?.is_ok() {
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
async fn client_hello(
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
fn host_of(authority: &str) -> Option<&str> {
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
        eprintln!("conn::serve's future: {serve} bytes");
        assert!(
            serve <= 1536,
            "conn::serve's future is {serve} bytes (limit 1536): box what is only alive during setup or a refusal"
        );
    }
}
