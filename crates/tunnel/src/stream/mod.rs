//! Layer 2, streams: per-connection queues and flow control, the fair queue
//! towards one agent stream, deadlines, and the budget of packets that move
//! nothing.

pub mod clock;
pub mod deadline;
pub mod fair;
pub mod flood;
pub mod flow;
pub mod queue;
