//! How a connection ends: refused before it was proxied ([`Refusal`], with
//! its metric label), or proxied and copied ([`Outcome`]).

use std::net::SocketAddr;
use std::sync::Arc;

use seedlink_config::routes::ControlPlane;
use seedlink_proto::{client_hello, connect_head, proxy_header};

use crate::state::{Gateway, ListenerCtx};

/// Why a connection ended before being proxied; `reason()` is the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
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
    pub(super) fn reason(&self) -> &'static str {
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
pub(super) enum Outcome {
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
pub(super) enum Copied {
    Ok,
    Reset,
    Error,
    /// Its control plane was removed and the grace period ended.
    ClosedRemoved,
    /// The drain deadline passed.
    ClosedDrain,
}

impl Outcome {
    pub(super) fn reason(&self) -> &'static str {
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
pub(super) type Ended = (Option<Arc<ControlPlane>>, Outcome);

/// Why a well-formed request head cannot be tunnelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BadConnect {
    NotConnect,
    FramingHeader,
    BadTarget,
    MissingDestination,
    DuplicateDestination,
    MalformedDestination,
}

impl BadConnect {
    pub(super) fn reason(&self) -> &'static str {
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

pub(super) fn refuse(gw: &Gateway, lctx: &ListenerCtx, who: SocketAddr, r: Refusal) -> Ended {
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
