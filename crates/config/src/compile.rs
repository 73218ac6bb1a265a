//! Validation and compilation of a [`ConfigFile`] into a [`Snapshot`].

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use ipnet::IpNet;

use crate::model::{
    ConfigFile, ControlPlane as ControlPlaneCfg, DestinationCfg, InvalidRequest, Limits, Listener,
    Protocol, ProxyMode, Timeouts, Upstream,
};
use crate::routes::{
    normalize_host, CidrSet, ControlPlane, DestinationRoute, Endpoint, RouteTable,
};

/// One problem in a configuration, located by its path in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where, e.g. `control_planes[2].hostnames[0]`; empty for the whole file.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// Every problem found in a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Errors(pub Vec<ConfigError>);

impl fmt::Display for Errors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            if e.path.is_empty() {
                write!(f, "{}", e.message)?;
            } else {
                write!(f, "{}: {}", e.path, e.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Errors {}

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

/// Compiles a destination guard with Envoy `safe_regex` semantics: RE2
/// syntax, matched against the whole value. The size limit keeps a hostile
/// configuration from building a huge automaton.
pub fn destination_regex(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(1 << 20)
        .build()
        .map_err(|e| format!("invalid regular expression: {e}"))
}

/// One immutable, fully validated configuration. Connections keep the
/// snapshot they started with; a reload swaps in a new one.
#[derive(Debug)]
pub struct Snapshot {
    /// The effective configuration, for the admin dump.
    pub file: ConfigFile,
    /// Listeners.
    pub listeners: Vec<ListenerSpec>,
    /// Admin endpoint address.
    pub admin: SocketAddr,
    /// SNI routes.
    pub routes: RouteTable,
    /// Control planes by name.
    pub control_planes: HashMap<String, Arc<ControlPlane>>,
    /// Peers whose PROXY headers are believed.
    pub trusted_lbs: CidrSet,
    /// Clients allowed to every control plane.
    pub always_allowed: CidrSet,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Limits.
    pub limits: Limits,
    /// Upstream behaviour.
    pub upstream: Upstream,
}

/// Parses YAML text. Syntax, type and unknown-key errors stop the parser, so
/// only the first is reported, with its line and column.
pub fn parse(text: &str) -> Result<ConfigFile, Errors> {
    serde_norway::from_str(text).map_err(|e| {
        Errors(vec![ConfigError {
            path: String::new(),
            message: e.to_string(),
        }])
    })
}

/// Reads, parses and compiles the file at `path`, reusing live endpoint
/// state from `previous`.
pub fn load(path: &Path, previous: Option<&Snapshot>) -> Result<Snapshot, Errors> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Errors(vec![ConfigError {
            path: String::new(),
            message: format!("cannot read {}: {e}", path.display()),
        }])
    })?;
    compile(parse(&text)?, previous)
}

struct Collector(Vec<ConfigError>);

impl Collector {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }
}

/// Validates `file` completely and compiles it. On failure every problem is
/// listed, in file order.
pub fn compile(file: ConfigFile, previous: Option<&Snapshot>) -> Result<Snapshot, Errors> {
    let mut c = Collector(Vec::new());
    let admin = check_admin(&mut c, &file.admin.listen);
    let listeners = check_listeners(&mut c, &file.listeners);
    let trusted_lbs = cidrs(
        &mut c,
        "trusted_load_balancers",
        &file.trusted_load_balancers,
    );
    let always_allowed = cidrs(&mut c, "always_allowed", &file.always_allowed);
    check_proxy_trust(&mut c, &listeners, &trusted_lbs);
    check_settings(&mut c, &file);
    let mut b = Routes::new(c, previous, &listeners);
    if let Some(k) = &file.kubernetes {
        check_kubernetes(&mut b.c, k, &listeners);
        b.exclusive_addresses(k);
    }
    b.control_planes(&file);
    let Routes {
        c,
        routes,
        control_planes,
        ..
    } = b;
    if !c.0.is_empty() {
        return Err(Errors(c.0));
    }
    Ok(Snapshot {
        listeners,
        admin,
        routes,
        control_planes,
        trusted_lbs,
        always_allowed,
        timeouts: file.timeouts.clone(),
        limits: file.limits.clone(),
        upstream: file.upstream.clone(),
        file,
    })
}

/// The admin endpoint's address (a placeholder after an error, so the
/// rest is still checked).
fn check_admin(c: &mut Collector, listen: &str) -> SocketAddr {
    listen.parse::<SocketAddr>().unwrap_or_else(|_| {
        c.err(
            "admin.listen",
            format!("{listen:?} is not an ip:port address"),
        );
        SocketAddr::from(([127, 0, 0, 1], 0))
    })
}

/// A listener that takes PROXY headers needs someone trusted to send them.
fn check_proxy_trust(c: &mut Collector, listeners: &[ListenerSpec], trusted_lbs: &CidrSet) {
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

/// The route table as control planes are added to it, with who owns each
/// name, and the problems found.
struct Routes<'a> {
    c: Collector,
    previous: Option<&'a Snapshot>,
    listeners: &'a [ListenerSpec],
    control_planes: HashMap<String, Arc<ControlPlane>>,
    routes: RouteTable,
    /// (host pattern, the address it is served at or None for everywhere)
    /// → control plane.
    owner: HashMap<(String, Option<SocketAddr>), String>,
    dest_owner: HashMap<String, String>,
}

impl<'a> Routes<'a> {
    fn new(c: Collector, previous: Option<&'a Snapshot>, listeners: &'a [ListenerSpec]) -> Self {
        Routes {
            c,
            previous,
            listeners,
            control_planes: HashMap::new(),
            routes: RouteTable::default(),
            owner: HashMap::new(),
            dest_owner: HashMap::new(),
        }
    }

    /// A class Gateway's address serves that Gateway's routes only, from
    /// its first moment (before any route is attached to it).
    fn exclusive_addresses(&mut self, k: &crate::model::KubernetesSource) {
        for a in k.gateway_class.iter().flat_map(|g| &g.addresses) {
            if let Ok(ip) = a.parse::<std::net::IpAddr>() {
                self.routes.exclusive.insert(crate::routes::canonical(ip));
            }
        }
    }

    /// The file's control planes, then those from Kubernetes.
    fn control_planes(&mut self, file: &ConfigFile) {
        let all = file
            .control_planes
            .iter()
            .enumerate()
            .map(|(i, cp)| (format!("control_planes[{i}]"), cp, false))
            .chain(
                file.from_kubernetes
                    .iter()
                    .enumerate()
                    .map(|(i, cp)| (format!("kubernetes[{i}]"), cp, true)),
            );
        for (at, cp, dynamic) in all {
            self.control_plane(&at, cp, dynamic);
        }
    }

    /// One control plane (`at` names it in problems; `dynamic`: from
    /// Kubernetes, whose endpoints may come later).
    fn control_plane(&mut self, at: &str, cp: &ControlPlaneCfg, dynamic: bool) {
        self.check_identity(at, cp, dynamic);
        let prev = self
            .previous
            .and_then(|p| p.control_planes.get(&cp.name))
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
        self.control_planes
            .entry(cp.name.clone())
            .or_insert(compiled);
    }

    /// Its name, and that it is reachable by something.
    fn check_identity(&mut self, at: &str, cp: &ControlPlaneCfg, dynamic: bool) {
        let c = &mut self.c;
        if !valid_name(&cp.name) {
            c.err(
                format!("{at}.name"),
                format!(
                    "{:?} must be 1-253 characters of a-z, A-Z, 0-9, '-', '_', '.'",
                    cp.name
                ),
            );
        } else if self.control_planes.contains_key(&cp.name) {
            c.err(
                format!("{at}.name"),
                format!("duplicate control plane name {:?}", cp.name),
            );
        }
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

    /// Checked endpoints (duplicates refused when `unique`), each keeping
    /// the health state it had in `prev`.
    fn endpoints(
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
    fn destination(
        &mut self,
        path: &str,
        cp: &ControlPlaneCfg,
        d: &DestinationCfg,
        compiled: &Arc<ControlPlane>,
    ) {
        let Some(canonical) = self.claim_destination(path, &d.name, &cp.name) else {
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
            canonical,
            DestinationRoute {
                control_plane: compiled.clone(),
                endpoints,
                tunnel_target,
            },
        );
    }

    /// A destination name's canonical form, now owned by control plane
    /// `cp` (none if it is invalid or another one owns it).
    fn claim_destination(&mut self, path: &str, name: &str, cp: &str) -> Option<String> {
        let canonical = match seedlink_proto::destination::parse(name) {
            Ok(dest) => dest.canonical(),
            Err(why) => {
                self.c
                    .err(format!("{path}.name"), format!("{name:?}: {why}"));
                return None;
            }
        };
        if let Some(other) = self.dest_owner.get(&canonical) {
            self.c.err(
                format!("{path}.name"),
                format!("destination {canonical:?} is already used by control plane {other:?}"),
            );
            return None;
        }
        self.dest_owner.insert(canonical.clone(), cp.to_string());
        Some(canonical)
    }

    /// A destination's own endpoints (keeping the state of those it had),
    /// or its control plane's.
    fn destination_endpoints(
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
    fn service_address(&mut self, path: &str, a: &str, compiled: &Arc<ControlPlane>) {
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
    }

    /// A cluster ID (HyperShift's TLV path): valid, one owner.
    fn cluster_id(&mut self, path: &str, id: &str, compiled: &Arc<ControlPlane>) {
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
                .insert(id.as_bytes().to_vec(), compiled.clone());
        }
    }

    /// Host names served everywhere (`hostnames`) and at one address
    /// (`served_on`, which then serves nothing else); a name conflicts
    /// only with the same name in the same scope.
    fn host_names(&mut self, at: &str, cp: &ControlPlaneCfg, compiled: &Arc<ControlPlane>) {
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
            self.host_name(scope, path, h, cp, compiled);
        }
    }

    /// One host name (everywhere, or at the `scope` address): a valid
    /// pattern with one owner.
    fn host_name(
        &mut self,
        scope: Option<SocketAddr>,
        path: String,
        h: &str,
        cp: &ControlPlaneCfg,
        compiled: &Arc<ControlPlane>,
    ) {
        let Some(pattern) = check_host_pattern(&mut self.c, &path, h) else {
            return;
        };
        let key = (pattern, scope);
        if let Some(other) = self.owner.get(&key) {
            let e = format!(
                "host name {:?} is already used by control plane {other:?}",
                key.0
            );
            self.c.err(path, e);
            return;
        }
        self.owner.insert(key.clone(), cp.name.clone());
        match scope {
            None => self.routes.hosts.insert(key.0, compiled.clone()),
            Some(a) => self
                .routes
                .scoped
                .entry(a)
                .or_default()
                .insert(key.0, compiled.clone()),
        };
    }
}

/// A destination's `tunnel_target`: `host:port`, and only where its
/// connections go to an in-process service (`local:`).
fn check_tunnel_target(
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

fn check_listeners(c: &mut Collector, ls: &[Listener]) -> Vec<ListenerSpec> {
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
fn check_listener_names(c: &mut Collector, at: &str, l: &Listener, names: &mut HashSet<String>) {
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
fn listener_spec(c: &mut Collector, at: &str, l: &Listener, address: SocketAddr) -> ListenerSpec {
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

fn check_settings(c: &mut Collector, f: &ConfigFile) {
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

fn check_limits(c: &mut Collector, l: &crate::model::Limits) {
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

fn cidrs(c: &mut Collector, path: &str, items: &[String]) -> CidrSet {
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

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn valid_hostname(h: &str) -> bool {
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

/// The `kubernetes` section: object names, and a class's addresses (each
/// one a TLS listener receives at, none twice, at most 256).
fn check_kubernetes(
    c: &mut Collector,
    k: &crate::model::KubernetesSource,
    listeners: &[ListenerSpec],
) {
    for (key, v) in [
        ("kubernetes.gateway", k.gateway.as_ref()),
        ("kubernetes.lease", k.lease.as_ref()),
        ("kubernetes.service", k.service.as_ref()),
    ] {
        if let Some(v) = v {
            if split_object_name(v).is_none() {
                c.err(key, format!("{v:?} is not namespace/name"));
            }
        }
    }
    if k.gateway.is_none() && k.gateway_class.is_none() {
        c.err(
            "kubernetes",
            "names no Gateway: set gateway (one Gateway, on every listener), gateway_class (every Gateway of a class, each at its own address), or both",
        );
    }
    if k.gateway.is_none() && k.lease.is_none() && k.write_status {
        c.err(
            "kubernetes.lease",
            "is required without kubernetes.gateway (its default is in the Gateway's namespace)",
        );
    }
    if let Some(class) = &k.gateway_class {
        check_gateway_class(c, class, listeners);
    }
}

/// A class's name, and its addresses: specific, distinct, each where a TLS
/// listener receives connections.
fn check_gateway_class(
    c: &mut Collector,
    class: &crate::model::GatewayClassSource,
    listeners: &[ListenerSpec],
) {
    if class.name.is_empty() || !valid_hostname(&class.name) || class.name.len() > 253 {
        c.err(
            "kubernetes.gateway_class.name",
            format!("{:?} is not a GatewayClass name", class.name),
        );
    }
    if class.addresses.is_empty() || class.addresses.len() > 256 {
        c.err(
            "kubernetes.gateway_class.addresses",
            "needs 1 to 256 addresses (one per Gateway of the class)",
        );
    }
    let mut seen = HashSet::new();
    for (i, a) in class.addresses.iter().enumerate() {
        let path = format!("kubernetes.gateway_class.addresses[{i}]");
        let Ok(ip) = a.parse::<std::net::IpAddr>() else {
            c.err(path, format!("{a:?} is not an IP address"));
            continue;
        };
        let ip = crate::routes::canonical(ip);
        if ip.is_unspecified() || ip.is_multicast() {
            c.err(path, format!("{a:?} is not a specific address"));
        } else if !seen.insert(ip) {
            c.err(path, format!("{a:?} is listed twice"));
        } else if !tls_received_at(listeners, ip) {
            c.err(
                path,
                format!("{a:?}: no tls or auto listener receives connections there"),
            );
        }
    }
}

/// Whether a `tls` or `auto` listener receives connections at `ip`.
fn tls_received_at(listeners: &[ListenerSpec], ip: std::net::IpAddr) -> bool {
    listeners.iter().any(|l| {
        matches!(l.protocol, Protocol::Tls | Protocol::Auto)
            && (l.address.ip().is_unspecified() || crate::routes::canonical(l.address.ip()) == ip)
    })
}

/// A `served_on` address (canonical), one an SNI listener receives
/// connections at.
fn served_at(
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
fn check_host_pattern(c: &mut Collector, path: &str, h: &str) -> Option<String> {
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

fn check_endpoint(ep: &str) -> Result<(), &'static str> {
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

/// Control planes left out of a compile, each with its problems.
pub type Refused = Vec<(String, Vec<ConfigError>)>;

/// Compiles a file whose `from_kubernetes` control planes are each admitted
/// on their own: one that is invalid, or claims a host name, destination,
/// service address or name already taken (by the file, or by one earlier in
/// the list), is left out and returned with its problems, and the rest
/// still compile. Problems of the file itself fail the whole compile, as
/// in [`compile`].
pub fn compile_admitting(
    mut file: ConfigFile,
    previous: Option<&Snapshot>,
) -> (Result<Snapshot, Errors>, Refused) {
    let errors = match compile(file.clone(), previous) {
        Ok(s) => return (Ok(s), Vec::new()),
        Err(e) => e,
    };
    let (mut bad, own) = by_kubernetes_index(errors, file.from_kubernetes.len());
    if !own.is_empty() {
        // The file's own problems: nothing to admit around.
        return (Err(Errors(own)), Vec::new());
    }
    let mut rejected = Vec::new();
    let mut kept = Vec::new();
    for (i, cp) in std::mem::take(&mut file.from_kubernetes)
        .into_iter()
        .enumerate()
    {
        match bad.remove(&i) {
            Some(mut problems) => {
                for p in &mut problems {
                    if let Some((_, rest)) = p.path.split_once(']') {
                        p.path = rest.trim_start_matches('.').to_string();
                    }
                }
                rejected.push((cp.name, problems));
            }
            None => kept.push(cp),
        }
    }
    file.from_kubernetes = kept;
    (compile(file, previous), rejected)
}

/// Problems of the control planes from Kubernetes, by index (`kubernetes[i]`
/// with `i` below `count`), and the file's own.
fn by_kubernetes_index(
    errors: Errors,
    count: usize,
) -> (HashMap<usize, Vec<ConfigError>>, Vec<ConfigError>) {
    let mut bad: HashMap<usize, Vec<ConfigError>> = HashMap::new();
    let mut own = Vec::new();
    for e in errors.0 {
        let index = e
            .path
            .strip_prefix("kubernetes[")
            .and_then(|r| r.split_once(']'))
            .and_then(|(i, _)| i.parse::<usize>().ok());
        match index {
            Some(i) if i < count => bad.entry(i).or_default().push(e),
            _ => own.push(e),
        }
    }
    (bad, own)
}

/// Control-plane names added, removed and changed between two snapshots.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Present only in the new snapshot.
    pub added: Vec<String>,
    /// Present only in the old snapshot.
    pub removed: Vec<String>,
    /// Present in both with a different definition.
    pub changed: Vec<String>,
}

/// Computes what a reload changes, by control-plane name (sorted).
pub fn diff(old: &ConfigFile, new: &ConfigFile) -> Diff {
    let all = |f: &'_ ConfigFile| {
        f.control_planes
            .iter()
            .chain(&f.from_kubernetes)
            .map(|c| (c.name.clone(), c.clone()))
            .collect::<HashMap<_, _>>()
    };
    let (o, n) = (all(old), all(new));
    let mut d = Diff::default();
    for (name, cp) in &n {
        match o.get(name) {
            None => d.added.push(name.clone()),
            Some(prev) if prev != cp => d.changed.push(name.clone()),
            Some(_) => {}
        }
    }
    d.removed = o.keys().filter(|k| !n.contains_key(*k)).cloned().collect();
    d.added.sort();
    d.removed.sort();
    d.changed.sort();
    d
}

/// Settings a reload cannot change (they need a restart), as a list of the
/// differing keys.
pub fn restart_only_changes(old: &ConfigFile, new: &ConfigFile) -> Vec<&'static str> {
    let keepalive = |f: &ConfigFile| {
        let t = &f.timeouts;
        (t.keepalive_time, t.keepalive_interval, t.keepalive_retries)
    };
    let (o, n) = (&old.limits, &new.limits);
    [
        ("listeners", old.listeners != new.listeners),
        ("admin", old.admin != new.admin),
        ("kubernetes", old.kubernetes != new.kubernetes),
        (
            "limits.max_connections",
            o.max_connections != n.max_connections,
        ),
        ("limits.splice_pipes", o.splice_pipes != n.splice_pipes),
        ("limits.copy", o.copy != n.copy),
        ("limits.workers", o.workers != n.workers),
        ("timeouts.keepalive_*", keepalive(old) != keepalive(new)),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

#[cfg(test)]
mod tests;
