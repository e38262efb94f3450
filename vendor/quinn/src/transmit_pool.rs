//! Felix patch: transmit buffers shared by the connections one thread drives (see
//! FELIX-PATCHES.md and `State::drive_transmit`).
//!
//! A connection borrows a buffer for one call of its driver's transmit step and gives it back
//! after, so an idle connection holds none, and a busy thread reuses the few it has (grown to
//! a segmentation-offload batch once) without allocating.

use std::cell::RefCell;

/// Buffers a thread keeps: more than a driver borrows at once (one), room for a few waiting on
/// a socket that was not writable.
const KEPT: usize = 4;

thread_local! {
    static POOL: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer, empty, with whatever capacity it was given back with.
pub(crate) fn take() -> Vec<u8> {
    POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default()
}

/// Gives a buffer back to this thread's pool (dropped when the pool is full).
pub(crate) fn give(mut buf: Vec<u8>) {
    if buf.capacity() == 0 {
        return;
    }
    buf.clear();
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < KEPT {
            p.push(buf);
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_buffer_given_back_is_taken_again_with_its_capacity() {
        let mut b = super::take();
        b.extend_from_slice(&[1; 6000]);
        let cap = b.capacity();
        super::give(b);
        let again = super::take();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), cap);
        assert_eq!(super::take().capacity(), 0, "only one was given");
    }
}
