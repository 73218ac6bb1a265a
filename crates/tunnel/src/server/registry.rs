//! All clusters, by name, swapped as a whole by a reload; which cluster
//! an agent's certificate or token belongs to.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::cluster::Cluster;
use crate::auth::token::TokenError;

/// Why an agent certificate got no cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertMatch {
    /// No cluster's CA verifies it.
    None,
    /// Two clusters' CAs verify it (their names).
    Ambiguous(Arc<str>, Arc<str>),
}

/// All clusters, by name; swapped as a whole by a reload.
#[derive(Default)]
pub struct Registry {
    pub(super) clusters: ArcSwap<Vec<Arc<Cluster>>>,
}

impl Registry {
    /// A registry of `clusters`.
    pub fn new(clusters: Vec<Arc<Cluster>>) -> Registry {
        Registry {
            clusters: ArcSwap::from_pointee(clusters),
        }
    }

    /// The clusters now.
    pub fn clusters(&self) -> Arc<Vec<Arc<Cluster>>> {
        self.clusters.load_full()
    }

    /// Replaces the cluster list.
    pub fn set(&self, clusters: Vec<Arc<Cluster>>) {
        self.clusters.store(Arc::new(clusters));
    }

    /// A cluster by name.
    pub fn cluster(&self, name: &str) -> Option<Arc<Cluster>> {
        self.clusters
            .load()
            .iter()
            .find(|c| &*c.name == name)
            .cloned()
    }

    /// The one cluster whose CA verifies `certs`. A chain that verifies
    /// for two clusters (one CA cross-signed by another, or a chain the
    /// agent presents through an intermediate that links them) is refused
    /// rather than given to whichever comes first: otherwise one tenant's
    /// agent could serve another tenant's traffic. The configuration check
    /// already refuses shared keys and direct cross-signing; this holds at
    /// any depth. Every cluster's verifier is asked (one signature check
    /// each, at agent connection time only).
    pub fn cluster_for_cert(
        &self,
        certs: &[rustls::pki_types::CertificateDer<'_>],
    ) -> Result<Arc<Cluster>, CertMatch> {
        let clusters = self.clusters.load();
        let mut found = clusters.iter().filter(|c| {
            c.conf
                .load()
                .verifier
                .as_ref()
                .is_some_and(|v| crate::auth::tls::accepts(v.as_ref(), certs))
        });
        match (found.next(), found.next()) {
            (Some(c), None) => Ok(c.clone()),
            (None, _) => Err(CertMatch::None),
            (Some(a), Some(b)) => Err(CertMatch::Ambiguous(a.name.clone(), b.name.clone())),
        }
    }

    /// The cluster whose issuer the token in `authorization` claims, once
    /// that cluster accepted it; a token is never shown to another
    /// cluster's API server.
    pub async fn cluster_for_token(&self, authorization: &str) -> Result<Arc<Cluster>, TokenError> {
        let iss = crate::auth::token::claimed_issuer(authorization)?;
        let found = self.clusters.load().iter().find_map(|c| {
            c.conf
                .load()
                .token
                .clone()
                .filter(|v| v.issuer() == iss)
                .map(|v| (c.clone(), v))
        });
        let Some((c, v)) = found else {
            return Err(TokenError::Invalid(format!(
                "no cluster has issuer {iss:?}"
            )));
        };
        v.check(authorization).await.map(|()| c)
    }

    /// The cluster a shared proxy request names with
    /// `Proxy-Authorization: Basic <cluster>:<password>`, if the password is
    /// that cluster's.
    pub fn cluster_for_proxy_credentials(&self, header: Option<&str>) -> Option<Arc<Cluster>> {
        use base64::Engine;
        let b64 = header?.trim().strip_prefix("Basic ")?.trim();
        let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (user, password) = text.split_once(':')?;
        self.cluster_for_credentials(user, password)
    }

    /// The cluster `user` names, if `password` is its proxy password.
    pub fn cluster_for_credentials(&self, user: &str, password: &str) -> Option<Arc<Cluster>> {
        let c = self.cluster(user)?;
        let conf = c.conf.load();
        let want = conf.proxy_password.as_deref()?;
        constant_time_eq(want.as_bytes(), password.as_bytes()).then(|| c.clone())
    }

    /// Whether any cluster has an agent.
    pub fn any_agent(&self) -> bool {
        self.clusters.load().iter().any(|c| c.agent_count() > 0)
    }
}

/// Compares secrets without an early exit (hand-written: four lines, not
/// worth a dependency).
pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
