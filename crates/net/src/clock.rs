//! A process-local monotonic clock in milliseconds, for deadlines kept in
//! atomics (an `Instant` does not fit one).

use std::sync::OnceLock;
use std::time::Instant;

/// Milliseconds since the first call.
pub fn now_ms() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_millis()).unwrap_or(u64::MAX)
}
