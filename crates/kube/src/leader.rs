//! One replica writes status: whoever holds the `coordination.k8s.io`
//! Lease. Every replica serves the same objects either way; only status
//! writes and Events wait for the lease, so two replicas never fight over
//! a condition.
//!
//! client-go's leader election, its semantics and its defaults (kube-rs
//! has none; it is this one loop, and [`Elector`] is its pure part):
//! - a 15 s lease; every replica tries every 2 s (the holder renews);
//! - a follower takes the lease over only once it has seen the lease
//!   record unchanged for the whole lease duration, measured on its own
//!   clock from when it observed the last change — never by comparing the
//!   remote `renewTime` with its clock, so clock skew cannot make it early;
//! - the holder stops writing when it has not renewed for 10 s (the renew
//!   deadline), counted from the start of its last successful renewal, so
//!   it has stopped before any follower may take over (15 s after it saw
//!   that renewal, which happened after it started): never two writers;
//! - on shutdown the holder stops writing and then releases the lease
//!   (empty holder, 1 s duration), so a rollout does not leave status
//!   unwritten for a lease duration;
//! - updates carry `resourceVersion`: of two replicas racing for a lease,
//!   the API server answers the second with 409 Conflict.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;

/// How long a lease is valid after its last change.
pub const LEASE: Duration = Duration::from_secs(15);
/// How long the holder keeps writing without a successful renewal.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// How often every replica tries (the holder renews).
pub const RETRY: Duration = Duration::from_secs(2);
/// Longest wait for one round of a replica that does not lead.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the release on shutdown (the caller waits a little
/// longer: `Handle::shutdown`).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether this replica currently holds the lease: until when it may
/// write (so a replica whose renewals hang stops writing at its renew
/// deadline, whatever its campaign loop is doing).
#[derive(Debug, Clone, Default)]
pub struct Leadership(Arc<std::sync::Mutex<Option<Instant>>>);

impl Leadership {
    /// Whether this replica may write status now.
    pub fn held(&self) -> bool {
        self.remaining().is_some()
    }

    /// How long this replica may still write (each write is bounded by
    /// it, so none lands after the renew deadline), if it may.
    pub fn remaining(&self) -> Option<Duration> {
        let until = (*seedlink_net::sync::lock(&self.0, "leadership"))?;
        until
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    /// Always held (no election: a single replica, or tests).
    pub fn always() -> Leadership {
        let forever = Instant::now() + Duration::from_secs(100 * 365 * 86_400);
        Leadership(Arc::new(std::sync::Mutex::new(Some(forever))))
    }

    fn set(&self, until: Option<Instant>) {
        let was = self.held();
        *seedlink_net::sync::lock(&self.0, "leadership") = until;
        let now = self.held();
        if was != now {
            if now {
                tracing::info!("status leader: this replica writes status");
            } else {
                tracing::info!("status leader: not (or no longer) this replica");
            }
        }
    }
}

/// What a replica saw of the lease: the record, and when (its own clock)
/// it last saw the record change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Observed {
    holder: Option<String>,
    renew: Option<String>,
    duration: Duration,
    at: Instant,
}

/// The election's decisions, on explicit time.
#[derive(Debug)]
pub struct Elector {
    identity: String,
    observed: Option<Observed>,
    /// Start of the last successful create or renewal by this replica.
    renewed: Option<Instant>,
}

impl Elector {
    /// An elector for `identity`.
    pub fn new(identity: &str) -> Elector {
        Elector {
            identity: identity.to_string(),
            observed: None,
            renewed: None,
        }
    }

    /// Records the lease as read at `now`: the observation time moves only
    /// when the record changed.
    pub fn observe(&mut self, spec: &LeaseSpec, now: Instant) {
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let renew = spec.renew_time.as_ref().map(|t| t.0.to_string());
        let duration = spec.lease_duration_seconds.map_or(LEASE, |s| {
            Duration::from_secs(u64::try_from(s).unwrap_or(0))
        });
        let changed = self
            .observed
            .as_ref()
            .is_none_or(|o| o.holder != holder || o.renew != renew);
        if changed {
            self.observed = Some(Observed {
                holder,
                renew,
                duration,
                at: now,
            });
        }
        // Someone else holds it: our own renewals no longer count.
        if self
            .observed
            .as_ref()
            .is_some_and(|o| o.holder.as_ref().is_some_and(|h| *h != self.identity))
        {
            self.renewed = None;
        }
    }

    /// Whether this replica may write the lease as its own at `now`: it
    /// holds it, nobody does, or the record was seen unchanged for its
    /// whole duration.
    pub fn may_acquire(&self, now: Instant) -> bool {
        match &self.observed {
            None => true,
            Some(o) => match &o.holder {
                None => true,
                Some(h) if *h == self.identity => true,
                Some(_) => now.saturating_duration_since(o.at) >= o.duration,
            },
        }
    }

    /// A create or renewal that started at `started` succeeded.
    pub fn renewed(&mut self, started: Instant) {
        self.renewed = Some(started);
    }

    /// The lease went to someone else (or could not be written).
    pub fn lost(&mut self) {
        self.renewed = None;
    }

    /// Whether this replica may write status at `now`.
    pub fn leading(&self, now: Instant) -> bool {
        self.until().is_some_and(|u| now < u)
    }

    /// Until when this replica may write status (the renew deadline after
    /// its last successful renewal's start).
    pub fn until(&self) -> Option<Instant> {
        self.renewed.map(|t| t + RENEW_DEADLINE)
    }
}

/// Campaigns for `namespace/name` as `identity` until `stop`; on stop, a
/// held lease is released.
pub async fn campaign(
    client: kube::Client,
    namespace: String,
    name: String,
    identity: String,
    me: Leadership,
    stop: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let mut elector = Elector::new(&identity);
    let lease_name = format!("{namespace}/{name}");
    loop {
        let started = Instant::now();
        // While leading, a renewal may take until the renew deadline (as
        // client-go's); otherwise one round is bounded by REQUEST_TIMEOUT.
        let limit = elector
            .until()
            .and_then(|u| u.checked_duration_since(started))
            .filter(|d| !d.is_zero())
            .unwrap_or(REQUEST_TIMEOUT);
        let round = tokio::select! {
            r = tokio::time::timeout(limit, try_acquire(&api, &name, &identity, &mut elector)) => r,
            () = stop.cancelled() => break,
        };
        match round {
            Ok(Ok(true)) => elector.renewed(started),
            Ok(Ok(false)) => elector.lost(),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, lease = %lease_name, "status lease: cannot reach the API server");
            }
            Err(_) => {
                tracing::warn!(lease = %lease_name, "status lease: the API server did not answer in time");
            }
        }
        me.set(elector.until());
        // Rounds start every RETRY, however long the last one took.
        tokio::select! {
            () = tokio::time::sleep_until((started + RETRY).into()) => {}
            () = stop.cancelled() => break,
        }
    }
    let was_leading = me.held();
    me.set(None);
    if was_leading {
        give_up(&api, &name, &identity, &lease_name).await;
    }
}

/// Releases a held lease, within [`RELEASE_TIMEOUT`] (else it expires).
async fn give_up(api: &Api<Lease>, name: &str, identity: &str, lease_name: &str) {
    match tokio::time::timeout(RELEASE_TIMEOUT, release(api, name, identity)).await {
        Ok(Ok(())) => tracing::info!(lease = %lease_name, "status lease released"),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, lease = %lease_name, "status lease not released; it expires")
        }
        Err(_) => {
            tracing::warn!(lease = %lease_name, "status lease not released in time; it expires")
        }
    }
}

/// Writes `identity` into the lease as its holder, renewed `now`; a new
/// holder counts a transition.
fn hold(spec: &mut LeaseSpec, identity: &str, now: Timestamp) {
    if spec.holder_identity.as_deref() != Some(identity) {
        spec.holder_identity = Some(identity.into());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(LEASE.as_secs() as i32);
    spec.renew_time = Some(MicroTime(now));
}

/// One round: creates, renews or takes over the lease. Whether it is ours.
async fn try_acquire(
    api: &Api<Lease>,
    name: &str,
    identity: &str,
    elector: &mut Elector,
) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let Some(mut lease) = api.get_opt(name).await? else {
        return create(api, name, identity, now).await;
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    elector.observe(spec, Instant::now());
    if !elector.may_acquire(Instant::now()) {
        return Ok(false);
    }
    hold(spec, identity, now);
    // `replace` sends the resourceVersion we read: a concurrent writer makes
    // this a 409, and the lease stays with whoever wrote first.
    match api.replace(name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Creates the lease, held by `identity`; false when another replica
/// created it first.
async fn create(
    api: &Api<Lease>,
    name: &str,
    identity: &str,
    now: Timestamp,
) -> Result<bool, kube::Error> {
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
    match api.create(&PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Gives the lease up (client-go's release on cancel): no holder, a 1 s
/// duration, so the next replica takes it at its next try.
async fn release(api: &Api<Lease>, name: &str, identity: &str) -> Result<(), kube::Error> {
    let Some(mut lease) = api.get_opt(name).await? else {
        return Ok(());
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(identity) {
        return Ok(());
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    api.replace(name, &PostParams::default(), &lease)
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renew_secs: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_string),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(
                Timestamp::from_second(1_700_000_000 + renew_secs).unwrap_or(Timestamp::UNIX_EPOCH),
            )),
            ..LeaseSpec::default()
        }
    }

    /// A follower takes over only after seeing the record unchanged for
    /// the whole lease, on its own clock; each renewal it sees restarts
    /// that; a remote renewTime far in the past (a skewed clock) does not
    /// make it early.
    #[test]
    fn a_follower_waits_a_whole_lease_from_the_last_change_it_saw() {
        let t0 = Instant::now();
        let mut f = Elector::new("b");
        // Skewed: the holder's clock says a year ago.
        f.observe(&spec(Some("a"), -31_536_000), t0);
        assert!(!f.may_acquire(t0));
        assert!(!f.may_acquire(t0 + Duration::from_secs(14)));
        // A renewal seen at t0+14 restarts the wait.
        f.observe(&spec(Some("a"), -31_535_990), t0 + Duration::from_secs(14));
        assert!(!f.may_acquire(t0 + Duration::from_secs(20)));
        // The same record seen again does not.
        f.observe(&spec(Some("a"), -31_535_990), t0 + Duration::from_secs(20));
        assert!(!f.may_acquire(t0 + Duration::from_secs(28)));
        assert!(f.may_acquire(t0 + Duration::from_secs(29)));
        // A released lease (no holder) is free at once.
        let mut g = Elector::new("c");
        g.observe(&spec(None, 0), t0);
        assert!(g.may_acquire(t0));
    }

    /// The holder stops writing 10 s after the start of its last
    /// successful renewal: before any follower (which saw that renewal no
    /// earlier than it started) may take over 15 s after seeing it.
    #[test]
    fn the_holder_stops_writing_before_anyone_may_take_over() {
        let t0 = Instant::now();
        let mut holder = Elector::new("a");
        holder.observe(&spec(Some("a"), 0), t0);
        holder.renewed(t0);
        assert!(holder.leading(t0 + Duration::from_secs(9)));
        assert!(!holder.leading(t0 + RENEW_DEADLINE));
        let mut follower = Elector::new("b");
        // The earliest the follower can see that renewal is when it began.
        follower.observe(&spec(Some("a"), 0), t0);
        let takeover = (0..60)
            .map(|s| t0 + Duration::from_secs(s))
            .find(|t| follower.may_acquire(*t))
            .unwrap_or(t0);
        let fenced = (0..60)
            .map(|s| t0 + Duration::from_secs(s))
            .find(|t| !holder.leading(*t))
            .unwrap_or(t0);
        assert!(fenced < takeover, "{fenced:?} vs {takeover:?}");
        // Seeing someone else hold it ends leadership at once.
        holder.observe(&spec(Some("b"), 20), t0 + Duration::from_secs(3));
        assert!(!holder.leading(t0 + Duration::from_secs(3)));
    }
}
