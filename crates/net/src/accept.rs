//! The accept loop.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// A listening socket the loop accepts on: TCP or Unix.
pub trait Listener {
    /// An accepted connection.
    type Stream;
    /// Its peer's address.
    type Peer;
    /// The next connection.
    fn accept(&self) -> impl std::future::Future<Output = io::Result<(Self::Stream, Self::Peer)>>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    type Peer = SocketAddr;
    async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        TcpListener::accept(self).await
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    type Peer = tokio::net::unix::SocketAddr;
    async fn accept(&self) -> io::Result<(UnixStream, Self::Peer)> {
        UnixListener::accept(self).await
    }
}

/// Connections accepted in a row before the loop lets the rest of its
/// runtime go first (see [`accept_loop`]).
pub const ACCEPT_BATCH: usize = 16;

/// Accepts connections until `shutdown` fires, handing each to `on_conn`.
///
/// Every [`ACCEPT_BATCH`] connections it yields, and tokio runs
/// it again only after the event loop has looked for I/O once: in a
/// reconnect storm the connections already established get their turn
/// between every batch of new ones, instead of waiting behind all that
/// one wake-up's accepts (up to tokio's budget of 128) and their setup.
///
/// Errors that concern one connection (it was reset before we accepted it)
/// are skipped. Resource errors (EMFILE, ENFILE, ENOBUFS, ENOMEM) pause the
/// loop with an exponential back-off from 10 ms to 1 s instead of spinning;
/// the loop never exits on its own.
pub async fn accept_loop<L, F>(listener: &L, shutdown: &CancellationToken, mut on_conn: F)
where
    L: Listener,
    F: FnMut(L::Stream, L::Peer),
{
    let mut backoff = Duration::from_millis(10);
    let mut since_yield = 0;
    loop {
        if since_yield >= ACCEPT_BATCH {
            since_yield = 0;
            tokio::task::yield_now().await;
        }
        let accepted = tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(10);
                since_yield += 1;
                on_conn(stream, peer);
            }
            Err(e) if is_connection_error(&e) => {}
            Err(e) => {
                tracing::warn!(error = %e, pause_ms = backoff.as_millis() as u64, "accept failed; pausing");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}
