//! Subscribers that follow their shard through the world's moves, fail-overs and crashes: one
//! per shard of the durable stream, each a real [`ClientConnection`] (so the client's own
//! resume rule is what is judged), some of them legacy (no FEATURE_SHARD_MOVED, no redirect:
//! their stream simply ends, and they find the shard again by asking any broker).
//!
//! A follower subscribes from the start of its shard, and whenever its subscription ends
//! (`shard_moved`, a finished stream, a lost connection, a retryable refusal) it subscribes
//! again where [`SubscriptionCursor::resume`] says (max(last delivered + 1, `resume_from`)), at
//! the broker a move or a redirect named when there was one, else at any broker. Checked:
//! * **exactly once, in order**: every record it is given is the one committed at that offset
//!   (the world's history), offsets only go up, and an offset passed over is a generation
//!   start or a record retention had dropped (the serving broker's log starts above it, or a
//!   `too_old` refusal said so): never a committed record lost in a hand-over;
//! * **only retryable refusals**: a subscribe is refused only with a code that says to retry
//!   (`not_leader`, `shard_unavailable`), or, for a client that offered no codes, a message;
//! * **answered**: a subscribe is answered before the client's request timeout;
//! * **caught up** once healed: every follower is subscribed on its shard's owner and has
//!   everything that owner committed (checked by [`World::followers_caught_up`]).

use super::{NS, ORDERS, TENANT, TOKEN, World, shard_id};
use crate::ErrorCode;
use crate::broker::PeerAddr;
use crate::client::{
    ClientConfig, ClientConnection, ClientEvent, ClientOutput, EndReason, SubscribeRequest, SubscriptionCursor,
};
use crate::cluster::sim::{Rng, Violation};
use crate::error_code::RetryClass;
use crate::features::Features;
use crate::message::{CursorErrorReason, StartPosition};
use crate::transport::{ConnId, Dir, Side, StreamId};
use bytes::Bytes;
use std::time::{Duration, Instant};

/// A follower's subscribe unanswered for this long is a violation (the client gives up then).
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(13);

/// One follower of one shard.
pub(super) struct Follower {
    /// The durable stream's shard it follows.
    pub(super) shard: u32,
    /// Offered neither FEATURE_SHARD_MOVED nor redirects (nor error codes).
    legacy: bool,
    cursor: SubscriptionCursor,
    /// Every offset below this was delivered once, in order, or is accounted for.
    next: u64,
    /// A `too_old` refusal said retention dropped everything below this.
    dropped_below: u64,
    state: Follow,
    /// Batches given since the last check: base offset, payloads, the serving broker's first
    /// retained offset then.
    given: Vec<(u64, Vec<Bytes>, u64)>,
}

/// Where a follower is in its lifecycle.
enum Follow {
    /// Not subscribed: subscribe at `at` from `from`, asking `to` first when a move or a
    /// redirect named a broker.
    Waiting { at: Instant, to: Option<String>, from: StartPosition },
    /// On a connection to `node`: its subscribe (from `from`) sent, answered (`live`) or not
    /// yet.
    On {
        node: String,
        conn: ConnId,
        client: Box<ClientConnection>,
        sub: u64,
        from: StartPosition,
        next_bi: u64,
        live: bool,
    },
}

impl Follower {
    pub(super) fn new(shard: u32, legacy: bool, at: Instant) -> Follower {
        Follower {
            shard,
            legacy,
            cursor: SubscriptionCursor::new(),
            next: 0,
            dropped_below: 0,
            state: Follow::Waiting { at, to: None, from: StartPosition::Offset(0) },
            given: Vec::new(),
        }
    }

    /// The broker and connection it is on, if any.
    pub(super) fn on(&self) -> Option<(&str, ConnId)> {
        match &self.state {
            Follow::On { node, conn, .. } => Some((node, *conn)),
            Follow::Waiting { .. } => None,
        }
    }

    fn config(&self) -> ClientConfig {
        let mut cfg = ClientConfig::new(TENANT, TOKEN);
        cfg.request_timeout = SUBSCRIBE_TIMEOUT;
        if self.legacy {
            cfg.features = cfg.features.difference(Features::SHARD_MOVED | Features::REDIRECT | Features::ERROR_CODES);
        }
        cfg
    }
}

/// How long a follower waits before subscribing again: 1 to 4 ticks.
fn backoff(rng: &mut Rng) -> Duration {
    super::TICK * (1 + rng.below(4)) as u32
}

impl World {
    /// Whether `conn` on `name` is a follower's.
    pub(super) fn is_follower(&self, name: &str, conn: ConnId) -> bool {
        self.followers.iter().any(|f| f.on() == Some((name, conn)))
    }

    /// Bytes `name` wrote on a follower's connection; whether it was one.
    pub(super) fn give_follower(&mut self, name: &str, conn: ConnId, stream: StreamId, data: Bytes, fin: bool) -> bool {
        let now = self.now;
        let Some(f) = self.followers.iter_mut().find(|f| f.on() == Some((name, conn))) else { return false };
        if let Follow::On { client, .. } = &mut f.state {
            let n = data.len();
            client.handle_stream_data(stream, data, fin, now);
            if n > 0
                && let Some(node) = self.nodes.get_mut(name)
            {
                node.broker.handle_stream_flushed(conn, stream, n, now);
            }
        }
        true
    }

    /// A follower's connection was closed by its broker, or the broker crashed.
    pub(super) fn follower_lost(&mut self, name: &str, conn: Option<ConnId>, why: &str) {
        let now = self.now;
        for f in &mut self.followers {
            if let Follow::On { node, conn: c, client, .. } = &mut f.state
                && node == name
                && conn.is_none_or(|x| x == *c)
            {
                client.handle_connection_lost(why, now);
            }
        }
    }

    /// Moves bytes between followers and brokers, starts due subscribes and reads every
    /// follower's events; whether anything happened.
    pub(super) fn pump_followers(&mut self, rng: &mut Rng) -> Result<bool, Violation> {
        let mut any = false;
        for i in 0..self.followers.len() {
            any |= self.start_follower(i, rng);
            any |= self.follower_outputs(i);
            any |= self.follower_events(i, rng)?;
        }
        Ok(any)
    }

    /// A waiting follower whose pause is over connects and subscribes.
    fn start_follower(&mut self, i: usize, rng: &mut Rng) -> bool {
        let now = self.now;
        let Follow::Waiting { at, to, from } = &self.followers[i].state else { return false };
        if *at > now {
            return false;
        }
        let (to, from) = (to.clone(), *from);
        let live: Vec<String> = self.nodes.keys().cloned().collect();
        let Some(node) = to
            .filter(|t| self.nodes.contains_key(t))
            .or_else(|| (!live.is_empty()).then(|| live[rng.below(live.len() as u64) as usize].clone()))
        else {
            self.followers[i].state = Follow::Waiting { at: now + backoff(rng), to: None, from };
            return false;
        };
        let mut addr = [0u8; 16];
        addr[..8].copy_from_slice(&rng.next().to_be_bytes());
        let Some(conn) = self.nodes.get_mut(&node).and_then(|n| n.broker.admit(PeerAddr(addr), now).ok()) else {
            self.followers[i].state = Follow::Waiting { at: now + backoff(rng), to: None, from };
            return false;
        };
        let f = &mut self.followers[i];
        let mut client = Box::new(ClientConnection::new(f.config(), now));
        let req = SubscribeRequest {
            namespace: NS.into(),
            stream: ORDERS.into(),
            start: Some(from),
            shard: Some(f.shard),
            queue_capacity: None,
            filter: None,
        };
        match client.subscribe_dedicated(req, now) {
            Ok(sub) => f.state = Follow::On { node, conn, client, sub, from, next_bi: 0, live: false },
            Err(_) => f.state = Follow::Waiting { at: now + backoff(rng), to: None, from },
        }
        true
    }

    /// What a follower's client asks the driver for, carried out against its broker.
    fn follower_outputs(&mut self, i: usize) -> bool {
        let now = self.now;
        let mut any = false;
        loop {
            let Follow::On { node, conn, client, next_bi, .. } = &mut self.followers[i].state else { return any };
            let Some(o) = client.poll_output() else { return any };
            any = true;
            let (node, conn) = (node.clone(), *conn);
            let broker = self.nodes.get_mut(&node).map(|n| &mut n.broker);
            match o {
                ClientOutput::OpenBi { token } => {
                    let s = StreamId::new(Side::Client, Dir::Bi, *next_bi);
                    *next_bi += 1;
                    client.handle_stream_opened(token, s, now);
                }
                ClientOutput::Transmit { stream, data } => {
                    if let Some(b) = broker {
                        b.handle_stream_data(conn, stream, data, false, now);
                    }
                }
                ClientOutput::Finish { stream } => {
                    if let Some(b) = broker {
                        b.handle_stream_data(conn, stream, Bytes::new(), true, now);
                    }
                }
                ClientOutput::StopSending { stream, .. } => {
                    if let Some(b) = broker {
                        b.handle_stream_stopped(conn, stream, now);
                    }
                }
                // Events are taken as they come (handle_consumed), so reading never pauses.
                ClientOutput::PauseReading { .. } | ClientOutput::ResumeReading { .. } => {}
            }
        }
    }

    /// Reads a follower's events: deliveries are kept for [`check_followers`](Self::check_followers),
    /// an end or a refusal closes the connection and schedules the next subscribe.
    fn follower_events(&mut self, i: usize, rng: &mut Rng) -> Result<bool, Violation> {
        let now = self.now;
        let (seed, step) = (self.seed, self.report.requests);
        let bad = |what: String| Violation { seed, step, what };
        let mut any = false;
        loop {
            let f = &mut self.followers[i];
            let Follow::On { node, conn, client, sub, live, from, .. } = &mut f.state else { return Ok(any) };
            let Some(e) = client.poll_event() else { return Ok(any) };
            any = true;
            let (node, conn, sub, asked) = (node.clone(), *conn, *sub, *from);
            // Where to go next when this event ends the subscription.
            let mut then: Option<(Option<String>, StartPosition)> = None;
            match e {
                ClientEvent::Subscribed { start_offset, .. } => {
                    *live = true;
                    f.cursor.subscribed(start_offset);
                }
                ClientEvent::Events { sub: s, batch } if s == sub => {
                    f.cursor.delivered(&batch);
                    let bytes = batch.records.payload_bytes();
                    client.handle_consumed(sub, bytes, now);
                    let Some(base) = batch.base_offset else {
                        return Err(bad(format!("follower of shard {} got a batch with no offset", f.shard)));
                    };
                    let start = self
                        .nodes
                        .get(&node)
                        .and_then(|n| n.broker.shard_state(TENANT, NS, ORDERS, f.shard))
                        .map_or(0, |s| s.0);
                    f.given.push((base, batch.records.iter().map(|r| r.payload.clone()).collect(), start));
                }
                ClientEvent::SubscribeFailed { error, cursor, redirect, .. } => {
                    let retryable = match (&error.code, error.retry) {
                        (_, Some(RetryClass::OutcomeUnknown)) => {
                            return Err(bad(format!(
                                "{node} did not answer a follower's subscribe to shard {}: {}",
                                f.shard, error.message
                            )));
                        }
                        (Some(ErrorCode::NotLeader | ErrorCode::ShardUnavailable), _) => true,
                        (None, _) => f.legacy && !error.message.is_empty(),
                        _ => false,
                    };
                    match cursor {
                        Some(c) if c.reason == CursorErrorReason::TooOld => {
                            // Retention dropped what it asked for: it goes on from the first
                            // record kept (what was dropped is not a loss).
                            f.dropped_below = f.dropped_below.max(c.available);
                            then = Some((Some(node.clone()), StartPosition::Offset(c.available)));
                        }
                        Some(c) => {
                            return Err(bad(format!(
                                "{node} refused a follower of shard {} at {}: {:?} (it holds up to {}), \
                                 so a record it was given is not there",
                                f.shard, c.requested, c.reason, c.available
                            )));
                        }
                        None if retryable => {
                            let to = redirect.map(|r| r.node_id).or_else(|| {
                                // Asked again where it was while its shard is being handed over.
                                (error.code == Some(ErrorCode::ShardUnavailable)).then(|| node.clone())
                            });
                            // Refused, so nothing was given: the same start again.
                            then = Some((to, asked));
                        }
                        None => {
                            return Err(bad(format!(
                                "{node} refused a follower of shard {} with {:?}: {}",
                                f.shard, error.code, error.message
                            )));
                        }
                    }
                }
                ClientEvent::SubscriptionEnded { sub: s, reason } if s == sub => {
                    let Some(from) = f.cursor.resume(&reason) else {
                        return Err(bad(format!(
                            "a follower of shard {} on {node} cannot resume after {reason:?}",
                            f.shard
                        )));
                    };
                    let to = match &reason {
                        EndReason::Moved(m) => {
                            self.report.follows += 1;
                            m.node_id.clone()
                        }
                        _ => None,
                    };
                    then = Some((to, from));
                }
                ClientEvent::ProtocolError { reason } => {
                    return Err(bad(format!("{node} sent a follower what it cannot read: {reason}")));
                }
                ClientEvent::AuthFailed { error, .. } => {
                    return Err(bad(format!("{node} refused a follower's auth: {}", error.message)));
                }
                _ => {}
            }
            if let Some((to, from)) = then {
                let f = &mut self.followers[i];
                f.state = Follow::Waiting { at: now + backoff(rng), to, from };
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.broker.connection_closed(conn, now);
                }
            }
        }
    }

    /// Gives followers' clients the time (their request timeouts).
    pub(super) fn tick_followers(&mut self) {
        let now = self.now;
        for f in &mut self.followers {
            if let Follow::On { client, .. } = &mut f.state {
                client.handle_timeout(now);
            }
        }
    }

    /// Checks what followers were given since the last check against the history every broker
    /// committed: each record the one at its offset, once, in order; nothing committed and
    /// retained passed over.
    pub(super) fn check_followers(&mut self) -> Result<(), Violation> {
        for i in 0..self.followers.len() {
            let given = std::mem::take(&mut self.followers[i].given);
            let (shard, dropped_below) = (self.followers[i].shard, self.followers[i].dropped_below);
            let id = shard_id(ORDERS, shard);
            let mut next = self.followers[i].next;
            for (base, payloads, start) in given {
                if base < next {
                    return Err(self.violation(format!(
                        "a follower of shard {shard} was given offset {base} again (it had everything below {next})"
                    )));
                }
                for o in next..base {
                    match self.history.get(&(id.clone(), o)) {
                        // A generation start holds no record.
                        Some(p) if p.is_empty() => {}
                        _ if o < start.max(dropped_below) => {} // retention dropped it
                        held => {
                            return Err(self.violation(format!(
                                "a follower of shard {shard} skipped from {next} to {base}: offset {o} holds {held:?}"
                            )));
                        }
                    }
                }
                for (k, p) in payloads.iter().enumerate() {
                    let o = base + k as u64;
                    match self.history.get(&(id.clone(), o)) {
                        Some(h) if h == p => {}
                        held => {
                            return Err(self.violation(format!(
                                "a follower of shard {shard} was given {p:?} at offset {o}, where {held:?} is committed"
                            )));
                        }
                    }
                }
                self.report.followed += payloads.len() as u64;
                next = base + payloads.len() as u64;
            }
            self.followers[i].next = next;
        }
        Ok(())
    }

    /// Whether every follower is subscribed on its shard's owner and was given everything that
    /// owner committed.
    pub(super) fn followers_caught_up(&self) -> bool {
        self.followers.iter().all(|f| {
            let Follow::On { node, live: true, .. } = &f.state else { return false };
            let Some(n) = self.nodes.get(node) else { return false };
            let owns = n.metadata().owner(&shard_id(ORDERS, f.shard)).is_some_and(|a| a.owner == *node);
            let tail = n.broker.shard_state(TENANT, NS, ORDERS, f.shard).map_or(u64::MAX, |s| s.1);
            // Generation starts at the end hold no record to be given.
            let id = shard_id(ORDERS, f.shard);
            let mut next = f.next;
            while self.history.get(&(id.clone(), next)).is_some_and(Bytes::is_empty) {
                next += 1;
            }
            owns && next >= tail
        })
    }

    /// Why the followers are not caught up (for the violation).
    pub(super) fn followers_behind(&self) -> String {
        let mut out = Vec::new();
        for f in &self.followers {
            let at = match &f.state {
                Follow::On { node, live, .. } => format!("on {node} (subscribed: {live})"),
                Follow::Waiting { to, .. } => format!("waiting (for {to:?})"),
            };
            out.push(format!("shard {} {at} at {}", f.shard, f.next));
        }
        out.join("; ")
    }
}
