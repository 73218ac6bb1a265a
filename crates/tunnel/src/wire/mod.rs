//! Layer 1, the wire: what crosses between the peers, as pure data. No IO,
//! no clock.

pub mod dial_error;
pub mod proto;
pub mod socks5;
