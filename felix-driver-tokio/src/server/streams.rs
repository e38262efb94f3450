//! A client connection's tasks: the accept loop, and a reader and a writer per QUIC stream
//! (reads pausable and cancel-safe; writes never in a `select!`).

use super::*;

pub(super) enum WriterCmd {
    Data(Bytes),
    Finish,
}

pub(super) struct ConnHandle {
    pub(super) quic: quinn::Connection,
    pub(super) writers: HashMap<StreamId, crate::queue::Sender<WriterCmd>>,
    pub(super) gates: HashMap<StreamId, watch::Sender<ReadGate>>,
    /// The client's bidirectional and unidirectional streams open, and how many it may open.
    pub(super) bi: StreamCredit,
    pub(super) uni: StreamCredit,
}

impl ConnHandle {
    /// The client opened a stream: grants it more when half of what it may open is open.
    pub(super) fn stream_opened(&mut self, bi: bool) {
        if bi {
            if let Some(n) = self.bi.opened() {
                self.quic.set_max_concurrent_bi_streams(VarInt::from_u32(n));
            }
        } else if let Some(n) = self.uni.opened() {
            self.quic.set_max_concurrent_uni_streams(VarInt::from_u32(n));
        }
    }
}

/// Held by the tasks serving one of a client's streams; the last to end tells the broker task
/// the stream is over (both halves), so its place counts as free in the connection's
/// [`StreamCredit`].
pub(super) struct StreamEnd {
    pub(super) conn: ConnId,
    pub(super) bi: bool,
    pub(super) tx: mpsc::UnboundedSender<Input>,
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        let _ = self.tx.send(Input::StreamEnded { conn: self.conn, bi: self.bi });
    }
}

/// Hands every arriving connection to the broker task, which asks the core whether to admit it
/// before any handshake work is done. A failed handshake ends only that connection.
pub(super) async fn accept_loop(endpoint: quinn::Endpoint, tx: mpsc::UnboundedSender<Input>) {
    while let Some(incoming) = endpoint.accept().await {
        if tx.send(Input::Incoming(Box::new(incoming))).is_err() {
            return;
        }
    }
}

/// The core's name for a peer: its IP address in 16 bytes (IPv4 mapped into IPv6).
pub(super) async fn conn_loop(conn: ConnId, quic: quinn::Connection, tx: mpsc::UnboundedSender<Input>) {
    loop {
        tokio::select! {
            bi = quic.accept_bi() => match bi {
                Ok((send, recv)) => { let _ = tx.send(Input::Stream { conn, send: Some(send), recv }); }
                Err(_) => break,
            },
            uni = quic.accept_uni() => match uni {
                Ok(recv) => { let _ = tx.send(Input::Stream { conn, send: None, recv }); }
                Err(_) => break,
            },
        }
    }
    let _ = tx.send(Input::Closed { conn });
}

pub(super) async fn reader(
    conn: ConnId,
    stream: StreamId,
    recv: quinn::RecvStream,
    gate: watch::Receiver<ReadGate>,
    tx: mpsc::UnboundedSender<Input>,
    _end: Arc<StreamEnd>,
) {
    // Paused while a publish window is full: QUIC flow control holds the client.
    crate::read_gated(recv, gate, |event| match event {
        ReadEvent::Chunks(data) => tx.send(Input::Data { conn, stream, data, fin: false }).is_ok(),
        ReadEvent::Finished => tx.send(Input::Data { conn, stream, data: Vec::new(), fin: true }).is_ok(),
        ReadEvent::Reset => tx.send(Input::Reset { conn, stream }).is_ok(),
        ReadEvent::Failed => false,
    })
    .await
}

pub(super) async fn writer(
    conn: ConnId,
    stream: StreamId,
    mut send: quinn::SendStream,
    mut rx: crate::queue::Receiver<WriterCmd>,
    tx: mpsc::UnboundedSender<Input>,
    report: bool,
    _end: Option<Arc<StreamEnd>>,
) {
    let mut chunks: Vec<Bytes> = Vec::new();
    while let Some(cmd) = rx.recv().await {
        let mut finish = matches!(cmd, WriterCmd::Finish);
        if let WriterCmd::Data(b) = cmd {
            chunks.push(b);
        }
        // Batch everything already queued into one write.
        while !finish {
            match rx.try_recv() {
                Some(WriterCmd::Data(b)) => chunks.push(b),
                Some(WriterCmd::Finish) => finish = true,
                None => break,
            }
        }
        let n: usize = chunks.iter().map(Bytes::len).sum();
        if n > 0 {
            if let Err(e) = send.write_all_chunks(&mut chunks).await {
                if matches!(e, quinn::WriteError::Stopped(_)) {
                    let _ = tx.send(Input::Stopped { conn, stream });
                }
                return;
            }
            chunks.clear();
            if report {
                let _ = tx.send(Input::Flushed { conn, stream, bytes: n });
            }
        }
        if finish {
            let _ = send.finish();
            return;
        }
    }
}
