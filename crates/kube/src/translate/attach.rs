//! Who may attach a route to the seedlink Gateway, and whose backends a
//! route may use: the Gateway listeners' `allowedRoutes` and ReferenceGrants,
//! as Gateway API defines them. Both are the cluster operator's word, never
//! the tenant's: a route in a namespace the listener does not admit is not
//! served, and a route reaches a Service in another namespace only when that
//! namespace's owner granted it.

use std::collections::{BTreeMap, HashMap};

use gateway_api::gateways::{
    Gateway, GatewayListenersAllowedRoutes, GatewayListenersAllowedRoutesNamespacesFrom as From,
    GatewayListenersAllowedRoutesNamespacesSelector as Selector,
};
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRouteParentRefs;
use kube::ResourceExt;

use super::{Verdict, GATEWAY_GROUP};

/// One listener routes attach to.
pub(super) struct Listener<'a> {
    name: &'a str,
    /// `None`: a listener from the gateway file (no Gateway object):
    /// Gateway API's default, routes from the Gateway's own namespace.
    allowed: Option<&'a GatewayListenersAllowedRoutes>,
    /// `None` for the file's listeners (they are all TLS).
    protocol: Option<&'a str>,
    /// TLS passthrough (the file's listeners always are; a Gateway
    /// listener's `tls.mode` defaults to Terminate).
    passthrough: bool,
}

/// The listeners of the Gateway object when it exists, else the file's.
pub(super) fn listeners<'a>(gateway: Option<&'a Gateway>, file: &'a [String]) -> Vec<Listener<'a>> {
    match gateway {
        Some(g) => g
            .spec
            .listeners
            .iter()
            .map(|l| Listener {
                name: &l.name,
                allowed: l.allowed_routes.as_ref(),
                protocol: Some(&l.protocol),
                passthrough: is_passthrough(l),
            })
            .collect(),
        None => file
            .iter()
            .map(|n| Listener {
                name: n,
                allowed: None,
                protocol: None,
                passthrough: true,
            })
            .collect(),
    }
}

/// Whether every parentRef (each naming the seedlink Gateway) admits a
/// route in `route_ns`; the refusal otherwise (`NoMatchingParent` or
/// `NotAllowedByListeners`).
pub(super) fn check(
    parents: &[TlsRouteParentRefs],
    route_ns: &str,
    gateway_ns: &str,
    listeners: &[Listener<'_>],
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Result<(), Verdict> {
    for p in parents {
        let candidates: Vec<&Listener<'_>> = listeners
            .iter()
            .filter(|l| p.section_name.as_deref().is_none_or(|s| s == l.name))
            .collect();
        if candidates.is_empty() {
            let names: Vec<&str> = listeners.iter().map(|l| l.name).collect();
            return Err(Verdict::no(
                "NoMatchingParent",
                format!(
                    "the gateway has no listener {:?} (it has {})",
                    p.section_name.as_deref().unwrap_or_default(),
                    names.join(", ")
                ),
            ));
        }
        let mut why = Vec::new();
        let admitted =
            candidates
                .iter()
                .any(|l| match admits(l, route_ns, gateway_ns, namespaces) {
                    Ok(()) => true,
                    Err(w) => {
                        why.push(format!("listener {}: {w}", l.name));
                        false
                    }
                });
        if !admitted {
            return Err(Verdict::no("NotAllowedByListeners", why.join("; ")));
        }
    }
    Ok(())
}

/// The listeners a route that [`check`] admitted attaches to: for each
/// parentRef, every listener it names (all without a sectionName) that
/// admits the route's namespace.
pub(super) fn attached(
    parents: &[TlsRouteParentRefs],
    route_ns: &str,
    gateway_ns: &str,
    listeners: &[Listener<'_>],
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for p in parents {
        for l in listeners {
            let named = p.section_name.as_deref().is_none_or(|s| s == l.name);
            if named
                && admits(l, route_ns, gateway_ns, namespaces).is_ok()
                && !out.iter().any(|n| n == l.name)
            {
                out.push(l.name.to_string());
            }
        }
    }
    out
}

/// Each listener of the Gateway object: accepted when seedlink serves it
/// (TLS passthrough; a TLS listener without `tls.mode` is Terminate by the
/// spec's default, which seedlink does not do).
pub(super) fn outcomes(gateway: Option<&Gateway>) -> Vec<super::ListenerOutcome> {
    let Some(g) = gateway else {
        return Vec::new();
    };
    g.spec
        .listeners
        .iter()
        .map(|l| {
            let passthrough = is_passthrough(l);
            let accepted = if l.protocol != "TLS" {
                Verdict::no(
                    "UnsupportedProtocol",
                    format!("seedlink serves TLS passthrough only, not {}", l.protocol),
                )
            } else if !passthrough {
                Verdict::no(
                    "UnsupportedValue",
                    "seedlink serves tls.mode Passthrough only (it never terminates TLS)",
                )
            } else {
                Verdict::yes("Accepted", "served by seedlink (TLS passthrough)")
            };
            let kinds = if accepted.ok {
                vec!["TLSRoute".to_string()]
            } else {
                Vec::new()
            };
            super::ListenerOutcome {
                name: l.name.clone(),
                accepted,
                kinds,
            }
        })
        .collect()
}

fn is_passthrough(l: &gateway_api::gateways::GatewayListeners) -> bool {
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
    let kinds = l.allowed.and_then(|a| a.kinds.as_ref());
    if let Some(kinds) = kinds.filter(|k| !k.is_empty()) {
        let tls = kinds.iter().any(|k| {
            k.kind == "TLSRoute" && k.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
        });
        if !tls {
            return Err("its allowedRoutes.kinds has no TLSRoute".into());
        }
    }
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
        From::Selector => {
            let Some(sel) = ns.and_then(|n| n.selector.as_ref()) else {
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
