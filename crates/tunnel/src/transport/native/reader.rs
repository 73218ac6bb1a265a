//! The reader: frames into packets, PING answered, and the keepalive that
//! fails a stream whose peer went silent.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::Stream;
use prost::Message;
use tokio::io::AsyncRead;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

use crate::wire::proto::Packet;

use super::frame::*;
use super::writer::Control;

/// Packets from the peer, as a stream; PINGs are answered, and the
/// keepalive is kept: after `every` without a byte from the peer a PING
/// goes out, and after `timeout` more the stream fails. Ends at a clean
/// end of the connection.
pub struct Inbound<R> {
    pub(super) rd: R,
    pub(super) head: [u8; HEAD],
    pub(super) have: usize,
    /// The frame being read: its type, its length, what came so far.
    pub(super) body: Option<(u8, usize, BytesMut)>,
    pub(super) ctl: Arc<Control>,
    pub(super) writer_gone: Pin<Box<WaitForCancellationFutureOwned>>,
    pub(super) every: Duration,
    pub(super) timeout: Duration,
    pub(super) heard: Instant,
    /// When a PING went out with nothing heard since.
    pub(super) pinged: Option<std::time::Instant>,
    pub(super) timer: Pin<Box<Sleep>>,
    pub(super) done: bool,
    /// PINGs and PONGs move nothing: a stream may send so many.
    pub(super) idle: crate::stream::flood::Budget,
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
    pub(super) fn poll_some(
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
    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<(u8, Bytes)>, WireError>> {
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
    pub(super) fn poll_keepalive(&mut self, cx: &mut Context<'_>) -> Poll<WireError> {
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

    pub(super) fn writer_failure(&self) -> WireError {
        let why = seedlink_net::sync::lock(&self.ctl.failed, "native control").clone();
        WireError::Writer(why.unwrap_or_default())
    }
}

/// What the keepalive does at `now`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Keep {
    /// Nothing yet; look again then.
    Wait(std::time::Instant),
    /// Send a PING; look again then.
    Ping(std::time::Instant),
    /// Nothing heard for the interval and the timeout after the PING.
    Dead,
}

/// The keepalive's decision at `now`: last `heard` from the peer, when a
/// PING went out since (`pinged`).
pub(super) fn keepalive(
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
