//! The per-connection queue between a shared stream's receive loop and one
//! tunneled connection's socket. A push either fits the byte budget or is
//! handed back ([`PushError::Full`]); the receive loop then waits for room
//! with [`Room::step`] for as long as the reader keeps taking bytes, which
//! pauses that one stream (HTTP/2 flow control then holds the sender back)
//! instead of dropping data. Only a reader that takes nothing for the stall
//! deadline ends its connection (the link machines keep that deadline; each
//! [`Step::Progress`] restarts it). The budget is what lets a briefly slow
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
    /// Shared with the other connections of the same cluster.
    budget: Option<Budget>,
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

/// The largest message an empty queue takes past its shared [`Budget`]:
/// every connection keeps moving (none waits on another's reader), and
/// what the exemption can hold is bounded by connections × this, not by
/// connections × the largest message.
pub const EXEMPT: usize = 64 * 1024;

/// Bytes queued across several queues (one cluster's connections), with
/// a cap that may change (0: none). A queue takes bytes only within it,
/// except that an empty queue always takes one message of up to
/// [`EXEMPT`] bytes. Reservations are atomic, so concurrent receive loops
/// (one per agent stream) cannot overshoot the cap together.
#[derive(Clone, Debug, Default)]
pub struct Budget {
    used: Arc<AtomicUsize>,
    limit: Arc<AtomicUsize>,
    /// Queues waiting for room in the budget (only then is `freed` told).
    waiting: Arc<AtomicUsize>,
    freed: Arc<Notify>,
}

impl Budget {
    /// A budget of `limit` bytes (0: unlimited).
    pub fn new(limit: usize) -> Budget {
        Budget {
            used: Arc::new(AtomicUsize::new(0)),
            limit: Arc::new(AtomicUsize::new(limit)),
            waiting: Arc::new(AtomicUsize::new(0)),
            freed: Arc::new(Notify::new()),
        }
    }

    /// Reserves `n` bytes if they fit (or `exempt`); whether they did.
    fn reserve(&self, n: usize, exempt: bool) -> bool {
        let limit = self.limit.load(Ordering::Acquire);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (exempt || limit == 0 || u.saturating_add(n) <= limit).then_some(u + n)
            })
            .is_ok()
    }

    /// Gives `n` bytes back.
    fn release(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Changes the cap; bytes queued stay.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Release);
    }

    /// Bytes queued now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    fn fits(&self, n: usize) -> bool {
        let limit = self.limit.load(Ordering::Acquire);
        limit == 0 || self.used().saturating_add(n) <= limit
    }
}

impl Shared {
    fn took(&self, n: usize) {
        self.queued.fetch_sub(n, Ordering::AcqRel);
        if let Some(b) = &self.budget {
            b.release(n);
        }
    }

    /// Whether `n` more bytes would be taken now: within this queue's own
    /// `limit` (an empty queue takes any one message) and within the
    /// shared budget (an empty queue takes one of up to [`EXEMPT`]).
    fn room_for(&self, n: usize, limit: usize) -> bool {
        let queued = self.queued.load(Ordering::Acquire);
        let own = queued == 0 || queued.saturating_add(n) <= limit;
        own && self
            .budget
            .as_ref()
            .is_none_or(|b| b.fits(n) || (queued == 0 && n <= EXEMPT))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Bytes never taken leave the shared budget with their queue.
        if let Some(b) = &self.budget {
            b.release(*self.queued.get_mut());
        }
    }
}

/// Counts a waiter while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(n: &'a AtomicUsize) -> Waiting<'a> {
        n.fetch_add(1, Ordering::AcqRel);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
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
    queue_within(limit, None)
}

/// A queue with a budget of `limit` bytes of its own, within `budget`
/// shared with other queues.
pub fn queue_within(limit: usize, budget: Option<Budget>) -> (QueueTx, QueueRx) {
    let shared = Arc::new(Shared {
        queued: AtomicUsize::new(0),
        budget,
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

/// What one look at a queue's room saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The bytes fit now.
    Room,
    /// Something changed (the reader took bytes, or the shared budget
    /// moved) but the bytes do not fit yet.
    Progress,
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
    /// [`Step::Room`] or [`Step::Closed`] at once if so; else waits for the
    /// reader to take bytes (or the shared budget to move, other
    /// connections' readers taking bytes) and says so with
    /// [`Step::Progress`]. No deadline: the caller's timer decides when a
    /// reader that makes no progress has stalled.
    pub async fn step(&self, n: usize) -> Step {
        // Counted while waiting, so that budget releases tell it.
        let budget = self.shared.budget.as_ref();
        let _waiting = budget.map(|b| Waiting::new(&b.waiting));
        let drained = self.shared.drained.notified();
        let freed = budget.map(|b| b.freed.notified());
        if self.shared.reader_gone.load(Ordering::Acquire) {
            return Step::Closed;
        }
        if self.shared.room_for(n, self.limit) {
            return Step::Room;
        }
        match freed {
            Some(f) => tokio::select! { () = drained => {}, () = f => {} },
            None => drained.await,
        }
        Step::Progress
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
        let own = before == 0 || before.saturating_add(n) <= self.limit;
        let fits = own
            && self
                .shared
                .budget
                .as_ref()
                .is_none_or(|b| b.reserve(n, before == 0 && n <= EXEMPT));
        if !fits {
            self.shared.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(PushError::Full(data));
        }
        seedlink_net::sync::lock(&self.shared.items, "connection queue").push_back(data);
        self.shared.ready.notify_one();
        Ok(())
    }

    /// Whether `n` more bytes would pass this queue's own limit (not the
    /// shared budget); a first chunk always fits, as in [`QueueTx::push`].
    pub fn over_own_limit(&self, n: usize) -> bool {
        let queued = self.shared.queued.load(Ordering::Acquire);
        queued > 0 && queued.saturating_add(n) > self.limit
    }

    /// A handle to wait for room (see [`Room::step`]).
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
            let item = seedlink_net::sync::lock(&self.shared.items, "connection queue").pop_front();
            if let Some(data) = item {
                self.shared.took(data.len());
                self.shared.drained.notify_one();
                return Recv::Data(data);
            }
            if self.shared.closed.load(Ordering::Acquire) {
                // Closed after the last push: re-check once for a push that
                // raced with the close.
                let item =
                    seedlink_net::sync::lock(&self.shared.items, "connection queue").pop_front();
                return match item {
                    Some(data) => {
                        self.shared.took(data.len());
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
    use futures_util::FutureExt;

    use super::*;

    /// Steps until room or the reader's end.
    async fn until_room(room: &Room, n: usize) -> Step {
        loop {
            match room.step(n).await {
                Step::Progress => continue,
                end => return end,
            }
        }
    }

    /// Queues sharing a budget: a queue holding bytes takes more only
    /// within the shared cap (and its own); an empty queue always takes one
    /// push, so no connection waits on another's reader; bytes taken, or
    /// left in a dropped queue, go back to the budget.
    #[tokio::test]
    async fn queues_share_a_cluster_budget() {
        let budget = Budget::new(100);
        let (a, mut ra) = queue_within(1000, Some(budget.clone()));
        let (b, rb) = queue_within(1000, Some(budget.clone()));
        let chunk = |n: usize| Bytes::from(vec![0u8; n]);
        a.push(chunk(60)).unwrap();
        assert!(matches!(a.push(chunk(60)), Err(PushError::Full(_))));
        // b is empty: one push always fits, even past the shared cap.
        b.push(chunk(60)).unwrap();
        assert_eq!(budget.used(), 120);
        assert!(matches!(b.push(chunk(1)), Err(PushError::Full(_))));
        assert!(matches!(ra.recv().await, Recv::Data(d) if d.len() == 60));
        assert_eq!(budget.used(), 60);
        assert_eq!(a.room().step(30).await, Step::Room);
        a.push(chunk(30)).unwrap();
        assert!(matches!(a.push(chunk(20)), Err(PushError::Full(_))));
        // b's reader leaves with 60 bytes queued: they leave the budget.
        drop(rb);
        drop(b);
        assert_eq!(budget.used(), 30);
        a.push(chunk(20)).unwrap();
        budget.set_limit(0);
        a.push(chunk(500)).unwrap();
        assert_eq!(budget.used(), 550);
    }

    /// An empty queue's exemption covers one message of up to `EXEMPT`
    /// bytes only; a bigger one waits until other readers free the budget,
    /// and their progress wakes it.
    #[tokio::test]
    async fn a_big_message_waits_for_the_shared_budget() {
        let budget = Budget::new(EXEMPT);
        let chunk = |n: usize| Bytes::from(vec![0u8; n]);
        let (a, mut ra) = queue_within(4 * EXEMPT, Some(budget.clone()));
        let (b, _rb) = queue_within(4 * EXEMPT, Some(budget.clone()));
        a.push(chunk(EXEMPT)).unwrap();
        let big = chunk(2 * EXEMPT);
        assert!(matches!(b.push(big.clone()), Err(PushError::Full(_))));
        let room = b.room();
        let waiter = tokio::spawn(async move { until_room(&room, 2 * EXEMPT).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        budget.set_limit(4 * EXEMPT);
        assert!(matches!(ra.recv().await, Recv::Data(_)));
        assert_eq!(waiter.await.unwrap(), Step::Room);
        b.push(big).unwrap();
        assert_eq!(budget.used(), 2 * EXEMPT);
    }

    #[tokio::test]
    async fn a_full_queue_hands_the_bytes_back_and_room_appears_as_the_reader_reads() {
        let (tx, mut rx) = queue(10);
        tx.push(Bytes::from_static(b"0123456789")).unwrap();
        let back = tx.push(Bytes::from_static(b"xy"));
        assert_eq!(back, Err(PushError::Full(Bytes::from_static(b"xy"))));
        let room = tx.room();
        let (waited, got) = tokio::join!(until_room(&room, 2), rx.recv());
        assert_eq!(waited, Step::Room);
        assert_eq!(got, Recv::Data(Bytes::from_static(b"0123456789")));
        tx.push(Bytes::from_static(b"xy")).unwrap();
        // A reader that takes nothing: no progress to report (the stall
        // deadline is the link machine's).
        tx.push(Bytes::from_static(b"01234567")).unwrap();
        assert_eq!(room.step(5).now_or_never(), None);
        // It takes a chunk: progress, and room once enough is taken.
        let (step, _) = tokio::join!(room.step(5), rx.recv());
        assert!(matches!(step, Step::Progress | Step::Room), "{step:?}");
        drop(rx);
        assert_eq!(room.step(5).await, Step::Closed);
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
