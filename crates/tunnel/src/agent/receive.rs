//! The receive loop of one agent stream, the other half of its driver
//! (`link_driver`): packets from the server into the link machine, the
//! dials it asks for, the wait for room, and how the stream's end is
//! counted. The server's side is `server::receive`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::StreamExt;

use super::core::*;
use super::link::{self, Expired};
use super::link_driver::*;
use super::metrics::AgentMetrics;
use crate::stream::queue::{self};

impl Agent {
    pub(super) async fn serve_link(self: &Arc<Self>, s: Arc<LinkDriver>, mut inbound: Inbound) {
        loop {
            let p = tokio::select! {
                () = s.cut.cancelled() => return,
                m = inbound.next() => match m {
                    Some(Ok(p)) => p,
                    Some(Err(e)) => {
                        tracing::info!(error = %e, "server stream failed");
                        return;
                    }
                    None => return,
                },
                () = self.shutdown.cancelled() => return,
            };
            let (h, applied) = s.with(|m, out| m.on_packet(p, out));
            self.handled(&s, h, applied.bad_window);
            self.start_dials(&s, applied.dials);
            if let Some((id, data, room)) = applied.blocked {
                // Backpressure (the standard protocol has no per-connection
                // flow control): read nothing more from this server until
                // the destination makes room, as long as it keeps taking
                // bytes.
                if !self.wait_for_room(&s, id, data, room).await {
                    return;
                }
            }
        }
    }

    /// Starts the dials the server asked for, each its own task.
    fn start_dials(self: &Arc<Self>, s: &Arc<LinkDriver>, dials: Vec<Dial>) {
        for (random, address, protocol, cancel) in dials {
            let (agent, s) = (self.clone(), s.clone());
            tokio::spawn(async move { agent.dial(s, address, protocol, random, cancel).await });
        }
    }

    /// A stream ended or drained: a flap if it had not lasted [`STABLE`],
    /// else the streak is over.
    pub(super) fn count_flap(&self, s: &LinkDriver) {
        if s.since.elapsed() < STABLE {
            self.flaps.fetch_add(1, Ordering::AcqRel);
        } else {
            self.flaps.store(0, Ordering::Release);
        }
    }

    /// What a packet from the server meant beyond its actions: DRAIN
    /// (look for a replica to replace it), REPLICAS, counters for bad
    /// packets and windows.
    pub(super) fn handled(&self, s: &LinkDriver, h: link::Handled, bad_window: bool) {
        if h == link::Handled::ServerDraining && !s.draining.swap(true, Ordering::AcqRel) {
            tracing::info!(server_id = %s.server_id, "the tunnel server drains: looking for a replica to replace it");
            AgentMetrics::count(&self.metrics.server_connects, "server_draining");
            self.count_flap(s);
            let n = self.draining_streams.fetch_add(1, Ordering::AcqRel) + 1;
            if n > MAX_DRAINING {
                tracing::warn!(server_id = %s.server_id, "more draining streams than {MAX_DRAINING}: this one is ended");
                AgentMetrics::count(&self.metrics.server_connects, "too_many_draining");
                s.cut.cancel();
            }
            self.session_lost.notify_one();
        }
        if let link::Handled::Replicas(n) = h {
            self.replicas_changed(&s.server_id, n);
        }
        if let Some(label) = h.bad_label() {
            AgentMetrics::count(&self.metrics.bad_packets, label);
        }
        if bad_window {
            AgentMetrics::count(&self.metrics.bad_packets, "bad_window");
        }
    }

    /// Waits until connection `id`'s bytes fit its queue, then queues them,
    /// while its destination keeps taking bytes; the session machine's
    /// stall deadline ends the wait (resetting the connection). `false` on
    /// shutdown.
    pub(super) async fn wait_for_room(
        &self,
        s: &LinkDriver,
        id: i64,
        data: bytes::Bytes,
        room: queue::Room,
    ) -> bool {
        loop {
            let due = seedlink_net::sync::lock(&s.state, "agent session")
                .machine
                .poll_timeout();
            let step = tokio::select! {
                step = room.step(data.len()) => step,
                () = sleep_until(due) => {
                    if self.stall_expired(s) {
                        return true;
                    }
                    continue;
                }
                () = self.shutdown.cancelled() => return false,
            };
            if s.room_step(id, step, &data) {
                return true;
            }
        }
    }

    /// The machine's timer fired during a wait for room: `true` when the
    /// stall deadline passed (the connection was reset and counted).
    fn stall_expired(&self, s: &LinkDriver) -> bool {
        let now = crate::stream::clock::now();
        match s.with(|m, out| m.handle_timeout(now, out)).0 {
            Expired::Nothing => false,
            Expired::Stalled { reset } => {
                if reset {
                    AgentMetrics::count(&self.metrics.endpoint_closes, "stalled");
                }
                true
            }
        }
    }
}
