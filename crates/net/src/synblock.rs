//! Sources shut out at the listening socket: a bounded list of source
//! addresses (an IPv4 address, an IPv6 /64) whose new connections the
//! kernel drops before answering them, for a while.
//!
//! Refusing a connection in user space (accept, then close) comes after
//! the kernel has completed its TCP handshake, and tells the peer to try
//! again at once: a source that connects in a loop costs the host
//! thousands of handshakes a second, outside any thread priority. A
//! classic BPF filter on the listening socket (`SO_ATTACH_FILTER`) that
//! drops the source's SYNs makes the kernel neither answer nor queue
//! them, and the peer's own TCP stack backs off (1 s, 3 s, 7 s…).
//!
//! Hand-written: the filter is a few instructions per source, built with
//! socket2's `attach_filter`; an eBPF loader crate would add a toolchain
//! and privileges for the same comparison.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// The most sources a list holds: the filter stays well under the
/// kernel's 4,096 instructions (5 per IPv6 source). Past it, no further
/// source is shut out (their connections are still refused one by one).
pub const MAX_BLOCKED: usize = 512;

/// Offset of the network header in a socket filter (`SKF_NET_OFF`).
const NET: u32 = (-0x0010_0000i32) as u32;
/// Offset of the TCP flags in the TCP header, where the filter starts.
const TCP_FLAGS: u32 = 13;
const SYN: u32 = 0x02;
const ACCEPT: u32 = u32::MAX;
const DROP: u32 = 0;

// Classic BPF opcodes (linux/filter.h): class | size | mode.
const fn op(parts: &[u32]) -> u16 {
    let mut code = 0;
    let mut i = 0;
    while i < parts.len() {
        code |= parts[i];
        i += 1;
    }
    code as u16
}
const LD_W_ABS: u16 = op(&[libc::BPF_LD, libc::BPF_W, libc::BPF_ABS]);
const LD_B_ABS: u16 = op(&[libc::BPF_LD, libc::BPF_B, libc::BPF_ABS]);
const ALU_RSH_K: u16 = op(&[libc::BPF_ALU, libc::BPF_RSH, libc::BPF_K]);
const JMP_JEQ_K: u16 = op(&[libc::BPF_JMP, libc::BPF_JEQ, libc::BPF_K]);
const JMP_JSET_K: u16 = op(&[libc::BPF_JMP, libc::BPF_JSET, libc::BPF_K]);
const JMP_JA: u16 = op(&[libc::BPF_JMP, libc::BPF_JA]);
const RET_K: u16 = op(&[libc::BPF_RET, libc::BPF_K]);

/// Sources shut out until a moment each.
pub struct Blocklist {
    hold: Duration,
    /// Whether a filter is attached now (accepted sockets shed theirs).
    attached: std::sync::atomic::AtomicBool,
    until: Mutex<HashMap<IpAddr, Instant>>,
    changed: tokio::sync::Notify,
}

impl Blocklist {
    /// A list whose sources stay shut out for `hold` each.
    pub fn new(hold: Duration) -> Blocklist {
        Blocklist {
            hold,
            attached: std::sync::atomic::AtomicBool::new(false),
            until: Mutex::new(HashMap::new()),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// Shuts `ip`'s source out from `now` for the hold: whether it was
    /// added (not when already listed, or the list is full).
    pub fn block(&self, ip: IpAddr, now: Instant) -> bool {
        let key = crate::admin::source_key(ip);
        let mut m = crate::sync::lock(&self.until, "blocklist");
        m.retain(|_, until| *until > now);
        if m.contains_key(&key) || m.len() >= MAX_BLOCKED {
            return false;
        }
        m.insert(key, now + self.hold);
        drop(m);
        self.changed.notify_waiters();
        true
    }

    /// Whether `ip`'s source is shut out at `now`.
    pub fn is_blocked(&self, ip: IpAddr, now: Instant) -> bool {
        let key = crate::admin::source_key(ip);
        crate::sync::lock(&self.until, "blocklist")
            .get(&key)
            .is_some_and(|until| *until > now)
    }

    /// The sources listed at `now`, and when the next one leaves.
    fn current(&self, now: Instant) -> (Vec<IpAddr>, Option<Instant>) {
        let mut m = crate::sync::lock(&self.until, "blocklist");
        m.retain(|_, until| *until > now);
        let mut ips: Vec<IpAddr> = m.keys().copied().collect();
        ips.sort();
        (ips, m.values().min().copied())
    }

    /// Keeps `listener`'s filter equal to the list until `stop`: attached
    /// while a source is listed, detached when none is. A filter the
    /// kernel refuses is logged, and those sources are refused in user
    /// space as before.
    pub async fn enforce<L: AsFd>(&self, listener: &L, stop: &CancellationToken) {
        let mut applied: Option<Vec<IpAddr>> = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let next = self.apply(listener, &mut applied);
            let expiry = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = changed => {}
                () = expiry => {}
            }
        }
    }

    /// Sets `listener`'s filter to the list now, unless it is `applied`
    /// already: when the next source leaves it.
    fn apply<L: AsFd>(&self, listener: &L, applied: &mut Option<Vec<IpAddr>>) -> Option<Instant> {
        let (ips, next) = self.current(Instant::now());
        if applied.as_ref() == Some(&ips) {
            return next;
        }
        match set_filter(listener, &ips) {
            Ok(()) => {
                self.attached
                    .store(!ips.is_empty(), std::sync::atomic::Ordering::Release);
                *applied = Some(ips);
            }
            Err(e) => {
                // The kernel keeps the previous filter when it refuses a
                // new one (for its size, against `net.core.optmem_max`):
                // drop it, so that no source stays shut out past its hold,
                // and refuse the listed sources in user space until the
                // list changes (then the filter is tried again).
                tracing::warn!(error = %e, sources = ips.len(), "cannot filter shut-out sources at the listening socket; refusing them at accept instead");
                let _ = set_filter(listener, &[]);
                self.attached
                    .store(false, std::sync::atomic::Ordering::Release);
                *applied = Some(ips);
            }
        }
        next
    }

    /// Takes the filter off a socket accepted from `listener` (it inherits
    /// the listener's filter as it was then, and would keep that copy, and
    /// run it on every packet, for its life). One system call, only while
    /// a filter is attached.
    pub fn release<S: AsFd>(&self, accepted: &S) {
        if self.attached.load(std::sync::atomic::Ordering::Acquire) {
            let _ = socket2::SockRef::from(accepted).detach_filter();
        }
    }
}

/// Attaches the filter for `ips` to `listener`, or detaches it if empty.
fn set_filter<L: AsFd>(listener: &L, ips: &[IpAddr]) -> std::io::Result<()> {
    let sock = socket2::SockRef::from(listener);
    if ips.is_empty() {
        return match sock.detach_filter() {
            // None was attached.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        };
    }
    sock.attach_filter(&program(ips))
}

/// The filter: a packet without SYN passes (the filter is inherited by
/// accepted connections, which then pay three instructions a packet); a
/// SYN from a listed source is dropped; anything else passes.
fn program(ips: &[IpAddr]) -> Vec<libc::sock_filter> {
    let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let v4: Vec<u32> = ips
        .iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(a) => Some(u32::from(*a)),
            IpAddr::V6(_) => None,
        })
        .collect();
    let v6: Vec<(u32, u32)> = ips
        .iter()
        .filter_map(|ip| match ip {
            IpAddr::V6(a) => {
                let o = a.octets();
                let word = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
                Some((word(0), word(4)))
            }
            IpAddr::V4(_) => None,
        })
        .collect();
    // 0-2: not a SYN → accept. 3-5: the IP version; 4 → 6, else → 7.
    // 6: jump over the IPv6 list (`ja` has a 32-bit offset; the short
    // jumps stay within one entry).
    let mut p = vec![
        op(LD_B_ABS, 0, 0, TCP_FLAGS),
        op(JMP_JSET_K, 1, 0, SYN),
        op(RET_K, 0, 0, ACCEPT),
        op(LD_B_ABS, 0, 0, NET),
        op(ALU_RSH_K, 0, 0, 4),
        op(JMP_JEQ_K, 0, 1, 4),
        op(JMP_JA, 0, 0, (v6.len() * 5 + 1) as u32),
    ];
    // IPv6: the source's first 64 bits, at offsets 8 and 12.
    for (hi, lo) in &v6 {
        p.push(op(LD_W_ABS, 0, 0, NET.wrapping_add(8)));
        p.push(op(JMP_JEQ_K, 0, 3, *hi));
        p.push(op(LD_W_ABS, 0, 0, NET.wrapping_add(12)));
        p.push(op(JMP_JEQ_K, 0, 1, *lo));
        p.push(op(RET_K, 0, 0, DROP));
    }
    p.push(op(RET_K, 0, 0, ACCEPT));
    // IPv4: the source at offset 12.
    p.push(op(LD_W_ABS, 0, 0, NET.wrapping_add(12)));
    for a in &v4 {
        p.push(op(JMP_JEQ_K, 0, 1, *a));
        p.push(op(RET_K, 0, 0, DROP));
    }
    p.push(op(RET_K, 0, 0, ACCEPT));
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{SocketAddr, TcpListener};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    /// A listener on loopback and its address.
    fn listener() -> (TcpListener, SocketAddr) {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else {
            panic!("bind");
        };
        let Ok(to) = l.local_addr() else {
            panic!("addr")
        };
        (l, to)
    }

    /// Connects to `to` from `from`: whether the kernel answered within
    /// `wait` (a dropped SYN never is, however long the wait).
    fn answered(from: IpAddr, to: SocketAddr, wait: Duration) -> bool {
        let domain = socket2::Domain::for_address(to);
        let Ok(s) = socket2::Socket::new(domain, socket2::Type::STREAM, None) else {
            return false;
        };
        if s.bind(&SocketAddr::new(from, 0).into()).is_err() {
            return false;
        }
        s.connect_timeout(&to.into(), wait).is_ok()
    }

    /// A listed source's SYNs get no answer, the others' do; the list
    /// empty again, the filter is gone and the source connects.
    #[test]
    fn a_listed_source_gets_no_answer_and_others_do() {
        let (l, to) = listener();
        let list = Blocklist::new(Duration::from_secs(3600));
        let now = Instant::now();
        assert!(list.block(ip("127.0.0.2"), now));
        assert!(!list.block(ip("127.0.0.2"), now), "listed once");
        assert!(list.is_blocked(ip("127.0.0.2"), now));
        assert!(!list.is_blocked(ip("127.0.0.3"), now));
        let mut applied = None;
        assert!(list.apply(&l, &mut applied).is_some());
        // Generous: an answer comes within microseconds on loopback; a
        // dropped SYN is retransmitted after 1 s and dropped again.
        assert!(answered(ip("127.0.0.3"), to, Duration::from_secs(30)));
        assert!(!answered(ip("127.0.0.2"), to, Duration::from_millis(2500)));
        crate::sync::lock(&list.until, "test").clear();
        assert!(list.apply(&l, &mut applied).is_none());
        assert!(answered(ip("127.0.0.2"), to, Duration::from_secs(30)));
    }

    /// An IPv6 source is its /64; IPv4 and IPv6 sources in one filter.
    #[test]
    fn an_ipv6_source_is_its_64() {
        let Ok(l) = TcpListener::bind("[::1]:0") else {
            return; // no IPv6 loopback on this host
        };
        let Ok(to) = l.local_addr() else {
            panic!("addr")
        };
        let list = Blocklist::new(Duration::from_secs(3600));
        let now = Instant::now();
        assert!(list.block(ip("10.1.2.3"), now));
        assert!(list.block(ip("::1"), now));
        assert!(list.is_blocked(ip("::2"), now), "same /64");
        let mut applied = None;
        list.apply(&l, &mut applied);
        assert!(!answered(ip("::1"), to, Duration::from_millis(2500)));
        crate::sync::lock(&list.until, "test").remove(&ip("::"));
        list.apply(&l, &mut applied);
        assert!(answered(ip("::1"), to, Duration::from_secs(30)));
    }

    /// The opcodes are linux/filter.h's.
    #[test]
    fn opcodes_are_the_kernels() {
        assert_eq!(
            [LD_W_ABS, LD_B_ABS, ALU_RSH_K, JMP_JEQ_K, JMP_JSET_K, JMP_JA, RET_K],
            [0x20, 0x30, 0x74, 0x15, 0x45, 0x05, 0x06]
        );
    }

    /// Sources leave when their hold ends; the list is bounded.
    #[test]
    fn sources_leave_after_the_hold_and_the_list_is_bounded() {
        let list = Blocklist::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(list.block(ip("10.0.0.1"), t0));
        assert!(list.block(ip("10.0.0.2"), t0 + Duration::from_secs(5)));
        let (ips, next) = list.current(t0 + Duration::from_secs(1));
        assert_eq!(ips.len(), 2);
        assert_eq!(next, Some(t0 + Duration::from_secs(10)));
        let (ips, _) = list.current(t0 + Duration::from_secs(11));
        assert_eq!(ips, vec![ip("10.0.0.2")]);
        assert!(!list.is_blocked(ip("10.0.0.1"), t0 + Duration::from_secs(11)));
        for i in 0..(MAX_BLOCKED as u32 + 10) {
            list.block(
                IpAddr::from((0x0b00_0000 + i).to_be_bytes()),
                t0 + Duration::from_secs(6),
            );
        }
        let (ips, _) = list.current(t0 + Duration::from_secs(7));
        assert_eq!(ips.len(), MAX_BLOCKED);
        // The largest filter is within the kernel's 4,096 instructions.
        let v6: Vec<IpAddr> = (0..MAX_BLOCKED as u16)
            .map(|i| IpAddr::from([0x2001, 0xdb8, i, 0, 0, 0, 0, 0]))
            .collect();
        assert!(program(&v6).len() < 4096);
    }

    /// The largest list attaches on this host (net.core.optmem_max bounds
    /// a filter's size: where the kernel refuses one, the filter is taken
    /// off and the sources refused at accept instead), and an accepted
    /// socket sheds the copy it inherited.
    #[test]
    fn the_largest_list_attaches_and_accepted_sockets_shed_it() {
        let (l, to) = listener();
        let list = Blocklist::new(Duration::from_secs(3600));
        let now = Instant::now();
        for i in 0..MAX_BLOCKED as u16 {
            list.block(IpAddr::from([0x2001, 0xdb8, i, 0, 0, 0, 0, 0]), now);
        }
        let mut applied = None;
        list.apply(&l, &mut applied);
        let optmem = std::fs::read_to_string("/proc/sys/net/core/optmem_max").unwrap_or_default();
        let attached = list.attached.load(std::sync::atomic::Ordering::Acquire);
        assert!(
            attached || optmem.trim().parse::<u64>().is_ok_and(|m| m < 131_072),
            "a full list did not attach with optmem_max {optmem}"
        );
        // Whether attached or refused, nobody unlisted is shut out.
        assert!(answered(ip("127.0.0.1"), to, Duration::from_secs(30)));
        let Ok((accepted, _)) = l.accept() else {
            panic!("accept")
        };
        list.release(&accepted);
        assert!(
            socket2::SockRef::from(&accepted).detach_filter().is_err(),
            "no filter left"
        );
    }
}
