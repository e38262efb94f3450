//! Our client against a stand-in for the released Felix broker (`testkit::LegacyBroker`: no
//! ALPN, `server_flags` 0x003F, no feature bits, a subscription's control stream stopped after
//! `subscribed`), and our broker against clients that behave like the existing ones.

use bytes::Bytes;
use felix_driver_tokio::testkit::LegacyBroker;
use felix_driver_tokio::tls::AlpnOffer;
use felix_driver_tokio::{
    Client, ClientError, ClientOptions, FsyncPolicy, Identity, PublishOptions, Server, ServerOptions, SubscriptionItem,
    TransportTuning, Trust,
};
use felix_proto::broker::{BrokerConfig, TokenGrant};
use std::time::Duration;

const TOKEN: &str = "interop-token";

fn opts(chain: Vec<rustls::pki_types::CertificateDer<'static>>, alpn: AlpnOffer) -> ClientOptions {
    let mut o = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain));
    o.alpn = alpn;
    o
}

async fn our_broker(require_alpn: bool) -> (Server, Vec<rustls::pki_types::CertificateDer<'static>>) {
    let (id, _, _) = Identity::self_signed(&["localhost"]).unwrap();
    let chain = id.chain.clone();
    let server = Server::start(ServerOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        broker: BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], ..BrokerConfig::default() },
        identity: id,
        data_dir: None,
        fsync: FsyncPolicy::Always,
        transport: TransportTuning::default(),
        require_alpn,
        metrics_listen: None,
    })
    .await
    .unwrap();
    (server, chain)
}

async fn connect(addr: std::net::SocketAddr, o: ClientOptions) -> Result<Client, ClientError> {
    tokio::time::timeout(Duration::from_secs(10), Client::connect(addr, o)).await.expect("no hang")
}

#[tokio::test]
async fn alpn_auto_reaches_a_broker_that_knows_no_alpn_and_one_that_requires_it() {
    let legacy = LegacyBroker::start().await.unwrap();
    let addr = legacy.local_addr();
    // The released broker refuses a client offering felix/1 (TLS alert 120)...
    let err = connect(addr, opts(legacy.chain(), AlpnOffer::Felix1)).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Connect(m) if m.contains("refused ALPN felix/1") && m.contains("--alpn none")),
        "{err}"
    );
    // ...serves one offering none, and the default finds its way there by itself.
    connect(addr, opts(legacy.chain(), AlpnOffer::None)).await.unwrap();
    connect(addr, opts(legacy.chain(), AlpnOffer::Auto)).await.unwrap();

    // A broker that requires ALPN: the default and felix/1 are served, none is refused.
    let (ours, chain) = our_broker(true).await;
    let err = connect(ours.local_addr(), opts(chain.clone(), AlpnOffer::None)).await.unwrap_err();
    assert!(matches!(&err, ClientError::Connect(m) if m.contains("requires ALPN felix/1")), "{err}");
    for alpn in [AlpnOffer::Auto, AlpnOffer::Felix1] {
        let c = connect(ours.local_addr(), opts(chain.clone(), alpn)).await.unwrap();
        c.cache_put("default", "c", "k", Bytes::from("v"), None).await.unwrap();
    }
    ours.shutdown().await;
    // And one that accepts both (our default) serves every mode.
    let (ours, chain) = our_broker(false).await;
    for alpn in [AlpnOffer::Auto, AlpnOffer::Felix1, AlpnOffer::None] {
        connect(ours.local_addr(), opts(chain.clone(), alpn)).await.unwrap();
    }
    ours.shutdown().await;
}

#[tokio::test]
async fn against_the_released_broker_a_subscription_leaves_the_client_working() {
    let legacy = LegacyBroker::start().await.unwrap();
    let c = connect(legacy.local_addr(), opts(legacy.chain(), AlpnOffer::Auto)).await.unwrap();
    // The broker opens the event stream before `subscribed`, then stops the subscription's
    // control stream: the client subscribes on a stream of its own, so nothing else is lost.
    let mut sub = c.subscribe("default", "orders", None, None).await.unwrap();
    let acked = PublishOptions { ack: true, ..PublishOptions::default() };
    for i in 0..3 {
        c.publish("default", "orders", vec![Bytes::from(format!("o{i}"))], acked.clone()).await.unwrap();
    }
    c.cache_put("default", "c", "k", Bytes::from("v"), None).await.unwrap();
    assert_eq!(c.cache_get("default", "c", "k").await.unwrap(), Some(Bytes::from("v")));
    let mut got = Vec::new();
    while got.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("events arrive") {
            Some(SubscriptionItem::Events(b)) => got.extend(b.records.payloads()),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, ["o0", "o1", "o2"].map(Bytes::from).to_vec());
}

#[tokio::test]
async fn a_keyed_publish_to_a_broker_that_does_not_route_by_key_is_refused_not_sent() {
    let legacy = LegacyBroker::start().await.unwrap();
    let c = connect(legacy.local_addr(), opts(legacy.chain(), AlpnOffer::Auto)).await.unwrap();
    for ack in [false, true] {
        let keyed = PublishOptions { key: Some(Bytes::from("customer-1")), ack, json: false };
        let err = c.publish("default", "keyed", vec![Bytes::from("x")], keyed).await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Unsupported(m) if m.contains("FLAG_BINARY_PUBLISH_KEYED")),
            "ack {ack}: {err}"
        );
    }
    // Nothing reached the broker: no record, no dropped key.
    c.publish("default", "keyed", vec![Bytes::from("unkeyed")], PublishOptions { ack: true, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(legacy.records("keyed"), vec![Bytes::from("unkeyed")]);
    assert_eq!(legacy.dropped_keys(), 0);
}
