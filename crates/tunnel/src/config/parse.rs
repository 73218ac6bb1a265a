//! Parsing: YAML into the model, then every check, with each problem
//! blamed on its path, and clusters from the Kubernetes source refused one
//! by one ([`Refused`]) rather than failing the file.

use super::check::*;
use super::model::*;
use super::trust::*;
use seedlink_config::tunnel::Cluster;
use seedlink_config::{ConfigError, Errors};

impl ServerConfig {
    /// Parses and checks a configuration; all problems at once, each with
    /// its path (YAML and unknown-key errors carry their line).
    pub fn parse(text: &str) -> Result<ServerConfig, Errors> {
        Self::parse_with(text, Vec::new()).0
    }

    /// Parses the file and adds `extra` clusters (from Kubernetes), each
    /// admitted on its own: one that is invalid, collides with the file's
    /// clusters or an earlier one (name, issuer, socket, address), or names
    /// a file that does not read as what it must be, is left out and
    /// returned with its problems; the others are kept. Problems of the
    /// file itself fail the whole parse.
    pub fn parse_with(text: &str, extra: Vec<Cluster>) -> (Result<ServerConfig, Errors>, Refused) {
        let file: ServerConfig = match serde_norway::from_str(text) {
            Ok(c) => c,
            Err(e) => {
                return (
                    Err(Errors(vec![ConfigError::new("", e.to_string())])),
                    Vec::new(),
                )
            }
        };
        if extra.is_empty() {
            return (Self::validate(file).and_then(no_shared_trust), Vec::new());
        }
        let mut bad = match Self::blame_extra(&file, &extra)
            .and_then(|bad| refuse_shared_trust(&file, &extra, bad).map_err(|e| Errors(vec![e])))
        {
            Ok(bad) => bad,
            Err(own) => return (Err(own), Vec::new()),
        };
        let mut refused = Vec::new();
        let mut kept = file;
        for (i, c) in extra.into_iter().enumerate() {
            match bad.remove(&i) {
                Some(problems) => refused.push((c.name, problems)),
                None => kept.clusters.push(c),
            }
        }
        (Self::validate(kept), refused)
    }

    /// The files each extra cluster names must read as what they are; a
    /// problem is that cluster's.
    fn blame_files(
        extra: &[Cluster],
        bad: &mut std::collections::BTreeMap<usize, Vec<ConfigError>>,
    ) {
        for (i, c) in extra.iter().enumerate() {
            let problems = Self::check_cluster_files(c);
            if !problems.is_empty() {
                bad.entry(i).or_default().extend(problems);
            }
        }
    }

    /// The problems of each `extra` cluster (by its index) when validated
    /// with `file`, its files read as what they are; `Err` with the file's
    /// own problems, which refuse everything.
    fn blame_extra(
        file: &ServerConfig,
        extra: &[Cluster],
    ) -> Result<std::collections::BTreeMap<usize, Vec<ConfigError>>, Errors> {
        let from_file = file.clusters.len();
        let mut all = file.clone();
        all.clusters.extend(extra.iter().cloned());
        let mut bad: std::collections::BTreeMap<usize, Vec<ConfigError>> = Default::default();
        let mut own = Vec::new();
        for e in Self::validate(all).err().map(|e| e.0).unwrap_or_default() {
            match extra_index(&e.path, from_file, extra) {
                Some(i) => bad.entry(i).or_default().push(e),
                None => own.push(e),
            }
        }
        if !own.is_empty() {
            return Err(Errors(own));
        }
        Self::blame_files(extra, &mut bad);
        Ok(bad)
    }

    /// Checks a parsed configuration, section by section; every problem
    /// with its path.
    fn validate(mut cfg: ServerConfig) -> Result<ServerConfig, Errors> {
        let mut errs = Problems::default();
        check_templates(&cfg, &mut errs);
        if errs.is_empty() {
            expand_templates(&mut cfg, &mut errs);
        }
        check_settings(&cfg, &mut errs);
        // The operator's shared frontends claim their addresses first: a
        // cluster (from Kubernetes above all) naming one of them is that
        // cluster's problem, never the file's.
        let mut binds = Binds::default();
        check_shared_frontends(&cfg, &mut binds, &mut errs);
        check_clusters(&cfg, &mut binds, &mut errs);
        if errs.is_empty() {
            Ok(cfg)
        } else {
            Err(Errors(errs.0))
        }
    }
}

/// Which of the `extra` clusters (after the file's `from_file`) a problem's
/// path names, by index or by name.
fn extra_index(path: &str, from_file: usize, extra: &[Cluster]) -> Option<usize> {
    path.strip_prefix("clusters[")
        .and_then(|r| r.split_once(']'))
        .and_then(|(i, _)| i.parse::<usize>().ok())
        .filter(|i| *i >= from_file)
        .map(|i| i - from_file)
        .or_else(|| {
            extra
                .iter()
                .position(|c| path.starts_with(&format!("clusters ({})", c.name)))
        })
}
