//! The cluster: what several brokers agree on. So far, placement (which broker owns each
//! shard); membership, the metadata Raft group, routing and forwarding follow (issue 14).

pub mod placement;

pub use placement::place;
