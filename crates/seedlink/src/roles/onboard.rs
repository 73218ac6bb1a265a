//! `seedlink onboard`: the onboarding controller. Every replica watches
//! `SeedlinkControlPlane`s; the one holding the Lease generates and writes
//! (docs/KUBERNETES.md, "Onboarding a control plane"). It runs under a
//! ServiceAccount of its own: it writes Secrets, RoleBindings and routes in
//! tenant namespaces, which the data plane's pods never may.

use std::path::Path;

use anyhow::Context as _;
use seedlink_net::admin::{self, Answer, METRICS, TEXT};
use tokio_util::sync::CancellationToken;

use seedlink_config::onboard::{namespaced, NodeProxyRender, OnboardConfig, RenderConfig};
use seedlink_kube::leader::{self, Leadership};
use seedlink_kube::onboard::controller::{
    self, ClientIssuer, Context, NodeRoute, Renderer, Watched,
};
use seedlink_kube::onboard::generate::{Bundle, Settings};
use seedlink_kube::onboard::rotation::Validity;
use seedlink_kube::translate::Key;

/// `namespace/name` (checked when the file was read) as a [`Key`].
fn key(v: &str) -> Key {
    let (ns, name) = namespaced(v).unwrap_or_default();
    Key {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// Reads and checks the file.
fn load(path: &Path) -> anyhow::Result<OnboardConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    OnboardConfig::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The `tunnel-config` renderer for every control plane: the
/// tunnel-server's file read once, each cluster rendered as
/// `seedlink tunnel-config --cluster <namespace>.<name>` renders it.
fn renderer(r: &RenderConfig) -> anyhow::Result<Renderer> {
    let text = std::fs::read_to_string(&r.tunnel_config)
        .with_context(|| format!("reading {}", r.tunnel_config.display()))?;
    let cfg = seedlink_tunnel::config::ServerConfig::parse(&text)
        .with_context(|| r.tunnel_config.display().to_string())?;
    anyhow::ensure!(
        cfg.kubernetes.is_some(),
        "{}: no `kubernetes` section, so no TunnelCluster is served by it",
        r.tunnel_config.display()
    );
    let server_ca = std::fs::read_to_string(&r.server_ca)
        .with_context(|| format!("reading {}", r.server_ca.display()))?;
    let r = r.clone();
    Ok(std::sync::Arc::new(
        move |cluster: &str, route: &NodeRoute| {
            let opts = render_options(&r, cluster, route);
            let rendered = crate::egress::render(&cfg, &opts).map_err(|e| format!("{e:#}"))?;
            Ok(bundle_of(&rendered, &server_ca))
        },
    ))
}

/// The rendered files split into kube-apiserver's and the shoot's, the
/// shoot's with the tunnel-server's CA.
fn bundle_of(rendered: &crate::egress::Rendered, server_ca: &str) -> Bundle {
    let mut bundle = Bundle::default();
    for (name, text) in rendered.files() {
        let side = if crate::egress::Rendered::KUBE_APISERVER_FILES.contains(&name) {
            &mut bundle.kube_apiserver
        } else {
            &mut bundle.shoot
        };
        side.insert(name.to_string(), text);
    }
    bundle
        .shoot
        .insert("tunnel-ca.crt".into(), server_ca.to_string());
    bundle
}

/// What `tunnel-config` is told for `cluster`: the install's settings,
/// and the node-proxy when the install says where the gateway is and the
/// object names what routes to it there.
fn render_options(r: &RenderConfig, cluster: &str, route: &NodeRoute) -> crate::egress::Options {
    let node_proxy = r.node_proxy.as_ref().and_then(|np| node_path(np, route));
    crate::egress::Options {
        agent_server: Some(r.agent_server.clone()),
        server_name: r.server_name.clone(),
        frontend_address: r.frontend_address.clone(),
        gateway: node_proxy.as_ref().map(|(_, p)| p.gateway.clone()),
        advertise_address: node_proxy.as_ref().map(|(np, _)| np.address),
        destination: node_proxy.as_ref().and_then(|(_, p)| p.destination.clone()),
        cluster_id: node_proxy.as_ref().and_then(|(_, p)| p.cluster_id.clone()),
        node_proxy_host: node_proxy
            .as_ref()
            .map(|(np, _)| crate::egress::NodeProxyHost {
                link_kind: np.link_kind.clone(),
                interface: np.interface.clone(),
                admin_port: np.admin_port,
                metrics_port: np.metrics_port,
            }),
        ..crate::egress::Options::new(cluster)
    }
}

/// Where a control plane's node-proxy goes and what it sends: the
/// install's CONNECT listener with the object's destination, else its
/// PROXY listener with the object's cluster ID; none when the install
/// has no listener for what the object names.
fn node_path<'a>(
    np: &'a NodeProxyRender,
    route: &NodeRoute,
) -> Option<(&'a NodeProxyRender, NodePath)> {
    let path = match (&route.destination, &route.cluster_id, &np.proxy_gateway) {
        (Some(d), _, _) => NodePath {
            gateway: np.gateway.clone(),
            destination: Some(d.clone()),
            cluster_id: None,
        },
        (None, Some(id), Some(g)) => NodePath {
            gateway: g.clone(),
            destination: None,
            cluster_id: Some(id.clone()),
        },
        _ => return None,
    };
    Some((np, path))
}

/// A node-proxy's gateway and what it sends there.
struct NodePath {
    gateway: String,
    destination: Option<String>,
    cluster_id: Option<String>,
}

/// The CA for kube-apiserver's client certificates, when configured: read
/// and tried once (a certificate issued and thrown away), so that a key
/// that does not load or match stops the start with the reason.
fn client_issuer(r: &RenderConfig) -> anyhow::Result<Option<ClientIssuer>> {
    let Some(files) = &r.kube_apiserver_client_ca else {
        return Ok(None);
    };
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let issuer = ClientIssuer {
        cert_pem: read(&files.cert)?,
        key_pem: read(&files.key)?,
        server_ca: read(&r.server_ca)?,
    };
    seedlink_kube::onboard::certs::check_issuer(&issuer.cert_pem, &issuer.key_pem).with_context(
        || {
            format!(
                "render.kube_apiserver_client_ca: {} and {}",
                files.cert.display(),
                files.key.display()
            )
        },
    )?;
    Ok(Some(issuer))
}

/// How often the kube-apiserver client CA's files are read again.
const CLIENT_CA_CHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads the kube-apiserver client CA's files again every
/// [`CLIENT_CA_CHECK`] until `stop`: a pair that loads, matches and
/// differs from the last replaces it (every control plane is then
/// reconciled and its certificate issued by the new CA); one that does
/// not (half written, a key of another CA) is logged and the last good
/// one kept.
async fn follow_client_ca(
    r: RenderConfig,
    ca: tokio::sync::watch::Sender<Option<ClientIssuer>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(CLIENT_CA_CHECK) => {}
            () = stop.cancelled() => return,
        }
        match client_issuer(&r) {
            Ok(now) => {
                ca.send_if_modified(|was| replaced(was, now));
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "kube-apiserver's client CA does not load; keeping the last good one");
            }
        }
    }
}

/// `was` replaced by `now` if they differ; whether they did.
fn replaced(was: &mut Option<ClientIssuer>, now: Option<ClientIssuer>) -> bool {
    let new = *was != now;
    if new {
        tracing::info!(
            "kube-apiserver's client CA changed: issuing every control plane's certificate again"
        );
        *was = now;
    }
    new
}

/// The controller's view of the kube-apiserver client CA, `initial` at
/// first and followed in its files while the file configures one.
fn client_ca_follower(
    c: &OnboardConfig,
    initial: Option<ClientIssuer>,
    stop: &CancellationToken,
) -> tokio::sync::watch::Receiver<Option<ClientIssuer>> {
    let (ca, follower) = tokio::sync::watch::channel(initial);
    let configured = c
        .render
        .clone()
        .filter(|r| r.kube_apiserver_client_ca.is_some());
    if let Some(r) = configured {
        tokio::spawn(follow_client_ca(r, ca, stop.clone()));
    }
    follower
}

/// The file's certificate validities (checked when it was read).
fn validity(c: &OnboardConfig) -> Validity {
    c.certificates.durations().map_or_else(
        |_| Validity::default(),
        |(ca, leaf)| Validity::from_std(ca, leaf),
    )
}

/// Runs the controller until SIGTERM or SIGINT.
pub async fn run(config: &Path) -> anyhow::Result<i32> {
    let c = load(config)?;
    let render = c.render.as_ref().map(renderer).transpose()?;
    let kube_apiserver_ca = c.render.as_ref().map(client_issuer).transpose()?.flatten();
    let client = seedlink_kube::source::client()
        .await
        .context("kubernetes client")?;
    let stop = CancellationToken::new();
    let me = Leadership::default();
    let identity = super::identity();
    let lease = key(&c.lease);
    let campaign = tokio::spawn(leader::campaign(
        client.clone(),
        lease.namespace,
        lease.name,
        identity.clone(),
        me.clone(),
        stop.clone(),
    ));
    let mut ctx = context(&c, client, me.clone(), &identity, render).await;
    ctx.kube_apiserver_ca = client_ca_follower(&c, kube_apiserver_ca, &stop);
    ctx.agent_image = c.render.as_ref().and_then(|r| r.agent_image.clone());
    let admin = match &c.admin {
        Some(a) => Some(serve_admin(a, ctx.watched.clone(), me, ctx.validity).await?),
        None => None,
    };
    let mut running = tokio::spawn(controller::run(ctx, stop.clone()));
    println!(
        "{}",
        serde_json::json!({"event": "ready", "role": "onboard", "admin": admin.map(|a| a.to_string())})
    );
    // The controller ends only on stop: if it ends before (a panic), the
    // process exits, so the pod restarts and another replica leads.
    let code = tokio::select! {
        () = shutdown_signal() => 0,
        _ = &mut running => {
            tracing::error!("the onboarding controller stopped; exiting");
            1
        }
    };
    stop.cancel();
    let _ = running.await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), campaign).await;
    Ok(code)
}

/// What the controller runs with: the file's settings, the TLSRoute
/// version the API server serves, this replica's leadership.
async fn context(
    c: &OnboardConfig,
    client: kube::Client,
    leadership: Leadership,
    identity: &str,
    render: Option<Renderer>,
) -> Context {
    let route_version = seedlink_kube::source::served_route_version(&client)
        .await
        .map_or_else(|| "v1".to_string(), |ar| ar.version);
    let reporter = controller::reporter(identity);
    Context {
        recorder: kube::runtime::events::Recorder::new(client.clone(), reporter),
        client,
        settings: Settings {
            gateway: key(&c.gateway),
            route_version,
            tunnel_reader: key(&c.tunnel_reader),
            trust_role: c.trust_role.clone(),
            trust_role_config_maps: c.trust_role_config_maps.clone(),
        },
        leadership,
        namespace_label: c.namespace_label.clone(),
        render,
        kube_apiserver_ca: tokio::sync::watch::channel(None).1,
        agent_image: None,
        validity: validity(c),
        labelled: Default::default(),
        watched: Default::default(),
    }
}

/// What the admin endpoint answers from: the controller's cache, whether
/// it has listed the control planes, this replica's leadership.
struct View {
    watched: Watched,
    listed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    me: Leadership,
    validity: Validity,
}

/// The admin endpoint's access: the token in `token_file`, or open.
fn access(a: &seedlink_config::model::Admin) -> anyhow::Result<admin::Access> {
    Ok(match &a.token_file {
        Some(f) => admin::Access::from_token_file(Path::new(f))
            .with_context(|| format!("admin.token_file {f}"))?,
        None => admin::Access::open(),
    })
}

/// Binds the admin endpoint and serves it in a task: the probes, and
/// `/metrics` (with the token, when one is configured).
async fn serve_admin(
    a: &seedlink_config::model::Admin,
    watched: Watched,
    me: Leadership,
    validity: Validity,
) -> anyhow::Result<std::net::SocketAddr> {
    let access = access(a)?;
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("admin.listen {}", a.listen))?;
    let addr = listener.local_addr()?;
    let view = View {
        watched,
        listed: Default::default(),
        me,
        validity,
    };
    tokio::spawn(mark_listed(view.watched.clone(), view.listed.clone()));
    // Any pod may reach the port: one source holds at most 2 of the 32
    // connections, so it cannot starve the kubelet's probes (which would
    // restart the pod, and stop renewals for every tenant).
    tokio::spawn(admin::serve_limited(
        listener,
        admin::Slots::with_per_source(32, 2),
        access,
        std::sync::Arc::new(move |path: &str| view.answer(path)),
    ));
    Ok(addr)
}

/// Sets `listed` once the controller's cache holds the first complete
/// list of control planes (the controller makes the cache as it starts,
/// a moment after the endpoint).
async fn mark_listed(watched: Watched, listed: std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let store = loop {
        if let Some(s) = watched.get() {
            break s.clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let ready = store.wait_until_ready();
    tokio::pin!(ready);
    let mut waited = std::time::Duration::ZERO;
    loop {
        match tokio::time::timeout(LIST_WARN_EVERY, &mut ready).await {
            Ok(Ok(())) => break listed.store(true, std::sync::atomic::Ordering::Release),
            Ok(Err(_)) => break,
            Err(_) => {
                waited += LIST_WARN_EVERY;
                tracing::warn!(
                    waited_s = waited.as_secs(),
                    "onboarding: the control planes are not listed yet; not ready"
                );
            }
        }
    }
}

/// How often a replica whose first list of control planes is not done
/// says so (its watch's errors, if any, are logged as they come).
const LIST_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

const NOT_LISTED: &str = "not ready: the control planes are not listed yet\n";

impl View {
    /// `/healthz`; `/readyz` once the control planes are listed;
    /// `/metrics` from what the controller last saw of them.
    fn answer(&self, path: &str) -> Answer {
        let listed = self.listed.load(std::sync::atomic::Ordering::Acquire);
        match path {
            "/healthz" => (200, TEXT, "ok\n".to_string()),
            "/readyz" if listed => (200, TEXT, "ready\n".to_string()),
            "/readyz" => (503, TEXT, NOT_LISTED.to_string()),
            "/metrics" => {
                let cps = self.watched.get().map(|s| s.state()).unwrap_or_default();
                let r =
                    seedlink_kube::onboard::metrics::registry(&cps, self.me.held(), self.validity);
                (200, METRICS, admin::encode(&r))
            }
            _ => (
                404,
                TEXT,
                "not found; try /healthz /readyz /metrics\n".to_string(),
            ),
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A destination goes to the CONNECT listener; a cluster ID alone to
    /// the PROXY listener, when the install has one; otherwise no
    /// node-proxy.
    #[test]
    fn the_node_proxys_path_follows_what_the_object_names() {
        let text = "lease: s/l\ngateway: s/g\ntunnel_reader: s/x\nrender: {tunnel_config: t, agent_server: 'a:1', server_ca: c, node_proxy: {gateway: 'gw:8443', proxy_gateway: 'gw:8132'}}\n";
        let np = OnboardConfig::parse(text)
            .unwrap()
            .render
            .unwrap()
            .node_proxy
            .unwrap();
        let route = |d: Option<&str>, id: Option<&str>| NodeRoute {
            destination: d.map(String::from),
            cluster_id: id.map(String::from),
        };
        let (_, p) = node_path(&np, &route(Some("outbound|443||k.a.svc"), Some("id"))).unwrap();
        assert_eq!((p.gateway.as_str(), p.cluster_id), ("gw:8443", None));
        let (_, p) = node_path(&np, &route(None, Some("id"))).unwrap();
        assert_eq!(p.gateway, "gw:8132");
        assert_eq!((p.destination, p.cluster_id.as_deref()), (None, Some("id")));
        assert!(node_path(&np, &route(None, None)).is_none());
        let without = NodeProxyRender {
            proxy_gateway: None,
            ..np.clone()
        };
        assert!(node_path(&without, &route(None, Some("id"))).is_none());
    }
}
