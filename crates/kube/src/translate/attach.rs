//! Who may attach a route to a Gateway seedlink serves, under which host
//! names, and whose backends a route may use: the Gateway listeners'
//! `allowedRoutes`, `hostname` and `port`, and ReferenceGrants, as Gateway
//! API defines them. All of it is the cluster operator's word, never the
//! tenant's: a route in a namespace the listener does not admit is not
//! served, a route serves only the names its listener's hostname allows,
//! and a route reaches a Service in another namespace only when that
//! namespace's owner granted it.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use gateway_api::gateways::{
    Gateway, GatewayListeners, GatewayListenersAllowedRoutes,
    GatewayListenersAllowedRoutesNamespacesFrom as From,
    GatewayListenersAllowedRoutesNamespacesSelector as Selector,
};
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRouteParentRefs;
use kube::ResourceExt;

use super::outcome::{ListenerOutcome, Verdict, GATEWAY_GROUP};

/// One listener routes attach to.
pub(super) struct Listener<'a> {
    pub(super) name: &'a str,
    /// `None`: a listener from the gateway file (no Gateway object):
    /// Gateway API's default, routes from the Gateway's own namespace.
    allowed: Option<&'a GatewayListenersAllowedRoutes>,
    /// `None` for the file's listeners (they are all TLS).
    protocol: Option<&'a str>,
    /// TLS passthrough (the file's listeners always are; a Gateway
    /// listener's `tls.mode` defaults to Terminate).
    passthrough: bool,
    /// The Gateway listener's port (`None` for the file's).
    pub(super) port: Option<i32>,
    /// The Gateway listener's `hostname` (`None`: any).
    hostname: Option<&'a str>,
    /// Why seedlink does not serve it, if it does not (its `Accepted`
    /// condition is false): no route attaches to it.
    refused: Option<String>,
}

/// A route attached through one listener, and the names it serves there.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Attached {
    pub(super) listener: String,
    pub(super) port: Option<i32>,
    pub(super) hostnames: Vec<String>,
}

/// The listeners of the file (no Gateway object): TLS passthrough, routes
/// from the Gateway's own namespace.
pub(super) fn file_listeners(file: &[String]) -> Vec<Listener<'_>> {
    file.iter()
        .map(|n| Listener {
            name: n,
            allowed: None,
            protocol: None,
            passthrough: true,
            port: None,
            hostname: None,
            refused: None,
        })
        .collect()
}

/// The listeners of a Gateway object, with what seedlink reports for each.
/// `received`: for a Gateway served at its own address, whether a listener
/// of the gateway receives connections on a port there (`None`: the
/// Gateway is served on every listener of the file, whose ports the
/// Service in front maps).
pub(super) fn gateway_listeners<'a>(
    g: &'a Gateway,
    received: Option<&dyn Fn(i32) -> bool>,
) -> (Vec<Listener<'a>>, Vec<ListenerOutcome>) {
    let mut listeners = Vec::new();
    let mut outcomes = Vec::new();
    for l in &g.spec.listeners {
        let passthrough = is_passthrough(l);
        let accepted = listener_accepted(l, passthrough, received);
        let (kinds, resolved) = kinds(l);
        listeners.push(Listener {
            name: &l.name,
            allowed: l.allowed_routes.as_ref(),
            protocol: Some(&l.protocol),
            passthrough,
            port: Some(l.port),
            hostname: l.hostname.as_deref(),
            refused: (!accepted.ok).then(|| accepted.message.clone()),
        });
        outcomes.push(ListenerOutcome {
            name: l.name.clone(),
            kinds: if accepted.ok { kinds } else { Vec::new() },
            accepted,
            resolved,
        });
    }
    (listeners, outcomes)
}

/// A Gateway listener's `Accepted`: TLS passthrough on a port the gateway
/// receives.
fn listener_accepted(
    l: &GatewayListeners,
    passthrough: bool,
    received: Option<&dyn Fn(i32) -> bool>,
) -> Verdict {
    if l.protocol != "TLS" {
        Verdict::no(
            "UnsupportedProtocol",
            format!("seedlink serves TLS passthrough only, not {}", l.protocol),
        )
    } else if !passthrough {
        Verdict::no(
            "UnsupportedValue",
            "seedlink serves tls.mode Passthrough only (it never terminates TLS)",
        )
    } else if received.is_some_and(|r| !r(l.port)) {
        Verdict::no(
            "PortUnavailable",
            format!(
                "no TLS listener of the seedlink gateway receives connections on port {} at this Gateway's address",
                l.port
            ),
        )
    } else {
        Verdict::yes("Accepted", "served by seedlink (TLS passthrough)")
    }
}

/// The route kinds a listener takes (`supportedKinds`) and its
/// `ResolvedRefs`: false (`InvalidRouteKinds`) when `allowedRoutes.kinds`
/// names a kind seedlink does not serve.
fn kinds(l: &GatewayListeners) -> (Vec<String>, Verdict) {
    let asked = l
        .allowed_routes
        .as_ref()
        .and_then(|a| a.kinds.as_ref())
        .filter(|k| !k.is_empty());
    let Some(asked) = asked else {
        return (
            vec!["TLSRoute".into()],
            Verdict::yes("ResolvedRefs", "TLSRoute"),
        );
    };
    let tls = |k: &&gateway_api::gateways::GatewayListenersAllowedRoutesKinds| {
        k.kind == "TLSRoute" && k.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
    };
    let served: Vec<String> = asked
        .iter()
        .filter(tls)
        .take(1)
        .map(|_| "TLSRoute".to_string())
        .collect();
    let other: Vec<String> = asked
        .iter()
        .filter(|k| !tls(k))
        .map(|k| format!("{}/{}", k.group.as_deref().unwrap_or(GATEWAY_GROUP), k.kind))
        .collect();
    let resolved = if other.is_empty() {
        Verdict::yes("ResolvedRefs", "TLSRoute")
    } else {
        Verdict::no(
            "InvalidRouteKinds",
            format!("seedlink serves TLSRoute only, not {}", other.join(", ")),
        )
    };
    (served, resolved)
}

/// Whether a Gateway listener's port is received at `address` by one of
/// the gateway's TLS listeners (`receivers`, their bound addresses).
pub(super) fn receives(receivers: &[SocketAddr], address: IpAddr, port: i32) -> bool {
    receivers.iter().any(|r| {
        i32::from(r.port()) == port
            && (r.ip().is_unspecified() || seedlink_config::routes::canonical(r.ip()) == address)
    })
}

/// Where a route attaches through one parentRef: the listeners it names
/// (`sectionName`, `port`) that admit it (protocol, kind, namespace) and
/// whose hostname intersects the route's, with the names served through
/// each. The refusal otherwise: `NoMatchingParent`,
/// `NotAllowedByListeners`, `NoMatchingListenerHostname`.
pub(super) fn attach(
    p: &TlsRouteParentRefs,
    route_ns: &str,
    route_hosts: &[String],
    gateway_ns: &str,
    listeners: &[Listener<'_>],
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Result<Vec<Attached>, Verdict> {
    let candidates: Vec<&Listener<'_>> = listeners
        .iter()
        .filter(|l| p.section_name.as_deref().is_none_or(|s| s == l.name))
        .filter(|l| p.port.is_none() || l.port.is_none() || p.port == l.port)
        .collect();
    if candidates.is_empty() {
        return Err(no_matching_parent(p, listeners));
    }
    let mut why = Vec::new();
    let mut admitted = Vec::new();
    for l in &candidates {
        match admits(l, route_ns, gateway_ns, namespaces) {
            Ok(()) => admitted.push(*l),
            Err(w) => why.push(format!("listener {}: {w}", l.name)),
        }
    }
    if admitted.is_empty() {
        return Err(Verdict::no("NotAllowedByListeners", why.join("; ")));
    }
    by_hostname(route_hosts, &admitted, &candidates)
}

/// `NoMatchingParent`: what the parentRef asked for, and what there is.
fn no_matching_parent(p: &TlsRouteParentRefs, listeners: &[Listener<'_>]) -> Verdict {
    let names: Vec<&str> = listeners.iter().map(|l| l.name).collect();
    let mut wanted = Vec::new();
    if let Some(s) = &p.section_name {
        wanted.push(format!("named {s:?}"));
    }
    if let Some(port) = p.port {
        wanted.push(format!("on port {port}"));
    }
    Verdict::no(
        "NoMatchingParent",
        format!(
            "the gateway has no listener {} (it has {})",
            wanted.join(" "),
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        ),
    )
}

/// The listeners among `admitted` whose hostname intersects the route's,
/// with the names served through each; the refusal otherwise.
fn by_hostname(
    route_hosts: &[String],
    admitted: &[&Listener<'_>],
    candidates: &[&Listener<'_>],
) -> Result<Vec<Attached>, Verdict> {
    let mut out = Vec::new();
    let mut catch_all = false;
    for l in admitted {
        if route_hosts.is_empty() && l.hostname.is_none() {
            catch_all = true;
            continue;
        }
        let hostnames = intersect(route_hosts, l.hostname);
        if !hostnames.is_empty() {
            out.push(Attached {
                listener: l.name.to_string(),
                port: l.port,
                hostnames,
            });
        }
    }
    if out.is_empty() && catch_all {
        return Err(Verdict::no(
            "UnsupportedValue",
            "a TLSRoute without hostnames on a listener without a hostname would take every name; seedlink needs one of them to name the hosts",
        ));
    }
    if out.is_empty() {
        let hosts: Vec<&str> = candidates.iter().filter_map(|l| l.hostname).collect();
        return Err(Verdict::no(
            "NoMatchingListenerHostname",
            format!(
                "no host name of the route ({}) is within a listener's hostname ({})",
                route_hosts.join(", "),
                hosts.join(", ")
            ),
        ));
    }
    Ok(out)
}

/// The names a route serves through a listener, as Gateway API intersects
/// them: a route name within the listener's hostname stays; a listener
/// hostname within a route's wildcard is served as the listener names it;
/// a route without names takes the listener's. Lower-case, no duplicates.
pub(super) fn intersect(route: &[String], listener: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |h: &str| {
        let h = h.to_ascii_lowercase();
        if !out.contains(&h) {
            out.push(h);
        }
    };
    match listener {
        None => route.iter().for_each(|r| push(r)),
        Some(l) if route.is_empty() => push(l),
        Some(l) => {
            for r in route {
                if within(r, l) {
                    push(r);
                } else if within(l, r) {
                    push(l);
                }
            }
        }
    }
    out
}

/// Whether every name `x` (a name or a `*.` wildcard) stands for is one
/// `pattern` stands for: `*.example.com` holds `a.example.com`,
/// `a.b.example.com` and `*.a.example.com`, not `example.com`.
fn within(x: &str, pattern: &str) -> bool {
    let (x, pattern) = (x.to_ascii_lowercase(), pattern.to_ascii_lowercase());
    if x == pattern {
        return true;
    }
    let Some(suffix) = pattern.strip_prefix("*.") else {
        return false;
    };
    let names = x.strip_prefix("*.").unwrap_or(&x);
    names
        .strip_suffix(suffix)
        .is_some_and(|head| head.ends_with('.') && head.len() > 1)
}

fn is_passthrough(l: &GatewayListeners) -> bool {
    matches!(
        l.tls.as_ref().and_then(|t| t.mode.as_ref()),
        Some(gateway_api::gateways::GatewayListenersTlsMode::Passthrough)
    )
}

fn admits(
    l: &Listener<'_>,
    route_ns: &str,
    gateway_ns: &str,
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Result<(), String> {
    if let Some(p) = l.protocol.filter(|p| *p != "TLS") {
        return Err(format!("protocol {p} takes no TLSRoute"));
    }
    if !l.passthrough {
        return Err("seedlink serves tls.mode Passthrough only".into());
    }
    if let Some(why) = &l.refused {
        return Err(why.clone());
    }
    let kinds = l.allowed.and_then(|a| a.kinds.as_ref());
    if let Some(kinds) = kinds.filter(|k| !k.is_empty()) {
        let tls = kinds.iter().any(|k| {
            k.kind == "TLSRoute" && k.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
        });
        if !tls {
            return Err("its allowedRoutes.kinds has no TLSRoute".into());
        }
    }
    admits_namespace(l, route_ns, gateway_ns, namespaces)
}

/// Whether the listener's `allowedRoutes.namespaces` admits `route_ns`.
fn admits_namespace(
    l: &Listener<'_>,
    route_ns: &str,
    gateway_ns: &str,
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Result<(), String> {
    let ns = l.allowed.and_then(|a| a.namespaces.as_ref());
    match ns.and_then(|n| n.from.as_ref()).unwrap_or(&From::Same) {
        From::All => Ok(()),
        From::Same if route_ns == gateway_ns => Ok(()),
        From::Same => Err(format!(
            "routes only from namespace {gateway_ns} (allowedRoutes.namespaces.from: Same{})",
            if l.allowed.is_none() {
                ", the default without a Gateway object"
            } else {
                ""
            }
        )),
        From::Selector => by_selector(ns.and_then(|n| n.selector.as_ref()), route_ns, namespaces),
    }
}

/// `from: Selector`: the route's namespace must carry the selected labels.
fn by_selector(
    sel: Option<&Selector>,
    route_ns: &str,
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Result<(), String> {
    let Some(sel) = sel else {
        return Err("from: Selector without a selector admits no namespace".into());
    };
    let empty = BTreeMap::new();
    let labels = namespaces.get(route_ns).copied().unwrap_or(&empty);
    if selects(sel, labels) {
        Ok(())
    } else {
        Err(format!(
            "namespace {route_ns} does not match allowedRoutes.namespaces.selector"
        ))
    }
}

/// A label selector, as Kubernetes evaluates it; what Kubernetes would
/// refuse as invalid (an unknown operator, `In`/`NotIn` without values,
/// `Exists`/`DoesNotExist` with values) selects nothing (fail closed).
fn selects(sel: &Selector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = sel
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expressions = sel.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        let has = labels.get(&e.key);
        match e.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => false,
            "Exists" | "DoesNotExist" if !values.is_empty() => false,
            "In" => has.is_some_and(|v| values.contains(v)),
            "NotIn" => has.is_none_or(|v| !values.contains(v)),
            "Exists" => has.is_some(),
            "DoesNotExist" => has.is_none(),
            _ => false,
        }
    });
    by_labels && by_expressions
}

/// Whether a ReferenceGrant in `to_ns` lets TLSRoutes in `from_ns` use the
/// Service `service`.
pub(super) fn granted(
    grants: &[&ReferenceGrant],
    from_ns: &str,
    to_ns: &str,
    service: &str,
) -> bool {
    grants
        .iter()
        .filter(|g| g.namespace().as_deref() == Some(to_ns))
        .any(|g| {
            g.spec
                .from
                .iter()
                .any(|f| f.group == GATEWAY_GROUP && f.kind == "TLSRoute" && f.namespace == from_ns)
                && g.spec.to.iter().any(|t| {
                    t.group.is_empty()
                        && t.kind == "Service"
                        && t.name.as_deref().is_none_or(|n| n == service)
                })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(x: &[&str]) -> Vec<String> {
        x.iter().map(|s| s.to_string()).collect()
    }

    /// The hostname intersections the Gateway API spec and its
    /// conformance test (TLSRouteHostnameIntersection) define.
    #[test]
    fn hostnames_intersect_as_gateway_api_defines() {
        let cases: &[(&[&str], Option<&str>, &[&str])] = &[
            (
                &["abc.example.com"],
                Some("abc.example.com"),
                &["abc.example.com"],
            ),
            (
                &["*.example.com"],
                Some("abc.example.com"),
                &["abc.example.com"],
            ),
            (
                &["abc.example.com", "*.example.com"],
                Some("*.example.com"),
                &["abc.example.com", "*.example.com"],
            ),
            (
                &["abc.example.com", "*.example.com"],
                Some("*.com"),
                &["abc.example.com", "*.example.com"],
            ),
            (&["*.com"], Some("*.example.com"), &["*.example.com"]),
            (
                &["a.b.example.com"],
                Some("*.example.com"),
                &["a.b.example.com"],
            ),
            (&["example.com"], Some("*.example.com"), &[]),
            (&["non.matching.com"], Some("www.example.com"), &[]),
            (&["*.example.net"], Some("*.example.com"), &[]),
            (&["xexample.com"], Some("*.example.com"), &[]),
            (&[], Some("*.example.com"), &["*.example.com"]),
            (&["ABC.Example.com"], None, &["abc.example.com"]),
            (
                &["abc.example.com", "ABC.example.com"],
                Some("*.com"),
                &["abc.example.com"],
            ),
        ];
        for (route, listener, want) in cases {
            assert_eq!(
                intersect(&v(route), *listener),
                v(want),
                "{route:?} x {listener:?}"
            );
        }
    }
}
