//! The forwarding kinds' bodies (3 `forward`, 4 `forward_answer`, and their batches 15
//! `forward_batch` and 16 `forward_answers`, D64): written, written in pieces, and read.

use super::*;

/// What a forwarded publish's encoding takes, about (room reserved before writing it).
pub(super) fn forward_hint(p: &ForwardedPublish) -> usize {
    p.records.block_len() + p.key.as_ref().map_or(0, Bytes::len) + 192
}

/// Writes `u32 count`, then each item as `u32 len` + what `put` writes (the length patched
/// in place afterwards: each item is written once).
pub(super) fn put_list<T>(
    body: &mut BytesMut,
    list: &[T],
    what: &'static str,
    put: impl Fn(&mut BytesMut, &T) -> Result<(), PeerError>,
) -> Result<(), PeerError> {
    body.put_u32(u32::try_from(list.len()).map_err(|_| PeerError::FieldTooLong(what))?);
    for item in list {
        let at = body.len();
        body.put_u32(0);
        put(body, item)?;
        let len = u32::try_from(body.len() - at - 4).map_err(|_| PeerError::FieldTooLong(what))?;
        body[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }
    Ok(())
}

/// A `forward` body (kind 3).
pub(super) fn put_forward(body: &mut BytesMut, p: &ForwardedPublish) -> Result<(), PeerError> {
    let records = put_forward_head(body, p)?;
    body.extend_from_slice(records);
    Ok(())
}

/// A `forward` body up to its block's bytes, which it returns (not copied).
pub(super) fn put_forward_head<'a>(body: &mut BytesMut, p: &'a ForwardedPublish) -> Result<&'a Bytes, PeerError> {
    body.put_u64(p.id);
    put_str16(body, &p.tenant_id, "tenant")?;
    put_str16(body, &p.namespace, "namespace")?;
    put_str16(body, &p.stream, "stream")?;
    body.put_u32(p.shard);
    body.put_u64(p.generation);
    let envelope = p.records.envelope();
    body.put_u8(
        u8::from(p.acked)
            | (u8::from(p.key.is_some()) << 1)
            | (u8::from(envelope.is_some()) << 2)
            | (u8::from(p.records.stores_packed()) << 3),
    );
    let publisher = p.publisher.as_deref().unwrap_or(&[]);
    body.put_u8(u8::try_from(publisher.len()).map_err(|_| PeerError::FieldTooLong("publisher"))?);
    body.extend_from_slice(publisher);
    for (f, what) in [(p.key.as_ref(), "key"), (envelope, "envelope")] {
        if let Some(f) = f {
            body.put_u16(u16::try_from(f.len()).map_err(|_| PeerError::FieldTooLong(what))?);
            body.extend_from_slice(f);
        }
    }
    Ok(p.records.put_block_header(body))
}

/// A `forward_answer` body (kind 4).
pub(super) fn put_answer(body: &mut BytesMut, id: u64, outcome: &ForwardOutcome) -> Result<(), PeerError> {
    body.put_u64(id);
    match outcome {
        ForwardOutcome::Appended { offset } => {
            body.put_u8(0);
            body.put_u8(u8::from(offset.is_some()));
            body.put_u64(offset.unwrap_or(0));
        }
        ForwardOutcome::Refused { code, retry, message } => {
            body.put_u8(1);
            body.put_u16(code.number());
            body.put_u8(retry.number());
            put_str16(body, message, "message")?;
        }
    }
    Ok(())
}

/// A `forward` (one publish, kind 3) or `forward_batch` (kind 15) in pieces: each publish's
/// records, when large, go to the transport as they came from the client (shared, not
/// copied into the frame), so a forwarded payload is copied only into QUIC's packets.
pub(super) fn forward_chunks(list: &[ForwardedPublish], batch: bool, out: &mut Vec<Bytes>) -> Result<(), PeerError> {
    // Every publish's head first, so that every length is known before the first byte.
    let mut heads = BytesMut::with_capacity(list.len() * 96);
    let mut parts = Vec::with_capacity(list.len());
    for p in list {
        let records = put_forward_head(&mut heads, p)?;
        parts.push((heads.len(), records));
    }
    let records: usize = parts.iter().map(|(_, r)| r.len()).sum();
    let body_len = heads.len() + records + if batch { 4 + 4 * list.len() } else { 0 };
    if body_len + 1 > MAX_PEER_FRAME {
        return Err(PeerError::TooLong(body_len + 1));
    }
    let mut small = BytesMut::with_capacity(heads.len() + 9 + 4 * list.len());
    small.put_u32((body_len + 1) as u32);
    small.put_u8(if batch { 15 } else { 3 });
    if batch {
        small.put_u32(list.len() as u32);
    }
    let mut start = 0;
    for (end, records) in parts {
        if batch {
            small.put_u32((end - start + records.len()) as u32);
        }
        small.extend_from_slice(&heads[start..end]);
        start = end;
        put_piece(&mut small, out, records);
    }
    if !small.is_empty() {
        out.push(small.freeze());
    }
    Ok(())
}

/// A `forward` body (kind 3), read to the end of `r`.
pub(super) fn read_forward(r: &mut Reader) -> Result<ForwardedPublish, PeerError> {
    let id = r.u64("id")?;
    let tenant_id = r.str16("tenant")?;
    let namespace = r.str16("namespace")?;
    let stream = r.str16("stream")?;
    let shard = r.u32("shard")?;
    let generation = r.u64("generation")?;
    let flags = r.u8("flags")?;
    let plen = r.u8("publisher_len")? as usize;
    let publisher = r.bytes(plen, "publisher")?;
    let mut field = |bit: u8, what: &'static str| -> Result<Option<Bytes>, PayloadError> {
        if flags & bit == 0 {
            return Ok(None);
        }
        let len = r.u16(what)?;
        r.bytes(usize::from(len), what).map(Some)
    };
    let key = field(0x2, "key_len")?;
    let envelope = field(0x4, "envelope_len")?;
    // The origin checked the block against its frame limit; the owner's bound is the
    // storage reader's (a peer frame is at most `MAX_PEER_FRAME` compressed bytes).
    let records = Records::read_block(r, flags & 0x8 != 0, crate::storage::MAX_BATCH_BODY)?;
    let records = if envelope.is_some() { records.with_envelope(envelope) } else { records };
    let acked = flags & 0x1 != 0;
    Ok(ForwardedPublish {
        id,
        tenant_id,
        namespace,
        stream,
        shard,
        generation,
        key,
        records,
        publisher: (!publisher.is_empty()).then_some(publisher),
        acked,
    })
}

/// A `forward_answer` body (kind 4).
pub(super) fn read_answer(r: &mut Reader) -> Result<(u64, ForwardOutcome), PeerError> {
    let id = r.u64("id")?;
    let outcome = match r.u8("status")? {
        0 => {
            let has = r.u8("has_offset")? != 0;
            let offset = r.u64("offset")?;
            ForwardOutcome::Appended { offset: has.then_some(offset) }
        }
        _ => ForwardOutcome::Refused {
            code: ErrorCode::from_number(r.u16("code")?),
            retry: RetryClass::from_number(r.u8("retry")?),
            message: r.str16("message")?,
        },
    };
    Ok((id, outcome))
}

/// `u32 count`, then each item as `u32 len` + its bytes, read by `read` from a reader of its
/// own (a forward's records run to the end of its item). A count the bytes left could not hold
/// (at least 4 bytes an item) is refused before anything is allocated for it.
pub(super) fn read_list<T>(
    r: &mut Reader,
    read: impl Fn(&mut Reader) -> Result<T, PeerError>,
) -> Result<Vec<T>, PeerError> {
    let count = r.u32("count")?;
    if count as usize > r.remaining() / 4 {
        return Err(PeerError::Malformed(PayloadError::CountTooLarge { count, remaining: r.remaining() }));
    }
    let mut list = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let len = r.u32("len")? as usize;
        let mut item = Reader::new(r.bytes(len, "item")?);
        list.push(read(&mut item)?);
    }
    Ok(list)
}
