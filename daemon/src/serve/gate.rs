//! The door of the Unix socket: accepts connections (for [`conn`](super::conn)), counts the
//! ones open (each holds an [`Open`] until it closes), and can close for good when the daemon
//! is idle, atomically with the accepts: once [`GateState::close_if_idle`] says yes, no connection is ever accepted again,
//! and every connection a client makes from then on waits in the socket's backlog. Under socket
//! activation that backlog belongs to systemd's socket, which starts the daemon again for it:
//! the idle exit loses no request.

use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::UnixStream;

#[derive(Debug)]
struct Door {
    open: usize,
    closed: bool,
    /// When the last connection closed (or the gate opened).
    last: Instant,
}

/// What the gate and its connections share.
#[derive(Debug)]
pub struct GateState(Mutex<Door>);

impl GateState {
    /// Closes the gate if no connection is open and none has been for `idle`.
    pub fn close_if_idle(&self, idle: Duration) -> bool {
        let Ok(mut d) = self.0.lock() else { return false };
        if d.open == 0 && d.last.elapsed() >= idle {
            d.closed = true;
        }
        d.closed
    }
}

/// The listening socket, counted.
pub struct Gate {
    listener: tokio::net::UnixListener,
    state: Arc<GateState>,
}

impl Gate {
    pub fn new(listener: UnixListener) -> std::io::Result<Gate> {
        listener.set_nonblocking(true)?;
        let state = Arc::new(GateState(Mutex::new(Door { open: 0, closed: false, last: Instant::now() })));
        Ok(Gate { listener: tokio::net::UnixListener::from_std(listener)?, state })
    }

    pub fn state(&self) -> Arc<GateState> {
        Arc::clone(&self.state)
    }

    /// Polls for the next connection under the gate's lock, so that closing and accepting
    /// exclude each other: closed, it stays pending for good; a connection is counted open
    /// before the lock is let go, and stays counted while its [`Open`] lives.
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<(UnixStream, Open)>> {
        let Ok(mut d) = self.state.0.lock() else { return Poll::Pending };
        if d.closed {
            return Poll::Pending;
        }
        let r = self.listener.poll_accept(cx);
        if let Poll::Ready(Ok(_)) = &r {
            d.open += 1;
        }
        r.map_ok(|(io, _)| (io, Open(Arc::clone(&self.state))))
    }
}

/// A connection through the gate, counted open until this is dropped.
pub struct Open(Arc<GateState>);

impl Drop for Open {
    fn drop(&mut self) {
        if let Ok(mut d) = self.0 .0.lock() {
            d.open = d.open.saturating_sub(1);
            d.last = Instant::now();
        }
    }
}
