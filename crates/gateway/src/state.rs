//! What a running gateway shares with its connection paths and admin
//! endpoint: `Gateway` (the snapshot, limits, counters, closers), the
//! per-listener context and the slots a routed connection holds. What the
//! gateway does (bind, serve, reload, drain) is in the crate root; the
//! paths take this state, so neither side needs the other.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use seedlink_config::compile::ListenerSpec;
use seedlink_config::Snapshot;
use seedlink_net::admin::source_key;
use seedlink_net::copy::Copier;
use seedlink_net::lifecycle::Lifecycle;
use seedlink_net::sockopt::Keepalive;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::metrics;

/// Shared state of a running gateway.
pub struct Gateway {
    pub(crate) snapshot: ArcSwap<Snapshot>,
    pub(crate) generation: AtomicU64,
    pub(crate) config_path: Option<PathBuf>,
    /// Metrics served on `/metrics`.
    pub metrics: metrics::Metrics,
    pub(crate) copier: Copier,
    /// Phase, drain signals and connection tasks.
    pub lifecycle: Lifecycle,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) max_connections: u64,
    pub(crate) workers: usize,
    pub(crate) sources: Sources,
    /// Routed connections per source (`limits.max_routed_per_source`).
    pub(crate) routed_sources: Sources,
    /// Routed connections per control plane.
    pub(crate) routed: Mutex<HashMap<String, u64>>,
    pub(crate) closers: Mutex<HashMap<String, CancellationToken>>,
    /// Control planes from the Kubernetes source, compiled after the file's.
    pub(crate) kubernetes: Mutex<Vec<Arc<seedlink_config::model::ControlPlane>>>,
    /// The refusals last logged (name, problems).
    pub(crate) refused_logged: Mutex<Vec<(String, String)>>,
    /// When the last reload ended and how (`success`, `failure`).
    pub(crate) last_reload: Mutex<Option<(std::time::SystemTime, &'static str)>>,
    pub(crate) locals: Mutex<HashMap<String, LocalHandler>>,
    /// Cancelled once the sockets were handed to a new process: the admin
    /// endpoint (shared with it) stops accepting here.
    pub(crate) handed_over: CancellationToken,
    /// `api/state`'s index of control planes by name, for the snapshot it
    /// was made from (admin.rs `place_of`).
    pub(crate) state_index: Mutex<Option<StateIndex>>,
    /// The record of the paths in use (the migration gate).
    pub(crate) usage: crate::paths::Usage,
}

/// A snapshot's control planes by name: their place in the file's list
/// followed by the Kubernetes source's. Made once per snapshot that
/// `api/state?control_plane=` is asked about, so that a script polling one
/// control plane does not walk every tenant's on each request. Tied to the
/// snapshot by a weak pointer (whose address is not reused while held).
pub(crate) type StateIndex = (std::sync::Weak<seedlink_config::Snapshot>, Arc<Places>);

/// Places by a hash of the name, sorted: made from a snapshot of a
/// thousand tenants at each change, so it copies no name (one hash and
/// one sort). Two names with the same hash both stay: a lookup yields
/// every place with the name's hash, and its caller keeps the one whose
/// name is the name asked for.
pub(crate) struct Places {
    hasher: foldhash::fast::RandomState,
    by_hash: Vec<(u64, usize)>,
}

impl Places {
    /// The places of `names`, in their order.
    pub(crate) fn of<'a>(names: impl Iterator<Item = &'a str>) -> Places {
        let hasher = foldhash::fast::RandomState::default();
        let mut by_hash: Vec<(u64, usize)> = names
            .enumerate()
            .map(|(i, n)| (std::hash::BuildHasher::hash_one(&hasher, n), i))
            .collect();
        by_hash.sort_unstable();
        Places { hasher, by_hash }
    }

    /// The places that may hold `name`, first place first.
    pub(crate) fn of_name(&self, name: &str) -> impl Iterator<Item = usize> + '_ {
        let h = std::hash::BuildHasher::hash_one(&self.hasher, name);
        let from = self.by_hash.partition_point(|&(k, _)| k < h);
        self.by_hash[from..]
            .iter()
            .take_while(move |&&(k, _)| k == h)
            .map(|&(_, i)| i)
    }
}

/// A routed connection handed to an in-process service (endpoint
/// `local:<name>`).
pub struct Handoff {
    /// The client socket.
    pub stream: tokio::net::TcpStream,
    /// Bytes already read that belong to the service: the ClientHello and
    /// what followed (TLS), or what followed the head (CONNECT).
    pub replay: Vec<u8>,
    /// The client's address (from the PROXY header if the LB sent one).
    pub client: std::net::SocketAddr,
    /// The control plane the connection was routed to.
    pub control_plane: String,
    /// For a CONNECT: its target (`host:port`). The service answers the
    /// CONNECT itself (`200` only once its own dial worked).
    pub connect_target: Option<String>,
}

/// Takes over a routed connection in this process.
pub type LocalHandler = Arc<dyn Fn(Handoff) + Send + Sync>;

/// Per-listener context handed to each connection.
pub struct ListenerCtx {
    /// The listener's configuration.
    pub spec: ListenerSpec,
    /// Its metric handles.
    pub metrics: Arc<metrics::ListenerMetrics>,
    /// The `protocol` label of its CONNECT tunnels
    /// (`http-connect:<destination header>`).
    pub connect_protocol: String,
}

/// Keepalive settings of a snapshot.
pub(crate) fn keepalive(snap: &Snapshot) -> Keepalive {
    Keepalive {
        time: snap.timeouts.keepalive_time,
        interval: snap.timeouts.keepalive_interval,
        retries: snap.timeouts.keepalive_retries,
    }
}

/// Counts connections per source: an IPv4 address, or an IPv6 /64 (one
/// host commonly holds a whole /64, so counting single IPv6 addresses
/// would cap nobody). A v4-mapped IPv6 address counts as its IPv4 one.
#[derive(Default)]
pub(crate) struct Sources {
    counts: Mutex<HashMap<IpAddr, u32>>,
}

/// Holds one routed slot of a control plane; released on drop.
pub(crate) struct RoutedGuard<'a> {
    gw: &'a Gateway,
    name: String,
}

impl Gateway {
    /// A routed slot of control plane `name`, if it has one free
    /// (`limits.max_connections_per_control_plane`, default half of
    /// `max_connections`).
    pub(crate) fn enter_control_plane(
        &self,
        snap: &Snapshot,
        name: &str,
    ) -> Option<RoutedGuard<'_>> {
        let cap = snap
            .limits
            .max_connections_per_control_plane
            .unwrap_or(self.max_connections / 2)
            .max(1);
        let mut m = seedlink_net::sync::lock(&self.routed, "routed counts");
        let n = m.entry(name.to_string()).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(RoutedGuard {
            gw: self,
            name: name.to_string(),
        })
    }
}

impl Gateway {
    /// The ACL decision for `client` on control plane `cp`: its allow-list
    /// or the global always-allowed CIDRs. A denial is counted.
    pub(crate) fn admit(
        &self,
        snap: &Snapshot,
        cp: &seedlink_config::routes::ControlPlane,
        client: SocketAddr,
    ) -> bool {
        let ip = client.ip();
        let allowed =
            snap.always_allowed.contains(ip) || cp.acl.as_ref().is_none_or(|acl| acl.contains(ip));
        if !allowed {
            self.metrics
                .acl_denied
                .get_or_create(&metrics::CpLabels {
                    control_plane: cp.name.clone(),
                })
                .inc();
        }
        allowed
    }

    /// The token that closes open connections of control plane `name` if it
    /// is removed and the removal grace passes.
    pub(crate) fn closer_for(&self, name: &str) -> CancellationToken {
        let mut closers = seedlink_net::sync::lock(&self.closers, "closers");
        // Looked up by `&str` first: no allocation once the name is known.
        if let Some(c) = closers.get(name) {
            return c.clone();
        }
        closers.entry(name.to_string()).or_default().clone()
    }
}

impl Gateway {
    /// A routed slot of the client's source, when
    /// `limits.max_routed_per_source` is set: `Ok(None)` without a cap,
    /// `Err(())` when the source holds its cap.
    pub(crate) fn enter_routed_source(
        &self,
        snap: &Snapshot,
        client: IpAddr,
    ) -> Result<Option<SourceGuard<'_>>, ()> {
        match snap.limits.max_routed_per_source {
            None => Ok(None),
            Some(max) => self.routed_sources.enter(client, max).map(Some).ok_or(()),
        }
    }
}

impl Drop for RoutedGuard<'_> {
    fn drop(&mut self) {
        let mut m = seedlink_net::sync::lock(&self.gw.routed, "routed counts");
        if let Some(n) = m.get_mut(&self.name) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.name);
            }
        }
    }
}

/// Holds one unrouted slot for a source; released on drop.
pub(crate) struct SourceGuard<'a> {
    sources: &'a Sources,
    ip: IpAddr,
}

impl Sources {
    pub(crate) fn enter(&self, ip: IpAddr, max: u32) -> Option<SourceGuard<'_>> {
        let ip = source_key(ip);
        let mut m = seedlink_net::sync::lock(&self.counts, "source counts");
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(SourceGuard { sources: self, ip })
    }
}

impl Drop for SourceGuard<'_> {
    fn drop(&mut self) {
        {
            let mut m = seedlink_net::sync::lock(&self.sources.counts, "source counts");
            if let Some(n) = m.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&self.ip);
                }
            }
        }
    }
}

#[cfg(test)]
mod places_tests {
    use super::Places;

    /// Every name is found at its places, first place first (a name given
    /// twice at both), and a name not given at none that holds it.
    #[test]
    fn every_name_is_found_at_its_places_first_first() {
        let names: Vec<String> = (0..500).map(|i| format!("t-{i}.kube-apiserver")).collect();
        let mut given: Vec<&str> = names.iter().map(String::as_str).collect();
        given.push("t-7.kube-apiserver");
        let places = Places::of(given.iter().copied());
        for (i, n) in names.iter().enumerate() {
            let at: Vec<usize> = places
                .of_name(n)
                .filter(|&p| given[p] == n.as_str())
                .collect();
            let want = match i {
                7 => vec![7, 500],
                _ => vec![i],
            };
            assert_eq!(at, want, "{n}");
        }
        let mut missing = places.of_name("t-500.kube-apiserver");
        assert!(!missing.any(|p| given[p] == "t-500.kube-apiserver"));
        assert_eq!(Places::of(std::iter::empty()).of_name("a").count(), 0);
    }
}
