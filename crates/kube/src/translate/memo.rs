//! Incremental translation: each namespace's share of a translation (its
//! routes' outcomes and control planes, its policies' outcomes) is kept
//! with a fingerprint of what it was made from, and made again only when
//! that changes. A pass then costs the namespaces that changed, plus a
//! fingerprint and a copy per unchanged one, not a translation of every
//! tenant (docs/ARCHITECTURE.md, "What one Kubernetes event costs").
//!
//! What a namespace's share reads: its TLSRoutes, SeedlinkPolicies,
//! Services and EndpointSlices (each by `resourceVersion`, which changes on
//! every write, status included), its Namespace object (labels, for
//! `allowedRoutes.namespaces.selector`), the Services, EndpointSlices and
//! ReferenceGrants of its own namespace and of those its routes'
//! backendRefs name, and what every share reads (the global
//! fingerprint): the Gateways seedlink serves (spec, age and status
//! addresses), its GatewayClass and the settings. An object
//! without a `resourceVersion` (never from an API server) makes what reads
//! it be made again on every pass.

use std::hash::BuildHasher;
use std::sync::Arc;

// foldhash (hashbrown's hasher, already built) instead of SipHash: a pass
// hashes every object's identity, and SipHash was a fifth of a pass at
// 1,000 tenants. Seeded per process, so a tenant cannot aim at a
// collision.
use foldhash::fast::RandomState;
use foldhash::{HashMap, HashSet};

use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Resource;
use seedlink_config::model::ControlPlane;

use crate::crd::SeedlinkPolicy;

use super::objects::Objects;
use super::outcome::{Key, PolicyOutcome, RouteOutcome};

/// The namespaces a pass translates again.
pub(super) type Dirty = HashSet<String>;

/// An object's age key: creation time, then `namespace/name`.
pub(super) type Age = (Option<k8s_openapi::jiff::Timestamp>, Key);

/// A served route's control plane, the names it claims, and whether the
/// route's status says seedlink accepted it as it is now.
#[derive(Debug)]
pub(super) struct Served {
    /// Shared with every pass's translation while the namespace is kept.
    pub(super) cp: Arc<ControlPlane>,
    pub(super) claims: Vec<String>,
    pub(super) accepted: bool,
}

/// One route's share.
#[derive(Debug)]
pub(super) struct RoutePart {
    pub(super) age: Age,
    pub(super) outcome: Arc<RouteOutcome>,
    pub(super) served: Option<Served>,
}

/// One namespace's share of a translation.
#[derive(Debug, Default)]
pub(super) struct Part {
    /// What it was made from; `None` never matches.
    fingerprint: Option<u64>,
    /// The other namespaces its routes' backendRefs name: a change there
    /// translates it again.
    deps: Vec<String>,
    pub(super) routes: Vec<RoutePart>,
    pub(super) policies: Vec<(Age, Arc<PolicyOutcome>)>,
    /// Once kept: where its routes and policies stand in the memo's
    /// orders (they are moved there).
    kept: Vec<Age>,
    kept_policies: Vec<Age>,
}

/// The shares kept from earlier passes.
#[derive(Debug, Default)]
pub(super) struct Memo {
    global: Option<u64>,
    parts: HashMap<String, Part>,
    /// Every kept route's share and policy's outcome, oldest first: a pass
    /// reads them in order without sorting every tenant's again.
    routes: std::collections::BTreeMap<Age, RoutePart>,
    policies: std::collections::BTreeMap<Age, Arc<PolicyOutcome>>,
    /// The fingerprints' hasher: one seed for the process's life.
    pub(super) hasher: RandomState,
}

/// The fingerprints of one pass's objects.
pub(super) struct Prints<'o> {
    global: Option<u64>,
    namespaces: HashMap<&'o str, Option<u64>>,
    /// Namespaces holding a route or a policy: those with a share.
    pub(super) work: HashSet<&'o str>,
    /// (route namespace, backend namespace) for backendRefs across
    /// namespaces.
    deps: HashSet<(&'o str, &'o str)>,
}

/// An object's fingerprint: its kind, identity and `resourceVersion`.
fn print<K: Resource>(h: &RandomState, kind: u8, o: &K) -> Option<u64> {
    let m = o.meta();
    let rv = m.resource_version.as_deref()?;
    Some(h.hash_one((kind, &m.namespace, &m.name, &m.uid, rv)))
}

/// Adds `x` to `into` (order does not matter: stores list in any order);
/// `None` poisons.
fn add(into: &mut Option<u64>, x: Option<u64>) {
    *into = match (*into, x) {
        (Some(a), Some(b)) => Some(a.wrapping_add(b)),
        _ => None,
    };
}

/// Per namespace: the fingerprint of everything in it, and of what
/// another namespace's routes read of it (Services, EndpointSlices and
/// ReferenceGrants).
#[derive(Default)]
struct Bases<'o> {
    all: HashMap<&'o str, Option<u64>>,
    backing: HashMap<&'o str, Option<u64>>,
}

impl<'o> Bases<'o> {
    fn note(&mut self, ns: Option<&'o String>, x: Option<u64>, backing: bool) -> &'o str {
        let ns = ns.map(String::as_str).unwrap_or_default();
        add(self.all.entry(ns).or_insert(Some(0)), x);
        if backing {
            add(self.backing.entry(ns).or_insert(Some(0)), x);
        }
        ns
    }

    /// Notes every namespaced object in its namespace, and in `p` the
    /// namespaces with a share and the backends across namespaces.
    fn read(&mut self, objects: &Objects<'o>, h: &RandomState, p: &mut Prints<'o>) {
        for r in objects.routes {
            let ns = self.note(r.meta().namespace.as_ref(), print(h, 1, r.as_ref()), false);
            p.work.insert(ns);
            p.deps
                .extend(backend_namespaces(r).filter(|b| *b != ns).map(|b| (ns, b)));
        }
        for x in objects.policies {
            let ns = self.note(x.meta().namespace.as_ref(), print(h, 2, x.as_ref()), false);
            p.work.insert(ns);
        }
        for x in objects.services {
            self.note(x.meta().namespace.as_ref(), print(h, 3, x.as_ref()), true);
        }
        for x in objects.slices {
            self.note(x.meta().namespace.as_ref(), print(h, 4, x.as_ref()), true);
        }
        // A grant is read only by routes whose backends are in its
        // namespace: a tenant's grant is not every tenant's business.
        for x in objects.grants {
            self.note(x.meta().namespace.as_ref(), print(h, 7, x.as_ref()), true);
        }
        for x in objects.namespaces {
            self.note(x.meta().name.as_ref(), print(h, 5, x.as_ref()), false);
        }
    }
}

impl<'o> Prints<'o> {
    /// Fingerprints `objects`; `settings` is folded into the global one.
    pub(super) fn of(objects: &Objects<'o>, settings: u64, h: &RandomState) -> Prints<'o> {
        let mut p = Prints::global(objects, settings, h);
        let mut b = Bases::default();
        b.read(objects, h, &mut p);
        p.namespaces = p
            .work
            .iter()
            .map(|ns| (*ns, b.all.get(ns).copied().flatten()))
            .collect();
        for (a, dep) in &p.deps {
            let theirs = b.backing.get(dep).copied().unwrap_or(Some(0));
            if let Some(mine) = p.namespaces.get_mut(a) {
                add(mine, theirs.map(|t| h.hash_one((dep, t))));
            }
        }
        p
    }

    /// The global fingerprint alone: what every share reads.
    pub(super) fn global_of(objects: &Objects<'o>, settings: u64, h: &RandomState) -> Option<u64> {
        Prints::global(objects, settings, h).global
    }

    /// Prints with only the global fingerprint taken.
    fn global(objects: &Objects<'o>, settings: u64, h: &RandomState) -> Prints<'o> {
        let mut p = Prints {
            global: Some(settings),
            namespaces: HashMap::default(),
            work: HashSet::default(),
            deps: HashSet::default(),
        };
        p.global_objects(objects, h);
        p
    }

    /// The Gateways seedlink serves (the named one, the served class's:
    /// their spec's generation, age and status addresses, what the
    /// translation reads of them) and the served GatewayClass. Other
    /// Gateways and classes are not read.
    fn global_objects(&mut self, objects: &Objects<'o>, h: &RandomState) {
        let served = |g: &gateway_api::gateways::Gateway| {
            objects.gateway.is_some_and(|k| {
                g.metadata.name.as_deref() == Some(k.name.as_str())
                    && g.metadata.namespace.as_deref() == Some(k.namespace.as_str())
            }) || objects
                .class
                .is_some_and(|c| g.spec.gateway_class_name == c.name)
        };
        for g in objects.gateways.iter().filter(|g| served(g)) {
            add(&mut self.global, gateway_print(h, g));
        }
        let class = objects.class.map(|c| c.name.as_str());
        for c in objects
            .classes
            .iter()
            .filter(|c| c.metadata.name.as_deref() == class)
        {
            add(&mut self.global, print(h, 6, c.as_ref()));
        }
    }
}

/// A Gateway's fingerprint: what the translation reads of it (its spec's
/// generation, its age and its status addresses).
fn gateway_print(h: &RandomState, g: &gateway_api::gateways::Gateway) -> Option<u64> {
    let m = g.meta();
    let addresses: Vec<&str> = g
        .status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .map(|a| a.value.as_str())
        .collect();
    let created = m.creation_timestamp.as_ref().map(|t| t.0);
    m.generation
        .map(|gen| h.hash_one((&m.namespace, &m.name, &m.uid, gen, created, addresses)))
}

/// The namespaces a route's backendRefs name.
fn backend_namespaces(r: &TlsRoute) -> impl Iterator<Item = &str> {
    r.spec
        .rules
        .iter()
        .flat_map(|rule| &rule.backend_refs)
        .filter_map(|b| b.namespace.as_deref())
}

impl Memo {
    /// The namespaces to translate again: those whose fingerprint changed
    /// (every one when the global fingerprint did). Shares of namespaces
    /// without a route or a policy any more are dropped.
    pub(super) fn dirty(&mut self, prints: &Prints<'_>) -> Dirty {
        if prints.global.is_none() || prints.global != self.global {
            self.parts.clear();
            self.routes.clear();
            self.policies.clear();
            self.global = prints.global;
        }
        let gone: Vec<String> = self
            .parts
            .keys()
            .filter(|ns| !prints.work.contains(ns.as_str()))
            .cloned()
            .collect();
        self.forget(&gone.iter().collect::<Vec<_>>());
        prints
            .work
            .iter()
            .filter(|ns| {
                let now = prints.namespaces.get(*ns).copied().flatten();
                now.is_none() || self.parts.get(**ns).is_none_or(|p| p.fingerprint != now)
            })
            .map(|ns| ns.to_string())
            .collect()
    }

    /// Keeps `parts`, made from this pass's objects.
    pub(super) fn store(
        &mut self,
        parts: std::collections::HashMap<String, Part>,
        prints: &Prints<'_>,
    ) {
        for (ns, mut part) in parts {
            part.fingerprint = prints.namespaces.get(ns.as_str()).copied().flatten();
            part.deps = prints
                .deps
                .iter()
                .filter(|(a, _)| *a == ns)
                .map(|(_, b)| b.to_string())
                .collect();
            for r in &mut part.routes {
                self.keep_equal(r);
            }
            for (age, p) in &mut part.policies {
                if let Some(old) = self.policies.get(age).filter(|old| **old == *p) {
                    *p = old.clone();
                }
            }
            self.forget(&[&ns]);
            for r in std::mem::take(&mut part.routes) {
                part.kept.push(r.age.clone());
                self.routes.insert(r.age.clone(), r);
            }
            for (age, p) in std::mem::take(&mut part.policies) {
                part.kept_policies.push(age.clone());
                self.policies.insert(age, p);
            }
            self.parts.insert(ns, part);
        }
    }

    /// A route translated again keeps the outcome and control plane it
    /// had (the same `Arc`) where they came out equal: the status walks,
    /// the `attachedRoutes` count and the compile then find it unchanged
    /// by a pointer comparison (an EndpointSlice's change translates its
    /// namespace again, and changes its control plane's endpoints alone).
    fn keep_equal(&self, r: &mut RoutePart) {
        let Some(old) = self.routes.get(&r.age) else {
            return;
        };
        if *old.outcome == *r.outcome {
            r.outcome = old.outcome.clone();
        }
        if let (Some(was), Some(now)) = (&old.served, &mut r.served) {
            if *was.cp == *now.cp {
                now.cp = was.cp.clone();
            }
        }
    }

    /// Whether the shares kept were made under the global fingerprint
    /// `global` (`None` never matches).
    pub(super) fn holds(&self, global: Option<u64>) -> bool {
        global.is_some() && self.global == global
    }

    /// The namespaces `touched`, and those whose routes read one of them.
    pub(super) fn readers_of(&self, touched: &std::collections::HashSet<String>) -> Dirty {
        let mut out: Dirty = touched.iter().cloned().collect();
        for (ns, part) in &self.parts {
            if part.deps.iter().any(|d| touched.contains(d)) {
                out.insert(ns.clone());
            }
        }
        out
    }

    /// Drops the shares of `namespaces`.
    pub(super) fn forget(&mut self, namespaces: &[&String]) {
        for ns in namespaces {
            if let Some(part) = self.parts.remove(ns.as_str()) {
                for age in &part.kept {
                    self.routes.remove(age);
                }
                for age in &part.kept_policies {
                    self.policies.remove(age);
                }
            }
        }
    }

    /// Every route's share, oldest first.
    pub(super) fn routes(&self) -> Vec<&RoutePart> {
        self.routes.values().collect()
    }

    /// Every policy's outcome, oldest first.
    pub(super) fn policies(&self) -> Vec<Arc<PolicyOutcome>> {
        self.policies.values().cloned().collect()
    }

    /// How many namespaces have a share.
    pub(super) fn len(&self) -> usize {
        self.parts.len()
    }
}

/// The objects of the namespaces being translated again: their routes,
/// policies and Namespace objects, and the Services and EndpointSlices of
/// those namespaces and of the ones their backendRefs name.
pub(super) struct Subset {
    routes: Vec<Arc<TlsRoute>>,
    policies: Vec<Arc<SeedlinkPolicy>>,
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
    namespaces: Vec<Arc<Namespace>>,
}

impl Subset {
    /// The objects of the namespaces `dirty` and what their routes read,
    /// found through `places` (no walk over every object).
    pub(super) fn of(
        objects: &Objects<'_>,
        dirty: &HashSet<String>,
        places: &mut super::placed::Places,
    ) -> Subset {
        let own: HashSet<&str> = dirty.iter().map(String::as_str).collect();
        let routes = places.routes.within(objects.routes, &own);
        let mut read = own.clone();
        read.extend(routes.iter().flat_map(|r| backend_namespaces(r)));
        Subset {
            services: places.services.within(objects.services, &read),
            slices: places.slices.within(objects.slices, &read),
            routes,
            policies: places.policies.within(objects.policies, &own),
            namespaces: places.namespaces.within(objects.namespaces, &own),
        }
    }

    /// `all` with only these objects of the namespaced kinds.
    pub(super) fn objects<'a>(&'a self, all: &Objects<'a>) -> Objects<'a> {
        Objects {
            gateway: all.gateway,
            class: all.class,
            gateways: all.gateways,
            classes: all.classes,
            listeners: all.listeners,
            namespaces: &self.namespaces,
            grants: all.grants,
            routes: &self.routes,
            policies: &self.policies,
            services: &self.services,
            slices: &self.slices,
        }
    }
}
