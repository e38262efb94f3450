//! QUIC transport settings both drivers use (quinn's configuration types are quinn-proto's).

use quinn_proto::VarInt;
use std::net::SocketAddr;
use std::time::Duration;

/// QUIC transport settings, tuned for throughput on a LAN/loopback by default.
#[derive(Debug, Clone)]
pub struct TransportTuning {
    /// Concurrent bidirectional streams a peer may open.
    pub max_bi_streams: u32,
    /// Concurrent unidirectional streams a peer may open.
    pub max_uni_streams: u32,
    /// Per-stream receive window, bytes.
    pub stream_receive_window: u32,
    /// Per-connection receive window, bytes.
    pub receive_window: u32,
    /// Per-connection send window, bytes.
    pub send_window: u64,
    /// Idle timeout.
    pub idle_timeout: Duration,
    /// Keep-alive interval (below the idle timeout).
    pub keep_alive: Duration,
    /// Whether to probe for a larger MTU (helps bulk throughput on real networks).
    pub mtu_discovery: bool,
    /// The largest UDP payload MTU discovery probes for, bytes (1200..=65527). Fewer, larger
    /// packets cost less CPU per byte. Discovery never settles above what the path and the peer
    /// carry, so a high bound is safe on any network; above [`GSO_SAFE_MAX_UDP_PAYLOAD`] the
    /// kernel refuses quinn's segmentation-offload batches and every packet is sent alone.
    /// To loopback peers the bound is used from the first packet and is also the floor (see
    /// [`TransportTuning::to_quinn_for`]).
    pub max_udp_payload: u16,
    /// Ask the peer (through QUIC's ACK-frequency extension, which quinn peers honour and others
    /// ignore) to acknowledge only every `n + 1` ack-eliciting packets, within its usual ACK
    /// delay, instead of every second one. `None`: the standard behaviour.
    pub ack_eliciting_threshold: Option<u32>,
    /// UDP socket receive and send buffer sizes to ask the kernel for, bytes. Linux caps the
    /// request at `net.core.rmem_max`/`wmem_max`; the size obtained is logged.
    pub udp_buffer_bytes: usize,
}

impl Default for TransportTuning {
    fn default() -> Self {
        TransportTuning {
            max_bi_streams: 1024,
            max_uni_streams: 1024,
            stream_receive_window: 8 << 20,
            receive_window: 32 << 20,
            send_window: 32 << 20,
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            mtu_discovery: true,
            max_udp_payload: DEFAULT_MAX_UDP_PAYLOAD,
            ack_eliciting_threshold: None,
            udp_buffer_bytes: 4 << 20,
        }
    }
}

/// The largest UDP payload whose segmentation-offload (GSO) batch the kernel accepts: quinn hands
/// the kernel up to 10 segments in one `sendmsg`, and that batch travels as one UDP datagram of
/// at most 65,535 bytes, 8 of them the UDP header and, over IPv4, 20 the IP header:
/// (65,535 − 28) / 10 = 6,550. Above it the kernel refuses the batch (EIO), quinn turns GSO off
/// for the socket and every packet costs its own system call.
pub const GSO_SAFE_MAX_UDP_PAYLOAD: u16 = 6550;

/// The default bound for MTU discovery (see docs/operations.md for the measurements behind it).
pub const DEFAULT_MAX_UDP_PAYLOAD: u16 = 6144;

/// After quinn's black-hole detector drops the MTU to the minimum (it reads a burst of lost
/// full-size packets as a path that stopped carrying them, and congestion looks the same), probe
/// again this soon instead of quinn's one minute, so a busy connection does not spend a minute
/// on 1200-byte packets.
const BLACK_HOLE_COOLDOWN: Duration = Duration::from_secs(2);

/// Whether `addr` is this machine (IPv4-mapped loopback included).
pub fn is_loopback(addr: SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}

impl TransportTuning {
    /// The quinn transport configuration for a peer on an unknown path: start at 1200 bytes and
    /// discover the path MTU up to `max_udp_payload`.
    pub fn to_quinn(&self) -> quinn_proto::TransportConfig {
        let mut t = quinn_proto::TransportConfig::default();
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_bi_streams));
        t.max_concurrent_uni_streams(VarInt::from_u32(self.max_uni_streams));
        t.stream_receive_window(VarInt::from_u32(self.stream_receive_window));
        t.receive_window(VarInt::from_u32(self.receive_window));
        t.send_window(self.send_window);
        if let Ok(idle) = quinn_proto::IdleTimeout::try_from(self.idle_timeout) {
            t.max_idle_timeout(Some(idle));
        }
        t.keep_alive_interval(Some(self.keep_alive));
        if let Some(n) = self.ack_eliciting_threshold {
            let mut ack = quinn_proto::AckFrequencyConfig::default();
            ack.ack_eliciting_threshold(VarInt::from_u32(n));
            t.ack_frequency_config(Some(ack));
        }
        if self.mtu_discovery {
            let mut mtud = quinn_proto::MtuDiscoveryConfig::default();
            mtud.upper_bound(self.bound());
            mtud.black_hole_cooldown(BLACK_HOLE_COOLDOWN);
            t.mtu_discovery_config(Some(mtud));
        } else {
            t.mtu_discovery_config(None);
        }
        t
    }

    /// The transport configuration for a peer at `peer`. A loopback path carries 64 KiB
    /// datagrams, so there the bound is both the first and the smallest MTU: no discovery
    /// phase at 1200 bytes, and the black-hole detector (which resets to the smallest MTU on a
    /// burst of lost full-size packets, as a subscriber that cannot keep up causes) cannot
    /// collapse it. Any other path starts at 1200 and discovers ([`to_quinn`](Self::to_quinn)).
    pub fn to_quinn_for(&self, peer: SocketAddr) -> quinn_proto::TransportConfig {
        let mut t = self.to_quinn();
        if is_loopback(peer) && self.mtu_discovery {
            t.initial_mtu(self.bound());
            t.min_mtu(self.bound());
        }
        t
    }

    fn bound(&self) -> u16 {
        self.max_udp_payload.clamp(1200, 65527)
    }

    /// The quinn endpoint configuration: the largest datagram this side accepts, which it
    /// advertises to peers. Never below the GSO-safe size, so a peer configured for more than
    /// this side (an existing Felix broker pins 4096) is not held to less.
    pub fn endpoint_config(&self) -> quinn_proto::EndpointConfig {
        let mut e = quinn_proto::EndpointConfig::default();
        let _ = e.max_udp_payload_size(self.bound().max(GSO_SAFE_MAX_UDP_PAYLOAD));
        e
    }
}

/// Bidirectional streams a broker first allows a client to have open at once; more are granted
/// as it uses them ([`StreamCredit`]), up to `--max-streams`.
pub const INITIAL_BI_STREAMS: u32 = 8;

/// Unidirectional streams a broker first allows a client to have open at once (Felix's own
/// clients open none); more are granted as it uses them, up to `--max-uni-streams`.
pub const INITIAL_UNI_STREAMS: u32 = 2;

/// The rule of [`StreamCredit`]: with `open` of its `limit` streams open, a connection is
/// granted twice its limit (at most `most`) once half is open. A driver that can ask QUIC how
/// many of the peer's streams are open (quinn-proto's `remote_open_streams`) needs no more.
pub fn next_stream_limit(open: u64, limit: u64, most: u64) -> Option<u64> {
    (limit < most && open.saturating_mul(2) >= limit).then(|| limit.saturating_mul(2).min(most))
}

/// How many streams of one direction a connection may have open at once, granted as the peer
/// uses them.
///
/// Why: quinn keeps a table entry for every stream the peer may open, from the handshake on.
/// At the full `--max-streams` (128 bidirectional, 32 unidirectional) that table was 10.8 KB of
/// an idle connection's 53 KiB, although a Felix client holds two or three streams. So a
/// connection starts with a few ([`INITIAL_BI_STREAMS`]) and, whenever half of what it may
/// open is open, the driver doubles the limit (quinn sends the peer `MAX_STREAMS` at once),
/// up to the configured most. A client opening streams in a burst waits at most a round trip
/// for the next grant; nothing fails, as when it reaches the most. The limit never shrinks:
/// quinn keeps the entries it has allocated either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCredit {
    limit: u32,
    most: u32,
    open: u32,
}

impl StreamCredit {
    /// Starting at `initial` (at most `most`) of `most`.
    pub fn new(initial: u32, most: u32) -> Self {
        StreamCredit { limit: initial.min(most), most, open: 0 }
    }

    /// The limit the connection was configured with at its handshake.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Streams open now.
    pub fn open(&self) -> u32 {
        self.open
    }

    /// The peer opened a stream: the new limit to grant, when it grows.
    pub fn opened(&mut self) -> Option<u32> {
        self.open = self.open.saturating_add(1);
        let grown = next_stream_limit(self.open.into(), self.limit.into(), self.most.into())?;
        self.limit = u32::try_from(grown).unwrap_or(self.most);
        Some(self.limit)
    }

    /// One of the peer's streams ended (both its halves).
    pub fn closed(&mut self) {
        self.open = self.open.saturating_sub(1);
    }
}

#[cfg(test)]
mod credit_tests {
    use super::*;

    #[test]
    fn credit_doubles_once_half_is_open_and_stops_at_the_most() {
        let mut c = StreamCredit::new(8, 40);
        // 1..=3 open: under half of 8.
        assert_eq!((c.opened(), c.opened(), c.opened()), (None, None, None));
        assert_eq!(c.opened(), Some(16), "4 of 8 open");
        assert_eq!(c.limit(), 16);
        for _ in 5..8 {
            assert_eq!(c.opened(), None);
        }
        assert_eq!(c.opened(), Some(32), "8 of 16 open");
        for _ in 9..16 {
            assert_eq!(c.opened(), None);
        }
        assert_eq!(c.opened(), Some(40), "16 of 32 open, capped at the most");
        for _ in 17..100 {
            assert_eq!(c.opened(), None, "past the most nothing more is granted");
        }
    }

    #[test]
    fn streams_that_end_free_their_place_and_the_limit_stays() {
        let mut c = StreamCredit::new(8, 128);
        for _ in 0..3 {
            assert_eq!(c.opened(), None);
            c.closed();
        }
        assert_eq!((c.open(), c.limit()), (0, 8), "a client opening one stream at a time keeps the first limit");
        for _ in 0..4 {
            c.opened();
        }
        assert_eq!(c.limit(), 16);
        for _ in 0..10 {
            c.closed();
        }
        assert_eq!((c.open(), c.limit()), (0, 16), "never below zero open, and the limit is not taken back");
    }

    #[test]
    fn an_initial_credit_above_the_most_is_the_most() {
        let mut c = StreamCredit::new(8, 2);
        assert_eq!(c.limit(), 2);
        assert_eq!((c.opened(), c.opened()), (None, None));
    }
}
