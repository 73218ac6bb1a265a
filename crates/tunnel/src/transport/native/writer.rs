//! The writer task: packets from the fair queue, batched into few writes
//! (a DATA payload goes out as it came, behind a hand-encoded head), and the
//! control frames (PING, PONG) the reader asks for.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::stream::flow::FairQueue;
use crate::wire::proto::{Data, Packet, Payload};

use super::frame::*;

/// At most this many packets, or [`BATCH_BYTES`], go into one write.
pub(super) const BATCH_PACKETS: usize = 64;

pub(super) const BATCH_BYTES: usize = 256 * 1024;

/// What the reader asks of the writer (a PING, a PONG) and tells it, and
/// how the writer tells the reader it failed.
#[derive(Default)]
pub struct Control {
    pub(super) ping: AtomicBool,
    pub(super) pong: AtomicBool,
    pub(super) wake: Notify,
    pub(super) failed: Mutex<Option<String>>,
    pub(super) writer_gone: CancellationToken,
}

impl Control {
    /// A new control block.
    pub fn new() -> Arc<Control> {
        Arc::new(Control::default())
    }

    pub(super) fn ask(&self, flag: &AtomicBool) {
        flag.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    pub(super) fn writer_failed(&self, why: String) {
        *seedlink_net::sync::lock(&self.failed, "native control") = Some(why);
        self.writer_gone.cancel();
    }
}

/// A batch of frames for one vectored write: heads in one buffer, DATA
/// payloads by reference (no copy before TLS's own).
#[derive(Default)]
pub(super) struct Batch {
    pub(super) heads: BytesMut,
    pub(super) parts: Vec<Bytes>,
    pub(super) bytes: usize,
    pub(super) packets: usize,
}

impl Batch {
    pub(super) fn full(&self) -> bool {
        self.packets >= BATCH_PACKETS || self.bytes >= BATCH_BYTES
    }

    pub(super) fn cut_head(&mut self) {
        if !self.heads.is_empty() {
            self.parts.push(self.heads.split().freeze());
        }
    }

    pub(super) fn control(&mut self, kind: u8) {
        self.heads.put_u8(kind);
        self.heads.put_u32(0);
    }

    /// Adds one packet; a DATA payload goes in by reference.
    pub(super) fn packet(&mut self, p: Packet) {
        self.packets += 1;
        if let Some(data) = encode_head(p, &mut self.heads) {
            self.cut_head();
            self.bytes += data.len();
            self.parts.push(data);
        }
    }

    /// Writes the batch; a peer that takes nothing for `stall` fails it.
    pub(super) async fn write<W: AsyncWrite + Unpin>(
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
pub(super) async fn within<T>(
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
pub(super) fn encode_head(p: Packet, heads: &mut BytesMut) -> Option<Bytes> {
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
pub(super) fn len_u32(n: usize) -> u32 {
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

pub(super) async fn write_all<W: AsyncWrite + Unpin>(
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
