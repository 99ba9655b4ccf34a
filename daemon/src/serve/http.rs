//! The HTTP edge on the Unix socket (and the optional loopback TCP listener): OpenAI-compatible
//! completions and chat completions (whole or as Server-Sent Events), Ollama's API
//! ([`ollama`](super::ollama)), `/tokenize`,
//! `/detokenize`, `/health`, `/v1/models`, `/v1/status` and Prometheus `/metrics`. The JSON is
//! parsed here; checking and submitting are the shared [`request`](super::request) path. The
//! peer's uid comes from SO_PEERCRED on the connection ([`Peer`], [`conn`](super::conn)).

use super::answer::Answers;
use super::api::{model_field, object, ApiError};
use super::chat::{self, Tools};
pub use super::conn::Peer;
use super::fields::{self, FIELDS};
use super::request;
use super::Shared;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use inferd_engine::plugin::session::MAX_TOP_LOGPROBS;
use inferd_engine::request::Request;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Responses per route and status, for `/metrics`.
#[derive(Debug, Default)]
pub struct HttpCounters {
    counts: Mutex<BTreeMap<(String, u16), u64>>,
}

impl HttpCounters {
    fn count(&self, route: &str, status: u16) {
        if let Ok(mut c) = self.counts.lock() {
            *c.entry((route.to_owned(), status)).or_default() += 1;
        }
    }

    pub fn snapshot(&self) -> BTreeMap<(String, u16), u64> {
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

pub use super::openai::error;

pub fn router(sh: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .merge(super::ollama::routes())
        .merge(super::anthropic::routes())
        .merge(super::responses::routes())
        .merge(super::rerank::routes())
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&sh), super::loading::progress))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/apply-template", post(apply_template))
        .route("/infill", post(super::infill::infill))
        .route("/detokenize", post(detokenize))
        .merge(super::loading::routes())
        .merge(super::upload::routes())
        .fallback(unknown)
        .method_not_allowed_fallback(not_allowed)
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&sh), count))
        // `read_body` bounds every body (and answers in JSON); the extractors' own 2 MiB
        // default, with its plain-text 413, would otherwise be the limit.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&sh), super::conn::read_body))
        .with_state(sh)
}

/// Counts every response by route and status.
async fn count(State(sh): State<Arc<Shared>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let route = req.uri().path().to_owned();
    let known = [
        "/health",
        "/v1/models",
        "/v1/status",
        "/metrics",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/rerank",
        "/rerank",
        "/v1/reranking",
        "/reranking",
        "/tokenize",
        "/apply-template",
        "/detokenize",
        "/api/version",
        "/api/tags",
        "/api/ps",
        "/api/show",
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/embeddings",
        "/api/delete",
        "/api/pull",
    ];
    let route = if known.contains(&route.as_str()) { route } else { "other".into() };
    let resp = next.run(req).await;
    sh.http.count(&route, resp.status().as_u16());
    resp
}

async fn health(State(sh): State<Arc<Shared>>) -> Response {
    if sh.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "status": "shutting down" }))).into_response();
    }
    Json(json!({ "status": "ok" })).into_response()
}

/// What a model's file says, loaded or not.
pub fn facts_json(slot: &super::models::Slot) -> Value {
    let source = match slot.source {
        super::models::Source::Configured => "config",
        super::models::Source::Store => "store",
    };
    let mut v =
        json!({ "path": slot.config.path, "source": source, "device": slot.device, "memory_bytes": slot.footprint() });
    if let Some(f) = &slot.facts {
        v["size"] = json!(f.size);
        v["format"] = json!(f.format);
        v["architecture"] = json!(f.architecture);
        v["file_type"] = json!(f.file_type);
        v["parameters"] = json!(f.parameters);
        v["trained_context_length"] = json!(f.context_len);
    }
    v
}

async fn models(State(sh): State<Arc<Shared>>, ConnectInfo(peer): ConnectInfo<Peer>) -> Json<Value> {
    Json(json!({ "object": "list", "data": model_list(&sh, &peer).await }))
}

/// `GET /v1/models/{id}`: one model as the list gives it, or a 404 naming it.
pub(super) async fn model(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let list = model_list(&sh, &peer).await;
    match list.into_iter().find(|m| m["id"] == id.as_str()) {
        Some(m) => Json(m).into_response(),
        None => error(ApiError::new(404, format!("the model {id:?} does not exist"), Some("model"))),
    }
}

/// Every route not served: a 404 with an OpenAI error body naming it.
async fn unknown(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(ApiError::new(404, format!("no route {method} {} in inferd", uri.path()), None))
}

/// A route served, asked with a method it does not take: a 405 with an error body.
async fn not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(ApiError::new(405, format!("{} does not take {method}", uri.path()), None))
}

/// The models as `/v1/models` lists them (loaded or not, drafts, remote ones); to a peer over
/// loopback TCP without file paths or upstream addresses.
async fn model_list(sh: &Arc<Shared>, peer: &Peer) -> Vec<Value> {
    sh.rescan_store().await;
    let mut data = Vec::new();
    for slot in &sh.models.slots() {
        let Some(m) = slot.loaded() else {
            let mut v = json!({ "id": slot.name, "object": "model", "owned_by": "inferd", "loaded": false });
            v["inferd"] = facts_json(slot);
            data.push(v);
            continue;
        };
        let mut roles = vec!["target"];
        if m.draft.is_some() {
            roles.push("speculative");
        }
        data.push(json!({ "id": m.name, "object": "model", "owned_by": "inferd", "loaded": true, "roles": roles, "context_length": m.context_len(), "draft": m.draft, "inferd": facts_json(slot) }));
        if let Some(d) = &m.draft {
            data.push(
                json!({ "id": d, "object": "model", "owned_by": "inferd", "roles": ["draft"], "draft_for": m.name }),
            );
        }
    }
    for r in sh.remotes.read().map(|r| r.clone()).unwrap_or_default() {
        data.push(json!({ "id": r.name, "object": "model", "owned_by": "remote", "remote": true, "inferd": { "upstream": r.upstream } }));
    }
    if !peer.local() {
        // Over loopback TCP: no file paths or upstream addresses (a web page may be asking).
        for m in &mut data {
            m["inferd"].as_object_mut().map(|o| (o.remove("path"), o.remove("upstream")));
        }
    }
    data
}

/// The engine state: per model KV blocks, queue, counters; plugins; uptime.
pub fn status_json(sh: &Shared) -> Value {
    let keep_alive = |k: Option<std::time::Duration>| k.map_or(json!(-1), |k| json!(k.as_secs_f64()));
    let models: Vec<Value> = sh
        .models
        .slots()
        .iter()
        .map(|slot| {
            let (loads, ka) = (slot.loads.load(std::sync::atomic::Ordering::Relaxed), keep_alive(slot.keep_alive()));
            let Some(m) = slot.loaded() else {
                let p = slot.progress.borrow();
                let loading = p.loading.then(|| json!({ "done_bytes": p.done, "total_bytes": p.total }));
                return json!({ "name": slot.name, "loaded": false, "loads": loads, "keep_alive_seconds": ka, "loading": loading, "file": facts_json(slot) });
            };
            let s = m.monitor.snapshot();
            json!({
                "name": m.name, "loaded": true, "loads": loads, "keep_alive_seconds": ka, "file": facts_json(slot),
                "idle_expires_in_seconds": slot.expires().map(|t| t.saturating_duration_since(std::time::Instant::now()).as_secs_f64()),
                "draft": m.draft, "context_length": m.context_len(), "backend": m.engine.backend(),
                "device_memory": m.engine.device_memory().map(|d| json!({ "weights_bytes": d.weights_bytes, "kv_bytes": d.kv_bytes })),
                "kv_blocks": { "total": s.kv.total, "free": s.kv.free, "used": s.kv.total - s.kv.free, "cached": s.kv.cached, "block_size": s.kv.block_size },
                "requests": { "running": s.running, "waiting": s.waiting, "finished": s.finished, "failed": s.failed, "cancelled": s.cancelled, "preempted": s.preempted },
                "tokens": { "generated": s.generated_tokens, "prompt": s.prompt_tokens, "prompt_cached": s.cached_prompt_tokens, "per_second": s.tokens_per_second },
                "steps": s.steps,
                "heartbeat_age_ms": m.monitor.since_beat().as_millis() as u64,
            })
        })
        .collect();
    let reg = sh.registry();
    let strategies: Vec<Value> = reg.strategies().iter().map(|s| json!({ "name": s.name(), "plugin": s.plugin_name, "version": s.plugin_version, "path": s.path, "isolated": s.isolated(), "quarantined": s.quarantined() })).collect();
    let refused = sh.refused.lock().map(|r| r.clone()).unwrap_or_default();
    let (reloads, refusal) = sh.reloads.lock().map(|r| r.clone()).unwrap_or_default();
    json!({
        "status": if sh.draining.load(std::sync::atomic::Ordering::Relaxed) { "stopping" } else { "ready" },
        "uptime_seconds": sh.started.elapsed().as_secs_f64(),
        "model_store": sh.models.store,
        "models": models,
        "strategies": strategies,
        "plugins_refused": refused,
        "reloads": { "count": reloads, "last_refused": refusal },
        "requests_per_user": sh.users.snapshot().into_iter().map(|(uid, n)| (uid.to_string(), json!(n))).collect::<Map<String, Value>>(),
        "limits": { "max_requests_per_user": sh.limits().max_requests_per_user, "max_tokens": sh.limits().max_tokens },
    })
}

/// The status; to a peer that is not a local user (loopback TCP), without what would tell a
/// web page about the machine: file paths, plugin paths, uids.
async fn status(State(sh): State<Arc<Shared>>, ConnectInfo(peer): ConnectInfo<Peer>) -> Json<Value> {
    let mut v = status_json(&sh);
    if !peer.local() {
        if let Some(o) = v.as_object_mut() {
            for k in ["model_store", "plugins_refused", "requests_per_user", "reloads"] {
                o.remove(k);
            }
        }
        for s in v["strategies"].as_array_mut().into_iter().flatten() {
            s.as_object_mut().map(|o| o.remove("path"));
        }
        for m in v["models"].as_array_mut().into_iter().flatten() {
            m["file"].as_object_mut().map(|o| o.remove("path"));
        }
    }
    Json(v)
}

async fn metrics(State(sh): State<Arc<Shared>>) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], super::metrics::prometheus(&sh)).into_response()
}

/// llama-server's `/apply-template`: a chat request's prompt as the model's template renders it
/// (messages, tools and the thinking switch as `/v1/chat/completions` takes them), nothing
/// generated.
async fn apply_template(State(sh): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let run = |sh: &Arc<Shared>, body: &[u8]| -> Result<Value, ApiError> {
        let m = object(body)?;
        let model = sh.model(model_field(&m)?)?;
        known_keys(&m, "messages")?;
        let tools = Tools::of(&m, &model.model)?;
        let extra = super::reasoning::openai(m.get("reasoning_effort"), m.get("chat_template_kwargs"))?;
        let prompt = chat::prompt_text(sh, &model.model, &chat::messages(&m)?, Some(&tools), &extra)?;
        Ok(json!({ "prompt": prompt }))
    };
    sh.cpu_with(&body, run).await.map_or_else(error, |v| Json(v).into_response())
}

async fn tokenize(State(sh): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let run = |sh: &Arc<Shared>, body: &[u8]| -> Result<Value, ApiError> {
        let m = object(body)?;
        let model = sh.model(model_field(&m)?)?;
        let text = m
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad("content must be a string", "content"))?;
        // As llama-server: `add_special` adds the model's BOS (and EOS), `parse_special` (on
        // unless false) reads special-token text as the special tokens.
        let flag = |k: &str, default: bool| m.get(k).and_then(Value::as_bool).unwrap_or(default);
        let (add, parse) = (flag("add_special", false), flag("parse_special", true));
        let tok = &model.model.tokenizer;
        let ids = if add { tok.encode(text, parse) } else { tok.encode_bare(text, parse) };
        let ids = ids.map_err(|e| ApiError::bad(e.to_string(), "content"))?;
        if !flag("with_pieces", false) {
            return Ok(json!({ "tokens": ids }));
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id).unwrap_or_default();
                let piece = std::str::from_utf8(bytes).map_or_else(|_| json!(bytes), |s| json!(s));
                json!({ "id": id, "piece": piece })
            })
            .collect();
        Ok(json!({ "tokens": pieces }))
    };
    sh.cpu_with(&body, run).await.map_or_else(error, |v| Json(v).into_response())
}

async fn detokenize(State(sh): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let run = |sh: &Arc<Shared>, body: &[u8]| -> Result<Value, ApiError> {
        let m = object(body)?;
        let model = sh.model(model_field(&m)?)?;
        let ids = m
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| ApiError::bad("tokens must be an array of token ids", "tokens"))?;
        let ids = request::prompt_ids(&model.model, ids, "tokens")?;
        let text = model.model.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad(e.to_string(), "tokens"))?;
        Ok(json!({ "content": text }))
    };
    sh.cpu_with(&body, run).await.map_or_else(error, |v| Json(v).into_response())
}

/// Keys of OpenAI's request bodies that inferd accepts and ignores: bookkeeping for OpenAI's
/// own service (`user` identifies the end user to it; inferd knows the local user from the
/// socket).
pub const IGNORED: [&str; 4] = ["user", "store", "metadata", "service_tier"];

/// The keys a route reads itself, beside [`FIELDS`].
const ROUTE_KEYS: [&str; 10] = [
    "model",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "reasoning_effort",
    "chat_template_kwargs",
];

/// Checks that every key of the body is one inferd implements or an accepted no-op: a field
/// OpenAI defines that inferd does not implement is a 400 naming it, never silently dropped.
/// `body_key` is the route's own (`prompt` or `messages`).
fn known_keys(m: &Map<String, Value>, body_key: &str) -> Result<(), ApiError> {
    for (k, v) in m {
        let k = k.as_str();
        // A completion's `suffix`: the code after a fill-in-the-middle gap.
        let own = k == body_key || (body_key == "prompt" && k == "suffix");
        if own || FIELDS.contains(&k) || IGNORED.contains(&k) || ROUTE_KEYS.contains(&k) || v.is_null() {
            continue;
        }
        // Values that ask for nothing beyond plain text generation.
        let default = match k {
            "modalities" => v.as_array().is_some_and(|a| a.iter().all(|x| x == "text")),
            "echo" => v == &Value::Bool(false),
            "best_of" => v.as_u64() == Some(1),
            _ => false,
        };
        if default {
            continue;
        }
        let what = match k {
            "functions" | "function_call" => "the deprecated functions API; send tools",
            _ => "",
        };
        let message = if what.is_empty() {
            format!("{k} is not supported by inferd")
        } else {
            format!("{k} is not supported by inferd yet ({what})")
        };
        return Err(ApiError::bad(message, param(k)));
    }
    Ok(())
}

/// A body key as a `'static` str for [`ApiError::param`].
fn param(k: &str) -> &'static str {
    const NAMED: [&str; 14] = [
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "logprobs",
        "top_logprobs",
        "echo",
        "best_of",
        "suffix",
        "modalities",
        "stream_options",
        "reasoning_effort",
        "chat_template_kwargs",
    ];
    NAMED.iter().find(|n| **n == k).copied().unwrap_or("body")
}

/// Whether the body asks for each token's log-probability, and for how many of the most
/// probable alternatives: chat's `logprobs: true` with `top_logprobs: N`, completions'
/// `logprobs: N`.
fn wants_logprobs(m: &Map<String, Value>, chat: bool) -> Result<Option<u32>, ApiError> {
    let max = u64::from(MAX_TOP_LOGPROBS);
    let count = |key: &'static str| -> Result<Option<u32>, ApiError> {
        match m.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(k) if k <= max => Ok(Some(k as u32)),
                _ => Err(ApiError::bad(format!("{key} must be an integer from 0 to {max}"), key)),
            },
        }
    };
    if !chat {
        if m.get("top_logprobs").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad("top_logprobs is a chat field; completions take logprobs: N", "top_logprobs"));
        }
        return count("logprobs");
    }
    let top = count("top_logprobs")?;
    match m.get("logprobs") {
        Some(Value::Bool(true)) => Ok(Some(top.unwrap_or(0))),
        None | Some(Value::Null) | Some(Value::Bool(false)) if top.is_some_and(|k| k > 0) => {
            Err(ApiError::bad("top_logprobs needs logprobs: true", "top_logprobs"))
        }
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(_) => Err(ApiError::bad("logprobs must be true or false", "logprobs")),
    }
}

/// `stream_options.include_usage` (a 400 unless streaming, as OpenAI answers).
fn include_usage(m: &Map<String, Value>) -> Result<bool, ApiError> {
    let Some(o) = m.get("stream_options").filter(|v| !v.is_null()) else { return Ok(false) };
    if m.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err(ApiError::bad("stream_options is only allowed when stream is true", "stream_options"));
    }
    let o = o.as_object().ok_or_else(|| ApiError::bad("stream_options must be an object", "stream_options"))?;
    let mut usage = false;
    for (k, v) in o {
        match (k.as_str(), v) {
            ("include_usage", Value::Bool(b)) => usage = *b,
            ("include_usage", _) => return Err(ApiError::bad("include_usage must be true or false", "stream_options")),
            _ => return Err(ApiError::bad(format!("stream_options.{k} is not supported by inferd"), "stream_options")),
        }
    }
    Ok(usage)
}

async fn completions(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match remote(&sh, "/completions", body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let start = |sh: &Arc<Shared>, body: &[u8]| -> Result<(request::Prepared, Map<String, Value>), ApiError> {
        let m = object(body)?;
        let model = sh.model(model_field(&m)?)?;
        known_keys(&m, "prompt")?;
        include_usage(&m)?;
        let ids = completion_prompt(&model, &m)?;
        let req = Request { logprobs: wants_logprobs(&m, false)?, ..fields::typed(&m)? };
        Ok((request::prepare(sh, model, req, ids)?, m))
    };
    match sh.cpu_with(&body, start).await {
        Ok((p, m)) => respond(sh, p, &m, peer, false, None).await,
        Err(e) => error(e),
    }
}

/// A completion's prompt as token ids: text (special-token text parsed) or token ids, alone or
/// as a list of one (OpenAI's batch form; one prompt per request here). With a non-empty
/// `suffix`, the prompt is the code before a gap and the suffix the code after it: a
/// fill-in-the-middle prompt in the model's tokens.
fn completion_prompt(model: &super::ModelHandle, m: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let bad = || ApiError::bad("prompt must be a string, token ids, or a list of one of those", "prompt");
    let mut prompt = m.get("prompt").ok_or_else(bad)?;
    if let Value::Array(a) = prompt {
        if a.len() == 1 && (a[0].is_string() || a[0].is_array()) {
            prompt = &a[0];
        } else if a.len() > 1 && a.iter().all(|p| p.is_string() || p.is_array()) {
            return Err(ApiError::bad(
                format!("prompt lists {} prompts; inferd takes one per request", a.len()),
                "prompt",
            ));
        }
    }
    let suffix = match m.get("suffix") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(ApiError::bad("suffix must be a string", "suffix")),
    };
    match prompt {
        Value::String(p) if !suffix.is_empty() => {
            let tok = &model.model.tokenizer;
            super::fim::gap(tok, super::fim::tokens(tok, &model.name, "suffix")?, p, suffix)
        }
        _ if !suffix.is_empty() => Err(ApiError::bad("a suffix needs the prompt as text", "suffix")),
        Value::String(p) => request::encode_prompt(&model.model, p),
        Value::Array(ids) => request::prompt_ids(&model.model, ids, "prompt"),
        _ => Err(bad()),
    }
}

async fn chat_completions(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match remote(&sh, "/chat/completions", body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    let body = match super::image_fetch::inline(&sh, body).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let start = |sh: &Arc<Shared>, body: &[u8]| -> Result<(request::Prepared, Map<String, Value>, Tools), ApiError> {
        let m = object(body)?;
        let model = sh.model(model_field(&m)?)?;
        known_keys(&m, "messages")?;
        include_usage(&m)?;
        let tools = Tools::of(&m, &model.model)?;
        let extra = super::reasoning::openai(m.get("reasoning_effort"), m.get("chat_template_kwargs"))?;
        let (ids, images) = chat::encode_with_images(sh, &model.model, &chat::messages(&m)?, Some(&tools), &extra)?;
        let mut req = Request { logprobs: wants_logprobs(&m, true)?, ..fields::typed(&m)? };
        tools.constrain(&mut req, model.vocabulary.as_deref())?;
        let mut p = request::prepare(sh, model, req, ids)?;
        p.images = images;
        Ok((p, m, tools))
    };
    match sh.cpu_with(&body, start).await {
        Ok((p, m, tools)) => respond(sh, p, &m, peer, true, tools.active().then_some(tools)).await,
        Err(e) => error(e),
    }
}

/// A request for a remote model goes to its upstream: `Err` with the answer; `Ok` with the
/// body to serve here (a local model's request, or a fallback's while the upstream is down).
pub(super) async fn remote(
    sh: &Arc<Shared>,
    route: &str,
    body: axum::body::Bytes,
    peer: &Peer,
) -> Result<axum::body::Bytes, Response> {
    let Some(r) = sh.remote_for(&body) else { return Ok(body) };
    match r.forward(sh, route, &body, peer.clone()).await {
        super::remote::openai::Forwarded::Answer(a) => Err(a),
        super::remote::openai::Forwarded::Fallback(b) => Ok(b),
    }
}

/// OpenAI's embeddings: the loaded model's mean-pooled, normalized final hidden states.
async fn embeddings(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match remote(&sh, "/embeddings", body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let run = async {
        let m = object(&body)?;
        let model = super::embed::model_of(&sh, &m)?;
        let (inputs, b64) = super::embed::openai_body(&m, model.model.config.hidden)?;
        let (vectors, tokens) =
            super::embed::embed(&sh, &model, inputs, false, peer.uid(), Some(Arc::clone(&peer.hangup))).await?;
        Ok::<_, ApiError>(super::embed::openai_reply(&model.name, &vectors, tokens, b64))
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(e),
    }
}

/// A prepared request submitted and answered as a completion or a chat completion, whole or
/// streamed ([`openai`](super::openai)).
async fn respond(
    sh: Arc<Shared>,
    p: request::Prepared,
    m: &Map<String, Value>,
    peer: Peer,
    chat: bool,
    tools: Option<Tools>,
) -> Response {
    let shape = super::openai::Shape {
        chat,
        stream: m.get("stream").and_then(Value::as_bool).unwrap_or(false),
        usage_chunk: include_usage(m).unwrap_or(false),
        logprobs: p.logprobs.is_some(),
        decoder: p.strategy.name().to_owned(),
    };
    let (n, stop) = (p.n, p.stop.clone());
    // A thinking model's chat answer: its `<think>` block is `reasoning_content`.
    let think = if chat { super::reasoning::start(&p.model.model, &p.prompt) } else { None };
    match request::submit(&sh, p, peer.uid(), Some(Arc::clone(&peer.hangup))) {
        Ok(sub) => super::openai::respond(Answers::local(sub, n, stop, tools.as_ref()).thinking(think), shape).await,
        Err(e) => error(e),
    }
}
