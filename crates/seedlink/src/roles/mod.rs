//! Every role's library entry: each builds its role from its options,
//! binds its listeners, prints one `ready` line on stdout and hands itself
//! to the one [`crate::supervisor::Supervisor`] (signals, reloads, drain).

pub mod gateway;
pub mod node_proxy;
pub mod tunnel;

/// `v` seconds from the command line, or an error naming the flag.
pub fn secs(v: f64, what: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .map_err(|_| anyhow::anyhow!("--{what}: {v} is not a valid number of seconds"))
}

/// Problems of a role's configuration, named as the user wrote them: a
/// key of the file given with `--config`, or the flag it came from.
pub fn problems(role: &str, from_file: bool, errors: &seedlink_config::Errors) -> anyhow::Error {
    let lines: Vec<String> = errors
        .0
        .iter()
        .map(|e| match (e.path.is_empty(), from_file) {
            (true, _) => e.message.clone(),
            (false, true) => format!("{}: {}", e.path, e.message),
            (false, false) => format!("--{}: {}", e.path.replace('_', "-"), e.message),
        })
        .collect();
    anyhow::anyhow!("invalid {role} configuration:\n{}", lines.join("\n"))
}
