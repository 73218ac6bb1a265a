//! What a running node-proxy keeps between tunnels: the gateway's resolved
//! addresses and the shared HTTP/2 connections. Plain state, used by
//! `proxy::NodeProxy` (which holds it) and by `tunnel` (which acts on it),
//! so that neither needs the other.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::net::TcpStream;

/// Resolves the gateway name and keeps the answer for a while, so that a
/// moved gateway is followed without a lookup per connection.
pub struct Resolver {
    target: String,
    ttl: Duration,
    cache: Mutex<Option<(Instant, Vec<SocketAddr>)>>,
}

impl Resolver {
    /// A resolver for `host:port`.
    pub fn new(target: String, ttl: Duration) -> Resolver {
        Resolver {
            target,
            ttl,
            cache: Mutex::new(None),
        }
    }

    async fn addresses(&self, deadline: Duration) -> io::Result<Vec<SocketAddr>> {
        {
            let c = seedlink_net::sync::lock(&self.cache, "gateway addresses");
            if let Some((at, addrs)) = c.as_ref() {
                if at.elapsed() < self.ttl && !addrs.is_empty() {
                    return Ok(addrs.clone());
                }
            }
        }
        let addrs = lookup_absolute(&self.target, deadline).await?;
        if addrs.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the gateway name resolved to no address",
            ));
        }
        *seedlink_net::sync::lock(&self.cache, "gateway addresses") =
            Some((Instant::now(), addrs.clone()));
        Ok(addrs)
    }

    /// Connects to the first gateway address that answers, each within the
    /// connect timeout.
    pub async fn connect(
        &self,
        connect_timeout: Duration,
        failures: &prometheus_client::metrics::counter::Counter,
    ) -> io::Result<TcpStream> {
        let addrs = self.addresses(connect_timeout).await?;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no gateway address");
        for addr in addrs {
            match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Ok(Err(e)) => last = e,
                Err(_) => {
                    last = io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connect to {addr} timed out"),
                    )
                }
            }
            failures.inc();
        }
        // A failed resolution result should not be reused.
        *seedlink_net::sync::lock(&self.cache, "gateway addresses") = None;
        Err(last)
    }
}

async fn lookup(target: &str, deadline: Duration) -> io::Result<Vec<SocketAddr>> {
    match tokio::time::timeout(deadline, tokio::net::lookup_host(target)).await {
        Ok(r) => Ok(r?.collect()),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "resolving the gateway timed out",
        )),
    }
}

/// The HTTP/2 connections to the gateway that tunnels share in
/// [`crate::proxy::Mode::Http2Connect`]: a tunnel takes a stream on the first live
/// connection below the gateway's concurrent-stream limit; a new connection
/// is opened only when all are full, and a failed one is replaced.
#[derive(Default)]
pub struct H2Session {
    pub(crate) conns: tokio::sync::Mutex<Vec<H2Conn>>,
}

/// One shared connection: its sender, its driver, its open streams.
pub(crate) struct H2Conn {
    pub(crate) send: SendRequest<Bytes>,
    pub(crate) task: tokio::task::JoinHandle<()>,
    pub(crate) streams: Arc<AtomicUsize>,
}

/// One stream slot on a shared connection; released on drop.
pub(crate) struct StreamSlot(pub(crate) Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Looks `target` up; an absolute name (`api.example.com.`) is the same
/// name without the dot: DNS resolvers accept both, /etc/hosts only the
/// latter, so that is tried when the first lookup fails.
async fn lookup_absolute(target: &str, deadline: Duration) -> io::Result<Vec<SocketAddr>> {
    match lookup(target, deadline).await {
        Ok(a) => Ok(a),
        Err(e) => match target.rsplit_once(':') {
            Some((host, port)) if host.ends_with('.') => {
                lookup(&format!("{}:{port}", host.trim_end_matches('.')), deadline)
                    .await
                    .map_err(|_| e)
            }
            _ => Err(e),
        },
    }
}
