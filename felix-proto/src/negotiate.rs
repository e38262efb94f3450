//! Capability negotiation: what each side may send the other, decided from the `auth` /
//! `auth_ok` exchange. Pure functions, so every row of the spec's table is testable alone.

use crate::features::Features;
use crate::flags::{Flags, FlagsHi};
use crate::message::{Auth, AuthOk};

/// What the broker learned from a client's `auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOffer {
    /// Whether `client_flags` was present (decides `auth_ok` vs plain `ok`).
    pub negotiating: bool,
    /// The client's flags; `ORIGINAL_V1` when absent.
    pub flags: Flags,
    /// The client's second flag word (D56): counted only when `flags` has
    /// [`Flags::EXTENDED`]; unknown bits kept out.
    pub flags_hi: FlagsHi,
    /// The client's features; none when absent.
    pub features: Features,
    /// Whether the client set `FEATURE_EXTENDED` (may receive `server_features_hi`).
    pub extended: bool,
}

impl ClientOffer {
    /// Reads an `auth`. Unknown flag bits in `client_flags` are kept out: a bit we do not know
    /// we will never send anyway.
    pub fn from_auth(a: &Auth) -> ClientOffer {
        let negotiating = a.client_flags.is_some();
        let flags = a.client_flags.map_or(Flags::ORIGINAL_V1, |f| Flags(f).intersection(Flags::KNOWN));
        let flags_hi = match a.client_flags_hi {
            Some(h) if flags.contains(Flags::EXTENDED) => FlagsHi(h).intersection(FlagsHi::KNOWN),
            _ => FlagsHi::EMPTY,
        };
        let extended = a.client_features.is_some_and(|f| f & Features::EXTENDED_MARKER != 0);
        ClientOffer {
            negotiating,
            flags,
            flags_hi,
            features: Features::from_words(a.client_features, a.client_features_hi),
            extended,
        }
    }
    /// Whether the client offered a feature.
    pub fn has(&self, f: Features) -> bool {
        self.features.contains(f)
    }
    /// Whether the client offered a flag.
    pub fn offered(&self, f: Flags) -> bool {
        self.flags.contains(f)
    }
    /// Whether the client offered a second-word flag (D56).
    pub fn offered_hi(&self, f: FlagsHi) -> bool {
        self.flags.contains(Flags::EXTENDED) && self.flags_hi.contains(f)
    }
}

/// The broker's answer to an `auth` that offered `client_flags`; `None` means plain `ok`.
///
/// `server_flags` goes out in full (D8), but for [`Flags::EXTENDED`] and `server_flags_hi`,
/// which only a client that set the bit is shown (D56): every other client reads the very
/// `auth_ok` it did before the second word existed.
pub fn broker_answer(
    offer: &ClientOffer,
    server_flags: Flags,
    server_flags_hi: FlagsHi,
    server_features: Features,
    publish_window: u32,
) -> Option<AuthOk> {
    if !offer.negotiating {
        return None;
    }
    let (lo, hi) = server_features.to_words(offer.extended);
    let pipeline = offer.has(Features::PUBLISH_PIPELINE) && publish_window > 0;
    let extended = offer.flags.contains(Flags::EXTENDED) && !server_flags_hi.is_empty();
    Some(AuthOk {
        server_flags: server_flags.with(Flags::EXTENDED, extended).bits(),
        server_flags_hi: extended.then_some(server_flags_hi.bits()),
        server_features: lo,
        server_features_hi: hi,
        listener_ports: None,
        publish_window: pipeline.then_some(publish_window),
    })
}

/// What a client learned from the broker's answer to its `auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// The flags the broker advertised (`ORIGINAL_V1` after a plain `ok`).
    pub server_flags: Flags,
    /// The second flag word the broker advertised (D56; empty unless `server_flags` has
    /// [`Flags::EXTENDED`]).
    pub server_flags_hi: FlagsHi,
    /// The features the broker advertised (none after a plain `ok`).
    pub server_features: Features,
    /// The pipelined-publish window, when granted and the client offered pipelining.
    pub publish_window: Option<u32>,
    /// Whether the window is per stream (else one window shared by the connection's streams).
    pub per_stream_window: bool,
    /// The flags the client itself offered (what it may receive).
    pub client_flags: Flags,
    /// The second flag word the client offered.
    pub client_flags_hi: FlagsHi,
    /// The features the client itself offered.
    pub client_features: Features,
}

impl Negotiated {
    /// From an `auth_ok`. A window is honoured only if the client offered pipelining.
    pub fn from_auth_ok(
        a: &AuthOk,
        client_flags: Flags,
        client_flags_hi: FlagsHi,
        client_features: Features,
    ) -> Negotiated {
        let server_features = Features::from_words(a.server_features, a.server_features_hi);
        let offered_pipeline = client_features.contains(Features::PUBLISH_PIPELINE);
        let server_flags = Flags(a.server_flags);
        Negotiated {
            server_flags,
            server_flags_hi: match a.server_flags_hi {
                Some(h) if server_flags.contains(Flags::EXTENDED) => FlagsHi(h),
                _ => FlagsHi::EMPTY,
            },
            server_features,
            publish_window: a.publish_window.filter(|w| *w > 0 && offered_pipeline),
            per_stream_window: server_features.contains(Features::STREAM_PUBLISH_WINDOW),
            client_flags,
            client_flags_hi,
            client_features,
        }
    }
    /// After a plain `ok`: a legacy broker (or a legacy client).
    pub fn legacy(client_flags: Flags, client_flags_hi: FlagsHi, client_features: Features) -> Negotiated {
        Negotiated {
            server_flags: Flags::ORIGINAL_V1,
            server_flags_hi: FlagsHi::EMPTY,
            server_features: Features::NONE,
            publish_window: None,
            per_stream_window: false,
            client_flags,
            client_flags_hi,
            client_features,
        }
    }
    /// Whether the client may send frames using `f` (decided from the broker's set only).
    pub fn may_send(&self, f: Flags) -> bool {
        self.server_flags.contains(f)
    }
    /// Whether the client may send frames using the second-word bit `f` (D56).
    pub fn may_send_hi(&self, f: FlagsHi) -> bool {
        self.server_flags.contains(Flags::EXTENDED) && self.server_flags_hi.contains(f)
    }
    /// Whether the broker serves a feature.
    pub fn broker_has(&self, f: Features) -> bool {
        self.server_features.contains(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(flags: Option<u16>, features: Option<u32>, hi: Option<u32>) -> Auth {
        Auth {
            tenant_id: "t".into(),
            token: "x".into(),
            client_flags: flags,
            client_flags_hi: None,
            client_features: features,
            client_features_hi: hi,
        }
    }

    #[test]
    fn legacy_client_gets_plain_ok() {
        let o = ClientOffer::from_auth(&auth(None, Some(0x800), None));
        assert!(!o.negotiating);
        assert_eq!(o.flags, Flags::ORIGINAL_V1);
        assert_eq!(broker_answer(&o, Flags::KNOWN, FlagsHi::KNOWN, Features::ERROR_CODES, 64), None);
    }

    #[test]
    fn hi_word_only_to_an_extended_client() {
        let f = Features::ERROR_CODES | Features::PUBLISH_WIDTH;
        let plain = ClientOffer::from_auth(&auth(Some(25), Some(0x800), None));
        let a = broker_answer(&plain, Flags::KNOWN, FlagsHi::KNOWN, f, 0).unwrap();
        assert_eq!((a.server_features, a.server_features_hi), (Some(0x800), None));
        let ext = ClientOffer::from_auth(&auth(Some(25), Some(0x8000_0800), Some(2)));
        let a = broker_answer(&ext, Flags::KNOWN, FlagsHi::KNOWN, f, 0).unwrap();
        assert_eq!((a.server_features, a.server_features_hi), (Some(0x8000_0800), Some(4)));
    }

    #[test]
    fn the_second_flag_word_only_to_a_client_that_set_bit_15() {
        let mut plain = auth(Some(0x7FFF), None, None);
        plain.client_flags_hi = Some(3);
        let o = ClientOffer::from_auth(&plain);
        assert_eq!(o.flags_hi, FlagsHi::EMPTY, "a word without its bit is not counted");
        let a = broker_answer(&o, Flags::KNOWN, FlagsHi::KNOWN, Features::NONE, 0).unwrap();
        assert_eq!((a.server_flags, a.server_flags_hi), (0x7FFF, None), "byte-identical to before D56");
        let mut ext = auth(Some(0xFFFF), None, None);
        ext.client_flags_hi = Some(0xFF01);
        let o = ClientOffer::from_auth(&ext);
        assert_eq!(o.flags_hi, FlagsHi::COMPRESSED_ZSTD, "unknown bits kept out");
        assert!(o.offered_hi(FlagsHi::COMPRESSED_ZSTD) && !o.offered_hi(FlagsHi::COMPRESSED_LZ4));
        let a = broker_answer(&o, Flags::KNOWN, FlagsHi::KNOWN, Features::NONE, 0).unwrap();
        assert_eq!((a.server_flags, a.server_flags_hi), (0xFFFF, Some(7)));
        let n = Negotiated::from_auth_ok(&a, Flags(0xFFFF), FlagsHi(3), Features::NONE);
        assert!(n.may_send_hi(FlagsHi::COMPRESSED_LZ4));
        // A broker that knows no second-word bit does not set bit 15 either.
        let a = broker_answer(&o, Flags::KNOWN, FlagsHi::EMPTY, Features::NONE, 0).unwrap();
        assert_eq!((a.server_flags, a.server_flags_hi), (0x7FFF, None));
        // A word without bit 15 in `server_flags` is not believed.
        let lying = AuthOk { server_flags: 0x7FFF, server_flags_hi: Some(3), ..a };
        assert!(
            !Negotiated::from_auth_ok(&lying, Flags(0xFFFF), FlagsHi(3), Features::NONE)
                .may_send_hi(FlagsHi::COMPRESSED_ZSTD)
        );
    }

    #[test]
    fn window_only_for_a_pipelining_client() {
        let no = ClientOffer::from_auth(&auth(Some(25), None, None));
        assert_eq!(
            broker_answer(&no, Flags::KNOWN, FlagsHi::KNOWN, Features::PUBLISH_PIPELINE, 8).unwrap().publish_window,
            None
        );
        let yes = ClientOffer::from_auth(&auth(Some(25), Some(0x8000), None));
        assert_eq!(
            broker_answer(&yes, Flags::KNOWN, FlagsHi::KNOWN, Features::PUBLISH_PIPELINE, 8).unwrap().publish_window,
            Some(8)
        );
        assert_eq!(
            broker_answer(&yes, Flags::KNOWN, FlagsHi::KNOWN, Features::PUBLISH_PIPELINE, 0).unwrap().publish_window,
            None
        );
    }

    #[test]
    fn client_ignores_a_window_it_did_not_ask_for() {
        let a = AuthOk {
            server_flags: 25,
            server_flags_hi: None,
            server_features: None,
            server_features_hi: None,
            listener_ports: None,
            publish_window: Some(4),
        };
        assert_eq!(Negotiated::from_auth_ok(&a, Flags(25), FlagsHi::EMPTY, Features::NONE).publish_window, None);
        assert_eq!(
            Negotiated::from_auth_ok(&a, Flags(25), FlagsHi::EMPTY, Features::PUBLISH_PIPELINE).publish_window,
            Some(4)
        );
    }
}
