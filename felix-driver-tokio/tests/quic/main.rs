//! End-to-end over real QUIC on 127.0.0.1: wiring only; protocol behaviour is tested in
//! felix-proto.

use bytes::Bytes;
use felix_driver_tokio::{
    Client, ClientError, ClientOptions, FsyncMode, Identity, PublishOptions, Server, ServerOptions, SubscriptionItem,
    TransportTuning, Trust,
};
use felix_proto::broker::{BrokerConfig, TokenGrant};
use felix_proto::client::EndReason;
use felix_proto::error_code::ErrorCode;
use felix_proto::message::StartPosition;
use rustls::pki_types::CertificateDer;
use std::path::Path;
use std::time::Duration;

mod connections;
mod flow;
mod storage;
use flow::*;
mod trust;

const TOKEN: &str = "test-token";

async fn start(data: Option<&Path>) -> (Server, Vec<CertificateDer<'static>>) {
    start_with(data, BrokerConfig::default()).await
}

async fn start_with(data: Option<&Path>, broker: BrokerConfig) -> (Server, Vec<CertificateDer<'static>>) {
    start_at("127.0.0.1:0".parse().unwrap(), data, broker).await
}

async fn start_at(
    listen: std::net::SocketAddr,
    data: Option<&Path>,
    broker: BrokerConfig,
) -> (Server, Vec<CertificateDer<'static>>) {
    start_tuned(listen, data, broker, TransportTuning::default()).await
}

async fn start_tuned(
    listen: std::net::SocketAddr,
    data: Option<&Path>,
    broker: BrokerConfig,
    transport: TransportTuning,
) -> (Server, Vec<CertificateDer<'static>>) {
    let (opts, chain) = options(listen, data, broker, transport);
    (Server::start(opts).await.unwrap(), chain)
}

/// What the tests' brokers start with: a self-signed certificate (its chain beside), the
/// development token, `--fsync always`, metrics on a free port.
fn options(
    listen: std::net::SocketAddr,
    data: Option<&Path>,
    broker: BrokerConfig,
    transport: TransportTuning,
) -> (ServerOptions, Vec<CertificateDer<'static>>) {
    let (id, _, _) = Identity::self_signed(&["localhost"]).unwrap();
    let chain = id.chain.clone();
    let opts = ServerOptions {
        listen,
        broker: BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], ..broker },
        identity: id,
        data_dir: data.map(Path::to_path_buf),
        fsync: FsyncMode::Always,
        transport,
        require_alpn: false,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        http: None,
        cluster: None,
        client_ca: None,
    };
    (opts, chain)
}

async fn connect(server: &Server, chain: &[CertificateDer<'static>]) -> Client {
    let opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.to_vec()));
    Client::connect(server.local_addr(), opts).await.unwrap()
}

async fn collect(sub: &mut felix_driver_tokio::Subscription, n: usize) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("events arrive") {
            Some(SubscriptionItem::Events(b)) => {
                for (i, p) in b.records.payloads().enumerate() {
                    out.push((b.base_offset.unwrap() + i as u64, p));
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}
