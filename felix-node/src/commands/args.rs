//! What the subcommands' flags parse into: addresses, names, offsets, durations, byte rates,
//! codecs; each bad value named in its error.

use super::*;

/// [`connect`], with the client options adjusted by `adjust` first.
/// `--compress`: a codec name.
pub fn parse_codec(s: &str) -> Result<Codec, String> {
    Codec::from_name(s).ok_or_else(|| format!("unknown codec {s:?}: zstd or lz4"))
}

/// `--compress` and `--level` checked together, before anything connects: the codec and the
/// level (the codec's default when none is given).
pub fn compression(codec: Option<Codec>, level: Option<i32>) -> Result<Option<(Codec, i32)>, String> {
    let Some(codec) = codec else { return Ok(None) };
    let level = level.unwrap_or(codec.default_level());
    felix_proto::Compressor::new(codec, level).map_err(|e| format!("--level: {e}"))?;
    Ok(Some((codec, level)))
}

/// A duration as the CLI's flags take it: `5s`, `250ms`, `2m`.
pub fn humantime(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".into(),
        ms if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

pub(crate) fn parse_start(s: &str) -> Result<StartPosition, String> {
    match s {
        "earliest" => Ok(StartPosition::Earliest),
        "latest" => Ok(StartPosition::Latest),
        n => n
            .parse::<u64>()
            .map(StartPosition::Offset)
            .map_err(|_| format!("--from {n:?}: expected earliest, latest or an offset")),
    }
}

/// Broker addresses to try, in order, and the host name the first was given by (the TLS
/// server name when `--server-name` is not given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addrs(pub Vec<std::net::SocketAddr>, pub Option<String>);

impl Addrs {
    /// One address, given as an address.
    pub fn one(addr: std::net::SocketAddr) -> Self {
        Self(vec![addr], None)
    }

    /// The first one (the one a single-broker command uses).
    pub fn first(&self) -> std::net::SocketAddr {
        self.0[0]
    }
}

impl std::fmt::Display for Addrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&v.join(","))
    }
}

/// Parses `127.0.0.1:5001,broker-2.example:5002`: addresses, or host names resolved now (each
/// name's first address; a name is also what the broker's certificate is checked against).
pub fn parse_addrs(s: &str) -> Result<Addrs, String> {
    use std::net::ToSocketAddrs;
    let mut v = Vec::new();
    let mut host = None;
    for p in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Ok(a) = p.parse::<std::net::SocketAddr>() {
            v.push(a);
            continue;
        }
        let Some((name, port)) = p.rsplit_once(':') else {
            return Err(format!("{p:?} is not HOST:PORT (like 127.0.0.1:5000 or localhost:5000)"));
        };
        if port.parse::<u16>().is_err() {
            return Err(format!("{p:?}: the port {port:?} is not a number from 0 to 65535"));
        }
        let found = p.to_socket_addrs().map_err(|e| format!("{p:?}: cannot resolve {name:?} ({e})"))?;
        // IPv4 first: a broker listening on 127.0.0.1 (the default) is not on ::1.
        let mut found: Vec<_> = found.collect();
        found.sort_by_key(|a| !a.is_ipv4());
        let a = found.first().ok_or_else(|| format!("{p:?}: {name:?} resolves to no address"))?;
        v.push(*a);
        if host.is_none() && v.len() == 1 {
            host = Some(name.trim_start_matches('[').trim_end_matches(']').to_owned());
        }
    }
    if v.is_empty() {
        return Err("no address given".into());
    }
    Ok(Addrs(v, host))
}

/// The brokers of a cluster: node id and cluster address of each.
#[derive(Debug, Clone)]
pub struct Peers(pub Vec<(String, std::net::SocketAddr)>);

/// Parses `n1=127.0.0.1:7001,n2=127.0.0.1:7002`.
pub fn parse_peers(s: &str) -> Result<Peers, String> {
    let mut out: Vec<(String, std::net::SocketAddr)> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected ID=HOST:PORT"))?;
        let addr =
            addr.parse().map_err(|e| format!("{part:?}: {addr:?} is not an address like 127.0.0.1:7001 ({e})"))?;
        if id.is_empty() || out.iter().any(|(n, _)| n == id) {
            return Err(format!("{part:?}: node ids must be non-empty and distinct"));
        }
        out.push((id.to_owned(), addr));
    }
    if out.is_empty() {
        return Err("no peers given".into());
    }
    Ok(Peers(out))
}

/// An offset: a whole number (0 is a shard's first record).
pub fn parse_offset(s: &str) -> Result<u64, String> {
    s.trim().parse().map_err(|_| format!("{s:?}: expected an offset, a whole number (0 is a shard's first record)"))
}

/// A stream, cache or group name, checked against the broker's grammar (docs/protocol.md D49)
/// before anything is sent.
pub fn parse_name(s: &str) -> Result<String, String> {
    match felix_proto::broker::name_problem(s) {
        None => Ok(s.to_owned()),
        Some(why) => Err(format!("the name {why}")),
    }
}

/// [`parse_duration`] for a flag that once took bare milliseconds (`--ttl`): a number without
/// a unit is refused rather than read as seconds, which would silently mean 1000 times longer.
pub fn parse_duration_with_unit(s: &str) -> Result<std::time::Duration, String> {
    if !s.trim().is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?}: give a unit, like {s}ms or {s}s"));
    }
    parse_duration(s)
}

/// Parses a byte rate: `50MB/s`, `20MiB/s`, `1G`, `65536` (bytes a second; `/s` optional;
/// k/M/G and KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024; case does not matter).
pub fn parse_byte_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("/s").unwrap_or(t).trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected bytes a second, like 50MB/s or 20MiB/s"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use B, KB, MB, GB, KiB, MiB or GiB)")),
    };
    match n.checked_mul(mult) {
        Some(0) => Err(format!("{s:?}: a rate above zero (leave it out for no limit)")),
        Some(r) => Ok(r),
        None => Err(format!("{s:?}: too large")),
    }
}

/// Parses `90s`, `10m`, `2h`, `1d`, `500ms` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a number and a unit, like 10m"))?;
    let ms = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use ms, s, m, h or d)")),
    };
    n.checked_mul(ms).map(std::time::Duration::from_millis).ok_or_else(|| format!("{s:?}: too long"))
}

/// Microseconds since the Unix epoch, `ago` before now.
pub(crate) fn micros_ago(ago: std::time::Duration) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.saturating_sub(ago).as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_may_be_host_names_whose_name_is_the_server_name() {
        let a = parse_addrs("localhost:5000").unwrap();
        assert_eq!(a.0, vec!["127.0.0.1:5000".parse().unwrap()], "IPv4 first: the default listener");
        assert_eq!(a.1.as_deref(), Some("localhost"));
        let b = parse_addrs("127.0.0.1:5001, localhost:5002").unwrap();
        assert_eq!(b.0.len(), 2);
        assert_eq!(b.1, None, "the first was an address: the default server name stays");
        assert!(parse_addrs("localhost").unwrap_err().contains("HOST:PORT"));
        assert!(parse_addrs("localhost:http").unwrap_err().contains("not a number"));
        assert!(parse_addrs(" , ").unwrap_err().contains("no address"));
    }

    #[test]
    fn durations_print_as_the_flags_take_them() {
        for s in ["5s", "250ms", "2m", "1h", "1d", "0s"] {
            assert_eq!(humantime(parse_duration(s).unwrap()), s);
        }
        assert_eq!(humantime(std::time::Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn byte_rates_read_as_operators_write_them_and_bad_ones_are_named() {
        assert_eq!(parse_byte_rate("50MB/s"), Ok(50_000_000));
        assert_eq!(parse_byte_rate(" 20MiB/s "), Ok(20 << 20));
        assert_eq!(parse_byte_rate("1G"), Ok(1_000_000_000));
        assert_eq!(parse_byte_rate("3gib"), Ok(3 << 30));
        assert_eq!(parse_byte_rate("65536"), Ok(65_536));
        assert_eq!(parse_byte_rate("512 KiB/s"), Ok(512 << 10));
        assert!(parse_byte_rate("0MB/s").unwrap_err().contains("above zero"));
        assert!(parse_byte_rate("fast").unwrap_err().contains("like 50MB/s"));
        assert!(parse_byte_rate("5Mb/s").is_ok(), "case does not matter: bytes");
        assert!(parse_byte_rate("5 furlongs").unwrap_err().contains("unknown unit"));
        assert!(parse_byte_rate("99999999999GB").unwrap_err().contains("too large"));
        assert!(parse_byte_rate("-5MB").is_err());
    }
}
