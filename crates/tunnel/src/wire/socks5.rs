//! SOCKS5's wire constants and its reply (RFC 1928), shared by the SOCKS
//! frontend and the dial errors that map to its reply codes.

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Protocol version byte of SOCKS5.
pub const VERSION: u8 = 5;
/// "No authentication required".
pub const NO_AUTH: u8 = 0x00;
/// "Username/password" (RFC 1929).
pub const USER_PASS: u8 = 0x02;
/// "No acceptable methods".
pub const NO_METHOD: u8 = 0xFF;

/// Reply codes (RFC 1928 §6).
pub mod rep {
    /// Succeeded.
    pub const OK: u8 = 0x00;
    /// General SOCKS server failure.
    pub const FAILURE: u8 = 0x01;
    /// Connection not allowed by ruleset.
    pub const NOT_ALLOWED: u8 = 0x02;
    /// Network unreachable.
    pub const NETWORK_UNREACHABLE: u8 = 0x03;
    /// Host unreachable.
    pub const HOST_UNREACHABLE: u8 = 0x04;
    /// Connection refused.
    pub const REFUSED: u8 = 0x05;
    /// Command not supported.
    pub const COMMAND: u8 = 0x07;
    /// Address type not supported.
    pub const ADDRESS_TYPE: u8 = 0x08;
}

/// A reply with the bound address 0.0.0.0:0 (the agent's local address is
/// not known here, and clients of CONNECT do not use it).
pub async fn reply<S: AsyncWrite + Unpin>(io: &mut S, code: u8) -> std::io::Result<()> {
    io.write_all(&[VERSION, code, 0, 1, 0, 0, 0, 0, 0, 0]).await
}
