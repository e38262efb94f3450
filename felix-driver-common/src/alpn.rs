//! Accepting clients that offer no ALPN.
//!
//! Existing Felix clients offer no ALPN; current ones offer `felix/1`. rustls in QUIC mode is
//! strict either way: a server configured with ALPN refuses a client that offers none, and one
//! configured without refuses a client that offers some. So the server session is started
//! lazily: it buffers the ClientHello, looks for the ALPN extension, and only then starts the
//! real rustls session from the matching configuration, feeding it the buffered bytes.

use quinn_proto::TransportError;
use quinn_proto::crypto::rustls::QuicServerConfig;
use quinn_proto::crypto::{
    self, ExportKeyingMaterialError, HeaderKey, KeyPair, Keys, PacketKey, Session, UnsupportedVersion,
};
use quinn_proto::transport_parameters::TransportParameters;
use quinn_proto::{ConnectionId, Side};
use std::any::Any;
use std::sync::Arc;

/// A server crypto configuration that serves clients with and without ALPN.
pub(crate) struct AlpnOptional {
    pub(crate) with_alpn: Arc<QuicServerConfig>,
    pub(crate) without_alpn: Arc<QuicServerConfig>,
}

impl crypto::ServerConfig for AlpnOptional {
    fn initial_keys(&self, version: u32, dst_cid: &ConnectionId) -> Result<Keys, UnsupportedVersion> {
        self.with_alpn.initial_keys(version, dst_cid)
    }

    fn retry_tag(&self, version: u32, orig_dst_cid: &ConnectionId, packet: &[u8]) -> [u8; 16] {
        self.with_alpn.retry_tag(version, orig_dst_cid, packet)
    }

    fn start_session(self: Arc<Self>, version: u32, params: &TransportParameters) -> Box<dyn Session> {
        Box::new(LazySession { cfg: self, version, params: *params, buf: Vec::new(), inner: None })
    }
}

struct LazySession {
    cfg: Arc<AlpnOptional>,
    version: u32,
    params: TransportParameters,
    buf: Vec<u8>,
    inner: Option<Box<dyn Session>>,
}

/// Whether a ClientHello body carries the ALPN extension (type 16). A hello this parser cannot
/// read is treated as offering ALPN, so rustls (the strict path) judges it.
fn offers_alpn(body: &[u8]) -> bool {
    fn skip(b: &[u8], at: usize, len_bytes: usize) -> Option<usize> {
        let len = match len_bytes {
            1 => usize::from(*b.get(at)?),
            _ => usize::from(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?])),
        };
        Some(at + len_bytes + len)
    }
    let parse = || -> Option<bool> {
        let mut at = 2 + 32; // legacy_version, random
        at = skip(body, at, 1)?; // session id
        at = skip(body, at, 2)?; // cipher suites
        at = skip(body, at, 1)?; // compression methods
        let end = skip(body, at, 2)?.min(body.len());
        at += 2;
        while at + 4 <= end {
            let ty = u16::from_be_bytes([body[at], body[at + 1]]);
            if ty == 16 {
                return Some(true);
            }
            at = skip(body, at + 2, 2)?;
        }
        Some(false)
    };
    parse().unwrap_or(true)
}

impl Session for LazySession {
    fn initial_keys(&self, dst_cid: &ConnectionId, side: Side) -> Keys {
        match &self.inner {
            Some(i) => i.initial_keys(dst_cid, side),
            None => crypto::ServerConfig::initial_keys(&*self.cfg.with_alpn, self.version, dst_cid)
                .expect("start_session is only called for a version initial_keys accepted"),
        }
    }

    fn handshake_data(&self) -> Option<Box<dyn Any>> {
        self.inner.as_ref()?.handshake_data()
    }

    fn peer_identity(&self) -> Option<Box<dyn Any>> {
        self.inner.as_ref()?.peer_identity()
    }

    fn early_crypto(&self) -> Option<(Box<dyn HeaderKey>, Box<dyn PacketKey>)> {
        self.inner.as_ref()?.early_crypto()
    }

    fn early_data_accepted(&self) -> Option<bool> {
        self.inner.as_ref()?.early_data_accepted()
    }

    fn is_handshaking(&self) -> bool {
        self.inner.as_ref().is_none_or(|i| i.is_handshaking())
    }

    fn read_handshake(&mut self, buf: &[u8]) -> Result<bool, TransportError> {
        if let Some(i) = &mut self.inner {
            return i.read_handshake(buf);
        }
        self.buf.extend_from_slice(buf);
        // The first handshake message is the ClientHello: type (1), length (3), body.
        if self.buf.len() < 4 {
            return Ok(false);
        }
        let len = usize::from(self.buf[1]) << 16 | usize::from(self.buf[2]) << 8 | usize::from(self.buf[3]);
        if self.buf.len() < 4 + len {
            return Ok(false);
        }
        let cfg = if offers_alpn(&self.buf[4..4 + len]) { &self.cfg.with_alpn } else { &self.cfg.without_alpn };
        let mut inner = crypto::ServerConfig::start_session(cfg.clone(), self.version, &self.params);
        let data = std::mem::take(&mut self.buf);
        let res = inner.read_handshake(&data);
        self.inner = Some(inner);
        res
    }

    fn transport_parameters(&self) -> Result<Option<TransportParameters>, TransportError> {
        match &self.inner {
            Some(i) => i.transport_parameters(),
            None => Ok(None),
        }
    }

    fn write_handshake(&mut self, buf: &mut Vec<u8>) -> Option<Keys> {
        self.inner.as_mut()?.write_handshake(buf)
    }

    fn next_1rtt_keys(&mut self) -> Option<KeyPair<Box<dyn PacketKey>>> {
        self.inner.as_mut()?.next_1rtt_keys()
    }

    fn is_valid_retry(&self, orig_dst_cid: &ConnectionId, header: &[u8], payload: &[u8]) -> bool {
        self.inner.as_ref().is_some_and(|i| i.is_valid_retry(orig_dst_cid, header, payload))
    }

    fn export_keying_material(
        &self,
        output: &mut [u8],
        label: &[u8],
        context: &[u8],
    ) -> Result<(), ExportKeyingMaterialError> {
        match &self.inner {
            Some(i) => i.export_keying_material(output, label, context),
            None => Err(ExportKeyingMaterialError),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_hellos_take_the_strict_path() {
        assert!(offers_alpn(&[]));
        assert!(offers_alpn(&[3, 3]));
        // A minimal hello with no extensions block at all cannot be read: strict path.
        let mut h = vec![3, 3];
        h.extend([0u8; 32]);
        h.extend([0, 0, 2, 0x13, 0x01, 1, 0]);
        assert!(offers_alpn(&h));
        // With an empty extensions block: no ALPN.
        h.extend([0, 0]);
        assert!(!offers_alpn(&h));
        // With an ALPN extension.
        let mut a = h.clone();
        let n = a.len();
        a[n - 1] = 4;
        a.extend([0, 16, 0, 0]);
        assert!(offers_alpn(&a));
    }
}
