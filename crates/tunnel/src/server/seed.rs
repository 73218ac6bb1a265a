//! Seed destinations: a cluster's webhooks and aggregated APIs that run
//! beside its control plane, in the seed. kube-apiserver's `cluster`
//! egress sends them to the tunnel like everything else; the server dials
//! the ones its cluster's configuration names itself, on the seed's
//! network, and sends the rest to the shoot through the agents. Only a
//! named host at a named port goes this way, never an address a frontend
//! asks for: from a TunnelCluster, a Service of its own namespace, read
//! from the API server (its ClusterIP), so no DNS answer or ExternalName
//! can point a tenant at another tenant's Service.
//!
//! A seed dial takes the cluster's limits (connections, dial rate) like
//! one through an agent, and the dial deadline; it is carried by a plain
//! copy both ways.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use seedlink_config::tunnel::SeedDestination;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::core::Core;
use super::frontend::{FrontendEnd, FrontendIo, Reply};
use super::{Cluster, DialError};

/// A boxed future, as the lookup returns.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Reads a seed Service from the API server.
pub trait ServiceLookup: Send + Sync {
    /// The ClusterIP of Service `name` in `namespace`, if it has one and
    /// serves `port`; why not otherwise.
    fn cluster_ip<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<IpAddr, String>>;
}

/// How long a looked-up Service is used without asking again.
const FOUND_FOR: Duration = Duration::from_secs(10);
/// How long a failed lookup is answered from memory.
const FAILED_FOR: Duration = Duration::from_secs(2);
/// The most lookups remembered (each is a Service a cluster names, at
/// most [`seedlink_config::tunnel::MAX_SEED_DESTINATIONS`] per cluster);
/// past it, the memory is cleared.
const REMEMBERED: usize = 16_384;

type Key = (String, String, u16);
/// A lookup's answer and until when it is used.
type Remembered = (Instant, Result<IpAddr, String>);

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
    ) -> Result<IpAddr, String> {
        let key = (namespace.to_string(), name.to_string(), port);
        let remembered = seedlink_net::sync::lock(&self.memory, "seed services")
            .get(&key)
            .filter(|(until, _)| now < *until)
            .map(|(_, r)| r.clone());
        if let Some(r) = remembered {
            return r;
        }
        let r = self.lookup.cluster_ip(namespace, name, port).await;
        let keep = if r.is_ok() { FOUND_FOR } else { FAILED_FOR };
        let mut memory = seedlink_net::sync::lock(&self.memory, "seed services");
        if memory.len() >= REMEMBERED {
            memory.clear();
        }
        memory.insert(key, (now + keep, r.clone()));
        r
    }
}

/// The seed destination `target` (`host:port`) is, with its port, if it
/// is one of the cluster's.
pub fn matching<'a>(
    seed: &'a [SeedDestination],
    target: &str,
) -> Option<(&'a SeedDestination, u16)> {
    if seed.is_empty() {
        return None;
    }
    let (host, port) = target.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?;
    let host = host.trim_end_matches('.');
    seed.iter()
        .find(|d| d.matches(host, port))
        .map(|d| (d, port))
}

/// The addresses `d` is dialled at, for `port`.
async fn addresses(srv: &Core, d: &SeedDestination, port: u16) -> Result<Vec<SocketAddr>, String> {
    if let Some(service) = &d.service {
        let (ns, name) = service
            .split_once('/')
            .ok_or_else(|| format!("service {service:?} is not <namespace>/<name>"))?;
        let services = srv
            .services
            .get()
            .ok_or("no Kubernetes source to read the Service from")?;
        let ip = services
            .cluster_ip(ns, name, port, crate::stream::clock::now())
            .await
            .map_err(|e| format!("Service {service}: {e}"))?;
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    if !d.addresses.is_empty() {
        return Ok(d
            .addresses
            .iter()
            .map(|ip| SocketAddr::new(*ip, port))
            .collect());
    }
    let found = tokio::net::lookup_host((d.host.as_str(), port))
        .await
        .map_err(|e| format!("{}: {e}", d.host))?;
    Ok(found.take(16).collect())
}

/// Connects to `d` at `port` within the dial deadline: each address in
/// turn.
async fn connect(srv: &Core, d: &SeedDestination, port: u16) -> Result<TcpStream, DialError> {
    let attempt = async {
        let mut last = String::from("no address");
        for a in addresses(srv, d, port).await? {
            match TcpStream::connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = format!("dial tcp {a}: {e}"),
            }
        }
        Err(last)
    };
    match tokio::time::timeout(srv.settings.dial_timeout, attempt).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(DialError::Seed(e)),
        Err(_) => Err(DialError::Seed(format!(
            "{}:{port}: no connection within the dial timeout",
            d.host
        ))),
    }
}

/// Admits a seed dial under the cluster's limits, connects, and sends
/// `leftover`: the connection and its permit, or why not (counted).
async fn open(
    srv: &Core,
    cluster: &Cluster,
    (d, port): (&SeedDestination, u16),
    leftover: &[u8],
) -> Result<(super::ConnPermit, TcpStream), DialError> {
    let started = crate::stream::clock::now();
    let permit = cluster.gate.admit(started).map_err(|l| {
        cluster.metrics.dial_failure(l.reason());
        DialError::Limited(l)
    })?;
    let mut up = connect(srv, d, port).await.map_err(|e| {
        cluster.metrics.dial_failure(e.reason());
        tracing::debug!(cluster = %cluster.name, error = %e, "seed destination not reached");
        e
    })?;
    cluster.metrics.dial_ok(started.elapsed());
    let _ = up.set_nodelay(true);
    if !leftover.is_empty() && up.write_all(leftover).await.is_err() {
        return Err(DialError::Seed(format!(
            "{}:{port}: closed at once",
            d.host
        )));
    }
    Ok((permit, up))
}

/// Dials seed destination `d` at `port` for the frontend `io` and carries
/// the connection both ways; `leftover` (bytes the frontend already sent)
/// goes first; the frontend is answered as `reply` says.
pub(crate) async fn carry<S: FrontendIo>(
    srv: &Core,
    cluster: &Cluster,
    mut io: S,
    (d, port): (&SeedDestination, u16),
    leftover: BytesMut,
    reply: Reply,
) -> FrontendEnd {
    let (permit, mut up) = match open(srv, cluster, (d, port), &leftover).await {
        Ok(pair) => pair,
        Err(e) => {
            super::frontend::refuse(&mut io, &e, reply).await;
            return FrontendEnd::Dial(e);
        }
    };
    if super::frontend::answer_success(&mut io, reply)
        .await
        .is_err()
    {
        return FrontendEnd::WriteError;
    }
    cluster.metrics.established(1);
    let copied = tokio::io::copy_bidirectional(&mut io, &mut up).await;
    cluster.metrics.established(-1);
    drop(permit);
    match copied {
        Ok(_) => FrontendEnd::Ok,
        Err(_) => FrontendEnd::Aborted,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn dest(host: &str, ports: &[u16]) -> SeedDestination {
        SeedDestination {
            host: host.into(),
            ports: ports.to_vec(),
            addresses: Vec::new(),
            service: None,
        }
    }

    #[test]
    fn only_a_named_host_at_a_named_port_goes_to_the_seed() {
        let d = dest("hooks.shoot--a.svc", &[443]);
        assert!(d.matches("hooks.shoot--a.svc", 443));
        assert!(d.matches("HOOKS.shoot--a.svc", 443));
        assert!(d.matches("hooks.shoot--a.svc.cluster.local", 443));
        assert!(!d.matches("hooks.shoot--a.svc", 8443));
        assert!(!d.matches("hooks.shoot--b.svc", 443));
        assert!(!d.matches("x.hooks.shoot--a.svc", 443));
        assert!(!d.matches("hooks.shoot--a.svc.evil.example", 443));
        let plain = dest("hooks.seed.example", &[443]);
        assert!(!plain.matches("hooks.seed.example.cluster.local", 443));
        let seed = [plain, d];
        assert!(matching(&seed, "hooks.shoot--a.svc.:443").is_some());
        assert!(matching(&seed, "hooks.seed.example:443").is_some());
        assert!(matching(&seed, "10.96.0.7:443").is_none());
        assert!(matching(&seed, "hooks.shoot--a.svc").is_none());
    }

    struct Counting(AtomicUsize);

    impl ServiceLookup for Counting {
        fn cluster_ip<'a>(
            &'a self,
            _: &'a str,
            name: &'a str,
            _: u16,
        ) -> BoxFuture<'a, Result<IpAddr, String>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            let r = match name {
                "hooks" => Ok("10.96.0.7".parse().unwrap()),
                _ => Err("not found".to_string()),
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
        // Another namespace, port or name is another lookup.
        s.cluster_ip("b", "hooks", 443, t0).await.unwrap();
        s.cluster_ip("a", "hooks", 8443, t0).await.unwrap();
        assert_eq!(lookup.0.load(Ordering::SeqCst), 6);
    }
}
