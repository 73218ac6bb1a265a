//! Connecting to a destination's resolved addresses Happy Eyeballs style
//! (RFC 8305): the families interleaved, a new attempt started every
//! [`ATTEMPT_DELAY`] while none has connected (or at once when one
//! fails), the first connection kept and the others dropped. Tried one
//! after another, a first address that never answers (a black-holed IPv6
//! route, a node gone) took the whole dial timeout, and the addresses
//! after it were never tried. tokio connects one address at a time and no
//! well-kept crate does this for a tokio `TcpStream` without a resolver
//! of its own; the agent resolves itself (its destination policy filters
//! the addresses first), so this is written here.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::net::TcpStream;

use crate::wire::dial_error::DialFailure;

/// RFC 8305's recommended Connection Attempt Delay.
pub(super) const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

/// The most addresses of one destination tried (a name may resolve to
/// many): the sockets one dial holds stay bounded.
pub(super) const MOST_ADDRESSES: usize = 16;

/// `addrs` with the families taking turns, the first address's first
/// (RFC 8305 section 4), at most [`MOST_ADDRESSES`].
pub(super) fn interleave(addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
    let first_v6 = addrs.first().is_some_and(SocketAddr::is_ipv6);
    let (first, other): (Vec<_>, Vec<_>) = addrs.into_iter().partition(|a| a.is_ipv6() == first_v6);
    let (mut first, mut other) = (first.into_iter(), other.into_iter());
    let mut out = Vec::new();
    while out.len() < MOST_ADDRESSES {
        match (first.next(), other.next()) {
            (None, None) => break,
            (a, b) => out.extend(a.into_iter().chain(b)),
        }
    }
    out.truncate(MOST_ADDRESSES);
    out
}

/// Connects to the first of `addrs` to answer (see the module); the last
/// failure if none does. The caller bounds the whole (the dial timeout).
pub(super) async fn connect_any(
    address: &str,
    addrs: Vec<SocketAddr>,
) -> Result<TcpStream, DialFailure> {
    let mut pending = interleave(addrs).into_iter();
    let mut attempts = FuturesUnordered::new();
    let mut last = DialFailure::other(format!("dial tcp {address}: no address"));
    loop {
        if attempts.is_empty() {
            match pending.next() {
                Some(a) => attempts.push(TcpStream::connect(a)),
                None => return Err(last),
            }
        }
        let more = pending.len() > 0;
        tokio::select! {
            Some(r) = attempts.next() => match r {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => {
                    last = DialFailure::io(address, &e);
                    if let Some(a) = pending.next() {
                        attempts.push(TcpStream::connect(a));
                    }
                }
            },
            () = tokio::time::sleep(ATTEMPT_DELAY), if more => {
                if let Some(a) = pending.next() {
                    attempts.push(TcpStream::connect(a));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listening socket that never answers a new connection: its
    /// accept queue (of one) is full and never taken, so the kernel drops
    /// every further SYN, as a black-holed route does.
    fn black_hole() -> (socket2::Socket, std::net::TcpStream) {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        s.listen(0).unwrap();
        let at = s.local_addr().unwrap().as_socket().unwrap();
        let filler = std::net::TcpStream::connect(at).unwrap();
        (s, filler)
    }

    /// The families take turns, the first address's family first.
    #[test]
    fn the_families_take_turns() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let got = interleave(vec![
            a("[fd00::1]:1"),
            a("[fd00::2]:1"),
            a("[fd00::3]:1"),
            a("10.0.0.1:1"),
        ]);
        let want = [
            a("[fd00::1]:1"),
            a("10.0.0.1:1"),
            a("[fd00::2]:1"),
            a("[fd00::3]:1"),
        ];
        assert_eq!(got, want);
        let many: Vec<SocketAddr> = (0..40).map(|i| a(&format!("10.0.0.{i}:1"))).collect();
        assert_eq!(interleave(many).len(), MOST_ADDRESSES);
    }

    /// A first address that never answers does not hold the dial: the
    /// next one is tried meanwhile and connects. (One after another, the
    /// dial waited on the black hole for the kernel's SYN retries, about
    /// two minutes: the bound here is a generous one between the two.)
    #[tokio::test]
    async fn a_black_holed_first_address_does_not_hold_the_dial() {
        let (hole, _filler) = black_hole();
        let hole = hole.local_addr().unwrap().as_socket().unwrap();
        let good = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = good.local_addr().unwrap();
        let dial = connect_any("example:443", vec![hole, at]);
        let s = tokio::time::timeout(Duration::from_secs(30), dial)
            .await
            .expect("the dial waited on the black hole")
            .unwrap();
        assert_eq!(s.peer_addr().unwrap(), at);
    }

    /// Every address refused: the last failure, after each was tried. The
    /// addresses are sockets bound and not listening: refused, and held
    /// here so that no other test takes their ports meanwhile.
    #[tokio::test]
    async fn every_address_refused_is_the_last_failure() {
        let bound: Vec<socket2::Socket> = (0..3)
            .map(|_| {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                    .unwrap();
                s.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
                    .unwrap();
                s
            })
            .collect();
        let addrs: Vec<SocketAddr> = bound
            .iter()
            .map(|s| s.local_addr().unwrap().as_socket().unwrap())
            .collect();
        let e = connect_any("example:443", addrs).await.unwrap_err();
        assert!(e.text.contains("refused"), "{}", e.text);
    }
}
