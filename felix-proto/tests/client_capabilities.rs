//! The client never sends a request, or an optional field, that the broker did not advertise:
//! against a broker that advertises what the released upstream broker does (`server_flags`
//! 0x003F, no feature bits) every row below is refused before anything is sent, naming what is
//! missing; against a broker that advertises everything, each goes out.

mod support;

use bytes::{Bytes, BytesMut};
use felix_proto::client::{
    CacheWatchRequest, ClientConfig, ClientConnection, ClientOutput, ClientStream, CommandError, PublishRequest,
    StreamReadRequest, SubscribeRequest, WatchOn,
};
use felix_proto::features::Features;
use felix_proto::message::{self, Message, StartPosition};
use felix_proto::transport::{Dir, Side, StreamId};
use support::epoch;

const S: ClientStream = ClientStream(0);

/// A client whose first control stream authenticated against a broker advertising `flags` and
/// `features`.
fn connected(flags: u16, features: Features) -> ClientConnection {
    let t0 = epoch();
    let mut c = ClientConnection::new(ClientConfig::new("t1", "tok"), t0);
    let Some(ClientOutput::OpenBi { token }) = c.poll_output() else { panic!("opens a stream") };
    let sid = StreamId::new(Side::Client, Dir::Bi, 0);
    c.handle_stream_opened(token, sid, t0);
    while c.poll_output().is_some() {}
    let (server_features, server_features_hi) = features.to_words(true);
    let ok = Message::AuthOk(message::AuthOk {
        server_flags: flags,
        server_flags_hi: None,
        server_features,
        server_features_hi,
        listener_ports: None,
        publish_window: None,
    });
    let mut b = BytesMut::new();
    ok.encode(&mut b).unwrap();
    c.handle_stream_data(sid, b.freeze(), false, t0);
    while c.poll_event().is_some() {}
    c
}

fn group(f: impl FnOnce(u64) -> Message) -> impl FnOnce(&mut ClientConnection) -> Result<u64, CommandError> {
    move |c: &mut ClientConnection| c.request(S, f)
}

fn poll(consumer: Option<&str>, visibility_ms: Option<u64>) -> impl FnOnce(u64) -> Message {
    let consumer = consumer.map(String::from);
    move |request_id| {
        Message::GroupPoll(message::GroupPoll {
            tenant_id: "t1".into(),
            namespace: "ns".into(),
            stream: "s".into(),
            shard: 0,
            group: "g".into(),
            max_records: 1,
            wait_ms: 0,
            request_id,
            consumer,
            reclaim: None,
            visibility_ms,
        })
    }
}

fn offset(request_id: u64) -> message::GroupOffset {
    message::GroupOffset {
        tenant_id: "t1".into(),
        namespace: "ns".into(),
        stream: "s".into(),
        shard: 0,
        group: "g".into(),
        offset: 1,
        request_id,
    }
}

fn whole(request_id: u64) -> message::GroupRef {
    message::GroupRef {
        tenant_id: "t1".into(),
        namespace: "ns".into(),
        stream: "s".into(),
        shard: 0,
        group: "g".into(),
        request_id,
    }
}

fn nack(delay_ms: Option<u64>, attempts: Option<u32>) -> impl FnOnce(u64) -> Message {
    move |request_id| {
        Message::GroupNack(message::GroupNack {
            tenant_id: "t1".into(),
            namespace: "ns".into(),
            stream: "s".into(),
            shard: 0,
            group: "g".into(),
            offset: 1,
            request_id,
            delay_ms,
            attempts,
        })
    }
}

type Attempt = Box<dyn FnOnce(&mut ClientConnection) -> Result<u64, CommandError>>;
type Row = (&'static str, &'static str, Attempt);

fn rows() -> Vec<Row> {
    let payload = || vec![Bytes::from_static(b"x")];
    let publish = move |edit: fn(&mut PublishRequest)| -> Attempt {
        Box::new(move |c: &mut ClientConnection| {
            let mut r = PublishRequest::new("ns", "s", payload()).acked();
            edit(&mut r);
            c.publish(S, r, epoch()).map(|p| p.0)
        })
    };
    let sub = |queue_capacity| SubscribeRequest {
        filter: None,
        namespace: "ns".into(),
        stream: "s".into(),
        start: Some(StartPosition::Earliest),
        shard: None,
        queue_capacity,
    };
    let watch = |retained| CacheWatchRequest {
        namespace: "ns".into(),
        cache: "c".into(),
        filter: WatchOn::Key("k".into()),
        from_offset: None,
        retained,
    };
    vec![
        (
            "publish with a key",
            "FLAG_BINARY_PUBLISH_KEYED (routing by key)",
            publish(|r| r.key = Some(Bytes::from_static(b"k"))),
        ),
        (
            "JSON publish with a key",
            "FLAG_BINARY_PUBLISH_KEYED (routing by key)",
            publish(|r| {
                r.key = Some(Bytes::from_static(b"k"));
                r.json = true;
            }),
        ),
        ("publish to an explicit shard", "FEATURE_EXPLICIT_SHARD", publish(|r| r.shard = Some(1))),
        ("idempotent publish", "FEATURE_IDEMPOTENT_PRODUCER", publish(|r| r.idempotent = Some((7, 0)))),
        ("publish_if", "FEATURE_PUBLISH_CONDITIONAL", publish(|r| r.expected_offset = Some(0))),
        (
            "subscribe with a queue capacity",
            "FEATURE_SUBSCRIBE_QUEUE",
            Box::new(move |c: &mut ClientConnection| c.subscribe(S, sub(Some(8)), epoch())),
        ),
        (
            "dedicated subscribe with a queue capacity",
            "FEATURE_SUBSCRIBE_QUEUE",
            Box::new(move |c: &mut ClientConnection| c.subscribe_dedicated(sub(Some(8)), epoch())),
        ),
        (
            "cache watch",
            "FEATURE_CACHE_WATCH",
            Box::new(move |c: &mut ClientConnection| c.cache_watch(S, watch(false))),
        ),
        (
            "dedicated cache watch",
            "FEATURE_CACHE_WATCH",
            Box::new(move |c: &mut ClientConnection| c.cache_watch_dedicated(watch(false), epoch())),
        ),
        (
            "cache delete",
            "FEATURE_CACHE_DELETE",
            Box::new(|c: &mut ClientConnection| c.cache_delete(S, "ns", "c", "k")),
        ),
        (
            "cache put_if",
            "FEATURE_CACHE_CONDITIONAL",
            Box::new(|c: &mut ClientConnection| {
                c.cache_put_if(S, "ns", "c", "k", Bytes::from_static(b"v"), None, message::CacheCondition::Absent)
            }),
        ),
        (
            "cache delete_if",
            "FEATURE_CACHE_CONDITIONAL",
            Box::new(|c: &mut ClientConnection| c.cache_delete_if(S, "ns", "c", "k", 1)),
        ),
        ("counter add", "FEATURE_COUNTERS", Box::new(|c: &mut ClientConnection| c.counter_add(S, "ns", "c", "k", 1))),
        ("counter get", "FEATURE_COUNTERS", Box::new(|c: &mut ClientConnection| c.counter_get(S, "ns", "c", "k"))),
        (
            "stream_read",
            "FEATURE_STREAM_READ",
            Box::new(|c: &mut ClientConnection| {
                c.stream_read(
                    S,
                    StreamReadRequest {
                        namespace: "ns".into(),
                        stream: "s".into(),
                        shard: 0,
                        from: 0,
                        end: None,
                        max_records: None,
                        max_bytes: None,
                        replica_local: false,
                    },
                )
            }),
        ),
        (
            "offset_for_time",
            "FEATURE_RECORD_TIMESTAMPS",
            Box::new(|c: &mut ClientConnection| c.offset_for_time(S, "ns", "s", 0, 1)),
        ),
        ("producer_init", "FEATURE_IDEMPOTENT_PRODUCER", Box::new(|c: &mut ClientConnection| c.producer_init(S))),
        ("stream_shards", "FEATURE_STREAM_SHARDS", Box::new(|c: &mut ClientConnection| c.stream_shards(S, "ns", "s"))),
        ("group poll", "FEATURE_CONSUMER_GROUP", Box::new(group(poll(None, None)))),
        ("group ack", "FEATURE_CONSUMER_GROUP", Box::new(group(|id| Message::GroupAck(offset(id))))),
        ("group nack", "FEATURE_CONSUMER_GROUP", Box::new(group(nack(None, None)))),
        (
            "group extend",
            "FEATURE_GROUP_CLAIM_CONTROL",
            Box::new(group(|id| {
                Message::GroupExtend(message::GroupExtend {
                    tenant_id: "t1".into(),
                    namespace: "ns".into(),
                    stream: "s".into(),
                    shard: 0,
                    group: "g".into(),
                    offset: 1,
                    attempts: 1,
                    extend_ms: 10,
                    request_id: id,
                })
            })),
        ),
        (
            "group dead_letter",
            "FEATURE_GROUP_CLAIM_CONTROL",
            Box::new(group(|id| Message::GroupDeadLetter(offset(id)))),
        ),
        (
            "group dead_letters",
            "FEATURE_GROUP_DEAD_LETTERS",
            Box::new(group(|id| Message::GroupDeadLetters(whole(id)))),
        ),
        ("group discard", "FEATURE_GROUP_DEAD_LETTERS", Box::new(group(|id| Message::GroupDiscard(offset(id))))),
        ("group redrive", "FEATURE_GROUP_DEAD_LETTERS", Box::new(group(|id| Message::GroupRedrive(offset(id))))),
        (
            "group seek",
            "FEATURE_GROUP_ADMIN",
            Box::new(group(|id| {
                Message::GroupSeek(message::GroupSeek {
                    tenant_id: "t1".into(),
                    namespace: "ns".into(),
                    stream: "s".into(),
                    shard: 0,
                    group: "g".into(),
                    start: StartPosition::Earliest,
                    if_new: false,
                    request_id: id,
                })
            })),
        ),
        ("group describe", "FEATURE_GROUP_ADMIN", Box::new(group(|id| Message::GroupDescribe(whole(id))))),
        ("group delete", "FEATURE_GROUP_ADMIN", Box::new(group(|id| Message::GroupDelete(whole(id))))),
    ]
}

/// Rows whose optional field needs a second feature: refused by a broker with groups but not
/// the field's feature.
fn field_rows() -> Vec<Row> {
    vec![
        ("group poll naming a consumer", "FEATURE_GROUP_CONSUMER", Box::new(group(poll(Some("m1"), None)))),
        ("group poll with visibility_ms", "FEATURE_GROUP_CLAIM_CONTROL", Box::new(group(poll(None, Some(5000))))),
        ("group nack with delay_ms", "FEATURE_GROUP_CLAIM_CONTROL", Box::new(group(nack(Some(10), None)))),
        ("group nack with attempts", "FEATURE_GROUP_CLAIM_CONTROL", Box::new(group(nack(None, Some(1))))),
    ]
}

fn transmits(c: &mut ClientConnection) -> usize {
    std::iter::from_fn(|| c.poll_output()).filter(|o| matches!(o, ClientOutput::Transmit { .. })).count()
}

#[test]
fn a_legacy_broker_is_sent_nothing_it_did_not_advertise() {
    for (what, missing, row) in rows() {
        let mut c = connected(0x003F, Features::NONE);
        assert_eq!(row(&mut c), Err(CommandError::NotNegotiated(missing)), "{what}");
        assert_eq!(transmits(&mut c), 0, "{what}: something was sent");
    }
}

#[test]
fn an_optional_field_needs_its_own_feature() {
    for (what, missing, row) in field_rows() {
        let mut c = connected(0x7FFF, Features::CONSUMER_GROUP);
        assert_eq!(row(&mut c), Err(CommandError::NotNegotiated(missing)), "{what}");
        assert_eq!(transmits(&mut c), 0, "{what}: something was sent");
    }
}

#[test]
fn a_broker_that_advertises_everything_is_sent_each_request() {
    let all = Features(!u64::from(Features::EXTENDED_MARKER));
    for (what, _, row) in rows().into_iter().chain(field_rows()) {
        let mut c = connected(0x7FFF, all);
        assert!(row(&mut c).is_ok(), "{what}");
        // A dedicated request opens its own stream first; the others go out at once.
        let out: Vec<ClientOutput> = std::iter::from_fn(|| c.poll_output()).collect();
        assert!(
            out.iter().any(|o| matches!(o, ClientOutput::Transmit { .. } | ClientOutput::OpenBi { .. })),
            "{what}: nothing sent"
        );
    }
}

#[test]
fn an_unkeyed_publish_to_a_legacy_broker_still_goes_out() {
    let mut c = connected(0x003F, Features::NONE);
    let r = PublishRequest::new("ns", "s", vec![Bytes::from_static(b"x")]).acked();
    assert!(c.publish(S, r, epoch()).is_ok());
    assert_eq!(transmits(&mut c), 1);
}

/// `replica_local` on a `stream_read` (D51) is sent only to a broker that advertises
/// FEATURE_STREAM_INFO besides FEATURE_STREAM_READ.
#[test]
fn a_replica_local_read_needs_stream_info() {
    let req = |replica_local| StreamReadRequest {
        namespace: "ns".into(),
        stream: "s".into(),
        shard: 0,
        from: 0,
        end: None,
        max_records: None,
        max_bytes: None,
        replica_local,
    };
    let mut c = connected(0x7FFF, Features::STREAM_READ);
    assert_eq!(c.stream_read(S, req(true)), Err(CommandError::NotNegotiated("FEATURE_STREAM_INFO")));
    assert_eq!(transmits(&mut c), 0, "nothing was sent");
    assert!(c.stream_read(S, req(false)).is_ok(), "a plain read goes");
    let mut c = connected(0x7FFF, Features::STREAM_READ | Features::STREAM_INFO);
    assert!(c.stream_read(S, req(true)).is_ok());
    assert!(transmits(&mut c) > 0);
}

/// `after`/`limit` on a `cluster_status` (D55) are sent only to a broker that advertises
/// FEATURE_STATUS_PAGES besides FEATURE_CLUSTER_ADMIN: an older one would drop them and answer
/// the whole status. A `cluster_status` without them goes to any broker with the admin feature.
#[test]
fn a_status_page_needs_status_pages() {
    use felix_proto::message::{ClusterStatus, Message};
    let ask =
        |limit: Option<u32>| move |request_id| Message::ClusterStatus(ClusterStatus { after: None, limit, request_id });
    let mut c = connected(0x7FFF, Features::CLUSTER_ADMIN);
    assert_eq!(c.request(S, ask(Some(10))), Err(CommandError::NotNegotiated("FEATURE_STATUS_PAGES")));
    assert_eq!(transmits(&mut c), 0, "nothing was sent");
    assert!(c.request(S, ask(None)).is_ok(), "the whole status goes");
    let mut c = connected(0x7FFF, Features::CLUSTER_ADMIN | Features::STATUS_PAGES);
    assert!(c.request(S, ask(Some(10))).is_ok());
    assert!(transmits(&mut c) > 0);
}
