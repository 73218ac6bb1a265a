//! Status written back by the lease holder: routes, policies and
//! TunnelClusters, an Event per rejection, and the patch helpers the
//! Gateway API objects' status (gateway_status.rs) uses too.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use gateway_api::tlsroutes::{TlsRoute, TlsRouteParentRefs};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::PatchParams;
use kube::runtime::events::{Event as RuntimeEvent, EventType, Recorder, Reporter};
use kube::Resource;
use serde_json::json;

use super::metrics::{Budget, SourceMetrics};
pub(super) use super::released::{held_claims, reserved, Hold};
use super::settled::{names, FastMap, Settled, SettledMap};
use super::sink::TunnelSink;
use crate::crd::{SeedlinkPolicy, CONTROLLER_NAME};
use crate::leader::Leadership;
use crate::translate::{Key, RouteOutcome, Translation, Verdict, GATEWAY_GROUP};

/// Status patches in flight at once: one after another, a round trip
/// each (measured about 16 per second at 1,000 TunnelClusters), they
/// stayed below the budget of [`crate::source::WRITES_PER_SEC`]; a few at
/// once let the budget set the pace.
pub(super) const WRITES_AT_ONCE: usize = 8;

/// Writes route and policy status (only while holding the lease) and an
/// Event per rejection (once per object generation and message).
pub(super) struct StatusWriter {
    pub(super) client: kube::Client,
    pub(super) leadership: Leadership,
    pub(super) evented: HashSet<(Key, Option<i64>, String)>,
    /// events.k8s.io/v1 Events as the API server wants them
    /// (`reportingController`, `reportingInstance` = the pod, repeats
    /// counted in a series).
    pub(super) recorder: Recorder,
    /// The TLSRoute version read when it is not v1 (status is written
    /// through the same one).
    pub(super) route_resource: Option<kube::api::ApiResource>,
    pub(super) metrics: SourceMetrics,
    /// The writes per second all objects share.
    pub(super) budget: std::sync::Mutex<Budget>,
    /// Objects whose last write failed: how many times in a row, and
    /// when the next may be tried.
    pub(super) failing: std::sync::Mutex<HashMap<(String, Key), (u32, tokio::time::Instant)>>,
    /// Routes whose status was found as wanted, with what it was found
    /// from: while none of it changes, a pass does not look again.
    pub(super) settled: SettledMap<Settled>,
    /// Policies likewise: their `resourceVersion` and outcome.
    pub(super) settled_policies: SettledMap<(String, Arc<crate::translate::PolicyOutcome>)>,
    /// The routes and their outcomes last walked with every status right.
    pub(super) routes_walked: Option<super::settled::Walked<TlsRoute, RouteOutcome>>,
    /// The policies likewise.
    pub(super) policies_walked:
        Option<super::settled::Walked<SeedlinkPolicy, crate::translate::PolicyOutcome>>,
    /// Each served Gateway's `attachedRoutes`, kept from pass to pass.
    pub(super) attached: HashMap<Key, crate::translate::AttachedCounts>,
    /// Each control plane's legacy paths in use, as the gateway last told
    /// them (a condition on its route's status).
    pub(super) legacy: Arc<super::sink::LegacyPaths>,
}

/// The condition a route's status names its control plane's legacy paths
/// in use with (the gateway's `legacy` listeners, `migration.window`).
pub const LEGACY_CONDITION: &str = "seedlink.dev/LegacyPathsInUse";

/// The legacy paths control plane `key` (`<namespace>.<name>`) used, if
/// the gateway has legacy listeners.
fn legacy_of<'a>(legacy: &'a super::sink::LegacyPaths, key: &Key) -> Option<&'a [String]> {
    let all = legacy.as_ref()?;
    let name = format!("{}.{}", key.namespace, key.name);
    Some(all.get(&name).map_or(&[][..], Vec::as_slice))
}

/// Events remembered (object, generation, message) so that one is not
/// repeated on every pass; forgotten past this many.
pub(super) const MAX_EVENTED: usize = 10_000;

/// The longest Event note the API server takes.
pub(super) const MAX_NOTE: usize = 1024;

pub(super) fn condition(
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
pub(super) fn route_parents(
    route: &TlsRoute,
    key: &Key,
    outcome: Option<&RouteOutcome>,
    served: &[Key],
    legacy: Option<&[String]>,
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
        desired.push(parent_status(o, parent, &ours, legacy));
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
pub(super) fn parent_status(
    o: &RouteOutcome,
    parent: &crate::translate::ParentOutcome,
    ours: &[gateway_api::tlsroutes::TlsRouteStatusParents],
    legacy: Option<&[String]>,
) -> gateway_api::tlsroutes::TlsRouteStatusParents {
    let p = &parent.parent_ref;
    let prev = ours
        .iter()
        .find(|x| parent_eq(&x.parent_ref, p))
        .map(|x| x.conditions.clone())
        .unwrap_or_default();
    let mut conditions = vec![
        condition("Accepted", &parent.accepted, o.generation, &prev),
        condition("ResolvedRefs", &o.resolved, o.generation, &prev),
    ];
    if let Some(paths) = legacy {
        let v = match paths {
            [] => Verdict::no(
                "NoneInUse",
                "no legacy path used within the migration window",
            ),
            paths => Verdict::yes(
                "InUse",
                format!("used within the migration window: {}", paths.join(", ")),
            ),
        };
        conditions.push(condition(LEGACY_CONDITION, &v, o.generation, &prev));
    }
    gateway_api::tlsroutes::TlsRouteStatusParents {
        conditions,
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
pub(super) fn policy_ancestors(
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
pub(super) fn previous_conditions(at: &serde_json::Value) -> Vec<Condition> {
    at.get("conditions")
        .and_then(|c| serde_json::from_value(c.clone()).ok())
        .unwrap_or_default()
}

/// A TunnelCluster's status as it should be: `Ready`, `AgentsConnected`
/// from the replica's `health`, the agent count, when agents last came or
/// went, dial errors (`current`: the status as read).
pub(super) fn tunnel_status(
    outcome: &crate::tunnel::TunnelOutcome,
    health: Option<&seedlink_config::tunnel::ClusterHealth>,
    trust: Vec<String>,
    current: &crate::crd::TunnelClusterStatus,
    hold: Hold,
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
        ..held_claims(outcome.cluster.is_some(), trust, current, hold)
    }
}

/// `AgentsConnected`: the agent streams the replica writing status has.
pub(super) fn agents_connected(served: bool, agents: usize) -> Verdict {
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
pub(super) type StatusFields<'a> = (
    u64,
    &'a Option<String>,
    &'a std::collections::BTreeMap<String, u64>,
    Option<i64>,
    &'a [String],
    &'a [crate::crd::ReleasedClaim],
);

/// A TunnelCluster status's fields besides its conditions.
pub(super) fn status_fields(s: &crate::crd::TunnelClusterStatus) -> StatusFields<'_> {
    (
        s.agents,
        &s.last_agent_seen,
        &s.dial_errors,
        s.observed_generation,
        &s.trust,
        &s.released,
    )
}

/// `v` without any `lastTransitionTime` (what a comparison of desired and
/// current status ignores).
pub(super) fn untimed(v: &mut serde_json::Value) -> &serde_json::Value {
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
pub(super) fn same(a: &[Condition], b: &[Condition]) -> bool {
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
    pub(super) fn new(
        client: kube::Client,
        leadership: Leadership,
        identity: &str,
        metrics: &SourceMetrics,
    ) -> StatusWriter {
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
            metrics: metrics.clone(),
            budget: std::sync::Mutex::default(),
            failing: std::sync::Mutex::default(),
            settled: SettledMap::default(),
            settled_policies: SettledMap::default(),
            routes_walked: None,
            policies_walked: None,
            attached: HashMap::new(),
            legacy: Arc::new(None),
        }
    }

    pub(super) async fn write(
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
    /// once this replica is no longer the leader (the rest is left to the
    /// next one). A failed write backs that object off and the walk goes
    /// on.
    pub(super) async fn write_routes(
        &mut self,
        t: &Translation,
        routes: &[Arc<TlsRoute>],
        served: &[Key],
    ) -> bool {
        let served_print = {
            use std::hash::{BuildHasher, BuildHasherDefault};
            let legacy = self.legacy.as_ref().as_ref();
            BuildHasherDefault::<std::hash::DefaultHasher>::default().hash_one((served, legacy))
        };
        let walked = self.routes_walked.take();
        if walked
            .as_ref()
            .is_some_and(|w| w.holds(routes, &t.routes, served_print))
        {
            self.routes_walked = walked;
            return true;
        }
        let outcomes: FastMap<(&str, &str), &Arc<RouteOutcome>> = t
            .routes
            .iter()
            .map(|r| ((r.key.namespace.as_str(), r.key.name.as_str()), r))
            .collect();
        let mut right = true;
        self.settled.begin();
        for route in routes {
            let (ns, name) = names(route.as_ref());
            let outcome = outcomes.get(&(ns, name)).copied();
            let version = &route.metadata.resource_version;
            if self
                .settled
                .still(ns, name, |was| was.holds(version, outcome, served_print))
            {
                continue;
            }
            let key = Key::of(route.as_ref());
            if let Some(o) = outcome.filter(|o| !o.accepted.ok) {
                right = false;
                self.event(route.as_ref(), "TLSRoute", o.generation, &o.accepted)
                    .await;
            }
            let outcome = outcome.cloned();
            let legacy = legacy_of(&self.legacy, &key);
            let Some(desired) = route_parents(route, &key, outcome.as_deref(), served, legacy)
            else {
                // Found as wanted. A refused route is looked at again on
                // every pass (its Event is retried until it is sent).
                if outcome.as_ref().is_none_or(|o| o.accepted.ok) {
                    let version = version.clone();
                    let was = Settled {
                        version,
                        outcome,
                        served: served_print,
                    };
                    self.settled.settle(ns, name, was);
                }
                continue;
            };
            right = false;
            if !self.write_route(route, &key, desired).await {
                return false;
            }
        }
        // The routes gone are forgotten.
        self.settled.end();
        if right {
            let walked = super::settled::Walked::new(routes, &t.routes, served_print);
            self.routes_walked = Some(walked);
        }
        true
    }

    /// Writes route `key`'s `status.parents`; false once this replica is
    /// no longer the leader.
    async fn write_route(
        &self,
        route: &TlsRoute,
        key: &Key,
        desired: Vec<gateway_api::tlsroutes::TlsRouteStatusParents>,
    ) -> bool {
        // `status.parents` is one atomic list shared with other
        // controllers: the patch carries their entries as read, so it is
        // made conditional on the version they were read from. A 409
        // means someone wrote meanwhile: the watch brings the new version
        // and the next pass writes again from it.
        let patch = json!({
            "metadata": {"resourceVersion": route.metadata.resource_version},
            "status": {"parents": desired}
        });
        match &self.route_resource {
            None => self.patch_status::<TlsRoute>(key, &patch).await,
            Some(ar) => self.patch_route_status_as(ar, key, &patch).await,
        }
    }

    /// Writes each SeedlinkPolicy's `status.ancestors` where it changed.
    pub(super) async fn write_policies(
        &mut self,
        t: &Translation,
        policies: &[Arc<SeedlinkPolicy>],
    ) {
        let walked = self.policies_walked.take();
        if walked
            .as_ref()
            .is_some_and(|w| w.holds(policies, &t.policies, 0))
        {
            self.policies_walked = walked;
            return;
        }
        let by_policy: FastMap<(&str, &str), _> = t
            .policies
            .iter()
            .map(|p| ((p.key.namespace.as_str(), p.key.name.as_str()), p))
            .collect();
        let mut right = true;
        self.settled_policies.begin();
        for policy in policies {
            let (ns, name) = names(policy.as_ref());
            let Some(o) = by_policy.get(&(ns, name)).copied() else {
                continue;
            };
            let version = policy.metadata.resource_version.as_deref();
            if self.settled_policies.still(ns, name, |(v, w)| {
                Some(v.as_str()) == version && Arc::ptr_eq(w, o)
            }) {
                continue;
            }
            let key = Key::of(policy.as_ref());
            right &= o.targets.iter().all(|(_, v)| v.ok);
            for (_, v) in o.targets.iter().filter(|(_, v)| !v.ok) {
                self.event(policy.as_ref(), "SeedlinkPolicy", o.generation, v)
                    .await;
            }
            let Some(desired) = policy_ancestors(policy, &key, o) else {
                // Found as wanted. One with a refused target is looked at
                // again on every pass (its Event is retried until sent).
                if let Some(v) = version.filter(|_| o.targets.iter().all(|(_, v)| v.ok)) {
                    let was = (v.to_string(), o.clone());
                    self.settled_policies.settle(ns, name, was);
                }
                continue;
            };
            right = false;
            let patch = json!({
                "metadata": {"resourceVersion": policy.metadata.resource_version},
                "status": {"ancestors": desired}
            });
            if !self.patch_status::<SeedlinkPolicy>(&key, &patch).await {
                return;
            }
        }
        // The policies gone are forgotten.
        self.settled_policies.end();
        if right {
            let walked = super::settled::Walked::new(policies, &t.policies, 0);
            self.policies_walked = Some(walked);
        }
    }

    /// Writes each TunnelCluster's status: `Ready`, `AgentsConnected`, the
    /// agent count, when agents last came or went, dial errors. Warning
    /// Events go first, then the patches of those that changed, up to
    /// [`WRITES_AT_ONCE`] at a time within the shared budget.
    pub(super) async fn write_tunnels(
        &mut self,
        t: &crate::tunnel::TunnelTranslation,
        objects: &[Arc<crate::crd::TunnelCluster>],
        sink: &dyn TunnelSink,
        released_hold: k8s_openapi::jiff::SignedDuration,
    ) {
        if !self.leadership.held() {
            return;
        }
        let outcomes: HashMap<&Key, _> = t.outcomes.iter().map(|o| (&o.key, o)).collect();
        let (mut healths, mut trusts) = (sink.health(), sink.trust());
        let mut patches = Vec::new();
        for o in objects {
            let key = Key::of(o.as_ref());
            let Some(outcome) = outcomes.get(&key) else {
                continue;
            };
            let current = o.status.clone().unwrap_or_default();
            let health = outcome.cluster.as_deref().and_then(|c| healths.remove(c));
            let trust = outcome
                .cluster
                .as_deref()
                .and_then(|c| trusts.remove(c))
                .unwrap_or_default();
            let hold = Hold {
                now: Timestamp::now(),
                hold: released_hold,
            };
            let desired = tunnel_status(outcome, health.as_ref(), trust, &current, hold);
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
            patches.push((key, tunnel_patch(o, &desired, &current)));
        }
        // Several at once, so that the shared budget (not one round trip
        // after another) sets the pace; stops once this replica is no
        // longer the leader.
        use futures_util::StreamExt;
        let this = &*self;
        futures_util::stream::iter(patches)
            .map(move |(key, patch)| async move {
                this.patch_status::<crate::crd::TunnelCluster>(&key, &patch)
                    .await
            })
            .buffer_unordered(WRITES_AT_ONCE)
            .all(|leader| async move { leader })
            .await;
    }

    /// A Warning Event on `object`, once per generation and message.
    pub(super) async fn event<K: Resource<DynamicType = ()>>(
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
pub(super) fn tunnel_patch(
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
    // An empty list is not written, and a merge patch keeps what it
    // does not name.
    if desired.released.is_empty() && !current.released.is_empty() {
        patch["status"]["released"] = json!([]);
    }
    patch
}

/// An Event's note: the message, cut at a character boundary to
/// [`MAX_NOTE`] bytes with `...` when longer.
pub(super) fn note(message: &str) -> String {
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

/// A status entry's parentRef as a route's parentRef (to ask whether it
/// names our Gateway).
pub(super) fn status_parent_ref(
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
pub(super) fn status_params() -> PatchParams {
    PatchParams {
        field_manager: Some("seedlink".into()),
        ..PatchParams::default()
    }
}

pub(super) fn parent_eq(
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

#[cfg(test)]
mod settled_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::source::SourceMetrics;
    use crate::translate::{ParentOutcome, Verdict};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An API server that counts requests and answers each with `object`.
    pub(super) fn counting(object: &impl serde::Serialize) -> (kube::Client, Arc<AtomicUsize>) {
        let body = serde_json::to_vec(object).unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        let seen = n.clone();
        let svc = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
            seen.fetch_add(1, Ordering::Relaxed);
            let body = body.clone();
            async move {
                http::Response::builder()
                    .status(200)
                    .body(kube::client::Body::from(body))
            }
        });
        (kube::Client::new(svc, "default"), n)
    }

    fn route(version: &str, parents: Option<serde_json::Value>) -> Arc<TlsRoute> {
        let mut r = serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "TLSRoute",
            "metadata": {"name": "r", "namespace": "t", "resourceVersion": version, "generation": 1},
            "spec": {"hostnames": ["r.example.com"], "parentRefs": [{"name": "gw", "namespace": "gw"}], "rules": []}
        });
        if let Some(p) = parents {
            r["status"] = serde_json::json!({ "parents": p });
        }
        Arc::new(serde_json::from_value(r).unwrap())
    }

    fn outcome(r: &TlsRoute, ok: bool) -> Arc<RouteOutcome> {
        let verdict = match ok {
            true => Verdict::yes("Accepted", ""),
            false => Verdict::no("NotAllowedByListeners", "no"),
        };
        let gateway = Key {
            namespace: "gw".into(),
            name: "gw".into(),
        };
        Arc::new(RouteOutcome {
            key: Key::of(r),
            generation: Some(1),
            parents: vec![ParentOutcome {
                parent_ref: r.spec.parent_refs.clone().unwrap_or_default()[0].clone(),
                gateway,
                accepted: verdict.clone(),
                listeners: vec!["tls".into()],
            }],
            accepted: verdict,
            resolved: Verdict::yes("ResolvedRefs", ""),
            control_plane: ok.then(|| "t-r".into()),
        })
    }

    /// A route whose status was found right is not looked at again while
    /// it, its outcome and the Gateways served stay; a new outcome or a
    /// new version of the route is written at once.
    #[tokio::test]
    async fn a_settled_route_is_written_again_when_its_outcome_or_version_changes() {
        let served = [Key {
            namespace: "gw".into(),
            name: "gw".into(),
        }];
        let bare = route("1", None);
        let accepted = outcome(&bare, true);
        let (client, requests) = counting(bare.as_ref());
        let metrics = SourceMetrics::new("gateway");
        let mut w = StatusWriter::new(client, Leadership::always(), "test", &metrics);
        let t = |o: &Arc<RouteOutcome>| Translation {
            routes: vec![o.clone()],
            ..Translation::default()
        };
        assert!(
            w.write_routes(&t(&accepted), std::slice::from_ref(&bare), &served)
                .await
        );
        assert_eq!(requests.load(Ordering::Relaxed), 1, "written");
        // The API server's next version carries what was written.
        let ours = route_parents(
            &bare,
            &Key::of(bare.as_ref()),
            Some(&accepted),
            &served,
            None,
        )
        .unwrap();
        let written = route("2", Some(serde_json::to_value(ours).unwrap()));
        for _ in 0..3 {
            assert!(
                w.write_routes(&t(&accepted), std::slice::from_ref(&written), &served)
                    .await
            );
        }
        assert_eq!(
            requests.load(Ordering::Relaxed),
            1,
            "found right: not written"
        );
        assert_eq!(w.settled.len(), 1);
        // Refused now: a new outcome, written though the route is the same.
        let refused = outcome(&written, false);
        assert!(
            w.write_routes(&t(&refused), std::slice::from_ref(&written), &served)
                .await
        );
        let after_refusal = requests.load(Ordering::Relaxed);
        assert!(after_refusal >= 2, "written: {after_refusal} requests");
        // Back to the first outcome, settled again; then someone else
        // empties the status (a new version): written again.
        assert!(
            w.write_routes(&t(&accepted), std::slice::from_ref(&written), &served)
                .await
        );
        let settled = requests.load(Ordering::Relaxed);
        assert!(
            w.write_routes(&t(&accepted), &[route("3", None)], &served)
                .await
        );
        assert_eq!(
            requests.load(Ordering::Relaxed),
            settled + 1,
            "written again"
        );
        // A route gone is forgotten.
        assert!(w.write_routes(&t(&accepted), &[], &served).await);
        assert_eq!(w.settled.len(), 0);
    }

    /// A walk that found every route's status right is skipped while the
    /// same routes and outcomes come (the same `Arc`s): an equal route or
    /// outcome in a new `Arc` is walked again, and a walk that met a
    /// refused route is never skipped.
    #[tokio::test]
    async fn a_walk_that_found_everything_right_is_skipped_until_something_is_new() {
        let served = [Key {
            namespace: "gw".into(),
            name: "gw".into(),
        }];
        let bare = route("1", None);
        let accepted = outcome(&bare, true);
        let ours = route_parents(
            &bare,
            &Key::of(bare.as_ref()),
            Some(&accepted),
            &served,
            None,
        )
        .unwrap();
        let written = route("2", Some(serde_json::to_value(ours).unwrap()));
        let (client, requests) = counting(bare.as_ref());
        let metrics = SourceMetrics::new("gateway");
        let mut w = StatusWriter::new(client, Leadership::always(), "test", &metrics);
        let t = |o: &Arc<RouteOutcome>| Translation {
            routes: vec![o.clone()],
            ..Translation::default()
        };
        let routes = [written.clone()];
        assert!(w.write_routes(&t(&accepted), &routes, &served).await);
        assert!(w.routes_walked.is_some(), "every status right: remembered");
        // What was settled is forgotten behind the walk's back: a skipped
        // walk does not look.
        w.settled = SettledMap::default();
        assert!(w.write_routes(&t(&accepted), &routes, &served).await);
        assert_eq!(w.settled.len(), 0, "skipped");
        let copy = [Arc::new(written.as_ref().clone())];
        assert!(w.write_routes(&t(&accepted), &copy, &served).await);
        assert_eq!(w.settled.len(), 1, "a new route Arc: walked");
        w.settled = SettledMap::default();
        let again = Arc::new(accepted.as_ref().clone());
        assert!(w.write_routes(&t(&again), &copy, &served).await);
        assert_eq!(w.settled.len(), 1, "a new outcome Arc: walked");
        assert_eq!(requests.load(Ordering::Relaxed), 0, "nothing written");
        let refused = outcome(&written, false);
        assert!(w.write_routes(&t(&refused), &copy, &served).await);
        assert!(w.routes_walked.is_none(), "a refused route: never skipped");
    }
}

#[cfg(test)]
mod settled_policy_tests {
    #![allow(clippy::unwrap_used)]
    use super::settled_tests::counting;
    use super::*;
    use crate::source::SourceMetrics;
    use crate::translate::{PolicyOutcome, Verdict};
    use std::sync::atomic::Ordering;

    fn policy(version: &str, ancestors: Option<serde_json::Value>) -> Arc<SeedlinkPolicy> {
        let mut p = serde_json::json!({
            "apiVersion": "policy.seedlink.dev/v1alpha1", "kind": "SeedlinkPolicy",
            "metadata": {"name": "p", "namespace": "t", "resourceVersion": version, "generation": 1},
            "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "name": "r"}]}
        });
        if let Some(a) = ancestors {
            p["status"] = serde_json::json!({ "ancestors": a });
        }
        Arc::new(serde_json::from_value(p).unwrap())
    }

    /// A policy found right is not looked at again while its version and
    /// outcome stay; either changing makes the pass look (and write).

    #[tokio::test]
    async fn a_settled_policy_is_written_again_when_its_outcome_or_version_changes() {
        let bare = policy("1", None);
        let outcome = |ok: bool| {
            let verdict = match ok {
                true => Verdict::yes("Accepted", ""),
                false => Verdict::no("TargetNotFound", "no"),
            };
            Arc::new(PolicyOutcome {
                key: Key::of(bare.as_ref()),
                generation: Some(1),
                targets: vec![("r".into(), verdict)],
                foreign: Vec::new(),
            })
        };
        let accepted = outcome(true);
        let (client, requests) = counting(bare.as_ref());
        let metrics = SourceMetrics::new("gateway");
        let mut w = StatusWriter::new(client, Leadership::always(), "test", &metrics);
        let t = |o: &Arc<PolicyOutcome>| Translation {
            policies: vec![o.clone()],
            ..Translation::default()
        };
        w.write_policies(&t(&accepted), std::slice::from_ref(&bare))
            .await;
        assert_eq!(requests.load(Ordering::Relaxed), 1, "written");
        let ours = policy_ancestors(&bare, &Key::of(bare.as_ref()), &accepted).unwrap();
        let written = policy("2", Some(serde_json::to_value(ours).unwrap()));
        for _ in 0..3 {
            w.write_policies(&t(&accepted), std::slice::from_ref(&written))
                .await;
        }
        assert_eq!(requests.load(Ordering::Relaxed), 1, "found right");
        assert_eq!(w.settled_policies.len(), 1);
        // Refused now: written, and never settled.
        w.write_policies(&t(&outcome(false)), std::slice::from_ref(&written))
            .await;
        let refused = requests.load(Ordering::Relaxed);
        assert!(refused >= 2, "written: {refused} requests");
        assert_eq!(w.settled_policies.len(), 0);
        // Someone else empties the status (a new version): written again.
        w.write_policies(&t(&accepted), std::slice::from_ref(&written))
            .await;
        let settled = requests.load(Ordering::Relaxed);
        w.write_policies(&t(&accepted), &[policy("3", None)]).await;
        assert_eq!(requests.load(Ordering::Relaxed), settled + 1);
        // A policy gone is forgotten.
        w.write_policies(&t(&accepted), &[]).await;
        assert_eq!(w.settled_policies.len(), 0);
    }
}
