use super::*;
use crate::binary::Codec;

fn batch(base: u64, payloads: &[&str]) -> StoredBatch {
    StoredBatch {
        key: None,
        base_offset: base,
        timestamp_micros: 42,
        generation_start: false,
        publisher: Some(Bytes::from_static(b"alice")),
        producer: None,
        state: None,
        records: Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).unwrap(),
    }
}

#[test]
fn index_round_trip_and_every_bad_index_is_refused() {
    let mut b = batch(7, &["x", "yy"]);
    b.producer = Some((9, 4));
    let entries = vec![IndexEntry::of(&batch(0, &["a"]), 0), IndexEntry::of(&b, 40)];
    assert_eq!(entries[1].producer.map(|p| (p.0, p.1)), Some((9, 4)));
    let idx = encode_index(&entries, 100);
    assert_eq!(decode_index(&idx, 100), Ok(entries));
    assert_eq!(decode_index(&idx, 101), Err(IndexError::Stale { covered: 100, actual: 101 }));
    for i in 0..idx.len() {
        let mut bad = idx.to_vec();
        bad[i] ^= 0x10;
        assert!(decode_index(&bad, 100).is_err(), "flipped byte {i}");
    }
    assert_eq!(decode_index(&idx[..idx.len() - 1], 100), Err(IndexError::Malformed));
    assert_eq!(decode_index(b"", 0), Err(IndexError::Malformed));
}

/// The sliced CRC equals the byte-at-a-time definition for every length and split.
#[test]
fn crc32c_equals_the_bitwise_definition() {
    fn bytewise(data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    let data: Vec<u8> = (0..300u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    for len in 0..data.len() {
        assert_eq!(crc32c(&data[..len]), bytewise(&data[..len]), "length {len}");
    }
    for split in 0..64 {
        assert_eq!(crc32c_append(crc32c(&data[..split]), &data[split..]), bytewise(&data), "split {split}");
    }
}

#[test]
fn a_compressed_batch_is_stored_compressed_and_read_back_as_it_was() {
    for codec in [Codec::Zstd, Codec::Lz4] {
        let mut b = batch(5, &crate::samples::COMPRESSIBLE);
        b.records = crate::samples::packed_records(codec);
        b.producer = Some((3, 1));
        let plain = StoredBatch { records: b.records.plain(), ..b.clone() };
        let (mut packed_buf, mut plain_buf) = (BytesMut::new(), BytesMut::new());
        encode_batch(&b, &mut packed_buf);
        encode_batch(&plain, &mut plain_buf);
        assert!(packed_buf.len() < plain_buf.len(), "{codec}: {} vs {}", packed_buf.len(), plain_buf.len());
        assert_eq!(packed_buf[BATCH_HEADER_LEN + 16] & FLAG_COMPRESSED, FLAG_COMPRESSED);
        encode_batch(&batch(9, &["after"]), &mut packed_buf);
        let r = decode_segment(packed_buf.clone().freeze());
        assert_eq!(r.problem, None);
        assert_eq!(r.batches[0], b, "{codec}: the compressed form kept");
        assert_eq!(r.batches[0].records.payloads().collect::<Vec<_>>(), plain.records.payloads().collect::<Vec<_>>());
        // The producer digest is the plain block's, whichever way the batch is stored.
        assert_eq!(IndexEntry::of(&r.batches[0], 0).producer, IndexEntry::of(&plain, 0).producer);
        // A codec byte this version does not know, under a sound checksum: refused.
        let mut bad = packed_buf[..BATCH_HEADER_LEN + plain_len_of(&b)].to_vec();
        let at = BATCH_HEADER_LEN + 8 + 8 + 1 + 1 + 5 + 16;
        bad[at] = 7;
        let crc = crc32c(&bad[BATCH_HEADER_LEN..]);
        bad[8..12].copy_from_slice(&crc.to_be_bytes());
        let r = decode_segment(Bytes::from(bad));
        assert!(
            matches!(r.problem, Some(SegmentError::Malformed { error: PayloadError::UnknownCodec(7), .. })),
            "{:?}",
            r.problem
        );
    }
}

#[test]
fn a_batch_keeps_its_key_across_a_restart() {
    let mut b = batch(3, &["x", "y"]);
    b.key = Some(Bytes::from_static(b"customer-7"));
    b.producer = Some((1, 2));
    let mut c = batch(5, &["z"]);
    c.key = Some(Bytes::new()); // an empty key is still a key
    c.records = crate::samples::packed_records(Codec::Lz4).with_envelope(Some(Bytes::from_static(b"\x01\x01\x02k1")));
    let mut buf = BytesMut::new();
    for x in [&b, &c, &batch(9, &["unkeyed"])] {
        encode_batch(x, &mut buf);
    }
    let r = decode_segment(buf.freeze());
    assert_eq!(r.problem, None);
    assert_eq!(r.batches, vec![b, c, batch(9, &["unkeyed"])]);
    assert_eq!(r.batches[2].key, None);
    assert_eq!(r.batches[1].records.envelope(), Some(&Bytes::from_static(b"\x01\x01\x02k1")), "D58");
}

/// The body length of `b` as stored.
fn plain_len_of(b: &StoredBatch) -> usize {
    let mut buf = BytesMut::new();
    encode_batch(b, &mut buf);
    buf.len() - BATCH_HEADER_LEN
}

#[test]
fn a_batch_header_read_alone_is_checked() {
    let mut buf = BytesMut::new();
    encode_batch(&batch(3, &["abc"]), &mut buf);
    let header: [u8; BATCH_HEADER_LEN] = buf[..BATCH_HEADER_LEN].try_into().unwrap();
    assert_eq!(batch_body_len(&header), Ok(buf.len() - BATCH_HEADER_LEN));
    let mut bad = header;
    bad[0] ^= 1;
    assert!(matches!(batch_body_len(&bad), Err(SegmentError::BadMagic { .. })));
    let mut huge = header;
    huge[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(batch_body_len(&huge), Err(SegmentError::TooLong { .. })));
}

#[test]
fn a_commits_state_round_trips_in_the_segment_and_the_index() {
    let changes: Vec<StateChange> = vec![
        ("balance".into(), Some(Bytes::from_static(b"10"))),
        ("owner".into(), None),
        (String::new(), Some(Bytes::new())),
    ];
    let state = encode_state_changes(&changes).unwrap();
    assert_eq!(decode_state_changes(&state).unwrap(), changes);
    let mut b = batch(7, &["event"]);
    b.state = Some(state);
    b.producer = Some((1, 2));
    let mut buf = BytesMut::new();
    encode_batch(&b, &mut buf);
    encode_batch(&batch(8, &["plain"]), &mut buf);
    let r = decode_segment(buf.freeze());
    assert_eq!(r.problem, None);
    assert_eq!(r.batches, vec![b.clone(), batch(8, &["plain"])]);
    let entries = vec![IndexEntry::of(&b, 0), IndexEntry::of(&batch(8, &["plain"]), 80)];
    assert!(entries[0].state && !entries[1].state);
    assert_eq!(decode_index(&encode_index(&entries, 100), 100), Ok(entries));
    // A key too long for its length field is refused, not cut.
    assert_eq!(encode_state_changes(&[("k".repeat(MAX_STATE_KEY + 1), None)]), None);
}

#[test]
fn bad_state_bytes_are_errors_and_a_batch_carrying_them_is_malformed() {
    let state = encode_state_changes(&[("k".into(), Some(Bytes::from_static(b"v")))]).unwrap();
    for cut in 0..state.len() {
        assert!(decode_state_changes(&state.slice(..cut)).is_err(), "cut at {cut}");
    }
    let mut bad_op = state.to_vec();
    bad_op[4] = 9;
    assert_eq!(decode_state_changes(&Bytes::from(bad_op.clone())), Err(PayloadError::InvalidStateOp(9)));
    let mut not_utf8 = state.to_vec();
    not_utf8[7] = 0xFF;
    assert!(matches!(decode_state_changes(&Bytes::from(not_utf8)), Err(PayloadError::InvalidUtf8 { .. })));
    let mut b = batch(1, &["e"]);
    b.state = Some(Bytes::from(bad_op));
    let mut buf = BytesMut::new();
    encode_batch(&b, &mut buf);
    let r = decode_segment(buf.freeze());
    assert!(r.batches.is_empty());
    assert!(matches!(r.problem, Some(SegmentError::Malformed { .. })), "{:?}", r.problem);
}

proptest::proptest! {
    /// Whatever the bytes, decoding state changes returns, and what decodes encodes back.
    #[test]
    fn state_decoding_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
        let data = Bytes::from(data);
        if let Ok(changes) = decode_state_changes(&data) {
            proptest::prop_assert_eq!(encode_state_changes(&changes), Some(data));
        }
    }
}

#[test]
fn producer_id_and_sequence_round_trip() {
    let mut b = batch(7, &["x", "yy"]);
    b.producer = Some((0xDEAD_BEEF_0000_0001, 41));
    let mut buf = BytesMut::new();
    encode_batch(&b, &mut buf);
    encode_batch(&batch(9, &["z"]), &mut buf);
    let r = decode_segment(buf.freeze());
    assert_eq!(r.problem, None);
    assert_eq!(r.batches[0], b);
    assert_eq!(r.batches[1].producer, None);
}

#[test]
fn crc32c_known_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
}

#[test]
fn round_trip_and_torn_tail() {
    let mut seg = BytesMut::new();
    encode_batch(&batch(0, &["a", "bb"]), &mut seg);
    encode_batch(&batch(2, &["c"]), &mut seg);
    let whole = decode_segment(seg.clone().freeze());
    assert_eq!(whole.batches, vec![batch(0, &["a", "bb"]), batch(2, &["c"])]);
    assert_eq!((whole.valid_len, whole.problem), (seg.len(), None));
    let first_len = {
        let mut one = BytesMut::new();
        encode_batch(&batch(0, &["a", "bb"]), &mut one);
        one.len()
    };
    for cut in first_len + 1..seg.len() {
        let r = decode_segment(seg.clone().freeze().slice(..cut));
        assert_eq!(r.batches.len(), 1);
        assert_eq!(r.valid_len, first_len);
        assert!(matches!(r.problem, Some(SegmentError::Torn { .. })), "{cut}");
    }
}

#[test]
fn every_flipped_byte_is_caught() {
    let mut seg = BytesMut::new();
    encode_batch(&batch(7, &["payload"]), &mut seg);
    for i in 0..seg.len() {
        let mut bad = seg.clone();
        bad[i] ^= 0x40;
        let r = decode_segment(bad.freeze());
        assert!(r.batches.is_empty() && r.problem.is_some(), "byte {i} flip went unnoticed");
    }
}

#[test]
fn unknown_batch_flags_are_refused_not_masked() {
    let mut seg = BytesMut::new();
    encode_batch(&batch(0, &["a"]), &mut seg);
    // Set an unknown flag bit and fix the checksum, as a newer writer would.
    seg[BATCH_HEADER_LEN + 16] |= 0x40;
    let crc = crc32c(&seg[BATCH_HEADER_LEN..]);
    seg[8..12].copy_from_slice(&crc.to_be_bytes());
    let r = decode_segment(seg.freeze());
    assert!(r.batches.is_empty());
    assert_eq!(r.problem, Some(SegmentError::UnknownFlags { at: 0, flags: 0x40 }));
}

#[test]
fn backward_offsets_stop_reading_and_forward_gaps_do_not() {
    let mut seg = BytesMut::new();
    encode_batch(&batch(0, &["a"]), &mut seg);
    encode_batch(&batch(5, &["b"]), &mut seg); // offsets 1..5: a write that failed
    encode_batch(&batch(3, &["c"]), &mut seg);
    let r = decode_segment(seg.freeze());
    assert_eq!(r.batches.len(), 2);
    assert!(matches!(r.problem, Some(SegmentError::OutOfOrder { got: 3, expected: 6, .. })));
}

#[test]
fn a_corrupt_batch_inside_the_file_is_skipped_and_the_rest_served() {
    let mut seg = BytesMut::new();
    encode_batch(&batch(0, &["a"]), &mut seg);
    let second = seg.len();
    encode_batch(&batch(1, &["bbbb"]), &mut seg);
    let third = seg.len();
    encode_batch(&batch(2, &["c"]), &mut seg);
    let mut bytes = seg.to_vec();
    bytes[third - 2] ^= 0x40; // a flipped bit in the second batch's payload
    let r = decode_segment(Bytes::from(bytes.clone()));
    assert_eq!(r.batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), [0, 2]);
    assert_eq!(r.positions, [0, third]);
    assert_eq!(r.damaged, [SegmentError::BadChecksum { at: second }]);
    assert_eq!((r.problem, r.valid_len), (None, bytes.len()));
    // The same damage in the last batch is a bad tail: cut there.
    bytes[third - 2] ^= 0x40;
    let last = bytes.len() - 2;
    bytes[last] ^= 0x40;
    let r = decode_segment(Bytes::from(bytes));
    assert_eq!(r.batches.len(), 2);
    assert_eq!((r.problem, r.valid_len), (Some(SegmentError::BadChecksum { at: third }), third));
}

#[test]
fn names() {
    assert_eq!(segment_name(42), "00000000000000000042.seg");
    assert_eq!(parse_segment_name("00000000000000000042.seg"), Some(42));
    assert_eq!(parse_segment_name("42.seg"), None);
    for n in ["orders", "../etc", ".hidden", "a/b", "ünï", "", "%41"] {
        let c = path_component(n);
        assert_eq!(path_component_len(n), c.len(), "{n}");
        assert!(!c.contains('/') && c != "." && c != ".." && !c.starts_with('.'), "{c}");
        assert_eq!(parse_path_component(&c).as_deref(), Some(n));
    }
}

/// A checkpoint written in place after other bytes (a replicated shard's snapshot) is the
/// same checkpoint, byte for byte, and one that cannot be written leaves the bytes before it
/// as they were.
#[test]
fn a_state_checkpoint_written_in_place_is_the_checkpoint_and_a_failed_one_leaves_nothing() {
    let c = StateCheckpoint {
        as_of: 41,
        values: vec![("a".into(), Bytes::from_static(b"one"), 7), ("b".into(), Bytes::from_static(b""), 9)],
    };
    let whole = encode_state_checkpoint(&c).expect("encodes");
    let mut out = b"head".to_vec();
    let values = c.values.iter().map(|(k, v, version)| (k.as_str(), v.as_ref(), *version));
    assert_eq!(encode_state_checkpoint_into(c.as_of, values, &mut out), Some(()));
    assert_eq!(&out[..4], b"head");
    assert_eq!(&out[4..], &whole[..]);
    assert_eq!(decode_state_checkpoint(&Bytes::copy_from_slice(&out[4..])).expect("reads"), c);

    let long = "k".repeat(u16::MAX as usize + 1);
    let values = [(long.as_str(), &b"v"[..], 1u64)];
    let mut out = b"head".to_vec();
    assert_eq!(encode_state_checkpoint_into(1, values.iter().copied(), &mut out), None);
    assert_eq!(out, b"head");
}
