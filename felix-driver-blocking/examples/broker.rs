//! A Felix broker without an async runtime: one thread, one socket.
//!
//! ```text
//! cargo run --release -p felix-driver-blocking --example broker -- 127.0.0.1:5000 ./data
//! ```
//!
//! It keeps its certificate, development token and durable streams in the data directory in the
//! same layout as `felix-node serve`, so the `felix-node` client commands work against it
//! unchanged (`FELIX_ADDR=127.0.0.1:5000 FELIX_DATA_DIR=./data felix-node publish orders hi`).

use felix_driver_blocking::{BlockingBroker, BrokerOptions};
use felix_driver_common::FsyncMode;
use felix_driver_common::data_dir::DataDir;
use felix_proto::broker::{BrokerConfig, TokenGrant};
use std::process::ExitCode;

const USAGE: &str = "usage: broker LISTEN_ADDR DATA_DIR [DEV_TOKEN]
  LISTEN_ADDR  UDP address to serve QUIC on, e.g. 127.0.0.1:5000
  DATA_DIR     certificate, development token and durable streams (created if absent)
  DEV_TOKEN    the development token (default: the one stored in DATA_DIR, or a new one)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let (Some(listen), Some(dir)) = (args.first(), args.get(1)) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match run(listen, dir, args.get(2).map(String::as_str)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(listen: &str, dir: &str, token: Option<&str>) -> Result<(), String> {
    let listen = listen.parse().map_err(|e| format!("{listen:?} is not an address like 127.0.0.1:5000: {e}"))?;
    let data = DataDir::new(dir);
    let token = data.dev_token(token)?;
    let (identity, _) = data.identity()?;
    let broker = BlockingBroker::bind(BrokerOptions {
        listen,
        broker: BrokerConfig { tokens: vec![TokenGrant::dev(token)], ..BrokerConfig::default() },
        identity,
        data_dir: Some(data.root.clone()),
        // `serve`'s default: appends reach the disk within 100 ms.
        fsync: FsyncMode::Interval(std::time::Duration::from_millis(100)),
        transport: Default::default(),
    })
    .map_err(|e| e.to_string())?;
    println!(
        "Felix broker (blocking driver) listening on {} (data in {dir}, {} records recovered)",
        broker.local_addr().map_err(|e| e.to_string())?,
        broker.recovered_records
    );
    broker.run().map_err(|e| e.to_string())
}
