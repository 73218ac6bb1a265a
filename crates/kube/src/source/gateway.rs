//! The gateway's source: its kinds, each snapshot translated and handed
//! to the gateway, the Gateway API version it supports.

use std::collections::HashSet;
use std::sync::Arc;

use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::Store;
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::api::ApiClients;
use super::coalesce::{follow_passes, Coalescer, StatusTask, Wake};
use super::gateway_status::*;
use super::handle::Handle;
use super::metrics::SourceMetrics;
use super::sink::GatewaySink;
use super::status::*;
use super::watches::*;
use crate::crd::{SeedlinkPolicy, CONTROLLER_NAME};
use crate::leader::{self, Leadership};
use crate::translate::{Key, Objects, Translation, Translator};

/// Starts the gateway's source: watches, snapshots into `sink`, status.
pub fn start_gateway(
    clients: ApiClients,
    settings: GatewaySettings,
    sink: Arc<dyn GatewaySink>,
) -> Handle {
    let stop = CancellationToken::new();
    let client = clients.main().clone();
    let metrics = SourceMetrics::new("gateway");
    let mut w = Watches::new(&clients, &stop, &metrics);
    let touched = Touched::default();
    w.tx.touched = Some(touched.clone());
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
    let writer_metrics = metrics.clone();
    tokio::spawn(async move {
        let (routes, route_resource) = Routes::watch(&client, routes_tx, routes_stop).await;
        let stores = GatewayStores {
            routes,
            kinds,
            touched,
            read_from: Arc::default(),
        };
        tokio::select! {
            r = stores.ready() => if r.is_none() { return },
            () = coalescer.stop.cancelled() => return,
        }
        let mut status = StatusWriter::new(
            client.clone(),
            writer_leadership,
            &settings.identity,
            &writer_metrics,
        );
        status.route_resource = route_resource;
        let mut translator = Translator::default();
        translator.slice_managers = settings.slice_managers.clone();
        let (legacy_tx, legacy_rx) = watch::channel(Arc::new(None));
        let writer = GatewayStatus {
            legacy: legacy_rx,
            bundle: bundle_version(&client).await,
            bundle_read: tokio::time::Instant::now(),
            ever: HashSet::new(),
            stores: stores.clone(),
            settings: settings.clone(),
            status,
        };
        let pass = GatewayPasses {
            translator,
            stores,
            settings,
            metrics: writer_metrics,
            status: follow_passes(writer, coalescer.stop.clone()),
            legacy: legacy_tx,
        };
        pass.run(coalescer, sink.as_ref(), &synced_tx).await;
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

/// The objects the gateway's source reads besides TLSRoutes, each a
/// watched store.
#[derive(Clone)]
pub(super) struct GatewayKinds {
    pub(super) policies: Store<SeedlinkPolicy>,
    pub(super) services: Store<Service>,
    pub(super) slices: Store<EndpointSlice>,
    pub(super) gateways: Store<Gateway>,
    pub(super) classes: Store<GatewayClass>,
    pub(super) namespaces: Store<Namespace>,
    pub(super) grants: Store<ReferenceGrant>,
    /// The Services whose events (and their slices') wake a pass.
    pub(super) interest: Interest,
}

impl GatewayKinds {
    pub(super) fn watch(w: &Watches, settings: &GatewaySettings) -> GatewayKinds {
        let interest = Interest::default();
        GatewayKinds {
            policies: w.kind(),
            services: w.kind_where(service_read(&interest)),
            slices: w.kind_where(slice_read(&interest)),
            // Only the named Gateway's namespace when that is all it
            // serves; every namespace for a class.
            gateways: match (&settings.gateway, &settings.class) {
                (Some(g), None) => w.in_namespace(&g.namespace),
                _ => w.kind(),
            },
            classes: w.kind(),
            namespaces: w.kind(),
            grants: w.kind(),
            interest,
        }
    }
}

/// The label naming an EndpointSlice's Service.
const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Whether a Service is one `interest` holds.
pub(super) fn service_read(interest: &Interest) -> Relevant<Service> {
    let interest = interest.clone();
    Arc::new(move |s: &Service, _| {
        interest.counts(
            s.metadata.namespace.as_deref().unwrap_or_default(),
            s.metadata.name.as_deref().unwrap_or_default(),
        )
    })
}

/// Whether an EndpointSlice is of a Service `interest` holds (one without
/// a Service's name is nobody's backend), or was when its last event
/// counted: a slice relabelled away from a Service the routes read, then
/// deleted or not, changes that Service's endpoints.
pub(super) fn slice_read(interest: &Interest) -> Relevant<EndpointSlice> {
    let interest = interest.clone();
    let counted: std::sync::Mutex<HashSet<Key>> = Default::default();
    Arc::new(move |s: &EndpointSlice, deleted: bool| {
        let ns = s.metadata.namespace.as_deref().unwrap_or_default();
        let service = s.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME));
        let now = service.is_some_and(|name| interest.counts(ns, name));
        let key = Key {
            namespace: ns.to_string(),
            name: s.metadata.name.clone().unwrap_or_default(),
        };
        let mut counted = seedlink_net::sync::lock(&counted, "slices counted");
        let before = match now && !deleted {
            true => !counted.insert(key),
            false => counted.remove(&key),
        };
        now || before
    })
}

/// The Services a pass over `routes` reads: those their backendRefs name
/// (whether or not the route attaches, or a grant allows it), and the one
/// the Gateway's addresses come from.
pub(super) fn services_read(routes: &[Arc<TlsRoute>], settings: &GatewaySettings) -> HashSet<Key> {
    let mut read: HashSet<Key> = settings.service.iter().cloned().collect();
    for r in routes {
        let own = r.metadata.namespace.as_deref().unwrap_or_default();
        for b in r.spec.rules.iter().flat_map(|rule| &rule.backend_refs) {
            read.insert(Key {
                namespace: b.namespace.as_deref().unwrap_or(own).to_string(),
                name: b.name.clone(),
            });
        }
    }
    read
}

/// Whether a store's objects are the ones seen last time: the same
/// allocations (a reflector store replaces an object's `Arc` on every
/// event), held so that none is reused meanwhile. One sort of addresses
/// instead of what is derived from the objects.
pub(super) struct SameObjects<K>(Vec<Arc<K>>);

impl<K> Default for SameObjects<K> {
    fn default() -> Self {
        SameObjects(Vec::new())
    }
}

impl<K> SameObjects<K> {
    /// Whether `now` differs from the objects seen last; remembers `now`.
    pub(super) fn changed(&mut self, now: &[Arc<K>]) -> bool {
        let mut now: Vec<Arc<K>> = now.to_vec();
        now.sort_by_key(|o| Arc::as_ptr(o) as usize);
        let same =
            now.len() == self.0.len() && now.iter().zip(&self.0).all(|(a, b)| Arc::ptr_eq(a, b));
        self.0 = now;
        !same
    }
}

/// Every object the gateway's source reads.
#[derive(Clone)]
pub(super) struct GatewayStores {
    pub(super) routes: Routes,
    pub(super) kinds: GatewayKinds,
    /// The namespaces changed since the last pass.
    pub(super) touched: Touched,
    /// The routes the Services read were last taken from.
    pub(super) read_from: Arc<std::sync::Mutex<SameObjects<TlsRoute>>>,
}

impl GatewayStores {
    /// Waits for every store's first list; `None` if a watch ended first.
    pub(super) async fn ready(&self) -> Option<()> {
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
    pub(super) fn translate(
        &self,
        translator: &mut Translator,
        settings: &GatewaySettings,
    ) -> GatewayPass {
        let k = &self.kinds;
        // Before any store is read: what changes after this is in the
        // next pass's set.
        let touched = self.touched.take();
        let (routes, policies) = (self.routes.state(), k.policies.state());
        // Before the Services and slices are read: an event on one the
        // routes read from now on wakes the next pass, so none is missed
        // between this read and the next.
        if seedlink_net::sync::lock(&self.read_from, "routes read").changed(&routes) {
            k.interest.set(services_read(&routes, settings));
        }
        let (services, slices) = (k.services.state(), k.slices.state());
        let (gateways, classes) = (k.gateways.state(), k.classes.state());
        let (namespaces, grants) = (k.namespaces.state(), k.grants.state());
        let objects = Objects {
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
        };
        let t = translator.translate_touched(&objects, touched.as_ref());
        GatewayPass {
            t,
            routes,
            policies,
            gateways,
        }
    }

    /// The addresses a Gateway's status names: the named Gateway's are its
    /// Service's load-balancer addresses, a class Gateway's its own.
    pub(super) fn addresses(
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
        // Looked up by name: a walk over every Service (thousands in a
        // seed) on every pass showed in the profile.
        settings
            .service
            .as_ref()
            .and_then(|k| {
                let at = kube::runtime::reflector::ObjectRef::new(&k.name).within(&k.namespace);
                self.kinds.services.get(&at)
            })
            .map(|s| addresses(&s))
            .unwrap_or_default()
    }
}

/// The gateway source's loop: translate and apply on a change (status is
/// written apart, by [`GatewayStatus`]).
pub(super) struct GatewayPasses {
    pub(super) stores: GatewayStores,
    pub(super) settings: GatewaySettings,
    pub(super) translator: Translator,
    pub(super) metrics: SourceMetrics,
    /// The latest pass, and whether it was applied, for the status task.
    pub(super) status: tokio::sync::watch::Sender<Option<Arc<(GatewayPass, bool)>>>,
    /// The control planes' legacy paths in use, as the gateway last told
    /// them, for the status task.
    pub(super) legacy: tokio::sync::watch::Sender<Arc<super::sink::LegacyPaths>>,
}

impl GatewayPasses {
    pub(super) async fn run(
        mut self,
        mut coalescer: Coalescer,
        sink: &dyn GatewaySink,
        synced: &watch::Sender<bool>,
    ) {
        let mut wake = Wake::Changed;
        let mut passed = false;
        // Set when the gateway could not apply anything (its own file is
        // invalid): the next tick tries again, as the file may be fixed.
        let mut retry = false;
        loop {
            if wake == Wake::Changed || !passed || retry {
                let started = tokio::time::Instant::now();
                let mut pass = self.stores.translate(&mut self.translator, &self.settings);
                // The gateway keeps them; status reads the outcomes only.
                let refused = sink.apply(std::mem::take(&mut pass.t.control_planes));
                self.metrics.applied(started.elapsed());
                retry = not_applied(&refused);
                pass.t.refused(&refused);
                // Before the pass goes to status: written with it at once.
                self.tell_legacy(sink);
                let _ = synced.send(true);
                self.status.send_replace(Some(Arc::new((pass, !retry))));
                passed = true;
            }
            self.tell_legacy(sink);
            wake = coalescer.next().await;
            if wake == Wake::Stop {
                return;
            }
        }
    }
}

impl GatewayPasses {
    /// Asks the gateway for the legacy paths in use (each pass and each
    /// status tick); a change has the status task write the latest pass's
    /// status again.
    fn tell_legacy(&self, sink: &dyn GatewaySink) {
        let legacy = sink.legacy_paths();
        if **self.legacy.borrow() != legacy {
            self.legacy.send_replace(Arc::new(legacy));
            self.status.send_modify(|_| {});
        }
    }
}

/// Writes the gateway source's status from its latest pass.
pub(super) struct GatewayStatus {
    pub(super) stores: GatewayStores,
    pub(super) settings: GatewaySettings,
    pub(super) status: StatusWriter,
    /// Every Gateway this process has served.
    pub(super) ever: HashSet<Key>,
    /// The installed Gateway API bundle, re-read every `BUNDLE_REREAD`.
    pub(super) bundle: Option<String>,
    /// The control planes' legacy paths in use (from the passes' loop).
    pub(super) legacy: tokio::sync::watch::Receiver<Arc<super::sink::LegacyPaths>>,
    pub(super) bundle_read: tokio::time::Instant,
}

impl StatusTask for GatewayStatus {
    type Pass = (GatewayPass, bool);

    async fn write(&mut self, (pass, applied): &(GatewayPass, bool)) {
        self.write_status(pass, *applied).await;
    }
}

impl GatewayStatus {
    /// Reads the Gateway API bundle version again when it is older than
    /// [`BUNDLE_REREAD`]: an upgrade is noticed within minutes.
    async fn reread_bundle(&mut self) {
        if self.bundle_read.elapsed() > BUNDLE_REREAD {
            self.bundle = bundle_version(&self.status.client)
                .await
                .or(self.bundle.take());
            self.bundle_read = tokio::time::Instant::now();
        }
    }

    /// Writes the routes', policies', Gateways' and classes' status.
    pub(super) async fn write_status(&mut self, pass: &GatewayPass, applied: bool) {
        let t = &pass.t;
        let served = self.served(t);
        self.status.legacy = self.legacy.borrow().clone();
        self.status
            .write(t, &pass.routes, &pass.policies, &served)
            .await;
        // The counts of Gateways no longer served are let go.
        let attached = &mut self.status.attached;
        attached.retain(|k, _| t.gateways.iter().any(|g| g.key == *k));
        for g in &t.gateways {
            let object = pass.gateways.iter().find(|o| Key::of(o.as_ref()) == g.key);
            let Some(object) = object else {
                continue;
            };
            let addresses = self.stores.addresses(&self.settings, g);
            self.status
                .write_gateway(t, g, object, applied, &addresses)
                .await;
        }
        self.reread_bundle().await;
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
    pub(super) fn served(&mut self, t: &Translation) -> Vec<Key> {
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
pub(super) fn not_applied(refused: &seedlink_config::compile::Refused) -> bool {
    refused
        .iter()
        .any(|(_, p)| p.iter().any(|e| e.message.starts_with("not applied:")))
}

/// The last translation and the objects it was made from.
/// One translation and the objects it was made from: status is written
/// from these, never from newer objects (each patch carries the
/// resourceVersion of the object translated, so a pass older than the
/// object conflicts and the next pass writes).
pub(super) struct GatewayPass {
    pub(super) t: Translation,
    pub(super) routes: Vec<Arc<TlsRoute>>,
    pub(super) policies: Vec<Arc<SeedlinkPolicy>>,
    pub(super) gateways: Vec<Arc<Gateway>>,
}

/// Campaigns for `lease` (if any) until `stop`.
pub(super) fn campaign(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The same objects in any order are the same; one replaced (its
    /// content the same or not), added or removed is a change.
    #[test]
    fn a_store_is_the_same_while_its_objects_are() {
        let (a, b) = (Arc::new(1), Arc::new(2));
        let mut seen = SameObjects::default();
        assert!(seen.changed(&[a.clone(), b.clone()]));
        assert!(!seen.changed(&[b.clone(), a.clone()]));
        assert!(seen.changed(&[a.clone(), Arc::new(2)]));
        assert!(seen.changed(std::slice::from_ref(&a)));
        assert!(seen.changed(&[]));
        assert!(!seen.changed(&[]));
    }
}
