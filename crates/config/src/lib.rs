//! seedlink configuration.
//!
//! The path is model → validate → compile → swap:
//! [`model`] is the YAML file as written (serde, unknown keys rejected);
//! [`compile`] validates it completely, collecting every problem with its
//! path, and produces an immutable [`Snapshot`] (route table, ACLs, settings)
//! that the gateway swaps in atomically; [`watch`] reports file changes,
//! including editors' atomic renames.

pub mod compile;
pub mod model;
pub mod onboard;
pub mod routes;
pub mod tunnel;
pub mod watch;

pub use compile::{compile, load, ConfigError, Errors, Snapshot};
pub use model::ConfigFile;
