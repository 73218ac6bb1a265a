//! The incremental translation against a whole one: the same objects, the
//! same passes, the same result; and only the namespaces that changed are
//! translated again.

use std::hash::{Hash, Hasher};

use super::*;

/// `o` as an API server gives it: with a `resourceVersion` that changes
/// whenever its content does (and, for one without, a generation likewise).
fn stamp<K: kube::Resource + Clone + serde::Serialize>(o: &K) -> K {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(o).unwrap().hash(&mut h);
    let v = h.finish() >> 1;
    let mut x = o.clone();
    x.meta_mut().resource_version = Some(v.to_string());
    if x.meta().generation.is_none() {
        x.meta_mut().generation = Some(i64::try_from(v).unwrap());
    }
    x
}

fn stamped<K: kube::Resource + Clone + serde::Serialize>(all: &[Arc<K>]) -> Vec<Arc<K>> {
    all.iter().map(|o| Arc::new(stamp(o.as_ref()))).collect()
}

fn versioned(w: &World) -> World {
    World {
        routes: stamped(&w.routes),
        policies: stamped(&w.policies),
        services: stamped(&w.services),
        slices: stamped(&w.slices),
        gateway: w.gateway.as_ref().map(stamp),
        namespaces: stamped(&w.namespaces),
        grants: stamped(&w.grants),
    }
}

fn tenant(w: &mut World, i: usize) {
    let ns = format!("t{i}");
    w.routes.push(route(
        &ns,
        "api",
        &format!("2026-01-01T00:00:{i:02}Z"),
        &[&format!("api.{i}.example")],
        "kube-apiserver",
        443,
    ));
    w.services
        .push(service(&ns, "kube-apiserver", 443, "https"));
    let address = format!("10.0.0.{}", i + 1);
    w.slices.push(slice(
        &ns,
        "kube-apiserver",
        "https",
        &[(address.as_str(), Some(true))],
    ));
    w.namespaces.push(namespace(&ns, json!({})));
}

/// The translators see the same world: `whole` without versions (every
/// pass translates everything), `incremental` with them, and `told` told
/// which namespaces changed, as the watches tell it.
struct Pair {
    whole: Translator,
    incremental: Translator,
    told: Translator,
    /// The world `told` last saw.
    last: Option<World>,
}

/// Each object's namespace (a Namespace's own name) and version.
fn versions<K: kube::Resource>(all: &[Arc<K>], kind: u8) -> Vec<(u8, String, String, String)> {
    all.iter()
        .map(|o| {
            let m = o.meta();
            let ns = m.namespace.clone().or(m.name.clone()).unwrap_or_default();
            let name = m.name.clone().unwrap_or_default();
            (
                kind,
                ns,
                name,
                m.resource_version.clone().unwrap_or_default(),
            )
        })
        .collect()
}

/// The namespaces whose objects differ between `a` and `b`: what the
/// watches' events touch.
fn touched(a: &World, b: &World) -> HashSet<String> {
    let all = |w: &World| -> HashSet<(u8, String, String, String)> {
        let mut v = versions(&w.routes, 1);
        v.extend(versions(&w.policies, 2));
        v.extend(versions(&w.services, 3));
        v.extend(versions(&w.slices, 4));
        v.extend(versions(&w.namespaces, 5));
        v.extend(versions(&w.grants, 6));
        v.into_iter().collect()
    };
    let (a, b) = (all(a), all(b));
    a.symmetric_difference(&b).map(|x| x.1.clone()).collect()
}

impl Pair {
    fn new() -> Pair {
        Pair {
            whole: Translator::default(),
            incremental: Translator::default(),
            told: Translator::default(),
            last: None,
        }
    }

    /// The incremental result (asserted equal to the whole one, and to
    /// the one told what changed, which translates no more) and how many
    /// namespaces it translated again.
    fn pass(&mut self, w: &World) -> (Translation, usize) {
        let whole = w.translate(&mut self.whole);
        let now = versioned(w);
        let incremental = now.translate(&mut self.incremental);
        assert_eq!(incremental, whole);
        let told = self.last.as_ref().map(|last| touched(last, &now));
        let t = now.translate_touched(&mut self.told, told.as_ref());
        assert_eq!(t, whole, "told {told:?}");
        assert_eq!(self.told.retranslated, self.incremental.retranslated);
        self.last = Some(now);
        (incremental, self.incremental.retranslated)
    }
}

fn set_slice(w: &mut World, ns: &str, address: &str) {
    w.slices
        .retain(|s| s.metadata.namespace.as_deref() != Some(ns));
    w.slices.push(slice(
        ns,
        "kube-apiserver",
        "https",
        &[(address, Some(true))],
    ));
}

/// Five tenants, t0 with a policy, both translators past their first
/// pass.
fn five() -> (World, Pair) {
    let mut w = one_shoot();
    w.routes.clear();
    w.services.clear();
    w.slices.clear();
    for i in 0..5 {
        tenant(&mut w, i);
    }
    w.policies.push(policy(
        "t0",
        "acl",
        "2026-01-01T00:00:00Z",
        "api",
        &["10.1.0.0/16"],
    ));
    let mut p = Pair::new();
    assert_eq!(p.pass(&w).1, 5);
    (w, p)
}

#[test]
fn a_pass_translates_only_the_namespaces_that_changed_and_agrees_with_a_whole_one() {
    let (mut w, mut p) = five();
    let (t, again) = p.pass(&w);
    assert_eq!((t.control_planes.len(), again), (5, 0));

    // One tenant's endpoints.
    set_slice(&mut w, "t1", "10.0.9.1");
    let (t, again) = p.pass(&w);
    assert_eq!(again, 1);
    let t1 = t
        .control_planes
        .iter()
        .find(|c| c.name == "t1.api")
        .unwrap();
    assert_eq!(t1.endpoints, vec!["10.0.9.1:6443".to_string()]);

    // One tenant's policy made invalid: its last good one still holds.
    w.policies[0] = policy("t0", "acl", "2026-01-01T00:00:00Z", "api", &["not a cidr"]);
    assert_eq!(p.pass(&w).1, 1);

    // A route removed: nothing to translate, its control plane gone.
    w.routes
        .retain(|r| r.metadata.namespace.as_deref() != Some("t2"));
    let (t, again) = p.pass(&w);
    assert_eq!((t.control_planes.len(), again), (4, 0));

    // A tenant that takes another's name stays refused while the other
    // holds it, translated again or not.
    w.routes.push(route(
        "t5",
        "api",
        "2025-01-01T00:00:00Z",
        &["api.3.example"],
        "kube-apiserver",
        443,
    ));
    let (t, again) = p.pass(&w);
    assert_eq!(again, 1);
    assert_eq!(t.control_planes.last().unwrap().name, "t5.api");
    assert_eq!(p.pass(&w).1, 0);
}

/// A namespace translated again keeps the `Arc` of every outcome and
/// control plane that came out equal: a slice's new address replaces its
/// control plane alone, and a Service no route names replaces nothing.
#[test]
fn what_comes_out_equal_keeps_its_arc() {
    let (mut w, mut p) = five();
    let (before, _) = p.pass(&w);
    let route_of = |t: &Translation, ns: &str| {
        let r = t.routes.iter().find(|r| r.key.namespace == ns);
        r.cloned().unwrap()
    };
    let cp_of = |t: &Translation, name: &str| {
        let c = t.control_planes.iter().find(|c| c.name == name);
        c.cloned().unwrap()
    };
    set_slice(&mut w, "t0", "10.0.9.1");
    let (moved, again) = p.pass(&w);
    assert_eq!(again, 1);
    assert!(Arc::ptr_eq(
        &route_of(&before, "t0"),
        &route_of(&moved, "t0")
    ));
    assert!(Arc::ptr_eq(&before.policies[0], &moved.policies[0]));
    assert!(!Arc::ptr_eq(
        &cp_of(&before, "t0.api"),
        &cp_of(&moved, "t0.api")
    ));
    // Another Service in the namespace: translated again, all equal.
    w.services.push(service("t0", "etcd", 2379, "client"));
    let (same, again) = p.pass(&w);
    assert_eq!(again, 1);
    assert!(Arc::ptr_eq(
        &cp_of(&moved, "t0.api"),
        &cp_of(&same, "t0.api")
    ));
    assert!(Arc::ptr_eq(&route_of(&moved, "t0"), &route_of(&same, "t0")));
}

#[test]
fn what_other_namespaces_and_the_gateway_change_translates_the_readers_again() {
    let (mut w, mut p) = five();
    // A label on a namespace.
    w.namespaces[3] = namespace("t3", json!({"team": "x"}));
    assert_eq!(p.pass(&w).1, 1);

    // A backend in another namespace: its changes translate the route's.
    w.routes
        .retain(|r| r.metadata.namespace.as_deref() != Some("t4"));
    w.routes.push(route_into(
        "t4",
        "2026-01-01T00:00:04Z",
        "api.4.example",
        "t1",
    ));
    w.grants.push(grant("t1", "t4", None));
    assert_eq!(
        p.pass(&w).1,
        2,
        "t4's new route, and t1 whose grant only t4's route reads"
    );
    // Another tenant's grant is nobody else's business.
    w.grants.push(grant("t2", "t0", None));
    assert_eq!(p.pass(&w).1, 1, "t2 only");
    set_slice(&mut w, "t1", "10.0.9.2");
    let (t, again) = p.pass(&w);
    assert_eq!(again, 2, "t1 and t4, whose route reads t1's Service");
    let t4 = t
        .control_planes
        .iter()
        .find(|c| c.name == "t4.api")
        .unwrap();
    assert_eq!(t4.endpoints, vec!["10.0.9.2:6443".to_string()]);

    // The Gateway: every namespace.
    w.gateway = gateway(json!({"namespaces": {"from": "Same"}}));
    let (t, again) = p.pass(&w);
    assert_eq!((t.control_planes.len(), again), (0, 5));
}
