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
