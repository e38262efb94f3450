//! The ids a broker hands out: connections, and the tokens naming a pending write, read or
//! stream opening, and group polls.

use crate::transport::{ConnId, OpenToken, ReadToken, WriteToken};

/// The ids a broker hands out, each kind counting up from 1 on its own: connections, and the
/// tokens naming a write, a read or a stream opening until the driver reports it, and group
/// polls. Never reused within a broker's life, so a late report cannot be taken for a newer one.
#[derive(Debug)]
pub(super) struct Ids {
    conn: u64,
    write: u64,
    read: u64,
    open: u64,
    poll: u64,
}

impl Default for Ids {
    fn default() -> Self {
        Ids { conn: 1, write: 1, read: 1, open: 1, poll: 1 }
    }
}

impl Ids {
    fn take(n: &mut u64) -> u64 {
        *n += 1;
        *n - 1
    }
    pub(super) fn conn(&mut self) -> ConnId {
        ConnId(Self::take(&mut self.conn))
    }
    pub(super) fn write(&mut self) -> WriteToken {
        WriteToken(Self::take(&mut self.write))
    }
    pub(super) fn read(&mut self) -> ReadToken {
        ReadToken(Self::take(&mut self.read))
    }
    pub(super) fn open(&mut self) -> OpenToken {
        OpenToken(Self::take(&mut self.open))
    }
    pub(super) fn poll(&mut self) -> u64 {
        Self::take(&mut self.poll)
    }
}
