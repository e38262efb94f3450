//! Subscriptions and cache watches, and the event streams the broker opens for them.
//!
//! A subscription's event stream and its confirmation travel on different QUIC streams, so the
//! events can arrive first (a released broker even opens the event stream before it answers
//! `subscribed`). The application sees them in the order that makes sense: the confirmation,
//! then the events, then the end. What the application has not taken yet is counted, and past
//! `subscription_buffer_bytes` the event stream is paused (read again below half).

use super::control::Awaiting;
use super::{ClientConnection, ClientEvent, ClientOutput, EndReason, ErrorInfo, Timer, error_info};
use crate::binary::{EventBatch, Records};
use crate::flags::Flags;
use crate::frame::{Frame, FrameDecoder};
use crate::message::{self, Decoded, Message};
use crate::payload::Payload;
use crate::transport::StreamId;
use bytes::Bytes;
use std::time::Instant;

/// A subscription's (or cache watch's) lifecycle on the client.
#[derive(Debug)]
enum SubState {
    /// Asked for, not confirmed: what arrives for it waits here.
    Pending { early: Vec<ClientEvent> },
    /// Confirmed: events go to the application.
    Live,
}

#[derive(Debug)]
pub(super) struct SubEntry {
    state: SubState,
    /// Its event stream, once the broker named it there.
    stream: Option<StreamId>,
    /// Event bytes handed to the application and not reported taken.
    held: usize,
    paused: bool,
}

impl SubEntry {
    pub(super) fn pending() -> SubEntry {
        SubEntry { state: SubState::Pending { early: Vec::new() }, stream: None, held: 0, paused: false }
    }
}

#[derive(Debug)]
pub(super) struct EventStream {
    decoder: FrameDecoder,
    sub: Option<u64>,
    ended: bool,
}

/// The bytes an event counts for in its subscription's buffer (what
/// [`ClientConnection::handle_consumed`] is told once the application took it).
pub fn event_bytes(e: &ClientEvent) -> usize {
    match e {
        ClientEvent::Events { batch, .. } => batch.records.payload_bytes() + 4 * batch.records.count() as usize,
        ClientEvent::CacheEvent { event, .. } => event.key.len() + event.value.as_ref().map_or(0, |v| v.0.len()),
        _ => 0,
    }
}

impl ClientConnection {
    /// The event stream subscription (or watch) `sub` is delivered on, once its first frame
    /// named it.
    pub fn subscription_stream(&self, sub: u64) -> Option<StreamId> {
        self.subs.get(&sub).and_then(|s| s.stream)
    }

    /// The application took `bytes` of `sub`'s events ([`event_bytes`]): a subscription paused
    /// for holding too much is read again once below half of `subscription_buffer_bytes`.
    pub fn handle_consumed(&mut self, sub: u64, bytes: usize, now: Instant) {
        self.clock.advance(now);
        let low = self.cfg.subscription_buffer_bytes / 2;
        let Some(s) = self.subs.get_mut(&sub) else { return };
        s.held = s.held.saturating_sub(bytes);
        if s.paused && s.held <= low {
            s.paused = false;
            if let Some(stream) = s.stream {
                self.out.push_back(ClientOutput::ResumeReading { stream });
            }
        }
    }

    /// Ends a subscription: asks the broker to stop sending on its event stream.
    ///
    /// # Errors
    /// [`super::CommandError::Unknown`] for an unknown or not yet bound subscription.
    pub fn unsubscribe(&mut self, sub: u64, now: Instant) -> Result<(), super::CommandError> {
        self.clock.advance(now);
        let stream = self.subs.get(&sub).and_then(|s| s.stream).ok_or(super::CommandError::Unknown)?;
        self.subs.remove(&sub);
        self.event_streams.remove(&stream);
        self.out.push_back(ClientOutput::StopSending { stream, code: crate::transport::close_code::STREAM_CLOSED });
        Ok(())
    }

    /// Hands an event of `sub` to the application, or holds it until the subscription is
    /// confirmed.
    fn deliver(&mut self, sub: u64, e: ClientEvent) {
        let limit = self.cfg.subscription_buffer_bytes;
        let Some(s) = self.subs.get_mut(&sub) else { return };
        match &mut s.state {
            SubState::Pending { early } => early.push(e),
            SubState::Live => {
                s.held += event_bytes(&e);
                if !s.paused && s.held > limit {
                    s.paused = true;
                    if let Some(stream) = s.stream {
                        self.out.push_back(ClientOutput::PauseReading { stream });
                    }
                }
                self.events.push_back(e);
            }
        }
    }

    /// `subscribed` (or `cache_watch_started`) came: the confirmation first, then whatever
    /// arrived before it.
    pub(super) fn subscription_confirmed(&mut self, sub: u64, confirmation: ClientEvent) {
        self.events.push_back(confirmation);
        let Some(s) = self.subs.get_mut(&sub) else { return };
        let early = match std::mem::replace(&mut s.state, SubState::Live) {
            SubState::Pending { early } => early,
            SubState::Live => Vec::new(),
        };
        for e in early {
            let ended = matches!(e, ClientEvent::SubscriptionEnded { .. });
            self.deliver(sub, e);
            if ended {
                self.subs.remove(&sub);
            }
        }
    }

    /// A subscribe was refused (or failed): it is forgotten, with anything that came for it.
    pub(super) fn subscribe_failed(
        &mut self,
        sub: u64,
        error: ErrorInfo,
        cursor: Option<message::SubscribeCursorError>,
        redirect: Option<message::NotLeader>,
    ) {
        self.disarm(Timer::Subscribe(sub));
        if let Some(s) = self.subs.remove(&sub)
            && let Some(stream) = s.stream
        {
            self.event_streams.remove(&stream);
            self.out.push_back(ClientOutput::StopSending { stream, code: crate::transport::close_code::STREAM_CLOSED });
        }
        self.events.push_back(ClientEvent::SubscribeFailed { sub, error, cursor, redirect });
    }

    /// A subscribe's deadline passed with no answer.
    pub(super) fn expire_subscribe(&mut self, sub: u64, why: ErrorInfo) {
        for ctl in &mut self.ctls {
            if let Some(a) = ctl.awaiting.iter_mut().find(|a| **a == Awaiting::Sub(sub)) {
                *a = Awaiting::Expired;
            }
        }
        if self.subs.contains_key(&sub) {
            self.subscribe_failed(sub, why, None, None);
        }
    }

    /// A subscription ended. One not confirmed yet ends after its confirmation (or fails, if the
    /// connection went).
    pub(super) fn end_subscription(&mut self, sub: u64, reason: EndReason) {
        let pending = matches!(self.subs.get(&sub).map(|s| &s.state), Some(SubState::Pending { .. }));
        if pending {
            if let EndReason::ConnectionLost(why) = &reason {
                return self.subscribe_failed(
                    sub,
                    ErrorInfo::unknown_outcome(format!("connection lost: {why}")),
                    None,
                    None,
                );
            }
            return self.deliver(sub, ClientEvent::SubscriptionEnded { sub, reason });
        }
        if self.subs.remove(&sub).is_some() {
            self.events.push_back(ClientEvent::SubscriptionEnded { sub, reason });
        }
    }

    pub(super) fn event_stream_reset(&mut self, stream: StreamId) {
        if let Some(es) = self.event_streams.remove(&stream)
            && let (Some(sub), false) = (es.sub, es.ended)
        {
            self.end_subscription(sub, EndReason::Reset);
        }
    }

    pub(super) fn event_stream_data(&mut self, stream: StreamId, chunks: impl IntoIterator<Item = Bytes>, fin: bool) {
        let accepted = Flags::BROKER_SENDS.intersection(self.offered_flags().union(Flags::ORIGINAL_V1));
        if !self.event_streams.contains_key(&stream) {
            let mut decoder = self.new_decoder();
            decoder.set_accepted_flags(accepted);
            self.event_streams.insert(stream, EventStream { decoder, sub: None, ended: false });
        }
        let Some(es) = self.event_streams.get_mut(&stream) else { return };
        if es.ended {
            return;
        }
        for data in chunks {
            es.decoder.push(data);
        }
        loop {
            let Some(es) = self.event_streams.get_mut(&stream) else { return };
            let next = es.decoder.next_frame();
            let sub = es.sub;
            match next {
                Ok(Some(f)) => self.event_frame(stream, sub, f),
                Ok(None) => break,
                Err(e) => {
                    self.events.push_back(ClientEvent::ProtocolError { reason: format!("event stream: {e}") });
                    if e.is_fatal() {
                        break;
                    }
                }
            }
        }
        if fin
            && let Some(es) = self.event_streams.remove(&stream)
            && let (Some(sub), false) = (es.sub, es.ended)
        {
            self.end_subscription(sub, EndReason::Finished);
        }
    }

    /// A terminal frame ended the stream's subscription.
    fn end_sub(&mut self, stream: StreamId, sub: u64, reason: EndReason) {
        if let Some(es) = self.event_streams.get_mut(&stream) {
            es.ended = true;
        }
        self.end_subscription(sub, reason);
    }

    fn event_frame(&mut self, stream: StreamId, sub: Option<u64>, f: Frame) {
        let decoded = match crate::payload::PayloadKind::of(f.flags) {
            // Event batches with this connection's decompression contexts (D56).
            Some(crate::payload::PayloadKind::Events) => {
                let limit = self.cfg.max_frame_len as usize;
                crate::binary::EventBatch::decode_with(f.flags, f.payload.clone(), limit, &mut self.decompressor)
                    .map(Payload::Events)
                    .map_err(|e| e.to_string())
            }
            _ => f.decode_payload().map_err(|e| e.to_string()),
        };
        let payload = match decoded {
            Ok(p) => p,
            Err(e) => {
                return self.events.push_back(ClientEvent::ProtocolError { reason: format!("event stream: {e}") });
            }
        };
        match (sub, payload) {
            (None, Payload::Json(Decoded::Message(Message::EventStreamHello(h)))) => {
                let id = h.subscription_id;
                match self.subs.get_mut(&id) {
                    Some(s) => {
                        s.stream = Some(stream);
                        if let Some(es) = self.event_streams.get_mut(&stream) {
                            es.sub = Some(id);
                        }
                    }
                    // A subscription this client no longer waits for (given up on): stop it.
                    None => {
                        self.event_streams.remove(&stream);
                        let code = crate::transport::close_code::STREAM_CLOSED;
                        self.out.push_back(ClientOutput::StopSending { stream, code });
                    }
                }
            }
            (None, _) => self.events.push_back(ClientEvent::ProtocolError {
                reason: "event stream did not start with event_stream_hello".into(),
            }),
            (Some(sub), Payload::Events(batch)) => self.deliver(sub, ClientEvent::Events { sub, batch }),
            (Some(sub), Payload::Json(Decoded::Message(m))) => match m {
                Message::SubscriptionLagged(l) => {
                    self.end_sub(stream, sub, EndReason::Lagged { resume_from: l.resume_from })
                }
                Message::ShardMoved(m) => self.end_sub(stream, sub, EndReason::Moved(m)),
                Message::StreamDeleted(_) => self.end_sub(stream, sub, EndReason::Deleted),
                Message::CacheEvent(event) => self.deliver(sub, ClientEvent::CacheEvent { sub, event }),
                Message::CacheWatchLagged(l) => {
                    self.end_sub(stream, sub, EndReason::WatchLagged { resume_from: l.resume_from })
                }
                Message::Error(e) => self.end_sub(stream, sub, EndReason::Error(error_info(e))),
                Message::Event(e) => {
                    let records = Records::from_payloads([e.payload.0]).unwrap_or_default();
                    let batch = EventBatch { base_offset: e.offset, ..EventBatch::shared(records) };
                    self.deliver(sub, ClientEvent::Events { sub, batch });
                }
                Message::EventBatch(e) => {
                    let records = Records::from_payloads(e.payloads.into_iter().map(|p| p.0)).unwrap_or_default();
                    let batch = EventBatch { base_offset: e.base_offset, ..EventBatch::shared(records) };
                    self.deliver(sub, ClientEvent::Events { sub, batch });
                }
                other => self.events.push_back(ClientEvent::ProtocolError {
                    reason: format!("unexpected {} on an event stream", other.type_name()),
                }),
            },
            (Some(_), _) => self
                .events
                .push_back(ClientEvent::ProtocolError { reason: "unexpected frame on an event stream".into() }),
        }
    }
}
