//! Validation and compilation of a [`ConfigFile`] into a [`Snapshot`].

use std::collections::HashMap;
use std::path::Path;

use crate::model::{ConfigFile, ControlPlane as ControlPlaneCfg};

mod checks;
mod errors;
mod incremental;
mod listeners;
mod routes;
mod sections;
mod snapshot;

use checks::*;
pub use checks::{check_cluster_id, destination_regex, parse_cidr, split_object_name};
use errors::*;
pub use errors::{ConfigError, Errors, Refused};
pub use listeners::ListenerSpec;
use listeners::*;
use routes::*;
use sections::*;
pub use snapshot::Snapshot;

/// Parses YAML text. Syntax, type and unknown-key errors stop the parser, so
/// only the first is reported, with its line and column.
pub fn parse(text: &str) -> Result<ConfigFile, Errors> {
    serde_norway::from_str(text)
        .map_err(|e| Errors(vec![ConfigError::new(String::new(), e.to_string())]))
}

/// Reads, parses and compiles the file at `path`, reusing live endpoint
/// state from `previous`.
pub fn load(path: &Path, previous: Option<&Snapshot>) -> Result<Snapshot, Errors> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Errors(vec![ConfigError::new(
            String::new(),
            format!("cannot read {}: {e}", path.display()),
        )])
    })?;
    compile(parse(&text)?, previous)
}

/// Validates `file` completely and compiles it. On failure every problem is
/// listed, in file order.
pub fn compile(file: ConfigFile, previous: Option<&Snapshot>) -> Result<Snapshot, Errors> {
    compile_or_return(file, previous).map_err(|e| e.0)
}

/// [`compile`], giving the file back with the problems (so that a caller
/// that tries again without some of it need not have copied it first).
fn compile_or_return(
    file: ConfigFile,
    previous: Option<&Snapshot>,
) -> Result<Snapshot, Box<(Errors, ConfigFile)>> {
    let mut c = Collector(Vec::new());
    let admin = check_admin(&mut c, &file.admin.listen);
    let listeners = check_listeners(&mut c, &file.listeners);
    let trusted_lbs = cidrs(
        &mut c,
        "trusted_load_balancers",
        &file.trusted_load_balancers,
    );
    let always_allowed = cidrs(&mut c, "always_allowed", &file.always_allowed);
    check_proxy_trust(&mut c, &listeners, &trusted_lbs);
    check_settings(&mut c, &file);
    let mut b = Routes::new(c, previous, &listeners);
    if let Some(k) = &file.kubernetes {
        check_kubernetes(&mut b.c, k, &listeners);
        b.exclusive_addresses(k);
    }
    b.control_planes(&file);
    let Routes {
        c,
        routes,
        control_planes,
        ..
    } = b;
    if !c.0.is_empty() {
        return Err(Box::new((Errors(c.0), file)));
    }
    Ok(Snapshot {
        listeners,
        admin,
        routes,
        control_planes,
        trusted_lbs,
        always_allowed,
        timeouts: file.timeouts.clone(),
        limits: file.limits.clone(),
        upstream: file.upstream.clone(),
        file,
    })
}

/// Compiles a file whose `from_kubernetes` control planes are each admitted
/// on their own: one that is invalid, or claims a host name, destination,
/// service address or name already taken (by the file, or by one earlier in
/// the list), is left out and returned with its problems, and the rest
/// still compile. Problems of the file itself fail the whole compile, as
/// in [`compile`]. When `file` differs from `previous` only in those
/// control planes, only the new and changed ones are compiled, and a name
/// stays with the one that holds it ([`incremental`]).
pub fn compile_admitting(
    file: ConfigFile,
    previous: Option<&Snapshot>,
) -> (Result<Snapshot, Errors>, Refused) {
    if let Some(prev) = previous.filter(|p| incremental::same_but_kubernetes(&file, &p.file)) {
        let (snapshot, refused) = incremental::recompile(file, prev);
        return (Ok(snapshot), refused);
    }
    let (errors, mut file) = match compile_or_return(file, previous) {
        Ok(s) => return (Ok(s), Vec::new()),
        Err(e) => *e,
    };
    let (mut bad, own) = by_kubernetes_index(errors, file.from_kubernetes.len());
    if !own.is_empty() {
        // The file's own problems: nothing to admit around.
        return (Err(Errors(own)), Vec::new());
    }
    let (kept, rejected) = admit_apart(std::mem::take(&mut file.from_kubernetes), &mut bad);
    file.from_kubernetes = kept;
    (compile(file, previous), rejected)
}

/// Splits the control planes from Kubernetes into those without problems
/// and those refused, each with its problems (paths relative to it).
fn admit_apart(
    from_kubernetes: Vec<std::sync::Arc<ControlPlaneCfg>>,
    bad: &mut HashMap<usize, Vec<ConfigError>>,
) -> (Vec<std::sync::Arc<ControlPlaneCfg>>, Refused) {
    let mut rejected = Vec::new();
    let mut kept = Vec::new();
    for (i, cp) in from_kubernetes.into_iter().enumerate() {
        let Some(problems) = bad.remove(&i) else {
            kept.push(cp);
            continue;
        };
        let problems = problems.into_iter().map(incremental::relative).collect();
        rejected.push((cp.name.clone(), problems));
    }
    (kept, rejected)
}

/// Problems of the control planes from Kubernetes, by index (`kubernetes[i]`
/// with `i` below `count`), and the file's own.
fn by_kubernetes_index(
    errors: Errors,
    count: usize,
) -> (HashMap<usize, Vec<ConfigError>>, Vec<ConfigError>) {
    let mut bad: HashMap<usize, Vec<ConfigError>> = HashMap::new();
    let mut own = Vec::new();
    for e in errors.0 {
        let index = e
            .path
            .strip_prefix("kubernetes[")
            .and_then(|r| r.split_once(']'))
            .and_then(|(i, _)| i.parse::<usize>().ok());
        match index {
            Some(i) if i < count => bad.entry(i).or_default().push(e),
            _ => own.push(e),
        }
    }
    (bad, own)
}

/// Control-plane names added, removed and changed between two snapshots.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Present only in the new snapshot.
    pub added: Vec<String>,
    /// Present only in the old snapshot.
    pub removed: Vec<String>,
    /// Present in both with a different definition.
    pub changed: Vec<String>,
}

/// Computes what a reload changes, by control-plane name (sorted). The
/// same allocation (a control plane from Kubernetes the source handed
/// again) is equal without a look inside.
pub fn diff(old: &ConfigFile, new: &ConfigFile) -> Diff {
    // foldhash: run on every pass of the Kubernetes source, over every
    // tenant.
    fn all(f: &ConfigFile) -> foldhash::HashMap<&str, &ControlPlaneCfg> {
        f.control_planes
            .iter()
            .chain(f.from_kubernetes.iter().map(|c| c.as_ref()))
            .map(|c| (c.name.as_str(), c))
            .collect()
    }
    let (o, n) = (all(old), all(new));
    let mut d = Diff::default();
    for (name, cp) in &n {
        match o.get(name) {
            None => d.added.push(name.to_string()),
            Some(prev) if !std::ptr::eq(*prev, *cp) && prev != cp => {
                d.changed.push(name.to_string())
            }
            Some(_) => {}
        }
    }
    d.removed = o
        .keys()
        .filter(|k| !n.contains_key(*k))
        .map(|k| k.to_string())
        .collect();
    d.added.sort();
    d.removed.sort();
    d.changed.sort();
    d
}

/// Settings a reload cannot change (they need a restart), as a list of the
/// differing keys.
pub fn restart_only_changes(old: &ConfigFile, new: &ConfigFile) -> Vec<&'static str> {
    let keepalive = |f: &ConfigFile| {
        let t = &f.timeouts;
        (t.keepalive_time, t.keepalive_interval, t.keepalive_retries)
    };
    let (o, n) = (&old.limits, &new.limits);
    [
        ("listeners", old.listeners != new.listeners),
        ("admin", old.admin != new.admin),
        ("kubernetes", old.kubernetes != new.kubernetes),
        (
            "migration.usage_file",
            old.migration.usage_file != new.migration.usage_file,
        ),
        (
            "limits.max_connections",
            o.max_connections != n.max_connections,
        ),
        ("limits.splice_pipes", o.splice_pipes != n.splice_pipes),
        ("limits.copy", o.copy != n.copy),
        ("limits.workers", o.workers != n.workers),
        ("timeouts.keepalive_*", keepalive(old) != keepalive(new)),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

#[cfg(test)]
mod tests;
