//! seedlink's networking runtime, shared by every role.
//!
//! - [`accept`]: an accept loop that never exits on resource errors and never spins.
//! - [`admin`]: a small HTTP/1.1 admin endpoint (health, readiness, metrics).
//! - [`copy`]: moves bytes between two TCP sockets with `splice(2)` on Linux (buffered
//!   fallback elsewhere and when no pipe is free), propagating half-close and resets.
//! - [`egress`]: leaving through a corporate HTTP CONNECT proxy (node-proxy, tunnel-agent).
//! - [`h2copy`]: moves bytes between a socket and an HTTP/2 CONNECT stream, within h2 flow control.
//! - [`sockopt`]: keepalive, linger and file-descriptor limits.
//! - [`lifecycle`]: the process phase (starting, serving, draining) that readiness reports.
//! - [`rate`]: a token bucket per source address (anonymous peers' handshakes).
//! - [`lowprio`]: a runtime on a lower-priority thread (handshakes anyone can ask for).
//! - [`memtrim`]: gives freed memory back to the system after a burst (glibc).
//! - [`sync`]: mutex locking that reports poisoning (a bug) instead of skipping work.
//! - [`written`]: files this process writes itself, versioned, so their readers need no `stat`.

pub mod accept;
pub mod admin;
pub mod clock;
pub mod copy;
pub mod egress;
pub mod h2copy;
pub mod handoff;
pub mod lifecycle;
pub mod loglimit;
pub mod lowprio;
pub mod memtrim;
pub mod prefixed;
pub mod rate;
pub mod sockopt;
#[cfg(target_os = "linux")]
mod splice;
pub mod synblock;
pub mod sync;
pub mod written;
