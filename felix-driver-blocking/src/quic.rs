//! QUIC on one UDP socket with `quinn-proto`: the endpoint, its connections and their streams,
//! reduced to what a felix-proto state machine needs (bytes in per stream, bytes out per stream,
//! opens, stops, resets) and reported as [`Happening`]s.
//!
//! Both the broker loop and the client loop are this plus their own state machine. Nothing here
//! knows the Felix protocol.

use bytes::{Bytes, BytesMut};
use felix_driver_common::transport::{
    INITIAL_BI_STREAMS, INITIAL_UNI_STREAMS, TransportTuning, is_loopback, next_stream_limit,
};
use felix_proto::transport::StreamId;
use mio::net::UdpSocket;
use mio::{Events, Interest, Poll, Token, Waker};
use quinn_proto::{
    ConnectionHandle, DatagramEvent, Dir, Endpoint, Event, Incoming, ReadError, StreamEvent, VarInt, WriteError,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SOCKET: Token = Token(0);
const WAKER: Token = Token(1);

/// What the QUIC layer saw, for the loop above to hand to its state machine.
#[derive(Debug)]
pub(crate) enum Happening {
    /// A client knocks (broker only): accept it with [`Quic::accept`] or refuse it.
    Incoming(Box<Incoming>),
    /// A connection is gone.
    Lost(ConnectionHandle, String),
    /// Bytes on a stream, in order; `fin` when the peer finished it.
    Data { ch: ConnectionHandle, stream: StreamId, chunks: Vec<Bytes>, fin: bool },
    /// The peer reset a stream.
    Reset { ch: ConnectionHandle, stream: StreamId },
    /// The peer stopped reading a stream we send on.
    Stopped { ch: ConnectionHandle, stream: StreamId },
    /// Bytes we wrote on a stream were taken by QUIC (its send buffer).
    Flushed { ch: ConnectionHandle, stream: StreamId, bytes: usize },
    /// A stream we asked to open ([`Quic::open`]) is open.
    Opened { ch: ConnectionHandle, token: u64, stream: StreamId },
}

/// What we still have to write on one stream.
#[derive(Debug, Default)]
struct Outgoing {
    queue: VecDeque<Bytes>,
    finish: bool,
}

/// One connection and the per-stream state QUIC leaves to its user.
struct Conn {
    quic: quinn_proto::Connection,
    out: BTreeMap<StreamId, Outgoing>,
    /// Streams whose reading is paused (flow control then holds the peer), and which of them
    /// became readable meanwhile.
    paused: BTreeSet<StreamId>,
    readable: BTreeSet<StreamId>,
    /// Streams to open, by the caller's token, waiting for the peer's stream limit.
    opens: VecDeque<(u64, Dir)>,
    lost: bool,
    /// Its QUIC timer as [`Quic::timers`] holds it.
    timer: Option<Instant>,
}

/// The endpoint, its socket and its connections.
pub(crate) struct Quic {
    socket: UdpSocket,
    poll: Poll,
    events: Events,
    endpoint: Endpoint,
    conns: BTreeMap<ConnectionHandle, Conn>,
    server_config: Option<Arc<quinn_proto::ServerConfig>>,
    /// The server configuration for loopback peers (no MTU discovery: the largest size at once).
    loopback_config: Option<Arc<quinn_proto::ServerConfig>>,
    recv_buf: Vec<u8>,
    /// The most bidirectional and unidirectional streams a peer may be granted (the tuning's).
    most_streams: (u32, u32),
    send_buf: Vec<u8>,
    /// A datagram the socket refused (`WouldBlock`): sent first when it is writable again.
    blocked: Option<(Vec<u8>, SocketAddr)>,
    /// Connections something happened to (a datagram, a timer, a write asked for) since they
    /// last sent what they had to: only these are visited. Visiting every connection on each
    /// turn of the loop kept 1,000 idle connections at 14% of a core.
    dirty: BTreeSet<ConnectionHandle>,
    /// Every connection's next QUIC timer, earliest first (kept current for each connection
    /// visited), so the loop's sleep and its due timers cost no walk over every connection.
    timers: BTreeSet<(Instant, ConnectionHandle)>,
    happenings: VecDeque<Happening>,
}

fn felix_id(id: quinn_proto::StreamId) -> StreamId {
    StreamId(u64::from(id))
}

fn quic_id(id: StreamId) -> Option<quinn_proto::StreamId> {
    VarInt::from_u64(id.0).ok().map(quinn_proto::StreamId::from)
}

impl Quic {
    /// Binds `addr`. A broker passes its server configuration; a client passes none.
    pub(crate) fn bind(
        addr: SocketAddr,
        tuning: &TransportTuning,
        crypto: Option<Arc<dyn quinn_proto::crypto::ServerConfig>>,
    ) -> std::io::Result<(Quic, Arc<Waker>)> {
        let mut socket = UdpSocket::bind(addr)?;
        let poll = Poll::new()?;
        poll.registry().register(&mut socket, SOCKET, Interest::READABLE | Interest::WRITABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let server = |transport: quinn_proto::TransportConfig| {
            crypto.clone().map(|c| {
                let mut s = quinn_proto::ServerConfig::with_crypto(c);
                s.transport_config(Arc::new(transport));
                Arc::new(s)
            })
        };
        // A connection starts with a few streams and is granted more as it uses them
        // (`StreamCredit`): quinn keeps a table entry per stream a peer may open.
        let first_credit = |mut t: quinn_proto::TransportConfig| {
            t.max_concurrent_bidi_streams(VarInt::from_u32(INITIAL_BI_STREAMS.min(tuning.max_bi_streams)));
            t.max_concurrent_uni_streams(VarInt::from_u32(INITIAL_UNI_STREAMS.min(tuning.max_uni_streams)));
            t
        };
        let server_config = server(first_credit(tuning.to_quinn()));
        let loopback_config = server(first_credit(tuning.to_quinn_for(SocketAddr::from(([127, 0, 0, 1], 0)))));
        let endpoint = Endpoint::new(Arc::new(tuning.endpoint_config()), server_config.clone(), true, None);
        Ok((
            Quic {
                socket,
                poll,
                events: Events::with_capacity(64),
                endpoint,
                conns: BTreeMap::new(),
                server_config,
                loopback_config,
                recv_buf: vec![0; 65_536],
                most_streams: (tuning.max_bi_streams, tuning.max_uni_streams),
                send_buf: Vec::with_capacity(65_536),
                blocked: None,
                dirty: BTreeSet::new(),
                timers: BTreeSet::new(),
                happenings: VecDeque::new(),
            },
            waker,
        ))
    }

    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Starts a connection to a broker.
    pub(crate) fn connect(
        &mut self,
        config: quinn_proto::ClientConfig,
        addr: SocketAddr,
        server_name: &str,
        now: Instant,
    ) -> Result<ConnectionHandle, quinn_proto::ConnectError> {
        let (ch, quic) = self.endpoint.connect(now, config, addr, server_name)?;
        self.insert(ch, quic);
        Ok(ch)
    }

    /// Accepts a knocking client.
    pub(crate) fn accept(&mut self, incoming: Incoming, now: Instant) -> Option<ConnectionHandle> {
        let mut buf = Vec::new();
        let cfg = if is_loopback(incoming.remote_address()) {
            self.loopback_config.clone()
        } else {
            self.server_config.clone()
        };
        match self.endpoint.accept(incoming, now, &mut buf, cfg) {
            Ok((ch, quic)) => {
                self.insert(ch, quic);
                Some(ch)
            }
            Err(e) => {
                if let Some(t) = e.response {
                    self.send_datagram(&buf[..t.size], t.destination);
                }
                None
            }
        }
    }

    /// Refuses a knocking client.
    pub(crate) fn refuse(&mut self, incoming: Incoming) {
        let mut buf = Vec::new();
        let t = self.endpoint.refuse(incoming, &mut buf);
        self.send_datagram(&buf[..t.size], t.destination);
    }

    fn insert(&mut self, ch: ConnectionHandle, quic: quinn_proto::Connection) {
        self.conns.insert(
            ch,
            Conn {
                quic,
                out: BTreeMap::new(),
                paused: BTreeSet::new(),
                readable: BTreeSet::new(),
                opens: VecDeque::new(),
                lost: false,
                timer: None,
            },
        );
        self.dirty.insert(ch);
    }

    /// Files `ch`'s QUIC timer in [`Self::timers`] as it stands now.
    fn refresh_timer(&mut self, ch: ConnectionHandle) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        let t = c.quic.poll_timeout();
        if t != c.timer {
            if let Some(old) = c.timer {
                self.timers.remove(&(old, ch));
            }
            if let Some(new) = t {
                self.timers.insert((new, ch));
            }
            c.timer = t;
        }
    }

    /// The next thing that happened, if any.
    pub(crate) fn poll_happening(&mut self) -> Option<Happening> {
        self.happenings.pop_front()
    }

    /// Waits for a datagram, a wake-up or `deadline` (or a connection's own timer, whichever is
    /// first), then takes in everything that arrived and fires due timers.
    pub(crate) fn wait(&mut self, deadline: Option<Instant>) -> std::io::Result<()> {
        let now = Instant::now();
        let dirty: Vec<ConnectionHandle> = self.dirty.iter().copied().collect();
        for ch in dirty {
            self.refresh_timer(ch);
        }
        let next = self.timers.first().map(|(t, _)| *t).into_iter().chain(deadline).min();
        let timeout = next.map(|d| d.saturating_duration_since(now));
        // Something already queued to say: do not sleep.
        let timeout = if self.happenings.is_empty() { timeout } else { Some(Duration::ZERO) };
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        let writable = self.events.iter().any(|e| e.token() == SOCKET && e.is_writable());
        if writable && let Some((d, to)) = self.blocked.take() {
            self.send_datagram(&d, to);
        }
        let now = Instant::now();
        self.receive(now);
        while let Some(&(t, ch)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.pop_first();
            if let Some(c) = self.conns.get_mut(&ch) {
                c.timer = None;
                c.quic.handle_timeout(now);
            }
            self.dirty.insert(ch);
        }
        self.process(now);
        Ok(())
    }

    /// Takes in every datagram the socket holds.
    fn receive(&mut self, now: Instant) {
        loop {
            let (n, from) = match self.socket.recv_from(&mut self.recv_buf) {
                Ok(v) => v,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                // A transient error (an ICMP report of an earlier send): keep reading.
                Err(_) => continue,
            };
            let data = BytesMut::from(&self.recv_buf[..n]);
            let mut buf = Vec::new();
            match self.endpoint.handle(now, from, None, None, data, &mut buf) {
                Some(DatagramEvent::ConnectionEvent(ch, ev)) => {
                    if let Some(c) = self.conns.get_mut(&ch) {
                        c.quic.handle_event(ev);
                        self.dirty.insert(ch);
                    }
                }
                Some(DatagramEvent::NewConnection(incoming)) => {
                    self.happenings.push_back(Happening::Incoming(Box::new(incoming)));
                }
                Some(DatagramEvent::Response(t)) => self.send_datagram(&buf[..t.size], t.destination),
                None => {}
            }
        }
    }

    /// Lets every connection talk to the endpoint and report its events.
    fn process(&mut self, now: Instant) {
        let handles: Vec<ConnectionHandle> = self.dirty.iter().copied().collect();
        for ch in handles {
            let Some(c) = self.conns.get_mut(&ch) else { continue };
            while let Some(ev) = c.quic.poll_endpoint_events() {
                if let Some(back) = self.endpoint.handle_event(ch, ev) {
                    c.quic.handle_event(back);
                }
            }
            while let Some(ev) = c.quic.poll() {
                match ev {
                    Event::ConnectionLost { reason } => {
                        if !c.lost {
                            c.lost = true;
                            self.happenings.push_back(Happening::Lost(ch, reason.to_string()));
                        }
                    }
                    Event::Stream(StreamEvent::Opened { dir }) => {
                        while let Some(id) = c.quic.streams().accept(dir) {
                            read_stream(ch, c, felix_id(id), &mut self.happenings);
                        }
                        let most = if dir == Dir::Bi { self.most_streams.0 } else { self.most_streams.1 };
                        let open = c.quic.streams().remote_open_streams(dir);
                        if let Some(n) = next_stream_limit(open, c.quic.max_concurrent_streams(dir), most.into()) {
                            c.quic.set_max_concurrent_streams(dir, VarInt::from_u64(n).unwrap_or(VarInt::MAX));
                        }
                    }
                    Event::Stream(StreamEvent::Readable { id }) => {
                        read_stream(ch, c, felix_id(id), &mut self.happenings)
                    }
                    Event::Stream(StreamEvent::Writable { id }) => {
                        flush_stream(ch, c, felix_id(id), &mut self.happenings)
                    }
                    Event::Stream(StreamEvent::Stopped { id, .. }) => {
                        c.out.remove(&felix_id(id));
                        self.happenings.push_back(Happening::Stopped { ch, stream: felix_id(id) });
                    }
                    // Streams asked for before the handshake wait for the peer's limits, which
                    // come with it (no `Available` event says so).
                    Event::Connected | Event::Stream(StreamEvent::Available { .. }) => {
                        open_waiting(ch, c, &mut self.happenings)
                    }
                    Event::Stream(StreamEvent::Finished { .. })
                    | Event::HandshakeDataReady
                    | Event::DatagramReceived
                    | Event::DatagramsUnblocked => {}
                }
            }
            if c.quic.is_drained() {
                if !c.lost {
                    self.happenings.push_back(Happening::Lost(ch, "closed".into()));
                }
                if let Some(t) = c.timer {
                    self.timers.remove(&(t, ch));
                }
                self.conns.remove(&ch);
                self.dirty.remove(&ch);
            }
        }
        let _ = now;
    }

    /// Sends what every connection has to send.
    pub(crate) fn transmit(&mut self) {
        let now = Instant::now();
        self.process(now);
        let handles: Vec<ConnectionHandle> = self.dirty.iter().copied().collect();
        for ch in handles {
            loop {
                if self.blocked.is_some() {
                    // The rest stay dirty: they send once the socket drains.
                    return;
                }
                let Some(c) = self.conns.get_mut(&ch) else { break };
                self.send_buf.clear();
                let Some(t) = c.quic.poll_transmit(now, 1, &mut self.send_buf) else { break };
                let data = std::mem::take(&mut self.send_buf);
                self.send_datagram(&data[..t.size], t.destination);
                self.send_buf = data;
            }
            self.refresh_timer(ch);
            self.dirty.remove(&ch);
        }
    }

    fn send_datagram(&mut self, data: &[u8], to: SocketAddr) {
        match self.socket.send_to(data, to) {
            Ok(_) => {}
            // The socket buffer is full: keep the datagram and stop sending until it drains.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.blocked = Some((data.to_vec(), to)),
            // Anything else is a datagram lost on the way, which QUIC recovers from.
            Err(_) => {}
        }
    }

    /// Queues bytes on a stream (sent in order, as flow control allows).
    pub(crate) fn write(&mut self, ch: ConnectionHandle, stream: StreamId, data: Bytes) {
        self.dirty.insert(ch);
        let Some(c) = self.conns.get_mut(&ch) else { return };
        c.out.entry(stream).or_default().queue.push_back(data);
        flush_stream(ch, c, stream, &mut self.happenings);
    }

    /// Finishes our side of a stream once what is queued on it is written.
    pub(crate) fn finish(&mut self, ch: ConnectionHandle, stream: StreamId) {
        self.dirty.insert(ch);
        let Some(c) = self.conns.get_mut(&ch) else { return };
        c.out.entry(stream).or_default().finish = true;
        flush_stream(ch, c, stream, &mut self.happenings);
    }

    /// Stops reading a stream, telling the peer `code`.
    pub(crate) fn stop(&mut self, ch: ConnectionHandle, stream: StreamId, code: u64) {
        self.dirty.insert(ch);
        let (Some(c), Some(id)) = (self.conns.get_mut(&ch), quic_id(stream)) else { return };
        let _ = c.quic.recv_stream(id).stop(VarInt::from_u64(code).unwrap_or(VarInt::from_u32(0)));
        c.paused.remove(&stream);
        c.readable.remove(&stream);
    }

    /// Pauses or resumes reading a stream.
    pub(crate) fn set_paused(&mut self, ch: ConnectionHandle, stream: StreamId, paused: bool) {
        self.dirty.insert(ch);
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if paused {
            c.paused.insert(stream);
        } else if c.paused.remove(&stream) && c.readable.remove(&stream) {
            read_stream(ch, c, stream, &mut self.happenings);
        }
    }

    /// Opens a stream; reported as [`Happening::Opened`] with `token` (at once, or when the
    /// peer's stream limit allows).
    pub(crate) fn open(&mut self, ch: ConnectionHandle, token: u64, bi: bool) {
        self.dirty.insert(ch);
        let Some(c) = self.conns.get_mut(&ch) else { return };
        c.opens.push_back((token, if bi { Dir::Bi } else { Dir::Uni }));
        open_waiting(ch, c, &mut self.happenings);
    }

    /// Closes a connection with an application code.
    pub(crate) fn close(&mut self, ch: ConnectionHandle, code: u64, reason: &str) {
        self.dirty.insert(ch);
        let Some(c) = self.conns.get_mut(&ch) else { return };
        let code = VarInt::from_u64(code).unwrap_or(VarInt::from_u32(0));
        c.quic.close(Instant::now(), code, Bytes::copy_from_slice(reason.as_bytes()));
    }

    /// Closes every connection (a broker shutting down).
    pub(crate) fn close_all(&mut self, code: u64, reason: &str) {
        let handles: Vec<ConnectionHandle> = self.conns.keys().copied().collect();
        for ch in handles {
            self.close(ch, code, reason);
        }
        self.transmit();
    }

    /// Whether any connection is still open.
    pub(crate) fn has_connections(&self) -> bool {
        !self.conns.is_empty()
    }
}

fn open_waiting(ch: ConnectionHandle, c: &mut Conn, happenings: &mut VecDeque<Happening>) {
    while let Some(&(token, dir)) = c.opens.front() {
        let Some(id) = c.quic.streams().open(dir) else { return };
        c.opens.pop_front();
        happenings.push_back(Happening::Opened { ch, token, stream: felix_id(id) });
    }
}

/// Reads everything a stream holds (unless it is paused).
fn read_stream(ch: ConnectionHandle, c: &mut Conn, stream: StreamId, happenings: &mut VecDeque<Happening>) {
    if c.paused.contains(&stream) {
        c.readable.insert(stream);
        return;
    }
    let Some(id) = quic_id(stream) else { return };
    let mut recv = c.quic.recv_stream(id);
    let Ok(mut chunks) = recv.read(true) else { return };
    let mut got = Vec::new();
    let mut fin = false;
    let mut reset = false;
    loop {
        match chunks.next(usize::MAX) {
            Ok(Some(chunk)) => got.push(chunk.bytes),
            Ok(None) => {
                fin = true;
                break;
            }
            Err(ReadError::Blocked) => break,
            Err(ReadError::Reset(_)) => {
                reset = true;
                break;
            }
        }
    }
    // Returns whether flow-control credit must be sent; `transmit` sends it either way.
    let _ = chunks.finalize();
    if !got.is_empty() || fin {
        happenings.push_back(Happening::Data { ch, stream, chunks: got, fin });
    }
    if reset {
        happenings.push_back(Happening::Reset { ch, stream });
    }
}

/// Writes what is queued on a stream until QUIC's send buffer or flow control is full.
fn flush_stream(ch: ConnectionHandle, c: &mut Conn, stream: StreamId, happenings: &mut VecDeque<Happening>) {
    let Some(id) = quic_id(stream) else { return };
    let Some(o) = c.out.get_mut(&stream) else { return };
    let mut flushed = 0;
    while let Some(front) = o.queue.front_mut() {
        match c.quic.send_stream(id).write(front) {
            Ok(n) if n == front.len() => {
                flushed += n;
                o.queue.pop_front();
            }
            Ok(n) => {
                flushed += n;
                let _ = front.split_to(n);
            }
            Err(WriteError::Blocked) => break,
            Err(WriteError::Stopped(_) | WriteError::ClosedStream) => {
                c.out.remove(&stream);
                happenings.push_back(Happening::Stopped { ch, stream });
                return;
            }
        }
    }
    if flushed > 0 {
        happenings.push_back(Happening::Flushed { ch, stream, bytes: flushed });
    }
    if o.queue.is_empty() && o.finish {
        let _ = c.quic.send_stream(id).finish();
        c.out.remove(&stream);
    }
}
