//! Watches a configuration file for changes.
//!
//! The parent directory is watched, not the file, so that editors and
//! Kubernetes ConfigMap updates that replace the file by an atomic rename
//! (or a symlink swap) are seen.

use std::path::{Path, PathBuf};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// Keeps the watch alive; dropping it stops watching.
pub struct FileWatch {
    _watcher: notify::RecommendedWatcher,
}

/// Starts watching `path`; a unit is sent on the returned channel whenever
/// the file may have changed (events are coalesced by the channel's bound,
/// so a burst costs one reload or two, not one per event).
pub fn watch(path: &Path) -> notify::Result<(FileWatch, mpsc::Receiver<()>)> {
    let (tx, rx) = mpsc::channel(1);
    let file: PathBuf = path.file_name().map(PathBuf::from).unwrap_or_default();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else { return };
        if ev.kind.is_access() {
            return;
        }
        // Kubernetes ConfigMaps swap a `..data` symlink; react to that too.
        let relevant = ev.paths.iter().any(|p| {
            p.file_name()
                .is_some_and(|n| n == file.as_os_str() || n == "..data")
        });
        if relevant {
            let _ = tx.try_send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    Ok((FileWatch { _watcher: watcher }, rx))
}
