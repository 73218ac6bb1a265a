//! The Gateways seedlink serves as views (each with its address and its
//! listeners), the addresses given to a class's Gateways, and which routes
//! attach to which Gateway.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use std::collections::BTreeMap;

use gateway_api::gateways::Gateway;
use gateway_api::tlsroutes::{TlsRoute, TlsRouteParentRefs};
use kube::ResourceExt;
use seedlink_config::model::ServedOn;

use super::attach;
use super::objects::*;
use super::outcome::*;

/// The routes that name a Gateway seedlink serves.
pub(super) fn attached_routes(views: &[View<'_>], routes: &[&Arc<TlsRoute>]) -> HashSet<Key> {
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
pub(super) struct Attached {
    /// Per parent it names among the Gateways seedlink serves.
    pub(super) parents: Vec<ParentOutcome>,
    /// Through the named Gateway: served on every listener.
    pub(super) hostnames: Vec<String>,
    /// Through a class Gateway: served at its address and the listener's
    /// port only, each attachment with its own names.
    pub(super) served_on: Vec<ServedOn>,
}

/// Attaches `route` to each Gateway it names (listeners, hostnames,
/// namespaces allowed), collecting where and under which names it is
/// served.
pub(super) fn attach_to_parents(
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
pub(super) fn served_at(served_on: &mut Vec<ServedOn>, address: SocketAddr) -> &mut Vec<String> {
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

/// A Gateway seedlink serves, as the translation sees it.
pub(super) struct View<'a> {
    pub(super) key: Key,
    /// Whether there is a Gateway object (the named Gateway may have none:
    /// the file's listeners stand in).
    pub(super) object: bool,
    pub(super) listeners: Vec<attach::Listener<'a>>,
    pub(super) outcomes: Vec<ListenerOutcome>,
    pub(super) address: Option<IpAddr>,
    pub(super) named: bool,
}

/// The Gateways seedlink serves: the named one (with the file's listeners
/// when it has no object), then the class's, oldest first, each given an
/// address ([`assign`]).
pub(super) fn views<'a>(objects: &Objects<'a>) -> Vec<View<'a>> {
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
pub(super) fn class_views<'a>(
    objects: &Objects<'a>,
    class: &ClassSettings,
    out: &mut Vec<View<'a>>,
) {
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
    members.sort_by_cached_key(|g| age(*g));
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
pub(super) fn assign(gateways: &[&Gateway], pool: &[IpAddr]) -> Vec<Option<IpAddr>> {
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
