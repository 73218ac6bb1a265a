//! `seedlink tunnel-server` and `seedlink tunnel-agent`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use seedlink_tunnel::agent::{Agent, AgentOptions, DEFAULT_DENY};
use seedlink_tunnel::config::ServerConfig;
use seedlink_tunnel::grpc::H2Settings;
use seedlink_tunnel::server::run::TunnelServer;
use tokio::signal::unix::{signal, SignalKind};

/// `seedlink tunnel-agent` options.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// The tunnel server (or the gateway in front of it), `host:port`.
    #[arg(long)]
    pub server: String,
    /// TLS server name (SNI); default: the host of --server.
    #[arg(long)]
    pub server_name: Option<String>,
    /// CA certificate of the server (PEM).
    #[arg(long)]
    pub ca_cert: PathBuf,
    /// Client certificate (PEM); it decides the agent's cluster.
    #[arg(long, requires = "agent_key")]
    pub agent_cert: Option<PathBuf>,
    /// Its key (PEM).
    #[arg(long, requires = "agent_cert")]
    pub agent_key: Option<PathBuf>,
    /// Extra ALPN protocols to offer (comma-separated), for routing by ALPN.
    #[arg(long, value_delimiter = ',')]
    pub alpn_proto: Vec<String>,
    /// Agent ID (default: env PROXY_AGENT_ID or a random ID).
    #[arg(long, env = "PROXY_AGENT_ID")]
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
    /// Offer per-connection flow control to the server (used only when the
    /// server is seedlink; `false` forces the plain Konnectivity protocol).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub flow_control: bool,
    /// Drain deadline after the first SIGTERM, seconds.
    #[arg(long, default_value_t = 30.0)]
    pub drain: f64,
}

fn secs(v: f64, what: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| anyhow::anyhow!("--{what}: {v} is not a valid number of seconds"))
}

/// Content hash of the configuration file and every file it names (a
/// missing file hashes as missing).
pub fn fingerprint(config: &std::path::Path, cfg: &ServerConfig) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in std::iter::once(config.to_path_buf()).chain(cfg.files()) {
        p.hash(&mut h);
        std::fs::read(&p).ok().hash(&mut h);
    }
    h.finish()
}

/// The fingerprint now; for a configuration that does not parse, a hash
/// of its text (so a broken file is reported once, not on every check).
fn current_fingerprint(config: &std::path::Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let text = std::fs::read_to_string(config).unwrap_or_default();
    match ServerConfig::parse(&text) {
        Ok(cfg) => fingerprint(config, &cfg),
        Err(_) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ("unparsable", &text).hash(&mut h);
            h.finish()
        }
    }
}

/// Reloads from `config`; logs what changed or why nothing did. Returns
/// the new fingerprint if the reload was applied.
async fn reload(srv: &Arc<TunnelServer>, config: &std::path::Path) -> Option<u64> {
    let parsed = std::fs::read_to_string(config)
        .with_context(|| format!("reading {}", config.display()))
        .and_then(|t| ServerConfig::parse(&t).with_context(|| format!("{}", config.display())));
    let cfg = match parsed {
        Ok(c) => c,
        Err(e) => {
            srv.metrics.reload("error");
            tracing::warn!(error = %format!("{e:#}"), "reload refused; the running configuration stays");
            return None;
        }
    };
    match srv.reload(&cfg).await {
        Ok(r) => {
            tracing::info!(
                added = ?r.added,
                removed = ?r.removed,
                agents_rekeyed = r.agents_rekeyed,
                started = ?r.frontends_started,
                stopped = ?r.frontends_stopped,
                "configuration reloaded"
            );
            Some(fingerprint(config, &cfg))
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "reload failed");
            None
        }
    }
}

/// Runs the tunnel server until SIGTERM/SIGINT (drain up to `drain`
/// seconds), a second one (exit 1). SIGHUP, or a change of the
/// configuration or a file it names (checked every `reload_interval`
/// seconds; 0 = only on SIGHUP), reloads it.
pub async fn server(config: PathBuf, drain: f64, reload_interval: f64) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(&config)
        .with_context(|| format!("reading {}", config.display()))?;
    let cfg = ServerConfig::parse(&text).with_context(|| format!("{}", config.display()))?;
    let srv = TunnelServer::from_config(&cfg)?;
    let bound = srv.start().await?;
    let frontends: serde_json::Map<String, serde_json::Value> = bound
        .frontends
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "event": "ready",
            "agents": bound.agents.to_string(),
            "admin": bound.admin.map(|a| a.to_string()),
            "frontends": frontends,
            "server_id": srv.server_id,
        })
    );
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let stop = tokio_util::sync::CancellationToken::new();
    let watcher = tokio::spawn(watch(
        srv.clone(),
        config.clone(),
        fingerprint(&config, &cfg),
        secs(reload_interval, "reload-interval")?,
        stop.clone(),
    ));
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    stop.cancel();
    let _ = watcher.await;
    tracing::info!("draining");
    tokio::select! {
        () = srv.stop(secs(drain, "drain")?) => Ok(0),
        _ = term.recv() => Ok(1),
        _ = int.recv() => Ok(1),
    }
}

/// Reloads `srv` on SIGHUP and whenever the configuration or a file it
/// names changes (checked every `every`; zero: SIGHUP only), until `stop`.
pub async fn watch(
    srv: Arc<TunnelServer>,
    config: PathBuf,
    mut seen: u64,
    every: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; reloads only on file changes");
        return;
    };
    let mut tick = tokio::time::interval(if every.is_zero() {
        Duration::from_secs(3600)
    } else {
        every
    });
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading the tunnel-server configuration");
                seen = reload(&srv, &config).await.unwrap_or(seen);
            }
            _ = tick.tick(), if !every.is_zero() => {
                // The files are read again only if the configuration or a
                // file it names changed (Kubernetes swaps Secret volumes by
                // a symlink, so contents are compared, not events).
                let now = current_fingerprint(&config);
                if now != seen {
                    seen = reload(&srv, &config).await.unwrap_or(now);
                }
            }
        }
    }
}

/// Runs the tunnel agent: first SIGTERM drains, the second (or the drain
/// deadline) exits.
pub async fn agent(a: AgentArgs) -> anyhow::Result<i32> {
    let host = a
        .server
        .rsplit_once(':')
        .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']').to_string())
        .ok_or_else(|| anyhow::anyhow!("--server {:?} is not host:port", a.server))?;
    let deny = match a.deny_cidr {
        Some(d) => d,
        None => DEFAULT_DENY.iter().filter_map(|s| s.parse().ok()).collect(),
    };
    let agent_id = a.agent_id.unwrap_or_else(|| {
        let b: [u8; 8] = rand::random();
        b.iter().map(|x| format!("{x:02x}")).collect()
    });
    let opts = AgentOptions {
        server: a.server.clone(),
        server_name: a.server_name.unwrap_or(host),
        ca: a.ca_cert,
        identity: a.agent_cert.zip(a.agent_key),
        alpn: a.alpn_proto,
        agent_id,
        identifiers: a.agent_identifiers,
        token_path: a.service_account_token_path,
        allow: a.allow_cidr,
        allow_ports: a.allow_port,
        deny,
        dial_timeout: secs(a.dial_timeout, "dial-timeout")?,
        sync_interval: secs(a.sync_interval, "sync-interval")?,
        sync_interval_cap: secs(a.sync_interval_cap, "sync-interval-cap")?,
        keepalive: H2Settings {
            keepalive: secs(a.keepalive_time, "keepalive-time")?,
            keepalive_timeout: Duration::from_secs(5),
        },
        stall_timeout: Duration::from_secs(10),
        queue_bytes: 4 * 1024 * 1024,
        flow_control: a.flow_control,
    };
    let agent = Agent::new(opts)?;
    let admin = tokio::net::TcpListener::bind(a.admin)
        .await
        .with_context(|| format!("--admin {}", a.admin))?;
    let admin_addr = admin.local_addr()?;
    {
        let agent = agent.clone();
        let route = move |path: &str| -> seedlink_net::admin::Answer {
            use seedlink_net::admin::{encode, METRICS, TEXT};
            match path {
                "/healthz" => (200, TEXT, "ok\n".into()),
                "/readyz" | "/ready" => {
                    let body = format!("server streams: {}\n", agent.session_count());
                    if agent.ready() {
                        (200, TEXT, body)
                    } else {
                        (503, TEXT, format!("[-]server-connected failed\n{body}"))
                    }
                }
                "/metrics" => (200, METRICS, encode(&agent.metrics.registry)),
                _ => (
                    404,
                    TEXT,
                    "not found; try /healthz /readyz /metrics\n".into(),
                ),
            }
        };
        tokio::spawn(seedlink_net::admin::serve(admin, 32, Arc::new(route)));
    }
    {
        let agent = agent.clone();
        tokio::spawn(async move { agent.run().await });
    }
    println!(
        "{}",
        serde_json::json!({"event": "ready", "admin": admin_addr.to_string(), "agent_id": agent.opts.agent_id})
    );
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!("draining: DRAIN sent to every server");
    agent.drain();
    let deadline = secs(a.drain, "drain")?;
    tokio::select! {
        () = tokio::time::sleep(deadline) => {}
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    agent.shutdown.cancel();
    Ok(0)
}
