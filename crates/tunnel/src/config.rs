//! `seedlink tunnel-server` configuration (YAML). Unknown keys are errors;
//! every problem is reported with its path. See docs/TUNNEL.md.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use seedlink_config::model::humantime_serde;
pub use seedlink_config::tunnel::{
    Cluster, ClusterLimits, Frontend, FrontendProtocol, TokenAuth, TokenReview,
    MEASURED_DIALS_PER_SEC, STRATEGIES,
};
use seedlink_config::{ConfigError, Errors};
use serde::Deserialize;

/// The whole file.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// This replica's ID, sent to agents as `serverid` (default: random).
    #[serde(default)]
    pub server_id: Option<String>,
    /// Replicas behind the agents' address, sent as `servercount`.
    #[serde(default = "one")]
    pub server_count: u32,
    /// The agent endpoint.
    pub agents: AgentEndpoint,
    /// Admin endpoint: `/healthz`, `/readyz`, `/metrics`.
    #[serde(default)]
    pub admin: Option<Admin>,
    /// Deadline for an agent's answer to a dial.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub dial_timeout: Duration,
    /// How long a dial that finds no agent of its cluster waits for one to
    /// join (within `dial_timeout`) before it is answered `no_agent`; `0s`
    /// answers at once. Covers the moment a replica is replaced, when the
    /// agents are still finding its successor.
    #[serde(default = "agent_wait_default", with = "humantime_serde")]
    pub agent_wait: Duration,
    /// A tunneled connection whose frontend (or destination) accepts no byte
    /// for this long is closed; only that connection.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Bytes queued per tunneled connection towards a slow frontend before
    /// that connection is closed (standard Konnectivity protocol only).
    #[serde(default = "queue_default")]
    pub queue_bytes: usize,
    /// The clusters served.
    pub clusters: Vec<Cluster>,
    /// Frontends shared by all clusters, where each connection names its
    /// cluster: `http-proxy` by proxy credentials (`Proxy-Authorization:
    /// Basic <cluster>:<password>`, the cluster's `proxy_password_file`);
    /// `http-connect` and `grpc` (TCP with mTLS only) by the client
    /// certificate, whose subject CN is the cluster's name.
    #[serde(default)]
    pub shared_frontends: Vec<Frontend>,
    /// Frontends every cluster gets, with `{cluster}` in the Unix socket
    /// path replaced by the cluster's name (e.g.
    /// `/run/seedlink/{cluster}.sock`), so adding a cluster to the list is
    /// enough to give its kube-apiserver a socket.
    #[serde(default)]
    pub frontend_templates: Vec<Frontend>,
    /// More clusters from `TunnelCluster` objects (docs/KUBERNETES.md).
    #[serde(default)]
    pub kubernetes: Option<Kubernetes>,
}

/// Where the tunnel-server's Kubernetes objects are.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Kubernetes {
    /// `namespace/name` of the Lease electing the replica that writes
    /// `TunnelCluster` status.
    pub lease: String,
    /// `namespace/name` of the Service that selects the tunnel-server
    /// replicas: `servercount` (what agents hold a stream to each of)
    /// follows its EndpointSlices (the replicas serving and not
    /// terminating), so scaling needs no configuration change;
    /// `server_count` holds until they are read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<String>,
    /// Whether this replica takes part in writing status (default true).
    #[serde(default = "yes")]
    pub write_status: bool,
    /// Where the keys of the Secrets and ConfigMaps that clusters name are
    /// written for the server to read (a private directory; default
    /// `/tmp/seedlink-trust`, an `emptyDir` under a read-only root).
    #[serde(default = "default_trust_dir")]
    pub trust_dir: PathBuf,
    /// Where TunnelClusters' Unix-socket frontends are created: a
    /// TunnelCluster names only the file, which goes in
    /// `<socket_dir>/<namespace>.<name>/` (default `/run/seedlink`).
    #[serde(default = "default_socket_dir")]
    pub socket_dir: PathBuf,
    /// The most a TunnelCluster may have: its own `limits` can lower each
    /// of these, never raise it (absent or 0 there means this ceiling).
    /// Default: the built-in defaults.
    #[serde(default)]
    pub max_limits: ClusterLimits,
}

fn default_socket_dir() -> PathBuf {
    PathBuf::from("/run/seedlink")
}

fn yes() -> bool {
    true
}
fn default_trust_dir() -> PathBuf {
    PathBuf::from("/tmp/seedlink-trust")
}

/// Clusters left out of a parse, each with its problems.
pub type Refused = Vec<(String, Vec<ConfigError>)>;

/// Where agents connect.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentEndpoint {
    /// Listen address (Konnectivity's conventional port is 8132 or 8091).
    pub listen: SocketAddr,
    /// Server certificate (PEM).
    pub cert: PathBuf,
    /// Its key (PEM).
    pub key: PathBuf,
    /// HTTP/2 PING interval towards agents; a frozen agent is detected
    /// within this plus `keepalive_timeout`.
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub keepalive: Duration,
    /// How long a PING may go unanswered.
    #[serde(default = "five_s", with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// Agent connections at once (this port faces every shoot, and the
    /// internet); more are closed at accept and counted.
    #[serde(default = "agent_connections")]
    pub max_connections: usize,
    /// Agent connections at once from one source address (a shoot's agents
    /// usually leave through one NAT address, or the gateway's clients').
    #[serde(default = "agent_connections_per_source")]
    pub max_per_source: usize,
    /// Of `max_connections`, how many may be unauthenticated at once: not
    /// yet past TLS, or past it without a cluster's certificate and no
    /// stream admitted yet. The rest are kept for agents of known
    /// clusters, whatever anonymous peers do.
    #[serde(default = "unauthenticated_connections")]
    pub max_unauthenticated: usize,
    /// Unauthenticated connections at once from one source (an IPv4
    /// address, an IPv6 /64).
    #[serde(default = "unauthenticated_per_source")]
    pub max_unauthenticated_per_source: usize,
    /// TLS handshakes per second one source may start (a burst of twice
    /// as many); past it a connection is closed at accept
    /// (`handshake_rate`). 0: unlimited.
    #[serde(default = "handshakes_per_source")]
    pub handshakes_per_source: f64,
}

fn agent_connections() -> usize {
    10_000
}
fn unauthenticated_connections() -> usize {
    1_024
}
fn unauthenticated_per_source() -> usize {
    16
}
fn handshakes_per_source() -> f64 {
    50.0
}
fn agent_connections_per_source() -> usize {
    256
}

/// The admin endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// Listen address.
    pub listen: SocketAddr,
    /// A file holding a bearer token: then everything but the probes
    /// needs `Authorization: Bearer <token>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
}

fn one() -> u32 {
    1
}
fn agent_wait_default() -> Duration {
    Duration::from_secs(3)
}

fn ten_s() -> Duration {
    Duration::from_secs(10)
}
fn five_s() -> Duration {
    Duration::from_secs(5)
}
fn queue_default() -> usize {
    4 * 1024 * 1024
}
/// Checks one frontend; `authenticated` frontends (shared proxies, every
/// request carries a cluster's password) may listen in plain TCP anywhere.
/// Problems found so far, each with its path.
#[derive(Default)]
struct Problems(Vec<ConfigError>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Plain TCP only on loopback (a kube-apiserver in the same network
/// namespace) or with per-request credentials (`authenticated`); anywhere
/// else mTLS: whether `f`, listening on `a`, breaks that.
fn lacks_mtls(f: &Frontend, a: &SocketAddr, authenticated: bool) -> bool {
    let tls = [f.cert.is_some(), f.key.is_some(), f.client_ca.is_some()];
    let plain = tls.iter().all(|x| !x);
    !tls.iter().all(|x| *x) && !(plain && (a.ip().is_loopback() || authenticated))
}

/// Addresses frontends bind, in the order they claim them.
#[derive(Default)]
struct Binds {
    unix: HashSet<String>,
    tcp: Vec<SocketAddr>,
}

impl Binds {
    /// Claims `a`; false when an address already claimed would keep it
    /// from binding.
    fn tcp(&mut self, a: SocketAddr) -> bool {
        if self.tcp.iter().any(|b| overlaps(*b, a)) {
            return false;
        }
        self.tcp.push(a);
        true
    }
}

/// Whether two listening addresses keep each other from binding: the same
/// port on the same address, or on a wildcard address and any address of
/// its family (Linux refuses `10.0.0.5:443` while `0.0.0.0:443` listens,
/// and `[::]:443` also covers IPv4 unless the socket is IPv6-only).
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    // `[::ffff:10.0.0.5]:443` is `10.0.0.5:443`.
    let (a, b) = (
        SocketAddr::new(a.ip().to_canonical(), a.port()),
        SocketAddr::new(b.ip().to_canonical(), b.port()),
    );
    let wild_v6 = |x: SocketAddr| x.ip().is_unspecified() && x.is_ipv6();
    a.ip() == b.ip()
        || (a.ip().is_unspecified() && a.is_ipv4() == b.is_ipv4())
        || (b.ip().is_unspecified() && a.is_ipv4() == b.is_ipv4())
        || wild_v6(a)
        || wild_v6(b)
}

fn check_frontend(
    f: &Frontend,
    at: &str,
    authenticated: bool,
    agents: SocketAddr,
    binds: &mut Binds,
    errs: &mut Problems,
) {
    match (&f.unix, &f.tcp) {
        (Some(p), None) => {
            if !binds.unix.insert(p.display().to_string()) {
                errs.add(format!("{at}.unix"), "path used twice");
            }
            if f.cert.is_some() || f.key.is_some() || f.client_ca.is_some() {
                errs.add(at.to_string(), "cert/key/client_ca only apply to tcp");
            }
        }
        (None, Some(a)) => {
            // Port 0 (any free port) never clashes.
            if a.port() != 0 && (!binds.tcp(*a) || overlaps(*a, agents)) {
                errs.add(
                    format!("{at}.tcp"),
                    "address used twice (or overlapping an address already bound: the same port on 0.0.0.0 or [::] and a specific address)",
                );
            }
            if lacks_mtls(f, a, authenticated) {
                errs.add(
                    at.to_string(),
                    "a tcp frontend needs cert, key and client_ca (mTLS), unless it listens on loopback without any of them",
                );
            }
        }
        _ => errs.add(at.to_string(), "exactly one of unix and tcp"),
    }
}

/// The keys a cluster trusts to name its agents: the public keys of its
/// agent CA certificates and its token keys, as SubjectPublicKeyInfo DER.
/// Files that do not read give nothing here (their own check reports them).
fn trust_keys(c: &Cluster) -> Vec<(Vec<u8>, &'static str)> {
    use rustls::pki_types::pem::PemObject;
    let mut out = Vec::new();
    if let Some(p) = &c.agent_ca {
        for der in crate::auth::tls::load_certs(p).unwrap_or_default() {
            if let Ok((_, x)) = x509_parser::parse_x509_certificate(&der) {
                out.push((x.tbs_certificate.subject_pki.raw.to_vec(), "agent_ca"));
            }
        }
    }
    if let Some(p) = c.agent_token.as_ref().and_then(|t| t.keys.as_ref()) {
        if let Ok(keys) = rustls::pki_types::SubjectPublicKeyInfoDer::pem_file_iter(p) {
            for k in keys.flatten() {
                out.push((k.as_ref().to_vec(), "agent_token.keys"));
            }
        }
    }
    out
}

/// Who holds each trust claim in `cfg` (claim → cluster name): what
/// [`keep_first_trust`] is given on the next change.
pub fn trust_holders(cfg: &ServerConfig) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for c in &cfg.clusters {
        for k in trust_claims(c) {
            out.entry(k).or_insert_with(|| c.name.clone());
        }
    }
    out
}

/// What a cluster claims to be alone in trusting, each as `sha256:<hex>`:
/// the digest of each key it trusts (SubjectPublicKeyInfo DER) and of
/// `issuer <its token issuer>`. The same strings are kept in memory and
/// in a TunnelCluster's `status.trust`, so that who holds a claim survives
/// a restart and agrees across replicas.
pub fn trust_claims(c: &Cluster) -> Vec<String> {
    let mut raw: Vec<Vec<u8>> = trust_keys(c).into_iter().map(|(k, _)| k).collect();
    if let Some(t) = &c.agent_token {
        raw.push(format!("issuer {}", t.issuer).into_bytes());
    }
    // A TCP frontend's address is held like trust: an older object that
    // adds a newer one's address goes last and is refused on the
    // collision, never the holder (its kube-apiserver would otherwise
    // connect into the other tenant's frontend).
    for f in &c.frontends {
        if let Some(a) = f.tcp.filter(|a| a.port() != 0) {
            let a = SocketAddr::new(a.ip().to_canonical(), a.port());
            raw.push(format!("frontend {a}").into_bytes());
        }
    }
    raw.iter().map(|k| claim_id(k)).collect()
}

/// `sha256:<hex>` of `bytes`.
fn claim_id(bytes: &[u8]) -> String {
    use sha2::Digest;
    use std::fmt::Write;
    let mut out = String::from("sha256:");
    for b in sha2::Sha256::digest(bytes) {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Orders clusters from Kubernetes (oldest first) so that trust stays with
/// the cluster that holds it: one that claims a key (or token issuer)
/// `held` by another cluster that still claims it goes after every other,
/// so [`ServerConfig::parse_with`] refuses it on the overlap, whatever the
/// objects' ages. `held` is what the running configuration holds, with
/// what the objects' statuses say they held filling the gaps (a restarted
/// replica decides as the running ones do). A holder among `refused`
/// (its object exists but could not be read: a missing Secret) keeps what
/// it holds. Without this, a tenant could edit an older TunnelCluster to
/// claim a newer tenant's CA, token keys or frontend address and take its
/// agents or its kube-apiserver's connections.
pub fn keep_first_trust(
    extra: &mut Vec<Cluster>,
    held: &HashMap<String, String>,
    refused: &HashSet<String>,
) -> Refused {
    let claims: Vec<Vec<String>> = extra.iter().map(trust_claims).collect();
    let claimed_by = |key: &String, name: &str| {
        extra
            .iter()
            .zip(&claims)
            .any(|(c, keys)| c.name == name && keys.contains(key))
    };
    // What each cluster claims that another holds: held by one among the
    // clusters to apply (it goes last and the overlap refuses it), or by
    // one refused for now (it is refused here: no overlap would show).
    let stolen: Vec<(bool, Option<String>)> = extra
        .iter()
        .zip(&claims)
        .map(|(c, keys)| {
            let mut steals = false;
            let mut from_refused = None;
            for k in keys {
                let Some(owner) = held.get(k).filter(|o| **o != c.name) else {
                    continue;
                };
                if refused.contains(owner) {
                    from_refused = Some(owner.clone());
                } else if claimed_by(k, owner) {
                    steals = true;
                }
            }
            (steals, from_refused)
        })
        .collect();
    let mut out = Vec::new();
    let mut indexed: Vec<(bool, Cluster)> = Vec::new();
    for ((steals, from_refused), c) in stolen.into_iter().zip(extra.drain(..)) {
        match from_refused {
            Some(owner) => out.push((
                c.name,
                vec![ConfigError {
                    path: String::new(),
                    message: format!(
                        "trusts a key (or names an address) that cluster {owner:?} holds; that cluster is refused for now but keeps what it holds"
                    ),
                }],
            )),
            None => indexed.push((steals, c)),
        }
    }
    // Stable: ages stay in order within each group.
    indexed.sort_by_key(|(stealer, _)| *stealer);
    extra.extend(indexed.into_iter().map(|(_, c)| c));
    out
}

/// Certificates one `agent_ca` may hold.
pub const MAX_AGENT_CAS: usize = 16;

/// An `agent_ca` holds roots only: self-signed CA certificates, each one
/// that parses. An intermediate (or a leaf) as an anchor would let a
/// tenant name a certificate of another tenant's chain and share, or
/// block, its agents; with roots only, two clusters can overlap only by
/// sharing a key, which [`claim_trust`] refuses.
fn check_anchors(p: &Path) -> Result<(), String> {
    let certs = crate::auth::tls::load_certs(p).map_err(|e| e.to_string())?;
    if certs.len() > MAX_AGENT_CAS {
        return Err(format!(
            "{} certificates; at most {MAX_AGENT_CAS}",
            certs.len()
        ));
    }
    for (i, der) in certs.iter().enumerate() {
        let (_, c) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("certificate {i} does not parse: {e}"))?;
        let ca = c
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|b| b.value.ca);
        let self_signed = c.issuer() == c.subject() && c.verify_signature(None).is_ok();
        if !ca || !self_signed {
            return Err(format!(
                "certificate {i} ({}) is not a self-signed CA certificate: an agent_ca holds roots only",
                c.subject()
            ));
        }
    }
    Ok(())
}

/// The trust already claimed: public key (SubjectPublicKeyInfo DER) →
/// cluster.
#[derive(Default)]
struct Claimed {
    keys: HashMap<Vec<u8>, String>,
}

/// Trust shared with a cluster already kept (the file's, then the older
/// objects') refuses the newer claim: adds it to `bad` (the extra clusters'
/// problems by index). `Err` when the file's own clusters share trust.
fn refuse_shared_trust(
    file: &ServerConfig,
    extra: &[Cluster],
    mut bad: std::collections::BTreeMap<usize, Vec<ConfigError>>,
) -> Result<std::collections::BTreeMap<usize, Vec<ConfigError>>, ConfigError> {
    let mut seen = Claimed::default();
    for (i, c) in file.clusters.iter().enumerate() {
        if let Some(e) = claim_trust(&mut seen, c, &format!("clusters[{i}] ({})", c.name)) {
            return Err(e);
        }
    }
    for (i, c) in extra.iter().enumerate() {
        if bad.contains_key(&i) {
            continue;
        }
        if let Some(e) = claim_trust(&mut seen, c, &format!("clusters ({})", c.name)) {
            bad.entry(i).or_default().push(e);
        }
    }
    Ok(bad)
}

/// Records `c`'s trust in `seen`, or, when another cluster already trusts
/// one of its keys, says so instead: an agent certificate or token that
/// verifies for two clusters could be taken for either, so one tenant
/// could hand its agent another tenant's traffic. (`agent_ca` holds roots
/// only, see [`check_anchors`], so a shared key is the only overlap of
/// two files; a link the agent presents itself is refused when it
/// connects: `Registry::cluster_for_cert`.)
fn claim_trust(seen: &mut Claimed, c: &Cluster, at: &str) -> Option<ConfigError> {
    let keys = trust_keys(c);
    for (k, what) in &keys {
        if let Some(other) = seen.keys.get(k).filter(|o| **o != c.name) {
            return Some(ConfigError {
                path: format!("{at}.{what}"),
                message: format!(
                    "trusts a key that cluster {other:?} trusts already: an agent could be taken for either (each cluster needs its own CA and token keys)"
                ),
            });
        }
    }
    for (k, _) in keys {
        seen.keys.entry(k).or_insert_with(|| c.name.clone());
    }
    None
}

impl ServerConfig {
    /// Every file the configuration refers to (certificates, keys, CAs,
    /// token keys, passwords), for change detection. A TokenReview
    /// `token_file` is not listed: it is read again for every review.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut out = vec![self.agents.cert.clone(), self.agents.key.clone()];
        let fe = |f: &Frontend, out: &mut Vec<PathBuf>| {
            out.extend(f.cert.iter().chain(&f.key).chain(&f.client_ca).cloned());
        };
        for c in &self.clusters {
            out.extend(c.agent_ca.iter().cloned());
            out.extend(c.proxy_password_file.iter().cloned());
            if let Some(t) = &c.agent_token {
                out.extend(t.keys.iter().cloned());
                if let Some(r) = &t.review {
                    out.push(r.ca.clone());
                    out.extend(r.cert.iter().chain(&r.key).cloned());
                }
            }
            for f in &c.frontends {
                fe(f, &mut out);
            }
        }
        for f in &self.shared_frontends {
            fe(f, &mut out);
        }
        out.sort();
        out.dedup();
        out
    }

    /// Every file the configuration names, read and parsed as what it must
    /// be (certificate chain, private key, CA bundle, public keys, a
    /// non-empty secret); one problem per file, with the key that names it.
    pub fn check_files(&self) -> Vec<ConfigError> {
        let mut errs = Problems::default();
        for (at, p, kind) in self.named_files() {
            if let Err(e) = kind.check(p) {
                errs.add(at, format!("{}: {e}", p.display()));
            }
        }
        errs.0
    }

    /// Every file the configuration names: the key that names it, the
    /// path, what it must hold.
    fn named_files(&self) -> Vec<(String, &Path, Kind)> {
        let mut files = vec![(
            "agents.cert".to_string(),
            self.agents.cert.as_path(),
            Kind::Certs,
        )];
        if let Some(p) = self.admin.as_ref().and_then(|a| a.token_file.as_ref()) {
            files.push(("admin.token_file".into(), p, Kind::Secret));
        }
        files.push(("agents.key".into(), &self.agents.key, Kind::Key));
        for (i, c) in self.clusters.iter().enumerate() {
            let at = format!("clusters[{i}] ({})", c.name);
            cluster_files(&at, c, &mut files);
            for (j, f) in c.frontends.iter().enumerate() {
                frontend_files(&format!("{at}.frontends[{j}] ({})", f.name), f, &mut files);
            }
        }
        for (j, f) in self.shared_frontends.iter().enumerate() {
            let at = format!("shared_frontends[{j}] ({})", f.name);
            frontend_files(&at, f, &mut files);
        }
        files
    }

    /// Parses and checks a configuration; all problems at once, each with
    /// its path (YAML and unknown-key errors carry their line).
    pub fn parse(text: &str) -> Result<ServerConfig, Errors> {
        Self::parse_with(text, Vec::new()).0
    }

    /// Parses the file and adds `extra` clusters (from Kubernetes), each
    /// admitted on its own: one that is invalid, collides with the file's
    /// clusters or an earlier one (name, issuer, socket, address), or names
    /// a file that does not read as what it must be, is left out and
    /// returned with its problems; the others are kept. Problems of the
    /// file itself fail the whole parse.
    pub fn parse_with(text: &str, extra: Vec<Cluster>) -> (Result<ServerConfig, Errors>, Refused) {
        let file: ServerConfig = match serde_norway::from_str(text) {
            Ok(c) => c,
            Err(e) => {
                return (
                    Err(Errors(vec![ConfigError {
                        path: String::new(),
                        message: e.to_string(),
                    }])),
                    Vec::new(),
                )
            }
        };
        if extra.is_empty() {
            return (Self::validate(file).and_then(no_shared_trust), Vec::new());
        }
        let bad = match Self::blame_extra(&file, &extra) {
            Ok(bad) => bad,
            Err(own) => return (Err(own), Vec::new()),
        };
        let mut bad = match refuse_shared_trust(&file, &extra, bad) {
            Ok(bad) => bad,
            Err(e) => return (Err(Errors(vec![e])), Vec::new()),
        };
        let mut refused = Vec::new();
        let mut kept = file;
        for (i, c) in extra.into_iter().enumerate() {
            match bad.remove(&i) {
                Some(problems) => refused.push((c.name, problems)),
                None => kept.clusters.push(c),
            }
        }
        (Self::validate(kept), refused)
    }

    /// The files each extra cluster names must read as what they are; a
    /// problem is that cluster's.
    fn blame_files(
        file: &ServerConfig,
        extra: &[Cluster],
        bad: &mut std::collections::BTreeMap<usize, Vec<ConfigError>>,
    ) {
        let mut alone = file.clone();
        alone.shared_frontends.clear();
        for (i, c) in extra.iter().enumerate() {
            alone.clusters = vec![c.clone()];
            for e in alone.check_files() {
                if e.path.starts_with("clusters[") {
                    bad.entry(i).or_default().push(e);
                }
            }
        }
    }

    /// The problems of each `extra` cluster (by its index) when validated
    /// with `file`, its files read as what they are; `Err` with the file's
    /// own problems, which refuse everything.
    fn blame_extra(
        file: &ServerConfig,
        extra: &[Cluster],
    ) -> Result<std::collections::BTreeMap<usize, Vec<ConfigError>>, Errors> {
        let from_file = file.clusters.len();
        let mut all = file.clone();
        all.clusters.extend(extra.iter().cloned());
        let mut bad: std::collections::BTreeMap<usize, Vec<ConfigError>> = Default::default();
        let mut own = Vec::new();
        for e in Self::validate(all).err().map(|e| e.0).unwrap_or_default() {
            let index = e
                .path
                .strip_prefix("clusters[")
                .and_then(|r| r.split_once(']'))
                .and_then(|(i, _)| i.parse::<usize>().ok())
                .filter(|i| *i >= from_file)
                .map(|i| i - from_file)
                .or_else(|| {
                    extra
                        .iter()
                        .position(|c| e.path.starts_with(&format!("clusters ({})", c.name)))
                });
            match index {
                Some(i) => bad.entry(i).or_default().push(e),
                None => own.push(e),
            }
        }
        if !own.is_empty() {
            return Err(Errors(own));
        }
        Self::blame_files(file, extra, &mut bad);
        Ok(bad)
    }

    /// Checks a parsed configuration, section by section; every problem
    /// with its path.
    fn validate(mut cfg: ServerConfig) -> Result<ServerConfig, Errors> {
        let mut errs = Problems::default();
        check_templates(&cfg, &mut errs);
        if errs.is_empty() {
            expand_templates(&mut cfg, &mut errs);
        }
        check_settings(&cfg, &mut errs);
        // The operator's shared frontends claim their addresses first: a
        // cluster (from Kubernetes above all) naming one of them is that
        // cluster's problem, never the file's.
        let mut binds = Binds::default();
        check_shared_frontends(&cfg, &mut binds, &mut errs);
        check_clusters(&cfg, &mut binds, &mut errs);
        if errs.is_empty() {
            Ok(cfg)
        } else {
            Err(Errors(errs.0))
        }
    }
}

/// A template needs a Unix path with `{cluster}` (and no TCP address).
fn check_templates(cfg: &ServerConfig, errs: &mut Problems) {
    for (j, t) in cfg.frontend_templates.iter().enumerate() {
        let at = format!("frontend_templates[{j}] ({})", t.name);
        let templated = t
            .unix
            .as_ref()
            .is_some_and(|p| p.to_string_lossy().contains("{cluster}"));
        if !templated || t.tcp.is_some() {
            errs.add(
                at,
                "a template needs a unix path containing {cluster} (and no tcp)",
            );
        }
    }
}

impl ServerConfig {
    /// Cluster `name` as the file's templates serve one it does not list
    /// (a TunnelCluster from the Kubernetes source): no trust of its own
    /// here (the object holds it), the templated frontends.
    pub fn templated(&self, name: &str) -> Cluster {
        let frontends = self
            .frontend_templates
            .iter()
            .map(|t| {
                let mut f = t.clone();
                f.unix = t
                    .unix
                    .as_ref()
                    .map(|p| PathBuf::from(p.to_string_lossy().replace("{cluster}", name)));
                f
            })
            .collect();
        Cluster {
            name: name.to_string(),
            agent_ca: None,
            agent_token: None,
            strategies: Vec::new(),
            frontends,
            proxy_password_file: None,
            limits: ClusterLimits::default(),
        }
    }
}

/// Templates become ordinary per-cluster frontends (so reloads and checks
/// treat them like any other); a cluster name in a socket path is a safe
/// file name.
fn expand_templates(cfg: &mut ServerConfig, errs: &mut Problems) {
    for c in &mut cfg.clusters {
        let safe = !c.name.is_empty()
            && c.name != "."
            && c.name != ".."
            && c.name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch));
        for t in &cfg.frontend_templates {
            if !safe {
                errs.add(
                    format!("clusters ({})", c.name),
                    "a name used in a socket path may only hold letters, digits, '-', '_' and '.'",
                );
                break;
            }
            let mut f = t.clone();
            f.unix = t
                .unix
                .as_ref()
                .map(|p| PathBuf::from(p.to_string_lossy().replace("{cluster}", &c.name)));
            if c.frontends.iter().any(|x| x.name == f.name) {
                errs.add(
                    format!("clusters ({})", c.name),
                    format!("frontend {} is both configured and templated", f.name),
                );
            }
            c.frontends.push(f);
        }
    }
}

/// `<namespace>/<name>`.
fn object_name(v: &str) -> bool {
    v.split_once('/')
        .is_some_and(|(ns, n)| !ns.is_empty() && !n.is_empty() && !n.contains('/'))
}

/// The server-wide settings and the `kubernetes` section.
fn check_settings(cfg: &ServerConfig, errs: &mut Problems) {
    if cfg.server_count == 0 {
        errs.add("server_count", "must be at least 1");
    }
    if cfg.clusters.is_empty() && cfg.kubernetes.is_none() {
        errs.add(
            "clusters",
            "at least one cluster is needed (or a kubernetes section to read them from TunnelClusters)",
        );
    }
    if let Some(k) = &cfg.kubernetes {
        if !object_name(&k.lease) {
            errs.add(
                "kubernetes.lease",
                format!("{:?} is not namespace/name", k.lease),
            );
        }
        if let Some(r) = k.replicas.as_ref().filter(|r| !object_name(r)) {
            errs.add(
                "kubernetes.replicas",
                format!("{r:?} is not namespace/name"),
            );
        }
    }
    if cfg.queue_bytes < 64 * 1024 {
        errs.add("queue_bytes", "at least 65536");
    }
    if cfg.agent_wait > MAX_TIMEOUT {
        errs.add("agent_wait", "at most 24h");
    }
    for (key, d) in [
        ("dial_timeout", cfg.dial_timeout),
        ("stall_timeout", cfg.stall_timeout),
        ("agents.keepalive", cfg.agents.keepalive),
        ("agents.keepalive_timeout", cfg.agents.keepalive_timeout),
    ] {
        if d.is_zero() || d > MAX_TIMEOUT {
            errs.add(key, "must be more than 0 and at most 24h");
        }
    }
    if cfg.agents.max_connections == 0 {
        errs.add("agents.max_connections", "at least 1");
    }
    if cfg.agents.max_per_source == 0 {
        errs.add("agents.max_per_source", "at least 1");
    }
    if cfg.agents.max_unauthenticated == 0
        || cfg.agents.max_unauthenticated > cfg.agents.max_connections
    {
        errs.add(
            "agents.max_unauthenticated",
            "at least 1 and at most agents.max_connections",
        );
    }
    if cfg.agents.max_unauthenticated_per_source == 0 {
        errs.add("agents.max_unauthenticated_per_source", "at least 1");
    }
    let rate = cfg.agents.handshakes_per_source;
    if !(rate.is_finite() && rate >= 0.0) {
        errs.add("agents.handshakes_per_source", "a number ≥ 0");
    }
}

/// The longest `dial_timeout`, `stall_timeout` and keepalive setting: a
/// day (longer is a typo, and a deadline that far out is no deadline).
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// A cluster's dial limits and backend strategies.
fn check_dialing(at: &str, c: &Cluster, errs: &mut Problems) {
    let l = &c.limits;
    let sane = |v: f64| v >= 0.0 && v.is_finite();
    if !sane(l.dial_rate) || !sane(l.dial_burst) {
        errs.add(
            format!("{at}.limits"),
            "dial_rate and dial_burst must be ≥ 0",
        );
    }
    if c.strategies.is_empty() {
        errs.add(format!("{at}.strategies"), "empty");
    }
    for s in c
        .strategies
        .iter()
        .filter(|s| !STRATEGIES.contains(&s.as_str()))
    {
        errs.add(
            format!("{at}.strategies"),
            format!("{s:?} is not one of {}", STRATEGIES.join(", ")),
        );
    }
}

/// Every cluster: a unique name, a way to authenticate its agents (an
/// issuer belongs to one cluster), sane limits and strategies, its
/// frontends.
fn check_clusters(cfg: &ServerConfig, binds: &mut Binds, errs: &mut Problems) {
    let mut names = HashSet::new();
    let mut issuers = HashSet::new();
    for (i, c) in cfg.clusters.iter().enumerate() {
        let at = format!("clusters[{i}] ({})", c.name);
        if c.name.is_empty() || !names.insert(c.name.clone()) {
            errs.add(format!("{at}.name"), "empty or used twice");
        }
        if c.agent_ca.is_none() && c.agent_token.is_none() {
            errs.add(
                at.to_string(),
                "agent_ca or agent_token (or both) is needed",
            );
        }
        if let Some(t) = &c.agent_token {
            check_agent_token(&at, t, &mut issuers, errs);
        }
        check_dialing(&at, c, errs);
        for (j, f) in c.frontends.iter().enumerate() {
            let at = format!("{at}.frontends[{j}] ({})", f.name);
            check_frontend(f, &at, false, cfg.agents.listen, binds, errs);
        }
    }
}

/// A TokenReview's settings (`at`: its key).
fn check_review(at: &str, r: &TokenReview, errs: &mut Problems) {
    if !r.url.starts_with("https://") {
        errs.add(format!("{at}.url"), "must be https://");
    }
    if r.cert.is_some() != r.key.is_some() {
        errs.add(at, "cert and key go together");
    }
    if r.token_file.is_none() && r.cert.is_none() {
        errs.add(
            at,
            "token_file or cert/key is needed to authenticate to the API server",
        );
    }
    if r.timeout.is_zero() {
        errs.add(format!("{at}.timeout"), "must be > 0");
    }
}

/// A cluster's `agent_token`: a ServiceAccount, one way to check it, an
/// issuer of its own, and a TokenReview that can authenticate.
fn check_agent_token(at: &str, t: &TokenAuth, issuers: &mut HashSet<String>, errs: &mut Problems) {
    if !t.service_account.contains('/') {
        errs.add(
            format!("{at}.agent_token.service_account"),
            "<namespace>/<name>",
        );
    }
    if t.keys.is_some() == t.review.is_some() {
        errs.add(
            format!("{at}.agent_token"),
            "exactly one of keys (local check) or review (TokenReview)",
        );
    }
    if !issuers.insert(t.issuer.clone()) {
        errs.add(
            format!("{at}.agent_token.issuer"),
            "used by another cluster",
        );
    }
    if let Some(r) = &t.review {
        check_review(&format!("{at}.agent_token.review"), r, errs);
    }
}

/// Shared frontends: a proxy (the request names the cluster) or mTLS (the
/// client certificate does); a proxy needs a cluster with a password.
fn check_shared_frontends(cfg: &ServerConfig, binds: &mut Binds, errs: &mut Problems) {
    for (j, f) in cfg.shared_frontends.iter().enumerate() {
        let at = format!("shared_frontends[{j}] ({})", f.name);
        let proxy = f.protocol.is_proxy();
        let mtls = f.tcp.is_some() && f.client_ca.is_some();
        if !(proxy || mtls) {
            errs.add(
                at.clone(),
                format!(
                    "a shared {:?} frontend needs tcp with cert, key and client_ca: the client certificate names the cluster",
                    f.protocol
                ),
            );
        }
        check_frontend(f, &at, proxy, cfg.agents.listen, binds, errs);
    }
    if cfg.shared_frontends.iter().any(|f| f.protocol.is_proxy())
        && cfg.clusters.iter().all(|c| c.proxy_password_file.is_none())
    {
        errs.add(
            "shared_frontends",
            "no cluster has a proxy_password_file, so no proxy request could name one",
        );
    }
}

/// `cfg` if no two of its clusters share trust (a CA or a token issuer).
fn no_shared_trust(cfg: ServerConfig) -> Result<ServerConfig, Errors> {
    let mut seen = Claimed::default();
    let overlaps: Vec<ConfigError> = cfg
        .clusters
        .iter()
        .enumerate()
        .filter_map(|(i, c)| claim_trust(&mut seen, c, &format!("clusters[{i}] ({})", c.name)))
        .collect();
    if overlaps.is_empty() {
        Ok(cfg)
    } else {
        Err(Errors(overlaps))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A self-signed CA certificate (an agent CA must be one).
    fn root(cn: &str) -> rcgen::CertifiedKey<rcgen::KeyPair> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec![cn.to_string()]).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        rcgen::CertifiedKey {
            cert: p.self_signed(&key).unwrap(),
            signing_key: key,
        }
    }

    fn cfg(token: &str) -> String {
        format!(
            "agents: {{listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}}
clusters:
  - name: a
    agent_token: {token}
    frontends: [{{name: f, protocol: http-connect, unix: /tmp/a.sock}}]
"
        )
    }

    fn err(token: &str) -> String {
        format!("{:#}", ServerConfig::parse(&cfg(token)).unwrap_err())
    }

    /// A timeout of 0 would fire at once, and one of "300000000000y" is a
    /// typo that would overflow every deadline computed from it: both are
    /// refused, with the key named.
    #[test]
    fn timeouts_are_bounded() {
        let with = |extra: &str| {
            ServerConfig::parse(&format!("{extra}\n{}", cfg("{issuer: i, keys: sa.pub}")))
                .map_err(|e| format!("{e:#}"))
        };
        with("dial_timeout: 30s\nstall_timeout: 1h").unwrap();
        for (key, bad) in [
            ("dial_timeout", "0s"),
            ("stall_timeout", "300000000000y"),
            ("dial_timeout", "25h"),
        ] {
            let e = with(&format!("{key}: {bad}")).unwrap_err();
            assert!(
                e.contains(key) && e.contains("at most 24h"),
                "{key}: {bad}: {e}"
            );
        }
    }

    #[test]
    fn token_checks_are_validated() {
        let ok = ServerConfig::parse(&cfg(
            "{issuer: i, review: {url: 'https://10.0.0.1:443', ca: ca.pem, token_file: t}}",
        ))
        .unwrap();
        let r = ok.clusters[0]
            .agent_token
            .as_ref()
            .unwrap()
            .review
            .as_ref()
            .unwrap();
        assert_eq!(r.timeout, Duration::from_secs(5));
        assert_eq!(r.cache_ttl, Duration::from_secs(60));
        ServerConfig::parse(&cfg("{issuer: i, keys: sa.pub}")).unwrap();
        assert!(err("{issuer: i}").contains("exactly one of keys"));
        assert!(
            err("{issuer: i, keys: k, review: {url: 'https://a', ca: c, token_file: t}}")
                .contains("exactly one of keys")
        );
        assert!(
            err("{issuer: i, review: {url: 'http://a', ca: c, token_file: t}}")
                .contains("must be https://")
        );
        assert!(err("{issuer: i, review: {url: 'https://a', ca: c}}")
            .contains("token_file or cert/key"));
        assert!(
            err("{issuer: i, review: {url: 'https://a', ca: c, cert: x}}")
                .contains("cert and key go together")
        );
        assert!(
            err("{issuer: i, review: {url: 'https://a', ca: c, token_file: t, timeout: 0s}}")
                .contains("timeout")
        );
        let two = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters:
  - {name: a, agent_token: {issuer: i, keys: k}, frontends: [{name: f, protocol: grpc, unix: /a}]}
  - {name: b, agent_token: {issuer: i, keys: k}, frontends: [{name: f, protocol: grpc, unix: /b}]}
";
        assert!(format!("{:#}", ServerConfig::parse(two).unwrap_err())
            .contains("used by another cluster"));
    }

    #[test]
    fn templates_give_every_cluster_a_socket() {
        let yaml = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
frontend_templates: [{name: kas, protocol: http-connect, unix: '/run/seedlink/{cluster}.sock'}]
clusters:
  - {name: shoot--a, agent_ca: a.pem, frontends: []}
  - {name: shoot--b, agent_ca: b.pem, frontends: [{name: grpc, protocol: grpc, unix: /run/b-grpc.sock}]}
";
        let cfg = ServerConfig::parse(yaml).unwrap();
        let paths: Vec<_> = cfg
            .clusters
            .iter()
            .flat_map(|c| c.frontends.iter().map(|f| f.unix.clone().unwrap()))
            .collect();
        assert_eq!(
            paths,
            [
                PathBuf::from("/run/seedlink/shoot--a.sock"),
                PathBuf::from("/run/b-grpc.sock"),
                PathBuf::from("/run/seedlink/shoot--b.sock")
            ]
        );
        let bad = yaml.replace("name: shoot--a,", "name: 'a/../../etc',");
        assert!(format!("{:#}", ServerConfig::parse(&bad).unwrap_err()).contains("socket path"));
        let no_placeholder = yaml.replace("{cluster}.sock", "x.sock");
        assert!(
            format!("{:#}", ServerConfig::parse(&no_placeholder).unwrap_err())
                .contains("containing {cluster}")
        );
    }

    #[test]
    fn shared_proxy_frontends_need_passwords_and_may_be_plain() {
        let base = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters:
  - name: a
    agent_ca: ca.pem
    frontends: [{name: p, protocol: http-proxy, tcp: '10.0.0.1:3129'}]
";
        // A per-cluster proxy listener off loopback needs mTLS.
        assert!(format!("{:#}", ServerConfig::parse(base).unwrap_err()).contains("mTLS"));
        let base = base.replace("10.0.0.1:3129", "127.0.0.1:3129");
        let shared = format!(
            "{base}shared_frontends: [{{name: s, protocol: http-proxy, tcp: '0.0.0.0:3128'}}]\n"
        );
        assert!(format!("{:#}", ServerConfig::parse(&shared).unwrap_err())
            .contains("no cluster has a proxy_password_file"));
        let with_pw = shared.replace(
            "    agent_ca: ca.pem\n",
            "    agent_ca: ca.pem\n    proxy_password_file: pw\n",
        );
        let cfg = ServerConfig::parse(&with_pw).unwrap();
        assert_eq!(cfg.shared_frontends.len(), 1);
        let grpc = with_pw.replace("{name: s, protocol: http-proxy", "{name: s, protocol: grpc");
        assert!(format!("{:#}", ServerConfig::parse(&grpc).unwrap_err())
            .contains("the client certificate names the cluster"));
    }

    #[test]
    fn clusters_from_kubernetes_are_admitted_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let pki = root("x");
        std::fs::write(&ca, pki.cert.pem()).unwrap();
        let text = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters: []
frontend_templates: [{name: uds, protocol: http-connect, unix: '/run/{cluster}.sock'}]
kubernetes: {lease: seedlink-system/tunnel}
";
        let cluster = |name: &str, ca: &Path| Cluster {
            name: name.into(),
            agent_ca: Some(ca.to_path_buf()),
            agent_token: None,
            strategies: vec!["default".into()],
            frontends: Vec::new(),
            proxy_password_file: None,
            limits: ClusterLimits::default(),
        };
        let ca_c = dir.path().join("ca-c.pem");
        let pki_c = root("c");
        std::fs::write(&ca_c, pki_c.cert.pem()).unwrap();
        let extra = vec![
            cluster("ns-a.t", &ca),
            // The same name again, and a CA that does not read.
            cluster("ns-a.t", &ca),
            cluster("ns-b.t", &dir.path().join("missing.pem")),
            cluster("ns-c.t", &ca_c),
        ];
        let (cfg, refused) = ServerConfig::parse_with(text, extra);
        let cfg = cfg.unwrap();
        let kept: Vec<&str> = cfg.clusters.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(kept, ["ns-a.t", "ns-c.t"]);
        // Templates apply to them like to the file's clusters.
        assert_eq!(
            cfg.clusters[1].frontends[0].unix.as_deref(),
            Some(Path::new("/run/ns-c.t.sock"))
        );
        let names: Vec<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["ns-a.t", "ns-b.t"]);
        assert!(
            refused[1].1[0].message.contains("missing.pem"),
            "{refused:?}"
        );
        // Without a kubernetes section an empty cluster list is an error;
        // a problem of the file fails the whole parse.
        assert!(ServerConfig::parse(
            &text.replace("kubernetes: {lease: seedlink-system/tunnel}\n", "")
        )
        .is_err());
        let (bad, refused) = ServerConfig::parse_with(
            &text.replace("seedlink-system/tunnel", "nolease"),
            vec![cluster("ns-a.t", &ca)],
        );
        assert!(format!("{:#}", bad.unwrap_err()).contains("kubernetes.lease"));
        assert!(refused.is_empty());
    }

    /// Two clusters that trust the same agent CA (the same file, a copy, or
    /// another certificate for the same key) or the same token keys: an
    /// agent would be taken for whichever came first. The file's own
    /// overlap fails the parse; a newer object's is refused, the older kept.
    #[test]
    fn clusters_never_share_agent_trust() {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, pem: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).unwrap();
            p.display().to_string()
        };
        let key = rcgen::KeyPair::generate().unwrap();
        let ca = |cn: &str| {
            let mut params = rcgen::CertificateParams::new(vec![cn.to_string()]).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.self_signed(&key).unwrap().pem()
        };
        let a = w("a.pem", ca("a"));
        let copy = w("copy.pem", std::fs::read_to_string(&a).unwrap());
        // Another certificate, the same key: verifies the same agents.
        let same_key = w("same-key.pem", ca("other"));
        let other = root("o");
        let own = w("own.pem", other.cert.pem());
        let jwt_keys = w("sa.pub", key.public_key_pem());
        let file = |b: &str| {
            format!(
                "agents: {{listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}}
clusters:
  - {{name: a, agent_ca: '{a}'}}
  - {{name: b, {b}}}
"
            )
        };
        for b in [
            format!("agent_ca: '{a}'"),
            format!("agent_ca: '{copy}'"),
            format!("agent_ca: '{same_key}'"),
            format!("agent_token: {{issuer: b, keys: '{jwt_keys}'}}"),
        ] {
            let e = format!("{:#}", ServerConfig::parse(&file(&b)).unwrap_err());
            assert!(e.contains("cluster \"a\" trusts already"), "{b}: {e}");
        }
        ServerConfig::parse(&file(&format!("agent_ca: '{own}'"))).unwrap();

        // From Kubernetes: the newer claim is refused, the older kept.
        let text = file(&format!("agent_ca: '{own}'"));
        let cluster = |name: &str, ca: &str| Cluster {
            name: name.into(),
            agent_ca: Some(ca.into()),
            agent_token: None,
            strategies: vec!["default".into()],
            frontends: Vec::new(),
            proxy_password_file: None,
            limits: ClusterLimits::default(),
        };
        let fresh = root("f");
        let fresh = w("fresh.pem", fresh.cert.pem());
        let (cfg, refused) = ServerConfig::parse_with(
            &text,
            vec![
                cluster("ns-x.t", &fresh),
                cluster("ns-evil.t", &copy),
                cluster("ns-late.t", &fresh),
            ],
        );
        let kept: Vec<String> = cfg.unwrap().clusters.into_iter().map(|c| c.name).collect();
        assert_eq!(kept, ["a", "b", "ns-x.t"]);
        let names: Vec<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["ns-evil.t", "ns-late.t"]);
    }

    /// An older TunnelCluster edited to claim a newer one's CA does not
    /// take its trust: the cluster that held the key keeps it, the editor
    /// is refused; once the holder lets go, the key may move.
    #[test]
    fn trust_stays_with_the_cluster_that_held_it() {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, pem: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).unwrap();
            p.display().to_string()
        };
        let ca = |n: &str| {
            let c = root(n);
            w(&format!("{n}.pem"), c.cert.pem())
        };
        let (own, victims) = (ca("own"), ca("victims"));
        let cluster = |name: &str, ca: &str| Cluster {
            name: name.into(),
            agent_ca: Some(ca.into()),
            agent_token: None,
            strategies: vec!["default".into()],
            frontends: Vec::new(),
            proxy_password_file: None,
            limits: ClusterLimits::default(),
        };
        let text = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}\nclusters: []\n";
        let admit = |mut extra: Vec<Cluster>, held: &HashMap<String, String>| {
            let _ = keep_first_trust(&mut extra, held, &HashSet::new());
            let (cfg, refused) = ServerConfig::parse_with(text, extra);
            let cfg = cfg.unwrap();
            let names: Vec<String> = refused.into_iter().map(|(n, _)| n).collect();
            (trust_holders(&cfg), names)
        };
        // The attacker's object is older (first), each with its own CA.
        let (held, refused) = admit(
            vec![cluster("ns-x.t", &own), cluster("ns-v.t", &victims)],
            &HashMap::new(),
        );
        assert!(refused.is_empty());
        // The attacker edits its (older) object to the victim's CA.
        let (held, refused) = admit(
            vec![cluster("ns-x.t", &victims), cluster("ns-v.t", &victims)],
            &held,
        );
        assert_eq!(refused, ["ns-x.t"]);
        // And stays refused on the next change.
        let (held, refused) = admit(
            vec![cluster("ns-x.t", &victims), cluster("ns-v.t", &victims)],
            &held,
        );
        assert_eq!(refused, ["ns-x.t"]);
        assert!(held.values().any(|n| n == "ns-v.t"));
        // The victim's object goes: the key is free.
        let (held, refused) = admit(vec![cluster("ns-x.t", &victims)], &held);
        assert!(refused.is_empty());
        assert!(held.values().all(|n| n == "ns-x.t"));
        // A holder whose object exists but could not be read (its Secret
        // is missing: not among the clusters to apply) keeps its key.
        let (held, _) = admit(vec![cluster("ns-v.t", &victims)], &HashMap::new());
        let mut extra = vec![cluster("ns-x.t", &victims)];
        let out = keep_first_trust(&mut extra, &held, &HashSet::from(["ns-v.t".to_string()]));
        assert!(extra.is_empty(), "the claimant is not applied");
        assert_eq!(out[0].0, "ns-x.t");
        assert!(out[0].1[0].message.contains("ns-v.t"), "{:?}", out[0].1);
    }

    /// An older TunnelCluster that adds a newer one's TCP frontend address
    /// goes last and is refused on the collision; the holder keeps it.
    #[test]
    fn a_frontend_address_stays_with_its_holder() {
        let dir = tempfile::tempdir().unwrap();
        let ca = |n: &str| {
            let p = dir.path().join(format!("{n}.pem"));
            std::fs::write(&p, root(n).cert.pem()).unwrap();
            p
        };
        let cluster = |name: &str, ca: PathBuf, tcp: &str| Cluster {
            name: name.into(),
            agent_ca: Some(ca),
            agent_token: None,
            strategies: vec!["default".into()],
            frontends: vec![Frontend {
                name: "kas".into(),
                protocol: FrontendProtocol::HttpConnect,
                unix: None,
                tcp: Some(tcp.parse().unwrap()),
                cert: None,
                key: None,
                client_ca: None,
            }],
            proxy_password_file: None,
            limits: ClusterLimits::default(),
        };
        let (x, v) = (ca("x"), ca("v"));
        let text = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}\nclusters: []\n";
        let victim = cluster("ns-v.t", v, "127.0.0.1:9001");
        let (cfg, _) = ServerConfig::parse_with(text, vec![victim.clone()]);
        let held = trust_holders(&cfg.unwrap());
        // The attacker's object is older (first) and names the victim's
        // address, as an IPv4-mapped IPv6 address.
        let mut extra = vec![cluster("ns-x.t", x, "[::ffff:127.0.0.1]:9001"), victim];
        let _ = keep_first_trust(&mut extra, &held, &HashSet::new());
        let (cfg, refused) = ServerConfig::parse_with(text, extra);
        let names: Vec<String> = refused.into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["ns-x.t"]);
        let kept: Vec<String> = cfg.unwrap().clusters.into_iter().map(|c| c.name).collect();
        assert_eq!(kept, ["ns-v.t"]);
    }
}

/// What a file named by the configuration must hold.
#[derive(Clone, Copy)]
enum Kind {
    Certs,
    Key,
    Roots,
    /// A cluster's agent CA: self-signed CA certificates only.
    Anchors,
    PublicKeys,
    Secret,
}

impl Kind {
    /// Reads `p` and parses it as this kind; why not, if it is not.
    fn check(self, p: &Path) -> Result<(), String> {
        use crate::auth::tls::{load_certs, load_key, load_roots};
        match self {
            Kind::Certs => load_certs(p).map(|_| ()).map_err(|e| e.to_string()),
            Kind::Key => load_key(p).map(|_| ()).map_err(|e| e.to_string()),
            Kind::Roots => load_roots(p).map(|_| ()).map_err(|e| e.to_string()),
            Kind::Anchors => load_roots(p)
                .map_err(|e| e.to_string())
                .and_then(|_| check_anchors(p)),
            Kind::PublicKeys => crate::auth::token::load_keys(p)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Kind::Secret => match std::fs::read_to_string(p) {
                Ok(t) if t.trim().is_empty() => Err("empty".to_string()),
                Ok(_) => Ok(()),
                Err(e) => Err(e.to_string()),
            },
        }
    }
}

/// The files cluster `c` (named `at`) names itself.
fn cluster_files<'a>(at: &str, c: &'a Cluster, files: &mut Vec<(String, &'a Path, Kind)>) {
    if let Some(p) = &c.agent_ca {
        files.push((format!("{at}.agent_ca"), p, Kind::Anchors));
    }
    if let Some(p) = &c.proxy_password_file {
        files.push((format!("{at}.proxy_password_file"), p, Kind::Secret));
    }
    let Some(t) = &c.agent_token else { return };
    if let Some(p) = &t.keys {
        files.push((format!("{at}.agent_token.keys"), p, Kind::PublicKeys));
    }
    let Some(r) = &t.review else { return };
    let at = format!("{at}.agent_token.review");
    files.push((format!("{at}.ca"), &r.ca, Kind::Roots));
    for (key, p, kind) in [
        ("token_file", &r.token_file, Kind::Secret),
        ("cert", &r.cert, Kind::Certs),
        ("key", &r.key, Kind::Key),
    ] {
        if let Some(p) = p {
            files.push((format!("{at}.{key}"), p, kind));
        }
    }
}

/// The files frontend `f` (named `at`) names.
fn frontend_files<'a>(at: &str, f: &'a Frontend, files: &mut Vec<(String, &'a Path, Kind)>) {
    for (key, p, kind) in [
        ("cert", &f.cert, Kind::Certs),
        ("key", &f.key, Kind::Key),
        ("client_ca", &f.client_ca, Kind::Roots),
    ] {
        if let Some(p) = p {
            files.push((format!("{at}.{key}"), p, kind));
        }
    }
}
