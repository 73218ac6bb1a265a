//! The gateway and the tunnel-server driven by Kubernetes objects
//! (TLSRoute, SeedlinkPolicy, Service, EndpointSlice, Gateway, Namespace,
//! TunnelCluster, Secret, ConfigMap) on a real kube-apiserver with etcd and
//! RBAC on (the test kit's `KubeApi`), seedlink running as the
//! ServiceAccount and with the RBAC the install manifests give it: routes
//! follow the objects under load, invalid objects are refused with status
//! and an Event while the rest serve, a 410 (etcd compacted) and an outage
//! of the API server (a partition) drop nothing, and of two replicas one
//! writes status.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::faults::{Fault, FaultProxy};
use common::kubeapi::{self, KubeApi};
use common::*;
use serde_json::{json, Value};
use tokio::net::{TcpListener, UnixStream};
use tokio_util::sync::CancellationToken;

const A: &str = "api.a.kube.test";
const C: &str = "api.c.kube.test";
const D: &str = "api.d.kube.test";
const ROUTES: &str = "gateway.networking.k8s.io/v1";
const POLICIES: &str = "policy.seedlink.dev/v1alpha1";

/// The "pods" of a seed's network namespace: the API server refuses
/// loopback addresses in EndpointSlices, so the demo kube-apiservers live
/// on these (on the namespace's own `lo`).
const POD_1: &str = "10.99.0.2";
const POD_2: &str = "10.99.0.3";

/// One test's seed on the shared API server: its own install namespace
/// (RBAC from the manifests, the ServiceAccount's token), its own Gateway,
/// tenant namespaces named `<prefix>-<short>`, a fault proxy between
/// seedlink and the API server, and (for the gateway) a network namespace
/// for the gateway and its pods, bridged to the API server by that proxy.
struct Seed {
    api: &'static KubeApi,
    client: kube::Client,
    prefix: String,
    /// The install namespace (the Gateway's, the Leases').
    sys: String,
    /// The `seedlink` ServiceAccount's token.
    token: String,
    proxy: FaultProxy,
    /// The network namespace the gateway and its pods run in.
    net: Option<(Netns, NetnsDialer)>,
    dir: tempfile::TempDir,
}

/// A gateway in the seed's network namespace, reached through bridges.
struct SeedGw {
    gw: Gw,
    /// Its TLS listener, from here.
    tls: SocketAddr,
    admin: SocketAddr,
    _bridges: (FaultProxy, FaultProxy),
    /// Its own way to the API server, when it has one (to cut it off).
    api: Option<FaultProxy>,
}

impl SeedGw {
    async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path).await
    }

    fn write_config(&self, yaml: &str) {
        self.gw.write_config(yaml);
    }
}

impl Seed {
    /// What class mode needs beyond the install (Gateways of every
    /// namespace, with their status) and the GatewayClass; its name.
    async fn class_mode(&self) -> String {
        let class = format!("{}-class", self.prefix);
        self.apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": format!("seedlink-gateway-class-{}", self.sys)},
            "rules": [
                {"apiGroups": ["gateway.networking.k8s.io"], "resources": ["gateways"], "verbs": ["list", "watch"]},
                {"apiGroups": ["gateway.networking.k8s.io"], "resources": ["gateways/status"], "verbs": ["patch"]}
            ]
        }))
        .await;
        self.apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": format!("seedlink-gateway-class-{}", self.sys)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": format!("seedlink-gateway-class-{}", self.sys)},
            "subjects": [{"kind": "ServiceAccount", "name": "seedlink", "namespace": self.sys}]
        }))
        .await;
        self.apply(
            json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                          "metadata": {"name": class},
                          "spec": {"controllerName": "seedlink.dev/gateway"}}),
        )
        .await;
        class
    }
}

impl Seed {
    /// The Lease of the status writers' election.
    async fn status_lease(&self) -> Option<Value> {
        self.get(
            "coordination.k8s.io/v1",
            "Lease",
            &self.sys,
            "seedlink-status",
        )
        .await
    }
}

impl Seed {
    /// With `netns`, the gateway and its pods get a network namespace
    /// (the API server is reached through the proxy, listening there).
    async fn new(netns: bool) -> Seed {
        Seed::on(KubeApi::shared(), netns).await
    }

    /// The same on an API server of its own (kept until the test binary
    /// exits): an onboarding controller reconciles every
    /// SeedlinkControlPlane it can see, so two at once on one API server
    /// would take each other's.
    async fn own(netns: bool) -> Seed {
        let api = own_api().await;
        Seed::on(Box::leak(Box::new(api)), netns).await
    }

    async fn on(api: &'static KubeApi, netns: bool) -> Seed {
        static N: AtomicU32 = AtomicU32::new(0);
        let client = api.client().await.unwrap();
        let prefix = format!("k{}", N.fetch_add(1, Ordering::Relaxed));
        let sys = format!("{prefix}-system");
        kubeapi::apply(
            &client,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": sys}}),
        )
        .await;
        let token = api.install_rbac(&client, &sys).await;
        let (proxy, net) = if netns {
            let ns = Netns::new("kube");
            for pod in [POD_1, POD_2] {
                ns.run(&["ip", "addr", "add", &format!("{pod}/32"), "dev", "lo"]);
            }
            let dialer = NetnsDialer::new(&ns);
            let l = dialer.bind("127.0.0.1:0".parse().unwrap());
            let proxy = FaultProxy::start_with(l, None, api.addr, Fault::Pass);
            (proxy, Some((ns, dialer)))
        } else {
            (FaultProxy::start(api.addr, Fault::Pass).await, None)
        };
        Seed {
            api,
            client,
            prefix,
            sys,
            token,
            proxy,
            net,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Starts a gateway in the seed's network namespace, reaching the API
    /// server through the seed's proxy.
    async fn gateway(&self, pod: &str, token: &str) -> SeedGw {
        self.start_gateway(pod, token, None).await
    }

    /// The same through a proxy of its own (`SeedGw::api`).
    async fn gateway_with_own_proxy(&self, pod: &str, token: &str) -> SeedGw {
        self.start_gateway(pod, token, Some(Fault::Pass)).await
    }

    /// With `own`, through a proxy of its own that starts with that fault.
    async fn start_gateway(&self, pod: &str, token: &str, own: Option<Fault>) -> SeedGw {
        self.start_gateway_with(pod, token, own, &self.gateway_yaml())
            .await
    }

    /// The same from the gateway file `yaml`.
    async fn start_gateway_with(
        &self,
        pod: &str,
        token: &str,
        own: Option<Fault>,
        yaml: &str,
    ) -> SeedGw {
        let (ns, dialer) = self.net.as_ref().unwrap();
        let api = own.map(|fault| {
            let l = dialer.bind("127.0.0.1:0".parse().unwrap());
            FaultProxy::start_with(l, None, self.api.addr, fault)
        });
        let kc = match &api {
            Some(p) => self
                .api
                .kubeconfig(self.dir.path(), pod, token, Some(p.addr)),
            None => self.kubeconfig(pod, token),
        };
        let gw = Gw::start_in(
            Some(ns),
            yaml,
            &[("KUBECONFIG", kc.to_str().unwrap()), ("POD_NAME", pod)],
        );
        let mut bridges = Vec::new();
        for to in [gw.tls, gw.admin] {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            bridges.push(FaultProxy::start_with(
                l,
                Some(dialer.clone()),
                to,
                Fault::Pass,
            ));
        }
        let (a, t) = (bridges.pop().unwrap(), bridges.pop().unwrap());
        SeedGw {
            tls: t.addr,
            admin: a.addr,
            gw,
            _bridges: (t, a),
            api,
        }
    }

    /// Two demo kube-apiservers ("pods") on [`POD_1`] and [`POD_2`] in the
    /// seed's network namespace, one port.
    fn two_pods(
        &self,
        pki: &Arc<seedlink::demo::Pki>,
        host: usize,
        name: &str,
        stop: &CancellationToken,
    ) -> u16 {
        let (_, dialer) = self.net.as_ref().unwrap();
        let l1 = dialer.bind(format!("{POD_1}:0").parse().unwrap());
        let port = l1.local_addr().unwrap().port();
        let l2 = dialer.bind(format!("{POD_2}:{port}").parse().unwrap());
        for (l, pod) in [(l1, "1"), (l2, "2")] {
            tokio::spawn(seedlink::demo::serve_demo_apiserver(
                l,
                format!("{name}{pod}"),
                pki.server_config(host).unwrap(),
                stop.clone(),
            ));
        }
        port
    }

    fn ns(&self, short: &str) -> String {
        format!("{}-{short}", self.prefix)
    }

    /// Creates tenant namespace `short`, admitted by the Gateway's
    /// listener (labelled `seedlink.dev/gateway-access=true`) or not.
    async fn tenant(&self, short: &str, admitted: bool) -> String {
        let ns = self.ns(short);
        let labels = if admitted {
            json!({"seedlink.dev/gateway-access": "true"})
        } else {
            json!({})
        };
        self.apply(json!({"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": ns, "labels": labels}}))
            .await;
        ns
    }

    async fn apply(&self, object: Value) -> Value {
        kubeapi::apply(&self.client, object).await
    }

    async fn get(&self, api_version: &str, kind: &str, ns: &str, name: &str) -> Option<Value> {
        kubeapi::get(&self.client, api_version, kind, ns, name).await
    }

    async fn delete(&self, api_version: &str, kind: &str, ns: &str, name: &str) -> bool {
        kubeapi::delete(&self.client, api_version, kind, ns, name).await
    }

    /// A kubeconfig through the fault proxy with `token`.
    fn kubeconfig(&self, name: &str, token: &str) -> std::path::PathBuf {
        self.api
            .kubeconfig(self.dir.path(), name, token, Some(self.proxy.addr))
    }

    /// The Gateway as the install ships it (routes from namespaces
    /// labelled `seedlink.dev/gateway-access=true`).
    async fn gateway_object(&self) {
        let shipped = std::fs::read_to_string(
            kubeapi::repo_root().join("deploy/kustomize/seed/gateway.yaml"),
        )
        .unwrap();
        for mut doc in kubeapi::yaml_docs(&shipped) {
            if doc["kind"] == "Gateway" {
                doc["metadata"]["namespace"] = self.sys.clone().into();
                self.apply(doc).await;
            } else if doc["kind"] == "GatewayClass" {
                // Cluster-wide and the same for every test (the status
                // every seedlink writes on it is the same too).
                self.apply(doc).await;
            }
        }
    }

    fn gateway_yaml(&self) -> String {
        format!(
            "admin: {{listen: '127.0.0.1:0'}}\nlisteners: [{{name: tls, address: '127.0.0.1:0'}}]\nkubernetes: {{gateway: {}/seedlink}}\n",
            self.sys
        )
    }

    fn route(&self, ns: &str, name: &str, host: &str, svc: &str) -> Value {
        json!({
            "apiVersion": ROUTES, "kind": "TLSRoute",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "parentRefs": [{"name": "seedlink", "namespace": self.sys, "sectionName": "tls"}],
                "hostnames": [host],
                "rules": [{"backendRefs": [{"name": svc, "port": 443}]}]
            }
        })
    }

    /// Our condition `type_` on the route's (or policy's) status, if written.
    async fn condition(
        &self,
        api_version: &str,
        kind: &str,
        ns: &str,
        name: &str,
        type_: &str,
    ) -> Option<Value> {
        let o = self.get(api_version, kind, ns, name).await?;
        let entries = o["status"]["parents"]
            .as_array()
            .or(o["status"]["ancestors"].as_array())?
            .clone();
        entries
            .iter()
            .filter(|e| e["controllerName"] == "seedlink.dev/gateway")
            .flat_map(|e| e["conditions"].as_array().cloned().unwrap_or_default())
            .find(|c| c["type"] == type_)
    }

    /// Waits (at most `limit`) until route `ns/kube-apiserver` has our
    /// condition `type_` and `ok` says yes to it.
    async fn wait_route(
        &self,
        what: &str,
        limit: Duration,
        ns: &str,
        type_: &str,
        ok: impl Fn(Value) -> bool,
    ) {
        eventually(what, limit, async || {
            self.condition(ROUTES, "TLSRoute", ns, "kube-apiserver", type_)
                .await
                .is_some_and(&ok)
        })
        .await;
    }

    /// Whether an Event about object `name` in `ns` was recorded.
    async fn event_about(&self, ns: &str, name: &str) -> bool {
        kubeapi::list(&self.client, "v1", "Event", ns)
            .await
            .iter()
            .any(|e| e["involvedObject"]["name"] == name)
    }

    /// [`Self::writers`] once there is at least one: kube-apiserver logs a
    /// write's ResponseComplete stage after the client has its answer, so
    /// the entry may trail a status the test has just seen.
    async fn wait_writers(&self, resource: &str, ns: &str, subresource: &str) -> Vec<String> {
        eventually(
            "the status write in the audit log",
            Duration::from_secs(60),
            async || !self.writers(resource, ns, subresource).is_empty(),
        )
        .await;
        self.writers(resource, ns, subresource)
    }

    /// Who (user names) wrote `subresource` of `resource` objects in `ns`
    /// according to the API server's audit log, in order.
    fn writers(&self, resource: &str, ns: &str, subresource: &str) -> Vec<String> {
        self.api
            .audit()
            .iter()
            .filter(|e| {
                e["stage"] == "ResponseComplete"
                    && e["objectRef"]["resource"] == resource
                    && e["objectRef"]["namespace"] == ns
                    && e["objectRef"]["subresource"] == subresource
                    && e["responseStatus"]["code"]
                        .as_u64()
                        .is_some_and(|c| c < 300)
            })
            .filter_map(|e| e["user"]["username"].as_str().map(str::to_string))
            .collect()
    }
}

impl Seed {
    /// What the platform creates next to a TunnelCluster: a RoleBinding of
    /// the install's `seedlink-tunnel-trust` ClusterRole in its namespace.
    async fn trust_binding(&self, ns: &str) {
        self.apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "seedlink-tunnel-trust", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": format!("seedlink-tunnel-trust-{}", self.sys)},
            "subjects": [{"kind": "ServiceAccount", "name": "seedlink", "namespace": self.sys}]
        }))
        .await;
    }

    /// Another ServiceAccount `name` with exactly the install's roles (a
    /// second replica whose writes the audit log tells apart); its token.
    async fn second_identity(&self, name: &str) -> String {
        let subject = json!([{"kind": "ServiceAccount", "name": name, "namespace": self.sys}]);
        self.apply(json!({"apiVersion": "v1", "kind": "ServiceAccount",
                          "metadata": {"name": name, "namespace": self.sys}}))
            .await;
        self.apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": format!("{name}-{}", self.sys)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": format!("seedlink-{}", self.sys)},
            "subjects": subject
        }))
        .await;
        self.apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("{name}-leases"), "namespace": self.sys},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "seedlink-leases"},
            "subjects": subject
        }))
        .await;
        self.api.token(&self.client, &self.sys, name).await
    }
}

fn service(ns: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"app": name},
                 "ports": [{"name": "https", "port": 443, "targetPort": 6443}]}
    })
}

fn slice(ns: &str, svc: &str, port: u16, eps: &[(&str, bool)]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{svc}-x1"), "namespace": ns,
                     "labels": {"kubernetes.io/service-name": svc,
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

fn policy(ns: &str, route: &str, cidrs: &[&str]) -> Value {
    json!({
        "apiVersion": POLICIES, "kind": "SeedlinkPolicy",
        "metadata": {"name": "acl", "namespace": ns},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "name": route}],
            "allowedSourceCIDRs": cidrs
        }
    })
}

async fn get(pki: &seedlink::demo::Pki, gw: SocketAddr, host: &str) -> anyhow::Result<String> {
    let cfg = pki.client_config(true, &[]).unwrap();
    tokio::time::timeout(
        Duration::from_secs(5),
        seedlink::demo::https_get(gw, host, cfg),
    )
    .await
    .map_err(|_| anyhow::anyhow!("timed out"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_the_objects_under_load_through_conflicts_a_410_and_an_outage() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A, C]).unwrap());
    let seed = Seed::new(true).await;
    let port_a = seed.two_pods(&pki, 0, "a", &stop);
    let port_c = seed.two_pods(&pki, 1, "c", &stop);
    seed.gateway_object().await;
    let [a, b, c, d, e] = [
        seed.tenant("shoot--a", true).await,
        seed.tenant("shoot--b", true).await,
        seed.tenant("shoot--c", true).await,
        seed.tenant("shoot--d", true).await,
        seed.tenant("shoot--e", true).await,
    ];
    let outsider = seed.tenant("outsider", false).await;
    seed.apply(service(&a, "kube-apiserver")).await;
    seed.apply(slice(
        &a,
        "kube-apiserver",
        port_a,
        &[(POD_1, true), (POD_2, true)],
    ))
    .await;
    seed.apply(seed.route(&a, "kube-apiserver", A, "kube-apiserver"))
        .await;

    let gw = seed.gateway("replica-a", &seed.token).await;
    let t = Routes {
        stop,
        pki,
        seed,
        gw,
        a,
        b,
        c,
        d,
        e,
        outsider,
        port_a,
        port_c,
    };
    first_route_serves_with_route_gateway_and_class_status(&t).await;
    another_controllers_status_entry_is_kept(&t).await;
    another_controllers_gateway_conditions_are_kept(&t).await;
    conflicts_unadmitted_namespaces_and_missing_backends_are_refused(&t).await;
    a_policy_applies_and_an_invalid_edit_keeps_the_last_valid_one(&t).await;
    a_terminating_pod_gets_no_new_connections(&t).await;
    an_unchanged_route_serves_through_churn_a_410_and_an_outage(&t).await;
    a_broken_gateway_file_holds_new_routes_back_and_says_so(&t).await;
    a_burst_of_routes_is_a_few_snapshots(&t).await;
    a_deleted_route_stops_and_status_was_written_on_change_only(&t).await;
    t.stop.cancel();
}

/// A control plane from Kubernetes says on its route's status which
/// legacy paths it used within the migration window: none before its
/// first connection through the gateway's `legacy` listener, that listener
/// and protocol after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_says_which_legacy_paths_its_control_plane_still_uses() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A]).unwrap());
    let seed = Seed::new(true).await;
    let port = seed.two_pods(&pki, 0, "a", &stop);
    seed.gateway_object().await;
    let a = seed.tenant("shoot--legacy", true).await;
    seed.apply(service(&a, "kube-apiserver")).await;
    seed.apply(slice(&a, "kube-apiserver", port, &[(POD_1, true)]))
        .await;
    seed.apply(seed.route(&a, "kube-apiserver", A, "kube-apiserver"))
        .await;
    let yaml = seed.gateway_yaml().replace(
        "{name: tls, address: '127.0.0.1:0'}",
        "{name: tls, address: '127.0.0.1:0', legacy: true}",
    );
    let gw = seed
        .start_gateway_with("replica-l", &seed.token, None, &yaml)
        .await;
    let in_use = async |status: &str, text: &str| {
        let what = format!("{LEGACY} {status} with {text:?}");
        eventually(&what, Duration::from_secs(60), async || {
            let c = seed
                .condition(ROUTES, "TLSRoute", &a, "kube-apiserver", LEGACY)
                .await
                .unwrap_or_default();
            let message = c["message"].as_str().unwrap_or_default();
            ok_if(c["status"] == status && message.contains(text), || {
                c.to_string()
            })
        })
        .await;
    };
    in_use("False", "no legacy path").await;
    let answer = eventually("the route to serve", Duration::from_secs(60), async || {
        get(&pki, gw.tls, A).await.map_err(|e| e.to_string())
    })
    .await;
    assert!(answer.contains("hello from a"), "{answer}");
    in_use("True", "tls (tls-sni)").await;
    stop.cancel();
}

/// The condition a route's status names its legacy paths with.
const LEGACY: &str = "seedlink.dev/LegacyPathsInUse";

/// What the phases of `routes_follow_the_objects_under_load_…` share.
/// Fields drop in order: the gateway before the seed it talks to.
struct Routes {
    gw: SeedGw,
    a: String,
    b: String,
    c: String,
    d: String,
    e: String,
    outsider: String,
    port_a: u16,
    port_c: u16,
    seed: Seed,
    pki: Arc<seedlink::demo::Pki>,
    stop: CancellationToken,
}

/// The first route serves at once, and its status, the GatewayClass's and the
/// Gateway's say so.
async fn first_route_serves_with_route_gateway_and_class_status(t: &Routes) {
    let Routes {
        pki, seed, gw, a, ..
    } = t;
    // Ready means the first snapshot is in: the route serves at once, on
    // both pods (least-connections spreads sequential requests).
    let body = get(pki, gw.tls, A).await.unwrap();
    assert!(body.contains("hello from a"), "{body}");
    seed.wait_route(
        "route status Accepted=True",
        Duration::from_secs(20),
        a,
        "Accepted",
        |c| c["status"] == "True",
    )
    .await;
    let resolved = seed
        .condition(ROUTES, "TLSRoute", a, "kube-apiserver", "ResolvedRefs")
        .await
        .unwrap();
    assert_eq!(resolved["status"], "True");
    assert_eq!(resolved["observedGeneration"], 1);
    // The GatewayClass naming seedlink's controller is accepted, and the
    // installed Gateway API version (read with the install's RBAC) is one
    // seedlink supports.
    eventually(
        "GatewayClass Accepted and SupportedVersion",
        Duration::from_secs(20),
        async || {
            let c = seed
                .get(
                    "gateway.networking.k8s.io/v1",
                    "GatewayClass",
                    "",
                    "seedlink",
                )
                .await
                .unwrap_or_default();
            c["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Accepted" && c["status"] == "True")
                    && cs.iter().any(|c| {
                        c["type"] == "SupportedVersion"
                            && c["status"] == "True"
                            && c["message"].as_str().is_some_and(|m| m.contains("v1.6.3"))
                    })
            })
        },
    )
    .await;
    // The Service seedlink is exposed by (the install's `seedlink`): its
    // load balancer's address becomes the Gateway's.
    seed.apply(json!({"apiVersion": "v1", "kind": "Service",
                      "metadata": {"name": "seedlink", "namespace": seed.sys},
                      "spec": {"type": "LoadBalancer",
                               "ports": [{"name": "tls", "port": 443, "targetPort": 9443}]}}))
        .await;
    kubeapi::patch_status(
        &seed.client,
        "v1",
        "Service",
        &seed.sys,
        "seedlink",
        json!({"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}}),
    )
    .await
    .unwrap();
    // The Gateway's own status: accepted, programmed, its listener
    // counting the route, with the kind it takes.
    eventually("Gateway status", Duration::from_secs(20), async || {
        let g = seed
            .get(
                "gateway.networking.k8s.io/v1",
                "Gateway",
                &seed.sys,
                "seedlink",
            )
            .await
            .unwrap_or_default();
        let st = &g["status"];
        let cond = |at: &Value, t: &str| {
            at["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == t))
                .map(|c| c["status"].clone())
        };
        let l = &st["listeners"][0];
        st["addresses"] == json!([{"type": "IPAddress", "value": "192.0.2.10"}])
            && cond(st, "Accepted") == Some("True".into())
            && cond(st, "Programmed") == Some("True".into())
            && l["name"] == "tls"
            && l["attachedRoutes"] == 1
            && l["supportedKinds"][0]["kind"] == "TLSRoute"
            && cond(l, "Accepted") == Some("True".into())
            && cond(l, "Conflicted") == Some("False".into())
    })
    .await;
}

/// Another controller's conditions on the Gateway and on its listener
/// (Gateway API v1.7's GatewayPreserveForeignConditions) survive
/// seedlink's next write of the Gateway's status (its load balancer's
/// address changed, then changed back).
async fn another_controllers_gateway_conditions_are_kept(t: &Routes) {
    let seed = &t.seed;
    let gw = (
        "gateway.networking.k8s.io/v1",
        "Gateway",
        seed.sys.as_str(),
        "seedlink",
    );
    let get = async || seed.get(gw.0, gw.1, gw.2, gw.3).await.unwrap_or_default();
    let foreign = json!({"type": "example.net/Audited", "status": "True", "reason": "Audited",
                         "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"});
    let mut status = get().await["status"].clone();
    status["conditions"]
        .as_array_mut()
        .unwrap()
        .push(foreign.clone());
    status["listeners"][0]["conditions"]
        .as_array_mut()
        .unwrap()
        .push(foreign.clone());
    kubeapi::patch_status(
        &seed.client,
        gw.0,
        gw.1,
        gw.2,
        gw.3,
        json!({"status": status}),
    )
    .await
    .unwrap();
    for ip in ["192.0.2.11", "192.0.2.10"] {
        let lb = json!({"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}});
        kubeapi::patch_status(&seed.client, "v1", "Service", &seed.sys, "seedlink", lb)
            .await
            .unwrap();
        eventually(
            "the foreign conditions kept",
            Duration::from_secs(20),
            async || {
                let st = get().await["status"].clone();
                let kept = |at: &Value| {
                    at["conditions"].as_array().is_some_and(|cs| {
                        cs.iter().any(|c| c["type"] == "example.net/Audited")
                            && cs.iter().any(|c| c["type"] == "Accepted")
                    })
                };
                st["addresses"][0]["value"] == ip && kept(&st) && kept(&st["listeners"][0])
            },
        )
        .await;
    }
}

/// Another controller's entry on the same route's status survives
/// seedlink's writes of its own.
async fn another_controllers_status_entry_is_kept(t: &Routes) {
    let Routes { seed, a, .. } = t;
    // A second writer: another controller's entry on the same route's
    // status. seedlink's later writes of its own entry keep it.
    let other = json!({
        "controllerName": "example.net/other-gateway",
        "parentRef": {"name": "other", "namespace": a},
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                        "message": "", "observedGeneration": 1,
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    });
    let read = seed
        .get(ROUTES, "TLSRoute", a, "kube-apiserver")
        .await
        .unwrap();
    let mut parents = read["status"]["parents"].as_array().cloned().unwrap();
    parents.push(other);
    kubeapi::patch_status(
        &seed.client,
        ROUTES,
        "TLSRoute",
        a,
        "kube-apiserver",
        json!({"metadata": {"resourceVersion": read["metadata"]["resourceVersion"]},
               "status": {"parents": parents}}),
    )
    .await
    .unwrap();
    let mut broken = seed.route(a, "kube-apiserver", A, "kube-apiserver");
    broken["spec"]["rules"][0]["backendRefs"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "nothing-here", "port": 443}));
    seed.apply(broken).await;
    seed.wait_route(
        "seedlink rewrites its entry",
        Duration::from_secs(20),
        a,
        "ResolvedRefs",
        |c| c["reason"] == "BackendNotFound",
    )
    .await;
    let read = seed
        .get(ROUTES, "TLSRoute", a, "kube-apiserver")
        .await
        .unwrap();
    assert!(
        read["status"]["parents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["controllerName"] == "example.net/other-gateway"),
        "the other controller's entry was lost: {}",
        read["status"]
    );
    seed.apply(seed.route(a, "kube-apiserver", A, "kube-apiserver"))
        .await;
}

/// A younger route for the same host name, a route from a namespace the
/// listener does not admit, and a missing backend: each refused with
/// status, the older route serving on.
async fn conflicts_unadmitted_namespaces_and_missing_backends_are_refused(t: &Routes) {
    let Routes {
        pki,
        seed,
        gw,
        b,
        d,
        outsider,
        ..
    } = t;
    // A younger route claiming the same host name: refused with a
    // condition and an Event; the older one keeps serving.
    seed.apply(seed.route(b, "kube-apiserver", A, "kube-apiserver"))
        .await;
    seed.wait_route(
        "the conflicting route is not accepted",
        Duration::from_secs(20),
        b,
        "Accepted",
        |c| c["status"] == "False" && c["message"].as_str().unwrap_or("").contains("already used"),
    )
    .await;
    eventually(
        "an Event for the refused route",
        Duration::from_secs(20),
        async || seed.event_about(b, "kube-apiserver").await,
    )
    .await;
    assert!(get(pki, gw.tls, A).await.unwrap().contains("hello from a"));

    // A route from a namespace the Gateway's listener does not admit:
    // not accepted, nothing served.
    seed.apply(seed.route(
        outsider,
        "kube-apiserver",
        "api.outsider.kube.test",
        "kube-apiserver",
    ))
    .await;
    seed.wait_route(
        "the outsider's route is not allowed",
        Duration::from_secs(20),
        outsider,
        "Accepted",
        |c| c["status"] == "False" && c["reason"] == "NotAllowedByListeners",
    )
    .await;

    // A missing backend Service: ResolvedRefs=False, BackendNotFound.
    seed.apply(seed.route(d, "kube-apiserver", "api.d.kube.test", "nothing-here"))
        .await;
    seed.wait_route(
        "BackendNotFound",
        Duration::from_secs(20),
        d,
        "ResolvedRefs",
        |c| c["status"] == "False" && c["reason"] == "BackendNotFound",
    )
    .await;
}

/// A SeedlinkPolicy's allow-list applies; what the CRD checks is refused
/// by the API server, what seedlink checks with status, the last valid
/// version in force.
async fn a_policy_applies_and_an_invalid_edit_keeps_the_last_valid_one(t: &Routes) {
    let Routes {
        pki, seed, gw, a, ..
    } = t;
    // An allow-list without us: refused; an invalid edit keeps it; a
    // valid one lets us in again.
    seed.apply(policy(a, "kube-apiserver", &["192.0.2.0/24"]))
        .await;
    eventually("the ACL applies", Duration::from_secs(20), async || {
        get(pki, gw.tls, A).await.is_err()
    })
    .await;
    eventually(
        "policy Accepted=True",
        Duration::from_secs(20),
        async || {
            seed.condition(POLICIES, "SeedlinkPolicy", a, "acl", "Accepted")
                .await
                .is_some_and(|c| c["status"] == "True")
        },
    )
    .await;
    // What the CRD can check, the API server refuses at once...
    let refused =
        kubeapi::try_apply(&seed.client, policy(a, "kube-apiserver", &["300.0.0.0/8"])).await;
    assert!(
        refused
            .err()
            .is_some_and(|e| e.to_string().contains("each entry must be a CIDR")),
        "the API server took an invalid CIDR"
    );
    // ...what only seedlink checks (a destination's form) is refused with
    // status, and the last valid version stays in force.
    let mut invalid = policy(a, "kube-apiserver", &["192.0.2.0/24"]);
    invalid["spec"]["destinations"] = json!(["not a destination"]);
    seed.apply(invalid).await;
    eventually("policy Invalid", Duration::from_secs(20), async || {
        seed.condition(POLICIES, "SeedlinkPolicy", a, "acl", "Accepted")
            .await
            .is_some_and(|c| c["reason"] == "Invalid")
    })
    .await;
    assert!(
        get(pki, gw.tls, A).await.is_err(),
        "an invalid edit must not open the route"
    );
    seed.apply(policy(a, "kube-apiserver", &["127.0.0.0/8"]))
        .await;
    eventually(
        "the new ACL admits us",
        Duration::from_secs(20),
        async || get(pki, gw.tls, A).await.is_ok(),
    )
    .await;
}

/// A terminating pod (ready=false) gets no new connections.
async fn a_terminating_pod_gets_no_new_connections(t: &Routes) {
    let Routes {
        pki, seed, gw, a, ..
    } = t;
    let port_a = t.port_a;
    // Pod 1 terminating (ready=false): new connections go to pod 2 only.
    seed.apply(slice(
        a,
        "kube-apiserver",
        port_a,
        &[(POD_1, false), (POD_2, true)],
    ))
    .await;
    eventually("only pod 2 answers", Duration::from_secs(20), async || {
        for _ in 0..12 {
            match get(pki, gw.tls, A).await {
                Ok(b) if b.contains("hello from a2") => {}
                _ => return false,
            }
        }
        true
    })
    .await;
}

/// Load on one route while another comes and goes, the watches expire
/// (410) and the API server is cut off and comes back: no request to the
/// unchanged route fails.
async fn an_unchanged_route_serves_through_churn_a_410_and_an_outage(t: &Routes) {
    let Routes {
        pki, seed, gw, c, ..
    } = t;
    let port_c = t.port_c;
    // Load on route a while route c comes and goes, the watches expire
    // (etcd compacted, the watches reset) and the API server
    // becomes unreachable and comes back.
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let load_stop = CancellationToken::new();
    let load = {
        let (pki, ok, failed, load_stop, addr) = (
            pki.clone(),
            ok.clone(),
            failed.clone(),
            load_stop.clone(),
            gw.tls,
        );
        tokio::spawn(async move {
            for _ in 0..100_000 {
                if load_stop.is_cancelled() {
                    break;
                }
                match get(&pki, addr, A).await {
                    Ok(b) if b.contains("hello from a2") => ok.fetch_add(1, Ordering::Relaxed),
                    Ok(b) => panic!("unexpected answer {b}"),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    seed.apply(service(c, "kube-apiserver")).await;
    seed.apply(slice(
        c,
        "kube-apiserver",
        port_c,
        &[(POD_1, true), (POD_2, true)],
    ))
    .await;
    for round in 0..6 {
        let reconnected = seed.proxy.accepted.load(Ordering::Relaxed);
        let lists = || {
            let user = format!("system:serviceaccount:{}:seedlink", seed.sys);
            seed.api
                .audit()
                .iter()
                .filter(|e| {
                    e["stage"] == "ResponseComplete"
                        && e["verb"] == "list"
                        && e["objectRef"]["resource"] == "tlsroutes"
                        && e["user"]["username"] == user.as_str()
                })
                .count()
        };
        let listed = lists();
        if round == 1 {
            // The TLSRoute watch loses the next event (the proxy resets its
            // connection instead of delivering it)...
            seed.proxy.set(Fault::ResetAfter(0));
        }
        seed.apply(seed.route(c, "kube-apiserver", C, "kube-apiserver"))
            .await;
        if round == 1 {
            eventually("a watch reconnects", Duration::from_secs(20), async || {
                seed.proxy.accepted.load(Ordering::Relaxed) > reconnected
            })
            .await;
            // ...and etcd is compacted past it, so the watch resumes from a
            // compacted version: 410 Gone, and seedlink re-lists.
            seed.api.compact().await;
            seed.proxy.set(Fault::Pass);
            eventually(
                "a re-list after 410 Gone",
                Duration::from_secs(60),
                async || lists() > listed,
            )
            .await;
        }
        eventually("route c serves", Duration::from_secs(30), async || {
            get(pki, gw.tls, C).await.is_ok()
        })
        .await;
        if round == 3 {
            // The API server is unreachable: the last snapshot keeps
            // serving and readiness stays true.
            seed.proxy.set(Fault::Blackhole);
            let (code, _) = gw.get("/readyz").await;
            assert_eq!(code, 200);
            assert!(get(pki, gw.tls, C).await.is_ok());
            seed.proxy.set(Fault::Pass);
        }
        assert!(seed.delete(ROUTES, "TLSRoute", c, "kube-apiserver").await);
        eventually("route c is gone", Duration::from_secs(30), async || {
            get(pki, gw.tls, C).await.is_err()
        })
        .await;
    }
    load_stop.cancel();
    load.await.unwrap();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert!(ok > 0, "no request completed");
    assert_eq!(
        failed,
        0,
        "{failed} of {} requests to the unchanged route failed",
        ok + failed
    );
}

/// The gateway's own file broken: a new route is not applied and its
/// status says so; the file fixed, it is.
async fn a_broken_gateway_file_holds_new_routes_back_and_says_so(t: &Routes) {
    let Routes {
        pki, seed, gw, e, ..
    } = t;
    // The gateway's own file broken: a new route is not applied, and its
    // status says so rather than claiming it is served; the file fixed,
    // it is.
    gw.write_config(&format!("{}bogus: 1\n", seed.gateway_yaml()));
    seed.apply(seed.route(e, "kube-apiserver", "api.e.kube.test", "kube-apiserver"))
        .await;
    seed.wait_route(
        "route e pending on the broken file",
        Duration::from_secs(20),
        e,
        "Accepted",
        |c| {
            c["status"] == "False"
                && c["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("configuration file is invalid")
        },
    )
    .await;
    // The running routes keep serving.
    assert!(get(pki, gw.tls, A).await.unwrap().contains("hello from a2"));
    gw.write_config(&seed.gateway_yaml());
    seed.wait_route(
        "route e accepted once the file is fixed",
        Duration::from_secs(20),
        e,
        "Accepted",
        |c| c["status"] == "True",
    )
    .await;
}

/// Thirty routes created at once become one snapshot or a few.
async fn a_burst_of_routes_is_a_few_snapshots(t: &Routes) {
    let Routes { seed, gw, .. } = t;
    // A burst: thirty routes created one after another become a few
    // snapshots, not thirty reloads.
    let burst: Vec<String> = {
        let mut v = Vec::new();
        for i in 0..30 {
            v.push(seed.tenant(&format!("burst-{i}"), true).await);
        }
        v
    };
    let generation = |body: String| -> u64 {
        serde_json::from_str::<Value>(&body).unwrap()["generation"]
            .as_u64()
            .unwrap()
    };
    let before = generation(gw.get("/config").await.1);
    for (i, ns) in burst.iter().enumerate() {
        seed.apply(seed.route(
            ns,
            "kube-apiserver",
            &format!("api.burst-{i}.kube.test"),
            "kube-apiserver",
        ))
        .await;
    }
    eventually(
        "the burst's last route is served",
        Duration::from_secs(20),
        async || {
            let (_, body) = gw.get("/config").await;
            body.contains("api.burst-29.kube.test")
        },
    )
    .await;
    let after = generation(gw.get("/config").await.1);
    eprintln!("a burst of 30 routes: {} reload(s)", after - before);
    // At most 500 ms after a burst's first event: routes applied one
    // after another on a busy machine make a few passes.
    assert!(
        after - before <= 10,
        "30 routes took {} reloads",
        after - before
    );
}

/// A deleted route stops serving; the Gateway's status was written only
/// when it changed.
async fn a_deleted_route_stops_and_status_was_written_on_change_only(t: &Routes) {
    let Routes {
        pki, seed, gw, a, ..
    } = t;
    // Deleting the route stops it.
    assert!(seed.delete(ROUTES, "TLSRoute", a, "kube-apiserver").await);
    eventually("route a is gone", Duration::from_secs(20), async || {
        get(pki, gw.tls, A).await.is_err()
    })
    .await;
    // The Gateway's status was written when it changed, never in a loop
    // (each write wakes the watch; an unchanged status is not written).
    let gateway_writes = seed.writers("gateways", &seed.sys, "status").len();
    assert!(
        (1..=40).contains(&gateway_writes),
        "{gateway_writes} Gateway status writes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_serve_and_one_writes_status_until_it_goes() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A, C]).unwrap());
    let seed = Seed::new(true).await;
    let port_a = seed.two_pods(&pki, 0, "a", &stop);
    let port_c = seed.two_pods(&pki, 1, "c", &stop);
    let token_b = seed.second_identity("seedlink-b").await;
    seed.gateway_object().await;
    let (a, c) = (
        seed.tenant("shoot--a", true).await,
        seed.tenant("shoot--c", true).await,
    );
    seed.apply(service(&a, "kube-apiserver")).await;
    seed.apply(slice(&a, "kube-apiserver", port_a, &[(POD_1, true)]))
        .await;
    seed.apply(seed.route(&a, "kube-apiserver", A, "kube-apiserver"))
        .await;
    let users = [
        format!("system:serviceaccount:{}:seedlink", seed.sys),
        format!("system:serviceaccount:{}:seedlink-b", seed.sys),
    ];
    let mut replicas = Vec::new();
    for (token, pod) in [(&seed.token, "replica-a"), (&token_b, "replica-b")] {
        replicas.push(seed.gateway_with_own_proxy(pod, token).await);
    }
    for gw in &replicas {
        assert!(get(&pki, gw.tls, A)
            .await
            .unwrap()
            .contains("hello from a1"));
    }
    eventually("route status", Duration::from_secs(20), async || {
        seed.condition(ROUTES, "TLSRoute", &a, "kube-apiserver", "Accepted")
            .await
            .is_some()
    })
    .await;
    let mut writers = seed.wait_writers("tlsroutes", &a, "status").await;
    writers.dedup();
    assert_eq!(writers.len(), 1, "status written by {writers:?}");
    let lease = seed.status_lease().await.unwrap();
    let leader = users.iter().position(|u| *u == writers[0]).unwrap();
    assert_eq!(
        lease["spec"]["holderIdentity"],
        ["replica-a", "replica-b"][leader]
    );

    // The writer is cut off from the API server (a partition): it stops
    // writing at its renew deadline; the other takes the lease over once
    // it saw it unchanged for a whole lease, and writes the status of a
    // route created meanwhile. Healed, the old writer writes nothing more.
    let follower = 1 - leader;
    let names = ["replica-a", "replica-b"];
    let holder = || async {
        seed.status_lease()
            .await
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
    };
    replicas[leader].api.as_ref().unwrap().set(Fault::Blackhole);
    eventually(
        "the follower takes the lease",
        Duration::from_secs(60),
        async || holder().await.as_deref() == Some(names[follower]),
    )
    .await;
    seed.apply(service(&c, "kube-apiserver")).await;
    seed.apply(slice(&c, "kube-apiserver", port_c, &[(POD_2, true)]))
        .await;
    seed.apply(seed.route(&c, "kube-apiserver", C, "kube-apiserver"))
        .await;
    eventually(
        "route c served by the new writer",
        Duration::from_secs(20),
        async || get(&pki, replicas[follower].tls, C).await.is_ok(),
    )
    .await;
    eventually(
        "the new writer writes status",
        Duration::from_secs(40),
        async || {
            seed.condition(ROUTES, "TLSRoute", &c, "kube-apiserver", "Accepted")
                .await
                .is_some()
        },
    )
    .await;
    replicas[leader].api.as_ref().unwrap().set(Fault::Pass);
    // The healed replica sees route c (and serves it) but is no writer: a
    // route changed after the heal gets its status from the new writer
    // only.
    eventually(
        "the healed replica serves route c",
        Duration::from_secs(30),
        async || get(&pki, replicas[leader].tls, C).await.is_ok(),
    )
    .await;
    seed.apply(seed.route(&c, "kube-apiserver", C, "nothing-here"))
        .await;
    seed.wait_route(
        "BackendNotFound on route c",
        Duration::from_secs(30),
        &c,
        "ResolvedRefs",
        |c| c["reason"] == "BackendNotFound",
    )
    .await;
    let c_writers = seed.wait_writers("tlsroutes", &c, "status").await;
    assert!(
        !c_writers.is_empty() && c_writers.iter().all(|u| *u == users[follower]),
        "two writers: {c_writers:?}"
    );
    assert_eq!(holder().await.as_deref(), Some(names[follower]));

    // The writer stops (SIGTERM): it releases the lease on its way out, so
    // the other need not wait out a lease.
    let mut gone = replicas.remove(follower);
    gone.gw.signal("TERM");
    assert!(
        gone.gw.wait_exit(Duration::from_secs(60)).is_some(),
        "the writer did not exit"
    );
    assert_ne!(
        holder().await.as_deref(),
        Some(names[follower]),
        "the lease was not released"
    );
    let lease = seed.status_lease().await.unwrap();
    assert!(lease["spec"]["leaseTransitions"].as_i64().unwrap_or(0) >= 1);
    stop.cancel();
}

fn tunnel_cluster(ns: &str, ca: Value) -> Value {
    json!({
        "apiVersion": "tunnel.seedlink.dev/v1alpha1", "kind": "TunnelCluster",
        "metadata": {"name": "tunnel", "namespace": ns},
        "spec": {"agentCA": ca}
    })
}

/// A started process that printed a ready line, and that line.
fn started(mut cmd: std::process::Command) -> (Proc, Value) {
    // SEEDLINK_TEST_LOG=info: the processes' log lines too.
    let log = std::env::var("SEEDLINK_TEST_LOG").unwrap_or_else(|_| "warn".into());
    let mut child = cmd
        .env("RUST_LOG", log)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready = common::tunnel_env::ready_line(&mut child);
    assert_eq!(ready["event"], "ready", "{ready}");
    (Proc(child), ready)
}

/// Starts `seedlink tunnel-agent` on loopback with a client certificate:
/// the agent and its admin address.
fn tunnel_agent(server: &str, seed_ca: &str, cert: &str, key: &str) -> (Proc, SocketAddr) {
    let cmd = seedlink_testkit::agent_cmd::AgentCmd::new(server)
        .mtls(seed_ca, cert, key)
        .fast_sync()
        .command();
    let (agent, ready) = started(cmd);
    let admin = ready["admin"].as_str().unwrap().parse().unwrap();
    (agent, admin)
}

/// The bed of `tunnel_clusters_come_from_objects_with_their_health_in_status`:
/// two tenants' TunnelClusters on the seed (shoot--a's CA in a Secret,
/// shoot--b's in a ConfigMap that does not exist yet), a tunnel-server
/// reading them as the ServiceAccount, and the files its agents need.
struct TunnelObjects {
    stop: CancellationToken,
    dir: tempfile::TempDir,
    seed: Seed,
    pki: seedlink::demo::Pki,
    shoot_a: seedlink::demo::Pki,
    shoot_b: seedlink::demo::Pki,
    echo: SocketAddr,
    /// shoot--a's and shoot--b's namespaces.
    a: String,
    b: String,
    kubeconfig: std::path::PathBuf,
    config: std::path::PathBuf,
    upgrade_socket: std::path::PathBuf,
    /// The server's agent endpoint and admin address.
    agents: String,
    admin: SocketAddr,
}

const TUNNELS: &str = "tunnel.seedlink.dev/v1alpha1";

impl TunnelObjects {
    /// The objects, then the server: the server and the bed.
    async fn start() -> (Proc, TunnelObjects) {
        let stop = CancellationToken::new();
        let dir = tempfile::tempdir().unwrap();
        let pki = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
        let shoot_a = seedlink::demo::Pki::generate(&[]).unwrap();
        let shoot_b = seedlink::demo::Pki::generate(&[]).unwrap();
        let echo = echo_backend(&stop).await;
        let seed = Seed::new(false).await;
        let kubeconfig = seed.kubeconfig("tunnel-server", &seed.token);
        let a = seed.tenant("shoot--a", false).await;
        let b = seed.tenant("shoot--b", false).await;
        seed.trust_binding(&a).await;
        seed.trust_binding(&b).await;
        seed.apply(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "agent-ca", "namespace": a,
                         "labels": {"seedlink.dev/tunnel-trust": "true"}},
            "stringData": {"ca.crt": shoot_a.ca_pem}
        }))
        .await;
        seed.apply(tunnel_cluster(
            &a,
            json!({"secret": "agent-ca", "key": "ca.crt"}),
        ))
        .await;
        // Its ConfigMap does not exist yet.
        seed.apply(tunnel_cluster(
            &b,
            json!({"configMap": "agent-ca", "key": "ca.crt"}),
        ))
        .await;
        let d = dir.path();
        let (config, upgrade_socket) = (d.join("tunnel.yaml"), d.join("upgrade.sock"));
        let mut bed = TunnelObjects {
            stop,
            dir,
            seed,
            pki,
            shoot_a,
            shoot_b,
            echo,
            a,
            b,
            kubeconfig,
            config,
            upgrade_socket,
            agents: String::new(),
            admin: "127.0.0.1:0".parse().unwrap(),
        };
        let server = bed.server();
        (server, bed)
    }

    /// Writes `name` into the bed's directory: its path.
    fn file(&self, name: &str, text: &str) -> String {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    /// The server's certificate and key.
    fn server_tls(&self) -> (String, String) {
        let (_, leaf) = &self.pki.servers[0];
        (
            self.file("tun.pem", &leaf.cert_pem),
            self.file("tun-key.pem", &leaf.key_pem),
        )
    }

    /// Starts the tunnel-server on its Kubernetes configuration (no
    /// cluster in the file, one frontend template) and records where it
    /// listens.
    fn server(&mut self) -> Proc {
        let (d, sys) = (self.dir.path().display(), &self.seed.sys);
        let (crt, key) = self.server_tls();
        std::fs::write(
            &self.config,
            format!(
                "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
clusters: []
frontend_templates:
  - {{name: uds, protocol: http-connect, unix: '{d}/{{cluster}}.sock'}}
kubernetes: {{lease: {sys}/seedlink-tunnel-status, trust_dir: '{d}/trust', replicas: {sys}/seedlink-internal, review_cidrs: ['127.0.0.1/32']}}
"
            ),
        )
        .unwrap();
        let mut cmd = self.server_cmd();
        cmd.env(
            "RUST_LOG",
            std::env::var("SERVER_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(std::process::Stdio::piped());
        let mut server = cmd.spawn().unwrap();
        let ready = common::tunnel_env::ready_line(&mut server);
        assert_eq!(ready["event"], "ready", "{ready}");
        self.agents = ready["agents"].as_str().unwrap().to_string();
        self.admin = ready["admin"].as_str().unwrap().parse().unwrap();
        Proc(server)
    }

    /// `seedlink tunnel-server` on the bed's file, as the ServiceAccount.
    fn server_cmd(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(seedlink_bin());
        cmd.args(["tunnel-server", "--config"])
            .arg(&self.config)
            .arg("--upgrade-socket")
            .arg(&self.upgrade_socket)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("POD_NAME", "tunnel-0");
        cmd
    }

    /// An agent of `shoot` (its client certificate) dialing `server`.
    fn agent(&self, server: &str, shoot: &seedlink::demo::Pki, name: &str) -> (Proc, SocketAddr) {
        let ca = self.file("seed-ca.pem", &self.pki.ca_pem);
        let crt = self.file(&format!("{name}.pem"), &shoot.client.cert_pem);
        let key = self.file(&format!("{name}-key.pem"), &shoot.client.key_pem);
        tunnel_agent(server, &ca, &crt, &key)
    }

    /// The frontend socket the template made for `ns`'s cluster.
    fn socket(&self, ns: &str) -> String {
        self.dir
            .path()
            .join(format!("{ns}.tunnel.sock"))
            .display()
            .to_string()
    }

    async fn object(&self, ns: &str) -> Option<Value> {
        self.seed.get(TUNNELS, "TunnelCluster", ns, "tunnel").await
    }

    /// The TunnelCluster's condition `type_`.
    async fn condition(&self, ns: &str, type_: &str) -> Option<Value> {
        self.object(ns).await?["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == type_)
            .cloned()
    }

    /// Replaces the EndpointSlice of the replicas' Service.
    async fn replicas(&self, endpoints: Value) {
        self.seed.replica_slice(endpoints).await;
    }
}

impl Seed {
    /// Replaces the EndpointSlice of the tunnel-server replicas' Service
    /// (`seedlink-internal` in the install namespace).
    async fn replica_slice(&self, endpoints: Value) {
        self.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "seedlink-internal-x1", "namespace": self.sys,
                         "labels": {"kubernetes.io/service-name": "seedlink-internal",
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "ports": [{"name": "kas", "port": 8090, "protocol": "TCP"}],
            "endpoints": endpoints
        }))
        .await;
    }
}

/// An agent's `/readyz` says `want`, within 30 s.
async fn agent_says(admin: SocketAddr, want: &str) {
    eventually(want, Duration::from_secs(30), async || {
        http_get(admin, "/readyz").await.1.contains(want)
    })
    .await;
}

/// `servercount` follows the replicas in the EndpointSlices of the Service
/// that selects them: three serving, one terminating but still serving
/// (being replaced: agents join its successor at once) and one not serving
/// are 4.
async fn servercount_follows_the_endpoint_slices(bed: &TunnelObjects) {
    bed.replicas(json!([
        {"addresses": ["10.99.2.1"], "conditions": {"ready": true, "serving": true, "terminating": false}},
        {"addresses": ["10.99.2.2"], "conditions": {"ready": true}},
        {"addresses": ["10.99.2.3"]},
        {"addresses": ["10.99.2.4"], "conditions": {"ready": false, "serving": true, "terminating": true}},
        {"addresses": ["10.99.2.5"], "conditions": {"ready": false, "serving": false}}
    ]))
    .await;
    eventually(
        "servercount follows the replicas",
        Duration::from_secs(30),
        async || {
            let (_, body) = http_get(bed.admin, "/api/state").await;
            serde_json::from_str::<Value>(&body).is_ok_and(|v| v["process"]["server_count"] == 4)
        },
    )
    .await;
}

/// shoot--a is Ready with no agent; shoot--b is refused for its missing
/// ConfigMap, with an Event.
async fn status_says_served_and_refused(bed: &TunnelObjects) {
    let (a, b) = (&bed.a, &bed.b);
    eventually(
        "shoot--a Ready, no agents",
        Duration::from_secs(20),
        async || {
            bed.condition(a, "Ready")
                .await
                .is_some_and(|c| c["status"] == "True")
                && bed
                    .condition(a, "AgentsConnected")
                    .await
                    .is_some_and(|c| c["status"] == "False" && c["reason"] == "NoAgents")
        },
    )
    .await;
    eventually(
        "shoot--b refused for its missing ConfigMap",
        Duration::from_secs(20),
        async || {
            bed.condition(b, "Ready")
                .await
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "ReferenceNotFound")
        },
    )
    .await;
    eventually(
        "an Event for shoot--b",
        Duration::from_secs(20),
        async || bed.seed.event_about(b, "tunnel").await,
    )
    .await;
}

/// shoot--a's agent, through the agents' load balancer (this replica and
/// a second one that starts later, health checked: skipped until it
/// listens): connected in status, and the tunnel works. The agent, its
/// admin address, the tunnel, and the second replica's port.
async fn shoot_a_connects(bed: &TunnelObjects) -> (Proc, SocketAddr, UnixStream, u16, Proc) {
    let second_port = free_port();
    let lb = format!("127.0.0.1:{}", free_port());
    let replicas = [bed.agents.clone(), format!("127.0.0.1:{second_port}")];
    let haproxy = common::tunnel_env::haproxy_lb(None, bed.dir.path(), &lb, &replicas, true);
    eventually(
        "the agents' load balancer",
        Duration::from_secs(20),
        async || tokio::net::TcpStream::connect(&lb).await.is_ok(),
    )
    .await;
    let (agent, admin) = bed.agent(&lb, &bed.shoot_a, "a");
    eventually(
        "shoot--a AgentsConnected",
        Duration::from_secs(20),
        async || {
            bed.condition(&bed.a, "AgentsConnected")
                .await
                .is_some_and(|c| c["status"] == "True")
                && bed.object(&bed.a).await.is_some_and(|o| {
                    o["status"]["agents"] == 1 && o["status"]["lastAgentSeen"].is_string()
                })
        },
    )
    .await;
    let to = bed.echo.to_string();
    let mut s = common::tunnel_env::kas_connect_eventually(
        &bed.socket(&bed.a),
        &to,
        Duration::from_secs(20),
    )
    .await;
    common::tunnel_env::echo_rtt(&mut s, 1000).await;
    (agent, admin, s, second_port, haproxy)
}

/// The agent holds its one stream and knows of 4 replicas: not ready. The
/// replicas change; the server tells its agents at once (REPLICAS),
/// without their 5-minute re-check: with one replica left it is ready, with
/// two again not.
async fn the_agent_follows_the_replicas(bed: &TunnelObjects, agent: SocketAddr) {
    agent_says(agent, "failed\nserver streams: 1 of 4 replicas").await;
    bed.replicas(json!([{"addresses": ["10.99.2.1"]}])).await;
    // Ready: the body starts with it (no failed check above it).
    eventually("ready with 1 of 1", Duration::from_secs(30), async || {
        http_get(agent, "/readyz")
            .await
            .1
            .starts_with("server streams: 1 of 1 replicas")
    })
    .await;
    bed.replicas(json!([{"addresses": ["10.99.2.1"]}, {"addresses": ["10.99.2.6"]}]))
        .await;
    agent_says(agent, "failed\nserver streams: 1 of 2 replicas").await;
}

/// The second replica starts (a file-configured server with the same
/// cluster): the agent, still dialing, joins it within seconds.
async fn a_second_replica_is_joined(bed: &TunnelObjects, agent: SocketAddr, port: u16) -> Proc {
    let state: Value = serde_json::from_str(&http_get(bed.admin, "/api/state").await.1).unwrap();
    let cluster_a = state["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .find(|n| n.contains(bed.a.as_str()))
        .unwrap();
    let a_ca = bed.file("a-ca.pem", &bed.shoot_a.ca_pem);
    let (crt, key) = bed.server_tls();
    let d = bed.dir.path().display();
    let cfg = bed.file(
        "tunnel-2.yaml",
        &format!(
            "agents: {{listen: '127.0.0.1:{port}', cert: '{crt}', key: '{key}', keepalive: 1s, keepalive_timeout: 1s}}
server_count: 2
clusters:
  - name: {cluster_a}
    agent_ca: '{a_ca}'
    frontends:
      - {{name: uds, protocol: http-connect, unix: '{d}/second.sock'}}
"
        ),
    );
    let mut second = std::process::Command::new(seedlink_bin());
    second.args(["tunnel-server", "--config", &cfg]);
    let (second, _) = started(second);
    eventually(
        "the agent holds both replicas",
        Duration::from_secs(30),
        async || {
            http_get(agent, "/readyz")
                .await
                .1
                .starts_with("server streams: 2 of 2 replicas")
        },
    )
    .await;
    second
}

/// The ConfigMap appears: shoot--b is served and its agent is let in;
/// shoot--a's tunnel `a` is not touched. shoot--b's agent and tunnel.
async fn shoot_b_is_served_once_its_ca_exists(
    bed: &TunnelObjects,
    a: &mut UnixStream,
) -> (Proc, UnixStream) {
    bed.seed
        .apply(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "agent-ca", "namespace": bed.b,
                         "labels": {"seedlink.dev/tunnel-trust": "true"}},
            "data": {"ca.crt": bed.shoot_b.ca_pem}
        }))
        .await;
    eventually("shoot--b Ready", Duration::from_secs(20), async || {
        bed.condition(&bed.b, "Ready")
            .await
            .is_some_and(|c| c["status"] == "True")
    })
    .await;
    let (agent, _) = bed.agent(&bed.agents, &bed.shoot_b, "b");
    let to = bed.echo.to_string();
    let mut sb = common::tunnel_env::kas_connect_eventually(
        &bed.socket(&bed.b),
        &to,
        Duration::from_secs(20),
    )
    .await;
    common::tunnel_env::echo_rtt(&mut sb, 1000).await;
    common::tunnel_env::echo_rtt(a, 1000).await;
    (agent, sb)
}

/// shoot--a's agent goes, and the status says so; then its object goes:
/// its socket stops answering and its trust files go, while shoot--b's
/// tunnel `b` goes on.
async fn shoot_a_leaves(bed: &TunnelObjects, agent: Proc, b: &mut UnixStream) {
    drop(agent);
    eventually(
        "shoot--a NoAgents again",
        Duration::from_secs(20),
        async || {
            bed.condition(&bed.a, "AgentsConnected")
                .await
                .is_some_and(|c| c["status"] == "False")
        },
    )
    .await;
    assert!(
        bed.seed
            .delete(TUNNELS, "TunnelCluster", &bed.a, "tunnel")
            .await
    );
    let (sock, to) = (bed.socket(&bed.a), bed.echo.to_string());
    eventually(
        "shoot--a's socket is gone",
        Duration::from_secs(20),
        async || common::tunnel_env::kas_connect(&sock, &to).await.is_err(),
    )
    .await;
    let trust = bed.dir.path().join(format!("trust/{}.tunnel", bed.a));
    eventually(
        "shoot--a's trust files are removed",
        Duration::from_secs(10),
        async || !trust.exists(),
    )
    .await;
    common::tunnel_env::echo_rtt(b, 1000).await;
}

/// A binary upgrade: the new process takes the TunnelCluster's socket
/// (made from the objects, not the file) with the rest; shoot--b's agent
/// moves to it, a new tunnel goes through it, and the one opened before
/// (`b`) goes on through the old process until it ends.
async fn an_upgrade_takes_the_object_made_socket(
    bed: &TunnelObjects,
    mut old: Proc,
    mut b: UnixStream,
) -> Proc {
    let mut next = bed.server_cmd();
    next.args(["--take-over", "--take-over-wait", "20"]);
    let (next, _) = started(next);
    let to = bed.echo.to_string();
    let mut b2 = common::tunnel_env::kas_connect_eventually(
        &bed.socket(&bed.b),
        &to,
        Duration::from_secs(20),
    )
    .await;
    common::tunnel_env::echo_rtt(&mut b2, 1000).await;
    assert!(
        old.0.try_wait().unwrap().is_none(),
        "the old process drains while its tunnel is open"
    );
    common::tunnel_env::echo_rtt(&mut b, 1000).await;
    drop(b);
    eventually(
        "the old process exits",
        Duration::from_secs(30),
        async || old.0.try_wait().unwrap().is_some(),
    )
    .await;
    common::tunnel_env::echo_rtt(&mut b2, 1000).await;
    next
}

/// A TunnelCluster whose agents present ServiceAccount tokens checked by a
/// TokenReview at the shoot's kube-apiserver (here the test's API server,
/// at an address the operator allows with `kubernetes.review_cidrs`), as
/// the namespace's own credentials: the agent joins and carries a dial,
/// and the review was asked as that identity (the audit log). Another
/// tenant's TunnelCluster pointing its review at a Service of the first
/// tenant's namespace is refused, with the reason on its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_clusters_agents_are_checked_by_a_token_review() {
    let (_server, bed) = TunnelObjects::start().await;
    let seed = &bed.seed;
    let t = seed.tenant("shoot--t", false).await;
    seed.trust_binding(&t).await;
    for sa in ["agent", "reviewer"] {
        seed.apply(json!({"apiVersion": "v1", "kind": "ServiceAccount",
                          "metadata": {"name": sa, "namespace": t}}))
            .await;
    }
    seed.apply(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": format!("{t}-reviewer")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "system:auth-delegator"},
        "subjects": [{"kind": "ServiceAccount", "name": "reviewer", "namespace": t}]
    }))
    .await;
    let reviewer = seed.api.token(&seed.client, &t, "reviewer").await;
    let trust = json!({"seedlink.dev/tunnel-trust": "true"});
    seed.apply(json!({"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": "reviewer", "namespace": t, "labels": trust},
                      "stringData": {"token": reviewer}}))
        .await;
    let ca = std::fs::read_to_string(&seed.api.ca).unwrap();
    seed.apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": "kas-ca", "namespace": t, "labels": trust},
                      "data": {"ca.crt": ca}}))
        .await;
    let review = |url: &str| json!({"url": url, "ca": {"configMap": "kas-ca", "key": "ca.crt"}, "credentials": "reviewer"});
    let token_cluster = |ns: &str, url: &str| {
        json!({
            "apiVersion": TUNNELS, "kind": "TunnelCluster",
            "metadata": {"name": "tunnel", "namespace": ns},
            "spec": {"agentToken": {"issuer": seed.api.issuer,
                                    "serviceAccount": format!("{t}/agent"),
                                    "review": review(url)}}
        })
    };
    seed.apply(token_cluster(&t, &seed.api.url)).await;
    let token = seed
        .api
        .token_for(&seed.client, &t, "agent", "system:konnectivity-server")
        .await;
    let tok = bed.file("agent.token", &token);
    let seed_ca = bed.file("seed-ca.pem", &bed.pki.ca_pem);
    let (_agent, _) = started(
        seedlink_testkit::agent_cmd::AgentCmd::new(&bed.agents)
            .args(["--ca-cert", &seed_ca, "--service-account-token-path", &tok])
            .fast_sync()
            .command(),
    );
    eventually(
        "the reviewed agent connected",
        Duration::from_secs(30),
        async || {
            bed.object(&t)
                .await
                .is_some_and(|o| o["status"]["agents"] == 1)
        },
    )
    .await;
    let mut s = common::tunnel_env::kas_connect_eventually(
        &bed.socket(&t),
        &bed.echo.to_string(),
        Duration::from_secs(20),
    )
    .await;
    common::tunnel_env::echo_rtt(&mut s, 100).await;
    let me = format!("system:serviceaccount:{t}:reviewer");
    assert!(
        seed.api
            .audit()
            .iter()
            .any(|e| e["objectRef"]["resource"] == "tokenreviews"
                && e["user"]["username"] == me.as_str()),
        "no TokenReview by {me}"
    );
    // Another tenant points its review at the first tenant's Service.
    let h = seed.tenant("shoot--h", false).await;
    seed.trust_binding(&h).await;
    seed.apply(token_cluster(
        &h,
        &format!("https://kube-apiserver.{t}.svc"),
    ))
    .await;
    eventually(
        "the other tenant's review refused",
        Duration::from_secs(30),
        async || {
            bed.condition(&h, "Ready").await.is_some_and(|c| {
                c["status"] == "False"
                    && c["reason"] == "InvalidSpec"
                    && c["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("agentToken.review.url"))
            })
        },
    )
    .await;
    bed.stop.cancel();
}

/// Tenant namespaces the connection test serves, and the watches it
/// lets share one connection (the default is 200; a small cap shows the
/// spreading with a few namespaces).
const CONN_TENANTS: usize = 12;
const CONN_WATCHES: usize = 4;

/// The tunnel-server reaches the API server over HTTP/2: its per-namespace
/// trust watches (one per tenant namespace) share connections, at most
/// `watches_per_connection` on each, instead of holding one connection
/// each as over HTTP/1.1. Every tenant is served through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_connections_do_not_grow_with_tenant_namespaces() {
    let bed = ConnBed::start("namespaces").await;
    // The main connection (requests and the TunnelCluster watch) and one
    // per CONN_WATCHES namespaces; one more of slack for a connection the
    // API server or a busy machine ended meanwhile. Over HTTP/1.1 it was
    // one per watch at least: CONN_TENANTS + 1.
    let accepted = bed.proxy.accepted.load(Ordering::Relaxed);
    let most = 1 + CONN_TENANTS.div_ceil(CONN_WATCHES) as u64 + 1;
    assert!(
        accepted <= most,
        "{accepted} connections to the API server for {CONN_TENANTS} tenant namespaces (at most {most} expected)"
    );
    // The source's metrics and its section of the live page say the same.
    let clients = 1 + CONN_TENANTS.div_ceil(CONN_WATCHES);
    let (_, metrics) = http_get(bed.admin, "/metrics").await;
    let sample = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(name));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
    };
    assert_eq!(
        sample("seedlink_kubernetes_api_connections{source=\"tunnel\"}"),
        clients as f64
    );
    assert!(sample("seedlink_kubernetes_watches{source=\"tunnel\"}") >= (CONN_TENANTS + 1) as f64);
    assert!(
        sample("seedlink_kubernetes_status_writes_total{source=\"tunnel\",outcome=\"written\"}")
            >= CONN_TENANTS as f64
    );
    let (_, state) = http_get(bed.admin, "/api/state").await;
    let state: Value = serde_json::from_str(&state).unwrap();
    let section = &state["sections"][0];
    assert_eq!(section["title"], "Kubernetes source (tunnel)", "{state}");
    assert!(
        section["lines"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l[0] == "API server connections"
                && l[1].as_str() == Some(clients.to_string().as_str())),
        "{section}"
    );
}

/// Past the watches `kubernetes.max_api_connections` leaves (here 2: the
/// main connection and one of CONN_WATCHES watches), the other tenant
/// namespaces' trust is listed again on a pace: the connections stay at
/// the bound, every tenant is still served, and a CA replaced in a
/// namespace past the bound reaches the server (within the pace's 10 s
/// interval; the bound here is generous).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trust_past_the_connection_bound_is_listed_on_a_pace() {
    let bed = ConnBed::start_with("namespaces", "max_api_connections: 2").await;
    // The two, and one of slack for a connection ended meanwhile.
    let accepted = bed.proxy.accepted.load(Ordering::Relaxed);
    assert!(
        accepted <= 3,
        "{accepted} connections to the API server for {CONN_TENANTS} tenant namespaces (at most 3 expected)"
    );
    let (_, metrics) = http_get(bed.admin, "/metrics").await;
    let polled = CONN_TENANTS - CONN_WATCHES;
    for line in [
        "seedlink_kubernetes_api_connections{source=\"tunnel\"} 2\n".to_string(),
        format!("seedlink_kubernetes_trust_polled_namespaces{{source=\"tunnel\"}} {polled}\n"),
    ] {
        assert!(metrics.contains(&line), "no {line:?} in:\n{metrics}");
    }
    // Watched are the first CONN_WATCHES namespaces by name (conn-0,
    // conn-1, conn-10, conn-11): conn-5 is listed on the pace.
    let ns = "conn-5";
    let ca = seedlink::demo::Pki::generate(&[]).unwrap().ca_pem;
    kubeapi::apply(
        &bed.client,
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "agent-ca", "namespace": ns,
                            "labels": {"seedlink.dev/tunnel-trust": "true"}},
               "data": {"ca.crt": ca}}),
    )
    .await;
    let file = bed
        ._dir
        .path()
        .join(format!("trust/{ns}.tunnel/configmap-agent-ca-ca.crt"));
    eventually(
        "the replaced CA in the server's trust directory",
        Duration::from_secs(90),
        async || std::fs::read_to_string(&file).is_ok_and(|t| t == ca),
    )
    .await;
    // Two watched tenants leave: their watches go to the first two
    // namespaces on the pace (conn-2, conn-3), each taking over once
    // listed, on the same connections; those tenants stay served.
    for ns in ["conn-0", "conn-1"] {
        assert!(kubeapi::delete(&bed.client, TUNNELS, "TunnelCluster", ns, "tunnel").await);
    }
    let fewer = format!(
        "seedlink_kubernetes_trust_polled_namespaces{{source=\"tunnel\"}} {}\n",
        polled - 2
    );
    eventually(
        "two namespaces watched instead of listed on the pace",
        Duration::from_secs(60),
        async || http_get(bed.admin, "/metrics").await.1.contains(&fewer),
    )
    .await;
    for ns in ["conn-2", "conn-3"] {
        let o = kubeapi::get(&bed.client, TUNNELS, "TunnelCluster", ns, "tunnel").await;
        let ready = o.and_then(|o| o["status"]["conditions"].as_array().cloned());
        assert!(
            ready.is_some_and(|c| c
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")),
            "{ns} not Ready"
        );
    }
    let accepted = bed.proxy.accepted.load(Ordering::Relaxed);
    assert!(accepted <= 3, "{accepted} connections to the API server");
}

/// `trust_watch: cluster`: the labelled trust of every tenant namespace
/// comes from one watch of each kind across the cluster (bound
/// cluster-wide, no RoleBinding in any tenant namespace), so the
/// tunnel-server holds one connection whatever the tenant count, and
/// every tenant is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_wide_trust_watch_holds_one_connection_whatever_the_tenants() {
    let bed = ConnBed::start("cluster").await;
    // One (the main one), and one of slack for a connection the API
    // server or a busy machine ended meanwhile.
    let accepted = bed.proxy.accepted.load(Ordering::Relaxed);
    assert!(
        accepted <= 2,
        "{accepted} connections to the API server for {CONN_TENANTS} tenant namespaces (at most 2 expected)"
    );
    let (_, metrics) = http_get(bed.admin, "/metrics").await;
    assert!(
        metrics.contains("seedlink_kubernetes_api_connections{source=\"tunnel\"} 1\n"),
        "{metrics}"
    );
}

/// [`CONN_TENANTS`] tenant namespaces, each with a TunnelCluster naming a
/// labelled ConfigMap, served by a tunnel-server reaching its own API
/// server through a proxy that counts connections, its trust watched as
/// `trust_watch` says (bound per namespace or cluster-wide to match);
/// started once every tenant is Ready.
struct ConnBed {
    proxy: FaultProxy,
    admin: SocketAddr,
    client: kube::Client,
    _server: Proc,
    _dir: tempfile::TempDir,
    _api: KubeApi,
}

/// An API server of this test's own, with seedlink's CRDs (started off
/// the runtime's threads).
async fn own_api() -> KubeApi {
    tokio::task::spawn_blocking(|| {
        KubeApi::start_with(kubeapi::Options {
            crds: true,
            ..Default::default()
        })
    })
    .await
    .unwrap()
}

impl ConnBed {
    async fn start(trust_watch: &str) -> ConnBed {
        ConnBed::start_with(trust_watch, "").await
    }

    /// With `more` in the `kubernetes` section (`key: value`).
    async fn start_with(trust_watch: &str, more: &str) -> ConnBed {
        // An API server of its own: the tunnel-server follows every
        // TunnelCluster's namespace, and the shared one holds other tests'.
        let api = own_api().await;
        let client = api.client().await.unwrap();
        let sys = "seedlink-system";
        kubeapi::apply(
            &client,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": sys}}),
        )
        .await;
        let token = api.install_rbac(&client, sys).await;
        let binding = |kind: &str, ns: Option<&str>| {
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind,
                   "metadata": {"name": "seedlink-tunnel-trust", "namespace": ns},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": format!("seedlink-tunnel-trust-{sys}")},
                   "subjects": [{"kind": "ServiceAccount", "name": "seedlink", "namespace": sys}]})
        };
        let cluster_wide = trust_watch == "cluster";
        if cluster_wide {
            kubeapi::apply(&client, binding("ClusterRoleBinding", None)).await;
        }
        let dir = tempfile::tempdir().unwrap();
        let proxy = FaultProxy::start(api.addr, Fault::Pass).await;
        let kubeconfig = api.kubeconfig(dir.path(), "tunnel-server", &token, Some(proxy.addr));
        let mut tenants = Vec::new();
        for i in 0..CONN_TENANTS {
            let ns = format!("conn-{i}");
            let ca = seedlink::demo::Pki::generate(&[]).unwrap().ca_pem;
            let mut objects = vec![
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "agent-ca", "namespace": ns,
                                    "labels": {"seedlink.dev/tunnel-trust": "true"}},
                       "data": {"ca.crt": ca}}),
                tunnel_cluster(&ns, json!({"configMap": "agent-ca", "key": "ca.crt"})),
            ];
            if !cluster_wide {
                objects.insert(1, binding("RoleBinding", Some(&ns)));
            }
            for o in objects {
                kubeapi::apply(&client, o).await;
            }
            tenants.push(ns);
        }
        let pki = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
        let (_, leaf) = &pki.servers[0];
        let (crt, key) = (dir.path().join("tun.pem"), dir.path().join("tun-key.pem"));
        std::fs::write(&crt, &leaf.cert_pem).unwrap();
        std::fs::write(&key, &leaf.key_pem).unwrap();
        let d = dir.path().display();
        let more = match more {
            "" => String::new(),
            m => format!(", {m}"),
        };
        let config = dir.path().join("tunnel.yaml");
        std::fs::write(
            &config,
            format!(
                "agents: {{listen: '127.0.0.1:0', cert: '{}', key: '{}'}}
admin: {{listen: '127.0.0.1:0'}}
clusters: []
frontend_templates:
  - {{name: uds, protocol: http-connect, unix: '{d}/{{cluster}}.sock'}}
kubernetes: {{lease: {sys}/seedlink-tunnel-status, trust_dir: '{d}/trust', watches_per_connection: {CONN_WATCHES}, trust_watch: {trust_watch}{more}}}
",
                crt.display(),
                key.display()
            ),
        )
        .unwrap();
        let mut cmd = std::process::Command::new(seedlink_bin());
        cmd.args(["tunnel-server", "--config"])
            .arg(&config)
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAME", "tunnel-0");
        let (server, ready) = started(cmd);
        let admin: SocketAddr = ready["admin"].as_str().unwrap().parse().unwrap();
        for ns in &tenants {
            eventually(
                &format!("{ns} Ready"),
                Duration::from_secs(60),
                async || {
                    let o = kubeapi::get(&client, TUNNELS, "TunnelCluster", ns, "tunnel").await;
                    o.and_then(|o| o["status"]["conditions"].as_array().cloned())
                        .is_some_and(|c| {
                            c.iter()
                                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                        })
                },
            )
            .await;
        }
        ConnBed {
            proxy,
            admin,
            client,
            _server: server,
            _dir: dir,
            _api: api,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_clusters_come_from_objects_with_their_health_in_status() {
    let (server, bed) = TunnelObjects::start().await;
    servercount_follows_the_endpoint_slices(&bed).await;
    status_says_served_and_refused(&bed).await;
    let (agent_a, admin_a, mut a, second_port, _lb) = shoot_a_connects(&bed).await;
    the_agent_follows_the_replicas(&bed, admin_a).await;
    let _second = a_second_replica_is_joined(&bed, admin_a, second_port).await;
    let (_agent_b, mut b) = shoot_b_is_served_once_its_ca_exists(&bed, &mut a).await;
    shoot_a_leaves(&bed, agent_a, &mut b).await;
    let _next = an_upgrade_takes_the_object_made_socket(&bed, server, b).await;
    bed.stop.cancel();
}

/// The tunnel-server replicas of [`replicas_are_reached_without_a_load_balancer`]:
/// each "pod" `tunnel-<i>` on 10.99.3.<i> in the seed's network namespace,
/// its agent port 8091 reached by no load balancer.
struct NoLb {
    seed: Seed,
    pki: seedlink::demo::Pki,
    shoot: seedlink::demo::Pki,
}

impl NoLb {
    /// Pod `i`'s address.
    fn pod(i: usize) -> String {
        format!("10.99.3.{i}")
    }

    /// Writes `name` into the seed's directory: its path.
    fn file(&self, name: &str, text: &str) -> String {
        let p = self.seed.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    /// The frontend socket of replica `i`.
    fn socket(&self, i: usize) -> String {
        self.seed
            .dir
            .path()
            .join(format!("r{i}.sock"))
            .display()
            .to_string()
    }

    /// Replicas `1..=n` serving, as their Service's EndpointSlice says.
    async fn serving(&self, n: usize) {
        let eps: Vec<Value> = (1..=n)
            .map(|i| {
                json!({"addresses": [NoLb::pod(i)], "conditions": {"ready": true},
                       "targetRef": {"kind": "Pod", "name": format!("tunnel-{i}"), "namespace": self.seed.sys}})
            })
            .collect();
        self.seed.replica_slice(json!(eps)).await;
    }

    /// Starts replica `i` in the seed's network namespace, as the
    /// ServiceAccount, telling agents where each replica is.
    fn replica(&self, i: usize) -> Proc {
        let (ns, _) = self.seed.net.as_ref().unwrap();
        ns.run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/32", NoLb::pod(i)),
            "dev",
            "lo",
        ]);
        let (_, leaf) = &self.pki.servers[0];
        let crt = self.file("tun.pem", &leaf.cert_pem);
        let key = self.file("tun-key.pem", &leaf.key_pem);
        let ca = self.file("shoot-ca.pem", &self.shoot.ca_pem);
        let (d, sys) = (self.seed.dir.path().display(), &self.seed.sys);
        let cfg = self.file(
            &format!("tunnel-{i}.yaml"),
            &format!(
                "agents: {{listen: '{pod}:8091', cert: '{crt}', key: '{key}', keepalive: 1s, keepalive_timeout: 1s}}
clusters:
  - name: shoot
    agent_ca: '{ca}'
    frontends:
      - {{name: uds, protocol: http-connect, unix: '{d}/r{i}.sock'}}
kubernetes: {{lease: {sys}/seedlink-tunnel-status, write_status: false, trust_dir: '{d}/trust-{i}',
  replicas: {sys}/seedlink-internal, replica_addresses: {{address: '{{ip}}:8091'}}}}
",
                pod = NoLb::pod(i)
            ),
        );
        let name = format!("tunnel-{i}");
        let kc = self.seed.kubeconfig(&name, &self.seed.token);
        let mut cmd = ns.cmd(&[seedlink_bin()]);
        cmd.args(["tunnel-server", "--config", &cfg])
            .env("KUBECONFIG", &kc)
            .env("POD_NAME", &name);
        started(cmd).0
    }

    /// Every replica `1..=n` carries a dial of the shoot's cluster.
    async fn each_dials(&self, n: usize) {
        for i in 1..=n {
            let to = format!("{}:8091", NoLb::pod(1));
            let s = common::tunnel_env::kas_connect_eventually(
                &self.socket(i),
                &to,
                Duration::from_secs(30),
            )
            .await;
            drop(s);
        }
    }
}

/// HA without a load balancer: 3 tunnel-server replicas, each "pod" on
/// its own address, tell their agents where each replica is (REPLICAS
/// with `kubernetes.replica_addresses`, from the replicas' EndpointSlice).
/// An agent given one replica's address holds a stream to all 3, to 5
/// when 2 more start, and to 3 again when those 2 drain; every replica
/// carries the cluster's dials throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_reached_without_a_load_balancer() {
    let bed = NoLb {
        seed: Seed::own(true).await,
        pki: seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap(),
        shoot: seedlink::demo::Pki::generate(&[]).unwrap(),
    };
    bed.serving(3).await;
    let mut replicas: Vec<Proc> = (1..=3).map(|i| bed.replica(i)).collect();
    let (ns, dialer) = bed.seed.net.as_ref().unwrap();
    let seed_ca = bed.file("seed-ca.pem", &bed.pki.ca_pem);
    let crt = bed.file("agent.pem", &bed.shoot.client.cert_pem);
    let key = bed.file("agent-key.pem", &bed.shoot.client.key_pem);
    let args = seedlink_testkit::agent_cmd::AgentCmd::new(&format!("{}:8091", NoLb::pod(1)))
        .mtls(&seed_ca, &crt, &key)
        .fast_sync()
        .to_args();
    let mut cmd = ns.cmd(&[seedlink_bin()]);
    cmd.args(&args);
    let (_agent, ready) = started(cmd);
    let inner: SocketAddr = ready["admin"].as_str().unwrap().parse().unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = FaultProxy::start_with(l, Some(dialer.clone()), inner, Fault::Pass);
    let holds = |n: usize| {
        let want = format!("server streams: {n} of {n} replicas ({n} in all)");
        async move {
            eventually(&want.clone(), Duration::from_secs(60), async || {
                http_get(admin.addr, "/readyz").await.1.starts_with(&want)
            })
            .await;
        }
    };
    holds(3).await;
    bed.each_dials(3).await;
    // Scaled to 5: both new replicas are joined, through their addresses.
    replicas.extend((4..=5).map(|i| bed.replica(i)));
    bed.serving(5).await;
    holds(5).await;
    bed.each_dials(5).await;
    // And back to 3: the 2 go (out of the EndpointSlice, then drained).
    bed.serving(3).await;
    let gone: Vec<Proc> = replicas.drain(3..).collect();
    for r in &gone {
        signal(r.0.id(), "-TERM");
    }
    holds(3).await;
    bed.each_dials(3).await;
}

/// Gateway API v1.7.0's CRDs (standard channel, as released) installed
/// over v1.6.3's: a route is served through them, and the GatewayClass
/// says v1.7.0 is supported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_served_through_gateway_api_v1_7s_crds() {
    let api = KubeApi::start_with(kubeapi::Options {
        crds: true,
        ..Default::default()
    });
    let crds = api.kube_dir.join("crds/gateway-api-v1.7.0");
    assert!(
        crds.join("VERSION").exists(),
        "{} is missing: run scripts/install-peers",
        crds.display()
    );
    let o = std::process::Command::new(api.kube_dir.join("bin/kubectl"))
        .arg(format!("--kubeconfig={}", api.admin_kubeconfig.display()))
        .args(["apply", "--server-side", "--force-conflicts", "-f"])
        .arg(&crds)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let client = api.client().await.unwrap();
    let gateway = "gateway.networking.k8s.io/v1";
    for o in [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "seedlink-system"}}),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tenant"}}),
        json!({"apiVersion": gateway, "kind": "GatewayClass", "metadata": {"name": "seedlink"},
               "spec": {"controllerName": "seedlink.dev/gateway"}}),
        json!({"apiVersion": gateway, "kind": "Gateway",
               "metadata": {"name": "seedlink", "namespace": "seedlink-system"},
               "spec": {"gatewayClassName": "seedlink",
                        "listeners": [{"name": "tls", "port": 443, "protocol": "TLS",
                                       "tls": {"mode": "Passthrough"},
                                       "allowedRoutes": {"namespaces": {"from": "All"}}}]}}),
        json!({"apiVersion": gateway, "kind": "TLSRoute",
               "metadata": {"name": "kube-apiserver", "namespace": "tenant"},
               "spec": {"parentRefs": [{"name": "seedlink", "namespace": "seedlink-system"}],
                        "hostnames": ["api.v17.kube.test"],
                        "rules": [{"backendRefs": [{"name": "kube-apiserver", "port": 443}]}]}}),
        service("tenant", "kube-apiserver"),
        slice("tenant", "kube-apiserver", 6443, &[(POD_1, true)]),
    ] {
        kubeapi::apply(&client, o).await;
    }
    let gw = Gw::start_with_env(
        "admin: {listen: '127.0.0.1:0'}\nlisteners: [{name: tls, address: '127.0.0.1:0'}]\nkubernetes: {gateway: seedlink-system/seedlink}\n",
        &[("KUBECONFIG", api.admin_kubeconfig.to_str().unwrap()), ("POD_NAME", "seedlink-0")],
    );
    eventually("the route is served", Duration::from_secs(60), async || {
        let (_, body) = http_get(gw.admin, "/config").await;
        body.contains("api.v17.kube.test") && body.contains(&format!("{POD_1}:6443"))
    })
    .await;
    eventually("v1.7.0 supported", Duration::from_secs(60), async || {
        let c = kubeapi::get(&client, gateway, "GatewayClass", "", "seedlink")
            .await
            .unwrap_or_default();
        c["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter().any(|c| {
                c["type"] == "SupportedVersion"
                    && c["status"] == "True"
                    && c["message"].as_str().is_some_and(|m| m.contains("v1.7.0"))
            })
        })
    })
    .await;
}

/// Gateway API v1.4.1's experimental TLSRoute CRD (what platforms such as
/// Kamaji installed before TLSRoute went v1) serves only v1alpha2 and
/// v1alpha3: seedlink reads routes through the newest version served and
/// writes their status through it; a route written as v1alpha2 is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_read_through_the_version_the_installed_crd_serves() {
    let api = KubeApi::start_with(kubeapi::Options {
        crds: true,
        ..Default::default()
    });
    let old = api
        .kube_dir
        .join("crds/gateway-api-v1.4.1-experimental/tlsroutes.yaml");
    assert!(
        old.exists(),
        "{} is missing: run scripts/install-peers",
        old.display()
    );
    let kubectl = |args: &[&str]| {
        let o = std::process::Command::new(api.kube_dir.join("bin/kubectl"))
            .arg(format!("--kubeconfig={}", api.admin_kubeconfig.display()))
            .args(args)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
        )
    };
    let (ok, out) = kubectl(&[
        "delete",
        "crd",
        "tlsroutes.gateway.networking.k8s.io",
        "--wait=true",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = kubectl(&["apply", "--server-side", "-f", old.to_str().unwrap()]);
    assert!(ok, "{out}");
    eventually(
        "v1alpha2 TLSRoutes served",
        Duration::from_secs(60),
        async || kubectl(&["get", "tlsroutes.v1alpha2.gateway.networking.k8s.io", "-A"]).0,
    )
    .await;
    assert!(!kubectl(&["get", "tlsroutes.v1.gateway.networking.k8s.io", "-A"]).0);

    let client = api.client().await.unwrap();
    for o in [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "seedlink-system"}}),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tenant"}}),
        json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
               "metadata": {"name": "seedlink", "namespace": "seedlink-system"},
               "spec": {"gatewayClassName": "seedlink",
                        "listeners": [{"name": "tls", "port": 443, "protocol": "TLS",
                                       "tls": {"mode": "Passthrough"},
                                       "allowedRoutes": {"namespaces": {"from": "All"}}}]}}),
        json!({"apiVersion": "gateway.networking.k8s.io/v1alpha2", "kind": "TLSRoute",
               "metadata": {"name": "kube-apiserver", "namespace": "tenant"},
               "spec": {"parentRefs": [{"name": "seedlink", "namespace": "seedlink-system"}],
                        "hostnames": ["api.old.kube.test"],
                        "rules": [{"backendRefs": [{"name": "kube-apiserver", "port": 443}]}]}}),
        service("tenant", "kube-apiserver"),
        slice("tenant", "kube-apiserver", 6443, &[(POD_1, true)]),
    ] {
        kubeapi::apply(&client, o).await;
    }
    let gw = Gw::start_with_env(
        "admin: {listen: '127.0.0.1:0'}\nlisteners: [{name: tls, address: '127.0.0.1:0'}]\nkubernetes: {gateway: seedlink-system/seedlink}\n",
        &[("KUBECONFIG", api.admin_kubeconfig.to_str().unwrap()), ("POD_NAME", "seedlink-0")],
    );
    eventually(
        "the v1alpha2 route is served",
        Duration::from_secs(60),
        async || {
            let (_, body) = http_get(gw.admin, "/config").await;
            body.contains("api.old.kube.test") && body.contains(&format!("{POD_1}:6443"))
        },
    )
    .await;
    eventually(
        "its status, written through v1alpha3",
        Duration::from_secs(60),
        async || {
            kubeapi::get(
                &client,
                "gateway.networking.k8s.io/v1alpha2",
                "TLSRoute",
                "tenant",
                "kube-apiserver",
            )
            .await
            .is_some_and(|r| {
                r["status"]["parents"].as_array().is_some_and(|ps| {
                    ps.iter().any(|p| {
                        p["controllerName"] == "seedlink.dev/gateway"
                            && p["conditions"].as_array().is_some_and(|cs| {
                                cs.iter()
                                    .any(|c| c["type"] == "Accepted" && c["status"] == "True")
                            })
                    })
                })
            })
        },
    )
    .await;
    // What it was read through: the audit log's status writes name the version.
    // kube-apiserver logs a write's ResponseComplete stage after the client
    // has its answer, so the entry may trail the status just seen.
    let status_writes = || -> Vec<String> {
        api.audit()
            .iter()
            .filter(|e| {
                e["objectRef"]["resource"] == "tlsroutes"
                    && e["objectRef"]["subresource"] == "status"
            })
            .filter_map(|e| e["objectRef"]["apiVersion"].as_str().map(str::to_string))
            .collect()
    };
    eventually(
        "the status write in the audit log",
        Duration::from_secs(60),
        async || !status_writes().is_empty(),
    )
    .await;
    let versions = status_writes();
    assert!(
        !versions.is_empty() && versions.iter().all(|v| v == "v1alpha3"),
        "{versions:?}"
    );
}

/// Every Gateway of a class at its own address (`kubernetes.gateway_class`),
/// with the RBAC docs/KUBERNETES.md names for it: two tenants' Gateways
/// route the same host name, each to its own backend, and neither is
/// reachable through the other's address; a Gateway deleted takes its
/// address's routes with it, and seedlink removes its entries from the
/// route's status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_gateway_of_the_class_is_served_at_its_own_address() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A]).unwrap());
    let seed = Seed::new(true).await;
    let port = seed.two_pods(&pki, 0, "pod", &stop);
    let (ns, dialer) = seed.net.as_ref().unwrap();
    const POOL: [&str; 2] = ["10.99.1.1", "10.99.1.2"];
    for a in POOL {
        ns.run(&["ip", "addr", "add", &format!("{a}/32"), "dev", "lo"]);
    }
    let class = seed.class_mode().await;
    let gateway = |tenant: &str| {
        json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
               "metadata": {"name": "entry", "namespace": tenant},
               "spec": {"gatewayClassName": class,
                        "listeners": [{"name": "tls", "port": 8443, "protocol": "TLS",
                                       "hostname": "*.kube.test",
                                       "tls": {"mode": "Passthrough"}}]}})
    };
    let mut tenants = Vec::new();
    for (short, pod) in [("one", POD_1), ("two", POD_2)] {
        let t = seed.tenant(short, true).await;
        seed.apply(service(&t, "kube-apiserver")).await;
        seed.apply(slice(&t, "kube-apiserver", port, &[(pod, true)]))
            .await;
        seed.apply(json!({
            "apiVersion": ROUTES, "kind": "TLSRoute",
            "metadata": {"name": "kube-apiserver", "namespace": t},
            "spec": {"parentRefs": [{"name": "entry"}], "hostnames": [A],
                     "rules": [{"backendRefs": [{"name": "kube-apiserver", "port": 443}]}]}
        }))
        .await;
        tenants.push(t);
    }
    // Oldest first: tenant one's Gateway gets the first address.
    seed.apply(gateway(&tenants[0])).await;
    let gw = Gw::start_in(
        Some(ns),
        &format!(
            "admin: {{listen: '127.0.0.1:0'}}\nlisteners: [{{name: tls, address: '0.0.0.0:8443'}}]\n\
             kubernetes: {{gateway_class: {{name: {class}, addresses: [{}]}}, lease: {}/seedlink-status}}\n",
            POOL.join(", "),
            seed.sys
        ),
        &[
            ("KUBECONFIG", seed.kubeconfig("replica-a", &seed.token).to_str().unwrap()),
            ("POD_NAME", "replica-a"),
        ],
    );
    let address = |t: String| {
        let seed = &seed;
        async move {
            seed.get("gateway.networking.k8s.io/v1", "Gateway", &t, "entry")
                .await
                .and_then(|g| {
                    g["status"]["addresses"][0]["value"]
                        .as_str()
                        .map(str::to_string)
                })
        }
    };
    eventually(
        "the first Gateway's address",
        Duration::from_secs(30),
        async || address(tenants[0].clone()).await.as_deref() == Some(POOL[0]),
    )
    .await;
    seed.apply(gateway(&tenants[1])).await;
    eventually(
        "the second Gateway's address",
        Duration::from_secs(30),
        async || address(tenants[1].clone()).await.as_deref() == Some(POOL[1]),
    )
    .await;
    let mut entries = Vec::new();
    for a in POOL {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to: SocketAddr = format!("{a}:8443").parse().unwrap();
        entries.push(FaultProxy::start_with(
            l,
            Some(dialer.clone()),
            to,
            Fault::Pass,
        ));
    }
    for (entry, pod) in entries.iter().zip(["pod1", "pod2"]) {
        eventually(
            "each address routes to its own tenant",
            Duration::from_secs(30),
            async || {
                get(&pki, entry.addr, A)
                    .await
                    .is_ok_and(|b| b.contains(pod))
            },
        )
        .await;
    }
    // Both routes are Accepted, each by its own parent.
    for t in &tenants {
        seed.wait_route("Accepted", Duration::from_secs(20), t, "Accepted", |c| {
            c["status"] == "True"
        })
        .await;
    }

    // Tenant two's Gateway goes: its address serves nothing, and its entry
    // leaves the route's status.
    assert!(
        seed.delete(
            "gateway.networking.k8s.io/v1",
            "Gateway",
            &tenants[1],
            "entry"
        )
        .await
    );
    eventually(
        "the deleted Gateway's address routes nothing",
        Duration::from_secs(30),
        async || get(&pki, entries[1].addr, A).await.is_err(),
    )
    .await;
    eventually(
        "its entry leaves the route's status",
        Duration::from_secs(30),
        async || {
            seed.get(ROUTES, "TLSRoute", &tenants[1], "kube-apiserver")
                .await
                .is_some_and(|r| {
                    r["status"]["parents"]
                        .as_array()
                        .is_none_or(|p| p.is_empty())
                })
        },
    )
    .await;
    assert!(get(&pki, entries[0].addr, A)
        .await
        .unwrap()
        .contains("pod1"));
    drop(gw);
    stop.cancel();
}

/// What a hostile tenant does to its own objects in one step of
/// [`gateway_tenants_stand_alone_through_random_steps`].
#[derive(Clone, Copy, Debug)]
enum GwStep {
    /// Its route on its own host name, its Service and pods, its
    /// namespace admitted (creates again what was deleted: reused names).
    Valid,
    /// Its route claims the victim's host name.
    Steal,
    /// Its route claims its own host name and the victim's.
    StealAmong,
    /// Its route claims a wildcard that covers the victim's host name.
    Wildcard,
    /// Its route's backend is the victim's Service, across namespaces.
    VictimsBackend,
    /// Its route's backend is a Service that does not exist.
    MissingService,
    /// A policy on its own route under the victim's policy's name,
    /// letting in almost nobody.
    Policy,
    /// Its namespace is no longer admitted by the Gateway's listener.
    Unadmitted,
    /// Its route is deleted.
    DeleteRoute,
    /// The gateway restarts.
    Restart,
}

const GW_STEPS: [GwStep; 10] = [
    GwStep::Valid,
    GwStep::Steal,
    GwStep::StealAmong,
    GwStep::Wildcard,
    GwStep::VictimsBackend,
    GwStep::MissingService,
    GwStep::Policy,
    GwStep::Unadmitted,
    GwStep::DeleteRoute,
    GwStep::Restart,
];

impl Seed {
    /// Waits until the gateway has written our `Accepted` condition for
    /// the current generation of route `ns/kube-apiserver` (if it exists)
    /// and of policy `ns/acl` (if it exists): it has seen the last step.
    async fn settled(&self, ns: &str) {
        eventually(
            &format!("{ns}'s objects settled"),
            Duration::from_secs(40),
            async || {
                for (api, kind, name) in [
                    (ROUTES, "TLSRoute", "kube-apiserver"),
                    (POLICIES, "SeedlinkPolicy", "acl"),
                ] {
                    let Some(o) = self.get(api, kind, ns, name).await else {
                        continue;
                    };
                    let c = self.condition(api, kind, ns, name, "Accepted").await;
                    let seen =
                        c.is_some_and(|c| c["observedGeneration"] == o["metadata"]["generation"]);
                    if !seen {
                        return Err(format!("{kind} {ns}/{name}: not yet"));
                    }
                }
                Ok(())
            },
        )
        .await;
    }
}

/// After an attacker's step: whatever its route names, it never holds the
/// victim's host name, and across namespaces it reaches nothing.
async fn the_attackers_route_holds_nothing(seed: &Seed, ns: &str, step: GwStep, i: usize) {
    if matches!(step, GwStep::Steal | GwStep::StealAmong) {
        let c = seed
            .condition(ROUTES, "TLSRoute", ns, "kube-apiserver", "Accepted")
            .await
            .unwrap_or_default();
        assert_ne!(c["status"], "True", "step {i}: {c}");
    }
    if matches!(step, GwStep::Unadmitted)
        && seed
            .get(ROUTES, "TLSRoute", ns, "kube-apiserver")
            .await
            .is_some()
    {
        seed.wait_route(
            "the unadmitted route refused",
            Duration::from_secs(40),
            ns,
            "Accepted",
            |c| c["status"] == "False",
        )
        .await;
    }
    if matches!(step, GwStep::VictimsBackend) {
        let c = seed
            .condition(ROUTES, "TLSRoute", ns, "kube-apiserver", "ResolvedRefs")
            .await
            .unwrap_or_default();
        assert_eq!(c["reason"], "RefNotPermitted", "step {i}: {c}");
    }
}

/// The generative isolation test against a running gateway: random
/// sequences of hostile tenants' edits of their own TLSRoutes,
/// SeedlinkPolicies and namespaces (the victim's host name, alone, among
/// others and by wildcard; the victim's Service as a backend; a missing
/// Service; a policy under the victim's policy's name; an unadmitted
/// namespace; deletes and reused names), with restarts of the gateway
/// between some steps. The attackers' objects are older than the
/// victim's, so only the record of who holds a name (read back from
/// status after a restart) keeps it. After every step the victim's route
/// is accepted and its host name reaches the victim's pods.
/// `SEEDLINK_ISOLATION_STEPS` and `SEEDLINK_ISOLATION_SEED` as for the
/// tunnel-server's (tenant_isolation.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_tenants_stand_alone_through_random_steps() {
    const V: &str = "api.victim.kube.test";
    let (steps, mut rng) = common::generative::run("gateway isolation", 20);
    let mut pick = |n: usize| rng.next(n);
    let stop = CancellationToken::new();
    let evil_hosts = ["api.evil1.kube.test", "api.evil2.kube.test"];
    let pki = Arc::new(seedlink::demo::Pki::generate(&[V, evil_hosts[0], evil_hosts[1]]).unwrap());
    let seed = Seed::new(true).await;
    let port_v = seed.two_pods(&pki, 0, "victim", &stop);
    let port_e = seed.two_pods(&pki, 1, "evil", &stop);
    seed.gateway_object().await;
    // The attackers first: their objects are older than the victim's.
    let attackers = [
        (seed.tenant("evil1", true).await, evil_hosts[0]),
        (seed.tenant("evil2", true).await, evil_hosts[1]),
    ];
    let backend = |ns: &str, port: u16| {
        (
            service(ns, "kube-apiserver"),
            slice(ns, "kube-apiserver", port, &[(POD_1, true), (POD_2, true)]),
        )
    };
    for (ns, host) in &attackers {
        let (svc, eps) = backend(ns, port_e);
        seed.apply(svc).await;
        seed.apply(eps).await;
        seed.apply(seed.route(ns, "kube-apiserver", host, "kube-apiserver"))
            .await;
    }
    let victim = seed.tenant("victim", true).await;
    let (svc, eps) = backend(&victim, port_v);
    seed.apply(svc).await;
    seed.apply(eps).await;
    seed.apply(seed.route(&victim, "kube-apiserver", V, "kube-apiserver"))
        .await;
    seed.apply(policy(&victim, "kube-apiserver", &["0.0.0.0/0"]))
        .await;
    let mut gw = seed.gateway("replica-a", &seed.token).await;
    let victim_served = async |gw: &SeedGw, what: &str| {
        let body = eventually(
            &format!("the victim's host after {what}"),
            Duration::from_secs(40),
            async || get(&pki, gw.tls, V).await.map_err(|e| e.to_string()),
        )
        .await;
        assert!(body.contains("hello from victim"), "{what}: {body}");
        let accepted = seed
            .condition(ROUTES, "TLSRoute", &victim, "kube-apiserver", "Accepted")
            .await
            .unwrap_or_default();
        assert_eq!(accepted["status"], "True", "{what}: {accepted}");
    };
    seed.settled(&victim).await;
    victim_served(&gw, "the start").await;
    for i in 0..steps {
        let step = GW_STEPS[pick(GW_STEPS.len())];
        // The first attacker's route is never deleted: it stays older than
        // the victim's, so only who held the name can keep it from it.
        let (ns, host) = match step {
            GwStep::DeleteRoute => &attackers[1],
            _ => &attackers[pick(attackers.len())],
        };
        eprintln!("gateway isolation step {i}: {ns} {step:?}");
        let with = |hosts: Value, backend: Value| {
            json!({
                "apiVersion": ROUTES, "kind": "TLSRoute",
                "metadata": {"name": "kube-apiserver", "namespace": ns},
                "spec": {
                    "parentRefs": [{"name": "seedlink", "namespace": seed.sys, "sectionName": "tls"}],
                    "hostnames": hosts,
                    "rules": [{"backendRefs": [backend]}]
                }
            })
        };
        let own = json!({"name": "kube-apiserver", "port": 443});
        match step {
            GwStep::Valid => {
                seed.tenant(&ns[seed.prefix.len() + 1..], true).await;
                let (svc, eps) = backend(ns, port_e);
                seed.apply(svc).await;
                seed.apply(eps).await;
                seed.apply(with(json!([host]), own)).await;
            }
            GwStep::Steal => {
                seed.apply(with(json!([V]), own)).await;
            }
            GwStep::StealAmong => {
                seed.apply(with(json!([host, V]), own)).await;
            }
            GwStep::Wildcard => {
                seed.apply(with(json!(["*.kube.test"]), own)).await;
            }
            GwStep::VictimsBackend => {
                let theirs = json!({"name": "kube-apiserver", "namespace": victim, "port": 443});
                seed.apply(with(json!([host]), theirs)).await;
            }
            GwStep::MissingService => {
                let none = json!({"name": "nothing", "port": 443});
                seed.apply(with(json!([host]), none)).await;
            }
            GwStep::Policy => {
                seed.apply(policy(ns, "kube-apiserver", &["192.0.2.1/32"]))
                    .await;
            }
            GwStep::Unadmitted => {
                seed.tenant(&ns[seed.prefix.len() + 1..], false).await;
            }
            GwStep::DeleteRoute => {
                seed.delete(ROUTES, "TLSRoute", ns, "kube-apiserver").await;
            }
            GwStep::Restart => {
                drop(gw);
                gw = seed.gateway("replica-a", &seed.token).await;
            }
        }
        seed.settled(ns).await;
        victim_served(&gw, &format!("step {i} {ns} {step:?}")).await;
        the_attackers_route_holds_nothing(&seed, ns, step, i).await;
    }
    // Always, whatever the steps were: the older attacker claims the
    // victim's name and the gateway restarts with no memory of who held
    // it; the victim's Accepted status keeps it.
    let (ns, host) = &attackers[0];
    seed.apply(seed.route(ns, "kube-apiserver", host, "kube-apiserver"))
        .await;
    let mut steal = seed.route(ns, "kube-apiserver", host, "kube-apiserver");
    steal["spec"]["hostnames"] = json!([host, V]);
    seed.apply(steal).await;
    seed.settled(ns).await;
    drop(gw);
    let gw = seed.gateway("replica-a", &seed.token).await;
    seed.settled(ns).await;
    victim_served(&gw, "the older attacker's claim across a restart").await;
    stop.cancel();
}

/// Readiness means "serving what the API server holds": a gateway started
/// while the API server is partitioned from it binds its listeners but
/// stays unready, saying why, and serves no route; once the partition
/// heals it reads the routes and becomes ready; a later outage leaves a
/// ready gateway ready, serving its last good state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_during_an_outage_stays_unready_until_it_reads_the_routes() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A]).unwrap());
    let seed = Seed::new(true).await;
    let port = seed.two_pods(&pki, 0, "a", &stop);
    seed.gateway_object().await;
    let a = seed.tenant("shoot--a", true).await;
    seed.apply(service(&a, "kube-apiserver")).await;
    seed.apply(slice(&a, "kube-apiserver", port, &[(POD_1, true)]))
        .await;
    seed.apply(seed.route(&a, "kube-apiserver", A, "kube-apiserver"))
        .await;
    // The pod starts partitioned from the API server: its ready line
    // comes after the bounded first wait, its probe says why not.
    let gw = seed
        .start_gateway("replica-a", &seed.token, Some(Fault::Blackhole))
        .await;
    let (code, body) = gw.get("/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("[-]kubernetes: no complete snapshot from the API server yet"),
        "{body}"
    );
    assert!(
        get(&pki, gw.tls, A).await.is_err(),
        "no route before the snapshot"
    );
    let proxy = gw.api.as_ref().unwrap();
    proxy.set(Fault::Pass);
    eventually(
        "ready once the routes are read",
        Duration::from_secs(90),
        async || {
            let (code, body) = gw.get("/readyz").await;
            ok_if(code == 200, || body)
        },
    )
    .await;
    let body = get(&pki, gw.tls, A).await.unwrap();
    assert!(body.contains("hello from a"), "{body}");
    // Ready, then partitioned: still ready, still serving.
    proxy.set(Fault::Blackhole);
    let (code, body) = gw.get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    let body = get(&pki, gw.tls, A).await.unwrap();
    assert!(body.contains("hello from a"), "{body}");
    stop.cancel();
}

/// A watch whose connection dies silently (a middlebox forgets it: no
/// reset, nothing more delivered, while new connections work) is replaced
/// within the watch timeout (`WATCH_TIMEOUT_SECS` plus kube-runtime's idle
/// margin), not left stale until the API server's own timeout: a route
/// created after the connections died is served, read through a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_whose_connection_died_silently_is_replaced() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A]).unwrap());
    let seed = Seed::new(true).await;
    let port = seed.two_pods(&pki, 0, "a", &stop);
    seed.gateway_object().await;
    let a = seed.tenant("shoot--a", true).await;
    seed.apply(service(&a, "kube-apiserver")).await;
    seed.apply(slice(&a, "kube-apiserver", port, &[(POD_1, true)]))
        .await;
    let gw = seed.gateway_with_own_proxy("replica-a", &seed.token).await;
    eventually("ready", Duration::from_secs(90), async || {
        let (code, body) = gw.get("/readyz").await;
        ok_if(code == 200, || body)
    })
    .await;
    let proxy = gw.api.as_ref().unwrap();
    let before = proxy.accepted.load(std::sync::atomic::Ordering::Relaxed);
    proxy.set(Fault::Orphan);
    seed.apply(seed.route(&a, "kube-apiserver", A, "kube-apiserver"))
        .await;
    let bound = Duration::from_secs(u64::from(seedlink_kube::source::WATCH_TIMEOUT_SECS) + 120);
    eventually("the route served through a new watch", bound, async || {
        let r = get(&pki, gw.tls, A).await;
        ok_if(r.as_ref().is_ok_and(|b| b.contains("hello from a")), || {
            format!("{r:?}")
        })
    })
    .await;
    let after = proxy.accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert!(after > before, "no new connection to the API server");
    stop.cancel();
}

const CONTROL_PLANES: &str = "seedlink.dev/v1alpha1";

/// One `SeedlinkControlPlane`: kube-apiserver's Service, its host name.
fn control_plane(ns: &str, name: &str, host: &str) -> Value {
    json!({
        "apiVersion": CONTROL_PLANES, "kind": "SeedlinkControlPlane",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"apiServer": {"service": "kube-apiserver", "hostnames": [host]}}
    })
}

/// The bed of `one_object_onboards_a_control_plane`: a seed with the
/// gateway (in its network namespace, two demo kube-apiserver pods behind
/// shoot--a's Service), a tunnel-server reading TunnelClusters, and the
/// onboarding controller under the ServiceAccount and RBAC the chart
/// gives it. shoot--a's namespace is not labelled for the Gateway: the
/// controller does that. Fields drop in order.
struct Onboarding {
    gw: SeedGw,
    _tunnel: Proc,
    _onboard: Proc,
    /// The onboarding controller's admin endpoint.
    onboard_admin: SocketAddr,
    /// The directory of the tunnel-server's files and frontend sockets.
    dir: tempfile::TempDir,
    /// The tunnel-server's shared TCP+mTLS CONNECT frontend (on loopback),
    /// which kube-apiserver's generated client certificates select.
    shared_frontend: u16,
    a: String,
    seed: Seed,
    pki: Arc<seedlink::demo::Pki>,
    echo: SocketAddr,
    stop: CancellationToken,
}

impl Onboarding {
    async fn start() -> Onboarding {
        Onboarding::start_with("{}").await
    }

    /// With the controller's `certificates` settings (YAML).
    async fn start_with(certificates: &str) -> Onboarding {
        let stop = CancellationToken::new();
        let pki = Arc::new(seedlink::demo::Pki::generate(&[A, C]).unwrap());
        let seed = Seed::own(true).await;
        let port = seed.two_pods(&pki, 0, "a", &stop);
        seed.gateway_object().await;
        let a = seed.tenant("shoot--a", false).await;
        seed.apply(service(&a, "kube-apiserver")).await;
        let pods = [(POD_1, true), (POD_2, true)];
        seed.apply(slice(&a, "kube-apiserver", port, &pods)).await;
        let gw = seed.gateway("replica-a", &seed.token).await;
        let echo = echo_backend(&stop).await;
        let dir = tempfile::tempdir().unwrap();
        let tunnel_pki = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
        let shared_frontend = free_port();
        let (tunnel, agents) =
            onboarding_tunnel_server(&seed, &tunnel_pki, dir.path(), shared_frontend);
        std::fs::write(dir.path().join("seed-ca.pem"), &tunnel_pki.ca_pem).unwrap();
        let token = seed
            .api
            .install_onboarding_rbac(&seed.client, &seed.sys)
            .await;
        let (onboard, onboard_admin) =
            onboard_controller(&seed, &token, dir.path(), &agents, certificates);
        Onboarding {
            gw,
            _tunnel: tunnel,
            _onboard: onboard,
            onboard_admin,
            dir,
            shared_frontend,
            a,
            seed,
            pki,
            echo,
            stop,
        }
    }

    /// The frontend socket of `ns`'s control plane `kas`.
    fn socket(&self, ns: &str) -> String {
        self.dir
            .path()
            .join(format!("{ns}.kas.sock"))
            .display()
            .to_string()
    }

    /// The control plane `ns/name`, once its status says `ok`.
    async fn status_until(
        &self,
        what: &str,
        ns: &str,
        name: &str,
        ok: impl Fn(&Value) -> bool,
    ) -> Value {
        eventually(what, Duration::from_secs(30), async || {
            let o = self
                .seed
                .get(CONTROL_PLANES, "SeedlinkControlPlane", ns, name)
                .await
                .unwrap_or_default();
            let status = o["status"].clone();
            if ok(&status) {
                Ok(status)
            } else {
                Err(format!("status: {status}"))
            }
        })
        .await
    }
}

/// A status condition's `status` (`True`, `False`, `Unknown`) and reason.
fn cond(status: &Value, type_: &str) -> (String, String) {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
            )
        })
        .unwrap_or_default()
}

/// A tunnel-server with no cluster in its file: TunnelClusters from the
/// API (as the install's ServiceAccount), a Unix-socket frontend per
/// cluster in `dir`. The process and its agent endpoint.
fn onboarding_tunnel_server(
    seed: &Seed,
    pki: &seedlink::demo::Pki,
    dir: &std::path::Path,
    shared_port: u16,
) -> (Proc, String) {
    let (_, leaf) = &pki.servers[0];
    let (crt, key) = (dir.join("tun.pem"), dir.join("tun-key.pem"));
    std::fs::write(&crt, &leaf.cert_pem).unwrap();
    std::fs::write(&key, &leaf.key_pem).unwrap();
    // The CA of kube-apiserver's client certificates on the shared
    // frontend: the controller issues from it (kas-ca*.pem).
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "kube-apiserver clients");
    let ca = ca.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join("kas-ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("kas-ca-key.pem"), ca_key.serialize_pem()).unwrap();
    // What the frontend trusts: a file of its own, so that a rotation can
    // trust both CAs while the controller signs with the new one.
    std::fs::write(dir.join("kas-trust.pem"), ca.pem()).unwrap();
    let (d, sys) = (dir.display(), &seed.sys);
    let config = dir.join("tunnel.yaml");
    std::fs::write(
        &config,
        format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
clusters: []
frontend_templates:
  - {{name: uds, protocol: http-connect, unix: '{d}/{{cluster}}.sock'}}
shared_frontends:
  - {{name: shared, protocol: http-connect, tcp: '127.0.0.1:{shared_port}', cert: '{crt}', key: '{key}', client_ca: '{d}/kas-trust.pem'}}
kubernetes: {{lease: {sys}/seedlink-tunnel-status, trust_dir: '{d}/trust'}}
",
            crt = crt.display(),
            key = key.display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(seedlink_bin());
    cmd.args(["tunnel-server", "--config"])
        .arg(&config)
        // On this side of the seed's network namespace: straight to the API
        // server, not through the seed's proxy (which listens in there).
        .env(
            "KUBECONFIG",
            seed.api
                .kubeconfig(seed.dir.path(), "tunnel-server", &seed.token, None),
        )
        .env("POD_NAME", "tunnel-0");
    let (server, ready) = started(cmd);
    (server, ready["agents"].as_str().unwrap().to_string())
}

/// `seedlink onboard` with `token` (the chart's `seedlink-onboard`
/// ServiceAccount), labelling control planes' namespaces for the Gateway
/// and rendering kube-apiserver's and the shoot's files from the
/// tunnel-server's file in `dir` (its agents at `agents`).
fn onboard_controller(
    seed: &Seed,
    token: &str,
    dir: &std::path::Path,
    agents: &str,
    certificates: &str,
) -> (Proc, SocketAddr) {
    let sys = &seed.sys;
    let config = dir.join("onboard.yaml");
    let (tunnel, ca) = (dir.join("tunnel.yaml"), dir.join("seed-ca.pem"));
    std::fs::write(
        &config,
        format!(
            "lease: {sys}/seedlink-onboard
gateway: {sys}/seedlink
tunnel_reader: {sys}/seedlink
trust_role: seedlink-tunnel-trust-{sys}
trust_role_config_maps: seedlink-tunnel-trust-configmaps-{sys}
namespace_label: seedlink.dev/gateway-access
admin: {{listen: '127.0.0.1:0'}}
certificates: {certificates}
render:
  tunnel_config: '{}'
  agent_server: '{agents}'
  server_name: tunnel.seedlink.test
  server_ca: '{}'
  kube_apiserver_client_ca: {{cert: '{d}/kas-ca.pem', key: '{d}/kas-ca-key.pem'}}
",
            tunnel.display(),
            ca.display(),
            d = dir.display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(seedlink_bin());
    cmd.args(["onboard", "--config"])
        .arg(&config)
        .env(
            "KUBECONFIG",
            seed.api.kubeconfig(seed.dir.path(), "onboard", token, None),
        )
        .env("POD_NAME", "onboard-0");
    let (p, ready) = started(cmd);
    (p, ready["admin"].as_str().unwrap().parse().unwrap())
}

/// The object is applied: the controller labels the namespace, writes the
/// route, and the gateway serves the control plane by SNI; everything it
/// wrote is owned by the object.
async fn one_object_serves_its_api_server_by_sni(t: &Onboarding) {
    t.seed.apply(control_plane(&t.a, "kas", A)).await;
    eventually(
        "the control plane is served by SNI",
        Duration::from_secs(30),
        async || get(&t.pki, t.gw.tls, A).await,
    )
    .await;
    let ns = t.seed.get("v1", "Namespace", "", &t.a).await.unwrap();
    assert_eq!(
        ns["metadata"]["labels"]["seedlink.dev/gateway-access"],
        "true"
    );
    let status = t
        .status_until("RouteAccepted", &t.a, "kas", |s| {
            cond(s, "RouteAccepted").0 == "True"
        })
        .await;
    let cp = t
        .seed
        .get(CONTROL_PLANES, "SeedlinkControlPlane", &t.a, "kas")
        .await
        .unwrap();
    let uid = cp["metadata"]["uid"].as_str().unwrap();
    let generated: Vec<&str> = status["generated"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| g.as_str())
        .collect();
    assert_eq!(
        generated,
        [
            "ConfigMap/kas-agent-trust",
            "RoleBinding/kas-seedlink-tunnel-trust",
            "TunnelCluster/kas",
            "TLSRoute/kas",
            "ConfigMap/kas-kube-apiserver-egress",
            "Secret/kas-shoot",
            "Secret/kas-kube-apiserver-tunnel"
        ]
    );
    let owned = [
        ("v1", "ConfigMap", "kas-agent-trust"),
        ("v1", "Secret", "kas-agent-ca"),
        ("v1", "Secret", "kas-agent"),
        (
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            "kas-seedlink-tunnel-trust",
        ),
        ("tunnel.seedlink.dev/v1alpha1", "TunnelCluster", "kas"),
        (ROUTES, "TLSRoute", "kas"),
        ("v1", "ConfigMap", "kas-kube-apiserver-egress"),
        ("v1", "Secret", "kas-shoot"),
    ];
    for (api, kind, name) in owned {
        let o = t.seed.get(api, kind, &t.a, name).await.unwrap();
        assert_eq!(
            o["metadata"]["ownerReferences"][0]["uid"], uid,
            "{kind}/{name}"
        );
    }
    assert!(status["certificatesNotAfter"].is_string());
    // The tunnel-server reads the trust ConfigMap, and none of the
    // namespace's Secrets (the agent CA's key, the agents' and
    // kube-apiserver's keys): its binding grants ConfigMaps only.
    let tunnel_server =
        t.seed
            .api
            .kubeconfig(t.seed.dir.path(), "tunnel-reader", &t.seed.token, None);
    let can_i = |what: &str| {
        let o = std::process::Command::new(t.seed.api.kube_dir.join("bin/kubectl"))
            .arg(format!("--kubeconfig={}", tunnel_server.display()))
            .args(["auth", "can-i", "list", what, "-n", &t.a])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    assert_eq!(
        (can_i("configmaps"), can_i("secrets")),
        ("yes".into(), "no".into())
    );
    // The expiry as a metric, for the shipped alerts.
    let series = format!(
        "seedlink_onboard_certificates_not_after_seconds{{namespace=\"{}\",name=\"kas\"}}",
        t.a
    );
    eventually("the expiry metric", Duration::from_secs(30), async || {
        let (_, body) = common::http_get(t.onboard_admin, "/metrics").await;
        body.contains(&series)
            .then_some(())
            .ok_or_else(|| body.clone())
    })
    .await;
}

/// The credential files of `ns`'s shoot Secret (`kas-shoot`), written into
/// `dir` as the kubelet would mount them.
async fn mount_shoot_credentials(t: &Onboarding, ns: &str, dir: &std::path::Path) -> Value {
    let secret = t.seed.get("v1", "Secret", ns, "kas-shoot").await.unwrap();
    std::fs::create_dir_all(dir).unwrap();
    for key in ["agent.crt", "agent.key", "tunnel-ca.crt"] {
        let b: k8s_openapi::ByteString =
            serde_json::from_value(secret["data"][key].clone()).unwrap();
        std::fs::write(dir.join(key), b.0).unwrap();
    }
    secret
}

/// An agent of `ns`'s control plane `kas` started from its shoot Secret
/// (paths moved to `dir`, its admin on loopback, loopback allowed), once
/// the control plane counts it and says Ready; and a tunnel through it.
async fn agent_from_the_bundle(
    t: &Onboarding,
    ns: &str,
    dir: &std::path::Path,
) -> (Proc, UnixStream) {
    let secret = mount_shoot_credentials(t, ns, dir).await;
    let b: k8s_openapi::ByteString =
        serde_json::from_value(secret["data"]["agent.yaml"].clone()).unwrap();
    let mut agent: Value = serde_norway::from_slice(&b.0).unwrap();
    assert_eq!(agent["agent_cert"], "/etc/seedlink/agent.crt", "{agent}");
    for k in ["ca_cert", "agent_cert", "agent_key"] {
        let moved = agent[k]
            .as_str()
            .unwrap()
            .replace("/etc/seedlink", &dir.display().to_string());
        agent[k] = moved.into();
    }
    agent["admin"] = "127.0.0.1:0".into();
    agent["deny_cidr"] = json!(common::SHOOT_LOOPBACK_DENY.split(',').collect::<Vec<_>>());
    let file = dir.join("agent.yaml");
    std::fs::write(&file, serde_norway::to_string(&agent).unwrap()).unwrap();
    let mut cmd = std::process::Command::new(seedlink_bin());
    cmd.args(["tunnel-agent", "--config"]).arg(&file);
    let (agent, _) = started(cmd);
    t.status_until("an agent, Ready", ns, "kas", |s| {
        s["agents"] == 1 && cond(s, "Ready").0 == "True"
    })
    .await;
    let to = t.echo.to_string();
    let mut s =
        common::tunnel_env::kas_connect_eventually(&t.socket(ns), &to, Duration::from_secs(20))
            .await;
    common::tunnel_env::echo_rtt(&mut s, 1000).await;
    (agent, s)
}

/// kube-apiserver's ConfigMap names the cluster's frontend socket, and
/// an agent started from the shoot's Secret joins the generated
/// TunnelCluster and carries kube-apiserver's CONNECT.
async fn the_shoot_bundle_carries_the_tunnel(t: &Onboarding) -> (Proc, UnixStream) {
    let kas = t
        .seed
        .get("v1", "ConfigMap", &t.a, "kas-kube-apiserver-egress")
        .await
        .unwrap();
    let egress = kas["data"]["egress-selector-configuration.yaml"]
        .as_str()
        .unwrap();
    assert!(egress.contains(&t.socket(&t.a)), "{egress}");
    let args = kas["data"]["kube-apiserver.args"].as_str().unwrap();
    assert!(args.contains("--egress-selector-config-file"), "{args}");
    agent_from_the_bundle(t, &t.a, &t.dir.path().join("shoot-a")).await
}

/// Raising shoot--a's `spec.tunnel.revision` revokes its agents'
/// credentials: its agent is cut (its certificate's CA is trusted no
/// more), a new certificate is issued, and the same agent process picks
/// it up from its files and reconnects. shoot--c's agent, onboarded the
/// same way, carries a loop of dials throughout with none failing.
async fn revoking_one_control_plane_cuts_only_its_agents(t: &Onboarding) -> Proc {
    let c = t.seed.tenant("shoot--c", false).await;
    t.seed.apply(service(&c, "kube-apiserver")).await;
    t.seed.apply(control_plane(&c, "kas", D)).await;
    t.status_until("shoot--c generated", &c, "kas", |s| {
        cond(s, "Generated").0 == "True"
    })
    .await;
    let (agent_c, _tunnel_c) = agent_from_the_bundle(t, &c, &t.dir.path().join("shoot-c")).await;
    let loop_c = DialLoop::start(t.socket(&c), t.echo.to_string());
    let before_ca = t
        .seed
        .get("v1", "Secret", &t.a, "kas-agent-ca")
        .await
        .unwrap();
    let before = t.seed.get("v1", "Secret", &t.a, "kas-agent").await.unwrap();
    let mut cp = control_plane(&t.a, "kas", A);
    cp["spec"]["tunnel"] = json!({"revision": 1});
    t.seed.apply(cp).await;
    eventually(
        "the trust names the new CA alone",
        Duration::from_secs(30),
        async || {
            let ca = t
                .seed
                .get("v1", "Secret", &t.a, "kas-agent-ca")
                .await
                .unwrap_or_default();
            let trust = t
                .seed
                .get("v1", "ConfigMap", &t.a, "kas-agent-trust")
                .await
                .unwrap_or_default();
            let (now, was) = (&ca["data"]["ca.crt"], &before_ca["data"]["ca.crt"]);
            // The CA Secret's data is base64, the trust ConfigMap's text.
            let pem: k8s_openapi::ByteString =
                serde_json::from_value(now.clone()).unwrap_or_default();
            if now != was && trust["data"]["ca.crt"] == *String::from_utf8_lossy(&pem.0) {
                Ok(())
            } else {
                Err(format!(
                    "CA {now} (was {was}), trust {}",
                    trust["data"]["ca.crt"]
                ))
            }
        },
    )
    .await;
    t.status_until("shoot--a's agent is cut", &t.a, "kas", |s| s["agents"] == 0)
        .await;
    let after = eventually("a new certificate", Duration::from_secs(30), async || {
        let s = t
            .seed
            .get("v1", "Secret", &t.a, "kas-agent")
            .await
            .unwrap_or_default();
        let renewed = s["data"]["tls.crt"] != before["data"]["tls.crt"];
        if renewed {
            Ok(s)
        } else {
            Err("the certificate is the revoked one".to_string())
        }
    })
    .await;
    assert_ne!(
        after["data"]["ca.crt"], before["data"]["ca.crt"],
        "a new CA signed it"
    );
    // The kubelet's update of the mounted Secret: the running agent reads it.
    mount_shoot_credentials(t, &t.a, &t.dir.path().join("shoot-a")).await;
    t.status_until("shoot--a's agent is back", &t.a, "kas", |s| {
        s["agents"] == 1 && cond(s, "Ready").0 == "True"
    })
    .await;
    let to = t.echo.to_string();
    let mut s =
        common::tunnel_env::kas_connect_eventually(&t.socket(&t.a), &to, Duration::from_secs(20))
            .await;
    common::tunnel_env::echo_rtt(&mut s, 1000).await;
    let (ok, failed) = loop_c.stop().await;
    eprintln!("shoot--c's dials during shoot--a's revocation: {ok} ok, {failed} failed");
    assert!(
        ok > 0 && failed == 0,
        "shoot--c's dials during the revocation: {ok} ok, {failed} failed"
    );
    agent_c
}

/// Dials through a frontend socket in a loop (at most 10,000 dials) until
/// stopped: each opens a tunnel, echoes 100 bytes and closes.
struct DialLoop {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<(u64, u64)>,
}

impl DialLoop {
    fn start(sock: String, to: String) -> DialLoop {
        DialLoop::paced(sock, to, Duration::ZERO)
    }

    /// The same with `pace` between dials (a loop that lasts minutes).
    fn paced(sock: String, to: String, pace: Duration) -> DialLoop {
        let stop = CancellationToken::new();
        let done = stop.clone();
        let task = tokio::spawn(async move {
            let (mut ok, mut failed) = (0, 0);
            for _ in 0..10_000 {
                if done.is_cancelled() {
                    break;
                }
                let dial = async {
                    let mut s = common::tunnel_env::kas_connect(&sock, &to).await?;
                    common::tunnel_env::echo_rtt(&mut s, 100).await;
                    Ok::<(), String>(())
                };
                match tokio::time::timeout(Duration::from_secs(10), dial).await {
                    Ok(Ok(())) => ok += 1,
                    _ => failed += 1,
                }
                if !pace.is_zero() {
                    tokio::time::sleep(pace).await;
                }
            }
            (ok, failed)
        });
        DialLoop { stop, task }
    }

    /// Dials that worked and that failed.
    async fn stop(self) -> (u64, u64) {
        self.stop.cancel();
        self.task.await.unwrap_or((0, u64::MAX))
    }
}

/// Another tenant's objects take nothing: one whose generated name is
/// already another object's is refused (NameTaken) and leaves that object
/// alone; one asking for shoot--a's host name is refused by the gateway
/// (its RouteAccepted says so); shoot--a serves on.
async fn another_tenant_takes_neither_a_name_nor_a_host(t: &Onboarding, tunnel: &mut UnixStream) {
    let b = t.seed.tenant("shoot--b", false).await;
    t.seed.apply(service(&b, "kube-apiserver")).await;
    let theirs = t.seed.route(&b, "kas", C, "kube-apiserver");
    t.seed.apply(theirs).await;
    t.seed.apply(control_plane(&b, "kas", C)).await;
    let status = t
        .status_until("NameTaken", &b, "kas", |s| {
            cond(s, "Ready") == ("False".into(), "NameTaken".into())
        })
        .await;
    assert!(
        status["conditions"].to_string().contains("TLSRoute/kas"),
        "{status}"
    );
    let route = t.seed.get(ROUTES, "TLSRoute", &b, "kas").await.unwrap();
    assert!(
        route["metadata"].get("ownerReferences").is_none(),
        "{route}"
    );
    assert_eq!(route["spec"]["hostnames"], json!([C]));
    t.seed.apply(control_plane(&b, "kas-2", A)).await;
    t.status_until("RouteAccepted False", &b, "kas-2", |s| {
        cond(s, "RouteAccepted").0 == "False" && cond(s, "Ready").0 == "False"
    })
    .await;
    let body = get(&t.pki, t.gw.tls, A).await.unwrap();
    assert!(body.contains("a1") || body.contains("a2"), "{body}");
    common::tunnel_env::echo_rtt(tunnel, 1000).await;
}

/// The platform's delivery of `ns`'s shoot Secret to the agent's files
/// in `dir` (a secret sync, then the kubelet's atomic update of the
/// mounted volume), looked at every second until stopped; counts the
/// deliveries.
fn credential_sync(
    t: &Onboarding,
    ns: &str,
    dir: &std::path::Path,
) -> (CancellationToken, tokio::task::JoinHandle<u64>) {
    let stop = CancellationToken::new();
    let (done, client, ns, dir) = (
        stop.clone(),
        t.seed.client.clone(),
        ns.to_string(),
        dir.to_path_buf(),
    );
    let task = tokio::spawn(async move {
        let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
            kube::Api::namespaced(client, &ns);
        let (mut last, mut delivered) = (None, 0);
        // Bounded: at most an hour.
        for _ in 0..3600 {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = done.cancelled() => break,
            }
            let Ok(s) = secrets.get("kas-shoot").await else {
                continue;
            };
            let data = s.data.unwrap_or_default();
            if last.as_ref() == Some(&data) {
                continue;
            }
            for key in ["agent.crt", "agent.key", "tunnel-ca.crt"] {
                let (tmp, to) = (dir.join(format!(".{key}.new")), dir.join(key));
                std::fs::write(&tmp, &data[key].0).unwrap();
                std::fs::rename(&tmp, &to).unwrap();
            }
            delivered += 1;
            last = Some(data);
        }
        delivered
    });
    (stop, task)
}

/// On short validities (the agents' certificate 1 minute, the CA 3),
/// the control plane's agent certificate is renewed and its CA rotated
/// under a paced loop of dials through its one agent; the platform
/// delivers each new Secret to the agent's files. The agent replaces its
/// stream with one presenting the new certificate before the old one goes
/// (the tunnel-server sends new dials to the replacement): through the
/// renewals, the rotation and the end of its overlap, no dial fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_and_a_ca_rotation_under_a_dial_loop_fail_no_dial() {
    let t = Onboarding::start_with("{ca_validity: 3m, leaf_validity: 1m}").await;
    // A host name of its own: tests run side by side on one API server.
    t.seed
        .apply(control_plane(&t.a, "kas", "api.renewals.kube.test"))
        .await;
    t.status_until("generated", &t.a, "kas", |s| {
        cond(s, "Generated").0 == "True"
    })
    .await;
    let dir = t.dir.path().join("shoot-a");
    let (_agent, tunnel) = agent_from_the_bundle(&t, &t.a, &dir).await;
    // Nothing held open: a connection on a stream outlives its drain.
    drop(tunnel);
    let ca = async || {
        t.seed
            .get("v1", "Secret", &t.a, "kas-agent-ca")
            .await
            .unwrap_or_default()
    };
    let first = ca().await["data"]["ca.crt"].clone();
    let (sync, delivered) = credential_sync(&t, &t.a, &dir);
    let dials = DialLoop::paced(
        t.socket(&t.a),
        t.echo.to_string(),
        Duration::from_millis(50),
    );
    eventually(
        "a new CA, its predecessor's overlap over",
        Duration::from_secs(420),
        async || {
            let now = ca().await;
            let (current, previous) = (&now["data"]["ca.crt"], &now["data"]["previous.crt"]);
            (*current != first && previous == "")
                .then_some(())
                .ok_or_else(|| format!("CA changed: {}, previous: {previous}", *current != first))
        },
    )
    .await;
    t.status_until("the agent on the new CA's certificate", &t.a, "kas", |s| {
        s["agents"] == 1 && cond(s, "Ready").0 == "True"
    })
    .await;
    let (ok, failed) = dials.stop().await;
    sync.cancel();
    let delivered = delivered.await.unwrap_or_default();
    eprintln!("renewals and a CA rotation: {delivered} deliveries, dials {ok} ok, {failed} failed");
    assert!(delivered >= 3, "{delivered} certificate deliveries");
    assert!(ok > 0 && failed == 0, "dials: {ok} ok, {failed} failed");
    t.stop.cancel();
}

/// One `SeedlinkControlPlane` onboards a control plane: the controller,
/// under the chart's RBAC, writes its route, tunnel cluster, trust, agent
/// certificate, kube-apiserver's egress files and the shoot's bundle; the
/// gateway serves it by SNI and the tunnel carries kube-apiserver's
/// CONNECT through an agent started from the bundle; another tenant takes
/// neither its names nor its host; revoking its credentials cuts its agent
/// alone, which picks up its new certificate without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_object_onboards_a_control_plane() {
    let t = Onboarding::start().await;
    one_object_serves_its_api_server_by_sni(&t).await;
    let (_agent, mut tunnel) = the_shoot_bundle_carries_the_tunnel(&t).await;
    another_tenant_takes_neither_a_name_nor_a_host(&t, &mut tunnel).await;
    let _agent_c = revoking_one_control_plane_cuts_only_its_agents(&t).await;
    a_recreated_control_plane_refuses_the_old_kube_apiserver_certificate(&t).await;
    the_kube_apiserver_client_ca_is_rotated_with_overlap(&t).await;
    t.stop.cancel();
}

/// The operator's kube-apiserver client CA rotated with overlap: the
/// frontend trusts both CAs, the controller's files are replaced by the
/// new CA (read again without a restart) and it issues the certificate
/// again from it; the old certificate still works during the overlap;
/// once the frontend trusts the new CA alone, the old one is refused.
async fn the_kube_apiserver_client_ca_is_rotated_with_overlap(t: &Onboarding) {
    let d = t.dir.path();
    let old = kas_client_certificate(t, "ca1").await;
    assert!(shared_frontend_answers(t, "ca1").await);
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kube-apiserver clients 2");
    let new_ca = params.self_signed(&key).unwrap().pem();
    let old_ca = std::fs::read_to_string(d.join("kas-ca.pem")).unwrap();
    std::fs::write(d.join("kas-trust.pem"), format!("{old_ca}{new_ca}")).unwrap();
    std::fs::write(d.join("kas-ca-key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(d.join("kas-ca.pem"), &new_ca).unwrap();
    eventually(
        "the certificate issued by the new CA selects its cluster",
        Duration::from_secs(90),
        async || {
            let now = kas_client_certificate(t, "ca2").await;
            now != old && shared_frontend_answers(t, "ca2").await
        },
    )
    .await;
    assert!(
        shared_frontend_answers(t, "ca1").await,
        "during the overlap"
    );
    std::fs::write(d.join("kas-trust.pem"), &new_ca).unwrap();
    eventually(
        "the old certificate refused once its CA is trusted no more",
        Duration::from_secs(60),
        async || !shared_frontend_answers(t, "ca1").await,
    )
    .await;
    assert!(shared_frontend_answers(t, "ca2").await);
}

/// kube-apiserver's generated client certificate selects its own cluster
/// on the shared frontend, and never a later object of the same namespace
/// and name: it names its object's UID, which the generated TunnelCluster
/// requires. (This test's API server runs no garbage collector: the test
/// deletes what the object owned, as the collector would.)
async fn a_recreated_control_plane_refuses_the_old_kube_apiserver_certificate(t: &Onboarding) {
    let old = kas_client_certificate(t, "old").await;
    eventually(
        "the generated certificate selects its cluster",
        Duration::from_secs(30),
        async || !old.is_empty() && shared_frontend_answers(t, "old").await,
    )
    .await;
    let cp = t
        .seed
        .get(CONTROL_PLANES, "SeedlinkControlPlane", &t.a, "kas")
        .await
        .unwrap();
    assert!(
        t.seed
            .delete(CONTROL_PLANES, "SeedlinkControlPlane", &t.a, "kas")
            .await
    );
    let old_uid = cp["metadata"]["uid"].as_str().unwrap();
    collect_garbage(t, old_uid).await;
    t.seed.apply(control_plane(&t.a, "kas", A)).await;
    eventually(
        "the new object's certificate selects the new cluster",
        Duration::from_secs(60),
        async || {
            // As the collector does, again: a pass of the controller that
            // was under way for the old object may write after the first.
            collect_garbage(t, old_uid).await;
            // Issued for the new object: a write of that old pass could
            // have put back a certificate for the old one.
            let secret = t
                .seed
                .get("v1", "Secret", &t.a, "kas-kube-apiserver-tunnel")
                .await;
            let owner = secret
                .as_ref()
                .map(|s| s["metadata"]["ownerReferences"][0]["uid"].clone());
            if owner.is_none() || owner == Some(serde_json::json!(old_uid)) {
                return false;
            }
            let new = kas_client_certificate(t, "new").await;
            !new.is_empty() && new != old && shared_frontend_answers(t, "new").await
        },
    )
    .await;
    assert!(
        !shared_frontend_answers(t, "old").await,
        "the old object's certificate selects the new cluster"
    );
}

/// Deletes every object in `t.a` whose controlling owner is `uid`.
async fn collect_garbage(t: &Onboarding, uid: &str) {
    let kinds = [
        (ROUTES, "TLSRoute"),
        (POLICIES, "SeedlinkPolicy"),
        (TUNNELS, "TunnelCluster"),
        ("v1", "Secret"),
        ("v1", "ConfigMap"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ];
    for (api, kind) in kinds {
        for o in kubeapi::list(&t.seed.client, api, kind, &t.a).await {
            let owned = o["metadata"]["ownerReferences"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|r| r["uid"] == uid));
            if owned {
                let name = o["metadata"]["name"].as_str().unwrap();
                assert!(t.seed.delete(api, kind, &t.a, name).await, "{kind}/{name}");
            }
        }
    }
}

/// `t.a`'s generated kube-apiserver client certificate and key, written to
/// `<dir>/<tag>.crt` and `.key`; returns the certificate (PEM), empty if
/// there is none yet.
async fn kas_client_certificate(t: &Onboarding, tag: &str) -> String {
    let Some(secret) = t
        .seed
        .get("v1", "Secret", &t.a, "kas-kube-apiserver-tunnel")
        .await
    else {
        return String::new();
    };
    let mut cert = String::new();
    for (key, to) in [("client.crt", "crt"), ("client.key", "key")] {
        let b: k8s_openapi::ByteString =
            serde_json::from_value(secret["data"][key].clone()).unwrap_or_default();
        if key == "client.crt" {
            cert = String::from_utf8_lossy(&b.0).into_owned();
        }
        std::fs::write(t.dir.path().join(format!("{tag}.{to}")), b.0).unwrap();
    }
    cert
}

/// Whether the shared frontend selects a cluster for the client
/// certificate `<dir>/<tag>.crt`: a plain proxy GET (curl) gets the
/// cluster's 405 (the frontend only carries CONNECT); a certificate that
/// selects none gets the connection closed.
async fn shared_frontend_answers(t: &Onboarding, tag: &str) -> bool {
    let d = t.dir.path().to_path_buf();
    let port = t.shared_frontend;
    let tag = tag.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "10",
            ])
            .args(["-x", &format!("https://tunnel.seedlink.test:{port}")])
            .args([
                "--resolve",
                &format!("tunnel.seedlink.test:{port}:127.0.0.1"),
            ])
            .arg("--proxy-cacert")
            .arg(d.join("seed-ca.pem"))
            .arg("--proxy-cert")
            .arg(d.join(format!("{tag}.crt")))
            .arg("--proxy-key")
            .arg(d.join(format!("{tag}.key")))
            .arg("http://127.0.0.1:1/")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    String::from_utf8_lossy(&out.stdout) == "405"
}

/// The host name of [`ipv6_and_dual_stack_endpoint_slices_are_served`].
const V6HOST: &str = "api.v6.kube.test";

/// A pod's address in an IPv6 EndpointSlice (on the seed namespace's
/// loopback; the API server refuses `::1` in a slice).
const POD_V6: &str = "fd00:99::2";

/// An IPv6 Service's pods, in an IPv6 EndpointSlice of the real API server,
/// are served at their IPv6 addresses; a dual-stack Service (the same pod
/// in an IPv4 and an IPv6 slice) at both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_and_dual_stack_endpoint_slices_are_served() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[V6HOST]).unwrap());
    let seed = Seed::new(true).await;
    let (ns, dialer) = seed.net.as_ref().unwrap();
    ns.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        &format!("{POD_V6}/128"),
        "dev",
        "lo",
        "nodad",
    ]);
    let l6 = dialer.bind(format!("[{POD_V6}]:0").parse().unwrap());
    let port = l6.local_addr().unwrap().port();
    let l4 = dialer.bind(format!("{POD_1}:{port}").parse().unwrap());
    for (l, name) in [(l6, "v6pod"), (l4, "v4pod")] {
        let config = pki.server_config(0).unwrap();
        tokio::spawn(seedlink::demo::serve_demo_apiserver(
            l,
            name.into(),
            config,
            stop.clone(),
        ));
    }
    seed.gateway_object().await;
    let t = seed.tenant("v6", true).await;
    let mut v6 = slice(&t, "kube-apiserver", port, &[(POD_V6, true)]);
    v6["metadata"]["name"] = json!("kube-apiserver-v6");
    v6["addressType"] = json!("IPv6");
    for o in [
        service(&t, "kube-apiserver"),
        v6,
        seed.route(&t, "kube-apiserver", V6HOST, "kube-apiserver"),
    ] {
        seed.apply(o).await;
    }
    let gw = seed.gateway("replica-v6", &seed.token).await;
    eventually(
        "served at the pod's IPv6 address",
        Duration::from_secs(60),
        async || {
            get(&pki, gw.tls, V6HOST)
                .await
                .is_ok_and(|b| b.contains("v6pod"))
        },
    )
    .await;
    // Dual-stack: the same Service in an IPv4 slice too; both are
    // endpoints, and both answer.
    seed.apply(slice(&t, "kube-apiserver", port, &[(POD_1, true)]))
        .await;
    let both = [format!("[{POD_V6}]:{port}"), format!("{POD_1}:{port}")];
    eventually(
        "both families' endpoints",
        Duration::from_secs(60),
        async || {
            let (_, config) = http_get(gw.admin, "/config").await;
            both.iter().all(|e| config.contains(e.as_str()))
        },
    )
    .await;
    let answered = std::sync::Mutex::new(std::collections::BTreeSet::new());
    eventually("both pods answer", Duration::from_secs(60), async || {
        if let Ok(b) = get(&pki, gw.tls, V6HOST).await {
            let name = ["v6pod", "v4pod"].into_iter().find(|n| b.contains(n));
            answered.lock().unwrap().extend(name);
        }
        answered.lock().unwrap().len() == 2
    })
    .await;
    stop.cancel();
}
