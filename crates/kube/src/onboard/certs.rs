//! The certificates the controller issues per control plane: an agent CA
//! (its key stays in a Secret of the control plane's namespace that is not
//! labelled for the tunnel-server) and the agents' client certificate
//! signed by it.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// How long an agent CA is valid.
pub const CA_VALIDITY: SignedDuration = SignedDuration::from_hours(24 * 3650);
/// How long an agent's client certificate is valid.
pub const LEAF_VALIDITY: SignedDuration = SignedDuration::from_hours(24 * 365);

/// A certificate and its key (PEM), and when it expires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its key.
    pub key_pem: String,
    /// Its `notAfter`.
    pub not_after: Timestamp,
}

/// Why a certificate could not be made or read back.
#[derive(Debug, thiserror::Error)]
#[error("certificate: {0}")]
pub struct CertError(String);

impl From<rcgen::Error> for CertError {
    fn from(e: rcgen::Error) -> CertError {
        CertError(e.to_string())
    }
}

fn at(t: Timestamp) -> Result<time::OffsetDateTime, CertError> {
    time::OffsetDateTime::from_unix_timestamp(t.as_second()).map_err(|e| CertError(e.to_string()))
}

/// The agent CA's parameters for the control plane `ns/name`: the same
/// every time, so that the stored key re-creates the issuer that signed
/// its certificate (its subject is every leaf's issuer).
fn ca_params(ns: &str, name: &str) -> Result<CertificateParams, CertError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.distinguished_name
        .push(DnType::CommonName, format!("seedlink agent CA {ns}/{name}"));
    p.distinguished_name
        .push(DnType::OrganizationName, "seedlink");
    Ok(p)
}

/// A new agent CA for the control plane `ns/name`, valid from `now` for
/// `validity`.
pub fn agent_ca(
    ns: &str,
    name: &str,
    now: Timestamp,
    validity: SignedDuration,
) -> Result<Issued, CertError> {
    let key = KeyPair::generate()?;
    let mut p = ca_params(ns, name)?;
    let not_after = now + validity;
    p.not_before = at(now - SignedDuration::from_mins(5))?;
    p.not_after = at(not_after)?;
    let cert = p.self_signed(&key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after,
    })
}

/// A client certificate for the agents of `ns/name`, signed by its CA's
/// key `ca_key_pem`, valid from `now` for `validity`.
pub fn agent_cert(
    ns: &str,
    name: &str,
    ca_key_pem: &str,
    now: Timestamp,
    validity: SignedDuration,
) -> Result<Issued, CertError> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    let issuer = Issuer::new(ca_params(ns, name)?, ca_key);
    client_cert(
        &ClientId {
            cn: &format!("seedlink agent {ns}/{name}"),
            uri: None,
        },
        &issuer,
        now,
        validity,
    )
}

/// kube-apiserver's client certificate for the tunnel-server's shared
/// TCP+mTLS frontend: its CN names the tunnel cluster `id.cn`
/// (`<namespace>.<name>`) and a URI SAN its object (`id.uri`, see
/// `seedlink_config::tunnel::control_plane_uri`), signed by the CA the
/// frontend trusts (`issuer_cert_pem`, `issuer_key_pem`: PKCS#8 or SEC1
/// PEM).
pub fn kube_apiserver_client(
    id: &ClientId<'_>,
    issuer_cert_pem: &str,
    issuer_key_pem: &str,
    now: Timestamp,
    validity: SignedDuration,
) -> Result<Issued, CertError> {
    let issuer_key = KeyPair::from_pem(issuer_key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(issuer_cert_pem, issuer_key)?;
    client_cert(id, &issuer, now, validity)
}

/// Who a client certificate names: its CN, and a URI SAN if any.
#[derive(Debug, Clone, Copy)]
pub struct ClientId<'a> {
    /// The subject's common name.
    pub cn: &'a str,
    /// A URI subject alternative name.
    pub uri: Option<&'a str>,
}

/// Whether the PEM certificate `cert_pem` carries the URI SAN `uri`.
pub fn has_uri(cert_pem: &str, uri: &str) -> bool {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .is_ok_and(|der| seedlink_config::tunnel::certificate_has_uri(&der, uri))
}

/// A client certificate (a fresh key) for `id`, signed by `issuer`, valid
/// from `now` for `validity` (and 5 minutes before, for clock skew).
fn client_cert(
    id: &ClientId<'_>,
    issuer: &Issuer<'_, KeyPair>,
    now: Timestamp,
    validity: SignedDuration,
) -> Result<Issued, CertError> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, id.cn);
    if let Some(uri) = id.uri {
        let uri = rcgen::string::Ia5String::try_from(uri)?;
        p.subject_alt_names = vec![rcgen::SanType::URI(uri)];
    }
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let not_after = now + validity;
    p.not_before = at(now - SignedDuration::from_mins(5))?;
    p.not_after = at(not_after)?;
    let cert = p.signed_by(&key, issuer)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after,
    })
}

/// Whether `cert_pem` and `key_pem` can issue kube-apiserver's
/// certificates: one is issued and verified against the CA as the
/// tunnel-server will (a key that is not the CA's fails here).
pub fn check_issuer(cert_pem: &str, key_pem: &str) -> Result<(), CertError> {
    use rustls::pki_types::{pem::PemObject, CertificateDer, UnixTime};
    let now = Timestamp::now();
    let c = kube_apiserver_client(
        &ClientId {
            cn: "check",
            uri: None,
        },
        cert_pem,
        key_pem,
        now,
        SignedDuration::from_mins(1),
    )?;
    let der = |pem: &str| {
        CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| CertError(e.to_string()))
    };
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(der(cert_pem)?)
        .map_err(|e| CertError(format!("the CA certificate: {e}")))?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.into(),
        rustls::crypto::ring::default_provider().into(),
    )
    .build()
    .map_err(|e| CertError(e.to_string()))?;
    verifier
        .verify_client_cert(&der(&c.cert_pem)?, &[], UnixTime::now())
        .map_err(|e| {
            CertError(format!(
                "a certificate it issues does not verify: {e} (is the key the CA's?)"
            ))
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The leaf a stored CA key signs verifies against the CA certificate
    /// made earlier (the issuer is re-created from the key alone).
    #[test]
    fn a_leaf_signed_with_the_stored_key_chains_to_the_ca() {
        let now = Timestamp::now();
        let ca = agent_ca("shoot--a", "cp", now, CA_VALIDITY).unwrap();
        let leaf = agent_cert("shoot--a", "cp", &ca.key_pem, now, LEAF_VALIDITY).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        let ca_der = rustls_pemfile_der(&ca.cert_pem);
        roots.add(ca_der).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        let leaf_der = rustls_pemfile_der(&leaf.cert_pem);
        let when = rustls::pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            u64::try_from(now.as_second()).unwrap(),
        ));
        verifier.verify_client_cert(&leaf_der, &[], when).unwrap();
        assert!(leaf.not_after > now && ca.not_after > leaf.not_after);
        // Another control plane's CA does not accept it.
        let other = agent_ca("shoot--b", "cp", now, CA_VALIDITY).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(rustls_pemfile_der(&other.cert_pem)).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        assert!(verifier.verify_client_cert(&leaf_der, &[], when).is_err());
    }

    /// kube-apiserver's certificate chains to the operator's CA (made
    /// apart, as openssl or cert-manager would) and names the cluster.
    #[test]
    fn kube_apiserver_client_chains_to_the_operators_ca() {
        let now = Timestamp::now();
        let ca = agent_ca("seed", "kas-clients", now, CA_VALIDITY).unwrap();
        let uri = "urn:seedlink:control-plane:0d1c";
        let id = ClientId {
            cn: "shoot--a.api",
            uri: Some(uri),
        };
        let c = kube_apiserver_client(&id, &ca.cert_pem, &ca.key_pem, now, LEAF_VALIDITY).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(rustls_pemfile_der(&ca.cert_pem)).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        let when = rustls::pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            u64::try_from(now.as_second()).unwrap(),
        ));
        let der = rustls_pemfile_der(&c.cert_pem);
        verifier.verify_client_cert(&der, &[], when).unwrap();
        let text = String::from_utf8_lossy(&der).into_owned();
        assert!(text.contains("shoot--a.api"));
        assert!(has_uri(&c.cert_pem, uri) && !has_uri(&c.cert_pem, "urn:seedlink:x"));
        assert!(!has_uri(&ca.cert_pem, uri) && !has_uri("junk", uri));
        // A key that is no key is an error, not a panic; another CA's
        // key is refused by the check.
        assert!(kube_apiserver_client(&id, &ca.cert_pem, "junk", now, LEAF_VALIDITY).is_err());
        check_issuer(&ca.cert_pem, &ca.key_pem).unwrap();
        let other = agent_ca("seed", "other", now, CA_VALIDITY).unwrap();
        assert!(check_issuer(&ca.cert_pem, &other.key_pem).is_err());
    }

    fn rustls_pemfile_der(pem: &str) -> rustls::pki_types::CertificateDer<'static> {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }
}
