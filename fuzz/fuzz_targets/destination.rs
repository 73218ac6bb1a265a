//! Fuzzes the destination grammar: no input may panic, and the canonical
//! form of an accepted destination parses to the same destination.
#![no_main]

use libfuzzer_sys::fuzz_target;
use seedlink_proto::destination;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(d) = destination::parse(s) {
            assert_eq!(destination::parse(&d.canonical()), Ok(d));
        }
    }
});
