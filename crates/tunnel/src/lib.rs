//! seedlink's reverse tunnel: `tunnel-server` (in the seed) and
//! `tunnel-agent` (in the shoot), wire-compatible with Konnectivity.

pub mod proto;
