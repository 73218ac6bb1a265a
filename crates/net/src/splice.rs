//! Thin, safe wrappers over pipe2(2) and splice(2).
//!
//! No maintained crate offers a nonblocking splice that fits tokio's
//! readiness model (`try_io`), so the two syscalls are wrapped here; this is
//! the only `unsafe` in seedlink. Pipes are pooled: an idle connection holds
//! none, an active direction borrows one only while bytes are in flight.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

/// Pipe capacity asked for (and so the most bytes moved per splice call).
/// Four times the kernel default: a quarter of the system calls per byte.
/// Pipe pages are only held while bytes are in flight.
const PIPE_SIZE: libc::c_int = 256 * 1024;

/// A nonblocking pipe used as the kernel-side buffer between two sockets.
pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Bytes the pipe can hold.
    pub capacity: usize,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid two-element array for pipe2 to fill.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and owned by us.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: fcntl on a pipe descriptor we own. Failure (a lower
        // pipe-max-size) leaves the default size, which is fine.
        let size = unsafe {
            libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE);
            libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ)
        };
        let capacity = usize::try_from(size).unwrap_or(64 * 1024).max(4096);
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }

    /// Moves up to `len` bytes from socket `src` into the pipe.
    pub fn fill_from(&self, src: RawFd, len: usize) -> io::Result<usize> {
        splice(src, self.write.as_raw_fd(), len)
    }

    /// Moves up to `len` bytes from the pipe into socket `dst`.
    pub fn drain_to(&self, dst: RawFd, len: usize) -> io::Result<usize> {
        splice(self.read.as_raw_fd(), dst, len)
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are open for the duration of the call (borrowed
    // from live sockets/pipes by the caller); null offsets are valid for
    // sockets and pipes.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// A bounded pool of empty pipes shared by all connections.
pub struct PipePool {
    free: Mutex<Vec<Pipe>>,
    created: std::sync::atomic::AtomicUsize,
    max: usize,
}

impl PipePool {
    /// A pool that creates at most `max` pipes (each holds two descriptors).
    pub fn new(max: usize) -> PipePool {
        PipePool {
            free: Mutex::new(Vec::new()),
            created: std::sync::atomic::AtomicUsize::new(0),
            max,
        }
    }

    /// Pipes that exist (each holds two descriptors) and, of those, the
    /// ones idle in the pool. After a burst the pool keeps what it created,
    /// up to its cap, so a process holds `2 × open` descriptors more than
    /// its connections: expected, not a leak.
    pub fn counts(&self) -> (usize, usize) {
        let idle = crate::sync::lock(&self.free, "pipe pool").len();
        (
            self.created.load(std::sync::atomic::Ordering::Acquire),
            idle,
        )
    }

    fn lease(&self, pipe: Pipe) -> Lease<'_> {
        Lease {
            pipe: Some(pipe),
            pool: self,
            in_flight: 0,
        }
    }

    /// Takes an empty pipe, creating one if the pool is below its cap.
    /// `None` means the caller should copy through user space this time.
    pub fn get(&self) -> Option<Lease<'_>> {
        use std::sync::atomic::Ordering;
        let reused = crate::sync::lock(&self.free, "pipe pool").pop();
        if let Some(pipe) = reused {
            return Some(self.lease(pipe));
        }
        if self
            .created
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                (c < self.max).then_some(c + 1)
            })
            .is_err()
        {
            return None;
        }
        match Pipe::new() {
            Ok(pipe) => Some(self.lease(pipe)),
            Err(_) => {
                self.created.fetch_sub(1, Ordering::AcqRel);
                None
            }
        }
    }
}

/// A pipe borrowed from the pool. It goes back to the pool on drop when it
/// is empty; a pipe dropped with bytes still inside (the connection failed
/// mid-transfer) is closed instead, and its slot freed.
pub struct Lease<'a> {
    pipe: Option<Pipe>,
    pool: &'a PipePool,
    /// Bytes spliced in and not yet spliced out.
    pub in_flight: usize,
}

impl Lease<'_> {
    /// The leased pipe.
    pub fn pipe(&self) -> &Pipe {
        // Invariant: `pipe` is Some until drop.
        match &self.pipe {
            Some(p) => p,
            None => unreachable!("lease used after drop"),
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let Some(pipe) = self.pipe.take() else { return };
        if self.in_flight == 0 {
            crate::sync::lock(&self.pool.free, "pipe pool").push(pipe);
            return;
        }
        drop(pipe);
        self.pool
            .created
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}
