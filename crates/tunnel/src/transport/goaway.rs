//! Notices the error code of an HTTP/2 GOAWAY the server sends. hyper ends
//! the connection cleanly on a GOAWAY and does not expose its code, but
//! the agent must know when upstream's proxy-server said `too_many_pings`
//! (GOAWAY with ENHANCE_YOUR_CALM) to ping less often. This wrapper sits
//! under the HTTP/2 client and follows the server's frame headers (9 bytes
//! each, payloads skipped without being read twice); hand-written because
//! no HTTP/2 crate offers a frame observer.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::transport::tap::{OnRead, ReadTap};

/// HTTP/2 frame type GOAWAY (RFC 9113 §6.8).
const GOAWAY: u8 = 0x7;
/// Error code ENHANCE_YOUR_CALM (RFC 9113 §7): grpc-go's `too_many_pings`.
pub const ENHANCE_YOUR_CALM: u32 = 0xb;
/// No GOAWAY seen.
const NONE: u32 = u32::MAX;

/// The last GOAWAY error code the server sent, shared with the wrapper.
#[derive(Clone, Debug)]
pub struct Seen(Arc<AtomicU32>);

impl Seen {
    /// The error code of the last GOAWAY received, if any.
    pub fn code(&self) -> Option<u32> {
        match self.0.load(Ordering::Acquire) {
            NONE => None,
            c => Some(c),
        }
    }
}

/// Frame-boundary tracking over the server's byte stream.
#[derive(Default)]
struct Scan {
    hdr: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to pass.
    left: usize,
    /// Inside a GOAWAY payload: its first 8 bytes (last stream ID, code).
    goaway: Option<([u8; 8], usize)>,
}

impl Scan {
    /// Takes bytes of a frame header from `b`; once all nine are in, the
    /// frame's length is known and a GOAWAY's payload is watched for. How
    /// many bytes it took.
    fn header(&mut self, b: &[u8]) -> usize {
        let n = (9 - self.have).min(b.len());
        self.hdr[self.have..self.have + n].copy_from_slice(&b[..n]);
        self.have += n;
        if self.have == 9 {
            self.have = 0;
            let len = usize::from(self.hdr[0]) << 16
                | usize::from(self.hdr[1]) << 8
                | usize::from(self.hdr[2]);
            self.left = len;
            self.goaway = (self.hdr[3] == GOAWAY && len >= 8).then_some(([0; 8], 0));
        }
        n
    }

    /// Follows `b`; returns the code of a GOAWAY completed in it.
    fn feed(&mut self, mut b: &[u8]) -> Option<u32> {
        let mut found = None;
        while !b.is_empty() {
            if self.left == 0 && self.goaway.is_none() {
                b = &b[self.header(b)..];
                continue;
            }
            let n = self.left.min(b.len());
            if let Some((buf, got)) = &mut self.goaway {
                let k = (8 - *got).min(n);
                buf[*got..*got + k].copy_from_slice(&b[..k]);
                *got += k;
                if *got == 8 {
                    found = Some(u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]));
                    self.goaway = None;
                }
            }
            self.left -= n;
            b = &b[n..];
        }
        found
    }
}

/// Follows the server's frames under the HTTP/2 client.
pub struct Watch {
    scan: Scan,
    seen: Seen,
}

impl OnRead for Watch {
    fn on_read(&mut self, bytes: &[u8]) {
        if let Some(code) = self.scan.feed(bytes) {
            self.seen.0.store(code, Ordering::Release);
        }
    }
}

/// An IO whose incoming HTTP/2 frames are watched for GOAWAY.
pub type Sniff<T> = ReadTap<T, Watch>;

/// Wraps the client side of an HTTP/2 connection (the server sends no
/// preface, so its bytes are frames from the first one).
pub fn sniff<T>(inner: T) -> (Sniff<T>, Seen) {
    let seen = Seen(Arc::new(AtomicU32::new(NONE)));
    (
        ReadTap::new(
            inner,
            Watch {
                scan: Scan::default(),
                seen: seen.clone(),
            },
        ),
        seen,
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn frame(ty: u8, payload: &[u8]) -> Vec<u8> {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, ty, 0, 0, 0, 0, 0];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn finds_a_goaway_code_at_every_split() {
        let mut bytes = frame(0x4, &[]);
        bytes.extend(frame(0x0, &[7u8; 300]));
        bytes.extend(frame(0x6, &[0; 8]));
        let mut ga = vec![0, 0, 0, 3, 0, 0, 0, 0xb];
        ga.extend_from_slice(b"too_many_pings");
        bytes.extend(frame(GOAWAY, &ga));
        for split in 0..bytes.len() {
            let mut s = Scan::default();
            let a = s.feed(&bytes[..split]);
            let b = s.feed(&bytes[split..]);
            assert_eq!(a.or(b), Some(ENHANCE_YOUR_CALM), "split at {split}");
        }
        // Byte by byte, and a DATA payload that looks like a GOAWAY header.
        let mut s = Scan::default();
        let mut tricky = frame(0x0, &frame(GOAWAY, &[0, 0, 0, 0, 0, 0, 0, 0xb]));
        tricky.extend(frame(GOAWAY, &[0, 0, 0, 1, 0, 0, 0, 0]));
        let got: Vec<u32> = tricky.iter().filter_map(|b| s.feed(&[*b])).collect();
        assert_eq!(got, vec![0]);
    }
}
