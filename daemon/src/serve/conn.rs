//! HTTP connections, one hyper connection task each, for both listeners (the Unix socket's
//! [`Gate`](super::gate::Gate) and loopback TCP). Each connection knows its [`Peer`]: the uid
//! from SO_PEERCRED on the Unix socket, and whether the client is still there. A client that
//! closes its end (or whose connection fails) trips the connection's [`Hangup`], and the
//! request it was waiting for is cancelled at the engine's next step, whether it streams or not
//! (`request::Submitted::recv`). Headers must arrive within `limits.header_timeout_secs`, which
//! also bounds how long an idle keep-alive connection stays open; a uid (on loopback TCP the
//! owner of the client's socket, [`super::tcp_owner`]) holds at most
//! `limits.max_connections_per_user` connections: the next one gets a 503 and is closed.

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// The uid a TCP client counts as (the conventional `nobody`).
pub const ANONYMOUS_UID: u32 = 65534;

/// Whether a connection's client has gone.
#[derive(Debug, Default)]
pub struct Hangup {
    gone: AtomicBool,
    notify: Notify,
}

impl Hangup {
    /// Marks the client gone, waking whoever waits for that.
    pub fn trip(&self) {
        if !self.gone.swap(true, Ordering::SeqCst) {
            self.notify.notify_waiters();
        }
    }

    pub fn gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Resolves once the client has gone.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.gone() {
                return;
            }
            notified.await;
        }
    }
}

/// Who is on the other end of a connection.
#[derive(Clone, Debug)]
pub struct Peer {
    /// From SO_PEERCRED on the Unix socket; none on loopback TCP.
    pub uid: Option<u32>,
    /// On loopback TCP, the owner of the client's socket ([`super::tcp_owner`]): it rations
    /// (limits, turns), it grants no rights.
    pub owner: Option<u32>,
    /// Tripped when the client goes.
    pub hangup: Arc<Hangup>,
}

impl Peer {
    /// The uid the limits count the request under (on TCP its socket's owner, else
    /// [`ANONYMOUS_UID`]).
    pub fn uid(&self) -> u32 {
        self.uid.or(self.owner).unwrap_or(ANONYMOUS_UID)
    }

    /// Whether the peer is on the Unix socket, so a local user the kernel named.
    pub fn local(&self) -> bool {
        self.uid.is_some()
    }
}

/// What a listener's connections are held to.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub header_timeout: Duration,
    pub per_peer: usize,
}

/// Open connections per uid (`None`: a TCP client whose owner is unknown).
type Counts = Arc<Mutex<HashMap<Option<u32>, usize>>>;

/// A connection's socket: reading its end (EOF) or failing trips the hangup, as does closing
/// it; it counts against its peer's connections while open (and in its gate's count).
struct Watched<S> {
    io: S,
    hangup: Arc<Hangup>,
    counts: Counts,
    uid: Option<u32>,
    _open: Option<super::gate::Open>,
}

impl<S> Drop for Watched<S> {
    fn drop(&mut self) {
        self.hangup.trip();
        if let Ok(mut c) = self.counts.lock() {
            if let Some(n) = c.get_mut(&self.uid) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.remove(&self.uid);
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let room = buf.remaining() > 0;
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        match &r {
            Poll::Ready(Ok(())) if room && buf.filled().len() == before => self.hangup.trip(),
            Poll::Ready(Err(_)) => self.hangup.trip(),
            _ => {}
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Err(_)) = &r {
            self.hangup.trip();
        }
        r
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
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Err(_)) = &r {
            self.hangup.trip();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A connection as a listener accepts it.
pub struct Accepted<S> {
    io: S,
    /// The peer's uid (none on TCP).
    uid: Option<u32>,
    /// A loopback TCP client's owner.
    owner: Option<u32>,
    /// What the connection holds while open (the Unix socket gate's count).
    open: Option<super::gate::Open>,
}

/// The listeners [`serve`] takes.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<Accepted<Self::Io>>>;
}

impl Accept for super::gate::Gate {
    type Io = tokio::net::UnixStream;

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<Accepted<Self::Io>>> {
        self.poll_accept(cx).map_ok(|(io, open)| Accepted {
            uid: io.peer_cred().ok().map(|c| c.uid()),
            owner: None,
            io,
            open: Some(open),
        })
    }
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<Accepted<Self::Io>>> {
        self.poll_accept(cx).map_ok(|(io, peer)| {
            // (A read of procfs, at memory speed: no reason to leave the accept loop.)
            let owner = io.local_addr().ok().and_then(|local| super::tcp_owner::owner(local, peer));
            Accepted { io, uid: None, owner, open: None }
        })
    }
}

/// Serves `router` on `listener` until `stop`; then lets every open connection finish its
/// response (graceful shutdown) and returns once they have. `limits` is read at each accept
/// (a reload changes it).
pub async fn serve(listener: impl Accept, router: Router, limits: impl Fn() -> ConnLimits, stop: Arc<Notify>) {
    let counts: Counts = Arc::default();
    let (closing, _) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        let accepted = tokio::select! {
            r = std::future::poll_fn(|cx| listener.poll_next(cx)) => r,
            _ = &mut stopped => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let Accepted { io, uid, owner, open } = match accepted {
            Ok(a) => a,
            Err(e) => {
                // A peer gone before its accept, out of descriptors: log and go on.
                eprintln!("inferd: accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let limits = limits();
        let counted = uid.or(owner);
        let over = counts.lock().map_or(true, |mut c| {
            let n = c.entry(counted).or_default();
            *n += 1;
            *n > limits.per_peer
        });
        let hangup = Arc::new(Hangup::default());
        let io = Watched { io, hangup: Arc::clone(&hangup), counts: Arc::clone(&counts), uid: counted, _open: open };
        let peer = Peer { uid, owner, hangup };
        let router = router.clone();
        let mut closing = closing.subscribe();
        conns.spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            if over {
                http.keep_alive(false);
            }
            let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let mut req = req.map(Body::new);
                let router = router.clone();
                let peer = peer.clone();
                async move {
                    if over {
                        return Ok(too_many(&peer, limits.per_peer));
                    }
                    req.extensions_mut().insert(ConnectInfo(peer));
                    tower::ServiceExt::oneshot(router, req).await
                }
            });
            let conn = http.serve_connection(TokioIo::new(io), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = closing.wait_for(|c| *c) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    let _ = closing.send(true);
    while conns.join_next().await.is_some() {}
}

/// The answer on a connection past its peer's limit.
fn too_many(peer: &Peer, max: usize) -> axum::response::Response {
    use axum::response::IntoResponse;
    let who = match (peer.uid, peer.owner) {
        (Some(u), _) => format!("user {u}"),
        (None, Some(u)) => format!("user {u} (loopback TCP)"),
        (None, None) => "loopback TCP (clients of unknown owner)".to_string(),
    };
    let msg = format!("{who} already has {max} connections open (limits.max_connections_per_user)");
    let body = serde_json::json!({ "error": { "message": msg, "type": "server_error", "param": null, "code": null } });
    (axum::http::StatusCode::SERVICE_UNAVAILABLE, [("connection", "close")], axum::Json(body)).into_response()
}

/// The largest request body read, for every route: room for a long prompt or a few images in
/// base64, while the JSON tree a body parses into stays within a few hundred MiB at worst.
/// (The routes' own extractor limit is lifted: this one answers in JSON.)
pub const BODY_LIMIT: usize = 16 << 20;

/// Middleware on every route: the body is read whole within `limits.request_timeout_secs`
/// (a client trickling it in gets 408), then the route runs on it.
pub async fn read_body(
    axum::extract::State(sh): axum::extract::State<Arc<super::Shared>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if super::upload::is_upload(req.method(), req.uri().path()) {
        return next.run(req).await; // a model file, streamed to the store by its route
    }
    let (parts, body) = req.into_parts();
    let limit = Duration::from_secs(sh.limits().request_timeout_secs.max(1));
    let refuse = |status: axum::http::StatusCode, msg: String| {
        let body = serde_json::json!({ "error": { "message": msg, "type": "invalid_request_error", "param": null, "code": null } });
        (status, axum::Json(body)).into_response()
    };
    match tokio::time::timeout(limit, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Ok(Ok(bytes)) => next.run(axum::extract::Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(e)) => {
            let declared =
                parts.headers.get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
            let over = declared.is_some_and(|n: usize| n > BODY_LIMIT)
                || std::error::Error::source(&e).is_some_and(|s| s.to_string().contains("length limit"))
                || e.to_string().contains("length limit");
            if over {
                let msg = format!("the request body is larger than {} MiB", BODY_LIMIT >> 20);
                refuse(axum::http::StatusCode::PAYLOAD_TOO_LARGE, msg)
            } else {
                refuse(axum::http::StatusCode::BAD_REQUEST, format!("reading the request body: {e}"))
            }
        }
        Err(_) => refuse(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s (limits.request_timeout_secs)", limit.as_secs()),
        ),
    }
}
