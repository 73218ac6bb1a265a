//! The onboarding controller: every replica watches `SeedlinkControlPlane`s
//! (kube-runtime's `Controller`, which queues, deduplicates and backs off),
//! and the one holding the Lease writes. Per object: the agent CA and the
//! agents' certificate (issued once, kept in Secrets it owns), then the
//! generated objects, then status mirrored from what they report.
//!
//! It never moves a claim: an object of a generated name that this control
//! plane does not own is left alone and the control plane is refused with
//! the reason (`NameTaken`); a missing object is created (a POST, which
//! fails if someone made it meanwhile), an owned one applied.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{watcher, Controller};
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::certs::{self, Issued};
use super::generate::{self, Bundle, Generated, Names, Refusal, Settings};
use super::rotation::{self, Asked, CaState, CaStep, Validity};
use crate::crd::TunnelCluster;
use crate::crd::{ControlPlaneStatus, SeedlinkControlPlane};
use crate::leader::Leadership;

/// The field manager of everything the controller applies.
pub const MANAGER: &str = "seedlink-onboarding";
/// How often a control plane is looked at when nothing it watches
/// changed (its certificates' renewal): its route's and tunnel cluster's
/// changes wake it at once.
const RESYNC: Duration = Duration::from_secs(60);
/// How soon a follower (not holding the Lease) looks again.
const FOLLOWER_RETRY: Duration = Duration::from_secs(2);
/// How soon a failed reconcile is retried.
const ERROR_RETRY: Duration = Duration::from_secs(5);

/// Renders kube-apiserver's and the shoot's files for the tunnel cluster
/// named (`<namespace>.<name>`), with what its node-proxies send: the
/// `tunnel-config` renderer, passed in by the binary (one code path for
/// the CLI and the controller), or why it cannot.
pub type Renderer = Arc<dyn Fn(&str, &NodeRoute) -> Result<Bundle, String> + Send + Sync>;

/// What a control plane's node-proxies send the gateway to reach it, from
/// its `spec.nodes`: the renderer picks the node-proxy's mode by it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeRoute {
    /// The first of `destinations` (HTTP CONNECT with the destination
    /// header, GEP-30).
    pub destination: Option<String>,
    /// `clusterID` (PROXY v2 with the ID in a TLV, HyperShift's node
    /// path), used when no destination is named.
    pub cluster_id: Option<String>,
}

/// What a reconcile needs.
pub struct Context {
    /// The API client (the controller's ServiceAccount).
    pub client: kube::Client,
    /// The install's settings.
    pub settings: Settings,
    /// Whether this replica writes.
    pub leadership: Leadership,
    /// The namespace label that lets routes attach to the Gateway, set on a
    /// control plane's namespace when configured.
    pub namespace_label: Option<String>,
    /// Events about control planes.
    pub recorder: Recorder,
    /// kube-apiserver's and the shoot's files, when configured.
    pub render: Option<Renderer>,
    /// The CA that issues kube-apiserver's client certificates for the
    /// shared frontend, when configured; a new one (its files replaced)
    /// reconciles every control plane, so each certificate is issued by it.
    pub kube_apiserver_ca: tokio::sync::watch::Receiver<Option<ClientIssuer>>,
    /// The agent's image for the shoot's manifests, when configured.
    pub agent_image: Option<String>,
    /// How long the certificates it issues are valid.
    pub validity: Validity,
    /// The namespaces labelled for the Gateway by this process.
    pub labelled: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The control planes as last seen, once the controller runs (what
    /// the metrics and the readiness probe read).
    pub watched: Watched,
}

/// The CA the tunnel-server's shared TCP+mTLS frontend trusts for
/// kube-apiserver's client certificates (its CN names the cluster), and
/// the tunnel-server's CA kube-apiserver verifies the frontend with.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIssuer {
    /// The CA's certificate (PEM).
    pub cert_pem: String,
    /// Its key (PEM).
    pub key_pem: String,
    /// The tunnel-server's CA (PEM).
    pub server_ca: String,
}

/// The controller's cache of control planes, shared with the admin
/// endpoint.
pub type Watched = Arc<std::sync::OnceLock<kube::runtime::reflector::Store<SeedlinkControlPlane>>>;

/// Why a reconcile failed (retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server answered with an error.
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// A certificate could not be made.
    #[error("{0}")]
    Cert(#[from] certs::CertError),
}

/// Runs the controller until `stop`.
pub async fn run(ctx: Context, stop: CancellationToken) {
    let cps: Api<SeedlinkControlPlane> = Api::all(ctx.client.clone());
    // What a control plane's status mirrors: a change in either wakes its
    // owner at once; only generated objects are watched.
    let generated = watcher::Config::default().labels(generate::CONTROL_PLANE_LABEL);
    let clusters: Api<TunnelCluster> = Api::all(ctx.client.clone());
    let routes_gvk = GroupVersionKind::gvk(
        "gateway.networking.k8s.io",
        &ctx.settings.route_version,
        "TLSRoute",
    );
    let routes_ar = ApiResource::from_gvk_with_plural(&routes_gvk, "tlsroutes");
    let routes: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &routes_ar);
    let controller = Controller::new(cps, watcher::Config::default());
    // Set once per process: a second run would keep the first's cache.
    let _ = ctx.watched.set(controller.store());
    let new_client_ca =
        futures_util::stream::unfold(ctx.kube_apiserver_ca.clone(), |mut ca| async {
            ca.changed().await.ok()?;
            Some(((), ca))
        });
    controller
        .owns(clusters, generated.clone())
        .owns_with(routes, routes_ar, generated)
        .reconcile_all_on(new_client_ca)
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(reconcile, error_policy, Arc::new(ctx))
        .for_each(|r| async move {
            match r {
                Ok(_) => {}
                // Logged by `error_policy`, with the control plane.
                Err(e @ kube::runtime::controller::Error::ReconcilerFailed(..)) => {
                    tracing::debug!(error = %e, "onboarding: reconcile");
                }
                // A watch failing (RBAC, a missing CRD, the API server
                // away) or an object gone: nothing is reconciled until it
                // recovers, and the operator must see why (the watcher
                // backs off, so this is not a flood).
                Err(e) => tracing::warn!(error = %e, "onboarding: controller"),
            }
        })
        .await;
}

fn error_policy(cp: Arc<SeedlinkControlPlane>, e: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(control_plane = %key(&cp), error = %e, "onboarding: will retry");
    Action::requeue(ERROR_RETRY)
}

fn key(cp: &SeedlinkControlPlane) -> String {
    format!("{}/{}", cp.namespace().unwrap_or_default(), cp.name_any())
}

/// One control plane: issue, generate, apply, report.
async fn reconcile(cp: Arc<SeedlinkControlPlane>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !ctx.leadership.held() {
        return Ok(Action::requeue(FOLLOWER_RETRY));
    }
    if cp.meta().deletion_timestamp.is_some() {
        // The garbage collector removes what it owns.
        return Ok(Action::await_change());
    }
    let ns = cp.namespace().unwrap_or_default();
    let w = Writer {
        ctx: &ctx,
        ns: &ns,
        cp: &cp,
    };
    let mut wait = RESYNC;
    let status = match w.generate().await {
        Ok((generated, not_after, wake)) => {
            wait = until(wake, Timestamp::now());
            w.observe(&generated, not_after).await?
        }
        Err(Stop::Refused(refusal)) => {
            w.event(&refusal).await;
            refused(&cp, &refusal)
        }
        Err(Stop::Failed(e)) => {
            // Said on the object too (a missing permission, a webhook),
            // then retried.
            let r = Refusal {
                reason: "Failed",
                message: e.to_string(),
            };
            if let Err(e) = w.write_status(refused(&cp, &r)).await {
                tracing::debug!(error = %e, "onboarding: status");
            }
            return Err(e);
        }
    };
    w.write_status(status).await?;
    Ok(Action::requeue(wait))
}

/// How long to wait for the next pass: until `wake` (a renewal, a
/// rotation, an overlap's end), at least a second, at most [`RESYNC`].
fn until(wake: Timestamp, now: Timestamp) -> Duration {
    let left = wake.duration_since(now);
    Duration::try_from(left)
        .unwrap_or(Duration::ZERO)
        .clamp(Duration::from_secs(1), RESYNC)
}

/// Why a pass stopped: the object is refused (said on its status), or
/// something failed (retried).
enum Stop {
    Refused(Refusal),
    Failed(Error),
}

impl From<Refusal> for Stop {
    fn from(r: Refusal) -> Stop {
        Stop::Refused(r)
    }
}

impl From<kube::Error> for Stop {
    fn from(e: kube::Error) -> Stop {
        Stop::Failed(e.into())
    }
}

impl From<certs::CertError> for Stop {
    fn from(e: certs::CertError) -> Stop {
        Stop::Failed(e.into())
    }
}

/// Writes into one control plane's namespace.
struct Writer<'a> {
    ctx: &'a Context,
    ns: &'a str,
    cp: &'a SeedlinkControlPlane,
}

impl Writer<'_> {
    fn api(&self, api_version: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let ar =
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
        Api::namespaced_with(self.ctx.client.clone(), self.ns, &ar)
    }

    fn uid(&self) -> String {
        self.cp.uid().unwrap_or_default()
    }

    /// The credentials, then every generated object: what was written and
    /// when the first certificate expires.
    async fn generate(&self) -> Result<(Vec<Generated>, Timestamp, Timestamp), Stop> {
        let names = Names::of(&self.cp.name_any());
        let now = Timestamp::now();
        let (ca, step) = self.ca(&names, now).await?;
        let trust = rotation::trust_bundle(&ca, now);
        let mut objects = generate::objects(self.cp, &self.ctx.settings, &trust)?;
        self.label_namespace().await?;
        // The trust first: a certificate from a new CA is written after
        // the trust that names it.
        for g in &objects {
            self.put(g).await?;
        }
        let leaf = self.leaf(&names, &ca, step, now).await?;
        let bundle = self.bundle(&leaf)?;
        for g in &bundle {
            self.put(g).await?;
        }
        objects.extend(bundle);
        let mut wake = rotation::next_due(&ca, &leaf, &self.ctx.validity);
        let mut not_after = ca.current.not_after.min(leaf.not_after);
        if let Some((g, expires)) = self.kube_apiserver_tunnel(&names, now, &mut wake).await? {
            self.put(&g).await?;
            objects.push(g);
            not_after = not_after.min(expires);
        }
        Ok((objects, not_after, wake))
    }

    /// kube-apiserver's client certificate for the shared frontend, when
    /// an issuer is configured and the tunnel is on: kept, or issued again
    /// with a third of its validity left or by a new issuer; `wake` moves
    /// to its renewal. With its expiry (in status and the metric).
    async fn kube_apiserver_tunnel(
        &self,
        names: &Names,
        now: Timestamp,
        wake: &mut Timestamp,
    ) -> Result<Option<(Generated, Timestamp)>, Stop> {
        let ca = self.ctx.kube_apiserver_ca.borrow().clone();
        let Some(k) = ca.as_ref().filter(|_| self.tunnel_on()) else {
            return Ok(None);
        };
        let v = &self.ctx.validity;
        let name = &names.kube_apiserver_tunnel;
        // Bound to this object: the TunnelCluster generated for it
        // requires the URI, so a later object of the same name refuses
        // this certificate.
        let uri = seedlink_config::tunnel::control_plane_uri(&self.uid());
        let kept = self
            .owned("v1", "Secret", "secrets", name)
            .await?
            .map(|e| generate::kube_apiserver_client_from(&e))
            .filter(|(c, issuer)| {
                *issuer == k.cert_pem
                    && certs::has_uri(&c.cert_pem, &uri)
                    && !rotation::due(c.not_after, now, v.leaf)
            })
            .map(|(c, _)| c);
        let client = match kept {
            Some(c) => c,
            None => {
                let id = certs::ClientId {
                    cn: &self.cluster(),
                    uri: Some(&uri),
                };
                let c = certs::kube_apiserver_client(&id, &k.cert_pem, &k.key_pem, now, v.leaf)?;
                tracing::info!(control_plane = %key(self.cp), not_after = %c.not_after, "onboarding: kube-apiserver's client certificate issued");
                c
            }
        };
        let renew = client
            .not_after
            .checked_sub(v.leaf / 3)
            .unwrap_or(Timestamp::MIN);
        *wake = (*wake).min(renew);
        let g = generate::kube_apiserver_tunnel_secret(
            self.cp,
            name,
            &client,
            &k.server_ca,
            &k.cert_pem,
        )?;
        Ok(Some((g, client.not_after)))
    }

    /// Whether the object's tunnel is on (the default).
    fn tunnel_on(&self) -> bool {
        self.cp.spec.tunnel.as_ref().is_none_or(|t| t.enabled)
    }

    /// The tunnel cluster's name (`<namespace>.<name>`, as the
    /// tunnel-server names it).
    fn cluster(&self) -> String {
        crate::tunnel::cluster_name(&crate::translate::Key {
            namespace: self.ns.to_string(),
            name: self.cp.name_any(),
        })
    }

    /// The Gateway's `allowedRoutes` label on the namespace, when
    /// configured: once per namespace and process.
    async fn label_namespace(&self) -> Result<(), Stop> {
        let Some(label) = &self.ctx.namespace_label else {
            return Ok(());
        };
        if seedlink_net::sync::lock(&self.ctx.labelled, "labelled namespaces").contains(self.ns) {
            return Ok(());
        }
        let nss: Api<Namespace> = Api::all(self.ctx.client.clone());
        let patch = json!({"metadata": {"labels": {label.as_str(): "true"}}});
        nss.patch(self.ns, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        seedlink_net::sync::lock(&self.ctx.labelled, "labelled namespaces")
            .insert(self.ns.to_string());
        Ok(())
    }

    /// kube-apiserver's ConfigMap and the shoot's Secret, when a renderer
    /// is configured and the tunnel is on.
    fn bundle(&self, agent: &Issued) -> Result<Vec<Generated>, Refusal> {
        let Some(render) = self.ctx.render.as_ref().filter(|_| self.tunnel_on()) else {
            return Ok(Vec::new());
        };
        let nodes = self.cp.spec.nodes.as_ref();
        let route = NodeRoute {
            destination: nodes.and_then(|n| n.destinations.first().cloned()),
            cluster_id: nodes.and_then(|n| n.cluster_id.clone()),
        };
        let bundle = render(&self.cluster(), &route).map_err(|e| Refusal {
            reason: "RenderFailed",
            message: format!("kube-apiserver's and the shoot's files: {e}"),
        })?;
        let mut out = generate::bundle_objects(self.cp, &bundle, agent)?;
        if let Some(image) = &self.ctx.agent_image {
            out.push(generate::shoot_manifests(self.cp, &bundle, agent, image)?);
        }
        Ok(out)
    }

    /// Creates `g`, or applies it over the version this control plane
    /// owns; refuses when another owner holds the name.
    async fn put(&self, g: &Generated) -> Result<(), Stop> {
        let api = self.api(&g.api_version, g.kind, g.plural);
        let obj: DynamicObject = serde_json::from_value(g.object.clone()).map_err(|e| Refusal {
            reason: "Invalid",
            message: format!("{}: {e}", g.id()),
        })?;
        if let Some(current) = self
            .owned(&g.api_version, g.kind, g.plural, &g.name)
            .await?
        {
            if current["roleRef"] == g.object["roleRef"] {
                let pp = PatchParams::apply(MANAGER).force();
                api.patch(&g.name, &pp, &Patch::Apply(&obj)).await?;
                return Ok(());
            }
            // A RoleBinding's roleRef cannot change: this one (owned) is
            // replaced, so the tunnel-server holds the old grant no longer.
            api.delete(&g.name, &Default::default()).await?;
        }
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Err(taken(g).into()),
            Err(e) => Err(e.into()),
        }
    }

    /// The object `name`, if there is one and this control plane owns it;
    /// refused when another owner holds the name.
    async fn owned(
        &self,
        api_version: &str,
        kind: &str,
        plural: &str,
        name: &str,
    ) -> Result<Option<Value>, Stop> {
        let Some(o) = self.api(api_version, kind, plural).get_opt(name).await? else {
            return Ok(None);
        };
        let v = serde_json::to_value(&o).unwrap_or_default();
        if !generate::owned_by(&v, &self.uid()) {
            return Err(taken_id(&format!("{kind}/{name}")).into());
        }
        Ok(Some(v))
    }

    /// The agent CA as it is to be now (made, kept, rotated, revoked),
    /// written when it changed, and the step taken (`None`: made).
    async fn ca(&self, names: &Names, now: Timestamp) -> Result<(CaState, Option<CaStep>), Stop> {
        let v = &self.ctx.validity;
        let (ns, name) = (self.ns.to_string(), self.cp.name_any());
        let asked = self
            .cp
            .spec
            .tunnel
            .as_ref()
            .map_or_else(Asked::default, |t| Asked {
                revision: t.revision,
                rotation: t.rotation,
            });
        let fresh = || certs::agent_ca(&ns, &name, now, v.ca);
        let (state, step) = match self
            .owned("v1", "Secret", "secrets", &names.agent_ca)
            .await?
        {
            None => {
                let state = CaState {
                    current: fresh()?,
                    previous: None,
                    revision: asked.revision,
                    rotation: asked.rotation,
                };
                (state, None)
            }
            Some(existing) => {
                let state = generate::ca_state_from(&existing);
                let step = rotation::ca_step(&state, asked, now, v);
                if step == CaStep::Keep {
                    return Ok((state, Some(step)));
                }
                let made = match step {
                    CaStep::Rotate | CaStep::Revoke => Some(fresh()?),
                    _ => None,
                };
                let next = rotation::after(state, step, made, asked, now, v);
                (next, Some(step))
            }
        };
        tracing::info!(control_plane = %key(self.cp), ?step, "onboarding: agent CA written");
        self.put(&generate::ca_secret(self.cp, &names.agent_ca, &state)?)
            .await?;
        Ok((state, step))
    }

    /// The agents' certificate: kept, or issued by the current CA when due
    /// (not in the pass that rotated the CA: its trust is written first).
    async fn leaf(
        &self,
        names: &Names,
        ca: &CaState,
        step: Option<CaStep>,
        now: Timestamp,
    ) -> Result<Issued, Stop> {
        let v = &self.ctx.validity;
        if let Some(existing) = self.owned("v1", "Secret", "secrets", &names.agent).await? {
            let (leaf, signed_by) = generate::leaf_from(&existing);
            let rotated_now = step == Some(CaStep::Rotate);
            if rotated_now || !rotation::leaf_due(&leaf, &signed_by, ca, now, v) {
                return Ok(leaf);
            }
        }
        let (ns, name) = (self.ns.to_string(), self.cp.name_any());
        let leaf = certs::agent_cert(&ns, &name, &ca.current.key_pem, now, v.leaf)?;
        tracing::info!(control_plane = %key(self.cp), not_after = %leaf.not_after, "onboarding: agent certificate issued");
        self.put(&generate::leaf_secret(
            self.cp,
            &names.agent,
            &leaf,
            &ca.current.cert_pem,
        )?)
        .await?;
        Ok(leaf)
    }

    /// Status from what the generated objects report.
    async fn observe(
        &self,
        generated: &[Generated],
        not_after: Timestamp,
    ) -> Result<ControlPlaneStatus, Error> {
        let gen = self.cp.meta().generation;
        let (mut conditions, agents) = self.reported(generated, gen).await?;
        let fresh = not_after > Timestamp::now();
        conditions.push(condition(
            "CertificatesReady",
            fresh,
            if fresh { "Valid" } else { "Expired" },
            &format!("the agent CA and the certificates it issued are valid until {not_after}"),
            gen,
        ));
        conditions.insert(0, ready(&conditions, gen));
        Ok(ControlPlaneStatus {
            conditions,
            agents,
            certificates_not_after: Some(not_after.to_string()),
            generated: generated.iter().map(Generated::id).collect(),
            observed_generation: gen,
        })
    }

    /// `Generated`, and what the route and the tunnel cluster say of
    /// themselves (their conditions, the agents connected).
    async fn reported(
        &self,
        generated: &[Generated],
        gen: Option<i64>,
    ) -> Result<(Vec<Condition>, u64), Error> {
        let mut conditions = vec![condition(
            "Generated",
            true,
            "Applied",
            "every object is written",
            gen,
        )];
        let mut agents = 0;
        for g in generated {
            let api = self.api(&g.api_version, g.kind, g.plural);
            let Some(obj) = api.get_opt(&g.name).await? else {
                continue;
            };
            let v = serde_json::to_value(&obj).unwrap_or_default();
            match g.kind {
                "TLSRoute" => conditions.push(route_condition(&v, &self.ctx.settings, gen)),
                "TunnelCluster" => {
                    agents = v["status"]["agents"].as_u64().unwrap_or(0);
                    let theirs = &v["status"]["conditions"];
                    conditions.push(mirrored(theirs, "Ready", "TunnelReady", gen));
                }
                _ => {}
            }
        }
        Ok((conditions, agents))
    }

    async fn write_status(&self, mut status: ControlPlaneStatus) -> Result<(), Error> {
        // A condition's time moves only when its status does.
        let old = self.cp.status.clone().unwrap_or_default();
        for c in &mut status.conditions {
            if let Some(o) = old.conditions.iter().find(|o| o.type_ == c.type_) {
                if o.status == c.status {
                    c.last_transition_time = o.last_transition_time.clone();
                }
            }
        }
        if old == status {
            return Ok(());
        }
        let api: Api<SeedlinkControlPlane> = Api::namespaced(self.ctx.client.clone(), self.ns);
        let patch = json!({"status": status});
        api.patch_status(
            &self.cp.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
        Ok(())
    }

    async fn event(&self, r: &Refusal) {
        let ev = Event {
            type_: EventType::Warning,
            reason: r.reason.to_string(),
            note: Some(r.message.clone()),
            action: "Onboard".into(),
            secondary: None,
        };
        if let Err(e) = self
            .ctx
            .recorder
            .publish(&ev, &self.cp.object_ref(&()))
            .await
        {
            tracing::debug!(error = %e, "onboarding: event");
        }
    }
}

fn taken(g: &Generated) -> Refusal {
    taken_id(&g.id())
}

/// `Kind/name` exists and another owner holds it.
fn taken_id(id: &str) -> Refusal {
    Refusal {
        reason: "NameTaken",
        message: format!("{id} exists and is not this SeedlinkControlPlane's: rename or remove it"),
    }
}

/// The status of a control plane nothing could be generated for.
fn refused(cp: &SeedlinkControlPlane, r: &Refusal) -> ControlPlaneStatus {
    let gen = cp.meta().generation;
    ControlPlaneStatus {
        conditions: vec![
            condition("Ready", false, r.reason, &r.message, gen),
            condition("Generated", false, r.reason, &r.message, gen),
        ],
        observed_generation: gen,
        ..cp.status.clone().unwrap_or_default()
    }
}

/// `Ready`: every other condition holds; else the first that does not,
/// by its reason.
fn ready(conditions: &[Condition], gen: Option<i64>) -> Condition {
    match conditions.iter().find(|c| c.status != "True") {
        Some(c) => condition(
            "Ready",
            false,
            &c.reason,
            &format!("{}: {}", c.type_, c.message),
            gen,
        ),
        None => condition("Ready", true, "Ready", "served", gen),
    }
}

fn condition(type_: &str, ok: bool, reason: &str, message: &str, gen: Option<i64>) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: gen,
        last_transition_time: Time(Timestamp::now()),
    }
}

/// The condition `type_` of `conditions` as this object's `as_type`;
/// `Unknown` until there is one.
fn mirrored(conditions: &Value, type_: &str, as_type: &str, gen: Option<i64>) -> Condition {
    let c = conditions
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_));
    match c {
        Some(c) => condition(
            as_type,
            c["status"] == "True",
            c["reason"].as_str().unwrap_or("Unknown"),
            c["message"].as_str().unwrap_or(""),
            gen,
        ),
        None => Condition {
            status: "Unknown".into(),
            ..condition(as_type, false, "Pending", "not reported yet", gen)
        },
    }
}

/// The TLSRoute's `Accepted` from the gateway's parent status.
fn route_condition(route: &Value, settings: &Settings, gen: Option<i64>) -> Condition {
    let parent = route["status"]["parents"].as_array().and_then(|ps| {
        ps.iter().find(|p| {
            p["parentRef"]["name"] == settings.gateway.name.as_str()
                && p["controllerName"] == crate::crd::CONTROLLER_NAME
        })
    });
    match parent {
        Some(p) => mirrored(&p["conditions"], "Accepted", "RouteAccepted", gen),
        None => Condition {
            status: "Unknown".into(),
            ..condition(
                "RouteAccepted",
                false,
                "Pending",
                "the gateway has not answered yet",
                gen,
            )
        },
    }
}

/// The reporter of the controller's Events.
pub fn reporter(instance: &str) -> Reporter {
    Reporter {
        controller: MANAGER.into(),
        instance: Some(instance.into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_next_pass_waits_until_due_between_a_second_and_the_resync() {
        let now: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let s = |n: i64| k8s_openapi::jiff::SignedDuration::from_secs(n);
        assert_eq!(until(now + s(10), now), Duration::from_secs(10));
        assert_eq!(until(now + s(3600), now), RESYNC);
        assert_eq!(until(now - s(3600), now), Duration::from_secs(1));
        assert_eq!(until(Timestamp::MIN, now), Duration::from_secs(1));
    }
}
