//! The client's task: it owns the `ClientConnection` state machine and the QUIC connection,
//! turns commands into its inputs and its outputs into stream reads and writes, and answers the
//! calls awaiting them.

use super::*;

pub(super) async fn accept_uni(quic: quinn::Connection, tx: mpsc::UnboundedSender<Input>) {
    loop {
        match quic.accept_uni().await {
            Ok(recv) => {
                if tx.send(Input::IncomingUni(recv)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Input::Closed(e.to_string()));
                return;
            }
        }
    }
}

async fn reader(
    stream: StreamId,
    recv: quinn::RecvStream,
    gate: watch::Receiver<ReadGate>,
    tx: mpsc::UnboundedSender<Input>,
) {
    crate::read_gated(recv, gate, |event| match event {
        ReadEvent::Chunks(data) => tx.send(Input::Data { stream, data, fin: false }).is_ok(),
        ReadEvent::Finished => tx.send(Input::Data { stream, data: Vec::new(), fin: true }).is_ok(),
        ReadEvent::Reset => tx.send(Input::Reset(stream)).is_ok(),
        // The connection failed: `accept_uni` reports it once, for every stream.
        ReadEvent::Failed => false,
    })
    .await
}

pub(super) enum WriterCmd {
    /// Bytes, and the unacknowledged publishes to complete once they are handed to QUIC.
    Data(Bytes, Vec<Reply<Option<u64>>>),
    Finish,
    /// Finish the stream and report once the broker acknowledged all its data.
    Close(oneshot::Sender<Result<(), Unconfirmed>>),
}

/// What a stream's writer could not get acknowledged at close.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Unconfirmed {
    pub(super) publishes: u64,
    pub(super) bytes: u64,
    pub(super) lost: bool,
}

async fn writer(mut send: quinn::SendStream, mut rx: mpsc::UnboundedReceiver<WriterCmd>) {
    let mut chunks = Vec::new();
    let mut done: Vec<Reply<Option<u64>>> = Vec::new();
    // Everything written on this stream, for the report at close.
    let mut written = Unconfirmed::default();
    while let Some(cmd) = rx.recv().await {
        let mut finish = false;
        let mut close = None;
        match cmd {
            WriterCmd::Data(b, d) => {
                chunks.push(b);
                done.extend(d);
            }
            WriterCmd::Finish => finish = true,
            WriterCmd::Close(r) => close = Some(r),
        }
        while !finish && close.is_none() {
            match rx.try_recv() {
                Ok(WriterCmd::Data(b, d)) => {
                    chunks.push(b);
                    done.extend(d);
                }
                Ok(WriterCmd::Finish) => finish = true,
                Ok(WriterCmd::Close(r)) => close = Some(r),
                Err(_) => break,
            }
        }
        if !chunks.is_empty() {
            written.bytes += chunks.iter().map(|c| c.len() as u64).sum::<u64>();
            written.publishes += done.len() as u64;
            // Completing an unacknowledged publish only once QUIC took its bytes is what gives
            // fire-and-forget publishers backpressure (flow control, not acknowledgements).
            let res = send.write_all_chunks(&mut chunks).await;
            for d in done.drain(..) {
                let _ = d.send(match &res {
                    Ok(()) => Ok(None),
                    Err(e) => Err(ClientError::Closed(e.to_string())),
                });
            }
            if res.is_err() {
                if let Some(r) = close {
                    let _ = r.send(Err(Unconfirmed { lost: true, ..written }));
                }
                return;
            }
            chunks.clear();
        }
        if finish {
            let _ = send.finish();
            return;
        }
        if let Some(r) = close {
            // Once, at close: waiting on the peer's acknowledgement per request would cost a
            // delayed ACK each time, but a close waits for it exactly once.
            let _ = send.finish();
            let confirmed = matches!(send.stopped().await, Ok(None));
            let _ = r.send(if confirmed || written.bytes == 0 { Ok(()) } else { Err(written) });
            return;
        }
    }
}

pub(super) struct Task {
    pub(super) machine: ClientConnection,
    pub(super) tenant: String,
    pub(super) quic: quinn::Connection,
    pub(super) tx: mpsc::UnboundedSender<Input>,
    pub(super) writers: HashMap<StreamId, mpsc::UnboundedSender<WriterCmd>>,
    pub(super) gates: HashMap<StreamId, watch::Sender<ReadGate>>,
    pub(super) ready: Option<oneshot::Sender<Result<Negotiated, ClientError>>>,
    pub(super) publishes: HashMap<PublishId, Reply<Option<u64>>>,
    /// Fire-and-forget publishes, completed once their bytes are handed to QUIC.
    pub(super) written: Vec<Reply<Option<u64>>>,
    pub(super) requests: HashMap<u64, Reply<core::Reply>>,
    pub(super) subs: HashMap<u64, mpsc::UnboundedSender<(SubscriptionItem, usize)>>,
    pub(super) sub_replies: HashMap<u64, Reply<Subscription>>,
    pub(super) watch_replies: HashMap<u64, Reply<CacheWatch>>,
    pub(super) closed: watch::Sender<Option<String>>,
    pub(super) endpoint: quinn::Endpoint,
    /// `ClientOptions::close_timeout`.
    pub(super) close_timeout: std::time::Duration,
    /// A close is under way: nothing more is written.
    pub(super) closing: bool,
    /// What was handed to each stream's writer (for the report of a close that times out).
    pub(super) written_totals: HashMap<StreamId, Unconfirmed>,
    /// During a close: the control streams the broker has not finished yet, and whom to tell
    /// once it finished them all.
    pub(super) closing_fins: Option<(std::collections::HashSet<StreamId>, oneshot::Sender<()>)>,
}

pub(super) fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

fn command_error(e: CommandError) -> ClientError {
    match e {
        CommandError::NotNegotiated(what) => ClientError::Unsupported(what.into()),
        CommandError::Encode(why) => ClientError::Invalid(why),
        other => ClientError::Closed(other.to_string()),
    }
}

fn refused(
    error: ErrorInfo,
    cursor: Option<SubscribeCursorError>,
    redirect: Option<felix_proto::message::NotLeader>,
) -> ClientError {
    if let Some(n) = redirect {
        return ClientError::NotLeader { node_id: n.node_id, addr: n.addr, generation: n.generation };
    }
    cursor.map_or(ClientError::Refused(error), ClientError::Cursor)
}

impl Task {
    pub(super) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Input>) {
        let mut reason = String::from("connection task ended");
        loop {
            self.drain();
            let deadline = self.machine.poll_timeout();
            let sleep = crate::sleep_until(deadline);
            tokio::select! {
                input = rx.recv() => {
                    let Some(input) = input else { break };
                    if let Input::Closed(why) = input {
                        reason = why;
                        break;
                    }
                    self.handle(input);
                    for _ in 0..256 {
                        match rx.try_recv() {
                            Ok(Input::Closed(why)) => {
                                reason = why;
                                return self.lost(reason);
                            }
                            Ok(i) => self.handle(i),
                            Err(_) => break,
                        }
                    }
                }
                () = sleep => self.machine.handle_timeout(now()),
            }
        }
        self.lost(reason);
    }

    /// The connection is gone: the state machine fails everything pending, and the replies get
    /// those failures.
    pub(super) fn lost(mut self, reason: String) {
        self.machine.handle_connection_lost(reason.clone(), now());
        self.drain();
        if let Some(r) = self.ready.take() {
            let _ = r.send(Err(ClientError::Connect(reason.clone())));
        }
        for r in self.written.drain(..) {
            let _ = r.send(Err(ClientError::Closed(reason.clone())));
        }
        let _ = self.closed.send(Some(reason));
    }

    pub(super) fn handle(&mut self, input: Input) {
        let now = now();
        match input {
            Input::Cmd(Cmd::Close { reply }) => self.close(reply),
            Input::Cmd(Cmd::SetToken(token)) => self.machine.set_token(token, now),
            Input::Cmd(Cmd::Publish { req, reply }) => {
                let ack = req.ack || req.idempotent.is_some() || req.expected_offset.is_some();
                match self.machine.publish_auto(req, now) {
                    Ok(id) if ack => {
                        self.publishes.insert(id, reply);
                    }
                    Ok(_) => self.written.push(reply),
                    Err(e) => drop(reply.send(Err(command_error(e)))),
                }
            }
            Input::Cmd(Cmd::Request { build, reply }) => {
                let tenant = self.tenant.clone();
                match self.machine.request_auto(|id| build(tenant, id), now) {
                    Ok(id) => {
                        self.requests.insert(id, reply);
                    }
                    Err(e) => drop(reply.send(Err(command_error(e)))),
                }
            }
            // Each subscription on a control stream of its own, as upstream clients do.
            Input::Cmd(Cmd::Subscribe { req, reply }) => match self.machine.subscribe_dedicated(req, now) {
                Ok(id) => {
                    self.sub_replies.insert(id, reply);
                }
                Err(e) => drop(reply.send(Err(command_error(e)))),
            },
            Input::Cmd(Cmd::Watch { req, reply }) => match self.machine.cache_watch_dedicated(req, now) {
                Ok(id) => {
                    self.watch_replies.insert(id, reply);
                }
                Err(e) => drop(reply.send(Err(command_error(e)))),
            },
            Input::OpenedBi { token, send, recv } => {
                let id = crate::stream_id(send.id());
                let (wtx, wrx) = mpsc::unbounded_channel();
                self.writers.insert(id, wtx);
                tokio::spawn(writer(send, wrx));
                let (gtx, grx) = watch::channel(ReadGate::Open);
                self.gates.insert(id, gtx);
                tokio::spawn(reader(id, recv, grx, self.tx.clone()));
                self.machine.handle_stream_opened(token, id, now);
            }
            Input::IncomingUni(recv) => {
                let id = crate::stream_id(recv.id());
                let (gtx, grx) = watch::channel(ReadGate::Open);
                self.gates.insert(id, gtx);
                tokio::spawn(reader(id, recv, grx, self.tx.clone()));
            }
            Input::Consumed(sub, bytes) => self.machine.handle_consumed(sub, bytes, now),
            Input::Data { stream, data, fin } => {
                self.machine.handle_stream_chunks(stream, data, fin, now);
                if fin {
                    self.stream_finished(stream);
                }
            }
            Input::Reset(stream) => {
                self.machine.handle_stream_reset(stream, now);
                self.stream_finished(stream);
            }
            Input::Closed(_) => {}
        }
    }

    /// The broker ended a stream; during a close, that is the confirmation awaited.
    pub(super) fn stream_finished(&mut self, stream: StreamId) {
        self.gates.remove(&stream);
        if let Some((waiting, _)) = &mut self.closing_fins {
            waiting.remove(&stream);
            if waiting.is_empty()
                && let Some((_, done)) = self.closing_fins.take()
            {
                let _ = done.send(());
            }
        }
    }

    pub(super) fn drain(&mut self) {
        loop {
            let mut progress = false;
            while let Some(o) = self.machine.poll_output() {
                progress = true;
                self.output(o);
            }
            while let Some(e) = self.machine.poll_event() {
                progress = true;
                self.event(e);
            }
            if !progress {
                return;
            }
        }
    }

    pub(super) fn output(&mut self, o: ClientOutput) {
        match o {
            ClientOutput::OpenBi { token } => {
                let quic = self.quic.clone();
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    match quic.open_bi().await {
                        Ok((send, recv)) => drop(tx.send(Input::OpenedBi { token, send, recv })),
                        Err(e) => drop(tx.send(Input::Closed(e.to_string()))),
                    }
                });
            }
            ClientOutput::Transmit { stream, data } => {
                if let Some(w) = self.writers.get(&stream) {
                    let t = self.written_totals.entry(stream).or_default();
                    t.bytes += data.len() as u64;
                    t.publishes += self.written.len() as u64;
                    let _ = w.send(WriterCmd::Data(data, std::mem::take(&mut self.written)));
                }
            }
            ClientOutput::Finish { stream } => {
                if let Some(w) = self.writers.remove(&stream) {
                    let _ = w.send(WriterCmd::Finish);
                }
            }
            ClientOutput::StopSending { stream, code } => {
                if let Some(g) = self.gates.remove(&stream) {
                    let _ = g.send(ReadGate::Stopped(code));
                }
            }
            ClientOutput::PauseReading { stream } => {
                if let Some(g) = self.gates.get(&stream) {
                    let _ = g.send(ReadGate::Paused);
                }
            }
            ClientOutput::ResumeReading { stream } => {
                if let Some(g) = self.gates.get(&stream) {
                    let _ = g.send(ReadGate::Open);
                }
            }
        }
    }

    /// A channel for a confirmed subscription or watch (the state machine delivers nothing for
    /// it before the confirmation).
    pub(super) fn item_channel(&mut self, sub: u64) -> ItemRx {
        let (tx, rx) = mpsc::unbounded_channel();
        self.subs.insert(sub, tx);
        ItemRx { sub, rx, task: self.tx.clone() }
    }

    pub(super) fn deliver(&mut self, sub: u64, e: &ClientEvent, item: SubscriptionItem) {
        let bytes = core::event_bytes(e);
        match self.subs.get(&sub) {
            Some(tx) if tx.send((item, bytes)).is_ok() => {}
            // The application dropped the subscription: what it would have taken is taken.
            _ => self.machine.handle_consumed(sub, bytes, now()),
        }
    }

    pub(super) fn event(&mut self, e: ClientEvent) {
        match e {
            ClientEvent::Connected { negotiated, .. } => {
                if let Some(r) = self.ready.take() {
                    let _ = r.send(Ok(negotiated));
                }
            }
            ClientEvent::AuthFailed { error, .. } => {
                if let Some(r) = self.ready.take() {
                    let _ = r.send(Err(ClientError::Refused(error)));
                }
            }
            ClientEvent::PublishAcked { id, offset, .. } => {
                if let Some(r) = self.publishes.remove(&id) {
                    let _ = r.send(Ok(offset));
                }
            }
            ClientEvent::PublishFailed { id, error } => {
                if let Some(r) = self.publishes.remove(&id) {
                    let _ = r.send(Err(ClientError::Refused(error)));
                }
            }
            ClientEvent::PublishRefused { id, reason, message } => {
                if let Some(r) = self.publishes.remove(&id) {
                    let _ = r.send(Err(ClientError::PublishRefused { reason, message }));
                }
            }
            ClientEvent::Reply { request_id, reply } => {
                if let Some(r) = self.requests.remove(&request_id) {
                    let _ = r.send(Ok(reply));
                }
            }
            ClientEvent::RequestFailed { request_id, error, cursor, redirect } => {
                if let Some(r) = self.requests.remove(&request_id) {
                    let _ = r.send(Err(refused(error, cursor, redirect)));
                }
            }
            ClientEvent::Subscribed { sub, start_offset, live_offset, .. } => {
                if let Some(r) = self.sub_replies.remove(&sub) {
                    let rx = self.item_channel(sub);
                    let _ = r.send(Ok(Subscription { id: sub, start_offset, live_offset, rx }));
                }
            }
            ClientEvent::CacheWatchStarted { sub, resume_offset, resnapshot, retained_count } => {
                if let Some(r) = self.watch_replies.remove(&sub) {
                    let rx = self.item_channel(sub);
                    let _ = r.send(Ok(CacheWatch { id: sub, resume_offset, resnapshot, retained_count, rx }));
                }
            }
            ClientEvent::SubscribeFailed { sub, error, cursor, redirect } => {
                let err = refused(error, cursor, redirect);
                if let Some(r) = self.sub_replies.remove(&sub) {
                    let _ = r.send(Err(err));
                } else if let Some(r) = self.watch_replies.remove(&sub) {
                    let _ = r.send(Err(err));
                }
            }
            ClientEvent::Events { sub, ref batch } => {
                let item = SubscriptionItem::Events(batch.clone());
                self.deliver(sub, &e, item);
            }
            ClientEvent::CacheEvent { sub, ref event } => {
                let item = SubscriptionItem::CacheChange(event.clone());
                self.deliver(sub, &e, item);
            }
            ClientEvent::SubscriptionEnded { sub, reason } => {
                if let Some(tx) = self.subs.remove(&sub) {
                    let _ = tx.send((SubscriptionItem::End(reason), 0));
                }
            }
            ClientEvent::Error { error, .. } => tracing::warn!("broker error: {}", error.message),
            ClientEvent::ProtocolError { reason } => tracing::warn!("protocol error from broker: {reason}"),
            ClientEvent::PublishWindowOpen { .. }
            | ClientEvent::Unsupported { .. }
            | ClientEvent::StreamClosed { .. }
            | ClientEvent::ConnectionLost { .. } => {}
        }
    }

    /// Finishes every send stream, waits (bounded) for the broker to take all they carried,
    /// then closes the connection and answers `reply` with what could not be confirmed.
    pub(super) fn close(&mut self, reply: Reply<()>) {
        if self.closing {
            let _ = reply.send(Ok(()));
            return;
        }
        self.closing = true;
        // The broker finishes its side of a control stream once it read our finish and answered
        // everything before it: that, not QUIC's acknowledgement (which only says the bytes
        // reached the broker's QUIC stack, whose unread data a close discards), is what says the
        // broker took every publish.
        let (fins_tx, fins_rx) = oneshot::channel();
        let control: std::collections::HashSet<StreamId> = self.writers.keys().copied().collect();
        if control.is_empty() {
            let _ = fins_tx.send(());
        } else {
            self.closing_fins = Some((control, fins_tx));
        }
        let totals = std::mem::take(&mut self.written_totals);
        let waits: Vec<(Unconfirmed, oneshot::Receiver<Result<(), Unconfirmed>>)> = self
            .writers
            .drain()
            .filter_map(|(id, w)| {
                let (tx, rx) = oneshot::channel();
                let written = totals.get(&id).copied().unwrap_or_default();
                w.send(WriterCmd::Close(tx)).ok().map(|()| (written, rx))
            })
            .collect();
        let (quic, endpoint, timeout) = (self.quic.clone(), self.endpoint.clone(), self.close_timeout);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut missing = Unconfirmed::default();
            let mut timed_out = false;
            for (written, w) in waits {
                let (publishes, bytes, lost) = match tokio::time::timeout_at(deadline, w).await {
                    Ok(Ok(Ok(()))) => continue,
                    Ok(Ok(Err(u))) => (u.publishes, u.bytes, u.lost),
                    // The writer is gone: its stream failed earlier.
                    Ok(Err(_)) => (written.publishes, written.bytes, true),
                    Err(_) => {
                        timed_out = true;
                        (written.publishes, written.bytes, false)
                    }
                };
                missing.publishes += publishes;
                missing.bytes += bytes;
                missing.lost |= lost;
            }
            if tokio::time::timeout_at(deadline, fins_rx).await.is_err() && missing.bytes == 0 {
                // The bytes were acknowledged but the broker did not finish its side in time:
                // what it had not read yet may be lost with the connection.
                timed_out = true;
                for w in totals.values() {
                    missing.publishes += w.publishes;
                    missing.bytes += w.bytes;
                }
            }
            let result = if missing.bytes == 0 {
                Ok(())
            } else {
                let reason = if timed_out {
                    format!("no acknowledgement within {timeout:?}")
                } else if missing.lost {
                    "the connection was lost".into()
                } else {
                    "the broker stopped a stream".into()
                };
                Err(ClientError::Unconfirmed { publishes: missing.publishes, bytes: missing.bytes, reason })
            };
            quic.close(quinn::VarInt::from_u32(0), b"client closing");
            // Let the endpoint send the close frame before the caller (perhaps a process about to
            // exit) goes on, so the broker need not wait out its idle timeout. Not the whole
            // draining period `wait_idle` would wait for: everything was confirmed already.
            let _ = tokio::time::timeout(std::time::Duration::from_millis(20), endpoint.wait_idle()).await;
            let _ = reply.send(result);
        });
    }
}
