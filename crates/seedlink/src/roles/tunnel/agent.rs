//! `seedlink tunnel-agent`: its flags and file, its admin endpoint, and the
//! role the supervisor runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use seedlink_tunnel::agent::config::AgentConfig;
use seedlink_tunnel::agent::Agent;

use super::super::{problems, secs};
use crate::supervisor::{BoxFut, Role, Supervisor};

/// `seedlink tunnel-agent` options.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// Read the whole configuration from this YAML file instead of flags
    /// (keys are the flags' names with `_`; see docs/TUNNEL.md).
    #[arg(long, conflicts_with_all = ["server", "server_name", "ca_cert", "agent_cert", "agent_key",
        "alpn_proto", "agent_id", "agent_identifiers", "service_account_token_path", "allow_cidr",
        "allow_port", "deny_cidr", "dial_timeout", "sync_interval", "sync_interval_cap",
        "keepalive_time", "admin", "admin_token_file", "flow_control", "transport", "replica_addresses",
        "drain", "egress_proxy",
        "egress_proxy_credentials_file", "egress_proxy_ca_file"])]
    pub config: Option<PathBuf>,
    /// The tunnel server (or the gateway in front of it), `host:port`.
    #[arg(long, required_unless_present = "config")]
    pub server: Option<String>,
    /// TLS server name (SNI); default: the host of --server.
    #[arg(long)]
    pub server_name: Option<String>,
    /// CA certificate of the server (PEM).
    #[arg(long, required_unless_present = "config")]
    pub ca_cert: Option<PathBuf>,
    /// Client certificate (PEM); it decides the agent's cluster.
    #[arg(long, requires = "agent_key")]
    pub agent_cert: Option<PathBuf>,
    /// Its key (PEM).
    #[arg(long, requires = "agent_cert")]
    pub agent_key: Option<PathBuf>,
    /// Extra ALPN protocols to offer (comma-separated), for routing by ALPN.
    #[arg(long, value_delimiter = ',')]
    pub alpn_proto: Vec<String>,
    /// Agent ID (default: env PROXY_AGENT_ID or a random ID). The
    /// environment is read by the configuration, not as this flag, so that
    /// it also names the agent started with --config (a pod's name in a
    /// shared ConfigMap's agent).
    #[arg(long)]
    pub agent_id: Option<String>,
    /// Agent identifiers, URL query form: host=…&ipv4=…&cidr=…&default-route=true.
    #[arg(long, default_value = "")]
    pub agent_identifiers: String,
    /// ServiceAccount token file, sent as `authorization: Bearer`.
    #[arg(long)]
    pub service_account_token_path: Option<PathBuf>,
    /// Allowed destination networks (comma-separated CIDRs; default: all but the denied).
    #[arg(long, value_delimiter = ',')]
    pub allow_cidr: Vec<ipnet::IpNet>,
    /// Allowed destination ports (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub allow_port: Vec<u16>,
    /// Denied destination networks (default: link-local and cloud metadata addresses).
    #[arg(long, value_delimiter = ',')]
    pub deny_cidr: Option<Vec<ipnet::IpNet>>,
    /// Destination dial timeout, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub dial_timeout: f64,
    /// First reconnect delay and replica-discovery interval, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub sync_interval: f64,
    /// Largest reconnect delay, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub sync_interval_cap: f64,
    /// HTTP/2 PING interval towards the server, seconds. Upstream's
    /// proxy-server refuses pings closer than 30 s (GOAWAY `too_many_pings`),
    /// so the default is twice that; a server that still says so doubles it.
    #[arg(long, default_value_t = 60.0)]
    pub keepalive_time: f64,
    /// Admin endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:8093")]
    pub admin: std::net::SocketAddr,
    /// A file holding a bearer token the admin endpoint requires for
    /// everything but `/healthz` and `/readyz`.
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// Offer per-connection flow control to the server (used only when the
    /// server is seedlink; `false` forces the plain Konnectivity protocol).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub flow_control: bool,
    /// The transport to a seedlink server: `auto` (the native
    /// `seedlink-tunnel/1` when the server offers it, else gRPC) or `grpc`.
    #[arg(long, default_value = "auto")]
    pub transport: seedlink_tunnel::agent::config::Transport,
    /// Dial the replicas a seedlink server says where to reach
    /// (`kubernetes.replica_addresses`) directly, besides --server: no load
    /// balancer is needed in front of the replicas.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub replica_addresses: bool,
    /// Drain deadline after the first SIGTERM, seconds.
    #[arg(long, default_value_t = 30.0)]
    pub drain: f64,
    /// Reach the server through this HTTP CONNECT forward proxy,
    /// `http://host:port` or `https://host:port` (TLS to the proxy; a
    /// corporate egress proxy, it resolves the server's name).
    #[arg(long)]
    pub egress_proxy: Option<String>,
    /// A file holding `user:password` for the egress proxy (Basic; read again for every connection).
    #[arg(long, requires = "egress_proxy")]
    pub egress_proxy_credentials_file: Option<PathBuf>,
    /// The CA bundle an `https://` egress proxy's certificate is checked against (default: the
    /// system's trust store).
    #[arg(long, requires = "egress_proxy")]
    pub egress_proxy_ca_file: Option<PathBuf>,
}

/// A running agent as the supervisor sees it.
struct AgentRole {
    agent: Arc<Agent>,
    drain: Duration,
}

impl Role for AgentRole {
    fn name(&self) -> &'static str {
        "tunnel-agent"
    }

    fn files(&self) -> Vec<PathBuf> {
        // The token is read again on every connection to a server; the
        // flags and certificates are read at start (a restart applies them).
        Vec::new()
    }

    fn reload(&self, forced: bool) -> BoxFut<'_, ()> {
        if forced {
            tracing::info!("SIGHUP ignored: the tunnel-agent reads its token and its egress proxy's credentials on every connection, its client certificate when it changes, its flags and CA at start (restart to change them)");
        }
        Box::pin(async {})
    }

    fn drain(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            tracing::info!("draining: DRAIN sent to every server");
            self.agent.drain();
            // Servers stop sending new dials; open connections may finish
            // within the deadline.
            tokio::time::sleep(self.drain).await;
            self.agent.shutdown.cancel();
        })
    }
}

impl AgentArgs {
    /// The configuration these flags (or the `--config` file) describe.
    pub fn model(&self) -> anyhow::Result<AgentConfig> {
        if let Some(path) = &self.config {
            return read_agent_config(path);
        }
        Ok(AgentConfig {
            server: self.server.clone().unwrap_or_default(),
            server_name: self.server_name.clone(),
            ca_cert: self.ca_cert.clone().unwrap_or_default(),
            agent_cert: self.agent_cert.clone(),
            agent_key: self.agent_key.clone(),
            alpn_proto: self.alpn_proto.clone(),
            agent_id: self.agent_id.clone(),
            agent_identifiers: self.agent_identifiers.clone(),
            service_account_token_path: self.service_account_token_path.clone(),
            allow_cidr: self.allow_cidr.clone(),
            allow_port: self.allow_port.clone(),
            deny_cidr: self.deny_cidr.clone(),
            dial_timeout: secs(self.dial_timeout, "dial-timeout")?,
            sync_interval: secs(self.sync_interval, "sync-interval")?,
            sync_interval_cap: secs(self.sync_interval_cap, "sync-interval-cap")?,
            keepalive_time: secs(self.keepalive_time, "keepalive-time")?,
            admin: self.admin,
            admin_token_file: self.admin_token_file.clone(),
            flow_control: self.flow_control,
            transport: self.transport,
            replica_addresses: self.replica_addresses,
            drain: secs(self.drain, "drain")?,
            egress_proxy: self.egress_proxy.clone(),
            egress_proxy_credentials_file: self.egress_proxy_credentials_file.clone(),
            egress_proxy_ca_file: self.egress_proxy_ca_file.clone(),
        })
    }
}

/// The agent's configuration file, parsed.
fn read_agent_config(path: &std::path::Path) -> anyhow::Result<AgentConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    AgentConfig::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The agent's `/readyz`: ready once it holds a stream to every replica
/// it knows of.
fn readiness(agent: &Agent) -> seedlink_net::admin::Answer {
    use seedlink_net::admin::TEXT;
    let body = format!(
        "server streams: {} of {} replicas ({} in all)\n",
        agent.held(),
        agent.known_count(),
        agent.session_count()
    );
    if agent.ready() {
        (200, TEXT, body)
    } else {
        (503, TEXT, format!("[-]server-connected failed\n{body}"))
    }
}

/// The agent's admin endpoint: probes, its configuration (which names
/// the token file; no secret is inline) and metrics.
fn agent_admin(
    agent: Arc<Agent>,
    cfg: &AgentConfig,
) -> Arc<dyn Fn(&str) -> seedlink_net::admin::Answer + Send + Sync> {
    let config = serde_json::to_string_pretty(&serde_json::json!({"config": cfg}))
        .unwrap_or_default()
        + "\n";
    Arc::new(move |path: &str| -> seedlink_net::admin::Answer {
        use seedlink_net::admin::{encode, JSON, METRICS, TEXT};
        match path {
            "/healthz" => (200, TEXT, "ok\n".into()),
            "/config" => (200, JSON, config.clone()),
            "/readyz" | "/ready" => readiness(&agent),
            "/metrics" => (200, METRICS, encode(&agent.metrics.registry)),
            _ => (
                404,
                TEXT,
                "not found; try /healthz /readyz /metrics /config\n".into(),
            ),
        }
    })
}

/// Binds and serves the agent's admin endpoint; where it listens.
async fn serve_admin(
    agent: &Arc<Agent>,
    cfg: &AgentConfig,
) -> anyhow::Result<std::net::SocketAddr> {
    let admin = tokio::net::TcpListener::bind(cfg.admin)
        .await
        .with_context(|| format!("admin {}", cfg.admin))?;
    let admin_addr = admin.local_addr()?;
    let access = match &cfg.admin_token_file {
        None => seedlink_net::admin::Access::open(),
        Some(p) => seedlink_net::admin::Access::from_token_file(p)
            .with_context(|| format!("admin_token_file {}", p.display()))?,
    };
    let route = agent_admin(agent.clone(), cfg);
    tokio::spawn(seedlink_net::admin::serve_with(admin, 32, access, route));
    Ok(admin_addr)
}

/// Runs the tunnel agent until drained; returns the exit code.
pub async fn agent(a: AgentArgs) -> anyhow::Result<i32> {
    let supervisor = Supervisor::install()?;
    let cfg = a.model()?;
    let opts = cfg
        .options(std::env::var("PROXY_AGENT_ID").ok())
        .map_err(|e| problems("tunnel-agent", a.config.is_some(), &e))?;
    let agent = Agent::new(opts)?;
    let admin_addr = serve_admin(&agent, &cfg).await?;
    {
        let agent = agent.clone();
        tokio::spawn(async move { agent.run().await });
    }
    let ready = serde_json::json!({"event": "ready", "admin": admin_addr.to_string(), "agent_id": agent.opts.agent_id});
    let role = AgentRole {
        agent,
        drain: cfg.drain,
    };
    let armed = supervisor.arm(vec![Arc::new(role)]);
    println!("{ready}");
    Ok(armed.run().await)
}
