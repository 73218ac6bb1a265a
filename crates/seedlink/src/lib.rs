//! Library side of the `seedlink` binary: the quickstart and the demo
//! control planes (TLS servers that require client certificates) that the
//! quickstart and the end-to-end tests share.

pub mod demo;
pub mod egress;
pub mod quickstart;
pub mod quickstart_tunnel;
