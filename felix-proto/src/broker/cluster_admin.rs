//! Operator requests over the client protocol (D52, FEATURE_CLUSTER_ADMIN): `cluster_status`
//! and `shard_move`, so an operator needs the client address and a token, as every other
//! command does, rather than the metrics listener and the cluster secret. The broker checks
//! the permission and holds the answer's turn on the stream; the cluster node, which holds
//! the metadata and the replicas, answers (`Broker::handle_cluster_admin_answer`). A broker
//! that runs alone answers at once.

use crate::shard::page::{STATUS_PAGE_MAX, StatusPage};

/// Shards on a status page when `limit` is absent (D55).
pub const DEFAULT_STATUS_PAGE: usize = 1_000;

use super::*;
use crate::error_code::ErrorCode;
use crate::message::{self, Message};
use crate::shard::{Kind, ShardId};
use crate::transport::{ConnId, StreamId};

/// What the cluster node is asked for a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterAdminRequest {
    /// The status document, for one tenant or (`None`) the operator.
    Status {
        /// The tenant whose shards it shows; `None`: all.
        tenant: Option<String>,
        /// One page of it (D55); `None`: whole.
        page: Option<crate::shard::page::StatusPage>,
    },
    /// Move a stream shard to `to`.
    Move {
        /// The shard.
        shard: ShardId,
        /// Its new owner.
        to: String,
    },
    /// Give a shard's move up.
    CancelMove {
        /// The shard.
        shard: ShardId,
    },
}

/// The cluster node's answer to a [`ClusterAdminRequest`].
#[derive(Debug, Clone, PartialEq)]
pub enum ClusterAdminAnswer {
    /// The status document.
    Status(serde_json::Value),
    /// Proposed to the metadata group: what.
    Proposed(String),
    /// The metadata refused it: why.
    Refused(String),
}

/// A client request waiting for the cluster node's answer.
#[derive(Debug)]
pub(super) struct PendingAdmin {
    conn: ConnId,
    stream: StreamId,
    request_id: u64,
    /// What the client offered (whether an `error` carries a code).
    offer: ClientOffer,
}

impl Broker {
    /// Who may see the status: the operator (a signed token holding `node.view:cluster:*`)
    /// sees all of it, a tenant's administrator (the admin action on every stream of its
    /// tenant, as the development token has) its tenant's part; anyone else is refused.
    fn status_scope(&self, st: &CtlStream) -> Result<Option<String>, Refusal> {
        if Self::may_inspect(st) {
            return Ok(None);
        }
        let Some(tenant) = st.session.as_ref().map(|s| s.tenant_id.clone()) else {
            return Err(Refusal::new(ErrorCode::Unauthenticated, "authenticate first"));
        };
        self.authorize(st, &tenant, "*", "*", Action::Admin).map_err(|_| {
            Refusal::new(
                ErrorCode::Forbidden,
                "the cluster's status needs the admin permission on the whole tenant (stream.admin:TENANT:*) \
                 or node.view:cluster:*",
            )
        })?;
        Ok(Some(tenant))
    }

    /// `cluster_status`.
    pub(super) fn cluster_status(&mut self, conn: ConnId, st: &mut CtlStream, q: message::ClusterStatus) {
        let tenant = match self.status_scope(st) {
            Ok(t) => t,
            Err(r) => return self.refuse(conn, st, r),
        };
        // A page (D55): asked only of a broker that offered FEATURE_STATUS_PAGES; an `after`
        // this broker could not have given is refused rather than read as the start.
        let page = if q.limit.is_some() || q.after.is_some() {
            let after = match q.after.as_deref().map(ShardId::from_cursor) {
                None => None,
                Some(Some(a)) => Some(a),
                Some(None) => {
                    let r = Refusal::new(ErrorCode::InvalidRequest, "`after` is not a cursor a status page gave");
                    return self.refuse(conn, st, r);
                }
            };
            let limit = q.limit.map_or(DEFAULT_STATUS_PAGE, |l| l as usize).clamp(1, STATUS_PAGE_MAX);
            Some(StatusPage { after, limit })
        } else {
            None
        };
        if self.membership.view.is_none() {
            let status = serde_json::json!({"cluster": false});
            let m = Message::ClusterStatusView(message::ClusterStatusView { status, request_id: q.request_id });
            return self.send(conn, st, json_frame(&m));
        }
        self.ask_cluster(conn, st, q.request_id, ClusterAdminRequest::Status { tenant, page });
    }

    /// `shard_move`: needs the admin permission on the stream (as deleting it does).
    pub(super) fn shard_move(&mut self, conn: ConnId, st: &mut CtlStream, m: message::ShardMove) {
        if let Err(r) =
            requests::check_names(&[("tenant", &m.tenant_id), ("namespace", &m.namespace), ("stream", &m.stream)])
                .and_then(|()| self.authorize(st, &m.tenant_id, &m.namespace, &m.stream, Action::Admin))
        {
            return self.refuse(conn, st, r);
        }
        if self.membership.view.is_none() {
            let r = Refusal::new(ErrorCode::InvalidRequest, "this broker runs alone: there is nowhere to move a shard");
            return self.refuse(conn, st, r);
        }
        let shard =
            ShardId { kind: Kind::Stream, tenant: m.tenant_id, namespace: m.namespace, name: m.stream, shard: m.shard };
        let request = match (m.to, m.cancel) {
            (Some(to), false) if !to.is_empty() => ClusterAdminRequest::Move { shard, to },
            (None, true) => ClusterAdminRequest::CancelMove { shard },
            _ => {
                let r = Refusal::new(ErrorCode::InvalidRequest, "shard_move takes either `to` or `cancel`");
                return self.refuse(conn, st, r);
            }
        };
        self.ask_cluster(conn, st, m.request_id, request);
    }

    /// Holds the answer's turn and hands the request to the cluster node.
    fn ask_cluster(&mut self, conn: ConnId, st: &mut CtlStream, request_id: u64, request: ClusterAdminRequest) {
        let id = self.membership.next_forward;
        self.membership.next_forward += 1;
        let offer = Self::features_of(st);
        self.membership.admin.insert(id, PendingAdmin { conn, stream: st.id, request_id, offer });
        Self::hold(st, HeldFor::Admin(id));
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ClusterAdmin { id, request }));
    }

    /// The cluster node answered a [`ClusterOutput::ClusterAdmin`]: the client gets it in its
    /// turn on its stream.
    pub(crate) fn handle_cluster_admin_answer(&mut self, id: u64, answer: ClusterAdminAnswer) {
        let Some(p) = self.membership.admin.remove(&id) else { return };
        let m = match answer {
            ClusterAdminAnswer::Status(status) => {
                Message::ClusterStatusView(message::ClusterStatusView { status, request_id: p.request_id })
            }
            ClusterAdminAnswer::Proposed(proposed) => {
                Message::ShardMoveOk(message::ShardMoveOk { proposed, request_id: p.request_id })
            }
            ClusterAdminAnswer::Refused(why) => {
                Self::error_message(&p.offer, &Refusal::new(ErrorCode::InvalidRequest, why))
            }
        };
        self.fill_held(p.conn, p.stream, HeldFor::Admin(id), json_frame(&m));
    }
}
