//! The admin HTTP endpoint: `/healthz`, `/readyz`, `/metrics`, `/config`,
//! `/api/state` (every control plane's routes, ACL, endpoints and
//! connection outcomes as JSON) and `/`, the live page over it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use seedlink_net::lifecycle::Phase;
use tokio::net::TcpListener;

use crate::state::Gateway;

/// Admin connections served at once; more are closed at accept.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Serves the admin endpoint until the process exits (it stays up while
/// draining so probes and scrapes see the drain).
pub async fn serve(
    gw: Arc<Gateway>,
    listener: TcpListener,
    access: seedlink_net::admin::Access,
    stop: tokio_util::sync::CancellationToken,
) {
    let slots = seedlink_net::admin::Slots::new(MAX_ADMIN_CONNECTIONS);
    seedlink_net::accept::accept_loop(&listener, &stop, |stream, peer| {
        let Some(slot) = slots.enter(peer.ip()) else {
            return;
        };
        let gw = gw.clone();
        let access = access.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let r = respond(&gw, &access, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
            drop(slot);
        });
    })
    .await;
}

/// A request's answer: refused without the token where one is needed.
fn respond(
    gw: &Gateway,
    access: &seedlink_net::admin::Access,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if access.allows(req.uri().path(), authorization) {
        return route(gw, req);
    }
    let mut r = text(
        StatusCode::UNAUTHORIZED,
        "unauthorized: send Authorization: Bearer <token>\n",
    );
    r.headers_mut().insert(
        hyper::header::WWW_AUTHENTICATE,
        hyper::header::HeaderValue::from_static("Bearer"),
    );
    r
}

fn route(gw: &Gateway, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => match gw.lifecycle.phase() {
            Phase::Serving => match gw.lifecycle.gates.unmet() {
                unmet if unmet.is_empty() => text(StatusCode::OK, "ready\n"),
                unmet => {
                    let body = format!("not ready\n[-]{}\n", unmet.join("\n[-]"));
                    let mut r = Response::new(Full::new(Bytes::from(body)));
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    r
                }
            },
            Phase::Starting => text(StatusCode::SERVICE_UNAVAILABLE, "starting\n"),
            Phase::Draining => text(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        },
        "/metrics" => typed(
            gw.metrics
                .encode_with(&gw.snapshot(), gw.copier.pipe_counts()),
            seedlink_net::admin::METRICS,
        ),
        "/" => typed(seedlink_net::admin::PAGE, seedlink_net::admin::HTML),
        "/api/state" => match only_control_plane(req.uri().query()) {
            Ok(only) => typed(
                state_of(gw, only.as_deref()).to_string(),
                seedlink_net::admin::JSON,
            ),
            Err(why) => text(StatusCode::BAD_REQUEST, why),
        },
        "/config" => {
            let body = serde_json::json!({
                "generation": gw.generation(),
                "max_connections": gw.max_connections(),
                "config": gw.snapshot().file,
            });
            let body = serde_json::to_string_pretty(&body).unwrap_or_default() + "\n";
            typed(body, seedlink_net::admin::JSON)
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /healthz /readyz /metrics /config\n",
        ),
    }
}

/// A 200 answer of `content_type`.
fn typed(body: impl Into<Bytes>, content_type: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r
}

/// Every control plane's live state, as the page and scripts read it.
pub fn state(gw: &Gateway) -> serde_json::Value {
    state_of(gw, None)
}

/// The control plane `api/state?control_plane=NAME` asks for: `None`
/// without the parameter (every control plane). At a thousand tenants the
/// whole state is about a megabyte; a script watching one control plane
/// asks for it alone.
fn only_control_plane(query: Option<&str>) -> Result<Option<String>, &'static str> {
    let mut only = None;
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "control_plane" if only.is_none() => only = Some(v.into_owned()),
            "control_plane" => return Err("control_plane: given more than once\n"),
            _ => return Err("unknown parameter: api/state takes only control_plane\n"),
        }
    }
    Ok(only)
}

/// [`state`], with only the control plane named `only` when given (none
/// when no control plane has that name).
pub fn state_of(gw: &Gateway, only: Option<&str>) -> serde_json::Value {
    let snap = gw.snapshot();
    let mut counts = Counts::read(gw, only);
    counts.in_use(gw, only);
    let now = crate::upstream::now_ms();
    let file = &snap.file;
    let all = file.control_planes.iter().map(|c| (c, "file")).chain(
        file.from_kubernetes
            .iter()
            .map(|c| (c.as_ref(), "kubernetes")),
    );
    let control_planes: Vec<serde_json::Value> = match only {
        None => all
            .map(|(c, source)| control_plane_state(&snap, &counts, c, source, now))
            .collect(),
        Some(name) => places_of(gw, &snap)
            .of_name(name)
            .filter_map(|i| match i.checked_sub(file.control_planes.len()) {
                None => file.control_planes.get(i).map(|c| (c, "file")),
                Some(k) => file
                    .from_kubernetes
                    .get(k)
                    .map(|c| (c.as_ref(), "kubernetes")),
            })
            .find(|(c, _)| c.name == name)
            .map(|(c, source)| control_plane_state(&snap, &counts, c, source, now))
            .into_iter()
            .collect(),
    };
    serde_json::json!({
        "role": "gateway",
        "process": {
            "version": env!("CARGO_PKG_VERSION"),
            "generation": gw.generation(),
            "last_reload": gw.last_reload().map(|(t, r)| serde_json::json!({"at": seedlink_net::admin::rfc3339(t), "result": r})),
        },
        "always_allowed": file.always_allowed,
        "control_planes": control_planes,
        "sections": sections(&gw.metrics.sections),
    })
}

/// Where `snap`'s control planes stand (see [`crate::state::StateIndex`]).
fn places_of(
    gw: &Gateway,
    snap: &std::sync::Arc<seedlink_config::Snapshot>,
) -> std::sync::Arc<crate::state::Places> {
    let mut held = seedlink_net::sync::lock(&gw.state_index, "state index");
    match held.as_ref() {
        Some((of, places)) if std::ptr::eq(of.as_ptr(), std::sync::Arc::as_ptr(snap)) => {
            places.clone()
        }
        _ => {
            let file = &snap.file;
            let names = file.control_planes.iter().map(|c| c.name.as_str());
            let names = names.chain(file.from_kubernetes.iter().map(|c| c.name.as_str()));
            let places = std::sync::Arc::new(crate::state::Places::of(names));
            *held = Some((std::sync::Arc::downgrade(snap), places.clone()));
            places
        }
    }
}

/// The added sections (`api/state`'s `sections`).
pub fn sections(s: &seedlink_net::admin::Sections) -> serde_json::Value {
    s.state()
        .into_iter()
        .map(|(title, lines)| serde_json::json!({"title": title, "lines": lines}))
        .collect()
}

type PerControlPlane = std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>;

/// The counters the state page shows per control plane.
#[derive(Debug, Default)]
struct Counts {
    /// Ended connections by outcome.
    outcomes: PerControlPlane,
    /// Routed connections by `listener / protocol`.
    routed: PerControlPlane,
    /// Open routed connections by `listener / protocol` (none: left out).
    open_by: PerControlPlane,
    /// When each path in use (within `migration.window`, before a restart
    /// too) was last used, by `listener / protocol` (RFC 3339).
    in_use: std::collections::HashMap<String, std::collections::BTreeMap<String, String>>,
}

impl Counts {
    /// The paths in use, of `only` when given (`migration`).
    fn in_use(&mut self, gw: &Gateway, only: Option<&str>) {
        for ((cp, listener, protocol), last) in gw.paths_in_use(only) {
            let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(last);
            self.in_use.entry(cp).or_default().insert(
                format!("{listener} / {protocol}"),
                seedlink_net::admin::rfc3339(at),
            );
        }
    }

    /// Every control plane's counters, or `only`'s, read from the
    /// listeners' handles: one control plane costs a lookup per listener,
    /// not an encoding of every control plane's metrics (a script polling
    /// one tenant at a thousand tenants).
    fn read(gw: &Gateway, only: Option<&str>) -> Counts {
        Counts::of(&gw.metrics.listeners(), only)
    }

    /// [`Counts::read`] from `listeners`.
    fn of(
        listeners: &[std::sync::Arc<crate::metrics::ListenerMetrics>],
        only: Option<&str>,
    ) -> Counts {
        let mut c = Counts::default();
        for l in listeners {
            l.each_cp(only, |cp, h| c.add(l.name(), cp, h));
        }
        c
    }

    /// What control plane `cp`'s handles `h` on `listener` count.
    fn add(&mut self, listener: &str, cp: &str, h: &crate::metrics::CpMetrics) {
        if cp.is_empty() {
            return; // ended before it was routed
        }
        for (outcome, n) in h.ends() {
            *self
                .outcomes
                .entry(cp.to_string())
                .or_default()
                .entry(outcome.to_string())
                .or_default() += n;
        }
        for (protocol, n, open) in h.routed() {
            let path = format!("{listener} / {protocol}");
            if let Ok(open @ 1..) = u64::try_from(open) {
                *self
                    .open_by
                    .entry(cp.to_string())
                    .or_default()
                    .entry(path.clone())
                    .or_default() += open;
            }
            *self
                .routed
                .entry(cp.to_string())
                .or_default()
                .entry(path)
                .or_default() += n;
        }
    }
}

/// The endpoints of control plane `name` as the snapshot has them.
fn endpoints_state(
    snap: &seedlink_config::Snapshot,
    name: &str,
    now: u64,
) -> Vec<serde_json::Value> {
    let Some(cp) = snap.control_planes.get(name) else {
        return Vec::new();
    };
    cp.endpoints
        .iter()
        .map(|e| endpoint_state(e, now))
        .collect()
}

/// One control plane's configuration, endpoints and counters.
fn control_plane_state(
    snap: &seedlink_config::Snapshot,
    counts: &Counts,
    c: &seedlink_config::model::ControlPlane,
    source: &str,
    now: u64,
) -> serde_json::Value {
    let endpoints = endpoints_state(snap, &c.name, now);
    let active: u64 = endpoints.iter().filter_map(|e| e["active"].as_u64()).sum();
    serde_json::json!({
        "name": c.name,
        "source": source,
        "hostnames": c.hostnames,
        "destinations": c.destinations.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
        "service_addresses": c.service_addresses,
        "acl": c.acl.as_ref().map(|a| a.allow.clone()),
        "active": active,
        "active_by": counts.open_by.get(&c.name),
        "endpoints": endpoints,
        "outcomes": counts.outcomes.get(&c.name),
        "routed": counts.routed.get(&c.name),
        "paths_in_use": counts.in_use.get(&c.name),
    })
}

/// An endpoint's open connections and ejection at `now` (ms).
fn endpoint_state(e: &seedlink_config::routes::Endpoint, now: u64) -> serde_json::Value {
    let until = e
        .state
        .ejected_until_ms
        .load(std::sync::atomic::Ordering::Relaxed);
    serde_json::json!({
        "address": e.address,
        "active": e.state.active.load(std::sync::atomic::Ordering::Relaxed),
        "ejected": until > now,
        "ejected_for_ms": until.saturating_sub(now),
    })
}

#[cfg(test)]
mod counts_tests {
    use super::Counts;

    #[test]
    fn one_control_planes_counts_are_its_own_and_the_same_as_in_all() {
        let m = crate::metrics::Metrics::new();
        let (tls, connect) = (m.listener("tls"), m.listener("connect"));
        tls.ended(&m, "a", "ok");
        tls.ended(&m, "a", "ok");
        tls.ended(&m, "a", "acl_denied");
        tls.ended(&m, "", "detect_failed");
        let _done = tls.routed(&m, "a", "tls-sni");
        let open = connect.routed(&m, "a", "http-connect");
        let _b = connect.routed(&m, "b", "http-connect");
        drop(_done);
        let all = Counts::of(&m.listeners(), None);
        let a = Counts::of(&m.listeners(), Some("a"));
        assert_eq!(a.outcomes["a"]["ok"], 2);
        assert_eq!(a.outcomes["a"]["acl_denied"], 1);
        assert_eq!(a.routed["a"]["tls / tls-sni"], 1);
        assert_eq!(a.routed["a"]["connect / http-connect"], 1);
        assert_eq!(a.open_by["a"].len(), 1, "{a:?}");
        assert_eq!(a.open_by["a"]["connect / http-connect"], 1);
        assert!(!a.routed.contains_key("b") && !a.outcomes.contains_key(""));
        assert_eq!(all.routed["b"]["connect / http-connect"], 1);
        for (name, per) in [
            ("outcomes", &a.outcomes),
            ("routed", &a.routed),
            ("open", &a.open_by),
        ] {
            let whole = match name {
                "outcomes" => &all.outcomes,
                "routed" => &all.routed,
                _ => &all.open_by,
            };
            assert_eq!(per.get("a"), whole.get("a"), "{name}");
        }
        drop(open);
        let a = Counts::of(&m.listeners(), Some("a"));
        assert!(a.open_by.is_empty(), "{a:?}");
        assert!(Counts::of(&m.listeners(), Some("none")).routed.is_empty());
        // Asked again for a listener's handles, the same ones: nothing is
        // counted twice.
        let again = m.listener("tls");
        assert!(std::sync::Arc::ptr_eq(&again, &tls));
        assert_eq!(Counts::of(&m.listeners(), Some("a")).outcomes["a"]["ok"], 2);
    }
}

#[cfg(test)]
mod query_tests {
    use super::only_control_plane;

    #[test]
    fn api_state_takes_one_control_plane_and_nothing_else() {
        assert_eq!(only_control_plane(None), Ok(None));
        assert_eq!(only_control_plane(Some("")), Ok(None));
        assert_eq!(
            only_control_plane(Some("control_plane=t-0.kube-apiserver")),
            Ok(Some("t-0.kube-apiserver".into()))
        );
        assert_eq!(
            only_control_plane(Some("control_plane=a%2Eb")),
            Ok(Some("a.b".into()))
        );
        assert!(only_control_plane(Some("control_plane=a&control_plane=b")).is_err());
        assert!(only_control_plane(Some("cluster=a")).is_err());
    }
}

#[cfg(test)]
mod state_of_tests {
    use std::sync::Arc;

    use seedlink_config::model::ControlPlane;

    const FILE: &str = "
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes:
  - {name: a, hostnames: [a.example], endpoints: ['127.0.0.1:1']}
  - {name: b, hostnames: [b.example], endpoints: ['127.0.0.1:2']}
";

    fn kube(name: &str) -> Arc<ControlPlane> {
        Arc::new(ControlPlane {
            name: name.into(),
            hostnames: vec![format!("{name}.example")],
            endpoints: vec!["127.0.0.1:3".into()],
            ..Default::default()
        })
    }

    /// The names and sources `api/state?control_plane=name` lists.
    fn listed(gw: &crate::Gateway, name: &str) -> Vec<(String, String)> {
        let s = super::state_of(gw, Some(name));
        let cps = s["control_planes"].as_array().cloned().unwrap_or_default();
        cps.iter()
            .map(|c| (c["name"].to_string(), c["source"].to_string()))
            .collect()
    }

    /// One control plane is found by name in either list, and the index
    /// follows each new snapshot.
    #[test]
    fn one_control_plane_is_found_in_every_snapshot() {
        let dir = std::env::temp_dir().join(format!("seedlink-state-of-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gateway.yaml");
        std::fs::write(&path, FILE).unwrap();
        let file = seedlink_config::compile::parse(FILE).unwrap();
        let snap = seedlink_config::compile(file, None).unwrap();
        let gw = crate::Gateway::new(snap, Some(path));
        let one = |n: &str, source: &str| vec![(format!("{n:?}"), format!("{source:?}"))];
        assert_eq!(listed(&gw, "b"), one("b", "file"));
        assert!(listed(&gw, "k").is_empty());
        let refused = gw.set_kubernetes(vec![kube("k"), kube("l")]);
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(listed(&gw, "k"), one("k", "kubernetes"));
        assert_eq!(listed(&gw, "l"), one("l", "kubernetes"));
        assert_eq!(listed(&gw, "a"), one("a", "file"));
        assert!(gw.set_kubernetes(vec![kube("l")]).is_empty());
        assert!(listed(&gw, "k").is_empty(), "gone with its snapshot");
        assert_eq!(listed(&gw, "l"), one("l", "kubernetes"));
        let all = super::state_of(&gw, None);
        assert_eq!(all["control_planes"].as_array().map(Vec::len), Some(3));
        let _ = std::fs::remove_dir_all(dir);
    }
}
