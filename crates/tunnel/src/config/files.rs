//! The files a configuration names (certificates, keys, CA bundles, tokens)
//! and what each must hold; checked before anything is applied.

use std::path::{Path, PathBuf};

use super::check::*;
use super::model::*;
use super::trust::*;
use seedlink_config::tunnel::{Cluster, Frontend};
use seedlink_config::ConfigError;

/// The files [`Kind::check`] found right, by file and kind.
static CHECKED: super::stamp::ByStamp<()> = super::stamp::ByStamp::new();

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
