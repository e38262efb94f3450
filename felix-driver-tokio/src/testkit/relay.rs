//! A UDP relay between one QUIC endpoint and another that a test steers: to make a peer go
//! silent (a broker killed with SIGKILL, a host gone: no close ever comes), or answer late and
//! then go silent (what a paused process's own round-trip estimate sees).

use std::net::SocketAddr;
use tokio::sync::mpsc;

/// What a [`UdpRelay`] does with datagrams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayMode {
    /// Both ways, as they come (what was held first).
    Forward,
    /// Keeps the far side's datagrams (the near side's still go through): to the near side,
    /// every answer takes as long as the hold.
    HoldReplies,
    /// Hands the near side what was held, then drops everything both ways.
    ReleaseThenDrop,
    /// Drops everything both ways (what was held too).
    Drop,
}

/// A relay in front of one address: the first endpoint to send to [`addr`](Self::addr) is its
/// near side.
#[derive(Debug)]
pub struct UdpRelay {
    addr: SocketAddr,
    steer: mpsc::UnboundedSender<RelayMode>,
}

impl UdpRelay {
    /// Starts relaying to `to`, forwarding (a tokio runtime must be running). Ends when the
    /// relay is dropped.
    ///
    /// # Panics
    /// When a loopback UDP socket cannot be bound (a test's setup).
    pub fn start(to: SocketAddr) -> UdpRelay {
        let socket = || {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("a loopback UDP socket");
            s.set_nonblocking(true).expect("a non-blocking socket");
            tokio::net::UdpSocket::from_std(s).expect("a socket for tokio")
        };
        let (front, back) = (socket(), socket());
        let addr = front.local_addr().expect("its address");
        let (steer, mut rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut mode, mut near, mut held) = (RelayMode::Forward, None, Vec::<Vec<u8>>::new());
            let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
            loop {
                tokio::select! {
                    m = rx.recv() => {
                        let Some(m) = m else { return };
                        if let (RelayMode::Forward | RelayMode::ReleaseThenDrop, Some(n)) = (m, near) {
                            for p in held.drain(..) {
                                let _ = front.send_to(&p, n).await;
                            }
                        }
                        if m == RelayMode::Drop {
                            held.clear();
                        }
                        mode = match m {
                            RelayMode::ReleaseThenDrop => RelayMode::Drop,
                            m => m,
                        };
                    }
                    r = front.recv_from(&mut a) => {
                        let Ok((n, from)) = r else { continue };
                        near = Some(from);
                        if mode != RelayMode::Drop {
                            let _ = back.send_to(&a[..n], to).await;
                        }
                    }
                    r = back.recv_from(&mut b) => {
                        let (Ok((n, _)), Some(to_near)) = (r, near) else { continue };
                        match mode {
                            RelayMode::Forward => { let _ = front.send_to(&b[..n], to_near).await; }
                            RelayMode::HoldReplies => held.push(b[..n].to_vec()),
                            RelayMode::ReleaseThenDrop | RelayMode::Drop => {}
                        }
                    }
                }
            }
        });
        UdpRelay { addr, steer }
    }

    /// Where the near side sends.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on, `mode`.
    pub fn set(&self, mode: RelayMode) {
        let _ = self.steer.send(mode);
    }
}
