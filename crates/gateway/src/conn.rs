//! One connection on a TLS listener, top to bottom:
//! limits → PROXY header (if configured and the peer is trusted) →
//! ClientHello under one absolute deadline → route by SNI → ACL →
//! upstream connect → replay the bytes read → copy until both sides end.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BufMut;
use prometheus_client::metrics::counter::Counter;
use seedlink_config::model::ProxyMode;
use seedlink_config::routes::canonical;
use seedlink_config::Snapshot;
use seedlink_net::copy::{write_all, Tally};
use seedlink_net::sockopt;
use seedlink_proto::{client_hello, proxy_header, Parse};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::metrics::{ByteLabels, ConnLabels, CpLabels, ListenerLabels, ReasonLabels};
use crate::{upstream, Gateway, ListenerCtx, SourceGuard};

/// Why a connection ended before being proxied; `reason()` is the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Timeout,
    Eof,
    ReadError,
    PerSourceLimit,
    UntrustedProxy,
    ProxyMissing,
    Proxy(proxy_header::Reject),
    Hello(client_hello::Reject),
    LbHealthCheck,
    NoSni,
    UnknownSni,
}

impl Refusal {
    fn reason(&self) -> &'static str {
        match self {
            Refusal::Timeout => "timeout",
            Refusal::Eof => "eof",
            Refusal::ReadError => "read_error",
            Refusal::PerSourceLimit => "per_source_limit",
            Refusal::UntrustedProxy => "proxy_untrusted_peer",
            Refusal::ProxyMissing => "proxy_missing",
            Refusal::Proxy(r) => r.reason(),
            Refusal::Hello(r) => r.reason(),
            Refusal::LbHealthCheck => "lb_health_check",
            Refusal::NoSni => "no_sni",
            Refusal::UnknownSni => "unknown_sni",
        }
    }
}

/// What detection learned.
struct Detected {
    client: SocketAddr,
    sni: String,
    alpn: Vec<String>,
    /// Bytes read from the client after any PROXY header: the ClientHello
    /// and whatever followed it; replayed to the upstream verbatim.
    replay: Vec<u8>,
}

/// Adds to a metric and to a local total, so the access log has byte counts.
struct Count<'a> {
    metric: &'a Counter,
    local: std::sync::atomic::AtomicU64,
}

impl Tally for Count<'_> {
    fn add(&self, n: u64) {
        self.metric.inc_by(n);
        self.local
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Serves one accepted connection. Never panics on input; every exit path
/// is counted exactly once.
pub async fn serve(gw: Arc<Gateway>, lctx: Arc<ListenerCtx>, stream: TcpStream, peer: SocketAddr) {
    let snap = gw.snapshot();
    let active = gw
        .metrics
        .active
        .get_or_create(&ListenerLabels {
            listener: lctx.spec.name.clone(),
        })
        .clone();
    active.inc();
    let outcome = run(&gw, &lctx, &snap, stream, peer).await;
    active.dec();
    let (cp, outcome) = outcome;
    gw.metrics
        .connections
        .get_or_create(&ConnLabels {
            listener: lctx.spec.name.clone(),
            control_plane: cp,
            outcome: outcome.to_string(),
        })
        .inc();
}

async fn run(
    gw: &Gateway,
    lctx: &ListenerCtx,
    snap: &Snapshot,
    stream: TcpStream,
    peer: SocketAddr,
) -> (String, &'static str) {
    let peer = SocketAddr::new(canonical(peer.ip()), peer.port());
    let trusted = snap.trusted_lbs.contains(peer.ip());
    // Unrouted connections are capped per source. A trusted load balancer is
    // exempt as a peer; its clients are capped once the PROXY header names them.
    let mut guard = None;
    if !trusted {
        match gw
            .sources
            .enter(peer.ip(), snap.limits.max_unrouted_per_source)
        {
            Some(g) => guard = Some(g),
            None => return refuse(gw, lctx, peer, Refusal::PerSourceLimit),
        }
    }
    let deadline = Instant::now() + snap.timeouts.client_hello;
    let detected = match tokio::time::timeout_at(
        deadline,
        detect(gw, lctx, snap, &stream, peer, trusted, &mut guard),
    )
    .await
    {
        Ok(Ok(d)) => d,
        Ok(Err(r)) => return refuse(gw, lctx, peer, r),
        Err(_) => return refuse(gw, lctx, peer, Refusal::Timeout),
    };
    drop(guard);
    let client = detected.client;

    let Some(cp) = snap.routes.lookup(&detected.sni).cloned() else {
        tracing::debug!(listener = %lctx.spec.name, %peer, %client, sni = %detected.sni, "unknown SNI");
        return refuse(gw, lctx, client, Refusal::UnknownSni);
    };
    let allowed = snap.always_allowed.contains(client.ip())
        || cp.acl.as_ref().is_none_or(|acl| acl.contains(client.ip()));
    if !allowed {
        gw.metrics
            .acl_denied
            .get_or_create(&CpLabels {
                control_plane: cp.name.clone(),
            })
            .inc();
        tracing::info!(listener = %lctx.spec.name, %client, %peer, control_plane = %cp.name, "ACL denied");
        return (cp.name.clone(), "acl_denied");
    }

    let (upstream, _active, endpoint) = match upstream::connect(
        &cp,
        &snap.upstream,
        snap.timeouts.upstream_connect,
        crate::keepalive(snap),
        &gw.metrics,
    )
    .await
    {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(listener = %lctx.spec.name, %client, control_plane = %cp.name, error = %e, "no upstream");
            return (cp.name.clone(), "upstream_unavailable");
        }
    };
    let labels = |direction: &str| ByteLabels {
        listener: lctx.spec.name.clone(),
        control_plane: cp.name.clone(),
        direction: direction.to_string(),
    };
    let up_metric = gw
        .metrics
        .bytes
        .get_or_create(&labels("to_upstream"))
        .clone();
    let down_metric = gw.metrics.bytes.get_or_create(&labels("to_client")).clone();
    let up = Count {
        metric: &up_metric,
        local: 0.into(),
    };
    let down = Count {
        metric: &down_metric,
        local: 0.into(),
    };

    if let Err(e) = write_all(&upstream, &detected.replay).await {
        tracing::debug!(control_plane = %cp.name, error = %e, "upstream write failed");
        sockopt::arm_reset(&stream);
        return (cp.name.clone(), "upstream_error");
    }
    up.add(detected.replay.len() as u64);
    drop(detected.replay);

    tracing::debug!(listener = %lctx.spec.name, %client, %peer, sni = %detected.sni,
        alpn = ?detected.alpn, control_plane = %cp.name, %endpoint, "proxying");
    let closer = gw.closer_for(&cp.name);
    let outcome = tokio::select! {
        r = gw.copier.run(&stream, &upstream, &up, &down) => match r {
            Ok(()) => "ok",
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => "reset",
            Err(_) => "error",
        },
        () = closer.cancelled() => "closed_removed",
        () = gw.lifecycle.close_all.cancelled() => "closed_drain",
    };
    if matches!(outcome, "closed_removed" | "closed_drain") {
        sockopt::arm_reset(&stream);
        sockopt::arm_reset(&upstream);
    }
    tracing::debug!(listener = %lctx.spec.name, %client, control_plane = %cp.name, outcome,
        bytes_up = up.local.into_inner(), bytes_down = down.local.into_inner(), "closed");
    (cp.name.clone(), outcome)
}

fn refuse(gw: &Gateway, lctx: &ListenerCtx, who: SocketAddr, r: Refusal) -> (String, &'static str) {
    let reason = r.reason();
    if r != Refusal::LbHealthCheck {
        gw.metrics
            .detect_failures
            .get_or_create(&ReasonLabels {
                listener: lctx.spec.name.clone(),
                reason: reason.to_string(),
            })
            .inc();
    }
    tracing::debug!(listener = %lctx.spec.name, client = %who, reason, "connection refused");
    (String::new(), reason)
}

/// Reads until a PROXY header (when configured) and a complete ClientHello
/// have arrived. The caller bounds it with the absolute deadline.
async fn detect<'g>(
    gw: &'g Gateway,
    lctx: &ListenerCtx,
    snap: &Snapshot,
    stream: &TcpStream,
    peer: SocketAddr,
    trusted: bool,
    guard: &mut Option<SourceGuard<'g>>,
) -> Result<Detected, Refusal> {
    let hello_cap = snap.limits.client_hello_max_bytes;
    let proxy_cap = snap.limits.proxy_header_max_bytes;
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    let mut client = peer;
    let mode = lctx.spec.proxy_protocol;

    if mode == ProxyMode::Required && !trusted {
        return Err(Refusal::UntrustedProxy);
    }
    if mode != ProxyMode::Off {
        let header = loop {
            let present = match proxy_header::detect(&buf) {
                Parse::Done(()) => true,
                Parse::Invalid(()) => false,
                Parse::Incomplete => {
                    read_more(stream, &mut buf, proxy_cap).await?;
                    continue;
                }
            };
            if !present {
                if mode == ProxyMode::Required {
                    return Err(Refusal::ProxyMissing);
                }
                break None;
            }
            if !trusted {
                return Err(Refusal::UntrustedProxy);
            }
            match proxy_header::parse(&buf, proxy_cap) {
                Parse::Done(h) => break Some(h),
                Parse::Invalid(r) => return Err(Refusal::Proxy(r)),
                Parse::Incomplete => read_more(stream, &mut buf, proxy_cap).await?,
            }
        };
        if let Some(h) = header {
            buf.drain(..h.len);
            match h.addresses {
                proxy_header::Addresses::Proxied { source, .. } => {
                    client = SocketAddr::new(canonical(source.ip()), source.port());
                    match gw
                        .sources
                        .enter(client.ip(), snap.limits.max_unrouted_per_source)
                    {
                        Some(g) => *guard = Some(g),
                        None => return Err(Refusal::PerSourceLimit),
                    }
                }
                proxy_header::Addresses::Local => {
                    // A load balancer health check: it usually closes now.
                    if buf.is_empty()
                        && read_more(stream, &mut buf, hello_cap).await == Err(Refusal::Eof)
                    {
                        return Err(Refusal::LbHealthCheck);
                    }
                }
            }
        }
    }

    loop {
        match client_hello::parse(&buf, hello_cap) {
            Parse::Done(h) => {
                let Some(sni) = h.sni else {
                    return Err(Refusal::NoSni);
                };
                return Ok(Detected {
                    client,
                    sni,
                    alpn: h.alpn,
                    replay: buf,
                });
            }
            Parse::Invalid(r) => {
                if r == client_hello::Reject::NotTls
                    && mode == ProxyMode::Off
                    && matches!(proxy_header::detect(&buf), Parse::Done(()))
                {
                    return Err(Refusal::UntrustedProxy);
                }
                return Err(Refusal::Hello(r));
            }
            Parse::Incomplete => read_more(stream, &mut buf, hello_cap).await?,
        }
    }
}

/// Appends what the socket has (at least one byte) without letting `buf`
/// grow past `cap` plus one read. Reads into spare capacity: no zeroing.
async fn read_more(stream: &TcpStream, buf: &mut Vec<u8>, cap: usize) -> Result<(), Refusal> {
    let want = cap.saturating_sub(buf.len()).clamp(1, 4096);
    if buf.capacity() - buf.len() < want {
        buf.reserve(want);
    }
    loop {
        if stream.readable().await.is_err() {
            return Err(Refusal::ReadError);
        }
        let room = buf.capacity() - buf.len();
        let mut limited = (&mut *buf).limit(room.min(want));
        match stream.try_read_buf(&mut limited) {
            Ok(0) => return Err(Refusal::Eof),
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Err(Refusal::ReadError),
        }
    }
}
