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

mod attached;
mod backends;
mod memo;
mod objects;
mod outcome;
mod placed;
mod policy;
mod views;

pub use attached::AttachedCounts;
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
    held: Held,
    /// Each namespace's share of the last pass.
    memo: memo::Memo,
    /// The stores' objects by namespace, for picking a pass's.
    places: placed::Places,
    /// How many namespaces the last pass translated again.
    pub retranslated: usize,
    /// The `endpointslice.kubernetes.io/managed-by` values whose slices
    /// name upstreams (`kubernetes.endpointslice_managers`).
    pub slice_managers: Vec<String>,
}

impl Default for Translator {
    fn default() -> Self {
        Translator {
            last_good: HashMap::new(),
            held: Held::default(),
            memo: memo::Memo::default(),
            places: placed::Places::default(),
            retranslated: 0,
            slice_managers: vec![seedlink_config::model::ENDPOINTSLICE_CONTROLLER.to_string()],
        }
    }
}

impl Translator {
    /// Translates `objects`: the namespaces whose objects changed since the
    /// last pass again, the others from what that pass made of them
    /// ([`memo`]).
    pub fn translate(&mut self, objects: &Objects<'_>) -> Translation {
        self.translate_touched(objects, None)
    }

    /// [`Translator::translate`], told which namespaces' objects changed
    /// since the last pass (`None`: it does not know, and fingerprints
    /// every object): those are translated again, with the namespaces
    /// whose routes read them, and nothing else is looked at. A change to
    /// what every namespace reads (the served Gateways, the class, the
    /// settings) translates everything again either way.
    pub fn translate_touched(
        &mut self,
        objects: &Objects<'_>,
        touched: Option<&HashSet<String>>,
    ) -> Translation {
        let views = views(objects);
        let ours: Vec<Key> = views.iter().map(|v| v.key.clone()).collect();
        let settings = self.settings_print(objects);
        let kept = self.memo.len();
        let global = memo::Prints::global_of(objects, settings, &self.memo.hasher);
        let translated = match touched.filter(|_| self.memo.holds(global)) {
            Some(touched) => self.pass_touched(objects, &views, &ours, touched, settings),
            None => self.pass_all(objects, &views, &ours, settings),
        };
        self.retranslated = translated;
        tracing::debug!(
            namespaces = self.memo.len(),
            translated,
            kept,
            everything = touched.is_none(),
            "translation pass"
        );
        self.assemble(views)
    }

    /// Fingerprints every object and translates the namespaces whose
    /// fingerprint changed; how many.
    fn pass_all(
        &mut self,
        objects: &Objects<'_>,
        views: &[View<'_>],
        ours: &[Key],
        settings: u64,
    ) -> usize {
        let prints = memo::Prints::of(objects, settings, &self.memo.hasher);
        let dirty = self.memo.dirty(&prints);
        let live = &prints.work;
        self.last_good
            .retain(|k, _| live.contains(k.namespace.as_str()));
        if !dirty.is_empty() {
            let subset = memo::Subset::of(objects, &dirty, &mut self.places);
            let parts = self.translate_namespaces(&subset.objects(objects), views, ours, &dirty);
            self.memo.store(parts, &prints);
        }
        dirty.len()
    }

    /// Translates the namespaces `touched` and those whose routes read
    /// them; how many. Objects elsewhere are not looked at.
    fn pass_touched(
        &mut self,
        objects: &Objects<'_>,
        views: &[View<'_>],
        ours: &[Key],
        touched: &HashSet<String>,
        settings: u64,
    ) -> usize {
        let candidates = self.memo.readers_of(touched);
        let subset = memo::Subset::of(objects, &candidates, &mut self.places);
        let sub = subset.objects(objects);
        let prints = memo::Prints::of(&sub, settings, &self.memo.hasher);
        // Those without a route or a policy any more have no share.
        let gone: Vec<&String> = candidates
            .iter()
            .filter(|ns| !prints.work.contains(ns.as_str()))
            .collect();
        self.memo.forget(&gone);
        self.last_good.retain(|k, _| !gone.contains(&&k.namespace));
        let dirty: memo::Dirty = prints.work.iter().map(|ns| ns.to_string()).collect();
        if !dirty.is_empty() {
            let parts = self.translate_namespaces(&sub, views, ours, &dirty);
            self.memo.store(parts, &prints);
        }
        dirty.len()
    }

    /// This pass's translation, from every namespace's share.
    fn assemble(&mut self, views: Vec<View<'_>>) -> Translation {
        let routes = self.memo.routes();
        let mut out = Translation {
            control_planes: keep_first_claims(&mut self.held, &routes),
            routes: routes.iter().map(|r| r.outcome.clone()).collect(),
            policies: self.memo.policies(),
            gateways: Vec::new(),
        };
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

    /// What every namespace's share reads of the settings.
    fn settings_print(&self, objects: &Objects<'_>) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (objects.gateway, objects.class, objects.listeners).hash(&mut h);
        self.slice_managers.hash(&mut h);
        h.finish()
    }

    /// Translates the namespaces `dirty` (`objects` holds theirs only),
    /// each into its share.
    fn translate_namespaces(
        &mut self,
        objects: &Objects<'_>,
        views: &[View<'_>],
        ours: &[Key],
        dirty: &memo::Dirty,
    ) -> HashMap<String, memo::Part> {
        let mut parts: HashMap<String, memo::Part> = dirty
            .iter()
            .map(|ns| (ns.clone(), memo::Part::default()))
            .collect();
        let mut routes: Vec<&Arc<TlsRoute>> = objects.routes.iter().collect();
        routes.sort_by_cached_key(|r| age(r.as_ref()));
        let services: HashMap<Key, &Service> = objects
            .services
            .iter()
            .map(|s| (Key::of(s.as_ref()), s.as_ref()))
            .collect();
        let slices = self.trusted_slices(objects);
        let mut policy_outcomes = Vec::new();
        let policies = self.policies(objects, views, &routes, dirty, &mut policy_outcomes);
        for (age, outcome) in policy_outcomes {
            if let Some(part) = parts.get_mut(&age.1.namespace) {
                part.policies.push((age, Arc::new(outcome)));
            }
        }
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
        let accepted = accepted_by_status(objects, ours);
        for route in routes {
            let key = Key::of(route.as_ref());
            let attached = attach_to_parents(route, &key, views, &namespaces);
            if attached.parents.is_empty() {
                continue;
            }
            let age = age(route.as_ref());
            let (outcome, cp) = serve_route(route, key, attached, &lookup, &policies);
            let served = cp.map(|cp| memo::Served {
                claims: claims(&cp),
                accepted: accepted.contains(&cp.name),
                cp: Arc::new(cp),
            });
            if let Some(part) = parts.get_mut(&age.1.namespace) {
                part.routes.push(memo::RoutePart {
                    age,
                    outcome: Arc::new(outcome),
                    served,
                });
            }
        }
        parts
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
        dirty: &memo::Dirty,
        out: &mut Vec<(memo::Age, PolicyOutcome)>,
    ) -> HashMap<String, Result<SeedlinkPolicySpec, String>> {
        let attached = attached_routes(views, routes);
        let existing: HashSet<Key> = routes.iter().map(|r| Key::of(r.as_ref())).collect();
        let mut policies: Vec<&Arc<SeedlinkPolicy>> = objects.policies.iter().collect();
        policies.sort_by_cached_key(|p| age(p.as_ref()));
        let mut result = HashMap::new();
        let live: HashSet<Key> = policies.iter().map(|p| Key::of(p.as_ref())).collect();
        // Only this pass's namespaces are here: the others' are kept.
        self.last_good
            .retain(|k, _| !dirty.contains(&k.namespace) || live.contains(k));
        for p in policies {
            let age = age(p.as_ref());
            let key = age.1.clone();
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
            let outcome = PolicyOutcome {
                key,
                generation: p.metadata.generation,
                targets,
                foreign,
            };
            out.push((age, outcome));
        }
        result
    }
}

/// The control planes of `routes` (oldest first) in the order the gateway
/// admits them: a name (host name, destination, service address, cluster
/// ID) stays with the route that held it in the last pass (`held`) for as
/// long as that route still claims it. A route that claims such a name
/// goes last, whatever its age, and the gateway refuses it on the
/// conflict. Without this, a tenant with an old route could add another
/// tenant's name at any time and take its traffic. What this replica has
/// not held itself (after a restart, or on a new replica) is held by the
/// control planes accepted by the objects' statuses (state in the API
/// server), so every replica decides alike.
fn keep_first_claims(held: &mut Held, routes: &[&memo::RoutePart]) -> Vec<Arc<ControlPlane>> {
    let served: Vec<&memo::Served> = routes.iter().filter_map(|r| r.served.as_ref()).collect();
    if holds_its_own(held, &served) {
        return served.into_iter().map(|s| s.cp.clone()).collect();
    }
    let mut claimed: HashMap<&str, HashSet<&str>> = HashMap::new();
    let mut by_status: HashMap<&str, &str> = HashMap::new();
    for s in &served {
        for c in &s.claims {
            claimed.entry(c).or_default().insert(s.cp.name.as_str());
            if s.accepted && !held.contains_key(c) {
                by_status.entry(c).or_insert(s.cp.name.as_str());
            }
        }
    }
    let owner = |c: &str| {
        held.get(c)
            .map(String::as_str)
            .or_else(|| by_status.get(c).copied())
    };
    let steals = |s: &memo::Served| {
        s.claims.iter().any(|c| {
            owner(c).is_some_and(|o| {
                o != s.cp.name && claimed.get(c.as_str()).is_some_and(|who| who.contains(o))
            })
        })
    };
    // Stable: ages stay in order within each group.
    let (first, last): (Vec<&memo::Served>, Vec<&memo::Served>) =
        served.iter().partition(|s| !steals(s));
    let ordered: Vec<&memo::Served> = first.into_iter().chain(last).collect();
    let mut now: HashMap<&str, &str> = HashMap::new();
    for s in &ordered {
        for c in &s.claims {
            now.entry(c).or_insert(s.cp.name.as_str());
        }
    }
    let same = now.len() == held.len()
        && now
            .iter()
            .all(|(c, o)| held.get(*c).is_some_and(|h| h == o));
    if !same {
        *held = now
            .into_iter()
            .map(|(c, o)| (c.to_string(), o.to_string()))
            .collect();
    }
    ordered.into_iter().map(|s| s.cp.clone()).collect()
}

/// Claim → the control plane that holds it. foldhash, seeded per process
/// (as the memo's fingerprints): every pass looks up every claim.
type Held = foldhash::HashMap<String, String>;

/// Whether every name claimed is held by its claimant, and nothing else is
/// held: the steady state, where the order is the age order and nothing
/// changes hands. One lookup per claim, nothing built.
fn holds_its_own(held: &Held, served: &[&memo::Served]) -> bool {
    let mut claims = 0usize;
    for s in served {
        for c in &s.claims {
            claims += 1;
            if held.get(c).is_none_or(|o| *o != s.cp.name) {
                return false;
            }
        }
    }
    claims == held.len()
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
