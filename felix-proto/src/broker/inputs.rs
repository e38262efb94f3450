//! What a driver feeds a broker from its transport and its storage, as one borrowed view:
//! [`ConnectionInputs`]. A cluster node hands this out
//! ([`ClusterNode::inputs`](crate::cluster::node::ClusterNode::inputs)) instead of its
//! [`Broker`], so a driver delivers a connection's bytes and storage's answers and reads the
//! broker's notices, but cannot reach what only the node may change on its broker (the
//! metadata it applies, fencing, moves, replica roles). A single broker hands out the same
//! view ([`Broker::inputs`]), so one driver loop serves both.

use super::*;

/// A driver's inputs to a broker ([`Broker::inputs`],
/// [`ClusterNode::inputs`](crate::cluster::node::ClusterNode::inputs)). Each method is the
/// broker's own of the same name.
pub struct ConnectionInputs<'a>(&'a mut Broker);

impl Broker {
    /// This broker's inputs from a driver.
    pub fn inputs(&mut self) -> ConnectionInputs<'_> {
        ConnectionInputs(self)
    }
}

impl ConnectionInputs<'_> {
    /// [`Broker::admit`].
    ///
    /// # Errors
    /// [`AdmitError`] naming the cap passed.
    pub fn admit(&mut self, peer: PeerAddr, now: Instant) -> Result<ConnId, AdmitError> {
        self.0.admit(peer, now)
    }

    /// [`Broker::set_peer_certificate`].
    pub fn set_peer_certificate(&mut self, conn: ConnId, names: Vec<String>) {
        self.0.set_peer_certificate(conn, names);
    }

    /// [`Broker::connection_closed`].
    pub fn connection_closed(&mut self, conn: ConnId, now: Instant) {
        self.0.connection_closed(conn, now);
    }

    /// [`Broker::handle_stream_data`].
    pub fn handle_stream_data(&mut self, conn: ConnId, stream: StreamId, data: Bytes, fin: bool, now: Instant) {
        self.0.handle_stream_data(conn, stream, data, fin, now);
    }

    /// [`Broker::handle_stream_chunks`].
    pub fn handle_stream_chunks<I>(&mut self, conn: ConnId, stream: StreamId, chunks: I, fin: bool, now: Instant)
    where
        I: IntoIterator<Item = Bytes>,
    {
        self.0.handle_stream_chunks(conn, stream, chunks, fin, now);
    }

    /// [`Broker::handle_stream_reset`].
    pub fn handle_stream_reset(&mut self, conn: ConnId, stream: StreamId, now: Instant) {
        self.0.handle_stream_reset(conn, stream, now);
    }

    /// [`Broker::handle_stream_stopped`].
    pub fn handle_stream_stopped(&mut self, conn: ConnId, stream: StreamId, now: Instant) {
        self.0.handle_stream_stopped(conn, stream, now);
    }

    /// [`Broker::handle_stream_opened`].
    pub fn handle_stream_opened(&mut self, conn: ConnId, token: OpenToken, stream: StreamId, now: Instant) {
        self.0.handle_stream_opened(conn, token, stream, now);
    }

    /// [`Broker::handle_stream_flushed`].
    pub fn handle_stream_flushed(&mut self, conn: ConnId, stream: StreamId, bytes: usize, now: Instant) {
        self.0.handle_stream_flushed(conn, stream, bytes, now);
    }

    /// [`Broker::handle_write_result`].
    pub fn handle_write_result(&mut self, token: WriteToken, outcome: WriteOutcome, now: Instant) {
        self.0.handle_write_result(token, outcome, now);
    }

    /// [`Broker::handle_write_complete`].
    pub fn handle_write_complete(&mut self, token: WriteToken, ok: bool, now: Instant) {
        self.0.handle_write_complete(token, ok, now);
    }

    /// [`Broker::handle_read_complete`].
    pub fn handle_read_complete(&mut self, token: ReadToken, batches: Vec<crate::storage::StoredBatch>, now: Instant) {
        self.0.handle_read_complete(token, batches, now);
    }

    /// [`Broker::handle_stream_recorded`].
    pub fn handle_stream_recorded(&mut self, token: WriteToken, result: Result<(), String>, now: Instant) {
        self.0.handle_stream_recorded(token, result, now);
    }

    /// [`Broker::set_jwt`].
    pub fn set_jwt(&mut self, verifier: Option<crate::jwt::Verifier>, now: Instant) {
        self.0.set_jwt(verifier, now);
    }

    /// [`Broker::begin_drain`].
    pub fn begin_drain(&mut self, now: Instant) {
        self.0.begin_drain(now);
    }

    /// [`Broker::poll_notice`].
    pub fn poll_notice(&mut self) -> Option<Notice> {
        self.0.poll_notice()
    }
}
