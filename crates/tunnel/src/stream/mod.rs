//! Layer 2, streams: how a connection's bytes move through an agent stream
//! (`flow`: the send window, the receive queue, the stream's fair send
//! queue), deadlines and the clock the drivers read, and the budget of
//! packets that move nothing (`flood`).

pub mod clock;
pub mod deadline;
pub mod flood;
pub mod flow;
