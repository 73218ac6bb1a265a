//! From Kubernetes objects to the gateway's model, as a pure function:
//! TLSRoutes attached to the seedlink Gateway become control planes (their
//! hostnames the SNI routes, the ready addresses of their backend Services'
//! EndpointSlices the upstreams), and SeedlinkPolicies attached to a route
//! add its ACL, CONNECT destinations and legacy service addresses. What
//! cannot be used is reported per object, for status and Events; the
//! gateway's own validation then admits each control plane on its own
//! (`seedlink_config::compile::compile_admitting`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use std::collections::BTreeMap;

use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use seedlink_config::model::ControlPlane;

use crate::crd::{SeedlinkPolicy, SeedlinkPolicySpec};

mod backends;
mod objects;
mod outcome;
mod policy;
mod views;

pub use backends::unroutable;
use backends::*;
use objects::*;
pub use objects::{ClassSettings, Objects, MANAGED_BY};
use policy::*;
pub use views::names_gateway;
use views::*;

pub use outcome::{
    control_plane_name, GatewayOutcome, Key, ListenerOutcome, ParentOutcome, PolicyOutcome,
    RouteOutcome, Translation, Verdict, GATEWAY_GROUP,
};

/// Remembers the last accepted spec of each policy, so that an invalid
/// edit keeps the route under its previous ACL instead of opening it (or
/// dropping it).
#[derive(Debug)]
pub struct Translator {
    last_good: HashMap<Key, SeedlinkPolicySpec>,
    /// Who held each name in the last pass (claim → control plane).
    held: HashMap<String, String>,
    /// The `endpointslice.kubernetes.io/managed-by` values whose slices
    /// name upstreams (`kubernetes.endpointslice_managers`).
    pub slice_managers: Vec<String>,
}

impl Default for Translator {
    fn default() -> Self {
        Translator {
            last_good: HashMap::new(),
            held: HashMap::new(),
            slice_managers: vec![seedlink_config::model::ENDPOINTSLICE_CONTROLLER.to_string()],
        }
    }
}

impl Translator {
    /// Translates `objects`.
    pub fn translate(&mut self, objects: &Objects<'_>) -> Translation {
        let mut out = Translation::default();
        let mut routes: Vec<&Arc<TlsRoute>> = objects.routes.iter().collect();
        routes.sort_by_cached_key(|r| age(r.as_ref()));
        let services: HashMap<Key, &Service> = objects
            .services
            .iter()
            .map(|s| (Key::of(s.as_ref()), s.as_ref()))
            .collect();
        let slices = self.trusted_slices(objects);
        let views = views(objects);
        let policies = self.policies(objects, &views, &routes, &mut out);
        let namespaces: HashMap<String, &BTreeMap<String, String>> = objects
            .namespaces
            .iter()
            .map(|n| (n.name_any(), n.labels()))
            .collect();
        let grants: Vec<&ReferenceGrant> = objects.grants.iter().map(|g| g.as_ref()).collect();
        let lookup = Lookup {
            services: &services,
            slices: &slices,
            grants: &grants,
        };
        for route in routes {
            let key = Key::of(route.as_ref());
            let attached = attach_to_parents(route, &key, &views, &namespaces);
            if attached.parents.is_empty() {
                continue;
            }
            let (outcome, cp) = serve_route(route, key, attached, &lookup, &policies);
            out.control_planes.extend(cp);
            out.routes.push(outcome);
        }
        let ours: Vec<Key> = views.iter().map(|v| v.key.clone()).collect();
        let accepted = accepted_by_status(objects, &ours);
        self.keep_first_claims(&mut out.control_planes, &accepted);
        out.gateways = views
            .into_iter()
            .filter(|v| v.object)
            .map(|v| GatewayOutcome {
                key: v.key,
                listeners: v.outcomes,
                address: v.address,
                named: v.named,
            })
            .collect();
        out
    }

    /// Orders `cps` so that a name (host name, destination, service
    /// address, cluster ID) stays with the route that held it in the last
    /// pass for as long as that route still claims it: a route that claims
    /// such a name goes last, whatever its age, and the gateway refuses it
    /// on the conflict. Without this, a tenant with an old route could add
    /// another tenant's name at any time and take its traffic. What this
    /// replica has not held itself (after a restart, or on a new replica)
    /// is held by the control planes `accepted` by the objects' statuses
    /// (state in the API server), so every replica decides alike.
    fn keep_first_claims(&mut self, cps: &mut [ControlPlane], accepted: &HashSet<String>) {
        let mut claimed: HashMap<String, HashSet<&str>> = HashMap::new();
        for cp in cps.iter() {
            for c in claims(cp) {
                claimed.entry(c).or_default().insert(cp.name.as_str());
            }
        }
        let mut held = self.held.clone();
        for cp in cps.iter().filter(|cp| accepted.contains(&cp.name)) {
            for c in claims(cp) {
                held.entry(c).or_insert_with(|| cp.name.clone());
            }
        }
        let steals = |cp: &ControlPlane| {
            claims(cp).iter().any(|c| {
                held.get(c).is_some_and(|owner| {
                    *owner != cp.name
                        && claimed
                            .get(c)
                            .is_some_and(|who| who.contains(owner.as_str()))
                })
            })
        };
        let order: Vec<bool> = cps.iter().map(steals).collect();
        drop(claimed);
        let mut indexed: Vec<(bool, ControlPlane)> =
            order.into_iter().zip(cps.iter().cloned()).collect();
        // Stable: ages stay in order within each group.
        indexed.sort_by_key(|(stealer, _)| *stealer);
        let mut held = HashMap::new();
        for (slot, (_, cp)) in cps.iter_mut().zip(indexed) {
            for c in claims(&cp) {
                held.entry(c).or_insert_with(|| cp.name.clone());
            }
            *slot = cp;
        }
        self.held = held;
    }

    /// The policy in force: `spec` if valid (remembered as the last good
    /// one), else the last good one, else the refusal.
    fn effective(
        &mut self,
        key: &Key,
        spec: &SeedlinkPolicySpec,
        invalid: Option<&str>,
    ) -> Result<SeedlinkPolicySpec, String> {
        match invalid {
            None => {
                self.last_good.insert(key.clone(), spec.clone());
                Ok(spec.clone())
            }
            Some(why) => match self.last_good.get(key) {
                Some(prev) => Ok(prev.clone()),
                None => Err(format!("SeedlinkPolicy {key} is invalid: {why}")),
            },
        }
    }

    /// Policy per route key; records each policy's outcome. A route's
    /// policy is the oldest one targeting it.
    fn policies(
        &mut self,
        objects: &Objects<'_>,
        views: &[View<'_>],
        routes: &[&Arc<TlsRoute>],
        out: &mut Translation,
    ) -> HashMap<String, Result<SeedlinkPolicySpec, String>> {
        let attached = attached_routes(views, routes);
        let existing: HashSet<Key> = routes.iter().map(|r| Key::of(r.as_ref())).collect();
        let mut policies: Vec<&Arc<SeedlinkPolicy>> = objects.policies.iter().collect();
        policies.sort_by_cached_key(|p| age(p.as_ref()));
        let mut result = HashMap::new();
        let live: HashSet<Key> = policies.iter().map(|p| Key::of(p.as_ref())).collect();
        self.last_good.retain(|k, _| live.contains(k));
        for p in policies {
            let key = Key::of(p.as_ref());
            let invalid = check_policy(&p.spec);
            let effective = self.effective(&key, &p.spec, invalid.as_deref());
            let mut targets = Vec::new();
            let mut foreign = Vec::new();
            for t in &p.spec.target_refs {
                let route = Key {
                    namespace: key.namespace.clone(),
                    name: t.name.clone(),
                };
                // A route that exists but is attached to none of the
                // Gateways this process serves is another install's: its
                // entry is not ours to write (two installs would take
                // turns writing "not found" and "accepted", and the
                // claims read from status would flap with them).
                if t.kind == "TLSRoute" && existing.contains(&route) && !attached.contains(&route) {
                    foreign.push(t.name.clone());
                    continue;
                }
                let verdict =
                    target_verdict(t, &route, &attached, &mut result, (&invalid, &effective));
                targets.push((t.name.clone(), verdict));
            }
            out.policies.push(PolicyOutcome {
                key,
                generation: p.metadata.generation,
                targets,
                foreign,
            });
        }
        result
    }
}

impl Translator {
    /// EndpointSlices by the Service they belong to, only those written by
    /// a manager the operator trusts: a tenant may write a slice naming any
    /// address (the CVE-2021-25740 class); a route then has no endpoints
    /// from it.
    fn trusted_slices<'o>(&self, objects: &Objects<'o>) -> HashMap<Key, Vec<&'o EndpointSlice>> {
        let mut slices: HashMap<Key, Vec<&EndpointSlice>> = HashMap::new();
        for s in objects.slices {
            let manager = s.labels().get(MANAGED_BY);
            if !manager.is_some_and(|m| self.slice_managers.contains(m)) {
                tracing::debug!(slice = %Key::of(s.as_ref()), manager = ?manager, "EndpointSlice ignored: not written by a trusted manager (kubernetes.endpointslice_managers)");
                continue;
            }
            if let Some(svc) = s.labels().get("kubernetes.io/service-name") {
                slices
                    .entry(Key {
                        namespace: s.namespace().unwrap_or_default(),
                        name: svc.clone(),
                    })
                    .or_default()
                    .push(s.as_ref());
            }
        }
        slices
    }
}

impl Key {
    fn name_in(&self, namespace: &str) -> String {
        format!("{namespace}/{}", self.name)
    }
}

/// An attached route's outcome, and the control plane it becomes if it
/// is served.
fn serve_route(
    route: &TlsRoute,
    key: Key,
    attached: Attached,
    lookup: &Lookup<'_>,
    policies: &HashMap<String, Result<SeedlinkPolicySpec, String>>,
) -> (RouteOutcome, Option<ControlPlane>) {
    let Attached {
        parents,
        hostnames,
        served_on,
    } = attached;
    let accepted = parents
        .iter()
        .find(|p| p.accepted.ok)
        .or(parents.first())
        .map(|p| p.accepted.clone())
        .unwrap_or_else(|| Verdict::no("NoMatchingParent", "no parent"));
    let (endpoints, resolved, weighted) = backends(route, &key, lookup);
    let mut outcome = RouteOutcome {
        key: key.clone(),
        generation: route.metadata.generation,
        parents,
        accepted,
        resolved,
        control_plane: None,
    };
    if !outcome.accepted.ok {
        return (outcome, None);
    }
    if weighted {
        outcome.weights_ignored();
    }
    if hostnames.is_empty() && served_on.is_empty() {
        // Accepted only by Gateways with no address yet: nowhere to serve
        // it.
        return (outcome, None);
    }
    let mut cp = ControlPlane {
        served_on,
        name: control_plane_name(&key),
        hostnames,
        endpoints,
        ..ControlPlane::default()
    };
    match policies.get(&key.name_in(&key.namespace)) {
        Some(Ok(spec)) => apply_policy(&mut cp, spec),
        Some(Err(why)) => {
            // Fail closed: without its valid policy the route would lose
            // its ACL.
            outcome.refuse(Verdict::no("UnsupportedValue", why.clone()));
            return (outcome, None);
        }
        None => {}
    }
    outcome.control_plane = Some(cp.name.clone());
    (outcome, Some(cp))
}

impl RouteOutcome {
    /// Accepted, with a note that backend weights are not applied.
    fn weights_ignored(&mut self) {
        let note = Verdict::yes(
            "Accepted",
            "served by seedlink; backend weights other than 0 are ignored (least-connections over every ready endpoint)",
        );
        for p in self.parents.iter_mut().filter(|p| p.accepted.ok) {
            p.accepted = note.clone();
        }
        self.accepted = note;
    }
}

mod attach;

#[cfg(test)]
mod tests;
