//! llama-server's `POST /infill`, what editor plugins written for it send (llama.vscode,
//! llama.vim): `input_prefix`, `input_suffix`, `input_extra` (other files, `{filename, text}`)
//! and `prompt` (text already typed at the cursor) become a fill-in-the-middle prompt
//! ([`fim::infill`]); the answer is llama-server's own completion shape, whole or streamed as
//! Server-Sent Events of `{content, stop}` objects ending with the one whose `stop` is true.

use super::answer::{Answer, Answers, Finish};
use super::api::object;
use super::api::ApiError;
use super::conn::Peer;
use super::fields::Field;
use super::fim;
use super::openai::error;
use super::request;
use super::Shared;
use axum::extract::{ConnectInfo, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use inferd_engine::request::Request;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Instant;

/// Keys llama-server's clients send that steer its own machinery (prompt caching, slots,
/// its sampler chain's order, time limits, which fields to return): accepted, without effect.
const IGNORED: [&str; 9] = [
    "cache_prompt",
    "samplers",
    "t_max_prompt_ms",
    "t_max_predict_ms",
    "response_fields",
    "n_indent",
    "id_slot",
    "return_tokens",
    "n_keep",
];

/// The body's sampling fields, in the names of [`fields`](super::fields).
fn fields(m: &Map<String, Value>) -> Result<Vec<(String, Field)>, ApiError> {
    let mut out = Vec::new();
    for (k, v) in m {
        if v.is_null() || IGNORED.contains(&k.as_str()) {
            continue;
        }
        let num =
            || v.as_f64().map(Field::Number).ok_or_else(|| ApiError::bad(format!("{k} must be a number"), "body"));
        let int = || {
            v.as_i64()
                .map(|x| Field::Int(x.into()))
                .ok_or_else(|| ApiError::bad(format!("{k} must be an integer"), "body"))
        };
        let f = match k.as_str() {
            "input_prefix" | "input_suffix" | "input_extra" | "prompt" | "model" | "stream" => continue,
            "temperature" | "top_p" | "min_p" | "presence_penalty" | "frequency_penalty" => (k.clone(), num()?),
            "top_k" | "seed" => (k.clone(), int()?),
            // -1: to the end of the context.
            "n_predict" | "max_tokens" if v.as_i64() == Some(-1) => continue,
            "n_predict" | "max_tokens" => ("max_tokens".to_owned(), int()?),
            "stop" => {
                match v.as_array().map(|a| a.iter().map(|s| s.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>())
                {
                    Some(Some(s)) => ("stop".to_owned(), Field::Strs(s)),
                    _ => return Err(ApiError::bad("stop must be an array of strings", "stop")),
                }
            }
            "n_probs" if v.as_u64() == Some(0) => continue,
            _ => return Err(ApiError::bad(format!("{k} is not supported by inferd's /infill"), "body")),
        };
        out.push(f);
    }
    Ok(out)
}

/// `input_extra`: `[{filename, text}]` (`filename` defaults to `tmp`, as llama-server's).
fn extra(m: &Map<String, Value>) -> Result<Vec<(String, String)>, ApiError> {
    let bad =
        || ApiError::bad("input_extra must be an array of {\"filename\": string, \"text\": string}", "input_extra");
    let Some(v) = m.get("input_extra").filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    v.as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|c| {
            let text = c.get("text").and_then(Value::as_str).ok_or_else(bad)?;
            let name = match c.get("filename") {
                None | Some(Value::Null) => "tmp",
                Some(Value::String(s)) => s,
                Some(_) => return Err(bad()),
            };
            Ok((name.to_owned(), text.to_owned()))
        })
        .collect()
}

pub async fn infill(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    if let Err(e) = sh.warm(&body, false, None).await {
        return error(e);
    }
    let start = |sh: &Arc<Shared>, body: &[u8]| -> Result<(request::Prepared, bool), ApiError> {
        let m = object(body)?;
        let model = sh.model(super::api::model_field(&m)?)?;
        let tok = &model.model.tokenizer;
        let toks = fim::tokens(tok, &model.name, "input_prefix")?;
        let part = |k: &'static str| match m.get(k) {
            Some(v) => fim::mixed(tok, v, k),
            None => Err(ApiError::bad(format!("{k} is required"), k)),
        };
        let prompt = match m.get("prompt") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => tok.encode_bare(s, true).map_err(|e| ApiError::bad(e.to_string(), "prompt"))?,
            Some(_) => return Err(ApiError::bad("prompt must be a string", "prompt")),
        };
        let gap =
            fim::Infill { prefix: part("input_prefix")?, suffix: part("input_suffix")?, extra: extra(&m)?, prompt };
        let req: Request = super::fields::build(fields(&m)?)?;
        let predict = req.max_tokens.map_or(0, |t| t as usize);
        let ids = fim::infill(tok, toks, &gap, sh.infill_layout(), model.context_len(), predict)?;
        let stream = m.get("stream").and_then(Value::as_bool).unwrap_or(false);
        Ok((request::prepare(sh, model, req, ids)?, stream))
    };
    let (p, stream) = match sh.cpu_with(&body, start).await {
        Ok(x) => x,
        Err(e) => return error(e),
    };
    let (n, stop) = (p.n, p.stop.clone());
    match request::submit(&sh, p, peer.uid(), Some(Arc::clone(&peer.hangup))) {
        Ok(sub) => respond(Answers::local(sub, n, stop, None), stream).await,
        Err(e) => error(e),
    }
}

/// llama-server's `stop_type`.
fn stop_type(f: &Finish) -> &'static str {
    match f {
        Finish::Length => "limit",
        Finish::StopSequence(_) => "word",
        _ => "eos",
    }
}

/// The last object: the whole content (empty when streamed), the counts and timings.
struct Last {
    model: String,
    prompt: usize,
    predicted: usize,
    t0: Instant,
    first: Option<Instant>,
    /// Prompt tokens the prefix cache held.
    cached: usize,
}

impl Last {
    fn json(&self, content: &str, finish: &Finish) -> Value {
        let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
        let now = Instant::now();
        let first = self.first.unwrap_or(now);
        let (prompt_ms, predicted_ms) = (ms(self.t0, first), ms(first, now));
        json!({
            "index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": true, "model": self.model,
            "tokens_predicted": self.predicted, "tokens_evaluated": self.prompt, "truncated": false,
            "has_new_line": content.contains('\n'), "stop_type": stop_type(finish),
            "stopping_word": if let Finish::StopSequence(w) = finish { w.as_str() } else { "" },
            "tokens_cached": self.cached,
            "timings": {
                "prompt_n": self.prompt, "prompt_ms": prompt_ms, "predicted_n": self.predicted, "predicted_ms": predicted_ms,
                "predicted_per_second": if predicted_ms > 0.0 { self.predicted as f64 * 1e3 / predicted_ms } else { 0.0 },
            },
        })
    }
}

async fn respond(mut answers: Answers, stream: bool) -> Response {
    let model = answers.model().map(|m| m.name.clone()).unwrap_or_default();
    let mut last = Last {
        model,
        prompt: answers.prompt_tokens().unwrap_or(0),
        predicted: 0,
        t0: Instant::now(),
        first: None,
        cached: 0,
    };
    if !stream {
        let mut content = String::new();
        let mut finish = Finish::Stop;
        while let Some(a) = answers.next().await {
            match a {
                Answer::Text { text, token, .. } => {
                    last.first.get_or_insert_with(Instant::now);
                    last.predicted += usize::from(token.is_some());
                    content.push_str(&text);
                }
                Answer::Finish { reason, .. } => finish = reason,
                Answer::Done(u) => {
                    last.predicted = u.completion;
                    last.cached = u.cached;
                    return Json(last.json(&content, &finish)).into_response();
                }
                Answer::Failed(e) => return error(e),
                Answer::Reasoning { .. } | Answer::Call { .. } => {}
            }
        }
        return error(ApiError::new(503, "the engine stopped", None));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut finish = Finish::Stop;
        while let Some(a) = answers.next().await {
            let line = match a {
                Answer::Text { text, .. } if text.is_empty() => continue,
                Answer::Text { text, token, .. } => {
                    last.first.get_or_insert_with(Instant::now);
                    last.predicted += usize::from(token.is_some()).max(1);
                    json!({ "index": 0, "content": text, "tokens": [], "stop": false, "id_slot": -1,
                            "tokens_predicted": last.predicted, "tokens_evaluated": last.prompt })
                }
                Answer::Finish { reason, .. } => {
                    finish = reason;
                    continue;
                }
                Answer::Done(u) => {
                    last.predicted = u.completion;
                    last.cached = u.cached;
                    let _ = tx.send(last.json("", &finish).to_string());
                    return;
                }
                Answer::Failed(e) => {
                    let _ = tx.send(
                        json!({ "error": { "code": e.status, "message": e.message, "type": e.kind() } }).to_string(),
                    );
                    return;
                }
                Answer::Reasoning { .. } | Answer::Call { .. } => continue,
            };
            if tx.send(line.to_string()).is_err() {
                return; // the client went away: dropping the answer cancels the request
            }
        }
    });
    let events = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), |s| {
        Ok::<_, std::convert::Infallible>(SseEvent::default().data(s))
    });
    Sse::new(events).into_response()
}
