//! Control planes into routes: SNI names and patterns, destinations,
//! upstreams and tunnels, ACLs and limits, and what collides with what.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::model::{ConfigFile, ControlPlane as ControlPlaneCfg, DestinationCfg, Protocol};
use crate::routes::{normalize_host, ControlPlane, DestinationRoute, Endpoint, RouteTable};

use super::checks::*;
use super::errors::*;
use super::listeners::*;
use super::snapshot::Snapshot;

/// The route table as control planes are added to it, with who owns each
/// name, and the problems found.
pub(super) struct Routes<'a> {
    pub(super) c: Collector,
    pub(super) previous: Option<&'a Snapshot>,
    pub(super) listeners: &'a [ListenerSpec],
    pub(super) control_planes: HashMap<Arc<str>, Arc<ControlPlane>>,
    pub(super) routes: RouteTable,
    /// What the control planes compiled so far put in `routes`, in order
    /// (so that one refused can be taken out again: [`Routes::undo`]).
    pub(super) claims: Vec<Claim>,
}

/// One entry a control plane put in the route table.
pub(super) enum Claim {
    Host(Option<SocketAddr>, String),
    Destination(String),
    Service(SocketAddr),
    Cluster(Vec<u8>),
    Name(String),
}

impl<'a> Routes<'a> {
    pub(super) fn new(
        c: Collector,
        previous: Option<&'a Snapshot>,
        listeners: &'a [ListenerSpec],
    ) -> Self {
        Routes {
            c,
            previous,
            listeners,
            control_planes: HashMap::new(),
            routes: RouteTable::default(),
            claims: Vec::new(),
        }
    }

    /// Takes out of the table the claims at `range` of the log (a control
    /// plane refused after it claimed some names).
    pub(super) fn undo(&mut self, range: std::ops::Range<usize>) {
        let r = &mut self.routes;
        for claim in self.claims.drain(range) {
            match claim {
                Claim::Host(None, p) => r.hosts.remove(&p),
                Claim::Host(Some(a), p) => {
                    if let Some(t) = r.scoped.get_mut(&a) {
                        t.remove(&p);
                        if t.len() == 0 {
                            r.scoped.remove(&a);
                        }
                    }
                }
                Claim::Destination(d) => drop(r.destinations.remove(d.as_str())),
                Claim::Service(a) => drop(r.services.remove(&a)),
                Claim::Cluster(id) => drop(r.clusters.remove(id.as_slice())),
                Claim::Name(n) => drop(self.control_planes.remove(n.as_str())),
            }
        }
    }

    /// A class Gateway's address serves that Gateway's routes only, from
    /// its first moment (before any route is attached to it).
    pub(super) fn exclusive_addresses(&mut self, k: &crate::model::KubernetesSource) {
        self.routes.exclusive.extend(class_addresses(k));
    }

    /// The file's control planes, then those from Kubernetes.
    pub(super) fn control_planes(&mut self, file: &ConfigFile) {
        let all = file
            .control_planes
            .iter()
            .enumerate()
            .map(|(i, cp)| (format!("control_planes[{i}]"), cp, false))
            .chain(
                file.from_kubernetes
                    .iter()
                    .enumerate()
                    .map(|(i, cp)| (format!("kubernetes[{i}]"), cp.as_ref(), true)),
            );
        for (at, cp, dynamic) in all {
            self.control_plane(&at, cp, dynamic);
        }
    }

    /// One control plane (`at` names it in problems; `dynamic`: from
    /// Kubernetes, whose endpoints may come later).
    pub(super) fn control_plane(&mut self, at: &str, cp: &ControlPlaneCfg, dynamic: bool) {
        self.check_identity(at, cp, dynamic);
        let prev = self
            .previous
            .and_then(|p| p.control_planes.get(cp.name.as_str()))
            .map(|p| p.endpoints.as_slice());
        let endpoints = self.endpoints(&format!("{at}.endpoints"), &cp.endpoints, prev, true);
        if cp.endpoints.len() > 1 && cp.endpoints.iter().any(|e| e.starts_with("local:")) {
            self.c.err(
                format!("{at}.endpoints"),
                "a local: endpoint must be the only endpoint",
            );
        }
        let acl = cp
            .acl
            .as_ref()
            .map(|a| cidrs(&mut self.c, &format!("{at}.acl.allow"), &a.allow));
        let compiled = Arc::new(ControlPlane {
            name: cp.name.clone(),
            endpoints,
            acl,
        });
        for (j, d) in cp.destinations.iter().enumerate() {
            self.destination(&format!("{at}.destinations[{j}]"), cp, d, &compiled);
        }
        for (j, a) in cp.service_addresses.iter().enumerate() {
            self.service_address(&format!("{at}.service_addresses[{j}]"), a, &compiled);
        }
        if let Some(id) = &cp.cluster_id {
            self.cluster_id(&format!("{at}.cluster_id"), id, &compiled);
        }
        self.host_names(at, cp, &compiled);
        if !self.control_planes.contains_key(cp.name.as_str()) {
            self.claims.push(Claim::Name(cp.name.clone()));
            self.control_planes
                .insert(cp.name.as_str().into(), compiled);
        }
    }

    /// Its name, and that it is reachable by something.
    pub(super) fn check_identity(&mut self, at: &str, cp: &ControlPlaneCfg, dynamic: bool) {
        let c = &mut self.c;
        if !valid_name(&cp.name) {
            c.err(
                format!("{at}.name"),
                format!(
                    "{:?} must be 1-253 characters of a-z, A-Z, 0-9, '-', '_', '.'",
                    cp.name
                ),
            );
        } else if self.control_planes.contains_key(cp.name.as_str()) {
            c.err(
                format!("{at}.name"),
                format!("duplicate control plane name {:?}", cp.name),
            );
        }
        check_reachable(c, at, cp, dynamic);
    }

    /// Checked endpoints (duplicates refused when `unique`), each keeping
    /// the health state it had in `prev`.
    pub(super) fn endpoints(
        &mut self,
        path: &str,
        list: &[String],
        prev: Option<&[Endpoint]>,
        unique: bool,
    ) -> Vec<Endpoint> {
        let mut out: Vec<Endpoint> = Vec::new();
        for (j, ep) in list.iter().enumerate() {
            if let Err(why) = check_endpoint(ep) {
                self.c.err(format!("{path}[{j}]"), format!("{ep:?} {why}"));
                continue;
            }
            if unique && out.iter().any(|e| &e.address == ep) {
                self.c
                    .err(format!("{path}[{j}]"), format!("duplicate endpoint {ep:?}"));
                continue;
            }
            let state = prev
                .and_then(|p| p.iter().find(|e| &e.address == ep))
                .map(|e| e.state.clone())
                .unwrap_or_default();
            out.push(Endpoint {
                address: ep.clone(),
                state,
            });
        }
        out
    }

    /// A CONNECT destination: its canonical name (owned by one control
    /// plane), its own endpoints or the control plane's, and its tunnel
    /// target.
    pub(super) fn destination(
        &mut self,
        path: &str,
        cp: &ControlPlaneCfg,
        d: &DestinationCfg,
        compiled: &Arc<ControlPlane>,
    ) {
        let Some(canonical) = self.claim_destination(path, &d.name) else {
            return;
        };
        let endpoints = self.destination_endpoints(path, &canonical, d, compiled);
        let tunnel_target = check_tunnel_target(&mut self.c, path, d, &endpoints);
        if tunnel_target.is_some() && cp.acl.is_none() {
            self.c.err(
                format!("{path}.tunnel_target"),
                "reaches into a shoot: its control plane needs an `acl` naming who may use it (e.g. the kube-apiservers' pod network)",
            );
        }
        self.routes.destinations.insert(
            canonical.into(),
            Arc::new(DestinationRoute {
                control_plane: compiled.clone(),
                endpoints,
                tunnel_target,
            }),
        );
    }

    /// A destination name's canonical form, now owned by control plane
    /// `cp` (none if it is invalid or another one owns it).
    pub(super) fn claim_destination(&mut self, path: &str, name: &str) -> Option<String> {
        let canonical = match seedlink_proto::destination::parse(name) {
            Ok(dest) => dest.canonical(),
            Err(why) => {
                self.c
                    .err(format!("{path}.name"), format!("{name:?}: {why}"));
                return None;
            }
        };
        if let Some(other) = self.routes.destinations.get(canonical.as_str()) {
            let other = &other.control_plane.name;
            self.c.err(
                format!("{path}.name"),
                format!("destination {canonical:?} is already used by control plane {other:?}"),
            );
            return None;
        }
        // Inserted by the caller, whatever else it finds.
        self.claims.push(Claim::Destination(canonical.clone()));
        Some(canonical)
    }

    /// A destination's own endpoints (keeping the state of those it had),
    /// or its control plane's.
    pub(super) fn destination_endpoints(
        &mut self,
        path: &str,
        canonical: &str,
        d: &DestinationCfg,
        compiled: &ControlPlane,
    ) -> Vec<Endpoint> {
        let Some(list) = &d.endpoints else {
            return compiled
                .endpoints
                .iter()
                .map(|e| Endpoint {
                    address: e.address.clone(),
                    state: e.state.clone(),
                })
                .collect();
        };
        if list.is_empty() {
            self.c.err(
                format!("{path}.endpoints"),
                "at least one endpoint is required (or omit it to use the control plane's)",
            );
        }
        let prev = self
            .previous
            .and_then(|p| p.routes.destination(canonical))
            .map(|r| r.endpoints.as_slice());
        self.endpoints(&format!("{path}.endpoints"), list, prev, false)
    }

    /// A service address (the legacy PROXY path): one `ip:port`, one owner.
    pub(super) fn service_address(&mut self, path: &str, a: &str, compiled: &Arc<ControlPlane>) {
        let Ok(sa) = a.parse::<SocketAddr>() else {
            self.c.err(path, format!("{a:?} is not an ip:port address"));
            return;
        };
        let sa = SocketAddr::new(crate::routes::canonical(sa.ip()), sa.port());
        if sa.port() == 0 || sa.ip().is_unspecified() {
            self.c
                .err(path, format!("{a:?} needs a specific address and port"));
            return;
        }
        if let Some(other) = self.routes.services.get(&sa) {
            self.c.err(
                path,
                format!("{sa} is already used by control plane {:?}", other.name),
            );
            return;
        }
        self.routes.services.insert(sa, compiled.clone());
        self.claims.push(Claim::Service(sa));
    }

    /// A cluster ID (HyperShift's TLV path): valid, one owner.
    pub(super) fn cluster_id(&mut self, path: &str, id: &str, compiled: &Arc<ControlPlane>) {
        if let Err(why) = check_cluster_id(id) {
            self.c.err(path, why);
        } else if let Some(other) = self.routes.clusters.get(id.as_bytes()) {
            self.c.err(
                path,
                format!("{id:?} is already used by control plane {:?}", other.name),
            );
        } else {
            self.routes
                .clusters
                .insert(id.as_bytes().into(), compiled.clone());
            self.claims.push(Claim::Cluster(id.as_bytes().to_vec()));
        }
    }

    /// Host names served everywhere (`hostnames`) and at one address
    /// (`served_on`, which then serves nothing else); a name conflicts
    /// only with the same name in the same scope.
    pub(super) fn host_names(
        &mut self,
        at: &str,
        cp: &ControlPlaneCfg,
        compiled: &Arc<ControlPlane>,
    ) {
        // (address or None for every listener, path, name)
        let mut names: Vec<(Option<SocketAddr>, String, &String)> = cp
            .hostnames
            .iter()
            .enumerate()
            .map(|(j, h)| (None, format!("{at}.hostnames[{j}]"), h))
            .collect();
        for (j, on) in cp.served_on.iter().enumerate() {
            let path = format!("{at}.served_on[{j}]");
            let Some(sa) = served_at(
                &mut self.c,
                &format!("{path}.address"),
                &on.address,
                self.listeners,
            ) else {
                continue;
            };
            self.routes.exclusive.insert(sa.ip());
            names.extend(
                on.hostnames
                    .iter()
                    .enumerate()
                    .map(|(k, h)| (Some(sa), format!("{path}.hostnames[{k}]"), h)),
            );
        }
        for (scope, path, h) in names {
            self.host_name(scope, path, h, compiled);
        }
    }

    /// One host name (everywhere, or at the `scope` address): a valid
    /// pattern with one owner.
    pub(super) fn host_name(
        &mut self,
        scope: Option<SocketAddr>,
        path: String,
        h: &str,
        compiled: &Arc<ControlPlane>,
    ) {
        let Some(pattern) = check_host_pattern(&mut self.c, &path, h) else {
            return;
        };
        let table = match scope {
            None => &mut self.routes.hosts,
            Some(a) => self.routes.scoped.entry(a).or_default(),
        };
        if let Some(other) = table.owner(&pattern) {
            let e = format!(
                "host name {pattern:?} is already used by control plane {:?}",
                other.name
            );
            self.c.err(path, e);
            return;
        }
        table.insert(pattern.clone(), compiled.clone());
        self.claims.push(Claim::Host(scope, pattern));
    }
}

/// A class Gateway's addresses (canonical).
pub(super) fn class_addresses(
    k: &crate::model::KubernetesSource,
) -> impl Iterator<Item = std::net::IpAddr> + '_ {
    k.gateway_class
        .iter()
        .flat_map(|g| &g.addresses)
        .filter_map(|a| a.parse::<std::net::IpAddr>().ok())
        .map(crate::routes::canonical)
}

/// A destination's `tunnel_target`: `host:port`, and only where its
/// connections go to an in-process service (`local:`).
pub(super) fn check_tunnel_target(
    c: &mut Collector,
    path: &str,
    d: &DestinationCfg,
    endpoints: &[Endpoint],
) -> Option<String> {
    let target = d.tunnel_target.as_ref()?;
    if !seedlink_proto::connect_head::authority_form(target) {
        c.err(
            format!("{path}.tunnel_target"),
            format!("{target:?} is not host:port"),
        );
        return None;
    }
    if !matches!(endpoints, [only] if only.address.starts_with("local:")) {
        c.err(
            format!("{path}.tunnel_target"),
            "needs the destination's endpoint to be a `local:` service (`seedlink seed`)",
        );
        return None;
    }
    Some(target.clone())
}

/// A `served_on` address (canonical), one an SNI listener receives
/// connections at.
pub(super) fn served_at(
    c: &mut Collector,
    path: &str,
    a: &str,
    listeners: &[ListenerSpec],
) -> Option<SocketAddr> {
    let Ok(sa) = a.parse::<SocketAddr>() else {
        c.err(path, format!("{a:?} is not ip:port"));
        return None;
    };
    let sa = SocketAddr::new(crate::routes::canonical(sa.ip()), sa.port());
    if sa.port() == 0 || sa.ip().is_unspecified() {
        c.err(path, format!("{a:?} is not a specific ip:port"));
        return None;
    }
    let received = listeners.iter().any(|l| {
        matches!(l.protocol, Protocol::Tls | Protocol::Auto)
            && l.address.port() == sa.port()
            && (l.address.ip().is_unspecified()
                || crate::routes::canonical(l.address.ip()) == sa.ip())
    });
    if !received {
        c.err(
            path,
            format!("{a:?}: no tls or auto listener receives connections there"),
        );
        return None;
    }
    Some(sa)
}

/// Validates a host name pattern and returns its normalised form.
pub(super) fn check_host_pattern(c: &mut Collector, path: &str, h: &str) -> Option<String> {
    let Some(n) = normalize_host(h) else {
        c.err(path, format!("{h:?} is not a host name"));
        return None;
    };
    if let Some(parent) = n.strip_prefix("*.") {
        // Gateway API allows `*.com` (its conformance suite routes one);
        // what a tenant may claim is bounded by the listener's hostname.
        if !valid_hostname(parent) {
            c.err(
                path,
                format!(
                    "{h:?}: a wildcard is \"*.\" followed by a host name, e.g. \"*.example.com\""
                ),
            );
            return None;
        }
    } else if n.contains('*') {
        c.err(
            path,
            format!("{h:?}: '*' is only allowed as the whole leftmost label (\"*.example.com\")"),
        );
        return None;
    } else if !valid_hostname(&n) {
        c.err(path, format!("{h:?} is not a valid host name"));
        return None;
    }
    Some(n)
}

pub(super) fn check_endpoint(ep: &str) -> Result<(), &'static str> {
    // `local:<name>`: a service in the same process (the tunnel-server
    // under `seedlink seed`) takes the connection over, no extra hop.
    if let Some(name) = ep.strip_prefix("local:") {
        return if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            Ok(())
        } else {
            Err("is not local:<name> (letters, digits, '-')")
        };
    }
    if let Ok(a) = ep.parse::<SocketAddr>() {
        return if a.port() == 0 {
            Err("has port 0")
        } else {
            Ok(())
        };
    }
    let (host, port) = ep.rsplit_once(':').ok_or("is not host:port")?;
    match port.parse::<u16>() {
        Ok(0) | Err(_) => return Err("has no valid port"),
        Ok(_) => {}
    }
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || !valid_hostname(host) {
        return Err("has an invalid host (use an IP, [IPv6] or a DNS name)");
    }
    Ok(())
}

/// A control plane is named by something (a host name, destination,
/// service address or cluster ID) and, unless Kubernetes fills them in,
/// has endpoints.
fn check_reachable(c: &mut Collector, at: &str, cp: &ControlPlaneCfg, dynamic: bool) {
    if cp.hostnames.is_empty()
        && cp.served_on.iter().all(|o| o.hostnames.is_empty())
        && cp.destinations.is_empty()
        && cp.service_addresses.is_empty()
        && cp.cluster_id.is_none()
    {
        c.err(
            format!("{at}.hostnames"),
            "at least one host name, destination, service address or cluster ID is required",
        );
    }
    if cp.endpoints.is_empty() && !dynamic {
        c.err(
            format!("{at}.endpoints"),
            "at least one endpoint is required",
        );
    }
}
