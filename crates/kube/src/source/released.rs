//! What a TunnelCluster's status says it trusts, and the claims it
//! stopped trusting, reserved to it for a while (`status.trust`,
//! `status.released`): no other cluster takes them meanwhile.

use k8s_openapi::jiff::Timestamp;

/// `trust` and `released` of a TunnelCluster's status. Served: what it
/// holds now, and what it stopped trusting stays reserved; refused: what
/// it held stays its own (a failing object never loses a claim to
/// another).
pub(super) fn held_claims(
    served: bool,
    trust: Vec<String>,
    current: &crate::crd::TunnelClusterStatus,
    hold: Hold,
) -> crate::crd::TunnelClusterStatus {
    let (trust, released) = match served && !trust.is_empty() {
        true => (trust.clone(), released(current, &trust, hold)),
        false => (current.trust.clone(), current.released.clone()),
    };
    crate::crd::TunnelClusterStatus {
        trust,
        released,
        ..Default::default()
    }
}

/// The time now, and how long a claim a cluster stops trusting stays
/// reserved to it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold {
    pub now: Timestamp,
    pub hold: k8s_openapi::jiff::SignedDuration,
}

/// Whether a released claim's reservation still runs at `now` (one whose
/// time does not parse has ended: only seedlink writes status).
pub(super) fn reserved(r: &crate::crd::ReleasedClaim, now: Timestamp) -> bool {
    r.until.parse::<Timestamp>().is_ok_and(|t| t > now)
}

/// The claims reserved to a served cluster that trusts `trust` now: those
/// still reserved and not trusted again, and those its status named and
/// it no longer trusts, until `hold` from now; the
/// [`crate::crd::RELEASED_MAX`] that end last.
pub(super) fn released(
    current: &crate::crd::TunnelClusterStatus,
    trust: &[String],
    h: Hold,
) -> Vec<crate::crd::ReleasedClaim> {
    let until = h.now.checked_add(h.hold).unwrap_or(Timestamp::MAX);
    let mut out: Vec<(Timestamp, crate::crd::ReleasedClaim)> = current
        .released
        .iter()
        .filter(|r| reserved(r, h.now) && !trust.contains(&r.claim))
        .filter_map(|r| Some((r.until.parse::<Timestamp>().ok()?, r.clone())))
        .collect();
    for claim in current.trust.iter().filter(|c| !trust.contains(c)) {
        if !out.iter().any(|(_, r)| &r.claim == claim) {
            let r = crate::crd::ReleasedClaim {
                claim: claim.clone(),
                until: until.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
            };
            out.push((until, r));
        }
    }
    out.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.claim.cmp(&b.1.claim)));
    out.truncate(crate::crd::RELEASED_MAX);
    out.sort_by(|a, b| a.1.claim.cmp(&b.1.claim));
    out.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::crd::{ReleasedClaim, TunnelClusterStatus};

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    /// A claim the cluster no longer trusts is reserved from now for the
    /// hold; one trusted again is no longer released; one whose time has
    /// come goes; at most `RELEASED_MAX` are kept, those that end last.
    #[test]
    fn a_claim_no_longer_trusted_is_reserved_until_its_hold_ends() {
        let h = Hold {
            now: at("2026-01-01T00:00:00Z"),
            hold: k8s_openapi::jiff::SignedDuration::from_hours(24),
        };
        let current = TunnelClusterStatus {
            trust: vec!["sha256:a".into(), "sha256:b".into()],
            released: vec![
                ReleasedClaim {
                    claim: "sha256:old".into(),
                    until: "2025-12-31T23:59:59Z".into(),
                },
                ReleasedClaim {
                    claim: "sha256:c".into(),
                    until: "2026-01-01T12:00:00Z".into(),
                },
            ],
            ..Default::default()
        };
        let out = released(&current, &["sha256:b".into(), "sha256:c".into()], h);
        assert_eq!(
            out,
            [ReleasedClaim {
                claim: "sha256:a".into(),
                until: "2026-01-02T00:00:00Z".into(),
            }]
        );
        assert!(reserved(&out[0], h.now));
        assert!(!reserved(&out[0], at("2026-01-02T00:00:00Z")));
        let many = TunnelClusterStatus {
            trust: (0..40).map(|i| format!("sha256:{i:02}")).collect(),
            released: vec![ReleasedClaim {
                claim: "sha256:soon".into(),
                until: "2026-01-01T00:00:01Z".into(),
            }],
            ..Default::default()
        };
        let out = released(&many, &["sha256:new".into()], h);
        assert_eq!(out.len(), crate::crd::RELEASED_MAX);
        assert!(out.iter().all(|r| r.claim != "sha256:soon"));
    }
}
