//! OpenAI's answer shapes over the [`answer`](super::answer) stream: a completion or chat
//! completion whole (one JSON object) or streamed (Server-Sent Events: a role chunk for chats,
//! one chunk per piece of text or tool call, a last chunk per choice with its finish reason,
//! the usage chunk of `stream_options.include_usage`, `[DONE]`), with `logprobs` in each
//! route's shape.

use super::answer::{Answer, Answers, Choice};
use super::api::ApiError;
use super::chat;
use super::request::Scored;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use inferd_engine::model::Model;
use serde_json::{json, Value};
use std::sync::Arc;

/// An OpenAI error object with its status.
pub fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(json!({ "error": { "message": e.message, "type": e.kind(), "param": e.param, "code": Value::Null } })),
    )
        .into_response()
}

/// How the client asked to be answered.
#[derive(Clone, Debug)]
pub struct Shape {
    /// A chat completion (else a text completion).
    pub chat: bool,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub usage_chunk: bool,
    /// The request asked for log-probabilities.
    pub logprobs: bool,
    /// The decoder's name, reported under `inferd`.
    pub decoder: String,
}

/// The answer in OpenAI's shape.
pub async fn respond(answers: Answers, shape: Shape) -> Response {
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let Some(model) = answers.model().cloned() else {
        return error(ApiError::new(500, "internal error: an upstream's answer is relayed as it comes", None));
    };
    let id = format!("{}-{}", if shape.chat { "chatcmpl" } else { "cmpl" }, answers.id().unwrap_or(0));
    let f = Format { id, created, model_name: model.name.clone(), model: Arc::clone(&model), shape };
    if f.shape.stream {
        f.stream(answers)
    } else {
        f.whole(answers).await
    }
}

struct Format {
    id: String,
    created: u64,
    model_name: String,
    model: Arc<super::ModelHandle>,
    shape: Shape,
}

impl Format {
    fn object(&self) -> &'static str {
        match (self.shape.chat, self.shape.stream) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// The log-probabilities of tokens `lps`, the first at text offset `offset` of its choice.
    fn logprobs(&self, lps: &[Scored], offset: usize) -> Value {
        if self.shape.logprobs {
            logprobs_json(&self.model.model, self.shape.chat, lps, offset)
        } else {
            Value::Null
        }
    }

    /// OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens the
    /// prefix cache held.
    fn usage(u: &super::answer::Usage) -> Value {
        json!({
            "prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
            "prompt_tokens_details": { "cached_tokens": u.cached },
        })
    }

    async fn whole(&self, answers: Answers) -> Response {
        let w = match answers.whole().await {
            Ok(w) => w,
            Err(e) => return error(e),
        };
        let choices: Vec<Value> = w.choices.iter().enumerate().map(|(i, c)| self.choice(i, c)).collect();
        Json(json!({
            "id": self.id, "object": self.object(), "created": self.created, "model": self.model_name,
            "choices": choices, "usage": Format::usage(&w.usage),
            "inferd": { "decoder": self.shape.decoder, "stats": w.usage.stats },
        }))
        .into_response()
    }

    fn choice(&self, i: usize, c: &Choice) -> Value {
        let lp = self.logprobs(&c.logprobs, 0);
        let reason = c.reason();
        if !self.shape.chat {
            return json!({ "index": i, "text": c.text, "logprobs": lp, "finish_reason": reason.openai() });
        }
        let mut message = json!({ "role": "assistant", "content": c.content() });
        if !c.calls.is_empty() {
            let calls: Vec<Value> = c.calls.iter().map(|call| chat::openai_call(call, None)).collect();
            message["tool_calls"] = json!(calls);
            if c.content().is_empty() {
                message["content"] = Value::Null;
            }
        }
        if !c.reasoning.is_empty() {
            message["reasoning_content"] = json!(c.reasoning);
        }
        json!({ "index": i, "message": message, "logprobs": lp, "finish_reason": reason.openai() })
    }

    /// Streaming: one SSE chunk per event, `[DONE]` after the last.
    fn stream(self, mut answers: Answers) -> Response {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let n = answers.choices();
        tokio::spawn(async move {
            let chunk = |choices: Value| {
                json!({ "id": self.id, "object": self.object(), "created": self.created, "model": self.model_name, "choices": choices })
                    .to_string()
            };
            let send = |s: String| tx.send(s).is_ok();
            if self.shape.chat {
                let roles: Vec<Value> = (0..n).map(|i| json!({ "index": i, "delta": { "role": "assistant", "content": "" }, "logprobs": Value::Null, "finish_reason": Value::Null })).collect();
                send(chunk(Value::Array(roles)));
            }
            // Text sent per choice so far (completions' logprobs give text offsets).
            let mut sent = vec![0usize; n as usize];
            let piece = |c: u32, delta: Value, lp: Value, reason: Value| {
                if self.shape.chat {
                    json!({ "index": c, "delta": delta, "logprobs": lp, "finish_reason": reason })
                } else {
                    let text = delta.get("content").cloned().unwrap_or_else(|| json!(""));
                    json!({ "index": c, "text": text, "logprobs": lp, "finish_reason": reason })
                }
            };
            while let Some(a) = answers.next().await {
                let line = match a {
                    Answer::Text { text, logprobs, .. }
                        if text.is_empty() && (logprobs.is_empty() || !self.shape.logprobs) =>
                    {
                        continue
                    }
                    Answer::Text { choice, text, logprobs, .. } => {
                        let Some(at) = sent.get_mut(choice as usize) else { continue };
                        let lp = self.logprobs(&logprobs, *at);
                        *at += text.len();
                        chunk(json!([piece(choice, json!({ "content": text }), lp, Value::Null)]))
                    }
                    Answer::Reasoning { choice, text } => {
                        if !self.shape.chat {
                            continue;
                        }
                        chunk(json!([piece(choice, json!({ "reasoning_content": text }), Value::Null, Value::Null)]))
                    }
                    Answer::Call { choice, index, call } => {
                        let delta = json!({ "tool_calls": [chat::openai_call(&call, Some(index))] });
                        chunk(json!([piece(choice, delta, Value::Null, Value::Null)]))
                    }
                    Answer::Finish { choice, reason } => {
                        let delta = if self.shape.chat { json!({}) } else { json!({ "content": "" }) };
                        chunk(json!([piece(choice, delta, Value::Null, json!(reason.openai()))]))
                    }
                    Answer::Done(u) => {
                        if self.shape.usage_chunk {
                            send(json!({ "id": self.id, "object": self.object(), "created": self.created, "model": self.model_name, "choices": [], "usage": Format::usage(&u) }).to_string());
                        }
                        break;
                    }
                    Answer::Failed(e) => {
                        send(json!({ "error": { "message": e.message, "type": "server_error", "param": Value::Null, "code": Value::Null } }).to_string());
                        break;
                    }
                };
                if !send(line) {
                    return; // the client went away: dropping the answer cancels the request
                }
            }
            send("[DONE]".to_string());
        });
        let events = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), |s| {
            Ok::<_, std::convert::Infallible>(SseEvent::default().data(s))
        });
        Sse::new(events).into_response()
    }
}

/// The `logprobs` of a choice (or of a streamed piece of one), in the route's shape: chat's
/// `content` entries with their `top_logprobs`, completions' parallel lists with a
/// `{text: logprob}` object of alternatives per token.
pub fn logprobs_json(model: &Model, chat: bool, lps: &[Scored], offset: usize) -> Value {
    let text = |t: u32| model.tokenizer.decode(&[t], false).unwrap_or_default();
    let lp = |x: f32| if x.is_finite() { json!(x) } else { json!(-9999.0) };
    // `bytes` are the token's own (a token ending inside a character shows as U+FFFD in
    // `token`; its bytes let a client join it to the next, as OpenAI's do).
    let entry = |t: u32, x: f32| {
        let bytes = model.tokenizer.token_bytes(t).map(<[u8]>::to_vec).unwrap_or_default();
        json!({ "token": text(t), "logprob": lp(x), "bytes": bytes })
    };
    if chat {
        let content: Vec<Value> = lps
            .iter()
            .map(|sc| {
                let mut e = entry(sc.token, sc.logprob);
                e["top_logprobs"] = sc.top.iter().map(|&(t, x)| entry(t, x)).collect();
                e
            })
            .collect();
        return json!({ "content": content });
    }
    let top: Vec<Value> =
        lps.iter().map(|sc| Value::Object(sc.top.iter().map(|&(t, x)| (text(t), lp(x))).collect())).collect();
    let top = if lps.iter().any(|sc| !sc.top.is_empty()) { json!(top) } else { Value::Null };
    let tokens: Vec<String> = lps.iter().map(|sc| text(sc.token)).collect();
    let mut at = offset;
    let offsets: Vec<usize> = tokens
        .iter()
        .map(|s| {
            let o = at;
            at += s.len();
            o
        })
        .collect();
    let values: Vec<Value> = lps.iter().map(|sc| lp(sc.logprob)).collect();
    json!({ "tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets })
}
