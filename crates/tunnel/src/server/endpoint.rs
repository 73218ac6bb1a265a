//! The agent endpoint: TLS with a client certificate from one of the
//! clusters' CAs (the certificate decides the cluster, nothing the agent
//! says does), then gRPC `AgentService/Connect` or the native transport;
//! and the receive loop of each agent stream it admits, the other half of
//! the stream's driver (`link_driver`): packets from the agent into the
//! link machine, the machine's timers, and why the stream ended
//! ([`StreamEnd`], the `agent_streams_total` reason).

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tokio::net::TcpStream;
use tonic::{Response, Status};

use super::activity::{Activity, Watched};
use super::admission::{
    admit, answer_meta, asked, cluster_of_cert, opening_notices, response, Admitted, AgentConn,
    Certs, ConnSlots,
};
pub use super::admission::{enter, MAX_AGENT_ID};
use super::core::Core;
use super::{detach, Cluster, Handled, LinkDriver};
use crate::transport::grpc::{self, Handler, PacketStream};
use crate::transport::native;
use crate::transport::usertls::UserTls;
use crate::wire::proto::{Packet, AGENT_CONNECT_PATH};

/// Serves one accepted agent connection.
pub async fn serve_agent_conn(srv: Arc<Core>, tcp: TcpStream, peer: SocketAddr, slots: ConnSlots) {
    let _ = tcp.set_nodelay(true);
    serve_agent_io(srv, tcp, peer, slots).await;
}

/// The agent connection past TLS: the cluster its certificate names, if
/// any (a certificate that names a cluster ambiguously ends it here). A
/// connection without an admitted stream for the handshake deadline is
/// closed: past TLS, a client without a certificate is still nobody.
fn agent_conn(
    srv: Arc<Core>,
    certs: Certs,
    activity: Arc<Activity>,
    peer: SocketAddr,
    slots: ConnSlots,
) -> Option<AgentConn> {
    let cert_cluster = cluster_of_cert(&srv, &certs, peer).ok()?;
    let slots = Arc::new(slots);
    Some(AgentConn {
        srv,
        cert_cluster,
        certs,
        activity,
        peer,
        slots,
    })
}

/// Serves one agent connection on any transport: an accepted socket, or
/// one the gateway handed over in-process (with the bytes it already read
/// replayed in front). TLS → the cluster its certificate names (if it
/// has one) → gRPC `Connect` streams, each opened by [`open_stream`].
pub async fn serve_agent_io<IO>(srv: Arc<Core>, tcp: IO, peer: SocketAddr, slots: ConnSlots)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::new();
    let tcp = Watched::new(tcp, activity.clone());
    // Boxed, as are the gRPC branch and the native stream's opening: the
    // task lives as long as the agent stream, and inline they would size
    // every stream's task for themselves (26.5 KB per task measured,
    // 4.4 KB boxed; docs/PERFORMANCE.md, issue 28).
    let Some(mut tls) = Box::pin(accept_tls(&srv, tcp, peer)).await else {
        return;
    };
    let Some(conn) = agent_conn(srv, tls.take_peer_certificates(), activity, peer, slots) else {
        return;
    };
    if tls.session().alpn.as_deref() == Some(native::ALPN.as_bytes()) {
        serve_native(conn, tls).await;
        return;
    }
    Box::pin(serve_grpc(conn, tls)).await;
}

/// gRPC `Connect` streams on one agent connection (HTTP/2), the first
/// within the handshake deadline.
async fn serve_grpc<IO>(conn: AgentConn, tls: IO)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let srv = conn.srv.clone();
    let live = Arc::new(Live::default());
    // Without a certificate naming its cluster, the peer is nobody until
    // a stream's token is checked: small windows until then.
    let windows = match conn.cert_cluster {
        Some(_) => grpc::Windows::Large,
        None => grpc::Windows::Small,
    };
    let handler = conn.handler(live.clone());
    let idle = without_streams_for(srv.settings.handshake_timeout, &live);
    tokio::select! {
        () = grpc::serve(tls, vec![(AGENT_CONNECT_PATH, handler)], srv.agent_h2, windows) => {}
        () = idle => srv.metrics.agent_stream("", "no_stream"),
        () = live.refused_anonymous.notified() => {}
    }
}

/// The admitted streams of one gRPC agent connection.
#[derive(Default)]
pub(crate) struct Live {
    streams: std::sync::atomic::AtomicUsize,
    changed: tokio::sync::Notify,
    /// A stream was refused on a connection without a cluster's
    /// certificate and without an admitted stream: it is nobody, and the
    /// connection ends.
    refused_anonymous: tokio::sync::Notify,
}

/// One admitted stream, counted in [`Live`] while it runs.
struct Running(Arc<Live>);

impl Running {
    fn new(live: Arc<Live>) -> Running {
        live.streams
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        live.changed.notify_waiters();
        Running(live)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0
            .streams
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// Ends once the connection has had no admitted stream for `deadline`: at
/// its start, after refused streams (an anonymous client that opens one
/// and is refused holds nothing), and after its last stream ended.
pub(crate) async fn without_streams_for(deadline: std::time::Duration, live: &Live) {
    loop {
        let changed = live.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if live.streams.load(std::sync::atomic::Ordering::Acquire) > 0 {
            changed.await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(deadline) => {
                if live.streams.load(std::sync::atomic::Ordering::Acquire) == 0 {
                    return;
                }
            }
            () = &mut changed => {}
        }
    }
}

/// The TLS handshake within the handshake deadline; `None` (counted) if
/// it failed or took too long. TLS 1.3 in this process (usertls.rs).
async fn accept_tls<IO>(srv: &Core, tcp: IO, peer: SocketAddr) -> Option<UserTls<IO>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let accept = crate::transport::usertls::accept(srv.agent_tls.load_full(), tcp);
    let within = tokio::time::timeout(srv.settings.handshake_timeout, accept);
    // The handshake's work on the low-priority thread; the stream comes
    // back to the workers.
    let done = match &srv.handshaker {
        Some(h) => h.spawn(within).await.map_err(|e| {
            tracing::warn!(%peer, error = %e, "agent TLS handshake task failed");
            srv.metrics.agent_stream("", "tls_failed");
        }),
        None => Ok(within.await),
    };
    let Ok(done) = done else { return None };
    match done {
        Ok(Ok(s)) => Some(s),
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "agent TLS handshake failed");
            srv.metrics.agent_stream("", "tls_failed");
            None
        }
        Err(_) => {
            srv.metrics.agent_stream("", "tls_timeout");
            None
        }
    }
}

/// One `Connect` stream: its cluster, its identity, the link, the receive
/// loop, and the answer with `serverid`/`servercount`.
async fn open_stream(
    conn: AgentConn,
    live: Arc<Live>,
    req: tonic::Request<tonic::Streaming<Packet>>,
) -> Result<Response<PacketStream>, Status> {
    let srv = conn.srv.clone();
    let anonymous = conn.cert_cluster.is_none();
    let a = match admit(conn, req.metadata()).await {
        Ok(a) => a,
        Err(status) => {
            if anonymous && live.streams.load(std::sync::atomic::Ordering::Acquire) == 0 {
                live.refused_anonymous.notify_one();
            }
            return Err(status);
        }
    };
    let running = Running::new(live);
    let answer = response(&srv, a.to_agent.clone(), a.flow, a.replicas);
    opening_notices(&srv, &a.link);
    tokio::spawn(async move {
        receive(srv, a.cluster, a.link, req.into_inner(), a.probe).await;
        drop(running);
    });
    answer
}

/// One agent stream on the native transport (`seedlink-tunnel/1`, see
/// native.rs): OPEN within the handshake deadline, the same admission as a
/// gRPC `Connect`, ANSWER or REFUSED, then packets both ways until the
/// stream ends. It requires flow control, so the receive loop never stops
/// reading for a full queue and PINGs are always answered.
async fn serve_native<IO>(conn: AgentConn, tls: IO)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let srv = conn.srv.clone();
    // The connection's slots are held as long as the connection is.
    let _slots = conn.slots.clone();
    // Boxed: the steps before the stream runs (OPEN, admission, ANSWER)
    // would otherwise size the task that lives as long as the stream.
    let Some((a, tls)) = Box::pin(open_native(conn, tls)).await else {
        return;
    };
    opening_notices(&srv, &a.link);
    let (inbound, writer) = native::start(tls, a.to_agent.clone(), srv.agent_h2);
    let grace = srv.settings.handshake_timeout;
    receive(srv, a.cluster, a.link, inbound, a.probe).await;
    // The queue is closed: the writer closes the connection, unless the
    // agent takes nothing (frozen), which the grace bounds.
    let abort = writer.abort_handle();
    if tokio::time::timeout(grace, writer).await.is_err() {
        abort.abort();
    }
}

/// The native stream's opening: OPEN, admission, ANSWER or REFUSED (counted);
/// the admitted stream and its connection.
async fn open_native<IO>(conn: AgentConn, mut tls: IO) -> Option<(Admitted, IO)>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let srv = conn.srv.clone();
    let peer = conn.peer;
    let meta = match tokio::time::timeout(srv.settings.handshake_timeout, native::accept(&mut tls))
        .await
    {
        Ok(Ok(m)) => m,
        // Records nobody should send (usertls.rs refused them): said
        // and counted, before any stream.
        Ok(Err(native::WireError::Io(e))) if e.kind() == std::io::ErrorKind::InvalidData => {
            tracing::info!(%peer, error = %e, "agent connection refused before OPEN: bad TLS record");
            srv.metrics.agent_stream("", "bad_record");
            return None;
        }
        // Gone before a whole frame (a port check, a scan): no stream.
        Ok(Err(native::WireError::Io(_) | native::WireError::Truncated)) => {
            srv.metrics.agent_stream("", "no_stream");
            return None;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "agent stream refused: bad OPEN");
            srv.metrics.agent_stream("", "bad_open");
            return None;
        }
        Err(_) => {
            srv.metrics.agent_stream("", "no_stream");
            return None;
        }
    };
    let (flow, replicas) = asked(&meta);
    let answer = answer_meta(&srv, flow, replicas);
    let admitted = match (flow, answer) {
        (false, _) => Err(Status::failed_precondition(format!(
            "the {} transport needs per-connection flow control",
            native::ALPN
        ))),
        (true, Err(s)) => Err(s),
        (true, Ok(answer)) => admit(conn, &meta).await.map(|a| (a, answer)),
    };
    let (a, answer) = match admitted {
        Ok(x) => x,
        Err(status) => {
            if !flow {
                srv.metrics.agent_stream("", "bad_open");
            }
            let _ = tokio::time::timeout(
                srv.settings.handshake_timeout,
                native::refuse(&mut tls, &status),
            )
            .await;
            return None;
        }
    };
    // An agent gone meanwhile: its stream fails at once and is detached.
    let _ = tokio::time::timeout(
        srv.settings.handshake_timeout,
        native::answer(&mut tls, &answer),
    )
    .await;
    Some((a, tls))
}

impl AgentConn {
    /// The `Connect` handler: each stream is opened by [`open_stream`] and
    /// counted in `live` while it runs.
    fn handler(self, live: Arc<Live>) -> Handler {
        Arc::new(move |req: tonic::Request<tonic::Streaming<Packet>>| {
            Box::pin(open_stream(self.clone(), live.clone(), req))
        })
    }
}

/// Why an agent stream ended; its label is the `agent_streams_total`
/// reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamEnd {
    /// The agent closed it.
    Closed,
    /// The transport failed (a reset, a protocol error).
    StreamError,
    /// More packets that move nothing than its budget (flood.rs).
    ControlFlood,
    /// The server queued more answers than the agent reads.
    ControlOverflow,
    /// The server is shutting down.
    ServerShutdown,
    /// Its cluster was removed.
    ClusterRemoved,
    /// It carried nothing more while the server drains.
    DrainedIdle,
    /// Its cluster was re-keyed away from the agent's credentials.
    Rekeyed,
}

impl StreamEnd {
    /// The metric label and log value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            StreamEnd::Closed => "closed",
            StreamEnd::StreamError => "stream_error",
            StreamEnd::ControlFlood => "control_flood",
            StreamEnd::ControlOverflow => "control_overflow",
            StreamEnd::ServerShutdown => "server_shutdown",
            StreamEnd::ClusterRemoved => "cluster_removed",
            StreamEnd::DrainedIdle => "drained_idle",
            StreamEnd::Rekeyed => "rekeyed",
        }
    }
}

/// The receive loop of one stream: each packet goes to the link; it waits
/// on a connection only when that connection's queue is full (see
/// `stream::flow` and docs/TUNNEL.md, "Head-of-line"). It also drives the link's
/// timers ([`LinkDriver::next_timeout`]), waiting or not. Ends with the
/// stream, on shutdown, when the cluster is removed or re-keyed away from
/// the agent.
pub(super) async fn receive<S, E>(
    srv: Arc<Core>,
    cluster: Arc<Cluster>,
    link: Arc<LinkDriver>,
    inbound: S,
    probe: bool,
) where
    S: Stream<Item = Result<Packet, E>> + Unpin,
    E: ReceiveError,
{
    let why = receive_loop(&srv, &cluster, &link, inbound).await;
    if why == StreamEnd::ControlFlood {
        let until = seedlink_net::clock::now_ms()
            + u64::try_from(crate::stream::flood::COOLDOWN.as_millis()).unwrap_or(u64::MAX);
        cluster
            .flood_until_ms
            .store(until, std::sync::atomic::Ordering::Release);
    }
    detach(&cluster, &link);
    cluster.metrics.agent(-1);
    if probe && why == StreamEnd::Closed {
        srv.metrics.agent_stream(&cluster.name, "duplicate");
        tracing::debug!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, "duplicate agent stream closed");
    } else {
        let why = why.label();
        srv.metrics.agent_stream(&cluster.name, why);
        tracing::info!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, why, "agent disconnected");
    }
}

/// Takes the stream's packets and drives the link's timers until the
/// stream ends; returns why (the `agent_streams_total` label).
pub(super) async fn receive_loop<S, E>(
    srv: &Core,
    cluster: &Cluster,
    link: &LinkDriver,
    mut inbound: S,
) -> StreamEnd
where
    S: Stream<Item = Result<Packet, E>> + Unpin,
    E: ReceiveError,
{
    // One sleep across packets; set again when it fired, and after a wait
    // for room (which ran the timers itself).
    let timer = link.next_timeout();
    tokio::pin!(timer);
    let mut idle = crate::stream::flood::Budget::new(crate::stream::clock::now());
    loop {
        // Each packet costs the task a unit of tokio's cooperative budget:
        // a stream whose packets are always ready (a flood, or a fast
        // bulk sender) gives the worker back to other tenants' tasks now
        // and then instead of keeping it for as long as the agent sends.
        tokio::task::consume_budget().await;
        let m = tokio::select! {
            m = inbound.next() => m,
            h = &mut timer => {
                if let Some(h) = h {
                    cluster.metrics.packet(h);
                }
                timer.set(link.next_timeout());
                continue;
            }
            why = stopped(srv, cluster, link) => return why,
        };
        let waited = match m {
            Some(Ok(p)) if moves_nothing(&p) && !idle.spend(crate::stream::clock::now()) => {
                tracing::info!(agent = %link.agent_id, "agent stream cut: more packets that move nothing than its budget");
                Err(StreamEnd::ControlFlood)
            }
            Some(Ok(p)) => take_packet(srv, cluster, link, p, &mut idle).await,
            Some(Err(e)) if e.flood() => {
                tracing::info!(agent = %link.agent_id, error = %e, "agent stream cut: more frames that move nothing than its budget");
                Err(StreamEnd::ControlFlood)
            }
            Some(Err(e)) => {
                tracing::info!(agent = %link.agent_id, error = %e, "agent stream failed");
                Err(StreamEnd::StreamError)
            }
            None => Err(StreamEnd::Closed),
        };
        match waited {
            Ok(true) => timer.set(link.next_timeout()),
            Ok(false) => {}
            Err(why) => return why,
        }
    }
}

/// One packet from the agent. DATA for a full connection makes the stream
/// read nothing more until that connection's reader makes room, or stops
/// reading for the stall deadline (backpressure); `Ok(true)` when it
/// waited. `Err(why)` ends the stream.
pub(super) async fn take_packet(
    srv: &Core,
    cluster: &Cluster,
    link: &LinkDriver,
    p: Packet,
    idle: &mut crate::stream::flood::Budget,
) -> Result<bool, StreamEnd> {
    let (h, blocked) = link.on_agent_packet(p);
    cluster.metrics.packet(h);
    if matches!(h, Handled::Unrecognized | Handled::Unexpected)
        && !idle.spend(crate::stream::clock::now())
    {
        tracing::info!(agent = %link.agent_id, "agent stream cut: more packets for nothing it has than its budget");
        return Err(StreamEnd::ControlFlood);
    }
    if link.to_agent.overflowed() {
        // It made the server queue more answers than it reads: cut off,
        // this agent only.
        return Err(StreamEnd::ControlOverflow);
    }
    let Some(b) = blocked else { return Ok(false) };
    // Boxed: a wait for room is rare, and inline it would size every
    // idle stream's receive loop for it.
    Box::pin(async {
        tokio::select! {
            h = b.resume(link) => {
                if h != Handled::Ok {
                    cluster.metrics.packet(h);
                }
                Ok(true)
            }
            why = stopped(srv, cluster, link) => Err(why),
        }
    })
    .await
}

/// Why an agent stream's packets stopped coming.
pub(crate) trait ReceiveError: std::fmt::Display {
    /// The transport cut it for frames that move nothing (flood.rs).
    fn flood(&self) -> bool {
        false
    }
}

impl ReceiveError for Status {}

impl ReceiveError for native::WireError {
    fn flood(&self) -> bool {
        matches!(self, native::WireError::Flood)
    }
}

/// A packet that carries nothing by its kind alone: a DRAIN (an agent
/// sends one per stream), DATA without bytes, a packet without a payload.
/// Packets naming what the stream does not have are counted once handled.
pub(super) fn moves_nothing(p: &Packet) -> bool {
    use crate::wire::proto::{PacketType as T, Payload};
    match (&p.payload, p.kind()) {
        (_, Some(T::Drain)) | (None, _) => true,
        (Some(Payload::Data(d)), _) => d.data.is_empty() && d.error.is_empty(),
        _ => false,
    }
}

/// Ends when the stream must: on shutdown, when the cluster is removed,
/// or when the link is kicked; says why.
pub(super) async fn stopped(srv: &Core, cluster: &Cluster, link: &LinkDriver) -> StreamEnd {
    tokio::select! {
        () = srv.shutdown.cancelled() => StreamEnd::ServerShutdown,
        () = cluster.removed.cancelled() => StreamEnd::ClusterRemoved,
        () = link.kick.cancelled() => kicked(srv, link),
    }
}

/// Why a link was kicked: its queue overflowed, it carried nothing more
/// while the server drains, or its cluster was re-keyed away from it.
pub(super) fn kicked(srv: &Core, link: &LinkDriver) -> StreamEnd {
    if link.to_agent.overflowed() {
        StreamEnd::ControlOverflow
    } else if srv.accepting.is_cancelled() {
        StreamEnd::DrainedIdle
    } else {
        StreamEnd::Rekeyed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DRAIN, DATA without bytes and a packet without a payload move
    /// nothing by their kind; DATA with bytes, a DIAL_RSP or a
    /// WINDOW_UPDATE may (they are counted once handled, if they named
    /// nothing the stream has).
    #[test]
    fn what_moves_nothing() {
        assert!(moves_nothing(&Packet::drain()));
        assert!(moves_nothing(&Packet::data(1, bytes::Bytes::new())));
        assert!(moves_nothing(&Packet::default()));
        assert!(!moves_nothing(&Packet::data(
            1,
            bytes::Bytes::from_static(b"x")
        )));
        assert!(!moves_nothing(&Packet::dial_cls(1)));
        assert!(!moves_nothing(&Packet::window_update(1, 10)));
    }
}
