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
    /// (keys are the flags' names with `_`; see docs/NODE-PROXY.md).
    #[arg(long, conflicts_with_all = ["address", "port", "gateway", "mode", "destination", "header",
        "authority", "admin", "admin_token_file", "metrics", "max_connections", "connect_timeout", "drain", "interface",
        "link_kind", "resync", "cluster_id", "cluster_id_tlv", "egress_proxy", "egress_proxy_credentials_file",
        "egress_proxy_ca_file",
        "health_check", "health_check_interval", "health_check_timeout", "health_check_rise", "health_check_fall",
        "health_check_ca", "health_check_server_name", "health_check_path"])]
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
    /// A metrics-only endpoint (`/metrics`, `/healthz`; no token), e.g.
    /// `0.0.0.0:16910` for the shoot's Prometheus.
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
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
    /// The hosted cluster's ID, sent as a TLV of every PROXY v2 header (`proxy-v2` mode; HyperShift's
    /// shared ingress routes by it).
    #[arg(long)]
    pub cluster_id: Option<String>,
    /// The TLV type of `--cluster-id` (0x20 as HyperShift; 0xE0-0xEF are the spec's application types).
    #[arg(long, default_value = "0x20", value_parser = parse_u8)]
    pub cluster_id_tlv: u8,
    /// Reach the gateway through this HTTP CONNECT forward proxy, `http://host:port`, or
    /// `https://host:port` (TLS to the proxy).
    #[arg(long)]
    pub egress_proxy: Option<String>,
    /// A file holding `user:password` for the egress proxy (sent as Basic; read again for every tunnel).
    #[arg(long)]
    pub egress_proxy_credentials_file: Option<std::path::PathBuf>,
    /// The CA bundle an `https://` egress proxy's certificate is checked against (default: the
    /// system's trust store).
    #[arg(long)]
    pub egress_proxy_ca_file: Option<std::path::PathBuf>,
    /// What readiness follows: `tcp` (the gateway accepts), `tunnel` (the gateway's 200, CONNECT modes),
    /// `tls` (a TLS handshake with the API server through a tunnel), `http` (and `GET /version` answered 2xx/3xx).
    #[arg(long, default_value = "tcp")]
    pub health_check: String,
    /// Seconds between health checks.
    #[arg(long, default_value_t = 10.0)]
    pub health_check_interval: f64,
    /// Deadline of one health check, seconds.
    #[arg(long, default_value_t = 5.0)]
    pub health_check_timeout: f64,
    /// Successes in a row that make an unhealthy upstream healthy.
    #[arg(long, default_value_t = 2)]
    pub health_check_rise: u32,
    /// Failures in a row that make a healthy upstream unhealthy.
    #[arg(long, default_value_t = 3)]
    pub health_check_fall: u32,
    /// CA bundle the API server's certificate is verified against (`tls`/`http` checks).
    #[arg(long)]
    pub health_check_ca: Option<std::path::PathBuf>,
    /// Server name of the check's TLS handshake.
    #[arg(long, default_value = "kubernetes.default.svc")]
    pub health_check_server_name: String,
    /// Path of the `http` check's GET.
    #[arg(long, default_value = "/version")]
    pub health_check_path: String,
}

/// A byte written in decimal or as `0x..`.
fn parse_u8(s: &str) -> Result<u8, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => s.parse::<u8>(),
    };
    r.map_err(|_| format!("{s:?} is not a number from 0 to 255 (decimal or 0x..)"))
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
            metrics: self.metrics,
            max_connections: self.max_connections,
            connect_timeout: secs(self.connect_timeout, "connect-timeout")?,
            drain: secs(self.drain, "drain")?,
            interface: self.interface.clone(),
            link_kind: self.link_kind.clone(),
            resync: secs(self.resync, "resync")?,
            cluster_id: self.cluster_id.clone(),
            cluster_id_tlv: self.cluster_id_tlv,
            egress_proxy: self.egress_proxy.clone(),
            egress_proxy_credentials_file: self.egress_proxy_credentials_file.clone(),
            egress_proxy_ca_file: self.egress_proxy_ca_file.clone(),
            health_check: self.health_check.clone(),
            health_check_interval: secs(self.health_check_interval, "health-check-interval")?,
            health_check_timeout: secs(self.health_check_timeout, "health-check-timeout")?,
            health_check_rise: self.health_check_rise,
            health_check_fall: self.health_check_fall,
            health_check_ca: self.health_check_ca.clone(),
            health_check_server_name: self.health_check_server_name.clone(),
            health_check_path: self.health_check_path.clone(),
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
    // For `/config`: the model as given (it holds no secret: the egress
    // proxy's credentials are only named by their file).
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
    let metrics = match plan.metrics {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("metrics on {a}: {e}"))?,
        ),
        None => None,
    };
    let mut ready = serde_json::json!({
        "event": "ready",
        "listen": listener.local_addr()?.to_string(),
        "admin": admin.local_addr()?.to_string(),
    });
    if let Some(m) = metrics {
        ready["metrics"] = m.local_addr()?.to_string().into();
        let np = np.clone();
        tokio::spawn(async move { seedlink_node_proxy::admin::serve_metrics(np, m).await });
    }
    np.serve(listener, admin, access);
    let armed = supervisor.arm(vec![Arc::new(NodeProxyRole(np))]);
    println!("{ready}");
    Ok(armed.run().await)
}
