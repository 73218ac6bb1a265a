//! The gateway's Kubernetes source at run time: one watch per kind
//! (kube-rs `watcher` + reflector stores: list, watch from the list's
//! resourceVersion, bookmarks, a re-list after `410 Gone`, back-off on
//! errors), bursts of events coalesced into one snapshot, the snapshot
//! handed to the gateway, and status written back by the lease holder.
//!
//! | event | behaviour |
//! |---|---|
//! | objects change | one snapshot 200 ms after the last event, at most 2 s after the first |
//! | an object is invalid | left out, with a status condition and an Event; the others are served |
//! | the API server is unreachable | the stores keep the last objects: nothing changes; retries back off |
//! | a watch expires (410) | re-list; the rebuilt snapshot is diffed, unchanged routes are untouched |

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::{TlsRoute, TlsRouteParentRefs};
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event as RuntimeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Resource;
use seedlink_config::model::ControlPlane;
use seedlink_config::ConfigError;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::crd::{SeedlinkPolicy, CONTROLLER_NAME};
use crate::leader::{self, Leadership};
use crate::translate::{
    Key, Objects, RouteOutcome, Translation, Translator, Verdict, GATEWAY_GROUP,
};

/// Quiet time after the last event before a snapshot is built.
pub const QUIET: Duration = Duration::from_millis(200);
/// Longest wait after the first event of a burst.
pub const MAX_DELAY: Duration = Duration::from_secs(2);
/// How often the status leader compares status with what it should be
/// (besides after every snapshot).
pub const STATUS_EVERY: Duration = Duration::from_secs(10);

/// Where the gateway's control planes go.
pub trait GatewaySink: Send + Sync + 'static {
    /// Serves these control planes (besides the file's); returns those it
    /// refused, with its problems. Open connections are never touched.
    fn apply(&self, control_planes: Vec<ControlPlane>) -> Vec<(String, Vec<ConfigError>)>;
}

/// What the gateway's source needs to know.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// The named Gateway (`kubernetes.gateway`), served on every listener.
    pub gateway: Option<Key>,
    /// The Gateways of a class, each at its own address
    /// (`kubernetes.gateway_class`).
    pub class: Option<crate::translate::ClassSettings>,
    /// The gateway's listener names.
    pub listeners: Vec<String>,
    /// The status lease; `None`: this replica never writes status.
    pub lease: Option<Key>,
    /// This replica's name in the lease (the pod name).
    pub identity: String,
    /// The EndpointSlice managers whose slices name upstreams.
    pub slice_managers: Vec<String>,
    /// The Service seedlink is exposed by (the named Gateway's addresses).
    pub service: Option<Key>,
}

/// A running source.
pub struct Handle {
    synced: watch::Receiver<bool>,
    errors: WatchErrors,
    /// Whether this replica writes status.
    pub leadership: Leadership,
    stop: CancellationToken,
    /// The lease campaign (which releases a held lease when it stops).
    campaign: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Whether a source's first snapshot is applied, and if not, why.
#[derive(Clone)]
pub struct Readiness {
    synced: watch::Receiver<bool>,
    errors: WatchErrors,
}

impl Readiness {
    /// `None` once the first snapshot is applied (for good: an outage
    /// later keeps the last snapshot served); before, why not.
    pub fn why_not(&self) -> Option<String> {
        if *self.synced.borrow() {
            return None;
        }
        Some(match self.errors.describe() {
            Some(e) => format!("no complete snapshot from the API server yet; last errors: {e}"),
            None => "no complete snapshot from the API server yet (listing)".to_string(),
        })
    }
}

impl Handle {
    /// Waits until every kind was listed once and the first snapshot was
    /// applied, at most `timeout`. Whether that happened.
    pub async fn synced(&self, timeout: Duration) -> bool {
        let mut rx = self.synced.clone();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// What readiness asks of this source: its first snapshot applied.
    pub fn readiness(&self) -> Readiness {
        Readiness {
            synced: self.synced.clone(),
            errors: self.errors.clone(),
        }
    }

    /// Stops the watches and the status writer.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Stops, and waits (at most `limit`) until a held status lease was
    /// released, so that another replica writes status at once.
    pub async fn shutdown(&self, limit: Duration) {
        self.stop.cancel();
        let task = seedlink_net::sync::lock(&self.campaign, "lease campaign").take();
        if let Some(task) = task {
            let _ = tokio::time::timeout(limit, task).await;
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Each kind's last watch error while it fails (cleared when its watch
/// delivers again): what readiness says while the first snapshot is not
/// in.
#[derive(Clone, Default)]
pub struct WatchErrors(Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>);

impl WatchErrors {
    fn set(&self, kind: &str, error: String) {
        seedlink_net::sync::lock(&self.0, "watch errors").insert(kind.to_string(), error);
    }

    fn clear(&self, kind: &str) {
        seedlink_net::sync::lock(&self.0, "watch errors").remove(kind);
    }

    /// The failing kinds with their last errors, if any.
    fn describe(&self) -> Option<String> {
        let m = seedlink_net::sync::lock(&self.0, "watch errors");
        let all: Vec<String> = m.iter().map(|(k, e)| format!("{k}: {e}")).collect();
        (!all.is_empty()).then(|| all.join("; "))
    }
}

/// What a watch reports to its source: "changed", and its errors.
#[derive(Clone)]
struct Changed {
    tx: mpsc::Sender<()>,
    errors: WatchErrors,
}

/// The watches of one source, all saying "changed" on one channel.
struct Watches {
    client: kube::Client,
    stop: CancellationToken,
    tx: Changed,
    changed: mpsc::Receiver<()>,
}

impl Watches {
    fn new(client: &kube::Client, stop: &CancellationToken) -> Watches {
        let (tx, changed) = mpsc::channel(1);
        Watches {
            client: client.clone(),
            stop: stop.clone(),
            tx: Changed {
                tx,
                errors: WatchErrors::default(),
            },
            changed,
        }
    }

    /// Every object of kind `K`, in every namespace.
    fn kind<K>(&self) -> Store<K>
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

    /// The objects of kind `K` with label `selector` in `namespace`, until
    /// `stop`.
    fn labelled_in<K>(&self, namespace: &str, selector: &str, stop: &CancellationToken) -> Store<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug
            + Send
            + Sync
            + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
    {
        // A tenant namespace's errors are logged, not shown on the
        // unauthenticated readiness probe (they name the namespace).
        let changed = Changed {
            tx: self.tx.tx.clone(),
            errors: WatchErrors::default(),
        };
        watch_kind(
            Api::<K>::namespaced(self.client.clone(), namespace),
            watcher::Config::default().labels(selector),
            changed,
            stop.clone(),
        )
    }

    /// Every object of kind `K` in `namespace`.
    fn in_namespace<K>(&self, namespace: &str) -> Store<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug
            + Send
            + Sync
            + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
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
fn watch_kind<K>(
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
fn watch_kind_of<K>(
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
    let config = config.timeout(WATCH_TIMEOUT_SECS);
    let writer = reflector::store::Writer::new(dyntype);
    let store = writer.as_reader();
    let stream = watcher(api, config)
        .default_backoff()
        // Kept in memory for every object: nothing here reads who
        // managed which field.
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .reflect(writer);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            let next = tokio::select! {
                n = stream.next() => n,
                () = stop.cancelled() => return,
            };
            match next {
                Some(Ok(_)) => {
                    changed.errors.clear(&kind);
                    let _ = changed.tx.try_send(());
                }
                Some(Err(e)) => {
                    tracing::warn!(kind = %kind, error = %e, "kubernetes watch failed; keeping the last objects and retrying");
                    changed.errors.set(&kind, e.to_string());
                }
                None => return,
            }
        }
    });
    store
}

/// The TLSRoute versions seedlink reads, newest first: the objects are the
/// same through each (a CRD's versions are views of one stored object), so
/// the newest one the installed CRD serves is watched.
const ROUTE_VERSIONS: [&str; 3] = ["v1", "v1alpha3", "v1alpha2"];

/// TLSRoutes through the version the installed CRD serves.
enum Routes {
    /// `v1` (Gateway API v1.5 and later, standard channel).
    V1(Store<TlsRoute>),
    /// An older version (`v1alpha3`, `v1alpha2`: the experimental channel
    /// before v1.5, which some platforms still install and write).
    Older(Store<kube::api::DynamicObject>),
}

/// The newest TLSRoute version the API server serves (asked within 10 s);
/// `None` when it cannot tell.
async fn served_route_version(client: &kube::Client) -> Option<kube::api::ApiResource> {
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
    async fn watch(
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

    async fn wait_until_ready(&self) -> Option<()> {
        match self {
            Routes::V1(s) => s.wait_until_ready().await.ok(),
            Routes::Older(s) => s.wait_until_ready().await.ok(),
        }
    }

    /// Every route, as the v1 type (the older versions' fields are the
    /// same; one that does not read is skipped, with a warning).
    fn state(&self) -> Vec<Arc<TlsRoute>> {
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

/// The Gateway API versions seedlink implements (bundle versions, as the
/// CRDs' `gateway.networking.k8s.io/bundle-version` annotation names them):
/// from v1.4 (TLSRoute v1alpha2/v1alpha3) to v1.6 (what it is tested with).
const SUPPORTED_BUNDLES: ((u32, u32), (u32, u32)) = ((1, 4), (1, 6));

/// The Gateway API features seedlink implements (conformance feature names,
/// sorted): TLS passthrough only.
const SUPPORTED_FEATURES: [&str; 3] = ["Gateway", "ReferenceGrant", "TLSRoute"];

/// How often the installed Gateway API version is read again.
const BUNDLE_REREAD: Duration = Duration::from_secs(300);

/// The installed Gateway API's bundle version (the GatewayClass CRD's
/// annotation), bounded; `None` when it cannot be read.
async fn bundle_version(client: &kube::Client) -> Option<String> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    match tokio::time::timeout(
        Duration::from_secs(10),
        api.get("gatewayclasses.gateway.networking.k8s.io"),
    )
    .await
    {
        Ok(Ok(crd)) => crd
            .metadata
            .annotations
            .and_then(|a| a.get("gateway.networking.k8s.io/bundle-version").cloned()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "kubernetes: cannot read the Gateway API version installed (GatewayClass SupportedVersion stays Unknown)");
            None
        }
        Err(_) => None,
    }
}

/// The GatewayClass `SupportedVersion` condition for an installed bundle
/// version.
fn supported_version(bundle: Option<&str>) -> (String, Verdict) {
    let ((lo_major, lo_minor), (hi_major, hi_minor)) = SUPPORTED_BUNDLES;
    let range = format!("v{lo_major}.{lo_minor} to v{hi_major}.{hi_minor}");
    let Some(b) = bundle else {
        return (
            "Unknown".into(),
            Verdict::no(
                "UnknownVersion",
                format!(
                    "the installed Gateway API version cannot be read (seedlink supports {range})"
                ),
            ),
        );
    };
    let parsed = b.strip_prefix('v').and_then(|v| {
        let mut it = v.split(['.', '-']);
        Some((
            it.next()?.parse::<u32>().ok()?,
            it.next()?.parse::<u32>().ok()?,
        ))
    });
    match parsed {
        Some(v) if v >= SUPPORTED_BUNDLES.0 && v <= SUPPORTED_BUNDLES.1 => (
            "True".into(),
            Verdict::yes(
                "SupportedVersion",
                format!("Gateway API {b} (seedlink supports {range})"),
            ),
        ),
        _ => (
            "False".into(),
            Verdict::no(
                "UnsupportedVersion",
                format!("Gateway API {b} is installed; seedlink supports {range}"),
            ),
        ),
    }
}

/// Starts the gateway's source: watches, snapshots into `sink`, status.
pub fn start_gateway(
    client: kube::Client,
    settings: GatewaySettings,
    sink: Arc<dyn GatewaySink>,
) -> Handle {
    let stop = CancellationToken::new();
    let w = Watches::new(&client, &stop);
    let errors = w.tx.errors.clone();
    let (routes_tx, routes_stop) = (w.tx.clone(), stop.clone());
    let kinds = GatewayKinds::watch(&w, &settings);
    let coalescer = Coalescer {
        changed: w.changed,
        stop: stop.clone(),
    };
    let (leadership, campaign_task) =
        campaign(&client, settings.lease.as_ref(), &settings.identity, &stop);
    let (synced_tx, synced) = watch::channel(false);
    let writer_leadership = leadership.clone();
    tokio::spawn(async move {
        let (routes, route_resource) = Routes::watch(&client, routes_tx, routes_stop).await;
        let stores = GatewayStores { routes, kinds };
        tokio::select! {
            r = stores.ready() => if r.is_none() { return },
            () = coalescer.stop.cancelled() => return,
        }
        let mut status = StatusWriter::new(client.clone(), writer_leadership, &settings.identity);
        status.route_resource = route_resource;
        let mut translator = Translator::default();
        translator.slice_managers = settings.slice_managers.clone();
        let pass = GatewayPasses {
            translator,
            bundle: bundle_version(&client).await,
            bundle_read: tokio::time::Instant::now(),
            ever: HashSet::new(),
            stores,
            settings,
            status,
        };
        pass.run(coalescer, sink.as_ref(), &synced_tx).await;
    });
    Handle {
        synced,
        errors,
        leadership,
        stop,
        campaign: std::sync::Mutex::new(campaign_task),
    }
}

/// The objects the gateway's source reads besides TLSRoutes, each a
/// watched store.
struct GatewayKinds {
    policies: Store<SeedlinkPolicy>,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    gateways: Store<Gateway>,
    classes: Store<GatewayClass>,
    namespaces: Store<Namespace>,
    grants: Store<ReferenceGrant>,
}

impl GatewayKinds {
    fn watch(w: &Watches, settings: &GatewaySettings) -> GatewayKinds {
        GatewayKinds {
            policies: w.kind(),
            services: w.kind(),
            slices: w.kind(),
            // Only the named Gateway's namespace when that is all it
            // serves; every namespace for a class.
            gateways: match (&settings.gateway, &settings.class) {
                (Some(g), None) => w.in_namespace(&g.namespace),
                _ => w.kind(),
            },
            classes: w.kind(),
            namespaces: w.kind(),
            grants: w.kind(),
        }
    }
}

/// Every object the gateway's source reads.
struct GatewayStores {
    routes: Routes,
    kinds: GatewayKinds,
}

impl GatewayStores {
    /// Waits for every store's first list; `None` if a watch ended first.
    async fn ready(&self) -> Option<()> {
        let k = &self.kinds;
        self.routes.wait_until_ready().await?;
        k.policies.wait_until_ready().await.ok()?;
        k.services.wait_until_ready().await.ok()?;
        k.slices.wait_until_ready().await.ok()?;
        k.gateways.wait_until_ready().await.ok()?;
        k.classes.wait_until_ready().await.ok()?;
        k.namespaces.wait_until_ready().await.ok()?;
        k.grants.wait_until_ready().await.ok()
    }

    /// Translates what the stores hold now.
    fn translate(&self, translator: &mut Translator, settings: &GatewaySettings) -> GatewayPass {
        let k = &self.kinds;
        let (routes, policies) = (self.routes.state(), k.policies.state());
        let (services, slices) = (k.services.state(), k.slices.state());
        let (gateways, classes) = (k.gateways.state(), k.classes.state());
        let (namespaces, grants) = (k.namespaces.state(), k.grants.state());
        let t = translator.translate(&Objects {
            gateway: settings.gateway.as_ref(),
            class: settings.class.as_ref(),
            gateways: &gateways,
            classes: &classes,
            listeners: &settings.listeners,
            namespaces: &namespaces,
            grants: &grants,
            routes: &routes,
            policies: &policies,
            services: &services,
            slices: &slices,
        });
        (t, routes, policies)
    }

    /// The addresses a Gateway's status names: the named Gateway's are its
    /// Service's load-balancer addresses, a class Gateway's its own.
    fn addresses(
        &self,
        settings: &GatewaySettings,
        g: &crate::translate::GatewayOutcome,
    ) -> Vec<serde_json::Value> {
        if !g.named {
            return g
                .address
                .iter()
                .map(|a| json!({"type": "IPAddress", "value": a.to_string()}))
                .collect();
        }
        settings
            .service
            .as_ref()
            .and_then(|k| {
                let services = self.kinds.services.state();
                services.into_iter().find(|s| Key::of(s.as_ref()) == *k)
            })
            .map(|s| addresses(&s))
            .unwrap_or_default()
    }
}

/// The gateway source's loop: translate and apply on a change, write
/// status on every wake-up.
struct GatewayPasses {
    stores: GatewayStores,
    settings: GatewaySettings,
    translator: Translator,
    status: StatusWriter,
    /// Every Gateway this process has served.
    ever: HashSet<Key>,
    /// The installed Gateway API bundle, re-read every `BUNDLE_REREAD`.
    bundle: Option<String>,
    bundle_read: tokio::time::Instant,
}

impl GatewayPasses {
    async fn run(
        mut self,
        mut coalescer: Coalescer,
        sink: &dyn GatewaySink,
        synced: &watch::Sender<bool>,
    ) {
        let mut wake = Wake::Changed;
        let mut last: Option<GatewayPass> = None;
        // Set when the gateway could not apply anything (its own file is
        // invalid): the next tick tries again, as the file may be fixed.
        let mut retry = false;
        loop {
            if wake == Wake::Changed || last.is_none() || retry {
                let mut pass = self.stores.translate(&mut self.translator, &self.settings);
                let refused = sink.apply(pass.0.control_planes.clone());
                retry = not_applied(&refused);
                pass.0.refused(&refused);
                let _ = synced.send(true);
                last = Some(pass);
            }
            if let Some(pass) = &last {
                self.write_status(pass, !retry).await;
            }
            wake = coalescer.next().await;
            if wake == Wake::Stop {
                return;
            }
        }
    }

    /// Writes the routes', policies', Gateways' and classes' status.
    async fn write_status(&mut self, (t, routes, policies): &GatewayPass, applied: bool) {
        let served = self.served(t);
        self.status.write(t, routes, policies, &served).await;
        let objects = self.stores.kinds.gateways.state();
        for g in &t.gateways {
            let Some(object) = objects.iter().find(|o| Key::of(o.as_ref()) == g.key) else {
                continue;
            };
            let addresses = self.stores.addresses(&self.settings, g);
            self.status
                .write_gateway(t, g, object, applied, &addresses)
                .await;
        }
        // A Gateway API upgrade is noticed within minutes.
        if self.bundle_read.elapsed() > BUNDLE_REREAD {
            self.bundle = bundle_version(&self.status.client)
                .await
                .or(self.bundle.take());
            self.bundle_read = tokio::time::Instant::now();
        }
        for class in self.stores.kinds.classes.state() {
            if class.spec.controller_name == CONTROLLER_NAME {
                self.status
                    .write_gateway_class(&class, self.bundle.as_deref())
                    .await;
            }
        }
    }

    /// The Gateways whose entries of ours status may touch: those served
    /// now and those this process served before and serves no more
    /// (deleted, moved to another class). Only those: another seedlink's
    /// Gateway (one without an object included) is not ours.
    fn served(&mut self, t: &Translation) -> Vec<Key> {
        let mut served: Vec<Key> = self
            .settings
            .gateway
            .iter()
            .cloned()
            .chain(t.gateways.iter().map(|g| g.key.clone()))
            .collect();
        self.ever.extend(served.iter().cloned());
        let gone: Vec<Key> = self
            .ever
            .iter()
            .filter(|k| !served.contains(k))
            .cloned()
            .collect();
        served.extend(gone);
        served
    }
}

/// Whether the sink applied nothing because its own configuration is
/// invalid (its refusals then say "not applied").
fn not_applied(refused: &seedlink_config::compile::Refused) -> bool {
    refused
        .iter()
        .any(|(_, p)| p.iter().any(|e| e.message.starts_with("not applied:")))
}

/// The last translation and the objects it was made from.
type GatewayPass = (Translation, Vec<Arc<TlsRoute>>, Vec<Arc<SeedlinkPolicy>>);

/// Campaigns for `lease` (if any) until `stop`.
fn campaign(
    client: &kube::Client,
    lease: Option<&Key>,
    identity: &str,
    stop: &CancellationToken,
) -> (Leadership, Option<tokio::task::JoinHandle<()>>) {
    let me = Leadership::default();
    let task = lease.map(|lease| {
        tokio::spawn(leader::campaign(
            client.clone(),
            lease.namespace.clone(),
            lease.name.clone(),
            identity.into(),
            me.clone(),
            stop.clone(),
        ))
    });
    (me, task)
}

/// Where the tunnel-server's clusters go, and what it says of them.
pub trait TunnelSink: Send + Sync + 'static {
    /// Serves these clusters (besides the file's); returns those refused,
    /// with the problems.
    /// `status_held`: who holds each trust claim by the TunnelClusters'
    /// statuses (claim → cluster).
    fn apply(
        &self,
        clusters: Vec<seedlink_config::tunnel::Cluster>,
        status_held: HashMap<String, String>,
    ) -> BoxFuture<'_, seedlink_config::compile::Refused>;
    /// A served cluster's agents and dial errors.
    fn health(&self, cluster: &str) -> Option<seedlink_config::tunnel::ClusterHealth>;
    /// The trust claims of a served cluster (for its `status.trust`).
    fn trust(&self, _cluster: &str) -> Vec<String> {
        Vec::new()
    }
    /// The tunnel-server replicas counted from their Service's
    /// EndpointSlices (`kubernetes.replicas`).
    fn set_server_count(&self, _replicas: u32) {}
}

/// The replicas a Service's EndpointSlices name: distinct addresses whose
/// endpoint serves (an unknown condition counts), terminating or not. A
/// replica being replaced still serves through its preStop wait while its
/// successor is already Ready and receiving dials: counting both tells the
/// agents (which hold a stream to each replica they know of) to join the
/// successor at once, instead of when the old one drains; otherwise dials
/// the successor gets meanwhile find no agent. Once the old one stops
/// serving the count drops back. `None` when there is none (a count of 0
/// is never sent to agents).
pub fn replica_count(slices: &[Arc<EndpointSlice>]) -> Option<u32> {
    let mut seen = HashSet::new();
    for s in slices {
        for ep in &s.endpoints {
            let c = ep.conditions.as_ref();
            let ready = c.and_then(|c| c.ready) != Some(false);
            let serving = c.and_then(|c| c.serving).unwrap_or(ready);
            if serving {
                if let Some(a) = ep.addresses.first() {
                    seen.insert(a.clone());
                }
            }
        }
    }
    u32::try_from(seen.len()).ok().filter(|n| *n > 0)
}

/// A boxed future, for the object-safe [`TunnelSink`].
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

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
    /// The operator's ceilings over TunnelClusters' limits.
    pub max_limits: seedlink_config::tunnel::ClusterLimits,
    /// The Service selecting the tunnel-server replicas (`servercount`).
    pub replicas: Option<Key>,
}

/// How long a pass waits for a new namespace's Secrets and ConfigMaps to
/// be listed (a namespace whose RoleBinding is missing never is).
const TRUST_LIST_WAIT: Duration = Duration::from_secs(5);

/// The Secrets and ConfigMaps the tunnel-server reads: per namespace that
/// holds a TunnelCluster, only those labelled `seedlink.dev/tunnel-trust=true`
/// — so it needs no cluster-wide grant, only a RoleBinding in each such
/// namespace (docs/KUBERNETES.md) — started and stopped as TunnelClusters
/// come and go.
#[derive(Default)]
struct TrustWatches {
    by_namespace: HashMap<
        String,
        (
            Store<k8s_openapi::api::core::v1::Secret>,
            Store<k8s_openapi::api::core::v1::ConfigMap>,
            CancellationToken,
        ),
    >,
}

impl TrustWatches {
    /// Watches exactly the namespaces of `clusters`; a new one is waited
    /// for (bounded) so that its references resolve in this pass.
    async fn follow(&mut self, w: &Watches, clusters: &[Arc<crate::crd::TunnelCluster>]) {
        let wanted: HashSet<String> = clusters
            .iter()
            .filter_map(|c| c.metadata.namespace.clone())
            .collect();
        self.by_namespace.retain(|ns, (_, _, stop)| {
            let keep = wanted.contains(ns);
            if !keep {
                stop.cancel();
            }
            keep
        });
        let selector = format!("{}=true", crate::tunnel::TRUST_LABEL);
        for ns in wanted {
            if self.by_namespace.contains_key(&ns) {
                continue;
            }
            let stop = w.stop.child_token();
            let secrets = w.labelled_in(&ns, &selector, &stop);
            let config_maps = w.labelled_in(&ns, &selector, &stop);
            let listed = async {
                secrets.wait_until_ready().await.ok()?;
                config_maps.wait_until_ready().await.ok()
            };
            if tokio::time::timeout(TRUST_LIST_WAIT, listed).await.is_err() {
                tracing::warn!(namespace = %ns, "Secrets and ConfigMaps of a TunnelCluster's namespace not listed yet (is seedlink's RoleBinding there?)");
            }
            self.by_namespace.insert(ns, (secrets, config_maps, stop));
        }
    }

    #[allow(clippy::type_complexity)]
    fn state(
        &self,
    ) -> (
        Vec<Arc<k8s_openapi::api::core::v1::Secret>>,
        Vec<Arc<k8s_openapi::api::core::v1::ConfigMap>>,
    ) {
        let mut secrets = Vec::new();
        let mut config_maps = Vec::new();
        for (s, c, _) in self.by_namespace.values() {
            secrets.extend(s.state());
            config_maps.extend(c.state());
        }
        (secrets, config_maps)
    }
}

/// Starts the tunnel-server's source: TunnelClusters and the Secrets and
/// ConfigMaps they name, clusters into `sink`, status with health.
pub fn start_tunnel(
    client: kube::Client,
    settings: TunnelSettings,
    sink: Arc<dyn TunnelSink>,
) -> Handle {
    let stop = CancellationToken::new();
    let mut w = Watches::new(&client, &stop);
    let errors = w.tx.errors.clone();
    let clusters = w.kind::<crate::crd::TunnelCluster>();
    let replicas = settings.replicas.as_ref().map(|k| {
        w.labelled_in::<EndpointSlice>(
            &k.namespace,
            &format!("kubernetes.io/service-name={}", k.name),
            &stop,
        )
    });
    let coalescer = Coalescer {
        changed: std::mem::replace(&mut w.changed, mpsc::channel(1).1),
        stop: stop.clone(),
    };
    let (leadership, campaign_task) =
        campaign(&client, settings.lease.as_ref(), &settings.identity, &stop);
    let (synced_tx, synced) = watch::channel(false);
    let status = StatusWriter::new(client, leadership.clone(), &settings.identity);
    tokio::spawn(async move {
        tokio::select! {
            r = clusters.wait_until_ready() => if r.is_err() { return },
            () = coalescer.stop.cancelled() => return,
        }
        let passes = TunnelPasses {
            w,
            clusters,
            replicas,
            settings,
            status,
            trust: TrustWatches::default(),
            applied: None,
        };
        passes.run(coalescer, sink, &synced_tx).await;
    });
    Handle {
        synced,
        errors,
        leadership,
        stop,
        campaign: std::sync::Mutex::new(campaign_task),
    }
}

/// The tunnel source's loop: translate and apply on a change, the
/// replica count and status on every wake-up.
struct TunnelPasses {
    w: Watches,
    clusters: Store<crate::crd::TunnelCluster>,
    /// The tunnel-server Service's EndpointSlices (`kubernetes.replicas`).
    replicas: Option<Store<EndpointSlice>>,
    settings: TunnelSettings,
    status: StatusWriter,
    trust: TrustWatches,
    /// What was last handed to the server, and what it refused: an event
    /// that changes none of it (another Secret in the namespace) does
    /// not reload the server.
    applied: Option<(
        Vec<seedlink_config::tunnel::Cluster>,
        seedlink_config::compile::Refused,
    )>,
}

/// The last tunnel translation and the objects it was made from.
type TunnelPass = (
    crate::tunnel::TunnelTranslation,
    Vec<Arc<crate::crd::TunnelCluster>>,
);

impl TunnelPasses {
    async fn run(
        mut self,
        mut coalescer: Coalescer,
        sink: Arc<dyn TunnelSink>,
        synced: &watch::Sender<bool>,
    ) {
        let mut wake = Wake::Changed;
        let mut last: Option<TunnelPass> = None;
        loop {
            // What could not be applied at all is tried again on a tick.
            if self.applied.as_ref().is_some_and(|(_, r)| not_applied(r)) {
                self.applied = None;
            }
            let count = self
                .replicas
                .as_ref()
                .and_then(|r| replica_count(&r.state()));
            if let Some(n) = count {
                sink.set_server_count(n);
            }
            if wake == Wake::Changed || last.is_none() || self.applied.is_none() {
                last = Some(self.pass(sink.as_ref()).await);
                let _ = synced.send(true);
            }
            if let Some((t, objects)) = &last {
                self.status.write_tunnels(t, objects, sink.as_ref()).await;
            }
            wake = coalescer.next().await;
            if wake == Wake::Stop {
                return;
            }
        }
    }

    /// Translates the TunnelClusters and what they name, writes their
    /// trust files and applies the clusters (unless nothing changed).
    async fn pass(&mut self, sink: &dyn TunnelSink) -> TunnelPass {
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
            &s.max_limits,
        );
        if let Err(e) = crate::tunnel::materialize(&s.trust_dir, &t.files) {
            // Nothing is applied: the running clusters stay.
            tracing::error!(dir = %s.trust_dir.display(), error = %e, "cannot write the clusters' trust files; keeping the running clusters");
            return (t, objects);
        }
        let refused = match &self.applied {
            Some((c, r)) if *c == t.clusters => r.clone(),
            _ => {
                let r = sink.apply(t.clusters.clone(), status_held(&objects)).await;
                self.applied = Some((t.clusters.clone(), r.clone()));
                r
            }
        };
        t.refused(&refused);
        (t, objects)
    }
}

/// Who holds each trust claim by the TunnelClusters' statuses (claim →
/// cluster); the oldest object first should two say the same (only
/// seedlink writes status, so they do not).
fn status_held(objects: &[Arc<crate::crd::TunnelCluster>]) -> HashMap<String, String> {
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
        for claim in o.status.iter().flat_map(|s| &s.trust) {
            held.entry(claim.clone()).or_insert_with(|| name.clone());
        }
    }
    held
}

/// Turns a stream of "changed" into one wake-up per burst.
struct Coalescer {
    changed: mpsc::Receiver<()>,
    stop: CancellationToken,
}

impl Coalescer {
    /// Waits for the next burst to settle (200 ms quiet, at most 2 s after
    /// its first event), or for the status tick.
    async fn next(&mut self) -> Wake {
        let burst = tokio::select! {
            c = self.changed.recv() => c.is_some(),
            () = tokio::time::sleep(STATUS_EVERY) => false,
            () = self.stop.cancelled() => return Wake::Stop,
        };
        if !burst {
            return Wake::Tick;
        }
        let deadline = tokio::time::Instant::now() + MAX_DELAY;
        loop {
            let quiet = tokio::time::Instant::now() + QUIET;
            tokio::select! {
                c = self.changed.recv() => if c.is_none() { return Wake::Changed },
                () = tokio::time::sleep_until(quiet.min(deadline)) => return Wake::Changed,
                () = self.stop.cancelled() => return Wake::Stop,
            }
            if tokio::time::Instant::now() >= deadline {
                return Wake::Changed;
            }
        }
    }
}

/// Why the loop woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// Objects changed: translate and apply.
    Changed,
    /// Only time passed: write status (health moves without events).
    Tick,
    /// Stopped.
    Stop,
}

/// Writes route and policy status (only while holding the lease) and an
/// Event per rejection (once per object generation and message).
struct StatusWriter {
    client: kube::Client,
    leadership: Leadership,
    evented: HashSet<(Key, Option<i64>, String)>,
    /// events.k8s.io/v1 Events as the API server wants them
    /// (`reportingController`, `reportingInstance` = the pod, repeats
    /// counted in a series).
    recorder: Recorder,
    /// The TLSRoute version read when it is not v1 (status is written
    /// through the same one).
    route_resource: Option<kube::api::ApiResource>,
}

/// Events remembered (object, generation, message) so that one is not
/// repeated on every pass; forgotten past this many.
const MAX_EVENTED: usize = 10_000;

/// The longest Event note the API server takes.
const MAX_NOTE: usize = 1024;

fn condition(
    type_: &str,
    v: &Verdict,
    generation: Option<i64>,
    previous: &[Condition],
) -> Condition {
    let status = if v.ok { "True" } else { "False" };
    // The transition time changes only when the status does.
    let time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map_or_else(
            || Time(Timestamp::now()),
            |c| c.last_transition_time.clone(),
        );
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: v.reason.clone(),
        message: v.message.clone(),
        observed_generation: generation,
        last_transition_time: time,
    }
}

/// A TLSRoute's `status.parents` as it should be, or `None` when ours are
/// already so. Ours are this controller's entries for the Gateways this
/// seedlink serves; another seedlink's (other Gateways) are kept as read.
fn route_parents(
    route: &TlsRoute,
    key: &Key,
    outcome: Option<&RouteOutcome>,
    served: &[Key],
) -> Option<Vec<gateway_api::tlsroutes::TlsRouteStatusParents>> {
    let current = route
        .status
        .as_ref()
        .map(|s| s.parents.clone())
        .unwrap_or_default();
    let (ours, mut desired): (Vec<_>, Vec<_>) = current.into_iter().partition(|p| {
        p.controller_name == CONTROLLER_NAME
            && served.iter().any(|g| {
                crate::translate::names_gateway(
                    &status_parent_ref(&p.parent_ref),
                    &key.namespace,
                    g,
                )
            })
    });
    let theirs = desired.len();
    for (o, parent) in outcome
        .iter()
        .flat_map(|o| o.parents.iter().map(move |p| (*o, p)))
    {
        desired.push(parent_status(o, parent, &ours));
    }
    let desired_ours = &desired[theirs..];
    let unchanged = desired_ours.len() == ours.len()
        && desired_ours
            .iter()
            .zip(&ours)
            .all(|(a, b)| a.parent_ref == b.parent_ref && same(&a.conditions, &b.conditions));
    (!unchanged).then_some(desired)
}

/// One parent's entry in a route's status (conditions kept from `ours`
/// where unchanged).
fn parent_status(
    o: &RouteOutcome,
    parent: &crate::translate::ParentOutcome,
    ours: &[gateway_api::tlsroutes::TlsRouteStatusParents],
) -> gateway_api::tlsroutes::TlsRouteStatusParents {
    let p = &parent.parent_ref;
    let prev = ours
        .iter()
        .find(|x| parent_eq(&x.parent_ref, p))
        .map(|x| x.conditions.clone())
        .unwrap_or_default();
    gateway_api::tlsroutes::TlsRouteStatusParents {
        conditions: vec![
            condition("Accepted", &parent.accepted, o.generation, &prev),
            condition("ResolvedRefs", &o.resolved, o.generation, &prev),
        ],
        controller_name: CONTROLLER_NAME.into(),
        parent_ref: gateway_api::tlsroutes::TlsRouteStatusParentsParentRef {
            group: p.group.clone(),
            kind: p.kind.clone(),
            name: p.name.clone(),
            namespace: p.namespace.clone(),
            port: p.port,
            section_name: p.section_name.clone(),
        },
    }
}

/// A SeedlinkPolicy's `status.ancestors` as it should be, or `None` when
/// they are already so.
fn policy_ancestors(
    policy: &SeedlinkPolicy,
    key: &Key,
    o: &crate::translate::PolicyOutcome,
) -> Option<Vec<crate::crd::PolicyAncestorStatus>> {
    let current = policy
        .status
        .as_ref()
        .map(|s| s.ancestors.clone())
        .unwrap_or_default();
    let ours = |name: &str, v: &Verdict| {
        let prev = current
            .iter()
            .find(|a| a.ancestor_ref.name == name)
            .map(|a| a.conditions.clone())
            .unwrap_or_default();
        crate::crd::PolicyAncestorStatus {
            ancestor_ref: crate::crd::AncestorRef {
                group: GATEWAY_GROUP.into(),
                kind: "TLSRoute".into(),
                name: name.to_string(),
                namespace: key.namespace.clone(),
            },
            controller_name: CONTROLLER_NAME.into(),
            conditions: vec![condition("Accepted", v, o.generation, &prev)],
        }
    };
    // In the order already written (so that installs sharing a policy
    // never take turns reordering it): another install's entries kept as
    // they are, ours brought up to date, ours no longer targeted gone, new
    // ones last.
    let mut desired: Vec<crate::crd::PolicyAncestorStatus> = Vec::new();
    for a in &current {
        if o.foreign.contains(&a.ancestor_ref.name) {
            desired.push(a.clone());
        } else if let Some((name, v)) = o.targets.iter().find(|(n, _)| *n == a.ancestor_ref.name) {
            desired.push(ours(name, v));
        }
    }
    for (name, v) in &o.targets {
        if !desired.iter().any(|a| a.ancestor_ref.name == *name) {
            desired.push(ours(name, v));
        }
    }
    let unchanged = desired.len() == current.len()
        && desired
            .iter()
            .zip(&current)
            .all(|(a, b)| a.ancestor_ref == b.ancestor_ref && same(&a.conditions, &b.conditions));
    (!unchanged).then_some(desired)
}

/// The `conditions` under a status object, as read.
fn previous_conditions(at: &serde_json::Value) -> Vec<Condition> {
    at.get("conditions")
        .and_then(|c| serde_json::from_value(c.clone()).ok())
        .unwrap_or_default()
}

/// A Gateway's `Accepted` and `Programmed` (`programmed`: the gateway
/// applied the last translation).
fn gateway_verdicts(g: &crate::translate::GatewayOutcome, programmed: bool) -> (Verdict, Verdict) {
    let served = g.listeners.iter().filter(|l| l.accepted.ok).count();
    let accepted = if served == g.listeners.len() {
        Verdict::yes("Accepted", "seedlink serves this Gateway")
    } else {
        let not: Vec<&str> = g
            .listeners
            .iter()
            .filter(|l| !l.accepted.ok)
            .map(|l| l.name.as_str())
            .collect();
        Verdict {
            ok: served > 0,
            reason: "ListenersNotValid".into(),
            message: format!("listeners not served: {}", not.join(", ")),
        }
    };
    let programmed = if !programmed {
        Verdict::no(
            "Invalid",
            "the gateway's own configuration is invalid: nothing applied (its log says why)",
        )
    } else if !g.named && g.address.is_none() {
        Verdict::no(
            "AddressNotAssigned",
            "every address of kubernetes.gateway_class.addresses is taken by an older Gateway",
        )
    } else if served == 0 {
        Verdict::no("Invalid", "no listener of this Gateway is served")
    } else {
        Verdict::yes("Programmed", "applied to the gateway")
    };
    (accepted, programmed)
}

/// One listener's entry in a Gateway's status (`current`: the status as
/// read, for the conditions' transition times).
fn listener_status(
    t: &Translation,
    g: &crate::translate::GatewayOutcome,
    l: &crate::translate::ListenerOutcome,
    gateway_programmed: &Verdict,
    generation: Option<i64>,
    current: &serde_json::Value,
) -> serde_json::Value {
    let prev = current
        .get("listeners")
        .and_then(|ls| ls.as_array())
        .and_then(|ls| ls.iter().find(|x| x["name"] == l.name.as_str()))
        .map(previous_conditions)
        .unwrap_or_default();
    let programmed = if !l.accepted.ok {
        Verdict::no("Invalid", l.accepted.message.clone())
    } else if gateway_programmed.ok {
        Verdict::yes("Programmed", "applied to the gateway")
    } else if gateway_programmed.reason == "AddressNotAssigned" {
        Verdict::no("Pending", gateway_programmed.message.clone())
    } else {
        Verdict::no("Invalid", gateway_programmed.message.clone())
    };
    let kinds: Vec<serde_json::Value> = l
        .kinds
        .iter()
        .map(|k| json!({"group": GATEWAY_GROUP, "kind": k}))
        .collect();
    let no_conflicts = Verdict::no("NoConflicts", "");
    json!({
        "name": l.name,
        "attachedRoutes": t.attached(&g.key, &l.name),
        "supportedKinds": kinds,
        "conditions": [
            condition("Accepted", &l.accepted, generation, &prev),
            condition("Programmed", &programmed, generation, &prev),
            condition("ResolvedRefs", &l.resolved, generation, &prev),
            condition("Conflicted", &no_conflicts, generation, &prev),
        ],
    })
}

/// A TunnelCluster's status as it should be: `Ready`, `AgentsConnected`
/// from the replica's `health`, the agent count, when agents last came or
/// went, dial errors (`current`: the status as read).
fn tunnel_status(
    outcome: &crate::tunnel::TunnelOutcome,
    health: Option<&seedlink_config::tunnel::ClusterHealth>,
    trust: Vec<String>,
    current: &crate::crd::TunnelClusterStatus,
) -> crate::crd::TunnelClusterStatus {
    let agents = health.map_or(0, |h| h.agents);
    let connected = agents_connected(outcome.cluster.is_some(), agents);
    let generation = outcome.generation;
    let last = health
        .and_then(|h| h.agents_changed)
        .and_then(|t| Timestamp::try_from(t).ok())
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string());
    crate::crd::TunnelClusterStatus {
        conditions: vec![
            condition("Ready", &outcome.ready, generation, &current.conditions),
            condition(
                "AgentsConnected",
                &connected,
                generation,
                &current.conditions,
            ),
        ],
        agents: agents as u64,
        last_agent_seen: last.or(current.last_agent_seen.clone()),
        dial_errors: health
            .iter()
            .flat_map(|h| h.dial_errors.iter().map(|(r, n)| (r.to_string(), *n)))
            .collect(),
        observed_generation: generation,
        // Served: what it holds now; refused: what it held stays its own
        // (a failing object never loses a claim to another).
        trust: match outcome.cluster {
            Some(_) if !trust.is_empty() => trust,
            _ => current.trust.clone(),
        },
    }
}

/// `AgentsConnected`: the agent streams the replica writing status has.
fn agents_connected(served: bool, agents: usize) -> Verdict {
    if !served {
        Verdict::no("NotServing", "the cluster is not served (see Ready)")
    } else if agents == 0 {
        Verdict::no(
            "NoAgents",
            "no agent is connected to the replica writing status",
        )
    } else {
        Verdict::yes(
            "AgentsConnected",
            format!("{agents} agent stream(s) connected"),
        )
    }
}

/// A TunnelCluster status's fields besides its conditions: agents, last
/// seen, dial errors, observed generation, trust.
type StatusFields<'a> = (
    u64,
    &'a Option<String>,
    &'a std::collections::BTreeMap<String, u64>,
    Option<i64>,
    &'a [String],
);

/// A TunnelCluster status's fields besides its conditions.
fn status_fields(s: &crate::crd::TunnelClusterStatus) -> StatusFields<'_> {
    (
        s.agents,
        &s.last_agent_seen,
        &s.dial_errors,
        s.observed_generation,
        &s.trust,
    )
}

/// A Service's LoadBalancer addresses as Gateway `status.addresses`
/// (none until a load balancer assigned one).
fn addresses(s: &Service) -> Vec<serde_json::Value> {
    s.status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| match (&i.ip, &i.hostname) {
            (Some(ip), _) => Some(json!({"type": "IPAddress", "value": ip})),
            (None, Some(h)) => Some(json!({"type": "Hostname", "value": h})),
            (None, None) => None,
        })
        .take(16)
        .collect()
}

/// `v` without any `lastTransitionTime` (what a comparison of desired and
/// current status ignores).
fn untimed(v: &mut serde_json::Value) -> &serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("lastTransitionTime");
            for x in m.values_mut() {
                untimed(x);
            }
        }
        serde_json::Value::Array(a) => {
            for x in a.iter_mut() {
                untimed(x);
            }
        }
        _ => {}
    }
    v
}

/// Conditions equal but for their transition times.
fn same(a: &[Condition], b: &[Condition]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (
                &x.type_,
                &x.status,
                &x.reason,
                &x.message,
                x.observed_generation,
            ) == (
                &y.type_,
                &y.status,
                &y.reason,
                &y.message,
                y.observed_generation,
            )
        })
}

impl StatusWriter {
    fn new(client: kube::Client, leadership: Leadership, identity: &str) -> StatusWriter {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.into(),
            instance: Some(identity.to_string()),
        };
        StatusWriter {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            route_resource: None,
            leadership,
            evented: HashSet::new(),
        }
    }

    async fn write(
        &mut self,
        t: &Translation,
        routes: &[Arc<TlsRoute>],
        policies: &[Arc<SeedlinkPolicy>],
        served: &[Key],
    ) {
        if self.leadership.held() && self.write_routes(t, routes, served).await {
            self.write_policies(t, policies).await;
        }
    }

    /// Writes each TLSRoute's `status.parents` where it changed; false
    /// when a write failed (the rest waits for the next pass).
    async fn write_routes(
        &mut self,
        t: &Translation,
        routes: &[Arc<TlsRoute>],
        served: &[Key],
    ) -> bool {
        let outcomes: HashMap<&Key, &RouteOutcome> = t.routes.iter().map(|r| (&r.key, r)).collect();
        for route in routes {
            let key = Key::of(route.as_ref());
            let outcome = outcomes.get(&key).copied();
            if let Some(o) = outcome.filter(|o| !o.accepted.ok) {
                self.event(route.as_ref(), "TLSRoute", o.generation, &o.accepted)
                    .await;
            }
            let Some(desired) = route_parents(route, &key, outcome, served) else {
                continue;
            };
            // `status.parents` is one atomic list shared with other
            // controllers: the patch carries their entries as read, so it
            // is made conditional on the version they were read from. A
            // 409 means someone wrote meanwhile: the watch brings the new
            // version and the next pass writes again from it.
            let patch = json!({
                "metadata": {"resourceVersion": route.metadata.resource_version},
                "status": {"parents": desired}
            });
            let written = match &self.route_resource {
                None => self.patch_status::<TlsRoute>(&key, &patch).await,
                Some(ar) => self.patch_route_status_as(ar, &key, &patch).await,
            };
            if !written {
                return false;
            }
        }
        true
    }

    /// Writes each SeedlinkPolicy's `status.ancestors` where it changed.
    async fn write_policies(&mut self, t: &Translation, policies: &[Arc<SeedlinkPolicy>]) {
        let by_policy: HashMap<&Key, _> = t.policies.iter().map(|p| (&p.key, p)).collect();
        for policy in policies {
            let key = Key::of(policy.as_ref());
            let Some(o) = by_policy.get(&key) else {
                continue;
            };
            for (_, v) in o.targets.iter().filter(|(_, v)| !v.ok) {
                self.event(policy.as_ref(), "SeedlinkPolicy", o.generation, v)
                    .await;
            }
            let Some(desired) = policy_ancestors(policy, &key, o) else {
                continue;
            };
            let patch = json!({
                "metadata": {"resourceVersion": policy.metadata.resource_version},
                "status": {"ancestors": desired}
            });
            if !self.patch_status::<SeedlinkPolicy>(&key, &patch).await {
                return;
            }
        }
    }

    /// Writes each TunnelCluster's status: `Ready`, `AgentsConnected`, the
    /// agent count, when agents last came or went, dial errors.
    async fn write_tunnels(
        &mut self,
        t: &crate::tunnel::TunnelTranslation,
        objects: &[Arc<crate::crd::TunnelCluster>],
        sink: &dyn TunnelSink,
    ) {
        if !self.leadership.held() {
            return;
        }
        let outcomes: HashMap<&Key, _> = t.outcomes.iter().map(|o| (&o.key, o)).collect();
        for o in objects {
            let key = Key::of(o.as_ref());
            let Some(outcome) = outcomes.get(&key) else {
                continue;
            };
            let current = o.status.clone().unwrap_or_default();
            let health = outcome.cluster.as_deref().and_then(|c| sink.health(c));
            let trust = outcome
                .cluster
                .as_deref()
                .map(|c| sink.trust(c))
                .unwrap_or_default();
            let desired = tunnel_status(outcome, health.as_ref(), trust, &current);
            let generation = outcome.generation;
            if !outcome.ready.ok {
                self.event(o.as_ref(), "TunnelCluster", generation, &outcome.ready)
                    .await;
            }
            let unchanged = same(&desired.conditions, &current.conditions)
                && status_fields(&desired) == status_fields(&current);
            if unchanged {
                continue;
            }
            let patch = tunnel_patch(o, &desired, &current);
            if !self
                .patch_status::<crate::crd::TunnelCluster>(&key, &patch)
                .await
            {
                return;
            }
        }
    }

    /// A Warning Event on `object`, once per generation and message.
    async fn event<K: Resource<DynamicType = ()>>(
        &mut self,
        object: &K,
        kind: &str,
        generation: Option<i64>,
        v: &Verdict,
    ) {
        let key = Key::of(object);
        if self.evented.len() >= MAX_EVENTED {
            self.evented.clear();
        }
        let seen = (key.clone(), generation, v.message.clone());
        if self.evented.contains(&seen) {
            return;
        }
        let Some(left) = self.leadership.remaining() else {
            return;
        };
        let reference = ObjectReference {
            api_version: Some(K::api_version(&()).into_owned()),
            kind: Some(kind.into()),
            name: Some(key.name.clone()),
            namespace: Some(key.namespace.clone()),
            uid: object.meta().uid.clone(),
            resource_version: object.meta().resource_version.clone(),
            ..ObjectReference::default()
        };
        let event = RuntimeEvent {
            type_: EventType::Warning,
            reason: v.reason.chars().take(128).collect(),
            note: Some(note(&v.message)),
            action: "Reconcile".into(),
            secondary: None,
        };
        match tokio::time::timeout(left, self.recorder.publish(&event, &reference)).await {
            // Remembered once published: a failed one is tried again.
            Ok(Ok(())) => {
                self.evented.insert(seen);
            }
            Ok(Err(e)) => tracing::warn!(object = %key, error = %e, "cannot create an Event"),
            Err(_) => tracing::debug!(object = %key, "no longer the status leader: Event not sent"),
        }
    }
}

/// The merge patch from `current` to `desired`, conditional on the version
/// read (like every status write).
fn tunnel_patch(
    o: &crate::crd::TunnelCluster,
    desired: &crate::crd::TunnelClusterStatus,
    current: &crate::crd::TunnelClusterStatus,
) -> serde_json::Value {
    let mut patch = json!({
        "metadata": {"resourceVersion": o.metadata.resource_version},
        "status": desired
    });
    // A merge patch keeps map keys it does not name: remove the reasons no
    // longer counted (a restart resets the counts).
    for r in current.dial_errors.keys() {
        if !desired.dial_errors.contains_key(r) {
            patch["status"]["dialErrors"][r] = serde_json::Value::Null;
        }
    }
    patch
}

/// An Event's note: the message, cut at a character boundary to
/// [`MAX_NOTE`] bytes with `...` when longer.
fn note(message: &str) -> String {
    let mut note = message.to_string();
    if note.len() > MAX_NOTE {
        let mut end = MAX_NOTE - 3;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    note
}

/// A class's `Accepted` and `SupportedVersion` (of the installed Gateway
/// API `bundle`).
fn class_conditions(
    bundle: Option<&str>,
    generation: Option<i64>,
    prev: &[Condition],
) -> Vec<Condition> {
    let accepted = Verdict::yes("Accepted", format!("{CONTROLLER_NAME} serves this class"));
    let (status, version) = supported_version(bundle);
    let mut supported = condition("SupportedVersion", &version, generation, prev);
    if status == "Unknown" {
        // What this replica cannot read, another (or an earlier read) may
        // have: an existing verdict is kept, so that two installs never
        // rewrite each other's.
        match prev.iter().find(|c| c.type_ == "SupportedVersion") {
            Some(c) => {
                supported = c.clone();
                supported.observed_generation = generation;
            }
            None => supported.status = status,
        }
    }
    vec![
        condition("Accepted", &accepted, generation, prev),
        supported,
    ]
}

impl StatusWriter {
    /// A GatewayClass whose `controllerName` is seedlink's: `Accepted` and
    /// `SupportedVersion` (of the installed Gateway API `bundle`), written
    /// when they change.
    async fn write_gateway_class(&mut self, class: &GatewayClass, bundle: Option<&str>) {
        if !self.leadership.held() {
            return;
        }
        let generation = class.metadata.generation;
        let prev: Vec<Condition> = class
            .status
            .as_ref()
            .and_then(|s| serde_json::to_value(&s.conditions).ok())
            .and_then(|c| serde_json::from_value(c).ok())
            .unwrap_or_default();
        let desired = class_conditions(bundle, generation, &prev);
        // What seedlink implements, for the conformance suite (which reads
        // it when no features are given) and for people: sorted by name,
        // as the API asks.
        let features: Vec<serde_json::Value> = SUPPORTED_FEATURES
            .iter()
            .map(|f| json!({"name": f}))
            .collect();
        let shown = class
            .status
            .as_ref()
            .and_then(|s| serde_json::to_value(&s.supported_features).ok())
            .unwrap_or_default();
        if same(&desired, &prev) && shown == json!(features) {
            return;
        }
        let Some(left) = self.leadership.remaining() else {
            return;
        };
        let name = kube::ResourceExt::name_any(class);
        let patch = json!({
            "metadata": {"resourceVersion": class.metadata.resource_version},
            "status": {"conditions": desired, "supportedFeatures": features},
        });
        let api: Api<GatewayClass> = Api::all(self.client.clone());
        let (params, patch) = (status_params(), Patch::Merge(&patch));
        match tokio::time::timeout(left, api.patch_status(&name, &params, &patch)).await {
            Ok(Ok(_)) => {}
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                tracing::debug!(class = %name, "GatewayClass changed meanwhile; written again on the next pass");
            }
            Ok(Err(e)) => {
                tracing::warn!(class = %name, error = %e, "cannot write GatewayClass status")
            }
            Err(_) => {
                tracing::debug!(class = %name, "no longer the status leader: status not written")
            }
        }
    }

    /// A served Gateway's status: `Accepted` (true while some listener is
    /// served; reason `ListenersNotValid` when some or all are not),
    /// `Programmed` (the gateway applied the routes and the Gateway has an
    /// address), and per listener its conditions, `supportedKinds` and
    /// `attachedRoutes`. The Gateway is seedlink's alone, so the lists are
    /// replaced whole; unchanged status is not written again.
    async fn write_gateway(
        &mut self,
        t: &Translation,
        g: &crate::translate::GatewayOutcome,
        gateway: &Gateway,
        programmed: bool,
        addresses: &[serde_json::Value],
    ) {
        if !self.leadership.held() {
            return;
        }
        let key = Key::of(gateway);
        let generation = gateway.metadata.generation;
        let current = serde_json::to_value(&gateway.status).unwrap_or_default();
        let prev = previous_conditions(&current);
        let (accepted, programmed) = gateway_verdicts(g, programmed);
        let conditions = vec![
            condition("Accepted", &accepted, generation, &prev),
            condition("Programmed", &programmed, generation, &prev),
        ];
        let listeners: Vec<serde_json::Value> = g
            .listeners
            .iter()
            .map(|l| listener_status(t, g, l, &programmed, generation, &current))
            .collect();
        let desired = json!({
            "conditions": conditions,
            "listeners": listeners,
            "addresses": addresses,
        });
        let mut now = json!({
            "conditions": current.get("conditions").cloned().unwrap_or(json!([])),
            "listeners": current.get("listeners").cloned().unwrap_or(json!([])),
            "addresses": current.get("addresses").cloned().unwrap_or(json!([])),
        });
        if untimed(&mut desired.clone()) == untimed(&mut now) {
            return;
        }
        let patch = json!({
            "metadata": {"resourceVersion": gateway.metadata.resource_version},
            "status": desired,
        });
        self.patch_status::<Gateway>(&key, &patch).await;
    }

    /// [`StatusWriter::patch_status`] for a TLSRoute read through an older
    /// version (`ar`).
    async fn patch_route_status_as(
        &self,
        ar: &kube::api::ApiResource,
        key: &Key,
        patch: &serde_json::Value,
    ) -> bool {
        let api = Api::<kube::api::DynamicObject>::namespaced_with(
            self.client.clone(),
            &key.namespace,
            ar,
        );
        self.patch_status_in(api, key, &format!("TLSRoute {}", ar.version), patch)
            .await
    }

    /// Merge-patches the status of `K` `key` (conditional on the
    /// resourceVersion the patch carries), bounded by the time left before
    /// the lease's renew deadline. `false`: no longer the status leader.
    async fn patch_status<K>(&self, key: &Key, patch: &serde_json::Value) -> bool
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), &key.namespace);
        self.patch_status_in(api, key, &K::kind(&()), patch).await
    }

    /// [`StatusWriter::patch_status`] through `api` (`kind` names it in logs).
    async fn patch_status_in<K>(
        &self,
        api: Api<K>,
        key: &Key,
        kind: &str,
        patch: &serde_json::Value,
    ) -> bool
    where
        K: Clone + DeserializeOwned + Debug,
    {
        let Some(left) = self.leadership.remaining() else {
            return false;
        };
        match tokio::time::timeout(
            left,
            api.patch_status(&key.name, &status_params(), &Patch::Merge(patch)),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                tracing::debug!(object = %key, %kind, "status changed meanwhile; written again on the next pass");
            }
            Ok(Err(e)) => tracing::warn!(object = %key, %kind, error = %e, "cannot write status"),
            Err(_) => {
                tracing::debug!(object = %key, %kind, "no longer the status leader: status not written")
            }
        }
        true
    }
}

/// A status entry's parentRef as a route's parentRef (to ask whether it
/// names our Gateway).
fn status_parent_ref(
    p: &gateway_api::tlsroutes::TlsRouteStatusParentsParentRef,
) -> TlsRouteParentRefs {
    TlsRouteParentRefs {
        group: p.group.clone(),
        kind: p.kind.clone(),
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        port: p.port,
        section_name: p.section_name.clone(),
    }
}

/// Status writes name seedlink as their field manager.
fn status_params() -> PatchParams {
    PatchParams {
        field_manager: Some("seedlink".into()),
        ..PatchParams::default()
    }
}

fn parent_eq(
    a: &gateway_api::tlsroutes::TlsRouteStatusParentsParentRef,
    b: &TlsRouteParentRefs,
) -> bool {
    (
        &a.group,
        &a.kind,
        &a.name,
        &a.namespace,
        a.port,
        &a.section_name,
    ) == (
        &b.group,
        &b.kind,
        &b.name,
        &b.namespace,
        b.port,
        &b.section_name,
    )
}

#[cfg(test)]
mod version_tests {
    use super::supported_version;

    #[test]
    fn supported_gateway_api_versions() {
        for (b, want) in [
            (Some("v1.6.3"), "True"),
            (Some("v1.4.1"), "True"),
            (Some("v1.5.0-rc.1"), "True"),
            (Some("v1.3.0"), "False"),
            (Some("v1.7.0"), "False"),
            (Some("v2.0.0"), "False"),
            (Some("garbage"), "False"),
            (None, "Unknown"),
        ] {
            assert_eq!(supported_version(b).0, want, "{b:?}");
        }
    }
}

#[cfg(test)]
mod replica_tests {
    use super::*;

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
}

#[cfg(test)]
mod policy_status_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Another install's entry on a shared policy is kept as written, in
    /// its place; ours is brought up to date; written again, nothing
    /// changes (two installs never take turns rewriting it).
    #[test]
    fn another_installs_ancestor_entry_is_kept_in_place() {
        let entry = |route: &str, status: &str| {
            serde_json::json!({
                "ancestorRef": {"group": GATEWAY_GROUP, "kind": "TLSRoute", "name": route, "namespace": "t"},
                "controllerName": CONTROLLER_NAME,
                "conditions": [{"type": "Accepted", "status": status, "reason": "x", "message": "",
                                "observedGeneration": 1, "lastTransitionTime": "2026-01-01T00:00:00Z"}]
            })
        };
        let policy: SeedlinkPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "policy.seedlink.dev/v1alpha1", "kind": "SeedlinkPolicy",
            "metadata": {"name": "acl", "namespace": "t", "generation": 2},
            "spec": {"targetRefs": [
                {"group": GATEWAY_GROUP, "kind": "TLSRoute", "name": "theirs"},
                {"group": GATEWAY_GROUP, "kind": "TLSRoute", "name": "ours"}]},
            "status": {"ancestors": [entry("theirs", "True"), entry("ours", "False")]}
        }))
        .unwrap();
        let key = Key {
            namespace: "t".into(),
            name: "acl".into(),
        };
        let o = crate::translate::PolicyOutcome {
            key: key.clone(),
            generation: Some(2),
            targets: vec![("ours".into(), Verdict::yes("Accepted", "applied"))],
            foreign: vec!["theirs".into()],
        };
        let desired = policy_ancestors(&policy, &key, &o).unwrap();
        assert_eq!(desired.len(), 2);
        assert_eq!(desired[0], policy.status.as_ref().unwrap().ancestors[0]);
        assert_eq!(desired[1].ancestor_ref.name, "ours");
        assert_eq!(desired[1].conditions[0].status, "True");
        let mut written = policy.clone();
        written.status = Some(crate::crd::PolicyStatus { ancestors: desired });
        assert!(policy_ancestors(&written, &key, &o).is_none());
    }
}
