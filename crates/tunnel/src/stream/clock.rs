//! The drivers' clock: tokio's, read as a `std::time::Instant` for the
//! link machines, which take the time as an argument. Outside tests it is
//! the system's monotonic clock; under tokio's paused test clock it is the
//! paused one, so a driver's timeout (a dial's deadline, a stall, a silent
//! agent) can be tested in virtual time, and the machine and the driver's
//! sleeps read the same clock.

/// Now, on the clock the drivers sleep on.
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}
