//! gRPC over HTTP/2 for the two Konnectivity services, on connections we
//! accept or dial ourselves (after our own TLS handshake, so the peer's
//! certificate is known): hyper for HTTP/2, tonic's codec layer for gRPC
//! framing and status, prost for the messages. tonic's own transport is not
//! used because its server router pulls in axum and hides the connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::codec::Streaming;
use tonic::{Request, Response, Status};

use crate::wire::proto::Packet;

/// Outbound packets of one stream.
pub type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// Future of a stream handler.
pub type HandlerFuture =
    Pin<Box<dyn Future<Output = Result<Response<PacketStream>, Status>> + Send>>;

/// A bidirectional-streaming handler.
pub type Handler = Arc<dyn Fn(Request<Streaming<Packet>>) -> HandlerFuture + Send + Sync>;

/// HTTP/2 stream window. An agent stream carries every tunneled connection
/// of that agent, so its window bounds their combined throughput: 1 MiB
/// capped a single download at ≈ 2.4 Gbit/s on loopback.
const STREAM_WINDOW: u32 = 8 * 1024 * 1024;
/// HTTP/2 connection window.
const CONN_WINDOW: u32 = 16 * 1024 * 1024;

/// Largest message accepted (gRPC's customary 4 MiB).
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// HTTP/2 settings of one side.
#[derive(Clone, Copy, Debug)]
pub struct H2Settings {
    /// PING interval (detects a frozen peer).
    pub keepalive: Duration,
    /// How long a PING may go unanswered.
    pub keepalive_timeout: Duration,
}

/// gRPC framing for [`Packet`]: prost's codec with a 1 KiB first buffer
/// instead of tonic's 8 KiB. tonic allocates that buffer for each direction
/// of every stream up front, and an agent stream is one long-lived stream:
/// two 8 KiB buffers were 16 of the ≈ 51 KiB the server held per idle agent
/// (heaptrack, docs/PERFORMANCE.md). Buffers still grow to fit each message
/// (a DATA packet reserves its length), so bulk transfers are unaffected.
#[derive(Debug, Clone, Copy, Default)]
pub struct PacketCodec;

/// First buffer size and batching threshold (tonic's default) of [`PacketCodec`].
fn buffers() -> tonic::codec::BufferSettings {
    tonic::codec::BufferSettings::new(1024, 32 * 1024)
}

impl tonic::codec::Codec for PacketCodec {
    type Encode = Packet;
    type Decode = Packet;
    type Encoder = <tonic_prost::ProstCodec<Packet, Packet> as tonic::codec::Codec>::Encoder;
    type Decoder = <tonic_prost::ProstCodec<Packet, Packet> as tonic::codec::Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstCodec::<Packet, Packet>::raw_encoder(buffers())
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstCodec::<Packet, Packet>::raw_decoder(buffers())
    }
}

struct Svc(Handler);

impl tonic::server::StreamingService<Packet> for Svc {
    type Response = Packet;
    type ResponseStream = PacketStream;
    type Future = HandlerFuture;

    fn call(&mut self, request: Request<Streaming<Packet>>) -> Self::Future {
        (self.0)(request)
    }
}

/// Answers one request with the handler of its path (unimplemented if
/// none).
async fn route(
    routes: &[(&'static str, Handler)],
    req: http::Request<Incoming>,
) -> http::Response<tonic::body::Body> {
    let handler = routes
        .iter()
        .find(|(p, _)| *p == req.uri().path())
        .map(|(_, h)| h.clone());
    match handler {
        Some(h) => {
            let mut grpc =
                tonic::server::Grpc::new(PacketCodec).max_decoding_message_size(MAX_MESSAGE);
            grpc.streaming(Svc(h), req).await
        }
        None => Status::unimplemented(format!("no method {}", req.uri().path())).into_http(),
    }
}

/// How much a peer may send before anything it sent is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Windows {
    /// The peer is known (its certificate named its cluster, or it is
    /// kube-apiserver on its own frontend): the large windows one agent
    /// stream needs for throughput.
    Large,
    /// The peer is nobody yet (no certificate: its token is checked per
    /// stream): HTTP/2's default 64 KiB windows and 16 KiB frames, for
    /// the connection's life, so that data sent before admission buffers
    /// at most 64 KiB per connection. Agents that authenticate by token
    /// alone get that window (use certificates, or seedlink's agent on
    /// the native transport, for bulk throughput).
    Small,
}

/// Serves gRPC on one accepted connection: `routes` maps method paths to
/// handlers; others get `UNIMPLEMENTED`. Returns when the connection ends.
pub async fn serve<IO>(
    io: IO,
    routes: Vec<(&'static str, Handler)>,
    h2: H2Settings,
    windows: Windows,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let routes = Arc::new(routes);
    let service = hyper::service::service_fn(move |req: http::Request<Incoming>| {
        let routes = routes.clone();
        async move { Ok::<_, std::convert::Infallible>(route(&routes, req).await) }
    });
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Some(h2.keepalive))
        .keep_alive_timeout(h2.keepalive_timeout)
        .max_concurrent_streams(1000)
        .max_pending_accept_reset_streams(20)
        .max_local_error_reset_streams(256);
    match windows {
        Windows::Large => builder
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONN_WINDOW)
            .max_frame_size(256 * 1024),
        Windows::Small => builder
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .max_frame_size(16 * 1024),
    };
    if let Err(e) = builder.serve_connection(TokioIo::new(io), service).await {
        tracing::debug!(error = %e, "gRPC connection ended");
    }
}

/// A gRPC client on one dialled connection.
pub type Client = tonic::client::Grpc<H2Client>;

/// hyper's HTTP/2 sender as the tower service tonic's client expects.
#[derive(Clone)]
pub struct H2Client(hyper::client::conn::http2::SendRequest<tonic::body::Body>);

impl tower_service::Service<http::Request<tonic::body::Body>> for H2Client {
    type Response = http::Response<Incoming>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.0.send_request(req))
    }
}

/// HTTP/2 handshake on `io` (already TLS if wanted) and a gRPC client on
/// it; the connection is driven by a spawned task that ends with it.
pub async fn connect<IO>(io: IO, origin: http::Uri, h2: H2Settings) -> Result<Client, hyper::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Some(h2.keepalive))
        .keep_alive_timeout(h2.keepalive_timeout)
        .keep_alive_while_idle(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_frame_size(256 * 1024)
        .handshake(TokioIo::new(io))
        .await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "gRPC client connection ended");
        }
    });
    Ok(tonic::client::Grpc::with_origin(H2Client(send), origin)
        .max_decoding_message_size(MAX_MESSAGE))
}

/// Opens a bidirectional stream on `path` sending `outbound`, with request
/// metadata `meta`.
pub async fn open_stream<S>(
    client: &mut Client,
    path: &'static str,
    outbound: S,
    meta: &[(&'static str, String)],
) -> Result<Response<Streaming<Packet>>, Status>
where
    S: Stream<Item = Packet> + Send + 'static,
{
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(format!("connection not ready: {e}")))?;
    let mut req = Request::new(outbound);
    for (k, v) in meta {
        let v = v
            .parse()
            .map_err(|_| Status::invalid_argument(format!("metadata {k} is not ASCII")))?;
        req.metadata_mut().insert(*k, v);
    }
    client
        .streaming(req, http::uri::PathAndQuery::from_static(path), PacketCodec)
        .await
}
