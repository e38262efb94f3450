//! Typed exceptions: one class per protocol error code (so `except felix.Forbidden` reads as
//! the spec does), all under `FelixError`, each carrying what the broker said: `code`, `retry`
//! (the retry class), `retry_after_ms`, `reason`; redirects their owner, cursor errors what is
//! available.

use felix_driver_tokio::ClientError;
use felix_proto::message::CursorErrorReason;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(_felix, FelixError, PyException, "Every Felix error; `code`, `retry`, `retry_after_ms`, `reason`.");
create_exception!(_felix, ConnectError, FelixError, "No broker could be reached (address, handshake).");
create_exception!(_felix, TlsError, ConnectError, "TLS setup or the broker's certificate.");
create_exception!(
    _felix,
    ConnectionClosed,
    FelixError,
    "The connection ended; `retry` says whether the request may have been carried out."
);
create_exception!(_felix, Unsupported, FelixError, "The broker does not offer what the request needs.");
create_exception!(
    _felix,
    InvalidRequest,
    FelixError,
    "`invalid_request`, or a request the client cannot send as asked."
);
create_exception!(_felix, Unauthenticated, FelixError, "`unauthenticated`: a bad or missing token.");
create_exception!(_felix, Forbidden, FelixError, "`forbidden`: the token may not do this.");
create_exception!(_felix, NotFound, FelixError, "`not_found`.");
create_exception!(
    _felix,
    ShardUnavailable,
    FelixError,
    "`shard_unavailable`: retry (after `retry_after_ms` when given)."
);
create_exception!(
    _felix,
    NotLeader,
    FelixError,
    "`not_leader`: another broker owns the shard (`node_id`, `addr`, `generation`)."
);
create_exception!(_felix, QuorumTimeout, FelixError, "`quorum_timeout`: outcome unknown.");
create_exception!(_felix, LeadershipLost, FelixError, "`leadership_lost`: outcome unknown.");
create_exception!(_felix, Unacknowledged, FelixError, "`unacknowledged`: outcome unknown.");
create_exception!(_felix, Overloaded, FelixError, "`overloaded`: retry after `retry_after_ms`.");
create_exception!(_felix, LimitExceeded, FelixError, "`limit_exceeded`.");
create_exception!(_felix, Draining, FelixError, "`draining`: the broker is stopping; another will serve.");
create_exception!(_felix, InternalError, FelixError, "`internal`: outcome unknown.");
create_exception!(_felix, StorageError, FelixError, "`storage`: the broker's disk failed; outcome unknown.");
create_exception!(
    _felix,
    StaleClaim,
    FelixError,
    "`stale_claim`: a group record not handed out since the group's state was rebuilt."
);
create_exception!(_felix, Revoked, FelixError, "`revoked`: the token was revoked.");
create_exception!(_felix, StaleWidth, FelixError, "`stale_width`: the stream's shard count changed; retry.");
create_exception!(
    _felix,
    CursorError,
    FelixError,
    "The offset asked for is not retained (`requested`, `available`, `too_old`)."
);
create_exception!(
    _felix,
    PublishRefused,
    FelixError,
    "An idempotent or conditional publish was refused (`reason`); nothing was written."
);
create_exception!(
    _felix,
    Unconfirmed,
    FelixError,
    "On close: the broker did not confirm receipt of up to `publishes` fire-and-forget publishes."
);
create_exception!(
    _felix,
    SubscriptionEnded,
    FelixError,
    "A subscription or watch ended (`reason`): deleted, lagged, revoked, or its broker gone for good."
);

/// Adds every exception class to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    macro_rules! add {
        ($($t:ident),*) => { $( m.add(stringify!($t), py.get_type::<$t>())?; )* };
    }
    add!(
        FelixError,
        ConnectError,
        TlsError,
        ConnectionClosed,
        Unsupported,
        InvalidRequest,
        Unauthenticated,
        Forbidden,
        NotFound,
        ShardUnavailable,
        NotLeader,
        QuorumTimeout,
        LeadershipLost,
        Unacknowledged,
        Overloaded,
        LimitExceeded,
        Draining,
        InternalError,
        StorageError,
        StaleClaim,
        Revoked,
        StaleWidth,
        CursorError,
        PublishRefused,
        Unconfirmed,
        SubscriptionEnded
    );
    Ok(())
}

/// The class for a protocol error code's name.
fn for_code(code: &str, message: String) -> PyErr {
    match code {
        "unauthenticated" => Unauthenticated::new_err(message),
        "forbidden" => Forbidden::new_err(message),
        "not_found" => NotFound::new_err(message),
        "invalid_request" => InvalidRequest::new_err(message),
        "shard_unavailable" => ShardUnavailable::new_err(message),
        "not_leader" => NotLeader::new_err(message),
        "quorum_timeout" => QuorumTimeout::new_err(message),
        "leadership_lost" => LeadershipLost::new_err(message),
        "unacknowledged" => Unacknowledged::new_err(message),
        "overloaded" => Overloaded::new_err(message),
        "limit_exceeded" => LimitExceeded::new_err(message),
        "draining" => Draining::new_err(message),
        "internal" => InternalError::new_err(message),
        "storage" => StorageError::new_err(message),
        "stale_claim" => StaleClaim::new_err(message),
        "revoked" => Revoked::new_err(message),
        "stale_width" => StaleWidth::new_err(message),
        _ => FelixError::new_err(message),
    }
}

/// What the Python exception carries besides its message.
#[derive(Default)]
struct Attrs {
    code: Option<String>,
    retry: Option<&'static str>,
    retry_after_ms: Option<u64>,
    reason: Option<String>,
    extra: Vec<(&'static str, Py<PyAny>)>,
}

/// A Python exception for a client error, with its attributes set.
pub fn to_py(e: ClientError) -> PyErr {
    let message = e.to_string();
    let mut a = Attrs::default();
    let err = match &e {
        ClientError::Connect(_) => ConnectError::new_err(message),
        ClientError::Tls(_) => TlsError::new_err(message),
        ClientError::Refused(info) => {
            a.code = info.code.as_ref().map(|c| c.name().into_owned());
            a.retry = info.retry.map(|r| r.name());
            a.retry_after_ms = info.detail.as_ref().and_then(|d| d.retry_after_ms);
            a.reason = info.detail.as_ref().and_then(|d| d.reason.clone());
            match (&a.code, info.retry) {
                (Some(c), _) => for_code(c, message),
                // A broker that sends no codes, or the client's own conclusion.
                (None, Some(felix_proto::error_code::RetryClass::OutcomeUnknown)) => ConnectionClosed::new_err(message),
                (None, _) => FelixError::new_err(message),
            }
        }
        ClientError::Cursor(c) => {
            a.reason = Some(if c.reason == CursorErrorReason::TooOld { "too_old" } else { "in_future" }.into());
            Python::attach(|py| {
                a.extra.push(("requested", c.requested.into_pyobject(py).map(|o| o.into_any().unbind()).ok()?));
                a.extra.push(("available", c.available.into_pyobject(py).map(|o| o.into_any().unbind()).ok()?));
                Some(())
            });
            CursorError::new_err(message)
        }
        ClientError::PublishRefused { reason, .. } => {
            a.reason = Some(format!("{reason:?}"));
            a.retry = Some("fatal");
            PublishRefused::new_err(message)
        }
        ClientError::NotLeader { node_id, addr, generation } => {
            a.code = Some("not_leader".into());
            a.retry = Some("redirect");
            Python::attach(|py| {
                a.extra.push(("node_id", node_id.clone().into_pyobject(py).ok()?.into_any().unbind()));
                a.extra.push(("addr", addr.clone().into_pyobject(py).ok()?.into_any().unbind()));
                a.extra.push(("generation", generation.into_pyobject(py).ok()?.into_any().unbind()));
                Some(())
            });
            NotLeader::new_err(message)
        }
        ClientError::Unsupported(_) => Unsupported::new_err(message),
        ClientError::Closed(_) => {
            a.retry = Some("outcome_unknown");
            ConnectionClosed::new_err(message)
        }
        ClientError::Invalid(_) => {
            a.retry = Some("fatal");
            InvalidRequest::new_err(message)
        }
        ClientError::Unconfirmed { publishes, bytes, .. } => {
            Python::attach(|py| {
                a.extra.push(("publishes", publishes.into_pyobject(py).ok()?.into_any().unbind()));
                a.extra.push(("bytes", bytes.into_pyobject(py).ok()?.into_any().unbind()));
                Some(())
            });
            Unconfirmed::new_err(message)
        }
        _ => FelixError::new_err(message),
    };
    Python::attach(|py| {
        let v = err.value(py);
        let _ = v.setattr("code", a.code);
        let _ = v.setattr("retry", a.retry);
        let _ = v.setattr("retry_after_ms", a.retry_after_ms);
        let _ = v.setattr("reason", a.reason);
        for (k, x) in a.extra {
            let _ = v.setattr(k, x);
        }
    });
    err
}

/// A subscription's end as an exception.
pub fn ended(reason: String) -> PyErr {
    let err = SubscriptionEnded::new_err(format!("the subscription ended: {reason}"));
    Python::attach(|py| {
        let v = err.value(py);
        let _ = v.setattr("code", None::<String>);
        let _ = v.setattr("retry", None::<String>);
        let _ = v.setattr("retry_after_ms", None::<u64>);
        let _ = v.setattr("reason", reason);
    });
    err
}
