//! Felix patch: the endpoint's events for one connection (see FELIX-PATCHES.md).
//!
//! Upstream hands them over in a tokio unbounded channel, which allocates a block of 32 events
//! (about 7 KB) with every connection and keeps it while the connection lives: at 10,000 idle
//! connections, 70 MB holding nothing. This queue holds one event in place (a keep-alive's
//! answer, the usual traffic of an idle connection, allocates nothing) and more in two buffers
//! that the endpoint and the connection swap, so a busy connection allocates nothing either
//! and no buffer is freed on another thread than the one that made it (cross-thread frees cost
//! 7% of a broker's throughput in glibc's arena locks). The connection's driver drops the
//! buffers once it has heard nothing for a while ([`EventReceiver::release`]).

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

struct Queue<T> {
    /// The oldest event, when it is the only one (no buffer needed).
    first: Option<T>,
    /// Events after `first`, in order.
    rest: VecDeque<T>,
    /// The receiver waiting for the next event.
    waker: Option<Waker>,
    /// The sender was dropped: once the queue is empty, the receiver hears `None`.
    sender_gone: bool,
    /// The receiver was dropped: sending fails.
    receiver_gone: bool,
}

/// A queue of events for one receiver, with one sender (as the endpoint holds it).
pub(crate) fn channel<T>() -> (EventSender<T>, EventReceiver<T>) {
    let q = Arc::new(Mutex::new(Queue {
        first: None,
        rest: VecDeque::new(),
        waker: None,
        sender_gone: false,
        receiver_gone: false,
    }));
    (
        EventSender(q.clone()),
        EventReceiver {
            shared: q,
            taken: VecDeque::new(),
        },
    )
}

pub(crate) struct EventSender<T>(Arc<Mutex<Queue<T>>>);

pub(crate) struct EventReceiver<T> {
    shared: Arc<Mutex<Queue<T>>>,
    /// Events taken from the queue in one go and not yet handed out (one lock per batch of
    /// datagrams); its buffer, once empty, goes back to the queue in exchange for the next.
    taken: VecDeque<T>,
}

fn lock<T>(q: &Mutex<Queue<T>>) -> MutexGuard<'_, Queue<T>> {
    // Nothing in here panics while it holds the lock; a poisoned lock's queue is still whole.
    q.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> EventSender<T> {
    /// Queues `event` and wakes the receiver; `Err` gives it back when the receiver is gone.
    pub(crate) fn send(&self, event: T) -> Result<(), T> {
        let waker = {
            let mut q = lock(&self.0);
            if q.receiver_gone {
                return Err(event);
            }
            if q.first.is_none() && q.rest.is_empty() {
                q.first = Some(event);
            } else {
                q.rest.push_back(event);
            }
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }
}

impl<T> Drop for EventSender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut q = lock(&self.0);
            q.sender_gone = true;
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The oldest queued event, and what came after it moved to `taken` (which must be empty) in
/// exchange for `taken`'s buffer.
fn take_queued<T>(q: &mut Queue<T>, taken: &mut VecDeque<T>) -> Option<T> {
    let event = q.first.take().or_else(|| q.rest.pop_front())?;
    std::mem::swap(&mut q.rest, taken);
    Some(event)
}

impl<T> EventReceiver<T> {
    /// The next event; `Ready(None)` once the sender is gone and every event was taken.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        // Each event spends the task's scheduling budget, as tokio's channel's did: a driver
        // with a flood of datagrams yields now and then, so the application reads what they
        // carried while it is still in the cache (without it, the broker's throughput fell 8%).
        #[cfg(feature = "runtime-tokio")]
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let event = match self.taken.pop_front() {
            Some(event) => Some(event),
            None => {
                let mut q = lock(&self.shared);
                match take_queued(&mut q, &mut self.taken) {
                    Some(event) => Some(event),
                    None if q.sender_gone => return Poll::Ready(None),
                    None => {
                        // Registered under the lock the sender takes: no event slips between.
                        match &q.waker {
                            Some(w) if w.will_wake(cx.waker()) => {}
                            _ => q.waker = Some(cx.waker().clone()),
                        }
                        return Poll::Pending;
                    }
                }
            }
        };
        #[cfg(feature = "runtime-tokio")]
        coop.made_progress();
        Poll::Ready(event)
    }

    /// Drops the buffers while they are empty: the connection went quiet, and what a burst
    /// grew them to is not kept for its idle hours.
    pub(crate) fn release(&mut self) {
        if self.taken.is_empty() {
            self.taken = VecDeque::new();
        }
        let mut q = lock(&self.shared);
        if q.rest.is_empty() {
            q.rest = VecDeque::new();
        }
    }

    /// Whether either buffer holds memory (for tests).
    #[cfg(test)]
    fn holds_buffers(&self) -> bool {
        self.taken.capacity() > 0 || lock(&self.shared).rest.capacity() > 0
    }
}

impl<T> Drop for EventReceiver<T> {
    fn drop(&mut self) {
        let mut q = lock(&self.shared);
        q.receiver_gone = true;
        q.first = None;
        q.rest.clear();
    }
}

impl<T> fmt::Debug for EventSender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventSender").finish_non_exhaustive()
    }
}

impl<T> fmt::Debug for EventReceiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventReceiver").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn events_come_in_order_one_needs_no_buffer_and_a_dropped_sender_ends_it() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let (tx, mut rx) = channel::<u32>();
        assert_eq!(rx.poll_recv(&mut cx), Poll::Pending);
        tx.send(1).unwrap();
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the waiting receiver was woken"
        );
        assert!(!rx.holds_buffers(), "one event is held in place");
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(1)));
        for i in 2..=6 {
            tx.send(i).unwrap();
        }
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(2)));
        tx.send(7).unwrap();
        for i in 3..=7 {
            assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(i)), "in order");
        }
        assert_eq!(rx.poll_recv(&mut cx), Poll::Pending);
        assert!(rx.holds_buffers(), "kept while busy");
        rx.release();
        assert!(!rx.holds_buffers(), "released when quiet");
        tx.send(8).unwrap();
        drop(tx);
        assert_eq!(
            rx.poll_recv(&mut cx),
            Poll::Ready(Some(8)),
            "what was sent before the end is taken"
        );
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
        let (tx, rx) = channel::<u32>();
        drop(rx);
        assert_eq!(tx.send(9), Err(9), "no receiver: the event comes back");
    }
}
