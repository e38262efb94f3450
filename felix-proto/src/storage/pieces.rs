//! Formats read item by item from bytes handed over in pieces of any size ([`feed_items`]):
//! a state read back from disk a piece at a time, each item taken as soon as its bytes are
//! in, so only an item cut by a piece's end is ever held over.

/// How the item a reader waits for reads at the start of some bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemLen {
    /// It is this many bytes long, more than there are: wait for more.
    Needs(usize),
    /// It is whole in the first this many bytes.
    Whole(usize),
    /// What is left is the format's tail (a checksum, bytes it ignores): handed over as it
    /// comes.
    Tail,
}

/// A format read item by item ([`feed_items`]).
pub trait Items {
    /// Why bytes cannot be read.
    type Error;
    /// How the next item reads at the start of `b` (its length as soon as its first bytes
    /// tell it: `Needs(n)` has `n > b.len()`).
    fn len(&self, b: &[u8]) -> ItemLen;
    /// Takes a whole item (exactly the bytes [`len`](Self::len) measured).
    fn take(&mut self, item: &[u8]) -> Result<(), Self::Error>;
    /// Takes bytes of the tail.
    fn tail(&mut self, b: &[u8]) -> Result<(), Self::Error>;
}

/// Hands `items` every whole item of `piece`, the one `carry` holds over from the last piece
/// first (completed with only the bytes it needs), and holds over the start of one cut by
/// the piece's end.
///
/// # Errors
/// The first error of `items`.
pub fn feed_items<T: Items>(carry: &mut Vec<u8>, items: &mut T, mut piece: &[u8]) -> Result<(), T::Error> {
    loop {
        if !carry.is_empty() {
            match items.len(carry) {
                ItemLen::Needs(_) if piece.is_empty() => return Ok(()),
                ItemLen::Needs(n) => {
                    let (more, rest) = piece.split_at(n.saturating_sub(carry.len()).clamp(1, piece.len()));
                    carry.extend_from_slice(more);
                    piece = rest;
                }
                ItemLen::Whole(n) => {
                    let held = std::mem::take(carry);
                    let (item, rest) = held.split_at(n.min(held.len()));
                    items.take(item)?;
                    carry.extend_from_slice(rest);
                }
                ItemLen::Tail => items.tail(&std::mem::take(carry))?,
            }
            continue;
        }
        if piece.is_empty() {
            return Ok(());
        }
        match items.len(piece) {
            ItemLen::Tail => return items.tail(piece),
            ItemLen::Whole(n) => {
                let (item, rest) = piece.split_at(n.min(piece.len()));
                items.take(item)?;
                piece = rest;
            }
            ItemLen::Needs(_) => {
                carry.extend_from_slice(piece);
                return Ok(());
            }
        }
    }
}
