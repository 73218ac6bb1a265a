//! The source's own metrics (docs/OPERATIONS.md, "Metrics"), served on
//! its role's `/metrics` with a `source` label (`gateway`, `tunnel`), and
//! its summary on the role's live page.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::api::ApiClients;

/// A watched kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

/// A status write's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

/// How a status write ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Write {
    /// Written.
    Written,
    /// Someone wrote meanwhile (409): the next pass writes from theirs.
    Conflict,
    /// Refused or unanswered: retried after the object's back-off.
    Failed,
    /// This replica lost the lease before it could write.
    NotLeader,
    /// The object was deleted meanwhile (404): nothing to write, no
    /// back-off (a tenant deleting its objects is no failure of the
    /// install's).
    Gone,
}

impl Write {
    fn label(self) -> &'static str {
        match self {
            Write::Written => "written",
            Write::Conflict => "conflict",
            Write::Failed => "failed",
            Write::NotLeader => "not_leader",
            Write::Gone => "gone",
        }
    }
}

/// The source's metrics; clones share them.
#[derive(Clone)]
pub struct SourceMetrics {
    source: String,
    registry: Arc<Registry>,
    lists: Family<KindLabels, Counter>,
    errors: Family<KindLabels, Counter>,
    tenant_errors: Family<KindLabels, Counter>,
    applied_at: Gauge<f64, AtomicU64>,
    apply_seconds: Histogram,
    writes: Family<OutcomeLabels, Counter>,
    backing_off: Gauge,
    budget_waits: Counter,
    connections: Gauge,
    watches: Gauge,
    polled: Gauge,
}

impl SourceMetrics {
    /// The metrics of the source named `source` (`gateway`, `tunnel`),
    /// registered under `seedlink_kubernetes_`.
    pub fn new(source: &str) -> SourceMetrics {
        let mut r = Registry::with_prefix_and_labels(
            "seedlink_kubernetes",
            [("source".into(), source.to_string().into())].into_iter(),
        );
        let m = SourceMetrics {
            source: source.to_string(),
            registry: Arc::new(Registry::default()),
            lists: Family::default(),
            errors: Family::default(),
            tenant_errors: Family::default(),
            applied_at: Gauge::default(),
            apply_seconds: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            writes: Family::default(),
            backing_off: Gauge::default(),
            budget_waits: Counter::default(),
            connections: Gauge::default(),
            watches: Gauge::default(),
            polled: Gauge::default(),
        };
        m.register(&mut r);
        SourceMetrics {
            registry: Arc::new(r),
            ..m
        }
    }

    fn register(&self, r: &mut Registry) {
        let m = self;
        r.register("watch_lists", "Complete lists by kind: the first, and each after a watch ended (expired, 410 Gone, or failed and retried)", m.lists.clone());
        r.register("watch_errors", "Watch and list errors by kind (each retried with back-off; the last objects stay served)", m.errors.clone());
        r.register("tenant_watch_errors", "Watch and list errors in tenants' namespaces by kind (a RoleBinding missing there: the tenant's object says so)", m.tenant_errors.clone());
        r.register(
            "last_applied_timestamp_seconds",
            "When the last snapshot was applied (Unix time; its age is time() minus this)",
            m.applied_at.clone(),
        );
        r.register(
            "apply_duration_seconds",
            "Translating and applying one snapshot",
            m.apply_seconds.clone(),
        );
        r.register(
            "status_writes",
            "Status writes by outcome (written, conflict, failed, not_leader)",
            m.writes.clone(),
        );
        r.register(
            "status_backing_off",
            "Objects whose last status write failed, waiting for their back-off before the next",
            m.backing_off.clone(),
        );
        r.register(
            "status_budget_waits",
            "Status writes that waited for the shared budget of writes per second",
            m.budget_waits.clone(),
        );
        r.register("api_connections", "Connections' clients to the API server (HTTP/2; the main one and those the per-namespace watches share)", m.connections.clone());
        r.register("watches", "Watches open", m.watches.clone());
        r.register("trust_polled_namespaces", "Tenant namespaces (and kinds) whose labelled trust is listed again on a pace instead of watched: past kubernetes.max_api_connections' worth of watches", m.polled.clone());
    }

    /// How many namespaces' trust is listed on a pace now.
    pub(super) fn polled(&self) -> usize {
        usize::try_from(self.polled.get()).unwrap_or(0)
    }

    /// How many namespaces' trust is listed on a pace, not watched.
    pub(super) fn set_polled(&self, n: usize) {
        self.polled.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(super) fn listed(&self, kind: &str) {
        self.lists.get_or_create(&kind_label(kind)).inc();
    }

    /// A watch of `kind` failed, in a tenant's namespace or not.
    pub(super) fn failed(&self, kind: &str, tenant: bool) {
        let family = if tenant {
            &self.tenant_errors
        } else {
            &self.errors
        };
        family.get_or_create(&kind_label(kind)).inc();
    }

    pub(super) fn watch_started(&self) {
        self.watches.inc();
    }

    pub(super) fn watch_ended(&self) {
        self.watches.dec();
    }

    /// A snapshot applied after `took`.
    pub(super) fn applied(&self, took: Duration) {
        self.apply_seconds.observe(took.as_secs_f64());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.applied_at.set(now.as_secs_f64());
    }

    pub(super) fn wrote(&self, w: Write) {
        let l = OutcomeLabels {
            outcome: w.label().into(),
        };
        self.writes.get_or_create(&l).inc();
    }

    pub(super) fn set_backing_off(&self, n: usize) {
        self.backing_off.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(super) fn budget_waited(&self) {
        self.budget_waits.inc();
    }

    pub(super) fn follow_connections(&self, clients: &ApiClients) {
        let n = clients.connections();
        self.connections.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// The live page's summary: name and value, in order.
    fn lines(&self) -> Vec<(String, String)> {
        let applied = self.applied_at.get();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let age = match applied > 0.0 {
            true => format!("{:.0} s", (now - applied).max(0.0)),
            false => "none applied yet".into(),
        };
        let sum = |f: &Family<OutcomeLabels, Counter>, o: Write| {
            f.get_or_create(&OutcomeLabels {
                outcome: o.label().into(),
            })
            .get()
        };
        vec![
            ("last snapshot applied".into(), age),
            (
                "API server connections".into(),
                self.connections.get().to_string(),
            ),
            ("watches".into(), self.watches.get().to_string()),
            (
                "trust listed on a pace (past the watches' connections)".into(),
                self.polled.get().to_string(),
            ),
            (
                "status written".into(),
                sum(&self.writes, Write::Written).to_string(),
            ),
            (
                "status writes failed".into(),
                sum(&self.writes, Write::Failed).to_string(),
            ),
            (
                "status backing off".into(),
                self.backing_off.get().to_string(),
            ),
        ]
    }
}

impl seedlink_net::admin::Section for SourceMetrics {
    fn title(&self) -> String {
        format!("Kubernetes source ({})", self.source)
    }

    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn summary(&self) -> Vec<(String, String)> {
        self.lines()
    }
}

fn kind_label(kind: &str) -> KindLabels {
    KindLabels {
        kind: kind.to_string(),
    }
}

/// The shared budget of status writes: a token bucket of [`WRITES_PER_SEC`]
/// with a burst of [`WRITE_BURST`]. A write waits for a token; none is
/// dropped.
pub(super) struct Budget {
    tokens: f64,
    at: tokio::time::Instant,
}

/// Status writes per second, shared by every object of a source. A cold
/// start of 1,000 tenants rewrites about 3,000 statuses: about a minute at
/// this rate, while a replica's writes stay a small share of what
/// kube-apiserver's priority and fairness gives a workload (client-go's
/// own default is 5 per second with a burst of 10, meant for one
/// controller among many).
pub const WRITES_PER_SEC: f64 = 50.0;
/// Writes allowed at once after a quiet time.
pub const WRITE_BURST: f64 = 100.0;

impl Default for Budget {
    fn default() -> Budget {
        Budget::full_at(tokio::time::Instant::now())
    }
}

impl Budget {
    /// A full bucket at `at`.
    fn full_at(at: tokio::time::Instant) -> Budget {
        Budget {
            tokens: WRITE_BURST,
            at,
        }
    }

    /// How long to wait before the next write (zero: write now); takes
    /// its token.
    pub(super) fn take(&mut self, now: tokio::time::Instant) -> Duration {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * WRITES_PER_SEC;
        self.tokens = (self.tokens + refill).min(WRITE_BURST);
        self.at = now;
        self.tokens -= 1.0;
        match self.tokens >= 0.0 {
            true => Duration::ZERO,
            false => Duration::from_secs_f64(-self.tokens / WRITES_PER_SEC),
        }
    }
}

/// How long an object whose status write failed `failures` times in a
/// row waits before the next: 10 s (a pass), doubling, at most 5 minutes.
pub(super) fn back_off(failures: u32) -> Duration {
    let doubled = 10u64.saturating_mul(1 << failures.saturating_sub(1).min(5));
    Duration::from_secs(doubled.min(300))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The burst goes out at once; beyond it each write waits its share,
    /// and a quiet time refills the bucket.
    #[test]
    fn the_budget_delays_writes_beyond_its_rate_and_drops_none() {
        let t0 = tokio::time::Instant::now();
        let mut b = Budget::full_at(t0);
        for _ in 0..WRITE_BURST as usize {
            assert_eq!(b.take(t0), Duration::ZERO);
        }
        let wait = b.take(t0);
        assert_eq!(wait, Duration::from_secs_f64(1.0 / WRITES_PER_SEC));
        let wait = b.take(t0);
        assert_eq!(wait, Duration::from_secs_f64(2.0 / WRITES_PER_SEC));
        assert_eq!(b.take(t0 + Duration::from_secs(10)), Duration::ZERO);
    }

    #[test]
    fn a_failing_object_backs_off_to_five_minutes() {
        let s: Vec<u64> = (1..=8).map(|n| back_off(n).as_secs()).collect();
        assert_eq!(s, [10, 20, 40, 80, 160, 300, 300, 300]);
    }

    /// A watch failing in a tenant's namespace (its RoleBinding missing)
    /// is counted apart from the install's watches, which the alert
    /// `SeedlinkKubernetesWatchFailing` reads: a tenant cannot fire it.
    #[test]
    fn tenant_watch_errors_are_counted_apart() {
        let m = SourceMetrics::new("tunnel");
        m.failed("ConfigMap", true);
        m.failed("ConfigMap", true);
        m.failed("TunnelCluster", false);
        use seedlink_net::admin::Section;
        let text = seedlink_net::admin::encode_all(&[m.registry()]);
        for line in [
            "seedlink_kubernetes_tenant_watch_errors_total{source=\"tunnel\",kind=\"ConfigMap\"} 2",
            "seedlink_kubernetes_watch_errors_total{source=\"tunnel\",kind=\"TunnelCluster\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in {text}");
        }
        assert!(!text.contains(
            "seedlink_kubernetes_watch_errors_total{source=\"tunnel\",kind=\"ConfigMap\"}"
        ));
    }

    #[test]
    fn the_summary_names_what_the_page_shows() {
        let m = SourceMetrics::new("tunnel");
        m.wrote(Write::Written);
        m.wrote(Write::Failed);
        use seedlink_net::admin::Section;
        let s = m.summary();
        assert!(s.iter().any(|(k, v)| k == "status written" && v == "1"));
        assert!(s
            .iter()
            .any(|(k, v)| k == "status writes failed" && v == "1"));
        let text = seedlink_net::admin::encode_all(&[m.registry()]);
        assert!(
            text.contains(
                "seedlink_kubernetes_status_writes_total{source=\"tunnel\",outcome=\"written\"} 1"
            ),
            "{text}"
        );
    }
}
