//! A deterministic in-memory harness: one [`Broker`], any number of clients, no sockets.
//!
//! Modelled on quinn-proto's `Pair`: the harness plays the driver for every party. It moves
//! bytes between them (optionally cut into chunks by a seeded splitter), opens streams, completes
//! storage writes (at once, or when the test says, in any order) and can hold back a client's
//! event streams to model a slow reader. Time only moves when the test moves it.
//!
//! Clients are either [`ClientConnection`]s or *raw* peers that send hand-made bytes and record
//! everything the broker writes to them byte for byte (to check what an old client would see).

use crate::broker::{
    Broker, BrokerConfig, BrokerOutput, ClusterOutput, PersistRequest, StorageOutput, TransportOutput, WriteOutcome,
};
use crate::client::{ClientConfig, ClientConnection, ClientEvent, ClientOutput};
use crate::transport::{ConnId, Dir, Side, StreamId, WallClock, WriteToken};
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// A shard's full name: tenant, namespace, stream, shard.
type ShardName = (String, String, String, u32);

/// When storage writes complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageMode {
    /// As soon as they are asked for.
    Immediate,
    /// Only when the test calls [`Sim::complete_write`] / [`Sim::complete_all_writes`].
    Manual,
}

/// One party talking to the broker.
#[derive(Debug)]
pub struct SimClient {
    /// Its broker-side connection id.
    pub conn: ConnId,
    /// The client state machine (`None` for a raw peer).
    pub client: Option<ClientConnection>,
    /// Events the client reported, in order.
    pub events: Vec<ClientEvent>,
    /// Everything the broker wrote, per stream (raw peers and clients alike).
    pub received: BTreeMap<StreamId, BytesMut>,
    /// Streams the broker finished.
    pub finished: HashSet<StreamId>,
    /// Streams the broker asked us to stop sending on.
    pub stopped: HashSet<StreamId>,
    /// Set when the broker closed the connection: `(code, reason)`.
    pub closed: Option<(u64, String)>,
    next_bi: u64,
    next_uni: u64,
    next_broker_uni: u64,
    to_broker: VecDeque<(StreamId, Bytes, bool)>,
    paused: HashSet<StreamId>,
    slow: bool,
    held: VecDeque<(StreamId, Bytes, bool)>,
    /// Event streams the client paused (it holds too much its application has not taken):
    /// their bytes wait here, unflushed, until it resumes them.
    reader_paused: BTreeMap<StreamId, VecDeque<(Bytes, bool)>>,
}

/// The harness.
#[derive(Debug)]
pub struct Sim {
    /// The broker.
    pub broker: Broker,
    /// Current virtual time.
    pub now: Instant,
    /// The parties.
    pub clients: Vec<SimClient>,
    /// Storage completion mode.
    pub storage: StorageMode,
    /// Writes asked for and not completed (manual mode).
    pub pending_writes: Vec<PersistRequest>,
    /// Every write the broker asked for, in order.
    pub writes: Vec<PersistRequest>,
    /// Every truncation the broker asked storage for: `(stream, shard, new start)`.
    pub truncations: Vec<(String, u32, u64)>,
    /// What the broker asked to send to other brokers of its cluster (`Forward`,
    /// `ForwardAnswer`), for a test to carry to another simulation's broker.
    pub to_peers: Vec<BrokerOutput>,
    /// How many history reads the broker asked for (answered from `writes`).
    pub reads: usize,
    /// Chunk size for bytes sent to the broker (`None`: whole).
    pub chunk: Option<usize>,
    /// What storage holds: writes that completed successfully, less what truncations removed.
    /// A [`restart`](Self::restart) recovers from exactly this.
    pub durable: Vec<PersistRequest>,
    /// What retention made the broker forget about idempotent producers, per shard (the
    /// `producers_forgotten` of its truncations, highest per producer), kept with `durable` as a
    /// disk keeps it and handed back at a restart.
    pub producer_watermarks: BTreeMap<ShardName, BTreeMap<u64, u64>>,
    /// The last state checkpoint of each shard's truncations (its commit state, kept before
    /// the commits that wrote it were removed), handed back at a restart.
    pub state_checkpoints: BTreeMap<ShardName, Bytes>,
    /// Durable streams `stream_create` made, with their shard counts (D60): what a data
    /// directory's `meta` files keep, handed back at a restart.
    pub created_streams: BTreeMap<(String, String, String), u32>,
    /// Broker restarts so far.
    pub restarts: u32,
    /// A digest of everything the broker and the clients put out, in order (see [`Trace`]):
    /// two runs of one seed that digest alike behaved alike.
    pub trace: Trace,
    /// Writes ever added to `durable` (removals keep the order of the rest, so the newest
    /// `stored - n` entries are the ones added since it was `n`, unless retention removed some
    /// of those already: checkers that need each write once read [`journal`](Self::journal)).
    pub stored: u64,
    /// Every write added to `durable`, in order, when `Some` (a checker turns it on and takes
    /// what it holds with [`take_journal`](Self::take_journal)): unlike `durable`, nothing is
    /// ever removed from it but by taking.
    pub journal: Option<Vec<PersistRequest>>,
    /// `durable` by shard and base offset (positions in `durable`), so that a history read
    /// costs what a disk's would rather than a scan of every write; rebuilt after a removal.
    index: BTreeMap<ShardName, BTreeMap<u64, usize>>,
    index_stale: bool,
    config: BrokerConfig,
    epoch: Instant,
    rng: u64,
}

/// The harness's wall clock at its epoch, in µs since the Unix epoch.
pub const SIM_WALL_EPOCH_MICROS: u64 = 1_760_000_000_000_000;

impl Sim {
    /// A harness around a broker with `config`, starting at virtual time `epoch` (the caller's
    /// clock reading: this crate never reads one); storage completes immediately.
    pub fn new(config: BrokerConfig, epoch: Instant) -> Sim {
        let now = epoch;
        Sim {
            broker: Broker::new(config.clone(), WallClock::new(now, SIM_WALL_EPOCH_MICROS)),
            durable: Vec::new(),
            restarts: 0,
            producer_watermarks: BTreeMap::new(),
            state_checkpoints: BTreeMap::new(),
            created_streams: BTreeMap::new(),
            trace: Trace::default(),
            stored: 0,
            journal: None,
            index: BTreeMap::new(),
            index_stale: false,
            config,
            epoch,
            now,
            clients: Vec::new(),
            storage: StorageMode::Immediate,
            pending_writes: Vec::new(),
            writes: Vec::new(),
            truncations: Vec::new(),
            to_peers: Vec::new(),
            reads: 0,
            chunk: None,
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// Seeds the splitter: every send to the broker is cut into chunks of 1..=max bytes.
    pub fn with_random_chunks(mut self, seed: u64, max: usize) -> Sim {
        self.rng = seed | 1;
        self.chunk = Some(max.max(1));
        self
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64*: deterministic, seeded by the test.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn add(&mut self, client: Option<ClientConnection>) -> usize {
        let conn = self.broker.connection_opened(self.now);
        self.clients.push(SimClient {
            conn,
            client,
            events: Vec::new(),
            received: BTreeMap::new(),
            finished: HashSet::new(),
            stopped: HashSet::new(),
            closed: None,
            next_bi: 0,
            next_uni: 0,
            next_broker_uni: 0,
            to_broker: VecDeque::new(),
            paused: HashSet::new(),
            slow: false,
            held: VecDeque::new(),
            reader_paused: BTreeMap::new(),
        });
        self.clients.len() - 1
    }

    /// Connects a client state machine; returns its index. Call [`run`](Self::run) to let it
    /// authenticate.
    pub fn connect(&mut self, cfg: ClientConfig) -> usize {
        let c = ClientConnection::new(cfg, self.now);
        self.add(Some(c))
    }

    /// The connection of party `i` is lost (no close frame: a network failure). The broker
    /// forgets it; the party receives nothing more.
    pub fn drop_connection(&mut self, i: usize) {
        let conn = self.clients[i].conn;
        self.broker.connection_closed(conn, self.now);
        let c = &mut self.clients[i];
        c.closed.get_or_insert((0, "connection lost".into()));
        c.to_broker.clear();
        c.held.clear();
        c.conn = ConnId(u64::MAX / 2 - i as u64);
    }

    /// Connects a raw peer; returns its index.
    pub fn connect_raw(&mut self) -> usize {
        self.add(None)
    }

    /// A new client-opened bidirectional stream id for a raw peer.
    pub fn raw_open_bi(&mut self, i: usize) -> StreamId {
        let c = &mut self.clients[i];
        let s = StreamId::new(Side::Client, Dir::Bi, c.next_bi);
        c.next_bi += 1;
        s
    }

    /// A new client-opened unidirectional stream id for a raw peer.
    pub fn raw_open_uni(&mut self, i: usize) -> StreamId {
        let c = &mut self.clients[i];
        let s = StreamId::new(Side::Client, Dir::Uni, c.next_uni);
        c.next_uni += 1;
        s
    }

    /// Queues raw bytes from peer `i` on `stream`.
    pub fn raw_send(&mut self, i: usize, stream: StreamId, data: impl Into<Bytes>, fin: bool) {
        self.clients[i].to_broker.push_back((stream, data.into(), fin));
    }

    /// The client state machine of party `i`.
    ///
    /// # Panics
    /// If party `i` is a raw peer (a test mistake).
    pub fn client(&mut self, i: usize) -> &mut ClientConnection {
        self.clients[i].client.as_mut().expect("party is a client, not a raw peer")
    }

    /// Takes the events party `i` reported so far.
    /// Takes the events party `i`'s client reported: its application consumed them (which the
    /// client is told, so a subscription it paused for holding too much reads again).
    pub fn take_events(&mut self, i: usize) -> Vec<ClientEvent> {
        let events = std::mem::take(&mut self.clients[i].events);
        let now = self.now;
        if let Some(c) = self.clients[i].client.as_mut() {
            for e in &events {
                let n = crate::client::event_bytes(e);
                if let (ClientEvent::Events { sub, .. } | ClientEvent::CacheEvent { sub, .. }, true) = (e, n > 0) {
                    c.handle_consumed(*sub, n, now);
                }
            }
        }
        events
    }

    /// Takes the bytes the broker wrote to party `i` on `stream` so far.
    pub fn take_received(&mut self, i: usize, stream: StreamId) -> Bytes {
        self.clients[i].received.remove(&stream).map(BytesMut::freeze).unwrap_or_default()
    }

    /// Makes party `i` a slow reader: its event-stream bytes are held (not flushed) until
    /// [`set_slow`](Self::set_slow) is called with `false`.
    pub fn set_slow(&mut self, i: usize, slow: bool) {
        self.clients[i].slow = slow;
    }

    /// Advances virtual time and fires timers.
    pub fn advance(&mut self, d: Duration) {
        self.now += d;
        self.broker.handle_timeout(self.now);
        self.run();
    }

    /// Adds a completed write to what storage holds.
    fn store(&mut self, w: PersistRequest) {
        if !self.index_stale {
            let name = (w.tenant_id.clone(), w.namespace.clone(), w.stream.clone(), w.shard);
            self.index.entry(name).or_default().insert(w.base_offset, self.durable.len());
        }
        if let Some(j) = &mut self.journal {
            j.push(w.clone());
        }
        self.durable.push(w);
        self.stored += 1;
    }

    /// The writes added to storage since the last call (with the journal on).
    pub fn take_journal(&mut self) -> Vec<PersistRequest> {
        self.journal.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Removes writes from what storage holds.
    fn unstore(&mut self, keep: impl FnMut(&PersistRequest) -> bool) {
        let before = self.durable.len();
        self.durable.retain(keep);
        self.index_stale |= self.durable.len() != before;
    }

    /// The index of `durable`, rebuilt if a removal left it stale.
    fn index(&mut self) -> &BTreeMap<ShardName, BTreeMap<u64, usize>> {
        if self.index_stale {
            self.index.clear();
            for (i, w) in self.durable.iter().enumerate() {
                let name = (w.tenant_id.clone(), w.namespace.clone(), w.stream.clone(), w.shard);
                self.index.entry(name).or_default().insert(w.base_offset, i);
            }
            self.index_stale = false;
        }
        &self.index
    }

    /// Completes a pending write (manual storage mode).
    pub fn complete_write(&mut self, token: WriteToken, ok: bool) {
        let outcome = if ok { WriteOutcome::Written } else { WriteOutcome::Failed };
        self.complete_write_with(token, outcome);
    }

    /// Completes a pending write with `outcome` (manual storage mode): `NoSpace` is a full disk.
    pub fn complete_write_with(&mut self, token: WriteToken, outcome: WriteOutcome) {
        if let Some(i) = self.pending_writes.iter().position(|w| w.token == token) {
            let w = self.pending_writes.remove(i);
            if outcome == WriteOutcome::Written {
                self.store(w);
            }
        }
        self.broker.handle_write_result(token, outcome, self.now);
        self.run();
    }

    /// Completes every pending write, oldest first.
    pub fn complete_all_writes(&mut self) {
        while !self.pending_writes.is_empty() {
            let w = self.pending_writes.remove(0);
            let token = w.token;
            self.store(w);
            self.broker.handle_write_complete(token, true, self.now);
            self.run();
        }
    }

    /// Crashes the broker and starts a new one from what storage holds ([`durable`](Self::durable)):
    /// writes not yet completed are lost, every connection is gone (clients that were connected
    /// see their connection closed; connect new ones). The new broker's clock goes on from now.
    pub fn restart(&mut self) {
        self.restarts += 1;
        let since = self.now.saturating_duration_since(self.epoch);
        let wall = WallClock::new(self.now, SIM_WALL_EPOCH_MICROS + since.as_micros() as u64);
        self.broker = Broker::new(self.config.clone(), wall);
        let mut shards: BTreeMap<(String, String, String, u32), Vec<crate::storage::StoredBatch>> = BTreeMap::new();
        // A disk completes a shard's writes in order: what completed after a write that never
        // did (possible only in manual mode) would not be on a real disk either.
        let mut first_lost: BTreeMap<(String, String, String, u32), u64> = BTreeMap::new();
        for w in &self.pending_writes {
            let k = (w.tenant_id.clone(), w.namespace.clone(), w.stream.clone(), w.shard);
            let e = first_lost.entry(k).or_insert(w.base_offset);
            *e = (*e).min(w.base_offset);
        }
        self.unstore(|w| {
            first_lost
                .get(&(w.tenant_id.clone(), w.namespace.clone(), w.stream.clone(), w.shard))
                .is_none_or(|lost| w.base_offset < *lost)
        });
        self.pending_writes.clear();
        let mut durable = self.durable.clone();
        durable.sort_by_key(|w| w.base_offset);
        for w in durable {
            shards
                .entry((w.tenant_id.clone(), w.namespace.clone(), w.stream.clone(), w.shard))
                .or_default()
                .push(w.to_stored());
        }
        // A created stream comes back with its shard count, written to or not.
        for (t, n, s) in self.created_streams.keys() {
            shards.entry((t.clone(), n.clone(), s.clone(), 0)).or_default();
        }
        for ((t, n, s, shard), batches) in shards {
            let mut cfg = crate::broker::StreamConfig { durable: true, ..self.config.default_stream.clone() };
            if let Some(count) = self.created_streams.get(&(t.clone(), n.clone(), s.clone())) {
                cfg.shards = *count;
            }
            if let Some(c) = self.state_checkpoints.get(&(t.clone(), n.clone(), s.clone(), shard)) {
                // The harness wrote it: it reads back whole.
                if let Ok(c) = crate::storage::decode_state_checkpoint(c) {
                    self.broker.restore_state_checkpoint((&t, &n, &s), cfg.clone(), shard, &c, self.now);
                }
            }
            self.broker.restore_shard((&t, &n, &s), cfg, shard, batches, self.now);
            if let Some(w) = self.producer_watermarks.get(&(t.clone(), n.clone(), s.clone(), shard)) {
                let w: Vec<(u64, u64)> = w.iter().map(|(id, through)| (*id, *through)).collect();
                self.broker.restore_producer_watermarks((&t, &n, &s), shard, &w);
            }
        }
        // The old connections are gone; their ids must not match the new broker's.
        for (i, c) in self.clients.iter_mut().enumerate() {
            c.conn = ConnId(u64::MAX - i as u64 - u64::from(self.restarts) * 1_000_000);
            c.closed.get_or_insert((0, "broker restarted".into()));
            c.to_broker.clear();
        }
        self.run();
    }

    /// Runs every party until nothing moves. Returns the number of steps taken.
    pub fn run(&mut self) -> usize {
        let mut steps = 0;
        while self.step() {
            steps += 1;
            assert!(steps < 1_000_000, "livelock: the simulation never settles");
        }
        steps
    }

    fn step(&mut self) -> bool {
        let mut progress = false;
        // Clients' outputs.
        for i in 0..self.clients.len() {
            while let Some(o) = self.clients[i].client.as_mut().and_then(ClientConnection::poll_output) {
                progress = true;
                self.trace.client_output(i, &o);
                match o {
                    ClientOutput::OpenBi { token } => {
                        let sc = &mut self.clients[i];
                        let s = StreamId::new(Side::Client, Dir::Bi, sc.next_bi);
                        sc.next_bi += 1;
                        let now = self.now;
                        self.clients[i].client.as_mut().expect("client").handle_stream_opened(token, s, now);
                    }
                    ClientOutput::Transmit { stream, data } => {
                        self.clients[i].to_broker.push_back((stream, data, false))
                    }
                    ClientOutput::Finish { stream } => {
                        self.clients[i].to_broker.push_back((stream, Bytes::new(), true))
                    }
                    ClientOutput::StopSending { stream, .. } => {
                        let conn = self.clients[i].conn;
                        self.clients[i].reader_paused.remove(&stream);
                        self.broker.handle_stream_stopped(conn, stream, self.now);
                    }
                    ClientOutput::PauseReading { stream } => {
                        self.clients[i].reader_paused.entry(stream).or_default();
                    }
                    ClientOutput::ResumeReading { stream } => {
                        for (data, fin) in self.clients[i].reader_paused.remove(&stream).unwrap_or_default() {
                            self.deliver(i, stream, data, fin);
                        }
                    }
                }
            }
        }
        // Bytes to the broker.
        for i in 0..self.clients.len() {
            if self.clients[i].closed.is_some() {
                self.clients[i].to_broker.clear();
                continue;
            }
            let mut keep = VecDeque::new();
            while let Some((s, data, fin)) = self.clients[i].to_broker.pop_front() {
                if self.clients[i].paused.contains(&s) {
                    keep.push_back((s, data, fin));
                    continue;
                }
                progress = true;
                let conn = self.clients[i].conn;
                match self.chunk {
                    Some(max) if data.len() > 1 => {
                        let mut rest = data;
                        while !rest.is_empty() {
                            let n = (self.next_rand() as usize % max + 1).min(rest.len());
                            let piece = rest.split_to(n);
                            let last = rest.is_empty();
                            self.broker.handle_stream_data(conn, s, piece, fin && last, self.now);
                        }
                    }
                    _ => self.broker.handle_stream_data(conn, s, data, fin, self.now),
                }
                if self.clients[i].paused.contains(&s) {
                    // Paused while we were feeding it: the rest waits.
                    while let Some(x) = self.clients[i].to_broker.pop_front() {
                        keep.push_back(x);
                    }
                }
            }
            self.clients[i].to_broker = keep;
        }
        // Broker outputs.
        while let Some(o) = self.broker.poll_output() {
            progress = true;
            self.apply(o);
        }
        // Release held bytes of readers that are no longer slow.
        for i in 0..self.clients.len() {
            if !self.clients[i].slow && !self.clients[i].held.is_empty() {
                progress = true;
                let held = std::mem::take(&mut self.clients[i].held);
                for (s, data, fin) in held {
                    self.deliver(i, s, data, fin);
                }
            }
        }
        // Client events.
        for (i, sc) in self.clients.iter_mut().enumerate() {
            if let Some(c) = sc.client.as_mut() {
                while let Some(e) = c.poll_event() {
                    progress = true;
                    self.trace.client_event(i, &e);
                    sc.events.push(e);
                }
            }
        }
        progress
    }

    fn index_of(&self, conn: ConnId) -> Option<usize> {
        self.clients.iter().position(|c| c.conn == conn)
    }

    fn deliver(&mut self, i: usize, s: StreamId, data: Bytes, fin: bool) {
        let now = self.now;
        let sc = &mut self.clients[i];
        if !data.is_empty() {
            sc.received.entry(s).or_default().extend_from_slice(&data);
        }
        if fin {
            sc.finished.insert(s);
        }
        if let Some(c) = sc.client.as_mut() {
            c.handle_stream_data(s, data.clone(), fin, now);
        }
        // The bytes are out of the broker's hands: its writer credit comes back (event streams),
        // and its answer backlog shrinks (control streams).
        if !data.is_empty() {
            let conn = sc.conn;
            self.broker.handle_stream_flushed(conn, s, data.len(), now);
        }
    }

    fn apply(&mut self, o: BrokerOutput) {
        self.trace.broker_output(&o);
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) => {
                let Some(i) = self.index_of(conn) else { return };
                if let Some(q) = self.clients[i].reader_paused.get_mut(&stream) {
                    return q.push_back((data, false));
                }
                // Bytes never overtake bytes still held for the same reader.
                let behind = !self.clients[i].held.is_empty();
                if (self.clients[i].slow || behind) && stream.initiator() == Side::Broker {
                    self.clients[i].held.push_back((stream, data, false));
                } else {
                    self.deliver(i, stream, data, false);
                }
            }
            BrokerOutput::Transport(TransportOutput::Finish { conn, stream }) => {
                let Some(i) = self.index_of(conn) else { return };
                if let Some(q) = self.clients[i].reader_paused.get_mut(&stream) {
                    return q.push_back((Bytes::new(), true));
                }
                let behind = !self.clients[i].held.is_empty();
                if (self.clients[i].slow || behind) && stream.initiator() == Side::Broker {
                    self.clients[i].held.push_back((stream, Bytes::new(), true));
                } else {
                    self.deliver(i, stream, Bytes::new(), true);
                }
            }
            BrokerOutput::Transport(TransportOutput::StopSending { conn, stream, .. }) => {
                if let Some(i) = self.index_of(conn) {
                    self.clients[i].stopped.insert(stream);
                    self.clients[i].to_broker.retain(|(s, _, _)| *s != stream);
                }
            }
            BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                let Some(i) = self.index_of(conn) else { return };
                let sc = &mut self.clients[i];
                let s = StreamId::new(Side::Broker, Dir::Uni, sc.next_broker_uni);
                sc.next_broker_uni += 1;
                self.broker.handle_stream_opened(conn, token, s, self.now);
            }
            BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream }) => {
                if let Some(i) = self.index_of(conn) {
                    self.clients[i].paused.insert(stream);
                }
            }
            BrokerOutput::Transport(TransportOutput::ResumeReading { conn, stream }) => {
                if let Some(i) = self.index_of(conn) {
                    self.clients[i].paused.remove(&stream);
                }
            }
            BrokerOutput::Storage(StorageOutput::Persist(w)) => {
                self.writes.push(w.clone());
                match self.storage {
                    StorageMode::Immediate => {
                        self.store(w.clone());
                        self.broker.handle_write_complete(w.token, true, self.now)
                    }
                    StorageMode::Manual => self.pending_writes.push(w),
                }
            }
            BrokerOutput::Transport(TransportOutput::CloseConnection { conn, code, reason }) => {
                if let Some(i) = self.index_of(conn) {
                    self.clients[i].closed = Some((code, reason));
                }
            }
            BrokerOutput::Storage(StorageOutput::Truncate {
                tenant_id,
                namespace,
                stream,
                shard,
                start,
                producers_forgotten,
                state_checkpoint,
            }) => {
                if let Some(c) = state_checkpoint {
                    self.state_checkpoints.insert((tenant_id.clone(), namespace.clone(), stream.clone(), shard), c);
                }
                let kept = self
                    .producer_watermarks
                    .entry((tenant_id.clone(), namespace.clone(), stream.clone(), shard))
                    .or_default();
                for (id, through) in producers_forgotten {
                    let e = kept.entry(id).or_insert(through);
                    *e = (*e).max(through);
                }
                // As a disk's storage does: nothing from the first commit its state checkpoint
                // does not hold on (the broker hands the state over once a second).
                let name = (tenant_id.clone(), namespace.clone(), stream.clone(), shard);
                let as_of = self.state_checkpoints.get(&name).and_then(|c| crate::storage::state_checkpoint_as_of(c));
                let of_shard = |w: &PersistRequest| {
                    w.tenant_id == name.0 && w.namespace == name.1 && w.stream == name.2 && w.shard == name.3
                };
                let blocked = self
                    .durable
                    .iter()
                    .filter(|w| of_shard(w) && w.state.is_some() && as_of.is_none_or(|a| w.base_offset > a))
                    .map(|w| w.base_offset)
                    .min();
                let limit = blocked.map_or(start, |b| b.min(start));
                self.unstore(|w| {
                    let end = w.base_offset + if w.generation_start { 1 } else { u64::from(w.records.count()) };
                    !(of_shard(w) && end <= limit)
                });
                self.truncations.push((stream, shard, start))
            }
            o @ (BrokerOutput::Cluster(ClusterOutput::Forward { .. })
            | BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { .. })
            | BrokerOutput::Cluster(ClusterOutput::ForwardRequest { .. })
            | BrokerOutput::Cluster(ClusterOutput::ForwardRequestAnswer { .. })
            | BrokerOutput::Cluster(ClusterOutput::ProposeCache { .. })
            | BrokerOutput::Cluster(ClusterOutput::ProposeStream { .. })
            | BrokerOutput::Cluster(ClusterOutput::ProposeStreamDeletion { .. })
            | BrokerOutput::Cluster(ClusterOutput::Copy { .. })
            | BrokerOutput::Cluster(ClusterOutput::ProposeCluster(_))
            | BrokerOutput::Cluster(ClusterOutput::ClusterAdmin { .. })
            | BrokerOutput::Storage(StorageOutput::ResetShard { .. })
            | BrokerOutput::Cluster(ClusterOutput::Replicate { .. })) => self.to_peers.push(o),
            BrokerOutput::Storage(StorageOutput::CreateStream { token, tenant_id, namespace, stream, shards }) => {
                self.created_streams.insert((tenant_id, namespace, stream), shards);
                let now = self.now;
                self.broker.handle_stream_recorded(token, Ok(()), now);
            }
            BrokerOutput::Storage(StorageOutput::DeleteStream { tenant_id, namespace, stream }) => {
                self.created_streams.remove(&(tenant_id.clone(), namespace.clone(), stream.clone()));
                // Writes asked for before it land first, then go with the rest: here they
                // simply never land.
                let of =
                    |w: &PersistRequest| w.tenant_id == tenant_id && w.namespace == namespace && w.stream == stream;
                self.pending_writes.retain(|w| !of(w));
                self.unstore(|w| !of(w));
                self.producer_watermarks
                    .retain(|(t, n, s, _), _| !(*t == tenant_id && *n == namespace && *s == stream));
                self.state_checkpoints.retain(|(t, n, s, _), _| !(*t == tenant_id && *n == namespace && *s == stream));
            }
            BrokerOutput::Storage(StorageOutput::Read(r)) => {
                // Storage is `durable`: answer from it, as a disk would.
                self.reads += 1;
                let mut out = Vec::new();
                let mut bytes = 0usize;
                let name = (r.tenant_id.clone(), r.namespace.clone(), r.stream.clone(), r.shard);
                // The batch holding `from` starts at or below it: begin at the last one that does.
                let positions: Vec<usize> = match self.index().get(&name) {
                    Some(by_base) => {
                        let first = by_base.range(..=r.from).next_back().map_or(r.from, |(b, _)| *b);
                        by_base.range(first..r.end).map(|(_, i)| *i).collect()
                    }
                    None => Vec::new(),
                };
                let ws = positions.into_iter().map(|i| &self.durable[i]).filter(|w| {
                    let end = w.base_offset + if w.generation_start { 1 } else { u64::from(w.records.count()) };
                    end > r.from
                });
                for w in ws {
                    if bytes >= r.max_bytes {
                        break;
                    }
                    bytes += w.records.payload_bytes();
                    out.push(w.to_stored());
                }
                self.broker.handle_read_complete(r.token, out, self.now);
            }
        }
    }
}

/// A running digest (FNV-1a, 64 bits: stable across processes, builds and platforms, unlike a
/// std hasher's) of every output of the broker and the clients, in the order they came: wire
/// bytes both ways, storage requests, and every client event. Equal digests of one seed in two
/// processes show that a run is a function of its seed, not of a process's hash seeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trace(u64);

impl Default for Trace {
    fn default() -> Self {
        Trace(0xcbf2_9ce4_8422_2325)
    }
}

impl Trace {
    /// The digest so far.
    pub fn value(&self) -> u64 {
        self.0
    }

    fn bytes(&mut self, b: &[u8]) {
        let mut h = self.0;
        for &x in b {
            h ^= u64::from(x);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_be_bytes());
    }

    fn debug(&mut self, v: &impl std::fmt::Debug) {
        self.bytes(format!("{v:?}").as_bytes());
    }

    fn broker_output(&mut self, o: &BrokerOutput) {
        match o {
            // The bulk: hashed as bytes, not formatted.
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) => {
                self.u64(1);
                self.u64(conn.0);
                self.u64(stream.0);
                self.bytes(data);
            }
            BrokerOutput::Storage(StorageOutput::Persist(w)) => {
                self.u64(2);
                self.u64(w.token.0);
                self.bytes(w.stream.as_bytes());
                self.u64(u64::from(w.shard));
                self.u64(w.base_offset);
                self.bytes(w.records.raw());
                self.debug(&w.producer);
            }
            other => self.debug(other),
        }
    }

    fn client_output(&mut self, client: usize, o: &ClientOutput) {
        self.u64(client as u64);
        match o {
            ClientOutput::Transmit { stream, data } => {
                self.u64(3);
                self.u64(stream.0);
                self.bytes(data);
            }
            other => self.debug(other),
        }
    }

    fn client_event(&mut self, client: usize, e: &ClientEvent) {
        self.u64(client as u64);
        match e {
            ClientEvent::Events { sub, batch } => {
                self.u64(4);
                self.u64(*sub);
                self.u64(batch.base_offset.unwrap_or(u64::MAX));
                self.bytes(batch.records.raw());
            }
            other => self.debug(other),
        }
    }
}
