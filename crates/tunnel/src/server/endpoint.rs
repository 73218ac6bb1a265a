//! The agent endpoint: TLS with a client certificate from one of the
//! clusters' CAs (the certificate decides the cluster, nothing the agent
//! says does), then gRPC `AgentService/Connect`.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tonic::{Response, Status};

use super::activity::{Activity, Watched};
use super::admission::{
    admit, answer_meta, asked, cluster_of_cert, drain_notice_if_moving, response, Admitted,
    AgentConn, Certs, ConnSlots,
};
pub use super::admission::{enter, MAX_AGENT_ID};
use super::core::Core;
use super::receive::receive;
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
    drain_notice_if_moving(&srv, &a.link);
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
    drain_notice_if_moving(&srv, &a.link);
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
