//! The Kubernetes and GatewayClass sections: what the Kubernetes source may
//! write, and the addresses a GatewayClass's Gateways are served at.

use std::collections::HashSet;

use super::checks::*;
use super::errors::*;
use super::listeners::*;

/// The objects the source names are `namespace/name`.
fn check_object_names(c: &mut Collector, k: &crate::model::KubernetesSource) {
    for (key, v) in [
        ("kubernetes.gateway", k.gateway.as_ref()),
        ("kubernetes.lease", k.lease.as_ref()),
        ("kubernetes.service", k.service.as_ref()),
    ] {
        if let Some(v) = v.filter(|v| split_object_name(v).is_none()) {
            c.err(key, format!("{v:?} is not namespace/name"));
        }
    }
}

/// The `kubernetes` section: object names, and a class's addresses (each
/// one a TLS listener receives at, none twice, at most 256).
pub(super) fn check_kubernetes(
    c: &mut Collector,
    k: &crate::model::KubernetesSource,
    listeners: &[ListenerSpec],
) {
    check_object_names(c, k);
    if k.gateway.is_none() && k.gateway_class.is_none() {
        c.err(
            "kubernetes",
            "names no Gateway: set gateway (one Gateway, on every listener), gateway_class (every Gateway of a class, each at its own address), or both",
        );
    }
    if k.gateway.is_none() && k.lease.is_none() && k.write_status {
        c.err(
            "kubernetes.lease",
            "is required without kubernetes.gateway (its default is in the Gateway's namespace)",
        );
    }
    if let Some(class) = &k.gateway_class {
        check_gateway_class(c, class, listeners);
    }
}

/// A class's name, and its addresses: specific, distinct, each where a TLS
/// listener receives connections.
pub(super) fn check_gateway_class(
    c: &mut Collector,
    class: &crate::model::GatewayClassSource,
    listeners: &[ListenerSpec],
) {
    if class.name.is_empty() || !valid_hostname(&class.name) || class.name.len() > 253 {
        c.err(
            "kubernetes.gateway_class.name",
            format!("{:?} is not a GatewayClass name", class.name),
        );
    }
    if class.addresses.is_empty() || class.addresses.len() > 256 {
        c.err(
            "kubernetes.gateway_class.addresses",
            "needs 1 to 256 addresses (one per Gateway of the class)",
        );
    }
    let mut seen = HashSet::new();
    for (i, a) in class.addresses.iter().enumerate() {
        let path = format!("kubernetes.gateway_class.addresses[{i}]");
        let Ok(ip) = a.parse::<std::net::IpAddr>() else {
            c.err(path, format!("{a:?} is not an IP address"));
            continue;
        };
        let ip = crate::routes::canonical(ip);
        if ip.is_unspecified() || ip.is_multicast() {
            c.err(path, format!("{a:?} is not a specific address"));
        } else if !seen.insert(ip) {
            c.err(path, format!("{a:?} is listed twice"));
        } else if !tls_received_at(listeners, ip) {
            c.err(
                path,
                format!("{a:?}: no tls or auto listener receives connections there"),
            );
        }
    }
}
