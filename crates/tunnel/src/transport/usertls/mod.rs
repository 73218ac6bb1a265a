//! TLS 1.3 between a seedlink agent and a seedlink server, with every
//! record decrypted in place in the buffer it was read into and handed on
//! with one copy (docs/PERFORMANCE.md, issue 28; docs/TUNNEL.md).
//!
//! Hand-written because no crate does it: rustls 0.23 copies each
//! decrypted record into a fresh `Vec` (`take_received_plaintext`), which
//! its reader then copies again — in its buffered and its unbuffered API
//! alike (the latter's in-place path is a TODO upstream) — and the profile
//! put those copies at a fifth of the tunnel server's CPU. This is what
//! the kernel does for kTLS, which this host lacks; rustls still does
//! everything cryptographic:
//! - the handshake, through its unbuffered API, so no byte read past the
//!   handshake is lost when it ends;
//! - the key schedule after it ([`KernelConnection`]: key updates, session
//!   tickets);
//! - the record protection (its `MessageEncrypter` / `MessageDecrypter`:
//!   nonces, additional data, the inner content type and padding).
//!
//! This module frames records (RFC 8446 §5), counts sequence numbers,
//! answers and initiates key updates, and bounds its buffers: at most one
//! read chunk plus one record in, [`WRITE_QUEUE`] out, nothing while idle.

mod handshake;
mod records;
mod state;

pub use handshake::{accept, connect, prepare_client, prepare_server};
pub use state::{Session, UserTls, READ_CHUNK, WRITE_QUEUE};

#[cfg(test)]
mod tests;
