//! Signed tokens: JWTs signed with EdDSA (Ed25519), verified locally by every broker against
//! a JWK set. Header `alg: EdDSA`, `kid`; claims `iss`, `aud`, `sub` (the principal, recorded as
//! the publisher), `tid` (tenant), `exp`, `iat`, optional `nbf` and `jti`, and `perms`: upstream
//! Felix's `ACTION:OBJECT` strings (`stream.publish:stream:t1/orders/*`,
//! `cache.read:cache:t1/default/sessions`, `ns.manage:namespace:t1/orders`,
//! `tenant.manage:tenant:t1`, `node.view:cluster:*`, and our `group.consume`/`group.manage`
//! on streams), `*` matching a whole path segment.
//!
//! The signature is checked by *ring* (the crypto rustls already uses here): no home-made
//! crypto. Pure computation with the time passed in, so it sits in the sans-IO core. Every
//! input is untrusted: a token that does not parse is an error, never a panic.

use crate::auth::Action;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Why a token was refused. Every one is `unauthenticated` to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    /// Not three base64url parts of JSON, or a field missing.
    #[error("malformed token: {0}")]
    Malformed(String),
    /// A header `alg` other than EdDSA.
    #[error("token algorithm {0:?} is not EdDSA")]
    Algorithm(String),
    /// No key with that `kid`.
    #[error("unknown key id {0:?}")]
    UnknownKey(String),
    /// The signature does not verify.
    #[error("bad signature")]
    BadSignature,
    /// Another issuer.
    #[error("issuer {0:?} is not trusted")]
    Issuer(String),
    /// Another audience.
    #[error("audience {0:?} is not this broker")]
    Audience(String),
    /// Past `exp`.
    #[error("token expired")]
    Expired,
    /// Before `nbf`.
    #[error("token not valid yet")]
    NotYetValid,
    /// Its `jti` or `sub` is revoked.
    #[error("token revoked")]
    Revoked,
    /// A permission string that is not `ACTION:OBJECT`.
    #[error("bad permission {0:?}")]
    BadPermission(String),
}

/// The claims of a verified token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Issuer.
    pub iss: String,
    /// Audience.
    pub aud: String,
    /// Principal.
    pub sub: String,
    /// Tenant.
    pub tid: String,
    /// Expiry, seconds since the epoch.
    pub exp: u64,
    /// Issued at.
    pub iat: u64,
    /// Not before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// Token id (for revocation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// Permissions.
    #[serde(default)]
    pub perms: Vec<String>,
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    #[serde(default)]
    kid: Option<String>,
}

#[derive(Deserialize)]
struct JwkSet {
    keys: Vec<Jwk>,
}

#[derive(Deserialize)]
struct Jwk {
    kty: String,
    #[serde(default)]
    crv: Option<String>,
    #[serde(default)]
    kid: Option<String>,
    #[serde(default)]
    x: Option<String>,
}

/// Trusted public keys by key id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Jwks {
    keys: BTreeMap<String, Vec<u8>>,
}

impl Jwks {
    /// Reads a standard JWK set (`{"keys":[{"kty":"OKP","crv":"Ed25519","kid":..,"x":..}]}`).
    /// Keys of other types are skipped (a set may hold keys for other services).
    ///
    /// # Errors
    /// [`JwtError::Malformed`] for a set that is not JSON, an Ed25519 key without `kid` or with
    /// an `x` that is not 32 base64url bytes, or a set with no usable key.
    pub fn parse(json: &[u8]) -> Result<Jwks, JwtError> {
        let set: JwkSet = serde_json::from_slice(json).map_err(|e| JwtError::Malformed(format!("JWK set: {e}")))?;
        let mut keys = BTreeMap::new();
        for k in set.keys {
            if k.kty != "OKP" || k.crv.as_deref() != Some("Ed25519") {
                continue;
            }
            let kid = k.kid.ok_or_else(|| JwtError::Malformed("an Ed25519 key without kid".into()))?;
            let x =
                k.x.and_then(|x| URL_SAFE_NO_PAD.decode(x).ok())
                    .filter(|x| x.len() == 32)
                    .ok_or_else(|| JwtError::Malformed(format!("key {kid}: x is not 32 base64url bytes")))?;
            keys.insert(kid, x);
        }
        if keys.is_empty() {
            return Err(JwtError::Malformed("the JWK set holds no Ed25519 key".into()));
        }
        Ok(Jwks { keys })
    }

    /// A set of one key (`x`: the 32-byte public key).
    pub fn single(kid: &str, x: &[u8]) -> Jwks {
        Jwks { keys: BTreeMap::from([(kid.to_owned(), x.to_vec())]) }
    }

    /// The set as JSON.
    pub fn to_json(&self) -> String {
        let keys: Vec<serde_json::Value> = self
            .keys
            .iter()
            .map(|(kid, x)| {
                serde_json::json!({"kty": "OKP", "crv": "Ed25519", "kid": kid, "use": "sig", "alg": "EdDSA",
                    "x": URL_SAFE_NO_PAD.encode(x)})
            })
            .collect();
        serde_json::json!({ "keys": keys }).to_string()
    }
}

/// What a broker accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verifier {
    /// Trusted issuer (default `felix-auth`).
    pub issuer: String,
    /// This broker's audience (default `felix-broker`).
    pub audience: String,
    /// Keys.
    pub keys: Jwks,
    /// Revoked token ids.
    pub revoked_jti: BTreeSet<String>,
    /// Revoked principals.
    pub revoked_sub: BTreeSet<String>,
}

impl Verifier {
    /// Trusting `keys` for the default issuer and audience.
    pub fn new(keys: Jwks) -> Verifier {
        Verifier {
            issuer: "felix-auth".into(),
            audience: "felix-broker".into(),
            keys,
            revoked_jti: BTreeSet::new(),
            revoked_sub: BTreeSet::new(),
        }
    }

    /// Whether a string looks like a JWT at all (three dot-separated parts), so a static token
    /// is never mistaken for one.
    pub fn looks_like_jwt(token: &str) -> bool {
        token.split('.').count() == 3
    }

    /// A token's `(iat, exp)` claims, read without checking anything (for a client scheduling
    /// its refresh; never for a decision to trust it). `None` for anything that is not a JWT.
    pub fn unverified_lifetime(token: &str) -> Option<(u64, u64)> {
        #[derive(serde::Deserialize)]
        struct Times {
            iat: u64,
            exp: u64,
        }
        let claims = token.split('.').nth(1)?;
        let t: Times = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(claims).ok()?).ok()?;
        Some((t.iat, t.exp))
    }

    /// Verifies a token at `now` (seconds since the epoch): signature, issuer, audience,
    /// validity window, revocation, and that every permission parses.
    ///
    /// # Errors
    /// [`JwtError`] saying what is wrong.
    pub fn verify(&self, token: &str, now: u64) -> Result<(Claims, Vec<Perm>), JwtError> {
        let mut parts = token.split('.');
        let (Some(h), Some(c), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(JwtError::Malformed("not three dot-separated parts".into()));
        };
        let b64 = |p: &str, what: &str| {
            URL_SAFE_NO_PAD.decode(p).map_err(|e| JwtError::Malformed(format!("{what} is not base64url: {e}")))
        };
        let header: Header =
            serde_json::from_slice(&b64(h, "header")?).map_err(|e| JwtError::Malformed(format!("header: {e}")))?;
        if header.alg != "EdDSA" {
            return Err(JwtError::Algorithm(header.alg));
        }
        let kid = header.kid.unwrap_or_default();
        let key = self.keys.keys.get(&kid).ok_or_else(|| JwtError::UnknownKey(kid.clone()))?;
        let sig = b64(s, "signature")?;
        let signed = &token.as_bytes()[..h.len() + 1 + c.len()];
        ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, key)
            .verify(signed, &sig)
            .map_err(|_| JwtError::BadSignature)?;
        let claims: Claims =
            serde_json::from_slice(&b64(c, "claims")?).map_err(|e| JwtError::Malformed(format!("claims: {e}")))?;
        if claims.iss != self.issuer {
            return Err(JwtError::Issuer(claims.iss));
        }
        if claims.aud != self.audience {
            return Err(JwtError::Audience(claims.aud));
        }
        if now >= claims.exp {
            return Err(JwtError::Expired);
        }
        if claims.nbf.is_some_and(|nbf| now < nbf) {
            return Err(JwtError::NotYetValid);
        }
        if claims.jti.as_ref().is_some_and(|j| self.revoked_jti.contains(j)) || self.revoked_sub.contains(&claims.sub) {
            return Err(JwtError::Revoked);
        }
        let perms = claims.perms.iter().map(|p| Perm::parse(p)).collect::<Result<Vec<_>, _>>()?;
        Ok((claims, perms))
    }
}

/// Signs `claims` with an Ed25519 key (PKCS#8 DER) as key `kid`: for `felix-node token mint`
/// and tests.
///
/// # Errors
/// [`JwtError::Malformed`] for a key that is not an Ed25519 PKCS#8 document.
pub fn mint(pkcs8: &[u8], kid: &str, claims: &Claims) -> Result<String, JwtError> {
    let key = ring::signature::Ed25519KeyPair::from_pkcs8_maybe_unchecked(pkcs8)
        .map_err(|e| JwtError::Malformed(format!("signing key: {e}")))?;
    let header = serde_json::json!({"alg": "EdDSA", "typ": "JWT", "kid": kid}).to_string();
    let body = serde_json::to_string(claims).map_err(|e| JwtError::Malformed(e.to_string()))?;
    let signed = format!("{}.{}", URL_SAFE_NO_PAD.encode(header), URL_SAFE_NO_PAD.encode(body));
    let sig = key.sign(signed.as_bytes());
    Ok(format!("{signed}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref())))
}

/// The public key (32 bytes) of an Ed25519 PKCS#8 document.
///
/// # Errors
/// As [`mint`].
pub fn public_key(pkcs8: &[u8]) -> Result<Vec<u8>, JwtError> {
    use ring::signature::KeyPair;
    let key = ring::signature::Ed25519KeyPair::from_pkcs8_maybe_unchecked(pkcs8)
        .map_err(|e| JwtError::Malformed(format!("signing key: {e}")))?;
    Ok(key.public_key().as_ref().to_vec())
}

/// RFC 8032's first test secret, wrapped as PKCS#8 (RFC 8410): a published key for tests,
/// fuzz seeds and benches, never for real tokens.
#[cfg(any(test, fuzzing, feature = "testkit"))]
pub fn rfc8032_test_key() -> Vec<u8> {
    let mut der = vec![0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    der.extend_from_slice(&[
        0x9d, 0x61, 0xb1, 0x9d, 0xef, 0xfd, 0x5a, 0x60, 0xba, 0x84, 0x4a, 0xf4, 0x92, 0xec, 0x2c, 0xc4, 0x44, 0x49,
        0xc5, 0x69, 0x7b, 0x32, 0x69, 0x19, 0x70, 0x3b, 0xac, 0x03, 0x1c, 0xae, 0x7f, 0x60,
    ]);
    der
}

/// What a permission lets its holder do.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verb {
    Do(Action),
    /// `ns.manage` or `tenant.manage`: everything in the object.
    Manage,
    /// `node.view`: diagnostics only.
    View,
}

/// One permission, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Perm {
    verb: Verb,
    /// `stream`, `cache`, `namespace`, `tenant` or `cluster`.
    kind: String,
    /// Path segments (`*` matches one whole segment; a shorter path covers what is inside).
    path: Vec<String>,
}

impl Perm {
    /// Reads `ACTION:OBJECT`.
    ///
    /// # Errors
    /// [`JwtError::BadPermission`] for an unknown action or object, or an action on the wrong
    /// kind of object.
    pub fn parse(s: &str) -> Result<Perm, JwtError> {
        let bad = || JwtError::BadPermission(s.to_owned());
        let (action, object) = s.split_once(':').ok_or_else(bad)?;
        let (kind, path) = object.split_once(':').ok_or_else(bad)?;
        let verb = match action {
            "stream.publish" => Verb::Do(Action::Publish),
            "stream.subscribe" => Verb::Do(Action::Subscribe),
            "cache.read" => Verb::Do(Action::CacheRead),
            "cache.write" => Verb::Do(Action::CacheWrite),
            "group.consume" => Verb::Do(Action::GroupConsume),
            "group.manage" => Verb::Do(Action::GroupManage),
            "stream.admin" => Verb::Do(Action::Admin),
            "ns.manage" | "tenant.manage" => Verb::Manage,
            "node.view" => Verb::View,
            _ => return Err(bad()),
        };
        let want = match (&verb, action) {
            (Verb::Do(Action::CacheRead | Action::CacheWrite), _) => "cache",
            (Verb::Do(_), _) => "stream",
            (Verb::Manage, "ns.manage") => "namespace",
            (Verb::Manage, _) => "tenant",
            (Verb::View, _) => "cluster",
        };
        if kind != want {
            return Err(bad());
        }
        let path: Vec<String> = path.split('/').map(str::to_owned).collect();
        let depth = match kind {
            "stream" | "cache" => 3,
            "namespace" => 2,
            _ => 1,
        };
        if path.len() != depth || path.iter().any(String::is_empty) {
            return Err(bad());
        }
        Ok(Perm { verb, kind: kind.to_owned(), path })
    }

    /// Whether this is exactly `node.view:cluster:*` (what operator diagnostics need; no
    /// other spelling counts).
    pub fn is_cluster_view(&self) -> bool {
        self.verb == Verb::View && self.kind == "cluster" && self.path == ["*"]
    }

    /// Whether this permission allows `action` on `tenant/namespace/name`.
    pub fn allows(&self, action: Action, tenant: &str, namespace: &str, name: &str) -> bool {
        let subject = [tenant, namespace, name];
        let covers = |n: usize| self.path.iter().take(n).zip(subject).all(|(p, s)| p == "*" || p == s);
        match &self.verb {
            Verb::View => false,
            Verb::Manage => covers(self.path.len()),
            Verb::Do(a) => *a == action && covers(3),
        }
    }
}

/// Whether any of `perms` allows it.
pub fn allows(perms: &[Perm], action: Action, tenant: &str, namespace: &str, name: &str) -> bool {
    perms.iter().any(|p| p.allows(action, tenant, namespace, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(perms: &[&str]) -> Claims {
        Claims {
            iss: "felix-auth".into(),
            aud: "felix-broker".into(),
            sub: "alice".into(),
            tid: "t1".into(),
            exp: 2_000,
            iat: 1_000,
            nbf: None,
            jti: Some("j1".into()),
            perms: perms.iter().map(|p| p.to_string()).collect(),
        }
    }

    #[test]
    fn a_minted_token_verifies_and_every_flaw_is_named() {
        let key = rfc8032_test_key();
        let pubkey = public_key(&key).unwrap();
        let v = Verifier::new(Jwks::single("k1", &pubkey));
        let good = mint(&key, "k1", &claims(&["stream.publish:stream:t1/orders/*"])).unwrap();
        let (c, perms) = v.verify(&good, 1_500).unwrap();
        assert_eq!(c.sub, "alice");
        assert!(allows(&perms, Action::Publish, "t1", "orders", "x"));
        assert!(!allows(&perms, Action::Subscribe, "t1", "orders", "x"));
        assert!(!allows(&perms, Action::Publish, "t2", "orders", "x"));
        assert_eq!(v.verify(&good, 2_000), Err(JwtError::Expired));
        let later = Claims { nbf: Some(1_800), ..claims(&[]) };
        assert_eq!(v.verify(&mint(&key, "k1", &later).unwrap(), 1_500), Err(JwtError::NotYetValid));
        assert!(matches!(v.verify(&mint(&key, "k2", &claims(&[])).unwrap(), 1_500), Err(JwtError::UnknownKey(_))));
        let other_iss = Claims { iss: "someone".into(), ..claims(&[]) };
        assert!(matches!(v.verify(&mint(&key, "k1", &other_iss).unwrap(), 1_500), Err(JwtError::Issuer(_))));
        let other_aud = Claims { aud: "another".into(), ..claims(&[]) };
        assert!(matches!(v.verify(&mint(&key, "k1", &other_aud).unwrap(), 1_500), Err(JwtError::Audience(_))));
        // A flipped byte of the claims: the signature no longer matches.
        let (head, rest) = good.split_once('.').unwrap();
        let (body, sig) = rest.split_once('.').unwrap();
        let mut b = URL_SAFE_NO_PAD.decode(body).unwrap();
        b[10] ^= 1;
        let forged = format!("{head}.{}.{sig}", URL_SAFE_NO_PAD.encode(b));
        assert!(matches!(v.verify(&forged, 1_500), Err(JwtError::BadSignature | JwtError::Malformed(_))));
        let mut revoking = v.clone();
        revoking.revoked_jti.insert("j1".into());
        assert_eq!(revoking.verify(&good, 1_500), Err(JwtError::Revoked));
        assert!(matches!(v.verify("a.b", 1), Err(JwtError::Malformed(_))));
        assert!(matches!(v.verify("!!.!!.!!", 1), Err(JwtError::Malformed(_))));
        let bad_perm = mint(&key, "k1", &claims(&["stream.publish:cache:t1/x/y"])).unwrap();
        assert!(matches!(v.verify(&bad_perm, 1_500), Err(JwtError::BadPermission(_))));
    }

    #[test]
    fn a_tokens_lifetime_is_read_without_verifying_it() {
        let key = rfc8032_test_key();
        let c = claims(&["stream.publish:stream:t1/orders/*"]);
        let token = mint(&key, "k1", &c).unwrap();
        assert_eq!(Verifier::unverified_lifetime(&token), Some((c.iat, c.exp)));
        for bad in ["", "a.b", "a.!!!.c", "a.e30.c", "opaque-static-token"] {
            assert_eq!(Verifier::unverified_lifetime(bad), None, "{bad}");
        }
    }

    #[test]
    fn permissions_follow_the_grammar() {
        let p = |s: &str| Perm::parse(s).unwrap();
        assert!(p("tenant.manage:tenant:t1").allows(Action::Admin, "t1", "any", "thing"));
        assert!(!p("tenant.manage:tenant:t1").allows(Action::Publish, "t2", "any", "thing"));
        assert!(p("ns.manage:namespace:t1/orders").allows(Action::GroupManage, "t1", "orders", "s"));
        assert!(!p("ns.manage:namespace:t1/orders").allows(Action::Publish, "t1", "other", "s"));
        assert!(p("cache.read:cache:t1/*/sessions").allows(Action::CacheRead, "t1", "eu", "sessions"));
        assert!(!p("cache.read:cache:t1/*/sessions").allows(Action::CacheWrite, "t1", "eu", "sessions"));
        assert!(!p("node.view:cluster:*").allows(Action::Subscribe, "t1", "a", "b"));
        for bad in [
            "publish",
            "stream.publish:stream:t1/x",
            "stream.publish:stream:t1//x",
            "x.y:stream:a/b/c",
            "cache.read:stream:a/b/c",
        ] {
            assert!(Perm::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_jwk_set_round_trips_and_bad_ones_are_refused() {
        let key = rfc8032_test_key();
        let set = Jwks::single("k1", &public_key(&key).unwrap());
        assert_eq!(Jwks::parse(set.to_json().as_bytes()), Ok(set));
        for bad in [
            &b"nope"[..],
            br#"{"keys":[]}"#,
            br#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"AAAA"}]}"#,
            br#"{"keys":[{"kty":"OKP","crv":"Ed25519","kid":"k","x":"AAAA"}]}"#,
        ] {
            assert!(Jwks::parse(bad).is_err());
        }
    }
}
