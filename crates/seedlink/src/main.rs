//! The `seedlink` binary: a thin command-line front over the role libraries.

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
    },
    /// Validate a configuration file; lists every problem and exits non-zero if any.
    CheckConfig {
        /// Configuration file (YAML).
        file: PathBuf,
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
        Command::CheckConfig { file } => Ok(check_config(&file)),
        Command::Gateway { config } => runtime()?.block_on(gateway(config)),
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

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

fn check_config(file: &std::path::Path) -> i32 {
    match seedlink_config::load(file, None) {
        Ok(s) => {
            println!(
                "{}: valid ({} listeners, {} control planes, {} host names)",
                file.display(),
                s.listeners.len(),
                s.control_planes.len(),
                s.routes.len()
            );
            0
        }
        Err(errors) => {
            eprintln!("{}: {} problem(s)", file.display(), errors.0.len());
            for e in &errors.0 {
                if e.path.is_empty() {
                    eprintln!("  - {}", e.message);
                } else {
                    eprintln!("  - {}: {}", e.path, e.message);
                }
            }
            1
        }
    }
}

async fn gateway(config: PathBuf) -> anyhow::Result<i32> {
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
    let gw = Gateway::new(snapshot, Some(config));
    let supervisor = seedlink_gateway::signals::Supervisor::install(gw.clone())?;
    let bound = gw.bind()?;
    let mut ready = bound.describe();
    ready["event"] = "ready".into();
    gw.serve(bound)?;
    // One machine-readable line on stdout tells scripts and tests the bound
    // addresses (listeners may be configured with port 0).
    println!("{ready}");
    tracing::info!(addresses = %ready, "gateway serving");
    Ok(supervisor.run().await)
}
