//! The tests' one poll loop. A test that waits for something (a metric,
//! readiness, a status condition, a log line) calls [`eventually`] with a
//! probe; the `limit` is generous and only bounds a broken build, it never
//! times a behaviour (docs/TESTING.md, "No timing in assertions").

use std::fmt::Display;
use std::time::Duration;

/// What a probe returns: `bool` (holds or not yet), or `Result` (the value
/// once there, else why not yet; the last reason is in the failure).
pub trait Probe {
    /// What [`eventually`] returns once the probe holds.
    type Value;
    /// The value, or why not yet.
    fn outcome(self) -> Result<Self::Value, String>;
}

impl Probe for bool {
    type Value = ();
    fn outcome(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err("not yet".into())
        }
    }
}

impl<T, E: Display> Probe for Result<T, E> {
    type Value = T;
    fn outcome(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// Pause between probes: 20 ms, doubling up to 250 ms.
fn next_pause(pause: Duration) -> Duration {
    (pause * 2).min(Duration::from_millis(250))
}

/// Probes until `probe` holds and returns its value; panics naming `what`
/// and the last reason once `limit` has passed.
pub async fn eventually<P: Probe>(
    what: &str,
    limit: Duration,
    mut probe: impl AsyncFnMut() -> P,
) -> P::Value {
    let end = tokio::time::Instant::now() + limit;
    let mut pause = Duration::from_millis(20);
    loop {
        let why = match probe().await.outcome() {
            Ok(v) => return v,
            Err(why) => why,
        };
        assert!(
            tokio::time::Instant::now() < end,
            "{what}: not within {limit:?}; last: {why}"
        );
        tokio::time::sleep(pause).await;
        pause = next_pause(pause);
    }
}

/// [`eventually`] for a test without an async runtime.
pub fn eventually_blocking<P: Probe>(
    what: &str,
    limit: Duration,
    mut probe: impl FnMut() -> P,
) -> P::Value {
    let end = std::time::Instant::now() + limit;
    let mut pause = Duration::from_millis(20);
    loop {
        let why = match probe().outcome() {
            Ok(v) => return v,
            Err(why) => why,
        };
        assert!(
            std::time::Instant::now() < end,
            "{what}: not within {limit:?}; last: {why}"
        );
        std::thread::sleep(pause);
        pause = next_pause(pause);
    }
}

/// `Ok` when `holds`, else the reason `why` gives (for a probe's last
/// word in the failure).
pub fn ok_if(holds: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if holds {
        Ok(())
    } else {
        Err(why())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_value_once_the_probe_holds() {
        let mut n = 0;
        let v = eventually("three probes", Duration::from_secs(60), async || {
            n += 1;
            if n == 3 {
                Ok(n)
            } else {
                Err("not yet")
            }
        })
        .await;
        assert_eq!(v, 3);
    }

    #[test]
    #[should_panic(expected = "never: not within 0ns; last: still false")]
    fn names_what_and_the_last_reason_when_the_limit_passes() {
        eventually_blocking("never", Duration::ZERO, || {
            ok_if(false, || "still false".into())
        });
    }

    #[test]
    fn pauses_grow_to_a_quarter_second() {
        let mut p = Duration::from_millis(20);
        for _ in 0..10 {
            p = next_pause(p);
        }
        assert_eq!(p, Duration::from_millis(250));
    }
}
