//! From what was detected to an upstream: the control plane the SNI or
//! destination names, its ACL and limits, and the hand-over to another
//! listener's socket.

use std::net::SocketAddr;
use std::sync::Arc;

use seedlink_config::routes::{ControlPlane, Endpoint};
use seedlink_config::Snapshot;
use seedlink_net::copy::write_all;
use seedlink_net::sockopt;
use seedlink_proto::connect_head;
use tokio::net::TcpStream;

use super::connect::*;
use super::detect::*;
use super::outcome::*;
use crate::state::{Gateway, ListenerCtx, SourceGuard};
use crate::upstream;

/// Where a detected connection goes.
pub(super) struct Route<'s> {
    pub(super) cp: Arc<ControlPlane>,
    pub(super) endpoints: &'s [Endpoint],
    /// The `protocol` label of the routed counters.
    pub(super) protocol: &'s str,
    /// For a CONNECT on a tunnel frontend, what an in-process tunnel-server
    /// may dial: the destination's configured target, never the request
    /// line.
    pub(super) tunnel_target: Option<&'s str>,
}

impl<'s> Route<'s> {
    /// Every endpoint of `cp`.
    pub(super) fn to(cp: &'s Arc<ControlPlane>, protocol: &'s str) -> Route<'s> {
        Route {
            cp: cp.clone(),
            endpoints: cp.endpoints.as_slice(),
            protocol,
            tunnel_target: None,
        }
    }

    /// The in-process service's name when the only endpoint is
    /// `local:<name>`.
    pub(super) fn local(&self) -> Option<&'s str> {
        match self.endpoints {
            [only] => only.address.strip_prefix("local:"),
            _ => None,
        }
    }
}

/// A detected connection, and what every step after detection reads
/// (`'s`: the gateway and its snapshot, which routes borrow from; `'a`: the
/// connection).
pub(super) struct At<'a, 's> {
    pub(super) gw: &'s Arc<Gateway>,
    pub(super) lctx: &'s Arc<ListenerCtx>,
    pub(super) snap: &'s Arc<Snapshot>,
    pub(super) stream: &'a TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) detected: &'a Detected,
}

impl<'s> At<'_, 's> {
    /// The one refusal line after detection (rate-limited; the excess is
    /// counted).
    pub(super) fn log_refused(
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
    pub(super) async fn answer_unavailable(&self) {
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
    pub(super) async fn unavailable(
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
    pub(super) async fn route(&self) -> Result<Route<'s>, Ended> {
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
    pub(super) async fn route_connect(
        &self,
        head: &connect_head::Head,
    ) -> Result<Route<'s>, Ended> {
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
    pub(super) async fn unknown_destination(&self, canonical: &str, refusal: Refusal) -> Ended {
        self.log_refused(refusal.reason(), None, Some(canonical), None);
        self.answer_unavailable().await;
        refuse(self.gw, self.lctx, self.detected.client, refusal)
    }

    /// The in-process service `name` a route hands connections to.
    pub(super) async fn local_handler(
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
    pub(super) async fn slots<'g>(
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
    pub(super) async fn connect(
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
    pub(super) async fn answer(&self, cp: &Arc<ControlPlane>) -> Result<(), Ended> {
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
    pub(super) async fn replay(
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
    pub(super) fn log_proxying(&self, cp: &str, endpoint: &str) {
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
pub(super) fn hand_over(
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
