//! Representative values of every message and layout: one fully populated instance of every
//! JSON message type, and the binary frames every flag combination allows. They generate the
//! vectors in `vectors/`, seed the fuzz corpora and drive the round-trip tests.

use crate::binary::{
    AckMode, AckStatus, AckedPrefix, Codec, Compressor, ErrorDetail, EventBatch, IdempotentPrefix, OwnerHint,
    PublishAck, PublishBatch, Records,
};
use crate::error_code::{ErrorCode, RetryClass};
use crate::message::*;
use bytes::Bytes;

fn s(x: &str) -> String {
    x.to_owned()
}

fn b(x: &str) -> B64 {
    B64::from(x)
}

/// One fully populated instance of every JSON message type, in catalogue order.
pub fn messages() -> Vec<Message> {
    let t = || s("t1");
    let ns = || s("default");
    let st = || s("orders");
    let detail = || Some(ErrorDetail { reason: Some(s("moving")), retry_after_ms: Some(250) });
    vec![
        Message::Auth(Auth {
            tenant_id: t(),
            token: s("demo-token"),
            client_flags: Some(0x7FFF),
            client_flags_hi: None,
            client_features: Some(0x8000_0800),
            client_features_hi: Some(0x2),
        }),
        Message::AuthOk(AuthOk {
            server_flags: 0x7FFF,
            server_flags_hi: None,
            server_features: Some(0x8002_8800),
            server_features_hi: Some(0xC),
            listener_ports: Some(vec![5001, 5002]),
            publish_window: Some(256),
        }),
        Message::Ok(OkMsg {}),
        Message::Error(ErrorMsg {
            message: s("shard is moving"),
            code: Some(ErrorCode::ShardUnavailable),
            retry: Some(RetryClass::Retry),
            detail: detail(),
        }),
        Message::Unsupported(Unsupported {
            request_type: s("frobnicate"),
            request_id: Some(12),
            extension: Some(s("x-trace")),
        }),
        Message::Extension(Extension { name: s("x-trace"), request_id: 12, body: serde_json::json!({"sample": 1}) }),
        Message::Topology(Topology {}),
        Message::TopologyView(TopologyView {
            brokers: vec![BrokerAddr { node_id: s("broker-a"), addr: s("127.0.0.1:5000") }],
        }),
        Message::NotLeader(NotLeader { node_id: s("broker-b"), addr: Some(s("10.0.0.5:5000")), generation: 9 }),
        Message::StreamShards(StreamShards { tenant_id: t(), namespace: ns(), stream: st(), request_id: 3 }),
        Message::StreamShardsView(StreamShardsView { shards: 8, request_id: 3, routing: Some(Routing::JumpHash) }),
        Message::CacheShards(CacheShards { tenant_id: t(), namespace: ns(), cache: s("primary"), request_id: 4 }),
        Message::CacheShardsView(CacheShardsView { shards: 1, request_id: 4 }),
        Message::ShardOwners(ShardOwners {
            tenant_id: t(),
            namespace: ns(),
            name: st(),
            kind: ShardKind::Stream,
            request_id: 5,
        }),
        Message::ShardOwnersView(ShardOwnersView {
            request_id: 5,
            owners: vec![
                ShardOwner {
                    shard: 0,
                    node_id: Some(s("broker-a")),
                    addr: Some(s("127.0.0.1:5000")),
                    generation: 2,
                    unavailable: None,
                },
                ShardOwner { shard: 1, node_id: None, addr: None, generation: 0, unavailable: Some(s("not_assigned")) },
            ],
        }),
        Message::Publish(Publish {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            payload: b("hello"),
            key: Some(b("customer-1")),
            shard: Some(3),
            request_id: Some(1),
            ack: Some(AckMode::PerMessage),
            publish_width: Some(8),
        }),
        Message::PublishBatch(PublishBatchMsg {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            payloads: vec![b("a"), b("bb")],
            key: Some(b("customer-1")),
            shard: Some(3),
            request_id: Some(2),
            ack: Some(AckMode::PerBatch),
            publish_width: Some(8),
        }),
        Message::PublishWidth(PublishWidth { tenant_id: t(), namespace: ns(), stream: st(), width: 8 }),
        Message::PublishOk(PublishOk { request_id: 2, offset: Some(100) }),
        Message::PublishError(PublishError {
            request_id: 2,
            message: s("shard is moving"),
            code: Some(ErrorCode::ShardUnavailable),
            retry: Some(RetryClass::Retry),
            detail: detail(),
        }),
        Message::ProducerInit(ProducerInit { request_id: 6 }),
        Message::ProducerInitOk(ProducerInitOk { request_id: 6, producer_id: 0x1234_5678_9abc_def0 }),
        Message::PublishIdempotent(PublishIdempotent {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            payloads: vec![b("a")],
            key: Some(b("k")),
            request_id: 7,
            producer_id: 0x1234_5678_9abc_def0,
            sequence: 4,
            publish_width: Some(8),
        }),
        Message::PublishRefused(PublishRefused {
            request_id: 7,
            reason: RefusedReason::SequenceGap { expected: 3 },
            message: s("sequence 4 is past the next expected 3"),
        }),
        Message::PublishIf(PublishIf {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            payloads: vec![b("a")],
            key: Some(b("k")),
            expected_offset: 41,
            shard: Some(1),
            request_id: 8,
            publish_width: Some(8),
        }),
        Message::Commit(Commit {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            entity_key: b("k"),
            event: b("created"),
            changes: vec![
                StateChange::Put { key: s("status"), value: b("open") },
                StateChange::Delete { key: s("draft") },
            ],
            shard: Some(1),
            request_id: 9,
            expected_offset: Some(41),
        }),
        Message::CommitOk(CommitOk { request_id: 9, offset: 41 }),
        Message::StateGet(StateGet {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            entity_key: b("k"),
            key: s("status"),
            shard: Some(1),
            request_id: 10,
        }),
        Message::StateValue(StateValue { value: Some(b("open")), version: Some(41), as_of: Some(44), request_id: 10 }),
        Message::Subscribe(Subscribe {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            subscription_id: Some(42),
            start: Some(StartPosition::Offset(100)),
            shard: Some(2),
            queue_capacity: Some(64),
            filter: None,
        }),
        Message::Subscribed(Subscribed {
            subscription_id: 42,
            start_offset: Some(100),
            live_offset: Some(120),
            queue_capacity: Some(64),
        }),
        Message::SubscribeCursorError(SubscribeCursorError {
            reason: CursorErrorReason::TooOld,
            requested: 3,
            available: 50,
        }),
        Message::EventStreamHello(EventStreamHello { subscription_id: 42 }),
        Message::Event(Event { tenant_id: t(), namespace: ns(), stream: st(), payload: b("world"), offset: Some(100) }),
        Message::EventBatch(EventBatchMsg {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            payloads: vec![b("a"), b("b")],
            base_offset: Some(100),
        }),
        Message::SubscriptionLagged(SubscriptionLagged { subscription_id: 42, resume_from: 130 }),
        Message::ShardMoved(ShardMoved {
            subscription_id: 7,
            resume_from: Some(1234),
            node_id: Some(s("broker-b")),
            addr: Some(s("10.0.0.5:5000")),
            generation: 9,
        }),
        Message::StreamDeleted(StreamDeleted { subscription_id: 42 }),
        Message::StreamDelete(StreamDelete { tenant_id: t(), namespace: ns(), stream: s("orders"), request_id: 12 }),
        Message::StreamDeleteOk(StreamDeleteOk { request_id: 12, existed: true }),
        Message::StreamCreate(StreamCreate {
            tenant_id: t(),
            namespace: ns(),
            streams: vec![
                NewStream { stream: s("orders"), shards: Some(8), replication: Some(3), durable: None },
                NewStream { stream: s("clicks"), shards: None, replication: None, durable: Some(false) },
            ],
            request_id: 13,
        }),
        Message::StreamCreateOk(StreamCreateOk {
            request_id: 13,
            created: vec![s("clicks")],
            existed: vec![ExistingStream { stream: s("orders"), shards: 4 }],
        }),
        Message::OffsetForTime(OffsetForTime {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 0,
            at_micros: 1_760_000_000_000_000,
            request_id: 11,
        }),
        Message::OffsetValue(OffsetValue { offset: Some(77), request_id: 11 }),
        Message::StreamRead(StreamRead {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 0,
            from: 10,
            end: Some(20),
            max_records: Some(100),
            max_bytes: Some(65_536),
            request_id: 12,
            replica_local: None,
        }),
        Message::StreamRecords(StreamRecords {
            records: vec![StreamRecord {
                offset: 10,
                payload: b("a"),
                publisher: Some(s("alice")),
                timestamp_micros: 1_760_000_000_000_000,
            }],
            next_offset: 11,
            request_id: 12,
        }),
        Message::CachePut(CachePut {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: s("demo-key"),
            value: b("cached"),
            request_id: Some(13),
            ttl_ms: Some(1000),
        }),
        Message::CacheGet(CacheGet {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: s("demo-key"),
            request_id: Some(14),
        }),
        Message::CacheDelete(CacheDelete {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: s("demo-key"),
            request_id: Some(15),
        }),
        Message::CacheValue(CacheValue {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: s("demo-key"),
            value: Some(b("cached")),
            request_id: Some(14),
            version: Some(5),
        }),
        Message::CacheOk(CacheOk { request_id: 13 }),
        Message::CachePutIf(CachePutIf {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: s("demo-key"),
            value: b("v2"),
            ttl_ms: Some(5000),
            condition: CacheCondition::Version(5),
            request_id: 16,
        }),
        Message::CacheDeleteIf(CacheDeleteIf {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: s("demo-key"),
            version: 6,
            request_id: 17,
        }),
        Message::CacheConditionResult(CacheConditionResult { applied: true, version: Some(6), request_id: 16 }),
        Message::CacheWatch(CacheWatch {
            tenant_id: t(),
            namespace: ns(),
            cache: s("primary"),
            key: None,
            prefix: Some(s("user:")),
            shard: Some(0),
            from_offset: Some(10),
            retained: true,
            subscription_id: Some(43),
        }),
        Message::CacheWatchStarted(CacheWatchStarted {
            subscription_id: 43,
            resume_offset: 20,
            resnapshot: true,
            retained_count: Some(3),
        }),
        Message::CacheEvent(CacheEvent {
            key: s("user:1"),
            value: Some(b("alice")),
            offset: 21,
            expires_at_millis: 1_760_000_000_000,
        }),
        Message::CacheWatchLagged(CacheWatchLagged { resume_from: 22 }),
        Message::CounterAdd(CounterAdd {
            tenant_id: t(),
            namespace: ns(),
            cache: s("counters"),
            key: s("visits"),
            delta: -3,
            request_id: 18,
        }),
        Message::CounterGet(CounterGet {
            tenant_id: t(),
            namespace: ns(),
            cache: s("counters"),
            key: s("visits"),
            request_id: 19,
        }),
        Message::CounterValue(CounterValue { value: Some(-3), request_id: 18 }),
        Message::GroupPoll(GroupPoll {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 0,
            group: s("billing"),
            max_records: 10,
            wait_ms: 500,
            request_id: 20,
            consumer: Some(s("worker-1")),
            reclaim: Some(true),
            visibility_ms: Some(30_000),
        }),
        Message::GroupRecords(GroupRecords {
            records: vec![GroupRecord {
                offset: 5,
                payload: b("a"),
                attempts: 1,
                skipped_before: Some(1),
                publisher: Some(s("alice")),
                timestamp_micros: Some(1_760_000_000_000_000),
            }],
            request_id: 20,
        }),
        Message::GroupAck(group_offset(21)),
        Message::GroupNack(GroupNack {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 0,
            group: s("billing"),
            offset: 5,
            request_id: 22,
            delay_ms: Some(1000),
            attempts: Some(1),
        }),
        Message::GroupExtend(GroupExtend {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 0,
            group: s("billing"),
            offset: 5,
            attempts: 1,
            extend_ms: 10_000,
            request_id: 23,
        }),
        Message::GroupExtended(GroupExtended { visible_ms: 10_000, request_id: 23 }),
        Message::GroupDeadLetter(group_offset(24)),
        Message::GroupDeadLetters(group_ref(25)),
        Message::GroupDeadLetterList(GroupDeadLetterList { offsets: vec![5, 9], request_id: 25 }),
        Message::GroupDiscard(group_offset(26)),
        Message::GroupRedrive(group_offset(27)),
        Message::GroupSeek(GroupSeek {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 0,
            group: s("billing"),
            start: StartPosition::Earliest,
            if_new: true,
            request_id: 28,
        }),
        Message::GroupPosition(GroupPosition { offset: 0, moved: true, request_id: 28 }),
        Message::GroupDescribe(group_ref(29)),
        Message::GroupInfo(GroupInfo {
            committed: Some(5),
            tail: 10,
            in_flight: 2,
            owed: 1,
            dead_letters: 1,
            request_id: 29,
        }),
        Message::GroupDelete(group_ref(30)),
        Message::GroupDeleted(GroupDeleted { existed: true, request_id: 30 }),
        Message::GroupList(GroupList { tenant_id: t(), namespace: ns(), stream: st(), shard: 0, request_id: 31 }),
        Message::GroupListView(GroupListView {
            groups: vec![
                GroupSummary { group: s("audit"), position: None, lag: 10, in_flight: 0, dead_letters: 0 },
                GroupSummary { group: s("billing"), position: Some(5), lag: 5, in_flight: 2, dead_letters: 1 },
            ],
            request_id: 31,
        }),
        Message::CacheKeys(CacheKeys {
            tenant_id: t(),
            namespace: ns(),
            cache: s("sessions"),
            prefix: Some(s("user:")),
            after: Some(s("user:1")),
            limit: Some(2),
            request_id: 32,
        }),
        Message::CacheKeysView(CacheKeysView {
            keys: vec![s("user:2"), s("user:3")],
            next: Some(s("user:3")),
            request_id: 32,
        }),
        Message::StreamList(StreamList {
            tenant_id: t(),
            namespace: Some(ns()),
            after: Some(s("default/audit")),
            limit: Some(2),
            request_id: 33,
        }),
        Message::StreamListView(StreamListView {
            streams: vec![
                StreamEntry { namespace: ns(), stream: s("events"), shards: 1 },
                StreamEntry { namespace: ns(), stream: st(), shards: 4 },
            ],
            next: Some(format!("{}/{}", ns(), st())),
            request_id: 33,
        }),
        Message::StreamInfo(StreamInfo { tenant_id: t(), namespace: ns(), stream: st(), shard: 1, request_id: 34 }),
        Message::StreamInfoView(StreamInfoView {
            shards: 4,
            shard: 1,
            durable: true,
            replication: 3,
            retention_records: Some(1_000_000),
            retention_bytes: Some(268_435_456),
            retention_secs: None,
            start: 120,
            next_offset: 4_096,
            records: 3_976,
            bytes: 1_017_856,
            subscribers: 2,
            groups: 1,
            request_id: 34,
        }),
        Message::ClusterStatus(ClusterStatus { after: None, limit: None, request_id: 35 }),
        Message::ClusterStatusView(ClusterStatusView {
            status: serde_json::json!({
                "cluster": true, "node_id": "n1", "leader": "n2", "fenced": false,
                "members": [{"node_id": "n1", "client_addr": "10.0.0.1:5000", "cluster_addr": "10.0.0.1:7000", "state": "active"}],
                "shards": [{"kind": "stream", "tenant": "t1", "namespace": "default", "name": "orders", "shard": 0,
                    "owner": "n1", "generation": 3}],
                "moves": [], "revoked": {"jti": [], "sub": []}
            }),
            request_id: 35,
        }),
        Message::ShardMove(ShardMove {
            tenant_id: t(),
            namespace: ns(),
            stream: st(),
            shard: 1,
            to: Some(s("n3")),
            cancel: false,
            request_id: 36,
        }),
        Message::ShardMoveOk(ShardMoveOk { proposed: s("move t1/default/orders shard 1 to n3"), request_id: 36 }),
        Message::ShardInspect(ShardInspect {
            tenant_id: t(),
            namespace: ns(),
            name: st(),
            kind: ShardKind::Stream,
            shard: 0,
            request_id: 31,
        }),
        Message::ShardInspectInfo(ShardInspectInfo {
            request_id: 31,
            view: Box::new(InspectView {
                node_id: s("broker-a"),
                shards: 1,
                role: s("leader"),
                phase: s("active"),
                serving: true,
                reason: None,
                detail: None,
                generation: Some(2),
                assignment: Some(InspectAssignment {
                    generation: 2,
                    leader: s("broker-a"),
                    replicas: vec![s("broker-b")],
                    draining: false,
                    successor: s(""),
                }),
                fence: Some(InspectFence { took: vec![s("broker-b")], pending: vec![], attempts: 1, retry_in_ms: 0 }),
                lease: Some(InspectLease { held: true, remaining_ms: 4000 }),
                tail: Some(10),
                committed: Some(10),
                accepted_generation: Some(2),
                replicas: Some(vec![InspectReplica {
                    node_id: s("broker-b"),
                    role: s("follower"),
                    next_offset: 10,
                    lag: 0,
                    fence: true,
                    state: s("shipping"),
                    halted: None,
                }]),
            }),
        }),
        Message::SubscriptionsList(SubscriptionsList {
            request_id: 32,
            filter: Some(SubscriptionFilter {
                tenant_id: Some(t()),
                namespace: Some(ns()),
                stream: Some(st()),
                shard: Some(0),
                principal: Some(s("alice")),
                dropping: Some(true),
            }),
            limit: Some(100),
            cursor: Some(cursor()),
        }),
        Message::SubscriptionsListInfo(SubscriptionsListInfo {
            request_id: 32,
            node_id: s(""),
            subscriptions: vec![SubscriptionInfo {
                tenant_id: t(),
                namespace: ns(),
                stream: st(),
                shard: 0,
                subscriber_id: 3,
                subscription_id: 42,
                connection: Some(1),
                peer: Some(s("127.0.0.1:40000")),
                principal: Some(s("alice")),
                policy: s("drop_new"),
                depth: 2,
                capacity: 64,
                dropped: 0,
                position: Some(100),
                tail: 102,
                age_ms: 1500,
            }],
            next_cursor: Some(cursor()),
        }),
    ]
}

fn group_offset(request_id: u64) -> GroupOffset {
    GroupOffset {
        tenant_id: s("t1"),
        namespace: s("default"),
        stream: s("orders"),
        shard: 0,
        group: s("billing"),
        offset: 5,
        request_id,
    }
}

fn group_ref(request_id: u64) -> GroupRef {
    GroupRef {
        tenant_id: s("t1"),
        namespace: s("default"),
        stream: s("orders"),
        shard: 0,
        group: s("billing"),
        request_id,
    }
}

fn cursor() -> SubscriptionCursor {
    SubscriptionCursor { tenant_id: s("t1"), namespace: s("default"), stream: s("orders"), shard: 0, subscriber_id: 3 }
}

/// Extra JSON vectors for forms worth pinning beyond the fully populated ones: the minimal
/// (legacy-identical) shape of messages with optional fields, and enum spellings.
pub fn message_variants() -> Vec<(&'static str, Message)> {
    let sub = |start| {
        Message::Subscribe(Subscribe {
            tenant_id: s("t1"),
            namespace: s("default"),
            stream: s("demo"),
            subscription_id: None,
            start,
            shard: None,
            queue_capacity: None,
            filter: None,
        })
    };
    let refused = |reason| Message::PublishRefused(PublishRefused { request_id: 7, reason, message: s("refused") });
    vec![
        (
            "stream_read_replica_local",
            Message::StreamRead(StreamRead {
                tenant_id: s("t1"),
                namespace: s("default"),
                stream: s("orders"),
                shard: 1,
                from: 0,
                end: None,
                max_records: Some(100),
                max_bytes: None,
                request_id: 13,
                replica_local: Some(true),
            }),
        ),
        (
            "shard_move_cancel",
            Message::ShardMove(ShardMove {
                tenant_id: s("t1"),
                namespace: s("default"),
                stream: s("orders"),
                shard: 1,
                to: None,
                cancel: true,
                request_id: 37,
            }),
        ),
        (
            "cluster_status_page",
            Message::ClusterStatus(ClusterStatus {
                after: Some(s("stream~t1~default~orders~3")),
                limit: Some(500),
                request_id: 38,
            }),
        ),
        (
            "cluster_status_view_page",
            Message::ClusterStatusView(ClusterStatusView {
                status: serde_json::json!({
                    "cluster": true, "node_id": "n1", "leader": "n2", "fenced": false,
                    "members": [{"node_id": "n1", "client_addr": "10.0.0.1:5000", "cluster_addr": "10.0.0.1:7000", "state": "active"}],
                    "shards": [{"kind": "stream", "tenant": "t1", "namespace": "default", "name": "orders", "shard": 4,
                        "owner": "n1", "generation": 3}],
                    "moves": [], "revoked": {"jti": [], "sub": []},
                    "next": "stream~t1~default~orders~4"
                }),
                request_id: 38,
            }),
        ),
        (
            "cluster_status_view_single",
            Message::ClusterStatusView(ClusterStatusView {
                status: serde_json::json!({"cluster": false}),
                request_id: 35,
            }),
        ),
        ("subscribe_start_latest", sub(Some(StartPosition::Latest))),
        ("subscribe_start_earliest", sub(Some(StartPosition::Earliest))),
        ("publish_refused_unknown_producer", refused(RefusedReason::UnknownProducer)),
        ("publish_refused_sequence_expired", refused(RefusedReason::SequenceExpired)),
        ("publish_refused_sequence_reused", refused(RefusedReason::SequenceReused)),
        ("publish_refused_offset_mismatch", refused(RefusedReason::OffsetMismatch { tail: 44 })),
        // Upstream's serialisation omits `expected_offset` (and `shard`) when absent.
        (
            "commit_unconditional",
            Message::Commit(Commit {
                tenant_id: s("t1"),
                namespace: s("ns"),
                stream: s("orders"),
                entity_key: B64(Bytes::from_static(b"k")),
                event: B64(Bytes::from_static(b"created")),
                changes: vec![StateChange::Put { key: s("status"), value: B64(Bytes::from_static(b"open")) }],
                shard: None,
                request_id: 3,
                expected_offset: None,
            }),
        ),
        // A key never written (or deleted): `value` is null, not absent; no version.
        (
            "state_value_absent",
            Message::StateValue(StateValue { value: None, version: None, as_of: Some(44), request_id: 11 }),
        ),
        (
            "publish_refused_not_leader",
            refused(RefusedReason::NotLeader(LeaderHint { node_id: s("broker-b"), addr: Some(s("10.0.0.5:5000")) })),
        ),
        (
            "cache_put_no_ttl",
            Message::CachePut(CachePut {
                tenant_id: s("t1"),
                namespace: s("default"),
                cache: s("primary"),
                key: s("k"),
                value: b("v"),
                request_id: None,
                ttl_ms: None,
            }),
        ),
        (
            "cache_value_miss",
            Message::CacheValue(CacheValue {
                tenant_id: s("t1"),
                namespace: s("default"),
                cache: s("primary"),
                key: s("k"),
                value: None,
                request_id: Some(3),
                version: None,
            }),
        ),
        (
            "cache_put_if_absent",
            Message::CachePutIf(CachePutIf {
                tenant_id: s("t1"),
                namespace: s("default"),
                cache: s("primary"),
                key: s("k"),
                value: b("v"),
                ttl_ms: None,
                condition: CacheCondition::Absent,
                request_id: 4,
            }),
        ),
        (
            "cache_event_delete",
            Message::CacheEvent(CacheEvent { key: s("user:1"), value: None, offset: 22, expires_at_millis: 0 }),
        ),
        ("counter_value_never_written", Message::CounterValue(CounterValue { value: None, request_id: 19 })),
        (
            "error_with_code_only",
            Message::Error(ErrorMsg {
                message: s("no such stream"),
                code: Some(ErrorCode::NotFound),
                retry: Some(RetryClass::RetryAfter),
                detail: None,
            }),
        ),
        (
            "error_revoked",
            Message::Error(ErrorMsg {
                message: s("credential revoked"),
                code: Some(ErrorCode::Revoked),
                retry: Some(RetryClass::Fatal),
                detail: None,
            }),
        ),
        (
            "publish_error_stale_width",
            Message::PublishError(PublishError {
                request_id: 5,
                message: s("stream has 4 shards, batch was routed by 8"),
                code: Some(ErrorCode::StaleWidth),
                retry: Some(RetryClass::Retry),
                detail: None,
            }),
        ),
        ("publish_ok_no_offset", Message::PublishOk(PublishOk { request_id: 2, offset: None })),
        (
            "shard_moved_bare",
            Message::ShardMoved(ShardMoved {
                subscription_id: 7,
                resume_from: None,
                node_id: None,
                addr: None,
                generation: 9,
            }),
        ),
        (
            "subscribe_filtered",
            Message::Subscribe(Subscribe {
                tenant_id: s("t1"),
                namespace: s("default"),
                stream: s("orders"),
                subscription_id: Some(4),
                start: Some(StartPosition::Earliest),
                shard: None,
                queue_capacity: None,
                filter: Some(KeyFilter {
                    keys: vec![B64(Bytes::from_static(b"customer-7"))],
                    key_prefixes: vec![B64(Bytes::from_static(b"eu-")), B64(Bytes::new())],
                }),
            }),
        ),
        (
            "subscribed_plain",
            Message::Subscribed(Subscribed {
                subscription_id: 42,
                start_offset: None,
                live_offset: None,
                queue_capacity: None,
            }),
        ),
        (
            "auth_ok_with_window",
            Message::AuthOk(AuthOk {
                server_flags: 2047,
                server_flags_hi: None,
                server_features: Some(196_132),
                server_features_hi: None,
                listener_ports: None,
                publish_window: Some(256),
            }),
        ),
        (
            "auth_second_flag_word",
            Message::Auth(Auth {
                tenant_id: s("t1"),
                token: s("demo-token"),
                client_flags: Some(0xFFFF),
                client_flags_hi: Some(0x3),
                client_features: Some(0x8000_0800),
                client_features_hi: Some(0x2),
            }),
        ),
        (
            "auth_ok_second_flag_word",
            Message::AuthOk(AuthOk {
                server_flags: 0xFFFF,
                server_flags_hi: Some(0x3),
                server_features: Some(0x8000_0800),
                server_features_hi: Some(0x2),
                listener_ports: None,
                publish_window: None,
            }),
        ),
        (
            "auth_legacy",
            Message::Auth(Auth {
                tenant_id: s("t1"),
                token: s("demo-token"),
                client_flags: None,
                client_flags_hi: None,
                client_features: None,
                client_features_hi: None,
            }),
        ),
    ]
}

fn records(payloads: &[&str]) -> Records {
    Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).expect("small payloads")
}

/// Four JSON-like records, alike enough to compress.
pub const COMPRESSIBLE: [&str; 4] = [
    r#"{"user":"alice","action":"click","page":"/home","ms":120}"#,
    r#"{"user":"alice","action":"click","page":"/cart","ms":95}"#,
    r#"{"user":"bob","action":"click","page":"/home","ms":130}"#,
    r#"{"user":"alice","action":"click","page":"/home","ms":118}"#,
];

/// [`COMPRESSIBLE`] compressed with `codec` at its default level (D56).
pub fn packed_records(codec: Codec) -> Records {
    let mut c = Compressor::new(codec, codec.default_level()).expect("the default level is valid");
    let r = records(&COMPRESSIBLE).compressed(&mut c);
    debug_assert!(r.packed().is_some(), "the sample shrinks");
    r
}

/// Every publish-batch flag combination: 0x0001, 0x0041, 0x0009 (both modes), 0x0049, 0x0109,
/// 0x0149.
pub fn publish_batches() -> Vec<(&'static str, PublishBatch)> {
    let base = |acked, idempotent, key: Option<&str>| PublishBatch {
        acked,
        idempotent,
        key: key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
        tenant_id: s("t1"),
        namespace: s("default"),
        stream: s("demo"),
        records: records(&["hello", "world"]),
    };
    let acked = |mode| Some(AckedPrefix { request_id: 7, ack_mode: mode });
    let idem = Some(IdempotentPrefix { producer_id: 0x1234_5678_9abc_def0, sequence: 3 });
    let mut empty = base(None, None, None);
    empty.records = Records::default();
    vec![
        ("binary_publish_plain", base(None, None, None)),
        ("binary_publish_plain_empty_batch", empty),
        ("binary_publish_keyed_two", base(None, None, Some("customer-1"))),
        ("binary_publish_keyed_empty_key", base(None, None, Some(""))),
        ("binary_publish_acked_per_message", base(acked(AckMode::PerMessage), None, None)),
        ("binary_publish_acked_per_batch", base(acked(AckMode::PerBatch), None, None)),
        ("binary_publish_acked_keyed_two", base(acked(AckMode::PerBatch), None, Some("customer-1"))),
        ("binary_publish_idempotent", base(acked(AckMode::PerBatch), idem, None)),
        ("binary_publish_idempotent_keyed", base(acked(AckMode::PerBatch), idem, Some("customer-1"))),
        ("binary_publish_zstd", PublishBatch { records: packed_records(Codec::Zstd), ..base(None, None, None) }),
        (
            "binary_publish_envelope",
            PublishBatch {
                records: records(&["\u{1}sealed-one", "\u{1}sealed-two"])
                    .with_envelope(Some(Bytes::from_static(b"\x01\x01\x06key-07"))),
                ..base(acked(AckMode::PerBatch), None, Some("customer-1"))
            },
        ),
        (
            "binary_publish_zstd_envelope",
            PublishBatch {
                records: packed_records(Codec::Zstd).with_envelope(Some(Bytes::from_static(b"\x01\x01\x06key-07"))),
                ..base(None, None, None)
            },
        ),
        (
            "binary_publish_lz4_idempotent_keyed",
            PublishBatch {
                records: packed_records(Codec::Lz4),
                ..base(acked(AckMode::PerBatch), idem, Some("customer-1"))
            },
        ),
    ]
}

/// Every publish-ack shape: success with any of owner/offset, failure with any of code,
/// code+detail, owner.
pub fn acks() -> Vec<(&'static str, PublishAck)> {
    let owner = || Some(OwnerHint { node_id: s("broker-b"), addr: Some(s("10.0.0.5:5000")), generation: 9 });
    let ok = |offset, owner| PublishAck {
        status: AckStatus::Ok,
        request_id: 7,
        message: s(""),
        code: None,
        detail: None,
        owner,
        offset,
    };
    let err = |code: bool, detail: bool, owner| PublishAck {
        status: AckStatus::Error,
        request_id: 9,
        message: s("shard is moving"),
        code: code.then_some((ErrorCode::ShardUnavailable, RetryClass::Retry)),
        detail: detail.then(|| ErrorDetail { reason: Some(s("moving")), retry_after_ms: Some(250) }),
        owner,
        offset: None,
    };
    let mut stale = err(true, false, None);
    stale.code = Some((ErrorCode::StaleWidth, RetryClass::Retry));
    stale.message = s("stream has 4 shards, batch was routed by 8");
    let mut no_addr = ok(None, owner());
    if let Some(o) = no_addr.owner.as_mut() {
        o.addr = None;
    }
    let mut detail_empty = err(true, true, None);
    detail_empty.detail = Some(ErrorDetail::default());
    vec![
        ("binary_ack_ok_offset", ok(Some(100), None)),
        ("binary_ack_ok_owner", ok(None, owner())),
        ("binary_ack_ok_owner_no_addr", no_addr),
        ("binary_ack_ok_owner_offset", ok(Some(100), owner())),
        ("binary_ack_error_code", err(true, false, None)),
        ("binary_ack_error_code_detail", err(true, true, None)),
        ("binary_ack_error_detail_empty", detail_empty),
        ("binary_ack_error_owner", err(false, false, owner())),
        ("binary_ack_error_code_owner", err(true, false, owner())),
        ("binary_ack_error_code_detail_owner", err(true, true, owner())),
        ("binary_ack_error_stale_width", stale),
    ]
}

/// Every event-batch flag combination: legacy (0x0002) and shared (0x0004), each with no
/// offsets / offsets / offsets+skipped, with and without publisher, with and without timestamps.
pub fn event_batches() -> Vec<(String, EventBatch)> {
    let mut out = Vec::new();
    for legacy in [true, false] {
        for offsets in 0..3 {
            for publisher in [false, true] {
                for timed in [false, true] {
                    let mut name = String::from(if legacy { "binary_event_legacy" } else { "binary_event_shared" });
                    match offsets {
                        1 => name.push_str("_offsets"),
                        2 => name.push_str("_offsets_skipped"),
                        _ => {}
                    }
                    if publisher {
                        name.push_str("_publisher");
                    }
                    if timed {
                        name.push_str("_timestamps");
                    }
                    let plain = records(&["alpha", "beta"]);
                    out.push((
                        name,
                        EventBatch {
                            subscription_id: legacy.then_some(42),
                            base_offset: (offsets > 0).then_some(100),
                            skipped_before: (offsets == 2).then_some(1),
                            publisher: publisher.then(|| Bytes::from_static(b"alice")),
                            records: if timed { plain.with_timestamp(1_760_000_000_000_000) } else { plain },
                        },
                    ));
                }
            }
        }
    }
    // Compressed (D56): the shared form only, as a publisher's block was stored.
    out.push((
        "binary_event_shared_offsets_zstd".into(),
        EventBatch {
            subscription_id: None,
            base_offset: Some(100),
            skipped_before: None,
            publisher: None,
            records: packed_records(Codec::Zstd),
        },
    ));
    out.push((
        "binary_event_shared_offsets_envelope".into(),
        EventBatch {
            subscription_id: None,
            base_offset: Some(100),
            skipped_before: None,
            publisher: None,
            records: records(&["\u{1}sealed-one"]).with_envelope(Some(Bytes::from_static(b"\x01\x01\x06key-07"))),
        },
    ));
    out.push((
        "binary_event_shared_offsets_skipped_publisher_timestamps_lz4".into(),
        EventBatch {
            subscription_id: None,
            base_offset: Some(100),
            skipped_before: Some(1),
            publisher: Some(Bytes::from_static(b"alice")),
            records: packed_records(Codec::Lz4).with_timestamp(1_760_000_000_000_000),
        },
    ));
    out
}
