//! The gateway's Kubernetes source at run time: one watch per kind
//! (kube-rs `watcher` + reflector stores: list, watch from the list's
//! resourceVersion, bookmarks, a re-list after `410 Gone`, back-off on
//! errors), bursts of events coalesced into one snapshot, the snapshot
//! handed to the gateway, and status written back by the lease holder.
//!
//! | event | behaviour |
//! |---|---|
//! | objects change | one snapshot 200 ms after the last event, at most 500 ms after the first |
//! | an object is invalid | left out, with a status condition and an Event; the others are served |
//! | the API server is unreachable | the stores keep the last objects: nothing changes; retries back off |
//! | a watch expires (410) | re-list; the rebuilt snapshot is diffed, unchanged routes are untouched |
//!
//! Its parts, each using only those before it: `api` (the API server
//! clients: HTTP/2, watches spread over a few connections), `metrics`
//! (the source's metrics, the status writes' budget and back-off),
//! `watches` (one watch per
//! kind, the TLSRoute version, the watches' errors), `coalesce` (bursts
//! into one wake-up), `handle` (what a started source returns), `sink`
//! (where its output goes), `status` (routes', policies' and
//! TunnelClusters' status, Events), `gateway_status` (Gateways' and
//! GatewayClasses' status, the Gateway API versions supported), `gateway`
//! (the gateway's kinds, each snapshot translated and applied) and
//! `tunnel` (TunnelClusters and their trust).

use std::time::Duration;

mod api;
mod coalesce;
mod gateway;
mod gateway_status;
mod handle;
mod metrics;
mod poll;
mod released;
mod settled;
mod sink;
mod status;
mod tunnel;
mod watches;

pub use api::{ApiClients, WATCHES_PER_CONNECTION};
pub use coalesce::{MAX_DELAY, QUIET, STATUS_EVERY};
pub use gateway::{start_gateway, GatewaySettings};
pub use handle::{Handle, Readiness};
pub use metrics::{SourceMetrics, WRITES_PER_SEC, WRITE_BURST};
pub use sink::{BoxFuture, GatewaySink, LegacyPaths, Replica, TunnelSink};
pub use tunnel::{
    replica_addresses, replica_count, start_tunnel, TunnelSettings, MAX_REPLICA_ADDRESSES,
};
pub use watches::{served_route_version, WatchErrors, WATCH_TIMEOUT_SECS};

/// The API clients seedlink watches and writes with (HTTP/2, see
/// `api`): the kubeconfig (`KUBECONFIG`, `~/.kube/config`) or the pod's
/// in-cluster configuration, with a read timeout. kube-client sets none by
/// default (for exec and attach, which seedlink does not use); without
/// one, a request sent on a connection that died silently would hang
/// until TCP gave up. No byte within `WATCH_TIMEOUT_SECS` plus 15 s (the
/// connection's pings and a watch's server-side end come before that)
/// ends the connection, and the watches retry on a new one.
/// `watches_per_connection`: how many per-namespace watches share one
/// connection; `most`: how many connections in all (the main one
/// included).
pub async fn clients(
    watches_per_connection: usize,
    most: usize,
) -> Result<ApiClients, kube::Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    config.read_timeout = Some(Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS) + 15));
    ApiClients::new(config, watches_per_connection, most)
}

/// The main client of [`clients`].
pub async fn client() -> Result<kube::Client, kube::Error> {
    Ok(clients(WATCHES_PER_CONNECTION, 1).await?.main().clone())
}
