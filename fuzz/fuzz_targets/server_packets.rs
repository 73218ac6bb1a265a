//! Fuzzes the tunnel-agent's handling of packets from a server, interleaved
//! with its own events (dials completing or failing, destinations closing or
//! stalling). Nothing may panic and the harness's invariants must hold after
//! every step. Deterministic: no runtime, sockets or clock.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| seedlink_tunnel::agent::harness::run_bytes(data));
