//! Consumer groups from the client: poll, ack, nack, extend, dead letters, seek, describe.
//!
//! Long polls go on a control stream of their own (opened on first use), so a poll waiting at
//! the broker holds up no ack or publish.

use crate::client::{Client, ClientError};
use felix_proto::client::Reply;
use felix_proto::message::{self, GroupRecord, Message, StartPosition};
use std::time::Duration;

/// One consumer group on one shard of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTarget {
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// Group name.
    pub group: String,
}

impl GroupTarget {
    /// Group `group` on shard 0 of `namespace/stream`.
    pub fn new(namespace: impl Into<String>, stream: impl Into<String>, group: impl Into<String>) -> GroupTarget {
        GroupTarget { namespace: namespace.into(), stream: stream.into(), shard: 0, group: group.into() }
    }

    fn offset(&self, tenant: String, offset: u64, request_id: u64) -> message::GroupOffset {
        message::GroupOffset {
            tenant_id: tenant,
            namespace: self.namespace.clone(),
            stream: self.stream.clone(),
            shard: self.shard,
            group: self.group.clone(),
            offset,
            request_id,
        }
    }

    fn whole(&self, tenant: String, request_id: u64) -> message::GroupRef {
        message::GroupRef {
            tenant_id: tenant,
            namespace: self.namespace.clone(),
            stream: self.stream.clone(),
            shard: self.shard,
            group: self.group.clone(),
            request_id,
        }
    }
}

/// Options of a poll.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PollOptions {
    /// Wait up to this long for records (the broker caps it); zero answers at once.
    pub wait: Duration,
    /// This member's name (claims are recorded as its own; FEATURE_GROUP_CONSUMER).
    pub consumer: Option<String>,
    /// Take back this member's claims from older connections first.
    pub reclaim: bool,
    /// Claim duration (zero: the broker's default).
    pub visibility: Duration,
}

/// What `group_describe` says.
pub type GroupInfo = message::GroupInfo;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn unexpected(r: &Reply) -> ClientError {
    ClientError::Closed(format!("unexpected answer {r:?}"))
}

impl Client {
    /// Sends a group request; the core checks what it (and its optional fields) needs the
    /// broker to have advertised, and puts a long poll on a stream of its own.
    async fn group_request(
        &self,
        build: impl FnOnce(String, u64) -> Message + Send + 'static,
    ) -> Result<Reply, ClientError> {
        self.request(build).await
    }

    async fn group_ok(&self, build: impl FnOnce(String, u64) -> Message + Send + 'static) -> Result<(), ClientError> {
        match self.group_request(build).await? {
            Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Claims up to `max_records` records of the group: records owed again first, then new
    /// ones, lowest offset first. Empty means nothing was available (within `opts.wait`).
    ///
    /// # Errors
    /// The broker's refusal; [`ClientError::Unsupported`] against a broker without groups.
    pub async fn group_poll(
        &self,
        g: &GroupTarget,
        max_records: u32,
        opts: PollOptions,
    ) -> Result<Vec<GroupRecord>, ClientError> {
        let g = g.clone();
        let m = self
            .group_request(move |tenant_id, request_id| {
                Message::GroupPoll(message::GroupPoll {
                    tenant_id,
                    namespace: g.namespace,
                    stream: g.stream,
                    shard: g.shard,
                    group: g.group,
                    max_records,
                    wait_ms: millis(opts.wait),
                    request_id,
                    consumer: opts.consumer,
                    reclaim: opts.reclaim.then_some(true),
                    visibility_ms: (!opts.visibility.is_zero()).then(|| millis(opts.visibility)),
                })
            })
            .await?;
        match m {
            Reply::GroupRecords(records) => Ok(records),
            other => Err(unexpected(&other)),
        }
    }

    /// Finishes a record (answered once durable).
    ///
    /// # Errors
    /// `stale_claim` for a record not handed out since the group's state was rebuilt.
    pub async fn group_ack(&self, g: &GroupTarget, offset: u64) -> Result<(), ClientError> {
        let g = g.clone();
        self.group_ok(move |t, id| Message::GroupAck(g.offset(t, offset, id))).await
    }

    /// Hands a record back: owed again at once, or after `delay`. With `attempts` (the value
    /// it was delivered with), a nack whose claim no longer stands is refused.
    ///
    /// # Errors
    /// `stale_claim` when `attempts` names a delivery that is over.
    pub async fn group_nack(
        &self,
        g: &GroupTarget,
        offset: u64,
        delay: Option<Duration>,
        attempts: Option<u32>,
    ) -> Result<(), ClientError> {
        let g = g.clone();
        self.group_ok(move |tenant_id, request_id| {
            Message::GroupNack(message::GroupNack {
                tenant_id,
                namespace: g.namespace,
                stream: g.stream,
                shard: g.shard,
                group: g.group,
                offset,
                request_id,
                delay_ms: delay.map(millis),
                attempts,
            })
        })
        .await
    }

    /// Keeps a claim for `extend` from now; returns the granted extension.
    ///
    /// # Errors
    /// `stale_claim` when that delivery's claim no longer stands.
    pub async fn group_extend(
        &self,
        g: &GroupTarget,
        offset: u64,
        attempts: u32,
        extend: Duration,
    ) -> Result<Duration, ClientError> {
        let g = g.clone();
        let m = self
            .group_request(move |tenant_id, request_id| {
                Message::GroupExtend(message::GroupExtend {
                    tenant_id,
                    namespace: g.namespace,
                    stream: g.stream,
                    shard: g.shard,
                    group: g.group,
                    offset,
                    attempts,
                    extend_ms: millis(extend),
                    request_id,
                })
            })
            .await?;
        match m {
            Reply::GroupExtended(ms) => Ok(Duration::from_millis(ms)),
            other => Err(unexpected(&other)),
        }
    }

    /// Gives up on a record: listed as a dead letter, then finished.
    ///
    /// # Errors
    /// `invalid_request` for a record already finished.
    pub async fn group_dead_letter(&self, g: &GroupTarget, offset: u64) -> Result<(), ClientError> {
        let g = g.clone();
        self.group_ok(move |t, id| Message::GroupDeadLetter(g.offset(t, offset, id))).await
    }

    /// The offsets the group gave up on, lowest first.
    ///
    /// # Errors
    /// The broker's refusal.
    pub async fn group_dead_letters(&self, g: &GroupTarget) -> Result<Vec<u64>, ClientError> {
        let g = g.clone();
        match self.group_request(move |t, id| Message::GroupDeadLetters(g.whole(t, id))).await? {
            Reply::GroupDeadLetters(offsets) => Ok(offsets),
            other => Err(unexpected(&other)),
        }
    }

    /// The consumer groups of one shard, by name (FEATURE_LISTING).
    ///
    /// # Errors
    /// `not_found` for a stream that does not exist; [`ClientError::Unsupported`] against a
    /// broker without the feature.
    pub async fn group_list(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Result<Vec<message::GroupSummary>, ClientError> {
        let (namespace, stream) = (namespace.to_owned(), stream.to_owned());
        let build = move |tenant_id, request_id| {
            Message::GroupList(message::GroupList { tenant_id, namespace, stream, shard, request_id })
        };
        match self.group_request(build).await? {
            Reply::GroupList(groups) => Ok(groups),
            other => Err(unexpected(&other)),
        }
    }

    /// Drops a dead letter from the list (the record stays in the log).
    ///
    /// # Errors
    /// `invalid_request` when the offset is not a dead letter.
    pub async fn group_discard(&self, g: &GroupTarget, offset: u64) -> Result<(), ClientError> {
        let g = g.clone();
        self.group_ok(move |t, id| Message::GroupDiscard(g.offset(t, offset, id))).await
    }

    /// Makes a dead letter owed again, its attempt count reset.
    ///
    /// # Errors
    /// `invalid_request` when the offset is not a dead letter.
    pub async fn group_redrive(&self, g: &GroupTarget, offset: u64) -> Result<(), ClientError> {
        let g = g.clone();
        self.group_ok(move |t, id| Message::GroupRedrive(g.offset(t, offset, id))).await
    }

    /// Moves the group's position; with `if_new` only a group that never started moves.
    /// Returns the position and whether it moved.
    ///
    /// # Errors
    /// `invalid_request` for an offset outside the retained range.
    pub async fn group_seek(
        &self,
        g: &GroupTarget,
        start: StartPosition,
        if_new: bool,
    ) -> Result<(u64, bool), ClientError> {
        let g = g.clone();
        let m = self
            .group_request(move |tenant_id, request_id| {
                Message::GroupSeek(message::GroupSeek {
                    tenant_id,
                    namespace: g.namespace,
                    stream: g.stream,
                    shard: g.shard,
                    group: g.group,
                    start,
                    if_new,
                    request_id,
                })
            })
            .await?;
        match m {
            Reply::GroupPosition { offset, moved } => Ok((offset, moved)),
            other => Err(unexpected(&other)),
        }
    }

    /// The group's position, the shard's tail, and what is in flight, owed and dead.
    ///
    /// # Errors
    /// The broker's refusal.
    pub async fn group_describe(&self, g: &GroupTarget) -> Result<GroupInfo, ClientError> {
        let g = g.clone();
        match self.group_request(move |t, id| Message::GroupDescribe(g.whole(t, id))).await? {
            Reply::GroupInfo(i) => Ok(i),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes the group (position, dead letters, claims); returns whether it existed.
    ///
    /// # Errors
    /// The broker's refusal.
    pub async fn group_delete(&self, g: &GroupTarget) -> Result<bool, ClientError> {
        let g = g.clone();
        match self.group_request(move |t, id| Message::GroupDelete(g.whole(t, id))).await? {
            Reply::GroupDeleted(existed) => Ok(existed),
            other => Err(unexpected(&other)),
        }
    }
}
