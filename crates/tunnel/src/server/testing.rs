//! What the server's unit tests share: a cluster without trust, and the
//! timers its links use.

use std::time::Duration;

use super::cluster::Limits;
use super::link::Timers;
use super::{Cluster, Strategy};

pub(crate) fn cluster(strategies: &[Strategy]) -> Cluster {
    Cluster::with_trust("c", strategies.to_vec(), None, None, Limits::UNLIMITED)
}

pub(crate) const LIVE: Duration = Duration::from_secs(12);

pub(crate) const TIMERS: Timers = Timers {
    stall: Duration::from_secs(10),
    unresponsive_after: LIVE,
};
