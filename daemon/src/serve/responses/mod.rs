//! OpenAI's Responses API (`/v1/responses`): what the OpenAI SDK's newer agents and Codex CLI
//! send. A request is read into the chat request the other routes serve ([`Ask`]:
//! `instructions` as the system message, `input` items as turns, function calls and their
//! outputs as calls and tool messages, function `tools`, `tool_choice`, `text.format` as the
//! response format); with `previous_response_id`, the stored conversation of that response
//! comes first. The [`answer`](super::answer) stream becomes output items (`reasoning`,
//! `message` with `output_text`, `function_call`), whole or as the API's typed events
//! ([`turn`]). Unless `store` is false, the response and its conversation are kept for the
//! user ([`stored`](super::stored)): `GET` and `DELETE /v1/responses/{id}` reach them.

use super::answer::{Answer, Answers, Finish};
use super::api::ApiError;
use super::api::{model_field, object};
use super::chat::{self, Tools};
use super::conn::Peer;
use super::fields;
use super::openai::error;
use super::request;
use super::{stored, Shared};
use axum::extract::{ConnectInfo, Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use turn::Turn;

mod turn;

/// The Responses API's routes.
pub fn routes() -> Router<Arc<Shared>> {
    Router::new().route("/v1/responses", post(create)).route("/v1/responses/{id}", get(fetch).delete(remove))
}

/// Keys of a Responses body read here.
const KEYS: [&str; 18] = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "top_logprobs",
    // inferd's own, as on its other routes: the decoding strategy and its parameters.
    "decoder",
    "decoder_params",
];

/// Keys accepted and ignored: OpenAI's own service's bookkeeping (`user` and
/// `safety_identifier` name the end user to it; inferd knows the local user from the socket),
/// its prompt cache's key (inferd's prefix cache needs none), and what it may send back that
/// inferd does not make (`include`: encrypted reasoning, search results).
const IGNORED: [&str; 7] = [
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "include",
    "stream_options",
];

/// A Responses request read into a chat request.
#[derive(Debug)]
pub struct Ask {
    /// The chat body the chat route reads (`messages` with the stored conversation first).
    pub openai: Map<String, Value>,
    /// The conversation as stored for the next turn: earlier turns and this input, without
    /// `instructions` (they do not carry over, as OpenAI defines it).
    pub history: Vec<Value>,
    /// What the response object repeats of the request.
    pub echo: Map<String, Value>,
    pub stream: bool,
    pub store: bool,
    /// The template's thinking switch (`reasoning.effort`).
    pub extra: inferd_engine::chat::Extra,
}

impl Ask {
    /// Reads a Responses body; `earlier` is the stored conversation of `previous_response_id`.
    pub fn of(m: &Map<String, Value>, earlier: Vec<Value>) -> Result<Ask, ApiError> {
        for (k, v) in m {
            let k = k.as_str();
            let neutral = match k {
                "truncation" => v == "disabled" || v == "auto",
                "background" => v == &Value::Bool(false),
                _ => false,
            };
            if KEYS.contains(&k) || IGNORED.contains(&k) || neutral || v.is_null() {
                continue;
            }
            return Err(ApiError::bad(format!("{k} is not supported by inferd"), "body"));
        }
        let mut o = Map::new();
        if let Some(model) = m.get("model") {
            o.insert("model".into(), model.clone());
        }
        let mut history = earlier;
        history.extend(input(m.get("input"), &history)?);
        let mut messages = history.clone();
        match m.get("instructions") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => messages.insert(0, json!({ "role": "system", "content": s })),
            Some(_) => return Err(ApiError::bad("instructions must be a string", "instructions")),
        }
        o.insert("messages".into(), Value::Array(messages));
        if let Some(t) = tools(m.get("tools"))? {
            o.insert("tools".into(), t);
        }
        if let Some(c) = tool_choice(m.get("tool_choice"))? {
            o.insert("tool_choice".into(), c);
        }
        for (from, to) in [
            ("parallel_tool_calls", "parallel_tool_calls"),
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("decoder", "decoder"),
            ("decoder_params", "decoder_params"),
        ] {
            if let Some(v) = m.get(from).filter(|v| !v.is_null()) {
                o.insert(to.into(), v.clone());
            }
        }
        if let Some(f) = text_format(m.get("text"))? {
            o.insert("response_format".into(), f);
        }
        match m.get("top_logprobs") {
            None | Some(Value::Null) => {}
            Some(v) => {
                o.insert("logprobs".into(), true.into());
                o.insert("top_logprobs".into(), v.clone());
            }
        }
        // `reasoning.effort` is the template's switch, as chat's `reasoning_effort` is.
        let extra = match m.get("reasoning") {
            None | Some(Value::Null) => Default::default(),
            Some(r @ Value::Object(_)) => super::reasoning::openai(r.get("effort"), None)?,
            Some(_) => return Err(ApiError::bad("reasoning must be an object", "reasoning")),
        };
        let flag = |k: &'static str, default: bool| match m.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::bad(format!("{k} must be true or false"), k)),
        };
        let (stream, store) = (flag("stream", false)?, flag("store", true)?);
        let mut echo = Map::new();
        for k in [
            "instructions",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "max_output_tokens",
            "temperature",
            "top_p",
            "previous_response_id",
            "reasoning",
            "text",
            "metadata",
            "top_logprobs",
        ] {
            echo.insert(k.into(), m.get(k).cloned().unwrap_or(Value::Null));
        }
        let defaults = [
            ("tools", json!([])),
            ("tool_choice", json!("auto")),
            ("parallel_tool_calls", json!(true)),
            ("text", json!({ "format": { "type": "text" } })),
            ("metadata", json!({})),
            ("reasoning", json!({ "effort": null, "summary": null })),
        ];
        for (k, v) in defaults {
            if echo[k].is_null() {
                echo.insert(k.into(), v);
            }
        }
        echo.insert("store".into(), store.into());
        echo.insert("truncation".into(), m.get("truncation").cloned().unwrap_or_else(|| json!("disabled")));
        Ok(Ask { openai: o, history, echo, stream, store, extra })
    }
}

/// A message's content as a chat message's: a string, or parts whose text is joined
/// (`input_text`, `output_text`, a `refusal`'s); `input_image` parts (an `image_url`, a
/// `data:` URL as the chat API takes) make it OpenAI chat content parts, text and images in
/// their order; files and audio are refused by name.
fn content(at: &str, v: Option<&Value>) -> Result<Value, ApiError> {
    let bad = |what: String| ApiError::bad(format!("{at}: {what}"), "input");
    match v {
        Some(Value::String(s)) => Ok(json!(s)),
        Some(Value::Array(parts)) => {
            let (mut text, mut chat) = (String::new(), Vec::new());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or_default();
                let t = match kind {
                    "input_text" | "output_text" | "text" => p.get("text"),
                    "refusal" => p.get("refusal"),
                    "input_image" => {
                        let url = p.get("image_url").and_then(Value::as_str).ok_or_else(|| {
                            bad(format!("content[{j}]: an input_image needs its image_url (file_id is not supported)"))
                        })?;
                        if !text.is_empty() {
                            chat.push(json!({ "type": "text", "text": std::mem::take(&mut text) }));
                        }
                        chat.push(json!({ "type": "image_url", "image_url": { "url": url } }));
                        continue;
                    }
                    "input_file" | "input_audio" => {
                        return Err(bad(format!("content[{j}]: {kind} is not supported by inferd")))
                    }
                    _ => return Err(bad(format!("content[{j}]: unknown content type {kind:?}"))),
                };
                text.push_str(t.and_then(Value::as_str).ok_or_else(|| bad(format!("content[{j}] needs its text")))?);
            }
            if chat.is_empty() {
                return Ok(json!(text));
            }
            if !text.is_empty() {
                chat.push(json!({ "type": "text", "text": text }));
            }
            Ok(Value::Array(chat))
        }
        _ => Err(bad("content must be a string or a list of content parts".into())),
    }
}

/// `input`: a string (one user message) or items, as chat turns: messages keep their roles
/// (`developer` is a system message), `function_call` items join the assistant turn before
/// them as its calls, `function_call_output` items become tool messages; `reasoning` items
/// are left out, as chat templates leave out earlier reasoning. `earlier` (the stored turns)
/// names the calls that outputs answer.
fn input(v: Option<&Value>, earlier: &[Value]) -> Result<Vec<Value>, ApiError> {
    let items = match v {
        Some(Value::String(s)) => return Ok(vec![json!({ "role": "user", "content": s })]),
        Some(Value::Array(a)) => a,
        _ => return Err(ApiError::bad("input must be a string or a list of items", "input")),
    };
    let mut out: Vec<Value> = Vec::new();
    let name_of = |out: &[Value], id: &str| -> Option<String> {
        earlier.iter().chain(out.iter()).rev().find_map(|m| {
            m.get("tool_calls")?
                .as_array()?
                .iter()
                .find(|c| c["id"] == id)
                .and_then(|c| c.pointer("/function/name").and_then(Value::as_str).map(str::to_owned))
        })
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let bad = |what: &str| ApiError::bad(format!("{at}: {what}"), "input");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") => "system",
                    Some(r @ ("user" | "system" | "assistant")) => r,
                    _ => return Err(bad("role must be user, assistant, system or developer")),
                };
                out.push(json!({ "role": role, "content": content(&at, item.get("content"))? }));
            }
            "function_call" => {
                let (Some(id), Some(name), Some(args)) = (
                    item.get("call_id").and_then(Value::as_str),
                    item.get("name").and_then(Value::as_str),
                    item.get("arguments").and_then(Value::as_str),
                ) else {
                    return Err(bad("a function_call needs call_id, name and arguments (JSON text)"));
                };
                let call = json!({ "id": id, "type": "function", "function": { "name": name, "arguments": args } });
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" => {
                        let calls = m.as_object_mut().map(|o| o.entry("tool_calls").or_insert_with(|| json!([])));
                        if let Some(Value::Array(calls)) = calls {
                            calls.push(call);
                        }
                    }
                    _ => out.push(json!({ "role": "assistant", "content": "", "tool_calls": [call] })),
                }
            }
            "function_call_output" => {
                let id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a function_call_output needs a call_id"))?;
                let output = content(&at, item.get("output"))?;
                let mut m = json!({ "role": "tool", "tool_call_id": id, "content": output });
                if let Some(name) = name_of(&out, id) {
                    m["name"] = json!(name);
                }
                out.push(m);
            }
            "reasoning" => {}
            other => return Err(bad(&format!("{other} items are not supported by inferd"))),
        }
    }
    Ok(out)
}

/// `tools`: function tools (`name`, `description`, `parameters`) as chat tools; OpenAI's own
/// tools (web search, file search, computer use, MCP...) are refused by name.
fn tools(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad("tools must be a list", "tools")),
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::bad(
                    format!("tools[{i}]: {other} tools are not supported by inferd (function tools are)"),
                    "tools",
                ))
            }
            None => return Err(ApiError::bad(format!("tools[{i}] needs a type"), "tools")),
        }
        let mut f = json!({ "name": t.get("name").cloned().unwrap_or(Value::Null) });
        for k in ["description", "parameters"] {
            if let Some(x) = t.get(k).filter(|x| !x.is_null()) {
                f[k] = x.clone();
            }
        }
        out.push(json!({ "type": "function", "function": f }));
    }
    Ok(Some(Value::Array(out)))
}

/// `tool_choice`: `auto`, `none`, `required` or `{"type": "function", "name": ...}`, in chat's
/// shape.
fn tool_choice(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(json!(s))),
        Some(c) => match (c.get("type").and_then(Value::as_str), c.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => Ok(Some(json!({ "type": "function", "function": { "name": name } }))),
            _ => Err(ApiError::bad(
                "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                "tool_choice",
            )),
        },
    }
}

/// `text.format` as chat's `response_format` (`text`, `json_object`, or `json_schema` with its
/// `name`, `schema` and `strict` beside the type); `text.verbosity` is the model's affair.
fn text_format(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(f) = v.filter(|v| !v.is_null()).and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({ "type": "json_object" }))),
        Some("json_schema") => {
            let mut js = json!({ "name": f.get("name").cloned().unwrap_or_else(|| json!("output")) });
            for k in ["schema", "strict", "description"] {
                if let Some(x) = f.get(k).filter(|x| !x.is_null()) {
                    js[k] = x.clone();
                }
            }
            Ok(Some(json!({ "type": "json_schema", "json_schema": js })))
        }
        _ => Err(ApiError::bad("text.format.type must be text, json_object or json_schema", "text")),
    }
}

/// A prepared local request and what its answer needs.
struct Started {
    prepared: request::Prepared,
    tools: Tools,
    ask: Ask,
}

/// `POST /v1/responses`.
async fn create(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match super::image_fetch::inline(&sh, body).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    let m = match object(&body) {
        Ok(m) => m,
        Err(e) => return error(e),
    };
    // The stored conversation this one continues (the user's own).
    let earlier = match m.get("previous_response_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(id)) => match sh.responses.get(peer.uid(), id).await {
            Some(rec) => rec["history"].as_array().cloned().unwrap_or_default(),
            None => {
                let e = ApiError::new(404, format!("no stored response {id:?}"), Some("previous_response_id"));
                return error(e);
            }
        },
        Some(_) => return error(ApiError::bad("previous_response_id must be a string", "previous_response_id")),
    };
    let body = match remote(&sh, &peer, &m, &earlier, body).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let start = move |sh: &Arc<Shared>, body: &[u8]| -> Result<Started, ApiError> {
        let m = object(body)?;
        let ask = Ask::of(&m, earlier)?;
        let model = sh.model(model_field(&m)?)?;
        let tools = Tools::of(&ask.openai, &model.model)?;
        let (ids, images) =
            chat::encode_with_images(sh, &model.model, &chat::messages(&ask.openai)?, Some(&tools), &ask.extra)?;
        let logprobs = match ask.openai.get("top_logprobs") {
            None => None,
            Some(v) => match v.as_u64() {
                Some(k) if k <= u64::from(inferd_engine::plugin::session::MAX_TOP_LOGPROBS) => Some(k as u32),
                _ => return Err(ApiError::bad("top_logprobs must be an integer from 0 to 20", "top_logprobs")),
            },
        };
        let mut req = inferd_engine::request::Request { logprobs, ..fields::typed(&ask.openai)? };
        tools.constrain(&mut req, model.vocabulary.as_deref())?;
        let mut prepared = request::prepare(sh, model, req, ids)?;
        prepared.images = images;
        Ok(Started { prepared, tools, ask })
    };
    let Started { prepared, tools, ask } = match sh.cpu_with(&body, start).await {
        Ok(s) => s,
        Err(e) => return error(e),
    };
    let model = Arc::clone(&prepared.model);
    let logprobs = prepared.logprobs.is_some();
    let stop = prepared.stop.clone();
    let think = super::reasoning::start(&prepared.model.model, &prepared.prompt);
    match request::submit(&sh, prepared, peer.uid(), Some(Arc::clone(&peer.hangup))) {
        Ok(sub) => {
            let answers = Answers::local(sub, 1, stop, tools.active().then_some(&tools)).thinking(think);
            let reply = Reply::new(model.name.clone(), ask, logprobs.then_some(model));
            respond(sh, peer, answers, reply).await
        }
        Err(e) => error(e),
    }
}

/// A request for a remote model goes to its upstream as an OpenAI chat request (streamed, so
/// that the answer comes back through the same events): `Err` with the answer; `Ok` with the
/// body to serve here (a local model's, or the fallback's while the upstream is down).
async fn remote(
    sh: &Arc<Shared>,
    peer: &Peer,
    m: &Map<String, Value>,
    earlier: &[Value],
    body: axum::body::Bytes,
) -> Result<axum::body::Bytes, Response> {
    let Some(r) = sh.remote_for(&body) else { return Ok(body) };
    let ask = Ask::of(m, earlier.to_vec()).map_err(|e| error(r.failed(e)))?;
    let mut req = ask.openai.clone();
    req.insert("stream".into(), true.into());
    req.insert("stream_options".into(), json!({ "include_usage": true }));
    // Token log-probabilities name tokens of the upstream's vocabulary, which is not known here.
    req.remove("logprobs");
    req.remove("top_logprobs");
    let opened = match r.open(sh, "/chat/completions", req, peer).await {
        Ok(o) => o,
        Err(f) => return r.fall_back(f, r.keep_for_fallback(m)).map_err(error),
    };
    if opened.resp.status().is_client_error() {
        return Err(error(r.refusal(opened.resp).await));
    }
    let answers = Answers::remote(Arc::clone(&r), opened, Arc::clone(&peer.hangup));
    Err(respond(Arc::clone(sh), peer.clone(), answers, Reply::new(r.name.clone(), ask, None)).await)
}

/// `GET /v1/responses/{id}`: a stored response of the caller's.
async fn fetch(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> Response {
    match sh.responses.get(peer.uid(), &id).await {
        Some(rec) => Json(rec["response"].clone()).into_response(),
        None => error(ApiError::new(404, format!("no stored response {id:?}"), None)),
    }
}

/// `DELETE /v1/responses/{id}`.
async fn remove(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> Response {
    if sh.responses.delete(peer.uid(), &id).await {
        Json(json!({ "id": id, "object": "response", "deleted": true })).into_response()
    } else {
        error(ApiError::new(404, format!("no stored response {id:?}"), None))
    }
}

/// The response being written: its request's echo, and what the answer has made of it.
struct Reply {
    id: String,
    created: u64,
    model_name: String,
    ask: Ask,
    /// The model whose tokens the log-probabilities name, when they were asked for.
    logprobs: Option<Arc<super::ModelHandle>>,
    turn: Turn,
}

impl Reply {
    fn new(model_name: String, ask: Ask, logprobs: Option<Arc<super::ModelHandle>>) -> Reply {
        let id = stored::new_id();
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let turn = Turn::new(&id[5..]);
        Reply { id, created, model_name, ask, logprobs, turn }
    }

    /// The response object in its present state.
    fn object(&self, status: &str, error: Option<&ApiError>) -> Value {
        let mut v = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model_name, "output": self.turn.items, "error": Value::Null,
            "incomplete_details": Value::Null, "usage": Value::Null,
        });
        for (k, x) in &self.ask.echo {
            v[k] = x.clone();
        }
        if status == "incomplete" {
            v["incomplete_details"] = json!({ "reason": "max_output_tokens" });
        }
        if let Some(e) = error {
            v["error"] = json!({ "code": "server_error", "message": e.message });
        }
        if let Some(u) = &self.turn.usage {
            v["usage"] = json!({
                "input_tokens": u.prompt, "input_tokens_details": { "cached_tokens": u.cached },
                "output_tokens": u.completion, "output_tokens_details": { "reasoning_tokens": 0 },
                "total_tokens": u.prompt + u.completion,
            });
        }
        v
    }

    /// The status the answer ended with.
    fn status(&self) -> &'static str {
        if self.turn.finish == Finish::Length {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// The record kept for `GET` and for the next turn: the response and the conversation, its
    /// answer (text and calls) as the assistant's turn.
    fn record(&self) -> Value {
        let mut history = self.ask.history.clone();
        let mut text = String::new();
        let mut calls = Vec::new();
        for item in &self.turn.items {
            match item["type"].as_str() {
                Some("message") => {
                    text.push_str(item.pointer("/content/0/text").and_then(Value::as_str).unwrap_or_default())
                }
                Some("function_call") => calls.push(json!({ "id": item["call_id"], "type": "function",
                    "function": { "name": item["name"], "arguments": item["arguments"] } })),
                _ => {}
            }
        }
        let mut turn = json!({ "role": "assistant", "content": text });
        if !calls.is_empty() {
            turn["tool_calls"] = Value::Array(calls);
        }
        history.push(turn);
        json!({ "response": self.object(self.status(), None), "history": history })
    }
}

/// The answer as a response, whole or streamed; kept when it completes, unless `store: false`.
async fn respond(sh: Arc<Shared>, peer: Peer, mut answers: Answers, mut reply: Reply) -> Response {
    if !reply.ask.stream {
        let mut sink = Vec::new();
        while let Some(a) = answers.next().await {
            if let Answer::Failed(e) = a {
                return error(e);
            }
            reply.turn.on(a, reply.logprobs.as_deref(), &mut sink);
        }
        keep(&sh, &peer, &reply).await;
        return Json(reply.object(reply.status(), None)).into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut seq = 0u64;
        let mut send = |mut ev: Value| {
            ev["sequence_number"] = json!(seq);
            seq += 1;
            tx.send(ev.to_string()).is_ok()
        };
        let opening = [
            json!({ "type": "response.created", "response": reply.object("in_progress", None) }),
            json!({ "type": "response.in_progress", "response": reply.object("in_progress", None) }),
        ];
        for ev in opening {
            if !send(ev) {
                return;
            }
        }
        let mut events = Vec::new();
        while let Some(a) = answers.next().await {
            if let Answer::Failed(e) = &a {
                let e = e.clone();
                reply.turn.close(&mut events);
                events.push(json!({ "type": "response.failed", "response": reply.object("failed", Some(&e)) }));
                for ev in events.drain(..) {
                    send(ev);
                }
                return;
            }
            let done = matches!(a, Answer::Done(_));
            reply.turn.on(a, reply.logprobs.as_deref(), &mut events);
            if done {
                keep(&sh, &peer, &reply).await;
                let status = reply.status();
                let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                events.push(json!({ "type": kind, "response": reply.object(status, None) }));
            }
            for ev in events.drain(..) {
                if !send(ev) {
                    return; // the client went away: dropping the answer cancels the request
                }
            }
        }
    });
    let events = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), |s| {
        let kind = serde_json::from_str::<Value>(&s)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        Ok::<_, std::convert::Infallible>(SseEvent::default().event(kind).data(s))
    });
    Sse::new(events).into_response()
}

/// Keeps a completed response for its user, unless the request said `store: false`. A store
/// that cannot be written loses the record, not the answer.
async fn keep(sh: &Shared, peer: &Peer, reply: &Reply) {
    if !reply.ask.store {
        return;
    }
    if let Err(e) = sh.responses.put(peer.uid(), &reply.id, &reply.record()).await {
        eprintln!("inferd: keeping response {}: {e}", reply.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(v: Value, earlier: Vec<Value>) -> Result<Ask, ApiError> {
        Ask::of(v.as_object().unwrap(), earlier)
    }

    #[test]
    fn items_become_the_chat_request_and_the_stored_turns_come_first() {
        let earlier = vec![
            json!({ "role": "user", "content": "Weather in Paris?" }),
            json!({ "role": "assistant", "content": "", "tool_calls": [{ "id": "call_1", "type": "function",
                "function": { "name": "get_weather", "arguments": "{\"city\":\"Paris\"}" } }] }),
        ];
        let a = ask(
            json!({
                "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "store": false,
                "input": [
                    { "type": "function_call_output", "call_id": "call_1", "output": "18C" },
                    { "role": "developer", "content": [{ "type": "input_text", "text": "Use Celsius." }] },
                    { "type": "reasoning", "id": "rs_1", "summary": [] },
                    { "type": "message", "role": "user", "content": "And Rome?" },
                    { "type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}" },
                ],
                "tools": [{ "type": "function", "name": "get_weather", "parameters": { "type": "object" } }],
                "tool_choice": { "type": "function", "name": "get_weather" },
                "text": { "format": { "type": "json_schema", "name": "w", "schema": { "type": "object" }, "strict": true } },
                "truncation": "disabled", "user": "x",
            }),
            earlier,
        )
        .unwrap();
        let msgs = a.openai["messages"].as_array().unwrap();
        assert_eq!(msgs[0], json!({ "role": "system", "content": "Be brief." }));
        assert_eq!(
            msgs[3],
            json!({ "role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C" })
        );
        assert_eq!(msgs[4], json!({ "role": "system", "content": "Use Celsius." }));
        assert_eq!(msgs[5], json!({ "role": "user", "content": "And Rome?" }));
        assert_eq!(msgs[6]["tool_calls"][0]["id"], "call_2");
        assert_eq!(a.history.len(), msgs.len() - 1, "instructions are not kept for the next turn");
        assert_eq!(a.openai["max_tokens"], 50);
        assert_eq!(a.openai["tool_choice"]["function"]["name"], "get_weather");
        assert_eq!(a.openai["tools"][0]["function"]["name"], "get_weather");
        assert_eq!(a.openai["response_format"]["json_schema"]["name"], "w");
        assert!(!a.store && !a.stream);
        assert_eq!(a.echo["tool_choice"]["name"], "get_weather");
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let refused = |v: Value| ask(v, Vec::new()).unwrap_err().message;
        assert!(refused(json!({ "input": "x", "background": true })).contains("background is not supported"));
        assert!(refused(json!({ "input": "x", "tools": [{ "type": "web_search" }] })).contains("web_search tools"));
        assert!(refused(
            json!({ "input": [{ "role": "user", "content": [{ "type": "input_file", "file_id": "f" }] }] })
        )
        .contains("input_file is not supported"));
        assert!(refused(
            json!({ "input": [{ "role": "user", "content": [{ "type": "input_image", "file_id": "f" }] }] })
        )
        .contains("file_id is not supported"));
        // An image becomes a chat content part, text and images in their order.
        let a = ask(
            json!({ "input": [{ "role": "user", "content": [
                { "type": "input_text", "text": "Look: " },
                { "type": "input_image", "image_url": "data:image/png;base64,AA==" },
                { "type": "input_text", "text": "What is it?" },
            ] }] }),
            Vec::new(),
        )
        .unwrap();
        assert_eq!(
            a.openai["messages"][0]["content"],
            json!([
                { "type": "text", "text": "Look: " },
                { "type": "image_url", "image_url": { "url": "data:image/png;base64,AA==" } },
                { "type": "text", "text": "What is it?" },
            ])
        );
        assert!(refused(json!({ "input": [{ "type": "item_reference", "id": "x" }] })).contains("item_reference items"));
        assert!(refused(json!({ "input": 3 })).contains("input must be"));
    }
}
