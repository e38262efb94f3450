//! JSON control messages.
//!
//! A control message travels in a frame with flags `0`: one compact JSON object whose first key
//! is `"type"`, fields in upstream's order, optional fields left out when absent. [`Message`] is
//! the whole catalogue as one enum; [`decode`] turns a payload into a [`Decoded`], which keeps an
//! unknown `type` apart from a malformed message (the broker answers the first with
//! `unsupported`, the second with `error`).
//!
//! Decoding reads the `type` first (directly from the bytes when the payload starts with
//! `{"type":"…"`, as every encoder we know writes it; otherwise by a scan of the object), then
//! deserialises the one struct it names. There is no intermediate tree.
//!
//! The structs live in one module per part of the protocol (`session`, `topology`, `publish`,
//! `subscribe`, `history`, `cache`, `counter`, `group`, `listing`, `inspect`), re-exported
//! here, fields in upstream's serialisation order.
//!
//! Rules every struct follows (so that an old peer sees byte-identical frames):
//! * an optional field is `Option<_>` with `skip_serializing_if`, so "absent" means "what it
//!   meant before the field existed";
//! * a few fields upstream always writes (`cache_put.ttl_ms`, `cache_value.value`,
//!   `state_value.value`, `group_poll.wait_ms`, group record `attempts`,
//!   `cache_event.expires_at_millis`, `cache_watch_started.resnapshot`) are always written here
//!   too, and accepted when absent;
//! * unknown fields are ignored on decode (serde's default), which is what makes additive fields
//!   safe.

mod b64;
mod cache;
mod counter;
mod group;
mod history;
mod inspect;
mod listing;
mod publish;
mod session;
mod subscribe;
mod topology;

pub use b64::B64;
pub use cache::*;
pub use counter::*;
pub use group::*;
pub use history::*;
pub use inspect::*;
pub use listing::*;
pub use publish::*;
pub use session::*;
pub use subscribe::*;
pub use topology::*;

fn is_false(b: &bool) -> bool {
    !*b
}

use crate::binary::EncodeError;
use crate::flags::Flags;
use crate::frame::{begin_frame, patch_length};
use bytes::BytesMut;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// Who sends a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Client → broker (a request).
    ToBroker,
    /// Broker → client (an answer or a delivery).
    ToClient,
    /// Either side (`error`).
    Both,
}

macro_rules! messages {
    ($( $variant:ident($ty:ty) = $wire:literal, $dir:ident; )*) => {
        /// Every JSON control message.
        #[derive(Debug, Clone, PartialEq, Serialize)]
        #[serde(tag = "type")]
        #[non_exhaustive]
        pub enum Message {
            $( #[doc = concat!("`", $wire, "`")] #[serde(rename = $wire)] $variant($ty), )*
        }

        impl Message {
            /// Every type name, in catalogue order.
            pub const TYPE_NAMES: &'static [&'static str] = &[ $( $wire, )* ];

            /// The `type` tag.
            pub fn type_name(&self) -> &'static str {
                match self { $( Message::$variant(_) => $wire, )* }
            }

            /// Who may send it.
            pub fn direction(&self) -> Direction {
                match self { $( Message::$variant(_) => Direction::$dir, )* }
            }

            /// The direction of a type name, `None` when unknown.
            pub fn direction_of(type_name: &str) -> Option<Direction> {
                match type_name { $( $wire => Some(Direction::$dir), )* _ => None }
            }

            fn decode_known(type_name: &str, payload: &[u8]) -> Option<Result<Message, serde_json::Error>> {
                Some(match type_name {
                    $( $wire => serde_json::from_slice::<$ty>(payload).map(Message::$variant), )*
                    _ => return None,
                })
            }
        }
    };
}

messages! {
    Auth(Auth) = "auth", ToBroker;
    AuthOk(AuthOk) = "auth_ok", ToClient;
    Ok(OkMsg) = "ok", ToClient;
    Error(ErrorMsg) = "error", Both;
    Unsupported(Unsupported) = "unsupported", ToClient;
    Extension(Extension) = "extension", ToBroker;
    Topology(Topology) = "topology", ToBroker;
    TopologyView(TopologyView) = "topology_view", ToClient;
    NotLeader(NotLeader) = "not_leader", ToClient;
    StreamShards(StreamShards) = "stream_shards", ToBroker;
    StreamShardsView(StreamShardsView) = "stream_shards_view", ToClient;
    CacheShards(CacheShards) = "cache_shards", ToBroker;
    CacheShardsView(CacheShardsView) = "cache_shards_view", ToClient;
    ShardOwners(ShardOwners) = "shard_owners", ToBroker;
    ShardOwnersView(ShardOwnersView) = "shard_owners_view", ToClient;
    Publish(Publish) = "publish", ToBroker;
    PublishBatch(PublishBatchMsg) = "publish_batch", ToBroker;
    PublishWidth(PublishWidth) = "publish_width", ToBroker;
    PublishOk(PublishOk) = "publish_ok", ToClient;
    PublishError(PublishError) = "publish_error", ToClient;
    ProducerInit(ProducerInit) = "producer_init", ToBroker;
    ProducerInitOk(ProducerInitOk) = "producer_init_ok", ToClient;
    PublishIdempotent(PublishIdempotent) = "publish_idempotent", ToBroker;
    PublishRefused(PublishRefused) = "publish_refused", ToClient;
    PublishIf(PublishIf) = "publish_if", ToBroker;
    Commit(Commit) = "commit", ToBroker;
    CommitOk(CommitOk) = "commit_ok", ToClient;
    StateGet(StateGet) = "state_get", ToBroker;
    StateValue(StateValue) = "state_value", ToClient;
    Subscribe(Subscribe) = "subscribe", ToBroker;
    Subscribed(Subscribed) = "subscribed", ToClient;
    SubscribeCursorError(SubscribeCursorError) = "subscribe_cursor_error", ToClient;
    EventStreamHello(EventStreamHello) = "event_stream_hello", ToClient;
    Event(Event) = "event", ToClient;
    EventBatch(EventBatchMsg) = "event_batch", ToClient;
    SubscriptionLagged(SubscriptionLagged) = "subscription_lagged", ToClient;
    ShardMoved(ShardMoved) = "shard_moved", ToClient;
    StreamDeleted(StreamDeleted) = "stream_deleted", ToClient;
    StreamDelete(StreamDelete) = "stream_delete", ToBroker;
    StreamDeleteOk(StreamDeleteOk) = "stream_delete_ok", ToClient;
    OffsetForTime(OffsetForTime) = "offset_for_time", ToBroker;
    OffsetValue(OffsetValue) = "offset_value", ToClient;
    StreamRead(StreamRead) = "stream_read", ToBroker;
    StreamRecords(StreamRecords) = "stream_records", ToClient;
    CachePut(CachePut) = "cache_put", ToBroker;
    CacheGet(CacheGet) = "cache_get", ToBroker;
    CacheDelete(CacheDelete) = "cache_delete", ToBroker;
    CacheValue(CacheValue) = "cache_value", ToClient;
    CacheOk(CacheOk) = "cache_ok", ToClient;
    CachePutIf(CachePutIf) = "cache_put_if", ToBroker;
    CacheDeleteIf(CacheDeleteIf) = "cache_delete_if", ToBroker;
    CacheConditionResult(CacheConditionResult) = "cache_condition_result", ToClient;
    CacheWatch(CacheWatch) = "cache_watch", ToBroker;
    CacheWatchStarted(CacheWatchStarted) = "cache_watch_started", ToClient;
    CacheEvent(CacheEvent) = "cache_event", ToClient;
    CacheWatchLagged(CacheWatchLagged) = "cache_watch_lagged", ToClient;
    CounterAdd(CounterAdd) = "counter_add", ToBroker;
    CounterGet(CounterGet) = "counter_get", ToBroker;
    CounterValue(CounterValue) = "counter_value", ToClient;
    GroupPoll(GroupPoll) = "group_poll", ToBroker;
    GroupRecords(GroupRecords) = "group_records", ToClient;
    GroupAck(GroupOffset) = "group_ack", ToBroker;
    GroupNack(GroupNack) = "group_nack", ToBroker;
    GroupExtend(GroupExtend) = "group_extend", ToBroker;
    GroupExtended(GroupExtended) = "group_extended", ToClient;
    GroupDeadLetter(GroupDeadLetterReq) = "group_dead_letter", ToBroker;
    GroupDeadLetters(GroupRef) = "group_dead_letters", ToBroker;
    GroupDeadLetterList(GroupDeadLetterList) = "group_dead_letter_list", ToClient;
    GroupDiscard(GroupDiscard) = "group_discard", ToBroker;
    GroupRedrive(GroupRedrive) = "group_redrive", ToBroker;
    GroupSeek(GroupSeek) = "group_seek", ToBroker;
    GroupPosition(GroupPosition) = "group_position", ToClient;
    GroupDescribe(GroupDescribe) = "group_describe", ToBroker;
    GroupInfo(GroupInfo) = "group_info", ToClient;
    GroupList(GroupList) = "group_list", ToBroker;
    GroupListView(GroupListView) = "group_list_view", ToClient;
    CacheKeys(CacheKeys) = "cache_keys", ToBroker;
    CacheKeysView(CacheKeysView) = "cache_keys_view", ToClient;
    StreamList(StreamList) = "stream_list", ToBroker;
    StreamListView(StreamListView) = "stream_list_view", ToClient;
    StreamInfo(StreamInfo) = "stream_info", ToBroker;
    StreamInfoView(StreamInfoView) = "stream_info_view", ToClient;
    StreamCreate(StreamCreate) = "stream_create", ToBroker;
    StreamCreateOk(StreamCreateOk) = "stream_create_ok", ToClient;
    ClusterStatus(ClusterStatus) = "cluster_status", ToBroker;
    ClusterStatusView(ClusterStatusView) = "cluster_status_view", ToClient;
    ShardMove(ShardMove) = "shard_move", ToBroker;
    ShardMoveOk(ShardMoveOk) = "shard_move_ok", ToClient;
    GroupDelete(GroupDelete) = "group_delete", ToBroker;
    GroupDeleted(GroupDeleted) = "group_deleted", ToClient;
    ShardInspect(ShardInspect) = "shard_inspect", ToBroker;
    ShardInspectInfo(ShardInspectInfo) = "shard_inspect_info", ToClient;
    SubscriptionsList(SubscriptionsList) = "subscriptions_list", ToBroker;
    SubscriptionsListInfo(SubscriptionsListInfo) = "subscriptions_list_info", ToClient;
}

/// `group_dead_letter` has the same fields as `group_ack`.
pub type GroupDeadLetterReq = GroupOffset;
/// `group_discard` has the same fields as `group_ack`.
pub type GroupDiscard = GroupOffset;
/// `group_redrive` has the same fields as `group_ack`.
pub type GroupRedrive = GroupOffset;
/// `group_describe` has the same fields as `group_dead_letters`.
pub type GroupDescribe = GroupRef;
/// `group_delete` has the same fields as `group_dead_letters`.
pub type GroupDelete = GroupRef;

/// A message whose `type` this implementation does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownMessage {
    /// The `type` tag as sent.
    pub type_name: String,
    /// The `request_id`, when the object had a numeric one (echoed by `unsupported`).
    pub request_id: Option<u64>,
}

/// The result of decoding a JSON payload.
// `Unknown` is small and rare; boxing `Message` would cost an allocation on every decode.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    /// A message of the catalogue.
    Message(Message),
    /// A well-formed object with a `type` nobody here knows.
    Unknown(UnknownMessage),
}

/// Why a JSON payload could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// Not valid JSON (syntax error, truncated, invalid UTF-8).
    #[error("invalid JSON: {0}")]
    InvalidJson(serde_json::Error),
    /// Valid JSON whose top level is not an object.
    #[error("a control message must be a JSON object")]
    NotAnObject,
    /// An object without a string `type`.
    #[error("message has no \"type\" field")]
    MissingType,
    /// A known type whose fields are wrong (missing, wrong type, bad base64, out of range).
    #[error("invalid {type_name} message: {source}")]
    InvalidFields {
        /// The message type.
        type_name: &'static str,
        /// serde's account of the problem.
        source: serde_json::Error,
    },
}

impl MessageError {
    /// A short stable name for the error kind, used by conformance vectors.
    pub fn kind(&self) -> &'static str {
        match self {
            MessageError::InvalidJson(_) => "invalid_json",
            MessageError::NotAnObject => "not_an_object",
            MessageError::MissingType => "missing_type",
            MessageError::InvalidFields { .. } => "invalid_fields",
        }
    }
}

#[derive(Deserialize)]
struct Tag<'a> {
    #[serde(rename = "type", borrow, default)]
    ty: Option<Cow<'a, str>>,
    #[serde(default)]
    request_id: Option<serde_json::Value>,
}

/// Reads `type` straight from a payload that starts `{"type":"NAME"` (no escapes in NAME).
fn fast_tag(payload: &[u8]) -> Option<&str> {
    const PREFIX: &[u8] = b"{\"type\":\"";
    let rest = payload.strip_prefix(PREFIX)?;
    let end = rest.iter().position(|&b| b == b'"' || b == b'\\')?;
    if rest[end] != b'"' {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok()
}

/// Decodes a JSON control-message payload.
///
/// # Errors
/// See [`MessageError`]. An unknown `type` is not an error: it is [`Decoded::Unknown`].
pub fn decode(payload: &[u8]) -> Result<Decoded, MessageError> {
    // serde accepts a JSON array for a struct; a control message is an object, so say so first.
    match payload.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        _ => {
            return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(payload) {
                Ok(_) => MessageError::NotAnObject,
                Err(e) => MessageError::InvalidJson(e),
            });
        }
    }
    let fast = fast_tag(payload);
    let (type_name, request_id): (Cow<'_, str>, Option<u64>) = match fast {
        Some(t) if Message::direction_of(t).is_some() => (Cow::Borrowed(t), None),
        _ => {
            let tag: Tag<'_> = serde_json::from_slice(payload)
                .map_err(|e| if e.is_data() { MessageError::MissingType } else { MessageError::InvalidJson(e) })?;
            let ty = tag.ty.ok_or(MessageError::MissingType)?;
            (ty, tag.request_id.and_then(|v| v.as_u64()))
        }
    };
    match Message::decode_known(&type_name, payload) {
        Some(Ok(m)) => Ok(Decoded::Message(m)),
        Some(Err(source)) => {
            let type_name = Message::TYPE_NAMES
                .iter()
                .find(|n| **n == type_name)
                .copied()
                .expect("decode_known matched a catalogue name");
            if source.is_syntax() || source.is_eof() {
                Err(MessageError::InvalidJson(source))
            } else {
                Err(MessageError::InvalidFields { type_name, source })
            }
        }
        None => Ok(Decoded::Unknown(UnknownMessage { type_name: type_name.into_owned(), request_id })),
    }
}

impl Message {
    /// The compact JSON payload.
    ///
    /// # Errors
    /// Only if a value cannot be represented in JSON (an `extension` body with a non-string map
    /// key cannot occur from decoded input; this is a defensive path).
    pub fn to_json(&self) -> Result<Vec<u8>, EncodeError> {
        serde_json::to_vec(self).map_err(|e| EncodeError::Json(e.to_string()))
    }

    /// Writes the whole frame (flags 0) into `dst`.
    ///
    /// # Errors
    /// As [`to_json`](Self::to_json), or a payload over 4 GiB. Nothing is left in `dst` on error.
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        use bytes::BufMut;
        let start = dst.len();
        let at = begin_frame(dst, Flags::EMPTY);
        let res = serde_json::to_writer((&mut *dst).writer(), self)
            .map_err(|e| EncodeError::Json(e.to_string()))
            .and_then(|()| patch_length(dst, at));
        if res.is_err() {
            dst.truncate(start);
        }
        res
    }

    /// The `request_id` the message carries, if any (for matching answers).
    pub fn request_id(&self) -> Option<u64> {
        let v = serde_json::to_value(self).ok()?;
        v.get("request_id")?.as_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_json_vectors_round_trip() {
        let cases = [
            r#"{"type":"auth","tenant_id":"t1","token":"demo-token","client_flags":25}"#,
            r#"{"type":"auth_ok","server_flags":25}"#,
            r#"{"type":"publish","tenant_id":"t1","namespace":"default","stream":"demo","payload":"aGVsbG8="}"#,
            r#"{"type":"subscribe","tenant_id":"t1","namespace":"default","stream":"demo"}"#,
            r#"{"type":"event","tenant_id":"t1","namespace":"default","stream":"demo","payload":"d29ybGQ="}"#,
            r#"{"type":"cache_put","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key","value":"Y2FjaGVk","ttl_ms":1000}"#,
            r#"{"type":"cache_get","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key"}"#,
            r#"{"type":"cache_value","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key","value":"Y2FjaGVk"}"#,
            r#"{"type":"ok"}"#,
            r#"{"type":"error","message":"oops"}"#,
            r#"{"type":"shard_moved","subscription_id":7,"resume_from":1234,"node_id":"broker-b","addr":"10.0.0.5:5000","generation":9}"#,
            r#"{"type":"shard_moved","subscription_id":7,"generation":9}"#,
            r#"{"type":"subscribed","subscription_id":42}"#,
        ];
        for c in cases {
            let Decoded::Message(m) = decode(c.as_bytes()).unwrap() else { panic!("{c}") };
            assert_eq!(String::from_utf8(m.to_json().unwrap()).unwrap(), c);
        }
    }

    #[test]
    fn unknown_type_is_distinct_from_malformed() {
        assert_eq!(
            decode(br#"{"type":"frobnicate","request_id":5}"#).unwrap(),
            Decoded::Unknown(UnknownMessage { type_name: "frobnicate".into(), request_id: Some(5) })
        );
        assert!(matches!(decode(br#"{"request_id":5}"#), Err(MessageError::MissingType)));
        assert!(matches!(decode(br#"{"type":5}"#), Err(MessageError::MissingType)));
        assert!(matches!(decode(b"[1,2]"), Err(MessageError::NotAnObject)));
        assert!(matches!(decode(b"  \"ok\""), Err(MessageError::NotAnObject)));
        assert!(matches!(decode(b""), Err(MessageError::InvalidJson(_))));
        assert!(matches!(decode(b"{\"type\":"), Err(MessageError::InvalidJson(_))));
        assert!(matches!(
            decode(br#"{"type":"publish","tenant_id":"t"}"#),
            Err(MessageError::InvalidFields { type_name: "publish", .. })
        ));
        assert!(matches!(
            decode(br#"{"type":"auth","tenant_id":"t","token":"x","client_flags":70000}"#),
            Err(MessageError::InvalidFields { type_name: "auth", .. })
        ));
    }

    #[test]
    fn fields_in_any_order_and_unknown_fields_ignored() {
        let m = decode(br#"{"token":"x","extra":[1,{"a":2}],"tenant_id":"t","type":"auth"}"#).unwrap();
        assert_eq!(
            m,
            Decoded::Message(Message::Auth(Auth {
                tenant_id: "t".into(),
                token: "x".into(),
                client_flags: None,
                client_flags_hi: None,
                client_features: None,
                client_features_hi: None
            }))
        );
    }

    #[test]
    fn escaped_type_falls_back_to_the_slow_path() {
        let m = decode(br#"{"type":"o\u006b"}"#).unwrap();
        assert_eq!(m, Decoded::Message(Message::Ok(OkMsg {})));
    }

    #[test]
    fn frame_encoding_has_header() {
        let mut b = BytesMut::new();
        Message::Ok(OkMsg {}).encode(&mut b).unwrap();
        assert_eq!(&b[..], b"FLX1\x00\x01\x00\x00\x00\x00\x00\x0d{\"type\":\"ok\"}");
    }
}
