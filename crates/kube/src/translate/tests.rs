use std::net::IpAddr;
use std::sync::Arc;

use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::TlsRoute;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::*;
use crate::crd::SeedlinkPolicy;
use serde_json::json;

fn route(
    ns: &str,
    name: &str,
    created: &str,
    hosts: &[&str],
    backend: &str,
    port: i32,
) -> Arc<TlsRoute> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "TLSRoute",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": created, "generation": 3},
            "spec": {
                "parentRefs": [{"name": "seedlink", "namespace": "seedlink-system"}],
                "hostnames": hosts,
                "rules": [{"backendRefs": [{"name": backend, "port": port}]}]
            }
        }))
        .unwrap(),
    )
}

fn service(ns: &str, name: &str, port: i32, port_name: &str) -> Arc<Service> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"app": name},
                     "ports": [{"name": port_name, "port": port, "targetPort": 6443}]}
        }))
        .unwrap(),
    )
}

fn slice(ns: &str, svc: &str, port_name: &str, eps: &[(&str, Option<bool>)]) -> Arc<EndpointSlice> {
    let endpoints: Vec<_> = eps
        .iter()
        .map(|(a, ready)| match ready {
            Some(r) => json!({"addresses": [a], "conditions": {"ready": r}}),
            None => json!({"addresses": [a]}),
        })
        .collect();
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{svc}-abc"), "namespace": ns,
                         "labels": {"kubernetes.io/service-name": svc,
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "ports": [{"name": port_name, "port": 6443}],
            "endpoints": endpoints
        }))
        .unwrap(),
    )
}

fn policy(ns: &str, name: &str, created: &str, route: &str, cidrs: &[&str]) -> Arc<SeedlinkPolicy> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "policy.seedlink.dev/v1alpha1", "kind": "SeedlinkPolicy",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": created, "generation": 1},
            "spec": {
                "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "name": route}],
                "allowedSourceCIDRs": cidrs
            }
        }))
        .unwrap(),
    )
}

fn gw() -> Key {
    Key {
        namespace: "seedlink-system".into(),
        name: "seedlink".into(),
    }
}

/// The seedlink Gateway object with one TLS listener `tls` admitting
/// routes by `allowed` (its `allowedRoutes`).
fn gateway(allowed: serde_json::Value) -> Option<Gateway> {
    Some(
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "seedlink", "namespace": "seedlink-system"},
            "spec": {
                "gatewayClassName": "seedlink",
                "listeners": [{"name": "tls", "port": 443, "protocol": "TLS",
                               "tls": {"mode": "Passthrough"}, "allowedRoutes": allowed}]
            }
        }))
        .unwrap(),
    )
}

fn all_namespaces() -> Option<Gateway> {
    gateway(json!({"namespaces": {"from": "All"}}))
}

fn namespace(name: &str, labels: serde_json::Value) -> Arc<Namespace> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels}
        }))
        .unwrap(),
    )
}

fn grant(ns: &str, from_ns: &str, service: Option<&str>) -> Arc<ReferenceGrant> {
    let mut to = json!({"group": "", "kind": "Service"});
    if let Some(s) = service {
        to["name"] = json!(s);
    }
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "ReferenceGrant",
            "metadata": {"name": "g", "namespace": ns},
            "spec": {
                "from": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "namespace": from_ns}],
                "to": [to]
            }
        }))
        .unwrap(),
    )
}

struct World {
    routes: Vec<Arc<TlsRoute>>,
    policies: Vec<Arc<SeedlinkPolicy>>,
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
    gateway: Option<Gateway>,
    namespaces: Vec<Arc<Namespace>>,
    grants: Vec<Arc<ReferenceGrant>>,
}

impl World {
    fn translate(&self, t: &mut Translator) -> Translation {
        self.translate_touched(t, None)
    }

    /// [`World::translate`], told which namespaces changed.
    fn translate_touched(
        &self,
        t: &mut Translator,
        touched: Option<&HashSet<String>>,
    ) -> Translation {
        let gw = gw();
        let listeners = vec!["tls".to_string()];
        let gateways: Vec<Arc<Gateway>> = self.gateway.iter().cloned().map(Arc::new).collect();
        t.translate_touched(
            &Objects {
                gateway: Some(&gw),
                class: None,
                gateways: &gateways,
                classes: &[],
                listeners: &listeners,
                routes: &self.routes,
                policies: &self.policies,
                services: &self.services,
                slices: &self.slices,
                namespaces: &self.namespaces,
                grants: &self.grants,
            },
            touched,
        )
    }
}

fn one_shoot() -> World {
    World {
        routes: vec![route(
            "shoot--a",
            "api",
            "2026-01-01T00:00:00Z",
            &["api.a.example"],
            "kube-apiserver",
            443,
        )],
        policies: vec![],
        services: vec![service("shoot--a", "kube-apiserver", 443, "https")],
        slices: vec![slice(
            "shoot--a",
            "kube-apiserver",
            "https",
            &[
                ("10.0.0.1", Some(true)),
                ("10.0.0.2", Some(false)),
                ("10.0.0.3", None),
            ],
        )],
        gateway: all_namespaces(),
        namespaces: vec![],
        grants: vec![],
    }
}

#[test]
fn a_route_becomes_a_control_plane_with_its_ready_pod_addresses() {
    let t = one_shoot().translate(&mut Translator::default());
    assert_eq!(t.control_planes.len(), 1);
    let cp = &t.control_planes[0];
    assert_eq!(cp.name, "shoot--a.api");
    assert_eq!(cp.hostnames, vec!["api.a.example"]);
    // The terminating (ready=false) pod gets nothing; unknown counts as ready.
    assert_eq!(cp.endpoints, vec!["10.0.0.1:6443", "10.0.0.3:6443"]);
    assert!(t.routes[0].accepted.ok && t.routes[0].resolved.ok);
}

#[test]
fn a_missing_service_or_port_is_backend_not_found_and_the_route_has_no_endpoints() {
    let mut w = one_shoot();
    w.services.clear();
    let t = w.translate(&mut Translator::default());
    assert_eq!(t.routes[0].resolved.reason, "BackendNotFound");
    assert!(t.control_planes[0].endpoints.is_empty());
    let mut w = one_shoot();
    w.routes = vec![route(
        "shoot--a",
        "api",
        "2026-01-01T00:00:00Z",
        &["api.a.example"],
        "kube-apiserver",
        8443,
    )];
    let t = w.translate(&mut Translator::default());
    assert_eq!(t.routes[0].resolved.reason, "BackendNotFound");
    assert!(
        t.routes[0].resolved.message.contains("no port 8443"),
        "{:?}",
        t.routes[0].resolved
    );
}

#[test]
fn routes_of_other_gateways_are_ignored_and_an_unknown_listener_is_not_accepted() {
    let mut w = one_shoot();
    let mut other = (*w.routes[0]).clone();
    other.metadata.name = Some("other".into());
    other.spec.parent_refs.as_mut().unwrap()[0].name = "istio".into();
    let mut wrong = (*w.routes[0]).clone();
    wrong.metadata.name = Some("wrong".into());
    wrong.spec.parent_refs.as_mut().unwrap()[0].section_name = Some("https".into());
    w.routes.push(Arc::new(other));
    w.routes.push(Arc::new(wrong));
    let t = w.translate(&mut Translator::default());
    assert_eq!(t.routes.len(), 2);
    let wrong = t.routes.iter().find(|r| r.key.name == "wrong").unwrap();
    assert_eq!(wrong.accepted.reason, "NoMatchingParent");
    assert_eq!(t.control_planes.len(), 1);
}

#[test]
fn a_policy_sets_the_acl_an_invalid_edit_keeps_the_last_good_one_and_the_oldest_policy_wins() {
    let mut w = one_shoot();
    let mut tr = Translator::default();
    w.policies = vec![policy(
        "shoot--a",
        "acl",
        "2026-01-02T00:00:00Z",
        "api",
        &["192.0.2.0/24"],
    )];
    let t = w.translate(&mut tr);
    assert_eq!(
        t.control_planes[0].acl.as_ref().unwrap().allow,
        vec!["192.0.2.0/24"]
    );
    assert!(t.policies[0].targets[0].1.ok);

    // An invalid edit: the previous ACL stays, the policy says why.
    w.policies = vec![policy(
        "shoot--a",
        "acl",
        "2026-01-02T00:00:00Z",
        "api",
        &["192.0.2.0/33"],
    )];
    let t = w.translate(&mut tr);
    assert_eq!(
        t.control_planes[0].acl.as_ref().unwrap().allow,
        vec!["192.0.2.0/24"]
    );
    let v = &t.policies[0].targets[0].1;
    assert_eq!(v.reason, "Invalid");
    assert!(v.message.contains("previously accepted"), "{v:?}");

    // Invalid from the start (a fresh translator): the route is not served.
    let t = w.translate(&mut Translator::default());
    assert!(t.control_planes.is_empty());
    assert_eq!(t.routes[0].accepted.reason, "UnsupportedValue");

    // Two policies: the younger one is Conflicted.
    w.policies = vec![
        policy(
            "shoot--a",
            "young",
            "2026-03-01T00:00:00Z",
            "api",
            &["198.51.100.0/24"],
        ),
        policy(
            "shoot--a",
            "old",
            "2026-01-01T00:00:00Z",
            "api",
            &["192.0.2.0/24"],
        ),
    ];
    let t = w.translate(&mut Translator::default());
    assert_eq!(
        t.control_planes[0].acl.as_ref().unwrap().allow,
        vec!["192.0.2.0/24"]
    );
    let young = t.policies.iter().find(|p| p.key.name == "young").unwrap();
    assert_eq!(young.targets[0].1.reason, "Conflicted");
}

#[test]
fn what_the_gateway_refuses_is_not_accepted_and_leaves_the_control_planes() {
    let mut t = one_shoot().translate(&mut Translator::default());
    t.refused(&[(
        "shoot--a.api".into(),
        vec![seedlink_config::ConfigError::new(
            "hostnames[0]",
            "host name \"api.a.example\" is already used by control plane \"x\"",
        )],
    )]);
    assert!(t.control_planes.is_empty());
    assert!(!t.routes[0].accepted.ok);
    assert!(t.routes[0].accepted.message.contains("already used"));
}

#[test]
fn a_policy_cluster_id_routes_by_tlv_and_a_bad_one_is_refused() {
    let mut w = one_shoot();
    let with_id = |id: &str| {
        let mut p = (*policy("shoot--a", "id", "2026-01-02T00:00:00Z", "api", &[])).clone();
        p.spec.cluster_id = Some(id.to_string());
        Arc::new(p)
    };
    w.policies = vec![with_id("3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d")];
    let t = w.translate(&mut Translator::default());
    assert_eq!(
        t.control_planes[0].cluster_id.as_deref(),
        Some("3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d")
    );
    w.policies = vec![with_id("has space")];
    let t = w.translate(&mut Translator::default());
    assert!(t.control_planes.is_empty());
    assert!(
        t.routes[0].accepted.message.contains("clusterID"),
        "{:?}",
        t.routes[0].accepted
    );
}

/// An EndpointSlice that points at the gateway's own host, link-local
/// (cloud metadata) or other non-host addresses gets none of them used as
/// upstreams (the CVE-2021-25740 class); its real pod addresses still are.
#[test]
fn endpoint_slices_cannot_point_the_gateway_at_itself() {
    let mut w = one_shoot();
    w.slices = vec![slice(
        "shoot--a",
        "kube-apiserver",
        "https",
        &[
            ("127.0.0.1", Some(true)),
            ("0.0.0.0", Some(true)),
            ("169.254.169.254", Some(true)),
            ("224.0.0.1", Some(true)),
            ("255.255.255.255", Some(true)),
            ("10.0.0.1", Some(true)),
        ],
    )];
    let t = w.translate(&mut Translator::default());
    assert_eq!(t.control_planes[0].endpoints, vec!["10.0.0.1:6443"]);
    for bad in [
        "::1",
        "::",
        "fe80::1",
        "::ffff:127.0.0.1",
        "ff02::1",
        "100.100.100.200",
        "fd00:ec2::254",
    ] {
        assert!(super::unroutable(bad.parse().unwrap()).is_some(), "{bad}");
    }
    for good in ["10.0.0.1", "fd00::1", "2001:db8::1", "100.64.0.1"] {
        assert!(super::unroutable(good.parse().unwrap()).is_none(), "{good}");
    }
}

/// A tenant's route naming another tenant's Service (a backendRef with a
/// namespace) gets none of its endpoints: without a ReferenceGrant, which
/// seedlink does not read yet, it is `RefNotPermitted`.
/// Route `ns/api` for `host`, made at `age`, whose backend is Service
/// `kube-apiserver:443` in namespace `backend_ns`.
fn route_into(ns: &str, age: &str, host: &str, backend_ns: &str) -> Arc<TlsRoute> {
    let mut r = (*route(ns, "api", age, &[host], "kube-apiserver", 443)).clone();
    let mut spec = serde_json::to_value(&r.spec).unwrap();
    spec["rules"][0]["backendRefs"][0]["namespace"] = json!(backend_ns);
    r.spec = serde_json::from_value(spec).unwrap();
    Arc::new(r)
}

#[test]
fn a_route_cannot_take_another_namespaces_backend() {
    let mut w = one_shoot();
    w.routes.push(route_into(
        "shoot--evil",
        "2026-01-01T00:00:00Z",
        "api.evil.example",
        "shoot--a",
    ));
    let t = w.translate(&mut Translator::default());
    let evil = t
        .routes
        .iter()
        .find(|o| o.key.namespace == "shoot--evil")
        .unwrap();
    assert_eq!(evil.resolved.reason, "RefNotPermitted");
    let cp = t
        .control_planes
        .iter()
        .find(|c| c.hostnames == ["api.evil.example"]);
    assert!(cp.is_none_or(|c| c.endpoints.is_empty()), "{cp:?}");
}

/// A tenant with an old route adds another tenant's host name: the first
/// claim keeps it (the newcomer goes last and the gateway refuses it on
/// the conflict), whatever the routes' ages; once the first route lets it
/// go, the name can move.
/// A victim's and an attacker's namespaces with their kube-apiserver
/// Services, all namespaces admitted.
fn victim_and_attacker(routes: Vec<Arc<TlsRoute>>, policies: Vec<Arc<SeedlinkPolicy>>) -> World {
    World {
        routes,
        policies,
        services: vec![
            service("shoot--v", "kube-apiserver", 443, "https"),
            service("shoot--x", "kube-apiserver", 443, "https"),
        ],
        slices: vec![],
        gateway: all_namespaces(),
        namespaces: vec![],
        grants: vec![],
    }
}

/// The control planes' names, in the order the translation gives them.
fn names(t: &Translation) -> Vec<String> {
    t.control_planes.iter().map(|c| c.name.clone()).collect()
}

#[test]
fn the_first_claim_keeps_a_name_whatever_the_ages() {
    let victim = route(
        "shoot--v",
        "api",
        "2026-06-01T00:00:00Z",
        &["api.v.example"],
        "kube-apiserver",
        443,
    );
    let attacker = |hosts: &[&str]| {
        route(
            "shoot--x",
            "api",
            "2025-01-01T00:00:00Z",
            hosts,
            "kube-apiserver",
            443,
        )
    };
    let world = |routes: Vec<Arc<TlsRoute>>| victim_and_attacker(routes, vec![]);
    let mut tr = Translator::default();
    // Both serve their own names: oldest first.
    let t = world(vec![victim.clone(), attacker(&["api.x.example"])]).translate(&mut tr);
    assert_eq!(names(&t), ["shoot--x.api", "shoot--v.api"]);
    // The older route adds the victim's name: it goes last.
    let greedy = attacker(&["api.x.example", "API.V.example."]);
    let t = world(vec![victim.clone(), greedy.clone()]).translate(&mut tr);
    assert_eq!(names(&t), ["shoot--v.api", "shoot--x.api"]);
    // And stays last on the next pass (the victim still holds the name).
    let t = world(vec![victim.clone(), greedy.clone()]).translate(&mut tr);
    assert_eq!(names(&t), ["shoot--v.api", "shoot--x.api"]);
    // The victim's route goes: the name is free to move.
    let t = world(vec![greedy.clone()]).translate(&mut tr);
    assert_eq!(names(&t), ["shoot--x.api"]);
    let t = world(vec![victim, greedy]).translate(&mut tr);
    assert_eq!(names(&t), ["shoot--x.api", "shoot--v.api"]);
}

/// A replica that starts (no pass of its own to remember) while an older
/// route claims a newer route's name decides as the running replicas do:
/// the route whose status says seedlink accepted it as it is now (its
/// generation) holds its names; the editor's `Accepted` is for an older
/// generation, and a route whose SeedlinkPolicy was edited since counts as
/// edited.
#[test]
fn a_restarted_replica_keeps_names_with_the_route_accepted_now() {
    let accepted = |mut r: TlsRoute, observed: i64| {
        r.status = serde_json::from_value(json!({"parents": [{
            "parentRef": {"name": "seedlink", "namespace": "seedlink-system"},
            "controllerName": crate::crd::CONTROLLER_NAME,
            "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                            "lastTransitionTime": "2026-06-01T00:00:00Z", "observedGeneration": observed}]
        }]}))
        .unwrap();
        Arc::new(r)
    };
    let victim = |observed| {
        accepted(
            (*route(
                "shoot--v",
                "api",
                "2026-06-01T00:00:00Z",
                &["api.v.example"],
                "kube-apiserver",
                443,
            ))
            .clone(),
            observed,
        )
    };
    // The attacker's route was accepted at generation 2, then edited (3)
    // to add the victim's name.
    let greedy = accepted(
        (*route(
            "shoot--x",
            "api",
            "2025-01-01T00:00:00Z",
            &["api.x.example", "api.v.example"],
            "kube-apiserver",
            443,
        ))
        .clone(),
        2,
    );
    let world = victim_and_attacker;
    let fresh = |w: &World| w.translate(&mut Translator::default());
    assert_eq!(
        names(&fresh(&world(vec![victim(3), greedy.clone()], vec![]))),
        ["shoot--v.api", "shoot--x.api"]
    );
    // Without status to go by (never accepted as it is now), the ages
    // decide, as before.
    assert_eq!(
        names(&fresh(&world(vec![victim(2), greedy.clone()], vec![]))),
        ["shoot--x.api", "shoot--v.api"]
    );
    // The victim's SeedlinkPolicy edited since it was accepted: the
    // victim's status no longer counts.
    let edited = policy(
        "shoot--v",
        "p",
        "2026-06-01T00:00:00Z",
        "api",
        &["10.0.0.0/8"],
    );
    assert_eq!(
        names(&fresh(&world(
            vec![victim(3), greedy.clone()],
            vec![edited]
        ))),
        ["shoot--x.api", "shoot--v.api"]
    );
    // Another install (the same controller name) accepted the attacker's
    // route for its own Gateway at the current generation: that entry
    // says nothing here, and the victim's name stays the victim's.
    let mut elsewhere = (*greedy).clone();
    elsewhere.metadata.generation = Some(3);
    let mut st = serde_json::to_value(&elsewhere.status).unwrap();
    st["parents"].as_array_mut().unwrap().push(json!({
        "parentRef": {"name": "seedlink", "namespace": "other-install"},
        "controllerName": crate::crd::CONTROLLER_NAME,
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                        "lastTransitionTime": "2026-06-01T00:00:00Z", "observedGeneration": 3}]
    }));
    elsewhere.status = serde_json::from_value(st).unwrap();
    assert_eq!(
        names(&fresh(&world(vec![victim(3), Arc::new(elsewhere)], vec![]))),
        ["shoot--v.api", "shoot--x.api"]
    );
}

/// The Gateway's listener decides who attaches: without a Gateway object
/// only routes from its own namespace (Gateway API's default); `Same`
/// likewise; `Selector` by the namespace's labels (which the cluster
/// operator sets, not the tenant); kinds without TLSRoute and non-TLS
/// listeners admit none. A refused route serves nothing.
#[test]
fn only_the_listeners_allowed_routes_attach() {
    let verdict = |w: &World| {
        let t = w.translate(&mut Translator::default());
        let r = t
            .routes
            .iter()
            .find(|r| r.key.name == "api")
            .unwrap()
            .clone();
        (
            r.accepted.ok,
            r.accepted.reason.clone(),
            t.control_planes.len(),
        )
    };
    let mut w = one_shoot();
    assert_eq!(verdict(&w), (true, "Accepted".into(), 1));
    w.gateway = None;
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    w.gateway = gateway(json!({"namespaces": {"from": "Same"}}));
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    let selector = json!({"namespaces": {"from": "Selector", "selector": {
        "matchLabels": {"seedlink.dev/gateway-access": "true"},
        "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["banned"]}]}}});
    w.gateway = gateway(selector.clone());
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    w.namespaces = vec![namespace(
        "shoot--a",
        json!({"seedlink.dev/gateway-access": "true"}),
    )];
    assert_eq!(verdict(&w), (true, "Accepted".into(), 1));
    w.namespaces = vec![namespace(
        "shoot--a",
        json!({"seedlink.dev/gateway-access": "true", "tier": "banned"}),
    )];
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    w.gateway = gateway(json!({"namespaces": {"from": "Selector"}}));
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    // A selector Kubernetes would refuse selects nothing.
    w.gateway = gateway(json!({"namespaces": {"from": "Selector", "selector": {
        "matchExpressions": [{"key": "tier", "operator": "NotIn"}]}}}));
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    w.gateway = gateway(json!({"namespaces": {"from": "All"}, "kinds": [{"kind": "HTTPRoute"}]}));
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    w.gateway = all_namespaces();
    if let Some(g) = w.gateway.as_mut() {
        g.spec.listeners[0].protocol = "HTTPS".into();
    }
    assert_eq!(verdict(&w), (false, "NotAllowedByListeners".into(), 0));
    // A route in the Gateway's own namespace attaches by default.
    let mut w = one_shoot();
    w.gateway = None;
    w.routes = vec![route(
        "seedlink-system",
        "api",
        "2026-01-01T00:00:00Z",
        &["api.a.example"],
        "kube-apiserver",
        443,
    )];
    assert_eq!(verdict(&w), (true, "Accepted".into(), 1));
    // sectionName names the Gateway object's listeners when there is one.
    let mut w = one_shoot();
    let mut r = (*w.routes[0]).clone();
    r.spec.parent_refs.as_mut().unwrap()[0].section_name = Some("tls".into());
    w.routes = vec![Arc::new(r)];
    assert_eq!(verdict(&w), (true, "Accepted".into(), 1));
    if let Some(g) = w.gateway.as_mut() {
        g.spec.listeners[0].name = "passthrough".into();
    }
    assert_eq!(verdict(&w), (false, "NoMatchingParent".into(), 0));
}

/// A backend in another namespace is used only when a ReferenceGrant there
/// lets TLSRoutes from the route's namespace use that Service.
#[test]
fn a_reference_grant_lets_a_route_use_another_namespaces_service() {
    let mut w = one_shoot();
    let mut r = (*route(
        "shoot--b",
        "api",
        "2026-01-01T00:00:00Z",
        &["api.b.example"],
        "kube-apiserver",
        443,
    ))
    .clone();
    let mut spec = serde_json::to_value(&r.spec).unwrap();
    spec["rules"][0]["backendRefs"][0]["namespace"] = json!("shoot--a");
    r.spec = serde_json::from_value(spec).unwrap();
    w.routes.push(Arc::new(r));
    let endpoints = |w: &World| {
        let t = w.translate(&mut Translator::default());
        let o = t
            .routes
            .iter()
            .find(|o| o.key.namespace == "shoot--b")
            .unwrap();
        let cp = t.control_planes.iter().find(|c| c.name == "shoot--b.api");
        (
            o.resolved.reason.clone(),
            cp.map(|c| c.endpoints.len()).unwrap_or_default(),
        )
    };
    assert_eq!(endpoints(&w), ("RefNotPermitted".into(), 0));
    // A grant for another namespace, another Service, or in the wrong
    // namespace does not count.
    w.grants = vec![
        grant("shoot--a", "shoot--c", None),
        grant("shoot--a", "shoot--b", Some("etcd")),
        grant("shoot--b", "shoot--b", None),
    ];
    assert_eq!(endpoints(&w), ("RefNotPermitted".into(), 0));
    w.grants
        .push(grant("shoot--a", "shoot--b", Some("kube-apiserver")));
    assert_eq!(endpoints(&w), ("ResolvedRefs".into(), 2));
}

/// Only slices from a trusted manager name upstreams: one written by hand
/// (a tenant may write one, naming another tenant's pod) is ignored.
#[test]
fn slices_not_written_by_a_trusted_manager_are_ignored() {
    let mut w = one_shoot();
    let mut forged = (*w.slices[0]).clone();
    forged.metadata.name = Some("forged".into());
    if let Some(l) = forged.metadata.labels.as_mut() {
        l.insert(MANAGED_BY.into(), "tenant.example/hand".into());
    }
    forged.endpoints[0].addresses = vec!["10.9.9.9".into()];
    w.slices.push(Arc::new(forged.clone()));
    let t = w.translate(&mut Translator::default());
    assert!(!t.control_planes[0]
        .endpoints
        .iter()
        .any(|e| e.starts_with("10.9.9.9")));
    if let Some(l) = forged.metadata.labels.as_mut() {
        l.remove(MANAGED_BY);
    }
    w.slices[1] = Arc::new(forged);
    let t = w.translate(&mut Translator::default());
    assert!(!t.control_planes[0]
        .endpoints
        .iter()
        .any(|e| e.starts_with("10.9.9.9")));
    // An operator who trusts that manager gets its slices.
    let mut tr = Translator::default();
    tr.slice_managers.push("tenant.example/hand".into());
    let mut w2 = one_shoot();
    let mut own = (*w2.slices[0]).clone();
    if let Some(l) = own.metadata.labels.as_mut() {
        l.insert(MANAGED_BY.into(), "tenant.example/hand".into());
    }
    w2.slices = vec![Arc::new(own)];
    let t = w2.translate(&mut tr);
    assert_eq!(t.control_planes[0].endpoints.len(), 2);
}

/// The label is anyone's to write: a slice that claims Kubernetes'
/// controller for a Service without a selector (for which the controller
/// writes none) is ignored, whatever addresses it names.
#[test]
fn a_forged_controller_slice_for_a_service_without_selector_is_ignored() {
    let mut w = one_shoot();
    let mut svc = (*w.services[0]).clone();
    if let Some(spec) = svc.spec.as_mut() {
        spec.selector = None;
    }
    w.services = vec![Arc::new(svc)];
    let t = w.translate(&mut Translator::default());
    assert!(t.control_planes[0].endpoints.is_empty());
}

/// The Gateway object's listeners as seedlink reports them: a TLS
/// passthrough listener is accepted and counts the routes attached to it;
/// a Terminate (the default mode) or non-TLS listener is not, and no route
/// attaches to it.
#[test]
fn listeners_report_what_seedlink_serves_and_their_attached_routes() {
    let mut w = one_shoot();
    w.gateway = all_namespaces();
    let t = w.translate(&mut Translator::default());
    let listeners = &t.gateways[0].listeners;
    assert_eq!(listeners.len(), 1);
    assert!(listeners[0].accepted.ok);
    assert_eq!(listeners[0].kinds, ["TLSRoute"]);
    assert_eq!(t.attached(&gw(), "tls"), 1);
    assert_eq!(t.attached(&gw(), "other"), 0);

    if let Some(g) = w.gateway.as_mut() {
        g.spec.listeners[0].tls = None;
    }
    let t = w.translate(&mut Translator::default());
    let listeners = &t.gateways[0].listeners;
    assert!(!listeners[0].accepted.ok);
    assert_eq!(listeners[0].accepted.reason, "UnsupportedValue");
    assert!(listeners[0].kinds.is_empty());
    assert_eq!(t.attached(&gw(), "tls"), 0);
    assert_eq!(t.routes[0].accepted.reason, "NotAllowedByListeners");

    if let Some(g) = w.gateway.as_mut() {
        g.spec.listeners[0].protocol = "HTTP".into();
    }
    let t = w.translate(&mut Translator::default());
    assert_eq!(
        t.gateways[0].listeners[0].accepted.reason,
        "UnsupportedProtocol"
    );
    // No Gateway object: nothing to report.
    w.gateway = None;
    assert!(w.translate(&mut Translator::default()).gateways.is_empty());
}

/// A Gateway of class `seedlink` in `infra` with the given listeners.
fn class_gateway(name: &str, created: &str, listeners: serde_json::Value) -> Arc<Gateway> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": name, "namespace": "infra", "creationTimestamp": created},
            "spec": {"gatewayClassName": "seedlink", "listeners": listeners}
        }))
        .unwrap(),
    )
}

fn tls_listener(name: &str, port: i32, hostname: Option<&str>) -> serde_json::Value {
    let mut l = json!({"name": name, "port": port, "protocol": "TLS",
                       "tls": {"mode": "Passthrough"},
                       "allowedRoutes": {"namespaces": {"from": "Same"}, "kinds": [{"kind": "TLSRoute"}]}});
    if let Some(h) = hostname {
        l["hostname"] = json!(h);
    }
    l
}

fn class_route(name: &str, parents: serde_json::Value, hosts: &[&str]) -> Arc<TlsRoute> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "TLSRoute",
            "metadata": {"name": name, "namespace": "infra", "creationTimestamp": "2026-01-01T00:00:00Z", "generation": 2},
            "spec": {"parentRefs": parents, "hostnames": hosts,
                     "rules": [{"backendRefs": [{"name": "tls-backend", "port": 443}]}]}
        }))
        .unwrap(),
    )
}

fn seedlink_class(controller: &str) -> Arc<GatewayClass> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": {"name": "seedlink"},
            "spec": {"controllerName": controller}
        }))
        .unwrap(),
    )
}

struct ClassWorld {
    gateways: Vec<Arc<Gateway>>,
    routes: Vec<Arc<TlsRoute>>,
    controller: &'static str,
    pool: Vec<IpAddr>,
}

impl ClassWorld {
    fn new() -> ClassWorld {
        ClassWorld {
            gateways: Vec::new(),
            routes: Vec::new(),
            controller: crate::crd::CONTROLLER_NAME,
            pool: vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()],
        }
    }

    fn translate(&self) -> Translation {
        let class = ClassSettings {
            name: "seedlink".into(),
            addresses: self.pool.clone(),
            receivers: vec!["0.0.0.0:443".parse().unwrap()],
        };
        let classes = vec![seedlink_class(self.controller)];
        let services = vec![service("infra", "tls-backend", 443, "https")];
        let slices = vec![slice(
            "infra",
            "tls-backend",
            "https",
            &[("10.1.0.1", Some(true))],
        )];
        Translator::default().translate(&Objects {
            gateway: None,
            class: Some(&class),
            gateways: &self.gateways,
            classes: &classes,
            listeners: &[],
            routes: &self.routes,
            policies: &[],
            services: &services,
            slices: &slices,
            namespaces: &[],
            grants: &[],
        })
    }
}

fn key(name: &str) -> Key {
    Key {
        namespace: "infra".into(),
        name: name.into(),
    }
}

/// Every Gateway of the class is served at its own address: the same
/// names on two Gateways do not conflict, each route's names are what its
/// listener's hostname allows, and each is served only on its Gateway's
/// address and listener port.
#[test]
fn each_gateway_of_the_class_has_its_own_address_and_names() {
    let mut w = ClassWorld::new();
    w.gateways = vec![
        class_gateway(
            "exact",
            "2026-01-01T00:00:00Z",
            json!([tls_listener("tls", 443, Some("abc.example.com"))]),
        ),
        class_gateway(
            "wide",
            "2026-01-02T00:00:00Z",
            json!([tls_listener("tls", 443, Some("*.com"))]),
        ),
    ];
    w.routes = vec![
        class_route("on-exact", json!([{"name": "exact"}]), &["*.example.com"]),
        class_route(
            "on-wide",
            json!([{"name": "wide"}]),
            &["abc.example.com", "*.example.com"],
        ),
    ];
    let t = w.translate();
    assert!(t.routes.iter().all(|r| r.accepted.ok), "{:?}", t.routes);
    let cp = |n: &str| t.control_planes.iter().find(|c| c.name == n).unwrap();
    let on = |n: &str| -> Vec<(String, Vec<String>)> {
        cp(n)
            .served_on
            .iter()
            .map(|o| (o.address.clone(), o.hostnames.clone()))
            .collect()
    };
    assert!(cp("infra.on-exact").hostnames.is_empty());
    assert_eq!(
        on("infra.on-exact"),
        [("10.0.0.1:443".into(), vec!["abc.example.com".to_string()])]
    );
    assert_eq!(
        on("infra.on-wide"),
        [(
            "10.0.0.2:443".into(),
            vec!["abc.example.com".to_string(), "*.example.com".to_string()]
        )]
    );
    let address = |n: &str| t.gateways.iter().find(|g| g.key == key(n)).unwrap().address;
    assert_eq!(address("exact"), Some("10.0.0.1".parse().unwrap()));
    assert_eq!(address("wide"), Some("10.0.0.2".parse().unwrap()));
    assert_eq!(t.attached(&key("exact"), "tls"), 1);
    assert_eq!(t.attached(&key("wide"), "tls"), 1);
}

/// A route whose names are outside every listener's hostname is refused
/// with `NoMatchingListenerHostname`, per parent: a route with two parents
/// is served through the one that admits it, and each parent's status
/// says what became of it there.
#[test]
fn hostnames_outside_the_listener_are_refused_per_parent() {
    let mut w = ClassWorld::new();
    w.gateways = vec![
        class_gateway(
            "exact",
            "2026-01-01T00:00:00Z",
            json!([tls_listener("tls", 443, Some("www.example.com"))]),
        ),
        class_gateway(
            "wide",
            "2026-01-02T00:00:00Z",
            json!([tls_listener("tls", 443, Some("*.example.com"))]),
        ),
    ];
    w.routes = vec![
        class_route(
            "mismatch",
            json!([{"name": "exact"}]),
            &["non.matching.com"],
        ),
        class_route(
            "both",
            json!([{"name": "exact"}, {"name": "wide"}]),
            &["abc.example.com"],
        ),
    ];
    let t = w.translate();
    let r = |n: &str| t.routes.iter().find(|r| r.key.name == n).unwrap();
    assert_eq!(r("mismatch").accepted.reason, "NoMatchingListenerHostname");
    assert_eq!(r("mismatch").control_plane, None);
    let both = r("both");
    assert!(both.accepted.ok);
    let reasons: Vec<(&str, &str)> = both
        .parents
        .iter()
        .map(|p| (p.gateway.name.as_str(), p.accepted.reason.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("exact", "NoMatchingListenerHostname"),
            ("wide", "Accepted")
        ]
    );
    let cp = t
        .control_planes
        .iter()
        .find(|c| c.name == "infra.both")
        .unwrap();
    let at: Vec<&str> = cp.served_on.iter().map(|o| o.address.as_str()).collect();
    assert_eq!(at, ["10.0.0.2:443"]);
    assert_eq!(t.attached(&key("exact"), "tls"), 0);
    assert_eq!(t.attached(&key("wide"), "tls"), 1);
}

/// What a listener asks for and seedlink cannot give is said on the
/// listener: a port no TLS listener receives (`PortUnavailable`), a route
/// kind it does not serve (`ResolvedRefs=False, InvalidRouteKinds`, the
/// kinds it does serve kept); a parentRef's port picks listeners.
#[test]
fn listener_ports_kinds_and_parent_ports() {
    let mut w = ClassWorld::new();
    let mut kinds = tls_listener("tcp-and-tls", 443, None);
    kinds["allowedRoutes"]["kinds"] = json!([{"kind": "TCPRoute"}, {"kind": "TLSRoute"}]);
    w.gateways = vec![class_gateway(
        "g",
        "2026-01-01T00:00:00Z",
        json!([tls_listener("alt", 8443, None), kinds]),
    )];
    w.routes = vec![
        class_route(
            "on-443",
            json!([{"name": "g", "port": 443}]),
            &["a.example.com"],
        ),
        class_route(
            "on-8443",
            json!([{"name": "g", "port": 8443}]),
            &["b.example.com"],
        ),
        class_route(
            "on-9443",
            json!([{"name": "g", "port": 9443}]),
            &["c.example.com"],
        ),
    ];
    let t = w.translate();
    let g = &t.gateways[0];
    assert_eq!(g.listeners[0].accepted.reason, "PortUnavailable");
    assert!(g.listeners[0].kinds.is_empty());
    assert!(g.listeners[1].accepted.ok);
    assert_eq!(g.listeners[1].resolved.reason, "InvalidRouteKinds");
    assert_eq!(g.listeners[1].kinds, ["TLSRoute"]);
    let r = |n: &str| {
        t.routes
            .iter()
            .find(|r| r.key.name == n)
            .unwrap()
            .accepted
            .reason
            .clone()
    };
    assert_eq!(r("on-443"), "Accepted");
    assert_eq!(r("on-8443"), "NotAllowedByListeners");
    assert_eq!(r("on-9443"), "NoMatchingParent");
}

/// Addresses: the one a Gateway's status shows stays with it (whatever
/// the ages); a Gateway beyond the pool gets none (and serves nothing);
/// a class whose controllerName is not seedlink's is not served at all.
#[test]
fn class_addresses_are_stable_and_bounded() {
    let mut w = ClassWorld::new();
    let mut young: Gateway = (*class_gateway(
        "young",
        "2026-01-03T00:00:00Z",
        json!([tls_listener("tls", 443, None)]),
    ))
    .clone();
    young.status = Some(
        serde_json::from_value(json!({"addresses": [{"type": "IPAddress", "value": "10.0.0.1"}]}))
            .unwrap(),
    );
    w.gateways = vec![
        class_gateway(
            "old",
            "2026-01-01T00:00:00Z",
            json!([tls_listener("tls", 443, None)]),
        ),
        Arc::new(young),
        class_gateway(
            "third",
            "2026-01-04T00:00:00Z",
            json!([tls_listener("tls", 443, None)]),
        ),
    ];
    w.routes = vec![class_route(
        "on-third",
        json!([{"name": "third"}]),
        &["t.example.com"],
    )];
    let t = w.translate();
    let address = |n: &str| t.gateways.iter().find(|g| g.key == key(n)).unwrap().address;
    assert_eq!(address("young"), Some("10.0.0.1".parse().unwrap()));
    assert_eq!(address("old"), Some("10.0.0.2".parse().unwrap()));
    assert_eq!(address("third"), None);
    assert!(t.routes[0].accepted.ok);
    assert!(t.control_planes.is_empty(), "no address, nowhere to serve");

    w.controller = "example.com/other";
    let t = w.translate();
    assert!(t.gateways.is_empty() && t.routes.is_empty());
}

/// A Service's terminating pods that still serve take new connections only
/// when it has no ready pod (the serving-while-terminating fallback); one
/// neither ready nor serving never does.
#[test]
fn terminating_pods_serve_only_when_nothing_is_ready() {
    let with = |eps: serde_json::Value| {
        let mut w = one_shoot();
        let mut s = (*w.slices[0]).clone();
        s.endpoints = serde_json::from_value(eps).unwrap();
        w.slices = vec![Arc::new(s)];
        w.translate(&mut Translator::default()).control_planes[0]
            .endpoints
            .clone()
    };
    let draining = json!({"addresses": ["10.0.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true}});
    let gone = json!({"addresses": ["10.0.0.3"], "conditions": {"ready": false, "serving": false, "terminating": true}});
    let up = json!({"addresses": ["10.0.0.1"], "conditions": {"ready": true, "serving": true, "terminating": false}});
    assert_eq!(with(json!([up, draining, gone])), ["10.0.0.1:6443"]);
    assert_eq!(with(json!([draining, gone])), ["10.0.0.2:6443"]);
    assert!(with(json!([gone])).is_empty());
    // Not ready and not terminating (starting, failing its probe): nothing.
    assert!(with(
        json!([{"addresses": ["10.0.0.4"], "conditions": {"ready": false, "serving": false}}])
    )
    .is_empty());
}

/// A route attached to two Gateways with different listener hostnames
/// serves at each address only what that listener allows: names never
/// cross from one Gateway's address to another's, nor to the named
/// Gateway's (served everywhere).
#[test]
fn each_attachment_serves_its_own_names_at_its_own_address() {
    let mut w = ClassWorld::new();
    w.gateways = vec![
        class_gateway(
            "a",
            "2026-01-01T00:00:00Z",
            json!([tls_listener("tls", 443, None)]),
        ),
        class_gateway(
            "b",
            "2026-01-02T00:00:00Z",
            json!([tls_listener("tls", 443, Some("*.b.example"))]),
        ),
    ];
    w.routes = vec![class_route(
        "two",
        json!([{"name": "a"}, {"name": "b"}]),
        &["x.b.example", "www.victim.com"],
    )];
    let t = w.translate();
    let cp = &t.control_planes[0];
    assert!(cp.hostnames.is_empty());
    let on: Vec<(String, Vec<String>)> = cp
        .served_on
        .iter()
        .map(|o| (o.address.clone(), o.hostnames.clone()))
        .collect();
    assert_eq!(
        on,
        [
            (
                "10.0.0.1:443".into(),
                vec!["x.b.example".to_string(), "www.victim.com".to_string()]
            ),
            ("10.0.0.2:443".into(), vec!["x.b.example".to_string()]),
        ]
    );
}

/// A Gateway that asks for an address not in the pool (or taken) gets
/// none, not another one.
#[test]
fn a_requested_address_is_given_or_none() {
    let mut w = ClassWorld::new();
    let mut g: Gateway = (*class_gateway(
        "asks",
        "2026-01-01T00:00:00Z",
        json!([tls_listener("tls", 443, None)]),
    ))
    .clone();
    g.spec.addresses =
        Some(serde_json::from_value(json!([{"type": "IPAddress", "value": "192.0.2.1"}])).unwrap());
    w.gateways = vec![Arc::new(g.clone())];
    assert_eq!(w.translate().gateways[0].address, None);
    g.spec.addresses =
        Some(serde_json::from_value(json!([{"type": "IPAddress", "value": "10.0.0.2"}])).unwrap());
    w.gateways = vec![Arc::new(g)];
    assert_eq!(
        w.translate().gateways[0].address,
        Some("10.0.0.2".parse().unwrap())
    );
}

/// Two installs in one cluster: a policy whose target route is attached to
/// another install's Gateway is that install's to report. Here its target
/// is neither accepted nor "not found": it is left alone (foreign), while
/// a target that exists nowhere is still reported not found.
#[test]
fn a_policy_on_another_gateways_route_is_left_to_it() {
    let mut w = one_shoot();
    let mut theirs = (*route(
        "shoot--b",
        "api",
        "2026-01-01T00:00:00Z",
        &["api.b.example"],
        "kube-apiserver",
        443,
    ))
    .clone();
    theirs.spec.parent_refs =
        serde_json::from_value(json!([{"name": "seedlink", "namespace": "other-install"}]))
            .unwrap();
    w.routes.push(Arc::new(theirs));
    w.policies = vec![
        policy(
            "shoot--b",
            "acl",
            "2026-01-02T00:00:00Z",
            "api",
            &["192.0.2.0/24"],
        ),
        policy(
            "shoot--c",
            "acl",
            "2026-01-02T00:00:00Z",
            "api",
            &["192.0.2.0/24"],
        ),
    ];
    let t = w.translate(&mut Translator::default());
    let b = t
        .policies
        .iter()
        .find(|p| p.key.namespace == "shoot--b")
        .unwrap();
    assert!(b.targets.is_empty(), "{b:?}");
    assert_eq!(b.foreign, vec!["api".to_string()]);
    let c = t
        .policies
        .iter()
        .find(|p| p.key.namespace == "shoot--c")
        .unwrap();
    assert_eq!(c.targets[0].1.reason, "TargetNotFound");
    assert!(c.foreign.is_empty());
}

mod memo;
