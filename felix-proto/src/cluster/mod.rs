//! The cluster: what several brokers agree on. Placement (which broker owns each shard), a
//! sans-IO member of a Raft group on tikv's engine ([`meta`]), the metadata state machine it
//! replicates ([`metadata`]), a broker of a cluster ([`node`]) and the messages between brokers
//! ([`peer`]); a replicated shard's replica, whose Raft log is the shard's log ([`replica`]), and
//! reading that log back from its files once entries left memory ([`log_read`]); the byte budget
//! of moves ([`bandwidth`]).

pub mod log_read;
pub mod meta;
pub mod metadata;
pub mod node;
pub mod peer;
pub mod placement;
pub mod replica;
#[cfg(feature = "testkit")]
pub mod replica_sim;
pub mod segment_summary;
#[cfg(feature = "testkit")]
pub mod sim;
pub mod snapshot_send;
pub mod status;
#[cfg(feature = "testkit")]
pub mod world;

pub use crate::shard::bandwidth;
pub use placement::place;
