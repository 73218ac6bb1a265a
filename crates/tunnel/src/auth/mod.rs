//! Layer 4, authentication: TLS identities and settings, service-account
//! tokens, and the TokenReview that checks them.

pub mod tls;
pub mod token;
pub mod token_error;
pub mod token_review;
