//! What a translation produces: the control planes, and per object the
//! verdicts its status reports. Plain data, shared by `translate` and
//! `translate::attach` (so neither needs the other's internals).

use std::collections::HashMap;
use std::net::IpAddr;

use gateway_api::tlsroutes::TlsRouteParentRefs;
use kube::ResourceExt;
use seedlink_config::model::ControlPlane;

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

/// What became of one TLSRoute attached to a Gateway seedlink serves.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteOutcome {
    /// The route.
    pub key: Key,
    /// Its `metadata.generation`.
    pub generation: Option<i64>,
    /// Per parentRef naming a Gateway seedlink serves: its own `Accepted`.
    pub parents: Vec<ParentOutcome>,
    /// `Accepted` as a whole: true when some parent accepted it (then it
    /// is served), else the first parent's refusal.
    pub accepted: Verdict,
    /// `ResolvedRefs` (the backends, the same for every parent).
    pub resolved: Verdict,
    /// The control plane it became, if any.
    pub control_plane: Option<String>,
}

/// One parentRef of a route, as written, and what became of it there.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentOutcome {
    /// The parentRef.
    pub parent_ref: TlsRouteParentRefs,
    /// The Gateway it names.
    pub gateway: Key,
    /// `Accepted` for this parent.
    pub accepted: Verdict,
    /// The Gateway's listeners the route attached to through it (their
    /// `attachedRoutes`).
    pub listeners: Vec<String>,
}

/// The status of one listener of a Gateway object.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerOutcome {
    /// Its name.
    pub name: String,
    /// `Accepted` (false for what seedlink does not serve: a protocol other
    /// than TLS, TLS other than Passthrough, a port it does not receive).
    pub accepted: Verdict,
    /// `ResolvedRefs`: false (`InvalidRouteKinds`) when `allowedRoutes.kinds`
    /// names a kind seedlink does not serve.
    pub resolved: Verdict,
    /// Route kinds it takes (empty when not accepted).
    pub kinds: Vec<String>,
}

/// What becomes of one Gateway object seedlink serves.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayOutcome {
    /// The Gateway.
    pub key: Key,
    /// Its listeners.
    pub listeners: Vec<ListenerOutcome>,
    /// For a Gateway of the class (`kubernetes.gateway_class`): the address
    /// it is served at; `None` when the pool has none left. For the named
    /// Gateway (`kubernetes.gateway`): `None`, its addresses are the
    /// Service's.
    pub address: Option<IpAddr>,
    /// Whether it is the named Gateway (served on every listener).
    pub named: bool,
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
    /// Targets that are routes of another Gateway (another seedlink
    /// install's, or another implementation's): their ancestor entries
    /// are whoever serves them to write, and left as they are.
    pub foreign: Vec<String>,
}

/// Everything the gateway gets from the objects, and what to report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Translation {
    /// Control planes in the order the gateway admits them (the first
    /// wins a conflict): oldest route first, except that a route claiming
    /// a name another route held in the last pass, and still claims, goes
    /// after every other (the first claim keeps a name while it holds it).
    pub control_planes: Vec<std::sync::Arc<ControlPlane>>,
    /// Per attached route (shared with the translator, which keeps each
    /// namespace's until it changes).
    pub routes: Vec<std::sync::Arc<RouteOutcome>>,
    /// Per policy (shared like the routes').
    pub policies: Vec<std::sync::Arc<PolicyOutcome>>,
    /// Per Gateway object seedlink serves.
    pub gateways: Vec<GatewayOutcome>,
}

impl Translation {
    /// Routes accepted on listener `name` of Gateway `gateway` (its
    /// `attachedRoutes`).
    pub fn attached(&self, gateway: &Key, name: &str) -> i32 {
        self.attached_by_listener(gateway)
            .get(name)
            .copied()
            .unwrap_or(0)
    }

    /// Per listener of Gateway `gateway`: the routes accepted on it, in
    /// one walk over the routes (not one per listener).
    pub fn attached_by_listener(&self, gateway: &Key) -> HashMap<&str, i32> {
        let mut counts: HashMap<&str, i32> = HashMap::new();
        let mut on: Vec<&str> = Vec::new();
        for r in &self.routes {
            on.clear();
            let parents = r.parents.iter();
            let ours = parents.filter(|p| p.accepted.ok && p.gateway == *gateway);
            for l in ours.flat_map(|p| &p.listeners) {
                if !on.contains(&l.as_str()) {
                    on.push(l);
                }
            }
            for l in &on {
                let n = counts.entry(l).or_default();
                *n = n.saturating_add(1);
            }
        }
        counts
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
                let r = std::sync::Arc::make_mut(r);
                r.refuse(Verdict::no("UnsupportedValue", why.clone()));
                r.control_plane = None;
            }
        }
        self.control_planes
            .retain(|c| !by_name.contains_key(c.name.as_str()));
    }
}

impl RouteOutcome {
    /// Not served after all: every parent that accepted it refuses it.
    pub(super) fn refuse(&mut self, why: Verdict) {
        for p in &mut self.parents {
            if p.accepted.ok {
                p.accepted = why.clone();
                p.listeners.clear();
            }
        }
        self.accepted = why;
    }
}
