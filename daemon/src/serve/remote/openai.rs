//! The OpenAI routes of a remote model: the request goes as it came (its model renamed), the
//! upstream's answer (an SSE stream or a JSON body) comes back byte for byte as it arrives.

use super::{object, Remote};
use crate::serve::api::ApiError;
use crate::serve::conn::Peer;
use crate::serve::Shared;
use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::sync::Arc;

/// What became of a forwarded request.
pub enum Forwarded {
    /// The answer for the client (the upstream's, or an error).
    Answer(Response),
    /// The upstream is down: the body, renamed for the fallback model, to answer locally.
    Fallback(Bytes),
}

impl Remote {
    /// Forwards an OpenAI request `body` to the upstream's `route` ("/chat/completions") and
    /// relays the answer.
    pub async fn forward(self: Arc<Self>, sh: &Arc<Shared>, route: &str, body: &[u8], peer: Peer) -> Forwarded {
        let answer = |e: ApiError| Forwarded::Answer(crate::serve::openai::error(e));
        let m = match object(body) {
            Ok(m) => m,
            Err(e) => {
                self.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return answer(self.failed(e));
            }
        };
        let original = self.keep_for_fallback(&m);
        let opened = match self.open(sh, route, m, &peer).await {
            Ok(o) => o,
            Err(f) => {
                return match self.fall_back(f, original) {
                    Ok(b) => Forwarded::Fallback(b),
                    Err(e) => answer(e),
                }
            }
        };
        let (resp, place) = (opened.resp, opened.place);
        let code = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        if code.is_client_error() {
            self.errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let kind = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or_else(|| header::HeaderValue::from_static("application/json"));
        if !kind.to_str().unwrap_or("").starts_with("text/event-stream") {
            // A whole answer goes back whole.
            let body = tokio::select! {
                b = resp.bytes() => b,
                () = peer.hangup.wait() => return answer(self.failed(ApiError::new(499, "the client left", None))),
            };
            drop(place);
            return match body {
                Ok(b) => Forwarded::Answer((code, [(header::CONTENT_TYPE, kind)], b).into_response()),
                Err(e) => answer(self.failed(ApiError::new(
                    502,
                    format!("upstream {} for {}: {e}", self.upstream, self.name),
                    None,
                ))),
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
                        // The upstream failed mid-stream: an error event says so (as OpenAI's
                        // servers end a failed stream), and the stream ends without `[DONE]`.
                        me.errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let why = format!("upstream {} for {} failed mid-stream: {e}", me.upstream, me.name);
                        let error = json!({ "error": { "message": why, "type": "upstream_error", "param": null, "code": null } });
                        let _ = tx.send(Ok(Bytes::from(format!("data: {error}\n\n")))).await;
                        break;
                    }
                }
            }
        });
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        Forwarded::Answer((code, [(header::CONTENT_TYPE, kind)], body).into_response())
    }
}
