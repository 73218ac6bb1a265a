//! One replica writes status: whoever holds the `coordination.k8s.io`
//! Lease. Every replica serves the same objects either way; only status
//! writes and Events wait for the lease, so two replicas never fight over
//! a condition.
//!
//! The timings are client-go's leader-election defaults: a 15 s lease,
//! renewed every 10 s by its holder, tried every 2 s by the others. A
//! holder that cannot renew for the whole lease stops writing before anyone
//! else may take over. Updates carry `resourceVersion`, so two replicas
//! racing for an expired lease cannot both win (the API server answers
//! the second with 409 Conflict). Hand-written because kube-rs has no
//! leader election and it is this one loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;

/// How long a lease is valid after its last renewal.
pub const LEASE: Duration = Duration::from_secs(15);
/// How often the holder renews.
pub const RENEW: Duration = Duration::from_secs(10);
/// How often the others try.
pub const RETRY: Duration = Duration::from_secs(2);

/// Whether this replica currently holds the lease.
#[derive(Debug, Clone, Default)]
pub struct Leadership(Arc<AtomicBool>);

impl Leadership {
    /// Whether this replica may write status now.
    pub fn held(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// Always held (no election: a single replica, or tests).
    pub fn always() -> Leadership {
        Leadership(Arc::new(AtomicBool::new(true)))
    }

    fn set(&self, v: bool) {
        if self.0.swap(v, Ordering::AcqRel) != v {
            if v {
                tracing::info!("status leader: this replica writes status");
            } else {
                tracing::info!("status leader: lost; another replica writes status");
            }
        }
    }
}

/// Campaigns for `namespace/name` as `identity` until `stop`.
pub async fn campaign(
    client: kube::Client,
    namespace: String,
    name: String,
    identity: String,
    me: Leadership,
    stop: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let mut last_renewed: Option<Instant> = None;
    loop {
        match try_acquire(&api, &name, &identity).await {
            Ok(true) => {
                last_renewed = Some(Instant::now());
                me.set(true);
            }
            Ok(false) => {
                last_renewed = None;
                me.set(false);
            }
            Err(e) => {
                tracing::warn!(error = %e, lease = %format!("{namespace}/{name}"), "status lease: cannot reach the API server");
                // Keep writing only while the lease surely is still ours.
                if last_renewed.is_none_or(|t| t.elapsed() >= LEASE - RETRY) {
                    me.set(false);
                }
            }
        }
        let wait = if me.held() { RENEW } else { RETRY };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => break,
        }
    }
    me.set(false);
}

/// One round: creates, renews or takes over the lease. Whether it is ours.
async fn try_acquire(api: &Api<Lease>, name: &str, identity: &str) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let Some(mut lease) = api.get_opt(name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(identity.into()),
                lease_duration_seconds: Some(LEASE.as_secs() as i32),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let ours = spec.holder_identity.as_deref() == Some(identity);
    let duration = spec.lease_duration_seconds.map_or(LEASE, |s| {
        Duration::from_secs(u64::try_from(s).unwrap_or(0))
    });
    // A renewal time in the future (another clock) is not expired.
    let expired = spec
        .renew_time
        .as_ref()
        .is_none_or(|t| now.duration_since(t.0).as_secs_f64() >= duration.as_secs_f64());
    if !ours && !expired && spec.holder_identity.is_some() {
        return Ok(false);
    }
    if !ours {
        spec.holder_identity = Some(identity.into());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(LEASE.as_secs() as i32);
    spec.renew_time = Some(MicroTime(now));
    // `replace` sends the resourceVersion we read: a concurrent writer makes
    // this a 409, and the lease stays with whoever wrote first.
    match api.replace(name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
