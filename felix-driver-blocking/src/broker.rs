//! A broker on one thread: `felix_proto::broker::Broker`, QUIC ([`crate::quic`]) and disk
//! ([`felix_driver_common::storage`]) in one loop.
//!
//! ```text
//! loop {
//!     drain the broker's outputs   → stream writes, opens, stops, pauses, disk writes
//!     write to disk, synchronously → handle_write_result (group commit: one pass per turn)
//!     send what QUIC has to send
//!     wait: a datagram, a stop, or the earliest timer (broker's, QUIC's)
//!     hand what arrived to the broker (handle_stream_chunks, connection_closed, ...)
//! }
//! ```
//!
//! Everything the tokio driver spreads over tasks and channels is here in order on one thread,
//! which is the point: the protocol lives in felix-proto, and this file only moves bytes.

use crate::quic::{Happening, Quic};
use felix_driver_common::storage::{DiskStorage, FsyncMode};
use felix_driver_common::tls::{Identity, quic_server_crypto};
pub use felix_driver_common::transport::TransportTuning;
use felix_proto::broker::{
    Broker, BrokerConfig, BrokerOutput, PeerAddr, PersistRequest, ReadRequest, StorageOutput, TransportOutput,
};
use felix_proto::transport::{ConnId, WallClock};
use quinn_proto::ConnectionHandle;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How a blocking broker is set up.
#[derive(Debug)]
pub struct BrokerOptions {
    /// UDP address to listen on.
    pub listen: SocketAddr,
    /// The protocol configuration.
    pub broker: BrokerConfig,
    /// TLS certificate and key.
    pub identity: Identity,
    /// Where durable streams live; `None` keeps them in memory only.
    pub data_dir: Option<PathBuf>,
    /// When appends are forced to disk.
    pub fsync: FsyncMode,
    /// QUIC settings (the tokio driver's, shared through felix-driver-common).
    pub transport: TransportTuning,
}

/// Why the broker could not start or stopped (shared with the tokio driver).
pub use felix_driver_common::StartError as BrokerError;

/// Stops a running [`BlockingBroker`] from another thread.
#[derive(Clone)]
pub struct StopHandle {
    stop: Arc<AtomicBool>,
    waker: Arc<mio::Waker>,
}

impl StopHandle {
    /// Asks the broker to stop; its `run` then closes every connection and returns.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
    }
}

/// A broker bound to its socket, with its storage recovered; [`run`](Self::run) serves.
pub struct BlockingBroker {
    broker: Broker,
    quic: Quic,
    disk: Option<DiskStorage>,
    stop: StopHandle,
    conns: BTreeMap<ConnectionHandle, ConnId>,
    handles: BTreeMap<ConnId, ConnectionHandle>,
    writes: Vec<PersistRequest>,
    reads: Vec<ReadRequest>,
    /// Records recovered from disk at start.
    pub recovered_records: u64,
    /// What storage repaired at start.
    pub repairs: Vec<String>,
}

/// How often files under an interval fsync policy are checked when nothing else wakes the loop.
const SYNC_CHECK: Duration = Duration::from_millis(20);

impl BlockingBroker {
    /// Binds, sets up TLS and recovers storage.
    ///
    /// # Errors
    /// TLS, socket or storage failures.
    pub fn bind(opts: BrokerOptions) -> Result<BlockingBroker, BrokerError> {
        let crypto = quic_server_crypto(opts.identity, false)?;
        let (quic, waker) = Quic::bind(opts.listen, &opts.transport, Some(crypto))?;
        let now = Instant::now();
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0);
        let mut cfg = opts.broker;
        cfg.history_reads = opts.data_dir.is_some();
        // The core draws no randomness itself: give it some (producer ids).
        cfg.random_seed = felix_driver_common::random_seed();
        let mut broker = Broker::new(cfg, WallClock::new(now, unix));
        let mut repairs = Vec::new();
        let mut recovered_records = 0;
        let disk = match &opts.data_dir {
            Some(dir) => {
                let mut disk = DiskStorage::open(dir, opts.fsync)?;
                for mut s in disk.recover_within(|t, n, st| broker.memory_budget(t, n, st))? {
                    repairs.append(&mut s.repairs);
                    recovered_records += broker.restore(s, now);
                }
                Some(disk)
            }
            None => None,
        };
        Ok(BlockingBroker {
            broker,
            quic,
            disk,
            stop: StopHandle { stop: Arc::new(AtomicBool::new(false)), waker },
            conns: BTreeMap::new(),
            handles: BTreeMap::new(),
            writes: Vec::new(),
            reads: Vec::new(),
            recovered_records,
            repairs,
        })
    }

    /// The address the broker listens on.
    ///
    /// # Errors
    /// If the socket cannot say.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.quic.local_addr()
    }

    /// A handle that stops [`run`](Self::run) from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Serves until stopped, then writes what is pending and closes every connection.
    ///
    /// # Errors
    /// If waiting on the socket fails.
    pub fn run(mut self) -> Result<(), BrokerError> {
        while !self.stop.stop.load(Ordering::SeqCst) {
            self.drain();
            self.quic.transmit();
            let mut deadline = self.broker.poll_timeout();
            if self.disk.is_some() {
                let check = Instant::now() + SYNC_CHECK;
                deadline = Some(deadline.map_or(check, |d| d.min(check)));
            }
            self.quic.wait(deadline)?;
            let now = Instant::now();
            if self.broker.poll_timeout().is_some_and(|t| t <= now) {
                self.broker.handle_timeout(now);
            }
            while let Some(h) = self.quic.poll_happening() {
                self.handle(h, now);
            }
            if let Some(d) = self.disk.as_mut() {
                d.sync_due();
            }
        }
        self.drain();
        if let Some(d) = self.disk.as_mut() {
            d.sync_all();
        }
        self.quic.close_all(felix_proto::transport::close_code::SHUTDOWN, "broker shutting down");
        // Let the close frames go out (bounded: a peer that never answers does not hold us).
        let until = Instant::now() + Duration::from_millis(200);
        while self.quic.has_connections() && Instant::now() < until {
            self.quic.wait(Some(until))?;
            while self.quic.poll_happening().is_some() {}
            self.quic.transmit();
        }
        Ok(())
    }

    fn handle(&mut self, h: Happening, now: Instant) {
        match h {
            Happening::Incoming(incoming) => {
                let peer: PeerAddr = felix_driver_common::peer_addr(incoming.remote_address().ip());
                match self.broker.admit(peer, now) {
                    Ok(conn) => match self.quic.accept(*incoming, now) {
                        Some(ch) => {
                            self.conns.insert(ch, conn);
                            self.handles.insert(conn, ch);
                        }
                        None => self.broker.connection_closed(conn, now),
                    },
                    Err(_) => self.quic.refuse(*incoming),
                }
            }
            Happening::Lost(ch, _) => {
                if let Some(conn) = self.conns.remove(&ch) {
                    self.handles.remove(&conn);
                    self.broker.connection_closed(conn, now);
                }
            }
            Happening::Data { ch, stream, chunks, fin } => {
                if let Some(&conn) = self.conns.get(&ch) {
                    self.broker.handle_stream_chunks(conn, stream, chunks, fin, now);
                }
            }
            Happening::Reset { ch, stream } => {
                if let Some(&conn) = self.conns.get(&ch) {
                    self.broker.handle_stream_reset(conn, stream, now);
                }
            }
            Happening::Stopped { ch, stream } => {
                if let Some(&conn) = self.conns.get(&ch) {
                    self.broker.handle_stream_stopped(conn, stream, now);
                }
            }
            Happening::Flushed { ch, stream, bytes } => {
                if let Some(&conn) = self.conns.get(&ch) {
                    self.broker.handle_stream_flushed(conn, stream, bytes, now);
                }
            }
            Happening::Opened { ch, token, stream } => {
                if let Some(&conn) = self.conns.get(&ch) {
                    self.broker.handle_stream_opened(conn, felix_proto::transport::OpenToken(token), stream, now);
                }
            }
        }
    }

    /// Carries out the broker's outputs until it has none; disk work is done in one pass at the
    /// end of each round (writes first, then the reads queued after them).
    fn drain(&mut self) {
        loop {
            while let Some(o) = self.broker.poll_output() {
                self.output(o);
            }
            // This driver has no logger (it depends on nothing but std and the core): notices
            // go to standard error, as a refused login is worth an operator's eye.
            while let Some(n) = self.broker.poll_notice() {
                eprintln!("felix: {n}");
            }
            if self.writes.is_empty() && self.reads.is_empty() {
                return;
            }
            self.write_pending();
            let now = Instant::now();
            for r in std::mem::take(&mut self.reads) {
                let batches = match self.disk.as_mut() {
                    Some(d) => {
                        d.read_range((&r.tenant_id, &r.namespace, &r.stream), r.shard, r.from, r.end, r.max_bytes)
                    }
                    None => felix_proto::storage::MemoryOnly.read(&r),
                };
                self.broker.handle_read_complete(r.token, batches, now);
            }
        }
    }

    /// Writes what the broker asked to persist (one group-commit pass) and reports each outcome.
    fn write_pending(&mut self) {
        if self.writes.is_empty() {
            return;
        }
        let writes = std::mem::take(&mut self.writes);
        let results = match self.disk.as_mut() {
            Some(d) => d.write(writes),
            None => felix_proto::storage::MemoryOnly.write(writes),
        };
        let now = Instant::now();
        for (token, outcome) in results {
            self.broker.handle_write_result(token, outcome, now);
        }
    }

    fn output(&mut self, o: BrokerOutput) {
        let ch = |conn: &ConnId| self.handles.get(conn).copied();
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.write(ch, stream, data);
                }
            }
            BrokerOutput::Transport(TransportOutput::Finish { conn, stream }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.finish(ch, stream);
                }
            }
            BrokerOutput::Transport(TransportOutput::StopSending { conn, stream, code }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.stop(ch, stream, code);
                }
            }
            BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.set_paused(ch, stream, true);
                }
            }
            BrokerOutput::Transport(TransportOutput::ResumeReading { conn, stream }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.set_paused(ch, stream, false);
                }
            }
            BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.open(ch, token.0, false);
                }
            }
            BrokerOutput::Storage(StorageOutput::Persist(w)) => self.writes.push(w),
            BrokerOutput::Storage(StorageOutput::Read(r)) => self.reads.push(r),
            BrokerOutput::Storage(StorageOutput::Truncate {
                tenant_id,
                namespace,
                stream,
                shard,
                start,
                producers_forgotten,
                state_checkpoint,
            }) => {
                // Writes asked for before the truncation go first.
                self.write_pending();
                if let Some(d) = self.disk.as_mut() {
                    d.truncate_before(
                        (&tenant_id, &namespace, &stream),
                        shard,
                        start,
                        &producers_forgotten,
                        state_checkpoint.as_deref(),
                    );
                }
            }
            BrokerOutput::Storage(StorageOutput::DeleteStream { tenant_id, namespace, stream }) => {
                // Writes asked for before the deletion go first.
                self.write_pending();
                if let Some(d) = self.disk.as_mut()
                    && let Err(e) = d.delete_stream((&tenant_id, &namespace, &stream))
                {
                    eprintln!("deleting {namespace}/{stream}: {e}");
                }
            }
            BrokerOutput::Storage(StorageOutput::CreateStream { token, tenant_id, namespace, stream, shards }) => {
                let r = match self.disk.as_mut() {
                    Some(d) => d.record_stream((&tenant_id, &namespace, &stream), shards).map_err(|e| e.to_string()),
                    None => Ok(()),
                };
                self.broker.handle_stream_recorded(token, r, Instant::now());
            }
            // A shard is reset only when it moves here, which needs a cluster.
            BrokerOutput::Storage(StorageOutput::ResetShard { .. }) => {}
            // No cluster transport in this driver (it is never given a cluster's metadata): any
            // cluster output is answered as the cluster would, by the broker.
            BrokerOutput::Cluster(c) => self.broker.handle_cluster_output_alone(c, Instant::now()),
            BrokerOutput::Transport(TransportOutput::CloseConnection { conn, code, reason }) => {
                if let Some(ch) = ch(&conn) {
                    self.quic.close(ch, code, &reason);
                }
            }
        }
    }
}
