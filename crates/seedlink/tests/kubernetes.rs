//! The gateway driven by Kubernetes objects (TLSRoute, SeedlinkPolicy,
//! Service, EndpointSlice) served by the API-server stand-in in the test
//! kit: routes follow the objects under load, invalid objects are refused
//! with status and an Event while the rest serve, a 410 and an outage of
//! the API server drop nothing, and of two replicas one writes status.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::apiserver::ApiServer;
use common::*;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const A: &str = "api.a.kube.test";
const C: &str = "api.c.kube.test";
const GATEWAY: &str = "seedlink-system/seedlink";

fn route(ns: &str, name: &str, host: &str, svc: &str) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "TLSRoute",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "parentRefs": [{"name": "seedlink", "namespace": "seedlink-system", "sectionName": "tls"}],
            "hostnames": [host],
            "rules": [{"backendRefs": [{"name": svc, "port": 443}]}]
        }
    })
}

fn service(ns: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": 6443}]}
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
        "ports": [{"name": "https", "port": port}],
        "endpoints": endpoints
    })
}

/// The Gateway as the install ships it (routes from namespaces labelled
/// `seedlink.dev/gateway-access=true`) and the tenants' namespaces, so
/// labelled.
fn gateway_objects(api: &ApiServer) {
    api.apply(json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "seedlink", "namespace": "seedlink-system"},
        "spec": {
            "gatewayClassName": "seedlink",
            "listeners": [{"name": "tls", "port": 443, "protocol": "TLS", "tls": {"mode": "Passthrough"},
                           "allowedRoutes": {"namespaces": {"from": "Selector",
                               "selector": {"matchLabels": {"seedlink.dev/gateway-access": "true"}}}}}]
        }
    }));
    let burst = (0..30).map(|i| format!("shoot--burst-{i}"));
    let names = ["shoot--a", "shoot--b", "shoot--c", "shoot--d", "shoot--e"];
    for ns in names.iter().map(|n| n.to_string()).chain(burst) {
        api.apply(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": {"seedlink.dev/gateway-access": "true"}}
        }));
    }
}

fn policy(ns: &str, route: &str, cidrs: &[&str]) -> Value {
    json!({
        "apiVersion": "policy.seedlink.dev/v1alpha1", "kind": "SeedlinkPolicy",
        "metadata": {"name": "acl", "namespace": ns},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute", "name": route}],
            "allowedSourceCIDRs": cidrs
        }
    })
}

/// Two demo kube-apiservers ("pods") on 127.0.0.2 and 127.0.0.3, one port.
async fn two_pods(
    pki: &Arc<seedlink::demo::Pki>,
    host: usize,
    name: &str,
    stop: &CancellationToken,
) -> u16 {
    for _ in 0..20 {
        let l1 = TcpListener::bind("127.0.0.2:0").await.unwrap();
        let port = l1.local_addr().unwrap().port();
        let Ok(l2) = TcpListener::bind(("127.0.0.3", port)).await else {
            continue;
        };
        for (l, pod) in [(l1, "1"), (l2, "2")] {
            tokio::spawn(seedlink::demo::serve_demo_apiserver(
                l,
                format!("{name}{pod}"),
                pki.server_config(host).unwrap(),
                stop.clone(),
            ));
        }
        return port;
    }
    panic!("no port free on both 127.0.0.2 and 127.0.0.3");
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

/// Polls `check` every 50 ms for at most `limit`.
async fn wait_for<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < end, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Our condition `type_` on the route's (or policy's) status, if written.
fn condition(api: &ApiServer, plural: &str, ns: &str, name: &str, type_: &str) -> Option<Value> {
    let o = api.get(plural, ns, name)?;
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

fn gateway_yaml() -> String {
    format!("admin: {{listen: '127.0.0.1:0'}}\nlisteners: [{{name: tls, address: '127.0.0.1:0'}}]\nkubernetes: {{gateway: {GATEWAY}, loopback_endpoints: true}}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_the_objects_under_load_through_conflicts_a_410_and_an_outage() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A, C]).unwrap());
    let port_a = two_pods(&pki, 0, "a", &stop).await;
    let port_c = two_pods(&pki, 1, "c", &stop).await;
    let api = ApiServer::start(&[("token-a", "replica-a")]).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.kubeconfig(dir.path(), "token-a");
    gateway_objects(&api);
    api.apply(service("shoot--a", "kube-apiserver"));
    api.apply(slice(
        "shoot--a",
        "kube-apiserver",
        port_a,
        &[("127.0.0.2", true), ("127.0.0.3", true)],
    ));
    api.apply(route("shoot--a", "kube-apiserver", A, "kube-apiserver"));

    let gw = Gw::start_with_env(
        &gateway_yaml(),
        &[
            ("KUBECONFIG", kubeconfig.to_str().unwrap()),
            ("POD_NAME", "replica-a"),
        ],
    );
    // Ready means the first snapshot is in: the route serves at once, on
    // both pods (least-connections spreads sequential requests).
    let body = get(&pki, gw.tls, A).await.unwrap();
    assert!(body.contains("hello from a"), "{body}");
    wait_for(
        "route status Accepted=True",
        Duration::from_secs(20),
        || async {
            condition(&api, "tlsroutes", "shoot--a", "kube-apiserver", "Accepted")
                .is_some_and(|c| c["status"] == "True")
        },
    )
    .await;
    let resolved = condition(
        &api,
        "tlsroutes",
        "shoot--a",
        "kube-apiserver",
        "ResolvedRefs",
    )
    .unwrap();
    assert_eq!(resolved["status"], "True");
    assert_eq!(resolved["observedGeneration"], 1);

    // A younger route claiming the same host name: refused with a
    // condition and an Event; the older one keeps serving.
    api.apply(route("shoot--b", "kube-apiserver", A, "kube-apiserver"));
    wait_for(
        "the conflicting route is not accepted",
        Duration::from_secs(20),
        || async {
            condition(&api, "tlsroutes", "shoot--b", "kube-apiserver", "Accepted").is_some_and(
                |c| {
                    c["status"] == "False"
                        && c["message"].as_str().unwrap_or("").contains("already used")
                },
            )
        },
    )
    .await;
    wait_for(
        "an Event for the refused route",
        Duration::from_secs(10),
        || async {
            api.writes()
                .iter()
                .any(|w| w.method == "POST" && w.path == "/api/v1/namespaces/shoot--b/events")
        },
    )
    .await;
    assert!(get(&pki, gw.tls, A).await.unwrap().contains("hello from a"));

    // A route from a namespace the Gateway's listener does not admit:
    // not accepted, nothing served.
    api.apply(route(
        "outsider",
        "kube-apiserver",
        "api.outsider.kube.test",
        "kube-apiserver",
    ));
    wait_for(
        "the outsider's route is not allowed",
        Duration::from_secs(20),
        || async {
            condition(&api, "tlsroutes", "outsider", "kube-apiserver", "Accepted")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "NotAllowedByListeners")
        },
    )
    .await;

    // A missing backend Service: ResolvedRefs=False, BackendNotFound.
    api.apply(route(
        "shoot--d",
        "kube-apiserver",
        "api.d.kube.test",
        "nothing-here",
    ));
    wait_for("BackendNotFound", Duration::from_secs(20), || async {
        condition(
            &api,
            "tlsroutes",
            "shoot--d",
            "kube-apiserver",
            "ResolvedRefs",
        )
        .is_some_and(|c| c["status"] == "False" && c["reason"] == "BackendNotFound")
    })
    .await;

    // An allow-list without us: refused; an invalid edit keeps it; a
    // valid one lets us in again.
    api.apply(policy("shoot--a", "kube-apiserver", &["192.0.2.0/24"]));
    wait_for("the ACL applies", Duration::from_secs(20), || async {
        get(&pki, gw.tls, A).await.is_err()
    })
    .await;
    wait_for("policy Accepted=True", Duration::from_secs(20), || async {
        condition(&api, "seedlinkpolicies", "shoot--a", "acl", "Accepted")
            .is_some_and(|c| c["status"] == "True")
    })
    .await;
    api.apply(policy("shoot--a", "kube-apiserver", &["300.0.0.0/8"]));
    wait_for("policy Invalid", Duration::from_secs(20), || async {
        condition(&api, "seedlinkpolicies", "shoot--a", "acl", "Accepted")
            .is_some_and(|c| c["reason"] == "Invalid")
    })
    .await;
    assert!(
        get(&pki, gw.tls, A).await.is_err(),
        "an invalid edit must not open the route"
    );
    api.apply(policy("shoot--a", "kube-apiserver", &["127.0.0.0/8"]));
    wait_for("the new ACL admits us", Duration::from_secs(20), || async {
        get(&pki, gw.tls, A).await.is_ok()
    })
    .await;

    // Pod 1 terminating (ready=false): new connections go to pod 2 only.
    api.apply(slice(
        "shoot--a",
        "kube-apiserver",
        port_a,
        &[("127.0.0.2", false), ("127.0.0.3", true)],
    ));
    wait_for("only pod 2 answers", Duration::from_secs(20), || async {
        for _ in 0..12 {
            match get(&pki, gw.tls, A).await {
                Ok(b) if b.contains("hello from a2") => {}
                _ => return false,
            }
        }
        true
    })
    .await;

    // Load on route a while route c comes and goes, the watches expire
    // and the API server goes away and comes back.
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
    api.apply(service("shoot--c", "kube-apiserver"));
    api.apply(slice(
        "shoot--c",
        "kube-apiserver",
        port_c,
        &[("127.0.0.2", true), ("127.0.0.3", true)],
    ));
    for round in 0..6 {
        api.apply(route("shoot--c", "kube-apiserver", C, "kube-apiserver"));
        wait_for("route c serves", Duration::from_secs(20), || async {
            get(&pki, gw.tls, C).await.is_ok()
        })
        .await;
        match round {
            1 => api.expire_watches(),
            3 => {
                api.stop();
                // The API server is gone: the last snapshot keeps serving
                // and readiness stays true.
                let (code, _) = gw.get("/readyz").await;
                assert_eq!(code, 200);
                assert!(get(&pki, gw.tls, C).await.is_ok());
                api.start_again().await;
            }
            _ => {}
        }
        assert!(api.remove("tlsroutes", "shoot--c", "kube-apiserver"));
        wait_for("route c is gone", Duration::from_secs(30), || async {
            get(&pki, gw.tls, C).await.is_err()
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

    // The gateway's own file broken: a new route is not applied, and its
    // status says so rather than claiming it is served; the file fixed,
    // it is.
    gw.write_config(&format!("{}bogus: 1\n", gateway_yaml()));
    api.apply(route(
        "shoot--e",
        "kube-apiserver",
        "api.e.kube.test",
        "kube-apiserver",
    ));
    wait_for(
        "route e pending on the broken file",
        Duration::from_secs(20),
        || async {
            condition(&api, "tlsroutes", "shoot--e", "kube-apiserver", "Accepted").is_some_and(
                |c| {
                    c["status"] == "False"
                        && c["message"]
                            .as_str()
                            .unwrap_or("")
                            .contains("configuration file is invalid")
                },
            )
        },
    )
    .await;
    // The running routes keep serving.
    assert!(get(&pki, gw.tls, A)
        .await
        .unwrap()
        .contains("hello from a2"));
    gw.write_config(&gateway_yaml());
    wait_for(
        "route e accepted once the file is fixed",
        Duration::from_secs(20),
        || async {
            condition(&api, "tlsroutes", "shoot--e", "kube-apiserver", "Accepted")
                .is_some_and(|c| c["status"] == "True")
        },
    )
    .await;

    // A burst: thirty routes created at once become one snapshot (or a
    // few), not thirty reloads.
    let generation = |body: String| -> u64 {
        serde_json::from_str::<Value>(&body).unwrap()["generation"]
            .as_u64()
            .unwrap()
    };
    let before = generation(gw.get("/config").await.1);
    for i in 0..30 {
        api.apply(route(
            &format!("shoot--burst-{i}"),
            "kube-apiserver",
            &format!("api.burst-{i}.kube.test"),
            "kube-apiserver",
        ));
    }
    wait_for(
        "the burst's last route is served",
        Duration::from_secs(20),
        || async {
            let (_, body) = gw.get("/config").await;
            body.contains("api.burst-29.kube.test")
        },
    )
    .await;
    let after = generation(gw.get("/config").await.1);
    eprintln!("a burst of 30 routes: {} reload(s)", after - before);
    assert!(
        after - before <= 5,
        "30 routes took {} reloads",
        after - before
    );

    // Deleting the route stops it.
    api.remove("tlsroutes", "shoot--a", "kube-apiserver");
    wait_for("route a is gone", Duration::from_secs(20), || async {
        get(&pki, gw.tls, A).await.is_err()
    })
    .await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_serve_and_one_writes_status_until_it_goes() {
    let stop = CancellationToken::new();
    let pki = Arc::new(seedlink::demo::Pki::generate(&[A, C]).unwrap());
    let port_a = two_pods(&pki, 0, "a", &stop).await;
    let port_c = two_pods(&pki, 1, "c", &stop).await;
    let api = ApiServer::start(&[("token-a", "replica-a"), ("token-b", "replica-b")]).await;
    let dir = tempfile::tempdir().unwrap();
    gateway_objects(&api);
    api.apply(service("shoot--a", "kube-apiserver"));
    api.apply(slice(
        "shoot--a",
        "kube-apiserver",
        port_a,
        &[("127.0.0.2", true)],
    ));
    api.apply(route("shoot--a", "kube-apiserver", A, "kube-apiserver"));
    let mut replicas = Vec::new();
    for (token, pod) in [("token-a", "replica-a"), ("token-b", "replica-b")] {
        let kc = api.kubeconfig(dir.path(), token);
        replicas.push(Gw::start_with_env(
            &gateway_yaml(),
            &[("KUBECONFIG", kc.to_str().unwrap()), ("POD_NAME", pod)],
        ));
    }
    for gw in &replicas {
        assert!(get(&pki, gw.tls, A)
            .await
            .unwrap()
            .contains("hello from a1"));
    }
    wait_for("route status", Duration::from_secs(20), || async {
        condition(&api, "tlsroutes", "shoot--a", "kube-apiserver", "Accepted").is_some()
    })
    .await;
    let status_writers = |api: &ApiServer| -> Vec<String> {
        let mut users: Vec<String> = api
            .writes()
            .into_iter()
            .filter(|w| w.path.ends_with("/status"))
            .map(|w| w.user)
            .collect();
        users.dedup();
        users
    };
    let writers = status_writers(&api);
    assert_eq!(writers.len(), 1, "status written by {writers:?}");
    let lease = api
        .get("leases", "seedlink-system", "seedlink-status")
        .unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], writers[0].as_str());

    // The writer goes; the other takes the lease once it expired and
    // writes the status of a new route.
    let leader = if writers[0] == "replica-a" { 0 } else { 1 };
    let mut gone = replicas.remove(leader);
    gone.signal("KILL");
    gone.wait_exit(Duration::from_secs(10));
    api.apply(service("shoot--c", "kube-apiserver"));
    api.apply(slice(
        "shoot--c",
        "kube-apiserver",
        port_c,
        &[("127.0.0.3", true)],
    ));
    api.apply(route("shoot--c", "kube-apiserver", C, "kube-apiserver"));
    wait_for(
        "route c served by the survivor",
        Duration::from_secs(20),
        || async { get(&pki, replicas[0].tls, C).await.is_ok() },
    )
    .await;
    wait_for(
        "the survivor writes status",
        Duration::from_secs(40),
        || async {
            condition(&api, "tlsroutes", "shoot--c", "kube-apiserver", "Accepted").is_some()
        },
    )
    .await;
    let survivor = if leader == 0 {
        "replica-b"
    } else {
        "replica-a"
    };
    let c_writers: Vec<String> = api
        .writes()
        .into_iter()
        .filter(|w| {
            w.path
                .ends_with("/shoot--c/tlsroutes/kube-apiserver/status")
        })
        .map(|w| w.user)
        .collect();
    assert!(c_writers.iter().all(|u| u == survivor), "{c_writers:?}");
    let lease = api
        .get("leases", "seedlink-system", "seedlink-status")
        .unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], survivor);
    assert_eq!(lease["spec"]["leaseTransitions"], 1);
    stop.cancel();
}

fn tunnel_cluster(ns: &str, ca: Value) -> Value {
    json!({
        "apiVersion": "tunnel.seedlink.dev/v1alpha1", "kind": "TunnelCluster",
        "metadata": {"name": "tunnel", "namespace": ns},
        "spec": {"agentCA": ca}
    })
}

/// Starts `seedlink tunnel-agent` on loopback with a client certificate.
fn tunnel_agent(server: &str, seed_ca: &str, cert: &str, key: &str) -> Proc {
    let mut child = std::process::Command::new(seedlink_bin())
        .args([
            "tunnel-agent",
            "--deny-cidr",
            seedlink_testkit::SHOOT_LOOPBACK_DENY,
            "--server",
            server,
            "--server-name",
            "tunnel.seedlink.test",
        ])
        .args([
            "--ca-cert",
            seed_ca,
            "--agent-cert",
            cert,
            "--agent-key",
            key,
        ])
        .args([
            "--admin",
            "127.0.0.1:0",
            "--sync-interval",
            "0.2",
            "--sync-interval-cap",
            "2",
        ])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready = common::tunnel_env::ready_line(&mut child);
    assert_eq!(ready["event"], "ready", "{ready}");
    Proc(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_clusters_come_from_objects_with_their_health_in_status() {
    use common::tunnel_env::{kas_connect, kas_connect_eventually, ready_line};
    let stop = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let seed = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
    let (shoot_a, shoot_b) = (
        seedlink::demo::Pki::generate(&[]).unwrap(),
        seedlink::demo::Pki::generate(&[]).unwrap(),
    );
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let seed_ca = w("seed-ca.pem", &seed.ca_pem);
    let (tun_crt, tun_key) = (
        w("tun.pem", &seed.servers[0].1.cert_pem),
        w("tun-key.pem", &seed.servers[0].1.key_pem),
    );
    let (a_crt, a_key) = (
        w("a.pem", &shoot_a.client.cert_pem),
        w("a-key.pem", &shoot_a.client.key_pem),
    );
    let (b_crt, b_key) = (
        w("b.pem", &shoot_b.client.cert_pem),
        w("b-key.pem", &shoot_b.client.key_pem),
    );
    let echo = echo_backend(&stop).await;

    let api = ApiServer::start(&[("token-t", "tunnel-server")]).await;
    let kubeconfig = api.kubeconfig(d, "token-t");
    api.apply(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "agent-ca", "namespace": "shoot--a"},
        "data": {"ca.crt": common::apiserver::base64(shoot_a.ca_pem.as_bytes())}
    }));
    api.apply(tunnel_cluster(
        "shoot--a",
        json!({"secret": "agent-ca", "key": "ca.crt"}),
    ));
    // Its ConfigMap does not exist yet.
    api.apply(tunnel_cluster(
        "shoot--b",
        json!({"configMap": "agent-ca", "key": "ca.crt"}),
    ));

    let config = d.join("tunnel.yaml");
    std::fs::write(
        &config,
        format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{tun_crt}', key: '{tun_key}', keepalive: 1s, keepalive_timeout: 1s}}
admin: {{listen: '127.0.0.1:0'}}
clusters: []
frontend_templates:
  - {{name: uds, protocol: http-connect, unix: '{}/{{cluster}}.sock'}}
kubernetes: {{lease: seedlink-system/seedlink-tunnel-status, trust_dir: '{}/trust'}}
",
            d.display(),
            d.display()
        ),
    )
    .unwrap();
    let mut server = std::process::Command::new(seedlink_bin())
        .args(["tunnel-server", "--config"])
        .arg(&config)
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", "tunnel-0")
        .env(
            "RUST_LOG",
            std::env::var("SERVER_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready = ready_line(&mut server);
    let _server = Proc(server);
    assert_eq!(ready["event"], "ready", "{ready}");
    let agents = ready["agents"].as_str().unwrap().to_string();
    let sock_a = d.join("shoot--a.tunnel.sock").display().to_string();
    let sock_b = d.join("shoot--b.tunnel.sock").display().to_string();

    let tc = |ns: &str, type_: &str| -> Option<Value> {
        let o = api.get("tunnelclusters", ns, "tunnel")?;
        o["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == type_)
            .cloned()
    };
    wait_for(
        "shoot--a Ready, no agents",
        Duration::from_secs(20),
        || async {
            tc("shoot--a", "Ready").is_some_and(|c| c["status"] == "True")
                && tc("shoot--a", "AgentsConnected")
                    .is_some_and(|c| c["status"] == "False" && c["reason"] == "NoAgents")
        },
    )
    .await;
    wait_for(
        "shoot--b refused for its missing ConfigMap",
        Duration::from_secs(20),
        || async {
            tc("shoot--b", "Ready")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "ReferenceNotFound")
        },
    )
    .await;
    wait_for("an Event for shoot--b", Duration::from_secs(10), || async {
        api.writes()
            .iter()
            .any(|w| w.method == "POST" && w.path == "/api/v1/namespaces/shoot--b/events")
    })
    .await;

    // An agent of shoot--a: connected in status, and the tunnel works.
    let agent_a = tunnel_agent(&agents, &seed_ca, &a_crt, &a_key);
    wait_for(
        "shoot--a AgentsConnected",
        Duration::from_secs(20),
        || async {
            tc("shoot--a", "AgentsConnected").is_some_and(|c| c["status"] == "True")
                && api
                    .get("tunnelclusters", "shoot--a", "tunnel")
                    .is_some_and(|o| {
                        o["status"]["agents"] == 1 && o["status"]["lastAgentSeen"].is_string()
                    })
        },
    )
    .await;
    let mut s = kas_connect_eventually(&sock_a, &echo.to_string(), Duration::from_secs(20)).await;
    common::tunnel_env::echo_rtt(&mut s, 1000).await;

    // The ConfigMap appears: shoot--b is served and its agent is let in.
    api.apply(json!({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agent-ca", "namespace": "shoot--b"},
        "data": {"ca.crt": shoot_b.ca_pem}
    }));
    wait_for("shoot--b Ready", Duration::from_secs(20), || async {
        tc("shoot--b", "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await;
    let _agent_b = tunnel_agent(&agents, &seed_ca, &b_crt, &b_key);
    let mut sb = kas_connect_eventually(&sock_b, &echo.to_string(), Duration::from_secs(20)).await;
    common::tunnel_env::echo_rtt(&mut sb, 1000).await;
    // shoot--a's tunnel was not touched by shoot--b's arrival.
    common::tunnel_env::echo_rtt(&mut s, 1000).await;

    // shoot--a's agent goes: the status says so.
    drop(agent_a);
    wait_for(
        "shoot--a NoAgents again",
        Duration::from_secs(20),
        || async { tc("shoot--a", "AgentsConnected").is_some_and(|c| c["status"] == "False") },
    )
    .await;

    // shoot--a's object goes: its socket stops answering, its trust files go.
    assert!(api.remove("tunnelclusters", "shoot--a", "tunnel"));
    wait_for(
        "shoot--a's socket is gone",
        Duration::from_secs(20),
        || async { kas_connect(&sock_a, &echo.to_string()).await.is_err() },
    )
    .await;
    wait_for(
        "shoot--a's trust files are removed",
        Duration::from_secs(10),
        || async { !d.join("trust/shoot--a.tunnel").exists() },
    )
    .await;
    common::tunnel_env::echo_rtt(&mut sb, 1000).await;
    stop.cancel();
}
