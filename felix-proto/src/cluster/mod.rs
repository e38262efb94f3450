//! The cluster: what several brokers agree on. So far, placement (which broker owns each
//! shard), a sans-IO member of a Raft group on tikv's engine ([`meta`]) and the metadata state
//! machine it replicates ([`metadata`]); the driver's transport and log, routing and forwarding
//! follow (issue 14).

pub mod meta;
pub mod metadata;
pub mod node;
pub mod peer;
pub mod placement;
#[cfg(feature = "testkit")]
pub mod sim;
#[cfg(feature = "testkit")]
pub mod world;

pub use placement::place;
