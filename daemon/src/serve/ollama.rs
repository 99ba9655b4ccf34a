//! Ollama's native API on the same listeners as the OpenAI one, for the desktop apps that speak
//! it: `/api/generate` and `/api/chat` (NDJSON streaming, the default, or one object),
//! `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, `/api/embed` and `/api/embeddings`
//! (and `/api/pull`, [`pull`](super::pull); `/api/delete`, [`loading`](super::loading)). Requests go through the shared
//! request path ([`request`](super::request)) like every other edge; only the shapes are
//! Ollama's. `options` map onto inferd's sampling fields; hardware options (`num_ctx`,
//! `num_thread`, `num_gpu`, ...) are accepted and ignored, as is a sampling option at its
//! neutral value; `keep_alive` sets how long the model stays loaded once idle; anything else
//! inferd does not implement is a 400 naming it.
//! Model names may carry Ollama's `:latest` tag. A remote model's requests go to its upstream
//! ([`remote::ollama`]).

use super::answer::{Answer, Answers, Finish};
use super::api::ApiError;
use super::chat::Tools;
use super::conn::Peer;
use super::fields::{self, Field};
use super::models::Slot;
use super::remote::{self, ollama::Route};
use super::request;
use super::{ModelHandle, Shared};
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use inferd_engine::chat::ChatMessage;
use serde_json::{json, Map, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The version of Ollama's API these routes follow (what `/api/version` answers: clients check
/// it before they use newer fields).
pub const OLLAMA_API_VERSION: &str = "0.12.0";

/// The routes, for the HTTP edge's router.
pub fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/api/version", get(version))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route("/api/show", post(show))
        .route("/api/generate", post(generate))
        .route("/api/chat", post(chat))
        .route("/api/embed", post(embed))
        .route("/api/embeddings", post(embeddings))
        .route("/api/pull", post(super::pull::pull))
}

/// Ollama's error shape: `{"error": message}` with the status.
pub fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(json!({ "error": e.message }))).into_response()
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad(message, "options")
}

/// `time` as RFC 3339 in UTC with nanoseconds, as Ollama writes `created_at`.
pub fn rfc3339(time: SystemTime) -> String {
    let d = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (secs, nanos) = (d.as_secs() as i64, d.subsec_nanos());
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = inferd_engine::time::civil(days);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{nanos:09}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The loaded model an Ollama client names (`name:latest` is `name`).
fn model(sh: &Shared, m: &Map<String, Value>) -> Result<Arc<ModelHandle>, ApiError> {
    let name = match m.get("model").or_else(|| m.get("name")) {
        Some(Value::String(s)) => s.as_str(),
        None | Some(Value::Null) => "",
        Some(_) => return Err(ApiError::bad("model must be a string", "model")),
    };
    sh.model(Some(name.strip_suffix(":latest").unwrap_or(name)).filter(|n| !n.is_empty()))
}

fn tagged(m: &ModelHandle) -> String {
    format!("{}:latest", m.name)
}

/// `134.52M`, `1.24B`: the size Ollama lists, from the file's parameter count.
fn parameter_size(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2}B", n as f64 / 1e9)
    } else {
        format!("{:.2}M", n as f64 / 1e6)
    }
}

/// A model's details as its file gives them, loaded or not.
fn details(slot: &Slot) -> Value {
    match &slot.facts {
        Some(f) => json!({
            "parent_model": "", "format": f.format, "family": f.architecture, "families": [f.architecture],
            "parameter_size": parameter_size(f.parameters), "quantization_level": f.file_type,
        }),
        None => json!({ "parent_model": "", "format": "unknown" }),
    }
}

/// The model file's size and modification time.
fn file_facts(path: &Path) -> (u64, SystemTime) {
    let meta = std::fs::metadata(path).ok();
    (meta.as_ref().map_or(0, |x| x.len()), meta.and_then(|x| x.modified().ok()).unwrap_or(UNIX_EPOCH))
}

/// A stable identifier of the file (path, size, modification time); not a content hash.
fn digest(path: &Path) -> String {
    let (size, modified) = file_facts(path);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let key = format!("{}\0{size}\0{:?}", path.display(), modified);
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

async fn version() -> Json<Value> {
    Json(json!({ "version": OLLAMA_API_VERSION }))
}

async fn tags(State(sh): State<Arc<Shared>>, ConnectInfo(peer): ConnectInfo<Peer>) -> Json<Value> {
    sh.rescan_store().await;
    let mut models: Vec<Value> = sh
        .models
        .slots()
        .iter()
        .map(|slot| {
            let path = &slot.config.path;
            let (_, modified) = file_facts(path);
            let size = slot.facts.as_ref().map_or(0, |f| f.size);
            let name = format!("{}:latest", slot.name);
            json!({ "name": name, "model": name, "modified_at": rfc3339(modified), "size": size, "digest": digest(path), "details": details(slot) })
        })
        .collect();
    models.extend(remote::ollama::tags(&sh, peer.local()));
    Json(json!({ "models": models }))
}

async fn ps(State(sh): State<Arc<Shared>>) -> Json<Value> {
    let models: Vec<Value> = sh
        .models
        .slots()
        .iter()
        .filter_map(|slot| {
            let m = slot.loaded()?;
            let path = &slot.config.path;
            let size = slot.footprint();
            let vram = m.engine.device_memory().map_or(0, |d| d.weights_bytes + d.kv_bytes);
            // When it unloads: its idle expiry, or its keep_alive from now while in use.
            let expires = match (slot.expires(), slot.keep_alive()) {
                (_, None) => "9999-12-31T23:59:59Z".to_string(),
                (Some(t), _) => rfc3339(SystemTime::now() + t.saturating_duration_since(Instant::now())),
                (None, Some(k)) => rfc3339(SystemTime::now() + k),
            };
            Some(json!({ "name": tagged(&m), "model": tagged(&m), "size": size, "digest": digest(path), "details": details(slot), "expires_at": expires, "size_vram": vram }))
        })
        .collect();
    Json(json!({ "models": models }))
}

async fn show(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    if let Some(r) = sh.remote_for(&body) {
        return Json(remote::ollama::show(&r, peer.local())).into_response();
    }
    if let Err(e) = sh.warm(&body, true, peer.uid).await {
        return error(e);
    }
    let run = || -> Result<Value, ApiError> {
        let m = super::api::object(&body)?;
        let h = model(&sh, &m)?;
        let slot = sh.models.slot(Some(&h.name))?;
        let (_, modified) = file_facts(&slot.config.path);
        let (cfg, arch) = (&h.model.config, h.model.arch.name);
        let mut info = json!({
            "general.architecture": arch,
            format!("{arch}.context_length"): h.context_len(),
            format!("{arch}.embedding_length"): cfg.hidden,
            format!("{arch}.block_count"): cfg.n_layers,
            format!("{arch}.attention.head_count"): cfg.n_heads,
            format!("{arch}.attention.head_count_kv"): cfg.n_kv_heads,
            "tokenizer.ggml.vocab_size": cfg.vocab,
        });
        if let Some(moe) = &h.model.arch.moe {
            // A mixture of experts, as Ollama reports one (its GGUF keys).
            info[format!("{arch}.expert_count")] = json!(moe.experts);
            info[format!("{arch}.expert_used_count")] = json!(moe.used);
            info[format!("{arch}.expert_feed_forward_length")] = json!(moe.expert_ffn);
        }
        Ok(json!({
            "modelfile": "", "parameters": "", "license": "",
            "template": h.model.chat_template.clone().unwrap_or_default(),
            "details": details(&slot),
            "model_info": info,
            "capabilities": capabilities(&h),
            "modified_at": rfc3339(modified),
        }))
    };
    run().map_or_else(error, |v| Json(v).into_response())
}

/// What a model can do, as Ollama lists it (apps show or hide features by it): `tools` when
/// its chat template renders tools itself (any model gets them described otherwise, but Ollama
/// reports the template's support), `insert` when the vocabulary has fill-in-the-middle tokens
/// (`suffix` works), `thinking` when the template has a reasoning switch or block, `vision`
/// when a projector is paired with it (images work).
fn capabilities(h: &ModelHandle) -> Vec<&'static str> {
    let template = h.model.chat_template.as_deref();
    let mut caps = vec!["completion"];
    if inferd_engine::tools::ToolFormat::detect(template).native {
        caps.push("tools");
    }
    if h.model.tokenizer.fim().fim().is_ok() {
        caps.push("insert");
    }
    let t = template.unwrap_or_default();
    if super::reasoning::capable(Some(t)) {
        caps.push("thinking");
    }
    if h.model.vision.is_some() {
        caps.push("vision");
    }
    caps
}

/// The body a route answers here, its model loaded: `Err` with the answer when the body names
/// a remote model (which its upstream gave, unless it is down and a fallback answers here) or
/// the model cannot load.
async fn local(
    sh: &Arc<Shared>,
    route: Route,
    body: axum::body::Bytes,
    peer: &Peer,
) -> Result<axum::body::Bytes, Response> {
    let body = remote::ollama::serve(sh, route, body, peer).await?;
    sh.warm(&body, true, peer.uid).await.map_err(error)?;
    Ok(body)
}

/// Ollama's legacy `/api/embeddings`: one `prompt`, answered as `{"embedding": [...]}` (what
/// older clients and LangChain's Ollama embeddings send): `/api/embed` of that one text, the
/// same vector (normalized; an empty prompt has no vector, as in Ollama).
async fn embeddings(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let m = match super::api::object(&body) {
        Ok(m) => m,
        Err(e) => return error(e),
    };
    let mut ask = Map::new();
    for (k, v) in &m {
        match k.as_str() {
            "model" | "options" | "keep_alive" => {
                ask.insert(k.clone(), v.clone());
            }
            "prompt" => match v {
                Value::String(p) if p.is_empty() => return Json(json!({ "embedding": [] })).into_response(),
                Value::String(_) => {
                    ask.insert("input".into(), v.clone());
                }
                _ => return error(ApiError::bad("prompt must be a string", "prompt")),
            },
            _ if v.is_null() => {}
            _ => return error(ApiError::bad(format!("{k} is not supported by inferd"), "body")),
        }
    }
    if !ask.contains_key("input") {
        return error(ApiError::bad("prompt is required", "prompt"));
    }
    let body = axum::body::Bytes::from(Value::Object(ask).to_string());
    let answer = embed(State(sh), ConnectInfo(peer), body).await;
    if !answer.status().is_success() {
        return answer;
    }
    // The one vector of /api/embed's list.
    match axum::body::to_bytes(answer.into_body(), 64 << 20)
        .await
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    {
        Some(v) => Json(json!({ "embedding": v["embeddings"][0] })).into_response(),
        None => error(ApiError::new(500, "internal error: the embedding's answer did not parse", None)),
    }
}

/// Ollama's `/api/embed`: `input` (a string or strings), `truncate` (default true: a text
/// longer than the context keeps its start), `dimensions` (the model's own only).
async fn embed(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match local(&sh, Route::Embed, body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    let t0 = Instant::now();
    let run = async {
        let m = super::api::object(&body)?;
        let h = super::embed::model_of(&sh, &m)?;
        let known = ["model", "input", "truncate", "options", "keep_alive", "dimensions"];
        super::embed::check_body(&m, &known, h.model.config.hidden)?;
        let truncate = m.get("truncate").and_then(Value::as_bool) != Some(false);
        let inputs = super::embed::inputs(m.get("input"))?;
        let (vectors, tokens) =
            super::embed::embed(&sh, &h, inputs, truncate, peer.uid(), Some(Arc::clone(&peer.hangup))).await?;
        Ok(json!({
            "model": tagged(&h),
            "embeddings": vectors,
            "total_duration": t0.elapsed().as_nanos() as u64,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }))
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(e),
    }
}

/// Ollama's `format`: `"json"` (any JSON object) or a JSON schema, as the request's
/// `response_format` field; `""` is free text.
fn format_field(m: &Map<String, Value>) -> Result<Option<(String, Field)>, ApiError> {
    let rf = match m.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s.is_empty() => return Ok(None),
        Some(Value::String(s)) if s == "json" => json!({ "type": "json_object" }),
        Some(s @ Value::Object(_)) => json!({ "type": "json_schema", "json_schema": { "schema": s } }),
        Some(_) => return Err(bad("format must be \"json\" or a JSON schema object")),
    };
    Ok(Some(("response_format".into(), Field::Object(rf.to_string()))))
}

/// Ollama's `options` (and the top-level fields that set the same things) as request fields.
pub fn options(m: &Map<String, Value>) -> Result<Vec<(String, Field)>, ApiError> {
    let mut out: Vec<(String, Field)> = format_field(m)?.into_iter().collect();
    let Some(o) = m.get("options").filter(|v| !v.is_null()) else { return Ok(out) };
    let o = o.as_object().ok_or_else(|| bad("options must be an object"))?;
    for (k, v) in o {
        if v.is_null() {
            continue;
        }
        let num = || v.as_f64().ok_or_else(|| bad(format!("options.{k} must be a number")));
        let field = match k.as_str() {
            "temperature" | "top_p" | "min_p" | "presence_penalty" | "frequency_penalty" => {
                Some((k.clone(), Field::Number(num()?)))
            }
            "top_k" | "seed" => match v.as_i64() {
                Some(x) => Some((k.clone(), Field::Int(x.into()))),
                None => return Err(bad(format!("options.{k} must be an integer"))),
            },
            // -1: no limit, -2: fill the context; either way to the end of the turn or context.
            "num_predict" => match v.as_i64() {
                Some(-1 | -2) => None,
                Some(x) => Some(("max_tokens".into(), Field::Int(x.into()))),
                None => return Err(bad("options.num_predict must be an integer")),
            },
            "stop" => match v {
                Value::String(s) => Some(("stop".into(), Field::Str(s.clone()))),
                Value::Array(a) => Some((
                    "stop".into(),
                    Field::Strs(
                        a.iter()
                            .map(|x| x.as_str().map(str::to_owned))
                            .collect::<Option<_>>()
                            .ok_or_else(|| bad("options.stop must be strings"))?,
                    ),
                )),
                _ => return Err(bad("options.stop must be a string or an array of strings")),
            },
            // inferd's own, as on its OpenAI routes: the decoding strategy and its parameters.
            "decoder" => match v {
                Value::String(s) => Some((k.clone(), Field::Str(s.clone()))),
                _ => return Err(bad("options.decoder must be a string: a decoding strategy's name")),
            },
            "decoder_params" => match v {
                Value::Object(_) => Some((k.clone(), Field::Object(v.to_string()))),
                _ => return Err(bad("options.decoder_params must be an object")),
            },
            // How and where to run: inferd's configuration decides.
            "num_ctx" | "num_batch" | "num_gpu" | "main_gpu" | "low_vram" | "num_thread" | "numa" | "use_mmap"
            | "use_mlock" | "vocab_only" | "f16_kv" | "logits_all" | "embedding_only" | "num_keep" => None,
            // llama.cpp's repetition penalty (Ollama sends 1.1 by default) and its window:
            // -1 is the whole context, 0 turns it off.
            "repeat_penalty" => Some((k.clone(), Field::Number(num()?))),
            "repeat_last_n" => match v.as_i64() {
                Some(-1) => Some((k.clone(), Field::Int(u32::MAX.into()))),
                Some(x) if x >= 0 => Some((k.clone(), Field::Int(x.into()))),
                _ => return Err(bad("options.repeat_last_n must be an integer of -1 or more")),
            },
            // Sampling inferd does not implement, accepted at its neutral value only.
            "typical_p" | "tfs_z" if v.as_f64() == Some(1.0) => None,
            "mirostat" if v.as_f64() == Some(0.0) => None,
            "mirostat" => {
                return Err(bad("options.mirostat is not supported by inferd (mirostat sampling is not built in)"))
            }
            // Settings of the samplers above, inert while those are off; Ollama itself no
            // longer reads penalize_newline.
            "mirostat_tau" | "mirostat_eta" | "penalize_newline" => None,
            _ => return Err(bad(format!("options.{k} is not supported by inferd"))),
        };
        out.extend(field);
    }
    Ok(out)
}

/// Top-level keys both routes accept beside their own, checked like the OpenAI edge's.
fn check_keys(m: &Map<String, Value>, own: &[&str]) -> Result<(), ApiError> {
    for (k, v) in m {
        let k = k.as_str();
        if v.is_null() || own.contains(&k) || ["model", "stream", "options", "keep_alive", "format"].contains(&k) {
            continue;
        }
        let neutral = match k {
            "raw" | "logprobs" => v == &Value::Bool(false),
            "images" | "tools" => v.as_array().is_some_and(Vec::is_empty),
            "suffix" | "template" => v.as_str() == Some(""),
            _ => false,
        };
        if neutral {
            continue;
        }
        let what = match k {
            "tools" => " here (tools go to /api/chat)",
            "images" => " (text models only)",
            _ => "",
        };
        return Err(ApiError::bad(format!("{k} is not supported by inferd{what}"), "body"));
    }
    Ok(())
}

/// What a route asks the model for, before the shared checks; an empty prompt only loads
/// the model (Ollama's way to preload one), answered at once with `done_reason: "load"`.
struct Ask {
    model: Arc<ModelHandle>,
    prompt: Vec<u32>,
    fields: Vec<(String, Field)>,
    stream: bool,
    /// A chat's tools, when the answer may call them.
    tools: Option<Tools>,
    /// The prompt went through the chat template: a thinking model's `<think>` block is
    /// `thinking` ([`super::reasoning::start`]).
    templated: bool,
    /// The prompt's images.
    images: Vec<inferd_engine::vision::media::PromptImage>,
}

impl Ask {
    /// The body's `options` and `stream` (Ollama streams unless told not to) with the prompt.
    fn new(model: Arc<ModelHandle>, prompt: Vec<u32>, m: &Map<String, Value>) -> Result<Ask, ApiError> {
        let stream = m.get("stream").and_then(Value::as_bool) != Some(false);
        Ok(Ask { model, prompt, fields: options(m)?, stream, tools: None, templated: false, images: Vec::new() })
    }
}

/// A body's `think` as the template's switch for model `h`.
fn think(m: &Map<String, Value>, h: &ModelHandle) -> Result<inferd_engine::chat::Extra, ApiError> {
    super::reasoning::ollama(m.get("think"), &h.name, h.model.chat_template.as_deref())
}

/// The answer to an empty prompt: the model is loaded, or (with `keep_alive: 0`, Ollama's way
/// to unload one) it unloads as soon as it is idle.
fn loaded(sh: &Shared, a: &Ask, chat: bool) -> Response {
    let unload =
        sh.models.slot(Some(&a.model.name)).ok().and_then(|s| s.keep_alive()) == Some(std::time::Duration::ZERO);
    let reason = if unload { "unload" } else { "load" };
    let mut v = json!({ "model": tagged(&a.model), "created_at": rfc3339(SystemTime::now()), "done": true, "done_reason": reason });
    if chat {
        v["message"] = json!({ "role": "assistant", "content": "" });
    } else {
        v["response"] = json!("");
    }
    Json(v).into_response()
}

fn string(m: &Map<String, Value>, k: &str) -> Result<Option<String>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad(format!("{k} must be a string"), "body")),
    }
}

async fn generate(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match local(&sh, Route::Generate, body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    let ask = |sh: &Arc<Shared>, body: &[u8]| -> Result<Ask, ApiError> {
        let m = super::api::object(body)?;
        check_keys(&m, &["prompt", "system", "context", "raw", "suffix", "think", "images"])?;
        let h = model(sh, &m)?;
        let prompt = string(&m, "prompt")?.unwrap_or_default();
        let suffix = string(&m, "suffix")?.unwrap_or_default();
        let raw = m.get("raw").and_then(Value::as_bool).unwrap_or(false);
        // As Ollama does: the prompt goes through the model's chat template (with `system`)
        // unless `raw`; `context` (what an earlier answer returned) comes first.
        let mut ids: Vec<u32> = match m.get("context") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => request::prompt_ids(&h.model, a, "context")?,
            Some(_) => return Err(ApiError::bad("context must be an array of token ids", "context")),
        };
        if !suffix.is_empty() {
            // Code around a gap, as Ollama's code-model templates write it (without `system`).
            let tok = &h.model.tokenizer;
            ids.extend(super::fim::gap(tok, super::fim::tokens(tok, &h.name, "suffix")?, &prompt, &suffix)?);
        } else if prompt.is_empty() && ids.is_empty() {
            // Nothing to generate from: a request to load the model.
        } else if raw {
            ids.extend(request::encode_prompt(&h.model, &prompt)?);
        } else {
            let mut msgs = Vec::new();
            if let Some(system) = string(&m, "system")? {
                msgs.push(ChatMessage::new("system", &system));
            }
            // The prompt as a user message with the body's images (before its text).
            let user = serde_json::json!({ "role": "user", "content": prompt, "images": m.get("images") });
            let mut one = Map::new();
            one.insert("messages".into(), Value::Array(vec![user]));
            msgs.extend(super::chat::messages(&one)?);
            let (more, mut images) = super::chat::encode_with_images(sh, &h.model, &msgs, None, &think(&m, &h)?)?;
            images.iter_mut().for_each(|i| i.at += ids.len());
            ids.extend(more);
            return Ok(Ask { templated: true, images, ..Ask::new(h, ids, &m)? });
        }
        if m.get("images").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
            return Err(ApiError::bad("images need the chat template (not raw, not a suffix)", "images"));
        }
        Ask::new(h, ids, &m)
    };
    let ask = sh.cpu_with(&body, ask).await;
    reply(sh, ask, peer, false).await
}

async fn chat(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match local(&sh, Route::Chat, body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    let ask = |sh: &Arc<Shared>, body: &[u8]| -> Result<Ask, ApiError> {
        let m = super::api::object(body)?;
        check_keys(&m, &["messages", "tools", "think"])?;
        let h = model(sh, &m)?;
        let msgs = super::chat::messages(&m)?;
        let tools = Tools::of(&m, &h.model)?;
        let extra = think(&m, &h)?;
        let (ids, images) = if msgs.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            super::chat::encode_with_images(sh, &h.model, &msgs, Some(&tools), &extra)?
        };
        Ok(Ask { tools: tools.active().then_some(tools), templated: true, images, ..Ask::new(h, ids, &m)? })
    };
    let ask = sh.cpu_with(&body, ask).await;
    reply(sh, ask, peer, true).await
}

/// A route's answer to what it was asked: the load answer for an empty prompt, the generation
/// otherwise, or the error.
async fn reply(sh: Arc<Shared>, ask: Result<Ask, ApiError>, peer: Peer, chat: bool) -> Response {
    match ask {
        Ok(a) if a.prompt.is_empty() => loaded(&sh, &a, chat),
        Ok(a) => answer(sh, a, peer, chat).await,
        Err(e) => error(e),
    }
}

/// Submits the request and answers as Ollama does ([`respond`]).
async fn answer(sh: Arc<Shared>, a: Ask, peer: Peer, chat: bool) -> Response {
    let t0 = Instant::now();
    let req = match fields::build(a.fields) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let prompt_ids = a.prompt.clone();
    let think = if a.templated { super::reasoning::start(&a.model.model, &prompt_ids) } else { None };
    let mut p = match request::prepare(&sh, a.model, req, a.prompt) {
        Ok(p) => p,
        Err(e) => return error(e),
    };
    p.images = a.images;
    let stop = p.stop.clone();
    let sub = match request::submit(&sh, p, peer.uid(), Some(Arc::clone(&peer.hangup))) {
        Ok(s) => s,
        Err(e) => return error(e),
    };
    let tagged = tagged(&sub.model);
    let answers = Answers::local(sub, 1, stop, a.tools.as_ref()).thinking(think);
    let shape = Shape { chat, stream: a.stream, tagged, t0, context: (!chat).then_some(prompt_ids) };
    respond(answers, shape).await
}

/// How an Ollama client asked to be answered.
pub struct Shape {
    pub chat: bool,
    pub stream: bool,
    /// The model's name as Ollama lists it.
    pub tagged: String,
    /// When the request arrived (the durations count from it).
    pub t0: Instant,
    /// `/api/generate`'s prompt tokens, which the answer's `context` extends.
    pub context: Option<Vec<u32>>,
}

/// An answer as Ollama gives it, local or from an upstream: NDJSON lines while streaming (text,
/// thinking and tool calls as they come), a last line with `done: true`, the done reason, the
/// counts and durations (nanoseconds; the prompt's until the first piece, the answer's after
/// it); or one object with it all.
pub async fn respond(mut answers: Answers, shape: Shape) -> Response {
    let Shape { chat, stream, tagged, t0, mut context } = shape;
    let piece = move |text: &str, thinking: &str| {
        let now = rfc3339(SystemTime::now());
        let mut v = if chat {
            json!({ "model": tagged, "created_at": now, "message": { "role": "assistant", "content": text }, "done": false })
        } else {
            json!({ "model": tagged, "created_at": now, "response": text, "done": false })
        };
        if !thinking.is_empty() {
            if chat {
                v["message"]["thinking"] = thinking.into();
            } else {
                v["thinking"] = thinking.into();
            }
        }
        v
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Value, ApiError>>();
    tokio::spawn(async move {
        let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::<Value>::new());
        let (mut first, mut reason, mut usage) = (None, Finish::Stop, None);
        while let Some(a) = answers.next().await {
            let line = match a {
                Answer::Text { text: t, logprobs, .. } => {
                    if let Some(c) = context.as_mut() {
                        c.extend(logprobs.iter().map(|s| s.token));
                    }
                    if t.is_empty() {
                        continue;
                    }
                    if !stream {
                        text.push_str(&t);
                        first.get_or_insert_with(Instant::now);
                        continue;
                    }
                    piece(&t, "")
                }
                Answer::Reasoning { text: t, .. } if stream => piece("", &t),
                Answer::Reasoning { text: t, .. } => {
                    thinking.push_str(&t);
                    first.get_or_insert_with(Instant::now);
                    continue;
                }
                Answer::Call { call, .. } => {
                    let call = super::chat::ollama_call(&call);
                    if !stream {
                        calls.push(call);
                        first.get_or_insert_with(Instant::now);
                        continue;
                    }
                    let mut v = piece("", "");
                    v["message"]["tool_calls"] = json!([call]);
                    v
                }
                Answer::Finish { reason: r, .. } => {
                    reason = r;
                    continue;
                }
                Answer::Done(u) => {
                    usage = Some(u);
                    break;
                }
                Answer::Failed(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            first.get_or_insert_with(Instant::now);
            if tx.send(Ok(line)).is_err() {
                return; // the client went away: dropping the answer cancels it
            }
        }
        let Some(usage) = usage else { return };
        let end = Instant::now();
        let first = first.unwrap_or(end);
        let whole = if calls.is_empty() { text.as_str() } else { text.trim() };
        let mut last = piece(if stream { "" } else { whole }, if stream { "" } else { &thinking });
        if !calls.is_empty() {
            last["message"]["tool_calls"] = json!(calls);
        }
        last["done"] = json!(true);
        last["done_reason"] = json!(reason.ollama());
        last["total_duration"] = json!((end - t0).as_nanos() as u64);
        last["load_duration"] = json!(0);
        last["prompt_eval_count"] = json!(usage.prompt);
        last["prompt_eval_duration"] = json!((first - t0).as_nanos() as u64);
        last["eval_count"] = json!(usage.completion);
        last["eval_duration"] = json!((end - first).as_nanos() as u64);
        if let Some(c) = context {
            last["context"] = json!(c);
        }
        let _ = tx.send(Ok(last));
    });
    lines(rx, stream).await
}

/// An answer's lines as the response: NDJSON while streaming (an error as an `error` line);
/// otherwise its one object, or its error with the error's status.
async fn lines(mut rx: tokio::sync::mpsc::UnboundedReceiver<Result<Value, ApiError>>, stream: bool) -> Response {
    if stream {
        let lines = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), |v| {
            let v = v.unwrap_or_else(|e| json!({ "error": e.message }));
            Ok::<_, std::convert::Infallible>(format!("{v}\n"))
        });
        return ([(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], axum::body::Body::from_stream(lines))
            .into_response();
    }
    match rx.recv().await {
        Some(Ok(v)) => Json(v).into_response(),
        Some(Err(e)) => error(e),
        None => error(ApiError::new(503, "the engine stopped", None)),
    }
}

#[cfg(test)]
mod tests {
    use super::rfc3339;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn created_at_is_rfc3339_in_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let t = UNIX_EPOCH + Duration::new(1_764_547_200 + 3_723, 5); // 2025-12-01 + 1:02:03
        assert_eq!(rfc3339(t), "2025-12-01T01:02:03.000000005Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000000000Z");
    }
}
