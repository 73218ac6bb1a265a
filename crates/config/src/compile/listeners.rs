//! Listeners: addresses, names, protocols, and who may send a PROXY header
//! to them.

use std::collections::HashSet;
use std::net::SocketAddr;

use crate::model::{InvalidRequest, Listener, Protocol, ProxyMode};
use crate::routes::CidrSet;

use super::checks::*;
use super::errors::*;

/// A validated listener.
#[derive(Debug, Clone)]
pub struct ListenerSpec {
    /// Unique name.
    pub name: String,
    /// Address to bind.
    pub address: SocketAddr,
    /// Protocol spoken.
    pub protocol: Protocol,
    /// PROXY protocol handling.
    pub proxy_protocol: ProxyMode,
    /// `http-connect`: the destination header, lower case.
    pub destination_header: String,
    /// `http-connect`: the answer to an unusable request.
    pub on_invalid_request: InvalidRequest,
    /// `http-connect`: the compiled destination guard (full match).
    pub destination_regex: Option<regex::Regex>,
    /// `proxy` listeners: the PROXY v2 TLV type that selects the control
    /// plane (by its cluster ID) instead of the header's destination.
    pub route_by_tlv: Option<u8>,
    /// `http-connect`/`auto`: CONNECTs may be handed to an in-process
    /// tunnel-server.
    pub tunnel_frontend: bool,
}

impl PartialEq for ListenerSpec {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.address == other.address
            && self.protocol == other.protocol
            && self.proxy_protocol == other.proxy_protocol
            && self.destination_header == other.destination_header
            && self.on_invalid_request == other.on_invalid_request
            && self.route_by_tlv == other.route_by_tlv
            && self.destination_regex.as_ref().map(|r| r.as_str())
                == other.destination_regex.as_ref().map(|r| r.as_str())
    }
}

impl Eq for ListenerSpec {}

/// A listener that takes PROXY headers needs someone trusted to send them.
pub(super) fn check_proxy_trust(
    c: &mut Collector,
    listeners: &[ListenerSpec],
    trusted_lbs: &CidrSet,
) {
    for l in listeners {
        if l.proxy_protocol != ProxyMode::Off && trusted_lbs.is_empty() {
            c.err(
                format!("listeners[{}].proxy_protocol", l.name),
                format!(
                    "is {:?} but trusted_load_balancers is empty: no PROXY header could ever be accepted (refusing to start; fail closed)",
                    l.proxy_protocol
                ),
            );
        }
    }
}

pub(super) fn check_listeners(c: &mut Collector, ls: &[Listener]) -> Vec<ListenerSpec> {
    if ls.is_empty() {
        c.err("listeners", "at least one listener is required");
    }
    let mut names = HashSet::new();
    let mut addrs = HashSet::new();
    let mut out = Vec::new();
    for (i, l) in ls.iter().enumerate() {
        let at = format!("listeners[{i}]");
        check_listener_names(c, &at, l, &mut names);
        match l.address.parse::<SocketAddr>() {
            Ok(a) => {
                if a.port() != 0 && !addrs.insert(a) {
                    c.err(
                        format!("{at}.address"),
                        format!("{a} is used by another listener"),
                    );
                }
                out.push(listener_spec(c, &at, l, a));
            }
            Err(_) => c.err(
                format!("{at}.address"),
                format!("{:?} is not an ip:port address", l.address),
            ),
        }
    }
    out
}

/// A listener's name (unique) and its destination header's.
pub(super) fn check_listener_names(
    c: &mut Collector,
    at: &str,
    l: &Listener,
    names: &mut HashSet<String>,
) {
    if !valid_name(&l.name) {
        c.err(
            format!("{at}.name"),
            format!("{:?} is not a valid name", l.name),
        );
    } else if !names.insert(l.name.clone()) {
        c.err(
            format!("{at}.name"),
            format!("duplicate listener name {:?}", l.name),
        );
    }
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if l.destination_header.is_empty() || !l.destination_header.bytes().all(token) {
        c.err(
            format!("{at}.destination_header"),
            format!("{:?} is not a valid header name", l.destination_header),
        );
    }
}

/// One listener at a valid address, with the settings its protocol allows.
pub(super) fn listener_spec(
    c: &mut Collector,
    at: &str,
    l: &Listener,
    address: SocketAddr,
) -> ListenerSpec {
    if l.route_by_tlv.is_some() && l.protocol != Protocol::Proxy {
        c.err(
            format!("{at}.route_by_tlv"),
            "only a `proxy` listener routes by a TLV of the node proxy's PROXY header",
        );
    }
    if l.tunnel_frontend && !matches!(l.protocol, Protocol::HttpConnect | Protocol::Auto) {
        c.err(
            format!("{at}.tunnel_frontend"),
            "only an `http-connect` or `auto` listener hands CONNECTs to the tunnel-server",
        );
    }
    let destination_regex = match l.destination_regex.as_deref().map(destination_regex) {
        None => None,
        Some(Ok(r)) => Some(r),
        Some(Err(why)) => {
            c.err(format!("{at}.destination_regex"), why);
            None
        }
    };
    ListenerSpec {
        route_by_tlv: l.route_by_tlv,
        tunnel_frontend: l.tunnel_frontend,
        name: l.name.clone(),
        address,
        protocol: l.protocol,
        proxy_protocol: l.proxy_protocol,
        destination_header: l.destination_header.to_ascii_lowercase(),
        on_invalid_request: l.on_invalid_request,
        destination_regex,
    }
}

/// Whether a `tls` or `auto` listener receives connections at `ip`.
pub(super) fn tls_received_at(listeners: &[ListenerSpec], ip: std::net::IpAddr) -> bool {
    listeners.iter().any(|l| {
        matches!(l.protocol, Protocol::Tls | Protocol::Auto)
            && (l.address.ip().is_unspecified() || crate::routes::canonical(l.address.ip()) == ip)
    })
}
