//! felix-driver-blocking: the felix-proto state machines driven without tokio or any async
//! runtime. One thread, one UDP socket, `quinn-proto` for QUIC, and a loop:
//!
//! 1. hand the state machine what arrived (`handle_*`, with `now`),
//! 2. carry out its outputs (`poll_output` until `None`): stream writes, opens, stops, pauses,
//!    disk writes (done in place, then reported with `handle_write_result`),
//! 3. send what QUIC has to send,
//! 4. sleep until a datagram arrives or the earliest deadline (`poll_timeout` of the state
//!    machine and of QUIC), then `handle_timeout` if it is due.
//!
//! [`BlockingBroker`] is a whole broker (the same storage files and certificates as
//! `felix-node serve`, through `felix-driver-common`); [`BlockingClient`] is a client for a
//! plain `fn main`. docs/embedding.md walks through both next to the tokio driver.
//!
//! Run a broker: `cargo run --release -p felix-driver-blocking --example broker -- --help`.

mod broker;
mod client;
mod quic;

pub use broker::{BlockingBroker, BrokerError, BrokerOptions, StopHandle};
pub use client::{BlockingClient, ClientError, ConnectOptions};
