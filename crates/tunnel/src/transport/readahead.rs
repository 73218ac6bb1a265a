//! Reads ahead under TLS. rustls asks its transport for at most 4 KiB per
//! read (its deframer's fixed `READ_SIZE`), so a 16 KiB record costs four
//! `read` system calls and a gigabyte a quarter of a million. This wrapper
//! reads up to [`CHUNK`] at a time and serves rustls's small reads from
//! memory: one copy of the ciphertext instead of most of the system calls
//! (docs/PERFORMANCE.md, issue 28). Its buffer exists only while it holds
//! unread bytes, so an idle connection keeps none.
//!
//! Hand-written: tokio's `BufReader` keeps its buffer for the life of the
//! connection, which an idle agent stream must not.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most read at once.
pub const CHUNK: usize = 64 * 1024;

/// A reader that fetches up to [`CHUNK`] per system call.
#[derive(Debug)]
pub struct ReadAhead<IO> {
    io: IO,
    /// Bytes read and not yet handed on. Empty: no buffer.
    buf: BytesMut,
}

impl<IO> ReadAhead<IO> {
    /// Wraps `io`.
    pub fn new(io: IO) -> ReadAhead<IO> {
        ReadAhead {
            io,
            buf: BytesMut::new(),
        }
    }

    /// Bytes held and not yet read.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Hands on what is held; frees the buffer once it is all read.
    fn hand_on(&mut self, out: &mut ReadBuf<'_>) {
        let n = out.remaining().min(self.buffered());
        out.put_slice(&self.buf[..n]);
        self.buf.advance(n);
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for ReadAhead<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.buffered() > 0 {
            me.hand_on(out);
            return Poll::Ready(Ok(()));
        }
        // A large read gains nothing from a copy.
        if out.remaining() >= CHUNK / 2 {
            return Pin::new(&mut me.io).poll_read(cx, out);
        }
        // Into uninitialised capacity (no zeroing); freed again if nothing
        // came.
        let mut chunk = BytesMut::with_capacity(CHUNK);
        match tokio_util::io::poll_read_buf(Pin::new(&mut me.io), cx, &mut chunk) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    me.buf = chunk;
                    me.hand_on(out);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for ReadAhead<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn small_reads_come_from_one_chunk_and_the_buffer_goes_when_read() {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        a.write_all(&data).await.unwrap();
        drop(a);
        let mut r = ReadAhead::new(b);
        let mut got = Vec::new();
        let mut small = [0u8; 4096];
        loop {
            let n = r.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&small[..n]);
            if r.buffered() == 0 {
                assert_eq!(r.buf.capacity(), 0, "an emptied buffer is freed");
            }
        }
        assert_eq!(got, data);
    }

    #[tokio::test]
    async fn a_large_read_goes_straight_through() {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        a.write_all(&[7u8; 50_000]).await.unwrap();
        let mut r = ReadAhead::new(b);
        let mut big = vec![0u8; CHUNK];
        let n = r.read(&mut big).await.unwrap();
        assert!(n > 0);
        assert_eq!(r.buffered(), 0);
        assert_eq!(r.buf.capacity(), 0);
    }
}
