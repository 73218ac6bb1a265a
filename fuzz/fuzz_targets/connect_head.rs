//! Fuzzes the CONNECT head parser: no input may panic; a parsed head never
//! claims more bytes than given and parses the same from its own bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use seedlink_proto::{connect_head, Parse};

fuzz_target!(|data: &[u8]| {
    let limits = connect_head::Limits::default();
    let first = connect_head::parse(data, &limits);
    if let Parse::Done(h) = &first {
        assert!(h.len <= data.len());
        assert_eq!(connect_head::parse(&data[..h.len], &limits), first);
    }
});
