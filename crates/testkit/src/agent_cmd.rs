//! One way to write a `seedlink tunnel-agent` command line in the tests:
//! the settings every test agent shares (the test server's name, a free
//! admin port, the shoot-loopback deny rule, a fast re-sync), then what the
//! test is about.

/// A `seedlink tunnel-agent` command line being built.
#[derive(Debug, Clone)]
pub struct AgentCmd {
    args: Vec<String>,
}

/// The server name in the test PKI's server certificate.
pub const SERVER_NAME: &str = "tunnel.seedlink.test";

impl AgentCmd {
    /// An agent dialing `server` (`host:port`), checking the server's
    /// certificate for [`SERVER_NAME`], with its admin endpoint on a free
    /// loopback port. The test shoots serve on their own loopback, which
    /// the agent's default policy denies: that rule is lifted for
    /// [`crate::SHOOT_LOOPBACK_DENY`]'s range only.
    pub fn new(server: &str) -> AgentCmd {
        AgentCmd { args: Vec::new() }
            .args([
                "tunnel-agent",
                "--server",
                server,
                "--server-name",
                SERVER_NAME,
            ])
            .args(["--admin", "127.0.0.1:0"])
            .args(["--deny-cidr", crate::SHOOT_LOOPBACK_DENY])
    }

    /// Trusts `ca` for the server and presents the client certificate
    /// `cert` with its `key`.
    pub fn mtls(self, ca: &str, cert: &str, key: &str) -> AgentCmd {
        self.args(["--ca-cert", ca, "--agent-cert", cert, "--agent-key", key])
    }

    /// Re-syncs every 0.2 s, backing off to 2 s at most: a test sees the
    /// agent reconnect within seconds.
    pub fn fast_sync(self) -> AgentCmd {
        self.args(["--sync-interval", "0.2", "--sync-interval-cap", "2"])
    }

    /// Appends `args`.
    pub fn args<I, S>(mut self, args: I) -> AgentCmd
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// The arguments (after the binary's name).
    pub fn to_args(&self) -> Vec<String> {
        self.args.clone()
    }

    /// The command, with the seedlink binary under test.
    pub fn command(&self) -> std::process::Command {
        let mut c = std::process::Command::new(crate::seedlink_bin());
        c.args(&self.args);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_settings_come_first_and_the_rest_in_order() {
        let a = AgentCmd::new("127.0.0.1:1")
            .mtls("ca", "crt", "key")
            .fast_sync()
            .args(["--agent-id", "x"])
            .to_args();
        assert_eq!(a[0], "tunnel-agent");
        let at = |flag: &str| a.iter().position(|x| x == flag).unwrap();
        assert_eq!(a[at("--server") + 1], "127.0.0.1:1");
        assert_eq!(a[at("--server-name") + 1], SERVER_NAME);
        assert_eq!(a[at("--deny-cidr") + 1], crate::SHOOT_LOOPBACK_DENY);
        assert_eq!(a[at("--agent-cert") + 1], "crt");
        assert_eq!(a[at("--sync-interval-cap") + 1], "2");
        assert_eq!(a.last().map(String::as_str), Some("x"));
    }
}
