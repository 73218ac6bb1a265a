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
    /// `seedlink tunnel-agent --config`.
    TunnelAgent,
    /// `seedlink node-proxy --config`.
    NodeProxy,
}

/// Told from the top-level keys, which no two roles share: a tunnel-server
/// file has `clusters` or `agents`, an agent's has `ca_cert`, a
/// node-proxy's has `address`; anything else is a gateway's.
fn detect_role(text: &str) -> ConfigRole {
    match serde_norway::from_str::<serde_norway::Value>(text) {
        Ok(serde_norway::Value::Mapping(m)) => {
            if m.contains_key("clusters") || m.contains_key("agents") {
                ConfigRole::TunnelServer
            } else if m.contains_key("ca_cert") {
                ConfigRole::TunnelAgent
            } else if m.contains_key("address") {
                ConfigRole::NodeProxy
            } else {
                ConfigRole::Gateway
            }
        }
        _ => ConfigRole::Gateway,
    }
}

/// `path: message` lines of a list of problems.
fn lines(errs: &[seedlink_config::ConfigError]) -> Vec<String> {
    errs.iter()
        .map(|e| {
            if e.path.is_empty() {
                e.message.clone()
            } else {
                format!("{}: {}", e.path, e.message)
            }
        })
        .collect()
}

/// An agent file: parsed, every key checked, every file read.
fn check_agent_file(text: &str) -> Result<String, Vec<String>> {
    use seedlink_tunnel::agent::config::AgentConfig;
    let cfg = AgentConfig::parse(text).map_err(|e| lines(&e.0))?;
    let errs = cfg.check();
    if !errs.is_empty() {
        return Err(lines(&errs));
    }
    Ok(format!("tunnel-agent: server {}", cfg.server))
}

/// A node-proxy file: parsed and every key checked.
fn check_node_proxy_file(text: &str) -> Result<String, Vec<String>> {
    use seedlink_node_proxy::config::NodeProxyConfig;
    let cfg = NodeProxyConfig::parse(text).map_err(|e| lines(&e.0))?;
    let errs = cfg.check();
    if !errs.is_empty() {
        return Err(lines(&errs));
    }
    Ok(format!(
        "node-proxy: {}:{} → {} ({})",
        cfg.address, cfg.port, cfg.gateway, cfg.mode
    ))
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
    let problems = match check_as(file, role) {
        Ok(summary) => {
            println!("{}: valid ({summary})", file.display());
            for w in warnings(file, role) {
                eprintln!("{}: warning: {w}", file.display());
            }
            return 0;
        }
        Err(p) => p,
    };
    eprintln!("{}: {} problem(s)", file.display(), problems.len());
    for p in &problems {
        eprintln!("  - {p}");
    }
    1
}

/// Checks `file` as `role`'s configuration: a summary when valid, every
/// problem otherwise.
fn check_as(file: &std::path::Path, role: ConfigRole) -> Result<String, Vec<String>> {
    match role {
        ConfigRole::TunnelAgent | ConfigRole::NodeProxy => std::fs::read_to_string(file)
            .map_err(|e| vec![format!("cannot read it: {e}")])
            .and_then(|text| match role {
                ConfigRole::TunnelAgent => check_agent_file(&text),
                _ => check_node_proxy_file(&text),
            }),
        ConfigRole::TunnelServer => check_tunnel_file(file).map(|s| format!("tunnel-server: {s}")),
        _ => match seedlink_config::load(file, None) {
            Ok(s) => match paths_removed_in_use(&s.file) {
                gated if !gated.is_empty() => Err(lines(&gated)),
                _ => Ok(format!(
                    "{} listeners, {} control planes, {} host names",
                    s.listeners.len(),
                    s.control_planes.len(),
                    s.routes.len()
                )),
            },
            Err(errors) => Err(lines(&errors.0)),
        },
    }
}

/// The paths still in use (by the file's `migration.usage_file`, within
/// its window) that `file` removes without retiring them: the migration
/// gate, as a reload applies it.
fn paths_removed_in_use(
    file: &seedlink_config::model::ConfigFile,
) -> Vec<seedlink_config::ConfigError> {
    use seedlink_gateway::paths;
    let Some(usage) = file.migration.usage_file.as_deref() else {
        return Vec::new();
    };
    let now = seedlink_gateway::metrics::unix_now();
    let since = now.saturating_sub(file.migration.window.as_secs());
    let in_use = paths::Usage::open(Some(usage)).now(&[]);
    paths::problems(&paths::removed(&in_use, since, None, file), file, true)
}

/// What is valid but unsafe in a valid file: an admin endpoint off
/// loopback without a token (its `/config`, `/api/state` and `/metrics`
/// name every tenant to whoever reaches it).
fn warnings(file: &std::path::Path, role: ConfigRole) -> Vec<String> {
    let open = |listen: std::net::SocketAddr, token: bool| {
        (!listen.ip().is_loopback() && !token).then(|| {
            format!(
                "the admin endpoint listens on {listen} (not loopback) without a token_file: /config, /api/state and /metrics name every tenant to anyone who reaches it"
            )
        })
    };
    let Ok(text) = std::fs::read_to_string(file) else {
        return Vec::new();
    };
    match role {
        ConfigRole::TunnelServer => seedlink_tunnel::config::ServerConfig::parse(&text)
            .ok()
            .and_then(|c| c.admin)
            .and_then(|a| open(a.listen, a.token_file.is_some()))
            .into_iter()
            .collect(),
        ConfigRole::Gateway => seedlink_config::load(file, None)
            .ok()
            .and_then(|s| open(s.admin, s.file.admin.token_file.is_some()))
            .into_iter()
            .collect(),
        _ => Vec::new(),
    }
}

/// A tunnel-server file: parsed and checked (every problem with its path),
/// then every file it names read and parsed. A summary when valid.
fn check_tunnel_file(file: &std::path::Path) -> Result<String, Vec<String>> {
    let text = std::fs::read_to_string(file).map_err(|e| vec![format!("cannot read it: {e}")])?;
    let cfg = seedlink_tunnel::config::ServerConfig::parse(&text).map_err(|e| lines(&e.0))?;
    let missing = cfg.check_files();
    if !missing.is_empty() {
        return Err(lines(&missing));
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
