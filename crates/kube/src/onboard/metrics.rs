//! The onboarding controller's metrics (docs/OPERATIONS.md, "Metrics"),
//! made at each scrape from the control planes the controller watches:
//! a deleted one leaves no series behind, and every replica exports what
//! the writing one put on the objects' status.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::crd::SeedlinkControlPlane;

use super::rotation::Validity;

/// A control plane's series: its namespace and name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Labels {
    namespace: String,
    name: String,
}

type Seconds = Gauge<f64, AtomicU64>;

/// The gauges of one scrape.
#[derive(Default)]
struct Gauges {
    leader: Gauge,
    ready: Family<Labels, Gauge>,
    agents: Family<Labels, Gauge>,
    not_after: Family<Labels, Seconds>,
    renew_at: Family<Labels, Seconds>,
}

/// The registry for `cps` as last seen; `leader` is whether this replica
/// writes. The renewal time is the first certificate's expiry less a third
/// of the agents' certificate's validity (when the controller renews it).
pub fn registry(cps: &[Arc<SeedlinkControlPlane>], leader: bool, validity: Validity) -> Registry {
    let g = Gauges::default();
    g.leader.set(i64::from(leader));
    for cp in cps {
        let l = Labels {
            namespace: cp.namespace().unwrap_or_default(),
            name: cp.name_any(),
        };
        let Some(status) = &cp.status else { continue };
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        g.ready.get_or_create(&l).set(i64::from(ready));
        g.agents
            .get_or_create(&l)
            .set(i64::try_from(status.agents).unwrap_or(i64::MAX));
        let expiry = status
            .certificates_not_after
            .as_deref()
            .and_then(|t| t.parse::<Timestamp>().ok());
        if let Some(t) = expiry {
            g.not_after.get_or_create(&l).set(t.as_second() as f64);
            let renew = t.as_second() - validity.leaf.as_secs() / 3;
            g.renew_at.get_or_create(&l).set(renew as f64);
        }
    }
    let mut r = Registry::default();
    r.register(
        "seedlink_onboard_leader",
        "1 on the replica that holds the Lease and writes",
        g.leader,
    );
    r.register(
        "seedlink_onboard_control_plane_ready",
        "1 if the control plane's Ready condition is True (status)",
        g.ready,
    );
    r.register(
        "seedlink_onboard_control_plane_agents",
        "Agent streams connected for the control plane (status)",
        g.agents,
    );
    r.register(
        "seedlink_onboard_certificates_not_after_seconds",
        "When the first of the control plane's agent CA, agent certificate and kube-apiserver certificate expires (Unix time)",
        g.not_after,
    );
    r.register(
        "seedlink_onboard_certificates_renew_at_seconds",
        "When the controller renews the agent certificate (Unix time): a third of its validity before expiry",
        g.renew_at,
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ControlPlaneStatus, SeedlinkControlPlaneSpec};

    fn cp(ns: &str, name: &str, status: Option<ControlPlaneStatus>) -> Arc<SeedlinkControlPlane> {
        let spec: SeedlinkControlPlaneSpec =
            serde_json::from_value(serde_json::json!({"apiServer": {"service": "kube-apiserver", "hostnames": ["api.a.test"]}}))
                .unwrap();
        let mut o = SeedlinkControlPlane::new(name, spec);
        o.metadata.namespace = Some(ns.into());
        o.status = status;
        Arc::new(o)
    }

    fn text(r: &Registry) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, r).unwrap();
        s
    }

    #[test]
    fn each_control_plane_has_its_expiry_and_renewal_and_no_status_no_series() {
        let status = ControlPlaneStatus {
            agents: 2,
            certificates_not_after: Some("2030-01-01T00:00:00Z".into()),
            ..Default::default()
        };
        let cps = [cp("a", "api", Some(status)), cp("b", "api", None)];
        let v = Validity::default();
        let out = text(&registry(&cps, true, v));
        let expiry = 1_893_456_000_i64;
        let renew = expiry - v.leaf.as_secs() / 3;
        assert!(out.contains("seedlink_onboard_leader 1"), "{out}");
        assert!(
            out.contains(&format!(
                "seedlink_onboard_certificates_not_after_seconds{{namespace=\"a\",name=\"api\"}} {expiry}.0"
            )),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "seedlink_onboard_certificates_renew_at_seconds{{namespace=\"a\",name=\"api\"}} {renew}.0"
            )),
            "{out}"
        );
        assert!(
            out.contains("seedlink_onboard_control_plane_agents{namespace=\"a\",name=\"api\"} 2"),
            "{out}"
        );
        assert!(!out.contains("namespace=\"b\""), "{out}");
        // No control plane: every family still says its type.
        let empty = text(&registry(&[], false, v));
        for family in [
            "seedlink_onboard_leader",
            "seedlink_onboard_control_plane_ready",
            "seedlink_onboard_certificates_not_after_seconds",
            "seedlink_onboard_certificates_renew_at_seconds",
        ] {
            assert!(empty.contains(&format!("# TYPE {family} gauge")), "{empty}");
        }
    }
}
