//! The pure part of a reload: which clusters come and go, which frontends
//! keep listening and which start. No IO, no clock: `run` applies it.

use std::collections::{HashMap, HashSet};

use crate::config::Frontend;

/// What a reload changes, computed from what runs and what the new plan
/// asks for, touching neither (see [`diff`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// Clusters only the plan has.
    pub clusters_added: Vec<String>,
    /// Clusters only the running server has (their agents are ended).
    pub clusters_removed: Vec<String>,
    /// Running frontends (index) that keep listening, each with the planned
    /// frontend (index) whose certificates replace theirs.
    pub frontends_kept: Vec<(usize, usize)>,
    /// Planned frontends (index) to start: new, or changed (the running
    /// one, absent from `frontends_kept`, stops).
    pub frontends_started: Vec<usize>,
}

/// The pure part of a reload: which clusters are added or removed, which
/// frontends keep listening (same cluster, same settings), which start.
/// `running` and `planned` are `(cluster, frontend)`; `None` is shared.
pub fn diff(
    old_clusters: &[&str],
    running: &[(Option<&str>, &Frontend)],
    new_clusters: &[&str],
    planned: &[(Option<&str>, &Frontend)],
) -> Changes {
    let mut c = Changes {
        clusters_added: not_in(new_clusters, old_clusters),
        clusters_removed: not_in(old_clusters, new_clusters),
        ..Changes::default()
    };
    let mut taken = vec![false; planned.len()];
    let by_name = by_name(planned);
    for (i, r) in running.iter().enumerate() {
        let candidates = by_name.get(&(r.0, r.1.name.as_str()));
        let same = candidates
            .into_iter()
            .flatten()
            .copied()
            .find(|&j| !taken[j] && planned[j].1 == r.1);
        if let Some(j) = same {
            taken[j] = true;
            c.frontends_kept.push((i, j));
        }
    }
    c.frontends_started = (0..planned.len()).filter(|j| !taken[*j]).collect();
    c
}

/// Planned frontends' indexes by (cluster, name): each running one is
/// compared with those of its name only, not with every planned one.
fn by_name<'a>(
    planned: &[(Option<&'a str>, &'a Frontend)],
) -> HashMap<(Option<&'a str>, &'a str), Vec<usize>> {
    let mut by_name: HashMap<_, Vec<usize>> = HashMap::new();
    for (j, f) in planned.iter().enumerate() {
        by_name.entry((f.0, f.1.name.as_str())).or_default().push(j);
    }
    by_name
}

/// The names in `names` that `other` lacks.
fn not_in(names: &[&str], other: &[&str]) -> Vec<String> {
    let other: HashSet<&str> = other.iter().copied().collect();
    names
        .iter()
        .filter(|n| !other.contains(*n))
        .map(|n| n.to_string())
        .collect()
}
