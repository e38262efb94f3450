//! End-to-end encrypted records (D58): a publisher seals each record with AES-256-GCM under a
//! key the broker never sees, and names the key and algorithm in the batch's envelope, which
//! the broker stores and delivers as sent. A subscriber holding several keys (rotation) opens
//! each batch with the key its envelope names.
//!
//! Envelope (opaque to the broker; this is the client helpers' format):
//!
//! ```text
//! u8 version (1), u8 algorithm (1 = AES-256-GCM), u8 key_id_len, key_id (UTF-8)
//! ```
//!
//! Each record is `nonce (12 bytes, random) || ciphertext || tag (16 bytes)`, sealed with the
//! envelope as additional data (so a record cannot be passed off under another key id).
//!
//! Key file: one key per line, `KEY_ID HEX` (64 hex digits: 32 bytes); `#` starts a comment.
//! The last key is the one a publisher seals with; a subscriber opens with any of them.

use bytes::{BufMut, Bytes, BytesMut};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use std::collections::BTreeMap;
use std::path::Path;

/// The envelope's version byte.
const VERSION: u8 = 1;
/// The algorithm byte for AES-256-GCM.
const AES_256_GCM_ID: u8 = 1;
/// Bytes a sealed record adds: its nonce and its tag.
pub const OVERHEAD: usize = NONCE_LEN + 16;

/// Why a key file, an envelope or a record could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The key file could not be read or a line is not `KEY_ID HEX`.
    #[error("key file {path}: {reason}")]
    KeyFile {
        /// The file.
        path: String,
        /// What is wrong (line number included).
        reason: String,
    },
    /// Records are sealed with a key this ring does not hold.
    #[error("records are encrypted with key {key_id:?}, which the key file does not hold (it holds {held})")]
    UnknownKey {
        /// The key id the envelope names.
        key_id: String,
        /// The ids held, comma-separated.
        held: String,
    },
    /// The envelope is not one this helper writes (another version or algorithm, or damage).
    #[error("unsupported envelope: {0}")]
    Unsupported(String),
    /// A record does not open: damaged, or sealed with another key under the same id.
    #[error("a record does not decrypt with key {key_id:?} (damaged, or another key under that id)")]
    Corrupt {
        /// The key id.
        key_id: String,
    },
    /// The system's random source failed.
    #[error("no randomness for a nonce")]
    Random,
}

/// Keys by id, and the one new records are sealed with.
pub struct KeyRing {
    keys: BTreeMap<String, LessSafeKey>,
    current: String,
    rng: SystemRandom,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRing")
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("current", &self.current)
            .finish()
    }
}

/// The envelope naming `key_id`.
fn envelope_for(key_id: &str) -> Bytes {
    let mut e = BytesMut::with_capacity(3 + key_id.len());
    e.put_u8(VERSION);
    e.put_u8(AES_256_GCM_ID);
    e.put_u8(key_id.len() as u8);
    e.extend_from_slice(key_id.as_bytes());
    e.freeze()
}

/// The key id an envelope names, checking it is this helper's format.
///
/// # Errors
/// [`EnvelopeError::Unsupported`].
pub fn key_id_of(envelope: &[u8]) -> Result<String, EnvelopeError> {
    match envelope {
        [VERSION, AES_256_GCM_ID, len, rest @ ..] if rest.len() == usize::from(*len) => std::str::from_utf8(rest)
            .map(str::to_owned)
            .map_err(|_| EnvelopeError::Unsupported("a key id that is not UTF-8".into())),
        [v, a, ..] => Err(EnvelopeError::Unsupported(format!("version {v}, algorithm {a}"))),
        _ => Err(EnvelopeError::Unsupported(format!("{} bytes", envelope.len()))),
    }
}

impl KeyRing {
    /// Keys from `(id, 32-byte key)` pairs; the last is the one records are sealed with.
    ///
    /// # Errors
    /// No keys, an id over 255 bytes or empty, or an id given twice.
    pub fn new(keys: Vec<(String, [u8; 32])>) -> Result<KeyRing, String> {
        let mut ring = BTreeMap::new();
        let mut current = None;
        for (id, key) in keys {
            if id.is_empty() || id.len() > 255 || id.contains(char::is_whitespace) {
                return Err(format!("key id {id:?}: 1 to 255 bytes, no spaces"));
            }
            let k = UnboundKey::new(&AES_256_GCM, &key).map_err(|_| format!("key {id:?} is not an AES-256 key"))?;
            if ring.insert(id.clone(), LessSafeKey::new(k)).is_some() {
                return Err(format!("key id {id:?} given twice"));
            }
            current = Some(id);
        }
        let current = current.ok_or("no key")?;
        Ok(KeyRing { keys: ring, current, rng: SystemRandom::new() })
    }

    /// Reads a key file (see the module's documentation).
    ///
    /// # Errors
    /// [`EnvelopeError::KeyFile`], naming the line.
    pub fn load(path: &Path) -> Result<KeyRing, EnvelopeError> {
        let bad = |reason: String| EnvelopeError::KeyFile { path: path.display().to_string(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(id), Some(hex), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad(format!("line {}: expected KEY_ID HEX", n + 1)));
            };
            let key = parse_key(hex).map_err(|e| bad(format!("line {}: {e}", n + 1)))?;
            keys.push((id.to_owned(), key));
        }
        KeyRing::new(keys).map_err(bad)
    }

    /// The id records are sealed with.
    pub fn current(&self) -> &str {
        &self.current
    }

    /// The ids held, comma-separated.
    fn held(&self) -> String {
        self.keys.keys().cloned().collect::<Vec<_>>().join(", ")
    }

    /// Seals `payloads` with the current key: the envelope to publish them with, and the sealed
    /// records.
    ///
    /// # Errors
    /// [`EnvelopeError::Random`].
    pub fn seal(&self, payloads: &[Bytes]) -> Result<(Bytes, Vec<Bytes>), EnvelopeError> {
        let envelope = envelope_for(&self.current);
        let key = &self.keys[&self.current];
        let mut out = Vec::with_capacity(payloads.len());
        for p in payloads {
            let mut nonce = [0u8; NONCE_LEN];
            self.rng.fill(&mut nonce).map_err(|_| EnvelopeError::Random)?;
            let mut buf = Vec::with_capacity(OVERHEAD + p.len());
            buf.extend_from_slice(&nonce);
            buf.extend_from_slice(p);
            let (head, body) = buf.split_at_mut(NONCE_LEN);
            let tag = key
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(&envelope[..]), body)
                .map_err(|_| EnvelopeError::Random)?;
            let _ = head;
            buf.extend_from_slice(tag.as_ref());
            out.push(Bytes::from(buf));
        }
        Ok((envelope, out))
    }

    /// Opens one record of a batch with this envelope.
    ///
    /// # Errors
    /// [`EnvelopeError::UnknownKey`] naming the key id, [`EnvelopeError::Unsupported`], or
    /// [`EnvelopeError::Corrupt`].
    pub fn open(&self, envelope: &[u8], record: &[u8]) -> Result<Bytes, EnvelopeError> {
        let key_id = key_id_of(envelope)?;
        let Some(key) = self.keys.get(&key_id) else {
            return Err(EnvelopeError::UnknownKey { key_id, held: self.held() });
        };
        let corrupt = || EnvelopeError::Corrupt { key_id: key_id.clone() };
        if record.len() < OVERHEAD {
            return Err(corrupt());
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&record[..NONCE_LEN]);
        let mut body = record[NONCE_LEN..].to_vec();
        let plain = key
            .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(envelope), &mut body)
            .map_err(|_| corrupt())?;
        Ok(Bytes::copy_from_slice(plain))
    }
}

/// 64 hex digits as a 32-byte key.
fn parse_key(hex: &str) -> Result<[u8; 32], String> {
    if hex.len() != 64 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err("a key is 64 hex digits (32 bytes)".into());
    }
    let mut key = [0u8; 32];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(ids: &[(&str, u8)]) -> KeyRing {
        KeyRing::new(ids.iter().map(|(id, b)| ((*id).to_owned(), [*b; 32])).collect()).unwrap()
    }

    #[test]
    fn sealed_records_open_with_the_key_their_envelope_names_across_a_rotation() {
        let old = ring(&[("k1", 1)]);
        let (e1, sealed1) = old.seal(&[Bytes::from_static(b"secret one")]).unwrap();
        let new = ring(&[("k1", 1), ("k2", 2)]);
        assert_eq!(new.current(), "k2");
        let (e2, sealed2) = new.seal(&[Bytes::from_static(b"secret two")]).unwrap();
        assert_ne!(sealed1[0], sealed2[0]);
        assert!(!sealed1[0].windows(6).any(|w| w == b"secret"), "ciphertext");
        // A subscriber holding both keys opens both batches.
        assert_eq!(new.open(&e1, &sealed1[0]).unwrap(), Bytes::from_static(b"secret one"));
        assert_eq!(new.open(&e2, &sealed2[0]).unwrap(), Bytes::from_static(b"secret two"));
        // One holding only the old key is told which key it lacks.
        assert_eq!(
            old.open(&e2, &sealed2[0]),
            Err(EnvelopeError::UnknownKey { key_id: "k2".into(), held: "k1".into() })
        );
        // The same id with another key, a flipped bit, an envelope swapped: refused, never garbage.
        let impostor = ring(&[("k2", 9)]);
        assert!(matches!(impostor.open(&e2, &sealed2[0]), Err(EnvelopeError::Corrupt { .. })));
        let mut flipped = sealed2[0].to_vec();
        flipped[20] ^= 1;
        assert!(matches!(new.open(&e2, &flipped), Err(EnvelopeError::Corrupt { .. })));
        assert!(matches!(new.open(&e1, &sealed2[0]), Err(EnvelopeError::Corrupt { .. })));
        assert!(matches!(new.open(b"\x02\x01\x02k2", &sealed2[0]), Err(EnvelopeError::Unsupported(_))));
        assert!(matches!(new.open(&e2, b"short"), Err(EnvelopeError::Corrupt { .. })));
    }

    #[test]
    fn key_files_are_read_and_bad_lines_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        let k = "ab".repeat(32);
        std::fs::write(&path, format!("# rotated monthly\nk1 {k}\n\nk2 {}  # current\n", "cd".repeat(32))).unwrap();
        let r = KeyRing::load(&path).unwrap();
        assert_eq!(r.current(), "k2");
        for (text, why) in [
            ("k1\n", "line 1: expected KEY_ID HEX"),
            ("k1 abcd\n", "line 1: a key is 64 hex digits"),
            (&format!("k1 {k}\nk1 {k}\n"), "given twice"),
            ("# nothing\n", "no key"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = KeyRing::load(&path).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        assert!(KeyRing::load(&dir.path().join("missing")).is_err());
    }
}
