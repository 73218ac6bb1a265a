//! The gateway's Kubernetes source at run time: one watch per kind
//! (kube-rs `watcher` + reflector stores: list, watch from the list's
//! resourceVersion, bookmarks, a re-list after `410 Gone`, back-off on
//! errors), bursts of events coalesced into one snapshot, the snapshot
//! handed to the gateway, and status written back by the lease holder.
//!
//! | event | behaviour |
//! |---|---|
//! | objects change | one snapshot 200 ms after the last event, at most 2 s after the first |
//! | an object is invalid | left out, with a status condition and an Event; the others are served |
//! | the API server is unreachable | the stores keep the last objects: nothing changes; retries back off |
//! | a watch expires (410) | re-list; the rebuilt snapshot is diffed, unchanged routes are untouched |
//!
//! Its parts: `watches` (one watch per kind, the TLSRoute version),
//! `coalesce` (bursts into one wake-up), `gateway` (the gateway's kinds,
//! each snapshot translated and applied), `tunnel` (TunnelClusters and
//! their trust), `status` (routes', policies' and TunnelClusters' status,
//! Events) and `gateway_status` (Gateways' and GatewayClasses' status).

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use gateway_api::gatewayclasses::GatewayClass;
use gateway_api::gateways::Gateway;
use gateway_api::referencegrants::ReferenceGrant;
use gateway_api::tlsroutes::{TlsRoute, TlsRouteParentRefs};
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event as RuntimeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Resource;
use seedlink_config::model::ControlPlane;
use seedlink_config::ConfigError;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::crd::{SeedlinkPolicy, CONTROLLER_NAME};
use crate::leader::{self, Leadership};
use crate::translate::{
    Key, Objects, RouteOutcome, Translation, Translator, Verdict, GATEWAY_GROUP,
};

mod coalesce;
mod gateway;
mod gateway_status;
mod status;
mod tunnel;
mod watches;

use coalesce::*;
use gateway::*;
use gateway_status::*;
use status::*;
use watches::*;

pub use gateway::start_gateway;
pub use tunnel::{replica_count, start_tunnel, BoxFuture, TunnelSettings, TunnelSink};
pub use watches::WATCH_TIMEOUT_SECS;
/// The API client seedlink watches and writes with: the kubeconfig
/// (`KUBECONFIG`, `~/.kube/config`) or the pod's in-cluster configuration,
/// with a read timeout. kube-client sets none by default (for exec and
/// attach, which seedlink does not use); without one, a list or watch
/// request sent on a pooled connection that died silently would hang until
/// TCP gave up. No answer byte within `WATCH_TIMEOUT_SECS` plus 15 s (a
/// watch's server-side end comes before that) ends the request, and the
/// watcher retries on a new connection.
pub async fn client() -> Result<kube::Client, kube::Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    config.read_timeout = Some(Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS) + 15));
    kube::Client::try_from(config)
}

/// Quiet time after the last event before a snapshot is built.
pub const QUIET: Duration = Duration::from_millis(200);
/// Longest wait after the first event of a burst.
pub const MAX_DELAY: Duration = Duration::from_secs(2);
/// How often the status leader compares status with what it should be
/// (besides after every snapshot).
pub const STATUS_EVERY: Duration = Duration::from_secs(10);

/// Where the gateway's control planes go.
pub trait GatewaySink: Send + Sync + 'static {
    /// Serves these control planes (besides the file's); returns those it
    /// refused, with its problems. Open connections are never touched.
    fn apply(&self, control_planes: Vec<ControlPlane>) -> Vec<(String, Vec<ConfigError>)>;
}

/// What the gateway's source needs to know.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// The named Gateway (`kubernetes.gateway`), served on every listener.
    pub gateway: Option<Key>,
    /// The Gateways of a class, each at its own address
    /// (`kubernetes.gateway_class`).
    pub class: Option<crate::translate::ClassSettings>,
    /// The gateway's listener names.
    pub listeners: Vec<String>,
    /// The status lease; `None`: this replica never writes status.
    pub lease: Option<Key>,
    /// This replica's name in the lease (the pod name).
    pub identity: String,
    /// The EndpointSlice managers whose slices name upstreams.
    pub slice_managers: Vec<String>,
    /// The Service seedlink is exposed by (the named Gateway's addresses).
    pub service: Option<Key>,
}

/// A running source.
pub struct Handle {
    synced: watch::Receiver<bool>,
    errors: WatchErrors,
    /// Whether this replica writes status.
    pub leadership: Leadership,
    stop: CancellationToken,
    /// The lease campaign (which releases a held lease when it stops).
    campaign: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Whether a source's first snapshot is applied, and if not, why.
#[derive(Clone)]
pub struct Readiness {
    synced: watch::Receiver<bool>,
    errors: WatchErrors,
}

impl Readiness {
    /// `None` once the first snapshot is applied (for good: an outage
    /// later keeps the last snapshot served); before, why not.
    pub fn why_not(&self) -> Option<String> {
        if *self.synced.borrow() {
            return None;
        }
        Some(match self.errors.describe() {
            Some(e) => format!("no complete snapshot from the API server yet; last errors: {e}"),
            None => "no complete snapshot from the API server yet (listing)".to_string(),
        })
    }
}

impl Handle {
    /// Waits until every kind was listed once and the first snapshot was
    /// applied, at most `timeout`. Whether that happened.
    pub async fn synced(&self, timeout: Duration) -> bool {
        let mut rx = self.synced.clone();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// What readiness asks of this source: its first snapshot applied.
    pub fn readiness(&self) -> Readiness {
        Readiness {
            synced: self.synced.clone(),
            errors: self.errors.clone(),
        }
    }

    /// Stops the watches and the status writer.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Stops, and waits (at most `limit`) until a held status lease was
    /// released, so that another replica writes status at once.
    pub async fn shutdown(&self, limit: Duration) {
        self.stop.cancel();
        let task = seedlink_net::sync::lock(&self.campaign, "lease campaign").take();
        if let Some(task) = task {
            let _ = tokio::time::timeout(limit, task).await;
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Each kind's last watch error while it fails (cleared when its watch
/// delivers again): what readiness says while the first snapshot is not
/// in.
#[derive(Clone, Default)]
pub struct WatchErrors(Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>);

impl WatchErrors {
    fn set(&self, kind: &str, error: String) {
        seedlink_net::sync::lock(&self.0, "watch errors").insert(kind.to_string(), error);
    }

    fn clear(&self, kind: &str) {
        seedlink_net::sync::lock(&self.0, "watch errors").remove(kind);
    }

    /// The failing kinds with their last errors, if any.
    fn describe(&self) -> Option<String> {
        let m = seedlink_net::sync::lock(&self.0, "watch errors");
        let all: Vec<String> = m.iter().map(|(k, e)| format!("{k}: {e}")).collect();
        (!all.is_empty()).then(|| all.join("; "))
    }
}
