//! The native transport between a seedlink agent and a seedlink server,
//! `seedlink-tunnel/1`, agreed by ALPN in the TLS handshake the agent
//! makes anyway. An upstream agent or server offers only `h2` and gets
//! gRPC, unchanged. Decided and measured in docs/TUNNEL.md ("The native
//! transport") and docs/PERFORMANCE.md (issue 28): HTTP/2 and gRPC cost a
//! fixed 28 KiB per idle agent stream, two copies of every DATA payload on
//! the way in, and a hop through the HTTP/2 connection task each way.
//!
//! One connection carries one agent stream. Frames: a type byte, a 4-byte
//! big-endian length, the payload.
//! - OPEN (agent, first): the stream's metadata, `key:value` lines, what
//!   gRPC sends as request headers (`agentid`, `authorization`, ...).
//! - ANSWER (server): the answer's metadata (`serverid`, ...); or REFUSED
//!   with `code message` (a gRPC status code), after which the server
//!   closes.
//! - PACKET: one Konnectivity `Packet`, protobuf-encoded, exactly as in
//!   a gRPC message.
//! - PING / PONG (empty): a side that heard nothing for its keepalive
//!   interval sends PING; a PING is answered by one PONG; a side that then
//!   hears nothing for the keepalive timeout ends the stream.
//!
//! The stream ends with the TLS connection (close_notify, then FIN).
//! Hand-written: it is the framing above and nothing else; no crate frames
//! protobuf messages over a byte stream without a layer (gRPC, HTTP/2)
//! whose cost is the point.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::Stream;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::stream::fair::FairQueue;
use crate::wire::proto::{Data, Packet, Payload};

/// The ALPN protocol name.
pub const ALPN: &str = "seedlink-tunnel/1";

const PACKET: u8 = 0;
const PING: u8 = 1;
const PONG: u8 = 2;
const OPEN: u8 = 3;
const ANSWER: u8 = 4;
const REFUSED: u8 = 5;

/// A frame's body is read (and its buffer grown) this much at a time.
const STEP: usize = 64 * 1024;
/// Frames handled in one poll before the reader yields.
const CONTROL_BUDGET: usize = 64;
/// Frame header: type and length.
const HEAD: usize = 5;
/// Largest packet (gRPC's customary 4 MiB, as on the gRPC transport).
pub const MAX_PACKET: usize = crate::transport::grpc::MAX_MESSAGE;
/// Largest OPEN, ANSWER or REFUSED (a ServiceAccount token is ≈ 1 KiB).
pub const MAX_META: usize = 16 * 1024;
/// At most this many packets, or [`BATCH_BYTES`], go into one write.
const BATCH_PACKETS: usize = 64;
const BATCH_BYTES: usize = 256 * 1024;
/// The `Data` payload's tag in `Packet`, and `data`'s in `Data`
/// (proto.rs; checked by `heads_encode_like_prost`).
const DATA_TAG: u32 = 4;
const DATA_BYTES_TAG: u32 = 3;

/// What went wrong on the native transport.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// A frame type this side does not know.
    #[error("unknown frame type {0}")]
    UnknownFrame(u8),
    /// A frame type that has no place here.
    #[error("unexpected frame type {0}")]
    Unexpected(u8),
    /// A frame over its limit.
    #[error("a frame of type {kind} with {len} bytes is over the limit of {max}")]
    TooLarge {
        /// Its type.
        kind: u8,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The connection ended inside a frame.
    #[error("the connection ended inside a frame")]
    Truncated,
    /// A packet that does not decode.
    #[error("a packet does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// Metadata that is not `key:value` lines of header names and values.
    #[error("bad metadata: {0}")]
    BadMeta(String),
    /// Nothing heard for the keepalive interval and the timeout after the PING.
    #[error("nothing heard for {0:?} (keepalive)")]
    Silent(Duration),
    /// This side's writer failed.
    #[error("sending failed: {0}")]
    Writer(String),
    /// More PINGs and PONGs than a stream's budget (flood.rs).
    #[error("more PINGs and PONGs than the stream's budget")]
    Flood,
}

/// The stream's metadata: request or answer headers, as gRPC has them.
pub type Meta = Vec<(String, String)>;

/// `key:value` lines; keys and values must be header names and values.
fn encode_meta(meta: &[(&str, &str)]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::new();
    for (k, v) in meta {
        http::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| WireError::BadMeta(format!("{k:?} is not a header name")))?;
        if http::header::HeaderValue::from_str(v).is_err() {
            return Err(WireError::BadMeta(format!(
                "the value of {k} is not a header value"
            )));
        }
        out.extend_from_slice(k.as_bytes());
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
        out.push(b'\n');
    }
    Ok(out)
}

/// The lines of an OPEN or ANSWER as a metadata map.
pub fn decode_meta(b: &[u8]) -> Result<tonic::metadata::MetadataMap, WireError> {
    let mut headers = http::HeaderMap::new();
    let text = std::str::from_utf8(b).map_err(|_| WireError::BadMeta("not UTF-8".into()))?;
    for line in text.split_terminator('\n') {
        let Some((k, v)) = line.split_once(':') else {
            return Err(WireError::BadMeta("a line without ':'".into()));
        };
        let name = http::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| WireError::BadMeta(format!("{k:?} is not a header name")))?;
        let value = http::header::HeaderValue::from_str(v)
            .map_err(|_| WireError::BadMeta(format!("the value of {k} is not a header value")))?;
        headers.append(name, value);
    }
    Ok(tonic::metadata::MetadataMap::from_headers(headers))
}

/// The largest frame of type `kind`; `None` for an unknown type.
fn limit(kind: u8) -> Option<usize> {
    match kind {
        PACKET => Some(MAX_PACKET),
        PING | PONG => Some(0),
        OPEN | ANSWER | REFUSED => Some(MAX_META),
        _ => None,
    }
}

/// Checks a frame header; the frame's type and length.
fn check_head(head: [u8; HEAD]) -> Result<(u8, usize), WireError> {
    let kind = head[0];
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let max = limit(kind).ok_or(WireError::UnknownFrame(kind))?;
    if len > max {
        return Err(WireError::TooLarge { kind, len, max });
    }
    Ok((kind, len))
}

/// Reads one whole frame of the handshake (packets go through
/// [`Inbound`]): only a frame of a type in `kinds` is read, so before the
/// handshake (before the peer is authenticated) nothing larger than
/// [`MAX_META`] is ever allocated, whatever the peer announces.
async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    kinds: &[u8],
) -> Result<(u8, Vec<u8>), WireError> {
    let mut head = [0u8; HEAD];
    rd.read_exact(&mut head).await.map_err(truncated)?;
    if !kinds.contains(&head[0]) {
        return Err(WireError::Unexpected(head[0]));
    }
    let (kind, len) = check_head(head)?;
    let mut body = vec![0u8; len];
    rd.read_exact(&mut body).await.map_err(truncated)?;
    Ok((kind, body))
}

fn truncated(e: std::io::Error) -> WireError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        WireError::Truncated
    } else {
        WireError::Io(e)
    }
}

async fn write_frame<W: AsyncWrite + Unpin>(
    wr: &mut W,
    kind: u8,
    body: &[u8],
) -> Result<(), WireError> {
    let len = u32::try_from(body.len()).map_err(|_| WireError::BadMeta("over 4 GiB".into()))?;
    let mut f = Vec::with_capacity(HEAD + body.len());
    f.push(kind);
    f.extend_from_slice(&len.to_be_bytes());
    f.extend_from_slice(body);
    wr.write_all(&f).await?;
    wr.flush().await?;
    Ok(())
}

/// How the server answered an OPEN.
#[derive(Debug)]
pub enum Opened {
    /// It took the stream; its answer's metadata.
    Answer(tonic::metadata::MetadataMap),
    /// It refused it.
    Refused(tonic::Status),
}

/// The agent's side of the handshake: sends OPEN with `meta`, reads the
/// answer.
pub async fn open<IO: AsyncRead + AsyncWrite + Unpin>(
    io: &mut IO,
    meta: &[(&'static str, String)],
) -> Result<Opened, WireError> {
    let pairs: Vec<(&str, &str)> = meta.iter().map(|(k, v)| (*k, v.as_str())).collect();
    write_frame(io, OPEN, &encode_meta(&pairs)?).await?;
    match read_frame(io, &[ANSWER, REFUSED]).await? {
        (ANSWER, body) => Ok(Opened::Answer(decode_meta(&body)?)),
        (REFUSED, body) => Ok(Opened::Refused(status_of(&body))),
        (kind, _) => Err(WireError::Unexpected(kind)),
    }
}

/// A REFUSED frame's status: `code message`.
fn status_of(body: &[u8]) -> tonic::Status {
    let text = String::from_utf8_lossy(body);
    let (code, message) = text.split_once(' ').unwrap_or((&text, ""));
    let code = code
        .parse::<i32>()
        .map_or(tonic::Code::Unknown, tonic::Code::from_i32);
    tonic::Status::new(code, message.to_string())
}

/// The server's side of the handshake: the OPEN's metadata.
pub async fn accept<R: AsyncRead + Unpin>(
    rd: &mut R,
) -> Result<tonic::metadata::MetadataMap, WireError> {
    match read_frame(rd, &[OPEN]).await? {
        (OPEN, body) => decode_meta(&body),
        (kind, _) => Err(WireError::Unexpected(kind)),
    }
}

/// Answers an OPEN with the answer's metadata.
pub async fn answer<W: AsyncWrite + Unpin>(
    wr: &mut W,
    meta: &tonic::metadata::MetadataMap,
) -> Result<(), WireError> {
    let headers = meta.clone().into_headers();
    let mut pairs = Vec::new();
    for (k, v) in &headers {
        let v = v
            .to_str()
            .map_err(|_| WireError::BadMeta(format!("the value of {k} is not ASCII")))?;
        pairs.push((k.as_str(), v));
    }
    write_frame(wr, ANSWER, &encode_meta(&pairs)?).await
}

/// Refuses an OPEN with `status`; the caller closes the connection.
pub async fn refuse<W: AsyncWrite + Unpin>(
    wr: &mut W,
    status: &tonic::Status,
) -> Result<(), WireError> {
    let mut text = format!("{} {}", status.code() as i32, status.message());
    // The message is ours, but a limit is a limit.
    let mut cut = text.len().min(MAX_META);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    write_frame(wr, REFUSED, text.as_bytes()).await?;
    wr.shutdown().await?;
    Ok(())
}

/// What the reader asks of the writer (a PING, a PONG) and tells it, and
/// how the writer tells the reader it failed.
#[derive(Default)]
pub struct Control {
    ping: AtomicBool,
    pong: AtomicBool,
    wake: Notify,
    failed: Mutex<Option<String>>,
    writer_gone: CancellationToken,
}

impl Control {
    /// A new control block.
    pub fn new() -> Arc<Control> {
        Arc::new(Control::default())
    }

    fn ask(&self, flag: &AtomicBool) {
        flag.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    fn writer_failed(&self, why: String) {
        *seedlink_net::sync::lock(&self.failed, "native control") = Some(why);
        self.writer_gone.cancel();
    }
}

/// A batch of frames for one vectored write: heads in one buffer, DATA
/// payloads by reference (no copy before TLS's own).
#[derive(Default)]
struct Batch {
    heads: BytesMut,
    parts: Vec<Bytes>,
    bytes: usize,
    packets: usize,
}

impl Batch {
    fn full(&self) -> bool {
        self.packets >= BATCH_PACKETS || self.bytes >= BATCH_BYTES
    }

    fn cut_head(&mut self) {
        if !self.heads.is_empty() {
            self.parts.push(self.heads.split().freeze());
        }
    }

    fn control(&mut self, kind: u8) {
        self.heads.put_u8(kind);
        self.heads.put_u32(0);
    }

    /// Adds one packet; a DATA payload goes in by reference.
    fn packet(&mut self, p: Packet) {
        self.packets += 1;
        if let Some(data) = encode_head(p, &mut self.heads) {
            self.cut_head();
            self.bytes += data.len();
            self.parts.push(data);
        }
    }

    /// Writes the batch; a peer that takes nothing for `stall` fails it.
    async fn write<W: AsyncWrite + Unpin>(
        &mut self,
        wr: &mut W,
        stall: Duration,
    ) -> std::io::Result<()> {
        self.cut_head();
        let mut first = 0;
        while first < self.parts.len() {
            let slices: Vec<std::io::IoSlice<'_>> = self.parts[first..]
                .iter()
                .map(|b| std::io::IoSlice::new(b))
                .collect();
            let mut n = within(stall, wr.write_vectored(&slices)).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            while n > 0 {
                let part = &mut self.parts[first];
                if n >= part.len() {
                    n -= part.len();
                    first += 1;
                } else {
                    bytes::Buf::advance(part, n);
                    n = 0;
                }
            }
        }
        within(stall, wr.flush()).await?;
        self.parts.clear();
        self.heads = BytesMut::new();
        (self.bytes, self.packets) = (0, 0);
        Ok(())
    }
}

/// `io` unless the peer takes nothing for `stall`: a peer that reads
/// nothing (frozen, or hostile and still sending) holds no writer forever.
async fn within<T>(
    stall: Duration,
    io: impl Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(stall, io).await.unwrap_or_else(|_| {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the peer took nothing for {stall:?}"),
        ))
    })
}

/// Encodes packet `p`'s frame into `heads`, all of it but a DATA payload,
/// which comes back to be sent after it: prost's encoding, byte for byte
/// (`Data.data` is the last field of the last field).
fn encode_head(p: Packet, heads: &mut BytesMut) -> Option<Bytes> {
    let (r#type, d) = match p.payload {
        Some(Payload::Data(d)) if !d.data.is_empty() => (p.r#type, d),
        payload => {
            let p = Packet {
                r#type: p.r#type,
                payload,
            };
            heads.put_u8(PACKET);
            heads.put_u32(len_u32(p.encoded_len()));
            p.encode_raw(heads);
            return None;
        }
    };
    let Data {
        connect_id,
        error,
        data,
    } = d;
    let rest = Data {
        connect_id,
        error,
        data: Bytes::new(),
    };
    let n = data.len();
    let inner = rest.encoded_len() + key_len(DATA_BYTES_TAG) + encoded_len_varint(n as u64) + n;
    let outer = Packet {
        r#type,
        payload: None,
    };
    let total = outer.encoded_len() + key_len(DATA_TAG) + encoded_len_varint(inner as u64) + inner;
    heads.put_u8(PACKET);
    heads.put_u32(len_u32(total));
    outer.encode_raw(heads);
    encode_key(DATA_TAG, WireType::LengthDelimited, heads);
    encode_varint(inner as u64, heads);
    rest.encode_raw(heads);
    encode_key(DATA_BYTES_TAG, WireType::LengthDelimited, heads);
    encode_varint(n as u64, heads);
    Some(data)
}

/// A frame length; packets are far below 4 GiB (the queues bound them).
fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// One connection shared by its reader and its writer, each poll under a
/// lock held only for that poll. Hand-written instead of
/// `tokio::io::split`, whose lock makes a half that finds it taken wake
/// itself and return at once: with the reader and the writer on two
/// threads, they spun against each other (measured: a quarter more CPU
/// per GB than gRPC, whose connection is one task). The socket keeps a
/// waker per direction, so neither half's wake-up is lost (but for
/// tokio-rustls's last-gasp alert write when a read fails, which ends the
/// stream anyway; the writer's stall deadline bounds it).
pub struct Shared<IO>(Arc<Mutex<IO>>);

/// The connection as two handles: one for the reader, one for the writer.
pub fn split<IO>(io: IO) -> (Shared<IO>, Shared<IO>) {
    let a = Arc::new(Mutex::new(io));
    (Shared(a.clone()), Shared(a))
}

impl<IO: AsyncRead + Unpin> AsyncRead for Shared<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let mut io = seedlink_net::sync::lock(&self.0, "native connection");
        Pin::new(&mut *io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Shared<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let mut io = seedlink_net::sync::lock(&self.0, "native connection");
        Pin::new(&mut *io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let mut io = seedlink_net::sync::lock(&self.0, "native connection");
        Pin::new(&mut *io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        seedlink_net::sync::lock(&self.0, "native connection").is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let mut io = seedlink_net::sync::lock(&self.0, "native connection");
        Pin::new(&mut *io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let mut io = seedlink_net::sync::lock(&self.0, "native connection");
        Pin::new(&mut *io).poll_shutdown(cx)
    }
}

/// Runs a stream on `io` after the handshake: the writer task sending
/// `queue` (a peer that takes nothing for the keepalive interval and
/// timeout fails it), and the reader, keeping the keepalive.
pub fn start<IO>(
    io: IO,
    queue: Arc<FairQueue>,
    keepalive: crate::transport::grpc::H2Settings,
) -> (Inbound<Shared<IO>>, tokio::task::JoinHandle<()>)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = split(io);
    let ctl = Control::new();
    let (every, timeout) = (keepalive.keepalive, keepalive.keepalive_timeout);
    let writer = tokio::spawn(write_loop(
        wr,
        queue,
        ctl.clone(),
        every.saturating_add(timeout),
    ));
    (Inbound::new(rd, ctl, every, timeout), writer)
}

/// Sends the queue's packets (and the PINGs and PONGs the reader asks
/// for) until the queue is closed, then closes the connection's sending
/// side; a failure is told to the reader. A write the peer takes nothing
/// of for `stall` (the keepalive interval and timeout) is a failure.
pub async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    queue: Arc<FairQueue>,
    ctl: Arc<Control>,
    stall: Duration,
) {
    let r = write_all(&mut wr, &queue, &ctl, stall).await;
    match r {
        Ok(()) => {
            let _ = within(stall, wr.shutdown()).await;
        }
        Err(e) => {
            tracing::debug!(error = %e, "native transport: sending failed");
            ctl.writer_failed(e.to_string());
            queue.close();
        }
    }
}

async fn write_all<W: AsyncWrite + Unpin>(
    wr: &mut W,
    queue: &FairQueue,
    ctl: &Control,
    stall: Duration,
) -> std::io::Result<()> {
    let mut batch = Batch::default();
    loop {
        let woken = ctl.wake.notified();
        let first = if ctl.ping.load(Ordering::Acquire) || ctl.pong.load(Ordering::Acquire) {
            queue.try_next()
        } else {
            tokio::select! {
                biased;
                p = queue.next() => match p {
                    Some(p) => Some(p),
                    None => return Ok(()),
                },
                () = woken => None,
            }
        };
        if ctl.pong.swap(false, Ordering::AcqRel) {
            batch.control(PONG);
        }
        if ctl.ping.swap(false, Ordering::AcqRel) {
            batch.control(PING);
        }
        if let Some(p) = first {
            batch.packet(p);
            while !batch.full() {
                match queue.try_next() {
                    Some(p) => batch.packet(p),
                    None => break,
                }
            }
        }
        batch.write(wr, stall).await?;
    }
}

/// Packets from the peer, as a stream; PINGs are answered, and the
/// keepalive is kept: after `every` without a byte from the peer a PING
/// goes out, and after `timeout` more the stream fails. Ends at a clean
/// end of the connection.
pub struct Inbound<R> {
    rd: R,
    head: [u8; HEAD],
    have: usize,
    /// The frame being read: its type, its length, what came so far.
    body: Option<(u8, usize, BytesMut)>,
    ctl: Arc<Control>,
    writer_gone: Pin<Box<WaitForCancellationFutureOwned>>,
    every: Duration,
    timeout: Duration,
    heard: Instant,
    /// When a PING went out with nothing heard since.
    pinged: Option<std::time::Instant>,
    timer: Pin<Box<Sleep>>,
    done: bool,
    /// PINGs and PONGs move nothing: a stream may send so many.
    idle: crate::stream::flood::Budget,
}

impl<R: AsyncRead + Unpin> Inbound<R> {
    /// Reads `rd`; the writer that answers PINGs is told through `ctl`.
    pub fn new(rd: R, ctl: Arc<Control>, every: Duration, timeout: Duration) -> Inbound<R> {
        let now = Instant::now();
        let writer_gone = Box::pin(ctl.writer_gone.clone().cancelled_owned());
        Inbound {
            rd,
            head: [0; HEAD],
            have: 0,
            body: None,
            ctl,
            writer_gone,
            every,
            timeout,
            heard: now,
            pinged: None,
            timer: Box::pin(tokio::time::sleep_until(
                crate::stream::deadline::later(now.into_std(), every).into(),
            )),
            done: false,
            idle: crate::stream::flood::Budget::new(now.into_std()),
        }
    }

    /// Reads into `dst` (at most `max` bytes); the count, 0 at the end.
    fn poll_some(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut impl BufMut,
    ) -> Poll<std::io::Result<usize>> {
        let r = tokio_util::io::poll_read_buf(Pin::new(&mut self.rd), cx, dst);
        if let Poll::Ready(Ok(n)) = r {
            if n > 0 {
                self.heard = Instant::now();
                self.pinged = None;
            }
        }
        r
    }

    /// The next whole frame; `None` at a clean end (between frames).
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<(u8, Bytes)>, WireError>> {
        loop {
            if let Some((kind, len, buf)) = &mut self.body {
                let (kind, len) = (*kind, *len);
                if buf.len() == len {
                    let body = std::mem::take(buf).freeze();
                    self.body = None;
                    return Poll::Ready(Ok(Some((kind, body))));
                }
                let mut buf = std::mem::take(buf);
                // Grown as the bytes come: a header alone reserves little.
                let need = (len - buf.len()).min(STEP);
                if buf.capacity() == buf.len() {
                    buf.reserve(need);
                }
                let r = self.poll_some(cx, &mut (&mut buf).limit(need));
                if let Some((_, _, b)) = &mut self.body {
                    *b = buf;
                }
                match r {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(WireError::Truncated)),
                    Poll::Ready(Ok(_)) => continue,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                    Poll::Pending => return Poll::Pending,
                }
            }
            let mut head = self.head;
            let have = self.have;
            let r = self.poll_some(cx, &mut &mut head[have..]);
            match r {
                Poll::Ready(Ok(0)) if have == 0 => return Poll::Ready(Ok(None)),
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(WireError::Truncated)),
                Poll::Ready(Ok(n)) => {
                    self.head = head;
                    self.have += n;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            }
            if self.have == HEAD {
                self.have = 0;
                let (kind, len) = check_head(self.head)?;
                self.body = Some((kind, len, BytesMut::with_capacity(len.min(STEP))));
            }
        }
    }

    /// The keepalive: a PING after `every` of silence, a failure after
    /// `timeout` more.
    fn poll_keepalive(&mut self, cx: &mut Context<'_>) -> Poll<WireError> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = Instant::now();
            let heard = self.heard.into_std();
            let next = match keepalive(now.into_std(), heard, self.pinged, self.every, self.timeout)
            {
                Keep::Dead => {
                    return Poll::Ready(WireError::Silent(
                        now.saturating_duration_since(self.heard),
                    ))
                }
                Keep::Ping(next) => {
                    self.pinged = Some(now.into_std());
                    self.ctl.ask(&self.ctl.ping);
                    next
                }
                Keep::Wait(next) => next,
            };
            self.timer.as_mut().reset(next.into());
        }
    }

    fn writer_failure(&self) -> WireError {
        let why = seedlink_net::sync::lock(&self.ctl.failed, "native control").clone();
        WireError::Writer(why.unwrap_or_default())
    }
}

/// What the keepalive does at `now`.
#[derive(Debug, PartialEq, Eq)]
enum Keep {
    /// Nothing yet; look again then.
    Wait(std::time::Instant),
    /// Send a PING; look again then.
    Ping(std::time::Instant),
    /// Nothing heard for the interval and the timeout after the PING.
    Dead,
}

/// The keepalive's decision at `now`: last `heard` from the peer, when a
/// PING went out since (`pinged`).
fn keepalive(
    now: std::time::Instant,
    heard: std::time::Instant,
    pinged: Option<std::time::Instant>,
    every: Duration,
    timeout: Duration,
) -> Keep {
    match pinged {
        Some(at) => {
            let dead_at = crate::stream::deadline::later(at, timeout);
            if now >= dead_at {
                Keep::Dead
            } else {
                Keep::Wait(dead_at)
            }
        }
        None => {
            let ping_at = crate::stream::deadline::later(heard, every);
            if now >= ping_at {
                Keep::Ping(crate::stream::deadline::later(now, timeout))
            } else {
                Keep::Wait(ping_at)
            }
        }
    }
}

impl<R: AsyncRead + Unpin> Stream for Inbound<R> {
    type Item = Result<Packet, WireError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = self.get_mut();
        if me.done {
            return Poll::Ready(None);
        }
        let mut budget = CONTROL_BUDGET;
        let r = loop {
            if budget == 0 {
                // A stream of PINGs gives the thread back now and then.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            budget -= 1;
            match me.poll_frame(cx) {
                Poll::Ready(Ok(Some((PACKET, body)))) => {
                    break Some(Packet::decode(body).map_err(WireError::from))
                }
                Poll::Ready(Ok(Some((PING | PONG, _))))
                    if !me.idle.spend(std::time::Instant::now()) =>
                {
                    break Some(Err(WireError::Flood))
                }
                Poll::Ready(Ok(Some((PING, _)))) => me.ctl.ask(&me.ctl.pong),
                Poll::Ready(Ok(Some((PONG, _)))) => {}
                Poll::Ready(Ok(Some((kind, _)))) => break Some(Err(WireError::Unexpected(kind))),
                Poll::Ready(Ok(None)) => break None,
                Poll::Ready(Err(e)) => break Some(Err(e)),
                Poll::Pending => {
                    if me.writer_gone.as_mut().poll(cx).is_ready() {
                        break Some(Err(me.writer_failure()));
                    }
                    match me.poll_keepalive(cx) {
                        Poll::Ready(e) => break Some(Err(e)),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }
        };
        if !matches!(r, Some(Ok(_))) {
            me.done = true;
        }
        Poll::Ready(r)
    }
}

#[cfg(test)]
mod tests;
