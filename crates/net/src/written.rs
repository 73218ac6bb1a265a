//! Files this process writes itself, each with a version that changes on
//! every write: what was read from such a file stands while its version
//! stays, with no `stat` and no wait for the clock's granularity.
//!
//! The tunnel-server's Kubernetes source writes a thousand clusters' trust
//! files into a directory only it writes, then applies them; the checks of
//! the applied configuration read those files again. Asking the file
//! system whether each changed (a `stat` per file per pass, and a file
//! written within the last seconds read again on every pass until its
//! time stamp could tell) was most of the remaining CPU of a change at a
//! thousand tenants; the writer telling its readers costs what changed.
//!
//! A writer calls [`wrote`] after it replaced a file (by a rename), and
//! [`removed`] after it removed one. A reader takes [`version`] before and
//! after reading, and keeps what it read only when both are the same. A
//! file never written here has no version, and its readers ask the file
//! system as before.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};

static VERSIONS: LazyLock<Mutex<HashMap<PathBuf, u64>>> = LazyLock::new(Default::default);

/// Versions are never reused, not even for a path removed and written
/// again.
static NEXT: AtomicU64 = AtomicU64::new(1);

/// `path` was just replaced by this process: what was read from it before
/// no longer stands.
pub fn wrote(path: &Path) {
    let v = NEXT.fetch_add(1, Ordering::Relaxed);
    crate::sync::lock(&VERSIONS, "written files").insert(path.to_path_buf(), v);
}

/// `path` was found holding what this process would write there (a sweep
/// that read it): it is this process's from now on, at its current
/// version if it has one.
pub fn known(path: &Path) {
    let mut versions = crate::sync::lock(&VERSIONS, "written files");
    if !versions.contains_key(path) {
        let v = NEXT.fetch_add(1, Ordering::Relaxed);
        versions.insert(path.to_path_buf(), v);
    }
}

/// `path` was just removed by this process.
pub fn removed(path: &Path) {
    crate::sync::lock(&VERSIONS, "written files").remove(path);
}

/// The version of `path`, when this process writes it.
pub fn version(path: &Path) -> Option<u64> {
    crate::sync::lock(&VERSIONS, "written files")
        .get(path)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each write is a new version, a sweep's finding keeps the current
    /// one, and a removed file has none until written again, at a version
    /// it never had.
    #[test]
    fn every_write_is_a_new_version() {
        let p = Path::new("/written-test/a/ca.crt");
        assert_eq!(version(p), None);
        known(p);
        let first = version(p);
        assert!(first.is_some());
        known(p);
        assert_eq!(version(p), first);
        wrote(p);
        let second = version(p);
        assert!(second.is_some() && second != first);
        removed(p);
        assert_eq!(version(p), None);
        wrote(p);
        let third = version(p);
        assert!(third.is_some() && third != first && third != second);
    }
}
