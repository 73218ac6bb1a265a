//! Why an agent's token was refused, and why token checking could not be
//! set up: shared by the local check (`token`) and the TokenReview client
//! (`token_review`), which otherwise would import each other.

/// Why a token was refused (for logs and metrics; the agent only learns
/// that it was refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not `Bearer <token>`.
    #[error("authorization is not 'Bearer <token>'")]
    Malformed,
    /// Signature, issuer, audience or expiry wrong.
    #[error("token rejected: {0}")]
    Invalid(String),
    /// Signed and valid, but for another ServiceAccount.
    #[error("token is for {0}, not the agent's ServiceAccount")]
    WrongSubject(String),
    /// The API server could not be asked (TokenReview); not cached.
    #[error("token could not be reviewed: {0}")]
    Unavailable(String),
}

/// Why token checking for a cluster could not be set up (a bad file or
/// setting): the configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthSetupError {
    /// The public key file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A PEM block that is no RSA or EC public key.
    #[error("{0}: a PEM block is neither an RSA nor an EC public key")]
    NotAKey(String),
    /// No public key in the file.
    #[error("{0}: no public key found")]
    NoKey(String),
    /// `service_account` is not `<namespace>/<name>`.
    #[error("service_account must be <namespace>/<name>")]
    ServiceAccount,
    /// The TokenReview URL is unusable.
    #[error("review url {url:?}: {why}")]
    ReviewUrl {
        /// The URL as configured.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The TokenReview client's TLS material.
    #[error(transparent)]
    Tls(#[from] crate::auth::tls::TlsError),
}
