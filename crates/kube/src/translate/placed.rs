//! Where the objects of a reflector store's list are, by namespace, kept
//! from pass to pass. A pass told which namespaces changed reads only
//! their objects; finding them by a walk over every object costs a cache
//! miss or two per object (the object, its namespace's bytes), which at a
//! thousand tenants was the largest single cost of a pass. kube-runtime's
//! stores are flat maps with no index, so the index is kept here.
//!
//! A store lists its objects in the order of its map, which stays while
//! the set of objects does: an update replaces an object in its place. A
//! pass compares the new list with the one it saw, pointer by pointer (no
//! object is read); an object replaced in its place keeps its place if it
//! stays in the same namespace, and anything else (a list of another
//! length, a place now in another namespace) places every object again.

use std::sync::Arc;

use foldhash::{HashMap, HashSet};
use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Resource;

use crate::crd::SeedlinkPolicy;

/// One kind's objects by namespace.
pub(super) struct Placed<K> {
    /// The list last seen (held: no address in it is reused meanwhile).
    seen: Vec<Arc<K>>,
    /// Namespace → places in `seen`, ascending.
    at: HashMap<String, Vec<usize>>,
    /// An object's namespace (a Namespace object's: its own name).
    of: fn(&K) -> &str,
}

fn namespace_of<K: Resource>(o: &K) -> &str {
    o.meta().namespace.as_deref().unwrap_or_default()
}

fn name_of<K: Resource>(o: &K) -> &str {
    o.meta().name.as_deref().unwrap_or_default()
}

impl<K: Resource> Placed<K> {
    fn new(of: fn(&K) -> &str) -> Placed<K> {
        Placed {
            seen: Vec::new(),
            at: HashMap::default(),
            of,
        }
    }

    /// The objects of `all` in the namespaces `wanted`, in `all`'s order.
    pub(super) fn within(&mut self, all: &[Arc<K>], wanted: &HashSet<&str>) -> Vec<Arc<K>> {
        self.follow(all);
        let mut places: Vec<usize> = wanted
            .iter()
            .filter_map(|ns| self.at.get(*ns))
            .flatten()
            .copied()
            .collect();
        places.sort_unstable();
        places
            .into_iter()
            .filter_map(|i| all.get(i).cloned())
            .collect()
    }

    /// Brings the places up to `all`; whether every object was placed
    /// again.
    fn follow(&mut self, all: &[Arc<K>]) -> bool {
        if self.seen.len() == all.len() && self.replaced_in_place(all) {
            return false;
        }
        self.seen = all.to_vec();
        self.at.clear();
        for (i, o) in all.iter().enumerate() {
            self.at.entry((self.of)(o).to_string()).or_default().push(i);
        }
        true
    }

    /// Whether every object of `all` (as long as `seen`) is the one seen
    /// in its place, or one in the same namespace (then seen from now on).
    fn replaced_in_place(&mut self, all: &[Arc<K>]) -> bool {
        for (was, now) in self.seen.iter_mut().zip(all) {
            if Arc::ptr_eq(was, now) {
                continue;
            }
            if (self.of)(was) != (self.of)(now) {
                return false;
            }
            *was = now.clone();
        }
        true
    }
}

/// The places of every kind a pass picks by namespace.
pub(super) struct Places {
    pub(super) routes: Placed<TlsRoute>,
    pub(super) policies: Placed<SeedlinkPolicy>,
    pub(super) services: Placed<Service>,
    pub(super) slices: Placed<EndpointSlice>,
    pub(super) namespaces: Placed<Namespace>,
}

impl std::fmt::Debug for Places {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Places")
            .field("routes", &self.routes.seen.len())
            .field("policies", &self.policies.seen.len())
            .field("services", &self.services.seen.len())
            .field("slices", &self.slices.seen.len())
            .field("namespaces", &self.namespaces.seen.len())
            .finish()
    }
}

impl Default for Places {
    fn default() -> Places {
        Places {
            routes: Placed::new(namespace_of),
            policies: Placed::new(namespace_of),
            services: Placed::new(namespace_of),
            slices: Placed::new(namespace_of),
            namespaces: Placed::new(name_of),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(ns: &str, name: &str) -> Arc<Service> {
        let mut s = Service::default();
        s.metadata.namespace = Some(ns.into());
        s.metadata.name = Some(name.into());
        Arc::new(s)
    }

    fn names(v: &[Arc<Service>]) -> Vec<String> {
        v.iter()
            .map(|s| format!("{}/{}", namespace_of(s.as_ref()), name_of(s.as_ref())))
            .collect()
    }

    fn wanted<'a>(ns: &[&'a str]) -> HashSet<&'a str> {
        ns.iter().copied().collect()
    }

    /// The same answer as a walk over every object, whatever changed in
    /// the list; placed again only when a place changed namespace or the
    /// list its length.
    #[test]
    fn a_namespaces_objects_are_found_as_a_walk_finds_them() {
        let walk = |all: &[Arc<Service>], w: &HashSet<&str>| -> Vec<String> {
            let v: Vec<Arc<Service>> = all
                .iter()
                .filter(|o| w.contains(namespace_of(o.as_ref())))
                .cloned()
                .collect();
            names(&v)
        };
        let mut p = Placed::new(namespace_of);
        let mut all = vec![svc("a", "1"), svc("b", "1"), svc("a", "2"), svc("c", "1")];
        let w = wanted(&["a", "c"]);
        assert_eq!(names(&p.within(&all, &w)), walk(&all, &w));
        assert_eq!(names(&p.within(&all, &w)), ["a/1", "a/2", "c/1"]);
        // Replaced in place, same namespace: no new placing.
        all[2] = svc("a", "2");
        assert!(!p.follow(&all));
        assert_eq!(names(&p.within(&all, &w)), walk(&all, &w));
        // Another object in a place, of another namespace.
        all[1] = svc("c", "9");
        assert!(p.follow(&all));
        assert_eq!(names(&p.within(&all, &w)), ["a/1", "c/9", "a/2", "c/1"]);
        // One more, one fewer.
        all.push(svc("b", "2"));
        assert_eq!(names(&p.within(&all, &wanted(&["b"]))), ["b/2"]);
        all.remove(0);
        assert_eq!(names(&p.within(&all, &w)), walk(&all, &w));
        assert!(p.within(&all, &wanted(&["none"])).is_empty());
    }

    /// A Namespace object is placed by its own name.
    #[test]
    fn a_namespace_object_is_placed_by_its_name() {
        let mut n = Namespace::default();
        n.metadata.name = Some("t1".into());
        let all = vec![Arc::new(n)];
        let mut p = Places::default();
        assert_eq!(p.namespaces.within(&all, &wanted(&["t1"])).len(), 1);
        assert!(p.namespaces.within(&all, &wanted(&[""])).is_empty());
    }
}
