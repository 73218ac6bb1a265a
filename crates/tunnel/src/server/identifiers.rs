//! What an agent says about itself, and the strategies that pick an
//! agent for a destination by it.

use std::net::IpAddr;

use ipnet::IpNet;

/// What an agent says about itself (`agentidentifiers`).
#[derive(Debug, Clone, Default)]
pub struct Identifiers {
    /// `host=` values.
    pub hosts: Vec<String>,
    /// `ipv4=` / `ipv6=` values.
    pub ips: Vec<IpAddr>,
    /// `cidr=` values.
    pub cidrs: Vec<IpNet>,
    /// `default-route=true`.
    pub default_route: bool,
}

impl std::fmt::Display for Identifiers {
    /// The URL-query form the agent sent (canonical order).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = self.hosts.iter().map(|h| format!("host={h}")).collect();
        parts.extend(self.ips.iter().map(|ip| match ip {
            IpAddr::V4(_) => format!("ipv4={ip}"),
            IpAddr::V6(_) => format!("ipv6={ip}"),
        }));
        parts.extend(self.cidrs.iter().map(|c| format!("cidr={c}")));
        if self.default_route {
            parts.push("default-route=true".into());
        }
        write!(f, "{}", parts.join("&"))
    }
}

impl Identifiers {
    /// Parses the URL-query form; unknown keys and unparsable values are
    /// ignored (as upstream does), and reported back for logging.
    pub fn parse(s: &str) -> (Identifiers, Vec<String>) {
        let mut out = Identifiers::default();
        let mut ignored = Vec::new();
        for (k, v) in form_urlencoded::parse(s.as_bytes()) {
            match k.as_ref() {
                "host" => out.hosts.push(v.to_ascii_lowercase()),
                "ipv4" | "ipv6" => match v.parse() {
                    Ok(ip) => out.ips.push(ip),
                    Err(_) => ignored.push(format!("{k}={v}")),
                },
                "cidr" => match v.parse() {
                    Ok(n) => out.cidrs.push(n),
                    Err(_) => ignored.push(format!("{k}={v}")),
                },
                "default-route" => out.default_route = v.eq_ignore_ascii_case("true"),
                _ => ignored.push(k.to_string()),
            }
        }
        (out, ignored)
    }
}

/// How a backend is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Any agent of the cluster.
    Default,
    /// An agent whose `host`/`ipv4`/`ipv6` identifier equals the destination host.
    DestHost,
    /// An agent advertising `default-route=true`.
    DefaultRoute,
    /// An agent whose `cidr` identifier contains the destination IP.
    Cidr,
}

impl Strategy {
    /// From its configuration name.
    pub fn from_name(s: &str) -> Option<Strategy> {
        Some(match s {
            "default" => Strategy::Default,
            "destHost" => Strategy::DestHost,
            "defaultRoute" => Strategy::DefaultRoute,
            "cidr" => Strategy::Cidr,
            _ => return None,
        })
    }

    pub(super) fn matches(self, ids: &Identifiers, host: &str) -> bool {
        match self {
            Strategy::Default => true,
            Strategy::DefaultRoute => ids.default_route,
            Strategy::DestHost => {
                let h = host.trim_start_matches('[').trim_end_matches(']');
                match h.parse::<IpAddr>() {
                    Ok(ip) => ids.ips.contains(&ip),
                    Err(_) => ids.hosts.iter().any(|x| x.eq_ignore_ascii_case(h)),
                }
            }
            Strategy::Cidr => {
                let h = host.trim_start_matches('[').trim_end_matches(']');
                h.parse::<IpAddr>()
                    .is_ok_and(|ip| ids.cidrs.iter().any(|n| n.contains(&ip)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::server::*;

    #[test]
    fn identifiers_parse_like_upstream_and_report_what_they_ignore() {
        let (ids, ignored) = Identifiers::parse(
            "host=Node1&ipv4=10.0.0.5&ipv6=fd00::1&cidr=10.1.0.0/16&default-route=true&uid=x&ipv4=bad",
        );
        assert_eq!(ids.hosts, vec!["node1"]);
        assert_eq!(ids.ips.len(), 2);
        assert_eq!(ids.cidrs.len(), 1);
        assert!(ids.default_route);
        assert_eq!(ignored, vec!["uid".to_string(), "ipv4=bad".to_string()]);
    }
}
