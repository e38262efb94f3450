//! The operator web view (`serve --http`): one read-only page, rendered by the broker task from
//! what `GET /cluster` and `cluster inspect --subscriptions` show (brokers, moves in progress,
//! shards with owners, generations and replica lag, the subscriptions this broker serves), and
//! refreshed every two seconds. Behind a token: `Authorization: Bearer <token>`, or once in a
//! browser's address (`?token=<token>`, or the login form), after which an `HttpOnly`,
//! `SameSite=Strict` cookie keeps it logged in and the address is cleaned; anything else is 401.

use std::fmt::Write;

/// HTML-escapes text.
pub(crate) fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '&' => o.push_str("&amp;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// What the page shows: the broker's `/cluster` JSON (or `{"cluster":false}`), the shards it
/// holds with their rates since the last page, the subscriptions it serves, and who it is.
pub(crate) struct View<'a> {
    pub status: &'a serde_json::Value,
    pub shards: &'a [felix_proto::broker::ShardSummary],
    /// Per shard (same order as `shards`): records published and delivered per second since
    /// the previous page (`None` on the first).
    pub rates: &'a [Option<(f64, f64)>],
    pub subs: &'a [felix_proto::message::SubscriptionInfo],
    pub version: &'a str,
    pub uptime: std::time::Duration,
    /// The wall clock, seconds since the Unix epoch.
    pub now_unix: u64,
    /// Where the page's shard tables start (`?after=CURSOR`, a cursor of D55): both show at
    /// most [`PAGE_ROWS`] shards, with a link to the next page.
    pub after: Option<felix_proto::cluster::metadata::ShardId>,
    /// This broker's links to the others ([`crate::peer_links`]; none on a single broker).
    pub links: &'a [crate::peer_links::LinkReport],
}

/// The brokers table's cell for the link from this broker to `node`.
fn link_cell(links: &[crate::peer_links::LinkReport], me: &str, node: &str) -> String {
    if node == me {
        return "this broker".into();
    }
    let Some(l) = links.iter().find(|l| l.peer == node) else { return "-".into() };
    let lost = if l.lost_packets > 0 { format!(" · {} packets lost", l.lost_packets) } else { String::new() };
    match l.rtt_micros {
        Some(rtt) if l.up => format!("up · {:.2} ms{lost}", rtt as f64 / 1000.0),
        _ if l.connects == 0 => format!("DOWN: never reached{lost}"),
        _ => format!("DOWN (lost {}×){lost}", l.lost),
    }
}

/// Shards per page of the view: at 10,000 shards the whole table was megabytes of HTML every
/// two seconds.
pub(crate) const PAGE_ROWS: usize = 500;

/// The page's range of shards after `after`: its last shard when more follow (`None`: the
/// page runs to the end).
fn page_end(
    mut keys: Vec<felix_proto::cluster::metadata::ShardId>,
    after: Option<&felix_proto::cluster::metadata::ShardId>,
) -> Option<felix_proto::cluster::metadata::ShardId> {
    keys.retain(|k| after.is_none_or(|a| k > a));
    keys.sort();
    (keys.len() > PAGE_ROWS).then(|| keys.swap_remove(PAGE_ROWS - 1))
}

fn shard_of(x: &serde_json::Value) -> felix_proto::cluster::metadata::ShardId {
    use felix_proto::cluster::metadata::{Kind, ShardId};
    let kind = if x["kind"] == "cache" { Kind::Cache } else { Kind::Stream };
    let s = |k: &str| x[k].as_str().unwrap_or_default();
    ShardId::of(kind, s("tenant"), s("namespace"), s("name"), x["shard"].as_u64().unwrap_or(0) as u32)
}

/// A byte count as people read it.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.1} {}", UNITS[u]) }
}

/// A rate as people read it.
fn rate(r: Option<f64>) -> String {
    match r {
        None => "…".into(),
        Some(r) if r >= 1e6 => format!("{:.1}M/s", r / 1e6),
        Some(r) if r >= 1e3 => format!("{:.1}k/s", r / 1e3),
        Some(r) => format!("{r:.0}/s"),
    }
}

/// `12d 3h`, `3h 4m`, `4m 5s`, `5s`.
fn uptime(d: std::time::Duration) -> String {
    let s = d.as_secs();
    let (days, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (days, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) => format!("{m}m {sec}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{days}d {h}h"),
    }
}

/// `2026-12-04 10:41:15 UTC` from seconds since the Unix epoch (civil-from-days, proleptic
/// Gregorian: no date crate for one line).
fn utc(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The style: readable tables, health in colour (green ok, amber attention, red down).
const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em 2em;color:#222;background:#fafafa}\
h1{font-size:20px;margin:0 0 .2em}h2{font-size:16px;margin:1.4em 0 .4em}.meta{color:#666;margin-bottom:1em}\
table{border-collapse:collapse;margin-bottom:1em;background:#fff;box-shadow:0 1px 2px #0002}\
td,th{border-bottom:1px solid #e4e4e4;padding:4px 10px;text-align:left;white-space:nowrap}\
th{background:#f0f2f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}\
tr.ok td:first-child{border-left:4px solid #2e9d4b}tr.warn td:first-child{border-left:4px solid #e3a008}\
tr.bad td:first-child{border-left:4px solid #d03030}.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}\
.badge.ok{background:#2e9d4b}.badge.warn{background:#e3a008}.badge.bad{background:#d03030}.warn{color:#b06000}";

/// The page.
pub(crate) fn page(v: &View<'_>) -> String {
    let status = v.status;
    let s = |v: &serde_json::Value| esc(v.as_str().unwrap_or("-"));
    let mut h = String::new();
    let node = status["node_id"].as_str().unwrap_or("");
    let title = if node.is_empty() { "Felix broker".to_owned() } else { format!("Felix broker {}", esc(node)) };
    let cluster = status["cluster"] == true;
    // One page of shards: the cluster's (or, alone, the ones held here) after `after`.
    use felix_proto::cluster::metadata::{Kind, ShardId};
    let held =
        |x: &felix_proto::broker::ShardSummary| ShardId::of(Kind::Stream, &x.tenant, &x.namespace, &x.stream, x.shard);
    let keys: Vec<ShardId> = if cluster {
        status["shards"].as_array().into_iter().flatten().map(shard_of).collect()
    } else {
        v.shards.iter().map(held).collect()
    };
    let end = page_end(keys, v.after.as_ref());
    let in_page = |k: &ShardId| v.after.as_ref().is_none_or(|a| k > a) && end.as_ref().is_none_or(|e| k <= e);
    let members = status["members"].as_array().cloned().unwrap_or_default();
    let replicas = status["replicas"].as_array().cloned().unwrap_or_default();
    // Health at a glance: red when this broker is fenced or a broker is down, amber when a
    // subscriber drops or a replica is far behind, green otherwise.
    let down = members.iter().filter(|m| m["state"] != "active" && m["state"] != "draining").count();
    // Links from this broker down to brokers the cluster holds alive: a partition (or a one-way
    // fault) seen from here, which the members' states do not show.
    let cut: Vec<String> = members
        .iter()
        .filter(|m| m["state"] == "active" || m["state"] == "draining")
        .filter_map(|m| m["node_id"].as_str())
        .filter(|n| v.links.iter().any(|l| l.peer == *n && !l.up))
        .map(str::to_owned)
        .collect();
    let dropping = v.subs.iter().filter(|x| x.dropped > 0).count();
    let lagging = replicas
        .iter()
        .flat_map(|r| r["followers"].as_array().cloned().unwrap_or_default())
        .filter(|f| f["lag"].as_u64().unwrap_or(0) > 10_000)
        .count();
    let (class, health) = if status["fenced"] == true {
        ("bad", "fenced: not serving its shards".to_owned())
    } else if down > 0 {
        ("bad", format!("{down} broker(s) down"))
    } else if !cut.is_empty() {
        ("bad", esc(&format!("no link to {}", cut.join(", "))))
    } else if dropping > 0 || lagging > 0 {
        ("warn", format!("{dropping} subscriber(s) dropping, {lagging} replica(s) far behind"))
    } else {
        ("ok", "healthy".to_owned())
    };
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>{title}</title><style>{STYLE}</style></head><body>\
         <h1>{title} <span id=\"health\" class=\"badge {class}\">{health}</span></h1>\
         <div class=\"meta\">version {} · up <span id=\"uptime\">{}</span> · updated {} · refreshed every 2 s</div>",
        esc(v.version),
        uptime(v.uptime),
        utc(v.now_unix)
    );
    if cluster {
        let _ = write!(h, "<p id=\"leader\">metadata leader: <b>{}</b>", s(&status["leader"]));
        if status["fenced"] == true {
            h.push_str(" <span class=\"warn\">FENCED: not serving its shards</span>");
        }
        h.push_str("</p><h2>Brokers</h2><table id=\"brokers\"><tr><th>node</th><th>state</th><th>clients</th><th>cluster</th><th>shards</th><th>link from here</th></tr>");
        let shards = status["shards"].as_array().cloned().unwrap_or_default();
        for m in &members {
            let owned = shards.iter().filter(|x| x["owner"] == m["node_id"]).count();
            let node = m["node_id"].as_str().unwrap_or("-");
            let class = match m["state"].as_str() {
                _ if cut.iter().any(|c| c == node) => "bad",
                Some("active") => "ok",
                Some("draining") => "warn",
                _ => "bad",
            };
            let link = link_cell(v.links, status["node_id"].as_str().unwrap_or_default(), node);
            let _ = write!(
                h,
                "<tr class=\"{class}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{owned}</td><td>{}</td></tr>",
                esc(node),
                s(&m["state"]),
                s(&m["client_addr"]),
                s(&m["cluster_addr"]),
                esc(&link)
            );
        }
        h.push_str("</table><h2>Moves in progress</h2>");
        let moves = status["moves"].as_array().cloned().unwrap_or_default();
        if moves.is_empty() {
            h.push_str("<p id=\"moves\">none</p>");
        } else {
            h.push_str(
                "<table id=\"moves\"><tr><th>shard</th><th>from</th><th>to</th><th>phase</th><th>copied</th></tr>",
            );
            for m in &moves {
                let copied = status["move_progress"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| p["name"] == m["name"] && p["shard"] == m["shard"] && p["direction"] == "in")
                    .map(|p| format!("offset {} of {}", p["copied"], p["source_tail"]))
                    .unwrap_or_default();
                let _ = write!(
                    h,
                    "<tr class=\"warn\"><td>{}/{}/{} {}</td><td>{}</td><td>{}</td><td>{}</td><td>{copied}</td></tr>",
                    s(&m["tenant"]),
                    s(&m["namespace"]),
                    s(&m["name"]),
                    m["shard"],
                    s(&m["from"]),
                    s(&m["to"]),
                    esc(&m["phase"].as_str().unwrap_or("-").replace('_', " "))
                );
            }
            h.push_str("</table>");
        }
        h.push_str("<h2>Shards of the cluster</h2><table id=\"shards\"><tr><th>kind</th><th>name</th><th>shard</th><th>owner</th><th>generation</th><th>replicas (entries behind)</th></tr>");
        for x in shards.iter().filter(|x| in_page(&shard_of(x))) {
            let lag = replicas
                .iter()
                .find(|r| r["name"] == x["name"] && r["shard"] == x["shard"] && r["kind"] == x["kind"])
                .map(replica_cell)
                .unwrap_or_default();
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}/{}/{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                s(&x["kind"]),
                s(&x["tenant"]),
                s(&x["namespace"]),
                s(&x["name"]),
                x["shard"],
                s(&x["owner"]),
                x["generation"],
                esc(&lag)
            );
        }
        h.push_str("</table>");
    } else {
        h.push_str("<p>a single broker (not a cluster)</p>");
    }
    h.push_str(
        "<h2>Streams held here</h2><table id=\"streams\"><tr><th>stream</th><th>shard</th><th>kind</th><th>records</th>\
         <th>bytes</th><th>offsets</th><th>publish</th><th>delivery</th><th>subscribers</th><th>consumer groups (lag)</th></tr>",
    );
    for (i, x) in v.shards.iter().enumerate().filter(|(_, x)| in_page(&held(x))) {
        let (pubs, dels) = v.rates.get(i).copied().flatten().map_or((None, None), |(p, d)| (Some(p), Some(d)));
        let groups: Vec<String> = x
            .groups
            .iter()
            .map(
                |(g, _, lag, flight)| {
                    if *flight > 0 { format!("{g} ({lag}, {flight} in flight)") } else { format!("{g} ({lag})") }
                },
            )
            .collect();
        let lagging = x.groups.iter().any(|(_, _, lag, _)| *lag > 10_000);
        let class = if !x.served {
            ""
        } else if lagging {
            "warn"
        } else {
            "ok"
        };
        let kind = match (x.durable, x.served) {
            (true, true) => "durable",
            (false, true) => "in memory",
            (true, false) => "durable (copy)",
            (false, false) => "in memory (moved)",
        };
        let _ = write!(
            h,
            "<tr class=\"{class}\"><td>{}/{}/{}</td><td class=\"n\">{}</td><td>{kind}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}..{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
            esc(&x.tenant),
            esc(&x.namespace),
            esc(&x.stream),
            x.shard,
            x.records,
            bytes(x.bytes),
            x.start,
            x.tail,
            rate(pubs),
            rate(dels),
            x.subscribers,
            esc(&groups.join(", "))
        );
    }
    h.push_str("</table>");
    let _ = write!(h, "<h2>Subscriptions served here ({})</h2>", v.subs.len());
    h.push_str("<table id=\"subscriptions\"><tr><th>stream</th><th>shard</th><th>id</th><th>queue</th><th>dropped</th><th>position</th><th>tail</th></tr>");
    let sub_key = |x: &felix_proto::message::SubscriptionInfo| {
        ShardId::of(Kind::Stream, &x.tenant_id, &x.namespace, &x.stream, x.shard)
    };
    for x in v.subs.iter().filter(|x| in_page(&sub_key(x))) {
        let class = if x.dropped > 0 { "warn" } else { "ok" };
        let _ = write!(
            h,
            "<tr class=\"{class}\"><td>{}/{}/{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}/{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(&x.tenant_id),
            esc(&x.namespace),
            esc(&x.stream),
            x.shard,
            x.subscriber_id,
            x.depth,
            x.capacity,
            x.dropped,
            x.position.map_or_else(|| "-".into(), |p| p.to_string()),
            x.tail
        );
    }
    h.push_str("</table>");
    if v.after.is_some() || end.is_some() {
        let _ = write!(h, "<p id=\"pages\">{PAGE_ROWS} shards a page");
        if v.after.is_some() {
            h.push_str(" · <a href=\"/\">first page</a>");
        }
        if let Some(e) = &end {
            let _ = write!(
                h,
                " · <a id=\"next\" href=\"/?after={}\">next page</a>",
                crate::server::percent_encode_pub(&e.cursor())
            );
        }
        h.push_str("</p>");
    }
    h.push_str("</body></html>\n");
    h
}

/// A replicated shard's replicas as this broker knows them: on its leader each follower's
/// entries behind; on a follower, whom it follows and how far its own copy reached (only the
/// leader knows the others').
fn replica_cell(r: &serde_json::Value) -> String {
    let followers = r["followers"].as_array().cloned().unwrap_or_default();
    if !followers.is_empty() {
        return followers
            .iter()
            .map(|f| format!("{} ({})", f["node_id"].as_str().unwrap_or("?"), f["lag"]))
            .collect::<Vec<_>>()
            .join(", ");
    }
    let leader = r["leader"].as_str().unwrap_or("none yet");
    format!(
        "{} here, following {leader}: index {} of {} committed",
        r["role"].as_str().unwrap_or("replica"),
        r["last_index"],
        r["committed_index"]
    )
}

/// The login form a browser without the cookie gets (status 401): the token goes into the
/// address once, and the broker answers with a cookie and a clean address.
pub(crate) fn login_page() -> String {
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Felix broker: log in</title><style>{STYLE}</style></head><body>\
         <h1>Felix broker</h1><p>The web view needs its token (the dev token, or the broker's --http-token).</p>\
         <form method=\"get\" action=\"/\"><input name=\"token\" type=\"password\" size=\"44\" autofocus> <button>Open</button></form>\
         </body></html>\n"
    )
}

/// The cookie that keeps a browser logged in: `HttpOnly` (no script reads it),
/// `SameSite=Strict` (no other site sends it), for the view's own path.
pub(crate) const COOKIE: &str = "felix_view";

/// Whether a request's query names the token (a login: answered with the cookie and a
/// redirect to the clean address, so the token leaves the address bar and history).
pub(crate) fn token_in_query(head: &str, token: &str) -> bool {
    let target = head.lines().next().and_then(|l| l.split(' ').nth(1)).unwrap_or_default();
    let query = target.split_once('?').map_or("", |(_, q)| q);
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .any(|(k, v)| k == "token" && crate::cluster::same_secret(&crate::server::percent_decode_pub(v), token))
}

/// Whether a request head carries the token (bearer header or `token=` query argument).
pub(crate) fn authorized(head: &str, token: &str) -> bool {
    let mut lines = head.lines();
    let target = lines.next().and_then(|l| l.split(' ').nth(1)).unwrap_or_default();
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let in_query = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .any(|(k, v)| k == "token" && crate::cluster::same_secret(&crate::server::percent_decode_pub(v), token));
    let headers: Vec<(&str, &str)> = lines.filter_map(|l| l.split_once(':')).collect();
    let in_header = headers
        .iter()
        .filter(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .filter_map(|(_, v)| v.trim().strip_prefix("Bearer ").map(str::trim))
        .any(|g| crate::cluster::same_secret(g, token));
    let in_cookie = headers
        .iter()
        .filter(|(k, _)| k.trim().eq_ignore_ascii_case("cookie"))
        .flat_map(|(_, v)| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(k, v)| k == COOKIE && crate::cluster::same_secret(&crate::server::percent_decode_pub(v), token));
    in_query || in_header || in_cookie
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_needed_and_text_is_escaped() {
        assert!(authorized("GET /?token=s3cret HTTP/1.1\r\n\r\n", "s3cret"));
        assert!(authorized("GET / HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n", "s3cret"));
        assert!(!authorized("GET /?token=nope HTTP/1.1\r\n\r\n", "s3cret"));
        assert!(!authorized("GET / HTTP/1.1\r\n\r\n", "s3cret"));
        assert_eq!(esc("<a href='x'>&"), "&lt;a href=&#39;x&#39;&gt;&amp;");
        let v = serde_json::json!({"cluster": true, "node_id": "n<1>", "leader": "n1", "members": [], "shards": []});
        let p = page(&View {
            status: &v,
            shards: &[],
            rates: &[],
            subs: &[],
            version: "1.2.3",
            uptime: std::time::Duration::from_secs(3700),
            now_unix: 0,
            after: None,
            links: &[],
        });
        assert!(p.contains("Felix broker n&lt;1&gt;") && !p.contains("n<1>"));
        assert!(p.contains("version 1.2.3") && p.contains("up <span id=\"uptime\">1h 1m</span>"), "{p}");
        assert!(p.contains("1970-01-01 00:00:00 UTC") && p.contains("badge ok"), "{p}");
        // The cookie logs a browser in; a wrong one does not.
        assert!(authorized("GET / HTTP/1.1\r\nCookie: a=b; felix_view=s3cret\r\n\r\n", "s3cret"));
        assert!(!authorized("GET / HTTP/1.1\r\nCookie: felix_view=nope\r\n\r\n", "s3cret"));
        assert!(token_in_query("GET /?token=s3cret HTTP/1.1\r\n\r\n", "s3cret"));
        assert!(!token_in_query("GET / HTTP/1.1\r\nCookie: felix_view=s3cret\r\n\r\n", "s3cret"));
    }

    #[test]
    fn shards_show_records_bytes_rates_groups_and_health() {
        let shard = felix_proto::broker::ShardSummary {
            tenant: "t".into(),
            namespace: "ns".into(),
            stream: "orders".into(),
            shard: 1,
            durable: true,
            served: true,
            start: 0,
            tail: 50_000,
            records: 50_000,
            bytes: 3 << 20,
            subscribers: 2,
            delivered_positions: 0,
            groups: vec![("billing".into(), Some(10), 49_990, 5)],
        };
        let v = serde_json::json!({"cluster": true, "node_id": "n1", "leader": "n1",
            "members": [{"node_id": "n1", "state": "active"}, {"node_id": "n2", "state": "down"}], "shards": []});
        let p = page(&View {
            status: &v,
            shards: &[shard],
            rates: &[Some((1500.0, 3000.0))],
            subs: &[],
            version: "1",
            uptime: std::time::Duration::ZERO,
            now_unix: 1_796_380_875,
            after: None,
            links: &[],
        });
        assert!(p.contains("<td>t/ns/orders</td><td class=\"n\">1</td><td>durable</td><td class=\"n\">50000</td><td class=\"n\">3.0 MiB</td>"), "{p}");
        assert!(p.contains("1.5k/s") && p.contains("3.0k/s") && p.contains("billing (49990, 5 in flight)"), "{p}");
        assert!(p.contains("<tr class=\"warn\"><td>t/ns/orders"), "a group far behind is amber: {p}");
        assert!(p.contains("badge bad\">1 broker(s) down"), "{p}");
        assert!(p.contains("<tr class=\"bad\"><td>n2</td><td>down</td>"), "{p}");
        assert!(p.contains("2026-12-04"), "{p}");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(rate(None), "…");
    }

    /// Each broker's row says how this broker's link to it stands; a link down to a broker the
    /// cluster holds active (a partition seen from here) turns its row and the badge red.
    #[test]
    fn the_brokers_table_shows_each_link_and_a_cut_one_is_red() {
        use crate::peer_links::LinkReport;
        let link = |peer: &str, up: bool, connects: u64, lost: u64, lost_packets: u64| LinkReport {
            peer: peer.into(),
            up,
            connects,
            lost,
            rtt_micros: up.then_some(215),
            datagrams_sent: 10,
            lost_packets,
            bytes_sent: 1,
            bytes_received: 1,
        };
        let v = serde_json::json!({"cluster": true, "node_id": "n1", "leader": "n1", "shards": [],
            "members": [{"node_id": "n1", "state": "active"}, {"node_id": "n2", "state": "active"},
                        {"node_id": "n3", "state": "active"}, {"node_id": "n4", "state": "down"}]});
        let view = |status: &serde_json::Value, links: &[LinkReport]| {
            page(&View {
                status,
                shards: &[],
                rates: &[],
                subs: &[],
                version: "1",
                uptime: std::time::Duration::ZERO,
                now_unix: 0,
                after: None,
                links,
            })
        };
        let links = [link("n2", true, 1, 0, 3), link("n3", false, 2, 2, 0), link("n4", false, 0, 0, 0)];
        let p = view(&v, &links);
        assert!(p.contains("<td>this broker</td></tr>"), "{p}");
        assert!(p.contains("<td>up · 0.21 ms · 3 packets lost</td>"), "{p}");
        assert!(p.contains("<tr class=\"bad\"><td>n3</td><td>active</td>"), "cut from here: {p}");
        assert!(p.contains("<td>DOWN (lost 2×)</td>"), "{p}");
        assert!(p.contains("<td>DOWN: never reached</td>"), "{p}");
        // A broker down outranks a link (its link is down because it is); without it, the cut
        // link is the badge.
        assert!(p.contains("badge bad\">1 broker(s) down"), "{p}");
        let v2 = serde_json::json!({"cluster": true, "node_id": "n1", "leader": "n1", "shards": [],
            "members": [{"node_id": "n1", "state": "active"}, {"node_id": "n2", "state": "active"},
                        {"node_id": "n3", "state": "active"}]});
        let p = view(&v2, &links[..2]);
        assert!(p.contains("badge bad\">no link to n3"), "{p}");
        let p = view(&v2, &[link("n2", true, 1, 0, 0), link("n3", true, 2, 1, 0)]);
        assert!(p.contains("badge ok\">healthy"), "every link up again: {p}");
        assert!(p.contains("<td>up · 0.21 ms</td>"), "{p}");
    }

    /// At 10,000 shards the page showed every one: it now shows PAGE_ROWS of them, in order,
    /// with a link to the next page that starts after the last one shown.
    #[test]
    fn the_shard_tables_are_paged() {
        use felix_proto::cluster::metadata::{Kind, ShardId};
        let shards: Vec<serde_json::Value> = (0..PAGE_ROWS as u32 + 20)
            .map(|i| serde_json::json!({"kind": "stream", "tenant": "t", "namespace": "ns", "name": "s", "shard": i, "owner": "n1", "generation": 1}))
            .collect();
        let v = serde_json::json!({"cluster": true, "node_id": "n1", "leader": "n1",
            "members": [{"node_id": "n1", "state": "active"}], "shards": shards});
        let view = |after| {
            page(&View {
                status: &v,
                shards: &[],
                rates: &[],
                subs: &[],
                version: "1",
                uptime: std::time::Duration::ZERO,
                now_unix: 0,
                after,
                links: &[],
            })
        };
        let first = view(None);
        let rows = |p: &str| p.matches("<td>t/ns/s</td>").count();
        assert_eq!(rows(&first), PAGE_ROWS);
        let last = ShardId::of(Kind::Stream, "t", "ns", "s", PAGE_ROWS as u32 - 1);
        let link = format!("href=\"/?after={}\"", crate::server::percent_encode_pub(&last.cursor()));
        assert!(first.contains(&link), "a link to the next page");
        // The shard count per broker still counts every shard.
        assert!(first.contains(&format!("<td class=\"n\">{}</td>", PAGE_ROWS + 20)));
        let second = view(Some(last));
        assert_eq!(rows(&second), 20);
        assert!(second.contains("first page") && !second.contains("id=\"next\""));
    }
}
