//! Watches configuration files for changes, for every role (the supervisor
//! in `seedlink::supervisor` owns the one watcher of a process).
//!
//! Parent directories are watched, not the files, so that editors and
//! Kubernetes ConfigMap and Secret volume updates that replace a file by an
//! atomic rename (or a `..data` symlink swap) are seen. Nothing is polled.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// Keeps the watch alive; dropping it stops watching.
pub struct FileWatch {
    _watcher: notify::RecommendedWatcher,
}

/// Starts watching `path`; see [`watch_all`].
pub fn watch(path: &Path) -> notify::Result<(FileWatch, mpsc::Receiver<()>)> {
    watch_all(&[path.to_path_buf()])
}

/// Starts watching `paths`; a unit is sent on the returned channel whenever
/// one of them may have changed (events are coalesced by the channel's
/// bound, so a burst costs one reload or two, not one per event).
pub fn watch_all(paths: &[PathBuf]) -> notify::Result<(FileWatch, mpsc::Receiver<()>)> {
    let (tx, rx) = mpsc::channel(1);
    // Directory → the file names in it that matter.
    let mut dirs: BTreeMap<PathBuf, BTreeSet<OsString>> = BTreeMap::new();
    for path in paths {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let names = dirs.entry(dir).or_default();
        if let Some(n) = path.file_name() {
            names.insert(n.to_os_string());
        }
        // Kubernetes volumes swap a `..data` symlink; react to that too.
        names.insert(OsString::from("..data"));
    }
    let wanted: BTreeSet<OsString> = dirs.values().flatten().cloned().collect();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else { return };
        if ev.kind.is_access() {
            return;
        }
        let relevant = ev
            .paths
            .iter()
            .any(|p| p.file_name().is_some_and(|n| wanted.contains(n)));
        if relevant {
            let _ = tx.try_send(());
        }
    })?;
    for dir in dirs.keys() {
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
    }
    Ok((FileWatch { _watcher: watcher }, rx))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn changes_to_files_in_different_directories_are_reported() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let cfg = a.path().join("config.yaml");
        let cert = b.path().join("tls.crt");
        std::fs::write(&cfg, "x").unwrap();
        std::fs::write(&cert, "x").unwrap();
        let (_w, mut rx) = watch_all(&[cfg.clone(), cert.clone()]).unwrap();
        // A rename over the file, as editors and kubelet do.
        let tmp = b.path().join(".tls.crt.tmp");
        std::fs::write(&tmp, "new").unwrap();
        std::fs::rename(&tmp, &cert).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        assert!(matches!(got, Ok(Some(()))));
        while rx.try_recv().is_ok() {}
        std::fs::write(&cfg, "changed").unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        assert!(matches!(got, Ok(Some(()))));
    }
}
