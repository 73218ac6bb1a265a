//! Per-connection flow control between seedlink components, negotiated on
//! top of the Konnectivity protocol: the agent asks with the request header
//! `seedlink-flow-control: v1`, the server agrees with the same response
//! header, and from then on both sides send a connection's DATA only within
//! a window of [`WINDOW`] bytes that the receiver reopens with WINDOW_UPDATE
//! packets (a seedlink extension, type 100) after writing the bytes to its
//! socket. A reader that stops reading then holds back only its own
//! connection, end to end, and nothing is lost or closed; upstream
//! Konnectivity peers never see the header or the packet.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// Header (request and response) that enables flow control.
pub const HEADER: &str = "seedlink-flow-control";
/// Its value.
pub const VERSION: &str = "v1";
/// Bytes a sender may have unacknowledged per connection and direction
/// (measured on loopback: 256 KiB held one download to ≈ 2.4 Gbit/s, 2 MiB
/// reached ≈ 3.4). Memory is only used while a reader lags.
pub const WINDOW: usize = 2 * 1024 * 1024;
/// Credit is returned once this much was written (a quarter window).
pub const RETURN_AT: usize = WINDOW / 4;

/// The sending side's credit for one connection.
#[derive(Clone)]
pub struct SendCredit(Arc<Semaphore>);

impl Default for SendCredit {
    fn default() -> Self {
        SendCredit::new()
    }
}

impl SendCredit {
    /// A full window.
    pub fn new() -> SendCredit {
        SendCredit(Arc::new(Semaphore::new(WINDOW)))
    }

    /// Waits for `n` bytes of window (n ≤ [`WINDOW`]) and uses them. Fails
    /// when the connection is closed.
    pub async fn take(&self, n: usize) -> Result<(), ()> {
        let n = u32::try_from(n.min(WINDOW)).map_err(|_| ())?;
        let p = self.0.acquire_many(n).await.map_err(|_| ())?;
        p.forget();
        Ok(())
    }

    /// The receiver reopened `n` bytes. More than a window outstanding is a
    /// protocol error (`false`).
    pub fn give(&self, n: i64) -> bool {
        let Ok(n) = usize::try_from(n) else {
            return false;
        };
        if n == 0 || self.0.available_permits() + n > WINDOW {
            return false;
        }
        self.0.add_permits(n);
        true
    }

    /// Wakes a waiting sender with an error (the connection is gone).
    pub fn close(&self) {
        self.0.close();
    }
}

/// The receiving side's count of bytes written but not yet acknowledged.
#[derive(Default)]
pub struct Unacked(usize);

impl Unacked {
    /// `n` more bytes were written; returns the credit to send back now, if
    /// enough has gathered.
    pub fn written(&mut self, n: usize) -> Option<i64> {
        self.0 += n;
        if self.0 >= RETURN_AT {
            let v = i64::try_from(self.0).unwrap_or(i64::MAX);
            self.0 = 0;
            Some(v)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_window_is_used_and_reopened() {
        let c = SendCredit::new();
        c.take(WINDOW).await.unwrap();
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(30), c.take(1)).await;
        assert!(waiting.is_err(), "no window left");
        assert!(c.give(1000));
        c.take(1000).await.unwrap();
        // Reopening more than a window is refused.
        assert!(!c.give(i64::try_from(WINDOW).unwrap() + 1));
        assert!(!c.give(-5));
        c.close();
        assert!(c.take(1).await.is_err());
    }

    #[test]
    fn credit_is_returned_in_quarter_windows() {
        let mut u = Unacked::default();
        assert_eq!(u.written(RETURN_AT - 1), None);
        assert_eq!(u.written(1), Some(i64::try_from(RETURN_AT).unwrap()));
        assert_eq!(u.written(10), None);
    }
}
