//! [`Snapshot`]: one immutable, validated configuration, what connections
//! hold while a reload swaps in the next.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::model::{ConfigFile, Limits, Timeouts, Upstream};
use crate::routes::{CidrSet, ControlPlane, RouteTable};

use super::listeners::ListenerSpec;

/// One immutable, fully validated configuration. Connections keep the
/// snapshot they started with; a reload swaps in a new one.
#[derive(Debug)]
pub struct Snapshot {
    /// The effective configuration, for the admin dump.
    pub file: ConfigFile,
    /// Listeners.
    pub listeners: Vec<ListenerSpec>,
    /// Admin endpoint address.
    pub admin: SocketAddr,
    /// SNI routes.
    pub routes: RouteTable,
    /// Control planes by name.
    pub control_planes: HashMap<Arc<str>, Arc<ControlPlane>>,
    /// Peers whose PROXY headers are believed.
    pub trusted_lbs: CidrSet,
    /// Clients allowed to every control plane.
    pub always_allowed: CidrSet,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Limits.
    pub limits: Limits,
    /// Upstream behaviour.
    pub upstream: Upstream,
}
