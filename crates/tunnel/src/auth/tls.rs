//! TLS material for the tunnel roles: PEM files, server configurations that
//! require client certificates from one or more CAs, and telling which CA
//! (so which cluster) a verified client certificate belongs to.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

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

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
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
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions.list())?
        .with_root_certificates(load_roots(ca)?);
    let mut cfg = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|source| TlsError::Pair {
                cert: cert.display().to_string(),
                key: key.display().to_string(),
                source,
            })?,
        None => builder.with_no_client_auth(),
    };
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
