//! Layer 3, transports: how packets ride a connection. gRPC over HTTP/2 (what
//! upstream speaks), seedlink's native transport (`seedlink-tunnel/1`), TLS
//! 1.3's records in this process, and the byte-level helpers under them
//! (the read tap and GOAWAY sniffer, the read-ahead, the authority rewriter).

pub mod authority;
pub mod goaway;
pub mod grpc;
pub mod native;
pub mod readahead;
pub mod tap;
pub mod usertls;
