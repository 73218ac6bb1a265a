//! Seed Services looked up for their ClusterIP (a TunnelCluster's
//! `seedServices`, seed.rs): through the Kubernetes source's lookup,
//! remembered briefly, and dialled from the last answer while the API
//! server does not answer.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A boxed future, as the lookup returns.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Why a seed Service was not found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupError {
    /// The Service says no (missing, not a ClusterIP, no such port).
    Refused(String),
    /// The API server did not answer.
    Unavailable,
}

/// Reads a seed Service from the API server.
pub trait ServiceLookup: Send + Sync {
    /// The ClusterIP of Service `name` in `namespace`, if it has one and
    /// serves `port`; why not otherwise.
    fn cluster_ip<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<IpAddr, LookupError>>;
}

/// How long a looked-up Service is used without asking again.
const FOUND_FOR: Duration = Duration::from_secs(10);
/// How long a failed lookup is answered from memory.
const FAILED_FOR: Duration = Duration::from_secs(2);
/// How long after its last answer a Service is still dialled while the API
/// server does not answer (an outage of the seed's API server does not
/// stop the shoot's webhooks at once).
const STALE_FOR: Duration = Duration::from_secs(300);
/// The most lookups remembered (each is a Service a cluster names, at
/// most [`seedlink_config::tunnel::MAX_SEED_DESTINATIONS`] per cluster);
/// past it, the memory is cleared.
const REMEMBERED: usize = 16_384;

type Key = (String, String, u16);

/// A lookup's answer, until when it is used, and the last address found
/// (with when).
struct Remembered {
    until: Instant,
    answer: Result<IpAddr, LookupError>,
    found: Option<(IpAddr, Instant)>,
}

/// Service lookups, remembered for a short while: a webhook is called for
/// every admission request, the Service changes rarely.
pub struct Services {
    lookup: Arc<dyn ServiceLookup>,
    memory: Mutex<HashMap<Key, Remembered>>,
}

impl Services {
    /// Lookups through `lookup`.
    pub fn new(lookup: Arc<dyn ServiceLookup>) -> Services {
        Services {
            lookup,
            memory: Mutex::new(HashMap::new()),
        }
    }

    /// The ClusterIP of `namespace/name` for `port`, as of `now`.
    pub async fn cluster_ip(
        &self,
        namespace: &str,
        name: &str,
        port: u16,
        now: Instant,
    ) -> Result<IpAddr, LookupError> {
        let key = (namespace.to_string(), name.to_string(), port);
        let (remembered, found) = {
            let memory = seedlink_net::sync::lock(&self.memory, "seed services");
            let r = memory.get(&key);
            (
                r.filter(|r| now < r.until).map(|r| r.answer.clone()),
                r.and_then(|r| r.found),
            )
        };
        if let Some(r) = remembered {
            return stale_or(r, found, now);
        }
        let r = self.lookup.cluster_ip(namespace, name, port).await;
        let found = match &r {
            Ok(ip) => Some((*ip, now)),
            Err(LookupError::Unavailable) => found,
            Err(LookupError::Refused(_)) => None,
        };
        let keep = if r.is_ok() { FOUND_FOR } else { FAILED_FOR };
        let mut memory = seedlink_net::sync::lock(&self.memory, "seed services");
        if memory.len() >= REMEMBERED {
            memory.retain(|_, r| now < r.until);
        }
        if memory.len() < REMEMBERED {
            let answer = r.clone();
            memory.insert(
                key,
                Remembered {
                    until: now + keep,
                    answer,
                    found,
                },
            );
        }
        stale_or(r, found, now)
    }
}

/// `r`, or, while the API server does not answer, the address last found
/// if that was less than [`STALE_FOR`] ago.
fn stale_or(
    r: Result<IpAddr, LookupError>,
    found: Option<(IpAddr, Instant)>,
    now: Instant,
) -> Result<IpAddr, LookupError> {
    match (r, found) {
        (Err(LookupError::Unavailable), Some((ip, at))) if now < at + STALE_FOR => Ok(ip),
        (r, _) => r,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counting(AtomicUsize);

    impl ServiceLookup for Counting {
        fn cluster_ip<'a>(
            &'a self,
            _: &'a str,
            name: &'a str,
            _: u16,
        ) -> BoxFuture<'a, Result<IpAddr, LookupError>> {
            let n = self.0.fetch_add(1, Ordering::SeqCst);
            let r = match name {
                "hooks" => Ok("10.96.0.7".parse().unwrap()),
                // Found once, then the API server is down.
                "flaky" if n == 0 => Ok("10.96.0.8".parse().unwrap()),
                "flaky" => Err(LookupError::Unavailable),
                _ => Err(LookupError::Refused("not found".to_string())),
            };
            Box::pin(async move { r })
        }
    }

    /// A found Service is used for 10 s, a failure for 2 s, then asked
    /// again.
    #[tokio::test]
    async fn lookups_are_remembered_briefly() {
        let lookup = Arc::new(Counting(AtomicUsize::new(0)));
        let s = Services::new(lookup.clone());
        let t0 = Instant::now();
        let ip = s.cluster_ip("a", "hooks", 443, t0).await.unwrap();
        assert_eq!(ip, "10.96.0.7".parse::<IpAddr>().unwrap());
        s.cluster_ip("a", "hooks", 443, t0 + Duration::from_secs(9))
            .await
            .unwrap();
        assert_eq!(lookup.0.load(Ordering::SeqCst), 1);
        s.cluster_ip("a", "hooks", 443, t0 + Duration::from_secs(11))
            .await
            .unwrap();
        assert_eq!(lookup.0.load(Ordering::SeqCst), 2);
        assert!(s.cluster_ip("a", "gone", 443, t0).await.is_err());
        assert!(s
            .cluster_ip("a", "gone", 443, t0 + Duration::from_secs(1))
            .await
            .is_err());
        assert_eq!(lookup.0.load(Ordering::SeqCst), 3);
        assert!(s
            .cluster_ip("a", "gone", 443, t0 + Duration::from_secs(3))
            .await
            .is_err());
        assert_eq!(lookup.0.load(Ordering::SeqCst), 4);
        // The API server down after a first answer: the last address is
        // dialled for 5 minutes; a refusal is never covered that way.
        let flaky = Services::new(Arc::new(Counting(AtomicUsize::new(0))));
        let first = flaky.cluster_ip("a", "flaky", 443, t0).await.unwrap();
        let later = t0 + Duration::from_secs(60);
        assert_eq!(
            flaky.cluster_ip("a", "flaky", 443, later).await.unwrap(),
            first
        );
        let soon = later + Duration::from_secs(1);
        assert_eq!(flaky.cluster_ip("a", "flaky", 443, soon).await, Ok(first));
        let too_late = t0 + Duration::from_secs(301);
        assert_eq!(
            flaky.cluster_ip("a", "flaky", 443, too_late).await,
            Err(LookupError::Unavailable)
        );
        // Another namespace, port or name is another lookup.
        s.cluster_ip("b", "hooks", 443, t0).await.unwrap();
        s.cluster_ip("a", "hooks", 8443, t0).await.unwrap();
        assert_eq!(lookup.0.load(Ordering::SeqCst), 6);
    }
}
