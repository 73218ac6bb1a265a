//! A health check's settings and its results so far: plain data, held by
//! `proxy::NodeProxy` and acted on by `health`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// What a check proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckKind {
    /// A TCP connection to the gateway (through the egress proxy if one is
    /// configured); in `http2-connect` mode a live shared connection.
    /// Successful and unreachable tunnels count as checks too.
    Tcp,
    /// A tunnel opened as a client's would be: the gateway's `200` to
    /// CONNECT, which it gives only after it connected to the API server.
    Tunnel,
    /// A tunnel and a TLS handshake with the API server through it.
    Tls,
    /// A tunnel, a TLS handshake, and an HTTP request whose answer is 2xx
    /// or 3xx (HAProxy's `httpchk` rule).
    Http,
}

impl CheckKind {
    /// The configuration word.
    pub fn word(self) -> &'static str {
        match self {
            CheckKind::Tcp => "tcp",
            CheckKind::Tunnel => "tunnel",
            CheckKind::Tls => "tls",
            CheckKind::Http => "http",
        }
    }
}

/// The health check and how its results turn into readiness.
#[derive(Debug, Clone)]
pub struct HealthCheck {
    /// What is checked.
    pub kind: CheckKind,
    /// How often.
    pub interval: Duration,
    /// Deadline of one check (connect, tunnel, handshake and answer).
    pub timeout: Duration,
    /// Consecutive successes that make an unhealthy upstream healthy.
    pub rise: u32,
    /// Consecutive failures that make a healthy upstream unhealthy.
    pub fall: u32,
    /// TLS client settings of `tls` and `http` checks.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Server name sent in (and, with a CA, verified against) the handshake.
    pub server_name: String,
    /// Path of the `http` check's `GET`.
    pub path: String,
}

impl HealthCheck {
    /// A plain TCP check every 10 s, one result deciding.
    pub fn tcp() -> HealthCheck {
        HealthCheck {
            kind: CheckKind::Tcp,
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(10),
            rise: 1,
            fall: 1,
            tls: None,
            server_name: DEFAULT_SERVER_NAME.into(),
            path: "/version".into(),
        }
    }
}

/// The name kube-apiserver's serving certificate always carries.
pub const DEFAULT_SERVER_NAME: &str = "kubernetes.default.svc";

/// TLS settings of a check: verified against `roots` when given; otherwise
/// the handshake must complete (signatures are checked) but any certificate
/// is accepted, which proves a TLS server answers, not which one.
pub fn client_config(roots: Option<rustls::RootCertStore>) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let mut cfg = match roots {
        Some(roots) => builder.with_root_certificates(roots).with_no_client_auth(),
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Accepts every certificate but still checks the handshake signatures.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Results so far, turned into healthy / unhealthy with rise and fall.
#[derive(Debug, Default)]
pub struct HealthState {
    inner: Mutex<StateInner>,
}

#[derive(Debug, Default)]
struct StateInner {
    decided: bool,
    healthy: bool,
    oks: u32,
    fails: u32,
    last: String,
}

impl HealthState {
    /// Records one result; returns the health after it. The first result
    /// decides at once; after that it takes `rise` successes or `fall`
    /// failures in a row to change.
    pub fn record(&self, check: &HealthCheck, result: Result<(), &str>) -> bool {
        let mut s = seedlink_net::sync::lock(&self.inner, "health state");
        match result {
            Ok(()) => {
                s.fails = 0;
                s.oks = s.oks.saturating_add(1);
                s.last = "ok".into();
                if !s.healthy && (!s.decided || s.oks >= check.rise) {
                    if s.decided {
                        tracing::info!(check = check.kind.word(), "upstream healthy again");
                    }
                    s.healthy = true;
                }
            }
            Err(why) => {
                s.oks = 0;
                s.fails = s.fails.saturating_add(1);
                s.last = why.to_string();
                if s.healthy && s.fails >= check.fall {
                    tracing::warn!(
                        check = check.kind.word(),
                        reason = why,
                        failures = s.fails,
                        "upstream unhealthy"
                    );
                    s.healthy = false;
                } else if !s.decided {
                    tracing::warn!(
                        check = check.kind.word(),
                        reason = why,
                        "upstream not healthy yet"
                    );
                }
            }
        }
        s.decided = true;
        s.healthy
    }

    /// The last result's reason (`ok` or why it failed), for `/readyz`.
    pub fn last(&self) -> String {
        let s = seedlink_net::sync::lock(&self.inner, "health state");
        if s.decided {
            s.last.clone()
        } else {
            "no check yet".into()
        }
    }
}
