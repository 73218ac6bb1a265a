//! The `seedlink` binary: a thin command-line front over the role libraries.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use seedlink::check::ConfigRole;
use seedlink::roles::{self, tunnel::TunnelServerOptions};

/// The connectivity layer for seed clusters hosting many Kubernetes control planes.
#[derive(Parser)]
#[command(name = "seedlink", version, about)]
struct Cli {
    /// Log lines on stderr: `text` (for people) or `json` (one object per
    /// line, for log collectors). Also `SEEDLINK_LOG_FORMAT`.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "SEEDLINK_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable text.
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields`).
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the shared gateway (SNI passthrough, PROXY protocol, ACLs).
    Gateway {
        /// Configuration file (YAML); watched and re-read on SIGHUP.
        #[arg(long, short)]
        config: PathBuf,
        /// Share listener ports with a gateway already running on them
        /// (SO_REUSEPORT); without it a port in use is an error. For a
        /// binary upgrade prefer --upgrade-socket with --take-over: shared
        /// SO_REUSEPORT sockets lose the connections queued on the old one.
        #[arg(long)]
        reuse_port: bool,
        /// Offer the listening sockets on this Unix socket (mode 0600) to
        /// the next binary, which takes them with --take-over: then this
        /// process stops accepting and drains (docs/OPERATIONS.md,
        /// "Upgrades and rollouts").
        #[arg(long)]
        upgrade_socket: Option<PathBuf>,
        /// Take the listening sockets from the gateway offering them at
        /// --upgrade-socket, serve on them, and offer them on in turn.
        #[arg(long, requires = "upgrade_socket")]
        take_over: bool,
    },
    /// Serve the kube-apiserver address on a shoot node and tunnel every
    /// connection to the seed gateway.
    NodeProxy(Box<roles::node_proxy::NodeProxyArgs>),
    /// Run the reverse-tunnel server (Konnectivity-compatible, many clusters;
    /// reloads its configuration on SIGHUP and when a file changes).
    TunnelServer(TunnelServerArgs),
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
        /// Ignored (kept so that existing command lines start): files are
        /// watched, not polled.
        #[arg(long, hide = true)]
        reload_interval: Option<f64>,
        /// Share the gateway's listener ports with a running instance
        /// (see `gateway --reuse-port`).
        #[arg(long)]
        reuse_port: bool,
    },
    /// Run the reverse-tunnel agent in a shoot: dials out to the tunnel server.
    TunnelAgent(Box<roles::tunnel::AgentArgs>),
    /// Print (or write) kube-apiserver's EgressSelectorConfiguration and the
    /// agent's command line for one cluster of a tunnel-server configuration.
    TunnelConfig(Box<seedlink::tunnel_config::TunnelConfigArgs>),
    /// Validate a configuration file; lists every problem and exits non-zero if any.
    CheckConfig {
        /// Configuration file (YAML).
        file: PathBuf,
        /// Whose file it is: `gateway`, `tunnel-server`, `tunnel-agent` or
        /// `node-proxy` (`seed` reads a gateway and a tunnel-server file);
        /// by default told from its top-level keys.
        #[arg(long, default_value = "auto")]
        role: ConfigRole,
    },
    /// Print the CustomResourceDefinitions seedlink reads (SeedlinkPolicy,
    /// TunnelCluster, SeedlinkControlPlane), as shipped in deploy/crds/.
    Crds,
    /// Run the onboarding controller: each SeedlinkControlPlane becomes its
    /// routes, tunnel cluster, trust and certificates (docs/KUBERNETES.md).
    Onboard {
        /// Configuration file (YAML).
        #[arg(long, short)]
        config: PathBuf,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match &cli.command {
        Command::Quickstart { .. } => "warn",
        _ => "info",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_env_filter(filter)
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_writer(std::io::stderr)
            .with_env_filter(filter)
            .init(),
    }
    seedlink_net::sync::count_panics();
    // The allocator keeps what a relay frees between bursts, and freed
    // memory goes back to the system after a burst (docs/OPERATIONS.md);
    // SEEDLINK_MALLOC_TRIM=off keeps glibc's default behaviour.
    if std::env::var("SEEDLINK_MALLOC_TRIM").as_deref() != Ok("off") {
        seedlink_net::memtrim::tune();
        seedlink_net::memtrim::start();
    }
    match run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("seedlink: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// `seedlink tunnel-server`'s flags.
#[derive(clap::Args)]
struct TunnelServerArgs {
    /// Configuration file (YAML).
    #[arg(long, short)]
    config: PathBuf,
    /// Drain deadline on SIGTERM, seconds: open frontend connections may
    /// finish within it.
    #[arg(long, default_value_t = 30.0)]
    drain: f64,
    /// Ignored (kept so that existing command lines start): changes to
    /// the configuration and every file it names are watched, not polled.
    #[arg(long, hide = true)]
    reload_interval: Option<f64>,
    /// Offer the listening sockets on this Unix socket (mode 0600) to
    /// the next binary, which takes them with --take-over: agents move
    /// first, then the frontends; this process keeps carrying its open
    /// tunnels until they end or --drain passes (docs/OPERATIONS.md).
    #[arg(long)]
    upgrade_socket: Option<PathBuf>,
    /// Take the listening sockets from the tunnel-server offering them
    /// at --upgrade-socket, and offer them on in turn.
    #[arg(long, requires = "upgrade_socket")]
    take_over: bool,
    /// With --take-over: how long to wait for the agents to move before
    /// taking the frontends, seconds.
    #[arg(long, default_value_t = 30.0)]
    take_over_wait: f64,
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::CheckConfig { file, role } => Ok(seedlink::check::check_config(&file, role)),
        Command::Crds => {
            print!("{}", seedlink_kube::crd::crds_yaml()?);
            Ok(0)
        }
        Command::Gateway {
            config,
            reuse_port,
            upgrade_socket,
            take_over,
        } => runtime()?.block_on(roles::gateway::run(
            config,
            roles::Upgrade {
                reuse_port,
                socket: upgrade_socket,
                take_over,
                ..roles::Upgrade::default()
            },
        )),
        Command::NodeProxy(args) => runtime()?.block_on(roles::node_proxy::run(*args)),
        Command::Onboard { config } => runtime()?.block_on(roles::onboard::run(&config)),
        Command::TunnelServer(args) => tunnel_server(args),
        Command::TunnelAgent(args) => tunnel_runtime()?.block_on(roles::tunnel::agent(*args)),
        Command::TunnelConfig(args) => seedlink::tunnel_config::tunnel_config(*args),
        Command::Seed {
            gateway,
            tunnel,
            drain,
            reload_interval,
            reuse_port,
        } => {
            ignored_reload_interval(reload_interval);
            let opts = TunnelServerOptions {
                config: tunnel,
                drain: roles::secs(drain, "drain")?,
            };
            runtime()?.block_on(roles::seed::seed(gateway, opts, reuse_port))
        }
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

/// `seedlink tunnel-server`.
fn tunnel_server(args: TunnelServerArgs) -> anyhow::Result<i32> {
    let TunnelServerArgs {
        config,
        drain,
        reload_interval,
        upgrade_socket,
        take_over,
        take_over_wait,
    } = args;
    ignored_reload_interval(reload_interval);
    let opts = TunnelServerOptions {
        config,
        drain: roles::secs(drain, "drain")?,
    };
    let upgrade = roles::Upgrade {
        socket: upgrade_socket,
        take_over,
        wait: take_over_wait_of(take_over_wait)?,
        ..roles::Upgrade::default()
    };
    tunnel_runtime()?.block_on(roles::tunnel::server(opts, upgrade))
}

/// `--take-over-wait`: below the old process's own wait for `ready`
/// (`seedlink_net::handoff::READY_WITHIN`), so that it never gives up on a
/// new process that is about to serve.
fn take_over_wait_of(v: f64) -> anyhow::Result<std::time::Duration> {
    let d = roles::secs(v, "take-over-wait")?;
    let max =
        seedlink_net::handoff::READY_WITHIN.saturating_sub(std::time::Duration::from_secs(30));
    if d > max {
        anyhow::bail!("--take-over-wait: at most {} s", max.as_secs());
    }
    Ok(d)
}

fn ignored_reload_interval(v: Option<f64>) {
    if v.is_some() {
        tracing::warn!("--reload-interval is ignored: files are watched for changes, not polled");
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
