//! Client certificates, refreshed tokens, clients of a draining or silent broker.

use super::*;

/// Mutual TLS over real QUIC: a client certificate the broker's client CA signed authenticates
/// an `auth` with an empty token as the `client_certs` entry naming it (its grants apply: a
/// publish is allowed, a subscribe forbidden); a certificate whose name is not mapped, no
/// certificate at all with an empty token, and the right name for another tenant are refused
/// `unauthenticated`; a certificate from another CA fails the handshake; token clients on the
/// same broker are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_as_the_principal_they_map_to() {
    use felix_driver_tokio::tls::CertAuthority;
    use felix_proto::broker::{Action, Grant};
    let ca = CertAuthority::new("clients CA").unwrap();
    let (broker_id, _, _) = ca.issue("broker", &["localhost"]).unwrap();
    let opts = ServerOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        broker: BrokerConfig {
            tokens: vec![TokenGrant::dev(TOKEN)],
            client_certs: vec![TokenGrant {
                token: "orders.internal".into(),
                tenant_id: Some("t1".into()),
                principal: "orders-service".into(),
                grants: vec![Grant { action: Action::Publish, pattern: "default/*".into() }],
            }],
            ..BrokerConfig::default()
        },
        identity: broker_id,
        data_dir: None,
        fsync: FsyncMode::Never,
        transport: TransportTuning::default(),
        require_alpn: false,
        metrics_listen: None,
        http: None,
        cluster: None,
        client_ca: Some(vec![ca.cert()]),
    };
    let server = Server::start(opts).await.unwrap();
    let trust = Trust::Certificates(vec![ca.cert()]);
    let connect_as = |tenant: &str, token: &str, cert: Option<Identity>| {
        let mut o = ClientOptions::new(tenant, token, trust.clone());
        o.client_cert = cert.map(std::sync::Arc::new);
        Client::connect(server.local_addr(), o)
    };
    let code = |r: Result<Client, ClientError>| match r {
        Err(ClientError::Refused(e)) => e.code.map(|c| c.name().into_owned()).unwrap_or_default(),
        Err(e) => format!("{e}"),
        Ok(_) => "connected".into(),
    };
    // The mapped certificate (its DNS name): publish allowed, subscribe forbidden.
    let (svc, _, _) = ca.issue("svc-orders", &["orders.internal"]).unwrap();
    let c = connect_as("t1", "", Some(svc)).await.expect("the certificate authenticates");
    let ack = c
        .publish(
            "default",
            "orders",
            vec![Bytes::from("by certificate")],
            PublishOptions { ack: true, ..Default::default() },
        )
        .await;
    assert!(ack.is_ok(), "{ack:?}");
    let sub = c.subscribe("default", "orders", None, None).await;
    assert!(matches!(&sub, Err(ClientError::Refused(e)) if e.code == Some(ErrorCode::Forbidden)), "{sub:?}");
    // Not mapped, no certificate, another tenant: unauthenticated.
    let (unmapped, _, _) = ca.issue("svc-billing", &["billing.internal"]).unwrap();
    assert_eq!(code(connect_as("t1", "", Some(unmapped)).await), "unauthenticated");
    assert_eq!(code(connect_as("t1", "", None).await), "unauthenticated");
    let (svc, _, _) = ca.issue("svc-orders", &["orders.internal"]).unwrap();
    assert_eq!(code(connect_as("t2", "", Some(svc)).await), "unauthenticated");
    // Another CA's certificate: the handshake fails.
    let other = CertAuthority::new("someone else").unwrap();
    let (stranger, _, _) = other.issue("svc-orders", &["orders.internal"]).unwrap();
    let refused = connect_as("t1", "", Some(stranger)).await;
    assert!(
        matches!(refused, Err(ClientError::Connect(_) | ClientError::Closed(_) | ClientError::Tls(_))),
        "{:?}",
        refused.err()
    );
    // A token client on the same broker is unaffected, and a certificate with a token uses the token.
    let c = connect_as("t1", TOKEN, None).await.expect("token clients still work");
    assert!(c.subscribe("default", "orders", Some(StartPosition::Earliest), None).await.is_ok());
    let (svc, _, _) = ca.issue("svc-orders", &["orders.internal"]).unwrap();
    let c = connect_as("t1", TOKEN, Some(svc)).await.unwrap();
    assert!(
        c.subscribe("default", "orders", None, None).await.is_ok(),
        "the dev token's grants, not the certificate's"
    );
    server.shutdown().await;
}

/// Token refresh through the embedder's callback: a client holding signed tokens that live 3 s
/// publishes acked for 5 s without one refusal (the callback's fresh tokens take over before
/// each expires); a client with the same kind of token and no refresh is refused `revoked`
/// once its token expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_refreshed_through_the_callback_keeps_a_client_working_past_its_expiry() {
    use felix_driver_tokio::TokenRefresh;
    use felix_proto::jwt::{Claims, Jwks, Verifier, mint, public_key, rfc8032_test_key};
    let key = rfc8032_test_key();
    let verifier = Verifier::new(Jwks::single("k1", &public_key(&key).unwrap()));
    let (server, chain) = start_with(None, BrokerConfig { jwt: Some(verifier), ..BrokerConfig::default() }).await;
    let minted = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let fresh = {
        let minted = minted.clone();
        move || {
            minted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
            let c = Claims {
                iss: "felix-auth".into(),
                aud: "felix-broker".into(),
                sub: "svc".into(),
                tid: "t1".into(),
                exp: now + 3,
                iat: now,
                nbf: None,
                jti: None,
                perms: vec!["stream.publish:stream:t1/*/*".into()],
            };
            mint(&rfc8032_test_key(), "k1", &c).map_err(|e| e.to_string())
        }
    };
    let connect = |refresh: bool| {
        let mut o = ClientOptions::new("t1", fresh().unwrap(), Trust::Certificates(chain.clone()));
        if refresh {
            o.token_refresh = Some(TokenRefresh::new(fresh.clone()));
        }
        Client::connect(server.local_addr(), o)
    };
    let refreshed = connect(true).await.unwrap();
    let plain = connect(false).await.unwrap();
    let start = std::time::Instant::now();
    let (mut ok, mut plain_refused) = (0, None);
    while start.elapsed() < Duration::from_secs(5) {
        let opts = PublishOptions { ack: true, ..Default::default() };
        let r = refreshed.publish("default", "orders", vec![Bytes::from("x")], opts.clone()).await;
        assert!(r.is_ok(), "refused after {:?}: {r:?}", start.elapsed());
        ok += 1;
        if plain_refused.is_none()
            && let Err(ClientError::Refused(e)) = plain.publish("default", "orders", vec![Bytes::from("y")], opts).await
        {
            assert_eq!(e.code, Some(ErrorCode::Revoked), "{e:?}");
            plain_refused = Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok >= 20, "{ok} publishes");
    assert!(minted.load(std::sync::atomic::Ordering::Relaxed) >= 3, "the callback was asked for fresh tokens");
    let refused_at = plain_refused.expect("the client without refresh is refused once its token expired");
    assert!(refused_at >= Duration::from_secs(2), "{refused_at:?}");
    server.shutdown().await;
}

/// Starts a broker on `listen` with the certificate in `dir` (the same one on every start).
async fn serve_with_cert(dir: &Path, listen: std::net::SocketAddr) -> Server {
    let opts = ServerOptions {
        listen,
        broker: BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], ..BrokerConfig::default() },
        identity: Identity::load(&dir.join("cert.pem"), &dir.join("key.pem")).unwrap(),
        data_dir: None,
        fsync: FsyncMode::Never,
        transport: TransportTuning::default(),
        require_alpn: false,
        metrics_listen: None,
        http: None,
        cluster: None,
        client_ca: None,
    };
    Server::start(opts).await.unwrap()
}

async fn publish_through(c: &felix_driver_tokio::ClusterClient) -> Result<Option<u64>, ClientError> {
    let o = PublishOptions { ack: true, ..PublishOptions::default() };
    c.publish("default", "orders", vec![Bytes::from("x")], o).await
}

/// A draining broker's clients go elsewhere: a `ClusterClient` with two seeds keeps publishing
/// through the second once the first drained and stopped; with a single seed it waits and
/// retries until the broker is back (restarted on the same address and certificate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_a_draining_broker_reconnect_elsewhere_or_wait_for_it() {
    use felix_driver_tokio::ClusterClient;
    let dir = tempfile::tempdir().unwrap();
    let (_, cert, key) = Identity::self_signed(&["localhost"]).unwrap();
    std::fs::write(dir.path().join("cert.pem"), &cert).unwrap();
    std::fs::write(dir.path().join("key.pem"), &key).unwrap();
    let chain = Identity::load(&dir.path().join("cert.pem"), &dir.path().join("key.pem")).unwrap().chain;
    let a = serve_with_cert(dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let b = serve_with_cert(dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let (a_addr, b_addr) = (a.local_addr(), b.local_addr());
    let opts = || ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.clone()));
    let two = ClusterClient::connect(&[a_addr, b_addr], opts()).await.unwrap();
    publish_through(&two).await.unwrap();
    let one = ClusterClient::connect(&[a_addr], opts()).await.unwrap();
    publish_through(&one).await.unwrap();
    assert_eq!(a.drain(Duration::from_secs(2)).await, 0);
    // Two seeds: the drained broker is passed over.
    publish_through(&two).await.expect("published through the other broker");
    // One seed: the client waits for the broker to come back.
    let path = dir.path().to_path_buf();
    let back = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        serve_with_cert(&path, a_addr).await
    });
    let started = std::time::Instant::now();
    publish_through(&one).await.expect("published once the broker is back");
    assert!(started.elapsed() >= Duration::from_millis(700), "it waited: {:?}", started.elapsed());
    back.await.unwrap().shutdown().await;
    b.shutdown().await;
}

/// A broker that goes silent (nothing it sends arrives, nothing reaches it) is given up after
/// `unresponsive_after`, not QUIC's 30 s idle timeout: the acked publish waiting on it ends
/// outcome unknown and the client says it is closed, so a cluster client fails over in
/// seconds. A live broker that merely has nothing to say is not: the client's keep-alives keep
/// a quiet connection up past that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_is_given_up_in_seconds_and_a_quiet_one_is_not() {
    let (server, chain) = start(None).await;
    let relay = felix_driver_tokio::testkit::UdpRelay::start(server.local_addr());
    let mut opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.clone()));
    opts.unresponsive_after = Some(Duration::from_millis(600));
    let client = Client::connect(relay.addr(), opts).await.unwrap();
    let ack = PublishOptions { ack: true, ..PublishOptions::default() };
    client.publish("ns", "s", vec![Bytes::from_static(b"before")], ack.clone()).await.unwrap();
    // Quiet for well over the threshold: keep-alives are answered, nothing is given up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!client.is_closed(), "a quiet but live broker is kept");
    client.publish("ns", "s", vec![Bytes::from_static(b"quiet")], ack.clone()).await.unwrap();
    // Silence: the publish in flight ends outcome unknown, well before the idle timeout.
    relay.set(felix_driver_tokio::testkit::RelayMode::Drop);
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(15),
        client.publish("ns", "s", vec![Bytes::from_static(b"lost")], ack),
    )
    .await
    .expect("the publish is answered before the idle timeout");
    match r {
        Err(ClientError::Refused(i)) if i.retry == Some(felix_proto::RetryClass::OutcomeUnknown) => {
            assert!(i.message.contains("unresponsive"), "{}", i.message)
        }
        other => panic!("expected outcome unknown on a silent broker, got {other:?}"),
    }
    assert!(client.is_closed());
    eprintln!("given up after {:?}", started.elapsed());
}
