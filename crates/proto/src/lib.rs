//! Sans-IO protocol parsers used by every seedlink role.
//!
//! Nothing in this crate performs I/O or knows about tokio: every parser is a
//! pure function over the bytes received so far and answers with a three-way
//! result — complete, not this protocol / malformed, or "need more bytes" —
//! so the caller owns deadlines, size caps and buffering.

pub mod client_hello;
pub mod connect_head;
pub mod destination;
pub mod proxy_header;

/// Outcome of feeding the bytes received so far to a parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parse<T, E> {
    /// The message is complete; the value says how many bytes it used.
    Done(T),
    /// More bytes are needed before an answer can be given.
    Incomplete,
    /// The bytes can never become a valid message.
    Invalid(E),
}
