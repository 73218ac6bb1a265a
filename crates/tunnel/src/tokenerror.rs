//! Why an agent's token was refused: shared by the local check (`token`)
//! and the TokenReview client (`tokenreview`), which otherwise would
//! import each other.

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
