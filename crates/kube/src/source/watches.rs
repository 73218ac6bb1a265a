//! One watch per kind: kube-rs `watcher` and a reflector store, the
//! "changed" signal, and TLSRoutes through the version the CRD serves.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use gateway_api::tlsroutes::TlsRoute;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Resource;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::api::{ApiClients, WatchSlot};
use super::metrics::SourceMetrics;
use crate::translate::{Key, GATEWAY_GROUP};

/// The Services a source's pass reads (namespace, name), set before each
/// pass from what the routes name: an event on any other Service, or on
/// an EndpointSlice of any other Service, changes nothing translated and
/// wakes no pass (the object is still kept, for a route that names it
/// later: that route's own event wakes the pass that reads it). `None`
/// until the first pass: every event counts.
#[derive(Clone, Default)]
pub(super) struct Interest(Arc<std::sync::RwLock<Option<std::collections::HashSet<Key>>>>);

impl Interest {
    /// From now on only events on these Services (and their slices) count.
    pub(super) fn set(&self, services: std::collections::HashSet<Key>) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(services);
    }

    /// Whether an event on Service `namespace/name` (or one of its slices)
    /// may change a pass.
    pub(super) fn counts(&self, namespace: &str, name: &str) -> bool {
        let set = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        set.as_ref().is_none_or(|s| {
            s.contains(&Key {
                namespace: namespace.to_string(),
                name: name.to_string(),
            })
        })
    }
}

/// The namespaces whose objects changed since the last pass took them
/// ([`Touched::take`]), so that a pass translates those (and the ones
/// whose routes read them) rather than fingerprinting every object. A
/// watch that lists again (a start, a restart after an error or a gap)
/// touches everything: objects deleted meanwhile left no event. So does a
/// set grown past [`MAX_TOUCHED`] (a pass over everything is then the
/// cheaper one, and the set stays bounded). Cluster-scoped kinds other
/// than Namespace touch nothing: what a pass reads of them (the served
/// Gateways and class) is fingerprinted on every pass.
#[derive(Clone)]
pub(super) struct Touched(Arc<std::sync::Mutex<Option<std::collections::HashSet<String>>>>);

/// Beyond this many namespaces touched between two passes, the next pass
/// looks at everything.
pub(super) const MAX_TOUCHED: usize = 1024;

impl Default for Touched {
    /// Everything: the first pass looks at every object.
    fn default() -> Touched {
        Touched(Arc::new(std::sync::Mutex::new(None)))
    }
}

impl Touched {
    fn set(&self) -> std::sync::MutexGuard<'_, Option<std::collections::HashSet<String>>> {
        seedlink_net::sync::lock(&self.0, "touched namespaces")
    }

    /// Objects in `namespace` changed.
    pub(super) fn namespace(&self, namespace: &str) {
        let mut set = self.set();
        if let Some(s) = set.as_mut() {
            if s.len() >= MAX_TOUCHED {
                *set = None;
            } else if !s.contains(namespace) {
                s.insert(namespace.to_string());
            }
        }
    }

    /// Anything may have changed.
    pub(super) fn everything(&self) {
        *self.set() = None;
    }

    /// What was touched since the last call (`None`: everything), leaving
    /// nothing touched. Taken before the pass reads the stores: an event
    /// after this is in the next pass, which it wakes.
    pub(super) fn take(&self) -> Option<std::collections::HashSet<String>> {
        self.set().replace(Default::default())
    }

    /// Notes `event` of a kind (`namespaces`: the Namespace kind, whose
    /// objects are touched by name).
    fn note<K: Resource>(&self, event: &watcher::Event<K>, namespaces: bool) {
        let o = match event {
            watcher::Event::Apply(o) | watcher::Event::Delete(o) => o,
            watcher::Event::Init | watcher::Event::InitApply(_) | watcher::Event::InitDone => {
                return self.everything()
            }
        };
        let m = o.meta();
        match (&m.namespace, namespaces) {
            (Some(ns), _) => self.namespace(ns),
            (None, true) => self.namespace(m.name.as_deref().unwrap_or_default()),
            (None, false) => {}
        }
    }
}

/// Whether an event's object (deleted, or not) may change a pass (see
/// [`Interest`]).
pub(super) type Relevant<K> = Arc<dyn Fn(&K, bool) -> bool + Send + Sync>;

/// A namespaced kind whose objects a source keeps (Secrets, ConfigMaps,
/// EndpointSlices).
pub(super) trait Namespaced:
    Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + DeserializeOwned
    + Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Namespaced for K where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static
{
}

/// What a watch reports to its source: "changed", and its errors.
#[derive(Clone)]
pub(super) struct Changed {
    pub(super) tx: mpsc::Sender<()>,
    pub(super) errors: WatchErrors,
    /// The watch's place on its connection, held while it runs.
    pub(super) slot: Option<Arc<WatchSlot>>,
    pub(super) metrics: SourceMetrics,
    /// A watch in a tenant's namespace: its errors are counted apart
    /// (`tenant_watch_errors_total`), so that a tenant cannot fire the
    /// install's alert (a missing RoleBinding there is said on the
    /// tenant's own object).
    pub(super) tenant: bool,
    /// Where the source notes the namespaces an event touched, if it
    /// follows them.
    pub(super) touched: Option<Touched>,
}

/// The watches of one source, all saying "changed" on one channel.
pub(super) struct Watches {
    pub(super) client: kube::Client,
    pub(super) clients: ApiClients,
    pub(super) stop: CancellationToken,
    pub(super) tx: Changed,
    pub(super) changed: mpsc::Receiver<()>,
}

impl Watches {
    pub(super) fn new(
        clients: &ApiClients,
        stop: &CancellationToken,
        metrics: &SourceMetrics,
    ) -> Watches {
        let (tx, changed) = mpsc::channel(1);
        metrics.follow_connections(clients);
        Watches {
            client: clients.main().clone(),
            clients: clients.clone(),
            stop: stop.clone(),
            tx: Changed {
                tx,
                errors: WatchErrors::default(),
                slot: None,
                metrics: metrics.clone(),
                tenant: false,
                touched: None,
            },
            changed,
        }
    }

    /// Every object of kind `K`, in every namespace.
    pub(super) fn kind<K>(&self) -> Store<K>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
    {
        watch_kind(
            Api::<K>::all(self.client.clone()),
            watcher::Config::default(),
            self.tx.clone(),
            self.stop.clone(),
        )
    }

    /// Every object of kind `K`, in every namespace, whose events wake a
    /// pass only when `relevant` (a list or relist always does).
    pub(super) fn kind_where<K>(&self, relevant: Relevant<K>) -> Store<K>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
    {
        self.all_where(watcher::Config::default(), relevant)
    }

    /// The objects of kind `K` `config` selects in every namespace, whose
    /// events wake a pass only when `relevant`.
    fn all_where<K>(&self, config: watcher::Config, relevant: Relevant<K>) -> Store<K>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
    {
        let api = Api::<K>::all(self.client.clone());
        let (store, stream) = reflected(api, K::DynamicType::default(), config);
        spawn_follow(
            stream,
            K::kind(&K::DynamicType::default()).to_string(),
            self.tx.clone(),
            self.stop.clone(),
            Some(relevant),
            true,
        );
        store
    }

    /// The objects of kind `K` with label `selector` in `namespace` (a
    /// tenant's, or the install's), until `stop`.
    pub(super) fn labelled_in<K>(
        &self,
        namespace: &str,
        selector: &str,
        stop: &CancellationToken,
        tenant: bool,
    ) -> (Store<K>, WatchErrors)
    where
        K: Namespaced,
    {
        // A tenant namespace's errors are logged, not shown on the
        // unauthenticated readiness probe (they name the namespace).
        let errors = WatchErrors::default();
        // One per tenant namespace: spread over the connections.
        let (client, slot) = self.clients.for_watch();
        let changed = Changed {
            tx: self.tx.tx.clone(),
            errors: errors.clone(),
            slot: slot.map(Arc::new),
            metrics: self.tx.metrics.clone(),
            tenant,
            touched: self.tx.touched.clone(),
        };
        self.tx.metrics.follow_connections(&self.clients);
        let store = watch_kind(
            Api::<K>::namespaced(client, namespace),
            watcher::Config::default().labels(selector),
            changed,
            stop.clone(),
        );
        (store, errors)
    }

    /// The objects of kind `K` with label `selector` in tenant namespace
    /// `namespace`, listed again on `pace` on the main connection instead
    /// of watched (`poll.rs`: past the watches' connections), until `stop`.
    pub(super) fn polled_in<K>(
        &self,
        namespace: &str,
        selector: &str,
        stop: &CancellationToken,
        pace: &super::poll::Pace,
    ) -> (Store<K>, WatchErrors)
    where
        K: Namespaced,
    {
        let errors = WatchErrors::default();
        let changed = Changed {
            tx: self.tx.tx.clone(),
            errors: errors.clone(),
            slot: None,
            metrics: self.tx.metrics.clone(),
            tenant: true,
            touched: self.tx.touched.clone(),
        };
        let writer = reflector::store::Writer::default();
        let store = writer.as_reader();
        let api = Api::<K>::namespaced(self.client.clone(), namespace);
        let stream =
            super::poll::listed_on_pace(api, selector.to_string(), pace.clone()).reflect(writer);
        let kind = K::kind(&()).to_string();
        spawn_follow(stream, kind, changed, stop.clone(), None, false);
        (store, errors)
    }

    /// The objects of kind `K` with label `selector` in every namespace,
    /// on the main connection (its errors are the install's: a missing
    /// cluster-wide grant), whose events wake a pass only when `relevant`.
    pub(super) fn labelled_where<K>(&self, selector: &str, relevant: Relevant<K>) -> Store<K>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
    {
        self.all_where(watcher::Config::default().labels(selector), relevant)
    }

    /// Every object of kind `K` in `namespace`.
    pub(super) fn in_namespace<K>(&self, namespace: &str) -> Store<K>
    where
        K: Namespaced,
    {
        watch_kind(
            Api::<K>::namespaced(self.client.clone(), namespace),
            watcher::Config::default(),
            self.tx.clone(),
            self.stop.clone(),
        )
    }
}

/// How long one watch request lasts (the API server's `timeoutSeconds`)
/// before it is made again from the last resourceVersion. kube-runtime
/// also gives up on a watch that has sent nothing for this long plus 5 s,
/// so it bounds how long a connection that died silently (a partition or
/// a middlebox that dropped it without a reset) can leave the objects
/// stale: about a minute rather than kube-runtime's default of 295 s.
/// Each kind's watch is made again once a minute, which the API server
/// serves from its watch cache.
pub const WATCH_TIMEOUT_SECS: u32 = 60;

/// One kind's watch: a store and a task that keeps it and says "changed".
pub(super) fn watch_kind<K>(
    api: Api<K>,
    config: watcher::Config,
    changed: Changed,
    stop: CancellationToken,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    watch_kind_of(api, K::DynamicType::default(), config, changed, stop)
}

/// [`watch_kind`] for a kind known at run time (its `DynamicType`).
pub(super) fn watch_kind_of<K>(
    api: Api<K>,
    dyntype: K::DynamicType,
    config: watcher::Config,
    changed: Changed,
    stop: CancellationToken,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let kind = K::kind(&dyntype).to_string();
    let (store, stream) = reflected(api, dyntype, config);
    spawn_follow(stream, kind, changed, stop, None, true);
    store
}

/// A kind's store and the stream that fills it.
fn reflected<K>(
    api: Api<K>,
    dyntype: K::DynamicType,
    config: watcher::Config,
) -> (
    Store<K>,
    impl futures_util::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let config = config.timeout(WATCH_TIMEOUT_SECS);
    let writer = reflector::store::Writer::new(dyntype);
    let store = writer.as_reader();
    let stream = watcher(api, config)
        .default_backoff()
        // Kept in memory for every object: nothing here reads who managed
        // which field, nor any annotation (`kubectl apply` leaves a copy
        // of the whole object in one).
        .modify(|o: &mut K| {
            let meta = o.meta_mut();
            meta.managed_fields = None;
            meta.annotations = None;
        })
        .reflect(writer);
    (store, stream)
}

/// Follows `stream` on a task of its own until it ends or `stop`;
/// counted among the watches open when it is one (not lists on a pace).
fn spawn_follow<K, S>(
    stream: S,
    kind: String,
    changed: Changed,
    stop: CancellationToken,
    relevant: Option<Relevant<K>>,
    watch: bool,
) where
    K: Resource + Send + Sync + 'static,
    S: futures_util::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let _slot = changed.slot.clone();
        if watch {
            changed.metrics.watch_started();
        }
        follow(stream, &kind, &changed, &stop, relevant.as_ref()).await;
        if watch {
            changed.metrics.watch_ended();
        }
    });
}

/// Follows one kind's watch until it ends or `stop`: "changed" on each
/// event, its errors recorded.
async fn follow<K, S>(
    stream: S,
    kind: &str,
    changed: &Changed,
    stop: &CancellationToken,
    relevant: Option<&Relevant<K>>,
) where
    K: Resource,
    S: futures_util::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let namespaces = kind == "Namespace";
    let mut stream = std::pin::pin!(stream);
    loop {
        let next = tokio::select! {
            n = stream.next() => n,
            () = stop.cancelled() => return,
        };
        match next {
            Some(Ok(event)) => {
                if matches!(event, watcher::Event::InitDone) {
                    changed.metrics.listed(kind);
                }
                changed.errors.clear(kind);
                let counts = match (&event, relevant) {
                    (watcher::Event::Apply(o), Some(r)) => r(o, false),
                    (watcher::Event::Delete(o), Some(r)) => r(o, true),
                    _ => true,
                };
                // Noted before the wake, so the pass it wakes sees it. An
                // event that wakes no pass is noted too: what it changed
                // is read again at the next pass, as when every object was
                // fingerprinted (`Relevant` may miss a change that matters,
                // as a slice relabelled away from a Service the routes
                // name before this process counted it).
                if let Some(t) = &changed.touched {
                    t.note(&event, namespaces);
                }
                if counts {
                    let _ = changed.tx.try_send(());
                }
            }
            Some(Err(e)) => {
                tracing::warn!(kind = %kind, error = %e, "kubernetes watch failed; keeping the last objects and retrying");
                changed.metrics.failed(kind, changed.tenant);
                changed.errors.set(kind, e.to_string());
            }
            None => return,
        }
    }
}

/// The TLSRoute versions seedlink reads, newest first: the objects are the
/// same through each (a CRD's versions are views of one stored object), so
/// the newest one the installed CRD serves is watched.
pub(super) const ROUTE_VERSIONS: [&str; 3] = ["v1", "v1alpha3", "v1alpha2"];

/// TLSRoutes through the version the installed CRD serves.
#[derive(Clone)]
pub(super) enum Routes {
    /// `v1` (Gateway API v1.5 and later, standard channel).
    V1(Store<TlsRoute>),
    /// An older version (`v1alpha3`, `v1alpha2`: the experimental channel
    /// before v1.5, which some platforms still install and write).
    Older(Store<kube::api::DynamicObject>),
}

/// The newest TLSRoute version the API server serves (asked within 10 s);
/// `None` when it cannot tell.
pub async fn served_route_version(client: &kube::Client) -> Option<kube::api::ApiResource> {
    let served = tokio::time::timeout(
        Duration::from_secs(10),
        kube::discovery::group(client, GATEWAY_GROUP),
    )
    .await;
    match served {
        Ok(Ok(group)) => ROUTE_VERSIONS.iter().find_map(|v| {
            group
                .versioned_resources(v)
                .into_iter()
                .map(|(ar, _)| ar)
                .find(|ar| ar.kind == "TLSRoute")
        }),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "kubernetes: cannot list the served TLSRoute versions; reading v1");
            None
        }
        Err(_) => {
            tracing::warn!(
                "kubernetes: no answer listing the served TLSRoute versions; reading v1"
            );
            None
        }
    }
}

impl Routes {
    /// Asks the API server which TLSRoute versions it serves (bounded) and
    /// watches the newest; `v1` when it cannot tell.
    pub(super) async fn watch(
        client: &kube::Client,
        tx: Changed,
        stop: CancellationToken,
    ) -> (Routes, Option<kube::api::ApiResource>) {
        match served_route_version(client).await {
            Some(ar) if ar.version != "v1" => {
                tracing::info!(version = %ar.version, "kubernetes: the installed TLSRoute CRD does not serve v1; reading TLSRoutes through {}", ar.api_version);
                let api = Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar);
                let store = watch_kind_of(api, ar.clone(), watcher::Config::default(), tx, stop);
                (Routes::Older(store), Some(ar))
            }
            _ => {
                let api = Api::<TlsRoute>::all(client.clone());
                (
                    Routes::V1(watch_kind(api, watcher::Config::default(), tx, stop)),
                    None,
                )
            }
        }
    }

    pub(super) async fn wait_until_ready(&self) -> Option<()> {
        match self {
            Routes::V1(s) => s.wait_until_ready().await.ok(),
            Routes::Older(s) => s.wait_until_ready().await.ok(),
        }
    }

    /// Every route, as the v1 type (the older versions' fields are the
    /// same; one that does not read is skipped, with a warning).
    pub(super) fn state(&self) -> Vec<Arc<TlsRoute>> {
        match self {
            Routes::V1(s) => s.state(),
            Routes::Older(s) => s
                .state()
                .into_iter()
                .filter_map(|o| {
                    let mut v = serde_json::to_value(o.as_ref()).ok()?;
                    // Optional before v1 (the listener's names then).
                    if let Some(spec) = v.get_mut("spec").and_then(|s| s.as_object_mut()) {
                        spec.entry("hostnames").or_insert_with(|| json!([]));
                    }
                    match serde_json::from_value::<TlsRoute>(v) {
                        Ok(r) => Some(Arc::new(r)),
                        Err(e) => {
                            tracing::warn!(route = %Key { namespace: o.metadata.namespace.clone().unwrap_or_default(), name: o.metadata.name.clone().unwrap_or_default() }, error = %e, "TLSRoute skipped: it does not read as a TLSRoute");
                            None
                        }
                    }
                })
                .collect(),
        }
    }
}

/// Each kind's last watch error while it fails (cleared when its watch
/// delivers again): what readiness says while the first snapshot is not
/// in.
#[derive(Clone, Default)]
pub struct WatchErrors(
    Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
    Arc<tokio::sync::Notify>,
);

impl WatchErrors {
    pub(super) fn set(&self, kind: &str, error: String) {
        seedlink_net::sync::lock(&self.0, "watch errors").insert(kind.to_string(), error);
        self.1.notify_one();
    }

    /// Returns once a watch has failed since the last call (at once if
    /// one failed before): a wait for a first list that is refused (a
    /// 403) ends then rather than at its bound.
    pub(super) async fn failed(&self) {
        self.1.notified().await;
    }

    pub(super) fn clear(&self, kind: &str) {
        seedlink_net::sync::lock(&self.0, "watch errors").remove(kind);
    }

    /// The failing kinds with their last errors, if any.
    pub(super) fn describe(&self) -> Option<String> {
        let m = seedlink_net::sync::lock(&self.0, "watch errors");
        let all: Vec<String> = m.iter().map(|(k, e)| format!("{k}: {e}")).collect();
        (!all.is_empty()).then(|| all.join("; "))
    }
}

#[cfg(test)]
mod errors_tests {
    use super::*;

    /// A failure before the wait, or during it, ends it.
    #[tokio::test]
    async fn a_failed_watch_ends_a_wait_for_its_list() {
        let e = WatchErrors::default();
        e.set("ConfigMap", "403".into());
        e.failed().await;
        let waiting = tokio::spawn({
            let e = e.clone();
            async move { e.failed().await }
        });
        tokio::task::yield_now().await;
        e.set("Secret", "403".into());
        let ended = tokio::time::timeout(std::time::Duration::from_secs(30), waiting).await;
        assert!(ended.is_ok(), "the wait did not end");
        assert!(e.describe().is_some_and(|d| d.contains("Secret: 403")));
    }
}

#[cfg(test)]
mod interest_tests {
    use super::super::gateway::{service_read, slice_read};
    use super::*;
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::ObjectMeta;

    fn meta(ns: &str, name: &str, service: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            labels: service
                .map(|s| [("kubernetes.io/service-name".to_string(), s.to_string())].into()),
            ..Default::default()
        }
    }

    /// Whether following `events` wakes a pass.
    async fn wakes<K: Resource + Send + Sync + 'static>(
        events: Vec<watcher::Event<K>>,
        relevant: &Relevant<K>,
    ) -> bool {
        let (tx, mut rx) = mpsc::channel(1);
        let changed = Changed {
            tx,
            errors: WatchErrors::default(),
            slot: None,
            metrics: SourceMetrics::new("test"),
            tenant: false,
            touched: None,
        };
        let stream = futures_util::stream::iter(events.into_iter().map(Ok));
        follow(
            stream,
            "test",
            &changed,
            &CancellationToken::new(),
            Some(relevant),
        )
        .await;
        rx.try_recv().is_ok()
    }

    /// Before the first pass every event counts; after it, only events on
    /// the Services the routes name and on their slices (one relabelled
    /// away too, once), and every list or relist.
    #[tokio::test]
    async fn events_on_services_no_route_reads_wake_no_pass() {
        let interest = Interest::default();
        let (svc, slice) = (service_read(&interest), slice_read(&interest));
        let service = |ns: &str, name: &str| Service {
            metadata: meta(ns, name, None),
            ..Default::default()
        };
        let slice_of = |ns: &str, service: Option<&str>| EndpointSlice {
            metadata: meta(ns, "x1", service),
            address_type: "IPv4".into(),
            endpoints: Vec::new(),
            ports: None,
        };
        assert!(wakes(vec![watcher::Event::Apply(service("t1", "etcd"))], &svc).await);
        interest.set(
            [Key {
                namespace: "t1".into(),
                name: "kube-apiserver".into(),
            }]
            .into(),
        );
        let other = vec![
            watcher::Event::Apply(service("t1", "etcd")),
            watcher::Event::Delete(service("t2", "kube-apiserver")),
        ];
        assert!(!wakes(other, &svc).await);
        let slices = vec![
            watcher::Event::Apply(slice_of("t1", Some("etcd"))),
            watcher::Event::Apply(slice_of("t1", None)),
            watcher::Event::Delete(slice_of("t2", Some("kube-apiserver"))),
        ];
        assert!(!wakes(slices, &slice).await);
        assert!(
            wakes(
                vec![watcher::Event::Apply(service("t1", "kube-apiserver"))],
                &svc
            )
            .await
        );
        let ours = slice_of("t1", Some("kube-apiserver"));
        assert!(wakes(vec![watcher::Event::Apply(ours.clone())], &slice).await);
        // Relabelled away from a Service the routes read: its endpoints
        // changed, once.
        let away = vec![watcher::Event::Apply(slice_of("t1", Some("etcd")))];
        assert!(wakes(away.clone(), &slice).await);
        assert!(!wakes(away, &slice).await);
        assert!(wakes(vec![watcher::Event::Delete(ours)], &slice).await);
        assert!(wakes(vec![watcher::Event::<Service>::Init], &svc).await);
    }
}

#[cfg(test)]
mod touched_tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Namespace, Service};
    use kube::api::ObjectMeta;

    fn service(ns: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some("s".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn namespace(name: &str) -> Namespace {
        Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn set(names: &[&str]) -> Option<std::collections::HashSet<String>> {
        Some(names.iter().map(|n| n.to_string()).collect())
    }

    /// Events touch their object's namespace (a Namespace its own name);
    /// a list, or too many namespaces, touches everything; a take leaves
    /// nothing touched.
    #[test]
    fn events_touch_their_namespaces_and_a_list_touches_everything() {
        let t = Touched::default();
        assert_eq!(t.take(), None, "the first pass looks at everything");
        assert_eq!(t.take(), set(&[]));
        t.note(&watcher::Event::Apply(service("t1")), false);
        t.note(&watcher::Event::Delete(service("t2")), false);
        t.note(&watcher::Event::Apply(namespace("t3")), true);
        assert_eq!(t.take(), set(&["t1", "t2", "t3"]));
        t.note(&watcher::Event::Apply(service("t1")), false);
        t.note(&watcher::Event::<Service>::InitDone, false);
        t.note(&watcher::Event::Apply(service("t2")), false);
        assert_eq!(t.take(), None, "a list: objects may be gone unseen");
        for i in 0..=MAX_TOUCHED {
            t.namespace(&format!("t{i}"));
        }
        assert_eq!(t.take(), None, "bounded");
    }

    /// An event that wakes a pass has touched its namespace by then; one
    /// that wakes none touches its namespace too, for the next pass.
    #[tokio::test]
    async fn a_woken_pass_sees_what_its_event_touched() {
        let (tx, mut rx) = mpsc::channel(1);
        let touched = Touched::default();
        touched.take();
        let changed = Changed {
            tx,
            errors: WatchErrors::default(),
            slot: None,
            metrics: SourceMetrics::new("test"),
            tenant: false,
            touched: Some(touched.clone()),
        };
        let only_t1: Relevant<Service> =
            Arc::new(|s: &Service, _| s.metadata.namespace.as_deref() == Some("t1"));
        let events = vec![
            watcher::Event::Apply(service("t2")),
            watcher::Event::Apply(service("t1")),
        ];
        let stream = futures_util::stream::iter(events.into_iter().map(Ok));
        follow(
            stream,
            "Service",
            &changed,
            &CancellationToken::new(),
            Some(&only_t1),
        )
        .await;
        assert!(rx.try_recv().is_ok());
        assert_eq!(touched.take(), set(&["t1", "t2"]));
    }
}
