//! Moving bytes between a TCP socket and one HTTP/2 stream (a CONNECT
//! tunnel), shared by the gateway's HTTP/2 CONNECT listener and the
//! node-proxy's HTTP/2 mode. Each direction honours h2 flow control, so a
//! slow reader backpressures only its own stream.

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::net::TcpStream;

use crate::copy::write_all;

/// Bytes read from the socket per DATA frame batch.
const CHUNK: usize = 64 * 1024;

/// Largest DATA frame each side accepts (advertised in SETTINGS); larger
/// frames than h2's 16 KiB default cost fewer frame headers and wakeups.
pub const MAX_FRAME: u32 = 256 * 1024;

/// The keepalive PING interval on an HTTP/2 connection between seedlink and
/// its peers, and how long a pong may take.
pub const PING_EVERY: std::time::Duration = std::time::Duration::from_secs(30);
/// See [`PING_EVERY`].
pub const PONG_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Ends when a PING goes unanswered for [`PONG_WITHIN`] (one every
/// [`PING_EVERY`]); never without a ping handle.
pub async fn keepalive(pings: Option<h2::PingPong>) {
    let Some(mut p) = pings else {
        return std::future::pending::<()>().await;
    };
    loop {
        tokio::time::sleep(PING_EVERY).await;
        match tokio::time::timeout(PONG_WITHIN, p.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
    }
}

/// DATA frames → `socket`; END_STREAM → half-close the socket's write side;
/// a stream reset → reset the socket.
pub async fn stream_to_socket(mut recv: RecvStream, socket: &TcpStream) {
    while let Some(chunk) = recv.data().await {
        let Ok(chunk) = chunk else {
            crate::sockopt::arm_reset(socket);
            return;
        };
        let n = chunk.len();
        if write_all(socket, &chunk).await.is_err() {
            return;
        }
        // Only now may the peer send more: per-stream backpressure.
        let _ = recv.flow_control().release_capacity(n);
    }
    let _ = socket2::SockRef::from(socket).shutdown(std::net::Shutdown::Write);
}

/// `socket` bytes → DATA frames, as the stream's window allows; EOF →
/// END_STREAM; a socket error → RST_STREAM. The peer resetting the stream
/// ends it at once (the socket is then reset), even while the socket is
/// silent: a reset stream never keeps its upstream connection.
pub async fn socket_to_stream(socket: &TcpStream, mut send: SendStream<Bytes>) {
    loop {
        let readable = tokio::select! {
            r = socket.readable() => r,
            reason = std::future::poll_fn(|cx| send.poll_reset(cx)) => {
                // NO_ERROR after the peer's END_STREAM means "stop sending"
                // (RFC 9113 §8.1): what was written to the socket must still
                // arrive, so no reset for it.
                if !matches!(reason, Ok(h2::Reason::NO_ERROR)) {
                    crate::sockopt::arm_reset(socket);
                }
                return;
            }
        };
        if readable.is_err() {
            send.send_reset(h2::Reason::CANCEL);
            return;
        }
        // The buffer exists only while there is data: an idle tunnel holds
        // no read buffer, and the frozen bytes are sent without a copy.
        let mut buf = BytesMut::with_capacity(CHUNK);
        match socket.try_read_buf(&mut buf) {
            Ok(0) => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => {
                send.send_reset(h2::Reason::CONNECT_ERROR);
                return;
            }
        }
        if send_all(&mut send, buf.freeze()).await.is_none() {
            return;
        }
    }
}

/// Sends `data` as the stream's window allows; `None` when the stream is
/// gone.
async fn send_all(send: &mut SendStream<Bytes>, mut data: Bytes) -> Option<()> {
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        let granted = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
            Some(Ok(g)) if g > 0 => g,
            Some(Ok(_)) => continue,
            _ => return None,
        };
        let part = data.split_to(granted.min(data.len()));
        send.send_data(part, false).ok()?;
    }
    Some(())
}
