//! `seedlink node-proxy` configuration: one model for both sources, the
//! command line and a YAML file (`--config`). Keys are the flags' names with
//! `_` for `-`; durations are written like `5s` in the file and as seconds
//! on the command line. Model (unknown keys rejected, with line numbers) →
//! [`NodeProxyConfig::check`] (every problem with its key) →
//! [`NodeProxyConfig::plan`], what the node-proxy runs with.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use seedlink_config::model::humantime_serde;
use seedlink_config::{ConfigError, Errors};
use serde::Deserialize;

use crate::netif::{Interface, LinkKind};
use crate::{Mode, Options};

/// The node-proxy's whole configuration.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeProxyConfig {
    /// The advertised kube-apiserver address to listen on.
    pub address: IpAddr,
    /// Port to listen on.
    #[serde(default = "default_port")]
    pub port: u16,
    /// The gateway, `host:port`; a DNS name is re-resolved.
    pub gateway: String,
    /// `connect`, `http2-connect`, `proxy-v2` or `proxy-v1`.
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Destination header value (`connect` and `http2-connect`).
    #[serde(default)]
    pub destination: Option<String>,
    /// Destination header name.
    #[serde(default = "default_header")]
    pub header: String,
    /// CONNECT request target; default: the gateway host with port 443.
    #[serde(default)]
    pub authority: Option<String>,
    /// Admin endpoint (`/healthz`, `/readyz`, `/metrics`, `/config`).
    #[serde(default = "default_admin")]
    pub admin: SocketAddr,
    /// A file holding a bearer token the admin endpoint requires for
    /// everything but the probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Concurrent tunnels.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connect timeout per gateway address.
    #[serde(default = "five_s", with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Drain deadline on SIGTERM.
    #[serde(default = "thirty_s", with = "humantime_serde")]
    pub drain: Duration,
    /// Link that carries the address.
    #[serde(default = "default_interface")]
    pub interface: String,
    /// `dummy`, `bridge`, `existing` or `none`.
    #[serde(default = "default_link_kind")]
    pub link_kind: String,
    /// How often the address is re-asserted.
    #[serde(default = "sixty_s", with = "humantime_serde")]
    pub resync: Duration,
}

/// The port's default.
pub fn default_port() -> u16 {
    443
}
/// The mode's default.
pub fn default_mode() -> String {
    "connect".into()
}
/// The header's default.
pub fn default_header() -> String {
    "X-Gardener-Destination".into()
}
/// The admin endpoint's default.
pub fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 16910))
}
/// The connection limit's default.
pub fn default_max_connections() -> usize {
    10_000
}
/// The link's default name.
pub fn default_interface() -> String {
    "apiserver-proxy".into()
}
/// The link kind's default.
pub fn default_link_kind() -> String {
    "dummy".into()
}
fn five_s() -> Duration {
    Duration::from_secs(5)
}
fn thirty_s() -> Duration {
    Duration::from_secs(30)
}
fn sixty_s() -> Duration {
    Duration::from_secs(60)
}

/// What the node-proxy runs with.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The proxy's options.
    pub options: Options,
    /// The address to maintain on a link, unless `link_kind: none`.
    pub interface: Option<Interface>,
    /// How often it is re-asserted.
    pub resync: Duration,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The admin endpoint.
    pub admin: SocketAddr,
}

impl NodeProxyConfig {
    /// Parses a YAML file's text (unknown keys and type errors are reported
    /// with their line); nothing is checked yet.
    pub fn parse(text: &str) -> Result<NodeProxyConfig, Errors> {
        serde_norway::from_str(text).map_err(|e| {
            Errors(vec![ConfigError {
                path: String::new(),
                message: e.to_string(),
            }])
        })
    }

    fn mode(&self) -> Option<Mode> {
        Some(match self.mode.as_str() {
            "connect" => Mode::Connect,
            "http2-connect" => Mode::Http2Connect,
            "proxy-v2" => Mode::ProxyV2,
            "proxy-v1" => Mode::ProxyV1,
            _ => return None,
        })
    }

    fn link_kind(&self) -> Result<Option<LinkKind>, ()> {
        Ok(Some(match self.link_kind.as_str() {
            "dummy" => LinkKind::Dummy,
            "bridge" => LinkKind::Bridge,
            "existing" => LinkKind::Existing,
            "none" => return Ok(None),
            _ => return Err(()),
        }))
    }

    fn gateway_host(&self) -> Option<&str> {
        let (h, p) = self.gateway.rsplit_once(':')?;
        p.parse::<u16>().ok()?;
        (!h.is_empty()).then_some(h)
    }

    /// Every problem, with the key it is about.
    pub fn check(&self) -> Vec<ConfigError> {
        let mut errs = Vec::new();
        let mut err = |path: &str, message: String| {
            errs.push(ConfigError {
                path: path.to_string(),
                message,
            })
        };
        if self.gateway_host().is_none() {
            err("gateway", format!("{:?} is not host:port", self.gateway));
        }
        match self.mode() {
            None => err(
                "mode",
                format!(
                    "{:?} is not connect, http2-connect, proxy-v2 or proxy-v1",
                    self.mode
                ),
            ),
            Some(Mode::Connect | Mode::Http2Connect) => match &self.destination {
                None => err("destination", format!("needed in {} mode", self.mode)),
                Some(d) => {
                    if let Err(why) = seedlink_proto::destination::parse(d) {
                        err("destination", format!("{d:?}: {why}"));
                    }
                }
            },
            Some(_) => {}
        }
        if self.header.is_empty()
            || !self
                .header
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b':')
        {
            err(
                "header",
                format!("{:?} is not an HTTP header name", self.header),
            );
        }
        if self.link_kind().is_err() {
            err(
                "link_kind",
                format!(
                    "{:?} is not dummy, bridge, existing or none",
                    self.link_kind
                ),
            );
        }
        if self.max_connections == 0 {
            err("max_connections", "must be at least 1".into());
        }
        for (key, d) in [
            ("connect_timeout", self.connect_timeout),
            ("resync", self.resync),
        ] {
            if d.is_zero() {
                err(key, "must be more than 0".into());
            }
        }
        errs
    }

    /// What the node-proxy runs with, if [`NodeProxyConfig::check`] finds
    /// nothing.
    pub fn plan(&self) -> Result<Plan, Errors> {
        let errs = self.check();
        let (Some(mode), Ok(kind), Some(host), true) = (
            self.mode(),
            self.link_kind(),
            self.gateway_host(),
            errs.is_empty(),
        ) else {
            return Err(Errors(errs));
        };
        Ok(Plan {
            options: Options {
                gateway: self.gateway.clone(),
                mode,
                header: (
                    self.header.clone(),
                    self.destination.clone().unwrap_or_default(),
                ),
                authority: self
                    .authority
                    .clone()
                    .unwrap_or_else(|| format!("{host}:443")),
                connect_timeout: self.connect_timeout,
                handshake_timeout: Duration::from_secs(10),
                resolve_ttl: Duration::from_secs(30),
                max_connections: self.max_connections,
                drain: self.drain,
                probe_interval: Duration::from_secs(10),
            },
            interface: kind.map(|kind| Interface {
                name: self.interface.clone(),
                kind,
                address: self.address,
            }),
            resync: self.resync,
            listen: SocketAddr::new(self.address, self.port),
            admin: self.admin,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_mistake_is_listed_with_its_key() {
        let cfg = NodeProxyConfig::parse(
            "address: 10.0.0.1\ngateway: seed.example\nmode: connect\nlink_kind: tun\n\
             max_connections: 0\nheader: 'Bad Header'\n",
        )
        .unwrap();
        let paths: Vec<String> = cfg.check().into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            [
                "gateway",
                "destination",
                "header",
                "link_kind",
                "max_connections"
            ]
        );
        assert!(cfg.plan().is_err());
    }

    #[test]
    fn a_valid_file_plans_what_the_flags_would() {
        let cfg = NodeProxyConfig::parse(
            "address: 10.0.0.1\ngateway: 'seed.example:8443'\n\
             destination: 'outbound|443||kube-apiserver.shoot--a.svc.cluster.local'\n",
        )
        .unwrap();
        let p = cfg.plan().unwrap();
        assert_eq!(p.options.mode, Mode::Connect);
        assert_eq!(p.options.authority, "seed.example:443");
        assert_eq!(p.listen, "10.0.0.1:443".parse().unwrap());
        assert_eq!(p.interface.map(|i| i.kind), Some(LinkKind::Dummy));
        let e = NodeProxyConfig::parse("address: 10.0.0.1\ngateway: a:1\nmodee: x\n").unwrap_err();
        assert!(e.to_string().contains("modee"), "{e}");
    }
}
