//! `seedlink node-proxy`: the `kubernetes` service address on a shoot node,
//! tunneled to the seed gateway.

use std::sync::Arc;

use seedlink_node_proxy::NodeProxy;

use super::secs;
use crate::supervisor::{BoxFut, Role, Supervisor};

/// `seedlink node-proxy` options.
#[derive(clap::Args)]
pub struct NodeProxyArgs {
    /// The advertised kube-apiserver address to listen on (IPv4 or IPv6).
    #[arg(long)]
    pub address: std::net::IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 443)]
    pub port: u16,
    /// The gateway, `host:port`; a DNS name (a trailing dot is fine) is re-resolved.
    #[arg(long)]
    pub gateway: String,
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

/// Runs `seedlink node-proxy` until drained; returns the exit code.
pub async fn run(a: NodeProxyArgs) -> anyhow::Result<i32> {
    let supervisor = Supervisor::install()?;
    use seedlink_node_proxy::{Mode, NodeProxy, Options};
    let mode = match a.mode.as_str() {
        "connect" => Mode::Connect,
        "http2-connect" => Mode::Http2Connect,
        "proxy-v2" => Mode::ProxyV2,
        "proxy-v1" => Mode::ProxyV1,
        other => {
            anyhow::bail!("--mode: {other:?} is not connect, http2-connect, proxy-v2 or proxy-v1")
        }
    };
    let destination = a.destination.clone().unwrap_or_default();
    if matches!(mode, Mode::Connect | Mode::Http2Connect) {
        if let Err(why) = seedlink_proto_destination(&destination) {
            anyhow::bail!("--destination {destination:?}: {why}");
        }
    }
    let (gw_host, _) = a
        .gateway
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("--gateway {:?} is not host:port", a.gateway))?;
    let authority = a
        .authority
        .clone()
        .unwrap_or_else(|| format!("{gw_host}:443"));
    let opts = Options {
        gateway: a.gateway.clone(),
        mode,
        header: (a.header.clone(), destination),
        authority,
        connect_timeout: secs(a.connect_timeout, "connect-timeout")?,
        handshake_timeout: std::time::Duration::from_secs(10),
        resolve_ttl: std::time::Duration::from_secs(30),
        max_connections: a.max_connections,
        drain: secs(a.drain, "drain")?,
        probe_interval: std::time::Duration::from_secs(10),
    };
    use seedlink_node_proxy::netif::{Interface, LinkKind};
    let kind = match a.link_kind.as_str() {
        "dummy" => Some(LinkKind::Dummy),
        "bridge" => Some(LinkKind::Bridge),
        "existing" => Some(LinkKind::Existing),
        "none" => None,
        other => anyhow::bail!("--link-kind: {other:?} is not dummy, bridge, existing or none"),
    };
    let np = NodeProxy::new(opts, kind.is_some());
    if let Some(kind) = kind {
        let iface = Interface {
            name: a.interface.clone(),
            kind,
            address: a.address,
        };
        np.manage_interface(iface, secs(a.resync, "resync")?)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let listen = std::net::SocketAddr::new(a.address, a.port);
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        anyhow::anyhow!("listening on {listen}: {e} (is the address on an interface?)")
    })?;
    let admin = tokio::net::TcpListener::bind(a.admin)
        .await
        .map_err(|e| anyhow::anyhow!("admin on {}: {e}", a.admin))?;
    let ready = serde_json::json!({
        "event": "ready",
        "listen": listener.local_addr()?.to_string(),
        "admin": admin.local_addr()?.to_string(),
    });
    np.serve(listener, admin);
    println!("{ready}");
    Ok(supervisor.run(vec![Arc::new(NodeProxyRole(np))]).await)
}

fn seedlink_proto_destination(d: &str) -> Result<(), &'static str> {
    seedlink_proto::destination::parse(d).map(|_| ())
}
