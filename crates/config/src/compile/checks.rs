//! The checks of single values: names, host names, CIDRs, endpoints,
//! limits, settings, and the Kubernetes and GatewayClass sections.

use std::net::SocketAddr;

use ipnet::IpNet;

use crate::model::ConfigFile;
use crate::routes::CidrSet;

use super::errors::*;

/// Compiles a destination guard with Envoy `safe_regex` semantics: RE2
/// syntax, matched against the whole value. The size limit keeps a hostile
/// configuration from building a huge automaton.
pub fn destination_regex(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(1 << 20)
        .build()
        .map_err(|e| format!("invalid regular expression: {e}"))
}

/// The admin endpoint's address (a placeholder after an error, so the
/// rest is still checked).
pub(super) fn check_admin(c: &mut Collector, listen: &str) -> SocketAddr {
    listen.parse::<SocketAddr>().unwrap_or_else(|_| {
        c.err(
            "admin.listen",
            format!("{listen:?} is not an ip:port address"),
        );
        SocketAddr::from(([127, 0, 0, 1], 0))
    })
}

pub(super) fn check_settings(c: &mut Collector, f: &ConfigFile) {
    let t = &f.timeouts;
    for (name, d) in [
        ("client_hello", t.client_hello),
        ("upstream_connect", t.upstream_connect),
        ("half_closed", t.half_closed),
        ("keepalive_time", t.keepalive_time),
        ("keepalive_interval", t.keepalive_interval),
    ] {
        if d.is_zero() {
            c.err(format!("timeouts.{name}"), "must be greater than zero");
        }
    }
    if t.keepalive_retries == 0 {
        c.err("timeouts.keepalive_retries", "must be at least 1");
    }
    check_limits(c, &f.limits);
    let u = &f.upstream;
    if !(1..=16).contains(&u.connect_attempts) {
        c.err("upstream.connect_attempts", "must be between 1 and 16");
    }
    if u.eject_base.is_zero() || u.eject_base > u.eject_max {
        c.err(
            "upstream.eject_base",
            "must be greater than zero and not above eject_max",
        );
    }
}

pub(super) fn check_limits(c: &mut Collector, l: &crate::model::Limits) {
    if l.max_connections == Some(0) {
        c.err(
            "limits.max_connections",
            "must be at least 1 (omit it to derive from the open-file limit)",
        );
    }
    if l.max_routed_per_source == Some(0) {
        c.err(
            "limits.max_routed_per_source",
            "must be at least 1 (omit it for no cap)",
        );
    }
    if l.max_unrouted_per_source == 0 {
        c.err("limits.max_unrouted_per_source", "must be at least 1");
    }
    if !(1024..=65_536).contains(&l.client_hello_max_bytes) {
        c.err(
            "limits.client_hello_max_bytes",
            "must be between 1024 and 65536",
        );
    }
    if !(232..=65_551).contains(&l.proxy_header_max_bytes) {
        c.err(
            "limits.proxy_header_max_bytes",
            "must be between 232 and 65551",
        );
    }
    if l.workers.is_some_and(|w| w == 0 || w > 256) {
        c.err(
            "limits.workers",
            "must be between 1 and 256 (omit it for one per CPU)",
        );
    }
}

pub(super) fn cidrs(c: &mut Collector, path: &str, items: &[String]) -> CidrSet {
    let mut nets = Vec::new();
    for (i, s) in items.iter().enumerate() {
        match parse_cidr(s) {
            Ok(n) => nets.push(n),
            Err(why) => c.err(format!("{path}[{i}]"), why),
        }
    }
    CidrSet::new(nets)
}

/// A cluster ID as a PROXY v2 TLV carries it (HyperShift's cluster UUID):
/// 1-255 printable ASCII characters without spaces.
pub fn check_cluster_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 255 || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{id:?} must be 1-255 printable ASCII characters without spaces"
        ));
    }
    Ok(())
}

/// Parses `a.b.c.d/n`, `x::y/n` or a bare address; rejects host bits set.
pub fn parse_cidr(s: &str) -> Result<IpNet, String> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    let net: IpNet = s
        .parse()
        .map_err(|_| format!("{s:?} is not a CIDR (like 10.0.0.0/8 or 2001:db8::/32)"))?;
    if net.trunc() != net {
        return Err(format!(
            "{s:?} has host bits set; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

pub(super) fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

pub(super) fn valid_hostname(h: &str) -> bool {
    h.len() <= 253
        && h.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// `namespace/name` split in two, each part a non-empty DNS-1123 name.
pub fn split_object_name(s: &str) -> Option<(&str, &str)> {
    let (ns, name) = s.split_once('/')?;
    let ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 253
            && p.chars()
                .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '-' || ch == '.')
    };
    (ok(ns) && ok(name)).then_some((ns, name))
}
