//! Models served by an OpenAI-compatible server elsewhere (vLLM, SGLang, llama-server, another
//! inferd over TCP), behind the daemon's own socket and D-Bus: a `[[model]]` entry with
//! `upstream`.
//!
//! A request that names such a model is sent to the upstream with its `model` field set to the
//! upstream's name, under the same per-user limit as a local request. The OpenAI routes relay
//! the answer as it comes ([`openai`]); Ollama's routes and D-Bus translate their requests into
//! OpenAI's and read the upstream's stream back as [`events`]. A client that leaves ends the
//! forwarding, which closes the upstream connection: the servers named above cancel a request
//! whose client closed. Failure is explicit: an upstream that cannot be reached, or answers
//! with a server error, gives the client a 502 with the upstream's message (a 504 when it does
//! not answer in time); a request whose connection fails before an answer began is tried once
//! more.
//! A remote model with a `fallback` has that local model answer instead when the upstream is
//! unreachable, too slow to answer or failing, as long as nothing was sent to the client.

pub mod dbus;
pub mod events;
pub mod ollama;
pub mod openai;

use super::api::ApiError;
use super::config::RemoteConfig;
use super::conn::Peer;
use super::request;
use super::Shared;
use axum::body::Bytes;
use axum::http::header;
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the upstream may take to connect.
const CONNECT: Duration = Duration::from_secs(10);
/// How long it may take to start answering (a long prompt's prefill included).
const FIRST_BYTE: Duration = Duration::from_secs(300);

/// A remote model and its counters.
pub struct Remote {
    pub name: String,
    pub upstream: String,
    pub upstream_model: String,
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

/// An upstream that answered: its response, and the user's place, held while the answer flows.
pub struct Opened {
    pub resp: reqwest::Response,
    pub place: request::Slot,
}

/// Why a forwarded request got no answer from the upstream.
pub enum Failure {
    /// The upstream is unreachable, too slow to answer, or failing: a fallback may answer.
    Down(ApiError),
    /// Anything else (a malformed body, the user's limit, the client gone).
    Refused(ApiError),
}

impl Failure {
    pub fn error(self) -> ApiError {
        match self {
            Failure::Down(e) | Failure::Refused(e) => e,
        }
    }
}

impl Remote {
    pub fn new(c: &RemoteConfig) -> Result<Remote, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let key = match &c.key_file {
            Some(f) => {
                Some(read_key(f).map_err(|e| format!("model {}: upstream_key_file {}: {e}", c.name, f.display()))?)
            }
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

    /// An error in a forwarded answer, counted.
    pub fn failed(&self, e: ApiError) -> ApiError {
        self.count_error();
        e
    }

    /// Counts an error in a forwarded answer that reaches the client some other way (a
    /// stream's last line, a D-Bus signal).
    pub fn count_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// What a failure leaves the client: `Ok` with the fallback model's name, when the upstream
    /// is down and a fallback is configured; the error otherwise.
    pub fn fallback_model(&self, f: Failure) -> Result<String, ApiError> {
        self.errors.fetch_add(1, Ordering::Relaxed);
        match (f, &self.fallback) {
            (Failure::Down(e), Some(fallback)) => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                eprintln!("inferd: {}: {}; {fallback} answers instead", self.name, e.message);
                Ok(fallback.clone())
            }
            (f, _) => Err(f.error()),
        }
    }

    /// [`fallback_model`](Self::fallback_model) for an HTTP edge: `Ok` with the client's
    /// `original` body renamed for the fallback model.
    pub fn fall_back(&self, f: Failure, original: Option<Map<String, Value>>) -> Result<Bytes, ApiError> {
        let name = self.fallback_model(f)?;
        let mut m = original.unwrap_or_default();
        m.insert("model".into(), name.into());
        Ok(Bytes::from(Value::Object(m).to_string()))
    }

    /// The client's body kept for the fallback, when there is one.
    pub fn keep_for_fallback(&self, m: &Map<String, Value>) -> Option<Map<String, Value>> {
        self.fallback.is_some().then(|| m.clone())
    }

    /// Sends `body` (its `model` set to the upstream's) to the upstream's `route`
    /// ("/chat/completions") for `peer`, under the peer's per-user limit, and waits for the
    /// response's headers. A server error comes back as [`Failure::Down`] with the upstream's
    /// message; a client error (4xx) is the caller's to read.
    pub async fn open(
        &self,
        sh: &Arc<Shared>,
        route: &str,
        mut body: Map<String, Value>,
        peer: &Peer,
    ) -> Result<Opened, Failure> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        body.insert("model".into(), self.upstream_model.clone().into());
        let body = Value::Object(body).to_string();
        let place = request::user_place(sh, peer.uid()).map_err(Failure::Refused)?;
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
                () = peer.hangup.wait() => return Err(Failure::Refused(ApiError::new(499, "the client left", None))),
            };
            match sent {
                Ok(Ok(r)) => break r,
                // No answer began: a connection that failed (or a kept-alive one the upstream
                // had closed) is tried once more.
                Ok(Err(e)) if (e.is_connect() || e.is_request()) && tries < 2 => continue,
                Ok(Err(e)) => {
                    return Err(Failure::Down(ApiError::new(
                        502,
                        format!("upstream {} for {}: {e}", self.upstream, self.name),
                        None,
                    )))
                }
                Err(_) => {
                    let why = format!(
                        "upstream {} for {} did not answer within {} s",
                        self.upstream,
                        self.name,
                        FIRST_BYTE.as_secs()
                    );
                    return Err(Failure::Down(ApiError::new(504, why, None)));
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
            return Err(Failure::Down(ApiError::new(502, why, None)));
        }
        Ok(Opened { resp, place })
    }

    /// The upstream's refusal (a 4xx) as the client's error, with the upstream's message.
    pub async fn refusal(&self, resp: reqwest::Response) -> ApiError {
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        self.failed(ApiError::new(status, format!("upstream for {}: {}", self.name, upstream_message(&text)), None))
    }
}

/// An API key from a file only its owner may read (the daemon's other users could otherwise
/// spend it).
fn read_key(path: &std::path::Path) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).map_err(|e| e.to_string())?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(format!("group or others may read it (mode {:04o}): chmod 600 it", mode & 0o7777));
    }
    let key = std::fs::read_to_string(path).map_err(|e| e.to_string())?.trim().to_owned();
    if key.is_empty() {
        return Err("it holds no key".into());
    }
    Ok(key)
}

/// The message in an upstream's error body (OpenAI's `{"error": {"message": ...}}`, Ollama's
/// `{"error": ...}`), else the body's start.
fn upstream_message(text: &str) -> String {
    let v: Option<Value> = serde_json::from_str(text).ok();
    let m = v.as_ref().and_then(|v| v["error"]["message"].as_str().or_else(|| v["error"].as_str()));
    m.map_or_else(|| text.chars().take(500).collect(), str::to_owned)
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(ApiError::bad("the body must be a JSON object", "body")),
    }
}

impl Shared {
    /// The remote model a JSON body names, if it names one (Ollama's `name:latest` is `name`).
    pub fn remote_for(&self, body: &[u8]) -> Option<Arc<Remote>> {
        #[derive(serde::Deserialize)]
        struct Named {
            model: Option<String>,
            name: Option<String>,
        }
        let n = serde_json::from_slice::<Named>(body).ok()?;
        self.remote_named(&n.model.or(n.name)?)
    }

    /// The remote model called `name` (or `name:latest`).
    pub fn remote_named(&self, name: &str) -> Option<Arc<Remote>> {
        let name = name.strip_suffix(":latest").unwrap_or(name);
        let remotes = self.remotes.read().ok()?;
        remotes.iter().find(|r| r.name == name).cloned()
    }

    /// Every remote model.
    pub fn remote_models(&self) -> Vec<Arc<Remote>> {
        self.remotes.read().map(|r| r.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::read_key;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn an_api_key_must_be_its_owners_alone() {
        let dir = std::env::temp_dir().join(format!("inferd-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, "sk-test\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(read_key(&f).unwrap_err().contains("mode 0640"));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_key(&f).unwrap(), "sk-test");
        std::fs::write(&f, " \n").unwrap();
        assert!(read_key(&f).unwrap_err().contains("no key"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
