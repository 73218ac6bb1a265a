//! The pure part of a reload: which clusters come and go, which frontends
//! keep listening and which start. No IO, no clock: `run` applies it.

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
    for (i, r) in running.iter().enumerate() {
        let same = planned
            .iter()
            .enumerate()
            .position(|(j, f)| !taken[j] && f.0 == r.0 && f.1 == r.1);
        if let Some(j) = same {
            taken[j] = true;
            c.frontends_kept.push((i, j));
        }
    }
    c.frontends_started = (0..planned.len()).filter(|j| !taken[*j]).collect();
    c
}

/// The names in `names` that `other` lacks.
fn not_in(names: &[&str], other: &[&str]) -> Vec<String> {
    names
        .iter()
        .filter(|n| !other.contains(n))
        .map(|n| n.to_string())
        .collect()
}
