//! The tunnel-server's source: TunnelClusters, their trust from labelled
//! Secrets and ConfigMaps, and the replica count.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::Store;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::api::ApiClients;
use super::coalesce::{follow_passes, Coalescer, StatusTask, Wake};
use super::gateway::{campaign, not_applied};
use super::handle::Handle;
use super::metrics::SourceMetrics;
use super::sink::{Replica, TunnelSink};
use super::status::*;
use super::watches::*;
use crate::translate::Key;

/// The replicas a Service's EndpointSlices name: distinct pods (an
/// endpoint naming none: distinct addresses) whose endpoint serves (an
/// unknown condition counts), terminating or not; a dual-stack pod, in an
/// IPv4 and an IPv6 slice, is one replica. A replica being replaced still
/// serves through its preStop wait while its successor is already Ready
/// and receiving dials: counting both tells the agents (which hold a
/// stream to each replica they know of) to join the successor at once,
/// instead of when the old one drains; otherwise dials the successor gets
/// meanwhile find no agent. Once the old one stops serving the count drops
/// back. `None` when there is none (a count of 0 is never sent to agents).
pub fn replica_count(slices: &[Arc<EndpointSlice>]) -> Option<u32> {
    let mut seen = HashSet::new();
    for ep in slices.iter().flat_map(|s| &s.endpoints) {
        let c = ep.conditions.as_ref();
        let ready = c.and_then(|c| c.ready) != Some(false);
        if !c.and_then(|c| c.serving).unwrap_or(ready) {
            continue;
        }
        let key = pod_of(ep).map(|p| format!("pod/{p}"));
        if let Some(k) = key.or_else(|| ep.addresses.first().cloned()) {
            seen.insert(k);
        }
    }
    u32::try_from(seen.len()).ok().filter(|n| *n > 0)
}

/// The pod an endpoint names, if any.
fn pod_of(ep: &k8s_openapi::api::discovery::v1::Endpoint) -> Option<String> {
    ep.target_ref
        .as_ref()
        .filter(|r| r.kind.as_deref() == Some("Pod"))
        .and_then(|r| r.name.clone())
}

/// Serving and not terminating: agents are not sent to a replica that
/// drains (it is still counted while it serves).
fn takes_new_streams(ep: &k8s_openapi::api::discovery::v1::Endpoint) -> bool {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready) != Some(false);
    let terminating = c.and_then(|c| c.terminating) == Some(true);
    !terminating && c.and_then(|c| c.serving).unwrap_or(ready)
}

/// Most replicas told to agents with their addresses (the agent keeps no
/// more than this either).
pub const MAX_REPLICA_ADDRESSES: usize = 32;

/// Where each counted replica is reached, by `template`: the serving
/// endpoints (as [`replica_count`] counts them) that name their pod, whose
/// name is the replica's `serverid`; sorted by it, at most
/// [`MAX_REPLICA_ADDRESSES`].
pub fn replica_addresses(
    slices: &[Arc<EndpointSlice>],
    template: &seedlink_config::tunnel::ReplicaAddresses,
) -> Vec<Replica> {
    // Each pod's address; of a dual-stack pod's, the IPv4 one, whatever
    // order the slices come in.
    let mut at: std::collections::BTreeMap<String, std::net::IpAddr> = Default::default();
    for ep in slices.iter().flat_map(|s| &s.endpoints) {
        let ip = ep.addresses.first().and_then(|a| a.parse().ok());
        if let (true, Some(pod), Some(ip)) = (takes_new_streams(ep), pod_of(ep), ip) {
            let kept = at.entry(pod).or_insert(ip);
            *kept = (*kept).min(ip);
        }
    }
    at.into_iter()
        .take(MAX_REPLICA_ADDRESSES)
        .map(|(pod, ip)| {
            let (address, server_name) = template.of(ip, &pod);
            Replica {
                pod,
                address,
                server_name,
            }
        })
        .collect()
}

/// What the tunnel-server's source needs to know.
#[derive(Debug, Clone)]
pub struct TunnelSettings {
    /// The status lease; `None`: this replica never writes status.
    pub lease: Option<Key>,
    /// This replica's name in the lease.
    pub identity: String,
    /// Where Secret and ConfigMap keys are written.
    pub trust_dir: std::path::PathBuf,
    /// Where TunnelClusters' Unix sockets go, each cluster in a directory
    /// of its own.
    pub socket_dir: std::path::PathBuf,
    /// The operator's ceilings over TunnelClusters' limits, and the
    /// addresses their TokenReviews may go to.
    pub bounds: crate::tunnel::Bounds,
    /// The Service selecting the tunnel-server replicas (`servercount`).
    pub replicas: Option<Key>,
    /// Where agents reach each replica (`kubernetes.replica_addresses`).
    pub replica_addresses: Option<seedlink_config::tunnel::ReplicaAddresses>,
    /// How the labelled Secrets and ConfigMaps are watched
    /// (`kubernetes.trust_watch`).
    pub trust_watch: seedlink_config::tunnel::TrustWatch,
    /// How long a claim a cluster stops trusting stays reserved to it
    /// (`status.released`).
    pub released_trust_hold: Duration,
}

/// How long a pass waits for the new namespaces' Secrets and ConfigMaps
/// to be listed, all at once (a namespace whose RoleBinding is missing
/// never is).
pub(super) const TRUST_LIST_WAIT: Duration = Duration::from_secs(5);

/// The Secrets and ConfigMaps the tunnel-server reads: only those
/// labelled `seedlink.dev/tunnel-trust=true`, in the namespaces whose
/// TunnelClusters name that kind (a namespace whose clusters name only
/// ConfigMaps, as a control plane's generated one does, has none of its
/// Secrets read).
///
/// By default (`trust_watch: namespaces`) one watch per such namespace
/// and kind, started and stopped as TunnelClusters come and go: it needs
/// no cluster-wide grant, only a RoleBinding in each namespace
/// (docs/KUBERNETES.md). With `trust_watch: cluster`, one watch of each
/// kind across the cluster, filtered here to the same namespaces: two
/// watches whatever the tenant count, through a ClusterRoleBinding.
///
/// Per namespace, at most `most_watches` watches (what
/// `kubernetes.max_api_connections` leaves beside the main connection);
/// the namespaces past them are listed again on a pace instead
/// (`poll.rs`), the first ones come first and keep their watch, and a
/// watch freed goes to a namespace listed on the pace.
#[derive(Default)]
pub(super) struct TrustWatches {
    secrets: HashMap<String, Followed<Secret>>,
    config_maps: HashMap<String, Followed<ConfigMap>>,
    /// The most per-namespace watches.
    most_watches: usize,
    /// The turns of the lists of the namespaces past them.
    pace: super::poll::Pace,
    /// The cluster-wide watches (`trust_watch: cluster`).
    cluster: Option<ClusterTrust>,
}

/// One namespace's labelled objects of one kind: watched, or listed on a
/// pace (`polled`); until `stop`.
struct Followed<K: TrustKind> {
    store: Store<K>,
    stop: CancellationToken,
    polled: bool,
    /// A watch started for a namespace listed on the pace, which takes
    /// over once it has listed (until then, and should its list fail,
    /// what the pace read stands: the namespace's trust never reads as
    /// empty meanwhile).
    next: Option<(Store<K>, CancellationToken)>,
}

impl<K: TrustKind> Followed<K> {
    /// Whether it holds a watch (or one is starting for it).
    fn watching(&self) -> bool {
        !self.polled || self.next.is_some()
    }

    /// Its watch, once listed, takes over from the pace.
    fn take_over(&mut self) {
        use futures_util::FutureExt;
        let listed = self.next.as_ref().is_some_and(|(store, _)| {
            matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
        });
        if let Some((store, stop)) = self.next.take_if(|_| listed) {
            self.stop.cancel();
            *self = Followed {
                store,
                stop,
                polled: false,
                next: None,
            };
        }
    }

    fn stop(&self) {
        self.stop.cancel();
        if let Some((_, stop)) = &self.next {
            stop.cancel();
        }
    }
}

/// The cluster-wide trust watches, and the namespaces read from them
/// (shared with the watches: an event on an object elsewhere wakes no
/// pass).
struct ClusterTrust {
    secrets: Store<Secret>,
    config_maps: Store<ConfigMap>,
    errors: WatchErrors,
    wanted: Wanted,
    /// Whether the first lists were waited for (once: a missing
    /// ClusterRoleBinding delays the first pass only).
    waited: bool,
}

/// The namespaces whose TunnelClusters name a Secret, and those that name
/// a ConfigMap.
type Namespaces = (HashSet<String>, HashSet<String>);
type Wanted = Arc<std::sync::RwLock<Namespaces>>;

/// Whether an object's namespace is one `pick` takes from `wanted`.
fn in_wanted<K: kube::Resource>(
    wanted: &Wanted,
    pick: fn(&Namespaces) -> &HashSet<String>,
) -> super::watches::Relevant<K> {
    let wanted = wanted.clone();
    Arc::new(move |o: &K, _| {
        let w = wanted
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        o.meta()
            .namespace
            .as_ref()
            .is_some_and(|ns| pick(&w).contains(ns))
    })
}

type Secret = k8s_openapi::api::core::v1::Secret;
type ConfigMap = k8s_openapi::api::core::v1::ConfigMap;

impl TrustWatches {
    /// The trust watches `trust_watch` asks for: the cluster-wide ones
    /// start here, the per-namespace ones as clusters name them.
    /// Per namespace, at most `most_watches` watches.
    pub(super) fn new(
        w: &Watches,
        trust_watch: seedlink_config::tunnel::TrustWatch,
        most_watches: usize,
    ) -> Self {
        let cluster = (trust_watch == seedlink_config::tunnel::TrustWatch::Cluster).then(|| {
            let selector = format!("{}=true", crate::tunnel::TRUST_LABEL);
            let wanted = Wanted::default();
            ClusterTrust {
                secrets: w.labelled_where(&selector, in_wanted(&wanted, |w| &w.0)),
                config_maps: w.labelled_where(&selector, in_wanted(&wanted, |w| &w.1)),
                errors: w.tx.errors.clone(),
                wanted,
                waited: false,
            }
        });
        TrustWatches {
            cluster,
            most_watches,
            ..Default::default()
        }
    }

    /// Watches exactly the namespaces and kinds `clusters` name; a new
    /// watch (or, cluster-wide, the first list) is waited for (bounded)
    /// so that its references resolve in this pass.
    pub(super) async fn follow(
        &mut self,
        w: &Watches,
        clusters: &[Arc<crate::crd::TunnelCluster>],
    ) {
        let (secrets, config_maps) = wanted(clusters);
        if let Some(c) = &mut self.cluster {
            *c.wanted
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = (secrets, config_maps);
            if !std::mem::replace(&mut c.waited, true) {
                let listed = futures_util::future::join(
                    listed_or_failed((c.secrets.clone(), c.errors.clone())),
                    listed_or_failed((c.config_maps.clone(), c.errors.clone())),
                );
                if tokio::time::timeout(TRUST_LIST_WAIT, listed).await.is_err() {
                    tracing::warn!("the labelled Secrets and ConfigMaps not listed yet (is seedlink bound to seedlink-tunnel-trust cluster-wide?)");
                }
            }
            return;
        }
        stop_unwanted(&mut self.secrets, &secrets);
        stop_unwanted(&mut self.config_maps, &config_maps);
        let held =
            count(&self.secrets, Followed::watching) + count(&self.config_maps, Followed::watching);
        let mut room = self.most_watches.saturating_sub(held);
        let pace = &self.pace;
        let new_secrets = follow_kind(w, &mut self.secrets, secrets, &mut room, pace);
        let new_config_maps = follow_kind(w, &mut self.config_maps, config_maps, &mut room, pace);
        // Every new watch at once, within one bound: a namespace whose
        // RoleBinding is missing (never listed) costs a pass this wait
        // once, not once per namespace and kind.
        // A watch refused its list (no RoleBinding: 403) ends its wait.
        let listed = futures_util::future::join(
            futures_util::future::join_all(new_secrets.into_iter().map(listed_or_failed)),
            futures_util::future::join_all(new_config_maps.into_iter().map(listed_or_failed)),
        );
        if tokio::time::timeout(TRUST_LIST_WAIT, listed).await.is_err() {
            tracing::warn!("a TunnelCluster's namespace: its labelled Secrets or ConfigMaps not listed yet (is seedlink's RoleBinding there?)");
        }
        // The watches that took the place of the pace and have listed.
        self.secrets.values_mut().for_each(Followed::take_over);
        self.config_maps.values_mut().for_each(Followed::take_over);
        self.count_polled(w);
    }

    #[allow(clippy::type_complexity)]
    pub(super) fn state(&self) -> (Vec<Arc<Secret>>, Vec<Arc<ConfigMap>>) {
        if let Some(c) = &self.cluster {
            let w = c
                .wanted
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            return (
                in_namespaces(&c.secrets, &w.0),
                in_namespaces(&c.config_maps, &w.1),
            );
        }
        let secrets = self.secrets.values().flat_map(|f| f.store.state());
        let config_maps = self.config_maps.values().flat_map(|f| f.store.state());
        (secrets.collect(), config_maps.collect())
    }

    /// Counts the namespaces listed on the pace, and says so when their
    /// number changes.
    fn count_polled(&self, w: &Watches) {
        let n = count(&self.secrets, |f| f.polled) + count(&self.config_maps, |f| f.polled);
        let was = w.tx.metrics.polled();
        w.tx.metrics.set_polled(n);
        if n > 0 && n != was {
            let every = super::poll::EVERY_AT_LEAST.max(std::time::Duration::from_secs(
                n as u64 / u64::from(super::poll::PER_SECOND),
            ));
            tracing::warn!(
                polled = n,
                watches = self.most_watches,
                every_seconds = every.as_secs(),
                "kubernetes: more tenant namespaces' trust than kubernetes.max_api_connections leaves watches for; the rest is listed again on a pace (a change there is seen within the interval); raise max_api_connections or watches_per_connection where the API server allows more streams, or use trust_watch: cluster"
            );
        }
    }
}

/// How many of `followed` are `which`.
fn count<K: TrustKind>(
    followed: &HashMap<String, Followed<K>>,
    which: fn(&Followed<K>) -> bool,
) -> usize {
    followed.values().filter(|f| which(f)).count()
}

/// Stops following the namespaces no longer `wanted`.
fn stop_unwanted<K: TrustKind>(
    followed: &mut HashMap<String, Followed<K>>,
    wanted: &HashSet<String>,
) {
    followed.retain(|ns, f| {
        let keep = wanted.contains(ns);
        if !keep {
            f.stop();
        }
        keep
    });
}

/// The objects of `store` in one of `namespaces`.
fn in_namespaces<K: TrustKind>(store: &Store<K>, namespaces: &HashSet<String>) -> Vec<Arc<K>> {
    let mut objects = store.state();
    objects.retain(|o| {
        o.meta()
            .namespace
            .as_ref()
            .is_some_and(|ns| namespaces.contains(ns))
    });
    objects
}

/// The namespaces whose TunnelClusters name a Secret, and those that
/// name a ConfigMap.
fn wanted(clusters: &[Arc<crate::crd::TunnelCluster>]) -> (HashSet<String>, HashSet<String>) {
    let (mut secrets, mut config_maps) = (HashSet::new(), HashSet::new());
    for c in clusters {
        let Some(ns) = c.metadata.namespace.clone() else {
            continue;
        };
        let (s, m) = crate::tunnel::references(&c.spec);
        if s {
            secrets.insert(ns.clone());
        }
        if m {
            config_maps.insert(ns);
        }
    }
    (secrets, config_maps)
}

/// What the trust watches are of: a namespaced kind (Secrets,
/// ConfigMaps).
use super::watches::Namespaced as TrustKind;

/// Until `store` has its first list, or its watch failed.
async fn listed_or_failed<K: TrustKind>((store, errors): (Store<K>, WatchErrors)) {
    tokio::select! {
        _ = store.wait_until_ready() => {}
        () = errors.failed() => {}
    }
}

/// Follows each namespace in `wanted` (those no longer wanted are
/// stopped already): by a watch while there is `room`, the ones listed on
/// `pace` first (a watch started beside the pace, which takes over once
/// listed); else listed on `pace`. Returns the stores started, with their
/// errors, to wait for their first lists. Namespaces are taken in name
/// order, so that the same ones are watched from one start to the next.
fn follow_kind<K: TrustKind>(
    w: &Watches,
    followed: &mut HashMap<String, Followed<K>>,
    wanted: HashSet<String>,
    room: &mut usize,
    pace: &super::poll::Pace,
) -> Vec<(Store<K>, WatchErrors)> {
    let selector = format!("{}=true", crate::tunnel::TRUST_LABEL);
    let mut started = Vec::new();
    followed.values_mut().for_each(Followed::take_over);
    let mut start = |ns: &str, room: &mut usize, watch: bool| {
        let stop = w.stop.child_token();
        let (store, errors) = match watch {
            true => {
                *room -= 1;
                w.labelled_in::<K>(ns, &selector, &stop, true)
            }
            false => w.polled_in::<K>(ns, &selector, &stop, pace),
        };
        started.push((store.clone(), errors));
        (store, stop)
    };
    let mut promoted: Vec<&String> = followed
        .iter()
        .filter(|(_, f)| !f.watching())
        .map(|(ns, _)| ns)
        .collect();
    promoted.sort();
    let promoted: Vec<String> = promoted.into_iter().take(*room).cloned().collect();
    for ns in promoted {
        if let Some(f) = followed.get_mut(&ns) {
            f.next = Some(start(&ns, room, true));
        }
    }
    let mut new: Vec<String> = wanted
        .into_iter()
        .filter(|ns| !followed.contains_key(ns))
        .collect();
    new.sort();
    for ns in new {
        let watch = *room > 0;
        let (store, stop) = start(&ns, room, watch);
        let f = Followed {
            store,
            stop,
            polled: !watch,
            next: None,
        };
        followed.insert(ns, f);
    }
    started
}

/// Starts the tunnel-server's source: TunnelClusters and the Secrets and
/// ConfigMaps they name, clusters into `sink`, status with health.
pub fn start_tunnel(
    clients: ApiClients,
    settings: TunnelSettings,
    sink: Arc<dyn TunnelSink>,
) -> Handle {
    let stop = CancellationToken::new();
    let client = clients.main().clone();
    let metrics = SourceMetrics::new("tunnel");
    let mut w = Watches::new(&clients, &stop, &metrics);
    let errors = w.tx.errors.clone();
    let clusters = w.kind::<crate::crd::TunnelCluster>();
    let replicas = settings.replicas.as_ref().map(|k| {
        w.labelled_in::<EndpointSlice>(
            &k.namespace,
            &format!("kubernetes.io/service-name={}", k.name),
            &stop,
            false,
        )
        .0
    });
    let coalescer = Coalescer {
        changed: std::mem::replace(&mut w.changed, mpsc::channel(1).1),
        stop: stop.clone(),
    };
    let (leadership, campaign_task) =
        campaign(&client, settings.lease.as_ref(), &settings.identity, &stop);
    let (synced_tx, synced) = watch::channel(false);
    let status = StatusWriter::new(client, leadership.clone(), &settings.identity, &metrics);
    let metrics_for_passes = metrics.clone();
    tokio::spawn(async move {
        tokio::select! {
            r = clusters.wait_until_ready() => if r.is_err() { return },
            () = coalescer.stop.cancelled() => return,
        }
        let hold = k8s_openapi::jiff::SignedDuration::try_from(settings.released_trust_hold)
            .unwrap_or(k8s_openapi::jiff::SignedDuration::MAX);
        let writer = TunnelStatus {
            status,
            sink: sink.clone(),
            hold,
        };
        // The watches the connections besides the main one carry, but the
        // replicas' slices' (on one of them too).
        let room = w.clients.watch_room();
        let room = room.saturating_sub(usize::from(settings.replicas.is_some()));
        let trust = TrustWatches::new(&w, settings.trust_watch, room);
        let passes = TunnelPasses {
            w,
            clusters,
            replicas,
            settings,
            metrics: metrics_for_passes,
            status: follow_passes(writer, coalescer.stop.clone()),
            trust,
            applied: None,
            written: None,
        };
        passes.run(coalescer, sink, &synced_tx).await;
    });
    Handle {
        synced,
        errors,
        leadership,
        stop,
        campaign: std::sync::Mutex::new(campaign_task),
        metrics,
    }
}

/// The tunnel source's loop: translate and apply on a change, the
/// replica count and status on every wake-up.
pub(super) struct TunnelPasses {
    pub(super) w: Watches,
    pub(super) clusters: Store<crate::crd::TunnelCluster>,
    /// The tunnel-server Service's EndpointSlices (`kubernetes.replicas`).
    pub(super) replicas: Option<Store<EndpointSlice>>,
    pub(super) settings: TunnelSettings,
    pub(super) metrics: SourceMetrics,
    /// The latest pass, for the status task.
    pub(super) status: watch::Sender<Option<Arc<TunnelPass>>>,
    pub(super) trust: TrustWatches,
    /// What was last handed to the server, and what it refused: an event
    /// that changes none of it (another Secret in the namespace) does
    /// not reload the server.
    pub(super) applied: Option<Applied>,
    /// The trust files last written, and when the directory was last
    /// read and swept whole (`None` at first and after a failed write).
    /// It is swept whole at least every [`SWEEP_EVERY`], so that a file
    /// removed or changed from outside is put back.
    pub(super) written: Option<(
        tokio::time::Instant,
        std::collections::BTreeMap<std::path::PathBuf, Vec<u8>>,
    )>,
}

/// How often a pass reads and sweeps the trust directory whole.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Writes the TunnelClusters' status from the latest pass, with the
/// server's view of each (agents, dial errors, trust).
pub(super) struct TunnelStatus {
    pub(super) status: StatusWriter,
    pub(super) sink: Arc<dyn TunnelSink>,
    /// How long a released claim stays reserved.
    pub(super) hold: k8s_openapi::jiff::SignedDuration,
}

impl StatusTask for TunnelStatus {
    type Pass = TunnelPass;

    async fn write(&mut self, (t, objects): &TunnelPass) {
        self.status
            .write_tunnels(t, objects, self.sink.as_ref(), self.hold)
            .await;
    }
}

/// The clusters handed to the server, the trust files they name (a CA
/// replaced in its Secret keeps the file's path but changes its contents,
/// and must reach the server: its agents are checked against it again),
/// and what the server refused.
pub(super) type Applied = (
    Vec<seedlink_config::tunnel::Cluster>,
    std::collections::BTreeMap<std::path::PathBuf, Vec<u8>>,
    seedlink_config::compile::Refused,
);

/// The last tunnel translation and the objects it was made from.
pub(super) type TunnelPass = (
    crate::tunnel::TunnelTranslation,
    Vec<Arc<crate::crd::TunnelCluster>>,
);

impl TunnelPasses {
    /// `servercount`, and where each replica is reached, from the
    /// replicas' EndpointSlices, when they are read.
    fn count_replicas(&self, sink: &dyn TunnelSink) {
        let Some(slices) = self.replicas.as_ref().map(Store::state) else {
            return;
        };
        if let Some(n) = replica_count(&slices) {
            let at = self.settings.replica_addresses.as_ref();
            sink.set_replicas(
                n,
                at.map(|t| replica_addresses(&slices, t))
                    .unwrap_or_default(),
            );
        }
    }

    pub(super) async fn run(
        mut self,
        mut coalescer: Coalescer,
        sink: Arc<dyn TunnelSink>,
        synced: &watch::Sender<bool>,
    ) {
        let mut wake = Wake::Changed;
        let mut passed = false;
        loop {
            // What could not be applied at all is tried again on a tick.
            if self
                .applied
                .as_ref()
                .is_some_and(|(_, _, r)| not_applied(r))
            {
                self.applied = None;
            }
            self.count_replicas(sink.as_ref());
            if wake == Wake::Changed || !passed || self.applied.is_none() {
                let started = tokio::time::Instant::now();
                let pass = self.pass(sink.as_ref()).await;
                self.metrics.applied(started.elapsed());
                let _ = synced.send(true);
                self.status.send_replace(Some(Arc::new(pass)));
                passed = true;
            }
            wake = coalescer.next().await;
            if wake == Wake::Stop {
                return;
            }
        }
    }

    /// Translates the TunnelClusters and what they name, writes their
    /// trust files and applies the clusters (unless nothing changed).
    pub(super) async fn pass(&mut self, sink: &dyn TunnelSink) -> TunnelPass {
        let objects = self.clusters.state();
        self.trust.follow(&self.w, &objects).await;
        let (secrets, config_maps) = self.trust.state();
        let s = &self.settings;
        let mut t = crate::tunnel::translate(
            &objects,
            &secrets,
            &config_maps,
            &s.trust_dir,
            &s.socket_dir,
            &s.bounds,
        );
        let now = tokio::time::Instant::now();
        let written = self.written.take().filter(|w| now < w.0 + SWEEP_EVERY);
        let swept = written.as_ref().map_or(now, |w| w.0);
        let since = written.as_ref().map(|w| &w.1);
        match crate::tunnel::materialize_since(&s.trust_dir, &t.files, since) {
            Err(e) => {
                // Nothing is applied: the running clusters stay.
                tracing::error!(dir = %s.trust_dir.display(), error = %e, "cannot write the clusters' trust files; keeping the running clusters");
                return (t, objects);
            }
            // A sweep put back a file changed from outside: applied
            // again, so that nothing read from it meanwhile stands.
            Ok(true) => self.applied = None,
            Ok(false) => {}
        }
        self.written = Some((swept, t.files.clone()));
        let refused = match &self.applied {
            Some((c, f, r)) if *c == t.clusters && *f == t.files => r.clone(),
            _ => {
                let r = sink
                    .apply(
                        t.clusters.clone(),
                        status_held(&objects, k8s_openapi::jiff::Timestamp::now()),
                    )
                    .await;
                self.applied = Some((t.clusters.clone(), t.files.clone(), r.clone()));
                r
            }
        };
        t.refused(&refused);
        (t, objects)
    }
}

/// Who holds each trust claim by the TunnelClusters' statuses (claim →
/// cluster): what each trusts, and what each released that is still
/// reserved to it at `now`; the oldest object first should two say the
/// same (only seedlink writes status, so they do not).
pub(super) fn status_held(
    objects: &[Arc<crate::crd::TunnelCluster>],
    now: k8s_openapi::jiff::Timestamp,
) -> HashMap<String, String> {
    let mut sorted: Vec<&Arc<crate::crd::TunnelCluster>> = objects.iter().collect();
    sorted.sort_by_key(|o| {
        (
            o.metadata.creation_timestamp.as_ref().map(|t| t.0),
            Key::of(o.as_ref()),
        )
    });
    let mut held = HashMap::new();
    for o in sorted {
        let name = crate::tunnel::cluster_name(&Key::of(o.as_ref()));
        let status = o.status.iter();
        let released = status.clone().flat_map(|s| &s.released);
        let reserved = released.filter(|r| super::status::reserved(r, now));
        let claims = status
            .flat_map(|s| &s.trust)
            .chain(reserved.map(|r| &r.claim));
        for claim in claims {
            held.entry(claim.clone()).or_insert_with(|| name.clone());
        }
    }
    held
}

/// Watches the trust-labelled Secrets and ConfigMaps of namespace `ns`,
/// waiting (bounded) for their first lists; the handles and what stops
/// them.
#[cfg(test)]
mod replica_tests {
    use super::*;
    use serde_json::json;

    /// Cluster-wide, only the namespaces whose clusters name a kind are
    /// read of it, and only their objects' events wake a pass: a labelled
    /// Secret in a namespace without a cluster, or in one whose clusters
    /// name only ConfigMaps, is nobody's trust.
    #[test]
    fn cluster_wide_trust_is_read_only_where_clusters_name_it() {
        let secret = |ns: &str| -> Secret {
            serde_json::from_value(json!({"metadata": {"name": "ca", "namespace": ns}})).unwrap()
        };
        let mut writer = kube::runtime::reflector::store::Writer::<Secret>::default();
        for ns in ["t1", "t2", "nobody"] {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(secret(ns)));
        }
        let wanted = Wanted::default();
        *wanted.write().unwrap() = (
            ["t1".to_string()].into(),
            ["t1".to_string(), "t2".to_string()].into(),
        );
        let read = in_namespaces(&writer.as_reader(), &wanted.read().unwrap().0);
        let read: Vec<_> = read.iter().map(|s| s.metadata.namespace.clone()).collect();
        assert_eq!(read, vec![Some("t1".to_string())]);
        let wakes = in_wanted::<Secret>(&wanted, |w| &w.0);
        assert!(wakes(&secret("t1"), false));
        assert!(!wakes(&secret("t2"), false) && !wakes(&secret("nobody"), true));
    }

    /// A namespace is watched for the kinds its TunnelClusters name: a
    /// generated cluster trusting a ConfigMap needs no grant on Secrets.
    #[test]
    fn only_the_kinds_a_cluster_names_are_watched() {
        let spec = |v: serde_json::Value| -> crate::crd::TunnelClusterSpec {
            serde_json::from_value(v).unwrap()
        };
        let cm = json!({"configMap": "trust", "key": "ca.crt"});
        let secret = json!({"secret": "trust", "key": "ca.crt"});
        assert_eq!(
            crate::tunnel::references(&spec(json!({"agentCA": cm}))),
            (false, true)
        );
        assert_eq!(
            crate::tunnel::references(&spec(json!({"agentCA": secret}))),
            (true, false)
        );
        let review = json!({"agentToken": {"issuer": "i", "review": {
            "url": "https://k.ns.svc", "ca": cm, "credentials": "c"}}});
        assert_eq!(crate::tunnel::references(&spec(review)), (true, true));
        let tls = json!({"agentCA": cm, "frontends": [{"name": "f", "protocol": "grpc",
            "tcp": "0.0.0.0:1", "tls": {"secret": "fe", "clientCA": cm}}]});
        assert_eq!(crate::tunnel::references(&spec(tls)), (true, true));
    }

    #[test]
    fn replicas_are_the_serving_endpoints_terminating_or_not() {
        let slice = |eps: serde_json::Value| -> Arc<EndpointSlice> {
            Arc::new(
                serde_json::from_value(json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": eps
                }))
                .unwrap(),
            )
        };
        let three = slice(json!([
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.2"]},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "serving": true, "terminating": true}},
            {"addresses": ["10.0.0.4"], "conditions": {"ready": false}}
        ]));
        // The same address in two slices counts once.
        let again = slice(json!([{"addresses": ["10.0.0.1"], "conditions": {"ready": true}}]));
        // 10.0.0.1, 10.0.0.2 (no conditions) and 10.0.0.3 (terminating,
        // still serving through its preStop wait).
        assert_eq!(replica_count(&[three, again]), Some(3));
        assert_eq!(replica_count(&[slice(json!([]))]), None);
        assert_eq!(replica_count(&[]), None);
    }

    /// Each serving endpoint that names its pod is a replica known by the
    /// pod's name, reached where the template says (an IPv6 address in
    /// brackets); one naming no pod, not serving, or terminating (it
    /// drains) is not told.
    #[test]
    fn replica_addresses_name_each_serving_pod() {
        let slice: Arc<EndpointSlice> = Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": [
                    {"addresses": ["10.0.0.2"], "targetRef": {"kind": "Pod", "name": "seedlink-b"}},
                    {"addresses": ["fd00::1"], "targetRef": {"kind": "Pod", "name": "seedlink-a"}},
                    {"addresses": ["10.0.0.9"], "targetRef": {"kind": "Pod", "name": "seedlink-old"},
                     "conditions": {"ready": false, "serving": true, "terminating": true}},
                    {"addresses": ["10.0.0.3"], "targetRef": {"kind": "Pod", "name": "seedlink-c"},
                     "conditions": {"ready": false}},
                    {"addresses": ["10.0.0.4"]},
                    {"addresses": ["10.0.0.5"], "targetRef": {"kind": "Node", "name": "n"}}
                ]
            }))
            .unwrap(),
        );
        let t = seedlink_config::tunnel::ReplicaAddresses {
            address: "{ip}:8091".into(),
            server_name: Some("{pod}.tunnel.example.com".into()),
        };
        // seedlink-b is dual-stack: its IPv6 endpoint, in another slice,
        // first; it is one replica, told by its IPv4 address.
        let v6: Arc<EndpointSlice> = Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s6"}, "addressType": "IPv6", "endpoints": [
                    {"addresses": ["fd00::2"], "targetRef": {"kind": "Pod", "name": "seedlink-b"}}
                ]
            }))
            .unwrap(),
        );
        // b, a, old (terminating, still serving) and the two naming no pod.
        assert_eq!(replica_count(&[v6.clone(), slice.clone()]), Some(5));
        let at = replica_addresses(&[v6, slice.clone(), slice], &t);
        let got: Vec<_> = at
            .iter()
            .map(|r| (r.pod.as_str(), r.address.as_str(), r.server_name.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "seedlink-a",
                    "[fd00::1]:8091",
                    "seedlink-a.tunnel.example.com"
                ),
                (
                    "seedlink-b",
                    "10.0.0.2:8091",
                    "seedlink-b.tunnel.example.com"
                ),
            ]
        );
    }
}
