//! The `seedlink` binary: a thin command-line front over the role libraries.

mod tunnel_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use seedlink_gateway::Gateway;

/// The connectivity layer for seed clusters hosting many Kubernetes control planes.
#[derive(Parser)]
#[command(name = "seedlink", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the shared gateway (SNI passthrough, PROXY protocol, ACLs).
    Gateway {
        /// Configuration file (YAML); watched and re-read on SIGHUP.
        #[arg(long, short)]
        config: PathBuf,
        /// Share listener ports with a gateway already running on them
        /// (SO_REUSEPORT), for a zero-downtime upgrade; without it a port in
        /// use is an error.
        #[arg(long)]
        reuse_port: bool,
    },
    /// Serve the kube-apiserver address on a shoot node and tunnel every
    /// connection to the seed gateway.
    NodeProxy(Box<NodeProxyArgs>),
    /// Run the reverse-tunnel server (Konnectivity-compatible, many clusters;
    /// reloads its configuration on SIGHUP and when a file changes).
    TunnelServer {
        /// Configuration file (YAML).
        #[arg(long, short)]
        config: PathBuf,
        /// Drain deadline on SIGTERM, seconds: open frontend connections may
        /// finish within it.
        #[arg(long, default_value_t = 30.0)]
        drain: f64,
        /// Seconds between checks of the configuration and every file it
        /// names (certificates, keys, CAs); a change reloads. 0: only SIGHUP.
        #[arg(long, default_value_t = 2.0)]
        reload_interval: f64,
    },
    /// Run the gateway and the tunnel-server in one process: agents'
    /// connections that the gateway routes to an endpoint `local:tunnel-server`
    /// are handed over in-process (no second hop, no extra port).
    Seed {
        /// Gateway configuration (YAML); watched and re-read on SIGHUP.
        #[arg(long)]
        gateway: PathBuf,
        /// Tunnel-server configuration (YAML); reloaded on SIGHUP and changes.
        #[arg(long)]
        tunnel: PathBuf,
        /// Tunnel-server drain deadline after the gateway drained, seconds.
        #[arg(long, default_value_t = 30.0)]
        drain: f64,
        /// Seconds between checks of the tunnel-server's files (0: SIGHUP only).
        #[arg(long, default_value_t = 2.0)]
        reload_interval: f64,
        /// Share the gateway's listener ports with a running instance
        /// (see `gateway --reuse-port`).
        #[arg(long)]
        reuse_port: bool,
    },
    /// Run the reverse-tunnel agent in a shoot: dials out to the tunnel server.
    TunnelAgent(Box<tunnel_cmd::AgentArgs>),
    /// Print (or write) kube-apiserver's EgressSelectorConfiguration and the
    /// agent's command line for one cluster of a tunnel-server configuration.
    TunnelConfig(Box<TunnelConfigArgs>),
    /// Validate a configuration file; lists every problem and exits non-zero if any.
    CheckConfig {
        /// Configuration file (YAML).
        file: PathBuf,
        /// Whose file it is: `gateway` or `tunnel-server`; by default told
        /// from its top-level keys (`clusters`/`agents` → tunnel-server).
        #[arg(long, default_value = "auto")]
        role: ConfigRole,
    },
    /// Start a gateway with demo control planes on loopback and show how to reach them.
    Quickstart {
        /// Run the walkthrough unattended; exit 0 only if every step worked.
        #[arg(long)]
        check: bool,
        /// Gateway port on 127.0.0.1 (default: any free port).
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Admin port on 127.0.0.1 (default: any free port).
        #[arg(long, default_value_t = 0)]
        admin_port: u16,
    },
}

/// `seedlink node-proxy` options.
#[derive(clap::Args)]
struct NodeProxyArgs {
    /// The advertised kube-apiserver address to listen on (IPv4 or IPv6).
    #[arg(long)]
    address: std::net::IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 443)]
    port: u16,
    /// The gateway, `host:port`; a DNS name (a trailing dot is fine) is re-resolved.
    #[arg(long)]
    gateway: String,
    /// How to reach the gateway: `connect` (HTTP/1.1 CONNECT, GEP-30), `http2-connect` (streams on one
    /// shared h2c connection), `proxy-v2` or `proxy-v1` (GEP-08 legacy port).
    #[arg(long, default_value = "connect")]
    mode: String,
    /// Destination header value, e.g. `outbound|443||kube-apiserver.<ns>.svc.cluster.local`.
    #[arg(long, required_if_eq_any([("mode", "connect"), ("mode", "http2-connect")]))]
    destination: Option<String>,
    /// Destination header name.
    #[arg(long, default_value = "X-Gardener-Destination")]
    header: String,
    /// CONNECT request target (the gateway logs it, never routes by it); default: the gateway host with port 443.
    #[arg(long)]
    authority: Option<String>,
    /// Admin endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:16910")]
    admin: std::net::SocketAddr,
    /// Concurrent tunnels.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// Connect timeout per gateway address, seconds.
    #[arg(long, default_value_t = 5.0)]
    connect_timeout: f64,
    /// Drain deadline on SIGTERM, seconds.
    #[arg(long, default_value_t = 30.0)]
    drain: f64,
    /// Link that carries the address.
    #[arg(long, default_value = "apiserver-proxy")]
    interface: String,
    /// How that link comes to exist: `dummy` (created if missing), `bridge`
    /// (a port-less bridge, for kernels without dummy), `existing`, or `none`
    /// (do not manage the address at all).
    #[arg(long, default_value = "dummy")]
    link_kind: String,
    /// How often the address is re-asserted, seconds.
    #[arg(long, default_value_t = 60.0)]
    resync: f64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match &cli.command {
        Command::Quickstart { .. } => "warn",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .init();
    match run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("seedlink: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::CheckConfig { file, role } => Ok(check_config(&file, role)),
        Command::Gateway { config, reuse_port } => runtime()?.block_on(gateway(config, reuse_port)),
        Command::NodeProxy(args) => runtime()?.block_on(node_proxy(*args)),
        Command::TunnelServer {
            config,
            drain,
            reload_interval,
        } => tunnel_runtime()?.block_on(tunnel_cmd::server(config, drain, reload_interval)),
        Command::TunnelAgent(args) => tunnel_runtime()?.block_on(tunnel_cmd::agent(*args)),
        Command::TunnelConfig(args) => tunnel_config(*args),
        Command::Seed {
            gateway,
            tunnel,
            drain,
            reload_interval,
            reuse_port,
        } => runtime()?.block_on(seed(gateway, tunnel, drain, reload_interval, reuse_port)),
        Command::Quickstart {
            check,
            port,
            admin_port,
        } => runtime()?.block_on(seedlink::quickstart::run(seedlink::quickstart::Options {
            port,
            admin_port,
            check,
        })),
    }
}

/// The tunnel roles run on one thread unless `TOKIO_WORKER_THREADS` asks
/// for more: every tunneled byte hops between a few tasks (socket, queue,
/// HTTP/2, TLS), and on one thread those hops are plain function calls,
/// not cross-thread wake-ups (measured: see docs/PERFORMANCE.md).
fn tunnel_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    match std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(n) if n > 1 => runtime(),
        _ => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    }
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

/// The roles whose configuration `check-config` validates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ConfigRole {
    /// Told from the file's top-level keys.
    Auto,
    /// `seedlink gateway` (and the gateway of `seedlink seed`).
    Gateway,
    /// `seedlink tunnel-server` (and the tunnel of `seedlink seed`).
    TunnelServer,
}

/// A tunnel-server file has `clusters` or `agents` at the top; a gateway
/// file never does.
fn detect_role(text: &str) -> ConfigRole {
    match serde_norway::from_str::<serde_norway::Value>(text) {
        Ok(serde_norway::Value::Mapping(m))
            if m.contains_key("clusters") || m.contains_key("agents") =>
        {
            ConfigRole::TunnelServer
        }
        _ => ConfigRole::Gateway,
    }
}

fn check_config(file: &std::path::Path, role: ConfigRole) -> i32 {
    let role = match role {
        ConfigRole::Auto => match std::fs::read_to_string(file) {
            Ok(text) => detect_role(&text),
            Err(e) => {
                eprintln!("{}: 1 problem(s)\n  - cannot read it: {e}", file.display());
                return 1;
            }
        },
        r => r,
    };
    let problems: Vec<String> = match role {
        ConfigRole::TunnelServer => match check_tunnel_file(file) {
            Ok(summary) => {
                println!("{}: valid (tunnel-server: {summary})", file.display());
                return 0;
            }
            Err(p) => p,
        },
        _ => match seedlink_config::load(file, None) {
            Ok(s) => {
                println!(
                    "{}: valid ({} listeners, {} control planes, {} host names)",
                    file.display(),
                    s.listeners.len(),
                    s.control_planes.len(),
                    s.routes.len()
                );
                return 0;
            }
            Err(errors) => errors
                .0
                .iter()
                .map(|e| {
                    if e.path.is_empty() {
                        e.message.clone()
                    } else {
                        format!("{}: {}", e.path, e.message)
                    }
                })
                .collect(),
        },
    };
    eprintln!("{}: {} problem(s)", file.display(), problems.len());
    for p in &problems {
        eprintln!("  - {p}");
    }
    1
}

/// A tunnel-server file: parsed and checked (every problem with its path),
/// then every file it names read and parsed. A summary when valid.
fn check_tunnel_file(file: &std::path::Path) -> Result<String, Vec<String>> {
    let text = std::fs::read_to_string(file).map_err(|e| vec![format!("cannot read it: {e}")])?;
    let cfg = seedlink_tunnel::config::ServerConfig::parse(&text).map_err(|e| {
        format!("{e:#}")
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    })?;
    let missing = cfg.check_files();
    if !missing.is_empty() {
        return Err(missing);
    }
    let frontends: usize = cfg
        .clusters
        .iter()
        .map(|c| c.frontends.len())
        .sum::<usize>()
        + cfg.shared_frontends.len();
    Ok(format!(
        "{} clusters, {} frontends",
        cfg.clusters.len(),
        frontends
    ))
}

async fn gateway(config: PathBuf, reuse_port: bool) -> anyhow::Result<i32> {
    let gw = load_gateway(config)?;
    let supervisor = seedlink_gateway::signals::Supervisor::install(gw.clone())?;
    let bound = gw.bind(reuse_port)?;
    let mut ready = bound.describe();
    ready["event"] = "ready".into();
    gw.serve(bound)?;
    // One machine-readable line on stdout tells scripts and tests the bound
    // addresses (listeners may be configured with port 0).
    println!("{ready}");
    tracing::info!(addresses = %ready, "gateway serving");
    Ok(supervisor.run().await)
}

/// A gateway from its configuration file (every problem logged).
fn load_gateway(config: PathBuf) -> anyhow::Result<std::sync::Arc<Gateway>> {
    let snapshot = match seedlink_config::load(&config, None) {
        Ok(s) => s,
        Err(errors) => {
            for e in &errors.0 {
                tracing::error!(path = %e.path, problem = %e.message, "invalid configuration");
            }
            anyhow::bail!(
                "{}: invalid configuration ({} problem(s))",
                config.display(),
                errors.0.len()
            );
        }
    };
    Ok(Gateway::new(snapshot, Some(config)))
}

/// `seedlink seed`: the gateway and the tunnel-server in one process.
async fn seed(
    gw_config: PathBuf,
    tunnel_config: PathBuf,
    drain: f64,
    reload_interval: f64,
    reuse_port: bool,
) -> anyhow::Result<i32> {
    use anyhow::Context;
    use seedlink_tunnel::config::ServerConfig;
    use seedlink_tunnel::server::run::TunnelServer;
    let text = std::fs::read_to_string(&tunnel_config)
        .with_context(|| format!("reading {}", tunnel_config.display()))?;
    let tcfg =
        ServerConfig::parse(&text).with_context(|| format!("{}", tunnel_config.display()))?;
    let srv = TunnelServer::from_config(&tcfg)?;
    let tbound = srv.start().await?;
    let gw = load_gateway(gw_config)?;
    {
        let srv = srv.clone();
        // Agents' TLS is taken over as is; a CONNECT is answered by the
        // cluster named like the control plane it was routed to.
        gw.set_local(
            "tunnel-server",
            std::sync::Arc::new(move |h: seedlink_gateway::Handoff| match h.connect_target {
                None => srv.hand_over(h.stream, h.replay, h.client),
                Some(target) => srv.connect_handoff(h.stream, h.replay, &h.control_plane, target),
            }),
        );
    }
    let supervisor = seedlink_gateway::signals::Supervisor::install(gw.clone())?;
    let bound = gw.bind(reuse_port)?;
    let mut ready = bound.describe();
    gw.serve(bound)?;
    let frontends: serde_json::Map<String, serde_json::Value> = tbound
        .frontends
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    ready["event"] = "ready".into();
    ready["tunnel"] = serde_json::json!({
        "agents": tbound.agents.to_string(),
        "admin": tbound.admin.map(|a| a.to_string()),
        "frontends": frontends,
        "server_id": srv.server_id,
    });
    println!("{ready}");
    let stop = tokio_util::sync::CancellationToken::new();
    let watcher = tokio::spawn(tunnel_cmd::watch(
        srv.clone(),
        tunnel_config.clone(),
        tunnel_cmd::fingerprint(&tunnel_config, &tcfg),
        secs(reload_interval, "reload-interval")?,
        stop.clone(),
    ));
    // The gateway's supervisor owns SIGTERM/SIGINT (and its own SIGHUP
    // reload); once the gateway has drained, the tunnel-server drains.
    let code = supervisor.run().await;
    stop.cancel();
    let _ = watcher.await;
    srv.stop(secs(drain, "drain")?).await;
    Ok(code)
}

fn secs(v: f64, what: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .map_err(|_| anyhow::anyhow!("--{what}: {v} is not a valid number of seconds"))
}

async fn node_proxy(a: NodeProxyArgs) -> anyhow::Result<i32> {
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
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
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
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("draining");
    tokio::select! {
        closed = np.drain() => {
            tracing::info!(closed_at_deadline = closed, "drained; exiting");
            Ok(0)
        }
        _ = term.recv() => Ok(1),
        _ = int.recv() => Ok(1),
    }
}

fn seedlink_proto_destination(d: &str) -> Result<(), &'static str> {
    seedlink_proto::destination::parse(d).map(|_| ())
}

/// `seedlink tunnel-config` options.
#[derive(clap::Args)]
struct TunnelConfigArgs {
    /// The tunnel-server configuration (YAML).
    #[arg(long, short)]
    config: PathBuf,
    /// The cluster.
    #[arg(long)]
    cluster: String,
    /// The frontend kube-apiserver uses (default: the cluster's first
    /// http-connect or grpc frontend).
    #[arg(long)]
    frontend: Option<String>,
    /// Where agents reach the server (or the gateway in front of it),
    /// `host:port` (default: the agent endpoint, unless it is a wildcard).
    #[arg(long)]
    agent_server: Option<String>,
    /// TLS server name the agents ask for (default: the host of --agent-server).
    #[arg(long)]
    server_name: Option<String>,
    /// CA bundle path as kube-apiserver sees it (TCP+mTLS frontends).
    #[arg(long, default_value = "/etc/kubernetes/tunnel/ca.crt")]
    kas_ca: PathBuf,
    /// kube-apiserver's client certificate path (TCP+mTLS frontends).
    #[arg(long, default_value = "/etc/kubernetes/tunnel/client.crt")]
    kas_cert: PathBuf,
    /// Its key path.
    #[arg(long, default_value = "/etc/kubernetes/tunnel/client.key")]
    kas_key: PathBuf,
    /// The server's CA path as the agent sees it.
    #[arg(long, default_value = "/etc/seedlink/tunnel-ca.crt")]
    agent_ca_cert: PathBuf,
    /// The agent's client certificate path (clusters trusting a CA).
    #[arg(long, default_value = "/etc/seedlink/agent.crt")]
    agent_cert: PathBuf,
    /// Its key path.
    #[arg(long, default_value = "/etc/seedlink/agent.key")]
    agent_key: PathBuf,
    /// The agent's projected token path (clusters trusting tokens).
    #[arg(
        long,
        default_value = "/var/run/secrets/tokens/konnectivity-agent-token"
    )]
    agent_token: PathBuf,
    /// Write egress-selector-configuration.yaml, tunnel-agent.args and
    /// proxy-agent.args into this directory instead of printing.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn tunnel_config(a: TunnelConfigArgs) -> anyhow::Result<i32> {
    use anyhow::Context;
    let text = std::fs::read_to_string(&a.config)
        .with_context(|| format!("reading {}", a.config.display()))?;
    let cfg = seedlink_tunnel::config::ServerConfig::parse(&text)
        .with_context(|| format!("{}", a.config.display()))?;
    // What it prints must work: a CA or key that does not exist is an error.
    let missing = cfg.check_files();
    if !missing.is_empty() {
        anyhow::bail!("{}: {}", a.config.display(), missing.join("; "));
    }
    let opts = seedlink::egress::Options {
        cluster: a.cluster,
        frontend: a.frontend,
        agent_server: a.agent_server,
        server_name: a.server_name,
        kas_ca: a.kas_ca,
        kas_cert: a.kas_cert,
        kas_key: a.kas_key,
        agent_ca_cert: a.agent_ca_cert,
        agent_cert: a.agent_cert,
        agent_key: a.agent_key,
        agent_token: a.agent_token,
    };
    let r = seedlink::egress::render(&cfg, &opts)?;
    match a.out {
        Some(dir) => {
            for f in r.write(&dir)? {
                println!("wrote {}", f.display());
            }
        }
        None => print!("{}", r.text()),
    }
    Ok(0)
}
