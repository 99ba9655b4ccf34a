//! The door of the Unix socket: accepts connections for axum (`axum::serve::Listener`),
//! counts the ones open, and can close for good when the daemon is idle, atomically with the
//! accepts: once [`GateState::close_if_idle`] says yes, no connection is ever accepted again,
//! and every connection a client makes from then on waits in the socket's backlog. Under socket
//! activation that backlog belongs to systemd's socket, which starts the daemon again for it:
//! the idle exit loses no request.

use std::os::unix::net::UnixListener;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::unix::SocketAddr;
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
    /// before the lock is let go.
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<(UnixStream, SocketAddr)>> {
        let Ok(mut d) = self.state.0.lock() else { return Poll::Pending };
        if d.closed {
            return Poll::Pending;
        }
        let r = self.listener.poll_accept(cx);
        if let Poll::Ready(Ok(_)) = &r {
            d.open += 1;
        }
        r
    }
}

/// A connection through the gate; closing it is counted.
pub struct Conn {
    pub io: UnixStream,
    state: Arc<GateState>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Ok(mut d) = self.state.0.lock() {
            d.open = d.open.saturating_sub(1);
            d.last = Instant::now();
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl axum::serve::Listener for Gate {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        loop {
            match std::future::poll_fn(|cx| self.poll_accept(cx)).await {
                Ok((io, addr)) => return (Conn { io, state: Arc::clone(&self.state) }, addr),
                Err(e) => {
                    // A peer gone before its accept, out of descriptors: log and go on.
                    eprintln!("inferd: accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}
