//! The per-connection queue between a shared stream's receive loop and one
//! tunneled connection's socket. A push either fits the byte budget or is
//! handed back ([`PushError::Full`]); the receive loop then waits for room
//! with [`Room::wait`] for as long as the reader keeps taking bytes, which
//! pauses that one stream (HTTP/2 flow control then holds the sender back)
//! instead of dropping data. Only a reader that takes nothing for the stall
//! deadline ends its connection. The budget is what lets a briefly slow
//! reader never pause the stream at all (see docs/TUNNEL.md, "Head-of-line").

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

/// A `VecDeque` allocates nothing until the first push, so an idle
/// connection's queue costs a few dozen bytes (a channel would allocate a
/// block of slots up front).
struct Shared {
    queued: AtomicUsize,
    aborted: AtomicBool,
    /// The sender is gone (normally or aborted).
    closed: AtomicBool,
    /// The reader is gone.
    reader_gone: AtomicBool,
    items: Mutex<VecDeque<Bytes>>,
    ready: Notify,
    /// The reader took something (or left): room may have appeared.
    drained: Notify,
}

/// The receive loop's end.
pub struct QueueTx {
    shared: Arc<Shared>,
    limit: usize,
}

/// The socket writer's end.
pub struct QueueRx {
    shared: Arc<Shared>,
}

/// A queue with a budget of `limit` bytes.
pub fn queue(limit: usize) -> (QueueTx, QueueRx) {
    let shared = Arc::new(Shared {
        queued: AtomicUsize::new(0),
        aborted: AtomicBool::new(false),
        closed: AtomicBool::new(false),
        reader_gone: AtomicBool::new(false),
        items: Mutex::new(VecDeque::new()),
        ready: Notify::new(),
        drained: Notify::new(),
    });
    (
        QueueTx {
            shared: shared.clone(),
            limit,
        },
        QueueRx { shared },
    )
}

/// Why a push failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushError {
    /// The budget is used up for now; the bytes are handed back so the
    /// caller can wait for [`Room`] and push them again.
    Full(Bytes),
    /// The writer is gone.
    Closed,
}

/// How waiting for room ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// The bytes fit now.
    Room,
    /// The reader took nothing for the whole stall deadline.
    Stalled,
    /// The reader is gone.
    Closed,
}

/// A handle to wait for room in a queue without holding its sender (which
/// lives in a locked table).
pub struct Room {
    shared: Arc<Shared>,
    limit: usize,
}

impl Room {
    /// Waits until `n` more bytes fit the budget (or the queue is empty),
    /// for as long as the reader keeps taking bytes: every chunk it takes
    /// restarts the `stall` deadline.
    pub async fn wait(&self, n: usize, stall: Duration) -> WaitEnd {
        loop {
            let drained = self.shared.drained.notified();
            if self.shared.reader_gone.load(Ordering::Acquire) {
                return WaitEnd::Closed;
            }
            let queued = self.shared.queued.load(Ordering::Acquire);
            if queued == 0 || queued + n <= self.limit {
                return WaitEnd::Room;
            }
            if tokio::time::timeout(stall, drained).await.is_err() {
                return WaitEnd::Stalled;
            }
        }
    }
}

impl QueueTx {
    /// Queues `data` if it fits the budget; never waits.
    pub fn push(&self, data: Bytes) -> Result<(), PushError> {
        if self.shared.reader_gone.load(Ordering::Acquire) {
            return Err(PushError::Closed);
        }
        let n = data.len();
        let before = self.shared.queued.fetch_add(n, Ordering::AcqRel);
        if before + n > self.limit && before > 0 {
            self.shared.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(PushError::Full(data));
        }
        crate::sync::lock(&self.shared.items, "connection queue").push_back(data);
        self.shared.ready.notify_one();
        Ok(())
    }

    /// A handle to wait for room (see [`Room::wait`]).
    pub fn room(&self) -> Room {
        Room {
            shared: self.shared.clone(),
            limit: self.limit,
        }
    }

    /// Ends the connection abnormally: the writer resets instead of
    /// finishing cleanly, after nothing more.
    pub fn abort(self) {
        self.shared.aborted.store(true, Ordering::Release);
    }
}

impl Drop for QueueTx {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.ready.notify_one();
    }
}

impl Drop for QueueRx {
    fn drop(&mut self) {
        self.shared.reader_gone.store(true, Ordering::Release);
        self.shared.drained.notify_one();
    }
}

/// How the writer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PumpEnd {
    /// The sender closed normally and everything was written.
    Finished,
    /// The sender aborted (overflow, agent gone).
    Aborted,
    /// No byte could be written for the stall deadline.
    Stalled,
    /// The socket failed.
    WriteError,
}

/// What [`QueueRx::recv`] got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recv {
    /// Bytes to deliver.
    Data(Bytes),
    /// The sender closed normally; everything was delivered.
    Finished,
    /// The sender aborted (overflow, agent gone).
    Aborted,
}

impl QueueRx {
    /// The next bytes, or how the sender ended.
    pub async fn recv(&mut self) -> Recv {
        loop {
            let notified = self.shared.ready.notified();
            if self.shared.aborted.load(Ordering::Acquire) {
                return Recv::Aborted;
            }
            let item = crate::sync::lock(&self.shared.items, "connection queue").pop_front();
            if let Some(data) = item {
                self.shared.queued.fetch_sub(data.len(), Ordering::AcqRel);
                self.shared.drained.notify_one();
                return Recv::Data(data);
            }
            if self.shared.closed.load(Ordering::Acquire) {
                // Closed after the last push: re-check once for a push that
                // raced with the close.
                let item = crate::sync::lock(&self.shared.items, "connection queue").pop_front();
                return match item {
                    Some(data) => {
                        self.shared.queued.fetch_sub(data.len(), Ordering::AcqRel);
                        Recv::Data(data)
                    }
                    None => Recv::Finished,
                };
            }
            notified.await;
        }
    }

    /// Writes queued bytes to `w` until the sender closes or aborts; with a
    /// `stall` deadline each write must make progress within it (without,
    /// a slow reader just waits: flow control holds the sender back).
    /// `written` is told every chunk written (to return flow-control credit).
    pub async fn pump<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        stall: Option<Duration>,
        mut written: impl FnMut(usize),
    ) -> PumpEnd {
        loop {
            let data = match self.recv().await {
                Recv::Data(d) => d,
                Recv::Finished => return PumpEnd::Finished,
                Recv::Aborted => return PumpEnd::Aborted,
            };
            let write = w.write_all(&data);
            let r = match stall {
                Some(s) => match tokio::time::timeout(s, write).await {
                    Ok(r) => r,
                    Err(_) => return PumpEnd::Stalled,
                },
                None => write.await,
            };
            if r.is_err() {
                return PumpEnd::WriteError;
            }
            written(data.len());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_full_queue_hands_the_bytes_back_and_room_appears_as_the_reader_reads() {
        let (tx, mut rx) = queue(10);
        tx.push(Bytes::from_static(b"0123456789")).unwrap();
        let back = tx.push(Bytes::from_static(b"xy"));
        assert_eq!(back, Err(PushError::Full(Bytes::from_static(b"xy"))));
        let room = tx.room();
        let long = Duration::from_secs(30);
        let (waited, got) = tokio::join!(room.wait(2, long), rx.recv());
        assert_eq!(waited, WaitEnd::Room);
        assert_eq!(got, Recv::Data(Bytes::from_static(b"0123456789")));
        tx.push(Bytes::from_static(b"xy")).unwrap();
        // A reader that takes nothing: the wait ends at the deadline.
        tx.push(Bytes::from_static(b"01234567")).unwrap();
        assert_eq!(
            room.wait(5, Duration::from_millis(20)).await,
            WaitEnd::Stalled
        );
        drop(rx);
        assert_eq!(room.wait(5, long).await, WaitEnd::Closed);
    }

    #[tokio::test]
    async fn push_fails_past_the_budget_and_the_writer_sees_an_abort() {
        let (tx, mut rx) = queue(10);
        tx.push(Bytes::from_static(b"0123456789")).unwrap();
        assert!(matches!(
            tx.push(Bytes::from_static(b"x")),
            Err(PushError::Full(_))
        ));
        // A single message larger than the budget passes when nothing is queued.
        let (big_tx, _big_rx) = queue(4);
        big_tx.push(Bytes::from_static(b"too large")).unwrap();
        tx.abort();
        let mut out = Vec::new();
        assert_eq!(
            rx.pump(&mut out, Some(Duration::from_secs(1)), |_| {})
                .await,
            PumpEnd::Aborted
        );
    }

    #[tokio::test]
    async fn a_clean_close_writes_everything() {
        let (tx, mut rx) = queue(100);
        tx.push(Bytes::from_static(b"ab")).unwrap();
        tx.push(Bytes::from_static(b"cd")).unwrap();
        drop(tx);
        let mut out = Vec::new();
        assert_eq!(
            rx.pump(&mut out, Some(Duration::from_secs(1)), |_| {})
                .await,
            PumpEnd::Finished
        );
        assert_eq!(out, b"abcd");
    }

    #[tokio::test]
    async fn a_reader_that_never_reads_is_a_stall() {
        let (tx, mut rx) = queue(1 << 20);
        let (mut w, _r) = tokio::io::duplex(4);
        tx.push(Bytes::from(vec![0u8; 64])).unwrap();
        assert_eq!(
            rx.pump(&mut w, Some(Duration::from_millis(50)), |_| {})
                .await,
            PumpEnd::Stalled
        );
    }
}
