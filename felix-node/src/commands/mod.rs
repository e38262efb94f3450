//! The subcommands that are not a tool of their own: `serve`, `publish`, `cache`, `counter`,
//! `cluster`, `stream` and `sim`, and what they share (connecting, parsing flags). A module each.

use crate::node::{BrokerSettings, DataDir, client_trust, start_broker};
use crate::{
    AdminArgs, CacheArgs, CacheOp, ClusterArgs, ClusterOp, ConnectArgs, CounterArgs, CounterOp, PublishArgs, ServeArgs,
    SimArgs, StreamArgs, StreamOp,
};
use bytes::Bytes;
use felix_driver_tokio::{Client, ClientOptions, PublishOptions, SubscriptionItem};
use felix_proto::Codec;
use felix_proto::client::EndReason;
use felix_proto::error_code::RetryClass;
use felix_proto::message::StartPosition;
use std::io::Write;
use std::process::ExitCode;

mod serve;
pub(crate) use serve::*;
mod connect;
pub(crate) use connect::*;
mod args;
pub(crate) use args::*;
mod ending;
pub(crate) use ending::*;
mod publish;
pub(crate) use publish::*;
mod cache;
pub(crate) use cache::*;
mod cluster;
pub(crate) use cluster::*;
mod stream;
pub(crate) use stream::*;
mod sim;
pub(crate) use sim::*;
