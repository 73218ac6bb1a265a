//! A route's backends: the Service each names, its port, the
//! EndpointSlices behind it, and which endpoints seedlink refuses to dial
//! ([`unroutable`]).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

use crate::crd::SeedlinkPolicySpec;

use super::attach;
use super::objects::*;
use super::outcome::*;

/// The ready endpoints of a route's backends, the `ResolvedRefs` verdict,
/// and whether weights other than 0/1 were seen.
pub(super) fn backends(
    route: &TlsRoute,
    key: &Key,
    lookup: &Lookup<'_>,
) -> (Vec<String>, Verdict, bool) {
    let mut endpoints = Vec::new();
    let mut seen = HashSet::new();
    let mut problems = Vec::new();
    let mut reason = "ResolvedRefs";
    let mut weighted = false;
    for b in route.spec.rules.iter().flat_map(|r| &r.backend_refs) {
        if b.weight == Some(0) {
            continue;
        }
        weighted |= b.weight.is_some_and(|w| w != 1);
        let (skey, svc, port_name) = match resolve_backend(b, key, lookup) {
            Ok(found) => found,
            Err((why, problem)) => {
                reason = why;
                problems.push(problem);
                continue;
            }
        };
        // Ready endpoints take new connections; when a Service has none,
        // those still serving while they terminate do (kube-proxy's
        // ProxyTerminatingEndpoints, Envoy Gateway's and Istio's fallback),
        // so a rollout of its last pod does not refuse connections.
        let (ready, draining) = service_endpoints(&skey, svc, &port_name, lookup.slices);
        let chosen = if ready.is_empty() { draining } else { ready };
        for addr in chosen {
            if seen.insert(addr.clone()) {
                endpoints.push(addr);
            }
        }
    }
    endpoints.sort();
    let verdict = if problems.is_empty() {
        Verdict::yes("ResolvedRefs", "every backend resolved")
    } else {
        Verdict::no(reason, problems.join("; "))
    };
    (endpoints, verdict, weighted)
}

/// A backendRef's Service and its port's name, or the `ResolvedRefs`
/// reason and problem that refuse it.
pub(super) fn resolve_backend<'a>(
    b: &gateway_api::tlsroutes::TlsRouteRulesBackendRefs,
    key: &Key,
    lookup: &Lookup<'a>,
) -> Result<(Key, &'a Service, String), (&'static str, String)> {
    if !b.group.as_deref().unwrap_or("").is_empty()
        || b.kind.as_deref().unwrap_or("Service") != "Service"
    {
        return Err((
            "InvalidKind",
            format!("backend {}: only core Services are supported", b.name),
        ));
    }
    let namespace = b.namespace.as_deref().unwrap_or(&key.namespace);
    if namespace != key.namespace
        && !attach::granted(lookup.grants, &key.namespace, namespace, &b.name)
    {
        return Err(("RefNotPermitted", format!(
            "backend {namespace}/{}: no ReferenceGrant in {namespace} lets TLSRoutes from {} use it",
            b.name, key.namespace
        )));
    }
    let skey = Key {
        namespace: namespace.to_string(),
        name: b.name.clone(),
    };
    let Some(port) = b.port else {
        return Err((
            "UnsupportedValue",
            format!("backend {}: a port is required", b.name),
        ));
    };
    let Some(svc) = lookup.services.get(&skey).copied() else {
        return Err(("BackendNotFound", format!("Service {skey} not found")));
    };
    let port_name = port_name(&skey, svc, port)?;
    Ok((skey, svc, port_name))
}

/// The name of a Service's port `port` (empty if unnamed).
pub(super) fn port_name(
    skey: &Key,
    svc: &Service,
    port: i32,
) -> Result<String, (&'static str, String)> {
    let Some(sport) = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .and_then(|ps| ps.iter().find(|p| p.port == port))
    else {
        return Err((
            "BackendNotFound",
            format!("Service {skey} has no port {port}"),
        ));
    };
    Ok(sport.name.clone().unwrap_or_default())
}

/// A Service's endpoints for the port named `port_name`: those ready, and
/// those serving while they terminate.
pub(super) fn service_endpoints(
    skey: &Key,
    svc: &Service,
    port_name: &str,
    slices: &HashMap<Key, Vec<&EndpointSlice>>,
) -> (Vec<String>, Vec<String>) {
    // Kubernetes' controller writes slices only for a Service with a
    // selector (and deletes any other slice bearing its name there); a
    // slice claiming to be its for a Service without one was written by
    // someone else.
    let selected = svc
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .is_some_and(|s| !s.is_empty());
    let (mut ready, mut draining) = (Vec::new(), Vec::new());
    for slice in slices.get(skey).into_iter().flatten() {
        let by_controller = slice.labels().get(MANAGED_BY).map(String::as_str)
            == Some(seedlink_config::model::ENDPOINTSLICE_CONTROLLER);
        if by_controller && !selected {
            tracing::debug!(service = %skey, slice = %Key::of(*slice), "EndpointSlice ignored: it names Kubernetes' controller, which writes none for a Service without a selector");
            continue;
        }
        let Some(target) = slice_port(slice, port_name) else {
            continue;
        };
        for ep in &slice.endpoints {
            match endpoint(skey, ep, target) {
                Some((addr, true)) => ready.push(addr),
                Some((addr, false)) => draining.push(addr),
                None => {}
            }
        }
    }
    (ready, draining)
}

/// The target port of an IP slice for the Service port `port_name`.
pub(super) fn slice_port(slice: &EndpointSlice, port_name: &str) -> Option<u16> {
    if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
        return None;
    }
    slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref().unwrap_or_default() == port_name)
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
}

/// An endpoint's address and whether it is ready (else it is serving
/// while it terminates); `None` when it takes no connections or its
/// address is refused.
pub(super) fn endpoint(
    skey: &Key,
    ep: &k8s_openapi::api::discovery::v1::Endpoint,
    target: u16,
) -> Option<(String, bool)> {
    // An unknown readiness counts as ready (the API's advice); `serving`
    // unknown is `ready`'s value.
    let c = ep.conditions.as_ref();
    let is_ready = c.and_then(|c| c.ready) != Some(false);
    let serving = c.and_then(|c| c.serving).unwrap_or(is_ready);
    let terminating = c.and_then(|c| c.terminating) == Some(true);
    if !(is_ready || (serving && terminating)) {
        return None;
    }
    let ip = ep.addresses.first()?.parse::<IpAddr>().ok()?;
    if let Some(why) = unroutable(ip) {
        // The CVE-2021-25740 class: whoever may write an EndpointSlice
        // must not point the gateway at itself.
        tracing::warn!(service = %skey, address = %ip, why, "EndpointSlice address refused as an upstream");
        return None;
    }
    Some((SocketAddr::new(ip, target).to_string(), is_ready))
}

/// A policy's verdict on one of its targets; the first policy (oldest)
/// to target an attached route becomes its policy in `taken` (keyed
/// `namespace/name`). `spec` is the policy's own problem, if any, and the
/// spec in force (the last good one when it has a problem).
pub(super) fn target_verdict(
    t: &crate::crd::LocalPolicyTargetRef,
    route: &Key,
    attached: &HashSet<Key>,
    taken: &mut HashMap<String, Result<SeedlinkPolicySpec, String>>,
    spec: (&Option<String>, &Result<SeedlinkPolicySpec, String>),
) -> Verdict {
    let (invalid, effective) = spec;
    if t.group != GATEWAY_GROUP || t.kind != "TLSRoute" {
        return Verdict::no(
            "Invalid",
            format!(
                "targets {}/{}: only {GATEWAY_GROUP}/TLSRoute is supported",
                t.group, t.kind
            ),
        );
    }
    if !attached.contains(route) {
        return Verdict::no(
            "TargetNotFound",
            format!("no TLSRoute {route} attached to the seedlink Gateway"),
        );
    }
    let std::collections::hash_map::Entry::Vacant(slot) = taken.entry(route.to_string()) else {
        return Verdict::no(
            "Conflicted",
            "an older SeedlinkPolicy targets the same route",
        );
    };
    slot.insert(effective.clone());
    match (invalid, effective) {
        (None, _) => Verdict::yes("Accepted", "applied"),
        (Some(why), Ok(_)) => Verdict::no(
            "Invalid",
            format!("{why}; the previously accepted version stays in force"),
        ),
        (Some(why), Err(_)) => Verdict::no("Invalid", format!("{why}; the route is not served")),
    }
}

/// What backends are looked up in.
pub(super) struct Lookup<'a> {
    pub(super) services: &'a HashMap<Key, &'a Service>,
    pub(super) slices: &'a HashMap<Key, Vec<&'a EndpointSlice>>,
    pub(super) grants: &'a [&'a ReferenceGrant],
}

/// Why `ip` can never be a backend pod's address: the gateway's own host
/// (loopback, unspecified), link-local (cloud metadata), multicast or
/// broadcast, in either family or as a v4-mapped IPv6 address.
pub fn unroutable(ip: IpAddr) -> Option<&'static str> {
    let ip = ip.to_canonical();
    match ip {
        _ if ip.is_loopback() => Some("loopback"),
        _ if ip.is_unspecified() => Some("unspecified"),
        _ if ip.is_multicast() => Some("multicast"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local"),
        IpAddr::V4(v4) if v4.is_broadcast() || v4.octets()[0] == 0 => Some("not a host"),
        // Cloud metadata outside link-local (Alibaba, AWS over IPv6), as the
        // agent's default deny list has them.
        IpAddr::V4(v4) if v4.octets() == [100, 100, 100, 200] => Some("cloud metadata"),
        IpAddr::V6(v6) if v6.segments() == [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254] => {
            Some("cloud metadata")
        }
        IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80 => Some("link-local"),
        _ => None,
    }
}
