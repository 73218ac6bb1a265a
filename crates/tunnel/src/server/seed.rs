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
//! one through an agent, and the dial deadline; it is copied both ways in
//! user space, a half-closed connection for at most `stall_timeout`, and
//! ends (reset where the frontend can see it) when the server shuts down
//! or the cluster is removed.

use std::net::{IpAddr, SocketAddr};

use bytes::BytesMut;
use seedlink_config::tunnel::SeedDestination;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::answer::{FrontendEnd, FrontendIo, Reply};
use super::core::Core;
use super::services::LookupError;
use super::{Cluster, DialError};

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
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    seed.iter()
        .find(|d| d.matches(&host, port))
        .map(|d| (d, port))
}

/// The addresses `d` is dialled at, for `port`.
async fn addresses(srv: &Core, d: &SeedDestination, port: u16) -> Result<Vec<SocketAddr>, String> {
    if let Some(service) = &d.service {
        return Ok(vec![SocketAddr::new(
            service_ip(srv, service, port).await?,
            port,
        )]);
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

/// The ClusterIP of seed Service `service` (`<namespace>/<name>`) for
/// `port`, looked up through the Kubernetes source.
async fn service_ip(srv: &Core, service: &str, port: u16) -> Result<IpAddr, String> {
    let (ns, name) = service
        .split_once('/')
        .ok_or_else(|| format!("service {service:?} is not <namespace>/<name>"))?;
    let services = srv
        .services
        .get()
        .ok_or("no Kubernetes source to read the Service from")?;
    let now = crate::stream::clock::now();
    services
        .cluster_ip(ns, name, port, now)
        .await
        .map_err(|e| match e {
            LookupError::Refused(why) => format!("Service {service}: {why}"),
            LookupError::Unavailable => {
                format!("Service {service}: the seed's API server did not answer")
            }
        })
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
    let _ = up.set_nodelay(true);
    if !leftover.is_empty() && up.write_all(leftover).await.is_err() {
        let e = DialError::Seed(format!("{}:{port}: closed at once", d.host));
        cluster.metrics.dial_failure(e.reason());
        return Err(e);
    }
    cluster.metrics.dial_ok(started.elapsed());
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
    let (permit, up) = match open(srv, cluster, (d, port), &leftover).await {
        Ok(pair) => pair,
        Err(e) => {
            super::answer::refuse(&mut io, &e, reply).await;
            return FrontendEnd::Dial(e);
        }
    };
    if super::answer::answer_success(&mut io, reply).await.is_err() {
        return FrontendEnd::WriteError;
    }
    cluster.metrics.established(1);
    let end = both_ways(srv, cluster, io, up).await;
    cluster.metrics.established(-1);
    drop(permit);
    end
}

/// Copies between the frontend and the seed destination until both end
/// (the half-closed rest within `stall_timeout`), the server shuts down or
/// the cluster goes; a connection cut short is reset where the frontend
/// can see it, and counted.
async fn both_ways<S: FrontendIo>(
    srv: &Core,
    cluster: &Cluster,
    mut io: S,
    mut up: TcpStream,
) -> FrontendEnd {
    let stall = srv.settings.stall_timeout;
    let copied = tokio::select! {
        r = seedlink_net::copy::both_ways(&mut io, &mut up, stall) => r.is_ok(),
        () = srv.shutdown.cancelled() => false,
        () = cluster.removed.cancelled() => false,
    };
    if copied {
        return FrontendEnd::Ok;
    }
    let signal = if io.reset_on_close() { "reset" } else { "eof" };
    srv.metrics.frontend_abort(&cluster.name, signal);
    FrontendEnd::Aborted
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
        assert!(d.matches("hooks.shoot--a.svc.CLUSTER.LOCAL", 443));
        assert!(!d.matches("hooks.shoot--a.svc", 8443));
        assert!(!d.matches("hooks.shoot--b.svc", 443));
        assert!(!d.matches("x.hooks.shoot--a.svc", 443));
        assert!(!d.matches("hooks.shoot--a.svc.evil.example", 443));
        let plain = dest("hooks.seed.example", &[443]);
        assert!(!plain.matches("hooks.seed.example.cluster.local", 443));
        let seed = [plain, d];
        assert!(matching(&seed, "hooks.shoot--a.svc.:443").is_some());
        assert!(matching(&seed, "HOOKS.Shoot--A.svc.Cluster.Local:443").is_some());
        assert!(matching(&seed, "hooks.seed.example:443").is_some());
        assert!(matching(&seed, "10.96.0.7:443").is_none());
        assert!(matching(&seed, "hooks.shoot--a.svc").is_none());
    }
}
