//! The cluster: what several brokers agree on. So far, placement (which broker owns each
//! shard) and a sans-IO member of a Raft group on tikv's engine ([`meta`]); membership, the
//! metadata state machine, routing and forwarding follow (issue 14).

pub mod meta;
pub mod placement;

pub use placement::place;
