//! The links to the other brokers of a cluster as an operator sees them: for each peer, whether
//! the connection this broker sends on is up, how often it was made and lost, its round trip,
//! the packets it lost, and the bytes of messages each way (`felix_peer_*` in the metrics).
//!
//! Before these, a link that flapped, lost packets or slowed down showed only in what it
//! caused (a follower behind, forwards answered `shard_unavailable`, a member declared down),
//! and which of the links was at fault had to be guessed. The transport's tasks keep the table;
//! the metrics page reads it. Nothing here is on a message's path: the byte counts are atomics
//! each task holds its own handle to, and the table is locked only when a link comes up or goes
//! and when the page is rendered.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

/// What one link's connections sent, summed (QUIC's own counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sent {
    datagrams: u64,
    lost_packets: u64,
}

impl Sent {
    fn of(c: &quinn::Connection) -> Sent {
        let s = c.stats();
        Sent { datagrams: s.udp_tx.datagrams, lost_packets: s.path.lost_packets }
    }

    fn plus(self, o: Sent) -> Sent {
        Sent { datagrams: self.datagrams + o.datagrams, lost_packets: self.lost_packets + o.lost_packets }
    }
}

/// One peer's link.
#[derive(Debug, Default)]
struct Link {
    /// The connection this broker dials and sends on, while it is up.
    conn: Option<quinn::Connection>,
    /// Connections made.
    connects: u64,
    /// Connections that were up and ended (the peer went quiet past the idle timeout, closed
    /// it, or a write failed).
    lost: u64,
    /// What the connections that ended sent: counters never go back when a link is made again.
    ended: Sent,
    /// Bytes of messages written to the peer's stream.
    bytes_out: Arc<AtomicU64>,
    /// Bytes read from the peer's stream to this broker.
    bytes_in: Arc<AtomicU64>,
}

/// The table of links, shared by the transport's tasks and the metrics page.
#[derive(Debug, Clone, Default)]
pub(crate) struct Links(Arc<Mutex<BTreeMap<String, Link>>>);

/// One link, as the metrics show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LinkReport {
    /// The peer's node id.
    pub peer: String,
    /// The connection this broker sends on is up.
    pub up: bool,
    /// Connections made.
    pub connects: u64,
    /// Connections lost.
    pub lost: u64,
    /// The smoothed round trip of the connection, while it is up, microseconds.
    pub rtt_micros: Option<u64>,
    /// UDP datagrams sent to the peer.
    pub datagrams_sent: u64,
    /// Packets to the peer that QUIC declared lost (and sent again).
    pub lost_packets: u64,
    /// Bytes of messages written to the peer.
    pub bytes_sent: u64,
    /// Bytes of messages read from the peer.
    pub bytes_received: u64,
}

impl Links {
    /// A poisoned lock (a panic elsewhere while it was held) still holds a usable table: these
    /// are counts for people, and the broker must not stop over them.
    fn table(&self) -> MutexGuard<'_, BTreeMap<String, Link>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The link to `peer` came up on `conn` (connected, its hello written).
    pub(crate) fn up(&self, peer: &str, conn: &quinn::Connection) {
        let mut t = self.table();
        let l = t.entry(peer.to_owned()).or_default();
        if let Some(old) = l.conn.replace(conn.clone()) {
            // Not said down first (cannot happen in the dial loop): counted as lost all the same.
            l.ended = l.ended.plus(Sent::of(&old));
            l.lost += 1;
        }
        l.connects += 1;
    }

    /// The link to `peer` on `conn` went down. Only that connection: the dial loop of a peer
    /// removed from the cluster and added again at once may end after the new one came up.
    pub(crate) fn down(&self, peer: &str, conn: &quinn::Connection) {
        let mut t = self.table();
        if let Some(l) = t.get_mut(peer)
            && l.conn.as_ref().is_some_and(|c| c.stable_id() == conn.stable_id())
            && let Some(c) = l.conn.take()
        {
            l.ended = l.ended.plus(Sent::of(&c));
            l.lost += 1;
        }
    }

    /// The count of message bytes written to `peer`, for its dial loop to add to.
    pub(crate) fn bytes_out(&self, peer: &str) -> Arc<AtomicU64> {
        self.table().entry(peer.to_owned()).or_default().bytes_out.clone()
    }

    /// The count of message bytes read from `peer`, for the task reading its stream.
    pub(crate) fn bytes_in(&self, peer: &str) -> Arc<AtomicU64> {
        self.table().entry(peer.to_owned()).or_default().bytes_in.clone()
    }

    /// `peer` left the cluster: its link leaves the metrics (a task still running for it
    /// counts into handles no longer listed).
    pub(crate) fn remove(&self, peer: &str) {
        self.table().remove(peer);
    }

    /// Every link, in node id order.
    pub(crate) fn report(&self) -> Vec<LinkReport> {
        self.table()
            .iter()
            .map(|(peer, l)| {
                let now = l.conn.as_ref().map(Sent::of).unwrap_or_default();
                let sent = l.ended.plus(now);
                LinkReport {
                    peer: peer.clone(),
                    up: l.conn.is_some(),
                    connects: l.connects,
                    lost: l.lost,
                    rtt_micros: l.conn.as_ref().map(|c| c.rtt().as_micros().min(u128::from(u64::MAX)) as u64),
                    datagrams_sent: sent.datagrams,
                    lost_packets: sent.lost_packets,
                    bytes_sent: l.bytes_out.load(Relaxed),
                    bytes_received: l.bytes_in.load(Relaxed),
                }
            })
            .collect()
    }
}

/// The `felix_peer_*` metrics of `links`, in Prometheus' text format: one series per peer,
/// labelled `peer`.
pub(crate) fn render(links: &[LinkReport], out: &mut String) {
    use std::fmt::Write;
    type Value = fn(&LinkReport) -> Option<u64>;
    let series: [(&str, &str, &str, Value); 8] = [
        ("felix_peer_link_up", "gauge", "The connection this broker sends to the peer on is up (1) or not (0).", |l| {
            Some(u64::from(l.up))
        }),
        ("felix_peer_connects_total", "counter", "Connections made to the peer.", |l| Some(l.connects)),
        (
            "felix_peer_links_lost_total",
            "counter",
            "Connections to the peer that were up and ended (it went quiet past the 2 s idle timeout, closed it, or a write failed).",
            |l| Some(l.lost),
        ),
        (
            "felix_peer_rtt_micros",
            "gauge",
            "Smoothed round trip to the peer, microseconds (while the link is up).",
            |l| l.rtt_micros,
        ),
        ("felix_peer_datagrams_sent_total", "counter", "UDP datagrams sent to the peer.", |l| Some(l.datagrams_sent)),
        (
            "felix_peer_lost_packets_total",
            "counter",
            "Packets to the peer that QUIC declared lost and sent again.",
            |l| Some(l.lost_packets),
        ),
        ("felix_peer_bytes_sent_total", "counter", "Bytes of messages written to the peer.", |l| Some(l.bytes_sent)),
        ("felix_peer_bytes_received_total", "counter", "Bytes of messages read from the peer.", |l| {
            Some(l.bytes_received)
        }),
    ];
    for (name, kind, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for l in links {
            if let Some(v) = value(l) {
                let _ = writeln!(out, "{name}{{peer=\"{}\"}} {v}", label(&l.peer));
            }
        }
    }
}

/// A label value escaped as the text format wants it (node ids are plain, but nothing here
/// relies on that).
fn label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(peer: &str, up: bool) -> LinkReport {
        LinkReport {
            peer: peer.into(),
            up,
            connects: 2,
            lost: 1,
            rtt_micros: up.then_some(180),
            datagrams_sent: 40,
            lost_packets: 3,
            bytes_sent: 5000,
            bytes_received: 7000,
        }
    }

    #[test]
    fn each_peer_is_a_labelled_series_and_a_down_link_has_no_round_trip() {
        let mut out = String::new();
        render(&[report("n2", true), report("n\"3", false)], &mut out);
        assert!(out.contains("# TYPE felix_peer_link_up gauge\nfelix_peer_link_up{peer=\"n2\"} 1\n"), "{out}");
        assert!(out.contains("felix_peer_link_up{peer=\"n\\\"3\"} 0\n"), "escaped: {out}");
        assert!(out.contains("felix_peer_rtt_micros{peer=\"n2\"} 180\n"), "{out}");
        assert!(!out.contains("felix_peer_rtt_micros{peer=\"n\\\"3\"}"), "no round trip while down: {out}");
        for name in [
            "felix_peer_connects_total{peer=\"n2\"} 2",
            "felix_peer_links_lost_total{peer=\"n2\"} 1",
            "felix_peer_datagrams_sent_total{peer=\"n2\"} 40",
            "felix_peer_lost_packets_total{peer=\"n2\"} 3",
            "felix_peer_bytes_sent_total{peer=\"n2\"} 5000",
            "felix_peer_bytes_received_total{peer=\"n2\"} 7000",
        ] {
            assert!(out.contains(name), "{name}: {out}");
        }
        // Every series is announced once, with no peer at all too.
        let mut empty = String::new();
        render(&[], &mut empty);
        assert_eq!(empty.matches("# TYPE ").count(), 8);
        assert_eq!(out.matches("# TYPE ").count(), 8);
    }

    #[test]
    fn byte_counts_are_shared_with_the_tasks_and_a_removed_peer_leaves() {
        let links = Links::default();
        let out = links.bytes_out("n2");
        out.fetch_add(100, Relaxed);
        links.bytes_in("n2").fetch_add(7, Relaxed);
        let r = links.report();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].bytes_sent, r[0].bytes_received, r[0].up, r[0].lost, r[0].connects), (100, 7, false, 0, 0));
        links.remove("n2");
        out.fetch_add(1, Relaxed);
        assert!(links.report().is_empty());
    }
}
