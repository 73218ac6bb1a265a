//! `seedlink check-config`: validates a role's configuration file and lists
//! every problem with its path.

/// The roles whose configuration `check-config` validates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ConfigRole {
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

/// Checks `file` as `role`'s configuration: prints a summary and returns 0
/// when it is valid, else lists every problem on stderr and returns 1.
pub fn check_config(file: &std::path::Path, role: ConfigRole) -> i32 {
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
