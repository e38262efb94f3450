//! TLS 1.3 configuration for QUIC: certificates, keys, and the client's trust decision. Plain
//! rustls, shared by every driver (the tokio one wraps it for quinn, the blocking one for
//! quinn-proto).

pub use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, ServerName, UnixTime};
use std::path::Path;
use std::sync::Arc;

/// The ALPN id client listeners speak. Clients that offer none are accepted too (existing
/// clients predate the id).
pub const ALPN: &[u8] = b"felix/1";

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A PEM file holds no certificate or key, or a malformed one.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: String,
        /// What was wrong.
        what: String,
    },
    /// Generating a certificate failed.
    #[error("generating a certificate: {0}")]
    Generate(String),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A certificate chain and its key.
#[derive(Debug)]
pub struct Identity {
    /// The chain, leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The key.
    pub key: PrivateKeyDer<'static>,
}

impl Identity {
    /// A self-signed certificate for `names` (e.g. `localhost`), with its PEM texts.
    ///
    /// # Errors
    /// If generation fails.
    pub fn self_signed(names: &[&str]) -> Result<(Identity, String, String), TlsError> {
        let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        let ck = rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Generate(e.to_string()))?;
        let cert_pem = ck.cert.pem();
        let key_pem = ck.key_pair.serialize_pem();
        let chain = vec![ck.cert.der().clone()];
        let key =
            PrivateKeyDer::try_from(ck.key_pair.serialize_der()).map_err(|e| TlsError::Generate(e.to_string()))?;
        Ok((Identity { chain, key }, cert_pem, key_pem))
    }

    /// Loads a PEM certificate chain and key.
    ///
    /// # Errors
    /// Unreadable files, or files without a certificate or key.
    pub fn load(cert: &Path, key: &Path) -> Result<Identity, TlsError> {
        Ok(Identity { chain: load_certs(cert)?, key: load_key(key)? })
    }
}

/// A certificate's SHA-256 fingerprint, as `AB:CD:...` (what `openssl x509 -fingerprint
/// -sha256` prints), for an operator to check what clients will see.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    d.as_ref().iter().map(|b| format!("{b:02X}")).collect::<Vec<_>>().join(":")
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Io { path: path.display().to_string(), source })
}

/// Loads every certificate of a PEM file.
///
/// # Errors
/// An unreadable file, or one with no certificate.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let data = read(path)?;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&data).collect();
    let certs = certs.map_err(|e| TlsError::Pem { path: path.display().to_string(), what: e.to_string() })?;
    if certs.is_empty() {
        return Err(TlsError::Pem { path: path.display().to_string(), what: "no certificate found".into() });
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let data = read(path)?;
    PrivateKeyDer::from_pem_slice(&data)
        .map_err(|e| TlsError::Pem { path: path.display().to_string(), what: e.to_string() })
}

/// rustls's *ring* provider with AES-128-GCM first. Every TLS 1.3 peer implements it (it is the
/// one mandatory suite), it has 128-bit security, and with AES-NI it costs fewer cycles per byte
/// than AES-256-GCM (10 rounds instead of 14) on the packet protection that dominates a busy
/// connection. The broker applies its own order (`ignore_client_order`), so clients that prefer
/// AES-256 still get AES-128; both remain accepted, with ChaCha20-Poly1305 for hosts without AES
/// instructions.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256];
    Arc::new(p)
}

/// The server's rustls configuration: TLS 1.3 only, ALPN `felix/1` (a client offering no ALPN
/// is accepted; one offering only other ids is refused by rustls).
///
/// # Errors
/// If rustls refuses the key or chain.
pub fn server_config(id: Identity) -> Result<rustls::ServerConfig, TlsError> {
    server_config_with(id, None)
}

/// [`server_config`], also asking clients for a certificate when `client_ca` is given: one
/// that presents a certificate must present one that chains to those CA certificates (or the
/// handshake fails); one that presents none is served too and authenticates with a token.
///
/// # Errors
/// If rustls refuses the key, the chain or a CA certificate.
pub fn server_config_with(
    id: Identity,
    client_ca: Option<&[CertificateDer<'static>]>,
) -> Result<rustls::ServerConfig, TlsError> {
    let builder =
        rustls::ServerConfig::builder_with_provider(provider()).with_protocol_versions(&[&rustls::version::TLS13])?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(cas) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in cas {
                roots.add(c.clone())?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Generate(format!("client certificate verifier: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut cfg = builder.with_single_cert(id.chain, id.key)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.max_early_data_size = 0;
    cfg.ignore_client_order = true;
    Ok(cfg)
}

/// How a client decides to trust the broker.
#[derive(Debug, Clone)]
pub enum Trust {
    /// Trust these certificates (the broker's own, or a CA).
    Certificates(Vec<CertificateDer<'static>>),
    /// Accept any certificate. For development against a throwaway broker only: it gives up
    /// every protection TLS offers against an active attacker.
    DangerAcceptAnyCertificate,
}

/// Which ALPN id a client offers in its TLS handshake.
///
/// Released Felix brokers know no ALPN id and refuse a client that offers one (TLS alert 120,
/// `no_application_protocol`); current ones speak `felix/1` and accept a client that offers
/// none, unless they require ALPN. `Auto` works with all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AlpnOffer {
    /// Offer `felix/1`; if the broker refuses the handshake for it (alert 120), connect once more
    /// offering none. Costs one extra round trip, once, against a broker that knows no ALPN.
    #[default]
    Auto,
    /// Offer `felix/1` only (for a broker that requires it; fails against one that knows none).
    Felix1,
    /// Offer none, as existing Felix clients do (fails against a broker that requires ALPN).
    None,
}

impl std::str::FromStr for AlpnOffer {
    type Err = String;
    fn from_str(s: &str) -> Result<AlpnOffer, String> {
        match s {
            "auto" => Ok(AlpnOffer::Auto),
            "felix/1" => Ok(AlpnOffer::Felix1),
            "none" => Ok(AlpnOffer::None),
            other => Err(format!("{other:?}: expected auto, felix/1 or none")),
        }
    }
}

impl std::fmt::Display for AlpnOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AlpnOffer::Auto => "auto",
            AlpnOffer::Felix1 => "felix/1",
            AlpnOffer::None => "none",
        })
    }
}
/// The client's rustls configuration.
///
/// # Errors
/// If a trusted certificate is malformed or rustls refuses the configuration.
pub fn client_config(trust: Trust, offer_alpn: bool) -> Result<rustls::ClientConfig, TlsError> {
    client_config_with(trust, offer_alpn, None)
}

/// [`client_config`], presenting `cert` (a client certificate chain and its key) when the
/// broker asks for one (mutual TLS).
///
/// # Errors
/// If a trusted certificate is malformed or rustls refuses the configuration or the key.
pub fn client_config_with(
    trust: Trust,
    offer_alpn: bool,
    cert: Option<&Identity>,
) -> Result<rustls::ClientConfig, TlsError> {
    let builder =
        rustls::ClientConfig::builder_with_provider(provider()).with_protocol_versions(&[&rustls::version::TLS13])?;
    let builder = match trust {
        Trust::Certificates(certs) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs {
                roots.add(c)?;
            }
            builder.with_root_certificates(roots)
        }
        Trust::DangerAcceptAnyCertificate => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(AcceptAny(provider())))
        }
    };
    let mut cfg = match cert {
        None => builder.with_no_client_auth(),
        Some(id) => builder.with_client_auth_cert(id.chain.clone(), id.key.clone_key())?,
    };
    if offer_alpn {
        cfg.alpn_protocols = vec![ALPN.to_vec()];
    }
    Ok(cfg)
}

#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The QUIC server crypto for `id`: TLS 1.3 with ALPN `felix/1`, and, unless `require_alpn`,
/// also serving clients that offer no ALPN (existing Felix clients; see [`crate::alpn`]).
///
/// # Errors
/// If rustls refuses the key or chain.
pub fn quic_server_crypto(
    id: Identity,
    require_alpn: bool,
) -> Result<Arc<dyn quinn_proto::crypto::ServerConfig>, TlsError> {
    quic_server_crypto_with(id, require_alpn, None)
}

/// [`quic_server_crypto`], verifying client certificates against `client_ca` when given
/// ([`server_config_with`]).
///
/// # Errors
/// If rustls refuses the key, the chain or a CA certificate.
pub fn quic_server_crypto_with(
    id: Identity,
    require_alpn: bool,
    client_ca: Option<&[CertificateDer<'static>]>,
) -> Result<Arc<dyn quinn_proto::crypto::ServerConfig>, TlsError> {
    use quinn_proto::crypto::rustls::QuicServerConfig;
    let quic = |tls: rustls::ServerConfig| {
        QuicServerConfig::try_from(tls).map(Arc::new).map_err(|e| TlsError::Generate(e.to_string()))
    };
    let tls = server_config_with(id, client_ca)?;
    let with_alpn = quic(tls.clone())?;
    if require_alpn {
        return Ok(with_alpn);
    }
    let mut bare = tls;
    bare.alpn_protocols.clear();
    let without_alpn = quic(bare)?;
    Ok(Arc::new(crate::alpn::AlpnOptional { with_alpn, without_alpn }))
}

/// The QUIC client crypto for `trust`, offering ALPN `felix/1` or none.
///
/// # Errors
/// If a trusted certificate is malformed or rustls refuses the configuration.
pub fn quic_client_crypto(
    trust: Trust,
    offer_alpn: bool,
) -> Result<Arc<dyn quinn_proto::crypto::ClientConfig>, TlsError> {
    let tls = client_config(trust, offer_alpn)?;
    quinn_proto::crypto::rustls::QuicClientConfig::try_from(tls)
        .map(|c| Arc::new(c) as Arc<dyn quinn_proto::crypto::ClientConfig>)
        .map_err(|e| TlsError::Generate(e.to_string()))
}

/// The names a verified client certificate (its leaf) carries, which a broker maps to a
/// credential: every subject common name, then every DNS, URI and e-mail subject alternative
/// name, in the certificate's order. A certificate that does not parse carries none.
pub fn cert_names(leaf: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(leaf.as_ref()) else { return Vec::new() };
    let mut names: Vec<String> =
        cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok()).map(str::to_owned).collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(s) | GeneralName::URI(s) | GeneralName::RFC822Name(s) => {
                    names.push((*s).to_owned())
                }
                _ => {}
            }
        }
    }
    names.dedup();
    names
}

/// A certificate authority for tests and development: a self-signed CA, and leaf certificates
/// it signs (a broker's, or a client's for mutual TLS).
pub struct TestCa {
    key: rcgen::KeyPair,
    cert: rcgen::Certificate,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").field("fingerprint", &fingerprint(self.cert.der())).finish_non_exhaustive()
    }
}

impl TestCa {
    /// A fresh CA named `name`.
    ///
    /// # Errors
    /// If generation fails.
    pub fn new(name: &str) -> Result<TestCa, TlsError> {
        let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(g)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let key = rcgen::KeyPair::generate().map_err(g)?;
        let cert = params.self_signed(&key).map_err(g)?;
        Ok(TestCa { key, cert })
    }

    /// The CA's certificate (what a broker trusts for client certificates, or a client for
    /// the broker's).
    pub fn cert(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// The CA's certificate as PEM.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// A leaf certificate signed by the CA with subject common name `common_name` and DNS
    /// subject alternative names `dns`, with its PEM texts (certificate, key).
    ///
    /// # Errors
    /// If generation fails.
    pub fn issue(&self, common_name: &str, dns: &[&str]) -> Result<(Identity, String, String), TlsError> {
        let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
        let mut params =
            rcgen::CertificateParams::new(dns.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).map_err(g)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, common_name);
        let key = rcgen::KeyPair::generate().map_err(g)?;
        let cert = params.signed_by(&key, &self.cert, &self.key).map_err(g)?;
        let der = PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| TlsError::Generate(e.to_string()))?;
        let id = Identity { chain: vec![cert.der().clone()], key: der };
        Ok((id, cert.pem(), key.serialize_pem()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::CipherSuite;

    /// A TLS 1.3 handshake in memory between our broker's configuration and a client that
    /// offers `suites` (in its order of preference); the suite the broker chose.
    fn negotiated(suites: Vec<rustls::SupportedCipherSuite>) -> CipherSuite {
        let (id, _, _) = Identity::self_signed(&["localhost"]).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(id.chain[0].clone()).unwrap();
        let server = Arc::new(server_config(id).unwrap());
        let mut p = rustls::crypto::ring::default_provider();
        p.cipher_suites = suites;
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(p))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut c = rustls::ClientConnection::new(Arc::new(client), "localhost".try_into().unwrap()).unwrap();
        let mut s = rustls::ServerConnection::new(server).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut &buf[..]).unwrap();
            s.process_new_packets().unwrap();
            buf.clear();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut &buf[..]).unwrap();
            c.process_new_packets().unwrap();
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
        }
        assert!(!s.is_handshaking(), "the handshake completed");
        s.negotiated_cipher_suite().unwrap().suite()
    }

    /// Runs a handshake in memory; the server's view of the client's certificate names, or
    /// the error that stopped it.
    fn mutual(server: rustls::ServerConfig, client: rustls::ClientConfig) -> Result<Vec<String>, String> {
        let mut c = rustls::ClientConnection::new(Arc::new(client), "localhost".try_into().unwrap()).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut &buf[..]).unwrap();
            s.process_new_packets().map_err(|e| e.to_string())?;
            buf.clear();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut &buf[..]).unwrap();
            c.process_new_packets().map_err(|e| e.to_string())?;
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
        }
        // TLS 1.3: the server judges the client's certificate after the client's last flight.
        let mut buf = Vec::new();
        c.write_tls(&mut buf).unwrap();
        s.read_tls(&mut &buf[..]).unwrap();
        s.process_new_packets().map_err(|e| e.to_string())?;
        Ok(s.peer_certificates().and_then(|c| c.first()).map(cert_names).unwrap_or_default())
    }

    /// Mutual TLS: a client certificate the configured CA signed is accepted and its names
    /// read; one from another CA fails the handshake; a client with none is still served.
    #[test]
    fn client_certificates_from_the_configured_ca_are_verified_and_named() {
        let ca = TestCa::new("felix test CA").unwrap();
        let server = || {
            let (id, _, _) = ca.issue("broker", &["localhost"]).unwrap();
            server_config_with(id, Some(&[ca.cert()])).unwrap()
        };
        let trust = || Trust::Certificates(vec![ca.cert()]);
        let (client, _, _) = ca.issue("svc-orders", &["orders.internal"]).unwrap();
        let names = mutual(server(), client_config_with(trust(), false, Some(&client)).unwrap()).unwrap();
        assert_eq!(names, ["svc-orders", "orders.internal"]);
        let other = TestCa::new("someone else").unwrap();
        let (stranger, _, _) = other.issue("svc-orders", &[]).unwrap();
        let refused = mutual(server(), client_config_with(trust(), false, Some(&stranger)).unwrap());
        assert!(refused.is_err(), "a certificate from another CA is refused: {refused:?}");
        let anonymous = mutual(server(), client_config_with(trust(), false, None).unwrap()).unwrap();
        assert!(anonymous.is_empty(), "no certificate, no names, still served");
        // Without a client CA the broker asks for none (a client's certificate is not sent).
        let (id, _, _) = ca.issue("broker", &["localhost"]).unwrap();
        let plain = mutual(server_config(id).unwrap(), client_config_with(trust(), false, Some(&client)).unwrap());
        assert_eq!(plain, Ok(Vec::new()));
        assert!(cert_names(&CertificateDer::from(vec![1u8, 2, 3])).is_empty(), "garbage names nothing");
    }

    #[test]
    fn the_broker_chooses_aes_128_even_for_clients_that_prefer_aes_256() {
        // rustls's default order, which existing Felix clients send: AES-256 first.
        let default = rustls::crypto::ring::default_provider().cipher_suites;
        assert_eq!(default[0].suite(), CipherSuite::TLS13_AES_256_GCM_SHA384, "the premise");
        assert_eq!(negotiated(default), CipherSuite::TLS13_AES_128_GCM_SHA256);
    }

    #[test]
    fn clients_offering_only_aes_256_or_chacha_are_still_served() {
        use rustls::crypto::ring::cipher_suite::{TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256};
        assert_eq!(negotiated(vec![TLS13_AES_256_GCM_SHA384]), CipherSuite::TLS13_AES_256_GCM_SHA384);
        assert_eq!(negotiated(vec![TLS13_CHACHA20_POLY1305_SHA256]), CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
    }
}
