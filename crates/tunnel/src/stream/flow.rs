//! How a tunneled connection's bytes move through a shared agent stream,
//! in three parts, each bounded:
//!
//! - **The send window** ([`SendCredit`], [`Unacked`]): per-connection flow
//!   control between seedlink components, negotiated on top of the
//!   Konnectivity protocol. The agent asks with the request header
//!   `seedlink-flow-control: v1`, the server agrees with the same response
//!   header, and from then on both sides send a connection's DATA only
//!   within a window of [`WINDOW`] bytes that the receiver reopens with
//!   WINDOW_UPDATE packets (a seedlink extension, type 100) after writing
//!   the bytes to its socket. A reader that stops reading then holds back
//!   only its own connection, end to end, and nothing is lost or closed;
//!   upstream Konnectivity peers never see the header or the packet.
//! - **The receive queue** ([`queue`], [`QueueTx`], [`QueueRx`]): between a
//!   stream's receive loop and one connection's socket. A push either fits
//!   the byte budget or is handed back ([`PushError::Full`]); the receive
//!   loop then waits for room with [`Room::step`] for as long as the reader
//!   keeps taking bytes, which pauses that one stream (HTTP/2 flow control
//!   then holds the sender back) instead of dropping data. Only a reader
//!   that takes nothing for the stall deadline ends its connection (the
//!   link machines keep that deadline; each [`Step::Progress`] restarts
//!   it). The budget is what lets a briefly slow reader never pause the
//!   stream at all (see docs/TUNNEL.md, "Head-of-line").
//! - **The stream's send queue** ([`FairQueue`]): control packets go first,
//!   then DATA packets round-robin across connections, so a connection with
//!   a lot to send cannot queue megabytes ahead of another connection's
//!   single packet. Each connection may have only a few packets waiting;
//!   its sender waits for room (backpressure to that connection's socket
//!   only).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};

use crate::wire::proto::Packet;

/// Header (request and response) that enables flow control.
pub const HEADER: &str = "seedlink-flow-control";
/// Its value.
pub const VERSION: &str = "v1";
/// Bytes a sender may have unacknowledged per connection and direction
/// (measured on loopback: 256 KiB held one download to ≈ 2.4 Gbit/s, 2 MiB
/// reached ≈ 3.4). Memory is only used while a reader lags.
pub const WINDOW: usize = 2 * 1024 * 1024;
/// Credit is returned once this much was written (a quarter window).
pub const RETURN_AT: usize = WINDOW / 4;

/// The sending side's credit for one connection.
#[derive(Clone)]
pub struct SendCredit(Arc<Semaphore>);

impl Default for SendCredit {
    fn default() -> Self {
        SendCredit::new()
    }
}

impl SendCredit {
    /// A full window.
    pub fn new() -> SendCredit {
        SendCredit(Arc::new(Semaphore::new(WINDOW)))
    }

    /// Waits for `n` bytes of window (n ≤ [`WINDOW`]) and uses them. Fails
    /// when the connection is closed.
    pub async fn take(&self, n: usize) -> Result<(), ()> {
        let n = u32::try_from(n.min(WINDOW)).map_err(|_| ())?;
        let p = self.0.acquire_many(n).await.map_err(|_| ())?;
        p.forget();
        Ok(())
    }

    /// The receiver reopened `n` bytes. More than a window outstanding is a
    /// protocol error (`false`).
    pub fn give(&self, n: i64) -> bool {
        let Ok(n) = usize::try_from(n) else {
            return false;
        };
        if n == 0 || self.0.available_permits() + n > WINDOW {
            return false;
        }
        self.0.add_permits(n);
        true
    }

    /// Wakes a waiting sender with an error (the connection is gone).
    pub fn close(&self) {
        self.0.close();
    }
}

/// The receiving side's count of bytes written but not yet acknowledged.
#[derive(Default)]
pub struct Unacked(usize);

impl Unacked {
    /// `n` more bytes were written; returns the credit to send back now, if
    /// enough has gathered.
    pub fn written(&mut self, n: usize) -> Option<i64> {
        self.0 += n;
        if self.0 >= RETURN_AT {
            let v = i64::try_from(self.0).unwrap_or(i64::MAX);
            self.0 = 0;
            Some(v)
        } else {
            None
        }
    }
}

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

/// DATA packets a connection may have waiting.
const PER_CONN: usize = 4;
/// Control packets that may wait (a few MiB at most). A peer that makes
/// this side queue more — answers to packets for unknown connections while
/// it reads nothing — overflows the queue, which ends the stream: that peer
/// alone is cut off, never the process's memory.
pub const MAX_CONTROL: usize = 64 * 1024;

#[derive(Default)]
struct Inner {
    control: VecDeque<Packet>,
    conns: HashMap<i64, ConnQ>,
    ring: VecDeque<i64>,
    closed: bool,
    /// Closed because the control queue overflowed.
    overflowed: bool,
}

impl Inner {
    /// Queues a control packet; at [`MAX_CONTROL`] the queue closes as
    /// overflowed instead.
    fn push_control(&mut self, p: Packet) -> Result<(), Closed> {
        if self.control.len() >= MAX_CONTROL {
            self.overflowed = true;
            self.shut();
            return Err(Closed);
        }
        self.control.push_back(p);
        Ok(())
    }

    fn shut(&mut self) {
        self.closed = true;
        for (_, c) in self.conns.drain() {
            c.room.close();
        }
        self.ring.clear();
        self.control.clear();
    }
}

struct ConnQ {
    packets: VecDeque<Packet>,
    room: Arc<Semaphore>,
    /// Closed: removed once its last packet is sent; no new DATA.
    finishing: bool,
}

/// The queue; cheap to share.
#[derive(Default)]
pub struct FairQueue {
    inner: Mutex<Inner>,
    ready: Notify,
}

/// The stream is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

impl FairQueue {
    /// A new, open queue.
    pub fn new() -> Arc<FairQueue> {
        Arc::new(FairQueue::default())
    }

    /// Queues a control packet (dial, close, window update); never waits.
    pub fn control(&self, p: Packet) -> Result<(), Closed> {
        let mut g = seedlink_net::sync::lock(&self.inner, "fair queue");
        if g.closed {
            return Err(Closed);
        }
        let r = g.push_control(p);
        drop(g);
        self.ready.notify_waiters();
        self.ready.notify_one();
        r
    }

    /// Whether the queue was closed because its peer made it queue more
    /// than [`MAX_CONTROL`] control packets.
    pub fn overflowed(&self) -> bool {
        seedlink_net::sync::lock(&self.inner, "fair queue").overflowed
    }

    fn room_for(&self, id: i64) -> Result<Arc<Semaphore>, Closed> {
        let mut g = seedlink_net::sync::lock(&self.inner, "fair queue");
        if g.closed {
            return Err(Closed);
        }
        Ok(g.conns
            .entry(id)
            .or_insert_with(|| ConnQ {
                packets: VecDeque::new(),
                room: Arc::new(Semaphore::new(PER_CONN)),
                finishing: false,
            })
            .room
            .clone())
    }

    /// Queues a DATA packet of connection `id`, waiting while that
    /// connection already has [`PER_CONN`] packets waiting.
    pub async fn data(&self, id: i64, p: Packet) -> Result<(), Closed> {
        let room = self.room_for(id)?;
        let permit = room.acquire().await.map_err(|_| Closed)?;
        permit.forget();
        let mut g = seedlink_net::sync::lock(&self.inner, "fair queue");
        if g.closed {
            return Err(Closed);
        }
        let Some(c) = g.conns.get_mut(&id).filter(|c| !c.finishing) else {
            // Closed meanwhile: the data goes nowhere.
            return Ok(());
        };
        c.packets.push_back(p);
        if c.packets.len() == 1 {
            g.ring.push_back(id);
        }
        drop(g);
        self.ready.notify_one();
        Ok(())
    }

    /// Ends connection `id` on this stream: `last` (its CLOSE packet) is
    /// sent after the DATA it already queued, never before; then the
    /// connection's entry is removed. Without `last` only the entry goes.
    pub fn finish(&self, id: i64, last: Option<Packet>) {
        let mut g = seedlink_net::sync::lock(&self.inner, "fair queue");
        if g.closed {
            return;
        }
        match g.conns.get_mut(&id) {
            Some(c) if !c.packets.is_empty() => {
                c.packets.extend(last);
                c.finishing = true;
            }
            _ => {
                if let Some(c) = g.conns.remove(&id) {
                    c.room.close();
                }
                if let Some(p) = last {
                    let _ = g.push_control(p);
                }
            }
        }
        drop(g);
        self.ready.notify_one();
    }

    /// Connections with an entry (for leak checks).
    pub fn conn_entries(&self) -> usize {
        seedlink_net::sync::lock(&self.inner, "fair queue")
            .conns
            .len()
    }

    /// Ends the queue: senders fail, [`FairQueue::next`] returns `None`.
    pub fn close(&self) {
        seedlink_net::sync::lock(&self.inner, "fair queue").shut();
        self.ready.notify_waiters();
        self.ready.notify_one();
    }

    fn pop(&self) -> Option<Option<Packet>> {
        let mut g = seedlink_net::sync::lock(&self.inner, "fair queue");
        if let Some(p) = g.control.pop_front() {
            return Some(Some(p));
        }
        if g.closed {
            return None;
        }
        while let Some(id) = g.ring.pop_front() {
            let Some(c) = g.conns.get_mut(&id) else {
                continue;
            };
            let Some(p) = c.packets.pop_front() else {
                continue;
            };
            c.room.add_permits(1);
            if !c.packets.is_empty() {
                g.ring.push_back(id);
            } else if c.finishing {
                if let Some(c) = g.conns.remove(&id) {
                    c.room.close();
                }
            }
            return Some(Some(p));
        }
        Some(None)
    }

    /// The next packet if one is waiting (never waits).
    pub fn try_next(&self) -> Option<Packet> {
        self.pop().flatten()
    }

    /// The next packet to send: control first, then one DATA packet from
    /// the next connection in turn. `None` once closed.
    pub async fn next(&self) -> Option<Packet> {
        loop {
            let notified = self.ready.notified();
            match self.pop() {
                None => return None,
                Some(Some(p)) => return Some(p),
                Some(None) => notified.await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use bytes::Bytes;
    use futures_util::FutureExt;

    #[tokio::test]
    async fn a_window_is_used_and_reopened() {
        let c = SendCredit::new();
        c.take(WINDOW).await.unwrap();
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(30), c.take(1)).await;
        assert!(waiting.is_err(), "no window left");
        assert!(c.give(1000));
        c.take(1000).await.unwrap();
        // Reopening more than a window is refused.
        assert!(!c.give(i64::try_from(WINDOW).unwrap() + 1));
        assert!(!c.give(-5));
        c.close();
        assert!(c.take(1).await.is_err());
    }

    #[test]
    fn credit_is_returned_in_quarter_windows() {
        let mut u = Unacked::default();
        assert_eq!(u.written(RETURN_AT - 1), None);
        assert_eq!(u.written(1), Some(i64::try_from(RETURN_AT).unwrap()));
        assert_eq!(u.written(10), None);
    }

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

    fn id_of(p: &Packet) -> i64 {
        match &p.payload {
            Some(crate::wire::proto::Payload::Data(d)) => d.connect_id,
            _ => 0,
        }
    }

    #[tokio::test]
    async fn control_first_then_round_robin() {
        let q = FairQueue::new();
        for _ in 0..3 {
            q.data(1, Packet::data(1, Bytes::from_static(b"a")))
                .await
                .unwrap();
        }
        q.data(2, Packet::data(2, Bytes::from_static(b"b")))
            .await
            .unwrap();
        q.control(Packet::close_req(9)).unwrap();
        let order: Vec<i64> = [
            q.next().await.unwrap(),
            q.next().await.unwrap(),
            q.next().await.unwrap(),
            q.next().await.unwrap(),
            q.next().await.unwrap(),
        ]
        .iter()
        .map(id_of)
        .collect();
        // The CLOSE_REQ (id 0 here), then 1, 2, 1, 1: connection 2's single
        // packet does not wait behind all of connection 1's.
        assert_eq!(order, vec![0, 1, 2, 1, 1]);
    }

    #[tokio::test]
    async fn a_full_connection_waits_but_others_do_not() {
        let q = FairQueue::new();
        for _ in 0..PER_CONN {
            q.data(1, Packet::data(1, Bytes::new())).await.unwrap();
        }
        let blocked = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            q.data(1, Packet::data(1, Bytes::new())),
        )
        .await;
        assert!(blocked.is_err(), "connection 1 must wait for room");
        q.data(2, Packet::data(2, Bytes::new())).await.unwrap();
        q.close();
        assert!(q.data(3, Packet::data(3, Bytes::new())).await.is_err());
        assert!(q.next().await.is_none());
    }

    #[tokio::test]
    async fn a_close_never_overtakes_its_connections_data() {
        let q = FairQueue::new();
        q.data(1, Packet::data(1, Bytes::from_static(b"a")))
            .await
            .unwrap();
        q.data(1, Packet::data(1, Bytes::from_static(b"b")))
            .await
            .unwrap();
        q.finish(1, Some(Packet::close_rsp(1, String::new())));
        q.control(Packet::dial_cls(5)).unwrap();
        let kinds: Vec<_> = [
            q.next().await,
            q.next().await,
            q.next().await,
            q.next().await,
        ]
        .into_iter()
        .map(|p| p.unwrap().kind().unwrap())
        .collect();
        use crate::wire::proto::PacketType as T;
        assert_eq!(kinds, vec![T::DialCls, T::Data, T::Data, T::CloseRsp]);
        assert_eq!(q.conn_entries(), 0);
        // Without queued data the close goes out at once.
        q.finish(2, Some(Packet::close_req(2)));
        assert_eq!(q.next().await.unwrap().kind(), Some(T::CloseReq));
        assert_eq!(q.conn_entries(), 0);
        q.close();
        assert!(q.next().await.is_none());
    }

    #[tokio::test]
    async fn a_peer_that_overflows_the_control_queue_closes_it() {
        let q = FairQueue::new();
        for i in 0..MAX_CONTROL {
            q.control(Packet::close_req(i as i64)).unwrap();
        }
        assert!(!q.overflowed());
        assert_eq!(q.control(Packet::close_req(-1)), Err(Closed));
        assert!(q.overflowed());
        // Nothing of what was queued stays in memory, and the writer ends.
        assert_eq!(q.next().await, None);
        assert_eq!(q.data(1, Packet::close_req(1)).await, Err(Closed));
    }
}
