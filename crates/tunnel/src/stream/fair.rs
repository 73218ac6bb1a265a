//! The send side of one multiplexed stream (agent ↔ server): control
//! packets go first, then DATA packets round-robin across connections, so a
//! connection with a lot to send cannot queue megabytes ahead of another
//! connection's single packet. Each connection may have only a few packets
//! waiting; its sender waits for room (backpressure to that connection's
//! socket only).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, Semaphore};

use crate::wire::proto::Packet;

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
    use bytes::Bytes;

    use super::*;

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
