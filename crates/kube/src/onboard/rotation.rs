//! When the controller renews, rotates or revokes a control plane's agent
//! credentials: a pure function of what the Secrets hold, the object's
//! `spec.tunnel.revision` and the time, so every case is tested with
//! explicit time.
//!
//! - **Renewal**: the agents' certificate is issued again once a third
//!   of its validity is left, by the same CA: the trust does not change.
//! - **Rotation**: the CA is replaced once a third of its validity is
//!   left. The old CA stays trusted beside the new one for one
//!   certificate validity (every certificate it signed has expired by
//!   then), and the first certificate from the new CA is issued only in a
//!   later pass, after the trust naming both was written: an agent never
//!   presents a certificate the tunnel-server does not trust yet.
//! - **Rotation on demand**: raising `spec.tunnel.rotation` rotates the
//!   CA in the next pass, with the same overlap (a rotation asked for
//!   during an overlap replaces the previous CA: its certificates were
//!   replaced in the pass after it was rotated out).
//! - In the pass after a rotation (the trust naming both CAs is written
//!   in the rotating pass), the agents' certificate is issued again by
//!   the new CA, so the agents move to it at the start of the overlap.
//! - **Revocation**: raising `spec.tunnel.revision` replaces the CA at
//!   once with no overlap: the old one is no longer trusted, the
//!   tunnel-server disconnects the agents presenting its certificates (its
//!   re-keying), and a new certificate is issued.

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::certs::Issued;

/// How long the controller's certificates are valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// An agent CA.
    pub ca: SignedDuration,
    /// The agents' certificate.
    pub leaf: SignedDuration,
}

impl Validity {
    /// From the configuration's durations; one out of range keeps its
    /// default.
    pub fn from_std(ca: std::time::Duration, leaf: std::time::Duration) -> Validity {
        let d = Validity::default();
        Validity {
            ca: SignedDuration::try_from(ca).unwrap_or(d.ca),
            leaf: SignedDuration::try_from(leaf).unwrap_or(d.leaf),
        }
    }
}

impl Default for Validity {
    fn default() -> Validity {
        Validity {
            ca: super::certs::CA_VALIDITY,
            leaf: super::certs::LEAF_VALIDITY,
        }
    }
}

/// What a control plane's CA Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaState {
    /// The CA that signs now.
    pub current: Issued,
    /// The CA it replaced, and until when it stays trusted.
    pub previous: Option<(String, Timestamp)>,
    /// The `spec.tunnel.revision` it was made for.
    pub revision: u64,
    /// The `spec.tunnel.rotation` it was made for.
    pub rotation: u64,
}

/// What the object asks for: `spec.tunnel.revision` (revoke when raised)
/// and `spec.tunnel.rotation` (rotate when raised).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Asked {
    /// `spec.tunnel.revision`.
    pub revision: u64,
    /// `spec.tunnel.rotation`.
    pub rotation: u64,
}

/// What to do with the CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaStep {
    /// Nothing.
    Keep,
    /// The previous CA's overlap is over: trust the current one alone.
    DropPrevious,
    /// A new CA; the current one stays trusted for the overlap.
    Rotate,
    /// A new CA; the current one is trusted no more.
    Revoke,
}

/// Whether a third or less of `validity` is left at `now` before
/// `not_after` (a certificate to renew).
pub fn due(not_after: Timestamp, now: Timestamp, validity: SignedDuration) -> bool {
    not_after.duration_since(now) <= validity / 3
}

/// What the CA needs at `now`, the object asking for `asked`.
pub fn ca_step(state: &CaState, asked: Asked, now: Timestamp, v: &Validity) -> CaStep {
    if asked.revision > state.revision {
        CaStep::Revoke
    } else if asked.rotation > state.rotation
        || (due(state.current.not_after, now, v.ca) && state.previous.is_none())
    {
        CaStep::Rotate
    } else if state
        .previous
        .as_ref()
        .is_some_and(|(_, until)| *until <= now)
    {
        CaStep::DropPrevious
    } else {
        CaStep::Keep
    }
}

/// The CA state after `step`; `fresh` is the new CA a rotation or a
/// revocation puts in place (without one they change nothing).
pub fn after(
    state: CaState,
    step: CaStep,
    fresh: Option<Issued>,
    asked: Asked,
    now: Timestamp,
    v: &Validity,
) -> CaState {
    match (step, fresh) {
        (CaStep::DropPrevious, _) => CaState {
            previous: None,
            ..state
        },
        (CaStep::Rotate, Some(fresh)) => CaState {
            previous: Some((state.current.cert_pem, now + v.leaf)),
            current: fresh,
            revision: state.revision,
            rotation: asked.rotation.max(state.rotation),
        },
        (CaStep::Revoke, Some(fresh)) => CaState {
            current: fresh,
            previous: None,
            revision: asked.revision,
            rotation: asked.rotation.max(state.rotation),
        },
        _ => state,
    }
}

/// Whether the agents' certificate `leaf`, signed by the CA `signed_by`
/// (its PEM), is to be issued again at `now`: it is close to expiry, or
/// its CA is no longer the current one (the controller does not ask in
/// the pass that rotated the CA: the trust naming both is written
/// first).
pub fn leaf_due(
    leaf: &Issued,
    signed_by: &str,
    ca: &CaState,
    now: Timestamp,
    v: &Validity,
) -> bool {
    signed_by != ca.current.cert_pem || due(leaf.not_after, now, v.leaf)
}

/// When the CA or the agents' certificate next needs a pass: the
/// certificate's renewal, the CA's rotation (none while a previous CA
/// overlaps), the end of that overlap; the earliest. A time out of range
/// (a Secret's annotation written by hand) is due at once.
pub fn next_due(ca: &CaState, leaf: &Issued, v: &Validity) -> Timestamp {
    let before = |t: Timestamp, d: SignedDuration| t.checked_sub(d).unwrap_or(Timestamp::MIN);
    let mut next = before(leaf.not_after, v.leaf / 3);
    match &ca.previous {
        None => next = next.min(before(ca.current.not_after, v.ca / 3)),
        Some((_, until)) => next = next.min(*until),
    }
    next
}

/// The CAs the tunnel-server trusts at `now`: the current one, and the
/// previous one during its overlap (PEM, one after the other).
pub fn trust_bundle(ca: &CaState, now: Timestamp) -> String {
    let mut out = ca.current.cert_pem.clone();
    if let Some((pem, until)) = &ca.previous {
        if *until > now {
            if !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(pem);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const DAY: SignedDuration = SignedDuration::from_hours(24);

    fn v() -> Validity {
        Validity {
            ca: DAY * 300,
            leaf: DAY * 30,
        }
    }

    fn issued(name: &str, not_after: Timestamp) -> Issued {
        Issued {
            cert_pem: format!("{name}\n"),
            key_pem: format!("{name} key\n"),
            not_after,
        }
    }

    fn asked(revision: u64) -> Asked {
        Asked {
            revision,
            rotation: 0,
        }
    }

    /// A raised `spec.tunnel.rotation` rotates with overlap at once, also
    /// during another overlap; it is remembered, so it rotates once.
    #[test]
    fn a_raised_rotation_rotates_at_once_with_overlap() {
        let v = v();
        let state = CaState {
            current: issued("ca1", t0() + v.ca),
            previous: None,
            revision: 0,
            rotation: 0,
        };
        let ask = Asked {
            revision: 0,
            rotation: 1,
        };
        assert_eq!(ca_step(&state, ask, t0(), &v), CaStep::Rotate);
        let fresh = Some(issued("ca2", t0() + v.ca));
        let rotated = after(state, CaStep::Rotate, fresh, ask, t0(), &v);
        assert_eq!(rotated.rotation, 1);
        assert_eq!(trust_bundle(&rotated, t0()), "ca2\nca1\n");
        assert_eq!(ca_step(&rotated, ask, t0(), &v), CaStep::Keep);
        let again = Asked { rotation: 2, ..ask };
        assert_eq!(ca_step(&rotated, again, t0(), &v), CaStep::Rotate);
        let fresh = Some(issued("ca3", t0() + v.ca));
        let twice = after(rotated, CaStep::Rotate, fresh, again, t0(), &v);
        assert_eq!(trust_bundle(&twice, t0()), "ca3\nca2\n");
    }

    fn t0() -> Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    #[test]
    fn the_next_pass_is_the_earliest_renewal_rotation_or_overlap_end() {
        let v = v();
        let leaf = issued("leaf", t0() + v.leaf);
        let mut ca = CaState {
            current: issued("ca1", t0() + v.ca),
            previous: None,
            revision: 0,
            rotation: 0,
        };
        // The certificate's renewal: 20 days in.
        assert_eq!(next_due(&ca, &leaf, &v), t0() + DAY * 20);
        // A CA due before it: its rotation.
        ca.current.not_after = t0() + DAY * 105;
        assert_eq!(next_due(&ca, &leaf, &v), t0() + DAY * 5);
        // While a previous CA overlaps: no rotation, the overlap's end.
        ca.previous = Some(("ca0\n".into(), t0() + DAY * 3));
        assert_eq!(next_due(&ca, &leaf, &v), t0() + DAY * 3);
        // A time out of range is due at once, without a panic.
        ca.previous = None;
        ca.current.not_after = Timestamp::MIN;
        assert_eq!(next_due(&ca, &leaf, &v), Timestamp::MIN);
    }

    #[test]
    fn a_ca_is_rotated_with_overlap_and_its_successor_signs_only_after() {
        let v = v();
        let state = CaState {
            current: issued("ca1", t0() + v.ca),
            previous: None,
            revision: 0,
            rotation: 0,
        };
        let leaf = issued("leaf1", t0() + v.leaf);
        // Early on: nothing to do.
        assert_eq!(ca_step(&state, asked(0), t0() + DAY, &v), CaStep::Keep);
        assert!(!leaf_due(&leaf, "ca1\n", &state, t0() + DAY, &v));
        // A third of the CA's validity left: a new CA, both trusted.
        let at = t0() + DAY * 201;
        assert_eq!(ca_step(&state, asked(0), at, &v), CaStep::Rotate);
        let rotated = after(
            state,
            CaStep::Rotate,
            Some(issued("ca2", at + v.ca)),
            asked(0),
            at,
            &v,
        );
        assert_eq!(trust_bundle(&rotated, at), "ca2\nca1\n");
        // The leaf from ca1 is issued again by ca2 (in the pass after
        // this one, which wrote the trust naming both: the controller's).
        let leaf = issued("leaf1", at + DAY * 25);
        assert!(leaf_due(&leaf, "ca1\n", &rotated, at, &v));
        // After the overlap ca1 goes, and a leaf it signed is due.
        let over = at + v.leaf;
        assert_eq!(ca_step(&rotated, asked(0), over, &v), CaStep::DropPrevious);
        assert_eq!(trust_bundle(&rotated, over), "ca2\n");
        assert!(leaf_due(&leaf, "ca1\n", &rotated, over, &v));
        let dropped = after(rotated, CaStep::DropPrevious, None, asked(0), over, &v);
        assert_eq!(dropped.previous, None);
        assert_eq!(ca_step(&dropped, asked(0), over, &v), CaStep::Keep);
    }

    #[test]
    fn a_leaf_is_renewed_by_the_same_ca_at_a_third_of_its_validity() {
        let v = v();
        let state = CaState {
            current: issued("ca1", t0() + v.ca),
            previous: None,
            revision: 0,
            rotation: 0,
        };
        let leaf = issued("leaf1", t0() + v.leaf);
        assert!(!leaf_due(&leaf, "ca1\n", &state, t0() + DAY * 19, &v));
        assert!(leaf_due(&leaf, "ca1\n", &state, t0() + DAY * 20, &v));
        assert_eq!(ca_step(&state, asked(0), t0() + DAY * 20, &v), CaStep::Keep);
        assert_eq!(trust_bundle(&state, t0()), "ca1\n");
    }

    #[test]
    fn a_raised_revision_revokes_at_once_without_overlap() {
        let v = v();
        let state = CaState {
            current: issued("ca1", t0() + v.ca),
            previous: Some(("ca0\n".into(), t0() + DAY)),
            revision: 2,
            rotation: 0,
        };
        assert_eq!(ca_step(&state, asked(2), t0(), &v), CaStep::Keep);
        // A lower revision never goes back.
        assert_eq!(ca_step(&state, asked(1), t0(), &v), CaStep::Keep);
        assert_eq!(ca_step(&state, asked(3), t0(), &v), CaStep::Revoke);
        let revoked = after(
            state,
            CaStep::Revoke,
            Some(issued("ca2", t0() + v.ca)),
            asked(3),
            t0(),
            &v,
        );
        assert_eq!(trust_bundle(&revoked, t0()), "ca2\n");
        assert_eq!(revoked.revision, 3);
        // Every leaf of the old CA is due at once, however fresh.
        let leaf = issued("leaf1", t0() + v.leaf);
        assert!(leaf_due(&leaf, "ca1\n", &revoked, t0(), &v));
    }
}
