//! The paths each control plane still uses, and the migration gate.
//!
//! A path is a control plane reached through a listener by a protocol:
//! `routed_total`'s labels (`tls-sni`, `http-connect:<header>`,
//! `http2-connect`, `proxy-protocol`, `proxy-tlv`). Its last use is kept in
//! the listeners' metric handles while the process runs and in
//! `migration.usage_file` across restarts. A path used within
//! `migration.window` is in use: a configuration that removes it (its
//! listener, or every route of its kind from a control plane that stays)
//! is refused by reload and by `check-config`, unless `migration.retire`
//! names it. Removing a whole control plane is not gated: that is a shoot
//! leaving, not a path moving.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use seedlink_config::model::{ConfigFile, ControlPlane};
use seedlink_config::ConfigError;

use crate::metrics::ListenerMetrics;

/// A path: control plane, listener, protocol.
pub type PathKey = (String, String, String);

/// The last use of each path, in Unix seconds.
pub type LastUse = BTreeMap<PathKey, u64>;

/// The largest usage file read (a thousand tenants' paths are a few
/// hundred KiB).
const MAX_FILE: u64 = 16 * 1024 * 1024;

/// The most paths written (the latest used kept): well inside
/// [`MAX_FILE`] whatever the names (a control plane's name is at most 253
/// bytes), so churned route names never make the file unreadable.
const MAX_PATHS: usize = 20_000;

/// The usage file's format.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct FileFormat {
    version: u32,
    paths: Vec<FileEntry>,
}

impl FileFormat {
    /// The file's content for `paths`.
    fn of(paths: &LastUse) -> FileFormat {
        FileFormat {
            version: 1,
            paths: paths
                .iter()
                .map(|((cp, l, p), last)| FileEntry {
                    control_plane: cp.clone(),
                    listener: l.clone(),
                    protocol: p.clone(),
                    last_used: *last,
                })
                .collect(),
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct FileEntry {
    control_plane: String,
    listener: String,
    protocol: String,
    /// Unix seconds.
    last_used: u64,
}

/// The record: what the usage file held at start, this process's last
/// uses, and what was last written. A path's last use is when its
/// `routed_total` was seen to grow: read when the record is asked for
/// (every 30 s, within a second of a path's first connection, on reload
/// and on `/api/state`), so routing a connection costs nothing more than
/// the count; the resolution is that of the asking, which a window of
/// days does not notice.
pub struct Usage {
    file: Option<PathBuf>,
    loaded: LastUse,
    live: Mutex<Live>,
    written: Mutex<Option<LastUse>>,
}

/// Each path's count when last read, and when it last grew.
#[derive(Default)]
struct Live {
    counts: BTreeMap<PathKey, u64>,
    last: LastUse,
}

impl Usage {
    /// The record kept in `file` (none: in memory only), read now. A file
    /// that cannot be read or parsed starts an empty record, with a
    /// warning (the gate then knows only what this process routes).
    pub fn open(file: Option<&str>) -> Usage {
        let file = file.map(PathBuf::from);
        let loaded = file.as_deref().map(read).unwrap_or_default();
        Usage {
            file,
            loaded,
            live: Mutex::default(),
            written: Mutex::new(None),
        }
    }

    /// The last use of every path: the file's, and this process's since.
    pub fn now(&self, listeners: &[Arc<ListenerMetrics>]) -> LastUse {
        self.now_of(listeners, None)
    }

    /// [`Usage::now`], of control plane `only`'s paths alone when given.
    pub fn now_of(&self, listeners: &[Arc<ListenerMetrics>], only: Option<&str>) -> LastUse {
        let now = crate::metrics::unix_now();
        let mut live = seedlink_net::sync::lock(&self.live, "paths in use");
        let Live { counts, last } = &mut *live;
        for l in listeners {
            l.each_cp(only, |cp, h| {
                if cp.is_empty() {
                    return;
                }
                for (protocol, count, open) in h.routed() {
                    let key = (cp.to_string(), l.name().to_string(), protocol);
                    // A connection still open is a use (a VPN tunnel held
                    // for days).
                    if counts.get(&key) != Some(&count) || open > 0 {
                        counts.insert(key.clone(), count);
                        last.insert(key, now);
                    }
                }
            });
        }
        let mine = |(c, _, _): &PathKey| only.is_none_or(|o| o == c);
        let mut all: LastUse = self
            .loaded
            .iter()
            .filter(|(k, _)| mine(k))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (k, v) in last.iter().filter(|(k, _)| mine(k)) {
            let e = all.entry(k.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
        // A clock that was once ahead never keeps a path in use for ever.
        all.values_mut().for_each(|v| *v = (*v).min(now));
        all
    }

    /// Writes `now` (less what is older than `since`) to the file, if
    /// there is one and it changed: a new file renamed over the old one.
    pub fn save(&self, now: &LastUse, since: u64) -> std::io::Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let mut kept: Vec<(&PathKey, &u64)> =
            now.iter().filter(|(_, last)| **last >= since).collect();
        if kept.len() > MAX_PATHS {
            kept.sort_by_key(|(_, last)| std::cmp::Reverse(**last));
            kept.truncate(MAX_PATHS);
        }
        let kept: LastUse = kept.into_iter().map(|(k, v)| (k.clone(), *v)).collect();
        let mut written = seedlink_net::sync::lock(&self.written, "usage file");
        if written.as_ref() == Some(&kept) {
            return Ok(());
        }
        let text =
            serde_json::to_vec_pretty(&FileFormat::of(&kept)).map_err(std::io::Error::other)?;
        write_replacing(file, &text)?;
        *written = Some(kept);
        Ok(())
    }
}

/// Replaces `file` by `text`: a new file of this process's own (mode
/// 0600) beside it, synced, renamed over it; a crash leaves the old file
/// or the new one, and two processes (a binary upgrade) never write into
/// the same new file.
fn write_replacing(file: &std::path::Path, text: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = file.with_file_name(format!(
        ".{}.{}.{n}.new",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(text)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, file));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The usage file at `p`; empty (with a warning) when absent, unreadable
/// or not the format. One that is there but does not read is moved aside
/// (`<file>.unreadable`), never written over.
fn read(p: &std::path::Path) -> LastUse {
    use std::io::Read;
    let text = std::fs::File::open(p).and_then(|f| {
        let mut s = String::new();
        f.take(MAX_FILE).read_to_string(&mut s)?;
        Ok(s)
    });
    let parsed = match text {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return LastUse::new(),
        Err(e) => Err(e.to_string()),
        Ok(t) => serde_json::from_str::<FileFormat>(&t).map_err(|e| e.to_string()),
    };
    match parsed {
        Ok(f) => f
            .paths
            .into_iter()
            .map(|e| ((e.control_plane, e.listener, e.protocol), e.last_used))
            .collect(),
        Err(e) => {
            let aside = p.with_file_name(format!(
                "{}.unreadable",
                p.file_name()
                    .map(|n| n.to_string_lossy())
                    .unwrap_or_default()
            ));
            let moved = std::fs::rename(p, &aside).is_ok();
            tracing::warn!(file = %p.display(), error = %e, moved_to = ?moved.then_some(&aside), "migration.usage_file not read; paths in use are known from this process's traffic only");
            LastUse::new()
        }
    }
}

/// Whether `cp` still has routes of the kind `protocol` names.
fn still_routes(cp: &ControlPlane, protocol: &str) -> bool {
    match protocol {
        "tls-sni" => !cp.hostnames.is_empty() || !cp.served_on.is_empty(),
        "proxy-protocol" => !cp.service_addresses.is_empty(),
        "proxy-tlv" => cp.cluster_id.is_some(),
        // `http-connect:<header>` and `http2-connect`.
        _ => !cp.destinations.is_empty(),
    }
}

/// Each control plane's paths in use on the `legacy` listeners of
/// `listeners`, as `listener (protocol)`, sorted; `None` when no listener
/// is legacy (nothing to tell).
pub fn legacy(
    in_use: &LastUse,
    listeners: &[seedlink_config::model::Listener],
) -> Option<BTreeMap<String, Vec<String>>> {
    let legacy: Vec<&str> = listeners
        .iter()
        .filter(|l| l.legacy)
        .map(|l| l.name.as_str())
        .collect();
    if legacy.is_empty() {
        return None;
    }
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (cp, listener, protocol) in in_use.keys() {
        if legacy.contains(&listener.as_str()) {
            out.entry(cp.clone())
                .or_default()
                .push(format!("{listener} ({protocol})"));
        }
    }
    Some(out)
}

/// Whether `file` still serves the path of control plane `cp` on
/// `listener` by `protocol`: the listener is there, and a control plane of
/// the file by that name (if there is one) still routes that kind.
fn serves(file: &ConfigFile, (cp, listener, protocol): &PathKey) -> bool {
    file.listeners.iter().any(|l| l.name == *listener)
        && file
            .control_planes
            .iter()
            .find(|c| c.name == *cp)
            .is_none_or(|c| still_routes(c, protocol))
}

/// The paths in use (last used at or after `since`) that `new` no longer
/// serves and does not retire, and, given `old`, that `old` still served
/// (what this change removes). A whole control plane gone is not a path
/// removed (a shoot leaving).
pub fn removed(
    in_use: &LastUse,
    since: u64,
    old: Option<&ConfigFile>,
    new: &ConfigFile,
) -> Vec<PathKey> {
    in_use
        .iter()
        .filter(|(_, last)| **last >= since)
        .map(|(k, _)| k)
        .filter(|k| !new.migration.retires(&k.1, &k.0))
        .filter(|k| !serves(new, k) && old.is_none_or(|o| serves(o, k)))
        .cloned()
        .collect()
}

/// The problems `removed` paths make, one per listener and per control
/// plane of the file. With `names` (`check-config`, the operator's own
/// tool) every control plane is named; without (a reload, whose problems
/// may reach tenants' route statuses) those on a removed listener are
/// counted only, and the log names them.
pub fn problems(removed: &[PathKey], new: &ConfigFile, names: bool) -> Vec<ConfigError> {
    let retire = "name it in migration.retire to remove it anyway";
    let mut by_listener: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut out = Vec::new();
    for (cp, listener, protocol) in removed {
        if new.listeners.iter().any(|l| l.name == *listener) {
            out.push(ConfigError::new(
                format!("control_planes ({cp})"),
                format!("no longer routes {protocol} on listener {listener}, which it used within migration.window; {retire}"),
            ));
        } else {
            by_listener
                .entry(listener)
                .or_default()
                .push(format!("{cp} ({protocol})"));
        }
    }
    for (listener, users) in by_listener {
        let who = match names {
            true => users.join(", "),
            false => format!("{} control plane path(s), named in the log", users.len()),
        };
        out.push(ConfigError::new(
            format!("listeners ({listener})"),
            format!("removed, but used within migration.window by {who}; {retire}"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file(text: &str) -> ConfigFile {
        serde_norway::from_str(text).unwrap()
    }

    const BEFORE: &str = "listeners:
  - {name: sni, address: '0.0.0.0:443'}
  - {name: legacy-vpn, address: '0.0.0.0:8132', protocol: http-connect, destination_header: Reversed-VPN}
control_planes:
  - name: a
    hostnames: [api.a.example]
    endpoints: ['10.0.0.1:443']
    destinations: [{name: vpn-seed-server.a}]
";

    fn used(cp: &str, listener: &str, protocol: &str, at: u64) -> LastUse {
        [((cp.into(), listener.into(), protocol.into()), at)].into()
    }

    /// A listener or a control plane's routes of a kind in use are not
    /// removed silently; retired, or out of the window, or the whole
    /// control plane gone, they are.
    #[test]
    fn a_path_in_use_is_removed_only_when_retired() {
        let vpn = used("a", "legacy-vpn", "http-connect:Reversed-VPN", 1000);
        let before = file(BEFORE);
        let removed = |since: u64, new: &str| removed(&vpn, since, Some(&before), &file(new));
        assert!(removed(0, BEFORE).is_empty());
        let no_listener = BEFORE.replace(
            "  - {name: legacy-vpn, address: '0.0.0.0:8132', protocol: http-connect, destination_header: Reversed-VPN}\n",
            "",
        );
        let gone = removed(0, &no_listener);
        assert_eq!(gone.len(), 1);
        // The operator's tool names the control plane; a reload counts it.
        let named = problems(&gone, &file(&no_listener), true);
        assert_eq!(named[0].path, "listeners (legacy-vpn)");
        assert!(
            named[0].message.contains("a (http-connect:Reversed-VPN)"),
            "{}",
            named[0].message
        );
        let counted = problems(&gone, &file(&no_listener), false);
        assert!(
            !counted[0].message.contains("a (http"),
            "{}",
            counted[0].message
        );
        // Out of the window: no longer in use.
        assert!(removed(1001, &no_listener).is_empty());
        let retired = format!(
            "{no_listener}migration: {{retire: [{{listener: legacy-vpn, control_plane: '*'}}]}}\n"
        );
        assert!(removed(0, &retired).is_empty());
        // Taking the retire out again is no removal: the old file lacked it.
        let after_retire = removed_since(&vpn, &file(&retired), &file(&no_listener));
        assert!(after_retire.is_empty());
        let no_destinations = BEFORE.replace("    destinations: [{name: vpn-seed-server.a}]\n", "");
        let e = problems(
            &removed(0, &no_destinations),
            &file(&no_destinations),
            false,
        );
        assert_eq!(e[0].path, "control_planes (a)");
        let sni = used("a", "sni", "tls-sni", 1000);
        assert!(super::removed(&sni, 0, Some(&before), &file(&no_destinations)).is_empty());
        let other = format!("{no_destinations}migration: {{retire: [{{listener: legacy-vpn, control_plane: b}}]}}\n");
        assert_eq!(removed(0, &other).len(), 1);
        // The whole control plane gone: a shoot leaving, not a path moved.
        let cp_gone = "listeners:\n  - {name: sni, address: '0.0.0.0:443'}\n  - {name: legacy-vpn, address: '0.0.0.0:8132', protocol: http-connect}\n";
        assert!(removed(0, cp_gone).is_empty());
    }

    fn removed_since(in_use: &LastUse, old: &ConfigFile, new: &ConfigFile) -> Vec<PathKey> {
        removed(in_use, 0, Some(old), new)
    }

    /// The record survives a restart: written, read back, entries older
    /// than the window dropped; a broken file starts an empty record.
    #[test]
    fn the_record_is_kept_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("usage.json");
        let u = Usage::open(p.to_str());
        assert!(u.loaded.is_empty());
        let mut now = used("a", "legacy-vpn", "http-connect:Reversed-VPN", 1000);
        now.extend(used("b", "sni", "tls-sni", 10));
        u.save(&now, 500).unwrap();
        let again = Usage::open(p.to_str());
        assert_eq!(
            again.loaded,
            used("a", "legacy-vpn", "http-connect:Reversed-VPN", 1000)
        );
        assert_eq!(again.now(&[]), again.loaded);
        std::fs::write(&p, "not json").unwrap();
        assert!(Usage::open(p.to_str()).loaded.is_empty());
        // Moved aside, not written over.
        let aside = p.with_file_name("usage.json.unreadable");
        assert_eq!(std::fs::read_to_string(aside).unwrap(), "not json");
    }
}
