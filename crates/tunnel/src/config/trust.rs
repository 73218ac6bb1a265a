//! Who holds which agent trust: the keys of a cluster's CAs and token
//! issuers, the claims they make, and the rule that the first holder keeps
//! a claim (a later cluster naming the same trust is refused alone).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;

use super::model::*;
use seedlink_config::tunnel::Cluster;
use seedlink_config::{ConfigError, Errors};

/// The keys a cluster trusts to name its agents: the public keys of its
/// agent CA certificates and its token keys, as SubjectPublicKeyInfo DER.
/// Files that do not read give nothing here (their own check reports them).
pub(super) fn trust_keys(c: &Cluster) -> Vec<(Vec<u8>, &'static str)> {
    use rustls::pki_types::pem::PemObject;
    let mut out = Vec::new();
    if let Some(p) = &c.agent_ca {
        let keys = CA_KEYS.get(p, 0, ca_keys);
        for k in keys.unwrap_or_else(|()| every_ca_key(p)) {
            out.push((k, "agent_ca"));
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

/// The public keys of the CA certificates in file `p`, to be kept by the
/// file's stamp; `Err` (nothing kept: [`every_ca_key`] reads it, now and
/// next time) when it does not read, or holds more than
/// [`MAX_AGENT_CAS`] certificates or [`MOST_KEY_BYTES`] of keys (such a
/// file is refused anyway, and a cache of it would hold its size).
fn ca_keys(p: &std::path::Path) -> Result<Vec<Vec<u8>>, ()> {
    let certs = crate::auth::tls::load_certs(p).map_err(|_| ())?;
    if certs.len() > MAX_AGENT_CAS {
        return Err(());
    }
    let keys = keys_of(&certs);
    match keys.iter().map(Vec::len).sum::<usize>() <= MOST_KEY_BYTES {
        true => Ok(keys),
        false => Err(()),
    }
}

/// The public keys of every certificate in file `p` that parses (none if
/// it does not read).
fn every_ca_key(p: &std::path::Path) -> Vec<Vec<u8>> {
    keys_of(&crate::auth::tls::load_certs(p).unwrap_or_default())
}

fn keys_of(certs: &[rustls::pki_types::CertificateDer<'_>]) -> Vec<Vec<u8>> {
    certs
        .iter()
        .filter_map(|der| x509_parser::parse_x509_certificate(der).ok())
        .map(|(_, x)| x.tbs_certificate.subject_pki.raw.to_vec())
        .collect()
}

/// The most bytes of CA keys kept per file: sixteen RSA-4096 keys.
const MOST_KEY_BYTES: usize = 16 * 600;

/// [`ca_keys`] by file, while the file's stamp stays.
static CA_KEYS: super::stamp::ByStamp<Vec<Vec<u8>>> = super::stamp::ByStamp::new();

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
pub(super) fn claim_id(bytes: &[u8]) -> String {
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
/// it holds, and so does a holder among `extra` that no longer claims it
/// (it stopped trusting it, and its status keeps it reserved: agents may
/// still present the revoked CA's certificates, a kube-apiserver may
/// still dial the old address) against any cluster of another namespace;
/// a claimant of either is refused here. A
/// holder that is neither (its object was deleted) holds nothing. Without
/// this, a tenant could edit an older TunnelCluster to claim a newer
/// tenant's CA, token keys or frontend address and take its agents or its
/// kube-apiserver's connections.
pub fn keep_first_trust(
    extra: &mut Vec<Cluster>,
    held: &HashMap<String, String>,
    refused: &HashSet<String>,
) -> Refused {
    let stolen = what_each_takes(extra, held, refused);
    let mut out = Vec::new();
    let mut indexed: Vec<(bool, Cluster)> = Vec::new();
    for ((steals, from_refused), c) in stolen.into_iter().zip(extra.drain(..)) {
        match from_refused {
            Some((owner, how)) => out.push((
                c.name,
                vec![ConfigError {
                    path: String::new(),
                    message: format!(
                        "trusts a key (or names an address) that cluster {owner:?} holds; that cluster {how} what it holds"
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

/// A claim's owner that keeps it whatever the claimant: its name and how.
type Keeper = (String, &'static str);

/// Per cluster of `extra`: whether it claims what another among `extra`
/// holds and still claims (it goes last, and the overlap refuses it), and
/// which holder keeps a claim it makes though that holder does not claim
/// it now (refused for now, or reserved after it stopped: the claimant is
/// refused here, as no overlap would show).
fn what_each_takes(
    extra: &[Cluster],
    held: &HashMap<String, String>,
    refused: &HashSet<String>,
) -> Vec<(bool, Option<Keeper>)> {
    let claims: Vec<Vec<String>> = extra.iter().map(trust_claims).collect();
    let claimed_by = |key: &String, name: &str| {
        extra
            .iter()
            .zip(&claims)
            .any(|(c, keys)| c.name == name && keys.contains(key))
    };
    let exists = |name: &str| extra.iter().any(|c| c.name == name);
    let keeper = |k: &String, owner: &String, claimant: &str| -> Option<&'static str> {
        if refused.contains(owner) {
            Some("is refused for now but keeps")
        } else if !claimed_by(k, owner) && exists(owner) && !same_namespace(owner, claimant) {
            Some("stopped using it but keeps reserved (its status.released)")
        } else {
            None
        }
    };
    let take = |(c, keys): (&Cluster, &Vec<String>)| {
        let mut steals = false;
        let mut kept = None;
        for k in keys {
            let Some(owner) = held.get(k).filter(|o| **o != c.name) else {
                continue;
            };
            match keeper(k, owner, &c.name) {
                Some(how) => kept = Some((owner.clone(), how)),
                None => steals |= claimed_by(k, owner),
            }
        }
        (steals, kept)
    };
    extra.iter().zip(&claims).map(take).collect()
}

/// Whether two TunnelClusters (`<namespace>.<name>`) are of one
/// namespace: what one released, the other may take (whoever writes one
/// writes the other).
fn same_namespace(a: &str, b: &str) -> bool {
    match (a.split_once('.'), b.split_once('.')) {
        (Some((x, _)), Some((y, _))) => x == y,
        _ => false,
    }
}

/// Certificates one `agent_ca` may hold.
pub const MAX_AGENT_CAS: usize = 16;

/// An `agent_ca` holds roots only: self-signed CA certificates, each one
/// that parses. An intermediate (or a leaf) as an anchor would let a
/// tenant name a certificate of another tenant's chain and share, or
/// block, its agents; with roots only, two clusters can overlap only by
/// sharing a key, which [`claim_trust`] refuses.
pub(super) fn check_anchors(p: &Path) -> Result<(), String> {
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
pub(super) struct Claimed {
    pub(super) keys: HashMap<Vec<u8>, String>,
}

/// Trust shared with a cluster already kept (the file's, then the older
/// objects') refuses the newer claim: adds it to `bad` (the extra clusters'
/// problems by index). `Err` when the file's own clusters share trust.
pub(super) fn refuse_shared_trust(
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
pub(super) fn claim_trust(seen: &mut Claimed, c: &Cluster, at: &str) -> Option<ConfigError> {
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

/// `cfg` if no two of its clusters share trust (a CA or a token issuer).
pub(super) fn no_shared_trust(cfg: ServerConfig) -> Result<ServerConfig, Errors> {
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
