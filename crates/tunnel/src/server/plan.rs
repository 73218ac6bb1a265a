//! Reading a configuration into a [`Plan`] before anything changes: every
//! cluster's trust, tokens and limits, every frontend's transport and TLS,
//! every file loaded. A bad configuration fails here, whole, and nothing
//! running is touched; [`ServerError`] says where and why.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio_rustls::TlsAcceptor;

use super::cluster::Limits;
use super::metrics::Metrics;
use super::{ClusterConf, Strategy};
use crate::auth::tls;
use crate::auth::token::TokenValidator;
use crate::auth::token_review::TokenReviewer;
use crate::config::{Frontend, FrontendProtocol, ServerConfig};

pub(super) enum Transport {
    Unix(PathBuf),
    Tcp(SocketAddr, TlsAcceptor),
    /// Loopback only (checked by the configuration), or an authenticated
    /// shared proxy.
    TcpPlain(SocketAddr),
}

/// A frontend as configured and prepared (certificates loaded).
pub(super) struct PlannedFrontend {
    /// `None`: a shared proxy frontend (the request names the cluster).
    pub(super) cluster: Option<String>,
    pub(super) cfg: Frontend,
    pub(super) transport: Transport,
}

/// A cluster as configured and prepared (trust loaded).
pub(super) struct PlannedCluster {
    pub(super) name: String,
    pub(super) conf: ClusterConf,
    pub(super) limits: Limits,
}

/// Everything a configuration asks for, read and checked; applying it
/// cannot fail for want of a file.
pub struct Plan {
    pub(super) clusters: Vec<PlannedCluster>,
    pub(super) frontends: Vec<PlannedFrontend>,
    pub(super) agent_tls: rustls::ServerConfig,
}

/// Why a tunnel-server could not be built, started or reloaded; each
/// variant names the setting (and cluster) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// TLS material a setting names is unusable.
    #[error("{at}: {error}")]
    Tls {
        /// The setting.
        at: String,
        /// Why.
        error: Box<tls::TlsError>,
    },
    /// Token checking could not be set up.
    #[error("{at}: {error}")]
    Auth {
        /// The setting.
        at: String,
        /// Why.
        error: Box<crate::auth::token::AuthSetupError>,
    },
    /// A setting the checked configuration should have excluded, or a
    /// secret file that cannot be used.
    #[error("{at}: {why}")]
    Invalid {
        /// The setting.
        at: String,
        /// Why.
        why: String,
    },
    /// A socket could not be set up.
    #[error("{at}: {error}")]
    Listen {
        /// The listener and address.
        at: String,
        /// Why.
        error: std::io::Error,
    },
    /// A reload changed a setting that needs a restart.
    #[error("agents, admin, server_id, server_count, dial_timeout, agent_wait, stall_timeout and queue_bytes need a restart; only clusters, shared_frontends and frontend_templates reload")]
    NeedsRestart,
    /// A reload was applied, but some changed frontends did not start.
    #[error("applied, but frontends failed to start: {}", failed_text(.0))]
    FrontendsFailed(Vec<FrontendFailure>),
    /// Clusters whose trust, password or frontend could not be prepared
    /// (every one, found in one pass); nothing was applied.
    #[error("{}", in_clusters_text(.0))]
    InClusters(Vec<(String, String)>),
}

pub(super) fn in_clusters_text(c: &[(String, String)]) -> String {
    c.iter()
        .map(|(name, why)| format!("cluster {name}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A frontend that did not start in a reload.
#[derive(Debug, Clone)]
pub struct FrontendFailure {
    /// Its cluster (`None`: a shared frontend, the operator's).
    pub cluster: Option<String>,
    /// Why, with the frontend's label.
    pub why: String,
}

pub(super) fn failed_text(f: &[FrontendFailure]) -> String {
    f.iter()
        .map(|f| f.why.as_str())
        .collect::<Vec<_>>()
        .join("; ")
}

impl ServerError {
    /// The clusters this error is theirs alone (a cluster's frontend that
    /// did not start, its trust that did not load), if it is not the
    /// operator's.
    pub fn clusters(&self) -> Vec<(String, String)> {
        match self {
            ServerError::InClusters(c) => c.clone(),
            ServerError::FrontendsFailed(f) => f
                .iter()
                .filter_map(|f| Some((f.cluster.clone()?, f.why.clone())))
                .collect(),
            _ => Vec::new(),
        }
    }

    pub(super) fn tls(at: impl Into<String>) -> impl FnOnce(tls::TlsError) -> ServerError {
        let at = at.into();
        move |error| ServerError::Tls {
            at,
            error: Box::new(error),
        }
    }

    pub(super) fn listen(at: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServerError {
        let at = at.into();
        move |error| ServerError::Listen { at, error }
    }
}

/// The ALPN a TLS frontend of `protocol` offers.
fn frontend_alpn(protocol: FrontendProtocol) -> &'static [&'static [u8]] {
    match protocol {
        FrontendProtocol::Grpc => &[b"h2"],
        FrontendProtocol::HttpConnect | FrontendProtocol::HttpProxy => &[b"http/1.1"],
        FrontendProtocol::Socks5 => &[],
    }
}

/// How a configured frontend listens; `authenticated` frontends (every
/// request carries a cluster's password) may use plain TCP anywhere.
pub(super) fn transport(
    f: &Frontend,
    what: &str,
    authenticated: bool,
) -> Result<Transport, ServerError> {
    Ok(match (&f.unix, &f.tcp, &f.cert, &f.key, &f.client_ca) {
        (Some(p), None, ..) => Transport::Unix(p.clone()),
        (None, Some(a), Some(cert), Some(key), Some(ca)) => {
            let v = tls::load_roots(ca)
                .and_then(tls::client_verifier)
                .map_err(ServerError::tls(format!("{what}: client_ca")))?;
            let alpn = frontend_alpn(f.protocol);
            let sc =
                tls::server_config(cert, key, Some(v), alpn).map_err(ServerError::tls(what))?;
            Transport::Tcp(*a, TlsAcceptor::from(Arc::new(sc)))
        }
        (None, Some(a), None, None, None) if a.ip().is_loopback() || authenticated => {
            Transport::TcpPlain(*a)
        }
        _ => {
            return Err(ServerError::Invalid {
                at: what.to_string(),
                why: "unix, or tcp with cert, key and client_ca".into(),
            })
        }
    })
}

/// Reads and checks everything `cfg` refers to.
pub fn plan(cfg: &ServerConfig, metrics: &Metrics) -> Result<Plan, ServerError> {
    plan_with(cfg, metrics, &PlanCache::default())
}

/// [`plan`], reusing from `cache` each cluster's trust (its agent CA's
/// verifier, its token check, its proxy password) while its settings are
/// the same and none of the files they name was replaced or written (one
/// `stat` each): a reload costs a read and a parse only for the clusters
/// that changed, and the others' agents are not checked again.
pub fn plan_with(
    cfg: &ServerConfig,
    metrics: &Metrics,
    cache: &PlanCache,
) -> Result<Plan, ServerError> {
    let mut clusters = Vec::new();
    let mut frontends = Vec::new();
    // Every cluster's problem in one pass: a reload that must leave some
    // out leaves them all out at once.
    let mut failed = Vec::new();
    let mut cached = seedlink_net::sync::lock(&cache.0, "plan cache");
    let mut next = std::collections::HashMap::with_capacity(cfg.clusters.len());
    for c in &cfg.clusters {
        match plan_reusing(c, metrics, &mut cached) {
            Ok(((planned, mut fs), k)) => {
                next.insert(c.name.clone(), k);
                clusters.push(planned);
                frontends.append(&mut fs);
            }
            Err(e) => failed.push((c.name.clone(), e.to_string())),
        }
    }
    if !failed.is_empty() {
        return Err(ServerError::InClusters(failed));
    }
    // A plan that fails keeps what it did not look at; what it took is
    // read again the next time (a cost, never a stale trust).
    *cached = next;
    drop(cached);
    frontends.append(&mut shared_frontends(cfg)?);
    let agent_tls = agent_tls(cfg, &clusters)?;
    Ok(Plan {
        clusters,
        frontends,
        agent_tls,
    })
}

/// The frontends clusters share, read and checked.
fn shared_frontends(cfg: &ServerConfig) -> Result<Vec<PlannedFrontend>, ServerError> {
    cfg.shared_frontends
        .iter()
        .map(|f| {
            let what = format!("shared frontend {}", f.name);
            Ok(PlannedFrontend {
                cluster: None,
                cfg: f.clone(),
                transport: transport(f, &what, f.protocol.is_proxy())?,
            })
        })
        .collect()
}

/// What the clusters of the last plan were planned from, and their trust.
#[derive(Default)]
pub struct PlanCache(std::sync::Mutex<std::collections::HashMap<String, Cached>>);

/// One cluster's entry in a [`PlanCache`].
pub struct Cached {
    cfg: crate::config::Cluster,
    stamps: Vec<Option<crate::config::stamp::Stamp>>,
    trust: Trust,
}

/// A cluster's trust, as planned.
struct Trust {
    verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    token: Option<Arc<TokenValidator>>,
    proxy_password: Option<String>,
}

/// The stamps of every file cluster `c`'s trust names (`None`: it cannot
/// be read as a file now, or changed within the last seconds, so nothing
/// is reused).
fn stamps(c: &crate::config::Cluster) -> Vec<Option<crate::config::stamp::Stamp>> {
    let token = c.agent_token.as_ref();
    let review = token.and_then(|t| t.review.as_ref());
    let files = [
        c.agent_ca.as_deref(),
        c.proxy_password_file.as_deref(),
        token.and_then(|t| t.keys.as_deref()),
        review.map(|r| r.ca.as_path()),
        review.and_then(|r| r.token_file.as_deref()),
        review.and_then(|r| r.cert.as_deref()),
        review.and_then(|r| r.key.as_deref()),
    ];
    files
        .into_iter()
        .flatten()
        .map(crate::config::stamp::stamp)
        .collect()
}

/// Cluster `c` and its frontends, with its trust from `cached` where
/// that still holds (the entry is taken out), and its new entry.
fn plan_reusing(
    c: &crate::config::Cluster,
    metrics: &Metrics,
    cached: &mut std::collections::HashMap<String, Cached>,
) -> Result<((PlannedCluster, Vec<PlannedFrontend>), Cached), ServerError> {
    let stamps = stamps(c);
    let hit = cached
        .remove(&c.name)
        .filter(|k| k.cfg == *c && stamps.iter().all(Option::is_some) && k.stamps == stamps);
    if let Some(k) = hit {
        return plan_cached(c, k);
    }
    let (p, fs) = plan_one(c, metrics)?;
    let trust = Trust {
        verifier: p.conf.verifier.clone(),
        token: p.conf.token.clone(),
        proxy_password: p.conf.proxy_password.clone(),
    };
    let k = Cached {
        cfg: c.clone(),
        stamps,
        trust,
    };
    Ok(((p, fs), k))
}

/// Cluster `c` planned with the trust of its cache entry `k`.
fn plan_cached(
    c: &crate::config::Cluster,
    k: Cached,
) -> Result<((PlannedCluster, Vec<PlannedFrontend>), Cached), ServerError> {
    let t = &k.trust;
    let planned = PlannedCluster {
        name: c.name.clone(),
        conf: conf(
            c,
            t.verifier.clone(),
            t.token.clone(),
            t.proxy_password.clone(),
        ),
        limits: c.limits.into(),
    };
    Ok(((planned, cluster_frontends(c)?), k))
}

/// One cluster and its frontends, read and checked.
pub(super) fn plan_one(
    c: &crate::config::Cluster,
    metrics: &Metrics,
) -> Result<(PlannedCluster, Vec<PlannedFrontend>), ServerError> {
    let planned = plan_cluster(c, metrics)?;
    Ok((planned, cluster_frontends(c)?))
}

/// Cluster `c`'s own frontends, read and checked.
fn cluster_frontends(c: &crate::config::Cluster) -> Result<Vec<PlannedFrontend>, ServerError> {
    c.frontends
        .iter()
        .map(|f| {
            Ok(PlannedFrontend {
                cluster: Some(c.name.clone()),
                cfg: f.clone(),
                transport: transport(f, &format!("cluster {} frontend {}", c.name, f.name), false)?,
            })
        })
        .collect()
}

/// The agent endpoint's TLS: any cluster's CA verifies a client
/// certificate, which is mandatory unless some cluster takes tokens.
pub(super) fn agent_tls(
    cfg: &ServerConfig,
    clusters: &[PlannedCluster],
) -> Result<rustls::ServerConfig, ServerError> {
    let any = tls::AnyOf {
        verifiers: clusters
            .iter()
            .filter_map(|c| c.conf.verifier.clone())
            .collect(),
        mandatory: clusters.iter().all(|c| c.conf.token.is_none()),
    };
    let agent_tls = tls::server_config_for(
        &cfg.agents.cert,
        &cfg.agents.key,
        Some(Arc::new(any)),
        &[crate::transport::native::ALPN.as_bytes(), b"h2"],
        tls::Versions::UserTls13,
    )
    .map_err(ServerError::tls("agents: TLS"))?;
    Ok(agent_tls)
}

/// One cluster: its agents' trust (CA, tokens), proxy password, strategies
/// and limits, read and checked.
pub(super) fn plan_cluster(
    c: &crate::config::Cluster,
    metrics: &Metrics,
) -> Result<PlannedCluster, ServerError> {
    let verifier = match &c.agent_ca {
        Some(ca) => Some(
            tls::load_roots(ca)
                .and_then(tls::client_verifier)
                .map_err(ServerError::tls(format!("cluster {}: agent_ca", c.name)))?,
        ),
        None => None,
    };
    let token = match &c.agent_token {
        Some(t) => Some(Arc::new(token_validator(&c.name, t, metrics)?)),
        None => None,
    };
    let proxy_password = match &c.proxy_password_file {
        Some(p) => Some(read_password(&c.name, p)?),
        None => None,
    };
    Ok(PlannedCluster {
        name: c.name.clone(),
        conf: conf(c, verifier, token, proxy_password),
        limits: c.limits.into(),
    })
}

/// Cluster `c`'s settings with its trust.
fn conf(
    c: &crate::config::Cluster,
    verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    token: Option<Arc<TokenValidator>>,
    proxy_password: Option<String>,
) -> ClusterConf {
    ClusterConf {
        strategies: c
            .strategies
            .iter()
            .filter_map(|s| Strategy::from_name(s))
            .collect(),
        verifier,
        token,
        proxy_password,
        frontends: c.frontends.iter().map(frontend_label).collect(),
        client_uri: c.frontend_client_uri.clone(),
        seed: c.seed_destinations.clone(),
    }
}

/// Counts a cluster's TokenReview outcomes.
fn review_counter(cluster: &str, metrics: &Metrics) -> crate::auth::token_review::Outcomes {
    let (reviews, cluster) = (metrics.token_reviews.clone(), cluster.to_string());
    Arc::new(move |outcome: &str| {
        reviews
            .get_or_create(&crate::server::metrics::ClusterReason {
                cluster: cluster.clone(),
                reason: outcome.to_string(),
            })
            .inc();
    })
}

/// A cluster's token check: local keys, or a TokenReview whose outcomes
/// are counted.
pub(super) fn token_validator(
    cluster: &str,
    t: &crate::config::TokenAuth,
    metrics: &Metrics,
) -> Result<TokenValidator, ServerError> {
    match (&t.keys, &t.review) {
        (Some(keys), None) => TokenValidator::new(keys, &t.issuer, &t.audience, &t.service_account),
        (None, Some(r)) => TokenReviewer::new(r, review_counter(cluster, metrics)).and_then(|r| {
            TokenValidator::with_review(r, &t.issuer, &t.audience, &t.service_account)
        }),
        _ => {
            return Err(ServerError::Invalid {
                at: format!("cluster {cluster}: agent_token"),
                why: "exactly one of keys or review".into(),
            })
        }
    }
    .map_err(|error| ServerError::Auth {
        at: format!("cluster {cluster}: agent_token"),
        error: Box::new(error),
    })
}

/// A cluster's proxy password (the file's trimmed content, not empty).
pub(super) fn read_password(cluster: &str, p: &std::path::Path) -> Result<String, ServerError> {
    let at = || format!("cluster {cluster}: proxy_password_file {}", p.display());
    let text = std::fs::read_to_string(p).map_err(|e| ServerError::Invalid {
        at: at(),
        why: e.to_string(),
    })?;
    let pw = text.trim();
    if pw.is_empty() {
        return Err(ServerError::Invalid {
            at: at(),
            why: "empty".into(),
        });
    }
    Ok(pw.to_string())
}

/// `name (protocol, where)` of a frontend, for the admin views.
pub(super) fn frontend_label(f: &Frontend) -> String {
    let at = match (&f.unix, &f.tcp) {
        (Some(p), _) => p.display().to_string(),
        (_, Some(a)) => a.to_string(),
        _ => String::new(),
    };
    format!("{} ({:?}, {at})", f.name, f.protocol)
}

#[cfg(test)]
mod cache_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ca() -> String {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.self_signed(&rcgen::KeyPair::generate().unwrap())
            .unwrap()
            .pem()
    }

    /// Written a minute ago, as far as its stamp says (a file changed in
    /// the last seconds is always read again).
    fn aged(path: &std::path::Path) {
        let f = std::fs::File::options().write(true).open(path).unwrap();
        let then = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        f.set_modified(then).unwrap();
    }

    fn verifiers(p: &Plan) -> Vec<Arc<dyn rustls::server::danger::ClientCertVerifier>> {
        p.clusters
            .iter()
            .map(|c| c.conf.verifier.clone().unwrap())
            .collect()
    }

    /// A plan reuses a cluster's trust while its settings and files stay;
    /// a CA file replaced (a rename, as the Kubernetes source writes) or
    /// written in place, or other settings, are read again; the other
    /// cluster keeps its trust throughout.
    #[test]
    fn trust_is_read_again_only_where_it_changed() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.pem"), dir.path().join("b.pem"));
        std::fs::write(&a, ca()).unwrap();
        std::fs::write(&b, ca()).unwrap();
        aged(&a);
        aged(&b);
        let server = rcgen::generate_simple_self_signed(vec!["tunnel".to_string()]).unwrap();
        let (crt, key) = (dir.path().join("s.pem"), dir.path().join("s-key.pem"));
        std::fs::write(&crt, server.cert.pem()).unwrap();
        std::fs::write(&key, server.signing_key.serialize_pem()).unwrap();
        let cfg = |limit: u32| {
            crate::config::ServerConfig::parse(&format!(
                "agents: {{listen: '127.0.0.1:0', cert: '{}', key: '{}'}}\nclusters:\n  - {{name: a, agent_ca: '{}', limits: {{max_agents: {limit}}}}}\n  - {{name: b, agent_ca: '{}'}}\n",
                crt.display(),
                key.display(),
                a.display(),
                b.display()
            ))
            .unwrap()
        };
        let (metrics, cache) = (Metrics::new(), PlanCache::default());
        let first = verifiers(&plan_with(&cfg(4), &metrics, &cache).unwrap());
        let again = verifiers(&plan_with(&cfg(4), &metrics, &cache).unwrap());
        assert!(Arc::ptr_eq(&first[0], &again[0]) && Arc::ptr_eq(&first[1], &again[1]));
        // Replaced by a rename.
        let new = dir.path().join("a.new");
        std::fs::write(&new, ca()).unwrap();
        aged(&new);
        std::fs::rename(&new, &a).unwrap();
        let renamed = verifiers(&plan_with(&cfg(4), &metrics, &cache).unwrap());
        assert!(
            !Arc::ptr_eq(&again[0], &renamed[0]),
            "a replaced CA is read"
        );
        assert!(Arc::ptr_eq(&again[1], &renamed[1]), "b untouched");
        // Written in place (a longer file: another size).
        std::fs::write(&a, format!("{}{}", ca(), ca())).unwrap();
        aged(&a);
        let written = verifiers(&plan_with(&cfg(4), &metrics, &cache).unwrap());
        assert!(
            !Arc::ptr_eq(&renamed[0], &written[0]),
            "a rewritten CA is read"
        );
        // Written just now: read again, whatever its stamp.
        std::fs::write(&b, std::fs::read(&b).unwrap()).unwrap();
        let fresh = verifiers(&plan_with(&cfg(4), &metrics, &cache).unwrap());
        assert!(
            !Arc::ptr_eq(&written[1], &fresh[1]),
            "a file just written is read"
        );
        aged(&b);
        let b_now = verifiers(&plan_with(&cfg(4), &metrics, &cache).unwrap())[1].clone();
        // Another setting of the cluster: planned again.
        let other = verifiers(&plan_with(&cfg(5), &metrics, &cache).unwrap());
        assert!(!Arc::ptr_eq(&written[0], &other[0]));
        assert!(Arc::ptr_eq(&b_now, &other[1]), "b kept its trust");
        // A CA gone: the plan fails, as without the cache.
        std::fs::remove_file(&a).unwrap();
        assert!(plan_with(&cfg(5), &metrics, &cache).is_err());
    }
}
