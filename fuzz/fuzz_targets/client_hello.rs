//! Fuzzes the ClientHello parser: no input may panic, and the answer for a
//! complete message must not change when more bytes follow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use seedlink_proto::{client_hello, Parse};

fuzz_target!(|data: &[u8]| {
    let cap = 16 * 1024;
    let first = client_hello::parse(data, cap);
    if let Parse::Done(h) = &first {
        assert!(h.len <= data.len());
        let again = client_hello::parse(&data[..h.len], cap);
        assert_eq!(again, first);
    }
    // Every prefix of a complete hello is incomplete or the same answer.
    if data.len() < 2048 {
        for n in 0..data.len() {
            if let Parse::Done(h) = client_hello::parse(&data[..n], cap) {
                assert!(h.len <= n);
            }
        }
    }
});
