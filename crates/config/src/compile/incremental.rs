//! Compiling only what changed. When a configuration differs from the
//! running snapshot's in its control planes from Kubernetes alone (every
//! pass of the Kubernetes source), the unchanged ones keep what they
//! compiled to (the same `Arc<ControlPlane>`, so their endpoints' live
//! state, and their entries in the route table), those gone or changed let
//! their entries go, and only the new and changed ones are compiled, each
//! admitted on its own. A pass then costs what changed, plus a copy of the
//! table, not a compile of every control plane (docs/ARCHITECTURE.md).
//!
//! A name stays with the control plane that holds it: a changed one that
//! now claims a name an unchanged one holds is refused, wherever the two
//! stand in the list (a full compile, on a reload of the file, decides by
//! their order). The Kubernetes source keeps first claims itself, so what
//! it hands over collides only through the file's own names.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::model::{ConfigFile, ControlPlane as ControlPlaneCfg};

use super::errors::{Collector, ConfigError, Refused};
use super::routes::{class_addresses, Routes};
use super::snapshot::Snapshot;

/// Whether `a` and `b` differ at most in their control planes from
/// Kubernetes (every field named, so that a new one is not forgotten).
pub(super) fn same_but_kubernetes(a: &ConfigFile, b: &ConfigFile) -> bool {
    let ConfigFile {
        admin,
        listeners,
        trusted_load_balancers,
        always_allowed,
        timeouts,
        limits,
        upstream,
        control_planes,
        kubernetes,
        migration,
        from_kubernetes: _,
    } = a;
    *admin == b.admin
        && *listeners == b.listeners
        && *trusted_load_balancers == b.trusted_load_balancers
        && *always_allowed == b.always_allowed
        && *timeouts == b.timeouts
        && *limits == b.limits
        && *upstream == b.upstream
        && *control_planes == b.control_planes
        && *kubernetes == b.kubernetes
        && *migration == b.migration
}

/// `file` compiled from `prev` (with which it is [`same_but_kubernetes`]):
/// the snapshot, and the control planes from Kubernetes refused.
pub(super) fn recompile(mut file: ConfigFile, prev: &Snapshot) -> (Snapshot, Refused) {
    let given = std::mem::take(&mut file.from_kubernetes);
    let before = &prev.file.from_kubernetes;
    let held = |name: &str| prev.control_planes.contains_key(name);
    let (kept, gone) = match in_place(&given, before, held) {
        Some(found) => found,
        None => {
            let kept = unchanged(&given, before);
            let gone = gone(&prev.file, &kept);
            (kept.at, gone)
        }
    };
    let mut b = Routes::new(Collector(Vec::new()), Some(prev), &prev.listeners);
    b.routes = prev.routes.clone();
    b.control_planes = prev.control_planes.clone();
    let_go(&mut b, &gone);
    let (admitted, refused) = admit(&mut b, given, &kept);
    file.from_kubernetes = admitted;
    let mut routes = b.routes;
    routes.exclusive = exclusive(&file);
    let snapshot = Snapshot {
        listeners: prev.listeners.clone(),
        admin: prev.admin,
        routes,
        control_planes: b.control_planes,
        trusted_lbs: prev.trusted_lbs.clone(),
        always_allowed: prev.always_allowed.clone(),
        timeouts: file.timeouts.clone(),
        limits: file.limits.clone(),
        upstream: file.upstream.clone(),
        file,
    };
    (snapshot, refused)
}

/// The control planes of `given`: those at `kept` as they are, the
/// others compiled into `b`, each admitted on its own. The admitted, in
/// their order, and the refused with their problems.
fn admit(
    b: &mut Routes<'_>,
    given: Vec<Arc<ControlPlaneCfg>>,
    kept: &[bool],
) -> (Vec<Arc<ControlPlaneCfg>>, Refused) {
    let mut admitted = Vec::with_capacity(given.len());
    let mut refused = Vec::new();
    // The claims of each refused control plane, undone only at the end:
    // until then they stand in the way of those after it, as in a full
    // compile's first attempt (a refused holder's edit never hands its
    // names to the next claimant).
    let mut undo = Vec::new();
    for (i, cp) in given.into_iter().enumerate() {
        if kept.get(i).copied().unwrap_or(false) {
            admitted.push(cp);
            continue;
        }
        let (errors, claims) = (b.c.0.len(), b.claims.len());
        b.control_plane(&format!("kubernetes[{i}]"), cp.as_ref(), true);
        if b.c.0.len() == errors {
            admitted.push(cp);
            continue;
        }
        undo.push(claims..b.claims.len());
        let problems = b.c.0.drain(errors..).map(relative).collect();
        refused.push((cp.name.clone(), problems));
    }
    for range in undo.into_iter().rev() {
        b.undo(range);
    }
    (admitted, refused)
}

/// The control planes of `given` that `before` holds as they are: their
/// places and names (a name given twice is kept once, the first time).
struct Unchanged<'a> {
    at: Vec<bool>,
    names: Names<'a>,
}

/// A set of names. Every pass looks up each of a thousand tenants' names
/// a few times: foldhash (seeded per process) rather than SipHash.
type Names<'a> = foldhash::HashSet<&'a str>;

fn unchanged<'a>(
    given: &[Arc<ControlPlaneCfg>],
    before: &'a [Arc<ControlPlaneCfg>],
) -> Unchanged<'a> {
    let before: foldhash::HashMap<&str, &'a Arc<ControlPlaneCfg>> =
        before.iter().map(|c| (c.name.as_str(), c)).collect();
    let mut kept = Unchanged {
        at: vec![false; given.len()],
        names: Names::default(),
    };
    // Only a name's first place in `given` may be kept (a later copy is
    // refused as a duplicate, as in a full compile).
    let mut seen = Names::default();
    for (i, cp) in given.iter().enumerate() {
        if !seen.insert(cp.name.as_str()) {
            continue;
        }
        let Some(&was) = before.get(cp.name.as_str()) else {
            continue;
        };
        // The source hands an unchanged control plane over as the same
        // `Arc`: no field-by-field comparison for those.
        if Arc::ptr_eq(was, cp) || was == cp {
            kept.names.insert(was.name.as_str());
            kept.at[i] = true;
        }
    }
    kept
}

/// What [`unchanged`] and [`gone`] find, found without a set of every
/// name when `given` is `before` with some places replaced (the same
/// length, every other place the same `Arc`): every pass whose changes
/// are edits, as the source hands over an unchanged control plane as the
/// same `Arc` in the same place. Only the replaced places are looked at:
/// one is kept when it equals the control plane `before` had under its
/// name at a replaced place, and is its name's first replaced place; the
/// names `before` had at replaced places and no kept place has are gone.
/// `None` (ask the full comparison) when the lengths differ, or a
/// replaced place takes a name `held` by the snapshot (a control plane of
/// the file's, or one at a place not replaced): only the full comparison
/// knows which of the two places comes first.
fn in_place<'a>(
    given: &[Arc<ControlPlaneCfg>],
    before: &'a [Arc<ControlPlaneCfg>],
    held: impl Fn(&str) -> bool,
) -> Option<(Vec<bool>, Names<'a>)> {
    if given.len() != before.len() {
        return None;
    }
    let replaced: Vec<usize> = (0..given.len())
        .filter(|&i| !Arc::ptr_eq(&given[i], &before[i]))
        .collect();
    let mut at = vec![true; given.len()];
    let was: foldhash::HashMap<&'a str, &'a Arc<ControlPlaneCfg>> = replaced
        .iter()
        .map(|&i| (before[i].name.as_str(), &before[i]))
        .collect();
    let mut gone: Names<'a> = was.keys().copied().collect();
    let mut seen = Names::default();
    for &i in &replaced {
        let cp = &given[i];
        let name = cp.name.as_str();
        let Some((&name, &w)) = was.get_key_value(name) else {
            if held(name) {
                return None;
            }
            at[i] = false;
            continue;
        };
        at[i] = seen.insert(name) && (Arc::ptr_eq(w, cp) || **w == **cp);
        if at[i] {
            gone.remove(name);
        }
    }
    Some((at, gone))
}

/// The control planes from Kubernetes in `before` not `kept` as they were.
fn gone<'a>(before: &'a ConfigFile, kept: &Unchanged<'_>) -> Names<'a> {
    let names = before.from_kubernetes.iter().map(|c| c.name.as_str());
    names.filter(|n| !kept.names.contains(n)).collect()
}

/// Takes the entries of the control planes `gone` out of the table.
fn let_go(b: &mut Routes<'_>, gone: &Names<'_>) {
    if gone.is_empty() {
        return;
    }
    let stays = |name: &str| !gone.contains(name);
    let r = &mut b.routes;
    for t in std::iter::once(&mut r.hosts).chain(r.scoped.values_mut()) {
        t.exact.retain(|_, cp| stays(&cp.name));
        t.wildcard.retain(|_, cp| stays(&cp.name));
    }
    r.scoped.retain(|_, t| t.len() > 0);
    r.destinations.retain(|_, d| stays(&d.control_plane.name));
    r.services.retain(|_, cp| stays(&cp.name));
    r.clusters.retain(|_, cp| stays(&cp.name));
    b.control_planes.retain(|name, _| stays(name));
}

/// The addresses that serve only their own names: a class Gateway's, and
/// those the control planes' `served_on` name.
fn exclusive(file: &ConfigFile) -> HashSet<std::net::IpAddr> {
    let class = file.kubernetes.iter().flat_map(class_addresses);
    class.chain(served_on(file)).collect()
}

/// The addresses the control planes' `served_on` name (each checked when
/// its control plane was admitted), canonical.
fn served_on(file: &ConfigFile) -> impl Iterator<Item = std::net::IpAddr> + '_ {
    file.control_planes
        .iter()
        .chain(file.from_kubernetes.iter().map(|c| c.as_ref()))
        .flat_map(|cp| &cp.served_on)
        .filter_map(|on| on.address.parse::<SocketAddr>().ok())
        .map(|sa| crate::routes::canonical(sa.ip()))
}

/// A problem's path relative to its control plane (`kubernetes[i].x` → `x`).
pub(super) fn relative(mut p: ConfigError) -> ConfigError {
    if let Some((_, rest)) = p.path.split_once(']') {
        p.path = rest.trim_start_matches('.').to_string();
    }
    p
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::{compile, compile_admitting, parse};
    use super::*;

    const FILE: &str = "
listeners: [{name: tls, address: '127.0.0.1:0'}, {name: connect, address: '127.0.0.1:0', protocol: http-connect}]
control_planes:
  - name: file
    hostnames: [file.example.com]
    endpoints: ['127.0.0.1:1']
";

    fn cp(name: &str, host: &str, dest: &str) -> ControlPlaneCfg {
        ControlPlaneCfg {
            name: name.into(),
            hostnames: vec![host.into()],
            endpoints: vec!["127.0.0.1:2".into()],
            destinations: vec![crate::model::DestinationCfg {
                name: dest.into(),
                endpoints: None,
                tunnel_target: None,
            }],
            cluster_id: Some(name.into()),
            ..Default::default()
        }
    }

    fn with(kube: Vec<ControlPlaneCfg>) -> ConfigFile {
        let mut f = parse(FILE).unwrap();
        f.from_kubernetes = kube.into_iter().map(Arc::new).collect();
        f
    }

    fn tenants(n: usize) -> Vec<ControlPlaneCfg> {
        (0..n)
            .map(|i| {
                cp(
                    &format!("t{i}"),
                    &format!("t{i}.example.com"),
                    &format!("outbound|443||t{i}.svc"),
                )
            })
            .collect()
    }

    /// What a snapshot routes, comparable: every name, destination,
    /// service address and cluster ID with its control plane.
    fn served(s: &Snapshot) -> Vec<String> {
        let r = &s.routes;
        let mut out: Vec<String> = r
            .hosts
            .exact
            .iter()
            .map(|(k, v)| format!("host {k} {}", v.name))
            .collect();
        out.extend(
            r.destinations
                .iter()
                .map(|(k, v)| format!("dest {k} {}", v.control_plane.name)),
        );
        out.extend(
            r.services
                .iter()
                .map(|(k, v)| format!("svc {k} {}", v.name)),
        );
        out.extend(
            r.clusters
                .iter()
                .map(|(k, v)| format!("id {k:?} {}", v.name)),
        );
        out.extend(s.control_planes.keys().map(|k| format!("cp {k}")));
        out.sort();
        out
    }

    /// A pass that adds, changes, removes and refuses control planes
    /// serves what a compile from nothing serves, and the unchanged ones
    /// keep what they compiled to.
    #[test]
    fn a_pass_serves_what_a_full_compile_serves() {
        let before = compile(with(tenants(6)), None).unwrap();
        let mut next = tenants(6);
        next.remove(2);
        next[0].hostnames = vec!["moved.example.com".into()];
        next.push(cp("new", "new.example.com", "outbound|443||new.svc"));
        // Refused: an endpoint that is no address.
        let mut bad = cp("bad", "bad.example.com", "outbound|443||bad.svc");
        bad.endpoints = vec!["no port".into()];
        next.push(bad);
        let (full, full_refused) = compile_admitting(with(next.clone()), None);
        let (pass, refused) = compile_admitting(with(next), Some(&before));
        let (full, pass) = (full.unwrap(), pass.unwrap());
        assert_eq!(served(&pass), served(&full));
        assert_eq!(refused, full_refused);
        assert_eq!(refused.len(), 1);
        assert_eq!(pass.file, full.file);
        assert!(Arc::ptr_eq(
            &pass.control_planes["t3"],
            &before.control_planes["t3"]
        ));
        assert!(!Arc::ptr_eq(
            &pass.control_planes["t0"],
            &before.control_planes["t0"]
        ));
        assert!(pass.routes.lookup("bad.example.com").is_none());
        assert!(pass.routes.lookup("t0.example.com").is_none());
    }

    /// A changed control plane that claims a name an unchanged one holds
    /// is refused, even when it comes first; the holder keeps it.
    #[test]
    fn a_name_stays_with_its_holder() {
        let before = compile(with(tenants(3)), None).unwrap();
        let mut next = tenants(3);
        next[0].hostnames.push("t2.example.com".into());
        let (pass, refused) = compile_admitting(with(next), Some(&before));
        let pass = pass.unwrap();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "t0");
        assert!(
            refused[0].1[0]
                .message
                .contains("already used by control plane \"t2\""),
            "{refused:?}"
        );
        assert_eq!(
            pass.routes
                .lookup("t2.example.com")
                .map(|c| c.name.as_str()),
            Some("t2")
        );
        // Refused as a whole: its old names are let go too.
        assert!(pass.routes.lookup("t0.example.com").is_none());
        assert!(!pass.control_planes.contains_key("t0"));
    }

    /// A control plane refused after claiming some names stands in the
    /// way of those after it in the same pass, then takes its names with
    /// it, as a compile from nothing does: the name is nobody's.
    #[test]
    fn a_refused_control_plane_leaves_nothing_claimed() {
        let before = compile(with(Vec::new()), None).unwrap();
        let mut first = cp("first", "shared.example.com", "outbound|443||shared.svc");
        first.service_addresses = vec!["10.0.0.1:443".into()];
        first.cluster_id = Some("not a valid id!".into());
        let mut second = cp("second", "shared.example.com", "outbound|443||shared.svc");
        second.service_addresses = vec!["10.0.0.1:443".into()];
        let list = vec![first, second];
        let (pass, refused) = compile_admitting(with(list.clone()), Some(&before));
        let (full, full_refused) = compile_admitting(with(list), None);
        let (pass, full) = (pass.unwrap(), full.unwrap());
        assert_eq!(refused, full_refused);
        assert_eq!(served(&pass), served(&full));
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(pass.routes.lookup("shared.example.com").is_none());
        assert!(!served(&pass)
            .iter()
            .any(|s| s.contains("first") || s.contains("second")));
    }

    /// A holder whose edit is refused does not hand its names to the
    /// route that keeps claiming them: neither serves the name, as in a
    /// compile from nothing, and the holder gets it back with its next
    /// valid edit.
    #[test]
    fn a_refused_edit_hands_no_name_to_a_squatter() {
        let holder = cp("a", "h.example.com", "outbound|443||a.svc");
        let squatter = cp("b", "h.example.com", "outbound|443||b.svc");
        let (before, refused) =
            compile_admitting(with(vec![holder.clone(), squatter.clone()]), None);
        let before = before.unwrap();
        assert_eq!(refused.len(), 1);
        let mut edit = holder.clone();
        edit.cluster_id = Some("not a valid id!".into());
        let list = vec![edit, squatter.clone()];
        let (pass, refused) = compile_admitting(with(list.clone()), Some(&before));
        let (full, full_refused) = compile_admitting(with(list), None);
        let pass = pass.unwrap();
        assert_eq!(refused, full_refused);
        assert_eq!(served(&pass), served(&full.unwrap()));
        assert!(
            pass.routes.lookup("h.example.com").is_none(),
            "the squatter got it"
        );
        let mut fixed = holder;
        fixed.endpoints = vec!["127.0.0.1:3".into()];
        let (next, refused) = compile_admitting(with(vec![fixed, squatter]), Some(&pass));
        let holder_now = next
            .unwrap()
            .routes
            .lookup("h.example.com")
            .map(|c| c.name.clone());
        assert_eq!(holder_now.as_deref(), Some("a"));
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].0, "b");
    }

    /// A name given twice keeps its first place: a later unchanged copy
    /// does not win over an earlier changed one.
    #[test]
    fn a_later_copy_of_a_name_is_not_kept() {
        let before = compile(with(tenants(1)), None).unwrap();
        let mut changed = tenants(1).remove(0);
        changed.endpoints = vec!["127.0.0.1:9".into()];
        let list = vec![changed, tenants(1).remove(0)];
        let (pass, refused) = compile_admitting(with(list.clone()), Some(&before));
        let (full, full_refused) = compile_admitting(with(list), None);
        assert_eq!(refused, full_refused);
        let (pass, full) = (pass.unwrap(), full.unwrap());
        assert_eq!(served(&pass), served(&full));
        assert_eq!(
            pass.control_planes["t0"].endpoints[0].address,
            "127.0.0.1:9"
        );
    }

    /// Where `given` is `before` with places replaced, [`in_place`] finds
    /// what the full comparison finds, or leaves it to it: a place
    /// replaced by an equal copy, by a change, by a new name, by a name
    /// another replaced place had, by a copy of a name held at a place
    /// not replaced, or of one of the file's.
    #[test]
    fn replaced_places_are_found_as_the_full_comparison_finds_them() {
        let before: Vec<Arc<ControlPlaneCfg>> = tenants(8).into_iter().map(Arc::new).collect();
        let snapshot = compile(with(tenants(8)), None).unwrap();
        let held = |n: &str| snapshot.control_planes.contains_key(n);
        let t = |i: usize| Arc::new(tenants(8).remove(i));
        let mut changed = tenants(8).remove(3);
        changed.endpoints = vec!["127.0.0.1:9".into()];
        let new = Arc::new(cp("new", "new.example.com", "outbound|443||new.svc"));
        let file = Arc::new(cp("file", "f2.example.com", "outbound|443||f2.svc"));
        // (what, the places replaced and by what, found without the full comparison)
        type Case<'a> = (&'a str, Vec<(usize, Arc<ControlPlaneCfg>)>, bool);
        let cases: Vec<Case> = vec![
            ("nothing replaced", vec![], true),
            ("an equal copy", vec![(2, t(2))], true),
            ("a change", vec![(3, Arc::new(changed))], true),
            ("a new name", vec![(4, new.clone())], true),
            ("two places swapped", vec![(1, t(5)), (5, t(1))], true),
            (
                "a name from another replaced place",
                vec![(1, t(5)), (5, new)],
                true,
            ),
            ("a copy of a name held elsewhere", vec![(1, t(6))], false),
            (
                "a name given twice, both replaced",
                vec![(1, t(5)), (5, t(5))],
                true,
            ),
            ("the file's name", vec![(7, file)], false),
        ];
        for (what, replace, fast) in cases {
            let mut given = before.clone();
            for (i, cp) in replace {
                given[i] = cp;
            }
            let found = in_place(&given, &before, held);
            assert_eq!(found.is_some(), fast, "{what}");
            let Some((at, gone)) = found else { continue };
            let kept = unchanged(&given, &before);
            let mut f = before
                .iter()
                .map(|c| c.name.as_str())
                .filter(|n| !kept.names.contains(n))
                .collect::<Vec<_>>();
            let mut g: Vec<&str> = gone.into_iter().collect();
            f.sort();
            g.sort();
            assert_eq!(at, kept.at, "{what}");
            assert_eq!(g, f, "{what}");
        }
        let shorter = &before[1..];
        assert!(in_place(shorter, &before, held).is_none());
    }

    /// A name given twice: the first is kept, the second refused, as in a
    /// full compile.
    #[test]
    fn a_name_given_twice_is_refused_once() {
        let before = compile(with(tenants(2)), None).unwrap();
        let mut next = tenants(2);
        next.push(cp("t1", "other.example.com", "outbound|443||other.svc"));
        let (pass, refused) = compile_admitting(with(next.clone()), Some(&before));
        let (full, full_refused) = compile_admitting(with(next), None);
        assert_eq!(refused, full_refused);
        assert_eq!(served(&pass.unwrap()), served(&full.unwrap()));
    }
}
