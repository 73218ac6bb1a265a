//! Upstream endpoint choice, connect with timeout, passive ejection.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use seedlink_config::model::{Balance, Upstream};
use seedlink_config::routes::{Endpoint, EndpointState};
use seedlink_net::sockopt::Keepalive;
use tokio::net::{TcpSocket, TcpStream};

use crate::metrics::{EndpointLabels, Metrics};

/// The clock of ejection deadlines (milliseconds, kept in atomics).
pub use seedlink_net::clock::now_ms;

/// Counts a connection against an endpoint for as long as it lives.
pub struct ActiveGuard(Arc<EndpointState>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why no upstream connection could be made.
#[derive(Debug, thiserror::Error)]
#[error("all {attempts} connect attempts failed; last to {endpoint}: {source}")]
pub struct ConnectError {
    /// Attempts made.
    pub attempts: usize,
    /// The last endpoint tried.
    pub endpoint: String,
    /// The last error.
    pub source: io::Error,
}

/// Connects to one of `cp`'s endpoints, trying up to
/// `settings.connect_attempts` distinct endpoints. Nothing has been sent to
/// any upstream yet, so a retry loses no client byte.
pub async fn connect(
    cp_name: &str,
    endpoints: &[Endpoint],
    settings: &Upstream,
    timeout: Duration,
    ka: Keepalive,
    metrics: &Metrics,
) -> Result<(TcpStream, ActiveGuard, String), ConnectError> {
    let attempts = usize::try_from(settings.connect_attempts)
        .unwrap_or(1)
        .clamp(1, endpoints.len().max(1));
    let mut tried: Vec<usize> = Vec::with_capacity(attempts);
    let mut last = ConnectError {
        attempts: 0,
        endpoint: String::new(),
        source: io::Error::new(io::ErrorKind::NotFound, "no endpoints"),
    };
    for _ in 0..attempts {
        let Some(i) = pick(endpoints, settings.balance, &tried, now_ms()) else {
            break;
        };
        tried.push(i);
        let ep = &endpoints[i];
        let started = std::time::Instant::now();
        let result = match tokio::time::timeout(timeout, connect_host(&ep.address, ka)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
        };
        match result {
            Ok(stream) => {
                metrics
                    .upstream_connect_seconds
                    .observe(started.elapsed().as_secs_f64());
                ep.state.failures.store(0, Ordering::Relaxed);
                ep.state.ejected_until_ms.store(0, Ordering::Relaxed);
                ep.state.active.fetch_add(1, Ordering::Relaxed);
                return Ok((stream, ActiveGuard(ep.state.clone()), ep.address.clone()));
            }
            Err(e) => {
                eject(cp_name, ep, settings, metrics, &e);
                last = ConnectError {
                    attempts: tried.len(),
                    endpoint: ep.address.clone(),
                    source: e,
                };
            }
        }
    }
    last.attempts = tried.len();
    Err(last)
}

/// A connect to `ep` failed with `e`: counted, and the endpoint ejected
/// for a back-off that doubles with each failure in a row.
fn eject(cp_name: &str, ep: &Endpoint, settings: &Upstream, metrics: &Metrics, e: &io::Error) {
    let labels = EndpointLabels {
        control_plane: cp_name.to_string(),
        endpoint: ep.address.clone(),
    };
    metrics
        .upstream_connect_failures
        .get_or_create(&labels)
        .inc();
    let failures = ep
        .state
        .failures
        .fetch_add(1, Ordering::Relaxed)
        .saturating_add(1);
    let backoff = settings
        .eject_base
        .saturating_mul(1u32 << (failures - 1).min(16))
        .min(settings.eject_max);
    let until = now_ms().saturating_add(u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX));
    ep.state.ejected_until_ms.store(until, Ordering::Relaxed);
    metrics.upstream_ejections.get_or_create(&labels).inc();
    tracing::warn!(control_plane = %cp_name, endpoint = %ep.address, error = %e,
        eject_ms = backoff.as_millis() as u64, "upstream connect failed; endpoint ejected");
}

async fn connect_host(address: &str, ka: Keepalive) -> io::Result<TcpStream> {
    if let Ok(sa) = address.parse::<std::net::SocketAddr>() {
        return connect_tuned(sa, ka).await;
    }
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{address} resolved to no address"),
    );
    for sa in tokio::net::lookup_host(address).await? {
        match connect_tuned(sa, ka).await {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Connects with keepalive and `TCP_NODELAY` set before the SYN.
async fn connect_tuned(sa: std::net::SocketAddr, ka: Keepalive) -> io::Result<TcpStream> {
    let sock = if sa.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    seedlink_net::sockopt::tune(socket2::SockRef::from(&sock), ka)?;
    sock.connect(sa).await
}

/// Chooses an endpoint not yet tried. Healthy endpoints come first; when all
/// remaining ones are ejected, the one whose ejection ends soonest is tried
/// rather than failing without an attempt.
pub fn pick(endpoints: &[Endpoint], balance: Balance, tried: &[usize], now: u64) -> Option<usize> {
    let untried = (0..endpoints.len()).filter(|i| !tried.contains(i));
    let healthy: Vec<usize> = untried
        .clone()
        .filter(|&i| !endpoints[i].ejected(now))
        .collect();
    if healthy.is_empty() {
        return untried
            .min_by_key(|&i| endpoints[i].state.ejected_until_ms.load(Ordering::Relaxed));
    }
    let load = |i: usize| endpoints[i].state.active.load(Ordering::Relaxed);
    let mut rng = rand::rng();
    match balance {
        Balance::LeastConnections => {
            // Start the scan at a random offset so ties spread evenly.
            let start = rng.random_range(0..healthy.len());
            (0..healthy.len())
                .map(|k| healthy[(start + k) % healthy.len()])
                .min_by_key(|&i| load(i))
        }
        Balance::PowerOfTwoChoices => {
            let (a, b) = two_of(&mut rng, &healthy)?;
            Some(if load(b) < load(a) { b } else { a })
        }
    }
}

/// Two different entries of `of` at random (the same one twice when it has
/// only one); `None` when it is empty.
fn two_of(rng: &mut impl rand::Rng, of: &[usize]) -> Option<(usize, usize)> {
    match of.len() {
        0 => None,
        1 => Some((of[0], of[0])),
        n => {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            Some((of[a], of[b]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use seedlink_config::routes::ControlPlane;

    fn cp(n: usize) -> ControlPlane {
        ControlPlane {
            name: "cp".into(),
            endpoints: (0..n)
                .map(|i| Endpoint {
                    address: format!("127.0.0.1:{}", 1000 + i),
                    state: Arc::default(),
                })
                .collect(),
            acl: None,
        }
    }

    #[test]
    fn least_connections_prefers_idle_and_skips_ejected() {
        let c = cp(3);
        c.endpoints[0].state.active.store(5, Ordering::Relaxed);
        c.endpoints[1].state.active.store(1, Ordering::Relaxed);
        c.endpoints[2].state.active.store(0, Ordering::Relaxed);
        c.endpoints[2]
            .state
            .ejected_until_ms
            .store(1000, Ordering::Relaxed);
        for _ in 0..50 {
            assert_eq!(
                pick(&c.endpoints, Balance::LeastConnections, &[], 10),
                Some(1)
            );
        }
        assert_eq!(
            pick(&c.endpoints, Balance::LeastConnections, &[1], 10),
            Some(0)
        );
        // After the ejection ends it is the least loaded again.
        assert_eq!(
            pick(&c.endpoints, Balance::LeastConnections, &[], 2000),
            Some(2)
        );
        // All tried: nothing left.
        assert_eq!(
            pick(&c.endpoints, Balance::LeastConnections, &[0, 1, 2], 10),
            None
        );
    }

    #[test]
    fn all_ejected_tries_soonest_back() {
        let c = cp(2);
        c.endpoints[0]
            .state
            .ejected_until_ms
            .store(900, Ordering::Relaxed);
        c.endpoints[1]
            .state
            .ejected_until_ms
            .store(500, Ordering::Relaxed);
        assert_eq!(
            pick(&c.endpoints, Balance::PowerOfTwoChoices, &[], 10),
            Some(1)
        );
    }

    #[test]
    fn p2c_never_picks_the_busiest_of_two() {
        let c = cp(2);
        c.endpoints[0].state.active.store(9, Ordering::Relaxed);
        for _ in 0..50 {
            assert_eq!(
                pick(&c.endpoints, Balance::PowerOfTwoChoices, &[], 0),
                Some(1)
            );
        }
    }

    #[tokio::test]
    async fn failed_endpoint_is_ejected_and_another_tried() {
        let good = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // A port with nothing listening: bind then drop.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let c = ControlPlane {
            name: "cp".into(),
            endpoints: vec![
                Endpoint {
                    address: dead.to_string(),
                    state: Arc::default(),
                },
                Endpoint {
                    address: good.local_addr().unwrap().to_string(),
                    state: Arc::default(),
                },
            ],
            acl: None,
        };
        // Make the dead one look best so it is tried first.
        c.endpoints[1].state.active.store(3, Ordering::Relaxed);
        let m = Metrics::new();
        let settings = Upstream::default();
        let ka = Keepalive {
            time: Duration::from_secs(60),
            interval: Duration::from_secs(15),
            retries: 4,
        };
        let (s, _g, ep) = connect(
            &c.name,
            &c.endpoints,
            &settings,
            Duration::from_secs(2),
            ka,
            &m,
        )
        .await
        .unwrap();
        // Keepalive and no-delay are set on the upstream side.
        let sock = socket2::SockRef::from(&s);
        assert!(sock.keepalive().unwrap());
        assert!(sock.nodelay().unwrap());
        assert_eq!(sock.keepalive_time().unwrap(), Duration::from_secs(60));
        assert_eq!(ep, good.local_addr().unwrap().to_string());
        assert!(c.endpoints[0].ejected(now_ms()));
        assert_eq!(c.endpoints[0].state.failures.load(Ordering::Relaxed), 1);
    }
}
