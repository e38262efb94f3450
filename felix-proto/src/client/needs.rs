//! What each request needs the broker to have advertised: the one table the client checks before
//! it sends anything.
//!
//! The spec's rule is that a client sends a request (or an optional field) only to a broker that
//! advertised its bit: an older broker closes the stream on a request it does not know, and
//! silently ignores a field it does not know, which changes what the request means (a `key` that
//! is dropped changes ordering; a `visibility_ms` that is ignored changes a claim's length). So
//! the requirements are read off the message itself, optional fields included, and a request
//! the broker cannot take is refused here with [`CommandError::NotNegotiated`] naming what is
//! missing, with nothing sent.

use super::CommandError;
use crate::features::Features;
use crate::flags::Flags;
use crate::message::Message;
use crate::negotiate::Negotiated;

/// One thing a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The broker advertised this feature bit.
    Feature(Features, &'static str),
    /// The broker advertised this frame flag (it decides how the broker reads a field).
    Flag(Flags, &'static str),
}

fn f(bit: Features, name: &'static str) -> Need {
    Need::Feature(bit, name)
}

/// Everything `m` needs, its optional fields included.
pub fn needs(m: &Message) -> Vec<Need> {
    let mut n = Vec::new();
    let explicit_shard = |n: &mut Vec<Need>, shard: Option<u32>| {
        if shard.is_some() {
            n.push(f(Features::EXPLICIT_SHARD, "FEATURE_EXPLICIT_SHARD"));
        }
    };
    let width = |n: &mut Vec<Need>, w: Option<u32>| {
        if w.is_some() {
            n.push(f(Features::PUBLISH_WIDTH, "FEATURE_PUBLISH_WIDTH"));
        }
    };
    // A broker that does not read keyed batches does not route by key: a key it is sent is
    // dropped, and the batch lands on shard 0.
    let keyed = |n: &mut Vec<Need>, keyed: bool| {
        if keyed {
            n.push(Need::Flag(Flags::BINARY_PUBLISH_KEYED, "FLAG_BINARY_PUBLISH_KEYED (routing by key)"));
        }
    };
    match m {
        Message::Publish(p) => {
            keyed(&mut n, p.key.is_some());
            explicit_shard(&mut n, p.shard);
            width(&mut n, p.publish_width);
        }
        Message::PublishBatch(p) => {
            keyed(&mut n, p.key.is_some());
            explicit_shard(&mut n, p.shard);
            width(&mut n, p.publish_width);
        }
        Message::PublishWidth(_) => n.push(f(Features::PUBLISH_WIDTH, "FEATURE_PUBLISH_WIDTH")),
        Message::ProducerInit(_) => n.push(f(Features::IDEMPOTENT_PRODUCER, "FEATURE_IDEMPOTENT_PRODUCER")),
        Message::PublishIdempotent(p) => {
            n.push(f(Features::IDEMPOTENT_PRODUCER, "FEATURE_IDEMPOTENT_PRODUCER"));
            keyed(&mut n, p.key.is_some());
            width(&mut n, p.publish_width);
        }
        Message::PublishIf(p) => {
            n.push(f(Features::PUBLISH_CONDITIONAL, "FEATURE_PUBLISH_CONDITIONAL"));
            keyed(&mut n, p.key.is_some());
            explicit_shard(&mut n, p.shard);
            width(&mut n, p.publish_width);
        }
        Message::Commit(c) => {
            n.push(f(Features::ATOMIC_COMMIT, "FEATURE_ATOMIC_COMMIT"));
            explicit_shard(&mut n, c.shard);
            if c.expected_offset.is_some() {
                n.push(f(Features::PUBLISH_CONDITIONAL, "FEATURE_PUBLISH_CONDITIONAL"));
            }
        }
        Message::StateGet(s) => {
            n.push(f(Features::ATOMIC_COMMIT, "FEATURE_ATOMIC_COMMIT"));
            explicit_shard(&mut n, s.shard);
        }
        Message::Subscribe(s) => {
            if s.queue_capacity.is_some() {
                n.push(f(Features::SUBSCRIBE_QUEUE, "FEATURE_SUBSCRIBE_QUEUE"));
            }
            if s.filter.is_some() {
                n.push(f(Features::STREAM_FILTER, "FEATURE_STREAM_FILTER"));
            }
        }
        Message::Topology(_) => n.push(f(Features::TOPOLOGY, "FEATURE_TOPOLOGY")),
        Message::StreamDelete(_) => n.push(f(Features::STREAM_ADMIN, "FEATURE_STREAM_ADMIN")),
        Message::StreamCreate(_) => n.push(f(Features::STREAM_CREATE, "FEATURE_STREAM_CREATE")),
        Message::StreamShards(_) => n.push(f(Features::STREAM_SHARDS, "FEATURE_STREAM_SHARDS")),
        Message::CacheShards(_) => n.push(f(Features::CACHE_SHARDS, "FEATURE_CACHE_SHARDS")),
        Message::ShardOwners(_) => n.push(f(Features::SHARD_OWNERS, "FEATURE_SHARD_OWNERS")),
        Message::OffsetForTime(_) => n.push(f(Features::RECORD_TIMESTAMPS, "FEATURE_RECORD_TIMESTAMPS")),
        Message::StreamRead(r) => {
            n.push(f(Features::STREAM_READ, "FEATURE_STREAM_READ"));
            if r.replica_local == Some(true) {
                n.push(f(Features::STREAM_INFO, "FEATURE_STREAM_INFO"));
            }
        }
        Message::CacheDelete(_) => n.push(f(Features::CACHE_DELETE, "FEATURE_CACHE_DELETE")),
        Message::CachePutIf(_) | Message::CacheDeleteIf(_) => {
            n.push(f(Features::CACHE_CONDITIONAL, "FEATURE_CACHE_CONDITIONAL"));
        }
        Message::CacheWatch(w) => {
            n.push(f(Features::CACHE_WATCH, "FEATURE_CACHE_WATCH"));
            if w.retained {
                n.push(f(Features::CACHE_WATCH_RETAINED, "FEATURE_CACHE_WATCH_RETAINED"));
            }
        }
        Message::CounterAdd(_) | Message::CounterGet(_) => n.push(f(Features::COUNTERS, "FEATURE_COUNTERS")),
        Message::GroupPoll(p) => {
            n.push(f(Features::CONSUMER_GROUP, "FEATURE_CONSUMER_GROUP"));
            if p.consumer.is_some() || p.reclaim.is_some() {
                n.push(f(Features::GROUP_CONSUMER, "FEATURE_GROUP_CONSUMER"));
            }
            if p.visibility_ms.is_some() {
                n.push(f(Features::GROUP_CLAIM_CONTROL, "FEATURE_GROUP_CLAIM_CONTROL"));
            }
        }
        Message::GroupAck(_) => n.push(f(Features::CONSUMER_GROUP, "FEATURE_CONSUMER_GROUP")),
        Message::GroupNack(g) => {
            n.push(f(Features::CONSUMER_GROUP, "FEATURE_CONSUMER_GROUP"));
            if g.delay_ms.is_some() || g.attempts.is_some() {
                n.push(f(Features::GROUP_CLAIM_CONTROL, "FEATURE_GROUP_CLAIM_CONTROL"));
            }
        }
        Message::GroupExtend(_) | Message::GroupDeadLetter(_) => {
            n.push(f(Features::GROUP_CLAIM_CONTROL, "FEATURE_GROUP_CLAIM_CONTROL"));
        }
        Message::GroupDeadLetters(_) | Message::GroupDiscard(_) | Message::GroupRedrive(_) => {
            n.push(f(Features::GROUP_DEAD_LETTERS, "FEATURE_GROUP_DEAD_LETTERS"));
        }
        Message::GroupSeek(_) | Message::GroupDescribe(_) | Message::GroupDelete(_) => {
            n.push(f(Features::GROUP_ADMIN, "FEATURE_GROUP_ADMIN"));
        }
        Message::ShardInspect(_) | Message::SubscriptionsList(_) => n.push(f(Features::INSPECT, "FEATURE_INSPECT")),
        Message::GroupList(_) | Message::CacheKeys(_) => n.push(f(Features::LISTING, "FEATURE_LISTING")),
        Message::StreamList(_) | Message::StreamInfo(_) => n.push(f(Features::STREAM_INFO, "FEATURE_STREAM_INFO")),
        Message::ClusterStatus(q) => {
            n.push(f(Features::CLUSTER_ADMIN, "FEATURE_CLUSTER_ADMIN"));
            // An older broker would drop `after`/`limit` and answer the whole status.
            if q.after.is_some() || q.limit.is_some() {
                n.push(f(Features::STATUS_PAGES, "FEATURE_STATUS_PAGES"));
            }
        }
        Message::ShardMove(_) => n.push(f(Features::CLUSTER_ADMIN, "FEATURE_CLUSTER_ADMIN")),
        // The rest is part of every broker (auth, cache_put/get) or never sent by a client.
        _ => {}
    }
    n
}

/// The feature bit that makes `m`'s request type exist, if it is not part of every broker: the
/// first of [`needs`], without the bits its optional fields add. The broker admits a request by
/// this same table (it serves a request type only when it advertises its bit, and answers any
/// other like an unknown type), so client and broker cannot disagree about which bit a request
/// needs.
pub fn request_feature(m: &Message) -> Option<Features> {
    if matches!(m, Message::Publish(_) | Message::PublishBatch(_) | Message::Subscribe(_)) {
        return None; // their needs are optional fields only
    }
    needs(m).into_iter().find_map(|n| match n {
        Need::Feature(bit, _) => Some(bit),
        Need::Flag(..) => None,
    })
}

/// Refuses `m` if the broker lacks anything it needs.
///
/// # Errors
/// [`CommandError::NotNegotiated`] naming the first thing missing.
pub fn check(neg: &Negotiated, m: &Message) -> Result<(), CommandError> {
    for need in needs(m) {
        match need {
            Need::Feature(bit, name) if !neg.broker_has(bit) => return Err(CommandError::NotNegotiated(name)),
            Need::Flag(bit, name) if !neg.may_send(bit) => return Err(CommandError::NotNegotiated(name)),
            _ => {}
        }
    }
    Ok(())
}
