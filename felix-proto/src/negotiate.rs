//! Capability negotiation: what each side may send the other, decided from the `auth` /
//! `auth_ok` exchange. Pure functions, so every row of the spec's table is testable alone.

use crate::features::Features;
use crate::flags::Flags;
use crate::message::{Auth, AuthOk};

/// What the broker learned from a client's `auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOffer {
    /// Whether `client_flags` was present (decides `auth_ok` vs plain `ok`).
    pub negotiating: bool,
    /// The client's flags; `ORIGINAL_V1` when absent.
    pub flags: Flags,
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
        let extended = a.client_features.is_some_and(|f| f & Features::EXTENDED_MARKER != 0);
        ClientOffer {
            negotiating,
            flags,
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
}

/// The broker's answer to an `auth` that offered `client_flags`; `None` means plain `ok`.
pub fn broker_answer(
    offer: &ClientOffer,
    server_flags: Flags,
    server_features: Features,
    publish_window: u32,
) -> Option<AuthOk> {
    if !offer.negotiating {
        return None;
    }
    let (lo, hi) = server_features.to_words(offer.extended);
    let pipeline = offer.has(Features::PUBLISH_PIPELINE) && publish_window > 0;
    Some(AuthOk {
        server_flags: server_flags.bits(),
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
    /// The features the broker advertised (none after a plain `ok`).
    pub server_features: Features,
    /// The pipelined-publish window, when granted and the client offered pipelining.
    pub publish_window: Option<u32>,
    /// Whether the window is per stream (else one window shared by the connection's streams).
    pub per_stream_window: bool,
    /// The flags the client itself offered (what it may receive).
    pub client_flags: Flags,
    /// The features the client itself offered.
    pub client_features: Features,
}

impl Negotiated {
    /// From an `auth_ok`. A window is honoured only if the client offered pipelining.
    pub fn from_auth_ok(a: &AuthOk, client_flags: Flags, client_features: Features) -> Negotiated {
        let server_features = Features::from_words(a.server_features, a.server_features_hi);
        let offered_pipeline = client_features.contains(Features::PUBLISH_PIPELINE);
        Negotiated {
            server_flags: Flags(a.server_flags),
            server_features,
            publish_window: a.publish_window.filter(|w| *w > 0 && offered_pipeline),
            per_stream_window: server_features.contains(Features::STREAM_PUBLISH_WINDOW),
            client_flags,
            client_features,
        }
    }
    /// After a plain `ok`: a legacy broker (or a legacy client).
    pub fn legacy(client_flags: Flags, client_features: Features) -> Negotiated {
        Negotiated {
            server_flags: Flags::ORIGINAL_V1,
            server_features: Features::NONE,
            publish_window: None,
            per_stream_window: false,
            client_flags,
            client_features,
        }
    }
    /// Whether the client may send frames using `f` (decided from the broker's set only).
    pub fn may_send(&self, f: Flags) -> bool {
        self.server_flags.contains(f)
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
            client_features: features,
            client_features_hi: hi,
        }
    }

    #[test]
    fn legacy_client_gets_plain_ok() {
        let o = ClientOffer::from_auth(&auth(None, Some(0x800), None));
        assert!(!o.negotiating);
        assert_eq!(o.flags, Flags::ORIGINAL_V1);
        assert_eq!(broker_answer(&o, Flags::KNOWN, Features::ERROR_CODES, 64), None);
    }

    #[test]
    fn hi_word_only_to_an_extended_client() {
        let f = Features::ERROR_CODES | Features::PUBLISH_WIDTH;
        let plain = ClientOffer::from_auth(&auth(Some(25), Some(0x800), None));
        let a = broker_answer(&plain, Flags::KNOWN, f, 0).unwrap();
        assert_eq!((a.server_features, a.server_features_hi), (Some(0x800), None));
        let ext = ClientOffer::from_auth(&auth(Some(25), Some(0x8000_0800), Some(2)));
        let a = broker_answer(&ext, Flags::KNOWN, f, 0).unwrap();
        assert_eq!((a.server_features, a.server_features_hi), (Some(0x8000_0800), Some(4)));
    }

    #[test]
    fn window_only_for_a_pipelining_client() {
        let no = ClientOffer::from_auth(&auth(Some(25), None, None));
        assert_eq!(broker_answer(&no, Flags::KNOWN, Features::PUBLISH_PIPELINE, 8).unwrap().publish_window, None);
        let yes = ClientOffer::from_auth(&auth(Some(25), Some(0x8000), None));
        assert_eq!(broker_answer(&yes, Flags::KNOWN, Features::PUBLISH_PIPELINE, 8).unwrap().publish_window, Some(8));
        assert_eq!(broker_answer(&yes, Flags::KNOWN, Features::PUBLISH_PIPELINE, 0).unwrap().publish_window, None);
    }

    #[test]
    fn client_ignores_a_window_it_did_not_ask_for() {
        let a = AuthOk {
            server_flags: 25,
            server_features: None,
            server_features_hi: None,
            listener_ports: None,
            publish_window: Some(4),
        };
        assert_eq!(Negotiated::from_auth_ok(&a, Flags(25), Features::NONE).publish_window, None);
        assert_eq!(Negotiated::from_auth_ok(&a, Flags(25), Features::PUBLISH_PIPELINE).publish_window, Some(4));
    }
}
