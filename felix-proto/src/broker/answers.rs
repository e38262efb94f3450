//! Answers: each request owed an answer gets a slot on its stream, and answers leave in request
//! order (held behind one that waits for storage); refusals worded for what the client reads.

use super::*;
use crate::binary::PublishAck;
use crate::features::Features;
use crate::flags::Flags;
use crate::message::{self, Message};
use crate::negotiate::ClientOffer;
use crate::transport::{ConnId, StreamId};
use bytes::{Bytes, BytesMut};
use std::collections::VecDeque;

impl Broker {
    pub(super) fn features_of(st: &CtlStream) -> ClientOffer {
        st.session.as_ref().map_or(
            ClientOffer {
                negotiating: false,
                flags: Flags::ORIGINAL_V1,
                flags_hi: crate::flags::FlagsHi::EMPTY,
                features: Features::NONE,
                extended: false,
            },
            |s| s.offer,
        )
    }

    pub(super) fn error_message(offer: &ClientOffer, r: &Refusal) -> Message {
        let codes = offer.has(Features::ERROR_CODES);
        Message::Error(message::ErrorMsg {
            message: r.message.clone(),
            code: codes.then(|| r.code.clone()),
            retry: codes.then_some(r.retry),
            detail: r.detail.clone().filter(|_| codes),
        })
    }

    pub(super) fn publish_answer(
        offer: &ClientOffer,
        reply: Reply,
        result: Result<Option<u64>, &Refusal>,
    ) -> Option<Bytes> {
        match reply {
            Reply::None => None,
            Reply::Refusable(request_id) if result.is_err_and(|r| r.refused.is_some()) => {
                let r = result.err()?;
                let reason = *r.refused.clone()?;
                Some(json_frame(&Message::PublishRefused(message::PublishRefused {
                    request_id,
                    reason,
                    message: r.message.clone(),
                })))
            }
            Reply::Json(request_id) | Reply::Refusable(request_id) => {
                let m = match result {
                    Ok(offset) => Message::PublishOk(message::PublishOk {
                        request_id,
                        offset: offset.filter(|_| offer.offered(Flags::BINARY_PUBLISH_ACK_OFFSET)),
                    }),
                    Err(r) => {
                        let codes = offer.has(Features::ERROR_CODES);
                        Message::PublishError(message::PublishError {
                            request_id,
                            message: r.message.clone(),
                            code: codes.then(|| r.code.clone()),
                            retry: codes.then_some(r.retry),
                            detail: r.detail.clone().filter(|_| codes),
                        })
                    }
                };
                Some(json_frame(&m))
            }
            Reply::Commit(request_id) => {
                let m = match result {
                    Ok(offset) => {
                        Message::CommitOk(message::CommitOk { request_id, offset: offset.unwrap_or_default() })
                    }
                    Err(r) => match r.refused.clone() {
                        Some(reason) => Message::PublishRefused(message::PublishRefused {
                            request_id,
                            reason: *reason,
                            message: r.message.clone(),
                        }),
                        None => Self::error_message(offer, r),
                    },
                };
                Some(json_frame(&m))
            }
            Reply::Binary(request_id) => {
                let ack = match result {
                    Ok(offset) => PublishAck::ok(request_id, offset),
                    Err(r) => {
                        let mut a = PublishAck::error(request_id, r.message.clone(), r.code.clone(), r.retry);
                        a.detail = r.detail.clone();
                        a
                    }
                };
                let mut b = BytesMut::new();
                // Strings were checked on the way in; the message is cut to fit if needed.
                let _ = ack.encode(offer.flags, &mut b);
                Some(b.freeze())
            }
        }
    }

    /// Sends a non-publish answer (never held back by the pipeline).
    pub(super) fn send(&mut self, conn: ConnId, st: &mut CtlStream, data: Bytes) {
        self.answering().send(conn, st, data);
    }

    /// What answers write to ([`Answering`]), borrowed from the broker.
    pub(super) fn answering(&mut self) -> Answering<'_> {
        Answering {
            out: &mut self.out,
            stats: &mut self.stats,
            unflushed_limit: self.cfg.control_stream_unflushed_bytes,
        }
    }

    /// Control stream `stream` of `conn`, and what its answers write to, borrowed side by
    /// side: an answer that comes later (a write done, a forward answered, a deadline) is
    /// delivered in place, the stream never taken out of its connection and put back.
    pub(super) fn stream_answering(
        &mut self,
        conn: ConnId,
        stream: StreamId,
    ) -> Option<(&mut CtlStream, Answering<'_>)> {
        let Broker { conns, out, stats, cfg, .. } = self;
        let st = conns.get_mut(&conn)?.streams.get_mut(&stream)?;
        Some((st, Answering { out, stats, unflushed_limit: cfg.control_stream_unflushed_bytes }))
    }

    /// Forgets control stream `stream` of `conn` once it is done (both sides finished, nothing
    /// owed on it).
    pub(super) fn forget_if_done(&mut self, conn: ConnId, stream: StreamId) {
        if let Some(c) = self.conns.get_mut(&conn)
            && c.streams.get(&stream).is_some_and(|st| st.done())
        {
            c.streams.remove(&stream);
        }
    }

    /// Fills the held slot `slot` of a control stream with its answer, writes whatever is now
    /// ready in order, and finishes the stream if that was the last thing owed on it.
    pub(super) fn fill_held(&mut self, conn: ConnId, stream: StreamId, slot: HeldFor, data: Bytes) {
        let Some((st, mut a)) = self.stream_answering(conn, stream) else { return };
        if let Some(h) = st.held.iter_mut().find(|h| matches!(h, Held::Waiting(t) if *t == slot)) {
            *h = Held::Ready(data);
        }
        st.outstanding = st.outstanding.saturating_sub(1);
        a.release_held(conn, st);
        a.maybe_finish(conn, st);
        self.forget_if_done(conn, stream);
    }

    /// Reserves an answer slot that later answers on the stream wait behind.
    pub(super) fn hold(st: &mut CtlStream, slot: HeldFor) {
        st.held.push_back(Held::Waiting(slot));
        st.outstanding += 1;
    }

    /// Answers with a refusal ([`Answering::refuse`]).
    pub(super) fn refuse(&mut self, conn: ConnId, st: &mut CtlStream, r: Refusal) {
        self.answering().refuse(conn, st, r);
    }

    /// Reserves the answer slot of an owed publish (pipelined streams answer in order). A
    /// commit's answer keeps its turn among every answer of its stream: it may be an `error`,
    /// which the client gives to its oldest unanswered request.
    pub(super) fn owe(&mut self, conn: ConnId, st: &mut CtlStream, reply: Reply) -> AnswerSlot {
        if matches!(reply, Reply::None) {
            return AnswerSlot::Now;
        }
        if matches!(reply, Reply::Commit(_)) {
            let id = self.ids.poll();
            Self::hold(st, HeldFor::Commit(id));
            return AnswerSlot::Held(id);
        }
        st.outstanding += 1;
        let Some(window) = st.session.as_ref().and_then(|s| s.window) else { return AnswerSlot::Now };
        let seq = st.next_seq;
        st.next_seq += 1;
        st.owed.push_back(Owed { seq, answer: None });
        if st.owed.len() >= window as usize && !st.pauses.has(Pause::Window) && st.pause(Pause::Window) {
            self.out.push_back(BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream: st.id }));
        }
        AnswerSlot::Owed(seq)
    }

    // -----------------------------------------------------------------------------------------
    // Frames

    pub(super) fn answer_now(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        reply: Reply,
        result: Result<Option<u64>, &Refusal>,
    ) {
        let offer = Self::features_of(st);
        let seq = self.owe(conn, st, reply);
        let data = Self::publish_answer(&offer, reply, result);
        if !matches!(reply, Reply::None) {
            self.answering().deliver_answer(conn, st, seq, data);
        }
    }
}

/// What a control stream's answers write to: the driver's outputs, the counters, and the
/// limit of answer bytes handed to the driver before the stream stops being read. It is
/// borrowed beside the stream ([`Broker::stream_answering`]), so delivering an answer needs
/// neither the whole broker nor the stream taken out of its connection.
pub(super) struct Answering<'a> {
    pub(super) out: &'a mut VecDeque<BrokerOutput>,
    pub(super) stats: &'a mut BrokerStats,
    pub(super) unflushed_limit: usize,
}

impl Answering<'_> {
    /// Sends a non-publish answer (never held back by the pipeline).
    pub(super) fn send(&mut self, conn: ConnId, st: &mut CtlStream, data: Bytes) {
        if st.uni || st.send_finished {
            return;
        }
        if st.held.is_empty() {
            self.count_unflushed(conn, st, data.len());
            self.out.push_back(BrokerOutput::Transport(TransportOutput::Transmit { conn, stream: st.id, data }));
        } else {
            st.held.push_back(Held::Ready(data));
        }
    }

    /// Counts answer bytes handed to the driver; past the limit, stops reading the stream's
    /// requests until the client reads what it was sent.
    fn count_unflushed(&mut self, conn: ConnId, st: &mut CtlStream, n: usize) {
        st.unflushed += n;
        if st.unflushed > self.unflushed_limit && !st.pauses.has(Pause::Flush) && st.pause(Pause::Flush) {
            self.out.push_back(BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream: st.id }));
        }
    }

    /// Writes the held answers that are ready, in order, up to the first still waiting.
    pub(super) fn release_held(&mut self, conn: ConnId, st: &mut CtlStream) {
        while let Some(Held::Ready(_)) = st.held.front() {
            if let Some(Held::Ready(data)) = st.held.pop_front()
                && !st.send_finished
            {
                st.unflushed += data.len();
                self.out.push_back(BrokerOutput::Transport(TransportOutput::Transmit { conn, stream: st.id, data }));
            }
        }
    }

    /// Answers with a refusal worded for what the client reads; closes the stream when the
    /// refusal says so.
    pub(super) fn refuse(&mut self, conn: ConnId, st: &mut CtlStream, r: Refusal) {
        let m = Broker::error_message(&Broker::features_of(st), &r);
        self.send(conn, st, json_frame(&m));
        if r.close_stream {
            self.close_stream(conn, st);
        }
    }

    /// Finishes our side of a control stream once the client finished and every answer owed
    /// on it is written.
    pub(super) fn maybe_finish(&mut self, conn: ConnId, st: &mut CtlStream) {
        let drained = st.decoder.buffered() == 0 || st.recv == Recv::Closed;
        if st.recv != Recv::Open && drained && st.outstanding == 0 && !st.send_finished {
            st.send_finished = true;
            if !st.uni {
                self.out.push_back(BrokerOutput::Transport(TransportOutput::Finish { conn, stream: st.id }));
            }
        }
    }

    /// Ends a request stream after an answer: finish our side, stop reading theirs.
    pub(super) fn close_stream(&mut self, conn: ConnId, st: &mut CtlStream) {
        if st.recv == Recv::Closed {
            return;
        }
        st.recv = Recv::Closed;
        self.out.push_back(BrokerOutput::Transport(TransportOutput::StopSending {
            conn,
            stream: st.id,
            code: crate::transport::close_code::STREAM_CLOSED,
        }));
    }

    /// Delivers an owed publish answer: at once, in order behind earlier ones when the stream
    /// is pipelined, or in its held turn (a commit). Returns whether the stream should be
    /// driven again (it was paused and has room now).
    pub(super) fn deliver_answer(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        seq: AnswerSlot,
        data: Option<Bytes>,
    ) -> bool {
        st.outstanding = st.outstanding.saturating_sub(1);
        self.stats.acks_sent += u64::from(data.is_some());
        match seq {
            AnswerSlot::Now => {
                if let Some(d) = data {
                    self.send(conn, st, d);
                }
                false
            }
            AnswerSlot::Held(id) => {
                let slot = HeldFor::Commit(id);
                if let Some(i) = st.held.iter().position(|h| matches!(h, Held::Waiting(t) if *t == slot)) {
                    match data {
                        Some(d) => st.held[i] = Held::Ready(d),
                        None => {
                            st.held.remove(i);
                        }
                    }
                }
                self.release_held(conn, st);
                false
            }
            AnswerSlot::Owed(seq) => {
                if let Some(o) = st.owed.iter_mut().find(|o| o.seq == seq) {
                    o.answer = Some(data.unwrap_or_default());
                }
                while st.owed.front().is_some_and(|o| o.answer.is_some()) {
                    let o = st.owed.pop_front().expect("front exists");
                    if let Some(d) = o.answer.filter(|d| !d.is_empty()) {
                        self.send(conn, st, d);
                    }
                }
                let window = st.session.as_ref().and_then(|s| s.window).unwrap_or(u32::MAX) as usize;
                if st.pauses.has(Pause::Window) && st.owed.len() < window {
                    if st.pauses.remove(Pause::Window) {
                        // Told to the driver once the stream's backlog is processed.
                        st.resume_owed = true;
                    }
                    return true;
                }
                false
            }
        }
    }
}
