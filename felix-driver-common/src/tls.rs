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
    /// A cluster CA's files are not a CA certificate and its key as `cluster init-ca` writes
    /// them.
    #[error("cluster CA {path}: {what}")]
    Ca {
        /// The CA's directory or file.
        path: String,
        /// What was wrong.
        what: String,
    },
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
/// also serving clients that offer no ALPN (existing Felix clients; see the `alpn` module).
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

/// A certificate authority: a self-signed CA, and leaf certificates it signs (a broker's, or a
/// client's for mutual TLS). A cluster's brokers share one (`cluster init-ca`, `serve
/// --cluster-ca`) so that a client trusts one file whichever broker a redirect sends it to.
pub struct CertAuthority {
    key: rcgen::KeyPair,
    /// What rcgen signs leaves with: the CA's name and key identifier. Its own signature is
    /// not the file's when the CA was loaded (rcgen re-signs), so `der` is kept beside it.
    cert: rcgen::Certificate,
    /// The CA certificate as written to `ca.pem`: what leaves chain to and clients trust.
    der: CertificateDer<'static>,
}

/// `der` as PEM body lines of 64 characters, each ending in a newline.
fn base64_lines(der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 1);
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out
}

/// The file names of a CA directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// The CA's private key, readable by its owner only.
pub const CA_KEY_FILE: &str = "ca.key";

impl std::fmt::Debug for CertAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertAuthority").field("fingerprint", &fingerprint(self.cert.der())).finish_non_exhaustive()
    }
}

impl CertAuthority {
    /// A fresh CA named `name`.
    ///
    /// # Errors
    /// If generation fails.
    pub fn new(name: &str) -> Result<CertAuthority, TlsError> {
        let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
        let key = rcgen::KeyPair::generate().map_err(g)?;
        let cert = Self::params(name)?.self_signed(&key).map_err(g)?;
        let der = cert.der().clone();
        Ok(CertAuthority { key, cert, der })
    }

    /// What a CA named `name` is made from. Loading rebuilds the same parameters, so a
    /// loaded CA names itself as issuer with exactly the bytes of the written certificate.
    fn params(name: &str) -> Result<rcgen::CertificateParams, TlsError> {
        let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(g)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        Ok(params)
    }

    /// A CA from its PEM certificate and key (as [`CertAuthority::save`] writes them). `path`
    /// names them in errors.
    ///
    /// # Errors
    /// [`TlsError::Ca`] when the certificate is not a CA, the key is not its key, or the CA
    /// was not made by Felix (its name cannot be reproduced byte for byte; issue brokers'
    /// certificates with your own tools and give them with `--tls-cert` instead).
    pub fn from_pem(cert_pem: &str, key_pem: &str, path: &str) -> Result<CertAuthority, TlsError> {
        let bad = |what: String| TlsError::Ca { path: path.to_owned(), what };
        let der =
            CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| bad(format!("{CA_CERT_FILE}: {e}")))?;
        let key = rcgen::KeyPair::from_pem(key_pem).map_err(|e| bad(format!("{CA_KEY_FILE}: {e}")))?;
        let (_, x509) = x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| bad(format!("{CA_CERT_FILE}: not an X.509 certificate: {e}")))?;
        if !x509.is_ca() {
            return Err(bad(format!("{CA_CERT_FILE} is not a CA certificate")));
        }
        if x509.public_key().raw != key.public_key_der().as_slice() {
            return Err(bad(format!("{CA_KEY_FILE} is not the key of {CA_CERT_FILE}")));
        }
        let name = x509
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .ok_or_else(|| bad(format!("{CA_CERT_FILE} has no common name")))?
            .to_owned();
        let cert = Self::params(&name)?.self_signed(&key).map_err(|e| TlsError::Generate(e.to_string()))?;
        let same_name = x509_parser::parse_x509_certificate(cert.der().as_ref())
            .is_ok_and(|(_, again)| again.subject().as_raw() == x509.subject().as_raw());
        if !same_name {
            return Err(bad(format!(
                "{CA_CERT_FILE} was not made by `felix-node cluster init-ca`; issue the brokers' certificates \
                 with the tools that made it and give each broker its own with --tls-cert/--tls-key"
            )));
        }
        Ok(CertAuthority { key, cert, der: der.into_owned() })
    }

    /// Loads the CA kept in `dir` (`ca.pem`, `ca.key`).
    ///
    /// # Errors
    /// Unreadable files, or as [`CertAuthority::from_pem`].
    pub fn load(dir: &Path) -> Result<CertAuthority, TlsError> {
        let read = |f: &str| {
            let p = dir.join(f);
            std::fs::read_to_string(&p).map_err(|source| TlsError::Io { path: p.display().to_string(), source })
        };
        Self::from_pem(&read(CA_CERT_FILE)?, &read(CA_KEY_FILE)?, &dir.display().to_string())
    }

    /// The CA kept in `dir`, or a new one named `name` made there when `dir` holds none (the
    /// second value says so). Several brokers started at once with the same directory agree
    /// on one CA: the new files are written beside it and renamed into place as a whole, and
    /// the one that loses the rename loads the winner's.
    ///
    /// # Errors
    /// As [`CertAuthority::load`], or the directory cannot be written.
    pub fn load_or_create(dir: &Path, name: &str) -> Result<(CertAuthority, bool), TlsError> {
        let io = |p: &Path| {
            let path = p.display().to_string();
            move |source| TlsError::Io { path, source }
        };
        if dir.join(CA_CERT_FILE).exists() || dir.join(CA_KEY_FILE).exists() {
            return Self::load(dir).map(|ca| (ca, false));
        }
        let ca = CertAuthority::new(name)?;
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(io(parent))?;
        let base = dir.file_name().map_or_else(|| "ca".into(), |n| n.to_string_lossy().into_owned());
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = parent.join(format!(".{base}.new-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        ca.save(&tmp)?;
        // An empty directory is replaced (the operator made it for us); a full one means
        // another broker won.
        if dir.exists() && std::fs::read_dir(dir).map_err(io(dir))?.next().is_none() {
            let _ = std::fs::remove_dir(dir);
        }
        match std::fs::rename(&tmp, dir) {
            Ok(()) => Ok((ca, true)),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                if dir.join(CA_KEY_FILE).exists() { Self::load(dir).map(|ca| (ca, false)) } else { Err(io(dir)(e)) }
            }
        }
    }

    /// Writes `ca.pem` and `ca.key` (mode 0600) into `dir`, refusing to overwrite either.
    ///
    /// # Errors
    /// The directory cannot be written, or already holds a CA.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        use std::io::Write;
        let io = |p: &Path| {
            let path = p.display().to_string();
            move |source| TlsError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        for (file, data, private) in
            [(CA_CERT_FILE, self.cert_pem(), false), (CA_KEY_FILE, self.key.serialize_pem(), true)]
        {
            let p = dir.join(file);
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            if private {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600);
            }
            #[cfg(not(unix))]
            let _ = private;
            let mut f = opts.open(&p).map_err(io(&p))?;
            f.write_all(data.as_bytes()).and_then(|()| f.sync_all()).map_err(io(&p))?;
        }
        Ok(())
    }

    /// The CA's certificate (what a broker trusts for client certificates, or a client for
    /// the broker's).
    pub fn cert(&self) -> CertificateDer<'static> {
        self.der.clone()
    }

    /// The CA's certificate as PEM.
    pub fn cert_pem(&self) -> String {
        let b64 = base64_lines(self.der.as_ref());
        format!("-----BEGIN CERTIFICATE-----\n{b64}-----END CERTIFICATE-----\n")
    }

    /// A broker's certificate for `names` (the first is its common name), signed by the CA,
    /// as an identity whose chain carries the CA certificate after the leaf, and its PEM texts
    /// (that chain, the key). A client that trusts a broker's `cert.pem` thereby trusts the
    /// CA, and so every broker of the cluster.
    ///
    /// # Errors
    /// If generation fails.
    pub fn issue_chain(&self, names: &[&str]) -> Result<(Identity, String, String), TlsError> {
        let cn = names.first().copied().unwrap_or("felix broker");
        let (mut id, mut pem, key) = self.issue(cn, names)?;
        id.chain.push(self.cert());
        pem.push_str(&self.cert_pem());
        Ok((id, pem, key))
    }

    /// A leaf certificate signed by the CA with subject common name `common_name` and DNS
    /// subject alternative names `dns`, with its PEM texts (certificate, key).
    ///
    /// # Errors
    /// If generation fails.
    pub fn issue(&self, common_name: &str, dns: &[&str]) -> Result<(Identity, String, String), TlsError> {
        // Leaves carry the CA's name as issuer; rcgen takes it from `self.cert`, rebuilt on
        // load from the same parameters (checked there to match the file).
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
        let ca = CertAuthority::new("felix test CA").unwrap();
        let server = || {
            let (id, _, _) = ca.issue("broker", &["localhost"]).unwrap();
            server_config_with(id, Some(&[ca.cert()])).unwrap()
        };
        let trust = || Trust::Certificates(vec![ca.cert()]);
        let (client, _, _) = ca.issue("svc-orders", &["orders.internal"]).unwrap();
        let names = mutual(server(), client_config_with(trust(), false, Some(&client)).unwrap()).unwrap();
        assert_eq!(names, ["svc-orders", "orders.internal"]);
        let other = CertAuthority::new("someone else").unwrap();
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

    /// A cluster CA written by one broker and loaded by another issues certificates that a
    /// client trusting only `ca.pem`, or only one broker's `cert.pem` (leaf and CA), accepts
    /// from every broker; a broker with its own self-signed certificate is still refused.
    #[test]
    fn a_saved_cluster_ca_loads_and_its_brokers_are_trusted_through_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("ca");
        let (first, made) = CertAuthority::load_or_create(&ca_dir, "felix cluster CA").unwrap();
        assert!(made);
        let (again, made) = CertAuthority::load_or_create(&ca_dir, "ignored").unwrap();
        assert!(!made, "the second broker loads the first one's CA");
        assert_eq!(again.cert(), first.cert(), "the CA certificate is the file's, byte for byte");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(ca_dir.join(CA_KEY_FILE)).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "the CA key is private");
        }
        let ca_file = load_certs(&ca_dir.join(CA_CERT_FILE)).unwrap();
        let (b1, b1_pem, _) = first.issue_chain(&["localhost", "127.0.0.1"]).unwrap();
        let (b2, _, _) = again.issue_chain(&["localhost"]).unwrap();
        assert_eq!(b1.chain.len(), 2, "leaf, then the CA");
        let one_brokers_file =
            CertificateDer::pem_slice_iter(b1_pem.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap();
        assert_eq!(one_brokers_file.len(), 2);
        for trust in [ca_file.clone(), one_brokers_file] {
            for broker in [&b1, &b2] {
                let id = Identity { chain: broker.chain.clone(), key: broker.key.clone_key() };
                let client = client_config_with(Trust::Certificates(trust.clone()), false, None).unwrap();
                assert_eq!(mutual(server_config(id).unwrap(), client), Ok(Vec::new()));
            }
        }
        let (stranger, _, _) = Identity::self_signed(&["localhost"]).unwrap();
        let client = client_config_with(Trust::Certificates(ca_file), false, None).unwrap();
        assert!(mutual(server_config(stranger).unwrap(), client).is_err(), "a broker outside the CA is refused");
    }

    /// Files that are not a Felix cluster CA are refused with what is wrong, not used.
    #[test]
    fn a_cluster_ca_that_is_not_one_is_refused_with_the_reason() {
        let ca = CertAuthority::new("c").unwrap();
        let other = CertAuthority::new("c").unwrap();
        let key = ca.key.serialize_pem();
        let err = |r: Result<CertAuthority, TlsError>| r.map(|_| ()).unwrap_err().to_string();
        assert!(err(CertAuthority::from_pem(&ca.cert_pem(), &other.key.serialize_pem(), "d")).contains("not the key"));
        let (_, leaf_pem, leaf_key) = ca.issue("leaf", &["localhost"]).unwrap();
        assert!(err(CertAuthority::from_pem(&leaf_pem, &leaf_key, "d")).contains("not a CA"));
        assert!(err(CertAuthority::from_pem("garbage", &key, "d")).contains(CA_CERT_FILE));
        assert!(err(CertAuthority::from_pem(&ca.cert_pem(), "garbage", "d")).contains(CA_KEY_FILE));
        // A CA made elsewhere, whose name Felix would not write the same way.
        let mut params = CertAuthority::params("c").unwrap();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "Example");
        let k = rcgen::KeyPair::generate().unwrap();
        let foreign = params.self_signed(&k).unwrap();
        assert!(err(CertAuthority::from_pem(&foreign.pem(), &k.serialize_pem(), "d")).contains("--tls-cert"));
        // A half-written directory (a key without its certificate) is not silently replaced.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CA_KEY_FILE), key).unwrap();
        assert!(err(CertAuthority::load_or_create(dir.path(), "c").map(|(c, _)| c)).contains(CA_CERT_FILE));
        assert!(ca.save(dir.path()).is_err(), "save never overwrites a CA key");
    }

    /// Brokers started at once with one CA directory end up with one CA between them.
    #[test]
    fn brokers_creating_the_cluster_ca_at_once_agree_on_one() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("cluster-ca");
        let certs: Vec<CertificateDer<'static>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| CertAuthority::load_or_create(&ca_dir, "c").map(|(c, _)| c.cert())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(certs.windows(2).all(|w| w[0] == w[1]), "one CA");
        assert_eq!(certs[0], CertAuthority::load(&ca_dir).unwrap().cert());
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
