//! seedlink's Kubernetes configuration source (docs/KUBERNETES.md).
//!
//! - [`crd`]: the `SeedlinkPolicy` and `TunnelCluster` resources;
//! - [`translate`]: objects → the gateway's model, a pure function;
//! - [`source`]: the watches, the coalescing of bursts into one snapshot,
//!   and status written back;
//! - [`tunnel`]: TunnelClusters → the tunnel-server's clusters, their
//!   trust written from Secrets/ConfigMaps;
//! - [`leader`]: the Lease that picks the one replica writing status;
//! - [`onboard`]: `SeedlinkControlPlane`, one object per control plane, and
//!   the controller that generates the rest.

pub mod crd;
pub mod leader;
pub mod onboard;
pub mod seed_services;
pub mod source;
pub mod translate;
pub mod tunnel;
