//! The files a configuration names (certificates, keys, CA bundles, tokens)
//! and what each must hold; checked before anything is applied.

use std::path::{Path, PathBuf};

use super::check::*;
use super::model::*;
use super::trust::*;
use seedlink_config::tunnel::{Cluster, Frontend};
use seedlink_config::ConfigError;

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
pub(crate) fn stamp(p: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
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

/// The files [`Kind::check`] found right, by file and kind.
static CHECKED: ByStamp<()> = ByStamp::new();

/// What a file named by the configuration must hold.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    Certs,
    Key,
    Roots,
    /// A cluster's agent CA: self-signed CA certificates only.
    Anchors,
    PublicKeys,
    Secret,
}

impl Kind {
    /// Reads `p` and parses it as this kind; why not, if it is not. A
    /// file whose stamp stayed since it was checked is not read again.
    fn check(self, p: &Path) -> Result<(), String> {
        CHECKED.get(p, self as u8, |p| self.read_check(p))
    }

    /// [`Kind::check`], reading `p`.
    fn read_check(self, p: &Path) -> Result<(), String> {
        use crate::auth::tls::{load_certs, load_key, load_roots};
        match self {
            Kind::Certs => load_certs(p).map(|_| ()).map_err(|e| e.to_string()),
            Kind::Key => load_key(p).map(|_| ()).map_err(|e| e.to_string()),
            Kind::Roots => load_roots(p).map(|_| ()).map_err(|e| e.to_string()),
            Kind::Anchors => load_roots(p)
                .map_err(|e| e.to_string())
                .and_then(|_| check_anchors(p)),
            Kind::PublicKeys => crate::auth::token::load_keys(p)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Kind::Secret => match std::fs::read_to_string(p) {
                Ok(t) if t.trim().is_empty() => Err("empty".to_string()),
                Ok(_) => Ok(()),
                Err(e) => Err(e.to_string()),
            },
        }
    }
}

/// The files cluster `c` (named `at`) names itself.
pub(super) fn cluster_files<'a>(
    at: &str,
    c: &'a Cluster,
    files: &mut Vec<(String, &'a Path, Kind)>,
) {
    if let Some(p) = &c.agent_ca {
        files.push((format!("{at}.agent_ca"), p, Kind::Anchors));
    }
    if let Some(p) = &c.proxy_password_file {
        files.push((format!("{at}.proxy_password_file"), p, Kind::Secret));
    }
    let Some(t) = &c.agent_token else { return };
    if let Some(p) = &t.keys {
        files.push((format!("{at}.agent_token.keys"), p, Kind::PublicKeys));
    }
    let Some(r) = &t.review else { return };
    let at = format!("{at}.agent_token.review");
    files.push((format!("{at}.ca"), &r.ca, Kind::Roots));
    for (key, p, kind) in [
        ("token_file", &r.token_file, Kind::Secret),
        ("cert", &r.cert, Kind::Certs),
        ("key", &r.key, Kind::Key),
    ] {
        if let Some(p) = p {
            files.push((format!("{at}.{key}"), p, kind));
        }
    }
}

/// The files frontend `f` (named `at`) names.
pub(super) fn frontend_files<'a>(
    at: &str,
    f: &'a Frontend,
    files: &mut Vec<(String, &'a Path, Kind)>,
) {
    for (key, p, kind) in [
        ("cert", &f.cert, Kind::Certs),
        ("key", &f.key, Kind::Key),
        ("client_ca", &f.client_ca, Kind::Roots),
    ] {
        if let Some(p) = p {
            files.push((format!("{at}.{key}"), p, kind));
        }
    }
}

impl ServerConfig {
    /// Every file the configuration refers to (certificates, keys, CAs,
    /// token keys, passwords), for change detection. A TokenReview
    /// `token_file` is not listed: it is read again for every review.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut out = vec![self.agents.cert.clone(), self.agents.key.clone()];
        let fe = |f: &Frontend, out: &mut Vec<PathBuf>| {
            out.extend(f.cert.iter().chain(&f.key).chain(&f.client_ca).cloned());
        };
        for c in &self.clusters {
            out.extend(c.agent_ca.iter().cloned());
            out.extend(c.proxy_password_file.iter().cloned());
            if let Some(t) = &c.agent_token {
                out.extend(t.keys.iter().cloned());
                if let Some(r) = &t.review {
                    out.push(r.ca.clone());
                    out.extend(r.cert.iter().chain(&r.key).cloned());
                }
            }
            for f in &c.frontends {
                fe(f, &mut out);
            }
        }
        for f in &self.shared_frontends {
            fe(f, &mut out);
        }
        out.sort();
        out.dedup();
        out
    }

    /// Every file the configuration names, read and parsed as what it must
    /// be (certificate chain, private key, CA bundle, public keys, a
    /// non-empty secret); one problem per file, with the key that names it.
    pub fn check_files(&self) -> Vec<ConfigError> {
        let mut errs = Problems::default();
        for (at, p, kind) in self.named_files() {
            if let Err(e) = kind.check(p) {
                errs.add(at, format!("{}: {e}", p.display()));
            }
        }
        errs.0
    }

    /// [`ServerConfig::check_files`] of a configuration holding cluster
    /// `c` alone: the files it and its frontends name, each problem blamed
    /// on `clusters[0] (<name>)`.
    pub(super) fn check_cluster_files(c: &Cluster) -> Vec<ConfigError> {
        let at = format!("clusters[0] ({})", c.name);
        let mut files = Vec::new();
        cluster_files(&at, c, &mut files);
        for (j, f) in c.frontends.iter().enumerate() {
            frontend_files(&format!("{at}.frontends[{j}] ({})", f.name), f, &mut files);
        }
        let mut errs = Problems::default();
        for (at, p, kind) in files {
            if let Err(e) = kind.check(p) {
                errs.add(at, format!("{}: {e}", p.display()));
            }
        }
        errs.0
    }

    /// Every file the configuration names: the key that names it, the
    /// path, what it must hold.
    fn named_files(&self) -> Vec<(String, &Path, Kind)> {
        let mut files = vec![(
            "agents.cert".to_string(),
            self.agents.cert.as_path(),
            Kind::Certs,
        )];
        if let Some(p) = self.admin.as_ref().and_then(|a| a.token_file.as_ref()) {
            files.push(("admin.token_file".into(), p, Kind::Secret));
        }
        files.push(("agents.key".into(), &self.agents.key, Kind::Key));
        for (i, c) in self.clusters.iter().enumerate() {
            let at = format!("clusters[{i}] ({})", c.name);
            cluster_files(&at, c, &mut files);
            for (j, f) in c.frontends.iter().enumerate() {
                frontend_files(&format!("{at}.frontends[{j}] ({})", f.name), f, &mut files);
            }
        }
        for (j, f) in self.shared_frontends.iter().enumerate() {
            let at = format!("shared_frontends[{j}] ({})", f.name);
            frontend_files(&at, f, &mut files);
        }
        files
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
}
