//! Connections and their control streams: admission, stream inputs, reading requests off a
//! stream in order (pausing it when asked), finishing it.

use super::*;
use crate::flags::Flags;
use crate::frame::{FrameDecoder, FrameError};
use crate::message::{self, Message};
use crate::transport::{ConnId, Dir, OpenToken, Side, StreamId, close_code};
use bytes::Bytes;
use std::collections::HashMap;
use std::time::Instant;

impl Broker {
    /// A client connected (from a peer the driver does not name: not counted against the
    /// per-peer cap). Returns its id.
    pub fn connection_opened(&mut self, now: Instant) -> ConnId {
        let now = self.clock.advance(now);
        self.open_conn(None, now)
    }

    /// A client wants to connect from `peer`: call before its handshake. It is admitted (its
    /// id is returned; report a failed handshake with [`connection_closed`](Self::connection_closed))
    /// unless that would pass the caps on connections that authenticated no stream yet:
    /// * per peer (`max_unauthenticated_per_peer`): refused;
    /// * in all (`max_unauthenticated_connections`): the oldest unauthenticated connection that
    ///   has been so for longer than `auth_timeout` is closed (code 1) to make room, or, if none
    ///   has, the new one is refused.
    ///
    /// Authenticated connections never count, so a flood of idle connections cannot crowd out
    /// clients that authenticate.
    ///
    /// # Errors
    /// [`AdmitError`] naming the cap; refuse the connection in the handshake.
    pub fn admit(&mut self, peer: PeerAddr, now: Instant) -> Result<ConnId, AdmitError> {
        let now = self.clock.advance(now);
        if self.unauthenticated.of_peer(peer) >= self.cfg.max_unauthenticated_per_peer {
            self.stats.connections_refused += 1;
            return Err(AdmitError::TooManyFromPeer { max: self.cfg.max_unauthenticated_per_peer });
        }
        if self.unauthenticated.len() >= self.cfg.max_unauthenticated_connections {
            // The oldest is the one to evict, if it has had its time to authenticate.
            let stale = self
                .unauthenticated
                .oldest()
                .filter(|(opened_at, _)| crate::transport::after(*opened_at, self.cfg.auth_timeout) <= now)
                .map(|(_, id)| id);
            let Some(old) = stale else {
                self.stats.connections_refused += 1;
                return Err(AdmitError::TooManyUnauthenticated { max: self.cfg.max_unauthenticated_connections });
            };
            self.stats.connections_evicted += 1;
            self.out.push_back(BrokerOutput::Transport(TransportOutput::CloseConnection {
                conn: old,
                code: close_code::AUTH_TIMEOUT,
                reason: "unauthenticated for too long while others wait".into(),
            }));
            self.drop_conn(old);
        }
        Ok(self.open_conn(Some(peer), now))
    }

    pub(super) fn open_conn(&mut self, peer: Option<PeerAddr>, now: Instant) -> ConnId {
        self.timers.sweep.get_or_insert(crate::transport::after(now, std::time::Duration::from_secs(1)));
        let id = self.ids.conn();
        self.stats.connections_opened += 1;
        self.unauthenticated.opened(id, now, peer);
        self.conns.insert(
            id,
            Box::new(Conn {
                streams: HashMap::new(),
                subs: HashMap::new(),
                opens: HashMap::new(),
                authenticated: false,
                opened_at: now,
                peer,
                tenant: None,
                cert_names: Vec::new(),
                next_sub: 1,
                seen_bi: Default::default(),
                seen_uni: Default::default(),
            }),
        );
        id
    }

    /// The driver verified a client certificate in `conn`'s handshake (against the CA it was
    /// configured with) carrying `names` (its subject common name and subject alternative
    /// names). A control stream of the connection may then authenticate with an empty token
    /// as the [`client_certs`](BrokerConfig::client_certs) entry naming one of them.
    pub fn set_peer_certificate(&mut self, conn: ConnId, names: Vec<String>) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.cert_names = names;
        }
    }

    /// Connections none of whose streams authenticated yet.
    pub fn unauthenticated_connections(&self) -> usize {
        self.unauthenticated.len()
    }

    /// Connection `conn` authenticated (a stream of it did, or it serves another broker): it
    /// no longer counts against the caps on unauthenticated connections.
    pub(super) fn authenticated(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn)
            && !c.authenticated
        {
            c.authenticated = true;
            self.unauthenticated.closed(conn, c.opened_at, c.peer);
        }
    }

    /// The connection is gone (closed by either side or lost). Its subscriptions end.
    pub fn connection_closed(&mut self, conn: ConnId, now: Instant) {
        let now = self.clock.advance(now);
        self.drop_conn(conn);
        self.run_events(now);
    }

    pub(super) fn drop_conn(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            if !c.authenticated {
                self.unauthenticated.closed(conn, c.opened_at, c.peer);
            }
            for (sid, st) in &c.streams {
                if let Some(d) = st.auth_deadline {
                    self.timers.auth.remove(&(d, conn, *sid));
                }
            }
            // In subscription-id order: what this releases (held publishers read again)
            // becomes outputs, which must not follow a hash map's order.
            let mut subs: Vec<&Sub> = c.subs.values().collect();
            subs.sort_unstable_by_key(|s| s.id);
            for sub in subs {
                self.unlink_sub(conn, sub);
            }
        }
    }

    pub(super) fn unlink_sub(&mut self, conn: ConnId, sub: &Sub) {
        if sub.holding {
            self.events.raise(events::Event::HoldMayEnd(sub.key.clone(), sub.shard));
        }
        if sub.watch.is_some() {
            if let Some(w) = self.node.cache_watchers.get_mut(&sub.key) {
                w.retain(|(c, id)| !(*c == conn && *id == sub.id));
            }
            return;
        }
        if let Some(shard) = self.node.streams.get_mut(&sub.key).and_then(|e| e.shards.get_mut(sub.shard as usize)) {
            shard.subs.retain(|(c, id)| !(*c == conn && *id == sub.id));
        }
    }

    /// Bytes arrived on a stream the client opened (bidirectional control stream or
    /// unidirectional publish stream). `fin` says the client finished it.
    pub fn handle_stream_data(&mut self, conn: ConnId, stream: StreamId, data: Bytes, fin: bool, now: Instant) {
        self.handle_stream_chunks(conn, stream, std::iter::once(data), fin, now);
    }

    /// [`handle_stream_data`](Self::handle_stream_data) for several chunks that arrived
    /// together, in order: the stream is looked up and driven once for all of them (a busy
    /// stream hands over dozens of packet-sized chunks at a time).
    pub fn handle_stream_chunks<I>(&mut self, conn: ConnId, stream: StreamId, chunks: I, fin: bool, now: Instant)
    where
        I: IntoIterator<Item = Bytes>,
    {
        let now = self.clock.advance(now);
        let preauth = self.cfg.preauth_max_frame_len;
        let auth_timeout = self.cfg.auth_timeout;
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if stream.initiator() != Side::Client {
            // Our own event streams are unidirectional: a client cannot send on them.
            return;
        }
        if !c.streams.contains_key(&stream) {
            let seen = if stream.dir() == Dir::Bi { &mut c.seen_bi } else { &mut c.seen_uni };
            if !seen.first_sight(stream.index()) {
                return; // a stream that was closed
            }
        }
        let auth_deadlines = &mut self.timers.auth;
        let st = c.streams.entry(stream).or_insert_with(|| {
            let deadline = crate::transport::after(now, auth_timeout);
            auth_deadlines.insert((deadline, conn, stream));
            let mut decoder = FrameDecoder::new();
            decoder.set_max_frame_len(preauth);
            decoder.set_accepted_flags(Flags::CLIENT_SENDS);
            Box::new(CtlStream::new(stream, decoder, Some(deadline)))
        });
        if st.recv == Recv::Closed {
            return;
        }
        for data in chunks {
            st.decoder.push(data);
        }
        if fin {
            st.recv = Recv::Finished;
        }
        self.drive_stream(conn, stream, now);
        self.run_events(now);
    }

    /// The client reset its sending side of `stream`: drop what was buffered for it.
    pub fn handle_stream_reset(&mut self, conn: ConnId, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        if let Some(c) = self.conns.get_mut(&conn)
            && let Some(st) = c.streams.get_mut(&stream)
        {
            st.recv = Recv::Closed;
            st.decoder = FrameDecoder::new();
            if st.outstanding == 0 {
                c.streams.remove(&stream);
            }
        }
    }

    /// The client asked us to stop sending on `stream`. On an event stream that ends the
    /// subscription (this is how a client unsubscribes).
    pub fn handle_stream_stopped(&mut self, conn: ConnId, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let sub_id = c.subs.values().find(|s| s.stream == Some(stream)).map(|s| s.id);
        if let Some(id) = sub_id {
            if let Some(sub) = c.subs.remove(&id) {
                self.unlink_sub(conn, &sub);
            }
        } else if let Some(st) = c.streams.get_mut(&stream) {
            st.send_finished = true;
        }
        self.run_events(now);
    }

    /// The driver opened the unidirectional stream asked for with `token`.
    pub fn handle_stream_opened(&mut self, conn: ConnId, token: OpenToken, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let Some(sub_id) = c.opens.remove(&token) else { return };
        let Some(sub) = c.subs.get_mut(&sub_id) else {
            // The subscription ended before its stream opened: close the stream at once.
            self.out.push_back(BrokerOutput::Transport(TransportOutput::Finish { conn, stream }));
            return;
        };
        sub.stream = Some(stream);
        let hello = json_frame(&Message::EventStreamHello(message::EventStreamHello { subscription_id: sub.id }));
        sub.inflight += hello.len();
        self.out.push_back(BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data: hello }));
        self.pump(conn, sub_id);
    }

    /// The driver finished writing `bytes` previously transmitted on `stream`, whatever kind of
    /// stream it is. Required on control streams as well as event streams: on an event stream
    /// the writer credit comes back and more queued batches are written; on a control stream the
    /// unread answers go down, and a stream paused because its client did not read its answers
    /// ([`TransportOutput::PauseReading`]) is resumed only by this call. A driver that reports event
    /// streams alone leaves such a stream paused for ever.
    pub fn handle_stream_flushed(&mut self, conn: ConnId, stream: StreamId, bytes: usize, now: Instant) {
        let now = self.clock.advance(now);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if let Some(st) = c.streams.get_mut(&stream) {
            // A control stream: its answers were read.
            st.unflushed = st.unflushed.saturating_sub(bytes);
            if st.unflushed <= self.cfg.control_stream_unflushed_bytes / 2 && st.pauses.remove(Pause::Flush) {
                st.resume_owed = true;
                self.drive_stream(conn, stream, now);
                self.run_events(now);
            }
            return;
        }
        let Some(sub) = c.subs.values_mut().find(|s| s.stream == Some(stream)) else { return };
        sub.inflight = sub.inflight.saturating_sub(bytes);
        let id = sub.id;
        self.pump(conn, id);
        self.run_events(now);
    }

    pub(super) fn drive_stream(&mut self, conn: ConnId, sid: StreamId, now: Instant) {
        let Some(mut st) = self.conns.get_mut(&conn).and_then(|c| c.streams.remove(&sid)) else { return };
        loop {
            if !st.reading() {
                break;
            }
            match st.decoder.next_frame() {
                Ok(Some(frame)) => {
                    self.stats.frames_in += 1;
                    self.handle_frame(conn, &mut st, frame, now);
                    if !self.conns.contains_key(&conn) {
                        return; // the frame closed the connection
                    }
                }
                Ok(None) => break,
                Err(FrameError::Flags { error, payload }) => self.reject_flags(conn, &mut st, error, &payload),
                Err(e) => {
                    // Bad magic, bad version, oversized frame: the byte stream cannot be
                    // trusted any more. Close the connection (decision D10).
                    self.stats.protocol_violations += 1;
                    self.out.push_back(BrokerOutput::Transport(TransportOutput::CloseConnection {
                        conn,
                        code: close_code::PROTOCOL_VIOLATION,
                        reason: e.to_string(),
                    }));
                    self.drop_conn(conn);
                    return;
                }
            }
        }
        // Every frame held is processed (or the stream paused again): the driver may read it
        // again, if a pause ended meanwhile.
        if st.resume_owed && st.reading() {
            st.resume_owed = false;
            self.out.push_back(BrokerOutput::Transport(TransportOutput::ResumeReading { conn, stream: sid }));
        }
        if st.recv == Recv::Finished && st.reading() && st.decoder.finish().is_err() {
            // The client finished the stream inside a frame: nothing more can come.
            st.recv = Recv::Closed;
        }
        self.maybe_finish(conn, &mut st);
        self.put_back(conn, st);
    }

    /// The last pause reason of a stream went: the driver is told to read again at the end of
    /// the next [`drive_stream`](Self::drive_stream), once what the stream holds is processed.
    pub(super) fn owe_resume(&mut self, conn: ConnId, stream: StreamId) {
        if let Some(st) = self.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&stream)) {
            st.resume_owed = true;
        }
    }

    /// Returns a control stream taken out of its connection, unless it is done (or the
    /// connection is gone).
    pub(super) fn put_back(&mut self, conn: ConnId, st: Box<CtlStream>) {
        if let Some(c) = self.conns.get_mut(&conn)
            && !st.done()
        {
            c.streams.insert(st.id, st);
        }
    }

    /// Finishes our side of a control stream once the client finished and every answer owed on
    /// it is written.
    pub(super) fn maybe_finish(&mut self, conn: ConnId, st: &mut CtlStream) {
        self.answering().maybe_finish(conn, st);
    }

    /// Ends a request stream after an answer: finish our side, stop reading theirs.
    pub(super) fn close_stream(&mut self, conn: ConnId, st: &mut CtlStream) {
        self.answering().close_stream(conn, st);
    }

    // -----------------------------------------------------------------------------------------
    // Answers
}

/// The connections not authenticated yet, oldest first, and how many each peer has: the caps
/// [`Broker::admit`] checks at every handshake are read here, not counted by walking every
/// connection (which made a storm of N connections cost N² steps).
#[derive(Debug, Default)]
pub(super) struct Unauthenticated {
    by_age: std::collections::BTreeSet<(Instant, ConnId)>,
    /// Looked up only, never iterated.
    per_peer: HashMap<PeerAddr, usize>,
}

impl Unauthenticated {
    fn opened(&mut self, id: ConnId, at: Instant, peer: Option<PeerAddr>) {
        self.by_age.insert((at, id));
        if let Some(p) = peer {
            *self.per_peer.entry(p).or_default() += 1;
        }
    }

    /// It authenticated or went away.
    fn closed(&mut self, id: ConnId, at: Instant, peer: Option<PeerAddr>) {
        if !self.by_age.remove(&(at, id)) {
            return;
        }
        if let Some(p) = peer
            && let Some(n) = self.per_peer.get_mut(&p)
        {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&p);
            }
        }
    }

    fn len(&self) -> usize {
        self.by_age.len()
    }

    fn of_peer(&self, peer: PeerAddr) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }

    fn oldest(&self) -> Option<(Instant, ConnId)> {
        self.by_age.first().copied()
    }
}
