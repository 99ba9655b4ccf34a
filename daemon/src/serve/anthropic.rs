//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): what Claude Code and
//! the Anthropic SDK send. A Messages body is read into the chat request the other routes serve
//! ([`Ask`]: `system`, turns of content blocks, `tool_use`/`tool_result` blocks as calls and tool
//! messages, `tools` with their `input_schema`, `tool_choice`, `stop_sequences`, sampling), and
//! the [`answer`](super::answer) stream is written back in Anthropic's shapes: one `message`
//! object, or its Server-Sent Events (`message_start`, a `content_block_start`/`_delta`/`_stop`
//! run per thinking, text or `tool_use` block, `message_delta` with the stop reason and usage,
//! `message_stop`). Errors have Anthropic's shape (`{"type": "error", "error": {...}}`).
//!
//! A remote model's request goes to its upstream as the equivalent OpenAI chat request; its
//! answer comes back through the same formatter.

use super::answer::{Answer, Answers, Finish, Whole};
use super::api::ApiError;
use super::api::{model_field, object};
use super::chat::{self, Tools};
use super::conn::Peer;
use super::fields;
use super::request;
use super::Shared;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use inferd_engine::tools::ToolCall;
use inferd_engine::vision::media::PromptImage;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The Messages API's routes.
pub fn routes() -> Router<Arc<Shared>> {
    Router::new().route("/v1/messages", post(messages)).route("/v1/messages/count_tokens", post(count_tokens))
}

/// An error in Anthropic's shape, with its status.
pub fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(json!({ "type": "error", "error": error_object(&e) }))).into_response()
}

/// The `error` object: Anthropic's type for the status, and the message.
fn error_object(e: &ApiError) -> Value {
    let kind = match e.status {
        400 | 405 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({ "type": kind, "message": e.message })
}

/// Keys of a Messages body read here.
const KEYS: [&str; 15] = [
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    // inferd's own, as on its OpenAI routes: the decoding strategy and its parameters.
    "decoder",
    "decoder_params",
];

/// Keys accepted and ignored: bookkeeping of Anthropic's own service (`metadata.user_id`
/// identifies the end user to it; inferd knows the local user from the socket) and its prompt
/// cache's (inferd's prefix cache needs no marks).
const IGNORED: [&str; 8] = [
    "metadata",
    "service_tier",
    "inference_geo",
    "cache_control",
    "diagnostics",
    "speed",
    "user_profile_id",
    "workspace_id",
];

/// A Messages request read into a chat request: the OpenAI-shaped body the chat routes read,
/// and what only this API has.
#[derive(Debug)]
pub struct Ask {
    /// `model`, `messages`, `tools`, `tool_choice`, `parallel_tool_calls`, `max_tokens`,
    /// `stop`, `temperature`, `top_p`, `top_k`, `stream`, as OpenAI's chat body has them.
    pub openai: Map<String, Value>,
    /// The last turn is the assistant's: the answer continues its text (a "prefill").
    pub prefill: Option<String>,
    pub stream: bool,
    /// The template's thinking switch (`thinking`, `output_config.effort`).
    pub extra: inferd_engine::chat::Extra,
}

impl Ask {
    /// Reads a Messages body (`count`: a `count_tokens` body, which has no `max_tokens`).
    pub fn of(m: &Map<String, Value>, count: bool) -> Result<Ask, ApiError> {
        for (k, v) in m {
            let k = k.as_str();
            let empty = match v {
                Value::Null => true,
                Value::Array(a) => a.is_empty(),
                _ => false,
            };
            if KEYS.contains(&k) || IGNORED.contains(&k) || (k == "mcp_servers" && empty) {
                continue;
            }
            return Err(ApiError::bad(format!("{k} is not supported by inferd"), "body"));
        }
        let mut o = Map::new();
        if let Some(model) = m.get("model") {
            o.insert("model".into(), model.clone());
        }
        let (mut turns, prefill) = turns(m.get("messages"))?;
        if let Some(system) = system(m.get("system"))? {
            turns.insert(0, json!({ "role": "system", "content": system }));
        }
        o.insert("messages".into(), Value::Array(turns));
        match m.get("max_tokens") {
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n >= 1) => {
                o.insert("max_tokens".into(), Value::Number(n.clone()));
            }
            None | Some(Value::Null) if count => {}
            None | Some(Value::Null) => return Err(ApiError::bad("max_tokens: the field is required", "max_tokens")),
            Some(_) => return Err(ApiError::bad("max_tokens must be an integer of at least 1", "max_tokens")),
        }
        match m.get("stop_sequences") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
                o.insert("stop".into(), Value::Array(a.clone()));
            }
            Some(_) => return Err(ApiError::bad("stop_sequences must be a list of strings", "stop_sequences")),
        }
        for k in ["temperature", "top_p", "top_k", "decoder", "decoder_params"] {
            if let Some(v) = m.get(k).filter(|v| !v.is_null()) {
                o.insert(k.into(), v.clone());
            }
        }
        if let Some(tools) = tools(m.get("tools"))? {
            o.insert("tools".into(), tools);
        }
        tool_choice(m.get("tool_choice"), &mut o)?;
        let effort = output_config(m.get("output_config"), &mut o)?;
        // The template's thinking switch: `enabled` and `adaptive` turn it on, `disabled` off.
        let enable = match m.get("thinking") {
            None | Some(Value::Null) => None,
            Some(t) => match t.get("type").and_then(Value::as_str) {
                Some("enabled" | "adaptive") => Some(true),
                Some("disabled") => Some(false),
                _ => return Err(ApiError::bad("thinking.type must be enabled, adaptive or disabled", "thinking")),
            },
        };
        let extra = super::reasoning::switch(enable, effort.as_deref());
        let stream = match m.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::bad("stream must be true or false", "stream")),
        };
        Ok(Ask { openai: o, prefill, stream, extra })
    }
}

/// `system`: a string or a list of text blocks.
fn system(v: Option<&Value>) -> Result<Option<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => parts.push(t),
                    _ => return Err(ApiError::bad(format!("system[{i}] must be a text block"), "system")),
                }
            }
            Ok(Some(parts.join("\n")))
        }
        Some(_) => Err(ApiError::bad("system must be a string or a list of text blocks", "system")),
    }
}

/// The text of a tool result's `content`: a string or a list of text blocks.
fn result_text(at: &str, v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::bad(
                            format!("{at}.content[{j}]: {other} blocks are not supported by inferd (text only)"),
                            "messages",
                        ))
                    }
                    _ => return Err(ApiError::bad(format!("{at}.content[{j}] needs a string text"), "messages")),
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::bad(format!("{at}.content must be a string or a list of text blocks"), "messages")),
    }
}

/// `messages` as OpenAI chat turns: a user turn's `tool_result` blocks become `tool` messages
/// (before its text, as Anthropic orders them), an assistant turn's `tool_use` blocks its
/// `tool_calls`; earlier `thinking` blocks are left out, as chat templates leave out earlier
/// reasoning. A last assistant turn of text only is the prefill the answer continues.
fn turns(v: Option<&Value>) -> Result<(Vec<Value>, Option<String>), ApiError> {
    let list = v.and_then(Value::as_array).ok_or_else(|| ApiError::bad("messages must be a list", "messages"))?;
    if list.is_empty() {
        return Err(ApiError::bad("messages: at least one message is required", "messages"));
    }
    let mut out = Vec::new();
    // Tool names by call id, for the tool messages that answer them.
    let mut names: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut prefill = None;
    for (i, msg) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let bad = |what: String| ApiError::bad(format!("{at}: {what}"), "messages");
        let role = msg.get("role").and_then(Value::as_str).unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(bad("role must be user or assistant (the system prompt is the system field)".into()));
        }
        let blocks: Vec<Value> = match msg.get("content") {
            Some(Value::String(s)) => vec![json!({ "type": "text", "text": s })],
            Some(Value::Array(a)) => a.clone(),
            _ => return Err(bad("content must be a string or a list of content blocks".into())),
        };
        let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
        // A user turn's text and images in order, as OpenAI content parts (where it has images).
        let mut parts: Vec<Value> = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let kind = b.get("type").and_then(Value::as_str).unwrap_or_default();
            match (role, kind) {
                (_, "text") => {
                    let t = b.get("text").and_then(Value::as_str);
                    let t = t.ok_or_else(|| bad(format!("content[{j}] needs a string text")))?;
                    text.push_str(t);
                    parts.push(json!({ "type": "text", "text": t }));
                }
                ("user", "image") => {
                    // A base64 source as a data: URL; a url source as it is (inlined before this where
                    // `[server] fetch_images` allows it, refused by the chat edge otherwise).
                    let src = b.get("source").cloned().unwrap_or_default();
                    let url = match (src.get("type").and_then(Value::as_str), src.get("data"), src.get("url")) {
                        (Some("base64"), Some(Value::String(data)), _) => {
                            let kind = src.get("media_type").and_then(Value::as_str).unwrap_or("image/png");
                            format!("data:{kind};base64,{data}")
                        }
                        (Some("url"), _, Some(Value::String(url))) => url.clone(),
                        _ => {
                            return Err(bad(format!(
                                "content[{j}]: an image block needs a base64 source with data (or a url source)"
                            )))
                        }
                    };
                    parts.push(json!({ "type": "image_url", "image_url": { "url": url } }));
                }
                ("assistant", "tool_use") => {
                    let id = b.get("id").and_then(Value::as_str);
                    let name = b.get("name").and_then(Value::as_str);
                    let input = b.get("input").filter(|x| x.is_object());
                    let (Some(id), Some(name), Some(input)) = (id, name, input) else {
                        return Err(bad(format!(
                            "content[{j}]: a tool_use block needs an id, a name and an input object"
                        )));
                    };
                    names.insert(id.to_owned(), name.to_owned());
                    calls.push(json!({ "id": id, "type": "function", "function": { "name": name, "arguments": input.to_string() } }));
                }
                ("assistant", "thinking" | "redacted_thinking") => {}
                ("user", "tool_result") => {
                    let id = b.get("tool_use_id").and_then(Value::as_str);
                    let id = id.ok_or_else(|| bad(format!("content[{j}]: a tool_result block needs a tool_use_id")))?;
                    let content = result_text(&format!("{at}.content[{j}]"), b.get("content"))?;
                    let mut r = json!({ "role": "tool", "tool_call_id": id, "content": content });
                    if let Some(name) = names.get(id) {
                        r["name"] = json!(name);
                    }
                    results.push(r);
                }
                (_, "document" | "search_result" | "container_upload") => {
                    return Err(bad(format!("content[{j}]: {kind} blocks are not supported by inferd")))
                }
                (_, "") => return Err(bad(format!("content[{j}] needs a type"))),
                _ => return Err(bad(format!("content[{j}]: a {role} turn cannot hold a {kind} block"))),
            }
        }
        if role == "assistant" && i + 1 == list.len() && calls.is_empty() {
            // The answer goes on from here; Anthropic's API drops trailing whitespace of it.
            prefill = Some(text.trim_end().to_owned());
            continue;
        }
        out.extend(results);
        if role == "assistant" {
            let mut a = json!({ "role": "assistant", "content": text });
            if !calls.is_empty() {
                a["tool_calls"] = Value::Array(calls);
            }
            out.push(a);
        } else if parts.iter().any(|p| p["type"] == "image_url") {
            out.push(json!({ "role": "user", "content": parts }));
        } else if !text.is_empty() || out.last().is_none_or(|m| m["role"] != "tool") {
            out.push(json!({ "role": "user", "content": text }));
        }
    }
    if out.is_empty() {
        return Err(ApiError::bad("messages: the conversation needs a user turn", "messages"));
    }
    Ok((out, prefill))
}

/// `tools`: custom tools (`name`, `description`, `input_schema`) as OpenAI function tools.
fn tools(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad("tools must be a list", "tools")),
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(ApiError::bad(
                    format!("tools[{i}]: {other} is one of Anthropic's own tools; inferd runs custom tools (name, description, input_schema)"),
                    "tools",
                ))
            }
        }
        let schema = t
            .get("input_schema")
            .filter(|s| s.is_object())
            .ok_or_else(|| ApiError::bad(format!("tools[{i}] needs an input_schema object"), "tools"))?;
        let mut f = json!({ "name": t.get("name").cloned().unwrap_or(Value::Null), "parameters": schema });
        if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
            f["description"] = d.clone();
        }
        out.push(json!({ "type": "function", "function": f }));
    }
    Ok(Some(Value::Array(out)))
}

/// `tool_choice` (`auto`, `any`, `tool` with a `name`, `none`; `disable_parallel_tool_use`) as
/// OpenAI's `tool_choice` and `parallel_tool_calls`.
fn tool_choice(v: Option<&Value>, o: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(c) = v.filter(|v| !v.is_null()) else { return Ok(()) };
    let bad = || ApiError::bad("tool_choice must be {\"type\": auto, any, tool (with a name) or none}", "tool_choice");
    let choice = match (c.get("type").and_then(Value::as_str), c.get("name").and_then(Value::as_str)) {
        (Some("auto"), _) => json!("auto"),
        (Some("any"), _) => json!("required"),
        (Some("none"), _) => json!("none"),
        (Some("tool"), Some(name)) => json!({ "type": "function", "function": { "name": name } }),
        _ => return Err(bad()),
    };
    o.insert("tool_choice".into(), choice);
    match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => {
            o.insert("parallel_tool_calls".into(), json!(!b));
        }
        Some(_) => return Err(ApiError::bad("disable_parallel_tool_use must be true or false", "tool_choice")),
    }
    Ok(())
}

/// `output_config`: its `format` (a JSON schema the answer follows) as OpenAI's
/// `response_format`; its `effort`, returned, is the template's `reasoning_effort`.
fn output_config(v: Option<&Value>, o: &mut Map<String, Value>) -> Result<Option<String>, ApiError> {
    let Some(c) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let c = c.as_object().ok_or_else(|| ApiError::bad("output_config must be an object", "output_config"))?;
    let mut effort = None;
    for (k, f) in c {
        match (k.as_str(), f) {
            (_, Value::Null) => {}
            ("effort", Value::String(e)) => effort = Some(e.clone()),
            ("format", f) => {
                let schema = f.get("schema").filter(|s| s.is_object());
                let (Some("json_schema"), Some(schema)) = (f.get("type").and_then(Value::as_str), schema) else {
                    return Err(ApiError::bad(
                        "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                        "output_config",
                    ));
                };
                let format = json!({ "type": "json_schema", "json_schema": { "name": "output", "schema": schema } });
                o.insert("response_format".into(), format);
            }
            _ => return Err(ApiError::bad(format!("output_config.{k} is not supported by inferd"), "output_config")),
        }
    }
    Ok(effort)
}

/// A prepared local request and what its answer needs.
struct Started {
    prepared: request::Prepared,
    tools: Tools,
    stream: bool,
}

/// The prompt of a Messages request for a local model, rendered with its template (and the
/// prefill after the generation prompt), and the request's tools.
fn prompt(
    sh: &Arc<Shared>,
    model: &super::ModelHandle,
    ask: &Ask,
) -> Result<(Vec<u32>, Tools, Vec<PromptImage>), ApiError> {
    let tools = Tools::of(&ask.openai, &model.model)?;
    let (mut ids, images) =
        chat::encode_with_images(sh, &model.model, &chat::messages(&ask.openai)?, Some(&tools), &ask.extra)?;
    if let Some(p) = ask.prefill.as_deref().filter(|p| !p.is_empty()) {
        let more = model.model.tokenizer.encode_bare(p, false).map_err(|e| ApiError::bad(e.to_string(), "messages"))?;
        ids.extend(more);
    }
    Ok((ids, tools, images))
}

/// `POST /v1/messages`.
async fn messages(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match remote(&sh, body, &peer).await {
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
    let start = |sh: &Arc<Shared>, body: &[u8]| -> Result<Started, ApiError> {
        let m = object(body)?;
        let ask = Ask::of(&m, false)?;
        let model = sh.model(model_field(&m)?)?;
        let (ids, tools, images) = prompt(sh, &model, &ask)?;
        let mut req = fields::typed(&ask.openai)?;
        tools.constrain(&mut req, model.vocabulary.as_deref())?;
        let mut prepared = request::prepare(sh, model, req, ids)?;
        prepared.images = images;
        Ok(Started { prepared, tools, stream: ask.stream })
    };
    let Started { prepared, tools, stream } = match sh.cpu_with(&body, start).await {
        Ok(s) => s,
        Err(e) => return error(e),
    };
    let model = prepared.model.name.clone();
    let stop = prepared.stop.clone();
    let think = super::reasoning::start(&prepared.model.model, &prepared.prompt);
    match request::submit(&sh, prepared, peer.uid(), Some(Arc::clone(&peer.hangup))) {
        Ok(sub) => {
            let id = format!("msg_{:016x}", sub.id);
            let answers = Answers::local(sub, 1, stop, tools.active().then_some(&tools)).thinking(think);
            respond(answers, Message { id, model, stream }).await
        }
        Err(e) => error(e),
    }
}

/// A request for a remote model goes to its upstream as an OpenAI chat request: `Err` with the
/// answer; `Ok` with the body to serve here (a local model's, or the fallback's while the
/// upstream is down).
async fn remote(sh: &Arc<Shared>, body: axum::body::Bytes, peer: &Peer) -> Result<axum::body::Bytes, Response> {
    let Some(r) = sh.remote_for(&body) else { return Ok(body) };
    let ask = object(&body).and_then(|m| Ok((Ask::of(&m, false)?, r.keep_for_fallback(&m))));
    let (ask, original) = match ask {
        Ok(a) => a,
        Err(e) => {
            r.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(error(r.failed(e)));
        }
    };
    if ask.prefill.is_some() {
        let e = ApiError::bad("a last assistant turn (prefill) is not supported for a remote model", "messages");
        return Err(error(r.failed(e)));
    }
    let mut req = ask.openai;
    req.insert("stream".into(), true.into());
    req.insert("stream_options".into(), json!({ "include_usage": true }));
    let opened = match r.open(sh, "/chat/completions", req, peer).await {
        Ok(o) => o,
        Err(f) => return r.fall_back(f, original).map_err(error),
    };
    if opened.resp.status().is_client_error() {
        return Err(error(r.refusal(opened.resp).await));
    }
    let id = format!("msg_{:016x}", sh.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let message = Message { id, model: r.name.clone(), stream: ask.stream };
    Err(respond(Answers::remote(r, opened, Arc::clone(&peer.hangup)), message).await)
}

/// `POST /v1/messages/count_tokens`: the prompt's length in the model's tokens, as the request
/// would be rendered.
async fn count_tokens(State(sh): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    if let Some(r) = sh.remote_for(&body) {
        let why = format!("{} is served by an upstream: its tokens are counted there, not by inferd", r.name);
        return error(ApiError::bad(why, "model"));
    }
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let count = |sh: &Arc<Shared>, body: &[u8]| -> Result<usize, ApiError> {
        let m = object(body)?;
        let ask = Ask::of(&m, true)?;
        let model = sh.model(model_field(&m)?)?;
        Ok(prompt(sh, &model, &ask)?.0.len())
    };
    match sh.cpu_with(&body, count).await {
        Ok(n) => Json(json!({ "input_tokens": n })).into_response(),
        Err(e) => error(e),
    }
}

/// How the message is answered.
struct Message {
    id: String,
    model: String,
    stream: bool,
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop_reason(f: &Finish) -> (&'static str, Value) {
    match f {
        Finish::Stop => ("end_turn", Value::Null),
        Finish::StopSequence(s) => ("stop_sequence", json!(s)),
        Finish::Length => ("max_tokens", Value::Null),
        Finish::ToolCalls => ("tool_use", Value::Null),
        Finish::Other(r) if r == "content_filter" => ("refusal", Value::Null),
        Finish::Other(_) => ("end_turn", Value::Null),
    }
}

/// A call's `input`: its arguments as an object.
fn input(c: &ToolCall) -> Value {
    serde_json::from_str::<Value>(&c.arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}))
}

/// The answer in Anthropic's shape.
async fn respond(answers: Answers, m: Message) -> Response {
    if m.stream {
        return stream(answers, m);
    }
    match answers.whole().await {
        Ok(w) => Json(whole(&m, &w)).into_response(),
        Err(e) => error(e),
    }
}

/// A whole answer as one `message` object: its thinking, text and `tool_use` blocks.
fn whole(m: &Message, w: &Whole) -> Value {
    let c = w.choices.first().cloned().unwrap_or_default();
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(json!({ "type": "thinking", "thinking": c.reasoning, "signature": "" }));
    }
    if !c.content().is_empty() || c.calls.is_empty() {
        content.push(json!({ "type": "text", "text": c.content() }));
    }
    for call in &c.calls {
        content.push(json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": input(call) }));
    }
    let (reason, sequence) = stop_reason(&c.reason());
    json!({
        "id": m.id, "type": "message", "role": "assistant", "model": m.model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": { "input_tokens": w.usage.prompt, "output_tokens": w.usage.completion },
    })
}

/// The kind of content block open in a stream.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Thinking,
    Text,
    ToolUse,
}

/// Streaming: Anthropic's event sequence. Text of whitespace alone waits for more text, so a
/// call's surrounding whitespace opens no empty text block.
fn stream(mut answers: Answers, m: Message) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(&'static str, String)>();
    tokio::spawn(async move {
        let send = |kind: &'static str, v: Value| tx.send((kind, v.to_string())).is_ok();
        let start = json!({ "type": "message_start", "message": {
            "id": m.id, "type": "message", "role": "assistant", "model": m.model, "content": [],
            "stop_reason": Value::Null, "stop_sequence": Value::Null,
            "usage": { "input_tokens": answers.prompt_tokens().unwrap_or(0), "output_tokens": 0 },
        } });
        if !send("message_start", start) || !send("ping", json!({ "type": "ping" })) {
            return;
        }
        // The open block and its index; whitespace held back; why the message ended.
        let (mut open, mut index, mut held) = (None::<Block>, 0usize, String::new());
        let mut finish = Finish::Stop;
        // Closes the open block (if any) and opens `next` (if any).
        let switch = |open: &mut Option<Block>, index: &mut usize, next: Option<(Block, Value)>| -> bool {
            if open.is_some() {
                if !send("content_block_stop", json!({ "type": "content_block_stop", "index": *index })) {
                    return false;
                }
                *index += 1;
                *open = None;
            }
            if let Some((b, block)) = next {
                *open = Some(b);
                let v = json!({ "type": "content_block_start", "index": *index, "content_block": block });
                return send("content_block_start", v);
            }
            true
        };
        while let Some(a) = answers.next().await {
            let ok = match a {
                Answer::Reasoning { choice: 0, text } => {
                    let ok = open == Some(Block::Thinking)
                        || switch(
                            &mut open,
                            &mut index,
                            Some((Block::Thinking, json!({ "type": "thinking", "thinking": "", "signature": "" }))),
                        );
                    let delta = json!({ "type": "thinking_delta", "thinking": text });
                    ok && send(
                        "content_block_delta",
                        json!({ "type": "content_block_delta", "index": index, "delta": delta }),
                    )
                }
                Answer::Text { choice: 0, text, .. } => {
                    held.push_str(&text);
                    if held.trim().is_empty() {
                        continue;
                    }
                    let text = std::mem::take(&mut held);
                    let ok = open == Some(Block::Text)
                        || switch(&mut open, &mut index, Some((Block::Text, json!({ "type": "text", "text": "" }))));
                    let delta = json!({ "type": "text_delta", "text": text });
                    ok && send(
                        "content_block_delta",
                        json!({ "type": "content_block_delta", "index": index, "delta": delta }),
                    )
                }
                Answer::Call { choice: 0, call, .. } => {
                    held.clear();
                    let block = json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": {} });
                    let json = input(&call).to_string();
                    let delta = json!({ "type": "input_json_delta", "partial_json": json });
                    switch(&mut open, &mut index, Some((Block::ToolUse, block)))
                        && send(
                            "content_block_delta",
                            json!({ "type": "content_block_delta", "index": index, "delta": delta }),
                        )
                        && switch(&mut open, &mut index, None)
                }
                Answer::Finish { choice: 0, reason } => {
                    finish = reason;
                    true
                }
                Answer::Done(u) => {
                    let (reason, sequence) = stop_reason(&finish);
                    let delta = json!({ "type": "message_delta",
                        "delta": { "stop_reason": reason, "stop_sequence": sequence },
                        "usage": { "output_tokens": u.completion } });
                    if switch(&mut open, &mut index, None) && send("message_delta", delta) {
                        send("message_stop", json!({ "type": "message_stop" }));
                    }
                    return;
                }
                Answer::Failed(e) => {
                    send("error", json!({ "type": "error", "error": error_object(&e) }));
                    return;
                }
                // Messages have one choice.
                _ => true,
            };
            if !ok {
                return; // the client went away: dropping the answer cancels the request
            }
        }
    });
    let events = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), |(k, s)| {
        Ok::<_, std::convert::Infallible>(SseEvent::default().event(k).data(s))
    });
    Sse::new(events).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(v: Value) -> Result<Ask, ApiError> {
        Ask::of(v.as_object().unwrap(), false)
    }

    #[test]
    fn a_conversation_with_tools_becomes_the_chat_request() {
        let a = ask(json!({
            "model": "m", "max_tokens": 64, "stop_sequences": ["END"], "temperature": 0.2, "top_k": 5,
            "system": [{ "type": "text", "text": "Be brief." }, { "type": "text", "text": "Use tools.", "cache_control": { "type": "ephemeral" } }],
            "tools": [{ "name": "get_weather", "description": "Weather.", "input_schema": { "type": "object", "properties": { "city": { "type": "string" } } } }],
            "tool_choice": { "type": "any", "disable_parallel_tool_use": true },
            "metadata": { "user_id": "u" },
            "messages": [
                { "role": "user", "content": "Weather in Paris?" },
                { "role": "assistant", "content": [
                    { "type": "thinking", "thinking": "call it", "signature": "s" },
                    { "type": "text", "text": "Looking." },
                    { "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": { "city": "Paris" } }] },
                { "role": "user", "content": [
                    { "type": "tool_result", "tool_use_id": "toolu_1", "content": [{ "type": "text", "text": "18C" }] },
                    { "type": "text", "text": "And so?" }] },
            ],
        }))
        .unwrap();
        let o = Value::Object(a.openai);
        assert_eq!(o["messages"][0], json!({ "role": "system", "content": "Be brief.\nUse tools." }));
        assert_eq!(o["messages"][1], json!({ "role": "user", "content": "Weather in Paris?" }));
        assert_eq!(o["messages"][2]["content"], "Looking.");
        assert_eq!(o["messages"][2]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(
            o["messages"][3],
            json!({ "role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18C" })
        );
        assert_eq!(o["messages"][4], json!({ "role": "user", "content": "And so?" }));
        assert_eq!(o["tools"][0]["function"]["parameters"]["properties"]["city"]["type"], "string");
        assert_eq!(o["tool_choice"], "required");
        assert_eq!(o["parallel_tool_calls"], false);
        assert_eq!(o["stop"], json!(["END"]));
        assert_eq!((o["max_tokens"].clone(), o["top_k"].clone()), (json!(64), json!(5)));
        assert!(a.prefill.is_none() && !a.stream);
    }

    #[test]
    fn image_blocks_become_image_parts_in_order() {
        let a = ask(json!({ "model": "m", "max_tokens": 8, "messages": [{ "role": "user", "content": [
            { "type": "text", "text": "Compare " },
            { "type": "image", "source": { "type": "base64", "media_type": "image/jpeg", "data": "AAAA" } },
            { "type": "image", "source": { "type": "url", "url": "https://example.com/a.png" } },
            { "type": "text", "text": "please." }] }] }))
        .expect("valid");
        let parts = &a.openai["messages"][0]["content"];
        assert_eq!(parts[0], json!({ "type": "text", "text": "Compare " }));
        assert_eq!(parts[1]["image_url"]["url"], "data:image/jpeg;base64,AAAA");
        assert_eq!(parts[2]["image_url"]["url"], "https://example.com/a.png");
        assert_eq!(parts[3], json!({ "type": "text", "text": "please." }));
    }

    #[test]
    fn a_last_assistant_turn_is_a_prefill() {
        let a = ask(json!({ "model": "m", "max_tokens": 8, "messages": [
            { "role": "user", "content": "Count" }, { "role": "assistant", "content": "1, 2, " }] }))
        .unwrap();
        assert_eq!(a.prefill.as_deref(), Some("1, 2,"));
        assert_eq!(a.openai["messages"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let refused = |v: Value| ask(v).unwrap_err().message;
        let base = |extra: Value| {
            let mut b = json!({ "model": "m", "max_tokens": 8, "messages": [{ "role": "user", "content": "hi" }] });
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            b
        };
        assert!(
            refused(json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] })).contains("max_tokens")
        );
        assert!(refused(base(json!({ "container": "c" }))).contains("container is not supported"));
        assert!(refused(base(
            json!({ "messages": [{ "role": "user", "content": [{ "type": "image", "source": {} }] }] })
        ))
        .contains("an image block needs a base64 source with data"));
        assert!(refused(base(
            json!({ "messages": [{ "role": "user", "content": [{ "type": "document", "source": {} }] }] })
        ))
        .contains("document blocks are not supported"));
        assert!(refused(base(json!({ "tools": [{ "type": "web_search_20250305", "name": "web_search" }] })))
            .contains("web_search_20250305 is one of Anthropic's own tools"));
        assert!(refused(base(json!({ "tools": [{ "name": "f" }] }))).contains("input_schema"));
        assert!(refused(base(json!({ "tool_choice": { "type": "tool" } }))).contains("tool_choice"));
        assert!(refused(base(json!({ "messages": [{ "role": "system", "content": "x" }] }))).contains("role must be"));
        assert!(refused(base(json!({ "messages": [{ "role": "user", "content": [{ "type": "tool_use", "id": "a", "name": "f", "input": {} }] }] })))
            .contains("a user turn cannot hold a tool_use block"));
        let ok = Ask::of(
            json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] }).as_object().unwrap(),
            true,
        );
        assert!(ok.is_ok(), "count_tokens needs no max_tokens");
    }

    #[test]
    fn errors_have_anthropic_types() {
        let kind = |s: u16| error_object(&ApiError::new(s, "m", None))["type"].clone();
        assert_eq!(kind(400), "invalid_request_error");
        assert_eq!(kind(404), "not_found_error");
        assert_eq!(kind(429), "rate_limit_error");
        assert_eq!(kind(503), "overloaded_error");
        assert_eq!(kind(500), "api_error");
    }
}
