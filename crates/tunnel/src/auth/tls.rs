//! TLS material for the tunnel roles: PEM files, server configurations that
//! require client certificates from one or more CAs, and telling which CA
//! (so which cluster) a verified client certificate belongs to.
//!
//! The agent's client certificate is read again when its files change
//! ([`ReloadingIdentity`]): a Secret volume the kubelet updates (a
//! certificate renewed or rotated) is presented from the next handshake
//! on, without a restart, and the streams already open keep theirs. A pair
//! that does not load (a half-written update, a key that does not match)
//! is logged and the last good one kept, so a rotation never leaves the
//! agent without an identity.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, SignatureScheme};

/// Why TLS material could not be loaded or a TLS configuration built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate file could not be read or parsed.
    #[error("reading certificates from {path}: {source}")]
    Certs {
        /// The file.
        path: String,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// The file holds no certificate.
    #[error("{0}: no certificate found")]
    NoCert(String),
    /// A key file could not be read or parsed.
    #[error("reading a private key from {path}: {source}")]
    Key {
        /// The file.
        path: String,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// A certificate in a CA file cannot be a trust anchor.
    #[error("{path}: not a usable CA certificate: {source}")]
    Ca {
        /// The file.
        path: String,
        /// Why.
        source: rustls::Error,
    },
    /// A certificate and key that do not belong together (or are unusable).
    #[error("{cert} / {key}: certificate and key: {source}")]
    Pair {
        /// The certificate file.
        cert: String,
        /// The key file.
        key: String,
        /// Why.
        source: rustls::Error,
    },
    /// rustls refused the configuration itself.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// A client certificate verifier could not be built.
    #[error("building a client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The crypto provider every TLS configuration here uses (ring).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |source| TlsError::Certs {
        path: path.display().to_string(),
        source,
    };
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(bad)?
        .collect::<Result<_, _>>()
        .map_err(bad)?;
    if certs.is_empty() {
        return Err(TlsError::NoCert(path.display().to_string()));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::Key {
        path: path.display().to_string(),
        source,
    })
}

/// A root store with every certificate of `path`.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|source| TlsError::Ca {
            path: path.display().to_string(),
            source,
        })?;
    }
    Ok(roots)
}

/// A verifier accepting client certificates issued by `roots`.
pub fn client_verifier(roots: RootCertStore) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    Ok(WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider()).build()?)
}

/// A server configuration for `cert`/`key`; with `clients`, a client
/// certificate that it accepts is required.
pub fn server_config(
    cert: &Path,
    key: &Path,
    clients: Option<Arc<dyn ClientCertVerifier>>,
    alpn: &[&[u8]],
) -> Result<rustls::ServerConfig, TlsError> {
    server_config_for(cert, key, clients, alpn, Versions::Default)
}

/// Which TLS versions a configuration allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Versions {
    /// TLS 1.2 and 1.3.
    Default,
    /// TLS 1.3 only, secrets extractable: for [`crate::transport::usertls`].
    UserTls13,
}

/// TLS 1.3 alone.
static TLS13_ONLY: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];

impl Versions {
    fn list(self) -> &'static [&'static rustls::SupportedProtocolVersion] {
        match self {
            Versions::Default => rustls::DEFAULT_VERSIONS,
            Versions::UserTls13 => TLS13_ONLY,
        }
    }
}

/// [`server_config`] with the TLS versions given.
pub fn server_config_for(
    cert: &Path,
    key: &Path,
    clients: Option<Arc<dyn ClientCertVerifier>>,
    alpn: &[&[u8]],
    versions: Versions,
) -> Result<rustls::ServerConfig, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(versions.list())?;
    let builder = match clients {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(|source| TlsError::Pair {
            cert: cert.display().to_string(),
            key: key.display().to_string(),
            source,
        })?;
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    if versions == Versions::UserTls13 {
        crate::transport::usertls::prepare_server(&mut cfg);
    }
    Ok(cfg)
}

/// A client configuration trusting `ca`, presenting `cert`/`key` if given.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    alpn: &[String],
) -> Result<rustls::ClientConfig, TlsError> {
    client_config_for(ca, identity, alpn, Versions::Default)
}

/// [`client_config`] with the TLS versions given.
pub fn client_config_for(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    alpn: &[String],
    versions: Versions,
) -> Result<rustls::ClientConfig, TlsError> {
    let identity = identity
        .map(|(cert, key)| ReloadingIdentity::load(cert, key, provider()))
        .transpose()?
        .map(Arc::new);
    client_config_with(ca, identity, alpn, versions)
}

/// [`client_config_for`] presenting `identity` (read again when its files
/// change: a renewed certificate), which the caller keeps to see changes.
pub fn client_config_with(
    ca: &Path,
    identity: Option<Arc<ReloadingIdentity>>,
    alpn: &[String],
    versions: Versions,
) -> Result<rustls::ClientConfig, TlsError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions.list())?
        .with_root_certificates(load_roots(ca)?);
    let mut cfg = match identity {
        Some(id) => builder.with_client_cert_resolver(id),
        None => builder.with_no_client_auth(),
    };
    // No TLS session resumption with a client certificate: a resumed
    // session carries the certificate of the handshake that made it, so a
    // stream opened for a renewed certificate would present the old one
    // (expired, or from a CA no longer trusted) instead.
    if cfg.client_auth_cert_resolver.has_certs() {
        cfg.resumption = rustls::client::Resumption::disabled();
    }
    cfg.alpn_protocols = alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
    if versions == Versions::UserTls13 {
        crate::transport::usertls::prepare_client(&mut cfg);
    }
    Ok(cfg)
}

/// Whether `verifier` accepts the presented chain (`certs[0]` is the
/// end-entity certificate).
pub fn accepts(verifier: &dyn ClientCertVerifier, certs: &[CertificateDer<'_>]) -> bool {
    let Some((end, intermediates)) = certs.split_first() else {
        return false;
    };
    verifier
        .verify_client_cert(end, intermediates, UnixTime::now())
        .is_ok()
}

/// Accepts a client certificate issued by any of several verifiers (one per
/// cluster); which one is decided after the handshake with [`accepts`].
#[derive(Debug)]
pub struct AnyOf {
    /// One verifier per cluster with a client CA.
    pub verifiers: Vec<Arc<dyn ClientCertVerifier>>,
    /// Whether a client certificate is required (no cluster takes tokens).
    pub mandatory: bool,
}

impl ClientCertVerifier for AnyOf {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let mut last = rustls::Error::General("no client CA configured".into());
        for v in &self.verifiers {
            match v.verify_client_cert(end_entity, intermediates, now) {
                Ok(ok) => return Ok(ok),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        let p = provider();
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &p.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        let p = provider();
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &p.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }
}

/// The subject common name of a DER certificate.
pub fn subject_cn(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

/// What identifies one version of the files: their modification times
/// and sizes (a Secret volume swaps a symlink, which changes both).
type Stamp = [(Option<SystemTime>, u64); 2];

fn stamp(cert: &Path, key: &Path) -> Stamp {
    [cert, key].map(|p| match std::fs::metadata(p) {
        Ok(m) => (m.modified().ok(), m.len()),
        Err(_) => (None, 0),
    })
}

/// A client identity from a certificate and a key file, reloaded when
/// they change.
#[derive(Debug)]
pub struct ReloadingIdentity {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<(Stamp, Arc<CertifiedKey>)>,
}

impl ReloadingIdentity {
    /// Loads the pair (it must load: the agent does not start without
    /// its identity).
    pub fn load(
        cert: &Path,
        key: &Path,
        provider: Arc<CryptoProvider>,
    ) -> Result<ReloadingIdentity, TlsError> {
        let at = stamp(cert, key);
        let pair = certified(cert, key, &provider)?;
        Ok(ReloadingIdentity {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            loaded: Mutex::new((at, Arc::new(pair))),
        })
    }

    /// The identity to present now: the files' current pair if they
    /// changed and load, else the last good one.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.refresh();
        seedlink_net::sync::lock(&self.loaded, "agent identity")
            .1
            .clone()
    }

    /// Reads the files again if they changed; `true` when a new pair was
    /// loaded (one that does not load is tried again at the next call: an
    /// update may be half written).
    pub fn refresh(&self) -> bool {
        let now = stamp(&self.cert, &self.key);
        let mut loaded = seedlink_net::sync::lock(&self.loaded, "agent identity");
        if loaded.0 == now {
            return false;
        }
        match certified(&self.cert, &self.key, &self.provider) {
            // The same certificate written again: nothing changed.
            Ok(pair) if pair.cert == loaded.1.cert => {
                loaded.0 = now;
                false
            }
            Ok(pair) => {
                tracing::info!(cert = %self.cert.display(), "agent certificate reloaded");
                *loaded = (now, Arc::new(pair));
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "agent certificate changed but does not load; presenting the previous one");
                false
            }
        }
    }
}

/// The pair from the files, checked to belong together.
fn certified(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let pair = |source| TlsError::Pair {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        source,
    };
    let signing = provider
        .key_provider
        .load_private_key(load_key(key)?)
        .map_err(pair)?;
    let ck = CertifiedKey::new(load_certs(cert)?, signing);
    ck.keys_match().map_err(pair)?;
    Ok(ck)
}

impl ResolvesClientCert for ReloadingIdentity {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn leaf(cn: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        (p.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    /// Writes the pair and dates both files `secs` after the epoch, so
    /// that each version has a stamp of its own whatever the clock.
    fn write(dir: &Path, (cert, key): &(String, String), secs: u64) {
        for (name, text) in [("c.pem", cert), ("k.pem", key)] {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs))
                .unwrap();
        }
    }

    fn presented(id: &ReloadingIdentity) -> Vec<u8> {
        id.current().cert[0].to_vec()
    }

    #[test]
    fn a_renewed_pair_is_presented_and_a_broken_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let (one, two, three) = (leaf("one"), leaf("two"), leaf("three"));
        write(d, &one, 1_000);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let id = ReloadingIdentity::load(&d.join("c.pem"), &d.join("k.pem"), provider).unwrap();
        let first = presented(&id);
        assert_eq!(presented(&id), first, "unchanged files: the same pair");
        write(d, &two, 2_000);
        let second = presented(&id);
        assert_ne!(second, first, "the renewed pair is presented");
        // A certificate without its key (half an update): the last good
        // pair stays, and the whole update is taken once it lands.
        write(d, &(three.0.clone(), two.1.clone()), 3_000);
        assert_eq!(presented(&id), second);
        std::fs::write(d.join("c.pem"), "not a certificate").unwrap();
        assert_eq!(presented(&id), second);
        write(d, &three, 4_000);
        let third = presented(&id);
        assert!(third != second && third != first);
    }
}
