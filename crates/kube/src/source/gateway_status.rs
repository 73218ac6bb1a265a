//! Status of the Gateway API's own objects, written by the lease holder:
//! each Gateway's conditions, listeners and addresses, and GatewayClasses'
//! `Accepted` and `SupportedVersion`.

use std::fmt::Debug;
use std::time::Duration;

use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, Patch};
use kube::Resource;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::metrics::{back_off, Write};
use super::status::*;
use crate::crd::CONTROLLER_NAME;
use crate::translate::{Key, Translation, Verdict, GATEWAY_GROUP};

/// A Gateway's `Accepted` and `Programmed` (`programmed`: the gateway
/// applied the last translation).
pub(super) fn gateway_verdicts(
    g: &crate::translate::GatewayOutcome,
    programmed: bool,
) -> (Verdict, Verdict) {
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
pub(super) fn listener_status(
    attached: &crate::translate::AttachedCounts,
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
    let ours = vec![
        condition("Accepted", &l.accepted, generation, &prev),
        condition("Programmed", &programmed, generation, &prev),
        condition("ResolvedRefs", &l.resolved, generation, &prev),
        condition("Conflicted", &no_conflicts, generation, &prev),
    ];
    json!({
        "name": l.name,
        "attachedRoutes": attached.get(l.name.as_str()),
        "supportedKinds": kinds,
        "conditions": with_foreign(ours, &prev),
    })
}

/// `ours`, then every condition of `prev` of another type, as it was:
/// another controller's conditions on a Gateway or a listener stay
/// (Gateway API v1.7's GatewayPreserveForeignConditions).
pub(super) fn with_foreign(mut ours: Vec<Condition>, prev: &[Condition]) -> Vec<Condition> {
    let foreign: Vec<Condition> = prev
        .iter()
        .filter(|p| !ours.iter().any(|o| o.type_ == p.type_))
        .cloned()
        .collect();
    ours.extend(foreign);
    ours
}

/// A Service's LoadBalancer addresses as Gateway `status.addresses`
/// (none until a load balancer assigned one).
pub(super) fn addresses(s: &Service) -> Vec<serde_json::Value> {
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

/// A class's `Accepted` and `SupportedVersion` (of the installed Gateway
/// API `bundle`).
pub(super) fn class_conditions(
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
    pub(super) async fn write_gateway_class(&mut self, class: &GatewayClass, bundle: Option<&str>) {
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
    /// `attachedRoutes`. The lists are written whole, with the conditions
    /// of types seedlink does not write kept as they were (another
    /// controller's); unchanged status is not written again.
    pub(super) async fn write_gateway(
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
        let ours = vec![
            condition("Accepted", &accepted, generation, &prev),
            condition("Programmed", &programmed, generation, &prev),
        ];
        let conditions = with_foreign(ours, &prev);
        let attached = self.attached.entry(g.key.clone()).or_default();
        attached.count(t, &g.key);
        let listeners: Vec<serde_json::Value> = g
            .listeners
            .iter()
            .map(|l| listener_status(attached, l, &programmed, generation, &current))
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
    pub(super) async fn patch_route_status_as(
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
    pub(super) async fn patch_status<K>(&self, key: &Key, patch: &serde_json::Value) -> bool
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), &key.namespace);
        self.patch_status_in(api, key, &K::kind(&()), patch).await
    }

    /// [`StatusWriter::patch_status`] through `api` (`kind` names it in
    /// logs): not while the object backs off after a failed write, and
    /// within the shared budget of writes per second (waiting for it:
    /// nothing is dropped, a later pass writes what changed since).
    pub(super) async fn patch_status_in<K>(
        &self,
        api: Api<K>,
        key: &Key,
        kind: &str,
        patch: &serde_json::Value,
    ) -> bool
    where
        K: Clone + DeserializeOwned + Debug,
    {
        let object = (kind.to_string(), key.clone());
        if self.backing_off(&object) {
            return true;
        }
        let wait = seedlink_net::sync::lock(&self.budget, "status budget")
            .take(tokio::time::Instant::now());
        if !wait.is_zero() {
            self.metrics.budget_waited();
            tokio::time::sleep(wait).await;
        }
        let Some(left) = self.leadership.remaining() else {
            self.metrics.wrote(Write::NotLeader);
            return false;
        };
        let (params, patch) = (status_params(), Patch::Merge(patch));
        let patched = tokio::time::timeout(left, api.patch_status(&key.name, &params, &patch));
        let outcome = match patched.await {
            Ok(Ok(_)) => Write::Written,
            // The object itself is not found (the Status names it): a
            // 404 for a resource or subresource the API server does not
            // serve is a failure.
            Ok(Err(kube::Error::Api(s)))
                if s.code == 404 && s.details.as_ref().is_some_and(|d| d.name == key.name) =>
            {
                tracing::debug!(object = %key, %kind, "deleted before its status was written");
                Write::Gone
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                tracing::debug!(object = %key, %kind, "status changed meanwhile; written again on the next pass");
                Write::Conflict
            }
            Ok(Err(e)) => {
                tracing::warn!(object = %key, %kind, error = %e, "cannot write status; tried again after a back-off");
                Write::Failed
            }
            Err(_) => {
                tracing::debug!(object = %key, %kind, "no longer the status leader: status not written");
                Write::NotLeader
            }
        };
        self.metrics.wrote(outcome);
        self.after_write(object, outcome == Write::Failed);
        true
    }

    /// Whether `object`'s last write failed and its back-off has not
    /// ended.
    fn backing_off(&self, object: &(String, Key)) -> bool {
        let failing = seedlink_net::sync::lock(&self.failing, "status back-off");
        failing
            .get(object)
            .is_some_and(|(_, next)| *next > tokio::time::Instant::now())
    }

    /// Records a write's outcome: a failure backs the object off (longer
    /// each time in a row), a success ends its back-off.
    fn after_write(&self, object: (String, Key), failed: bool) {
        let mut failing = seedlink_net::sync::lock(&self.failing, "status back-off");
        let now = tokio::time::Instant::now();
        if failed {
            let n = failing.get(&object).map_or(1, |(n, _)| n.saturating_add(1));
            failing.insert(object, (n, now + back_off(n)));
            // An object deleted while failing is forgotten an hour after
            // its back-off ended.
            failing.retain(|_, (_, next)| *next + Duration::from_secs(3600) > now);
        } else {
            failing.remove(&object);
        }
        let waiting = failing.values().filter(|(_, next)| *next > now).count();
        self.metrics.set_backing_off(waiting);
    }
}

/// The Gateway API versions seedlink implements (bundle versions, as the
/// CRDs' `gateway.networking.k8s.io/bundle-version` annotation names them):
/// from v1.4 (TLSRoute v1alpha2/v1alpha3) to v1.7 (tested with v1.6.3's
/// CRDs and conformance suite, and with v1.7.0's CRDs).
pub(super) const SUPPORTED_BUNDLES: ((u32, u32), (u32, u32)) = ((1, 4), (1, 7));

/// The Gateway API features seedlink implements (conformance feature names,
/// sorted): TLS passthrough only.
pub(super) const SUPPORTED_FEATURES: [&str; 3] = ["Gateway", "ReferenceGrant", "TLSRoute"];

/// How often the installed Gateway API version is read again.
pub(super) const BUNDLE_REREAD: Duration = Duration::from_secs(300);

/// The installed Gateway API's bundle version (the GatewayClass CRD's
/// annotation), bounded; `None` when it cannot be read.
pub(super) async fn bundle_version(client: &kube::Client) -> Option<String> {
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
pub(super) fn supported_version(bundle: Option<&str>) -> (String, Verdict) {
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
            (Some("v1.7.0"), "True"),
            (Some("v1.8.0"), "False"),
            (Some("v2.0.0"), "False"),
            (Some("garbage"), "False"),
            (None, "Unknown"),
        ] {
            assert_eq!(supported_version(b).0, want, "{b:?}");
        }
    }
}

#[cfg(test)]
mod foreign_tests {
    use super::*;

    fn c(t: &str, status: &str) -> Condition {
        Condition {
            type_: t.into(),
            status: status.into(),
            reason: "R".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
        }
    }

    /// Our types replace theirs as read; another controller's stay.
    #[test]
    fn another_controllers_conditions_stay() {
        let prev = [c("Accepted", "False"), c("example.net/Audited", "True")];
        let out = with_foreign(vec![c("Accepted", "True")], &prev);
        let types: Vec<(&str, &str)> = out
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str()))
            .collect();
        assert_eq!(
            types,
            [("Accepted", "True"), ("example.net/Audited", "True")]
        );
    }
}

#[cfg(test)]
mod write_tests {
    use super::*;
    use crate::source::SourceMetrics;
    use seedlink_net::admin::Section;

    /// An API server that answers every request with `code`, naming the
    /// object `s` in its Status when `named`.
    fn answering(code: u16, named: bool) -> kube::Client {
        let svc = tower::service_fn(move |_req: http::Request<kube::client::Body>| async move {
            let details = named.then(|| json!({"name": "s", "kind": "services"}));
            let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "R", "code": code, "message": "m", "details": details});
            let body = serde_json::to_vec(&status).unwrap_or_default();
            http::Response::builder()
                .status(code)
                .body(kube::client::Body::from(body))
        });
        kube::Client::new(svc, "default")
    }

    fn writer(code: u16, named: bool) -> StatusWriter {
        StatusWriter::new(
            answering(code, named),
            crate::leader::Leadership::always(),
            "test",
            &SourceMetrics::new("gateway"),
        )
    }

    fn count(w: &StatusWriter, outcome: &str) -> bool {
        let text = seedlink_net::admin::encode_all(&[w.metrics.registry()]);
        text.contains(&format!(
            "seedlink_kubernetes_status_writes_total{{source=\"gateway\",outcome=\"{outcome}\"}} 1"
        ))
    }

    /// A status write to an object deleted meanwhile (404 naming it) is
    /// `gone`: no failure (which the install's alert counts) and no
    /// back-off; a 404 that names no object (a resource or subresource not
    /// served) and a 500 are failures, and the object then backs off.
    #[tokio::test]
    async fn a_deleted_object_is_gone_and_a_refusal_backs_off() {
        let key = Key {
            namespace: "tenant".into(),
            name: "s".into(),
        };
        let patch = json!({"status": {}});
        let gone = writer(404, true);
        assert!(
            gone.patch_status::<k8s_openapi::api::core::v1::Service>(&key, &patch)
                .await
        );
        assert!(count(&gone, "gone") && !count(&gone, "failed"));
        assert!(!gone.backing_off(&("Service".to_string(), key.clone())));
        for refused in [writer(500, false), writer(404, false)] {
            assert!(
                refused
                    .patch_status::<k8s_openapi::api::core::v1::Service>(&key, &patch)
                    .await
            );
            assert!(count(&refused, "failed"));
            assert!(refused.backing_off(&("Service".to_string(), key.clone())));
        }
    }
}
