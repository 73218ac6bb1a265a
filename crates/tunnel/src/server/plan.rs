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
    let mut clusters = Vec::new();
    let mut frontends = Vec::new();
    // Every cluster's problem in one pass: a reload that must leave some
    // out leaves them all out at once.
    let mut failed = Vec::new();
    for c in &cfg.clusters {
        match plan_one(c, metrics) {
            Ok((planned, mut fs)) => {
                clusters.push(planned);
                frontends.append(&mut fs);
            }
            Err(e) => failed.push((c.name.clone(), e.to_string())),
        }
    }
    if !failed.is_empty() {
        return Err(ServerError::InClusters(failed));
    }
    for f in &cfg.shared_frontends {
        frontends.push(PlannedFrontend {
            cluster: None,
            cfg: f.clone(),
            transport: transport(
                f,
                &format!("shared frontend {}", f.name),
                f.protocol.is_proxy(),
            )?,
        });
    }
    let agent_tls = agent_tls(cfg, &clusters)?;
    Ok(Plan {
        clusters,
        frontends,
        agent_tls,
    })
}

/// One cluster and its frontends, read and checked.
pub(super) fn plan_one(
    c: &crate::config::Cluster,
    metrics: &Metrics,
) -> Result<(PlannedCluster, Vec<PlannedFrontend>), ServerError> {
    let planned = plan_cluster(c, metrics)?;
    let frontends = c
        .frontends
        .iter()
        .map(|f| {
            Ok(PlannedFrontend {
                cluster: Some(c.name.clone()),
                cfg: f.clone(),
                transport: transport(f, &format!("cluster {} frontend {}", c.name, f.name), false)?,
            })
        })
        .collect::<Result<Vec<_>, ServerError>>()?;
    Ok((planned, frontends))
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
        conf: ClusterConf {
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
        },
        limits: c.limits.into(),
    })
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
