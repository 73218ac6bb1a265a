//! One tunnel: connect to the gateway, announce the destination, wait for
//! the answer, then copy.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use seedlink_net::copy::{write_all, Transfer};
use tokio::net::TcpStream;

use crate::{Mode, NodeProxy};

/// Largest gateway answer head accepted.
const MAX_RESPONSE_HEAD: usize = 8192;

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
        if let Ok(c) = self.cache.lock() {
            if let Some((at, addrs)) = c.as_ref() {
                if at.elapsed() < self.ttl && !addrs.is_empty() {
                    return Ok(addrs.clone());
                }
            }
        }
        let addrs = match lookup(&self.target, deadline).await {
            Ok(a) => a,
            // An absolute name (`api.example.com.`) is the same name without
            // the dot; DNS resolvers accept both, /etc/hosts only the latter.
            Err(e) => match self.target.rsplit_once(':') {
                Some((host, port)) if host.ends_with('.') => {
                    lookup(&format!("{}:{port}", host.trim_end_matches('.')), deadline)
                        .await
                        .map_err(|_| e)?
                }
                _ => return Err(e),
            },
        };
        if addrs.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the gateway name resolved to no address",
            ));
        }
        if let Ok(mut c) = self.cache.lock() {
            *c = Some((Instant::now(), addrs.clone()));
        }
        Ok(addrs)
    }

    /// Connects to the first gateway address that answers, each within the
    /// connect timeout.
    pub async fn connect(&self, np: &NodeProxy) -> io::Result<TcpStream> {
        let addrs = self.addresses(np.opts.connect_timeout).await?;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no gateway address");
        for addr in addrs {
            match tokio::time::timeout(np.opts.connect_timeout, TcpStream::connect(addr)).await {
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
            np.metrics.gateway_connect_failures.inc();
        }
        // A failed resolution result should not be reused.
        if let Ok(mut c) = self.cache.lock() {
            *c = None;
        }
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

/// Carries one client connection; returns the outcome label.
pub async fn carry(np: &NodeProxy, client: TcpStream, peer: SocketAddr) -> &'static str {
    let _ = client.set_nodelay(true);
    let gateway = match np.resolver.connect(np).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "gateway unreachable");
            np.gateway_ok.store(false, Ordering::Release);
            return "gateway_unreachable";
        }
    };
    let local = client.local_addr().unwrap_or(peer);
    let leftover = match np.opts.mode {
        Mode::Connect => {
            match tokio::time::timeout(np.opts.handshake_timeout, connect_handshake(np, &gateway))
                .await
            {
                Ok(Ok(rest)) => rest,
                Ok(Err(why)) => {
                    tracing::warn!(%peer, reason = why, "gateway refused the tunnel");
                    return why;
                }
                Err(_) => return "gateway_timeout",
            }
        }
        Mode::ProxyV2 => {
            let header = ppp::v2::Builder::with_addresses(
                ppp::v2::Version::Two | ppp::v2::Command::Proxy,
                ppp::v2::Protocol::Stream,
                (peer, local),
            )
            .build();
            let Ok(header) = header else {
                return "proxy_header_error";
            };
            if write_all(&gateway, &header).await.is_err() {
                return "gateway_error";
            }
            Vec::new()
        }
        Mode::ProxyV1 => {
            let header = match (peer, local) {
                (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                    ppp::v1::Addresses::new_tcp4(*s.ip(), *d.ip(), s.port(), d.port()).to_string()
                }
                (s, d) => {
                    let v6 = |a: SocketAddr| match a {
                        SocketAddr::V6(a) => *a.ip(),
                        SocketAddr::V4(a) => a.ip().to_ipv6_mapped(),
                    };
                    ppp::v1::Addresses::new_tcp6(v6(s), v6(d), s.port(), d.port()).to_string()
                }
            };
            if write_all(&gateway, header.as_bytes()).await.is_err() {
                return "gateway_error";
            }
            Vec::new()
        }
    };
    np.gateway_ok.store(true, Ordering::Release);
    if !leftover.is_empty() && write_all(&client, &leftover).await.is_err() {
        return "client_error";
    }
    let t = Transfer::default();
    match np
        .copier
        .run(&client, &gateway, &t.to_upstream, &t.to_client)
        .await
    {
        Ok(()) => "ok",
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => "reset",
        Err(_) => "error",
    }
}

/// Sends the CONNECT request and reads the answer head. Returns bytes the
/// gateway sent after the head (already tunnel payload), or why it failed.
async fn connect_handshake(np: &NodeProxy, gateway: &TcpStream) -> Result<Vec<u8>, &'static str> {
    let (name, value) = &np.opts.header;
    let head = format!(
        "CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n{name}: {value}\r\n\r\n",
        a = np.opts.authority
    );
    write_all(gateway, head.as_bytes())
        .await
        .map_err(|_| "gateway_error")?;
    let mut buf: Vec<u8> = Vec::with_capacity(256);
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                return match resp.code {
                    Some(200) => Ok(buf.split_off(n)),
                    Some(403) => Err("gateway_forbidden"),
                    Some(503) => Err("gateway_unavailable"),
                    Some(301) => Err("gateway_redirect"),
                    _ => Err("gateway_refused"),
                };
            }
            Ok(httparse::Status::Partial) => {}
            Err(_) => return Err("gateway_bad_response"),
        }
        if buf.len() >= MAX_RESPONSE_HEAD {
            return Err("gateway_bad_response");
        }
        gateway.readable().await.map_err(|_| "gateway_error")?;
        let mut chunk = [0u8; 1024];
        match gateway.try_read(&mut chunk) {
            Ok(0) => return Err("gateway_closed"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return Err("gateway_error"),
        }
    }
}
