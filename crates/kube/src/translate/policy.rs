//! SeedlinkPolicy: checking one, applying it to the control plane it
//! targets, the claims a control plane makes, and what the status already
//! says was accepted.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use gateway_api::tlsroutes::TlsRoute;
use seedlink_config::model::{Acl, ControlPlane, DestinationCfg};

use crate::crd::{SeedlinkPolicy, SeedlinkPolicySpec};

use super::objects::*;
use super::outcome::*;

/// A policy's own problems (values the gateway would refuse); conflicts
/// with other control planes are found later, by the gateway.
pub(super) fn check_policy(spec: &SeedlinkPolicySpec) -> Option<String> {
    let mut problems = Vec::new();
    for (i, c) in spec.allowed_source_cidrs.iter().flatten().enumerate() {
        if let Err(why) = seedlink_config::compile::parse_cidr(c) {
            problems.push(format!("allowedSourceCIDRs[{i}]: {why}"));
        }
    }
    for (i, d) in spec.destinations.iter().enumerate() {
        if let Err(why) = seedlink_proto::destination::parse(d) {
            problems.push(format!("destinations[{i}]: {d:?}: {why}"));
        }
    }
    for (i, a) in spec.service_addresses.iter().enumerate() {
        match a.parse::<SocketAddr>() {
            Ok(sa) if sa.port() != 0 && !sa.ip().is_unspecified() => {}
            _ => problems.push(format!(
                "serviceAddresses[{i}]: {a:?} is not a specific ip:port"
            )),
        }
    }
    if let Some(id) = &spec.cluster_id {
        if let Err(why) = seedlink_config::compile::check_cluster_id(id) {
            problems.push(format!("clusterID: {why}"));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// A SeedlinkPolicy's settings on the control plane of the route it
/// targets.
pub(super) fn apply_policy(cp: &mut ControlPlane, spec: &SeedlinkPolicySpec) {
    cp.acl = spec
        .allowed_source_cidrs
        .as_ref()
        .map(|a| Acl { allow: a.clone() });
    cp.destinations = spec
        .destinations
        .iter()
        .map(|d| DestinationCfg {
            name: d.clone(),
            endpoints: None,
            tunnel_target: None,
        })
        .collect();
    cp.service_addresses = spec.service_addresses.clone();
    cp.cluster_id = spec.cluster_id.clone();
}

/// Every name a control plane claims, one namespace per kind (a host name
/// served at one address only is a claim there, not everywhere), each
/// once: a name given twice (`a.example` and `A.example.`) is one claim,
/// so the steady-state check that counts claims against the names held
/// stays on its fast path.
pub(super) fn claims(cp: &ControlPlane) -> Vec<String> {
    let lower = |s: &str| s.trim_end_matches('.').to_ascii_lowercase();
    let mut claims: Vec<String> = cp
        .hostnames
        .iter()
        .map(|h| format!("host {}", lower(h)))
        .chain(cp.served_on.iter().flat_map(|o| {
            o.hostnames
                .iter()
                .map(move |h| format!("host {} at {}", lower(h), o.address))
        }))
        .chain(
            cp.destinations
                .iter()
                .map(|d| format!("destination {}", lower(&d.name))),
        )
        .chain(cp.service_addresses.iter().map(|a| format!("service {a}")))
        .chain(cp.cluster_id.iter().map(|i| format!("cluster {i}")))
        .collect();
    claims.sort_unstable();
    claims.dedup();
    claims
}

/// The control planes whose objects' statuses say seedlink accepted them
/// as they are now: the route's `Accepted=True` from seedlink at its
/// current generation, and every SeedlinkPolicy targeting it likewise. A
/// route (or policy) edited since, refused, or never seen is not among
/// them: an edit that adds another tenant's name cannot count as held.
pub(super) fn accepted_by_status(objects: &Objects<'_>, ours: &[Key]) -> HashSet<String> {
    let current = |conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
                   generation: Option<i64>| {
        conditions.iter().any(|c| {
            c.type_ == "Accepted"
                && c.status == "True"
                && generation.is_some()
                && c.observed_generation == generation
        })
    };
    // By namespace: a route's policies are in its own namespace, and
    // looking through every policy for every route would cost tenants².
    let mut in_namespace: HashMap<&str, Vec<&SeedlinkPolicy>> = HashMap::new();
    for p in objects.policies {
        let ns = p.metadata.namespace.as_deref().unwrap_or_default();
        in_namespace.entry(ns).or_default().push(p.as_ref());
    }
    let stale_policy = |key: &Key| {
        let policies = in_namespace.get(key.namespace.as_str());
        policies.into_iter().flatten().any(|p| {
            p.spec.target_refs.iter().any(|t| t.name == key.name)
                && !p.status.iter().flat_map(|s| &s.ancestors).any(|a| {
                    a.controller_name == crate::crd::CONTROLLER_NAME
                        && a.ancestor_ref.name == key.name
                        && current(&a.conditions, p.metadata.generation)
                })
        })
    };
    // Only the entries for the Gateways this install serves, and all of
    // them: another install (same controller name) that accepted a route
    // for its own Gateway says nothing about this one's names.
    let for_ours = |r: &TlsRoute, p: &gateway_api::tlsroutes::TlsRouteStatusParents| {
        let ns = r.metadata.namespace.as_deref().unwrap_or_default();
        p.controller_name == crate::crd::CONTROLLER_NAME
            && p.parent_ref.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
            && p.parent_ref.kind.as_deref().unwrap_or("Gateway") == "Gateway"
            && ours.iter().any(|k| {
                k.name == p.parent_ref.name
                    && k.namespace == p.parent_ref.namespace.as_deref().unwrap_or(ns)
            })
    };
    objects
        .routes
        .iter()
        .filter(|r| {
            let mut entries = r
                .status
                .iter()
                .flat_map(|s| &s.parents)
                .filter(|p| for_ours(r, p))
                .peekable();
            entries.peek().is_some()
                && entries.all(|p| current(&p.conditions, r.metadata.generation))
        })
        .map(|r| Key::of(r.as_ref()))
        .filter(|k| !stale_policy(k))
        .map(|k| control_plane_name(&k))
        .collect()
}

#[cfg(test)]
mod claims_tests {
    #[test]
    fn a_name_given_twice_is_claimed_once() {
        let cp = seedlink_config::model::ControlPlane {
            name: "a".into(),
            hostnames: vec![
                "api.a.example".into(),
                "API.a.example.".into(),
                "b.example".into(),
            ],
            ..Default::default()
        };
        let claims = super::claims(&cp);
        assert_eq!(claims, ["host api.a.example", "host b.example"]);
    }
}
