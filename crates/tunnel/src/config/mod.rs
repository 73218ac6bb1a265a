//! `seedlink tunnel-server` configuration (YAML). Unknown keys are errors;
//! every problem is reported with its path. See docs/TUNNEL.md.
//!
//! Its parts, each using only those above it: `model` (the types and their
//! defaults), `trust` (who holds which agent trust), `check` (bounds,
//! addresses, templates), `files` (what the named files must hold), `parse`
//! (YAML in, every check, problems blamed on their paths).

mod check;
mod files;
mod model;
mod parse;
pub(crate) mod stamp;
#[cfg(test)]
mod tests;
mod trust;

pub use model::{Admin, AgentEndpoint, Kubernetes, Refused, ServerConfig};
pub use seedlink_config::tunnel::{
    Cluster, ClusterLimits, Frontend, FrontendProtocol, ReplicaAddresses, TokenAuth, TokenReview,
    MEASURED_DIALS_PER_SEC, STRATEGIES,
};
pub use trust::{keep_first_trust, trust_claims, trust_holders, MAX_AGENT_CAS};
