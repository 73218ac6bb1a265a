//! What a translation reads: the watched objects by kind, and the
//! settings of the GatewayClass seedlink serves.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::crd::SeedlinkPolicy;

use super::outcome::*;

/// The Gateways of a class seedlink serves, each at its own address
/// (`kubernetes.gateway_class`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClassSettings {
    /// The GatewayClass (its `controllerName` must be seedlink's).
    pub name: String,
    /// The addresses Gateways are given, in order; each is one the
    /// gateway receives connections at.
    pub addresses: Vec<IpAddr>,
    /// The addresses the gateway's TLS listeners are bound to (which ports
    /// it receives where).
    pub receivers: Vec<SocketAddr>,
}

/// What the translation reads.
pub struct Objects<'a> {
    /// The named Gateway (`kubernetes.gateway`), `namespace/name`: served
    /// on every listener of the file.
    pub gateway: Option<&'a Key>,
    /// The Gateways of a class, each at its own address.
    pub class: Option<&'a ClassSettings>,
    /// Every Gateway watched (the class's are picked from them).
    pub gateways: &'a [Arc<Gateway>],
    /// Every GatewayClass (a class is served when its controllerName is
    /// seedlink's).
    pub classes: &'a [Arc<GatewayClass>],
    /// Names of the gateway file's listeners: the listeners routes attach
    /// to when there is no Gateway object (each admitting routes from the
    /// Gateway's own namespace only, Gateway API's default).
    pub listeners: &'a [String],
    /// Every Namespace (for `allowedRoutes.namespaces.selector`).
    pub namespaces: &'a [Arc<Namespace>],
    /// Every ReferenceGrant (for backends in another namespace).
    pub grants: &'a [Arc<ReferenceGrant>],
    /// Every TLSRoute.
    pub routes: &'a [Arc<TlsRoute>],
    /// Every SeedlinkPolicy.
    pub policies: &'a [Arc<SeedlinkPolicy>],
    /// Every Service.
    pub services: &'a [Arc<Service>],
    /// Every EndpointSlice.
    pub slices: &'a [Arc<EndpointSlice>],
}

/// The label naming who wrote an EndpointSlice.
pub const MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";

pub(super) fn age<K: kube::Resource>(o: &K) -> (Option<k8s_openapi::jiff::Timestamp>, Key) {
    (
        o.meta().creation_timestamp.as_ref().map(|t| t.0),
        Key::of(o),
    )
}
