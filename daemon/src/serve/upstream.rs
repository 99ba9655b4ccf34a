//! Models served by an OpenAI-compatible server elsewhere (vLLM, SGLang, llama-server, another
//! inferd over TCP), behind the daemon's own socket: a `[[model]]` entry with `upstream`.
//!
//! A request that names such a model is forwarded as it came, its `model` field set to the
//! upstream's name, under the same per-user limit as a local request; the answer (an SSE stream
//! or a JSON body) goes back chunk by chunk as it arrives. A client that leaves ends the
//! forwarding, which closes the upstream connection: the servers named above cancel a request
//! whose client closed. Failure is explicit: an upstream that cannot be reached, or answers
//! with a server error, gives the client a 502 with the upstream's message (a 504 when it does
//! not answer in time); a connection that fails before anything was sent is tried once more.
//! A remote model with a `fallback` has that local model answer instead when the upstream is
//! unreachable, too slow to answer or failing, as long as nothing was sent to the client.

use super::config::RemoteConfig;
use super::conn::Peer;
use super::request::{self, ApiError};
use super::Shared;
use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the upstream may take to connect.
const CONNECT: Duration = Duration::from_secs(10);
/// How long it may take to start answering (a long prompt's prefill included).
const FIRST_BYTE: Duration = Duration::from_secs(300);

/// What became of a forwarded request.
pub enum Forwarded {
    /// The answer for the client (the upstream's, or an error).
    Answer(Response),
    /// The upstream is down: the body, renamed for the fallback model, to answer locally.
    Fallback(Bytes),
}

/// A remote model and its counters.
pub struct Remote {
    pub name: String,
    pub upstream: String,
    upstream_model: String,
    fallback: Option<String>,
    key: Option<String>,
    client: reqwest::Client,
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    /// Time to the upstream's response headers, summed over the requests it answered, in
    /// microseconds.
    pub latency_us: AtomicU64,
    pub answered: AtomicU64,
    /// Requests the fallback model answered.
    pub fallbacks: AtomicU64,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Remote({} at {})", self.name, self.upstream)
    }
}

impl Remote {
    pub fn new(c: &RemoteConfig) -> Result<Remote, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let key = match &c.key_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| format!("model {}: upstream_key_file {}: {e}", c.name, f.display()))?
                    .trim()
                    .to_owned(),
            ),
            None => None,
        };
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT)
            .build()
            .map_err(|e| format!("model {}: an HTTP client for {}: {e}", c.name, c.upstream))?;
        Ok(Remote {
            name: c.name.clone(),
            upstream: c.upstream.clone(),
            upstream_model: c.upstream_model.clone(),
            fallback: c.fallback.clone(),
            key,
            client,
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            latency_us: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        })
    }

    fn failed(&self, e: ApiError) -> Forwarded {
        self.errors.fetch_add(1, Ordering::Relaxed);
        Forwarded::Answer(super::http::error(e))
    }

    /// The upstream failed before anything went to the client: the fallback answers, when
    /// there is one.
    fn down(&self, e: ApiError, m: &Option<serde_json::Map<String, serde_json::Value>>) -> Forwarded {
        let (Some(f), Some(m)) = (&self.fallback, m) else { return self.failed(e) };
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        eprintln!("inferd: {}: {}; {f} answers instead", self.name, e.message);
        let mut m = m.clone();
        m.insert("model".into(), f.clone().into());
        Forwarded::Fallback(Bytes::from(serde_json::Value::Object(m).to_string()))
    }

    /// Forwards an OpenAI request `body` to the upstream's `route` ("/chat/completions") and
    /// relays the answer.
    pub async fn forward(self: Arc<Self>, sh: &Arc<Shared>, route: &str, body: &[u8], peer: Peer) -> Forwarded {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let mut m = match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => return self.failed(ApiError::bad("the body must be a JSON object", "body")),
        };
        // The client's own body, for the fallback, should the upstream be down.
        let original = self.fallback.is_some().then(|| m.clone());
        m.insert("model".into(), self.upstream_model.clone().into());
        let body = serde_json::Value::Object(m).to_string();
        let place = match request::user_place(sh, peer.uid()) {
            Ok(p) => p,
            Err(e) => return self.failed(e),
        };
        let url = format!("{}{route}", self.upstream);
        let t0 = Instant::now();
        let mut tries = 0;
        let resp = loop {
            tries += 1;
            let mut req = self
                .client
                .post(&url)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::ACCEPT, "application/json, text/event-stream")
                .body(body.clone());
            if let Some(k) = &self.key {
                req = req.bearer_auth(k);
            }
            let sent = tokio::select! {
                r = tokio::time::timeout(FIRST_BYTE, req.send()) => r,
                () = peer.hangup.wait() => return self.failed(ApiError::new(499, "the client left", None)),
            };
            match sent {
                Ok(Ok(r)) => break r,
                // Nothing was sent yet: a connection that failed is tried once more.
                Ok(Err(e)) if e.is_connect() && tries < 2 => continue,
                Ok(Err(e)) => {
                    let why = format!("upstream {} for {}: {e}", self.upstream, self.name);
                    return self.down(ApiError::new(502, why, None), &original);
                }
                Err(_) => {
                    let why = format!(
                        "upstream {} for {} did not answer within {} s",
                        self.upstream,
                        self.name,
                        FIRST_BYTE.as_secs()
                    );
                    return self.down(ApiError::new(504, why, None), &original);
                }
            }
        };
        self.latency_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.answered.fetch_add(1, Ordering::Relaxed);
        let status = resp.status();
        if status.is_server_error() {
            let text = resp.text().await.unwrap_or_default();
            let why =
                format!("upstream {} for {} answered {status}: {}", self.upstream, self.name, upstream_message(&text));
            return self.down(ApiError::new(502, why, None), &original);
        }
        let kind = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or_else(|| header::HeaderValue::from_static("application/json"));
        let code = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        if !kind.to_str().unwrap_or("").starts_with("text/event-stream") {
            // A whole answer goes back whole.
            let body = tokio::select! {
                b = resp.bytes() => b,
                () = peer.hangup.wait() => return self.failed(ApiError::new(499, "the client left", None)),
            };
            drop(place);
            return match body {
                Ok(b) => Forwarded::Answer((code, [(header::CONTENT_TYPE, kind)], b).into_response()),
                Err(e) => {
                    self.failed(ApiError::new(502, format!("upstream {} for {}: {e}", self.upstream, self.name), None))
                }
            };
        }
        // A stream goes back as it comes; the client leaving ends it (and closes the upstream
        // connection, which cancels the request there).
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let me = Arc::clone(&self);
        let mut resp = resp;
        tokio::spawn(async move {
            let _place = place;
            loop {
                let chunk = tokio::select! {
                    c = resp.chunk() => c,
                    () = peer.hangup.wait() => break,
                };
                match chunk {
                    Ok(Some(b)) => {
                        if tx.send(Ok(b)).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        me.errors.fetch_add(1, Ordering::Relaxed);
                        let _ = tx.send(Err(std::io::Error::other(format!("upstream {}: {e}", me.upstream)))).await;
                        break;
                    }
                }
            }
        });
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        Forwarded::Answer((code, [(header::CONTENT_TYPE, kind)], body).into_response())
    }
}

/// The message in an upstream's error body (OpenAI's `{"error": {"message": ...}}`), else the
/// body's start.
fn upstream_message(text: &str) -> String {
    let v: Option<serde_json::Value> = serde_json::from_str(text).ok();
    let m = v.as_ref().and_then(|v| v["error"]["message"].as_str().or_else(|| v["error"].as_str()));
    m.map_or_else(|| text.chars().take(500).collect(), str::to_owned)
}

impl Shared {
    /// The remote model a JSON body names, if it names one.
    pub fn remote_for(&self, body: &[u8]) -> Option<Arc<Remote>> {
        #[derive(serde::Deserialize)]
        struct Named {
            model: Option<String>,
        }
        let name = serde_json::from_slice::<Named>(body).ok()?.model?;
        let remotes = self.remotes.read().ok()?;
        remotes.iter().find(|r| r.name == name).cloned()
    }
}
