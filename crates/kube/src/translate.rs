//! From Kubernetes objects to the gateway's model, as a pure function:
//! TLSRoutes attached to the seedlink Gateway become control planes (their
//! hostnames the SNI routes, the ready addresses of their backend Services'
//! EndpointSlices the upstreams), and SeedlinkPolicies attached to a route
//! add its ACL, CONNECT destinations and legacy service addresses. What
//! cannot be used is reported per object, for status and Events; the
//! gateway's own validation then admits each control plane on its own
//! (`seedlink_config::compile::compile_admitting`).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use std::collections::BTreeMap;

use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::{TlsRoute, TlsRouteParentRefs};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use seedlink_config::model::{Acl, ControlPlane, DestinationCfg};

use crate::crd::{SeedlinkPolicy, SeedlinkPolicySpec};

/// The Gateway API group.
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

/// `namespace/name` of an object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl Key {
    /// The key of a namespaced object.
    pub fn of<K: kube::Resource>(o: &K) -> Key {
        Key {
            namespace: o.namespace().unwrap_or_default(),
            name: o.name_any(),
        }
    }
}

/// The control plane a route becomes: `<namespace>.<name>`. Namespaces hold
/// no dot, so the name is unambiguous, and it is valid wherever a
/// file-defined control-plane name is (metric labels, logs).
pub fn control_plane_name(route: &Key) -> String {
    format!("{}.{}", route.namespace, route.name)
}

/// A condition's verdict: `True`, or `False` with a reason and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// `True` or `False`.
    pub ok: bool,
    /// A Gateway API reason (`Accepted`, `ResolvedRefs`, `BackendNotFound`…).
    pub reason: String,
    /// For people.
    pub message: String,
}

impl Verdict {
    /// `True` with `reason`.
    pub fn yes(reason: &str, message: impl Into<String>) -> Verdict {
        Verdict {
            ok: true,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// `False` with `reason`.
    pub fn no(reason: &str, message: impl Into<String>) -> Verdict {
        Verdict {
            ok: false,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// What became of one TLSRoute attached to the seedlink Gateway.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteOutcome {
    /// The route.
    pub key: Key,
    /// Its `metadata.generation`.
    pub generation: Option<i64>,
    /// The parentRefs that name the seedlink Gateway (status is written per parent).
    pub parents: Vec<TlsRouteParentRefs>,
    /// `Accepted`.
    pub accepted: Verdict,
    /// `ResolvedRefs`.
    pub resolved: Verdict,
    /// The control plane it became, if any.
    pub control_plane: Option<String>,
    /// The Gateway object's listeners it attached to (for their
    /// `attachedRoutes`).
    pub listeners: Vec<String>,
}

/// The status of one listener of the Gateway object.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerOutcome {
    /// Its name.
    pub name: String,
    /// `Accepted` (false for what seedlink does not serve: a protocol other
    /// than TLS, TLS other than Passthrough).
    pub accepted: Verdict,
    /// Route kinds it takes (empty when not accepted).
    pub kinds: Vec<String>,
}

/// What became of one SeedlinkPolicy, per target route.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyOutcome {
    /// The policy.
    pub key: Key,
    /// Its `metadata.generation`.
    pub generation: Option<i64>,
    /// Per TLSRoute target (by name, in the policy's namespace): `Accepted`.
    pub targets: Vec<(String, Verdict)>,
}

/// Everything the gateway gets from the objects, and what to report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Translation {
    /// Control planes in the order the gateway admits them (the first
    /// wins a conflict): oldest route first, except that a route claiming
    /// a name another route held in the last pass, and still claims, goes
    /// after every other (the first claim keeps a name while it holds it).
    pub control_planes: Vec<ControlPlane>,
    /// Per attached route.
    pub routes: Vec<RouteOutcome>,
    /// Per policy.
    pub policies: Vec<PolicyOutcome>,
    /// The Gateway object's listeners (none without a Gateway object).
    pub listeners: Vec<ListenerOutcome>,
}

impl Translation {
    /// Routes accepted on listener `name` (its `attachedRoutes`).
    pub fn attached(&self, name: &str) -> i32 {
        let n = self
            .routes
            .iter()
            .filter(|r| r.accepted.ok && r.listeners.iter().any(|l| l == name))
            .count();
        i32::try_from(n).unwrap_or(i32::MAX)
    }

    /// Marks the routes whose control planes the gateway refused (with the
    /// gateway's words) as not accepted.
    pub fn refused(&mut self, refused: &[(String, Vec<seedlink_config::ConfigError>)]) {
        let by_name: HashMap<&str, String> = refused
            .iter()
            .map(|(n, problems)| {
                let text: Vec<String> = problems
                    .iter()
                    .map(|p| {
                        if p.path.is_empty() {
                            p.message.clone()
                        } else {
                            format!("{}: {}", p.path, p.message)
                        }
                    })
                    .collect();
                (n.as_str(), text.join("; "))
            })
            .collect();
        for r in &mut self.routes {
            if let Some(why) = r.control_plane.as_deref().and_then(|n| by_name.get(n)) {
                r.accepted = Verdict::no("UnsupportedValue", why.clone());
                r.control_plane = None;
            }
        }
        self.control_planes
            .retain(|c| !by_name.contains_key(c.name.as_str()));
    }
}

/// What the translation reads.
pub struct Objects<'a> {
    /// The seedlink Gateway, `namespace/name`.
    pub gateway: &'a Key,
    /// Names of the gateway file's listeners: the listeners routes attach
    /// to when there is no Gateway object (each admitting routes from the
    /// Gateway's own namespace only, Gateway API's default).
    pub listeners: &'a [String],
    /// The Gateway object `gateway`, if it exists: its listeners (names,
    /// protocols, `allowedRoutes`) decide which routes attach.
    pub gateway_object: Option<&'a Gateway>,
    /// Every Namespace (for `allowedRoutes.namespaces.selector`).
    pub namespaces: &'a [Arc<Namespace>],
    /// Every ReferenceGrant (for backends in another namespace).
    pub grants: &'a [Arc<ReferenceGrant>],
    /// Every TLSRoute.
    pub routes: &'a [Arc<TlsRoute>],
    /// Every SeedlinkPolicy.
    pub policies: &'a [Arc<SeedlinkPolicy>],
    /// Every Service.
    pub services: &'a [Arc<Service>],
    /// Every EndpointSlice.
    pub slices: &'a [Arc<EndpointSlice>],
}

/// Remembers the last accepted spec of each policy, so that an invalid
/// edit keeps the route under its previous ACL instead of opening it (or
/// dropping it).
#[derive(Debug)]
pub struct Translator {
    last_good: HashMap<Key, SeedlinkPolicySpec>,
    /// Who held each name in the last pass (claim → control plane).
    held: HashMap<String, String>,
    /// The `endpointslice.kubernetes.io/managed-by` values whose slices
    /// name upstreams (`kubernetes.endpointslice_managers`).
    pub slice_managers: Vec<String>,
}

impl Default for Translator {
    fn default() -> Self {
        Translator {
            last_good: HashMap::new(),
            held: HashMap::new(),
            slice_managers: vec![seedlink_config::model::ENDPOINTSLICE_CONTROLLER.to_string()],
        }
    }
}

/// The label naming who wrote an EndpointSlice.
pub const MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";

fn age<K: kube::Resource>(o: &K) -> (Option<k8s_openapi::jiff::Timestamp>, Key) {
    (
        o.meta().creation_timestamp.as_ref().map(|t| t.0),
        Key::of(o),
    )
}

impl Translator {
    /// Translates `objects`.
    pub fn translate(&mut self, objects: &Objects<'_>) -> Translation {
        let mut out = Translation::default();
        let mut routes: Vec<&Arc<TlsRoute>> = objects.routes.iter().collect();
        routes.sort_by_key(|r| age(r.as_ref()));
        let services: HashMap<Key, &Service> = objects
            .services
            .iter()
            .map(|s| (Key::of(s.as_ref()), s.as_ref()))
            .collect();
        let mut slices: HashMap<Key, Vec<&EndpointSlice>> = HashMap::new();
        for s in objects.slices {
            let manager = s.labels().get(MANAGED_BY);
            if !manager.is_some_and(|m| self.slice_managers.contains(m)) {
                // Not written by a manager the operator trusts: a tenant may
                // write a slice naming any address (the CVE-2021-25740
                // class); the route then has no endpoints from it.
                tracing::debug!(slice = %Key::of(s.as_ref()), manager = ?manager, "EndpointSlice ignored: not written by a trusted manager (kubernetes.endpointslice_managers)");
                continue;
            }
            if let Some(svc) = s.labels().get("kubernetes.io/service-name") {
                slices
                    .entry(Key {
                        namespace: s.namespace().unwrap_or_default(),
                        name: svc.clone(),
                    })
                    .or_default()
                    .push(s.as_ref());
            }
        }
        let policies = self.policies(objects, &routes, &mut out);
        let listeners = attach::listeners(objects.gateway_object, objects.listeners);
        let namespaces: HashMap<String, &BTreeMap<String, String>> = objects
            .namespaces
            .iter()
            .map(|n| (n.name_any(), n.labels()))
            .collect();
        let grants: Vec<&ReferenceGrant> = objects.grants.iter().map(|g| g.as_ref()).collect();
        for route in routes {
            let key = Key::of(route.as_ref());
            let parents: Vec<TlsRouteParentRefs> = route
                .spec
                .parent_refs
                .iter()
                .flatten()
                .filter(|p| names_gateway(p, &key.namespace, objects.gateway))
                .cloned()
                .collect();
            if parents.is_empty() {
                continue;
            }
            let mut outcome = RouteOutcome {
                key: key.clone(),
                generation: route.metadata.generation,
                parents: parents.clone(),
                accepted: Verdict::yes("Accepted", "served by seedlink"),
                resolved: Verdict::yes("ResolvedRefs", "every backend resolved"),
                control_plane: None,
                listeners: Vec::new(),
            };
            if let Err(refused) = attach::check(
                &parents,
                &key.namespace,
                &objects.gateway.namespace,
                &listeners,
                &namespaces,
            ) {
                outcome.accepted = refused;
                out.routes.push(outcome);
                continue;
            }
            outcome.listeners = attach::attached(
                &parents,
                &key.namespace,
                &objects.gateway.namespace,
                &listeners,
                &namespaces,
            );
            let (endpoints, resolved, weighted) = backends(
                route,
                &key,
                &Lookup {
                    services: &services,
                    slices: &slices,
                    grants: &grants,
                },
            );
            outcome.resolved = resolved;
            if weighted {
                outcome.accepted = Verdict::yes(
                    "Accepted",
                    "served by seedlink; backend weights other than 0 are ignored (least-connections over every ready endpoint)",
                );
            }
            let mut cp = ControlPlane {
                name: control_plane_name(&key),
                hostnames: route.spec.hostnames.clone(),
                endpoints,
                acl: None,
                destinations: Vec::new(),
                service_addresses: Vec::new(),
                cluster_id: None,
            };
            match policies.get(&key.name_in(&key.namespace)) {
                Some(Ok(spec)) => {
                    cp.acl = spec
                        .allowed_source_cidrs
                        .as_ref()
                        .map(|a| Acl { allow: a.clone() });
                    cp.destinations = spec
                        .destinations
                        .iter()
                        .map(|d| DestinationCfg {
                            name: d.clone(),
                            endpoints: None,
                            tunnel_target: None,
                        })
                        .collect();
                    cp.service_addresses = spec.service_addresses.clone();
                    cp.cluster_id = spec.cluster_id.clone();
                }
                Some(Err(why)) => {
                    // Fail closed: without its valid policy the route would
                    // lose its ACL.
                    outcome.accepted = Verdict::no("UnsupportedValue", why.clone());
                    out.routes.push(outcome);
                    continue;
                }
                None => {}
            }
            outcome.control_plane = Some(cp.name.clone());
            out.control_planes.push(cp);
            out.routes.push(outcome);
        }
        self.keep_first_claims(&mut out.control_planes);
        out.listeners = attach::outcomes(objects.gateway_object);
        out
    }

    /// Orders `cps` so that a name (host name, destination, service
    /// address, cluster ID) stays with the route that held it in the last
    /// pass for as long as that route still claims it: a route that claims
    /// such a name goes last, whatever its age, and the gateway refuses it
    /// on the conflict. Without this, a tenant with an old route could add
    /// another tenant's name at any time and take its traffic.
    fn keep_first_claims(&mut self, cps: &mut [ControlPlane]) {
        let mut claimed: HashMap<String, HashSet<&str>> = HashMap::new();
        for cp in cps.iter() {
            for c in claims(cp) {
                claimed.entry(c).or_default().insert(cp.name.as_str());
            }
        }
        let steals = |cp: &ControlPlane| {
            claims(cp).iter().any(|c| {
                self.held.get(c).is_some_and(|owner| {
                    *owner != cp.name
                        && claimed
                            .get(c)
                            .is_some_and(|who| who.contains(owner.as_str()))
                })
            })
        };
        let order: Vec<bool> = cps.iter().map(steals).collect();
        drop(claimed);
        let mut indexed: Vec<(bool, ControlPlane)> =
            order.into_iter().zip(cps.iter().cloned()).collect();
        // Stable: ages stay in order within each group.
        indexed.sort_by_key(|(stealer, _)| *stealer);
        let mut held = HashMap::new();
        for (slot, (_, cp)) in cps.iter_mut().zip(indexed) {
            for c in claims(&cp) {
                held.entry(c).or_insert_with(|| cp.name.clone());
            }
            *slot = cp;
        }
        self.held = held;
    }

    /// Policy per route key; records each policy's outcome. A route's
    /// policy is the oldest one targeting it.
    fn policies(
        &mut self,
        objects: &Objects<'_>,
        routes: &[&Arc<TlsRoute>],
        out: &mut Translation,
    ) -> HashMap<String, Result<SeedlinkPolicySpec, String>> {
        let attached: HashSet<Key> = routes
            .iter()
            .filter(|r| {
                let ns = r.namespace().unwrap_or_default();
                r.spec
                    .parent_refs
                    .iter()
                    .flatten()
                    .any(|p| names_gateway(p, &ns, objects.gateway))
            })
            .map(|r| Key::of(r.as_ref()))
            .collect();
        let mut policies: Vec<&Arc<SeedlinkPolicy>> = objects.policies.iter().collect();
        policies.sort_by_key(|p| age(p.as_ref()));
        let mut result = HashMap::new();
        let live: HashSet<Key> = policies.iter().map(|p| Key::of(p.as_ref())).collect();
        self.last_good.retain(|k, _| live.contains(k));
        for p in policies {
            let key = Key::of(p.as_ref());
            let invalid = check_policy(&p.spec);
            let effective: Result<SeedlinkPolicySpec, String> = match &invalid {
                None => {
                    self.last_good.insert(key.clone(), p.spec.clone());
                    Ok(p.spec.clone())
                }
                Some(why) => match self.last_good.get(&key) {
                    Some(prev) => Ok(prev.clone()),
                    None => Err(format!("SeedlinkPolicy {key} is invalid: {why}")),
                },
            };
            let mut targets = Vec::new();
            for t in &p.spec.target_refs {
                let route_key = format!("{}/{}", key.namespace, t.name);
                let verdict = if t.group != GATEWAY_GROUP || t.kind != "TLSRoute" {
                    Verdict::no(
                        "Invalid",
                        format!(
                            "targets {}/{}: only {GATEWAY_GROUP}/TLSRoute is supported",
                            t.group, t.kind
                        ),
                    )
                } else if !attached.contains(&Key {
                    namespace: key.namespace.clone(),
                    name: t.name.clone(),
                }) {
                    Verdict::no(
                        "TargetNotFound",
                        format!("no TLSRoute {route_key} attached to the seedlink Gateway"),
                    )
                } else if let std::collections::hash_map::Entry::Vacant(slot) =
                    result.entry(route_key)
                {
                    slot.insert(effective.clone());
                    match (&invalid, &effective) {
                        (None, _) => Verdict::yes("Accepted", "applied"),
                        (Some(why), Ok(_)) => Verdict::no(
                            "Invalid",
                            format!("{why}; the previously accepted version stays in force"),
                        ),
                        (Some(why), Err(_)) => {
                            Verdict::no("Invalid", format!("{why}; the route is not served"))
                        }
                    }
                } else {
                    Verdict::no(
                        "Conflicted",
                        "an older SeedlinkPolicy targets the same route",
                    )
                };
                targets.push((t.name.clone(), verdict));
            }
            out.policies.push(PolicyOutcome {
                key,
                generation: p.metadata.generation,
                targets,
            });
        }
        result
    }
}

impl Key {
    fn name_in(&self, namespace: &str) -> String {
        format!("{namespace}/{}", self.name)
    }
}

/// Whether a parentRef names the seedlink Gateway.
pub fn names_gateway(p: &TlsRouteParentRefs, route_ns: &str, gw: &Key) -> bool {
    p.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
        && p.kind.as_deref().unwrap_or("Gateway") == "Gateway"
        && p.name == gw.name
        && p.namespace.as_deref().unwrap_or(route_ns) == gw.namespace
}

/// A policy's own problems (values the gateway would refuse); conflicts
/// with other control planes are found later, by the gateway.
fn check_policy(spec: &SeedlinkPolicySpec) -> Option<String> {
    let mut problems = Vec::new();
    for (i, c) in spec.allowed_source_cidrs.iter().flatten().enumerate() {
        if let Err(why) = seedlink_config::compile::parse_cidr(c) {
            problems.push(format!("allowedSourceCIDRs[{i}]: {why}"));
        }
    }
    for (i, d) in spec.destinations.iter().enumerate() {
        if let Err(why) = seedlink_proto::destination::parse(d) {
            problems.push(format!("destinations[{i}]: {d:?}: {why}"));
        }
    }
    for (i, a) in spec.service_addresses.iter().enumerate() {
        match a.parse::<SocketAddr>() {
            Ok(sa) if sa.port() != 0 && !sa.ip().is_unspecified() => {}
            _ => problems.push(format!(
                "serviceAddresses[{i}]: {a:?} is not a specific ip:port"
            )),
        }
    }
    if let Some(id) = &spec.cluster_id {
        if let Err(why) = seedlink_config::compile::check_cluster_id(id) {
            problems.push(format!("clusterID: {why}"));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// The ready endpoints of a route's backends, the `ResolvedRefs` verdict,
/// and whether weights other than 0/1 were seen.
fn backends(route: &TlsRoute, key: &Key, lookup: &Lookup<'_>) -> (Vec<String>, Verdict, bool) {
    let Lookup {
        services,
        slices,
        grants,
    } = lookup;
    let mut endpoints = Vec::new();
    let mut seen = HashSet::new();
    let mut problems = Vec::new();
    let mut reason = "ResolvedRefs";
    let mut weighted = false;
    for b in route.spec.rules.iter().flat_map(|r| &r.backend_refs) {
        if b.weight == Some(0) {
            continue;
        }
        if b.weight.is_some_and(|w| w != 1) {
            weighted = true;
        }
        if !b.group.as_deref().unwrap_or("").is_empty()
            || b.kind.as_deref().unwrap_or("Service") != "Service"
        {
            reason = "InvalidKind";
            problems.push(format!(
                "backend {}: only core Services are supported",
                b.name
            ));
            continue;
        }
        let namespace = b.namespace.as_deref().unwrap_or(&key.namespace);
        if namespace != key.namespace
            && !attach::granted(grants, &key.namespace, namespace, &b.name)
        {
            reason = "RefNotPermitted";
            problems.push(format!(
                "backend {namespace}/{}: no ReferenceGrant in {namespace} lets TLSRoutes from {} use it",
                b.name, key.namespace
            ));
            continue;
        }
        let skey = Key {
            namespace: namespace.to_string(),
            name: b.name.clone(),
        };
        let Some(port) = b.port else {
            reason = "UnsupportedValue";
            problems.push(format!("backend {}: a port is required", b.name));
            continue;
        };
        let Some(svc) = services.get(&skey) else {
            reason = "BackendNotFound";
            problems.push(format!("Service {skey} not found"));
            continue;
        };
        let Some(sport) = svc
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .and_then(|ps| ps.iter().find(|p| p.port == port))
        else {
            reason = "BackendNotFound";
            problems.push(format!("Service {skey} has no port {port}"));
            continue;
        };
        let port_name = sport.name.clone().unwrap_or_default();
        // Kubernetes' controller writes slices only for a Service with a
        // selector (and deletes any other slice bearing its name there); a
        // slice claiming to be its for a Service without one was written
        // by someone else.
        let selected = svc
            .spec
            .as_ref()
            .and_then(|s| s.selector.as_ref())
            .is_some_and(|s| !s.is_empty());
        for slice in slices.get(&skey).into_iter().flatten() {
            let by_controller = slice.labels().get(MANAGED_BY).map(String::as_str)
                == Some(seedlink_config::model::ENDPOINTSLICE_CONTROLLER);
            if by_controller && !selected {
                tracing::debug!(service = %skey, slice = %Key::of(*slice), "EndpointSlice ignored: it names Kubernetes' controller, which writes none for a Service without a selector");
                continue;
            }
            if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
                continue;
            }
            let Some(target) = slice
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.clone().unwrap_or_default() == port_name)
                .and_then(|p| p.port)
                .and_then(|p| u16::try_from(p).ok())
            else {
                continue;
            };
            for ep in &slice.endpoints {
                // An unknown readiness counts as ready (the API's advice);
                // a terminating pod is `ready: false` and gets nothing new.
                if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                    continue;
                }
                let Some(ip) = ep.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else {
                    continue;
                };
                if let Some(why) = unroutable(ip) {
                    // The CVE-2021-25740 class: whoever may write an
                    // EndpointSlice must not point the gateway at itself.
                    tracing::warn!(service = %skey, address = %ip, why, "EndpointSlice address refused as an upstream");
                    continue;
                }
                let addr = SocketAddr::new(ip, target).to_string();
                if seen.insert(addr.clone()) {
                    endpoints.push(addr);
                }
            }
        }
    }
    endpoints.sort();
    let verdict = if problems.is_empty() {
        Verdict::yes("ResolvedRefs", "every backend resolved")
    } else {
        Verdict::no(reason, problems.join("; "))
    };
    (endpoints, verdict, weighted)
}

/// What backends are looked up in.
struct Lookup<'a> {
    services: &'a HashMap<Key, &'a Service>,
    slices: &'a HashMap<Key, Vec<&'a EndpointSlice>>,
    grants: &'a [&'a ReferenceGrant],
}

/// Every name a control plane claims, one namespace per kind.
fn claims(cp: &ControlPlane) -> Vec<String> {
    let lower = |s: &str| s.trim_end_matches('.').to_ascii_lowercase();
    cp.hostnames
        .iter()
        .map(|h| format!("host {}", lower(h)))
        .chain(
            cp.destinations
                .iter()
                .map(|d| format!("destination {}", lower(&d.name))),
        )
        .chain(cp.service_addresses.iter().map(|a| format!("service {a}")))
        .chain(cp.cluster_id.iter().map(|i| format!("cluster {i}")))
        .collect()
}

/// Why `ip` can never be a backend pod's address: the gateway's own host
/// (loopback, unspecified), link-local (cloud metadata), multicast or
/// broadcast, in either family or as a v4-mapped IPv6 address.
pub fn unroutable(ip: IpAddr) -> Option<&'static str> {
    let ip = ip.to_canonical();
    match ip {
        _ if ip.is_loopback() => Some("loopback"),
        _ if ip.is_unspecified() => Some("unspecified"),
        _ if ip.is_multicast() => Some("multicast"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local"),
        IpAddr::V4(v4) if v4.is_broadcast() || v4.octets()[0] == 0 => Some("not a host"),
        // Cloud metadata outside link-local (Alibaba, AWS over IPv6), as the
        // agent's default deny list has them.
        IpAddr::V4(v4) if v4.octets() == [100, 100, 100, 200] => Some("cloud metadata"),
        IpAddr::V6(v6) if v6.segments() == [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254] => {
            Some("cloud metadata")
        }
        IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80 => Some("link-local"),
        _ => None,
    }
}

mod attach;

#[cfg(test)]
mod tests;
