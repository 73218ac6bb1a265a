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

use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::{TlsRoute, TlsRouteParentRefs};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use seedlink_config::model::{Acl, ControlPlane, DestinationCfg, ServedOn};

use crate::crd::{SeedlinkPolicy, SeedlinkPolicySpec};

mod outcome;

pub use outcome::{
    control_plane_name, GatewayOutcome, Key, ListenerOutcome, ParentOutcome, PolicyOutcome,
    RouteOutcome, Translation, Verdict, GATEWAY_GROUP,
};

/// The Gateways of a class seedlink serves, each at its own address
/// (`kubernetes.gateway_class`).
#[derive(Debug, Clone, PartialEq)]
pub struct ClassSettings {
    /// The GatewayClass (its `controllerName` must be seedlink's).
    pub name: String,
    /// The addresses Gateways are given, in order; each is one the
    /// gateway receives connections at.
    pub addresses: Vec<IpAddr>,
    /// The addresses the gateway's TLS listeners are bound to (which ports
    /// it receives where).
    pub receivers: Vec<SocketAddr>,
}

/// What the translation reads.
pub struct Objects<'a> {
    /// The named Gateway (`kubernetes.gateway`), `namespace/name`: served
    /// on every listener of the file.
    pub gateway: Option<&'a Key>,
    /// The Gateways of a class, each at its own address.
    pub class: Option<&'a ClassSettings>,
    /// Every Gateway watched (the class's are picked from them).
    pub gateways: &'a [Arc<Gateway>],
    /// Every GatewayClass (a class is served when its controllerName is
    /// seedlink's).
    pub classes: &'a [Arc<GatewayClass>],
    /// Names of the gateway file's listeners: the listeners routes attach
    /// to when there is no Gateway object (each admitting routes from the
    /// Gateway's own namespace only, Gateway API's default).
    pub listeners: &'a [String],
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
        let slices = self.trusted_slices(objects);
        let views = views(objects);
        let policies = self.policies(objects, &views, &routes, &mut out);
        let namespaces: HashMap<String, &BTreeMap<String, String>> = objects
            .namespaces
            .iter()
            .map(|n| (n.name_any(), n.labels()))
            .collect();
        let grants: Vec<&ReferenceGrant> = objects.grants.iter().map(|g| g.as_ref()).collect();
        let lookup = Lookup {
            services: &services,
            slices: &slices,
            grants: &grants,
        };
        for route in routes {
            let key = Key::of(route.as_ref());
            let attached = attach_to_parents(route, &key, &views, &namespaces);
            if attached.parents.is_empty() {
                continue;
            }
            let (outcome, cp) = serve_route(route, key, attached, &lookup, &policies);
            out.control_planes.extend(cp);
            out.routes.push(outcome);
        }
        let ours: Vec<Key> = views.iter().map(|v| v.key.clone()).collect();
        let accepted = accepted_by_status(objects, &ours);
        self.keep_first_claims(&mut out.control_planes, &accepted);
        out.gateways = views
            .into_iter()
            .filter(|v| v.object)
            .map(|v| GatewayOutcome {
                key: v.key,
                listeners: v.outcomes,
                address: v.address,
                named: v.named,
            })
            .collect();
        out
    }

    /// Orders `cps` so that a name (host name, destination, service
    /// address, cluster ID) stays with the route that held it in the last
    /// pass for as long as that route still claims it: a route that claims
    /// such a name goes last, whatever its age, and the gateway refuses it
    /// on the conflict. Without this, a tenant with an old route could add
    /// another tenant's name at any time and take its traffic. What this
    /// replica has not held itself (after a restart, or on a new replica)
    /// is held by the control planes `accepted` by the objects' statuses
    /// (state in the API server), so every replica decides alike.
    fn keep_first_claims(&mut self, cps: &mut [ControlPlane], accepted: &HashSet<String>) {
        let mut claimed: HashMap<String, HashSet<&str>> = HashMap::new();
        for cp in cps.iter() {
            for c in claims(cp) {
                claimed.entry(c).or_default().insert(cp.name.as_str());
            }
        }
        let mut held = self.held.clone();
        for cp in cps.iter().filter(|cp| accepted.contains(&cp.name)) {
            for c in claims(cp) {
                held.entry(c).or_insert_with(|| cp.name.clone());
            }
        }
        let steals = |cp: &ControlPlane| {
            claims(cp).iter().any(|c| {
                held.get(c).is_some_and(|owner| {
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

    /// The policy in force: `spec` if valid (remembered as the last good
    /// one), else the last good one, else the refusal.
    fn effective(
        &mut self,
        key: &Key,
        spec: &SeedlinkPolicySpec,
        invalid: Option<&str>,
    ) -> Result<SeedlinkPolicySpec, String> {
        match invalid {
            None => {
                self.last_good.insert(key.clone(), spec.clone());
                Ok(spec.clone())
            }
            Some(why) => match self.last_good.get(key) {
                Some(prev) => Ok(prev.clone()),
                None => Err(format!("SeedlinkPolicy {key} is invalid: {why}")),
            },
        }
    }

    /// Policy per route key; records each policy's outcome. A route's
    /// policy is the oldest one targeting it.
    fn policies(
        &mut self,
        objects: &Objects<'_>,
        views: &[View<'_>],
        routes: &[&Arc<TlsRoute>],
        out: &mut Translation,
    ) -> HashMap<String, Result<SeedlinkPolicySpec, String>> {
        let attached = attached_routes(views, routes);
        let existing: HashSet<Key> = routes.iter().map(|r| Key::of(r.as_ref())).collect();
        let mut policies: Vec<&Arc<SeedlinkPolicy>> = objects.policies.iter().collect();
        policies.sort_by_key(|p| age(p.as_ref()));
        let mut result = HashMap::new();
        let live: HashSet<Key> = policies.iter().map(|p| Key::of(p.as_ref())).collect();
        self.last_good.retain(|k, _| live.contains(k));
        for p in policies {
            let key = Key::of(p.as_ref());
            let invalid = check_policy(&p.spec);
            let effective = self.effective(&key, &p.spec, invalid.as_deref());
            let mut targets = Vec::new();
            let mut foreign = Vec::new();
            for t in &p.spec.target_refs {
                let route = Key {
                    namespace: key.namespace.clone(),
                    name: t.name.clone(),
                };
                // A route that exists but is attached to none of the
                // Gateways this process serves is another install's: its
                // entry is not ours to write (two installs would take
                // turns writing "not found" and "accepted", and the
                // claims read from status would flap with them).
                if t.kind == "TLSRoute" && existing.contains(&route) && !attached.contains(&route) {
                    foreign.push(t.name.clone());
                    continue;
                }
                let verdict =
                    target_verdict(t, &route, &attached, &mut result, (&invalid, &effective));
                targets.push((t.name.clone(), verdict));
            }
            out.policies.push(PolicyOutcome {
                key,
                generation: p.metadata.generation,
                targets,
                foreign,
            });
        }
        result
    }
}

impl Translator {
    /// EndpointSlices by the Service they belong to, only those written by
    /// a manager the operator trusts: a tenant may write a slice naming any
    /// address (the CVE-2021-25740 class); a route then has no endpoints
    /// from it.
    fn trusted_slices<'o>(&self, objects: &Objects<'o>) -> HashMap<Key, Vec<&'o EndpointSlice>> {
        let mut slices: HashMap<Key, Vec<&EndpointSlice>> = HashMap::new();
        for s in objects.slices {
            let manager = s.labels().get(MANAGED_BY);
            if !manager.is_some_and(|m| self.slice_managers.contains(m)) {
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
        slices
    }
}

/// The routes that name a Gateway seedlink serves.
fn attached_routes(views: &[View<'_>], routes: &[&Arc<TlsRoute>]) -> HashSet<Key> {
    routes
        .iter()
        .filter(|r| {
            let ns = r.namespace().unwrap_or_default();
            r.spec
                .parent_refs
                .iter()
                .flatten()
                .any(|p| views.iter().any(|v| names_gateway(p, &ns, &v.key)))
        })
        .map(|r| Key::of(r.as_ref()))
        .collect()
}

/// What a route's parents make of it.
struct Attached {
    /// Per parent it names among the Gateways seedlink serves.
    parents: Vec<ParentOutcome>,
    /// Through the named Gateway: served on every listener.
    hostnames: Vec<String>,
    /// Through a class Gateway: served at its address and the listener's
    /// port only, each attachment with its own names.
    served_on: Vec<ServedOn>,
}

/// Attaches `route` to each Gateway it names (listeners, hostnames,
/// namespaces allowed), collecting where and under which names it is
/// served.
fn attach_to_parents(
    route: &TlsRoute,
    key: &Key,
    views: &[View<'_>],
    namespaces: &HashMap<String, &BTreeMap<String, String>>,
) -> Attached {
    let mut out = Attached {
        parents: Vec::new(),
        hostnames: Vec::new(),
        served_on: Vec::new(),
    };
    for p in route.spec.parent_refs.iter().flatten() {
        let Some(view) = views
            .iter()
            .find(|v| names_gateway(p, &key.namespace, &v.key))
        else {
            continue;
        };
        let mut parent = ParentOutcome {
            parent_ref: p.clone(),
            gateway: view.key.clone(),
            accepted: Verdict::yes("Accepted", "served by seedlink"),
            listeners: Vec::new(),
        };
        match attach::attach(
            p,
            &key.namespace,
            &route.spec.hostnames,
            &view.key.namespace,
            &view.listeners,
            namespaces,
        ) {
            Err(refused) => parent.accepted = refused,
            Ok(attached) => {
                out.serve(view, &attached);
                parent.listeners = attached.into_iter().map(|a| a.listener).collect();
            }
        }
        out.parents.push(parent);
    }
    out
}

impl Attached {
    /// Serves the names of each attachment through `view`: everywhere for
    /// the named Gateway, at the address and port for a class Gateway.
    fn serve(&mut self, view: &View<'_>, attached: &[attach::Attached]) {
        for a in attached {
            let names = match (view.named, view.address) {
                (true, _) => &mut self.hostnames,
                (false, Some(ip)) => {
                    let port = a.port.and_then(|p| u16::try_from(p).ok()).unwrap_or(0);
                    served_at(&mut self.served_on, SocketAddr::new(ip, port))
                }
                // No address yet: served nowhere (the Gateway says
                // AddressNotAssigned).
                (false, None) => continue,
            };
            for h in &a.hostnames {
                if !names.contains(h) {
                    names.push(h.clone());
                }
            }
        }
    }
}

/// The host names served at `address` (an entry made if there is none).
fn served_at(served_on: &mut Vec<ServedOn>, address: SocketAddr) -> &mut Vec<String> {
    let address = address.to_string();
    let i = match served_on.iter().position(|o| o.address == address) {
        Some(i) => i,
        None => {
            served_on.push(ServedOn {
                address,
                hostnames: Vec::new(),
            });
            served_on.len() - 1
        }
    };
    &mut served_on[i].hostnames
}

impl Key {
    fn name_in(&self, namespace: &str) -> String {
        format!("{namespace}/{}", self.name)
    }
}

/// A Gateway seedlink serves, as the translation sees it.
struct View<'a> {
    key: Key,
    /// Whether there is a Gateway object (the named Gateway may have none:
    /// the file's listeners stand in).
    object: bool,
    listeners: Vec<attach::Listener<'a>>,
    outcomes: Vec<ListenerOutcome>,
    address: Option<IpAddr>,
    named: bool,
}

/// The Gateways seedlink serves: the named one (with the file's listeners
/// when it has no object), then the class's, oldest first, each given an
/// address ([`assign`]).
fn views<'a>(objects: &Objects<'a>) -> Vec<View<'a>> {
    let mut out = Vec::new();
    if let Some(named) = objects.gateway {
        let object = objects
            .gateways
            .iter()
            .find(|g| Key::of(g.as_ref()) == *named);
        let (listeners, outcomes) = match object {
            Some(g) => attach::gateway_listeners(g, None),
            None => (attach::file_listeners(objects.listeners), Vec::new()),
        };
        out.push(View {
            key: named.clone(),
            object: object.is_some(),
            listeners,
            outcomes,
            address: None,
            named: true,
        });
    }
    if let Some(class) = objects.class {
        class_views(objects, class, &mut out);
    }
    out
}

/// The Gateways of the class seedlink serves (if the class is seedlink's),
/// oldest first, each given an address.
fn class_views<'a>(objects: &Objects<'a>, class: &ClassSettings, out: &mut Vec<View<'a>>) {
    let ours = objects.classes.iter().any(|c| {
        c.name_any() == class.name && c.spec.controller_name == crate::crd::CONTROLLER_NAME
    });
    if !ours {
        return;
    }
    let mut members: Vec<&Gateway> = objects
        .gateways
        .iter()
        .map(|g| g.as_ref())
        .filter(|g| g.spec.gateway_class_name == class.name)
        .filter(|g| objects.gateway.is_none_or(|n| Key::of(*g) != *n))
        .collect();
    members.sort_by_key(|g| age(*g));
    let addresses = assign(&members, &class.addresses);
    for (g, address) in members.into_iter().zip(addresses) {
        // Without an address (the pool is used up) the listeners are still
        // what they are; the Gateway is not Programmed (AddressNotAssigned).
        let received = |port: i32| match address {
            Some(a) => attach::receives(&class.receivers, a, port),
            None => class.receivers.iter().any(|r| i32::from(r.port()) == port),
        };
        let (listeners, outcomes) = attach::gateway_listeners(g, Some(&received));
        out.push(View {
            key: Key::of(g),
            object: true,
            listeners,
            outcomes,
            address,
            named: false,
        });
    }
}

/// Each Gateway's address from `pool` (`gateways` oldest first): the one
/// its status already shows, so that an address stays with its Gateway
/// across restarts and replicas; else the one its `spec.addresses` asks
/// for; else the first free one. `None` when the pool is used up. Every
/// replica computes the same from the same objects.
fn assign(gateways: &[&Gateway], pool: &[IpAddr]) -> Vec<Option<IpAddr>> {
    let mut taken: HashSet<IpAddr> = HashSet::new();
    let in_pool = |v: &str| {
        v.parse::<IpAddr>()
            .ok()
            .map(seedlink_config::routes::canonical)
            .filter(|ip| pool.contains(ip))
    };
    let mut out: Vec<Option<IpAddr>> = gateways
        .iter()
        .map(|g| {
            let shown = g
                .status
                .iter()
                .flat_map(|s| s.addresses.iter().flatten())
                .filter_map(|a| in_pool(&a.value))
                .find(|ip| !taken.contains(ip));
            if let Some(ip) = shown {
                taken.insert(ip);
            }
            shown
        })
        .collect();
    for (g, slot) in gateways.iter().zip(out.iter_mut()) {
        if slot.is_some() {
            continue;
        }
        // A Gateway that asks for addresses gets one of them or none
        // (Programmed=False, AddressNotAssigned), never another.
        let requested = g.spec.addresses.iter().flatten().count() > 0;
        let asked = g
            .spec
            .addresses
            .iter()
            .flatten()
            .filter_map(|a| a.value.as_deref().and_then(in_pool))
            .find(|ip| !taken.contains(ip));
        let pick = if requested {
            asked
        } else {
            pool.iter().copied().find(|ip| !taken.contains(ip))
        };
        if let Some(ip) = pick {
            taken.insert(ip);
        }
        *slot = pick;
    }
    out
}

/// Whether a parentRef names the Gateway `gw`.
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
    let mut endpoints = Vec::new();
    let mut seen = HashSet::new();
    let mut problems = Vec::new();
    let mut reason = "ResolvedRefs";
    let mut weighted = false;
    for b in route.spec.rules.iter().flat_map(|r| &r.backend_refs) {
        if b.weight == Some(0) {
            continue;
        }
        weighted |= b.weight.is_some_and(|w| w != 1);
        let (skey, svc, port_name) = match resolve_backend(b, key, lookup) {
            Ok(found) => found,
            Err((why, problem)) => {
                reason = why;
                problems.push(problem);
                continue;
            }
        };
        // Ready endpoints take new connections; when a Service has none,
        // those still serving while they terminate do (kube-proxy's
        // ProxyTerminatingEndpoints, Envoy Gateway's and Istio's fallback),
        // so a rollout of its last pod does not refuse connections.
        let (ready, draining) = service_endpoints(&skey, svc, &port_name, lookup.slices);
        let chosen = if ready.is_empty() { draining } else { ready };
        for addr in chosen {
            if seen.insert(addr.clone()) {
                endpoints.push(addr);
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

/// A backendRef's Service and its port's name, or the `ResolvedRefs`
/// reason and problem that refuse it.
fn resolve_backend<'a>(
    b: &gateway_api::tlsroutes::TlsRouteRulesBackendRefs,
    key: &Key,
    lookup: &Lookup<'a>,
) -> Result<(Key, &'a Service, String), (&'static str, String)> {
    if !b.group.as_deref().unwrap_or("").is_empty()
        || b.kind.as_deref().unwrap_or("Service") != "Service"
    {
        return Err((
            "InvalidKind",
            format!("backend {}: only core Services are supported", b.name),
        ));
    }
    let namespace = b.namespace.as_deref().unwrap_or(&key.namespace);
    if namespace != key.namespace
        && !attach::granted(lookup.grants, &key.namespace, namespace, &b.name)
    {
        return Err(("RefNotPermitted", format!(
            "backend {namespace}/{}: no ReferenceGrant in {namespace} lets TLSRoutes from {} use it",
            b.name, key.namespace
        )));
    }
    let skey = Key {
        namespace: namespace.to_string(),
        name: b.name.clone(),
    };
    let Some(port) = b.port else {
        return Err((
            "UnsupportedValue",
            format!("backend {}: a port is required", b.name),
        ));
    };
    let Some(svc) = lookup.services.get(&skey).copied() else {
        return Err(("BackendNotFound", format!("Service {skey} not found")));
    };
    let port_name = port_name(&skey, svc, port)?;
    Ok((skey, svc, port_name))
}

/// The name of a Service's port `port` (empty if unnamed).
fn port_name(skey: &Key, svc: &Service, port: i32) -> Result<String, (&'static str, String)> {
    let Some(sport) = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .and_then(|ps| ps.iter().find(|p| p.port == port))
    else {
        return Err((
            "BackendNotFound",
            format!("Service {skey} has no port {port}"),
        ));
    };
    Ok(sport.name.clone().unwrap_or_default())
}

/// A Service's endpoints for the port named `port_name`: those ready, and
/// those serving while they terminate.
fn service_endpoints(
    skey: &Key,
    svc: &Service,
    port_name: &str,
    slices: &HashMap<Key, Vec<&EndpointSlice>>,
) -> (Vec<String>, Vec<String>) {
    // Kubernetes' controller writes slices only for a Service with a
    // selector (and deletes any other slice bearing its name there); a
    // slice claiming to be its for a Service without one was written by
    // someone else.
    let selected = svc
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .is_some_and(|s| !s.is_empty());
    let (mut ready, mut draining) = (Vec::new(), Vec::new());
    for slice in slices.get(skey).into_iter().flatten() {
        let by_controller = slice.labels().get(MANAGED_BY).map(String::as_str)
            == Some(seedlink_config::model::ENDPOINTSLICE_CONTROLLER);
        if by_controller && !selected {
            tracing::debug!(service = %skey, slice = %Key::of(*slice), "EndpointSlice ignored: it names Kubernetes' controller, which writes none for a Service without a selector");
            continue;
        }
        let Some(target) = slice_port(slice, port_name) else {
            continue;
        };
        for ep in &slice.endpoints {
            match endpoint(skey, ep, target) {
                Some((addr, true)) => ready.push(addr),
                Some((addr, false)) => draining.push(addr),
                None => {}
            }
        }
    }
    (ready, draining)
}

/// The target port of an IP slice for the Service port `port_name`.
fn slice_port(slice: &EndpointSlice, port_name: &str) -> Option<u16> {
    if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
        return None;
    }
    slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref().unwrap_or_default() == port_name)
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
}

/// An endpoint's address and whether it is ready (else it is serving
/// while it terminates); `None` when it takes no connections or its
/// address is refused.
fn endpoint(
    skey: &Key,
    ep: &k8s_openapi::api::discovery::v1::Endpoint,
    target: u16,
) -> Option<(String, bool)> {
    // An unknown readiness counts as ready (the API's advice); `serving`
    // unknown is `ready`'s value.
    let c = ep.conditions.as_ref();
    let is_ready = c.and_then(|c| c.ready) != Some(false);
    let serving = c.and_then(|c| c.serving).unwrap_or(is_ready);
    let terminating = c.and_then(|c| c.terminating) == Some(true);
    if !(is_ready || (serving && terminating)) {
        return None;
    }
    let ip = ep.addresses.first()?.parse::<IpAddr>().ok()?;
    if let Some(why) = unroutable(ip) {
        // The CVE-2021-25740 class: whoever may write an EndpointSlice
        // must not point the gateway at itself.
        tracing::warn!(service = %skey, address = %ip, why, "EndpointSlice address refused as an upstream");
        return None;
    }
    Some((SocketAddr::new(ip, target).to_string(), is_ready))
}

/// A policy's verdict on one of its targets; the first policy (oldest)
/// to target an attached route becomes its policy in `taken` (keyed
/// `namespace/name`). `spec` is the policy's own problem, if any, and the
/// spec in force (the last good one when it has a problem).
fn target_verdict(
    t: &crate::crd::LocalPolicyTargetRef,
    route: &Key,
    attached: &HashSet<Key>,
    taken: &mut HashMap<String, Result<SeedlinkPolicySpec, String>>,
    spec: (&Option<String>, &Result<SeedlinkPolicySpec, String>),
) -> Verdict {
    let (invalid, effective) = spec;
    if t.group != GATEWAY_GROUP || t.kind != "TLSRoute" {
        return Verdict::no(
            "Invalid",
            format!(
                "targets {}/{}: only {GATEWAY_GROUP}/TLSRoute is supported",
                t.group, t.kind
            ),
        );
    }
    if !attached.contains(route) {
        return Verdict::no(
            "TargetNotFound",
            format!("no TLSRoute {route} attached to the seedlink Gateway"),
        );
    }
    let std::collections::hash_map::Entry::Vacant(slot) = taken.entry(route.to_string()) else {
        return Verdict::no(
            "Conflicted",
            "an older SeedlinkPolicy targets the same route",
        );
    };
    slot.insert(effective.clone());
    match (invalid, effective) {
        (None, _) => Verdict::yes("Accepted", "applied"),
        (Some(why), Ok(_)) => Verdict::no(
            "Invalid",
            format!("{why}; the previously accepted version stays in force"),
        ),
        (Some(why), Err(_)) => Verdict::no("Invalid", format!("{why}; the route is not served")),
    }
}

/// An attached route's outcome, and the control plane it becomes if it
/// is served.
fn serve_route(
    route: &TlsRoute,
    key: Key,
    attached: Attached,
    lookup: &Lookup<'_>,
    policies: &HashMap<String, Result<SeedlinkPolicySpec, String>>,
) -> (RouteOutcome, Option<ControlPlane>) {
    let Attached {
        parents,
        hostnames,
        served_on,
    } = attached;
    let accepted = parents
        .iter()
        .find(|p| p.accepted.ok)
        .or(parents.first())
        .map(|p| p.accepted.clone())
        .unwrap_or_else(|| Verdict::no("NoMatchingParent", "no parent"));
    let (endpoints, resolved, weighted) = backends(route, &key, lookup);
    let mut outcome = RouteOutcome {
        key: key.clone(),
        generation: route.metadata.generation,
        parents,
        accepted,
        resolved,
        control_plane: None,
    };
    if !outcome.accepted.ok {
        return (outcome, None);
    }
    if weighted {
        outcome.weights_ignored();
    }
    if hostnames.is_empty() && served_on.is_empty() {
        // Accepted only by Gateways with no address yet: nowhere to serve
        // it.
        return (outcome, None);
    }
    let mut cp = ControlPlane {
        served_on,
        name: control_plane_name(&key),
        hostnames,
        endpoints,
        ..ControlPlane::default()
    };
    match policies.get(&key.name_in(&key.namespace)) {
        Some(Ok(spec)) => apply_policy(&mut cp, spec),
        Some(Err(why)) => {
            // Fail closed: without its valid policy the route would lose
            // its ACL.
            outcome.refuse(Verdict::no("UnsupportedValue", why.clone()));
            return (outcome, None);
        }
        None => {}
    }
    outcome.control_plane = Some(cp.name.clone());
    (outcome, Some(cp))
}

impl RouteOutcome {
    /// Accepted, with a note that backend weights are not applied.
    fn weights_ignored(&mut self) {
        let note = Verdict::yes(
            "Accepted",
            "served by seedlink; backend weights other than 0 are ignored (least-connections over every ready endpoint)",
        );
        for p in self.parents.iter_mut().filter(|p| p.accepted.ok) {
            p.accepted = note.clone();
        }
        self.accepted = note;
    }
}

/// A SeedlinkPolicy's settings on the control plane of the route it
/// targets.
fn apply_policy(cp: &mut ControlPlane, spec: &SeedlinkPolicySpec) {
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

/// What backends are looked up in.
struct Lookup<'a> {
    services: &'a HashMap<Key, &'a Service>,
    slices: &'a HashMap<Key, Vec<&'a EndpointSlice>>,
    grants: &'a [&'a ReferenceGrant],
}

/// Every name a control plane claims, one namespace per kind (a host name
/// served at one address only is a claim there, not everywhere).
fn claims(cp: &ControlPlane) -> Vec<String> {
    let lower = |s: &str| s.trim_end_matches('.').to_ascii_lowercase();
    cp.hostnames
        .iter()
        .map(|h| format!("host {}", lower(h)))
        .chain(cp.served_on.iter().flat_map(|o| {
            o.hostnames
                .iter()
                .map(move |h| format!("host {} at {}", lower(h), o.address))
        }))
        .chain(
            cp.destinations
                .iter()
                .map(|d| format!("destination {}", lower(&d.name))),
        )
        .chain(cp.service_addresses.iter().map(|a| format!("service {a}")))
        .chain(cp.cluster_id.iter().map(|i| format!("cluster {i}")))
        .collect()
}

/// The control planes whose objects' statuses say seedlink accepted them
/// as they are now: the route's `Accepted=True` from seedlink at its
/// current generation, and every SeedlinkPolicy targeting it likewise. A
/// route (or policy) edited since, refused, or never seen is not among
/// them: an edit that adds another tenant's name cannot count as held.
fn accepted_by_status(objects: &Objects<'_>, ours: &[Key]) -> HashSet<String> {
    let current = |conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
                   generation: Option<i64>| {
        conditions.iter().any(|c| {
            c.type_ == "Accepted"
                && c.status == "True"
                && generation.is_some()
                && c.observed_generation == generation
        })
    };
    let stale_policy = |key: &Key| {
        objects.policies.iter().any(|p| {
            p.namespace().as_deref() == Some(key.namespace.as_str())
                && p.spec.target_refs.iter().any(|t| t.name == key.name)
                && !p.status.iter().flat_map(|s| &s.ancestors).any(|a| {
                    a.controller_name == crate::crd::CONTROLLER_NAME
                        && a.ancestor_ref.name == key.name
                        && current(&a.conditions, p.metadata.generation)
                })
        })
    };
    // Only the entries for the Gateways this install serves, and all of
    // them: another install (same controller name) that accepted a route
    // for its own Gateway says nothing about this one's names.
    let for_ours = |r: &TlsRoute, p: &gateway_api::tlsroutes::TlsRouteStatusParents| {
        let ns = r.metadata.namespace.as_deref().unwrap_or_default();
        p.controller_name == crate::crd::CONTROLLER_NAME
            && p.parent_ref.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
            && p.parent_ref.kind.as_deref().unwrap_or("Gateway") == "Gateway"
            && ours.iter().any(|k| {
                k.name == p.parent_ref.name
                    && k.namespace == p.parent_ref.namespace.as_deref().unwrap_or(ns)
            })
    };
    objects
        .routes
        .iter()
        .filter(|r| {
            let mut entries = r
                .status
                .iter()
                .flat_map(|s| &s.parents)
                .filter(|p| for_ours(r, p))
                .peekable();
            entries.peek().is_some()
                && entries.all(|p| current(&p.conditions, r.metadata.generation))
        })
        .map(|r| Key::of(r.as_ref()))
        .filter(|k| !stale_policy(k))
        .map(|k| control_plane_name(&k))
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
