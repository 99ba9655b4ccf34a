//! The HTTP edge on the Unix socket: OpenAI-compatible completions (with SSE streaming),
//! `/tokenize`, `/detokenize`, `/health`, `/v1/models`. Requests are parsed and validated here
//! (admission: a bad parameter is a 400 before anything is scheduled) and handed to the engine
//! thread as [`Command`]s; its [`Event`]s come back through a channel per request. Engine types
//! stop here: the JSON is built from plain values.

// Helpers return the error response itself; its size does not matter once per request.
#![allow(clippy::result_large_err)]

use super::engine_loop::{Command, Event, Submission};
use crate::model::Model;
use crate::plugin::{PluginError, Registry, Session, SessionRequest};
use crate::tokenizer::stream::StreamDecoder;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::unbounded_channel;

pub struct AppState {
    pub model: Arc<Model>,
    pub registry: Arc<Registry>,
    pub engine: Mutex<std::sync::mpsc::Sender<Command>>,
    pub next_id: AtomicU64,
}

/// An OpenAI error object with its status.
fn error(status: StatusCode, kind: &str, message: impl Into<String>, param: Option<&str>) -> Response {
    (status, Json(json!({ "error": { "message": message.into(), "type": kind, "param": param, "code": Value::Null } }))).into_response()
}

fn bad(message: impl Into<String>, param: &str) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message, Some(param))
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({ "status": "ok" })) }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .with_state(state)
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "object": "list", "data": [{ "id": st.model.name, "object": "model", "owned_by": "inferd", "roles": ["target"] }] }))
}

/// The body as a JSON object, or the 400 that says why not.
fn object(body: &[u8]) -> Result<Map<String, Value>, Response> {
    let text = std::str::from_utf8(body).map_err(|_| bad("the request body is not valid UTF-8", "body"))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(bad("the request body must be a JSON object", "body")),
        Err(e) => Err(bad(format!("malformed JSON: {e}"), "body")),
    }
}

async fn tokenize(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let m = match object(&body) {
        Ok(m) => m,
        Err(r) => return r,
    };
    let Some(text) = m.get("content").and_then(Value::as_str) else { return bad("content must be a string", "content") };
    let special = m.get("add_special").and_then(Value::as_bool).unwrap_or(false);
    match st.model.tokenizer.encode(text, special) {
        Ok(ids) => Json(json!({ "tokens": ids })).into_response(),
        Err(e) => bad(e.to_string(), "content"),
    }
}

async fn detokenize(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let m = match object(&body) {
        Ok(m) => m,
        Err(r) => return r,
    };
    let Some(ids) = m.get("tokens").and_then(Value::as_array) else { return bad("tokens must be an array of token ids", "tokens") };
    let vocab = st.model.config.vocab as u64;
    let ids: Option<Vec<u32>> = ids.iter().map(|v| v.as_u64().filter(|&t| t < vocab).map(|t| t as u32)).collect();
    let Some(ids) = ids else { return bad(format!("tokens must be ids below {vocab}"), "tokens") };
    match st.model.tokenizer.decode(&ids, false) {
        Ok(text) => Json(json!({ "content": text })).into_response(),
        Err(e) => bad(e.to_string(), "tokens"),
    }
}

/// The strategy and its parameters for an OpenAI-style request: `decoder` and
/// `decoder_params` when given; otherwise greedy at temperature 0, min-p when `min_p` is set,
/// nucleus sampling else, with the request's sampling fields as parameters.
fn strategy_of(m: &Map<String, Value>) -> Result<(String, String), Response> {
    if let Some(d) = m.get("decoder") {
        let name = d.as_str().ok_or_else(|| bad("decoder must be a string", "decoder"))?;
        let params = match m.get("decoder_params") {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::Object(o)) => Value::Object(o.clone()).to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(bad("decoder_params must be a JSON object", "decoder_params")),
        };
        return Ok((name.to_owned(), params));
    }
    let temperature = m.get("temperature").and_then(Value::as_f64);
    let name = if temperature == Some(0.0) {
        "greedy"
    } else if m.get("min_p").is_some_and(|v| !v.is_null()) {
        "min-p"
    } else {
        "nucleus"
    };
    let keys: &[&str] = match name {
        "greedy" => &[],
        "min-p" => &["temperature", "min_p", "frequency_penalty", "presence_penalty", "logit_bias"],
        _ => &["temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "logit_bias"],
    };
    let params: Map<String, Value> = keys.iter().filter_map(|k| m.get(*k).filter(|v| !v.is_null()).map(|v| ((*k).to_owned(), v.clone()))).collect();
    Ok((name.to_owned(), Value::Object(params).to_string()))
}

fn uint(m: &Map<String, Value>, key: &str, default: u64, max: u64) -> Result<u64, Response> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_u64().filter(|&x| x <= max).ok_or_else(|| bad(format!("{key} must be an integer between 0 and {max}"), key)),
    }
}

async fn completions(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let m = match object(&body) {
        Ok(m) => m,
        Err(r) => return r,
    };
    let Some(prompt) = m.get("prompt").and_then(Value::as_str) else { return bad("prompt must be a string", "prompt") };
    let ids = match st.model.tokenizer.encode(prompt, false) {
        Ok(ids) => ids,
        Err(e) => return bad(e.to_string(), "prompt"),
    };
    respond(st, m, ids, false).await
}

/// The chat messages rendered with the model's own template, then as a completion.
async fn chat_completions(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let m = match object(&body) {
        Ok(m) => m,
        Err(r) => return r,
    };
    let Some(list) = m.get("messages").and_then(Value::as_array) else { return bad("messages must be an array", "messages") };
    let mut messages = Vec::with_capacity(list.len());
    for (i, msg) in list.iter().enumerate() {
        let (Some(role), Some(content)) = (msg.get("role").and_then(Value::as_str), msg.get("content").and_then(Value::as_str)) else {
            return bad(format!("messages[{i}] needs a string role and a string content"), "messages");
        };
        messages.push(crate::chat::ChatMessage::new(role, content));
    }
    if messages.is_empty() {
        return bad("messages is empty", "messages");
    }
    let tok = &st.model.tokenizer;
    let bos = tok.bos().map(|b| tok.token_text(b)).unwrap_or_default();
    let eos = tok.eos().first().map(|&e| tok.token_text(e)).unwrap_or_default();
    let text = match crate::chat::ChatTemplate::new(st.model.chat_template.as_deref(), bos, eos).and_then(|t| t.render(&messages, true)) {
        Ok(t) => t,
        Err(e) => return bad(format!("the chat template failed: {e}"), "messages"),
    };
    let ids = match tok.encode(&text, true) {
        Ok(ids) => ids,
        Err(e) => return bad(e.to_string(), "messages"),
    };
    respond(st, m, ids, true).await
}

/// A completion of `ids` for the request `m`: validated, submitted, answered as a completion
/// or a chat completion, whole or streamed.
async fn respond(st: Arc<AppState>, m: Map<String, Value>, ids: Vec<u32>, chat: bool) -> Response {
    if let Some(model) = m.get("model").and_then(Value::as_str) {
        if model != st.model.name {
            return error(StatusCode::NOT_FOUND, "invalid_request_error", format!("unknown model {model:?} (loaded: {})", st.model.name), Some("model"));
        }
    }
    let ctx = st.model.config.context_len as u64;
    let (max_tokens, n, seed) = match (uint(&m, "max_tokens", 16, ctx), uint(&m, "n", 1, 16), uint(&m, "seed", 0, u64::MAX)) {
        (Ok(a), Ok(b), Ok(c)) => (a as u32, b as u32, c),
        (Err(r), _, _) | (_, Err(r), _) | (_, _, Err(r)) => return r,
    };
    if n == 0 {
        return bad("n must be at least 1", "n");
    }
    let seed = if m.get("seed").is_some_and(|v| !v.is_null()) { seed } else { st.next_id.load(Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed };
    let stream = m.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let (name, params) = match strategy_of(&m) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let strategy = match st.registry.get(&name) {
        Ok(s) => s,
        Err(e @ PluginError::UnknownStrategy { .. }) => return error(StatusCode::NOT_FOUND, "invalid_request_error", e.to_string(), Some("decoder")),
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string(), Some("decoder")),
    };
    let tok = &st.model.tokenizer;
    if ids.is_empty() {
        return bad("the prompt is empty", "prompt");
    }
    if ids.len() as u64 + u64::from(max_tokens) > ctx {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("{} prompt tokens + max_tokens {max_tokens} exceed the context length {ctx}", ids.len()), Some("prompt"));
    }
    let req = SessionRequest { prompt: &ids, generated: &[], params: &params, max_tokens, n, seed, eos: tok.eos(), logprobs: false };
    if let Err(e) = Session::validate(&strategy, st.model.config.vocab as u32, 1, &req) {
        return bad(e.to_string(), "decoder_params");
    }
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = unbounded_channel::<Event>();
    let sub = Submission { id, strategy, prompt: ids.clone(), params, max_tokens, n, seed, logprobs: false, events: Box::new(move |e| tx.send(e).is_ok()) };
    let sent = st.engine.lock().map(|e| e.send(Command::Submit(sub)).is_ok()).unwrap_or(false);
    if !sent {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine is not running", None);
    }
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let cid = format!("cmpl-{id}");
    let model_name = st.model.name.clone();
    let prompt_tokens = ids.len();
    if !stream {
        // The text comes from the final tokens; the streamed ones are only counted on.
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token { .. } => {}
                Event::Finished(g) => {
                    let completion: usize = g.choices.iter().map(|c| c.tokens.len()).sum();
                    let choices: Vec<Value> = g
                        .choices
                        .iter()
                        .enumerate()
                        .map(|(i, c)| {
                            let text = tok.decode(&c.tokens, true).unwrap_or_default();
                            let reason = if c.finish == Some(crate::plugin::FinishReason::Length) { "length" } else { "stop" };
                            if chat {
                                json!({ "index": i, "message": { "role": "assistant", "content": text }, "logprobs": Value::Null, "finish_reason": reason })
                            } else {
                                json!({ "index": i, "text": text, "logprobs": Value::Null, "finish_reason": reason })
                            }
                        })
                        .collect();
                    return Json(json!({
                        "id": cid, "object": if chat { "chat.completion" } else { "text_completion" }, "created": created, "model": model_name, "choices": choices,
                        "usage": { "prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion },
                        "inferd": { "decoder": name, "stats": g.stats },
                    }))
                    .into_response();
                }
                Event::Failed(msg) => return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", msg, None),
            }
        }
        return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine stopped", None);
    }
    // Streaming: one SSE chunk per piece of text, a last one with the finish reasons, [DONE].
    let st2 = Arc::clone(&st);
    let stream = async_stream(move |emit| async move {
        let tok = &st2.model.tokenizer;
        let mut decs: Vec<StreamDecoder> = (0..n).map(|_| StreamDecoder::new(false)).collect();
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choices: Value| json!({ "id": cid, "object": object, "created": created, "model": model_name, "choices": choices }).to_string();
        // A choice's piece of text, as a completion or a chat delta.
        let piece = |i: u32, text: String, reason: Value| {
            if chat {
                json!({ "index": i, "delta": { "content": text }, "logprobs": Value::Null, "finish_reason": reason })
            } else {
                json!({ "index": i, "text": text, "logprobs": Value::Null, "finish_reason": reason })
            }
        };
        if chat {
            let roles: Vec<Value> = (0..n).map(|i| json!({ "index": i, "delta": { "role": "assistant" }, "finish_reason": Value::Null })).collect();
            emit(chunk(Value::Array(roles)));
        }
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token { choice, token } => {
                    let text = decs.get_mut(choice as usize).and_then(|d| d.push(tok, token).ok()).unwrap_or_default();
                    if !text.is_empty() && !emit(chunk(json!([piece(choice, text, Value::Null)]))) {
                        return; // the client went away: dropping `rx` cancels the request
                    }
                }
                Event::Finished(g) => {
                    let choices: Vec<Value> = g
                        .choices
                        .iter()
                        .enumerate()
                        .map(|(i, c)| {
                            let rest = decs.get_mut(i).map(StreamDecoder::finish).unwrap_or_default();
                            let reason = if c.finish == Some(crate::plugin::FinishReason::Length) { "length" } else { "stop" };
                            piece(i as u32, rest, json!(reason))
                        })
                        .collect();
                    emit(chunk(Value::Array(choices)));
                    break;
                }
                Event::Failed(msg) => {
                    emit(json!({ "error": { "message": msg, "type": "server_error", "param": Value::Null, "code": Value::Null } }).to_string());
                    break;
                }
            }
        }
        emit("[DONE]".to_string());
    });
    Sse::new(stream).into_response()
}

/// A stream of SSE events fed by an async producer through `emit` (false once the client is
/// gone).
fn async_stream<F, Fut>(producer: F) -> impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>>
where
    F: FnOnce(Box<dyn Fn(String) -> bool + Send + Sync>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = unbounded_channel::<String>();
    let emit: Box<dyn Fn(String) -> bool + Send + Sync> = Box::new(move |s| tx.send(s).is_ok());
    tokio::spawn(producer(emit));
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map_data()
}

trait MapData {
    fn map_data(self) -> impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>>;
}

impl<S: tokio_stream::Stream<Item = String>> MapData for S {
    fn map_data(self) -> impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>> {
        tokio_stream::StreamExt::map(self, |s| Ok(SseEvent::default().data(s)))
    }
}
