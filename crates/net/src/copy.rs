//! Bidirectional byte copy between two TCP sockets.
//!
//! Semantics, identical on both paths (splice and buffered):
//! - bytes arrive exactly once, in order;
//! - EOF from one side shuts down the write half of the other side while the
//!   reverse direction keeps flowing (half-close);
//! - an error on either side (a reset above all) aborts both directions and
//!   arms `SO_LINGER=0` on both sockets, so dropping them sends RST: a reset
//!   is never turned into a clean end.

use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::sockopt;

/// How bytes are moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyMode {
    /// `splice(2)` through pooled pipes on Linux; buffered elsewhere.
    #[default]
    Splice,
    /// Read into and write from a user-space buffer.
    Buffered,
}

/// Shared state for all copies of a process.
pub struct Copier {
    mode: CopyMode,
    #[cfg(target_os = "linux")]
    pipes: crate::splice::PipePool,
}

/// Something that counts bytes as they move (an atomic, a metric, both).
pub trait Tally: Sync {
    /// Records `n` more bytes.
    fn add(&self, n: u64);
}

impl Tally for AtomicU64 {
    fn add(&self, n: u64) {
        self.fetch_add(n, Ordering::Relaxed);
    }
}

/// Byte counts of one proxied connection, readable while it runs.
#[derive(Debug, Default)]
pub struct Transfer {
    /// Bytes moved from the client to the upstream.
    pub to_upstream: AtomicU64,
    /// Bytes moved from the upstream to the client.
    pub to_client: AtomicU64,
}

/// Buffer size for the user-space path.
const BUF: usize = 16 * 1024;

impl Copier {
    /// A copier using `mode`, with at most `max_pipes` pipes in flight.
    pub fn new(mode: CopyMode, max_pipes: usize) -> Copier {
        #[cfg(not(target_os = "linux"))]
        let _ = max_pipes;
        Copier {
            mode,
            #[cfg(target_os = "linux")]
            pipes: crate::splice::PipePool::new(max_pipes),
        }
    }

    /// The mode this copier uses.
    pub fn mode(&self) -> CopyMode {
        self.mode
    }

    /// Copies in both directions until both have ended, counting each chunk
    /// as it moves.
    pub async fn run(
        &self,
        client: &TcpStream,
        upstream: &TcpStream,
        to_upstream: &dyn Tally,
        to_client: &dyn Tally,
    ) -> io::Result<()> {
        let up = self.one_way(client, upstream, to_upstream);
        let down = self.one_way(upstream, client, to_client);
        match tokio::try_join!(up, down) {
            Ok(_) => Ok(()),
            Err(e) => {
                // Abort both sides: dropping the sockets now sends RST.
                sockopt::arm_reset(client);
                sockopt::arm_reset(upstream);
                Err(e)
            }
        }
    }

    async fn one_way(&self, src: &TcpStream, dst: &TcpStream, count: &dyn Tally) -> io::Result<()> {
        loop {
            src.readable().await?;
            let moved = match self.mode {
                #[cfg(target_os = "linux")]
                CopyMode::Splice => match self.pipes.get() {
                    Some(lease) => splice_chunk(src, dst, lease).await,
                    None => buffered_chunk(src, dst).await,
                },
                _ => buffered_chunk(src, dst).await,
            };
            match moved {
                Ok(Some(0)) => {
                    // EOF: propagate the half-close and stop this direction.
                    match socket2::SockRef::from(dst).shutdown(Shutdown::Write) {
                        Ok(()) => return Ok(()),
                        Err(e) if e.kind() == io::ErrorKind::NotConnected => return Ok(()),
                        Err(e) => return Err(e),
                    }
                }
                Ok(Some(n)) => {
                    count.add(n as u64);
                }
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Moves one chunk with splice: socket → pipe → socket. `Ok(None)` means the
/// source was not actually readable (spurious wake-up).
#[cfg(target_os = "linux")]
async fn splice_chunk(
    src: &TcpStream,
    dst: &TcpStream,
    mut lease: crate::splice::Lease<'_>,
) -> io::Result<Option<usize>> {
    use std::os::fd::AsRawFd;
    let src_fd = src.as_raw_fd();
    let dst_fd = dst.as_raw_fd();
    let n = match src.try_io(Interest::READABLE, || {
        lease.pipe().fill_from(src_fd, lease.pipe().capacity)
    }) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    };
    lease.in_flight = n;
    while lease.in_flight > 0 {
        dst.writable().await?;
        let left = lease.in_flight;
        match dst.try_io(Interest::WRITABLE, || lease.pipe().drain_to(dst_fd, left)) {
            Ok(m) => lease.in_flight -= m.min(left),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(n))
}

/// Moves one chunk through a user-space buffer that lives only for this
/// chunk, so idle connections hold no buffer.
async fn buffered_chunk(src: &TcpStream, dst: &TcpStream) -> io::Result<Option<usize>> {
    let mut buf = vec![0u8; BUF];
    let n = match src.try_read(&mut buf) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    };
    write_all(dst, &buf[..n]).await?;
    Ok(Some(n))
}

/// Writes all of `data` to a shared-reference socket.
pub async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        dst.writable().await?;
        match dst.try_write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(m) => data = &data[m..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
