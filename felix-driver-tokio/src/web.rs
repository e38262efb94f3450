//! The operator web view (`serve --http`): one read-only page, rendered by the broker task from
//! what `GET /cluster` and `cluster inspect --subscriptions` show (brokers, moves in progress,
//! shards with owners, generations and replica lag, the subscriptions this broker serves), and
//! refreshed every two seconds. Behind a token: `Authorization: Bearer <token>` or
//! `?token=<token>` (a browser's address bar); anything else is 401.

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

/// The page, from the broker's `/cluster` JSON (or `{"cluster":false}`), its streams (for a
/// broker alone) and its subscriptions.
pub(crate) fn page(
    status: &serde_json::Value,
    streams: &[(String, String, String, u32)],
    subs: &[felix_proto::message::SubscriptionInfo],
) -> String {
    let s = |v: &serde_json::Value| esc(v.as_str().unwrap_or("-"));
    let mut h = String::new();
    let node = status["node_id"].as_str().unwrap_or("");
    let title = if node.is_empty() { "Felix broker".to_owned() } else { format!("Felix broker {}", esc(node)) };
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>{title}</title><style>body{{font:14px sans-serif;margin:2em}}table{{border-collapse:collapse;margin-bottom:1.5em}}\
         td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}th{{background:#eee}}.warn{{color:#b00}}</style></head><body>\
         <h1>{title}</h1>"
    );
    if status["cluster"] == true {
        let _ = write!(h, "<p id=\"leader\">metadata leader: <b>{}</b>", s(&status["leader"]));
        if status["fenced"] == true {
            h.push_str(" <span class=\"warn\">FENCED: not serving its shards</span>");
        }
        h.push_str("</p><h2>Brokers</h2><table id=\"brokers\"><tr><th>node</th><th>state</th><th>clients</th><th>cluster</th><th>shards</th></tr>");
        let shards = status["shards"].as_array().cloned().unwrap_or_default();
        for m in status["members"].as_array().into_iter().flatten() {
            let owned = shards.iter().filter(|x| x["owner"] == m["node_id"]).count();
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{owned}</td></tr>",
                s(&m["node_id"]),
                s(&m["state"]),
                s(&m["client_addr"]),
                s(&m["cluster_addr"])
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
                    "<tr><td>{}/{}/{} {}</td><td>{}</td><td>{}</td><td>{}</td><td>{copied}</td></tr>",
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
        h.push_str("<h2>Shards</h2><table id=\"shards\"><tr><th>kind</th><th>name</th><th>shard</th><th>owner</th><th>generation</th><th>replicas (lag)</th></tr>");
        let replicas = status["replicas"].as_array().cloned().unwrap_or_default();
        for x in &shards {
            let lag = replicas
                .iter()
                .find(|r| r["name"] == x["name"] && r["shard"] == x["shard"] && r["kind"] == x["kind"])
                .map(|r| {
                    r["followers"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|f| format!("{} ({})", f["node_id"].as_str().unwrap_or("?"), f["lag"]))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
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
        h.push_str("<p>a single broker (not a cluster)</p><h2>Streams</h2><table id=\"streams\"><tr><th>name</th><th>shards</th></tr>");
        for (t, ns, name, shards) in streams {
            let _ = write!(h, "<tr><td>{}/{}/{}</td><td>{shards}</td></tr>", esc(t), esc(ns), esc(name));
        }
        h.push_str("</table>");
    }
    let _ = write!(h, "<h2>Subscriptions served here ({})</h2>", subs.len());
    h.push_str("<table id=\"subscriptions\"><tr><th>stream</th><th>shard</th><th>id</th><th>queue</th><th>dropped</th><th>position</th><th>tail</th></tr>");
    for x in subs {
        let _ = write!(
            h,
            "<tr><td>{}/{}/{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
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
    h.push_str("</table></body></html>\n");
    h
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
    let in_header = lines
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .filter_map(|(_, v)| v.trim().strip_prefix("Bearer ").map(str::trim))
        .any(|g| crate::cluster::same_secret(g, token));
    in_query || in_header
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
        let p = page(&v, &[], &[]);
        assert!(p.contains("Felix broker n&lt;1&gt;") && !p.contains("n<1>"));
    }
}
