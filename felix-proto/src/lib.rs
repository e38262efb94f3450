//! # felix-proto
//!
//! A sans-IO implementation of the Felix wire protocol: it performs no networking, reads no
//! clock, spawns no thread and draws no randomness of its own. Bytes, stream events, storage
//! results and time go in; bytes to write, streams to open or finish, records to persist,
//! wake-ups and events come out. A driver (`felix-driver-tokio` is ours) moves them between
//! sockets, disk and this crate. Outputs are a deterministic function of the inputs.
//!
//! Two state machines, one per role:
//! * [`Broker`]: every connection of a broker node, its logs, caches, groups and timers;
//! * [`ClientConnection`]: one client connection, with the protocol policy a client needs
//!   (stream choice, deferral, queues, typed replies, backpressure, timeouts), plus the
//!   idempotent producer ([`client::producer`]) and lag resumption ([`client::resume`]).
//!
//! They stand on the codec:
//! * [`frame`]: the 12-byte header and an incremental [`FrameDecoder`];
//! * [`flags`] and [`features`]: the two capability number spaces, and [`negotiate`];
//! * [`binary`]: publish batches, publish acks and event batches; [`payload`] dispatch;
//! * [`message`]: every JSON control message; [`error_code`]: error codes and retry classes;
//! * [`routing`]: the key → shard functions; [`cluster`]: placement of shards on brokers; [`storage`]: the on-disk batch, index and
//!   watermark formats and recovery's types; [`transport`]: stream and connection ids, tokens;
//! * [`conformance`]: the vector checker behind `felix-node conformance`.
//!
//! With the `testkit` feature: `sim` (broker, clients and storage in memory), `chaos` (the
//! seeded fault workload behind `felix-node sim`), `samples` and `fuzzing` (fuzz entry points).
//!
//! Nothing here panics on input from a peer or a file: every failure is a typed error.
//!
//! ## Driving a broker
//!
//! The contract, in the order a driver meets it:
//! 1. **Recovery first.** Read storage back and hand every shard to [`Broker::restore`] (older
//!    history from indexes, then whole batches, then producer watermarks; `restore` keeps that
//!    order) before accepting a connection.
//! 2. **Inputs**, each with the current time: [`Broker::admit`] a connection (or refuse it with
//!    the [`broker::AdmitError`]), report its streams' bytes ([`Broker::handle_stream_data`]),
//!    resets, stop-sendings, closes, opened streams, and the bytes flushed on *every* stream,
//!    control streams included ([`Broker::handle_stream_flushed`]: a stream paused because its
//!    answers went unread resumes only through it), and each storage outcome
//!    ([`Broker::handle_write_result`], [`Broker::handle_read_complete`]).
//! 3. **Outputs**: after every input, drain [`Broker::poll_output`] and match every
//!    [`BrokerOutput`] exhaustively (a new variant is a new duty). Bytes of one stream are
//!    written in the order given. A `Read` or `Truncate` must see every `Persist` asked for
//!    before it (storage applies them in output order), and writes of one shard complete in
//!    the order asked for.
//! 4. **Time**: sleep until [`Broker::poll_timeout`] (or the next input), then call
//!    [`Broker::handle_timeout`]. Time only goes forward; an earlier `now` is clamped.
//!
//! ```no_run
//! use bytes::Bytes;
//! use felix_proto::broker::{BrokerConfig, PeerAddr, WriteOutcome};
//! use felix_proto::transport::{StreamId, WallClock};
//! use felix_proto::{Broker, BrokerOutput, ClusterOutput, StorageOutput, TransportOutput};
//! use std::time::Instant;
//!
//! # fn read_socket() -> (StreamId, Bytes, bool) { unimplemented!() }
//! # fn write_socket(_: StreamId, _: Bytes) {}
//! # fn unix_micros() -> u64 { 0 }
//! let start = Instant::now();
//! let mut broker = Broker::new(BrokerConfig::default(), WallClock::new(start, unix_micros()));
//! // (recovery: broker.restore(shard, now) for every shard storage read back)
//! let conn = broker.admit(PeerAddr([0; 16]), Instant::now()).expect("admitted");
//! loop {
//!     // An input: bytes a client sent on one of its streams.
//!     let (stream, data, fin) = read_socket();
//!     broker.handle_stream_data(conn, stream, data, fin, Instant::now());
//!     // Then everything the broker asks for, in order.
//!     while let Some(out) = broker.poll_output() {
//!         match out {
//!             BrokerOutput::Transport(TransportOutput::Transmit { stream, data, .. }) => write_socket(stream, data),
//!             BrokerOutput::Storage(StorageOutput::Persist(w)) => {
//!                 // (write it, then report the outcome)
//!                 broker.handle_write_result(w.token, WriteOutcome::Written, Instant::now());
//!             }
//!             BrokerOutput::Storage(StorageOutput::Read(r)) => broker.handle_read_complete(r.token, Vec::new(), Instant::now()),
//!             BrokerOutput::Transport(TransportOutput::Finish { .. })
//!             | BrokerOutput::Transport(TransportOutput::StopSending { .. })
//!             | BrokerOutput::Transport(TransportOutput::OpenUni { .. })
//!             | BrokerOutput::Transport(TransportOutput::PauseReading { .. })
//!             | BrokerOutput::Transport(TransportOutput::ResumeReading { .. })
//!             | BrokerOutput::Storage(StorageOutput::Truncate { .. })
//!             | BrokerOutput::Storage(StorageOutput::DeleteStream { .. })
//!             | BrokerOutput::Storage(StorageOutput::CreateStream { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::Forward { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ForwardRequest { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ForwardRequestAnswer { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ProposeCache { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ProposeStream { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ProposeStreamDeletion { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::Copy { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::ProposeCluster(_))
//!             | BrokerOutput::Cluster(ClusterOutput::ClusterAdmin { .. })
//!             | BrokerOutput::Storage(StorageOutput::ResetShard { .. })
//!             | BrokerOutput::Cluster(ClusterOutput::Replicate { .. })
//!             | BrokerOutput::Transport(TransportOutput::CloseConnection { .. }) => { /* each is a driver duty */ }
//!         }
//!     }
//!     if broker.poll_timeout().is_some_and(|t| t <= Instant::now()) {
//!         broker.handle_timeout(Instant::now());
//!     }
//! }
//! ```
//!
//! A client driver is the same shape around [`ClientConnection`]: report stream data, opened
//! streams, resets and connection loss; drain [`ClientConnection::poll_output`] (bytes, streams
//! to open) and [`ClientConnection::poll_event`] (replies, events); honour its timeout.

#![deny(missing_docs)]

pub mod auth;
pub mod binary;
pub mod broker;
#[cfg(any(test, feature = "testkit"))]
pub mod chaos;
pub mod client;
pub mod cluster;
pub mod conformance;
pub mod error_code;
pub mod features;
pub mod flags;
pub mod frame;
#[cfg(any(test, fuzzing, feature = "testkit"))]
pub mod fuzzing;
pub mod jwt;
pub mod message;
pub mod negotiate;
pub mod payload;
pub mod routing;
#[cfg(any(test, feature = "testkit"))]
pub mod samples;
pub mod shard;
#[cfg(any(test, feature = "testkit"))]
pub mod sim;
pub mod storage;
pub mod transport;

pub use binary::{Codec, Compressor, EventBatch, PublishAck, PublishBatch, Records};
pub use broker::{Broker, BrokerOutput, ClusterOutput, StorageOutput, TransportOutput};
pub use client::{ClientConnection, ClientEvent, ClientOutput};
pub use error_code::{ErrorCode, RetryClass};
pub use features::Features;
pub use flags::{Flags, FlagsHi};
pub use frame::{Frame, FrameDecoder, FrameError};
pub use message::{Decoded, Message};
pub use payload::{Payload, PayloadKind};

/// docs/embedding.md, compiled: its `rust` blocks run as doctests, so the guide cannot drift
/// from the API.
#[cfg(doctest)]
#[doc = include_str!("../../docs/embedding.md")]
pub struct EmbeddingGuide;
