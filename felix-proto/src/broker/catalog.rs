//! What streams a tenant has, and one shard's description (D51, `FEATURE_STREAM_INFO`): what a
//! new user looks for first (`nats stream ls/info`, `kafka-topics --list/--describe`).
//!
//! `stream_list` answers from what this broker knows: its own streams, those its configuration
//! declares, and in a cluster every stream of the metadata registry, so any broker lists the
//! whole cluster's. `stream_info` describes one shard and is answered by the broker that
//! serves it (`not_leader` elsewhere, as `group_describe` is): offsets, retained records and
//! bytes, subscribers and groups live there. Neither creates anything.

use super::requests::Missing;
use super::{Broker, CtlStream, KeyRef, Refusal, json_frame, syslog};
use crate::broker::auth::Action;
use crate::error_code::ErrorCode;
use crate::message::{self, Message};
use crate::shard::Kind;
use crate::transport::ConnId;
use std::collections::BTreeMap;

/// Entries a `stream_list` page holds when the request names no limit, and at most.
const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

impl Broker {
    /// `stream_list`: the streams of the tenant this token may publish to or read, in
    /// `namespace/stream` order, a page at a time.
    pub(super) fn stream_list(&mut self, conn: ConnId, st: &mut CtlStream, q: message::StreamList) {
        let t = q.tenant_id.as_str();
        if let Some(sess) = st.session.as_ref()
            && sess.tenant_id != t
        {
            let r = Refusal::new(ErrorCode::Forbidden, format!("token is not valid for tenant {t}"));
            return self.refuse(conn, st, r);
        }
        let mut all: BTreeMap<(String, String), u32> = BTreeMap::new();
        for (k, e) in &self.node.streams {
            if k.tenant() == t && !syslog::is_sys(k) {
                all.insert((k.namespace().to_owned(), k.name().to_owned()), e.shards.len() as u32);
            }
        }
        for spec in self.cfg.streams.iter().filter(|s| s.tenant_id == t) {
            all.entry((spec.namespace.clone(), spec.name.clone())).or_insert(spec.config.shards.max(1));
        }
        if let Some(view) = &self.membership.view {
            for id in view.owners.keys().filter(|id| id.kind == Kind::Stream && id.tenant == t) {
                let n = all.entry((id.namespace.clone(), id.name.clone())).or_insert(0);
                *n = (*n).max(id.shard + 1);
            }
        }
        let limit = q.limit.filter(|n| *n > 0).unwrap_or(DEFAULT_PAGE).min(MAX_PAGE) as usize;
        let after = q.after.as_deref().and_then(|a| a.split_once('/'));
        let mut streams = Vec::new();
        let mut next = None;
        for ((ns, name), shards) in all {
            if q.namespace.as_deref().is_some_and(|want| want != ns) || name.starts_with(syslog::SYS_PREFIX) {
                continue;
            }
            if after.is_some_and(|(a_ns, a_name)| (ns.as_str(), name.as_str()) <= (a_ns, a_name)) {
                continue;
            }
            let may = |action| self.authorize(st, t, &ns, &name, action).is_ok();
            if !may(Action::Publish) && !may(Action::Subscribe) {
                continue;
            }
            if streams.len() == limit {
                next = streams.last().map(|e: &message::StreamEntry| format!("{}/{}", e.namespace, e.stream));
                break;
            }
            streams.push(message::StreamEntry { namespace: ns, stream: name, shards });
        }
        let m = Message::StreamListView(message::StreamListView { streams, next, request_id: q.request_id });
        self.send(conn, st, json_frame(&m));
    }

    /// `stream_info`: the stream's configuration and one shard's state, from the broker that
    /// serves the shard.
    pub(super) fn stream_info(&mut self, conn: ConnId, st: &mut CtlStream, q: message::StreamInfo) {
        let (t, ns, s) = (&q.tenant_id, &q.namespace, &q.stream);
        // Publishers and readers alike may ask, as for `stream_shards`.
        let action =
            if self.authorize(st, t, ns, s, Action::Publish).is_ok() { Action::Publish } else { Action::Subscribe };
        let shards = match self.lookup_stream(st, t, ns, s, action, Missing::NotFound) {
            Ok(n) => n,
            Err(r) => return self.refuse(conn, st, r),
        };
        if q.shard >= shards {
            let r =
                Refusal::new(ErrorCode::InvalidRequest, format!("stream has no shard {} (it has {shards})", q.shard));
            return self.refuse(conn, st, r);
        }
        let Some(entry) = self.node.streams.get(KeyRef(t, ns, s).q()) else {
            return self.refuse(conn, st, Refusal::new(ErrorCode::NotFound, "gone"));
        };
        let shard = &entry.shards[q.shard as usize];
        if let Some(m) = shard.serving.away() {
            let answer = Self::not_leader_answer(self.server_features, &Self::features_of(st), m, q.shard);
            return self.send(conn, st, json_frame(&answer));
        }
        let key = (super::key(t, ns, s), q.shard);
        let groups = self.node.groups.get(&key).map_or(0, |g| g.values().filter(|g| g.exists()).count() as u64);
        let (c, log) = (&entry.config, &shard.log);
        let m = Message::StreamInfoView(message::StreamInfoView {
            shards,
            shard: q.shard,
            durable: c.durable,
            replication: c.replication.max(1),
            retention_records: c.retention.max_records,
            retention_bytes: c.retention.max_bytes,
            retention_secs: c.retention.max_age.map(|d| d.as_secs()),
            start: log.start(),
            next_offset: log.committed_tail(),
            records: log.retained_records(),
            bytes: log.retained_bytes(),
            subscribers: shard.subs.len() as u64,
            groups,
            request_id: q.request_id,
        });
        self.send(conn, st, json_frame(&m));
    }
}
