//! A transport that shows every read to an observer: the agent follows the
//! server's HTTP/2 frames for GOAWAY codes ([`crate::transport::goaway`]), the server
//! stamps each agent connection's last read ([`crate::server::activity`]).
//! Writes pass through untouched. Hand-written: a dozen lines of
//! delegation, and no crate offers a read observer for tokio's traits.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Sees the bytes of every read that returned some.
pub trait OnRead {
    /// `bytes`: what this read added (never empty).
    fn on_read(&mut self, bytes: &[u8]);
}

/// `inner` with its reads shown to `observer`.
pub struct ReadTap<T, O> {
    inner: T,
    observer: O,
}

impl<T, O> ReadTap<T, O> {
    /// Wraps `inner`.
    pub fn new(inner: T, observer: O) -> ReadTap<T, O> {
        ReadTap { inner, observer }
    }
}

impl<T: AsyncRead + Unpin, O: OnRead + Unpin> AsyncRead for ReadTap<T, O> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let me = &mut *self;
        let r = Pin::new(&mut me.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            me.observer.on_read(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin, O: Unpin> AsyncWrite for ReadTap<T, O> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
