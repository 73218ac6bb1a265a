//! The record layer after the handshake: each record's header checked
//! before its body is awaited, opened in place, post-handshake messages
//! (tickets, key updates) and alerts handled, writes sealed in batches.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use rustls::crypto::cipher::{InboundOpaqueMessage, OutboundChunks, OutboundPlainMessage};
use rustls::pki_types::CertificateDer;
use rustls::{ContentType, ProtocolVersion};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::state::*;

impl<IO> UserTls<IO> {
    /// What the handshake agreed.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The peer's certificate chain, moved out (not kept twice).
    pub fn take_peer_certificates(&mut self) -> Vec<CertificateDer<'static>> {
        std::mem::take(&mut self.session.peer_certificates)
    }

    /// Records the first fatal error and returns it.
    pub(super) fn fail(&mut self, e: io::Error) -> io::Error {
        if self.failed.is_none() {
            self.failed = Some((e.kind(), e.to_string()));
        }
        e
    }

    pub(super) fn failed(&self) -> Option<io::Error> {
        self.failed
            .as_ref()
            .map(|(k, m)| io::Error::new(*k, m.clone()))
    }

    /// Decrypts the next whole record in the buffer, if there is one:
    /// `Ok(true)` when one was handled. Its plaintext, if application
    /// data, is left at the front of the buffer (`plain`).
    pub(super) fn open_record(&mut self) -> io::Result<bool> {
        self.rbuf.advance(self.raw);
        self.raw = 0;
        let avail = &self.rbuf[..];
        if avail.len() < HEADER {
            return Ok(false);
        }
        let len = usize::from(u16::from_be_bytes([avail[3], avail[4]]));
        if avail[0] != u8::from(ContentType::ApplicationData) {
            return Err(bad(format!("unexpected record type {}", avail[0])));
        }
        if avail[1..3] != [3, 3] {
            return Err(bad("unexpected record version"));
        }
        if len > MAX_CIPHERTEXT {
            return Err(bad(format!("record of {len} bytes is oversized")));
        }
        if avail.len() < HEADER + len {
            return Ok(false);
        }
        let end = HEADER + len;
        let base = self.rbuf.as_ptr() as usize;
        let msg = InboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            &mut self.rbuf[HEADER..end],
        );
        let msg = self.dec.decrypt(msg, self.rx_seq).map_err(tls_error)?;
        self.rx_seq += 1;
        let typ = msg.typ;
        let n = msg.payload.len();
        let at = (msg.payload.as_ptr() as usize)
            .checked_sub(base)
            .unwrap_or(usize::MAX);
        if at < HEADER || at.saturating_add(n) > end {
            return Err(bad("decrypted record out of place"));
        }
        match typ {
            ContentType::ApplicationData if self.hs.is_empty() => {
                if n > 0 {
                    self.key_updates_in_a_row = 0;
                }
                // Handed on in place, from the front.
                self.rbuf.advance(at);
                self.plain = n;
                self.raw = end - at;
                Ok(true)
            }
            ContentType::Handshake if n > 0 => {
                if self.hs.len() + n > MAX_HANDSHAKE_MESSAGE {
                    return Err(bad("post-handshake message too large"));
                }
                self.hs.extend_from_slice(&self.rbuf[at..at + n]);
                self.raw = end;
                self.handshake_messages()?;
                Ok(true)
            }
            ContentType::Alert if self.hs.is_empty() => {
                match &self.rbuf[at..at + n] {
                    [_, CLOSE_NOTIFY] => self.read_closed = true,
                    [1, USER_CANCELED] => {}
                    [_, d] => return Err(bad(format!("peer sent alert {d}"))),
                    _ => return Err(bad("malformed alert")),
                }
                self.raw = end;
                Ok(true)
            }
            _ => Err(bad(format!("unexpected content type {typ:?} ({n} bytes)"))),
        }
    }

    /// Handles the complete handshake messages held in `hs`.
    pub(super) fn handshake_messages(&mut self) -> io::Result<()> {
        while self.hs.len() >= 4 {
            let len = usize::from(self.hs[1]) << 16
                | usize::from(self.hs[2]) << 8
                | usize::from(self.hs[3]);
            if 4 + len > MAX_HANDSHAKE_MESSAGE {
                return Err(bad("post-handshake message too large"));
            }
            if self.hs.len() < 4 + len {
                break;
            }
            let rest = self.hs.len() - 4 - len;
            match self.hs[0] {
                NEW_SESSION_TICKET => {
                    let body = self.hs[4..4 + len].to_vec();
                    self.kernel.ticket(&body)?;
                }
                KEY_UPDATE => {
                    // RFC 8446 §5.1: a key change ends its record.
                    let request = match (&self.hs[4..4 + len], rest) {
                        ([r @ (0 | 1)], 0) => *r == 1,
                        (_, 0) => return Err(bad("malformed key update")),
                        _ => return Err(bad("key update not at a record boundary")),
                    };
                    self.key_updates_in_a_row += 1;
                    if self.key_updates_in_a_row > MAX_KEY_UPDATES_IN_A_ROW {
                        return Err(bad("too many key updates in a row"));
                    }
                    let (key, iv) = key_iv(self.kernel.next_rx().map_err(tls_error)?)?;
                    self.dec = self.aead.decrypter(key, iv);
                    self.rx_seq = 0;
                    // Owed before our next record (RFC 8446 §4.6.3); many
                    // requests owe one update.
                    self.key_update_owed |= request && !self.close_sent;
                }
                t => return Err(bad(format!("unexpected handshake message {t}"))),
            }
            self.hs.drain(..4 + len);
        }
        if self.hs.is_empty() {
            self.hs = Vec::new();
        }
        Ok(())
    }

    /// Seals `data` into records of type `typ` on the write queue.
    pub(super) fn seal(&mut self, typ: ContentType, data: OutboundChunks<'_>) -> io::Result<()> {
        self.pay_key_update()?;
        let mut rest = data;
        loop {
            if self.tx_seq >= self.tx_limit {
                self.update_tx_key()?;
            }
            let (head, tail) = rest.split_at(MAX_PLAINTEXT);
            let msg = OutboundPlainMessage {
                typ,
                version: ProtocolVersion::TLSv1_2,
                payload: head,
            };
            let rec = self.enc.encrypt(msg, self.tx_seq).map_err(tls_error)?;
            self.tx_seq += 1;
            let rec = rec.encode();
            self.wq_len += rec.len();
            self.wq.push_back(rec);
            if tail.is_empty() {
                return Ok(());
            }
            rest = tail;
        }
    }

    /// Sends the key update the peer asked for, if one is owed.
    pub(super) fn pay_key_update(&mut self) -> io::Result<()> {
        if std::mem::take(&mut self.key_update_owed) {
            self.update_tx_key()?;
        }
        Ok(())
    }

    /// Sends a KeyUpdate (not asking for one back) under the current key,
    /// then switches to the next.
    pub(super) fn update_tx_key(&mut self) -> io::Result<()> {
        let msg = OutboundPlainMessage {
            typ: ContentType::Handshake,
            version: ProtocolVersion::TLSv1_2,
            payload: OutboundChunks::Single(&[KEY_UPDATE, 0, 0, 1, 0]),
        };
        let rec = self.enc.encrypt(msg, self.tx_seq).map_err(tls_error)?;
        let rec = rec.encode();
        self.wq_len += rec.len();
        self.wq.push_back(rec);
        let (key, iv) = key_iv(self.kernel.next_tx().map_err(tls_error)?)?;
        self.enc = self.aead.encrypter(key, iv);
        self.tx_seq = 0;
        Ok(())
    }
}

impl<IO: AsyncWrite + Unpin> UserTls<IO> {
    /// Writes the queue out until it is empty.
    pub(super) fn poll_write_queue(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.wq.is_empty() {
            let mut slices = [io::IoSlice::new(&[]); WRITE_BATCH];
            let mut k = 0;
            for (i, rec) in self.wq.iter().take(WRITE_BATCH).enumerate() {
                let from = if i == 0 { self.wq_off } else { 0 };
                slices[i] = io::IoSlice::new(&rec[from..]);
                k = i + 1;
            }
            let n = match Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..k]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            self.wq_len -= n;
            let mut n = n + self.wq_off;
            self.wq_off = 0;
            while let Some(front) = self.wq.front() {
                if n < front.len() {
                    self.wq_off = n;
                    break;
                }
                n -= front.len();
                self.wq.pop_front();
            }
        }
        self.wq = VecDeque::new();
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for UserTls<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(e) = this.failed() {
            return Poll::Ready(Err(e));
        }
        let mut budget = RECORDS_PER_POLL;
        loop {
            if this.plain > 0 {
                let n = out.remaining().min(this.plain);
                out.put_slice(&this.rbuf[..n]);
                this.rbuf.advance(n);
                this.plain -= n;
                this.raw -= n;
                return Poll::Ready(Ok(()));
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            match this.open_record() {
                Ok(true) => {
                    budget -= 1;
                    if budget == 0 && this.plain == 0 {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    continue;
                }
                Ok(false) => {}
                Err(e) => return Poll::Ready(Err(this.fail(e))),
            }
            // Need more: room for a whole record after the partial one
            // (`reserve` moves it to the front when that is enough).
            if this.rbuf.capacity() == 0 {
                this.rbuf = BytesMut::with_capacity(READ_CHUNK + HEADER + MAX_CIPHERTEXT);
            } else if this.rbuf.capacity() - this.rbuf.len() < HEADER + MAX_CIPHERTEXT {
                this.rbuf.reserve(HEADER + MAX_CIPHERTEXT);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.io), cx, &mut this.rbuf) {
                // An end without close_notify: an error, as from rustls's
                // reader, but not a protocol error (not kept).
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed the connection without close_notify",
                    )));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if this.rbuf.is_empty() {
                        // Idle: keep no buffer.
                        this.rbuf = BytesMut::new();
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for UserTls<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if let Some(e) = this.failed() {
            return Poll::Ready(Err(e));
        }
        if this.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if this.wq_len >= WRITE_QUEUE {
            match this.poll_write_queue(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if this.wq_len >= WRITE_QUEUE => return Poll::Pending,
                Poll::Pending => {}
            }
        }
        let mut room = WRITE_QUEUE - this.wq_len;
        let mut chunks: Vec<&[u8]> = Vec::with_capacity(bufs.len());
        for b in bufs {
            if room == 0 {
                break;
            }
            let take = b.len().min(room);
            if take > 0 {
                chunks.push(&b[..take]);
                room -= take;
            }
        }
        let total: usize = chunks.iter().map(|c| c.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        if let Err(e) = this.seal(ContentType::ApplicationData, OutboundChunks::new(&chunks)) {
            return Poll::Ready(Err(this.fail(e)));
        }
        // Out now if the socket takes it; an error shows on the next call
        // (these bytes are taken: the socket's error repeats).
        let _ = this.poll_write_queue(cx);
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.failed.is_none() && !this.close_sent {
            if let Err(e) = this.pay_key_update() {
                return Poll::Ready(Err(this.fail(e)));
            }
        }
        match this.poll_write_queue(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.io).poll_flush(cx),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.close_sent && this.failed.is_none() {
            this.close_sent = true;
            let alert = [1u8, CLOSE_NOTIFY];
            if let Err(e) = this.seal(ContentType::Alert, OutboundChunks::Single(&alert)) {
                return Poll::Ready(Err(this.fail(e)));
            }
        }
        match this.poll_write_queue(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.io).poll_shutdown(cx),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}
