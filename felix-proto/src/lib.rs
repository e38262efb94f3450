//! # felix-proto
//!
//! A sans-IO implementation of the Felix wire protocol: it performs no networking, reads no
//! clock, spawns no thread and draws no randomness of its own. Bytes and time go in; bytes to
//! write, timers and events come out. A driver (see `felix-driver-tokio`) moves them between
//! sockets, disk and this crate.
//!
//! This crate currently holds the codec every other part stands on:
//! * [`frame`]: the 12-byte header and an incremental [`FrameDecoder`];
//! * [`flags`] and [`features`]: the two capability number spaces;
//! * [`binary`]: publish batches, publish acks and event batches;
//! * [`message`]: every JSON control message;
//! * [`error_code`]: error codes and retry classes;
//! * [`routing`]: the key → shard functions;
//! * [`conformance`]: the vector checker behind `felix-node conformance`.
//!
//! Nothing here panics on input from a peer or a file: every failure is a typed error.

#![deny(missing_docs)]

pub mod binary;
pub mod broker;
pub mod chaos;
pub mod client;
pub mod conformance;
pub mod error_code;
pub mod features;
pub mod flags;
pub mod frame;
pub mod fuzzing;
pub mod io;
pub mod message;
pub mod negotiate;
pub mod payload;
pub mod routing;
#[doc(hidden)]
pub mod samples;
pub mod sim;
pub mod storage;

pub use binary::{EventBatch, PublishAck, PublishBatch, Records};
pub use error_code::{ErrorCode, RetryClass};
pub use features::Features;
pub use flags::Flags;
pub use frame::{Frame, FrameDecoder, FrameError};
pub use message::{Decoded, Message};
pub use payload::{Payload, PayloadKind};
