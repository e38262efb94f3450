//! The client's protocol decisions, made in `ClientConnection` (not in a driver): where requests
//! go, what waits for what, what a subscription's events look like to the application, when an
//! event stream pauses, and what happens to pending work when a stream, the connection or the
//! clock runs out. Each case feeds hand-written broker frames to a bare state machine.

mod support;

use bytes::{Bytes, BytesMut};
use felix_proto::binary::{EventBatch, Records};
use felix_proto::client::{
    ClientConfig, ClientConnection, ClientEvent, ClientOutput, ClientStream, EndReason, PublishRequest, Reply,
    SubscribeRequest,
};
use felix_proto::error_code::RetryClass;
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::transport::{Dir, OpenToken, Side, StreamId};
use std::time::{Duration, Instant};
use support::{epoch, frames};

fn json(m: &Message) -> Bytes {
    let mut b = BytesMut::new();
    m.encode(&mut b).unwrap();
    b.freeze()
}

fn auth_ok(window: Option<u32>) -> Bytes {
    let (server_features, server_features_hi) =
        (Features::PUBLISH_PIPELINE | Features::STREAM_PUBLISH_WINDOW | Features::CONSUMER_GROUP).to_words(true);
    json(&Message::AuthOk(message::AuthOk {
        server_flags: 0x7FFF,
        server_flags_hi: None,
        server_features,
        server_features_hi,
        listener_ports: None,
        publish_window: window,
    }))
}

/// A harness: the client, its clock, and the streams it opened (in order).
struct H {
    c: ClientConnection,
    now: Instant,
    opened: Vec<StreamId>,
    next_bi: u64,
}

impl H {
    fn new(cfg: ClientConfig) -> H {
        let now = epoch();
        let mut h = H { c: ClientConnection::new(cfg, now), now, opened: Vec::new(), next_bi: 0 };
        h.outputs();
        h
    }

    /// Opens what the client asked to open; returns the transmits (stream, bytes) and the rest.
    fn outputs(&mut self) -> (Vec<(StreamId, Bytes)>, Vec<ClientOutput>) {
        let (mut tx, mut rest) = (Vec::new(), Vec::new());
        while let Some(o) = self.c.poll_output() {
            match o {
                ClientOutput::OpenBi { token } => self.open(token),
                ClientOutput::Transmit { stream, data } => tx.push((stream, data)),
                other => rest.push(other),
            }
        }
        (tx, rest)
    }

    fn open(&mut self, token: OpenToken) {
        let s = StreamId::new(Side::Client, Dir::Bi, self.next_bi);
        self.next_bi += 1;
        self.opened.push(s);
        self.c.handle_stream_opened(token, s, self.now);
    }

    fn feed(&mut self, s: StreamId, data: Bytes) {
        self.c.handle_stream_data(s, data, false, self.now);
    }

    fn events(&mut self) -> Vec<ClientEvent> {
        std::iter::from_fn(|| self.c.poll_event()).collect()
    }

    fn connected(cfg: ClientConfig, window: Option<u32>) -> H {
        let mut h = H::new(cfg);
        let s = h.opened[0];
        h.feed(s, auth_ok(window));
        h.events();
        h.outputs();
        h
    }
}

fn cfg() -> ClientConfig {
    ClientConfig::new("t1", "tok")
}

fn sub_req() -> SubscribeRequest {
    SubscribeRequest {
        namespace: "ns".into(),
        stream: "s".into(),
        start: None,
        shard: None,
        queue_capacity: None,
        filter: None,
    }
}

fn batch_frame(base: u64, payloads: &[&str]) -> Bytes {
    let records = Records::from_payloads(payloads.iter().map(|p| p.to_string())).unwrap();
    let mut b = BytesMut::new();
    EventBatch { base_offset: Some(base), ..EventBatch::shared(records) }.encode(&mut b).unwrap();
    b.freeze()
}

fn hello(sub: u64) -> Bytes {
    json(&Message::EventStreamHello(message::EventStreamHello { subscription_id: sub }))
}

fn subscribed(sub: u64) -> Bytes {
    json(&Message::Subscribed(message::Subscribed {
        subscription_id: sub,
        start_offset: Some(0),
        live_offset: Some(0),
        queue_capacity: None,
    }))
}

const EVENTS: StreamId = StreamId(3); // broker-initiated, unidirectional

#[test]
fn events_that_arrive_before_the_confirmation_are_delivered_after_it() {
    let mut h = H::connected(cfg(), None);
    let sub = h.c.subscribe_dedicated(sub_req(), h.now).unwrap();
    h.outputs();
    let ded = h.opened[1];
    h.feed(ded, auth_ok(None));
    h.outputs();
    // The event stream (hello, two batches, the end) arrives before `subscribed`.
    h.c.handle_stream_data(
        EVENTS,
        [hello(sub), batch_frame(0, &["a"]), batch_frame(1, &["b"])].concat().into(),
        true,
        h.now,
    );
    let early = h.events();
    assert!(
        early.iter().all(|e| matches!(e, ClientEvent::Connected { .. })),
        "nothing before the confirmation: {early:?}"
    );
    h.feed(ded, subscribed(sub));
    let ev = h.events();
    assert!(matches!(ev[0], ClientEvent::Subscribed { sub: s, .. } if s == sub), "{ev:?}");
    assert!(matches!(&ev[1], ClientEvent::Events { batch, .. } if batch.base_offset == Some(0)), "{ev:?}");
    assert!(matches!(&ev[2], ClientEvent::Events { batch, .. } if batch.base_offset == Some(1)), "{ev:?}");
    assert!(matches!(&ev[3], ClientEvent::SubscriptionEnded { reason: EndReason::Finished, .. }), "{ev:?}");
    // The dedicated stream was finished once answered.
    let (_, rest) = h.outputs();
    assert!(rest.contains(&ClientOutput::Finish { stream: ded }), "{rest:?}");
}

#[test]
fn a_subscription_holding_too_much_pauses_its_stream_and_resumes_once_taken() {
    let mut c = cfg();
    c.subscription_buffer_bytes = 100;
    let mut h = H::connected(c, None);
    let sub = h.c.subscribe(ClientStream(0), sub_req(), h.now).unwrap();
    h.outputs();
    h.feed(h.opened[0], subscribed(sub));
    let payload = "x".repeat(60);
    h.c.handle_stream_data(EVENTS, [hello(sub), batch_frame(0, &[&payload])].concat().into(), false, h.now);
    assert!(h.outputs().1.is_empty(), "64 bytes held: under the limit");
    h.c.handle_stream_data(EVENTS, batch_frame(1, &[&payload]), false, h.now);
    assert_eq!(h.outputs().1, vec![ClientOutput::PauseReading { stream: EVENTS }]);
    let taken: usize = h.events().iter().map(felix_proto::client::event_bytes).sum();
    assert_eq!(taken, 128);
    h.c.handle_consumed(sub, 64, h.now);
    assert!(h.outputs().1.is_empty(), "64 held: not yet below half");
    h.c.handle_consumed(sub, 64, h.now);
    assert_eq!(h.outputs().1, vec![ClientOutput::ResumeReading { stream: EVENTS }]);
}

#[test]
fn an_unanswered_request_times_out_and_its_late_answer_matches_nothing_else() {
    let mut c = cfg();
    c.request_timeout = Duration::from_secs(5);
    let mut h = H::connected(c, None);
    let first = h.c.cache_get(ClientStream(0), "ns", "c", "k").unwrap();
    h.now += Duration::from_secs(3);
    h.c.handle_timeout(h.now); // the client learns the time from its inputs
    let second = h.c.cache_get(ClientStream(0), "ns", "c", "k2").unwrap();
    assert_eq!(h.c.poll_timeout(), Some(h.now + Duration::from_secs(2)), "the earliest deadline");
    h.now += Duration::from_secs(2);
    h.c.handle_timeout(h.now);
    let ev = h.events();
    assert!(
        matches!(&ev[..], [ClientEvent::RequestFailed { request_id, error, .. }]
            if *request_id == first && error.retry == Some(RetryClass::OutcomeUnknown)),
        "{ev:?}"
    );
    // The first request's late answer is an id-less error: it must not be taken for the second's.
    let err =
        json(&Message::Error(message::ErrorMsg { message: "late".into(), code: None, retry: None, detail: None }));
    h.feed(h.opened[0], err);
    assert!(h.events().is_empty());
    let ok = json(&Message::CacheValue(message::CacheValue {
        tenant_id: "t1".into(),
        namespace: "ns".into(),
        cache: "c".into(),
        key: "k2".into(),
        value: None,
        request_id: Some(second),
        version: None,
    }));
    h.feed(h.opened[0], ok);
    assert_eq!(
        h.events(),
        vec![ClientEvent::Reply { request_id: second, reply: Reply::CacheValue { value: None, version: None } }]
    );
    assert_eq!(h.c.poll_timeout(), None, "nothing left to time out");
}

#[test]
fn a_lost_connection_fails_everything_pending_and_refuses_what_follows() {
    let mut h = H::connected(cfg(), Some(1));
    let get = h.c.cache_get(ClientStream(0), "ns", "c", "k").unwrap();
    let sub = h.c.subscribe(ClientStream(0), sub_req(), h.now).unwrap();
    let p1 = h.c.publish_auto(PublishRequest::new("ns", "s", vec![Bytes::from("a")]).acked(), h.now).unwrap();
    let p2 = h.c.publish_auto(PublishRequest::new("ns", "s", vec![Bytes::from("b")]).acked(), h.now).unwrap();
    h.outputs();
    h.c.handle_connection_lost("peer gone", h.now);
    let ev = h.events();
    let failed_req =
        ev.iter().any(|e| matches!(e, ClientEvent::RequestFailed { request_id, .. } if *request_id == get));
    let failed_sub = ev.iter().any(|e| matches!(e, ClientEvent::SubscribeFailed { sub: s, .. } if *s == sub));
    let failed_pubs = [p1, p2]
        .iter()
        .all(|p| ev.iter().any(|e| matches!(e, ClientEvent::PublishFailed { id, error } if id == p && error.retry == Some(RetryClass::OutcomeUnknown))));
    assert!(failed_req && failed_sub && failed_pubs, "{ev:?}");
    assert!(matches!(ev.last(), Some(ClientEvent::ConnectionLost { .. })));
    assert!(h.c.publish_auto(PublishRequest::new("ns", "s", vec![]), h.now).is_err());
    assert_eq!(h.c.poll_timeout(), None);
}

#[test]
fn publishes_wait_for_authentication_and_for_room_in_the_window_then_go_in_order() {
    let mut h = H::new(cfg());
    let ids: Vec<_> = (0..3)
        .map(|i| {
            h.c.publish_auto(PublishRequest::new("ns", "s", vec![Bytes::from(format!("p{i}"))]).acked(), h.now).unwrap()
        })
        .collect();
    let (tx, _) = h.outputs();
    assert!(tx.is_empty(), "nothing before the stream authenticated");
    h.feed(h.opened[0], auth_ok(Some(2)));
    let (tx, _) = h.outputs();
    assert_eq!(tx.len(), 2, "two go out: the window is 2");
    let ack = |id: u64| json(&Message::PublishOk(message::PublishOk { request_id: id, offset: Some(id) }));
    h.feed(h.opened[0], ack(ids[0].0));
    let (tx, _) = h.outputs();
    assert_eq!(tx.len(), 1, "the third goes once the first is answered");
}

#[test]
fn a_long_poll_goes_on_its_own_stream_held_until_it_authenticated() {
    let mut h = H::connected(cfg(), None);
    let poll = |wait_ms: u64| {
        move |request_id| {
            Message::GroupPoll(message::GroupPoll {
                tenant_id: "t1".into(),
                namespace: "ns".into(),
                stream: "s".into(),
                shard: 0,
                group: "g".into(),
                max_records: 1,
                wait_ms,
                request_id,
                consumer: None,
                reclaim: None,
                visibility_ms: None,
            })
        }
    };
    h.c.request_auto(poll(0), h.now).unwrap();
    let (tx, _) = h.outputs();
    assert_eq!(tx.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![h.opened[0]], "a short poll: the main stream");
    h.c.request_auto(poll(10_000), h.now).unwrap();
    let (tx, _) = h.outputs();
    let long = h.opened[1];
    assert_eq!(tx.len(), 1, "only its auth: the poll waits for the new stream to authenticate");
    assert_eq!(tx[0].0, long);
    h.feed(long, auth_ok(None));
    let (tx, _) = h.outputs();
    assert_eq!(tx.len(), 1);
    assert_eq!(tx[0].0, long);
    assert!(matches!(&frames(&tx[0].1)[0], f if String::from_utf8_lossy(&f.payload).contains("\"wait_ms\":10000")));
}

#[test]
fn a_reset_event_stream_ends_its_subscription() {
    let mut h = H::connected(cfg(), None);
    let sub = h.c.subscribe(ClientStream(0), sub_req(), h.now).unwrap();
    h.feed(h.opened[0], subscribed(sub));
    h.c.handle_stream_data(EVENTS, hello(sub), false, h.now);
    h.events();
    h.c.handle_stream_reset(EVENTS, h.now);
    assert_eq!(h.events(), vec![ClientEvent::SubscriptionEnded { sub, reason: EndReason::Reset }]);
}

/// A refreshed token (`set_token`): a new main stream authenticates with it at once and takes
/// everything sent from then on; the old stream still gets the answers to what was sent on it,
/// then is finished (not before). A publish made before the new stream authenticated waits for
/// it.
#[test]
fn a_refreshed_token_moves_new_work_to_a_stream_authenticated_with_it_and_retires_the_old_one() {
    let mut h = H::connected(cfg(), Some(8));
    let old = h.opened[0];
    let first = h.c.publish_auto(PublishRequest::new("ns", "s", vec![Bytes::from("a")]).acked(), h.now).unwrap();
    let (tx, _) = h.outputs();
    assert_eq!(tx.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [old]);
    h.c.set_token("fresh", h.now);
    let second = h.c.publish_auto(PublishRequest::new("ns", "s", vec![Bytes::from("b")]).acked(), h.now).unwrap();
    let (tx, rest) = h.outputs();
    assert_eq!(h.opened.len(), 2, "a new stream");
    let new = h.opened[1];
    let auths: Vec<Message> = tx.iter().filter(|(s, _)| *s == new).flat_map(|(_, d)| support::messages(d)).collect();
    assert!(
        matches!(&auths[..], [Message::Auth(a)] if a.token == "fresh"),
        "only its auth, with the new token: {auths:?}"
    );
    assert!(!tx.iter().any(|(s, _)| *s == old), "nothing new on the old stream");
    assert!(!rest.iter().any(|o| matches!(o, ClientOutput::Finish { .. })), "the old one still owes an answer");
    // The new stream authenticates: the waiting publish goes out on it.
    h.feed(new, auth_ok(Some(8)));
    let (tx, _) = h.outputs();
    assert_eq!(tx.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [new]);
    // The old stream's answer arrives there; then it is finished.
    let ack = |id: u64| json(&Message::PublishOk(message::PublishOk { request_id: id, offset: Some(id) }));
    h.feed(old, ack(first.0));
    let (_, rest) = h.outputs();
    assert!(rest.iter().any(|o| matches!(o, ClientOutput::Finish { stream } if *stream == old)), "{rest:?}");
    h.feed(new, ack(second.0));
    let acked: Vec<_> = h
        .events()
        .into_iter()
        .filter_map(|e| if let ClientEvent::PublishAcked { id, .. } = e { Some(id) } else { None })
        .collect();
    assert_eq!(acked, [first, second]);
    // A retired stream with nothing outstanding is finished at once.
    h.c.set_token("fresher", h.now);
    let (_, rest) = h.outputs();
    assert!(rest.iter().any(|o| matches!(o, ClientOutput::Finish { stream } if *stream == new)), "{rest:?}");
}
