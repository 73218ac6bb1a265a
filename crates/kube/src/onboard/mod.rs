//! Onboarding: one `SeedlinkControlPlane` (in [`crate::crd`]) per hosted
//! control plane, and the controller that generates everything else from it (docs/KUBERNETES.md,
//! "Onboarding a control plane").
//!
//! - [`generate`]: what it becomes, a pure function;
//! - [`certs`]: the agent CA and the agents' certificate;
//! - [`rotation`]: when they are renewed, rotated or revoked;
//! - [`controller`]: issue, generate, apply, report (the Lease holder
//!   writes).

pub mod certs;
pub mod controller;
pub mod generate;
pub mod metrics;
pub mod rotation;
