//! The native transport between a seedlink agent and a seedlink server,
//! `seedlink-tunnel/1`, agreed by ALPN in the TLS handshake the agent
//! makes anyway. An upstream agent or server offers only `h2` and gets
//! gRPC, unchanged. Decided and measured in docs/TUNNEL.md ("The native
//! transport") and docs/PERFORMANCE.md (issue 28): HTTP/2 and gRPC cost a
//! fixed 28 KiB per idle agent stream, two copies of every DATA payload on
//! the way in, and a hop through the HTTP/2 connection task each way.
//!
//! One connection carries one agent stream. Frames: a type byte, a 4-byte
//! big-endian length, the payload.
//! - OPEN (agent, first): the stream's metadata, `key:value` lines, what
//!   gRPC sends as request headers (`agentid`, `authorization`, ...).
//! - ANSWER (server): the answer's metadata (`serverid`, ...); or REFUSED
//!   with `code message` (a gRPC status code), after which the server
//!   closes.
//! - PACKET: one Konnectivity `Packet`, protobuf-encoded, exactly as in
//!   a gRPC message.
//! - PING / PONG (empty): a side that heard nothing for its keepalive
//!   interval sends PING; a PING is answered by one PONG; a side that then
//!   hears nothing for the keepalive timeout ends the stream.
//!
//! The stream ends with the TLS connection (close_notify, then FIN).
//! Hand-written: it is the framing above and nothing else; no crate frames
//! protobuf messages over a byte stream without a layer (gRPC, HTTP/2)
//! whose cost is the point.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::stream::flow::FairQueue;

mod frame;
mod handshake;
mod reader;
mod writer;

pub use frame::{decode_meta, Meta, WireError, ALPN, MAX_META, MAX_PACKET};
pub use handshake::{accept, answer, open, refuse, Opened};
pub use reader::Inbound;
pub use writer::{split, write_loop, Control, Shared};

/// Runs a stream on `io` after the handshake: the writer task sending
/// `queue` (a peer that takes nothing for the keepalive interval and
/// timeout fails it), and the reader, keeping the keepalive.
pub fn start<IO>(
    io: IO,
    queue: Arc<FairQueue>,
    keepalive: crate::transport::grpc::H2Settings,
) -> (Inbound<Shared<IO>>, tokio::task::JoinHandle<()>)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = split(io);
    let ctl = Control::new();
    let (every, timeout) = (keepalive.keepalive, keepalive.keepalive_timeout);
    let writer = tokio::spawn(write_loop(
        wr,
        queue,
        ctl.clone(),
        every.saturating_add(timeout),
    ));
    (Inbound::new(rd, ctl, every, timeout), writer)
}

#[cfg(test)]
mod tests;
