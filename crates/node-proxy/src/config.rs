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

use crate::health::{CheckKind, HealthCheck};
use crate::netif::{Interface, LinkKind};
use crate::proxy::{Mode, Options};
use seedlink_net::egress::EgressProxy;

/// A root store with every certificate of the PEM file `path`.
fn load_roots(path: &std::path::Path) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    let certs =
        CertificateDer::pem_file_iter(path).map_err(|e| format!("{}: {e}", path.display()))?;
    for c in certs {
        let c = c.map_err(|e| format!("{}: {e}", path.display()))?;
        roots
            .add(c)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no certificate in it", path.display()));
    }
    Ok(roots)
}

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
    /// A second endpoint with `/metrics` and `/healthz` only, never behind
    /// the admin token: for the shoot's Prometheus to scrape on the node's
    /// address (as Gardener's apiserver-proxy exposes its Envoy stats on
    /// 16910), while `/config` stays on the loopback admin endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<SocketAddr>,
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
    /// The hosted cluster's ID, sent as a TLV of every PROXY v2 header
    /// (`proxy-v2` mode; HyperShift's shared ingress routes by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// The TLV type of `cluster_id`.
    #[serde(default = "default_cluster_id_tlv")]
    pub cluster_id_tlv: u8,
    /// An HTTP CONNECT forward proxy to reach the gateway through,
    /// `http://host:port` (or `host:port`), or `https://host:port` (TLS to
    /// the proxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<String>,
    /// A file holding `user:password` for the egress proxy (Basic), read
    /// again for every tunnel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy_credentials_file: Option<std::path::PathBuf>,
    /// The CA bundle an `https://` egress proxy's certificate is checked
    /// against (default: the system's trust store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy_ca_file: Option<std::path::PathBuf>,
    /// `tcp`, `tunnel`, `tls` or `http`.
    #[serde(default = "default_health_check")]
    pub health_check: String,
    /// How often the health check runs.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub health_check_interval: Duration,
    /// Deadline of one check.
    #[serde(default = "five_s", with = "humantime_serde")]
    pub health_check_timeout: Duration,
    /// Successes in a row that make an unhealthy upstream healthy.
    #[serde(default = "default_rise")]
    pub health_check_rise: u32,
    /// Failures in a row that make a healthy upstream unhealthy.
    #[serde(default = "default_fall")]
    pub health_check_fall: u32,
    /// CA bundle the API server's certificate is verified against (`tls`
    /// and `http` checks); without it any certificate is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check_ca: Option<std::path::PathBuf>,
    /// Server name of the check's TLS handshake.
    #[serde(default = "default_server_name")]
    pub health_check_server_name: String,
    /// Path of the `http` check's `GET`.
    #[serde(default = "default_check_path")]
    pub health_check_path: String,
}

/// The cluster-ID TLV type's default: HyperShift's 0x20.
pub fn default_cluster_id_tlv() -> u8 {
    0x20
}
/// The health check's default.
pub fn default_health_check() -> String {
    "tcp".into()
}
/// Rise's default (HAProxy's).
pub fn default_rise() -> u32 {
    2
}
/// Fall's default (HAProxy's).
pub fn default_fall() -> u32 {
    3
}
/// The check's TLS server name's default.
pub fn default_server_name() -> String {
    crate::health::DEFAULT_SERVER_NAME.into()
}
/// The `http` check's path's default.
pub fn default_check_path() -> String {
    "/version".into()
}
fn ten_s() -> Duration {
    Duration::from_secs(10)
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
    /// The metrics-only endpoint, if any.
    pub metrics: Option<SocketAddr>,
}

impl NodeProxyConfig {
    /// Parses a YAML file's text (unknown keys and type errors are reported
    /// with their line); nothing is checked yet.
    pub fn parse(text: &str) -> Result<NodeProxyConfig, Errors> {
        serde_norway::from_str(text)
            .map_err(|e| Errors(vec![ConfigError::new(String::new(), e.to_string())]))
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

    fn check_kind(&self) -> Option<CheckKind> {
        Some(match self.health_check.as_str() {
            "tcp" => CheckKind::Tcp,
            "tunnel" => CheckKind::Tunnel,
            "tls" => CheckKind::Tls,
            "http" => CheckKind::Http,
            _ => return None,
        })
    }

    /// An egress proxy setting given without `egress_proxy`.
    fn egress_without_proxy(&self) -> Option<&'static str> {
        [
            (
                "egress_proxy_credentials_file",
                self.egress_proxy_credentials_file.is_some(),
            ),
            ("egress_proxy_ca_file", self.egress_proxy_ca_file.is_some()),
        ]
        .into_iter()
        .find_map(|(key, set)| set.then_some(key))
    }

    /// The egress proxy, its credentials read.
    fn egress(&self) -> Result<Option<EgressProxy>, (&'static str, String)> {
        let Some(url) = &self.egress_proxy else {
            return match self.egress_without_proxy() {
                Some(key) => Err((key, "set without egress_proxy".into())),
                None => Ok(None),
            };
        };
        seedlink_net::egress::address_of(url)
            .map_err(|e| ("egress_proxy", format!("{url:?}: {e}")))?;
        let file = self.egress_proxy_credentials_file.as_deref();
        if let Some(f) = file {
            seedlink_net::egress::check_credentials_file(f)
                .map_err(|e| ("egress_proxy_credentials_file", e))?;
        }
        let ca = self.egress_proxy_ca_file.as_deref();
        let key = match ca {
            Some(_) => "egress_proxy_ca_file",
            None => "egress_proxy",
        };
        EgressProxy::open(url, file, ca)
            .map(Some)
            .map_err(|e| (key, e))
    }

    /// The health check, its CA read.
    fn health(&self) -> Result<HealthCheck, (&'static str, String)> {
        let Some(kind) = self.check_kind() else {
            return Err((
                "health_check",
                format!("{:?} is not tcp, tunnel, tls or http", self.health_check),
            ));
        };
        self.check_health_kind(kind)?;
        let uses_tls = matches!(kind, CheckKind::Tls | CheckKind::Http);
        if !uses_tls && self.health_check_ca.is_some() {
            return Err(("health_check_ca", "only tls and http checks use it".into()));
        }
        self.check_health_request()?;
        let tls = if uses_tls {
            let roots = match &self.health_check_ca {
                None => None,
                Some(p) => Some(load_roots(p).map_err(|e| ("health_check_ca", e))?),
            };
            Some(std::sync::Arc::new(
                crate::health::client_config(roots).map_err(|e| ("health_check", e))?,
            ))
        } else {
            None
        };
        Ok(HealthCheck {
            kind,
            interval: self.health_check_interval,
            timeout: self.health_check_timeout,
            rise: self.health_check_rise,
            fall: self.health_check_fall,
            tls,
            server_name: self.health_check_server_name.clone(),
            path: self.health_check_path.clone(),
        })
    }

    /// The check kinds that prove something in the mode configured.
    fn check_health_kind(&self, kind: CheckKind) -> Result<(), (&'static str, String)> {
        match (kind, self.mode()) {
            (CheckKind::Tunnel, Some(Mode::ProxyV2 | Mode::ProxyV1)) => Err((
                "health_check",
                "a PROXY header gets no answer, so `tunnel` proves nothing in this mode; use tls or http".into(),
            )),
            (CheckKind::Tls | CheckKind::Http, Some(Mode::Http2Connect)) => Err((
                "health_check",
                "tls and http checks need a mode over TCP; use tunnel in http2-connect mode".into(),
            )),
            _ => Ok(()),
        }
    }

    /// The server name and path the tls and http checks send.
    fn check_health_request(&self) -> Result<(), (&'static str, String)> {
        if rustls::pki_types::ServerName::try_from(self.health_check_server_name.as_str()).is_err()
        {
            return Err((
                "health_check_server_name",
                format!(
                    "{:?} is not a DNS name or IP address",
                    self.health_check_server_name
                ),
            ));
        }
        if !self.health_check_path.starts_with('/')
            || !self.health_check_path.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err((
                "health_check_path",
                format!(
                    "{:?} is not an absolute path without spaces",
                    self.health_check_path
                ),
            ));
        }
        Ok(())
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
        let mut err =
            |path: &str, message: String| errs.push(ConfigError::new(path.to_string(), message));
        self.check_addresses(&mut err);
        self.check_mode(&mut err);
        if let Err((key, message)) = self.egress() {
            err(key, message);
        }
        if let Err((key, message)) = self.health() {
            err(key, message);
        }
        self.check_numbers(&mut err);
        errs
    }

    /// `gateway` and `metrics`.
    fn check_addresses(&self, err: &mut impl FnMut(&str, String)) {
        if self.gateway_host().is_none() {
            err("gateway", format!("{:?} is not host:port", self.gateway));
        }
        if let Some(m) = self.metrics {
            let overlap = |a: SocketAddr| {
                a.port() == m.port()
                    && m.port() != 0
                    && (a.ip() == m.ip() || a.ip().is_unspecified() || m.ip().is_unspecified())
            };
            if overlap(self.admin) {
                err(
                    "metrics",
                    format!("{m} overlaps the admin endpoint {}", self.admin),
                );
            }
            if overlap(SocketAddr::new(self.address, self.port)) {
                err("metrics", format!("{m} overlaps the listening address"));
            }
        }
    }

    /// `mode`, `destination`, `header` and the cluster ID's.
    fn check_mode(&self, err: &mut impl FnMut(&str, String)) {
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
        if !header_name(&self.header) {
            err(
                "header",
                format!("{:?} is not an HTTP header name", self.header),
            );
        }
        self.check_cluster_id(err);
    }

    /// The cluster ID (proxy-v2 only) and the TLV type it is sent in.
    fn check_cluster_id(&self, err: &mut impl FnMut(&str, String)) {
        match (&self.cluster_id, self.mode()) {
            (Some(_), Some(m)) if m != Mode::ProxyV2 => err(
                "cluster_id",
                format!("only sent in proxy-v2 mode, not {}", self.mode),
            ),
            (Some(id), _) => {
                if let Err(why) = seedlink_config::compile::check_cluster_id(id) {
                    err("cluster_id", why)
                }
            }
            _ => {}
        }
        // Types whose meaning a receiver acts on: a checksum, padding.
        if matches!(self.cluster_id_tlv, 0x00 | 0x03 | 0x04) {
            err(
                "cluster_id_tlv",
                format!(
                    "{:#04x} is reserved (0x03 is a CRC32C, 0x04 padding); HyperShift uses 0x20, applications 0xE0-0xEF",
                    self.cluster_id_tlv
                ),
            );
        }
    }

    /// Counts, durations and the link kind.
    fn check_numbers(&self, err: &mut impl FnMut(&str, String)) {
        for (key, n) in [
            ("health_check_rise", self.health_check_rise),
            ("health_check_fall", self.health_check_fall),
        ] {
            if n == 0 {
                err(key, "must be at least 1".into());
            }
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
        self.check_durations(err);
    }

    /// Every duration is more than 0.
    fn check_durations(&self, err: &mut impl FnMut(&str, String)) {
        for (key, d) in [
            ("connect_timeout", self.connect_timeout),
            ("resync", self.resync),
            ("health_check_interval", self.health_check_interval),
            ("health_check_timeout", self.health_check_timeout),
        ] {
            if d.is_zero() {
                err(key, "must be more than 0".into());
            }
        }
    }

    /// What the node-proxy runs with, if [`NodeProxyConfig::check`] finds
    /// nothing.
    pub fn plan(&self) -> Result<Plan, Errors> {
        let errs = self.check();
        let (Some(mode), Ok(kind), Some(host), Ok(egress), Ok(health), true) = (
            self.mode(),
            self.link_kind(),
            self.gateway_host(),
            self.egress(),
            self.health(),
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
                tlv: self
                    .cluster_id
                    .as_ref()
                    .map(|id| (self.cluster_id_tlv, id.as_bytes().to_vec())),
                egress,
                health,
                advertised: SocketAddr::new(self.address, self.port),
            },
            interface: kind.map(|kind| Interface {
                name: self.interface.clone(),
                kind,
                address: self.address,
            }),
            resync: self.resync,
            listen: SocketAddr::new(self.address, self.port),
            admin: self.admin,
            metrics: self.metrics,
        })
    }
}

/// A non-empty HTTP header name: visible ASCII without `:`.
fn header_name(h: &str) -> bool {
    !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic() && b != b':')
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
    fn the_metrics_endpoint_may_not_overlap_admin_or_the_listener() {
        let base = "address: 10.0.0.1\ngateway: 'seed.example:8443'\n\
                    destination: 'outbound|443||kube-apiserver.shoot--a.svc.cluster.local'\n";
        let with = |extra: &str| NodeProxyConfig::parse(&format!("{base}{extra}")).unwrap();
        // The default admin is 127.0.0.1:16910.
        let e = with("metrics: 0.0.0.0:16910\n").check();
        assert_eq!(e.len(), 1);
        assert!(e[0].message.contains("admin endpoint"), "{}", e[0].message);
        assert!(!with("metrics: 0.0.0.0:443\n").check().is_empty());
        let ok = with("admin: 127.0.0.1:9911\nmetrics: 0.0.0.0:16910\n");
        assert_eq!(
            ok.plan().unwrap().metrics,
            Some("0.0.0.0:16910".parse().unwrap())
        );
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
