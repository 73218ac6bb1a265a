//! Socket options and process limits.

use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;

/// TCP keepalive settings applied to both sides of every proxied connection.
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    /// Idle time before the first probe.
    pub time: Duration,
    /// Interval between probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub retries: u32,
}

/// Enables keepalive and disables Nagle on a socket. Set on a listening
/// socket, Linux copies both to every accepted socket, which saves five
/// system calls per connection.
pub fn tune(sock: SockRef<'_>, ka: Keepalive) -> std::io::Result<()> {
    sock.set_nodelay(true)?;
    let params = TcpKeepalive::new()
        .with_time(ka.time)
        .with_interval(ka.interval);
    #[cfg(any(target_os = "linux", target_os = "macos", target_os = "freebsd"))]
    let params = params.with_retries(ka.retries);
    sock.set_tcp_keepalive(&params)
}

/// Arms `SO_LINGER` with a zero timeout so that closing the socket sends RST.
pub fn arm_reset(stream: &TcpStream) {
    let _ = SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

/// Raises the soft open-file limit to the hard limit and returns the limit in
/// force afterwards.
pub fn raise_nofile_limit() -> u64 {
    #[cfg(unix)]
    {
        rlimit::raise()
    }
    #[cfg(not(unix))]
    {
        8192
    }
}

/// Bytes written to `stream` that its peer has not acknowledged yet (the
/// kernel's send queue, `SIOCOUTQ`); 0 where unknown.
pub fn unsent_bytes(stream: &TcpStream) -> usize {
    #[cfg(target_os = "linux")]
    {
        outq::get(std::os::fd::AsRawFd::as_raw_fd(stream))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = stream;
        0
    }
}

#[cfg(target_os = "linux")]
mod outq {
    #![allow(unsafe_code)]

    pub fn get(fd: std::os::fd::RawFd) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (= SIOCOUTQ for TCP sockets) writes one int.
        if unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) } != 0 {
            return 0;
        }
        usize::try_from(n).unwrap_or(0)
    }
}

#[cfg(unix)]
mod rlimit {
    #![allow(unsafe_code)]

    pub fn raise() -> u64 {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            // SAFETY: `want` is a valid rlimit; failure leaves the old limit.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        lim.rlim_cur
    }
}
