//! Reading history without subscribing: `stream_read` pages and `offset_for_time`.
//!
//! A page below what a shard holds in memory is read from storage first (a
//! [`StorageOutput::Read`]), then filled on from memory. Answers on the request's stream stay in
//! request order while the read is out: later answers are held behind it, because `error` and
//! `subscribe_cursor_error` carry no request id and are matched by order.

use super::log::Page;
use super::requests::Missing;
use super::{
    Broker, BrokerOutput, CtlStream, HeldFor, Key, PageRead, ReadFor, ReadRequest, Refusal, StorageOutput, json_frame,
    key,
};
use crate::broker::auth::Action;
use crate::error_code::ErrorCode;
use crate::message::{self, B64, CursorErrorReason, Message};
use crate::storage::StoredBatch;
use crate::transport::{ConnId, ReadToken};

/// Why a request for a durable shard cannot be served: a refusal, or a ready-made answer
/// (`not_leader`).
pub(super) enum Denied {
    Refused(Refusal),
    Answer(Box<Message>),
}

impl Broker {
    /// The checks every request for one durable shard makes (history reads, consumer groups):
    /// permission for `action`, the shard, leadership, durability. `needs` says, for the
    /// refusal, what the log is needed for.
    #[allow(clippy::too_many_arguments)] // the request's address
    pub(super) fn durable_shard(
        &mut self,
        st: &CtlStream,
        t: &str,
        ns: &str,
        s: &str,
        shard: u32,
        action: Action,
        missing: Missing,
        needs: &str,
    ) -> Result<Key, Denied> {
        let shards = self.lookup_stream(st, t, ns, s, action, missing).map_err(Denied::Refused)?;
        if shard >= shards {
            let r = Refusal::new(ErrorCode::InvalidRequest, format!("stream has no shard {shard} (it has {shards})"));
            return Err(Denied::Refused(r));
        }
        let k = key(t, ns, s);
        let entry =
            self.node.streams.get(&k).ok_or_else(|| Denied::Refused(Refusal::new(ErrorCode::NotFound, "gone")))?;
        if let Some(m) = entry.shards[shard as usize].serving.away() {
            return Err(Denied::Answer(Box::new(Self::not_leader_answer(
                self.server_features,
                &Self::features_of(st),
                m,
                shard,
            ))));
        }
        if !entry.config.durable {
            let r = Refusal::new(
                ErrorCode::InvalidRequest,
                format!("stream {ns}/{s} is in memory only: it keeps no log, and {needs} needs one"),
            );
            return Err(Denied::Refused(r));
        }
        Ok(k)
    }

    /// Whether this broker keeps a replica of the shard `r` reads (any role).
    fn holds_copy(&self, r: &message::StreamRead) -> bool {
        let k = key(&r.tenant_id, &r.namespace, &r.stream);
        self.node.streams.get(&k).and_then(|e| e.shards.get(r.shard as usize)).is_some_and(|s| s.serving.is_replica())
    }

    pub(super) fn deny(&mut self, conn: ConnId, st: &mut CtlStream, d: Denied) {
        match d {
            Denied::Refused(r) => self.refuse(conn, st, r),
            Denied::Answer(m) => self.send(conn, st, json_frame(&m)),
        }
    }

    pub(super) fn offset_for_time(&mut self, conn: ConnId, st: &mut CtlStream, q: message::OffsetForTime) {
        let k = match self.durable_shard(
            st,
            &q.tenant_id,
            &q.namespace,
            &q.stream,
            q.shard,
            Action::Subscribe,
            Missing::NotFound,
            "reading history",
        ) {
            Ok(k) => k,
            Err(d) => return self.deny(conn, st, d),
        };
        let offset = self.node.streams[&k].shards[q.shard as usize].log.offset_for_time(q.at_micros);
        let m = Message::OffsetValue(message::OffsetValue { offset, request_id: q.request_id });
        self.send(conn, st, json_frame(&m));
    }

    pub(super) fn stream_read(&mut self, conn: ConnId, st: &mut CtlStream, r: message::StreamRead) {
        let k = match self.durable_shard(
            st,
            &r.tenant_id,
            &r.namespace,
            &r.stream,
            r.shard,
            Action::Subscribe,
            Missing::NotFound,
            "reading history",
        ) {
            Ok(k) => k,
            // D51: a replica's own copy, asked for by an operator checking that copies agree
            // (a follower answers from what it applied; the leader as always).
            Err(Denied::Answer(_)) if r.replica_local == Some(true) && self.holds_copy(&r) => {
                key(&r.tenant_id, &r.namespace, &r.stream)
            }
            Err(d) => return self.deny(conn, st, d),
        };
        let (cap_records, cap_bytes) = (self.cfg.max_records_per_read.max(1), self.cfg.max_read_bytes.max(1));
        let log = &self.node.streams[&k].shards[r.shard as usize].log;
        let (start, tail, memory_start) = (log.start(), log.committed_tail(), log.memory_start());
        let cursor_error = |reason, available| {
            Message::SubscribeCursorError(message::SubscribeCursorError { reason, requested: r.from, available })
        };
        if r.from < start {
            return self.send(conn, st, json_frame(&cursor_error(CursorErrorReason::TooOld, start)));
        }
        if r.from > tail {
            return self.send(conn, st, json_frame(&cursor_error(CursorErrorReason::InFuture, tail)));
        }
        let end = r.end.unwrap_or(tail).min(tail);
        let max_records = r.max_records.filter(|n| *n > 0).map_or(cap_records, |n| n.min(cap_records));
        let max_bytes = r.max_bytes.filter(|n| *n > 0).map_or(cap_bytes, |n| n.min(cap_bytes));
        let mut page = Page::new(r.from, max_records as usize, max_bytes);
        if r.from < end && r.from < memory_start {
            let token = self.ids.read();
            self.out.push_back(BrokerOutput::Storage(StorageOutput::Read(ReadRequest {
                token,
                tenant_id: k.tenant().to_owned(),
                namespace: k.namespace().to_owned(),
                stream: k.name().to_owned(),
                shard: r.shard,
                from: r.from,
                end: memory_start.min(end),
                max_bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX),
            })));
            let read = PageRead { conn, stream: st.id, request_id: r.request_id, key: k, shard: r.shard, end, page };
            self.node.reads.insert(token, ReadFor::Page(read));
            Self::hold(st, HeldFor::Read(token));
            return;
        }
        if r.from < end {
            log.read_page(end, &mut page);
        }
        let m = records_message(page, r.request_id);
        self.send(conn, st, json_frame(&m));
    }

    /// Storage answered the read of a `stream_read` page: fill the rest from memory and answer.
    pub(super) fn page_read_complete(&mut self, token: ReadToken, p: PageRead, batches: Vec<StoredBatch>) {
        let PageRead { conn, stream, request_id, key, shard, end, mut page } = p;
        let from = page.next;
        for b in &batches {
            let batch_end = b.base_offset + b.count();
            if !page.take_batch(
                b.base_offset,
                batch_end,
                b.generation_start,
                &b.records,
                b.publisher.as_ref(),
                b.timestamp_micros,
                end,
            ) {
                break;
            }
        }
        if let Some(log) = self.node.streams.get(&key).and_then(|e| e.shards.get(shard as usize)).map(|s| &s.log) {
            let memory_start = log.memory_start();
            if page.next == from && page.records.is_empty() && page.next < memory_start {
                // Storage had nothing there (retention removed it meanwhile, or it is
                // unreadable): step over it rather than answer the same empty page forever.
                page.next = memory_start.min(end);
            }
            if !page.is_full() && page.next >= memory_start && page.next < end {
                log.read_page(end, &mut page);
            }
        }
        let data = json_frame(&records_message(page, request_id));
        self.fill_held(conn, stream, HeldFor::Read(token), data);
    }
}

fn records_message(page: Page, request_id: u64) -> Message {
    let records = page
        .records
        .into_iter()
        .map(|r| message::StreamRecord {
            offset: r.offset,
            payload: B64(r.payload),
            publisher: r.publisher.map(|p| String::from_utf8_lossy(&p).into_owned()),
            timestamp_micros: r.timestamp_micros,
        })
        .collect();
    Message::StreamRecords(message::StreamRecords { records, next_offset: page.next, request_id })
}
