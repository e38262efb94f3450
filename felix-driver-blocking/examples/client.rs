//! A client in a plain `fn main`, no async runtime: publish two records, read them back, use the
//! cache.
//!
//! ```text
//! cargo run -p felix-driver-blocking --example broker -- 127.0.0.1:5000 ./data &
//! cargo run -p felix-driver-blocking --example client -- 127.0.0.1:5000 ./data
//! ```

use felix_driver_blocking::{BlockingClient, ClientError, ConnectOptions};
use felix_driver_common::Trust;
use felix_driver_common::data_dir::DataDir;
use felix_proto::message::StartPosition;
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(addr), Some(dir)) = (args.first(), args.get(1)) else {
        return Err("usage: client BROKER_ADDR DATA_DIR (the broker's, for its certificate and dev token)".into());
    };
    let data = DataDir::new(dir);
    let certs = felix_driver_common::tls::load_certs(&data.cert())?;
    let token = std::fs::read_to_string(data.token())?;
    let mut c =
        BlockingClient::connect(ConnectOptions::new(addr.parse()?, Trust::Certificates(certs), "t1", token.trim()))?;
    let offset = c.publish("default", "orders", vec!["hello".into(), "world".into()])?;
    println!("published at offset {offset:?}");
    let sub = c.subscribe("default", "orders", StartPosition::Earliest)?;
    while let Some(batch) = c.next_batch(sub, Duration::from_millis(500))? {
        for r in batch.records.iter() {
            println!("{}", String::from_utf8_lossy(&r.payload));
        }
    }
    c.cache_put("default", "sessions", "user:1", "alice".into())?;
    match c.cache_get("default", "sessions", "user:1") {
        Ok(v) => println!("cache: {v:?}"),
        Err(ClientError::Refused(e)) => println!("refused: {}", e.message),
        Err(e) => return Err(e.into()),
    }
    c.close();
    Ok(())
}
