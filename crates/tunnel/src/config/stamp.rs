//! What was read from files, kept while each file's `stat` stays the
//! same: the tunnel-server's checks of the trust files a thousand
//! clusters name, made on every pass of the Kubernetes source.

use std::path::{Path, PathBuf};

/// A file as `stat` sees it: a replacement (a rename, as the Kubernetes
/// source writes) is a new inode; a write in place changes the size or
/// the modification or change time.
pub(crate) type Stamp = (u64, u64, u64, i64, i64, i64, i64);

/// How old a file must be for its stamp to stand for its content.
const RECENT: std::time::Duration = std::time::Duration::from_secs(2);

/// File `p`'s stamp; `None` when it cannot be read as a file now, or was
/// modified within the last seconds (a write in place of the same size
/// within the clock's granularity would leave its stamp as it was): then
/// nothing read from it before stands for it. Not covered: a writer that
/// rewrites a file in place with the same size and sets its modification
/// time back, twice within one tick of the change time (the Kubernetes
/// source writes by rename; an operator's tool that preserves times, such
/// as `rsync --inplace -t`, may: touch the file after it).
///
/// A file this process writes itself (the Kubernetes source's trust
/// files, `seedlink_net::written`) is stamped by its version instead:
/// no `stat`, and no wait after a write (the writer tells).
pub(crate) fn stamp(p: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    if let Some(v) = seedlink_net::written::version(p) {
        // No device is numbered u64::MAX: never a file system's stamp.
        return Some((u64::MAX, v, 0, 0, 0, 0, 0));
    }
    let m = std::fs::metadata(p).ok()?;
    if m.modified().ok()?.elapsed().ok()? < RECENT {
        return None;
    }
    Some((
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec(),
    ))
}

/// What was read from files, by path and a tag, with each file's stamp
/// when read. Every pass of the Kubernetes source names a thousand
/// clusters' trust files, and reading each again (parsing its PEM,
/// verifying its CA's signature) was most of the tunnel-server's CPU per
/// pass at a thousand tenants; a file whose stamp stayed is not read again.
/// Only what read well is kept: a failure (a file that does not parse, or
/// a read that failed for a while: no descriptor left, an I/O error) is
/// read again on the next pass, so a passing failure never stands for a
/// file's content. Each entry is small (a path and a few hundred bytes:
/// callers keep no more), and their number is bounded.
pub(crate) struct ByStamp<T>(std::sync::LazyLock<std::sync::Mutex<ByPath<T>>>);

type ByPath<T> = std::collections::HashMap<(PathBuf, u8), (Stamp, T)>;

/// The most entries a [`ByStamp`] keeps; past it, it starts again (the
/// files of clusters gone are not kept forever): a few per cluster, for
/// several thousand clusters.
const MOST_KEPT: usize = 16_384;

impl<T: Clone> ByStamp<T> {
    pub(crate) const fn new() -> Self {
        ByStamp(std::sync::LazyLock::new(Default::default))
    }

    /// `read(p)`, or what it gave while `p`'s stamp stays; an `Err` is
    /// not kept.
    pub(crate) fn get<E>(
        &self,
        p: &Path,
        tag: u8,
        read: impl FnOnce(&Path) -> Result<T, E>,
    ) -> Result<T, E> {
        let Some(before) = stamp(p) else {
            return read(p);
        };
        let key = (p.to_path_buf(), tag);
        if let Some((was, v)) = seedlink_net::sync::lock(&self.0, "files read").get(&key) {
            if *was == before {
                return Ok(v.clone());
            }
        }
        let v = read(p)?;
        // Replaced while it was read: read again next time.
        if stamp(p) == Some(before) {
            let mut kept = seedlink_net::sync::lock(&self.0, "files read");
            if kept.len() >= MOST_KEPT {
                kept.clear();
            }
            kept.insert(key, (before, v.clone()));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::path::Path;
    use std::time::{Duration, SystemTime};

    use super::ByStamp;

    /// Writes `text` to `p` with a modification time a minute ago.
    fn write_old(p: &Path, text: &str) {
        std::fs::write(p, text).unwrap();
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(60))
            .unwrap();
    }

    /// A file is read once while its stamp stays; replaced (a rename, a
    /// new inode) it is read again; changed within the last seconds it is
    /// read every time.
    #[test]
    fn a_file_is_read_again_only_when_its_stamp_changes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ca.pem");
        write_old(&p, "a");
        let cache: ByStamp<String> = ByStamp::new();
        let reads = Cell::new(0);
        let get = || {
            let got = cache.get(&p, 0, |p| {
                reads.set(reads.get() + 1);
                std::fs::read_to_string(p)
            });
            got.unwrap()
        };
        assert_eq!((get(), get(), reads.get()), ("a".into(), "a".into(), 1));
        let next = dir.path().join("ca.pem.new");
        write_old(&next, "b");
        std::fs::rename(&next, &p).unwrap();
        assert_eq!((get(), get(), reads.get()), ("b".into(), "b".into(), 2));
        std::fs::write(&p, "c").unwrap();
        assert_eq!((get(), get(), reads.get()), ("c".into(), "c".into(), 4));
        let other = cache.get(&p, 1, |_| Ok::<_, ()>("another tag".to_string()));
        assert_eq!(other, Ok("another tag".to_string()));
        // A failure is not kept: the next read is made.
        write_old(&p, "d");
        let failed = cache.get(&p, 2, |_| Err::<String, _>("no descriptor left"));
        assert_eq!(failed, Err("no descriptor left"));
        let read = cache.get(&p, 2, |p| std::fs::read_to_string(p).map_err(|_| "read"));
        assert_eq!(read, Ok("d".to_string()));
    }

    /// A file this process writes (and says so) is read once per write,
    /// even just after it (no wait for the clock), and a change made
    /// behind the writer's back is not taken: its next write puts it right.
    #[test]
    fn a_file_written_here_is_read_once_per_write() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ca.pem");
        std::fs::write(&p, "a").unwrap();
        seedlink_net::written::wrote(&p);
        let cache: ByStamp<String> = ByStamp::new();
        let reads = Cell::new(0);
        let get = || {
            cache
                .get(&p, 0, |p| {
                    reads.set(reads.get() + 1);
                    std::fs::read_to_string(p)
                })
                .unwrap()
        };
        assert_eq!((get(), get(), reads.get()), ("a".into(), "a".into(), 1));
        std::fs::write(&p, "tampered").unwrap();
        assert_eq!((get(), reads.get()), ("a".into(), 1));
        std::fs::write(&p, "b").unwrap();
        seedlink_net::written::wrote(&p);
        assert_eq!((get(), get(), reads.get()), ("b".into(), "b".into(), 2));
        seedlink_net::written::removed(&p);
        std::fs::write(&p, "c").unwrap();
        // No longer written here: the file system's stamp, and a file
        // changed within the last seconds is read every time.
        assert_eq!((get(), get(), reads.get()), ("c".into(), "c".into(), 4));
    }
}
