//! `seedlink node-proxy`: the `kubernetes` service address on a shoot node,
//! tunneled to the seed gateway.

use std::sync::Arc;

use seedlink_node_proxy::config::NodeProxyConfig;
use seedlink_node_proxy::NodeProxy;

use super::secs;
use crate::supervisor::{BoxFut, Role, Supervisor};

/// `seedlink node-proxy` options.
#[derive(clap::Args)]
pub struct NodeProxyArgs {
    /// Read the whole configuration from this YAML file instead of flags
    /// (keys are the flags' names with `_`; see docs/CONFIGURATION.md).
    #[arg(long, conflicts_with_all = ["address", "port", "gateway", "mode", "destination", "header",
        "authority", "admin", "admin_token_file", "max_connections", "connect_timeout", "drain", "interface",
        "link_kind", "resync"])]
    pub config: Option<std::path::PathBuf>,
    /// The advertised kube-apiserver address to listen on (IPv4 or IPv6).
    #[arg(long, required_unless_present = "config")]
    pub address: Option<std::net::IpAddr>,
    /// Port to listen on.
    #[arg(long, default_value_t = 443)]
    pub port: u16,
    /// The gateway, `host:port`; a DNS name (a trailing dot is fine) is re-resolved.
    #[arg(long, required_unless_present = "config")]
    pub gateway: Option<String>,
    /// How to reach the gateway: `connect` (HTTP/1.1 CONNECT, GEP-30), `http2-connect` (streams on one
    /// shared h2c connection), `proxy-v2` or `proxy-v1` (GEP-08 legacy port).
    #[arg(long, default_value = "connect")]
    pub mode: String,
    /// Destination header value, e.g. `outbound|443||kube-apiserver.<ns>.svc.cluster.local`.
    #[arg(long, required_if_eq_any([("mode", "connect"), ("mode", "http2-connect")]))]
    pub destination: Option<String>,
    /// Destination header name.
    #[arg(long, default_value = "X-Gardener-Destination")]
    pub header: String,
    /// CONNECT request target (the gateway logs it, never routes by it); default: the gateway host with port 443.
    #[arg(long)]
    pub authority: Option<String>,
    /// Admin endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:16910")]
    pub admin: std::net::SocketAddr,
    /// A file holding a bearer token the admin endpoint requires for
    /// everything but `/healthz` and `/readyz`.
    #[arg(long)]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Concurrent tunnels.
    #[arg(long, default_value_t = 10_000)]
    pub max_connections: usize,
    /// Connect timeout per gateway address, seconds.
    #[arg(long, default_value_t = 5.0)]
    pub connect_timeout: f64,
    /// Drain deadline on SIGTERM, seconds.
    #[arg(long, default_value_t = 30.0)]
    pub drain: f64,
    /// Link that carries the address.
    #[arg(long, default_value = "apiserver-proxy")]
    pub interface: String,
    /// How that link comes to exist: `dummy` (created if missing), `bridge`
    /// (a port-less bridge, for kernels without dummy), `existing`, or `none`
    /// (do not manage the address at all).
    #[arg(long, default_value = "dummy")]
    pub link_kind: String,
    /// How often the address is re-asserted, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub resync: f64,
}

/// A running node-proxy as the supervisor sees it.
struct NodeProxyRole(Arc<NodeProxy>);

impl Role for NodeProxyRole {
    fn name(&self) -> &'static str {
        "node-proxy"
    }

    fn files(&self) -> Vec<std::path::PathBuf> {
        Vec::new()
    }

    fn reload(&self, forced: bool) -> BoxFut<'_, ()> {
        if forced {
            tracing::info!(
                "SIGHUP ignored: the node-proxy reads its flags at start (restart to change them)"
            );
        }
        Box::pin(async {})
    }

    fn drain(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let closed = self.0.drain().await;
            tracing::info!(closed_at_deadline = closed, "node-proxy drained");
        })
    }
}

impl NodeProxyArgs {
    /// The configuration these flags (or the `--config` file) describe.
    pub fn model(&self) -> anyhow::Result<NodeProxyConfig> {
        if let Some(path) = &self.config {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
            return NodeProxyConfig::parse(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()));
        }
        Ok(NodeProxyConfig {
            address: self
                .address
                .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
            port: self.port,
            gateway: self.gateway.clone().unwrap_or_default(),
            mode: self.mode.clone(),
            destination: self.destination.clone(),
            header: self.header.clone(),
            authority: self.authority.clone(),
            admin: self.admin,
            admin_token_file: self.admin_token_file.clone(),
            max_connections: self.max_connections,
            connect_timeout: secs(self.connect_timeout, "connect-timeout")?,
            drain: secs(self.drain, "drain")?,
            interface: self.interface.clone(),
            link_kind: self.link_kind.clone(),
            resync: secs(self.resync, "resync")?,
        })
    }
}

/// Runs `seedlink node-proxy` until drained; returns the exit code.
pub async fn run(a: NodeProxyArgs) -> anyhow::Result<i32> {
    let supervisor = Supervisor::install()?;
    let model = a.model()?;
    let plan = model
        .plan()
        .map_err(|e| super::problems("node-proxy", a.config.is_some(), &e))?;
    let np = NodeProxy::new(plan.options, plan.interface.is_some());
    // For `/config`: the model as given (it holds no secret).
    let _ = np
        .config
        .set(serde_json::to_value(&model).unwrap_or_default());
    if let Some(iface) = plan.interface {
        np.manage_interface(iface, plan.resync)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let listen = plan.listen;
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        anyhow::anyhow!("listening on {listen}: {e} (is the address on an interface?)")
    })?;
    let admin = tokio::net::TcpListener::bind(plan.admin)
        .await
        .map_err(|e| anyhow::anyhow!("admin on {}: {e}", plan.admin))?;
    let access = match &model.admin_token_file {
        None => seedlink_net::admin::Access::open(),
        Some(p) => seedlink_net::admin::Access::from_token_file(p)
            .map_err(|e| anyhow::anyhow!("admin_token_file {}: {e}", p.display()))?,
    };
    let ready = serde_json::json!({
        "event": "ready",
        "listen": listener.local_addr()?.to_string(),
        "admin": admin.local_addr()?.to_string(),
    });
    np.serve(listener, admin, access);
    println!("{ready}");
    Ok(supervisor.run(vec![Arc::new(NodeProxyRole(np))]).await)
}
