//! A Gateway's `attachedRoutes` per listener, kept from pass to pass.
//!
//! Counting them reads every route's outcome, its parents and their keys:
//! a few cache misses per route, 5% of the gateway's CPU at a thousand
//! tenants when done on every pass. A pass replaces the outcomes of the
//! namespaces it translated again and shares the others (the same `Arc`
//! in the same place), so here a route whose outcome is the one counted
//! last time counts as it did, without being read: a pass reads what it
//! replaced.

use std::sync::Arc;

use super::outcome::{Key, RouteOutcome, Translation};

/// The most listeners counted apart (a Gateway has at most 64, the
/// Gateway API's bound); past them the counts are made by a walk every
/// time.
const MOST: usize = 64;

/// One Gateway's `attachedRoutes`, as [`Translation::attached_by_listener`]
/// counts them, updated from the routes replaced since the last count.
#[derive(Default)]
pub struct AttachedCounts {
    gateway: Option<Key>,
    /// The outcomes counted, in the translation's order.
    routes: Vec<Arc<RouteOutcome>>,
    /// Per route in `routes`: the listeners it is counted on (bits into
    /// `listeners`).
    on: Vec<u64>,
    listeners: Vec<String>,
    counts: Vec<i64>,
    /// Past [`MOST`] listeners: the walk's counts.
    walked: Option<std::collections::HashMap<String, i32>>,
}

impl AttachedCounts {
    /// Counts the routes of `t` attached to `gateway`: the routes in the
    /// same place as last time, with the same outcome, are not read.
    pub fn count(&mut self, t: &Translation, gateway: &Key) {
        let same = self.walked.is_none()
            && self.gateway.as_ref() == Some(gateway)
            && self.routes.len() == t.routes.len();
        if !same {
            *self = AttachedCounts {
                gateway: Some(gateway.clone()),
                ..AttachedCounts::default()
            };
        }
        for (i, r) in t.routes.iter().enumerate() {
            if same && Arc::ptr_eq(&self.routes[i], r) {
                continue;
            }
            let Some(bits) = self.bits(r, gateway) else {
                self.walk(t, gateway);
                return;
            };
            if same {
                self.add(self.on[i], -1);
                self.routes[i] = r.clone();
                self.on[i] = bits;
            } else {
                self.routes.push(r.clone());
                self.on.push(bits);
            }
            self.add(bits, 1);
        }
    }

    /// The routes counted on listener `name`.
    pub fn get(&self, name: &str) -> i32 {
        if let Some(w) = &self.walked {
            return w.get(name).copied().unwrap_or(0);
        }
        let at = self.listeners.iter().position(|l| l == name);
        let n = at.and_then(|i| self.counts.get(i)).copied().unwrap_or(0);
        i32::try_from(n).unwrap_or(i32::MAX)
    }

    /// The listeners of `gateway` that route `r` is accepted on, as bits;
    /// `None` past [`MOST`] listeners.
    fn bits(&mut self, r: &RouteOutcome, gateway: &Key) -> Option<u64> {
        let mut bits = 0u64;
        let ours = r
            .parents
            .iter()
            .filter(|p| p.accepted.ok && p.gateway == *gateway);
        for l in ours.flat_map(|p| &p.listeners) {
            let i = match self.listeners.iter().position(|x| x == l) {
                Some(i) => i,
                None if self.listeners.len() < MOST => {
                    self.listeners.push(l.clone());
                    self.counts.push(0);
                    self.listeners.len() - 1
                }
                None => return None,
            };
            bits |= 1 << i;
        }
        Some(bits)
    }

    /// Adds `by` to the count of every listener in `bits`.
    fn add(&mut self, bits: u64, by: i64) {
        for (i, n) in self.counts.iter_mut().enumerate() {
            if bits & (1 << i) != 0 {
                *n += by;
            }
        }
    }

    /// Past [`MOST`] listeners: the walk's counts, kept until the next
    /// count.
    fn walk(&mut self, t: &Translation, gateway: &Key) {
        let counts = t.attached_by_listener(gateway);
        *self = AttachedCounts {
            walked: Some(
                counts
                    .into_iter()
                    .map(|(l, n)| (l.to_string(), n))
                    .collect(),
            ),
            ..AttachedCounts::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::outcome::{ParentOutcome, Verdict};

    fn key(ns: &str, name: &str) -> Key {
        Key {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    /// Route `i` attached to `gateway` on `listeners` (accepted when `ok`).
    fn route(i: usize, gateway: &Key, listeners: &[&str], ok: bool) -> Arc<RouteOutcome> {
        let verdict = match ok {
            true => Verdict::yes("Accepted", ""),
            false => Verdict::no("NotAllowedByListeners", ""),
        };
        Arc::new(RouteOutcome {
            key: key(&format!("t-{i}"), "r"),
            generation: Some(1),
            parents: vec![ParentOutcome {
                parent_ref: Default::default(),
                gateway: gateway.clone(),
                accepted: verdict.clone(),
                listeners: listeners.iter().map(|l| l.to_string()).collect(),
            }],
            accepted: verdict.clone(),
            resolved: verdict,
            control_plane: None,
        })
    }

    fn same_as_the_walk(c: &AttachedCounts, t: &Translation, gateway: &Key, what: &str) {
        let walked = t.attached_by_listener(gateway);
        for l in ["tls", "other", "third", "none"] {
            let want = walked.get(l).copied().unwrap_or(0);
            assert_eq!(c.get(l), want, "{what}: listener {l}");
        }
    }

    /// Through replaced, added, removed and refused routes, another
    /// Gateway and too many listeners, the counts are the walk's.
    #[test]
    fn the_counts_are_the_walks_through_every_change() {
        let (gw, other) = (key("sys", "seedlink"), key("sys", "other"));
        let mut t = Translation {
            routes: (0..20).map(|i| route(i, &gw, &["tls"], true)).collect(),
            ..Translation::default()
        };
        let mut c = AttachedCounts::default();
        c.count(&t, &gw);
        same_as_the_walk(&c, &t, &gw, "first");
        let g = || key("sys", "seedlink");
        type Step = Box<dyn Fn(&mut Translation)>;
        let steps: Vec<(&str, Step)> = vec![
            (
                "a route moved to two listeners",
                Box::new(move |t| t.routes[3] = route(3, &g(), &["tls", "other", "tls"], true)),
            ),
            (
                "a route refused",
                Box::new(move |t| t.routes[4] = route(4, &g(), &["tls"], false)),
            ),
            (
                "a route on another Gateway",
                Box::new(|t| t.routes[5] = route(5, &key("sys", "other"), &["tls"], true)),
            ),
            (
                "an equal copy",
                Box::new(move |t| t.routes[6] = route(6, &g(), &["tls"], true)),
            ),
            (
                "a route added",
                Box::new(move |t| t.routes.push(route(20, &g(), &["third"], true))),
            ),
            (
                "a route removed",
                Box::new(|t| {
                    t.routes.remove(0);
                }),
            ),
            ("nothing", Box::new(|_| {})),
        ];
        for (what, step) in steps {
            step(&mut t);
            c.count(&t, &gw);
            same_as_the_walk(&c, &t, &gw, what);
        }
        c.count(&t, &other);
        same_as_the_walk(&c, &t, &other, "another Gateway");
        let many: Vec<String> = (0..=MOST).map(|i| format!("l{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).chain(["tls"]).collect();
        t.routes[1] = route(1, &gw, &many, true);
        c.count(&t, &gw);
        same_as_the_walk(&c, &t, &gw, "past 64 listeners");
        assert_eq!(c.get("l64"), 1);
        t.routes[1] = route(1, &gw, &["tls"], true);
        c.count(&t, &gw);
        same_as_the_walk(&c, &t, &gw, "back under 64");
    }
}
