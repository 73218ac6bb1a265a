//! `--scenario kube-scale`: the Kubernetes source at growing tenant
//! counts (`--tenants 10,100,1000`), on a real kube-apiserver and etcd
//! (the test kit's, with the API server's watch cache on, as in a real
//! seed).
//!
//! Each tenant is a namespace with what a control plane brings: a
//! TLSRoute, a SeedlinkPolicy, a TunnelCluster with its trust ConfigMap
//! (a CA of its own) and the RoleBinding that lets the tunnel-server read
//! it, a Service and its EndpointSlice, and a Service no route names (as
//! etcd's or monitoring's in a control plane's namespace) with its
//! EndpointSlice. At each count a gateway and a
//! tunnel-server start as the install's ServiceAccount, each through a
//! proxy that counts its connections to the API server, and the bench
//! measures:
//! - cold start: from the process's start until it serves every tenant
//!   (its `api/state` lists them all);
//! - memory: the resident set then, and per tenant between counts;
//! - then, once the gateway has written every new object's status (each
//!   write is an event that wakes a pass: once per object ever in a seed),
//!   the steady state:
//! - a change to one tenant (its EndpointSlice gets a new address), from
//!   the write until the gateway serves the new endpoint, while 10 other
//!   tenants change every second: p50 and p99, and the gateway's CPU per
//!   change (all changes counted; it includes answering this bench's
//!   polls of that one tenant's `api/state?control_plane=` every 50 ms).
//!   One change starts every [`CHANGE_EVERY`], whatever the latency, so
//!   that every count runs the same phase (the same time, the same number
//!   of background changes) and the CPU per change compares like with
//!   like;
//!   and the mean duration of the gateway's passes meanwhile (translate
//!   and apply: the source's own work);
//! - the connections each opened to the API server;
//! - writes to the slices of the Services no route names, 10 a second:
//!   the gateway's passes and CPU per write meanwhile;
//! - tenants' agent CAs replaced (their trust ConfigMaps), 10 a second:
//!   the tunnel-server's passes, mean pass and CPU per rotation;
//! - then a second tunnel-server with `trust_watch: cluster` (bound
//!   cluster-wide) in the first one's place: its cold start, memory and
//!   connections.
//!
//! No agents connect here: agents (2 per tenant, 2,000 at 1,000 tenants)
//! and a replica's restart under them are `--scenario tunnel-restart`
//! (`tunnel_restart.rs`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use seedlink_testkit::faults::{Fault, FaultProxy};
use seedlink_testkit::kubeapi::{self, KubeApi};
use serde_json::{json, Value};

use crate::procstat;
use crate::scenario::Opts;

pub(crate) const SYS: &str = "seedlink-system";
const ROUTES: &str = "gateway.networking.k8s.io/v1";
/// Foreground changes per count.
const CHANGES: usize = 30;
/// Other tenants changed per second meanwhile.
const BACKGROUND_PER_SEC: u64 = 10;
/// One foreground change starts this often (a change not yet served by
/// then delays the next): the change phase lasts [`CHANGES`] times this at
/// every count. Before, each change started when the last was served, so a
/// count whose changes were served sooner had a shorter phase, fewer
/// background changes and a smaller divisor for the same work.
const CHANGE_EVERY: Duration = Duration::from_secs(1);
/// How long anything here waits for seedlink (a bound, not a figure).
const WAIT: Duration = Duration::from_secs(300);

/// One count's figures.
struct Row {
    tenants: usize,
    gw_cold: Duration,
    tun_cold: Duration,
    gw_rss_kib: f64,
    tun_rss_kib: f64,
    change_p50: Duration,
    change_p99: Duration,
    cpu_ms_per_change: f64,
    /// The gateway's passes during the changes and their mean duration.
    gw_passes: (f64, f64),
    gw_conns: u64,
    tun_conns: u64,
    /// The tunnel-server's passes until it served every tenant, and their
    /// mean duration.
    tun_passes: (f64, f64),
    /// The tunnel-server with `trust_watch: cluster`: cold start, RSS and
    /// connections.
    tun_cluster: (Duration, f64, u64),
    /// Writes to slices of Services no route names: the gateway's passes
    /// and CPU per write meanwhile.
    unrelated: (f64, f64),
    /// Tenants' CAs rotated: the tunnel-server's passes, their mean
    /// duration and its CPU (ms) per rotation meanwhile.
    rotations: (f64, f64, f64),
}

pub async fn run(opts: &Opts) -> anyhow::Result<()> {
    let rows = scale(opts).await?;
    print(&rows);
    Ok(())
}

/// Every count of `opts.tenants` in turn, on one API server: each count's
/// figures.
async fn scale(opts: &Opts) -> anyhow::Result<Vec<Row>> {
    let api = api_server().await?;
    let client = api.client().await?;
    apply(
        &client,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYS}}),
    )
    .await?;
    let token = api.install_rbac(&client, SYS).await;
    // For the tunnel-server with `trust_watch: cluster` (the chart's
    // tunnelTrustWatch=cluster binds the same).
    apply(
        &client,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "seedlink-tunnel-trust"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": format!("seedlink-tunnel-trust-{SYS}")},
               "subjects": [{"kind": "ServiceAccount", "name": "seedlink", "namespace": SYS}]}),
    )
    .await?;
    for o in gateway_objects() {
        apply(&client, o).await?;
    }
    let dir = tempfile::tempdir()?;
    let mut rows = Vec::new();
    let mut made = 0;
    for &n in &opts.tenants {
        let started = Instant::now();
        create(&client, made..n).await?;
        eprintln!(
            "kube-scale: {n} tenants written in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        made = n;
        rows.push(measure(&api, &client, &token, n, dir.path(), opts).await?);
    }
    Ok(rows)
}

/// The test kit's kube-apiserver with the CRDs and its watch cache on, as
/// in a real seed.
pub(crate) async fn api_server() -> anyhow::Result<KubeApi> {
    let api = tokio::task::spawn_blocking(|| {
        KubeApi::start_with(kubeapi::Options {
            crds: true,
            args: vec!["--watch-cache=true".into()],
            ..Default::default()
        })
    })
    .await?;
    Ok(api)
}

pub(crate) async fn apply(client: &kube::Client, o: Value) -> anyhow::Result<Value> {
    let what = format!("{} {}", o["kind"], o["metadata"]["name"]);
    kubeapi::try_apply(client, o).await.with_context(|| what)
}

/// The class and the named Gateway every route attaches to.
fn gateway_objects() -> Vec<Value> {
    vec![
        json!({"apiVersion": ROUTES, "kind": "GatewayClass", "metadata": {"name": "seedlink"},
               "spec": {"controllerName": "seedlink.dev/gateway"}}),
        json!({"apiVersion": ROUTES, "kind": "Gateway",
               "metadata": {"name": "seedlink", "namespace": SYS},
               "spec": {"gatewayClassName": "seedlink",
                        "listeners": [{"name": "tls", "port": 443, "protocol": "TLS",
                                       "tls": {"mode": "Passthrough"},
                                       "allowedRoutes": {"namespaces": {"from": "All"}}}]}}),
    ]
}

pub(crate) fn ns(i: usize) -> String {
    format!("t-{i}")
}

fn host(i: usize) -> String {
    format!("api.t-{i}.kube.test")
}

/// Tenant `i`'s objects.
fn tenant(i: usize) -> anyhow::Result<Vec<Value>> {
    let ns = ns(i);
    Ok(vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        trust_binding(&ns),
        trust(&ns)?,
        tunnel_cluster(&ns),
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "kube-apiserver", "namespace": ns},
               "spec": {"selector": {"app": "kube-apiserver"},
                        "ports": [{"name": "https", "port": 443, "targetPort": 6443}]}}),
        slice(i, 0),
        // A Service no route names, as a control plane's namespace holds
        // many (etcd, monitoring, the VPN): its slice churns too.
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "etcd-main-client", "namespace": ns},
               "spec": {"selector": {"app": "etcd"},
                        "ports": [{"name": "client", "port": 2379}]}}),
        other_slice(i, 0),
        json!({"apiVersion": ROUTES, "kind": "TLSRoute",
               "metadata": {"name": "kube-apiserver", "namespace": ns},
               "spec": {"parentRefs": [{"name": "seedlink", "namespace": SYS, "sectionName": "tls"}],
                        "hostnames": [host(i)],
                        "rules": [{"backendRefs": [{"name": "kube-apiserver", "port": 443}]}]}}),
        json!({"apiVersion": "policy.seedlink.dev/v1alpha1", "kind": "SeedlinkPolicy",
               "metadata": {"name": "acl", "namespace": ns},
               "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "TLSRoute",
                                        "name": "kube-apiserver"}],
                        "allowedSourceCIDRs": ["10.0.0.0/8"]}}),
    ])
}

/// Tenant `i`'s EndpointSlice at version `v` (its one address changes
/// with `v`).
fn slice(i: usize, v: usize) -> Value {
    slice_of(i, ("kube-apiserver", "https", 6443), v)
}

/// Tenant `i`'s EndpointSlice of the Service no route names, at version
/// `v`.
fn other_slice(i: usize, v: usize) -> Value {
    slice_of(i, ("etcd-main-client", "client", 2379), v)
}

/// Tenant `i`'s slice of `service` (its port's name and number) at
/// version `v`.
fn slice_of(i: usize, (service, port_name, port): (&str, &str, u16), v: usize) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{service}-x1"), "namespace": ns(i),
                        "labels": {"kubernetes.io/service-name": service,
                                   "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
           "addressType": "IPv4",
           "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
           "endpoints": [{"addresses": [address(i, v)], "conditions": {"ready": true}}]})
}

/// Tenant `i`'s control plane's name (its route's namespace and name).
fn cp_name(i: usize) -> String {
    format!("{}.kube-apiserver", ns(i))
}

fn address(i: usize, v: usize) -> String {
    format!("10.{}.{}.{}", i / 256 % 256, i % 256, v % 250 + 1)
}

/// Writes tenants `range`, 16 at a time (each tenant's objects in order).
async fn create(client: &kube::Client, range: std::ops::Range<usize>) -> anyhow::Result<()> {
    let results: Vec<anyhow::Result<()>> = futures_util::stream::iter(range)
        .map(|i| async move {
            for o in tenant(i)? {
                apply(client, o).await?;
            }
            Ok(())
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

/// A started seedlink role and what the bench reads of it.
struct Role {
    child: std::process::Child,
    admin: SocketAddr,
    proxy: FaultProxy,
    started: Instant,
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start(
    api: &KubeApi,
    token: &str,
    role: &str,
    config: &str,
    dir: &Path,
    opts: &Opts,
) -> anyhow::Result<Role> {
    let proxy = FaultProxy::start(api.addr, Fault::Pass).await;
    let kubeconfig = api.kubeconfig(dir, role, token, Some(proxy.addr));
    let file = dir.join(format!("{role}.yaml"));
    std::fs::write(&file, config)?;
    let started = Instant::now();
    let mut child = std::process::Command::new(&opts.seedlink)
        .args([role, "--config"])
        .arg(&file)
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAME", format!("{role}-0"))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let ready = tokio::task::block_in_place(|| seedlink_testkit::ready_line(&mut child));
    let admin = ready["admin"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .context("no admin address in the ready line")?;
    Ok(Role {
        child,
        admin,
        proxy,
        started,
    })
}

/// `api/state` of `admin`.
async fn state(admin: SocketAddr) -> Value {
    state_at(admin, "/api/state").await
}

async fn state_at(admin: SocketAddr, path: &str) -> Value {
    let (_, body) = seedlink_testkit::http_get(admin, path).await;
    serde_json::from_str(&body).unwrap_or(Value::Null)
}

/// Waits until `count` of the role's `api/state` reaches `n`: the time
/// from its start.
async fn served(role: &Role, n: usize, count: fn(&Value) -> usize) -> anyhow::Result<Duration> {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if count(&state(role.admin).await) >= n {
            return Ok(role.started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("not every tenant served within {WAIT:?}")
}

fn control_planes(s: &Value) -> usize {
    s["control_planes"].as_array().map_or(0, |c| c.len())
}

fn clusters(s: &Value) -> usize {
    s["clusters"].as_array().map_or(0, |c| c.len())
}

async fn measure(
    api: &KubeApi,
    client: &kube::Client,
    token: &str,
    n: usize,
    dir: &Path,
    opts: &Opts,
) -> anyhow::Result<Row> {
    let gw_cfg = format!("admin: {{listen: '127.0.0.1:0'}}\nlisteners: [{{name: tls, address: '127.0.0.1:0'}}]\nkubernetes: {{gateway: {SYS}/seedlink}}\n");
    let sockets = dir.join(format!("sockets-{n}"));
    for watch in ["namespaces", "cluster"] {
        std::fs::create_dir_all(sockets.join(watch))?;
    }
    let tun_cfg = |watch: &str| -> anyhow::Result<String> {
        let s = sockets.join(watch);
        Ok(format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{key}'}}\nadmin: {{listen: '127.0.0.1:0'}}\nclusters: []\nfrontend_templates:\n  - {{name: uds, protocol: http-connect, unix: '{s}/{{cluster}}.sock'}}\nkubernetes: {{lease: {SYS}/seedlink-tunnel-status, trust_dir: '{s}/trust', trust_watch: {watch}}}\n",
            crt = server_cert(dir)?.0,
            key = server_cert(dir)?.1,
            s = s.display()
        ))
    };
    let gw = start(api, token, "gateway", &gw_cfg, dir, opts).await?;
    let tun = start(
        api,
        token,
        "tunnel-server",
        &tun_cfg("namespaces")?,
        dir,
        opts,
    )
    .await?;
    let gw_cold = served(&gw, n, control_planes).await?;
    let tun_cold = served(&tun, n, clusters).await?;
    let tun_passes = passes(tun.admin).await;
    let (gw_pid, tun_pid) = (gw.child.id(), tun.child.id());
    let (gw_rss_kib, tun_rss_kib) = (procstat::rss_kib(&[gw_pid]), procstat::rss_kib(&[tun_pid]));
    // Brand-new objects have no status: the gateway writes every route's
    // and policy's (at its budget of 50 a second), and each write is a
    // watch event that wakes a pass. In a seed that is once per object
    // ever; measured here is the steady state after it.
    status_written(gw.admin).await?;
    eprintln!("kube-scale: {n} tenants: changes");
    let cpu0 = procstat::cpu_seconds(&[gw_pid]);
    let passes0 = pass_totals(gw.admin).await;
    let phase = Instant::now();
    let (latencies, background) = changes(client, &gw, n).await?;
    let cpu = procstat::cpu_seconds(&[gw_pid]) - cpu0;
    eprintln!(
        "kube-scale: {n} tenants: {} changes and {background} background ones in {:.1} s, gateway CPU {:.0} ms",
        latencies.len(),
        phase.elapsed().as_secs_f64(),
        cpu * 1000.0
    );
    let passes1 = pass_totals(gw.admin).await;
    let unrelated = unrelated_churn(client, gw_pid, gw.admin, n).await?;
    let rotations = rotations(client, tun_pid, tun.admin, n).await?;
    let tun_conns = tun
        .proxy
        .accepted
        .load(std::sync::atomic::Ordering::Relaxed);
    // In its place (one replica writes status, as before), the same
    // tunnel-server watching the trust cluster-wide.
    drop(tun);
    let tun_c = start(api, token, "tunnel-server", &tun_cfg("cluster")?, dir, opts).await?;
    let tun_cluster = (
        served(&tun_c, n, clusters).await?,
        procstat::rss_kib(&[tun_c.child.id()]),
        tun_c
            .proxy
            .accepted
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    let gw_passes = mean((passes1.0 - passes0.0, passes1.1 - passes0.1));
    let mut sorted = latencies.clone();
    sorted.sort();
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    Ok(Row {
        tenants: n,
        gw_cold,
        tun_cold,
        gw_rss_kib,
        tun_rss_kib,
        change_p50: at(0.5),
        change_p99: at(0.99),
        cpu_ms_per_change: cpu * 1000.0 / (latencies.len() + background) as f64,
        gw_passes,
        gw_conns: gw.proxy.accepted.load(std::sync::atomic::Ordering::Relaxed),
        tun_conns,
        tun_passes,
        tun_cluster,
        unrelated,
        rotations,
    })
}

/// [`CHANGES`] tenants' agent CAs replaced (their trust ConfigMap gets a
/// new CA), [`BACKGROUND_PER_SEC`] a second: the tunnel-server's passes,
/// their mean duration and its CPU (ms) per rotation meanwhile.
async fn rotations(
    client: &kube::Client,
    pid: u32,
    admin: SocketAddr,
    n: usize,
) -> anyhow::Result<(f64, f64, f64)> {
    let (cpu0, passes0) = (procstat::cpu_seconds(&[pid]), pass_totals(admin).await);
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / BACKGROUND_PER_SEC));
    for k in 0..CHANGES {
        tick.tick().await;
        apply(client, trust(&ns(k % n))?).await?;
    }
    // The coalescer's longest wait, so that a pass it woke is counted.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu = procstat::cpu_seconds(&[pid]) - cpu0;
    let passes = pass_totals(admin).await;
    let (count, pass) = mean((passes.0 - passes0.0, passes.1 - passes0.1));
    Ok((count, pass * 1000.0, cpu * 1000.0 / CHANGES as f64))
}

/// Namespace `ns`'s trust ConfigMap, with a new CA.
fn trust(ns: &str) -> anyhow::Result<Value> {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&rcgen::KeyPair::generate()?)?.pem();
    Ok(trust_of(ns, &ca))
}

/// Namespace `ns`'s trust ConfigMap holding `ca` (PEM), labelled for the
/// tunnel-server's trust watch.
pub(crate) fn trust_of(ns: &str, ca: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "agent-ca", "namespace": ns,
                        "labels": {"seedlink.dev/tunnel-trust": "true"}},
           "data": {"ca.crt": ca}})
}

/// Namespace `ns`'s RoleBinding that lets the install's ServiceAccount
/// read its trust (what onboarding a tenant namespace binds).
pub(crate) fn trust_binding(ns: &str) -> Value {
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
           "metadata": {"name": "seedlink-tunnel-trust", "namespace": ns},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                       "name": format!("seedlink-tunnel-trust-{SYS}")},
           "subjects": [{"kind": "ServiceAccount", "name": "seedlink", "namespace": SYS}]})
}

/// Namespace `ns`'s TunnelCluster `tunnel`, trusting its `agent-ca`.
pub(crate) fn tunnel_cluster(ns: &str) -> Value {
    json!({"apiVersion": "tunnel.seedlink.dev/v1alpha1", "kind": "TunnelCluster",
           "metadata": {"name": "tunnel", "namespace": ns},
           "spec": {"agentCA": {"configMap": "agent-ca", "key": "ca.crt"}}})
}

/// Writes to the slices of Services no route names: [`CHANGES`] of them,
/// [`BACKGROUND_PER_SEC`] a second over the tenants; the gateway's passes
/// and its CPU (ms) per write meanwhile. (A pass still starting from the
/// changes before is counted.)
async fn unrelated_churn(
    client: &kube::Client,
    gw_pid: u32,
    admin: SocketAddr,
    n: usize,
) -> anyhow::Result<(f64, f64)> {
    let (cpu0, passes0) = (procstat::cpu_seconds(&[gw_pid]), pass_totals(admin).await);
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / BACKGROUND_PER_SEC));
    for k in 0..CHANGES {
        tick.tick().await;
        apply(client, other_slice(k % n, k / n + 1)).await?;
    }
    // The coalescer's longest wait, so that a pass it woke is counted.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu = procstat::cpu_seconds(&[gw_pid]) - cpu0;
    let passes = pass_totals(admin).await.0 - passes0.0;
    Ok((passes, cpu * 1000.0 / CHANGES as f64))
}

/// Waits until the gateway's status writes stop: the count unchanged
/// across two seconds.
async fn status_written(admin: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT;
    let mut last = f64::NAN;
    while Instant::now() < deadline {
        let (_, text) = seedlink_testkit::http_get(admin, "/metrics").await;
        let now = text
            .lines()
            .find(|l| {
                l.starts_with("seedlink_kubernetes_status_writes_total") && l.contains("written")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if now == last {
            return Ok(());
        }
        last = now;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    anyhow::bail!("the gateway's status writes did not settle within {WAIT:?}")
}

/// The source's passes so far and their mean duration (its
/// `apply_duration_seconds` histogram).
async fn passes(admin: SocketAddr) -> (f64, f64) {
    mean(pass_totals(admin).await)
}

/// A count and a sum: the count and the mean.
fn mean((count, sum): (f64, f64)) -> (f64, f64) {
    (count, if count > 0.0 { sum / count } else { 0.0 })
}

/// The source's passes so far and their summed duration.
async fn pass_totals(admin: SocketAddr) -> (f64, f64) {
    let (_, text) = seedlink_testkit::http_get(admin, "/metrics").await;
    let sample = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let count = sample("seedlink_kubernetes_apply_duration_seconds_count");
    let sum = sample("seedlink_kubernetes_apply_duration_seconds_sum");
    (count, sum)
}

/// The tunnel-server's certificate and key files (any name: no agent
/// connects here).
fn server_cert(dir: &Path) -> anyhow::Result<(String, String)> {
    let (crt, key) = (dir.join("tun.pem"), dir.join("tun-key.pem"));
    if !crt.exists() {
        let k = rcgen::KeyPair::generate()?;
        let c = rcgen::CertificateParams::new(vec!["tunnel.bench".to_string()])?.self_signed(&k)?;
        std::fs::write(&crt, c.pem())?;
        std::fs::write(&key, k.serialize_pem())?;
    }
    Ok((crt.display().to_string(), key.display().to_string()))
}

/// [`CHANGES`] changes to tenant 0, each timed from the write until the
/// gateway serves it, while other tenants change [`BACKGROUND_PER_SEC`]
/// times a second: the latencies and how many background changes there
/// were.
async fn changes(
    client: &kube::Client,
    gw: &Role,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let stop = tokio_util::sync::CancellationToken::new();
    let background = tokio::spawn({
        let (client, stop) = (client.clone(), stop.clone());
        async move {
            let mut made = 0usize;
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / BACKGROUND_PER_SEC));
            while !stop.is_cancelled() {
                tick.tick().await;
                let i = 1 + made % (n - 1).max(1);
                if apply(&client, slice(i, made / n + 1)).await.is_ok() {
                    made += 1;
                }
            }
            made
        }
    });
    let mut latencies = Vec::new();
    let mut pace = tokio::time::interval(CHANGE_EVERY);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for v in 1..=CHANGES {
        pace.tick().await;
        let want = format!("{}:6443", address(0, v));
        let t = Instant::now();
        apply(client, slice(0, v)).await?;
        let deadline = t + WAIT;
        loop {
            let s = state_at(
                gw.admin,
                &format!("/api/state?control_plane={}", cp_name(0)),
            )
            .await;
            let cp = s["control_planes"].as_array().and_then(|c| {
                c.iter().find(|c| {
                    c["hostnames"]
                        .as_array()
                        .is_some_and(|h| h.iter().any(|h| h == &host(0)))
                })
            });
            let eps = cp.and_then(|c| c["endpoints"].as_array());
            if eps.is_some_and(|e| e.iter().any(|e| e["address"] == want)) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "change {v} not served within {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        latencies.push(t.elapsed());
    }
    stop.cancel();
    let made = background.await?;
    Ok((latencies, made))
}

fn print(rows: &[Row]) {
    println!("\n## seedlink-bench (kube-scale): the Kubernetes source on a real kube-apiserver\n");
    println!("| tenants | gateway cold start | tunnel-server cold start (passes, mean pass) | gateway RSS | tunnel-server RSS | change p50 | change p99 | gateway CPU per change | gateway passes meanwhile (mean pass) | API connections (gateway, tunnel-server) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.2} s | {:.2} s ({}, {:.2} s) | {:.1} MiB | {:.1} MiB | {} ms | {} ms | {:.2} ms | {} ({:.2} ms) | {}, {} |",
            r.tenants,
            r.gw_cold.as_secs_f64(),
            r.tun_cold.as_secs_f64(),
            r.tun_passes.0,
            r.tun_passes.1,
            r.gw_rss_kib / 1024.0,
            r.tun_rss_kib / 1024.0,
            r.change_p50.as_millis(),
            r.change_p99.as_millis(),
            r.cpu_ms_per_change,
            r.gw_passes.0,
            r.gw_passes.1 * 1000.0,
            r.gw_conns,
            r.tun_conns
        );
    }
    println!("\nWrites to the slices of Services no route names ({CHANGES} per count, {BACKGROUND_PER_SEC} a second):\n");
    println!("| tenants | gateway passes meanwhile | gateway CPU per write |");
    println!("|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {:.2} ms |",
            r.tenants, r.unrelated.0, r.unrelated.1
        );
    }
    println!("\nTenants' agent CAs rotated ({CHANGES} per count, {BACKGROUND_PER_SEC} a second; their trust ConfigMaps):\n");
    println!(
        "| tenants | tunnel-server passes meanwhile | mean pass | tunnel-server CPU per rotation |"
    );
    println!("|---|---|---|---|");
    for r in rows {
        let (passes, pass, cpu) = r.rotations;
        println!("| {} | {passes} | {pass:.2} ms | {cpu:.2} ms |", r.tenants);
    }
    println!("\nThe tunnel-server with `trust_watch: cluster`:\n");
    println!("| tenants | cold start | RSS | API connections |");
    println!("|---|---|---|---|");
    for r in rows {
        let (cold, rss, conns) = r.tun_cluster;
        println!(
            "| {} | {:.2} s | {:.1} MiB | {} |",
            r.tenants,
            cold.as_secs_f64(),
            rss / 1024.0,
            conns
        );
    }
    if let (Some(a), Some(b)) = (rows.first(), rows.last()) {
        if b.tenants > a.tenants {
            let per = |x: f64, y: f64| (y - x) / (b.tenants - a.tenants) as f64;
            println!(
                "\nper tenant between {} and {}: gateway {:.1} KiB, tunnel-server {:.1} KiB; cost of a change at {} vs {}: {:.2}× in CPU, {:.2}× in mean pass",
                a.tenants,
                b.tenants,
                per(a.gw_rss_kib, b.gw_rss_kib),
                per(a.tun_rss_kib, b.tun_rss_kib),
                b.tenants,
                a.tenants,
                b.cpu_ms_per_change / a.cpu_ms_per_change,
                b.gw_passes.1 / a.gw_passes.1
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    /// The CI profile of this bench: 200 tenants, with the debug build.
    /// What it asserts is behaviour, with generous bounds (every tenant
    /// served by both roles within the bench's wait, every change to one
    /// tenant served under 10 other changes a second, and the connections
    /// to the API server within 10 per role); its figures are printed,
    /// not judged (docs/PERFORMANCE.md has the release build's).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_hundred_tenants_are_served_with_bounded_api_connections() {
        let opts = crate::scenario::Opts::parse_from([
            "seedlink-bench",
            "--scenario",
            "kube-scale",
            "--tenants",
            "200",
            "--seedlink",
            seedlink_testkit::seedlink_bin(),
        ]);
        let rows = super::scale(&opts).await.unwrap();
        super::print(&rows);
        let row = &rows[0];
        assert_eq!(row.tenants, 200);
        assert!(
            row.gw_conns <= 10 && row.tun_conns <= 10 && row.tun_cluster.2 <= 10,
            "API server connections: gateway {}, tunnel-server {} (trust_watch: cluster {})",
            row.gw_conns,
            row.tun_conns,
            row.tun_cluster.2
        );
    }
}
