//! The compiled, immutable route table and the runtime objects it points to.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use ipnet::IpNet;

/// A set of CIDRs. Membership is a linear scan of this set only, so the
/// cost of an ACL check depends on the size of one control plane's list,
/// never on the number of control planes.
#[derive(Debug, Clone, Default)]
pub struct CidrSet {
    nets: Vec<IpNet>,
}

impl CidrSet {
    /// A set of the given networks.
    pub fn new(nets: Vec<IpNet>) -> CidrSet {
        CidrSet { nets }
    }

    /// Whether `ip` (IPv4-mapped IPv6 addresses count as IPv4) is inside.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.nets.iter().any(|n| n.contains(&ip))
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }
}

/// Maps IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) to IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Normalises a host name for lookup: ASCII lower case and one trailing dot
/// removed. Returns `None` for names that cannot match any route.
pub fn normalize_host(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.ends_with('.') {
        return None;
    }
    Some(name.to_ascii_lowercase())
}

/// Live state of one upstream endpoint, carried over reloads for as long as
/// the same control plane keeps the same endpoint.
#[derive(Debug, Default)]
pub struct EndpointState {
    /// Connections currently open to this endpoint.
    pub active: AtomicU32,
    /// Consecutive failed connects.
    pub failures: AtomicU32,
    /// Ejected until this many milliseconds after the process clock's base.
    pub ejected_until_ms: AtomicU64,
}

/// One upstream endpoint.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `host:port` as configured.
    pub address: String,
    /// Shared live state.
    pub state: Arc<EndpointState>,
}

impl Endpoint {
    /// Whether the endpoint is ejected at `now_ms`.
    pub fn ejected(&self, now_ms: u64) -> bool {
        self.state.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }
}

/// A compiled control plane.
#[derive(Debug)]
pub struct ControlPlane {
    /// Unique name.
    pub name: String,
    /// Upstream endpoints (at least one).
    pub endpoints: Vec<Endpoint>,
    /// Allow-list; `None` allows every client.
    pub acl: Option<CidrSet>,
}

/// A destination served through `http-connect` listeners.
#[derive(Debug, Clone)]
pub struct DestinationRoute {
    /// Whose ACL applies and whose name labels metrics.
    pub control_plane: Arc<ControlPlane>,
    /// Where connections go.
    pub endpoints: Vec<Endpoint>,
    /// With a `local:` endpoint: what the in-process service dials
    /// (`host:port`), fixed by the configuration.
    pub tunnel_target: Option<String>,
}

/// Host names → control plane, as Gateway API matches them: an exact name
/// wins; else the most specific wildcard, where `*.example.com` matches any
/// name ending in `.example.com` (`a.example.com`, `a.b.example.com`, not
/// `example.com`).
///
/// Keys are shared strings, as in every table of [`RouteTable`]: each pass
/// of the Kubernetes source copies the table and changes a few entries, and
/// a copy of a thousand tenants' entries then costs no allocation per key.
#[derive(Debug, Default, Clone)]
pub struct HostRoutes {
    pub(crate) exact: HashMap<Arc<str>, Arc<ControlPlane>>,
    /// Keyed by the part after `*.`.
    pub(crate) wildcard: HashMap<Arc<str>, Arc<ControlPlane>>,
}

impl HostRoutes {
    /// `host` is normalised. At most one hash lookup per label.
    fn lookup(&self, host: &str) -> Option<&Arc<ControlPlane>> {
        if let Some(cp) = self.exact.get(host) {
            return Some(cp);
        }
        if self.wildcard.is_empty() {
            return None;
        }
        let mut rest = host;
        while let Some((_, parent)) = rest.split_once('.') {
            if let Some(cp) = self.wildcard.get(parent) {
                return Some(cp);
            }
            rest = parent;
        }
        None
    }

    pub(crate) fn insert(&mut self, pattern: String, cp: Arc<ControlPlane>) {
        match pattern.strip_prefix("*.") {
            Some(parent) => self.wildcard.insert(parent.into(), cp),
            None => self.exact.insert(pattern.into(), cp),
        };
    }

    /// Who holds `pattern` (as [`HostRoutes::insert`] takes it).
    pub(crate) fn owner(&self, pattern: &str) -> Option<&Arc<ControlPlane>> {
        match pattern.strip_prefix("*.") {
            Some(parent) => self.wildcard.get(parent),
            None => self.exact.get(pattern),
        }
    }

    /// Lets `pattern` go.
    pub(crate) fn remove(&mut self, pattern: &str) {
        match pattern.strip_prefix("*.") {
            Some(parent) => self.wildcard.remove(parent),
            None => self.exact.remove(pattern),
        };
    }

    pub(crate) fn len(&self) -> usize {
        self.exact.len() + self.wildcard.len()
    }
}

/// SNI → control plane: the names served on every listener, and those
/// served only on some listening addresses (`served_on`).
#[derive(Debug, Default, Clone)]
pub struct RouteTable {
    /// Served on every SNI listener.
    pub(crate) hosts: HostRoutes,
    /// Served only where a connection arrives at this address (canonical IP).
    pub(crate) scoped: HashMap<std::net::SocketAddr, HostRoutes>,
    /// Addresses (canonical) that serve only names given for them: the
    /// names served everywhere are not served there.
    pub(crate) exclusive: std::collections::HashSet<std::net::IpAddr>,
    /// Canonical destination string → route.
    pub(crate) destinations: HashMap<Arc<str>, Arc<DestinationRoute>>,
    /// In-cluster service address → control plane (legacy PROXY path).
    pub(crate) services: HashMap<std::net::SocketAddr, Arc<ControlPlane>>,
    /// Cluster ID → control plane (`route_by_tlv` listeners).
    pub(crate) clusters: HashMap<Arc<[u8]>, Arc<ControlPlane>>,
}

impl RouteTable {
    /// Finds the control plane for an SNI host name (any case, one optional
    /// trailing dot) among the names served on every listener. One hash
    /// lookup per label at most, whatever the table size.
    pub fn lookup(&self, sni: &str) -> Option<&Arc<ControlPlane>> {
        self.hosts.lookup(&normalize_host(sni)?)
    }

    /// Whether some names are served only on some addresses (then a
    /// connection's local address is needed: [`RouteTable::lookup_at`]).
    pub fn scoped(&self) -> bool {
        !self.exclusive.is_empty()
    }

    /// Finds the control plane for an SNI host name on a connection that
    /// arrived at `local`: at an address that serves only its own names
    /// (`served_on`, a class Gateway's), those; elsewhere the names served
    /// everywhere.
    pub fn lookup_at(&self, sni: &str, local: std::net::SocketAddr) -> Option<&Arc<ControlPlane>> {
        let host = normalize_host(sni)?;
        let local = std::net::SocketAddr::new(canonical(local.ip()), local.port());
        if self.exclusive.contains(&local.ip()) {
            self.scoped.get(&local).and_then(|s| s.lookup(&host))
        } else {
            self.hosts.lookup(&host)
        }
    }

    /// Finds a destination by its canonical string (one hash lookup).
    pub fn destination(&self, canonical: &str) -> Option<&DestinationRoute> {
        self.destinations.get(canonical).map(Arc::as_ref)
    }

    /// Finds the control plane whose in-cluster service address is `addr`
    /// (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn service(&self, addr: std::net::SocketAddr) -> Option<&Arc<ControlPlane>> {
        self.services.get(&std::net::SocketAddr::new(
            canonical(addr.ip()),
            addr.port(),
        ))
    }

    /// Finds the control plane whose `cluster_id` is exactly `id`.
    pub fn cluster(&self, id: &[u8]) -> Option<&Arc<ControlPlane>> {
        self.clusters.get(id)
    }

    /// Number of destinations served.
    pub fn destination_count(&self) -> usize {
        self.destinations.len()
    }

    /// Number of host names routed.
    pub fn len(&self) -> usize {
        self.hosts.len() + self.scoped.values().map(HostRoutes::len).sum::<usize>()
    }

    /// Whether no host name is routed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
