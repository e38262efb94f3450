//! TLS 1.3 configuration for QUIC: certificates, keys, and the client's trust decision.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
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

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server's rustls configuration: TLS 1.3 only, ALPN `felix/1` (a client offering no ALPN
/// is accepted; one offering only other ids is refused by rustls).
///
/// # Errors
/// If rustls refuses the key or chain.
pub fn server_config(id: Identity) -> Result<rustls::ServerConfig, TlsError> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(id.chain, id.key)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.max_early_data_size = 0;
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

/// The client's rustls configuration.
///
/// # Errors
/// If a trusted certificate is malformed or rustls refuses the configuration.
pub fn client_config(trust: Trust, offer_alpn: bool) -> Result<rustls::ClientConfig, TlsError> {
    let builder =
        rustls::ClientConfig::builder_with_provider(provider()).with_protocol_versions(&[&rustls::version::TLS13])?;
    let mut cfg = match trust {
        Trust::Certificates(certs) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs {
                roots.add(c)?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        Trust::DangerAcceptAnyCertificate => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(AcceptAny(provider()))).with_no_client_auth()
        }
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
