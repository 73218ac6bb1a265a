//! One agent stream's driver, the agent's side of a link: the sans-IO
//! [`LinkMachine`] behind one lock, the IO it asks for (packets to the
//! server, bytes to and from each destination), and the receive loop that
//! feeds it (`Agent::serve_link`). The server's side has the same shape
//! (`server::link_driver`).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio_util::sync::CancellationToken;

use super::link::{Action, Actions, LinkMachine};
use super::metrics::ConnEnd;
use crate::stream::flow::{self, FairQueue, PumpEnd, QueueTx, SendCredit};
use crate::wire::proto::Packet;

/// Destination to server: reads what the destination sends and sends it
/// as DATA, within the window when flow control is on. Returns how it
/// ended.
pub(super) async fn upload(
    rd: tokio::net::tcp::OwnedReadHalf,
    s: &LinkDriver,
    id: i64,
    credit: Option<&SendCredit>,
) -> ConnEnd {
    loop {
        // No buffer while the destination is quiet: an idle connection
        // holds none.
        if rd.readable().await.is_err() {
            return ConnEnd::RemoteClosed;
        }
        let mut b = BytesMut::with_capacity(CHUNK);
        match rd.try_read_buf(&mut b) {
            Ok(0) => return ConnEnd::RemoteClosed,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return ConnEnd::RemoteClosed,
            Ok(_) => {
                if let Err(end) = send_up(s, id, credit, b.freeze()).await {
                    return end;
                }
            }
        }
    }
}

/// Sends what the destination sent as DATA of connection `id`, within the
/// window: a server-side reader that stopped holds this connection back,
/// nothing else. How the connection ended if it did.
pub(super) async fn send_up(
    s: &LinkDriver,
    id: i64,
    credit: Option<&SendCredit>,
    data: bytes::Bytes,
) -> Result<(), ConnEnd> {
    if let Some(c) = credit {
        c.take(data.len()).await.map_err(|_| ConnEnd::Closed)?;
    }
    s.to_server
        .data(id, Packet::data(id, data))
        .await
        .map_err(|_| ConnEnd::ServerGone)
}

/// Server to destination: writes the connection's queue, granting the
/// server more window as it drains (flow control), or within `stall` per
/// write without. Returns how it ended.
pub(super) async fn download(
    mut qrx: flow::QueueRx,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    s: &LinkDriver,
    id: i64,
    stall: Duration,
) -> ConnEnd {
    let mut unacked = flow::Unacked::default();
    let deadline = (!s.flow).then_some(stall);
    let written = |n| {
        if s.flow {
            if let Some(k) = unacked.written(n) {
                s.send_soon(Packet::window_update(id, k));
            }
        }
    };
    match qrx.pump(&mut wr, deadline, written).await {
        PumpEnd::Finished | PumpEnd::Aborted => ConnEnd::Closed,
        PumpEnd::Stalled => ConnEnd::Stalled,
        PumpEnd::WriteError => ConnEnd::WriteError,
    }
}

/// A connection's ends the session machine keeps.
pub(super) struct ConnEnds {
    pub(super) queue: QueueTx,
    pub(super) cancel: CancellationToken,
    /// Window towards the server (flow control negotiated).
    pub(super) credit: Option<SendCredit>,
}

impl ConnEnds {
    /// Resets the connection: its task stops, its writer resets.
    pub(super) fn abort(self) {
        self.cancel.cancel();
        self.queue.abort();
    }
}

/// The machine and its reusable action buffer, behind the session's lock.
pub(super) struct Locked {
    pub(super) machine: LinkMachine<ConnEnds, CancellationToken>,
    pub(super) out: Actions<ConnEnds, CancellationToken>,
}

/// One stream to one server replica: the sans-IO [`LinkMachine`] behind one
/// lock, and the IO it drives.
pub(super) struct LinkDriver {
    pub(super) server_id: String,
    /// The pod its server runs in, when it says (`seedlink-pod`): what
    /// REPLICAS entries name replicas by.
    pub(super) pod: Option<String>,
    /// The server said DRAIN: it is going away, so it no longer counts
    /// as held (the agent looks for a replica to replace it).
    pub(super) draining: AtomicBool,
    pub(super) to_server: Arc<FairQueue>,
    pub(super) state: Mutex<Locked>,
    pub(super) gone: CancellationToken,
    /// Cancelled to end the stream from this side.
    pub(super) cut: CancellationToken,
    /// When it opened.
    pub(super) since: std::time::Instant,
    /// Per-connection flow control negotiated.
    pub(super) flow: bool,
}

/// A dial the server asked for: its random ID, address, protocol, and the
/// handle that cancels it.
pub(super) type Dial = (i64, String, String, CancellationToken);

/// What carrying out a call's actions produced for the caller.
#[derive(Default)]
pub(super) struct Applied {
    /// Dials to start.
    pub(super) dials: Vec<Dial>,
    /// DATA that did not fit its connection's queue.
    pub(super) blocked: Option<(i64, bytes::Bytes, flow::Room)>,
    /// A WINDOW_UPDATE gave more than was used.
    pub(super) bad_window: bool,
}

impl LinkDriver {
    /// Whether it carries no connection and no dial in progress.
    pub(super) fn idle(&self) -> bool {
        let g = seedlink_net::sync::lock(&self.state, "agent session");
        g.machine.open().next().is_none() && g.machine.pending() == 0
    }

    pub(super) fn send_soon(&self, p: Packet) {
        let _ = self.to_server.control(p);
    }

    pub(super) fn new(
        (server_id, pod): (String, Option<String>),
        to_server: Arc<FairQueue>,
        flow: bool,
        replicas: bool,
        stall: Duration,
    ) -> LinkDriver {
        let machine = LinkMachine::new(flow, stall);
        LinkDriver {
            server_id,
            pod,
            draining: AtomicBool::new(false),
            to_server,
            state: Mutex::new(Locked {
                machine: if replicas {
                    machine.with_replica_updates()
                } else {
                    machine
                },
                out: Actions::new(),
            }),
            gone: CancellationToken::new(),
            cut: CancellationToken::new(),
            since: crate::stream::clock::now(),
            flow,
        }
    }

    /// Runs `f` on the machine under the lock, then carries out what it
    /// asked for; nothing here waits.
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(
            &mut LinkMachine<ConnEnds, CancellationToken>,
            &mut Actions<ConnEnds, CancellationToken>,
        ) -> T,
    ) -> (T, Applied) {
        let mut g = seedlink_net::sync::lock(&self.state, "agent session");
        let Locked { machine, out } = &mut *g;
        let r = f(machine, out);
        (r, self.apply(machine, out))
    }

    /// What waiting for room for connection `id`'s `data` saw: room (the
    /// bytes are queued; a connection closed meanwhile drops them), the
    /// writer gone, or progress (the stall deadline starts again). `true`
    /// when the wait is over.
    pub(super) fn room_step(&self, id: i64, step: flow::Step, data: &bytes::Bytes) -> bool {
        let mut g = seedlink_net::sync::lock(&self.state, "agent session");
        match step {
            flow::Step::Room => {
                // Only the receive loop pushes, so the bytes fit.
                if let Some(e) = g.machine.conn(id) {
                    let _ = e.queue.push(data.clone());
                }
                g.machine.unblocked();
                true
            }
            flow::Step::Closed => {
                g.machine.unblocked();
                true
            }
            flow::Step::Progress => {
                g.machine.progress(crate::stream::clock::now());
                false
            }
        }
    }

    /// Carries out the machine's actions; nothing here waits.
    pub(super) fn apply(
        &self,
        machine: &mut LinkMachine<ConnEnds, CancellationToken>,
        out: &mut Actions<ConnEnds, CancellationToken>,
    ) -> Applied {
        let mut applied = Applied::default();
        while let Some(a) = out.pop_front() {
            match a {
                Action::Send(p) => self.send_soon(p),
                Action::Finish(id, last) => self.to_server.finish(id, last),
                Action::Dial {
                    random,
                    address,
                    protocol,
                    cancel,
                } => applied.dials.push((random, address, protocol, cancel)),
                Action::Cancel(c) => c.cancel(),
                Action::Deliver(id, data) => {
                    if let Some((data, room)) = deliver(machine, id, data) {
                        machine.blocked(crate::stream::clock::now(), id);
                        applied.blocked = Some((id, data, room));
                    }
                }
                Action::Reopen(id, n) => applied.bad_window |= !reopen(machine, id, n),
                Action::Close(e) => e.cancel.cancel(),
                Action::Abort(e) => e.abort(),
            }
        }
        applied
    }
}

/// Gives connection `id`'s sender `n` bytes more window; `false` when
/// that is more than it used (a connection without a window takes any).
pub(super) fn reopen(machine: &LinkMachine<ConnEnds, CancellationToken>, id: i64, n: i64) -> bool {
    machine
        .conn(id)
        .and_then(|e| e.credit.as_ref())
        .is_none_or(|c| c.give(n))
}

/// Queues DATA for connection `id`'s destination; what does not fit comes
/// back with a handle to wait for room.
pub(super) fn deliver(
    machine: &LinkMachine<ConnEnds, CancellationToken>,
    id: i64,
    data: bytes::Bytes,
) -> Option<(bytes::Bytes, flow::Room)> {
    let e = machine.conn(id)?;
    match e.queue.push(data) {
        Ok(()) | Err(flow::PushError::Closed) => None,
        Err(flow::PushError::Full(data)) => Some((data, e.queue.room())),
    }
}

/// Sleeps until `at`; forever without one.
pub(super) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

/// Bytes read from a destination per DATA packet.
pub(super) const CHUNK: usize = 32 * 1024;

/// The server's packets on either transport.
pub(super) type Inbound = std::pin::Pin<
    Box<
        dyn futures_util::Stream<Item = Result<Packet, Box<dyn std::error::Error + Send + Sync>>>
            + Send,
    >,
>;
