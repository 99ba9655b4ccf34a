//! The HTTP side of models coming and going: load progress for whoever waits, and the routes
//! that load and remove models.
//!
//! A streaming request (OpenAI `stream: true`, Ollama's default) for a model that is not loaded
//! gets its response at once, and the load's progress in it while it waits: SSE comments
//! (`: loading NAME 42% (...)`, which OpenAI clients skip) or Ollama status lines (an empty
//! chunk with `status`, `completed` and `total`, as Ollama's pull reports). The generation
//! follows in the same response; an error after that point comes as an error event, the
//! status line having gone. A request that does not stream waits for the load as before.
//!
//! Routes: `POST /v1/models/{name}/load` (a status stream, what `inferctl load` draws its
//! progress bar from), `DELETE /v1/models/{name}` and Ollama's `DELETE /api/delete` (removes a
//! store model: unloaded, its file deleted).

use super::api::ApiError;
use super::conn::Peer;
use super::models::LoadProgress;
use super::Shared;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::mpsc;

use super::conn::BODY_LIMIT;

pub fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/models/{name}/load", post(load))
        .route("/v1/models/{name}", delete(remove_openai).get(super::http::model))
        .route("/api/delete", delete(remove_ollama))
}

/// Whether a body asks for a stream (Ollama's endpoints stream unless told not to).
fn streams(body: &[u8], ollama: bool) -> bool {
    #[derive(serde::Deserialize)]
    struct Stream {
        stream: Option<Value>,
    }
    match serde_json::from_slice::<Stream>(body) {
        Ok(Stream { stream: Some(Value::Bool(s)) }) => s,
        Ok(_) => ollama,
        Err(_) => false,
    }
}

fn percent(p: &LoadProgress) -> f64 {
    if p.total == 0 {
        0.0
    } else {
        100.0 * p.done as f64 / p.total as f64
    }
}

/// Middleware on the generation routes: a streaming request for a model that is not loaded
/// gets the load's progress in its stream before the generation.
pub async fn progress(State(sh): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return (StatusCode::PAYLOAD_TOO_LARGE, e.to_string()).into_response(),
    };
    let ollama = parts.uri.path().starts_with("/api/");
    let uid = parts.extensions.get::<axum::extract::ConnectInfo<Peer>>().and_then(|c| c.0.uid);
    // Only a well-formed request for a known model that is not loaded: anything the route
    // refuses is refused with its status, before a 200 goes out.
    let cold = streams(&bytes, ollama)
        .then(|| sh.wanted(&bytes, ollama, uid).ok().flatten())
        .flatten()
        .and_then(|(model, _)| sh.models.slot(model.as_deref()).ok())
        .filter(|slot| slot.loaded().is_none());
    let Some(slot) = cold else {
        return next.run(Request::from_parts(parts, Body::from(bytes))).await;
    };
    let chat = parts.uri.path().ends_with("/chat");
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let mut watch = slot.progress.subscribe();
    tokio::spawn(async move {
        let name = slot.name.clone();
        let line = |p: &LoadProgress| -> String {
            if ollama {
                let mut v = json!({ "model": format!("{name}:latest"), "created_at": super::ollama::rfc3339(std::time::SystemTime::now()), "done": false, "status": format!("loading {name}"), "completed": p.done, "total": p.total });
                if chat {
                    v["message"] = json!({ "role": "assistant", "content": "" });
                } else {
                    v["response"] = json!("");
                }
                format!("{v}\n")
            } else {
                format!(": loading {name} {:.0}% ({} of {} bytes)\n\n", percent(p), p.done, p.total)
            }
        };
        let load = {
            let (sh, bytes) = (Arc::clone(&sh), bytes.clone());
            tokio::spawn(async move { sh.warm(&bytes, ollama, uid).await })
        };
        tokio::pin!(load);
        let mut first = *watch.borrow_and_update();
        if !first.loading {
            first = LoadProgress { done: 0, total: slot.weight_bytes(), loading: true };
        }
        let _ = tx.send(Ok(Bytes::from(line(&first)))).await;
        let loaded = loop {
            tokio::select! {
                r = &mut load => break r,
                Ok(()) = watch.changed() => {
                    let p = *watch.borrow_and_update();
                    if tx.send(Ok(Bytes::from(line(&p)))).await.is_err() {
                        return;
                    }
                }
            }
        };
        if let Ok(Err(e)) = loaded {
            let _ = tx.send(Ok(Bytes::from(error_event(ollama, e.status, &json!({ "message": e.message }))))).await;
            return;
        }
        let resp = next.run(Request::from_parts(parts, Body::from(bytes))).await;
        let status = resp.status();
        let mut body = resp.into_body().into_data_stream();
        if !status.is_success() {
            let text = axum::body::to_bytes(Body::from_stream(body), BODY_LIMIT).await.unwrap_or_default();
            let v: Value = serde_json::from_slice(&text).unwrap_or_else(|_| json!(String::from_utf8_lossy(&text)));
            let _ = tx.send(Ok(Bytes::from(error_event(ollama, status.as_u16(), &v)))).await;
            return;
        }
        while let Some(Ok(chunk)) = tokio_stream::StreamExt::next(&mut body).await {
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    let kind = if ollama { "application/x-ndjson" } else { "text/event-stream" };
    ([(header::CONTENT_TYPE, kind)], Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))).into_response()
}

/// An error after the status line went: an SSE `error` event, or an Ollama `{"error": ...}`
/// line.
fn error_event(ollama: bool, status: u16, v: &Value) -> String {
    let message = v
        .pointer("/error/message")
        .or_else(|| v.get("error"))
        .or_else(|| v.get("message"))
        .and_then(Value::as_str)
        .map_or_else(|| v.to_string(), str::to_string);
    if ollama {
        format!("{}\n", json!({ "error": message }))
    } else {
        format!("data: {}\n\n", json!({ "error": { "message": message, "code": status } }))
    }
}

/// `POST /v1/models/{name}/load`: loads the model, streaming its progress as status lines
/// (`{"status": "loading", "completed": N, "total": M}`), then `{"status": "success"}` or
/// `{"error": ...}`. Optional body: `{"keep_alive": "10m"}`.
async fn load(State(sh): State<Arc<Shared>>, Path(name): Path<String>, body: Bytes) -> Response {
    let slot = match sh.models.slot(Some(&name)) {
        Ok(s) => s,
        Err(e) => return super::openai::error(e),
    };
    let keep_alive = match serde_json::from_slice::<Value>(&body).ok().and_then(|v| v.get("keep_alive").cloned()) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(super::models::parse_keep_alive(&s)),
        Some(Value::Number(x)) => Some(super::models::parse_keep_alive(&x.to_string())),
        Some(_) => Some(Err("keep_alive must be a duration or a number of seconds".into())),
    };
    let keep_alive = match keep_alive.transpose() {
        Ok(k) => k,
        Err(e) => return super::openai::error(ApiError::bad(format!("keep_alive: {e}"), "keep_alive")),
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let mut watch = slot.progress.subscribe();
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(Bytes::from(format!("{v}\n")))).await.is_ok() }
        };
        let status =
            |p: &LoadProgress| json!({ "status": "loading", "model": name, "completed": p.done, "total": p.total });
        let was_loaded = slot.loaded().is_some();
        let load = {
            let (sh, name) = (Arc::clone(&sh), name.clone());
            tokio::spawn(async move { sh.load(Some(&name), keep_alive).await })
        };
        tokio::pin!(load);
        let loaded = loop {
            tokio::select! {
                r = &mut load => break r,
                Ok(()) = watch.changed() => {
                    let p = *watch.borrow_and_update();
                    if p.loading && !send(status(&p)).await {
                        return;
                    }
                }
            }
        };
        let _ = match loaded {
            Ok(Ok(())) => send(json!({ "status": "success", "model": name, "was_loaded": was_loaded })).await,
            Ok(Err(e)) => send(json!({ "error": e.message, "code": e.status })).await,
            Err(e) => send(json!({ "error": e.to_string() })).await,
        };
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

/// `DELETE /v1/models/{name}`: OpenAI's shape of a deletion (model management).
async fn remove_openai(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(name): Path<String>,
) -> Response {
    if let Err(e) = sh.managers().check(peer.uid, &format!("removing {name}")) {
        return super::openai::error(e);
    }
    match sh.models.remove(&name) {
        Ok(path) => {
            eprintln!("inferd: removed {name} ({})", path.display());
            Json(json!({ "id": name, "object": "model", "deleted": true })).into_response()
        }
        Err(e) => super::openai::error(e),
    }
}

/// Ollama's `DELETE /api/delete` with `{"model": NAME}`: 200 with no body, 404 if unknown.
async fn remove_ollama(State(sh): State<Arc<Shared>>, ConnectInfo(peer): ConnectInfo<Peer>, body: Bytes) -> Response {
    let Ok(Some((Some(name), _))) = sh.wanted(&body, true, peer.uid) else {
        return (StatusCode::BAD_REQUEST, Json(json!({ "error": "model is required" }))).into_response();
    };
    let removed = sh.managers().check(peer.uid, &format!("removing {name}")).and_then(|()| sh.models.remove(&name));
    match removed {
        Ok(path) => {
            eprintln!("inferd: removed {name} ({})", path.display());
            StatusCode::OK.into_response()
        }
        Err(e) => (
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            Json(json!({ "error": e.message })),
        )
            .into_response(),
    }
}
