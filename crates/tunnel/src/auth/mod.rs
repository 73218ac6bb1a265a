//! Layer 4, authentication: TLS identities and settings (the agent's
//! client certificate is reloaded when its files change), service-account
//! tokens, and the TokenReview that checks them.

pub mod tls;
pub mod token;
pub mod token_error;
pub mod token_review;
