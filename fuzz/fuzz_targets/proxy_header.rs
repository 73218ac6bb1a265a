//! Fuzzes the PROXY v1/v2 parser: no input may panic, a parsed header never
//! claims more bytes than it was given, and stays the same with more input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use seedlink_proto::{proxy_header, Parse};

fuzz_target!(|data: &[u8]| {
    let cap = 536;
    let first = proxy_header::parse(data, cap);
    if let Parse::Done(h) = &first {
        assert!(h.len <= data.len());
        assert_eq!(proxy_header::parse(&data[..h.len], cap), first);
    }
    let _ = proxy_header::detect(data);
});
