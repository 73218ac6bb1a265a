//! Fuzzes the tunnel-server's handling of packets from an agent: arbitrary
//! packet sequences (and frontend closes) at arbitrary times against a link
//! with pending dials and open connections. Nothing may panic and the
//! harness's invariants must hold after every step. Deterministic: time is
//! an input, not the clock.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| seedlink_tunnel::server::harness::run_bytes(data));
