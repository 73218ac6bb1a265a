//! A Kubernetes API server stand-in, for tests of seedlink's Kubernetes
//! source where no kube-apiserver binary can run. It is written to the
//! API's documented semantics, not to what seedlink happens to send:
//!
//! - HTTPS with a bearer token per user (401 otherwise);
//! - `GET` of one object, list (`limit`/`continue` paging over the
//!   objects in key order) and watch (`watch=true`, from a
//!   `resourceVersion`, replaying later events, `BOOKMARK`s when
//!   `allowWatchBookmarks=true`, closed after `timeoutSeconds`);
//! - a watch from a `resourceVersion` older than the kept history gets an
//!   `ERROR` event with a `410 Expired` Status, as the real server sends;
//! - `POST` (409 AlreadyExists), `PUT` (409 Conflict when the body's
//!   `resourceVersion` is not the current one), `PATCH` with
//!   `application/merge-patch+json` (RFC 7386), `DELETE`;
//! - the `status` subresource on the kinds that have one: writes to the
//!   object ignore `status`, writes to `/status` change only `status`, and
//!   `metadata.generation` moves only when `spec` changes;
//! - label and field selectors are refused with 400 rather than ignored.
//!
//! Differences (documented, not hidden): a list continuation is served from
//! the current objects after the last key, not from a snapshot at the
//! list's revision; one global resourceVersion counter like etcd's.
//!
//! Test hooks: [`ApiServer::apply`], [`ApiServer::remove`],
//! [`ApiServer::get`], [`ApiServer::expire_watches`], [`ApiServer::stop`]
//! and [`ApiServer::start_again`] (same port, objects kept, as a restarted
//! API server with etcd behind it), and a log of writes per user.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// A kind the stand-in serves.
#[derive(Debug, Clone)]
struct Kind {
    /// `""` for the core group.
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    status: bool,
}

const KINDS: &[Kind] = &[
    Kind {
        group: "gateway.networking.k8s.io",
        version: "v1",
        plural: "gateways",
        kind: "Gateway",
        status: true,
    },
    Kind {
        group: "gateway.networking.k8s.io",
        version: "v1",
        plural: "referencegrants",
        kind: "ReferenceGrant",
        status: false,
    },
    Kind {
        group: "",
        version: "v1",
        plural: "namespaces",
        kind: "Namespace",
        status: true,
    },
    Kind {
        group: "gateway.networking.k8s.io",
        version: "v1",
        plural: "tlsroutes",
        kind: "TLSRoute",
        status: true,
    },
    Kind {
        group: "policy.seedlink.dev",
        version: "v1alpha1",
        plural: "seedlinkpolicies",
        kind: "SeedlinkPolicy",
        status: true,
    },
    Kind {
        group: "tunnel.seedlink.dev",
        version: "v1alpha1",
        plural: "tunnelclusters",
        kind: "TunnelCluster",
        status: true,
    },
    Kind {
        group: "",
        version: "v1",
        plural: "services",
        kind: "Service",
        status: true,
    },
    Kind {
        group: "",
        version: "v1",
        plural: "secrets",
        kind: "Secret",
        status: false,
    },
    Kind {
        group: "",
        version: "v1",
        plural: "configmaps",
        kind: "ConfigMap",
        status: false,
    },
    Kind {
        group: "",
        version: "v1",
        plural: "events",
        kind: "Event",
        status: false,
    },
    Kind {
        group: "discovery.k8s.io",
        version: "v1",
        plural: "endpointslices",
        kind: "EndpointSlice",
        status: false,
    },
    Kind {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        kind: "Lease",
        status: false,
    },
];

impl Kind {
    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// One change, as a watch sends it.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    plural: &'static str,
    namespace: String,
    type_: &'static str,
    object: Value,
}

/// A write the server accepted, for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The token's user.
    pub user: String,
    /// `POST`, `PUT`, `PATCH`, `DELETE`.
    pub method: String,
    /// The request path.
    pub path: String,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// (plural, namespace, name) → object.
    objects: BTreeMap<(String, String, String), Value>,
    history: Vec<Change>,
    /// Watches from below this revision get 410.
    oldest: u64,
    writes: Vec<Write>,
    uid: u64,
}

struct Shared {
    state: Mutex<State>,
    changes: broadcast::Sender<Change>,
    tokens: BTreeMap<String, String>,
    bookmark_every: Duration,
    /// Cancelled to end every open watch with 410.
    expire: Mutex<CancellationToken>,
}

/// A running stand-in.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    tls: tokio_rustls::TlsAcceptor,
    /// The CA that signed the server's certificate (PEM).
    pub ca_pem: String,
    running: Mutex<CancellationToken>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code
    });
    json_response(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &body,
    )
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = code;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

fn now() -> String {
    // RFC 3339 in UTC, second precision, as metadata timestamps are.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

impl State {
    fn record(
        &mut self,
        shared_tx: &broadcast::Sender<Change>,
        plural: &'static str,
        ns: &str,
        type_: &'static str,
        object: Value,
    ) {
        let c = Change {
            rv: self.rv,
            plural,
            namespace: ns.into(),
            type_,
            object,
        };
        self.history.push(c.clone());
        let _ = shared_tx.send(c);
    }
}

/// What a request path names.
struct Target {
    kind: &'static Kind,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn parse_path(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, status) = match rest {
        [p] => (*p, None, false),
        [p, n] => (*p, Some(n.to_string()), false),
        [p, n, "status"] => (*p, Some(n.to_string()), true),
        _ => return None,
    };
    let kind = KINDS
        .iter()
        .find(|k| k.group == group && k.version == version && k.plural == plural)?;
    if status && !kind.status {
        return None;
    }
    Some(Target {
        kind,
        namespace,
        name,
        status,
    })
}

fn query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k.to_string(), v.replace("%2F", "/").replace("%3D", "="))
        })
        .collect()
}

impl ApiServer {
    /// Starts on 127.0.0.1 (a free port) with `tokens` (token → user).
    pub async fn start(tokens: &[(&str, &str)]) -> ApiServer {
        let ca = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "stand-in CA");
        let ca_cert = ca_params.self_signed(&ca).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca);
        let cert = params.signed_by(&key, &issuer).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        let (changes, _) = broadcast::channel(4096);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 100,
                ..State::default()
            }),
            changes,
            tokens: tokens
                .iter()
                .map(|(t, u)| (t.to_string(), u.to_string()))
                .collect(),
            bookmark_every: Duration::from_secs(1),
            expire: Mutex::new(CancellationToken::new()),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = ApiServer {
            shared,
            addr,
            tls: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            ca_pem: ca_cert.pem(),
            running: Mutex::new(CancellationToken::new()),
        };
        server.serve(listener);
        server
    }

    /// `https://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Writes a kubeconfig for `token` into `dir`; returns its path.
    pub fn kubeconfig(&self, dir: &Path, token: &str) -> PathBuf {
        use base64_engine::encode;
        let path = dir.join(format!("kubeconfig-{token}"));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: {}\n    certificate-authority-data: {}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: c\n  context: {{cluster: standin, user: u}}\ncurrent-context: c\n",
            self.url(),
            encode(self.ca_pem.as_bytes())
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    fn serve(&self, listener: TcpListener) {
        let stop = lock(&self.running).clone();
        let shared = self.shared.clone();
        let tls = self.tls.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = tokio::select! {
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                    () = stop.cancelled() => return,
                };
                let (shared, tls, stop) = (shared.clone(), tls.clone(), stop.clone());
                tokio::spawn(async move {
                    let Ok(Ok(stream)) =
                        tokio::time::timeout(Duration::from_secs(10), tls.accept(tcp)).await
                    else {
                        return;
                    };
                    let svc = hyper::service::service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(handle(&shared, req).await) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        () = stop.cancelled() => {}
                    }
                });
            }
        });
    }

    /// Stops answering: the port is closed and every connection (watches
    /// included) dropped. Objects are kept.
    pub fn stop(&self) {
        lock(&self.running).cancel();
    }

    /// Serves again on the same port, with the same objects.
    pub async fn start_again(&self) {
        let listener = {
            let mut tries = 0;
            loop {
                match TcpListener::bind(self.addr).await {
                    Ok(l) => break l,
                    Err(e) if tries < 100 => {
                        tries += 1;
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("rebinding {}: {e}", self.addr),
                }
            }
        };
        *lock(&self.running) = CancellationToken::new();
        self.serve(listener);
    }

    /// Ends every open watch with `410 Expired` and forgets the history, so
    /// that resuming from an old revision gets 410 too: clients must re-list.
    pub fn expire_watches(&self) {
        {
            let mut st = lock(&self.shared.state);
            st.oldest = st.rv + 1;
            st.history.clear();
        }
        let old = std::mem::replace(&mut *lock(&self.shared.expire), CancellationToken::new());
        old.cancel();
    }

    /// Creates or replaces an object (as an administrator would with
    /// `kubectl apply`): metadata is filled in, `generation` moves with
    /// `spec`, and watchers see ADDED or MODIFIED.
    pub fn apply(&self, mut object: Value) {
        let api_version = object["apiVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let kind_name = object["kind"].as_str().unwrap_or_default().to_string();
        let kind = KINDS
            .iter()
            .find(|k| k.api_version() == api_version && k.kind == kind_name)
            .unwrap_or_else(|| panic!("the stand-in does not serve {api_version} {kind_name}"));
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut st = lock(&self.shared.state);
        st.rv += 1;
        let rv = st.rv;
        let key = (kind.plural.to_string(), ns.clone(), name);
        let type_ = match st.objects.get(&key) {
            Some(old) => {
                let generation = old["metadata"]["generation"].as_i64().unwrap_or(1)
                    + i64::from(old.get("spec") != object.get("spec"));
                object["metadata"] = old["metadata"].clone();
                object["metadata"]["generation"] = generation.into();
                if kind.status {
                    if let Some(s) = old.get("status") {
                        object["status"] = s.clone();
                    }
                }
                "MODIFIED"
            }
            None => {
                st.uid += 1;
                object["metadata"]["uid"] =
                    format!("00000000-0000-0000-0000-{:012}", st.uid).into();
                object["metadata"]["creationTimestamp"] = now().into();
                object["metadata"]["generation"] = 1.into();
                "ADDED"
            }
        };
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        st.objects.insert(key, object.clone());
        st.record(&self.shared.changes, kind.plural, &ns, type_, object);
    }

    /// Deletes an object (watchers see DELETED); whether it existed.
    pub fn remove(&self, plural: &str, namespace: &str, name: &str) -> bool {
        let kind = KINDS
            .iter()
            .find(|k| k.plural == plural)
            .unwrap_or_else(|| panic!("unknown kind {plural}"));
        let mut st = lock(&self.shared.state);
        let Some(mut obj) = st
            .objects
            .remove(&(plural.into(), namespace.into(), name.into()))
        else {
            return false;
        };
        st.rv += 1;
        obj["metadata"]["resourceVersion"] = st.rv.to_string().into();
        st.record(&self.shared.changes, kind.plural, namespace, "DELETED", obj);
        true
    }

    /// An object as stored.
    pub fn get(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.shared.state)
            .objects
            .get(&(plural.into(), namespace.into(), name.into()))
            .cloned()
    }

    /// Every accepted write so far.
    pub fn writes(&self) -> Vec<Write> {
        lock(&self.shared.state).writes.clone()
    }
}

async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|t| shared.tokens.get(t))
        .cloned();
    let Some(user) = user else {
        return status(401, "Unauthorized", "Unauthorized");
    };
    let path = req.uri().path().to_string();
    let q = query(req.uri().query().unwrap_or(""));
    for sel in ["labelSelector", "fieldSelector"] {
        if q.get(sel).is_some_and(|v| !v.is_empty()) {
            return status(
                400,
                "BadRequest",
                &format!("{sel} is not supported by the stand-in"),
            );
        }
    }
    let Some(t) = parse_path(&path) else {
        return status(
            404,
            "NotFound",
            &format!("the server could not find the requested resource ({path})"),
        );
    };
    let method = req.method().clone();
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return status(400, "BadRequest", "unreadable body"),
    };
    match (method, &t.name) {
        (Method::GET, None) if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) => {
            watch(shared, &t, &q)
        }
        (Method::GET, None) => list(shared, &t, &q),
        (Method::GET, Some(name)) => {
            let st = lock(&shared.state);
            match st.objects.get(&(
                t.kind.plural.into(),
                t.namespace.clone().unwrap_or_default(),
                name.clone(),
            )) {
                Some(o) => json_response(StatusCode::OK, o),
                None => status(
                    404,
                    "NotFound",
                    &format!("{} \"{name}\" not found", t.kind.plural),
                ),
            }
        }
        (m, _) => {
            let Ok(value) = serde_json::from_slice::<Value>(&body).or_else(|e| {
                if m == Method::DELETE && body.is_empty() {
                    Ok(Value::Null)
                } else {
                    Err(e)
                }
            }) else {
                return status(400, "BadRequest", "the body is not JSON");
            };
            let r = write(shared, &t, &m, &content_type, value);
            if r.status().is_success() {
                lock(&shared.state).writes.push(Write {
                    user,
                    method: m.to_string(),
                    path,
                });
            }
            r
        }
    }
}

fn list(shared: &Arc<Shared>, t: &Target, q: &BTreeMap<String, String>) -> Response<Body> {
    let st = lock(&shared.state);
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let after = q.get("continue").filter(|c| !c.is_empty()).cloned();
    let mut items = Vec::new();
    let mut more = false;
    let mut last = String::new();
    for ((plural, ns, name), o) in &st.objects {
        if plural != t.kind.plural || t.namespace.as_ref().is_some_and(|n| n != ns) {
            continue;
        }
        let key = format!("{ns}/{name}");
        if after.as_ref().is_some_and(|a| key.as_str() <= a.as_str()) {
            continue;
        }
        if limit.is_some_and(|l| items.len() >= l) {
            more = true;
            break;
        }
        last = key;
        items.push(o.clone());
    }
    let mut meta = json!({"resourceVersion": st.rv.to_string()});
    if more {
        meta["continue"] = last.into();
    }
    json_response(
        StatusCode::OK,
        &json!({"kind": format!("{}List", t.kind.kind), "apiVersion": t.kind.api_version(), "metadata": meta, "items": items}),
    )
}

fn watch(shared: &Arc<Shared>, t: &Target, q: &BTreeMap<String, String>) -> Response<Body> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(256);
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true" || v == "1");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let line = |v: Value| Bytes::from(format!("{v}\n"));
    let (backlog, mut live, expired, rv_now) = {
        let st = lock(&shared.state);
        let live = shared.changes.subscribe();
        if from != 0 && from < st.oldest {
            (Vec::new(), live, true, st.rv)
        } else if from == 0 {
            // "Any" semantics: the current objects as ADDED, then changes.
            let objs: Vec<Value> = st
                .objects
                .iter()
                .filter(|((p, ns, _), _)| {
                    p == t.kind.plural && t.namespace.as_ref().is_none_or(|n| n == ns)
                })
                .map(|(_, o)| json!({"type": "ADDED", "object": o}))
                .collect();
            (objs, live, false, st.rv)
        } else {
            let h: Vec<Value> = st
                .history
                .iter()
                .filter(|c| {
                    c.rv > from
                        && c.plural == t.kind.plural
                        && t.namespace.as_ref().is_none_or(|n| *n == c.namespace)
                })
                .map(|c| json!({"type": c.type_, "object": c.object}))
                .collect();
            (h, live, false, st.rv)
        }
    };
    let plural = t.kind.plural;
    let namespace = t.namespace.clone();
    let api_version = t.kind.api_version();
    let kind = t.kind.kind;
    let expire = lock(&shared.expire).clone();
    let every = shared.bookmark_every;
    tokio::spawn(async move {
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410}});
        if expired {
            let _ = tx.send(line(gone)).await;
            return;
        }
        for e in backlog {
            if tx.send(line(e)).await.is_err() {
                return;
            }
        }
        let mut seen = rv_now.max(from);
        let end = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                c = live.recv() => match c {
                    Ok(c) => {
                        if c.rv <= seen || c.plural != plural || namespace.as_ref().is_some_and(|n| *n != c.namespace) {
                            continue;
                        }
                        seen = c.rv;
                        if tx.send(line(json!({"type": c.type_, "object": c.object}))).await.is_err() {
                            return;
                        }
                    }
                    // Fell behind: the real server ends such a watch too.
                    Err(_) => { let _ = tx.send(line(gone)).await; return; }
                },
                _ = tick.tick(), if bookmarks => {
                    let b = json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                        "metadata": {"resourceVersion": seen.to_string()}}});
                    if tx.send(line(b)).await.is_err() {
                        return;
                    }
                }
                () = expire.cancelled() => { let _ = tx.send(line(gone)).await; return; }
                () = tokio::time::sleep_until(end) => return,
            }
        }
    });
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|b| b.map(|b| Ok::<_, Infallible>(Frame::data(b))))
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn write(
    shared: &Arc<Shared>,
    t: &Target,
    m: &Method,
    content_type: &str,
    body: Value,
) -> Response<Body> {
    let ns = t.namespace.clone().unwrap_or_default();
    let mut st = lock(&shared.state);
    match (m, &t.name) {
        (&Method::POST, None) => {
            let Some(name) = body["metadata"]["name"].as_str().map(str::to_string) else {
                return status(422, "Invalid", "metadata.name: Required value");
            };
            let key = (t.kind.plural.to_string(), ns.clone(), name.clone());
            if st.objects.contains_key(&key) {
                return status(
                    409,
                    "AlreadyExists",
                    &format!("{} \"{name}\" already exists", t.kind.plural),
                );
            }
            let mut o = body;
            o["apiVersion"] = t.kind.api_version().into();
            o["kind"] = t.kind.kind.into();
            if !ns.is_empty() {
                o["metadata"]["namespace"] = ns.clone().into();
            }
            st.rv += 1;
            st.uid += 1;
            o["metadata"]["uid"] = format!("00000000-0000-0000-0000-{:012}", st.uid).into();
            o["metadata"]["creationTimestamp"] = now().into();
            o["metadata"]["resourceVersion"] = st.rv.to_string().into();
            if t.kind.status {
                o["metadata"]["generation"] = 1.into();
                if let Some(m) = o.as_object_mut() {
                    m.remove("status");
                }
            }
            st.objects.insert(key, o.clone());
            st.record(&shared.changes, t.kind.plural, &ns, "ADDED", o.clone());
            json_response(StatusCode::CREATED, &o)
        }
        (_, Some(name)) => {
            let key = (t.kind.plural.to_string(), ns.clone(), name.clone());
            let Some(old) = st.objects.get(&key).cloned() else {
                return status(
                    404,
                    "NotFound",
                    &format!("{} \"{name}\" not found", t.kind.plural),
                );
            };
            if *m == Method::DELETE {
                st.objects.remove(&key);
                st.rv += 1;
                let mut o = old;
                o["metadata"]["resourceVersion"] = st.rv.to_string().into();
                st.record(&shared.changes, t.kind.plural, &ns, "DELETED", o.clone());
                return json_response(StatusCode::OK, &o);
            }
            let mut new = match *m {
                Method::PUT => {
                    let sent = body["metadata"]["resourceVersion"].as_str().unwrap_or("");
                    if !sent.is_empty()
                        && sent != old["metadata"]["resourceVersion"].as_str().unwrap_or("")
                    {
                        return status(409, "Conflict", &format!(
                            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                            t.kind.plural
                        ));
                    }
                    body
                }
                Method::PATCH if content_type.starts_with("application/merge-patch+json") => {
                    let mut o = old.clone();
                    merge(&mut o, &body);
                    o
                }
                Method::PATCH => {
                    return status(
                        415,
                        "UnsupportedMediaType",
                        &format!("the stand-in only takes merge patches, not {content_type}"),
                    );
                }
                _ => return status(405, "MethodNotAllowed", "method not allowed"),
            };
            // Identity and server-set metadata are the server's.
            for k in ["uid", "creationTimestamp", "name", "namespace"] {
                new["metadata"][k] = old["metadata"][k].clone();
            }
            new["apiVersion"] = t.kind.api_version().into();
            new["kind"] = t.kind.kind.into();
            if t.kind.status {
                if t.status {
                    // The status subresource changes status only.
                    let s = new.get("status").cloned();
                    new = old.clone();
                    match s {
                        Some(s) => new["status"] = s,
                        None => {
                            if let Some(m) = new.as_object_mut() {
                                m.remove("status");
                            }
                        }
                    }
                } else {
                    match old.get("status") {
                        Some(s) => new["status"] = s.clone(),
                        None => {
                            if let Some(m) = new.as_object_mut() {
                                m.remove("status");
                            }
                        }
                    }
                    let generation = old["metadata"]["generation"].as_i64().unwrap_or(1)
                        + i64::from(old.get("spec") != new.get("spec"));
                    new["metadata"]["generation"] = generation.into();
                }
            }
            if new == old {
                // A no-op write does not move resourceVersion.
                return json_response(StatusCode::OK, &old);
            }
            st.rv += 1;
            new["metadata"]["resourceVersion"] = st.rv.to_string().into();
            st.objects.insert(key, new.clone());
            st.record(&shared.changes, t.kind.plural, &ns, "MODIFIED", new.clone());
            json_response(StatusCode::OK, &new)
        }
        _ => status(405, "MethodNotAllowed", "method not allowed"),
    }
}

/// Base64, for a Secret's `data`.
pub fn base64(data: &[u8]) -> String {
    base64_engine::encode(data)
}

/// Base64 for the kubeconfig and Secrets, hand-written: a dozen lines do
/// not justify a dependency in the test kit.
mod base64_engine {
    pub fn encode(data: &[u8]) -> String {
        const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for c in data.chunks(3) {
            let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= c.len() {
                    out.push(T[(n >> (18 - 6 * i)) as usize & 63] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }
}
