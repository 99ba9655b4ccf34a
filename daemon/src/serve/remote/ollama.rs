//! Ollama's routes for a remote model: `/api/chat`, `/api/generate` and `/api/embed` become
//! OpenAI requests to the upstream, whose answer comes back in Ollama's shapes (NDJSON lines
//! while streaming, one object otherwise), and the model is listed by `/api/tags` and described
//! by `/api/show` with Ollama's `remote_model` and `remote_host`.
//!
//! The translation: messages keep their roles; an assistant's `tool_calls` get ids and their
//! arguments as JSON text, and a `tool` message answers the earliest unanswered call of its
//! `tool_name`; `images` become image parts (data URLs); `tools` pass as they are (the shapes
//! agree); `format` becomes `response_format` and `options` OpenAI's sampling fields, as for a
//! local model (the same checks and refusals). `/api/generate` is a chat of `system` and
//! `prompt`, or with `raw` a completion of `prompt`. `context` (token ids) cannot cross to an
//! upstream with its own tokenizer, so it is refused; `keep_alive` is the upstream's business
//! and ignored. The upstream always streams, so the durations Ollama reports are measured here:
//! the prompt's until the first piece, the answer's after it.

use super::{object, Opened, Remote};
use crate::serve::answer::Answers;
use crate::serve::api::ApiError;
use crate::serve::conn::Peer;
use crate::serve::ollama::{error, options, rfc3339};
use crate::serve::Shared;
use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// Which Ollama route a request came to.
#[derive(Clone, Copy, PartialEq)]
pub enum Route {
    Chat,
    Generate,
    Embed,
}

/// A request for a remote model goes to its upstream: `Err` with the answer; `Ok` with the
/// body to serve here (a local model's, or the fallback's while the upstream is down).
pub async fn serve(sh: &Arc<Shared>, route: Route, body: Bytes, peer: &Peer) -> Result<Bytes, Response> {
    let Some(r) = sh.remote_for(&body) else { return Ok(body) };
    let t0 = Instant::now();
    let ask = object(&body).and_then(|m| {
        let original = r.keep_for_fallback(&m);
        let (path, req) = match route {
            Route::Chat => ("/chat/completions", chat_body(&m)?),
            Route::Generate => generate_body(&m)?,
            Route::Embed => ("/embeddings", embed_body(&m)?),
        };
        Ok((m, original, path, req))
    });
    let (m, original, path, req) = match ask {
        Ok(a) => a,
        Err(e) => {
            r.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(error(r.failed(e)));
        }
    };
    let tagged = format!("{}:latest", r.name);
    if route != Route::Embed && req.get("messages").or_else(|| req.get("prompt")).is_none() {
        // Nothing to answer: Ollama's way to load a model, and a remote one is always ready.
        let mut v =
            json!({ "model": tagged, "created_at": rfc3339(SystemTime::now()), "done": true, "done_reason": "load" });
        let (k, empty) = if route == Route::Chat {
            ("message", json!({ "role": "assistant", "content": "" }))
        } else {
            ("response", json!(""))
        };
        v[k] = empty;
        return Err(Json(v).into_response());
    }
    let opened = match r.open(sh, path, req, peer).await {
        Ok(o) => o,
        Err(f) => return r.fall_back(f, original).map_err(error),
    };
    if opened.resp.status().is_client_error() {
        return Err(error(r.refusal(opened.resp).await));
    }
    if route == Route::Embed {
        return Err(embedded(&r, opened, peer, &tagged, t0).await);
    }
    let stream = m.get("stream").and_then(Value::as_bool) != Some(false);
    let answers = Answers::remote(r, opened, Arc::clone(&peer.hangup));
    let shape = crate::serve::ollama::Shape { chat: route == Route::Chat, stream, tagged, t0, context: None };
    Err(crate::serve::ollama::respond(answers, shape).await)
}

/// Keys each route reads; other keys (and these at odd values) are refused as for a local model.
fn check_keys(m: &Map<String, Value>, own: &[&str]) -> Result<(), ApiError> {
    for (k, v) in m {
        let k = k.as_str();
        let common = ["model", "stream", "options", "keep_alive", "format", "think"];
        let neutral = match k {
            "context" | "images" | "tools" => v.as_array().is_some_and(Vec::is_empty),
            "suffix" | "template" => v.as_str() == Some(""),
            "raw" | "logprobs" => v == &Value::Bool(false),
            _ => false,
        };
        if v.is_null() || common.contains(&k) || own.contains(&k) || neutral {
            continue;
        }
        let why = match k {
            "context" => " for a remote model (its token ids belong to another tokenizer)",
            _ => " for a remote model",
        };
        return Err(ApiError::bad(format!("{k} is not supported{why}"), "body"));
    }
    Ok(())
}

/// `options` and `format` as OpenAI fields, and a stream that reports its usage.
fn sampling(m: &Map<String, Value>, out: &mut Map<String, Value>) -> Result<(), ApiError> {
    for (k, f) in options(m)? {
        out.insert(k, f.to_json());
    }
    out.insert("stream".into(), true.into());
    out.insert("stream_options".into(), json!({ "include_usage": true }));
    Ok(())
}

/// A base64 image as a data URL, its type read from its first bytes.
fn image_part(b64: &str) -> Value {
    let kind = match b64.get(..6).unwrap_or("") {
        s if s.starts_with("iVBOR") => "image/png",
        s if s.starts_with("/9j/") => "image/jpeg",
        s if s.starts_with("R0lGOD") => "image/gif",
        s if s.starts_with("UklGR") => "image/webp",
        _ => "application/octet-stream",
    };
    json!({ "type": "image_url", "image_url": { "url": format!("data:{kind};base64,{b64}") } })
}

/// A message's text with its images, as OpenAI's content.
fn content(text: &str, images: Option<&Value>) -> Result<Value, ApiError> {
    let Some(list) = images.and_then(Value::as_array).filter(|l| !l.is_empty()) else { return Ok(text.into()) };
    let mut parts = vec![json!({ "type": "text", "text": text })];
    for i in list {
        let b64 = i.as_str().ok_or_else(|| ApiError::bad("images must be base64 strings", "images"))?;
        parts.push(image_part(b64));
    }
    Ok(Value::Array(parts))
}

/// Ollama's messages as OpenAI's.
fn messages(list: &Value) -> Result<Vec<Value>, ApiError> {
    let list = list.as_array().ok_or_else(|| ApiError::bad("messages must be an array", "messages"))?;
    let mut out = Vec::with_capacity(list.len());
    // Calls not yet answered by a tool message: their ids and names.
    let mut open: Vec<(String, String)> = Vec::new();
    let mut n = 0;
    for (i, msg) in list.iter().enumerate() {
        let bad = |what: &str| ApiError::bad(format!("messages[{i}]: {what}"), "messages");
        let role = msg["role"].as_str().ok_or_else(|| bad("role must be a string"))?;
        let text = match &msg["content"] {
            Value::String(s) => s.as_str(),
            Value::Null => "",
            _ => return Err(bad("content must be a string")),
        };
        let mut o = json!({ "role": role, "content": content(text, msg.get("images"))? });
        let calls = msg["tool_calls"].as_array().filter(|c| !c.is_empty());
        if let Some(calls) = calls.filter(|_| role == "assistant") {
            let mut list = Vec::with_capacity(calls.len());
            for c in calls {
                let name = c["function"]["name"].as_str().ok_or_else(|| bad("a tool call needs function.name"))?;
                let args = match &c["function"]["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => "{}".into(),
                    v => v.to_string(),
                };
                let id = c["id"].as_str().map_or_else(|| format!("call_{n}"), str::to_owned);
                n += 1;
                open.push((id.clone(), name.to_owned()));
                list.push(json!({ "id": id, "type": "function", "function": { "name": name, "arguments": args } }));
            }
            o["tool_calls"] = Value::Array(list);
        }
        if role == "tool" {
            let name = msg["tool_name"].as_str().or_else(|| msg["name"].as_str());
            let id = match msg["tool_call_id"].as_str() {
                Some(id) => {
                    open.retain(|(x, _)| x != id);
                    id.to_owned()
                }
                None => {
                    let at = open.iter().position(|(_, n)| name.is_none_or(|name| n == name));
                    at.map(|at| open.remove(at).0).unwrap_or_else(|| format!("call_{i}"))
                }
            };
            o["tool_call_id"] = id.into();
            if let Some(name) = name {
                o["name"] = name.into();
            }
        }
        out.push(o);
    }
    Ok(out)
}

/// `/api/chat` as OpenAI's chat request (no `messages` when there are none: a load request).
fn chat_body(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    check_keys(m, &["messages", "tools"])?;
    let mut out = Map::new();
    let msgs = match m.get("messages") {
        None | Some(Value::Null) => Vec::new(),
        Some(l) => messages(l)?,
    };
    if !msgs.is_empty() {
        out.insert("messages".into(), Value::Array(msgs));
    }
    if let Some(t) = m.get("tools").filter(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
        out.insert("tools".into(), t.clone());
    }
    sampling(m, &mut out)?;
    Ok(out)
}

/// `/api/generate` as OpenAI's chat request (`system` and `prompt`), or with `raw` its
/// completion request; no prompt is a load request.
fn generate_body(m: &Map<String, Value>) -> Result<(&'static str, Map<String, Value>), ApiError> {
    check_keys(m, &["prompt", "system", "raw", "images"])?;
    let text = |k: &str| match m.get(k) {
        None | Some(Value::Null) => Ok(""),
        Some(Value::String(s)) => Ok(s.as_str()),
        Some(_) => Err(ApiError::bad(format!("{k} must be a string"), "body")),
    };
    let (prompt, system) = (text("prompt")?, text("system")?);
    let raw = m.get("raw").and_then(Value::as_bool).unwrap_or(false);
    let mut out = Map::new();
    let path = if raw {
        if !prompt.is_empty() {
            out.insert("prompt".into(), prompt.into());
        }
        "/completions"
    } else {
        if !prompt.is_empty() {
            let mut msgs = Vec::new();
            if !system.is_empty() {
                msgs.push(json!({ "role": "system", "content": system }));
            }
            msgs.push(json!({ "role": "user", "content": content(prompt, m.get("images"))? }));
            out.insert("messages".into(), Value::Array(msgs));
        }
        "/chat/completions"
    };
    sampling(m, &mut out)?;
    Ok((path, out))
}

/// `/api/embed` as OpenAI's embeddings request.
fn embed_body(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut out = Map::new();
    for (k, v) in m {
        match k.as_str() {
            "input" | "dimensions" => {
                out.insert(k.clone(), v.clone());
            }
            // Truncation and loading are the upstream's.
            "model" | "truncate" | "keep_alive" | "options" => {}
            _ if v.is_null() => {}
            _ => return Err(ApiError::bad(format!("{k} is not supported for a remote model"), "body")),
        }
    }
    if !out.contains_key("input") {
        return Err(ApiError::bad("input is required", "input"));
    }
    Ok(out)
}

/// The upstream's embeddings in Ollama's answer.
async fn embedded(r: &Remote, opened: Opened, peer: &Peer, tagged: &str, t0: Instant) -> Response {
    let Opened { resp, place } = opened;
    let body = tokio::select! {
        b = resp.bytes() => b,
        () = peer.hangup.wait() => return error(r.failed(ApiError::new(499, "the client left", None))),
    };
    drop(place);
    let read = |b: &[u8]| -> Option<(Vec<Value>, u64)> {
        let v: Value = serde_json::from_slice(b).ok()?;
        let mut data = v["data"].as_array()?.clone();
        data.sort_by_key(|d| d["index"].as_u64().unwrap_or(0));
        let vectors = data.into_iter().map(|mut d| d["embedding"].take()).collect::<Vec<_>>();
        vectors.iter().all(Value::is_array).then_some((vectors, v["usage"]["prompt_tokens"].as_u64().unwrap_or(0)))
    };
    match body.ok().as_deref().and_then(read) {
        Some((vectors, tokens)) => Json(json!({
            "model": tagged,
            "embeddings": vectors,
            "total_duration": t0.elapsed().as_nanos() as u64,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }))
        .into_response(),
        None => error(r.failed(ApiError::new(
            502,
            format!("upstream {} for {}: not an embeddings answer", r.upstream, r.name),
            None,
        ))),
    }
}

/// The remote models as `/api/tags` lists them; `local`: the client is on the Unix socket
/// (loopback TCP does not learn upstream addresses).
pub fn tags(sh: &Shared, local: bool) -> Vec<Value> {
    sh.remote_models().iter().map(|r| described(r, local)).collect()
}

/// A remote model as Ollama describes one.
pub fn described(r: &Remote, local: bool) -> Value {
    let name = format!("{}:latest", r.name);
    let mut v = json!({
        "name": name, "model": name, "modified_at": rfc3339(SystemTime::UNIX_EPOCH), "size": 0, "digest": "",
        "remote_model": r.upstream_model,
        "details": { "parent_model": "", "format": "remote", "family": "", "families": [], "parameter_size": "", "quantization_level": "" },
    });
    if local {
        v["remote_host"] = r.upstream.clone().into();
    }
    v
}

/// `/api/show` of a remote model: what inferd knows of it (the rest is the upstream's).
pub fn show(r: &Remote, local: bool) -> Value {
    let mut v = described(r, local);
    if let Some(o) = v.as_object_mut() {
        o.remove("name");
        o.remove("model");
        o.remove("size");
        o.remove("digest");
    }
    v["modelfile"] = "".into();
    v["parameters"] = "".into();
    v["template"] = "".into();
    v["model_info"] = json!({});
    v["capabilities"] = json!(["completion", "tools"]);
    v
}
