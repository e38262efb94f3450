//! TLS for quinn: [`felix_driver_common::tls`] (certificates, keys, trust, rustls configurations)
//! plus dialing with the ALPN fallback.

pub use felix_driver_common::tls::*;

/// Whether a failed handshake is the peer refusing our ALPN offer (TLS alert 120).
pub fn refused_alpn(e: &quinn::ConnectionError) -> bool {
    let no_application_protocol = quinn::TransportErrorCode::crypto(120);
    match e {
        quinn::ConnectionError::ConnectionClosed(c) => c.error_code == no_application_protocol,
        quinn::ConnectionError::TransportError(t) => t.code == no_application_protocol,
        _ => false,
    }
}

/// Connects `endpoint` to `addr` with `cfg(offer_alpn)` as the client configuration, following
/// `alpn`: with [`AlpnOffer::Auto`], a refusal of `felix/1` is followed by one attempt offering
/// none. The error says which offer was refused and what to try.
///
/// # Errors
/// The handshake's failure, worded for a person.
pub async fn dial(
    endpoint: &quinn::Endpoint,
    addr: std::net::SocketAddr,
    server_name: &str,
    alpn: AlpnOffer,
    cfg: impl Fn(bool) -> Result<quinn::ClientConfig, String>,
) -> Result<quinn::Connection, String> {
    let attempt = async |offer: bool| -> Result<quinn::Connection, (bool, String)> {
        let connecting = endpoint.connect_with(cfg(offer).map_err(|e| (false, e))?, addr, server_name);
        let e = match connecting.map_err(|e| (false, e.to_string()))?.await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        Err(match (refused_alpn(&e), offer) {
            (true, true) => (
                true,
                format!("{addr} refused ALPN felix/1 (a broker that knows no ALPN id): connect with --alpn none"),
            ),
            (true, false) => {
                (true, format!("{addr} requires ALPN felix/1 and none was offered: connect with --alpn felix/1"))
            }
            (false, _) => (false, e.to_string()),
        })
    };
    let first = attempt(alpn != AlpnOffer::None).await;
    match first {
        Err((true, why)) if alpn == AlpnOffer::Auto => {
            tracing::debug!("{why}; connecting again offering no ALPN");
            attempt(false).await.map_err(|(_, m)| m)
        }
        other => other.map_err(|(_, m)| m),
    }
}
