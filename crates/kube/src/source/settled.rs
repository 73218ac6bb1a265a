//! What a status pass found right, per object: looked up by the object's
//! namespace and name as borrowed from it (no key built per object per
//! pass), and forgotten when a whole walk did not see the object.

use std::sync::Arc;

use foldhash::HashMap;
use kube::Resource;

use crate::translate::RouteOutcome;

/// What a route's status was last found right from: the route's
/// `resourceVersion` (a write to it, by anyone, changes it), its outcome
/// (shared with the translation's memo, so the same `Arc` while its
/// namespace was not translated again; held, so its address is never
/// reused meanwhile) and the Gateways served.
pub(super) struct Settled {
    pub(super) version: Option<String>,
    /// `None`: the route is not one seedlink serves.
    pub(super) outcome: Option<Arc<RouteOutcome>>,
    pub(super) served: u64,
}

impl Settled {
    /// Whether the route's status was found right from this version,
    /// outcome and Gateways served.
    pub(super) fn holds(
        &self,
        version: &Option<String>,
        outcome: Option<&Arc<RouteOutcome>>,
        served: u64,
    ) -> bool {
        self.version.is_some()
            && self.version == *version
            && self.served == served
            && match (outcome, &self.outcome) {
                (Some(o), Some(w)) => Arc::ptr_eq(o, w),
                (None, None) => true,
                _ => false,
            }
    }
}

/// The lists a status walk last went through whole, finding every
/// object's status right (nothing written, nothing refused, no Event to
/// retry): while a pass hands over the same objects and the same outcomes
/// (the same `Arc`s in the same places: the stores' lists keep their
/// order, and the translation's memo keeps an equal outcome's `Arc`) and
/// the same Gateways served, every object is still right and the walk is
/// skipped. Any write to any of the objects (a status written, by anyone)
/// replaces its `Arc` in the store's list.
pub(super) struct Walked<O, T> {
    objects: Vec<Arc<O>>,
    outcomes: Vec<Arc<T>>,
    served: u64,
}

impl<O, T> Walked<O, T> {
    pub(super) fn new(objects: &[Arc<O>], outcomes: &[Arc<T>], served: u64) -> Self {
        Walked {
            objects: objects.to_vec(),
            outcomes: outcomes.to_vec(),
            served,
        }
    }

    /// Whether `objects`, `outcomes` and `served` are the ones walked.
    pub(super) fn holds(&self, objects: &[Arc<O>], outcomes: &[Arc<T>], served: u64) -> bool {
        fn same<X>(a: &[Arc<X>], b: &[Arc<X>]) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y))
        }
        self.served == served && same(&self.objects, objects) && same(&self.outcomes, outcomes)
    }
}

/// An object's namespace and name, borrowed.
pub(super) fn names<K: Resource>(o: &K) -> (&str, &str) {
    let m = o.meta();
    (
        m.namespace.as_deref().unwrap_or_default(),
        m.name.as_deref().unwrap_or_default(),
    )
}

/// A map every pass walks for every tenant: foldhash (seeded per process)
/// rather than SipHash, whose cost showed in the profile at 1,000 tenants.
pub(super) type FastMap<K, V> = foldhash::HashMap<K, V>;

/// Per namespace and name: what an object's status was last found right
/// from, and the walk that last saw it. foldhash, seeded per process:
/// every pass looks up every route and policy.
pub(super) struct SettledMap<V> {
    by_namespace: HashMap<String, HashMap<String, (V, u64)>>,
    walk: u64,
    /// Objects held.
    held: usize,
    /// Objects held that this walk saw.
    seen: usize,
}

impl<V> Default for SettledMap<V> {
    fn default() -> Self {
        SettledMap {
            by_namespace: HashMap::default(),
            walk: 0,
            held: 0,
            seen: 0,
        }
    }
}

impl<V> SettledMap<V> {
    /// Starts a walk over the objects.
    pub(super) fn begin(&mut self) {
        self.walk += 1;
        self.seen = 0;
    }

    /// Whether `namespace/name` was found right from what `same` accepts:
    /// then it is kept (seen by this walk); if not, it is forgotten.
    pub(super) fn still(
        &mut self,
        namespace: &str,
        name: &str,
        same: impl FnOnce(&V) -> bool,
    ) -> bool {
        let Some(names) = self.by_namespace.get_mut(namespace) else {
            return false;
        };
        match names.get_mut(name) {
            Some((v, seen)) if same(v) => {
                if *seen != self.walk {
                    *seen = self.walk;
                    self.seen += 1;
                }
                true
            }
            Some(_) => {
                if let Some((_, seen)) = names.remove(name) {
                    self.held = self.held.saturating_sub(1);
                    self.seen = self.seen.saturating_sub(usize::from(seen == self.walk));
                }
                if names.is_empty() {
                    self.by_namespace.remove(namespace);
                }
                false
            }
            None => false,
        }
    }

    /// `namespace/name` found right from `v`.
    pub(super) fn settle(&mut self, namespace: &str, name: &str, v: V) {
        let was = self
            .by_namespace
            .entry(namespace.to_string())
            .or_default()
            .insert(name.to_string(), (v, self.walk));
        match was {
            Some((_, seen)) if seen == self.walk => {}
            Some(_) => self.seen += 1,
            None => (self.held, self.seen) = (self.held + 1, self.seen + 1),
        }
    }

    /// Ends a walk that saw every object: those it did not see are gone.
    /// (A walk cut short leaves them until the next whole one.) When the
    /// walk saw every object held, the usual case, nothing is looked at.
    pub(super) fn end(&mut self) {
        if self.seen == self.held {
            return;
        }
        let walk = self.walk;
        self.by_namespace.retain(|_, names| {
            names.retain(|_, (_, seen)| *seen == walk);
            !names.is_empty()
        });
        self.held = self.seen;
    }

    /// How many objects are settled.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        let n = self.by_namespace.values().map(|n| n.len()).sum();
        assert_eq!(n, self.held, "the count held");
        assert!(
            self.by_namespace.values().all(|n| !n.is_empty()),
            "no empty namespace kept"
        );
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kept while the same, forgotten when not or when a whole walk
    /// missed it; a walk cut short forgets nothing.
    #[test]
    fn an_object_stays_settled_while_it_is_the_same_and_seen() {
        let mut s = SettledMap::default();
        s.begin();
        s.settle("t1", "r", 1);
        s.settle("t2", "r", 2);
        s.end();
        assert_eq!(s.len(), 2);
        s.begin();
        assert!(s.still("t1", "r", |v| *v == 1));
        assert!(!s.still("t2", "r", |v| *v == 3), "changed");
        assert!(!s.still("t3", "r", |_| true), "never settled");
        assert_eq!(s.len(), 1, "the changed one is forgotten at once");
        s.end();
        s.begin();
        s.settle("t2", "r", 3);
        // Cut short: t1 was not seen, and stays.
        assert_eq!(s.len(), 2);
        s.begin();
        assert!(s.still("t2", "r", |v| *v == 3));
        s.end();
        assert_eq!(s.len(), 1, "t1 gone");
        assert!(!s.still("t1", "r", |_| true));
    }

    /// A walk that saw everything forgets nothing and looks at nothing;
    /// one object seen twice or settled again counts once.
    #[test]
    fn the_count_of_objects_seen_is_kept_through_every_path() {
        let mut s = SettledMap::default();
        s.begin();
        s.settle("a", "r", 1);
        s.settle("a", "r", 2);
        s.settle("b", "r", 1);
        s.end();
        assert_eq!(s.len(), 2);
        s.begin();
        assert!(s.still("a", "r", |v| *v == 2));
        assert!(s.still("a", "r", |v| *v == 2), "seen twice");
        assert!(!s.still("b", "r", |v| *v == 9), "changed: forgotten");
        s.settle("b", "r", 9);
        s.end();
        assert_eq!(s.len(), 2);
        s.begin();
        assert!(s.still("a", "r", |_| true));
        s.end();
        assert_eq!(s.len(), 1, "b not seen: gone");
        s.begin();
        s.settle("a", "r", 3);
        s.settle("c", "r", 1);
        s.end();
        assert_eq!(s.len(), 2);
    }
}
