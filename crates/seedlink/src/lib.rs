//! Library side of the `seedlink` binary (whose `main` only parses flags and
//! dispatches): every role's entry ([`roles`]), the one [`supervisor`] they
//! run under, `check-config` ([`check`]), the `tunnel-config` renderer
//! ([`tunnel_config`], [`egress`]), the quickstart and the demo control
//! planes (TLS servers that require client certificates) that the
//! quickstart and the end-to-end tests share.

pub mod check;
pub mod demo;
pub mod egress;
pub mod quickstart;
pub mod quickstart_tunnel;
pub mod roles;
pub mod supervisor;
pub mod tunnel_config;
