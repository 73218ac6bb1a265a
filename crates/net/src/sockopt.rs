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

/// How long the kernel holds a connection that has sent nothing before
/// handing it to `accept` (`TCP_DEFER_ACCEPT`; nginx's `deferred` and
/// HAProxy's `defer-accept` use the same second).
pub const DEFER_ACCEPT_SECS: u32 = 1;

/// A proxy's listening socket: [`tune`]d for the sockets it accepts, and
/// accept deferred ([`DEFER_ACCEPT_SECS`]) until the client's first bytes
/// (for listeners whose client speaks first).
pub fn tune_listener(sock: SockRef<'_>, ka: Keepalive) -> std::io::Result<()> {
    tune(SockRef::from(&*sock), ka)?;
    defer_accept(sock, DEFER_ACCEPT_SECS)
}

/// Sets `TCP_DEFER_ACCEPT` on a listening socket: the kernel hands a
/// connection to `accept` only once its first bytes have arrived (or,
/// for a peer that sends nothing, after about `secs` seconds). For
/// protocols where the client speaks first (a ClientHello, a PROXY
/// header, a CONNECT request) this saves a wake-up and a read that would
/// find nothing per connection, and a connection that never sends holds
/// no slot of ours until then. socket2 has no call for it; elsewhere than
/// Linux this does nothing.
pub fn defer_accept(sock: SockRef<'_>, secs: u32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        deferaccept::set(std::os::fd::AsRawFd::as_raw_fd(&*sock), secs)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (sock, secs);
        Ok(())
    }
}

#[cfg(target_os = "linux")]
mod deferaccept {
    #![allow(unsafe_code)]

    pub fn set(fd: std::os::fd::RawFd, secs: u32) -> std::io::Result<()> {
        let v = libc::c_int::try_from(secs).unwrap_or(libc::c_int::MAX);
        // SAFETY: TCP_DEFER_ACCEPT takes one int, passed by pointer with its size.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_DEFER_ACCEPT,
                std::ptr::from_ref(&v).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// The option in force (the kernel rounds it to its retransmission
    /// schedule).
    #[cfg(test)]
    pub fn get(fd: std::os::fd::RawFd) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_DEFER_ACCEPT,
                std::ptr::from_mut(&mut v).cast(),
                &mut len,
            )
        };
        if r == 0 {
            v
        } else {
            -1
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn the_listener_defers_accept() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&l);
        assert_eq!(super::deferaccept::get(fd), 0);
        super::defer_accept(socket2::SockRef::from(&l), 1).unwrap();
        let got = super::deferaccept::get(fd);
        assert!(got >= 1, "TCP_DEFER_ACCEPT not in force: {got}");
    }
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
