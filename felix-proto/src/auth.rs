//! Credentials and permissions.
//!
//! A token belongs to one tenant (or, for a development token, to any) and grants actions on
//! `namespace/name` patterns, where `*` matches any run of characters.

/// Something a request needs permission for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Publish to a stream.
    Publish,
    /// Subscribe to (or read) a stream.
    Subscribe,
    /// Read a cache.
    CacheRead,
    /// Write a cache.
    CacheWrite,
    /// Operator actions.
    Admin,
    /// Consume through a consumer group: poll, ack, nack, extend, dead-letter, describe.
    GroupConsume,
    /// Manage a consumer group: seek and delete.
    GroupManage,
}

impl Action {
    /// Every action.
    pub const ALL: [Action; 7] = [
        Action::Publish,
        Action::Subscribe,
        Action::CacheRead,
        Action::CacheWrite,
        Action::Admin,
        Action::GroupConsume,
        Action::GroupManage,
    ];

    /// The configuration spelling.
    pub fn name(self) -> &'static str {
        match self {
            Action::Publish => "publish",
            Action::Subscribe => "subscribe",
            Action::CacheRead => "cache_read",
            Action::CacheWrite => "cache_write",
            Action::Admin => "admin",
            Action::GroupConsume => "group_consume",
            Action::GroupManage => "group_manage",
        }
    }

    /// Reads the configuration spelling.
    pub fn from_name(s: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// One permission: an action on the resources matching `pattern` (`namespace/name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The action.
    pub action: Action,
    /// `namespace/name` with `*` wildcards; `*` alone matches everything.
    pub pattern: String,
}

/// A credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGrant {
    /// The bearer token.
    pub token: String,
    /// The tenant it belongs to; `None` for a development token valid for any tenant.
    pub tenant_id: Option<String>,
    /// Who it authenticates (recorded as the publisher of what it writes).
    pub principal: String,
    /// What it may do.
    pub grants: Vec<Grant>,
}

impl TokenGrant {
    /// A token valid for any tenant with every permission: for development only.
    pub fn dev(token: impl Into<String>) -> TokenGrant {
        TokenGrant {
            token: token.into(),
            tenant_id: None,
            principal: "dev".into(),
            grants: Action::ALL.into_iter().map(|action| Grant { action, pattern: "*".into() }).collect(),
        }
    }

    /// Whether the token may do `action` on `namespace/name`.
    pub fn allows(&self, action: Action, namespace: &str, name: &str) -> bool {
        self.grants.iter().any(|g| g.action == action && pattern_matches(&g.pattern, namespace, name))
    }
}

fn pattern_matches(pattern: &str, namespace: &str, name: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    let mut subject = String::with_capacity(namespace.len() + name.len() + 1);
    subject.push_str(namespace);
    subject.push('/');
    subject.push_str(name);
    glob(pattern.as_bytes(), subject.as_bytes())
}

/// `*` matches any run of bytes (including `/`); everything else matches itself.
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            mark = si;
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some(st) = star {
            pi = st + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(pattern_matches("*", "a", "b"));
        assert!(pattern_matches("default/*", "default", "orders"));
        assert!(!pattern_matches("default/*", "other", "orders"));
        assert!(pattern_matches("*/orders", "x", "orders"));
        assert!(pattern_matches("default/ord*s", "default", "orders"));
        assert!(!pattern_matches("default/orders", "default", "orders2"));
    }

    #[test]
    fn grants() {
        let t = TokenGrant {
            token: "x".into(),
            tenant_id: Some("t1".into()),
            principal: "alice".into(),
            grants: vec![Grant { action: Action::Subscribe, pattern: "default/*".into() }],
        };
        assert!(t.allows(Action::Subscribe, "default", "a"));
        assert!(!t.allows(Action::Publish, "default", "a"));
        assert!(TokenGrant::dev("d").allows(Action::Admin, "n", "s"));
    }
}
