//! Bidirectional byte copy between two TCP sockets.
//!
//! Semantics, identical on both paths (splice and buffered):
//! - bytes arrive exactly once, in order;
//! - EOF from one side shuts down the write half of the other side while the
//!   reverse direction keeps flowing (half-close);
//! - an error on either side (a reset above all) aborts both directions and
//!   arms `SO_LINGER=0` on both sockets, so dropping them sends RST: a reset
//!   is never turned into a clean end.

use std::future::Future;
use std::io;
use std::net::Shutdown;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{ready, Context, Poll};
use std::time::Duration;

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
    /// Milliseconds a half-closed copy may go without moving a byte.
    half_closed_ms: AtomicU64,
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

/// Copies both ways between two streams that are not both plain sockets
/// (TLS on one side: no splice), in user space. Each direction passes its
/// end on (a FIN, or TLS close_notify); once one has ended, the other has
/// `half_closed` to end too, so a peer that never closes holds nothing
/// for longer. An error ends both.
pub async fn both_ways<A, B>(a: A, b: B, half_closed: Duration) -> io::Result<()>
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let up = async {
        tokio::io::copy(&mut ar, &mut bw).await?;
        bw.shutdown().await
    };
    let down = async {
        tokio::io::copy(&mut br, &mut aw).await?;
        aw.shutdown().await
    };
    tokio::pin!(up, down);
    let rest = tokio::select! {
        r = &mut up => { r?; tokio::time::timeout(half_closed, &mut down).await }
        r = &mut down => { r?; tokio::time::timeout(half_closed, &mut up).await }
    };
    rest.map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "half-closed too long"))?
}

/// Default of [`Copier::set_half_closed`] (HAProxy's `timeout client-fin`
/// is commonly 30 s; kube-apiserver answers within its 60 s request timeout).
pub const DEFAULT_HALF_CLOSED: Duration = Duration::from_secs(60);

/// Buffer size for the user-space path.
const BUF: usize = 16 * 1024;

/// In splice mode, each direction starts with reads of at most this many
/// bytes through user space and switches to splice(2) for good after the
/// first read that fills it. Request/response traffic (most API calls)
/// never pays splice's per-call cost and the pipe pool's lock; bulk
/// transfers copy one small chunk before the switch.
const FIRST_READS: usize = 4 * 1024;

impl Copier {
    /// A copier using `mode`, with at most `max_pipes` pipes in flight.
    pub fn new(mode: CopyMode, max_pipes: usize) -> Copier {
        #[cfg(not(target_os = "linux"))]
        let _ = max_pipes;
        Copier {
            mode,
            half_closed_ms: AtomicU64::new(DEFAULT_HALF_CLOSED.as_millis() as u64),
            #[cfg(target_os = "linux")]
            pipes: crate::splice::PipePool::new(max_pipes),
        }
    }

    /// Once one direction has ended (its source sent FIN) and everything
    /// it carried has been acknowledged by its destination, the other
    /// direction may go this long without moving a byte. Then a client
    /// that sent FIN and got no answer is reset together with the upstream
    /// (an abort it can see); a client that got the upstream's whole answer
    /// and FIN but neither sends nor closes is closed normally. Without
    /// it, either would hold the connection until TCP keepalive notices,
    /// if ever (the fault suite's stalled backend did).
    pub fn set_half_closed(&self, limit: Duration) {
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX).max(1);
        self.half_closed_ms.store(ms, Ordering::Relaxed);
    }

    /// The limit [`Copier::set_half_closed`] set.
    pub fn half_closed(&self) -> Duration {
        Duration::from_millis(self.half_closed_ms.load(Ordering::Relaxed))
    }

    /// The mode this copier uses.
    pub fn mode(&self) -> CopyMode {
        self.mode
    }

    /// Splice pipes that exist and, of those, the ones idle in the pool
    /// (see [`crate::splice::PipePool::counts`]); (0, 0) without splice.
    pub fn pipe_counts(&self) -> (usize, usize) {
        #[cfg(target_os = "linux")]
        return self.pipes.counts();
        #[cfg(not(target_os = "linux"))]
        (0, 0)
    }

    /// Copies in both directions until both have ended, counting bytes as
    /// they are written. On `Ok` the caller closes both sockets: that close
    /// sends the last direction's FIN.
    ///
    /// Written as a poll function over two small state machines rather
    /// than `async` blocks: the future is about a tenth of the size (tokio's
    /// readiness futures each embed a waiter node, and an `async` copy loop
    /// holds several), and an idle proxied connection holds nothing else.
    /// Each direction uses its own readiness slot (reads of its source,
    /// writes to its destination), so one task can poll both.
    pub async fn run(
        &self,
        client: &TcpStream,
        upstream: &TcpStream,
        to_upstream: &dyn Tally,
        to_client: &dyn Tally,
    ) -> io::Result<()> {
        let mut up = (Dir::Idle, false);
        let mut down = (Dir::Idle, false);
        let mut half = HalfClosed {
            timer: None,
            limit: Duration::from_millis(self.half_closed_ms.load(Ordering::Relaxed)),
        };
        let r = std::future::poll_fn(|cx| {
            let mut moved = false;
            let down_done = matches!(down.0, Dir::Done);
            let a = self.poll_dir(
                cx,
                &mut up,
                (client, upstream, down_done),
                to_upstream,
                &mut moved,
            );
            if let Poll::Ready(Err(e)) = a {
                return Poll::Ready(Err(e));
            }
            let up_done = matches!(up.0, Dir::Done);
            let b = self.poll_dir(
                cx,
                &mut down,
                (upstream, client, up_done),
                to_client,
                &mut moved,
            );
            let up_ended = a.is_ready();
            match (a, b) {
                (_, Poll::Ready(Err(e))) => Poll::Ready(Err(e)),
                (Poll::Ready(Ok(())), Poll::Ready(Ok(()))) => Poll::Ready(Ok(())),
                (Poll::Ready(Ok(())), Poll::Pending) | (Poll::Pending, Poll::Ready(Ok(()))) => {
                    // The ended direction's destination may still be
                    // taking in what was written before the FIN (a client
                    // reading the end of a download): that is progress too.
                    let delivering = if up_ended { upstream } else { client };
                    half.poll(cx, moved, delivering, up_ended)
                }
                _ => Poll::Pending,
            }
        })
        .await;
        if r.is_err() {
            // Abort both sides: dropping the sockets now sends RST.
            sockopt::arm_reset(client);
            sockopt::arm_reset(upstream);
        }
        r
    }

    /// Drives one direction (its state and whether it has seen bulk) from
    /// `src` to `dst` as far as it can go without blocking; `other_done`:
    /// the opposite direction has ended.
    fn poll_dir<'p>(
        &'p self,
        cx: &mut Context<'_>,
        (st, bulk): &mut (Dir<'p>, bool),
        (src, dst, other_done): (&TcpStream, &TcpStream, bool),
        count: &dyn Tally,
        moved: &mut bool,
    ) -> Poll<io::Result<()>> {
        loop {
            match st {
                Dir::Done => return Poll::Ready(Ok(())),
                #[cfg(not(target_os = "linux"))]
                Dir::Unused(_) => return Poll::Ready(Ok(())),
                Dir::Idle => {
                    ready!(src.poll_read_ready(cx))?;
                    match self.fill(src, bulk, (dst, count, moved))? {
                        // Not readable after all (readiness cleared): poll again.
                        None => {}
                        Some(Dir::Done) => {
                            // EOF: propagate the half-close and stop this
                            // direction. When the other direction has ended
                            // too, the copy ends here and the caller's close
                            // sends the FIN (both receive queues are empty, so
                            // it is a FIN, not a RST): one system call fewer
                            // per connection.
                            if !other_done {
                                match socket2::SockRef::from(dst).shutdown(Shutdown::Write) {
                                    Ok(()) => {}
                                    Err(e) if e.kind() == io::ErrorKind::NotConnected => {}
                                    Err(e) => return Poll::Ready(Err(e)),
                                }
                            }
                            *st = Dir::Done;
                        }
                        Some(next) => *st = next,
                    }
                }
                #[cfg(target_os = "linux")]
                Dir::Spliced(lease) => {
                    ready!(dst.poll_write_ready(cx))?;
                    if drain_pipe(lease, dst, count, moved)? {
                        // The empty pipe goes back to the pool.
                        *st = Dir::Idle;
                    }
                }
                Dir::Buffered { buf, pos, end } => {
                    ready!(dst.poll_write_ready(cx))?;
                    if write_buffer(&buf[..*end], pos, dst, count, moved)? {
                        // The chunk's buffer is freed: idle holds none.
                        *st = Dir::Idle;
                    }
                }
            }
        }
    }

    /// Reads what `src` has: into a pipe once the direction carries bulk
    /// (and a pipe is free), else into a buffer. `None`: nothing to read
    /// after all; `Some(Dir::Done)`: end of stream. The first reads go
    /// through the stack and on to `dst` at once (`Some(Dir::Idle)` when
    /// `dst` took all of it).
    #[inline]
    fn fill<'p>(
        &'p self,
        src: &TcpStream,
        bulk: &mut bool,
        to: (&TcpStream, &dyn Tally, &mut bool),
    ) -> io::Result<Option<Dir<'p>>> {
        match self.mode {
            #[cfg(target_os = "linux")]
            CopyMode::Splice if *bulk => match self.pipes.get() {
                Some(lease) => splice_in(src, lease),
                None => buffered_in(src, BUF),
            },
            #[cfg(target_os = "linux")]
            CopyMode::Splice => {
                let next = read_through(src, to)?;
                *bulk = next.1;
                Ok(next.0)
            }
            _ => buffered_in(src, BUF),
        }
    }
}

/// Moves what a leased pipe holds to `dst`, as far as it takes it; true
/// when the pipe is empty.
#[cfg(target_os = "linux")]
#[inline]
fn drain_pipe(
    lease: &mut crate::splice::Lease<'_>,
    dst: &TcpStream,
    count: &dyn Tally,
    moved: &mut bool,
) -> io::Result<bool> {
    let left = lease.in_flight;
    let dst_fd = std::os::fd::AsRawFd::as_raw_fd(dst);
    match dst.try_io(Interest::WRITABLE, || lease.pipe().drain_to(dst_fd, left)) {
        Ok(m) => {
            let m = m.min(left);
            lease.in_flight -= m;
            count.add(m as u64);
            *moved = true;
            Ok(lease.in_flight == 0)
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `buf[*pos..]` to `dst`, as far as it takes it; true when all is
/// written.
#[inline]
fn write_buffer(
    buf: &[u8],
    pos: &mut usize,
    dst: &TcpStream,
    count: &dyn Tally,
    moved: &mut bool,
) -> io::Result<bool> {
    match dst.try_write(&buf[*pos..]) {
        Ok(0) => Err(io::ErrorKind::WriteZero.into()),
        Ok(m) => {
            *pos += m;
            count.add(m as u64);
            *moved = true;
            Ok(*pos == buf.len())
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e),
    }
}

/// The limit on a half-closed connection: how long it may move nothing
/// once one direction ended.
struct HalfClosed {
    /// Armed (boxed: most copies never need it) when one direction ends.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    limit: Duration,
}

impl HalfClosed {
    /// Restarts the limit when bytes `moved` or the destination of the
    /// ended direction (`delivering`) still holds unsent bytes; ends the
    /// copy when the limit passes.
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        moved: bool,
        delivering: &TcpStream,
        up_ended: bool,
    ) -> Poll<io::Result<()>> {
        let limit = self.limit;
        let t = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if moved {
            t.as_mut().reset(tokio::time::Instant::now() + limit);
        }
        loop {
            match t.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) if sockopt::unsent_bytes(delivering) > 0 => {
                    t.as_mut().reset(tokio::time::Instant::now() + limit);
                }
                // The client sent FIN and the upstream never answered: an
                // abort (both reset), so the client cannot take the silence
                // for an empty answer.
                Poll::Ready(()) if up_ended => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "half-closed connection moved nothing within its limit",
                    )))
                }
                // The upstream finished (its FIN was passed on and
                // everything it sent was acknowledged) and the client
                // neither sends nor closes: the answer is complete, so the
                // end is an ordinary close.
                Poll::Ready(()) => return Poll::Ready(Ok(())),
            }
        }
    }
}

/// One direction of a copy.
enum Dir<'p> {
    /// Waiting for the source to become readable; holds nothing.
    Idle,
    /// Bytes are in a leased pipe, waiting for the destination.
    #[cfg(target_os = "linux")]
    Spliced(crate::splice::Lease<'p>),
    /// Bytes are in a user-space buffer that lives only for this chunk.
    Buffered {
        buf: Vec<u8>,
        pos: usize,
        end: usize,
    },
    /// EOF seen and propagated.
    Done,
    /// Elsewhere the lifetime is only used by the splice state.
    #[cfg(not(target_os = "linux"))]
    #[allow(dead_code)]
    Unused(std::marker::PhantomData<&'p ()>),
}

/// Moves one chunk from `src` into the leased pipe. `None`: the source was
/// not actually readable (spurious wake-up; the readiness is cleared).
#[cfg(target_os = "linux")]
fn splice_in<'p>(
    src: &TcpStream,
    mut lease: crate::splice::Lease<'p>,
) -> io::Result<Option<Dir<'p>>> {
    let src_fd = std::os::fd::AsRawFd::as_raw_fd(src);
    match src.try_io(Interest::READABLE, || {
        lease.pipe().fill_from(src_fd, lease.pipe().capacity)
    }) {
        Ok(0) => Ok(Some(Dir::Done)),
        Ok(n) => {
            lease.in_flight = n;
            Ok(Some(Dir::Spliced(lease)))
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// One of a direction's first reads: up to [`FIRST_READS`] bytes into a
/// stack buffer, written on to `dst` at once; only what `dst` does not
/// take is kept, in a buffer of its size. A request/response exchange
/// then allocates nothing per read (a fresh 4 KiB buffer per read, freed
/// a moment later, cost the allocator more than the copy). Also returns
/// whether the read filled the buffer (the direction carries bulk).
#[cfg(target_os = "linux")]
fn read_through<'p>(
    src: &TcpStream,
    (dst, count, moved): (&TcpStream, &dyn Tally, &mut bool),
) -> io::Result<(Option<Dir<'p>>, bool)> {
    let mut stack = [0u8; FIRST_READS];
    let end = match read_drained(src, FIRST_READS, || src.try_read(&mut stack)) {
        Ok(0) => return Ok((Some(Dir::Done), false)),
        Ok(end) => end,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok((None, false)),
        Err(e) => return Err(e),
    };
    let mut pos = 0;
    let next = if write_buffer(&stack[..end], &mut pos, dst, count, moved)? {
        Dir::Idle
    } else {
        let buf = stack[pos..end].to_vec();
        let end = buf.len();
        Dir::Buffered { buf, pos: 0, end }
    };
    Ok((Some(next), end >= FIRST_READS))
}

/// Reads up to `cap` bytes from `src` into a fresh buffer (not zeroed
/// first); as [`splice_in`].
fn buffered_in<'p>(src: &TcpStream, cap: usize) -> io::Result<Option<Dir<'p>>> {
    let mut buf = Vec::with_capacity(cap);
    match read_drained(src, cap, || src.try_read_buf(&mut buf)) {
        Ok(0) => Ok(Some(Dir::Done)),
        Ok(end) => Ok(Some(Dir::Buffered { buf, pos: 0, end })),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// Runs `read` (a read of at most `cap` bytes from `src`). When it comes
/// back short, the receive queue was drained: `src`'s read readiness is
/// cleared as part of the same readiness event, so the next poll waits
/// for epoll rather than trying a read that would only find nothing (one
/// system call fewer per message; nginx does the same over edge-triggered
/// epoll). Bytes or a FIN arriving later raise a new edge, and a FIN
/// already seen stays seen (tokio never clears the closed states). The
/// readiness is taken before the read, so an event that came in meanwhile
/// (another thread's driver) is not lost: tokio then leaves it set.
/// `cap` is the most `read` may return (a read that fills it is not
/// short). As tokio's own `poll_read`, this takes a short read for a
/// drained queue, which TCP urgent data (a read stops at its mark) can
/// belie: only the connection that sends it waits for its next bytes.
pub fn read_drained(
    src: &TcpStream,
    cap: usize,
    read: impl FnOnce() -> io::Result<usize>,
) -> io::Result<usize> {
    let mut got = None;
    let r = src.try_io(Interest::READABLE, || {
        let n = read()?;
        got = Some(n);
        if n > 0 && n < cap {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match (r, got) {
        (Err(e), Some(n)) if e.kind() == io::ErrorKind::WouldBlock => Ok(n),
        (r, _) => r,
    }
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
