//! `seedlink tunnel-agent` configuration: one model for both sources, the
//! command line and a YAML file (`--config`). Keys are the flags' names
//! with `_` for `-`; durations are written like `10s` in the file and as
//! seconds on the command line. The path is the same as every role's:
//! model (unknown keys rejected, with line numbers) → [`AgentConfig::check`]
//! (every problem with its key; every file it names read and parsed) →
//! [`AgentConfig::options`], what the agent runs with.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use seedlink_config::model::humantime_serde;
use seedlink_config::{ConfigError, Errors};
use serde::Deserialize;

use super::{AgentOptions, DEFAULT_DENY};
use crate::transport::grpc::H2Settings;

/// The agent's whole configuration.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The tunnel server (or the gateway in front of it), `host:port`.
    pub server: String,
    /// TLS server name (SNI); default: the host of `server`.
    #[serde(default)]
    pub server_name: Option<String>,
    /// CA certificate of the server (PEM).
    pub ca_cert: PathBuf,
    /// Client certificate (PEM); it decides the agent's cluster.
    #[serde(default)]
    pub agent_cert: Option<PathBuf>,
    /// Its key (PEM).
    #[serde(default)]
    pub agent_key: Option<PathBuf>,
    /// Extra ALPN protocols to offer, for routing by ALPN.
    #[serde(default)]
    pub alpn_proto: Vec<String>,
    /// Agent ID (default: env `PROXY_AGENT_ID` or a random ID).
    #[serde(default)]
    pub agent_id: Option<String>,
    /// Agent identifiers, URL query form: `host=…&ipv4=…&cidr=…&default-route=true`.
    #[serde(default)]
    pub agent_identifiers: String,
    /// ServiceAccount token file, sent as `authorization: Bearer`.
    #[serde(default)]
    pub service_account_token_path: Option<PathBuf>,
    /// Allowed destination networks (default: all but the denied).
    #[serde(default)]
    pub allow_cidr: Vec<IpNet>,
    /// Allowed destination ports (default: all).
    #[serde(default)]
    pub allow_port: Vec<u16>,
    /// Denied destination networks (default: link-local and cloud metadata).
    #[serde(default)]
    pub deny_cidr: Option<Vec<IpNet>>,
    /// Destination dial timeout.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub dial_timeout: Duration,
    /// First reconnect delay and replica-discovery interval.
    #[serde(default = "one_s", with = "humantime_serde")]
    pub sync_interval: Duration,
    /// Largest reconnect delay.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub sync_interval_cap: Duration,
    /// HTTP/2 PING interval towards the server.
    #[serde(default = "sixty_s", with = "humantime_serde")]
    pub keepalive_time: Duration,
    /// Admin endpoint (`/healthz`, `/readyz`, `/metrics`, `/config`).
    #[serde(default = "default_admin")]
    pub admin: SocketAddr,
    /// A file holding a bearer token the admin endpoint requires for
    /// everything but the probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<PathBuf>,
    /// Offer per-connection flow control to the server.
    #[serde(default = "yes")]
    pub flow_control: bool,
    /// The transport to a seedlink server: `auto` offers the native one
    /// (`seedlink-tunnel/1`) before gRPC, `grpc` only gRPC.
    #[serde(default)]
    pub transport: Transport,
    /// Dial the replicas a seedlink server says where to reach (REPLICAS
    /// with addresses) directly, besides `server`.
    #[serde(default = "yes")]
    pub replica_addresses: bool,
    /// Drain deadline after the first SIGTERM.
    #[serde(default = "thirty_s", with = "humantime_serde")]
    pub drain: Duration,
    /// Reach the server through this HTTP CONNECT forward proxy,
    /// `http://host:port` (a corporate egress proxy; it resolves the
    /// server's name), or `https://host:port` (TLS to the proxy, the
    /// agent's own TLS inside it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<String>,
    /// A file holding `user:password` for the proxy (`Proxy-Authorization:
    /// Basic`), read at start and again for every connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy_credentials_file: Option<PathBuf>,
    /// The CA bundle an `https://` proxy's certificate is checked against
    /// (default: the system's trust store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy_ca_file: Option<PathBuf>,
}

fn one_s() -> Duration {
    Duration::from_secs(1)
}
fn ten_s() -> Duration {
    Duration::from_secs(10)
}
fn thirty_s() -> Duration {
    Duration::from_secs(30)
}
fn sixty_s() -> Duration {
    Duration::from_secs(60)
}
/// The transport the agent offers (docs/TUNNEL.md, "The native transport").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The native transport when the server offers it (a seedlink server, with
    /// flow control on), else gRPC.
    #[default]
    Auto,
    /// gRPC only, as upstream Konnectivity.
    Grpc,
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Transport, String> {
        match s {
            "auto" => Ok(Transport::Auto),
            "grpc" => Ok(Transport::Grpc),
            _ => Err(format!("{s:?} is not a transport (auto, grpc)")),
        }
    }
}

fn yes() -> bool {
    true
}
/// The admin endpoint's default.
pub fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8093))
}

/// The host of `host:port` (brackets of an IPv6 literal removed).
fn host_of(server: &str) -> Option<String> {
    let (h, p) = server.rsplit_once(':')?;
    p.parse::<u16>().ok()?;
    let h = h.trim_start_matches('[').trim_end_matches(']');
    (!h.is_empty()).then(|| h.to_string())
}

impl AgentConfig {
    /// Parses a YAML file's text (unknown keys and type errors are reported
    /// with their line); nothing is checked yet.
    pub fn parse(text: &str) -> Result<AgentConfig, Errors> {
        serde_norway::from_str(text)
            .map_err(|e| Errors(vec![ConfigError::new(String::new(), e.to_string())]))
    }

    /// Every problem, with the key it is about: [`AgentConfig::check_values`]
    /// and [`AgentConfig::check_files`].
    pub fn check(&self) -> Vec<ConfigError> {
        let mut errs = self.check_values();
        errs.extend(self.check_files());
        errs
    }

    /// Problems of the values themselves (no file is read).
    pub fn check_values(&self) -> Vec<ConfigError> {
        let mut errs = Vec::new();
        let mut err = |path: &str, message: String| errs.push(ConfigError::new(path, message));
        if host_of(&self.server).is_none() {
            err("server", format!("{:?} is not host:port", self.server));
        }
        if self.agent_cert.is_some() != self.agent_key.is_some() {
            err("agent_cert", "agent_cert and agent_key go together".into());
        }
        for (key, d) in [
            ("dial_timeout", self.dial_timeout),
            ("sync_interval", self.sync_interval),
            ("sync_interval_cap", self.sync_interval_cap),
            ("keepalive_time", self.keepalive_time),
        ] {
            if d.is_zero() {
                err(key, "must be more than 0".into());
            }
        }
        if self.sync_interval_cap < self.sync_interval {
            err("sync_interval_cap", "must be at least sync_interval".into());
        }
        if let Some((path, message)) = self.egress_problem() {
            err(path, message);
        }
        errs
    }

    /// What is wrong with the egress proxy settings, if anything: the key
    /// and why.
    fn egress_problem(&self) -> Option<(&'static str, String)> {
        match &self.egress_proxy {
            Some(url) => seedlink_net::egress::address_of(url)
                .err()
                .map(|e| ("egress_proxy", format!("{url:?}: {e}"))),
            None if self.egress_proxy_credentials_file.is_some() => Some((
                "egress_proxy_credentials_file",
                "set without egress_proxy".into(),
            )),
            None if self.egress_proxy_ca_file.is_some() => {
                Some(("egress_proxy_ca_file", "set without egress_proxy".into()))
            }
            None => None,
        }
    }

    /// The egress proxy, its credentials read (checked by `check_files`).
    fn egress(&self) -> Result<Option<seedlink_net::egress::EgressProxy>, String> {
        let Some(url) = &self.egress_proxy else {
            return Ok(None);
        };
        let file = self.egress_proxy_credentials_file.as_deref();
        let ca = self.egress_proxy_ca_file.as_deref();
        seedlink_net::egress::EgressProxy::open(url, file, ca).map(Some)
    }

    /// Every file named, read and parsed as what it must be (CA bundle,
    /// certificate chain, private key, a non-empty token).
    pub fn check_files(&self) -> Vec<ConfigError> {
        let mut errs = Vec::new();
        let mut err = |path: &str, file: &std::path::Path, e: String| {
            errs.push(ConfigError::new(
                path.to_string(),
                format!("{}: {e}", file.display()),
            ))
        };
        if let Err(e) = crate::auth::tls::load_roots(&self.ca_cert) {
            err("ca_cert", &self.ca_cert, format!("{e:#}"));
        }
        if let (Some(c), Some(k)) = (&self.agent_cert, &self.agent_key) {
            if let Err(e) = crate::auth::tls::load_certs(c) {
                err("agent_cert", c, format!("{e:#}"));
            }
            if let Err(e) = crate::auth::tls::load_key(k) {
                err("agent_key", k, format!("{e:#}"));
            }
        }
        if let (Some(p), Some(_)) = (&self.egress_proxy_credentials_file, &self.egress_proxy) {
            if let Err(e) = read_secret(p, seedlink_net::egress::basic) {
                err("egress_proxy_credentials_file", p, e);
            }
        }
        if let Some(p) = &self.service_account_token_path {
            let non_empty = |t: &str| {
                if t.trim().is_empty() {
                    Err("empty".to_string())
                } else {
                    Ok(())
                }
            };
            if let Err(e) = read_secret(p, non_empty) {
                err("service_account_token_path", p, e);
            }
        }
        if let (Some(_), Some(url)) = (&self.egress_proxy_ca_file, &self.egress_proxy) {
            if let Err(e) = seedlink_net::egress::EgressProxy::open(
                url,
                None,
                self.egress_proxy_ca_file.as_deref(),
            ) {
                errs.push(ConfigError::new("egress_proxy_ca_file", e));
            }
        }
        errs
    }

    /// What the agent runs with, if [`AgentConfig::check`] finds nothing.
    /// `agent_id` defaults to `env_agent_id` (`PROXY_AGENT_ID`), else a
    /// random ID.
    pub fn options(&self, env_agent_id: Option<String>) -> Result<AgentOptions, Errors> {
        let errs = self.check();
        if !errs.is_empty() {
            return Err(Errors(errs));
        }
        let agent_id = self
            .agent_id
            .clone()
            .or(env_agent_id)
            .unwrap_or_else(random_agent_id);
        let egress = self
            .egress()
            .map_err(|message| Errors(vec![ConfigError::new("egress_proxy", message)]))?;
        Ok(self.options_with(agent_id, egress))
    }

    /// The options, the agent ID and egress proxy decided.
    fn options_with(
        &self,
        agent_id: String,
        egress: Option<seedlink_net::egress::EgressProxy>,
    ) -> AgentOptions {
        let deny = match &self.deny_cidr {
            Some(d) => d.clone(),
            None => DEFAULT_DENY.iter().filter_map(|s| s.parse().ok()).collect(),
        };
        AgentOptions {
            server: self.server.clone(),
            server_name: self
                .server_name
                .clone()
                .or_else(|| host_of(&self.server))
                .unwrap_or_default(),
            ca: self.ca_cert.clone(),
            identity: self.agent_cert.clone().zip(self.agent_key.clone()),
            alpn: self.alpn_proto.clone(),
            agent_id,
            identifiers: self.agent_identifiers.clone(),
            token_path: self.service_account_token_path.clone(),
            allow: self.allow_cidr.clone(),
            allow_ports: self.allow_port.clone(),
            deny,
            dial_timeout: self.dial_timeout,
            sync_interval: self.sync_interval,
            sync_interval_cap: self.sync_interval_cap,
            keepalive: H2Settings {
                keepalive: self.keepalive_time,
                keepalive_timeout: Duration::from_secs(5),
            },
            stall_timeout: Duration::from_secs(10),
            queue_bytes: 4 * 1024 * 1024,
            flow_control: self.flow_control,
            native: self.transport == Transport::Auto,
            replica_addresses: self.replica_addresses,
            egress,
        }
    }
}

/// Reads `p` and checks its text with `check`; why not, if it fails.
fn read_secret<T>(
    p: &std::path::Path,
    check: impl FnOnce(&str) -> Result<T, String>,
) -> Result<(), String> {
    let text = std::fs::read_to_string(p).map_err(|e| e.to_string())?;
    check(&text).map(|_| ())
}

/// A random agent ID (16 hex digits).
fn random_agent_id() -> String {
    let b: [u8; 8] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_file_with_every_mistake_lists_each_with_its_key() {
        let cfg = AgentConfig::parse(
            "server: no-port\nca_cert: /nonexistent/ca.pem\nagent_cert: /nonexistent/a.pem\n\
             sync_interval: 5s\nsync_interval_cap: 1s\n",
        )
        .unwrap();
        let paths: Vec<String> = cfg.check().into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            ["server", "agent_cert", "sync_interval_cap", "ca_cert"]
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_their_line() {
        let e = AgentConfig::parse("server: a:1\nca_cert: /x\nsevrer_name: y\n").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("sevrer_name") && text.contains("line 3"),
            "{text}"
        );
        let e = AgentConfig::parse("server: a:1\nca_cert: /x\ndial_timeout: soon\n").unwrap_err();
        assert!(e.to_string().contains("invalid duration"), "{e}");
    }

    #[test]
    fn defaults_match_the_flags() {
        let cfg = AgentConfig::parse("server: tunnel.example:8132\nca_cert: /x\n").unwrap();
        assert_eq!(cfg.dial_timeout, Duration::from_secs(10));
        assert_eq!(cfg.keepalive_time, Duration::from_secs(60));
        assert_eq!(cfg.admin, default_admin());
        assert!(cfg.flow_control);
        assert_eq!(host_of(&cfg.server).as_deref(), Some("tunnel.example"));
        assert_eq!(host_of("[fd00::1]:8132").as_deref(), Some("fd00::1"));
    }
}
