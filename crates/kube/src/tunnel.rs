//! From `TunnelCluster` objects to the tunnel-server's clusters: each
//! becomes a cluster `<namespace>.<name>` whose trust (agent CA bundle,
//! token issuer keys, frontend certificates) is read from the Secrets and
//! ConfigMaps it names. The keys are written into a private directory
//! (`trust_dir/<cluster>/`, files 0600, replaced atomically and only when
//! their bytes change), so that everything after the model — validation,
//! file checks, the reload diff, re-keying agents — is the file path's.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The label a Secret or ConfigMap needs for the tunnel-server to read it
/// (`seedlink.dev/tunnel-trust=true`): it watches no other.
pub const TRUST_LABEL: &str = "seedlink.dev/tunnel-trust";

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use seedlink_config::tunnel::{Cluster, ClusterLimits, Frontend, FrontendProtocol, TokenAuth};

use crate::crd::{KeyRef, TunnelCluster};
use crate::translate::{Key, Verdict};

/// What became of one TunnelCluster.
#[derive(Debug, Clone, PartialEq)]
pub struct TunnelOutcome {
    /// The object.
    pub key: Key,
    /// Its `metadata.generation`.
    pub generation: Option<i64>,
    /// The cluster it became, if it could be built.
    pub cluster: Option<String>,
    /// `Ready` (before the server's own checks; see [`TunnelTranslation::refused`]).
    pub ready: Verdict,
}

/// Clusters, the files their trust is read from, and per-object outcomes.
#[derive(Debug, Default)]
pub struct TunnelTranslation {
    /// Clusters, oldest object first (the oldest wins a collision).
    pub clusters: Vec<Cluster>,
    /// Path → contents, under the trust directory.
    pub files: BTreeMap<PathBuf, Vec<u8>>,
    /// Per object.
    pub outcomes: Vec<TunnelOutcome>,
}

impl TunnelTranslation {
    /// Marks the clusters the server refused as not ready.
    pub fn refused(&mut self, refused: &[(String, Vec<seedlink_config::ConfigError>)]) {
        for (name, problems) in refused {
            let text: Vec<String> = problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect();
            for o in &mut self.outcomes {
                if o.cluster.as_deref() == Some(name.as_str()) {
                    o.ready = Verdict::no("Invalid", text.join("; "));
                    o.cluster = None;
                }
            }
        }
        self.clusters
            .retain(|c| !refused.iter().any(|(n, _)| *n == c.name));
    }
}

/// The cluster a TunnelCluster becomes: `<namespace>.<name>`.
pub fn cluster_name(key: &Key) -> String {
    format!("{}.{}", key.namespace, key.name)
}

fn age<K: kube::Resource>(o: &K) -> (Option<k8s_openapi::jiff::Timestamp>, Key) {
    (
        o.meta().creation_timestamp.as_ref().map(|t| t.0),
        Key::of(o),
    )
}

/// Reads Secret and ConfigMap keys for one object, recording the files.
struct Keys<'a> {
    namespace: &'a str,
    dir: PathBuf,
    secrets: &'a HashMap<Key, &'a Secret>,
    config_maps: &'a HashMap<Key, &'a ConfigMap>,
    files: BTreeMap<PathBuf, Vec<u8>>,
}

impl Keys<'_> {
    /// Writes the key a reference names into the cluster's directory (in
    /// memory, for now): its path.
    fn file(&mut self, r: &KeyRef, what: &str) -> Result<PathBuf, Verdict> {
        let (bytes, source) = match (&r.secret, &r.config_map) {
            (Some(s), None) => (self.secret_key(s, &r.key, what)?, format!("secret-{s}")),
            (None, Some(c)) => (
                self.config_map_key(c, &r.key, what)?,
                format!("configmap-{c}"),
            ),
            _ => {
                return Err(Verdict::no(
                    "InvalidSpec",
                    format!("{what}: exactly one of secret and configMap"),
                ))
            }
        };
        // Names and keys are DNS subdomains / key names: no '/' in them.
        let path = self
            .dir
            .join(format!("{source}-{}", r.key.replace('/', "_")));
        self.files.insert(path.clone(), bytes);
        Ok(path)
    }

    fn key(&self, name: &str) -> Key {
        Key {
            namespace: self.namespace.into(),
            name: name.to_string(),
        }
    }

    /// Key `k` of Secret `name` (labelled as trust, in the namespace).
    fn secret_key(&self, name: &str, k: &str, what: &str) -> Result<Vec<u8>, Verdict> {
        let key = self.key(name);
        let secret = self
            .secrets
            .get(&key)
            .ok_or_else(|| not_found(what, "Secret", &key))?;
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .ok_or_else(|| no_key(what, "Secret", &key, k))
    }

    /// Key `k` of ConfigMap `name` (text or binary).
    fn config_map_key(&self, name: &str, k: &str, what: &str) -> Result<Vec<u8>, Verdict> {
        let key = self.key(name);
        let cm = self
            .config_maps
            .get(&key)
            .ok_or_else(|| not_found(what, "ConfigMap", &key))?;
        cm.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|s| s.as_bytes().to_vec())
            .or_else(|| {
                cm.binary_data
                    .as_ref()
                    .and_then(|d| d.get(k))
                    .map(|b| b.0.clone())
            })
            .ok_or_else(|| no_key(what, "ConfigMap", &key, k))
    }
}

/// A trust object without the key a reference names.
fn no_key(what: &str, kind: &str, key: &Key, k: &str) -> Verdict {
    Verdict::no(
        "ReferenceNotFound",
        format!("{what}: {kind} {key} has no key {k:?}"),
    )
}

/// A trust object that is not there (or not readable by seedlink).
fn not_found(what: &str, kind: &str, key: &Key) -> Verdict {
    Verdict::no(
        "ReferenceNotFound",
        format!("{what}: {kind} {key} not found (it needs the label {TRUST_LABEL}=true, and seedlink a RoleBinding of seedlink-tunnel-trust in its namespace, or with trust_watch: cluster the ClusterRoleBinding)"),
    )
}

/// What the operator allows every TunnelCluster at most.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bounds {
    /// Ceilings over each cluster's limits.
    pub max_limits: ClusterLimits,
    /// Addresses a TokenReview URL may name besides the namespace's own
    /// Services.
    pub review_cidrs: Vec<ipnet::IpNet>,
}

/// Translates every TunnelCluster (oldest first).
pub fn translate(
    objects: &[Arc<TunnelCluster>],
    secrets: &[Arc<Secret>],
    config_maps: &[Arc<ConfigMap>],
    trust_dir: &Path,
    socket_dir: &Path,
    bounds: &Bounds,
) -> TunnelTranslation {
    let secrets: HashMap<Key, &Secret> = secrets
        .iter()
        .map(|s| (Key::of(s.as_ref()), s.as_ref()))
        .collect();
    let config_maps: HashMap<Key, &ConfigMap> = config_maps
        .iter()
        .map(|c| (Key::of(c.as_ref()), c.as_ref()))
        .collect();
    let mut objects: Vec<&Arc<TunnelCluster>> = objects.iter().collect();
    objects.sort_by_cached_key(|o| age(o.as_ref()));
    let mut out = TunnelTranslation::default();
    for o in objects {
        let key = Key::of(o.as_ref());
        let name = cluster_name(&key);
        let mut keys = Keys {
            namespace: &key.namespace,
            dir: trust_dir.join(&name),
            secrets: &secrets,
            config_maps: &config_maps,
            files: BTreeMap::new(),
        };
        let built = build(o, &name, &mut keys, &socket_dir.join(&name), bounds);
        let (cluster, ready) = match built {
            Ok(cluster) => {
                // `extend`, not `append`: append merges the whole map
                // each time (tenants²).
                out.files.extend(std::mem::take(&mut keys.files));
                out.clusters.push(cluster);
                let ready = Verdict::yes("Serving", "trust loaded and frontends listening");
                (Some(name), ready)
            }
            Err(v) => (None, v),
        };
        out.outcomes.push(TunnelOutcome {
            key,
            generation: o.metadata.generation,
            cluster,
            ready,
        });
    }
    out
}

/// Where a TunnelCluster's Unix socket `unix` goes: a plain file name,
/// placed in the cluster's own directory `sockets` (`<socket_dir>/<cluster>/`),
/// or that same path written out. Anything else could remove and take over
/// another cluster's socket or any file the server may write, and is
/// refused.
fn confine(sockets: &Path, unix: &str) -> Result<PathBuf, String> {
    let file = match Path::new(unix).strip_prefix(sockets) {
        Ok(rest) => rest.to_str().unwrap_or_default(),
        Err(_) => unix,
    };
    let ok = (1..=64).contains(&file.len())
        && !file.starts_with('.')
        && file
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    // sun_path holds 108 bytes with its NUL.
    if ok && sockets.join(file).as_os_str().len() > 107 {
        return Err(format!(
            "{:?} is longer than a Unix socket path may be (107 bytes)",
            sockets.join(file)
        ));
    }
    if ok {
        Ok(sockets.join(file))
    } else {
        Err(format!(
            "{unix:?} is not a socket file name (1-64 of a-z A-Z 0-9 . - _, not starting with a dot); it is created in {}",
            sockets.display()
        ))
    }
}

/// A TunnelCluster's limits under the operator's `ceiling`: each value the
/// tenant sets can lower its ceiling, never raise it; absent, 0 (which
/// would switch a limit off) or negative means the ceiling itself. A
/// ceiling of 0 (off) leaves the tenant's value.
fn within(spec: Option<&crate::crd::LimitsSpec>, ceiling: &ClusterLimits) -> ClusterLimits {
    let size = |t: Option<u64>, c: usize| match t.map(|v| usize::try_from(v).unwrap_or(usize::MAX))
    {
        None | Some(0) => c,
        Some(t) if c == 0 => t,
        Some(t) => t.min(c),
    };
    let rate = |t: Option<f64>, c: f64| match t {
        Some(t) if t > 0.0 && (c <= 0.0 || t < c) => t,
        _ => c,
    };
    ClusterLimits {
        max_connections: size(
            spec.and_then(|l| l.max_connections),
            ceiling.max_connections,
        ),
        max_agents: size(spec.and_then(|l| l.max_agents), ceiling.max_agents),
        dial_rate: rate(spec.and_then(|l| l.dial_rate), ceiling.dial_rate),
        dial_burst: rate(spec.and_then(|l| l.dial_burst), ceiling.dial_burst),
        max_queued_bytes: size(
            spec.and_then(|l| l.max_queued_bytes),
            ceiling.max_queued_bytes,
        ),
    }
}

fn build(
    o: &TunnelCluster,
    name: &str,
    keys: &mut Keys<'_>,
    sockets: &Path,
    bounds: &Bounds,
) -> Result<Cluster, Verdict> {
    let (ceiling, review_cidrs) = (&bounds.max_limits, &bounds.review_cidrs[..]);
    let spec = &o.spec;
    let agent_ca = spec
        .agent_ca
        .as_ref()
        .map(|r| keys.file(r, "agentCA"))
        .transpose()?;
    let agent_token = spec
        .agent_token
        .as_ref()
        .map(|t| agent_token(t, keys, review_cidrs))
        .transpose()?;
    let frontends = spec
        .frontends
        .iter()
        .enumerate()
        .map(|(i, f)| frontend(&format!("frontends[{i}] ({})", f.name), f, keys, sockets))
        .collect::<Result<Vec<_>, _>>()?;
    let limits = within(spec.limits.as_ref(), ceiling);
    let seed_destinations = seed_services(&spec.seed_services, keys.namespace)?;
    Ok(Cluster {
        name: name.into(),
        agent_ca,
        agent_token,
        strategies: if spec.strategies.is_empty() {
            vec!["default".into()]
        } else {
            spec.strategies.clone()
        },
        frontends,
        proxy_password_file: None,
        frontend_client_uri: control_plane(o).map(seedlink_config::tunnel::control_plane_uri),
        limits,
        seed_destinations,
    })
}

/// A TunnelCluster's seed Services as seed destinations: each a Service
/// of `namespace` (the object's own; the spec cannot name another),
/// asked for as `<name>.<namespace>.svc` and dialled at its ClusterIP.
fn seed_services(
    services: &[crate::crd::SeedServiceSpec],
    namespace: &str,
) -> Result<Vec<seedlink_config::tunnel::SeedDestination>, Verdict> {
    use seedlink_config::tunnel::MAX_SEED_DESTINATIONS;
    if services.len() > MAX_SEED_DESTINATIONS {
        return Err(Verdict::no(
            "InvalidSpec",
            format!("seedServices: at most {MAX_SEED_DESTINATIONS}"),
        ));
    }
    services
        .iter()
        .map(|s| seed_service(s, namespace))
        .collect()
}

/// One seed Service of `namespace` as a seed destination.
fn seed_service(
    s: &crate::crd::SeedServiceSpec,
    namespace: &str,
) -> Result<seedlink_config::tunnel::SeedDestination, Verdict> {
    let label = (1..=63).contains(&s.name.len())
        && s.name.starts_with(|c: char| c.is_ascii_lowercase())
        && !s.name.ends_with('-')
        && s.name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !label {
        return Err(Verdict::no(
            "InvalidSpec",
            format!("seedServices: {:?} is not a Service name", s.name),
        ));
    }
    if s.ports.is_empty() || s.ports.len() > 16 || s.ports.contains(&0) {
        return Err(Verdict::no(
            "InvalidSpec",
            format!("seedServices {}: 1 to 16 ports, none 0", s.name),
        ));
    }
    Ok(seedlink_config::tunnel::SeedDestination {
        host: format!("{}.{namespace}.svc", s.name),
        ports: s.ports.clone(),
        addresses: Vec::new(),
        service: Some(format!("{namespace}/{}", s.name)),
    })
}

/// Whether a TunnelCluster names a Secret, and whether a ConfigMap.
pub fn references(spec: &crate::crd::TunnelClusterSpec) -> (bool, bool) {
    let token = spec.agent_token.as_ref();
    let review = token.and_then(|t| t.review.as_ref());
    let refs = spec
        .agent_ca
        .iter()
        .chain(token.and_then(|t| t.keys.as_ref()))
        .chain(review.map(|r| &r.ca))
        .chain(
            spec.frontends
                .iter()
                .filter_map(|f| f.tls.as_ref().map(|t| &t.client_ca)),
        );
    let (mut secret, mut config_map) = (false, false);
    for r in refs {
        secret |= r.secret.is_some();
        config_map |= r.config_map.is_some();
    }
    secret |= review.is_some() || spec.frontends.iter().any(|f| f.tls.is_some());
    (secret, config_map)
}

/// The UID of the `SeedlinkControlPlane` that generated `o` (its
/// controlling owner), if one did. Its kube-apiserver's certificate names
/// that UID; an owner reference a tenant writes by hand can only narrow
/// which certificates select its own cluster.
fn control_plane(o: &TunnelCluster) -> Option<&str> {
    o.metadata
        .owner_references
        .as_deref()?
        .iter()
        .find(|r| {
            r.controller == Some(true)
                && r.kind == "SeedlinkControlPlane"
                && r.api_version.starts_with("seedlink.dev/")
        })
        .map(|r| r.uid.as_str())
}

/// A TunnelCluster's `agentToken`, its keys' or its review's files named
/// in `keys`.
fn agent_token(
    t: &crate::crd::AgentToken,
    keys: &mut Keys<'_>,
    review_cidrs: &[ipnet::IpNet],
) -> Result<TokenAuth, Verdict> {
    let (local, review) = match (&t.keys, &t.review) {
        (Some(k), None) => (Some(keys.file(k, "agentToken.keys")?), None),
        (None, Some(r)) => (None, Some(token_review(r, keys, review_cidrs)?)),
        _ => {
            return Err(Verdict::no(
                "InvalidSpec",
                "agentToken: exactly one of keys (a local check) and review (a TokenReview)",
            ))
        }
    };
    Ok(TokenAuth {
        issuer: t.issuer.clone(),
        keys: local,
        review,
        audience: t
            .audience
            .clone()
            .unwrap_or_else(|| "system:konnectivity-server".into()),
        service_account: t
            .service_account
            .clone()
            .unwrap_or_else(|| "kube-system/konnectivity-agent".into()),
    })
}

/// A TunnelCluster's `agentToken.review`: the URL (a Service of the
/// object's own namespace, or an address the operator allows), the CA and
/// the credentials from the namespace's labelled Secret. The tunnel-server
/// never sends its own identity there: a tenant chooses where it goes.
fn token_review(
    r: &crate::crd::TokenReviewSpec,
    keys: &mut Keys<'_>,
    review_cidrs: &[ipnet::IpNet],
) -> Result<seedlink_config::tunnel::TokenReview, Verdict> {
    review_url(&r.url, keys.namespace, review_cidrs)
        .map_err(|why| Verdict::no("InvalidSpec", format!("agentToken.review.url: {why}")))?;
    let ca = keys.file(&r.ca, "agentToken.review.ca")?;
    let (token_file, cert, key) = review_credentials(&r.credentials, keys)?;
    Ok(seedlink_config::tunnel::TokenReview {
        url: r.url.clone(),
        ca,
        token_file,
        cert,
        key,
        timeout: std::time::Duration::from_secs(5),
        cache_ttl: std::time::Duration::from_secs(60),
    })
}

/// The review's credentials, from Secret `name` of the namespace: its
/// `token` as a bearer token file, else its `tls.crt` and `tls.key`.
#[allow(clippy::type_complexity)]
fn review_credentials(
    name: &str,
    keys: &mut Keys<'_>,
) -> Result<(Option<PathBuf>, Option<PathBuf>, Option<PathBuf>), Verdict> {
    let what = "agentToken.review.credentials";
    let secret = |k: &str| crate::crd::KeyRef {
        secret: Some(name.to_string()),
        config_map: None,
        key: k.to_string(),
    };
    let has = |k: &str| keys.secret_key(name, k, what).is_ok();
    if has("token") {
        return Ok((Some(keys.file(&secret("token"), what)?), None, None));
    }
    if has("tls.crt") && has("tls.key") {
        let cert = keys.file(&secret("tls.crt"), what)?;
        return Ok((None, Some(cert), Some(keys.file(&secret("tls.key"), what)?)));
    }
    let k = keys.key(name);
    if !keys.secrets.contains_key(&k) {
        return Err(not_found(what, "Secret", &k));
    }
    Err(Verdict::no(
        "InvalidSpec",
        format!("{what}: Secret {name} holds neither token nor tls.crt and tls.key"),
    ))
}

/// Whether a TunnelCluster of namespace `ns` may have its tokens reviewed
/// at `url`: `https://`, no user or path, and a host that is a Service of
/// `ns` (`<service>.<ns>.svc`, optionally `.cluster.local`) or an IP
/// address inside `cidrs` (the operator's `kubernetes.review_cidrs`).
/// Anything else would have the tunnel-server connect wherever a tenant
/// points it.
fn review_url(url: &str, ns: &str, cidrs: &[ipnet::IpNet]) -> Result<(), String> {
    let host = url_host(url)?;
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = literal.parse::<std::net::IpAddr>() {
        return if cidrs.iter().any(|c| c.contains(&ip)) {
            Ok(())
        } else {
            Err(format!(
                "{ip} is not within the operator's kubernetes.review_cidrs"
            ))
        };
    }
    let host = host.to_ascii_lowercase();
    let service = host
        .strip_suffix(".cluster.local")
        .unwrap_or(&host)
        .strip_suffix(&format!(".{ns}.svc"))
        .unwrap_or("");
    if dns_label(service) {
        Ok(())
    } else {
        Err(format!(
            "{host:?} is neither a Service of this namespace (<service>.{ns}.svc) nor an address the operator allows"
        ))
    }
}

/// Whether `v` is a DNS label (a Service's name).
fn dns_label(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The host of `https://host[:port][/]` (an IPv6 address in brackets),
/// or why the URL is not of that form.
fn url_host(url: &str) -> Result<&str, String> {
    let authority = url
        .strip_prefix("https://")
        .ok_or("not https://")?
        .trim_end_matches('/');
    if authority.contains(['/', '@', '?', '#']) || authority.is_empty() {
        return Err(format!("{url:?}: only https://host[:port]"));
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && p.parse::<u16>().is_ok() => Ok(h),
        Some((h, _)) if h.ends_with(']') || !h.contains(':') => {
            Err(format!("{url:?}: the port is not a number"))
        }
        _ => Ok(authority),
    }
}

/// One frontend of a TunnelCluster (`at` names it in refusals), its TLS
/// files named in `keys` and its Unix socket confined to `sockets`.
fn frontend(
    at: &str,
    f: &crate::crd::FrontendSpec,
    keys: &mut Keys<'_>,
    sockets: &Path,
) -> Result<Frontend, Verdict> {
    let invalid = |what: String| Verdict::no("InvalidSpec", what);
    let protocol: FrontendProtocol =
        serde_json::from_value(serde_json::Value::String(f.protocol.clone())).map_err(|_| {
            invalid(format!(
                "{at}.protocol: {:?} is not http-connect, grpc, http-proxy or socks5",
                f.protocol
            ))
        })?;
    let tcp = f
        .tcp
        .as_ref()
        .map(|a| {
            a.parse()
                .map_err(|_| invalid(format!("{at}.tcp: {a:?} is not an ip:port address")))
        })
        .transpose()?;
    let (cert, key, client_ca) = match &f.tls {
        None => (None, None, None),
        Some(tls) => {
            let (cert, key, ca) = tls_files(at, tls, keys)?;
            (Some(cert), Some(key), Some(ca))
        }
    };
    let unix = f
        .unix
        .as_deref()
        .map(|u| confine(sockets, u))
        .transpose()
        .map_err(|why| invalid(format!("{at}.unix: {why}")))?;
    Ok(Frontend {
        name: f.name.clone(),
        protocol,
        unix,
        tcp,
        cert,
        key,
        client_ca,
    })
}

/// A frontend's certificate, key (both from its TLS Secret) and client CA.
fn tls_files(
    at: &str,
    tls: &crate::crd::FrontendTls,
    keys: &mut Keys<'_>,
) -> Result<(PathBuf, PathBuf, PathBuf), Verdict> {
    let r = |k: &str| KeyRef {
        secret: Some(tls.secret.clone()),
        config_map: None,
        key: k.into(),
    };
    Ok((
        keys.file(&r("tls.crt"), &format!("{at}.tls"))?,
        keys.file(&r("tls.key"), &format!("{at}.tls"))?,
        keys.file(&tls.client_ca, &format!("{at}.tls.clientCA"))?,
    ))
}

/// Replaces `path` by a file (0600) holding `bytes`, by a rename; its
/// readers in this process are told (`seedlink_net::written`): this
/// directory is written only here, so what they read from a file stands
/// until it is written again.
fn replace_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp~");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    let renamed = std::fs::rename(&tmp, path);
    // Even a failed rename may have replaced it.
    seedlink_net::written::wrote(path);
    renamed
}

/// [`materialize`], knowing the files `written` last time (`None`:
/// unknown, so every file is read and the directory swept): only the
/// files whose bytes differ from what was written are written, and only
/// those no longer named are removed (with their directory once empty).
/// A pass then costs what changed, not a read of every cluster's files.
/// `Ok(true)` when a sweep found a file that was not what was written
/// last (changed or removed from outside) and put it back: what the server
/// read from it meanwhile is to be read again.
pub fn materialize_since(
    trust_dir: &Path,
    files: &BTreeMap<PathBuf, Vec<u8>>,
    written: Option<&BTreeMap<PathBuf, Vec<u8>>>,
) -> std::io::Result<bool> {
    use std::os::unix::fs::DirBuilderExt;
    let Some(written) = written else {
        return materialize(trust_dir, files);
    };
    for (path, bytes) in files.iter().filter(|(p, b)| written.get(*p) != Some(*b)) {
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        replace_file(path, bytes)?;
    }
    for path in written.keys().filter(|p| !files.contains_key(*p)) {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => seedlink_net::written::removed(path),
        }
        // Its cluster's directory goes with its last file.
        if let Some(dir) = path.parent().filter(|d| *d != trust_dir) {
            let _ = std::fs::remove_dir(dir);
        }
    }
    Ok(false)
}

/// Writes `files` under `trust_dir` (0700 directories, 0600 files, each
/// replaced by a rename and only when its bytes change) and removes what
/// no cluster names any more; `Ok(true)` when it wrote a file that was
/// there with other bytes, or missing.
pub fn materialize(trust_dir: &Path, files: &BTreeMap<PathBuf, Vec<u8>>) -> std::io::Result<bool> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(trust_dir)?;
    let mut rewrote = false;
    for (path, bytes) in files {
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        if std::fs::read(path).is_ok_and(|old| old == *bytes) {
            seedlink_net::written::known(path);
            continue;
        }
        replace_file(path, bytes)?;
        rewrote = true;
    }
    // Stale files and directories of removed clusters.
    for dir in std::fs::read_dir(trust_dir)?.flatten() {
        let dir = dir.path();
        if !dir.is_dir() {
            continue;
        }
        let mut kept = false;
        for f in std::fs::read_dir(&dir)?.flatten() {
            if files.contains_key(&f.path()) {
                kept = true;
            } else {
                std::fs::remove_file(f.path())?;
                seedlink_net::written::removed(&f.path());
            }
        }
        if !kept {
            std::fs::remove_dir(&dir)?;
        }
    }
    Ok(rewrote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(ns: &str, spec: serde_json::Value) -> Arc<TunnelCluster> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "tunnel.seedlink.dev/v1alpha1", "kind": "TunnelCluster",
                "metadata": {"name": "tunnel", "namespace": ns, "generation": 2},
                "spec": spec
            }))
            .unwrap(),
        )
    }

    fn secret(ns: &str, name: &str, key: &str, value: &str) -> Arc<Secret> {
        let mut data = std::collections::BTreeMap::new();
        data.insert(
            key.to_string(),
            k8s_openapi::ByteString(value.as_bytes().to_vec()),
        );
        Arc::new(Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                ..Default::default()
            },
            data: Some(data),
            ..Default::default()
        })
    }

    /// A TunnelCluster's seed Services are its own namespace's: the name
    /// is pinned to it (the spec has no namespace), and a name that is no
    /// Service name (a dot, a slash: another namespace) is refused.
    #[test]
    fn seed_services_are_the_objects_own_namespaces() {
        let svc = |name: &str, ports: &[u16]| crate::crd::SeedServiceSpec {
            name: name.into(),
            ports: ports.to_vec(),
        };
        let d = seed_services(&[svc("hooks", &[443, 8443])], "shoot--a").unwrap();
        assert_eq!(d[0].host, "hooks.shoot--a.svc");
        assert_eq!(d[0].service.as_deref(), Some("shoot--a/hooks"));
        assert_eq!(d[0].ports, vec![443, 8443]);
        assert!(d[0].addresses.is_empty());
        for bad in [
            "hooks.shoot--b",
            "shoot--b/hooks",
            "Hooks",
            "-x",
            "x-",
            "",
            "1x",
        ] {
            assert!(
                seed_services(&[svc(bad, &[443])], "shoot--a").is_err(),
                "{bad:?}"
            );
        }
        assert!(seed_services(&[svc("hooks", &[])], "shoot--a").is_err());
        assert!(seed_services(&[svc("hooks", &[0])], "shoot--a").is_err());
        let many: Vec<_> = (0..17).map(|i| svc(&format!("s{i}"), &[443])).collect();
        assert!(seed_services(&many, "shoot--a").is_err());
    }

    /// A tenant can lower the operator's ceilings but never raise them;
    /// asking for "unlimited" (0) or nothing gets the ceiling.
    #[test]
    fn a_tenant_lowers_its_limits_but_never_raises_them() {
        let ceiling = ClusterLimits {
            max_connections: 1000,
            dial_rate: 100.0,
            dial_burst: 200.0,
            max_agents: 4,
            max_queued_bytes: 1 << 20,
        };
        let spec = |c: Option<u64>, r: Option<f64>, a: Option<u64>| crate::crd::LimitsSpec {
            max_connections: c,
            dial_rate: r,
            dial_burst: None,
            max_agents: a,
            max_queued_bytes: c.map(|c| c * 1000),
        };
        assert_eq!(within(None, &ceiling), ceiling);
        let greedy = within(Some(&spec(Some(1_000_000), Some(1e9), Some(0))), &ceiling);
        assert_eq!(greedy, ceiling);
        let zero = within(Some(&spec(Some(0), Some(0.0), Some(0))), &ceiling);
        assert_eq!(zero, ceiling);
        let modest = within(Some(&spec(Some(10), Some(-5.0), Some(2))), &ceiling);
        assert_eq!(
            (
                modest.max_connections,
                modest.dial_rate,
                modest.max_agents,
                modest.max_queued_bytes
            ),
            (10, 100.0, 2, 10_000)
        );
        // An operator who switched a ceiling off leaves the tenant's value.
        let open = ClusterLimits {
            max_connections: 0,
            ..ceiling
        };
        assert_eq!(
            within(Some(&spec(Some(7), None, None)), &open).max_connections,
            7
        );
    }

    #[test]
    fn a_tunnel_clusters_socket_stays_in_its_own_directory() {
        let own = Path::new("/run/seedlink/shoot--a.tunnel");
        for ok in [
            "kas.sock",
            "/run/seedlink/shoot--a.tunnel/kas.sock",
            "a_b-1.x",
        ] {
            let p = confine(own, ok).unwrap();
            assert_eq!(p.parent(), Some(own), "{ok}");
        }
        for bad in [
            "/run/seedlink/shoot--b.tunnel/kas.sock",
            "/run/seedlink/shoot--b.sock",
            "../shoot--b.tunnel/kas.sock",
            "/run/seedlink/shoot--a.tunnel/../x",
            "/etc/passwd",
            "/var/run/docker.sock",
            "sub/kas.sock",
            ".hidden",
            "..",
            "",
            "a\0b",
        ] {
            assert!(confine(own, bad).is_err(), "{bad:?} accepted");
        }
    }

    /// A TokenReview goes only to a Service of the object's own namespace
    /// or to an address the operator allows; never to wherever a tenant
    /// points it.
    #[test]
    fn a_token_review_goes_only_to_the_namespaces_services_or_allowed_addresses() {
        let cidrs: Vec<ipnet::IpNet> =
            vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
        for ok in [
            "https://kube-apiserver.shoot--a.svc",
            "https://kube-apiserver.shoot--a.svc:443",
            "https://KAS.shoot--a.svc.cluster.local:6443/",
            "https://10.1.2.3:443",
            "https://[fd00::1]:443",
        ] {
            assert_eq!(review_url(ok, "shoot--a", &cidrs), Ok(()), "{ok}");
        }
        for bad in [
            "http://kube-apiserver.shoot--a.svc",
            "https://kube-apiserver.shoot--b.svc",
            "https://kube-apiserver.shoot--b.svc.shoot--a.svc.evil",
            "https://x.y.shoot--a.svc",
            "https://.shoot--a.svc",
            "https://shoot--a.svc",
            "https://169.254.169.254",
            "https://[::1]:443",
            "https://kas.shoot--a.svc/apis",
            "https://user@kas.shoot--a.svc",
            "https://kas.shoot--a.svc:http",
            "https://example.com",
            "https://",
        ] {
            assert!(review_url(bad, "shoot--a", &cidrs).is_err(), "{bad}");
        }
        assert!(review_url("https://10.1.2.3", "shoot--a", &[]).is_err());
    }

    /// A TunnelCluster with `agentToken.review` becomes a cluster whose
    /// tokens a TokenReview checks, with the namespace's credentials (a
    /// token, or a client certificate); a missing Secret or one with
    /// neither is refused with the reason.
    #[test]
    fn a_token_review_takes_its_credentials_from_the_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let spec = |creds: &str| {
            json!({"agentToken": {"issuer": "https://issuer.a", "review": {
                "url": "https://kube-apiserver.shoot--a.svc",
                "ca": {"configMap": "kas-ca", "key": "ca.crt"},
                "credentials": creds}}})
        };
        let mut tls = (*secret("shoot--a", "tls", "tls.crt", "CERT")).clone();
        tls.data
            .as_mut()
            .unwrap()
            .insert("tls.key".into(), k8s_openapi::ByteString(b"KEY".to_vec()));
        let secrets = [
            secret("shoot--a", "bearer", "token", "TOKEN"),
            Arc::new(tls),
            secret("shoot--a", "other", "x", "y"),
        ];
        let ca = Arc::new(ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some("kas-ca".into()),
                namespace: Some("shoot--a".into()),
                ..Default::default()
            },
            data: Some([("ca.crt".to_string(), "CA".to_string())].into()),
            ..Default::default()
        });
        let run = |creds: &str| {
            translate(
                &[object("shoot--a", spec(creds))],
                &secrets,
                std::slice::from_ref(&ca),
                dir.path(),
                Path::new("/run/seedlink"),
                &Bounds::default(),
            )
        };
        let review_of = |t: &TunnelTranslation| {
            let auth = t.clusters[0].agent_token.as_ref();
            auth.and_then(|a| a.review.clone()).unwrap()
        };
        let t = run("bearer");
        let review = review_of(&t);
        assert_eq!(t.files[review.token_file.as_ref().unwrap()], b"TOKEN");
        assert_eq!(t.files[&review.ca], b"CA");
        let t = run("tls");
        let review = review_of(&t);
        assert!(review.token_file.is_none());
        assert_eq!(t.files[review.key.as_ref().unwrap()], b"KEY");
        for (creds, reason) in [("other", "InvalidSpec"), ("gone", "ReferenceNotFound")] {
            let t = run(creds);
            assert!(t.clusters.is_empty());
            assert_eq!(
                t.outcomes[0].ready.reason, reason,
                "{creds}: {:?}",
                t.outcomes[0].ready
            );
        }
    }

    /// A TunnelCluster generated for a control plane (its controlling
    /// owner) requires that object's UID on kube-apiserver's certificate;
    /// a hand-written one, or one merely referring to an owner, does not.
    #[test]
    fn a_generated_tunnel_cluster_is_bound_to_its_control_planes_uid() {
        let owned = |kind: &str, api: &str, controller: bool| {
            let mut o = (*object("shoot--a", json!({}))).clone();
            o.metadata.owner_references = Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    api_version: api.into(),
                    kind: kind.into(),
                    name: "api".into(),
                    uid: "u-1".into(),
                    controller: Some(controller),
                    block_owner_deletion: None,
                },
            ]);
            o
        };
        let uri =
            |o: &TunnelCluster| control_plane(o).map(seedlink_config::tunnel::control_plane_uri);
        assert_eq!(
            uri(&owned(
                "SeedlinkControlPlane",
                "seedlink.dev/v1alpha1",
                true
            ))
            .as_deref(),
            Some("urn:seedlink:control-plane:u-1")
        );
        assert_eq!(
            uri(&owned(
                "SeedlinkControlPlane",
                "seedlink.dev/v1alpha1",
                false
            )),
            None
        );
        assert_eq!(uri(&owned("Deployment", "apps/v1", true)), None);
        assert_eq!(uri(&object("shoot--a", json!({}))), None);
    }

    #[test]
    fn a_tunnel_cluster_becomes_a_cluster_with_its_trust_in_files() {
        let dir = tempfile::tempdir().unwrap();
        let objects = [
            object(
                "shoot--a",
                json!({
                    "agentCA": {"secret": "ca", "key": "ca.crt"},
                    "agentToken": {"issuer": "https://issuer.a", "keys": {"secret": "ca", "key": "sa.pub"}},
                    "frontends": [{"name": "mtls", "protocol": "grpc", "tcp": "0.0.0.0:8443",
                                   "tls": {"secret": "fe", "clientCA": {"secret": "ca", "key": "ca.crt"}}}],
                    "limits": {"maxAgents": 4}
                }),
            ),
            object(
                "shoot--b",
                json!({"agentCA": {"configMap": "nothing", "key": "ca.crt"}}),
            ),
            object(
                "shoot--c",
                json!({"frontends": [{"name": "x", "protocol": "socks", "unix": "/x"}]}),
            ),
        ];
        // Two keys in each Secret.
        let two = |name: &str, k1: &str, v1: &str, k2: &str, v2: &str| {
            let mut s = (*secret("shoot--a", name, k1, v1)).clone();
            s.data
                .as_mut()
                .unwrap()
                .insert(k2.into(), k8s_openapi::ByteString(v2.as_bytes().to_vec()));
            Arc::new(s)
        };
        let secrets = [
            two("ca", "ca.crt", "CA PEM", "sa.pub", "KEYS"),
            two("fe", "tls.crt", "CERT", "tls.key", "KEY"),
        ];
        let t = translate(
            &objects,
            &secrets,
            &[],
            dir.path(),
            Path::new("/run/seedlink"),
            &Bounds::default(),
        );
        assert_eq!(t.clusters.len(), 1, "{:?}", t.outcomes);
        let c = &t.clusters[0];
        assert_eq!(c.name, "shoot--a.tunnel");
        assert_eq!(c.limits.max_agents, 4);
        assert_eq!(
            c.agent_token.as_ref().unwrap().audience,
            "system:konnectivity-server"
        );
        let ca = c.agent_ca.clone().unwrap();
        assert!(ca.starts_with(dir.path().join("shoot--a.tunnel")));
        assert_eq!(t.files[&ca], b"CA PEM");
        let by = |ns: &str| t.outcomes.iter().find(|o| o.key.namespace == ns).unwrap();
        assert!(by("shoot--a").ready.ok, "{:?}", by("shoot--a").ready);
        assert_eq!(by("shoot--b").ready.reason, "ReferenceNotFound");
        assert_eq!(by("shoot--c").ready.reason, "InvalidSpec");
        assert!(by("shoot--c").ready.message.contains("\"socks\""));
    }

    #[test]
    fn trust_files_are_written_private_and_removed_with_their_cluster() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shoot--a.tunnel/secret-ca-ca.crt");
        let mut files = BTreeMap::new();
        files.insert(path.clone(), b"one".to_vec());
        materialize(dir.path(), &files).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        materialize(dir.path(), &BTreeMap::new()).unwrap();
        assert!(!path.parent().unwrap().exists());
    }

    /// Knowing what was written, a pass writes only the files whose bytes
    /// changed and removes only those no longer named (with their
    /// cluster's directory once empty); the result is what a whole
    /// materialize makes.
    #[test]
    fn a_pass_writes_only_what_changed() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let at = |p: &str| dir.path().join(p);
        let files = |list: &[(&str, &str)]| -> BTreeMap<PathBuf, Vec<u8>> {
            list.iter()
                .map(|(p, b)| (at(p), b.as_bytes().to_vec()))
                .collect()
        };
        let before = files(&[("a/ca.crt", "a"), ("b/ca.crt", "b"), ("c/ca.crt", "c")]);
        assert!(materialize_since(dir.path(), &before, None).unwrap());
        let ino = |p: &str| std::fs::metadata(at(p)).unwrap().ino();
        let (a, b) = (ino("a/ca.crt"), ino("b/ca.crt"));
        let version = |p: &str| seedlink_net::written::version(&at(p));
        let (va, vb) = (version("a/ca.crt"), version("b/ca.crt"));
        assert!(va.is_some() && vb.is_some() && version("c/ca.crt").is_some());
        let after = files(&[("a/ca.crt", "a"), ("b/ca.crt", "b2"), ("d/ca.crt", "d")]);
        assert!(!materialize_since(dir.path(), &after, Some(&before)).unwrap());
        assert_eq!(ino("a/ca.crt"), a, "unchanged: not written");
        assert_ne!(ino("b/ca.crt"), b, "changed: replaced");
        // Its readers are told what was written and what went.
        assert_eq!(version("a/ca.crt"), va);
        assert!(version("b/ca.crt").is_some() && version("b/ca.crt") != vb);
        assert_eq!(version("c/ca.crt"), None);
        assert!(version("d/ca.crt").is_some());
        assert_eq!(std::fs::read(at("b/ca.crt")).unwrap(), b"b2");
        assert_eq!(std::fs::read(at("d/ca.crt")).unwrap(), b"d");
        assert!(!at("c").exists(), "removed with its directory");
        let mut on_disk: Vec<PathBuf> = walk(dir.path());
        on_disk.sort();
        assert_eq!(on_disk, after.keys().cloned().collect::<Vec<_>>());
        // A sweep finds everything as written: nothing to read again. A
        // file changed from outside is put back, and said so.
        assert!(!materialize_since(dir.path(), &after, None).unwrap());
        std::fs::write(at("b/ca.crt"), "tampered").unwrap();
        assert!(materialize_since(dir.path(), &after, None).unwrap());
        assert_eq!(std::fs::read(at("b/ca.crt")).unwrap(), b"b2");
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            match e.path().is_dir() {
                true => out.extend(walk(&e.path())),
                false => out.push(e.path()),
            }
        }
        out
    }
}
