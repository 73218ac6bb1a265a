//! The receive loop of one agent stream, the other half of its driver
//! (`link_driver`): packets from the agent into the link machine, the
//! machine's timers, and why the stream ended ([`StreamEnd`], the
//! `agent_streams_total` reason).

use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tonic::Status;

use super::core::Core;
use super::{detach, Cluster, Handled, LinkDriver};
use crate::transport::native;
use crate::wire::proto::Packet;

/// Why an agent stream ended; its label is the `agent_streams_total`
/// reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamEnd {
    /// The agent closed it.
    Closed,
    /// The transport failed (a reset, a protocol error).
    StreamError,
    /// More packets that move nothing than its budget (flood.rs).
    ControlFlood,
    /// The server queued more answers than the agent reads.
    ControlOverflow,
    /// The server is shutting down.
    ServerShutdown,
    /// Its cluster was removed.
    ClusterRemoved,
    /// It carried nothing more while the server drains.
    DrainedIdle,
    /// Its cluster was re-keyed away from the agent's credentials.
    Rekeyed,
}

impl StreamEnd {
    /// The metric label and log value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            StreamEnd::Closed => "closed",
            StreamEnd::StreamError => "stream_error",
            StreamEnd::ControlFlood => "control_flood",
            StreamEnd::ControlOverflow => "control_overflow",
            StreamEnd::ServerShutdown => "server_shutdown",
            StreamEnd::ClusterRemoved => "cluster_removed",
            StreamEnd::DrainedIdle => "drained_idle",
            StreamEnd::Rekeyed => "rekeyed",
        }
    }
}

/// The receive loop of one stream: each packet goes to the link; it waits
/// on a connection only when that connection's queue is full (see
/// queue.rs and docs/TUNNEL.md, "Head-of-line"). It also drives the link's
/// timers ([`LinkDriver::next_timeout`]), waiting or not. Ends with the
/// stream, on shutdown, when the cluster is removed or re-keyed away from
/// the agent.
pub(super) async fn receive<S, E>(
    srv: Arc<Core>,
    cluster: Arc<Cluster>,
    link: Arc<LinkDriver>,
    inbound: S,
    probe: bool,
) where
    S: Stream<Item = Result<Packet, E>> + Unpin,
    E: ReceiveError,
{
    let why = receive_loop(&srv, &cluster, &link, inbound).await;
    if why == StreamEnd::ControlFlood {
        let until = seedlink_net::clock::now_ms()
            + u64::try_from(crate::stream::flood::COOLDOWN.as_millis()).unwrap_or(u64::MAX);
        cluster
            .flood_until_ms
            .store(until, std::sync::atomic::Ordering::Release);
    }
    detach(&cluster, &link);
    cluster.metrics.agent(-1);
    if probe && why == StreamEnd::Closed {
        srv.metrics.agent_stream(&cluster.name, "duplicate");
        tracing::debug!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, "duplicate agent stream closed");
    } else {
        let why = why.label();
        srv.metrics.agent_stream(&cluster.name, why);
        tracing::info!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, why, "agent disconnected");
    }
}

/// Takes the stream's packets and drives the link's timers until the
/// stream ends; returns why (the `agent_streams_total` label).
pub(super) async fn receive_loop<S, E>(
    srv: &Core,
    cluster: &Cluster,
    link: &LinkDriver,
    mut inbound: S,
) -> StreamEnd
where
    S: Stream<Item = Result<Packet, E>> + Unpin,
    E: ReceiveError,
{
    // One sleep across packets; set again when it fired, and after a wait
    // for room (which ran the timers itself).
    let timer = link.next_timeout();
    tokio::pin!(timer);
    let mut idle = crate::stream::flood::Budget::new(crate::stream::clock::now());
    loop {
        // Each packet costs the task a unit of tokio's cooperative budget:
        // a stream whose packets are always ready (a flood, or a fast
        // bulk sender) gives the worker back to other tenants' tasks now
        // and then instead of keeping it for as long as the agent sends.
        tokio::task::consume_budget().await;
        let m = tokio::select! {
            m = inbound.next() => m,
            h = &mut timer => {
                if let Some(h) = h {
                    cluster.metrics.packet(h);
                }
                timer.set(link.next_timeout());
                continue;
            }
            why = stopped(srv, cluster, link) => return why,
        };
        let waited = match m {
            Some(Ok(p)) if moves_nothing(&p) && !idle.spend(crate::stream::clock::now()) => {
                tracing::info!(agent = %link.agent_id, "agent stream cut: more packets that move nothing than its budget");
                Err(StreamEnd::ControlFlood)
            }
            Some(Ok(p)) => take_packet(srv, cluster, link, p, &mut idle).await,
            Some(Err(e)) if e.flood() => {
                tracing::info!(agent = %link.agent_id, error = %e, "agent stream cut: more frames that move nothing than its budget");
                Err(StreamEnd::ControlFlood)
            }
            Some(Err(e)) => {
                tracing::info!(agent = %link.agent_id, error = %e, "agent stream failed");
                Err(StreamEnd::StreamError)
            }
            None => Err(StreamEnd::Closed),
        };
        match waited {
            Ok(true) => timer.set(link.next_timeout()),
            Ok(false) => {}
            Err(why) => return why,
        }
    }
}

/// One packet from the agent. DATA for a full connection makes the stream
/// read nothing more until that connection's reader makes room, or stops
/// reading for the stall deadline (backpressure); `Ok(true)` when it
/// waited. `Err(why)` ends the stream.
pub(super) async fn take_packet(
    srv: &Core,
    cluster: &Cluster,
    link: &LinkDriver,
    p: Packet,
    idle: &mut crate::stream::flood::Budget,
) -> Result<bool, StreamEnd> {
    let (h, blocked) = link.on_agent_packet(p);
    cluster.metrics.packet(h);
    if matches!(h, Handled::Unrecognized | Handled::Unexpected)
        && !idle.spend(crate::stream::clock::now())
    {
        tracing::info!(agent = %link.agent_id, "agent stream cut: more packets for nothing it has than its budget");
        return Err(StreamEnd::ControlFlood);
    }
    if link.to_agent.overflowed() {
        // It made the server queue more answers than it reads: cut off,
        // this agent only.
        return Err(StreamEnd::ControlOverflow);
    }
    let Some(b) = blocked else { return Ok(false) };
    // Boxed: a wait for room is rare, and inline it would size every
    // idle stream's receive loop for it.
    Box::pin(async {
        tokio::select! {
            h = b.resume(link) => {
                if h != Handled::Ok {
                    cluster.metrics.packet(h);
                }
                Ok(true)
            }
            why = stopped(srv, cluster, link) => Err(why),
        }
    })
    .await
}

/// Why an agent stream's packets stopped coming.
pub(crate) trait ReceiveError: std::fmt::Display {
    /// The transport cut it for frames that move nothing (flood.rs).
    fn flood(&self) -> bool {
        false
    }
}

impl ReceiveError for Status {}

impl ReceiveError for native::WireError {
    fn flood(&self) -> bool {
        matches!(self, native::WireError::Flood)
    }
}

/// A packet that carries nothing by its kind alone: a DRAIN (an agent
/// sends one per stream), DATA without bytes, a packet without a payload.
/// Packets naming what the stream does not have are counted once handled.
pub(super) fn moves_nothing(p: &Packet) -> bool {
    use crate::wire::proto::{PacketType as T, Payload};
    match (&p.payload, p.kind()) {
        (_, Some(T::Drain)) | (None, _) => true,
        (Some(Payload::Data(d)), _) => d.data.is_empty() && d.error.is_empty(),
        _ => false,
    }
}

/// Ends when the stream must: on shutdown, when the cluster is removed,
/// or when the link is kicked; says why.
pub(super) async fn stopped(srv: &Core, cluster: &Cluster, link: &LinkDriver) -> StreamEnd {
    tokio::select! {
        () = srv.shutdown.cancelled() => StreamEnd::ServerShutdown,
        () = cluster.removed.cancelled() => StreamEnd::ClusterRemoved,
        () = link.kick.cancelled() => kicked(srv, link),
    }
}

/// Why a link was kicked: its queue overflowed, it carried nothing more
/// while the server drains, or its cluster was re-keyed away from it.
pub(super) fn kicked(srv: &Core, link: &LinkDriver) -> StreamEnd {
    if link.to_agent.overflowed() {
        StreamEnd::ControlOverflow
    } else if srv.accepting.is_cancelled() {
        StreamEnd::DrainedIdle
    } else {
        StreamEnd::Rekeyed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DRAIN, DATA without bytes and a packet without a payload move
    /// nothing by their kind; DATA with bytes, a DIAL_RSP or a
    /// WINDOW_UPDATE may (they are counted once handled, if they named
    /// nothing the stream has).
    #[test]
    fn what_moves_nothing() {
        assert!(moves_nothing(&Packet::drain()));
        assert!(moves_nothing(&Packet::data(1, bytes::Bytes::new())));
        assert!(moves_nothing(&Packet::default()));
        assert!(!moves_nothing(&Packet::data(
            1,
            bytes::Bytes::from_static(b"x")
        )));
        assert!(!moves_nothing(&Packet::dial_cls(1)));
        assert!(!moves_nothing(&Packet::window_update(1, 10)));
    }
}
