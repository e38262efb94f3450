//! Control streams: each authenticates on its own, carries requests, and matches the broker's
//! answers to them (by request id, or by order for the id-less `error`, `subscribe_cursor_error`
//! and `not_leader`, which a broker sends in request order).

use super::{
    CacheWatchRequest, ClientConnection, ClientEvent, ClientOutput, ClientStream, ErrorInfo, Reply, SubscribeRequest,
    Timer, error_info,
};
use crate::binary::{AckStatus, PublishAck};
use crate::error_code::{ErrorCode, RetryClass};
use crate::flags::Flags;
use crate::frame::{Frame, FrameDecoder};
use crate::message::{self, Decoded, Message};
use crate::negotiate::Negotiated;
use crate::payload::Payload;
use crate::transport::{OpenToken, StreamId};
use bytes::Bytes;
use std::collections::VecDeque;

/// Where a control stream is in its life.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum CtlState {
    /// `auth` sent (or waiting for the stream to open), no answer yet.
    Authenticating,
    /// Authenticated: requests may go out.
    Ready(Negotiated),
    /// `auth` was refused.
    Refused,
    /// Ended: by the broker (finished or reset), by us (a dedicated stream once answered), or
    /// with the connection.
    Closed,
}

/// What a stream is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Ordinary requests and publishes ([`ClientConnection::publish_auto`],
    /// [`ClientConnection::request_auto`]).
    Main,
    /// Long polls, so they hold up nothing else.
    Long,
    /// One subscription or cache watch; finished by us once it is answered.
    Dedicated,
    /// Opened by the embedder with [`ClientConnection::open_stream`].
    Plain,
    /// A main or long-poll stream authenticated with a token since replaced
    /// ([`ClientConnection::set_token`]): nothing new goes on it, and it is finished once
    /// everything sent on it is answered.
    Retired,
}

/// An answer a stream waits for, in the order the requests went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Awaiting {
    Sub(u64),
    Request(u64),
    /// A request given up on (timed out): its late answer, if any, is taken and dropped, so
    /// that id-less answers still match the requests behind it.
    Expired,
}

/// A request held until its stream authenticated.
#[derive(Debug)]
pub(super) enum Queued {
    Request { request_id: u64, message: Message, extra: std::time::Duration },
    Sub { sub: u64, req: SubRequest },
}

/// What opens a subscription: a stream subscription or a cache watch. Both take a client-chosen
/// subscription id, an event stream and the same answers, so they share one path.
#[derive(Debug, Clone)]
pub(super) enum SubRequest {
    Subscribe(SubscribeRequest),
    Watch(CacheWatchRequest),
}

#[derive(Debug)]
pub(super) struct Ctl {
    pub(super) id: Option<StreamId>,
    /// Frames written before the stream had an id.
    pub(super) pending: Vec<Bytes>,
    pub(super) decoder: FrameDecoder,
    pub(super) state: CtlState,
    pub(super) role: Role,
    /// Acked publishes unanswered on this stream (its publish window).
    pub(super) inflight: u32,
    pub(super) was_full: bool,
    pub(super) awaiting: VecDeque<Awaiting>,
    pub(super) queued: Vec<Queued>,
}

impl ClientConnection {
    /// Opens another control stream (it authenticates on its own) for the embedder's own use.
    pub fn open_stream(&mut self, now: std::time::Instant) -> ClientStream {
        self.clock.advance(now);
        self.open_ctl(Role::Plain)
    }

    pub(super) fn open_ctl(&mut self, role: Role) -> ClientStream {
        let mut decoder = self.new_decoder();
        decoder.set_accepted_flags(Flags::BROKER_SENDS);
        let auth = Message::Auth(message::Auth {
            tenant_id: self.cfg.tenant_id.clone(),
            token: self.cfg.token.clone(),
            client_flags: self.cfg.flags.map(|_| self.offered_flags().bits()),
            client_flags_hi: Some(self.offered_flags_hi().bits()).filter(|h| *h != 0),
            client_features: self.cfg.features.to_words(true).0,
            client_features_hi: self.cfg.features.to_words(true).1,
        });
        let idx = self.ctls.len();
        self.ctls.push(Ctl {
            id: None,
            pending: super::frame_of(&auth).into_iter().collect(),
            decoder,
            state: CtlState::Authenticating,
            role,
            inflight: 0,
            was_full: false,
            awaiting: VecDeque::new(),
            queued: Vec::new(),
        });
        let token = OpenToken(self.next_open);
        self.next_open += 1;
        self.opens.insert(token, idx);
        self.out.push_back(ClientOutput::OpenBi { token });
        ClientStream(idx as u32)
    }

    /// What a stream negotiated, once `Connected`.
    pub fn negotiated(&self, stream: ClientStream) -> Option<&Negotiated> {
        match &self.ctls.get(stream.0 as usize)?.state {
            CtlState::Ready(n) => Some(n),
            _ => None,
        }
    }

    /// What some stream of this connection negotiated (every stream negotiates the same with
    /// one broker).
    pub(super) fn any_negotiated(&self) -> Option<Negotiated> {
        self.ctls.iter().find_map(|c| match c.state {
            CtlState::Ready(n) => Some(n),
            _ => None,
        })
    }

    pub(super) fn send(&mut self, idx: usize, data: Bytes) {
        let ctl = &mut self.ctls[idx];
        match ctl.id {
            Some(stream) => self.out.push_back(ClientOutput::Transmit { stream, data }),
            None => ctl.pending.push(data),
        }
    }

    /// The stream's index, if it authenticated and is open.
    pub(super) fn ctl_index(&self, stream: ClientStream) -> Result<usize, super::CommandError> {
        if let Some(why) = &self.lost {
            return Err(super::CommandError::ConnectionLost(why.clone()));
        }
        let idx = stream.0 as usize;
        match self.ctls.get(idx).map(|c| c.state) {
            None => Err(super::CommandError::Unknown),
            Some(CtlState::Ready(_)) => Ok(idx),
            Some(_) => Err(super::CommandError::NotConnected),
        }
    }

    pub(super) fn negotiated_at(&self, idx: usize) -> Negotiated {
        match self.ctls[idx].state {
            CtlState::Ready(n) => n,
            _ => unreachable!("ctl_index checked the stream is ready"),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Receiving

    pub(super) fn control_data(&mut self, idx: usize, chunks: impl IntoIterator<Item = Bytes>, fin: bool) {
        for data in chunks {
            self.ctls[idx].decoder.push(data);
        }
        loop {
            match self.ctls[idx].decoder.next_frame() {
                Ok(Some(f)) => self.control_frame(idx, f),
                Ok(None) => break,
                Err(e) => {
                    self.events.push_back(ClientEvent::ProtocolError { reason: e.to_string() });
                    if e.is_fatal() {
                        break;
                    }
                }
            }
        }
        if fin {
            self.stream_ended(idx);
        }
        if self.ctls[idx].role == Role::Retired {
            self.finish_retired(idx);
        }
    }

    /// Finishes a retired stream once nothing sent on it waits for an answer.
    pub(super) fn finish_retired(&mut self, idx: usize) {
        let ctl = &mut self.ctls[idx];
        if ctl.role == Role::Retired
            && ctl.awaiting.is_empty()
            && ctl.queued.is_empty()
            && ctl.inflight == 0
            && let CtlState::Ready(_) = ctl.state
        {
            ctl.state = CtlState::Closed;
            if let Some(stream) = ctl.id {
                self.out.push_back(ClientOutput::Finish { stream });
            }
        }
    }

    /// Replaces the token new control streams authenticate with (a refreshed credential before
    /// the old one expires): the main and long-poll streams are retired (what was sent on them
    /// is still answered there, then they are finished) and a new main stream authenticates
    /// with `token` at once; every request, publish, subscription and watch from now on goes
    /// on streams authenticated with it. Subscriptions already open stay on the streams they
    /// were opened with: the broker ends them `revoked` when the old token expires.
    pub fn set_token(&mut self, token: impl Into<String>, now: std::time::Instant) {
        self.clock.advance(now);
        self.cfg.token = token.into();
        if self.lost.is_some() {
            return;
        }
        for idx in [Some(self.main), self.long.take()].into_iter().flatten() {
            if !matches!(self.ctls[idx].state, CtlState::Closed | CtlState::Refused) {
                self.ctls[idx].role = Role::Retired;
                self.finish_retired(idx);
            }
        }
        self.main = self.open_ctl(Role::Main).0 as usize;
    }

    /// The broker ended a control stream (finished or reset it): whatever was waiting on it will
    /// never be answered, and fails now.
    pub(super) fn stream_ended(&mut self, idx: usize) {
        if self.ctls[idx].state == CtlState::Closed {
            return;
        }
        let why = ErrorInfo::unknown_outcome("the broker closed the control stream before answering");
        self.fail_stream(idx, &why);
        self.events.push_back(ClientEvent::StreamClosed { stream: ClientStream(idx as u32) });
    }

    /// Fails everything pending or queued on a stream, and closes it.
    pub(super) fn fail_stream(&mut self, idx: usize, why: &ErrorInfo) {
        self.ctls[idx].state = CtlState::Closed;
        for q in std::mem::take(&mut self.ctls[idx].queued) {
            self.fail_queued(q, why.clone());
        }
        for a in std::mem::take(&mut self.ctls[idx].awaiting) {
            match a {
                Awaiting::Sub(sub) => self.subscribe_failed(sub, why.clone(), None, None),
                Awaiting::Request(request_id) => self.request_failed(request_id, why.clone(), None, None),
                Awaiting::Expired => {}
            }
        }
        let mut stranded: Vec<u64> =
            self.publishes.iter().filter(|(_, (_, i))| *i == idx).map(|(request_id, _)| *request_id).collect();
        stranded.sort_unstable();
        for request_id in stranded {
            if let Some(id) = self.publish_done(request_id) {
                self.events.push_back(ClientEvent::PublishFailed { id, error: why.clone() });
            }
        }
    }

    fn control_frame(&mut self, idx: usize, f: Frame) {
        match f.decode_payload() {
            Ok(Payload::Ack(a)) => self.on_ack(a),
            Ok(Payload::Json(Decoded::Message(m))) => self.control_message(idx, m),
            Ok(Payload::Json(Decoded::Unknown(u))) => self
                .events
                .push_back(ClientEvent::ProtocolError { reason: format!("unknown message type {}", u.type_name) }),
            Ok(_) => self.events.push_back(ClientEvent::ProtocolError { reason: "unexpected frame kind".into() }),
            Err(e) => self.events.push_back(ClientEvent::ProtocolError { reason: e.to_string() }),
        }
    }

    fn on_ack(&mut self, a: PublishAck) {
        let Some(id) = self.publish_done(a.request_id) else {
            return self
                .events
                .push_back(ClientEvent::ProtocolError { reason: format!("ack for unknown request {}", a.request_id) });
        };
        match a.status {
            AckStatus::Ok => self.events.push_back(ClientEvent::PublishAcked { id, offset: a.offset, owner: a.owner }),
            AckStatus::Error => {
                let (code, retry) = a.code.map_or((None, None), |(c, r)| (Some(c), Some(r)));
                let error = ErrorInfo { message: a.message, code, retry, detail: a.detail };
                self.events.push_back(ClientEvent::PublishFailed { id, error });
            }
        }
    }

    /// A stream authenticated: what waited for it goes out, each request checked against what
    /// the broker advertised (a request it cannot take fails, nothing is sent).
    fn authenticated(&mut self, idx: usize, n: Negotiated) {
        self.ctls[idx].state = CtlState::Ready(n);
        self.events.push_back(ClientEvent::Connected { stream: ClientStream(idx as u32), negotiated: n });
        for q in std::mem::take(&mut self.ctls[idx].queued) {
            self.send_queued(idx, q);
        }
        if idx == self.main {
            self.flush_publishes();
        }
    }

    fn control_message(&mut self, idx: usize, m: Message) {
        let stream = ClientStream(idx as u32);
        let (flags, flags_hi, features) = (self.offered_flags(), self.offered_flags_hi(), self.cfg.features);
        let authenticating = self.ctls[idx].state == CtlState::Authenticating;
        match m {
            Message::AuthOk(a) if authenticating => {
                self.authenticated(idx, Negotiated::from_auth_ok(&a, flags, flags_hi, features))
            }
            Message::Ok(_) if authenticating => self.authenticated(idx, Negotiated::legacy(flags, flags_hi, features)),
            Message::Error(e) if authenticating => {
                let error = error_info(e);
                self.ctls[idx].state = CtlState::Refused;
                self.fail_stream(idx, &error);
                self.ctls[idx].state = CtlState::Refused;
                self.events.push_back(ClientEvent::AuthFailed { stream, error });
            }
            Message::PublishOk(p) => {
                if let Some(id) = self.publish_done(p.request_id) {
                    self.events.push_back(ClientEvent::PublishAcked { id, offset: p.offset, owner: None });
                }
            }
            Message::PublishRefused(p) => {
                if let Some(id) = self.publish_done(p.request_id) {
                    self.events.push_back(ClientEvent::PublishRefused { id, reason: p.reason, message: p.message });
                } else if self.settle(idx, Awaiting::Request(p.request_id)) {
                    // A refused commit: a request, not a publish.
                    self.reply(p.request_id, Reply::Refused { reason: p.reason, message: p.message });
                }
            }
            Message::PublishError(p) => {
                if let Some(id) = self.publish_done(p.request_id) {
                    let error = ErrorInfo { message: p.message, code: p.code, retry: p.retry, detail: p.detail };
                    self.events.push_back(ClientEvent::PublishFailed { id, error });
                }
            }
            Message::Subscribed(s) => {
                if self.settle(idx, Awaiting::Sub(s.subscription_id)) {
                    self.subscription_confirmed(
                        s.subscription_id,
                        ClientEvent::Subscribed {
                            sub: s.subscription_id,
                            start_offset: s.start_offset,
                            live_offset: s.live_offset,
                            queue_capacity: s.queue_capacity,
                        },
                    );
                }
                self.finish_dedicated(idx);
            }
            Message::CacheWatchStarted(w) => {
                if self.settle(idx, Awaiting::Sub(w.subscription_id)) {
                    self.subscription_confirmed(
                        w.subscription_id,
                        ClientEvent::CacheWatchStarted {
                            sub: w.subscription_id,
                            resume_offset: w.resume_offset,
                            resnapshot: w.resnapshot,
                            retained_count: w.retained_count,
                        },
                    );
                }
                self.finish_dedicated(idx);
            }
            Message::SubscribeCursorError(c) => {
                let error = ErrorInfo {
                    message: format!("cursor {:?}: requested {}, available {}", c.reason, c.requested, c.available),
                    code: None,
                    retry: None,
                    detail: None,
                };
                self.fail_oldest(idx, error, Some(c), None);
            }
            Message::NotLeader(n) => {
                let error = ErrorInfo {
                    message: format!("shard owned by {}", n.node_id),
                    code: Some(ErrorCode::NotLeader),
                    retry: Some(RetryClass::Redirect),
                    detail: None,
                };
                self.fail_oldest(idx, error, None, Some(n));
            }
            // Errors carry no request id: the oldest unanswered request on the stream claims it
            // (a broker answers a stream's requests in order).
            Message::Error(e) => self.fail_oldest(idx, error_info(e), None, None),
            // A legacy broker answers a cache write with a bare `ok`.
            Message::Ok(_) => self.reply_oldest(idx, Reply::Done),
            Message::Unsupported(u) => {
                if let Some(request_id) = u.request_id
                    && self.settle(idx, Awaiting::Request(request_id))
                {
                    let error = ErrorInfo {
                        message: format!("the broker does not serve {}", u.request_type),
                        code: Some(ErrorCode::UnknownName("unsupported".into())),
                        retry: Some(RetryClass::Fatal),
                        detail: None,
                    };
                    self.request_failed(request_id, error, None, None);
                }
                self.events.push_back(ClientEvent::Unsupported { request_type: u.request_type });
            }
            other => match typed_reply(other) {
                Ok((Some(request_id), reply)) => {
                    if self.settle(idx, Awaiting::Request(request_id)) {
                        self.reply(request_id, reply);
                    }
                }
                Ok((None, reply)) => self.reply_oldest(idx, reply),
                Err(other) => self.events.push_back(ClientEvent::ProtocolError {
                    reason: format!("unexpected {} on a control stream", other.type_name()),
                }),
            },
        }
    }

    /// Removes what an answer settles from the stream's order. `false` when nothing was waiting
    /// for it (an answer to a request given up on).
    fn settle(&mut self, idx: usize, what: Awaiting) -> bool {
        let awaiting = &mut self.ctls[idx].awaiting;
        match awaiting.iter().position(|a| *a == what) {
            Some(i) => {
                awaiting.remove(i);
                match what {
                    Awaiting::Sub(s) => self.disarm(Timer::Subscribe(s)),
                    Awaiting::Request(r) => self.disarm(Timer::Request(r)),
                    Awaiting::Expired => {}
                }
                true
            }
            None => false,
        }
    }

    /// An id-less success (a legacy broker's `ok`) answers the oldest request on the stream.
    fn reply_oldest(&mut self, idx: usize, reply: Reply) {
        match self.ctls[idx].awaiting.pop_front() {
            Some(Awaiting::Request(request_id)) => {
                self.disarm(Timer::Request(request_id));
                self.reply(request_id, reply);
            }
            Some(Awaiting::Sub(sub)) => {
                // Not an answer a subscribe can have: keep it waiting.
                self.ctls[idx].awaiting.push_front(Awaiting::Sub(sub));
                self.events
                    .push_back(ClientEvent::ProtocolError { reason: "an id-less ok answered a subscribe".into() });
            }
            Some(Awaiting::Expired) | None => {}
        }
    }

    /// An answer with no request id (`error`, `subscribe_cursor_error`, `not_leader`) settles
    /// the oldest unanswered request on the stream.
    fn fail_oldest(
        &mut self,
        idx: usize,
        error: ErrorInfo,
        cursor: Option<message::SubscribeCursorError>,
        redirect: Option<message::NotLeader>,
    ) {
        match self.ctls[idx].awaiting.pop_front() {
            Some(Awaiting::Sub(sub)) => {
                self.disarm(Timer::Subscribe(sub));
                self.subscribe_failed(sub, error, cursor, redirect);
                self.finish_dedicated(idx);
            }
            Some(Awaiting::Request(request_id)) => {
                self.disarm(Timer::Request(request_id));
                self.request_failed(request_id, error, cursor, redirect);
            }
            Some(Awaiting::Expired) => {}
            None => self.events.push_back(ClientEvent::Error { stream: ClientStream(idx as u32), error }),
        }
    }

    pub(super) fn reply(&mut self, request_id: u64, reply: super::Reply) {
        self.events.push_back(ClientEvent::Reply { request_id, reply });
    }

    pub(super) fn request_failed(
        &mut self,
        request_id: u64,
        error: ErrorInfo,
        cursor: Option<message::SubscribeCursorError>,
        redirect: Option<message::NotLeader>,
    ) {
        self.disarm(Timer::Request(request_id));
        self.events.push_back(ClientEvent::RequestFailed { request_id, error, cursor, redirect });
    }

    /// A request's deadline passed: it fails, and a late answer is dropped.
    pub(super) fn expire_request(&mut self, request_id: u64, why: ErrorInfo) {
        // Publish answers always carry their request id: nothing to keep for a late one.
        if let Some(id) = self.publish_done(request_id) {
            return self.events.push_back(ClientEvent::PublishFailed { id, error: why });
        }
        for ctl in &mut self.ctls {
            if let Some(a) = ctl.awaiting.iter_mut().find(|a| **a == Awaiting::Request(request_id)) {
                *a = Awaiting::Expired;
                self.events.push_back(ClientEvent::RequestFailed {
                    request_id,
                    error: why,
                    cursor: None,
                    redirect: None,
                });
                return;
            }
        }
    }

    /// A dedicated stream's request was answered: our side is finished.
    pub(super) fn finish_dedicated(&mut self, idx: usize) {
        let ctl = &mut self.ctls[idx];
        if ctl.role == Role::Dedicated
            && ctl.awaiting.is_empty()
            && ctl.queued.is_empty()
            && let CtlState::Ready(_) = ctl.state
        {
            ctl.state = CtlState::Closed;
            if let Some(stream) = ctl.id {
                self.out.push_back(ClientOutput::Finish { stream });
            }
        }
    }

    /// An acked publish was answered: its window slot comes back.
    pub(super) fn publish_done(&mut self, request_id: u64) -> Option<super::PublishId> {
        let (id, idx) = self.publishes.remove(&request_id)?;
        self.disarm(Timer::Request(request_id));
        self.ctls[idx].inflight = self.ctls[idx].inflight.saturating_sub(1);
        self.shared_inflight = self.shared_inflight.saturating_sub(1);
        if let CtlState::Ready(neg) = self.ctls[idx].state {
            if neg.per_stream_window {
                if self.ctls[idx].was_full {
                    self.ctls[idx].was_full = false;
                    self.events.push_back(ClientEvent::PublishWindowOpen { stream: ClientStream(idx as u32) });
                }
            } else {
                // One shared window: every stream that found it full may go on.
                for (i, c) in self.ctls.iter_mut().enumerate() {
                    if c.was_full {
                        c.was_full = false;
                        self.events.push_back(ClientEvent::PublishWindowOpen { stream: ClientStream(i as u32) });
                    }
                }
            }
        }
        if !self.queued_publishes.is_empty() {
            self.flush_publishes();
        }
        Some(id)
    }
}

/// The typed reply a message carries, with its request id (`None`: matched by order).
fn typed_reply(m: Message) -> Result<(Option<u64>, Reply), Box<Message>> {
    Ok(match m {
        Message::CacheValue(v) => (v.request_id, Reply::CacheValue { value: v.value.map(|b| b.0), version: v.version }),
        Message::CacheOk(c) => (Some(c.request_id), Reply::Done),
        Message::CacheConditionResult(c) => {
            (Some(c.request_id), Reply::CacheCondition { applied: c.applied, version: c.version })
        }
        Message::CounterValue(v) => (Some(v.request_id), Reply::CounterValue(v.value)),
        Message::StreamRecords(r) => {
            (Some(r.request_id), Reply::StreamRecords { records: r.records, next_offset: r.next_offset })
        }
        Message::OffsetValue(v) => (Some(v.request_id), Reply::OffsetValue(v.offset)),
        Message::ProducerInitOk(p) => (Some(p.request_id), Reply::ProducerId(p.producer_id)),
        Message::StreamShardsView(v) => (
            Some(v.request_id),
            Reply::StreamShards { shards: v.shards, routing: v.routing.unwrap_or(message::Routing::Modulo) },
        ),
        Message::ShardOwnersView(v) => (Some(v.request_id), Reply::ShardOwners(v.owners)),
        Message::ShardInspectInfo(i) => (Some(i.request_id), Reply::ShardInspect(i.view)),
        Message::SubscriptionsListInfo(l) => (Some(l.request_id), Reply::Subscriptions(Box::new(l))),
        Message::GroupRecords(r) => (Some(r.request_id), Reply::GroupRecords(r.records)),
        Message::GroupExtended(e) => (Some(e.request_id), Reply::GroupExtended(e.visible_ms)),
        Message::GroupDeadLetterList(l) => (Some(l.request_id), Reply::GroupDeadLetters(l.offsets)),
        Message::GroupPosition(p) => (Some(p.request_id), Reply::GroupPosition { offset: p.offset, moved: p.moved }),
        Message::GroupDeleted(d) => (Some(d.request_id), Reply::GroupDeleted(d.existed)),
        Message::GroupInfo(i) => (Some(i.request_id), Reply::GroupInfo(i)),
        Message::GroupListView(l) => (Some(l.request_id), Reply::GroupList(l.groups)),
        Message::CacheKeysView(k) => (Some(k.request_id), Reply::CacheKeys { keys: k.keys, next: k.next }),
        Message::StreamListView(l) => (Some(l.request_id), Reply::StreamList { streams: l.streams, next: l.next }),
        Message::StreamInfoView(i) => (Some(i.request_id), Reply::StreamInfo(Box::new(i))),
        Message::ClusterStatusView(v) => (Some(v.request_id), Reply::ClusterStatus(Box::new(v.status))),
        Message::ShardMoveOk(m) => (Some(m.request_id), Reply::ShardMoveProposed(m.proposed)),
        Message::CommitOk(c) => (Some(c.request_id), Reply::Committed(c.offset)),
        Message::StreamDeleteOk(d) => (Some(d.request_id), Reply::StreamDeleted(d.existed)),
        Message::StreamCreateOk(c) => {
            (Some(c.request_id), Reply::StreamsCreated { created: c.created, existed: c.existed })
        }
        Message::StateValue(v) => {
            (Some(v.request_id), Reply::State { value: v.value.map(|b| b.0), version: v.version, as_of: v.as_of })
        }
        other => return Err(Box::new(other)),
    })
}
