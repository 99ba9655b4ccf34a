//! Embeddings from the loaded model, on every edge: OpenAI's `/v1/embeddings` (floats or
//! base64, as its client asks by default), Ollama's `/api/embed`, D-Bus `Embed`. One path to
//! the model's engine thread ([`embed`]): the texts' token ids go as a `Command::Embed`, run as
//! work of the engine's steps (`inferd_engine::sched`), and the pooled, normalized vectors come
//! back ([`inferd_engine::engine::Pooler`]). A reranker's scores come the same way
//! ([`pooled`], for [`rerank`](super::rerank)); it is refused here.

use super::api::ApiError;
use super::conn::Hangup;
use super::request::user_place;
use super::{ModelHandle, Shared};
use inferd_engine::sched::{Command, Embedding, Priority, RequestId, RequestMeta};
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Texts per request, at most.
pub const MAX_INPUTS: usize = 2048;

/// What to embed: texts, or token ids (OpenAI accepts both).
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    Text(String),
    Tokens(Vec<u32>),
}

/// OpenAI's `input` (and Ollama's): a string, an array of strings, an array of token ids, or an
/// array of such arrays.
pub fn inputs(v: Option<&Value>) -> Result<Vec<Input>, ApiError> {
    let bad = |m: &str| ApiError::bad(m, "input");
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    let list = match v {
        Some(Value::String(s)) => vec![Input::Text(s.clone())],
        Some(Value::Array(a)) if a.is_empty() => return Err(bad("input is empty")),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            a.iter().map(|s| Input::Text(s.as_str().unwrap_or_default().to_owned())).collect()
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            vec![Input::Tokens(ids(a).ok_or_else(|| bad("token ids must be non-negative integers"))?)]
        }
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x.as_array().and_then(|t| ids(t)) {
                Some(t) => Ok(Input::Tokens(t)),
                None => Err(bad("input must be a string, strings, token ids or arrays of token ids")),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad("input must be a string, strings, token ids or arrays of token ids")),
    };
    if list.len() > MAX_INPUTS {
        return Err(bad(&format!("input has {} texts; at most {MAX_INPUTS}", list.len())));
    }
    Ok(list)
}

/// The vectors of `inputs` by `model`, and the tokens they took. `truncate`: a text longer
/// than the context keeps its start (Ollama's default) instead of being refused. The job
/// takes one of `uid`'s places (`limits.max_requests_per_user`) and runs in the engine's steps
/// beside everyone's requests; it is cancelled when `hangup` trips or this future is dropped.
pub async fn embed(
    sh: &Arc<Shared>,
    model: &Arc<ModelHandle>,
    inputs: Vec<Input>,
    truncate: bool,
    uid: u32,
    hangup: Option<Arc<Hangup>>,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    if model.model.rank.is_some() {
        let msg = format!(
            "{} is a reranker: it scores documents against a query (/v1/rerank), it gives no embeddings",
            model.name
        );
        return Err(ApiError::bad(msg, "model"));
    }
    pooled(sh, model, inputs, truncate, uid, hangup).await
}

/// [`embed`] for any model: a reranker's answers are its scores ([`super::rerank`]).
pub(super) async fn pooled(
    sh: &Arc<Shared>,
    model: &Arc<ModelHandle>,
    inputs: Vec<Input>,
    truncate: bool,
    uid: u32,
    hangup: Option<Arc<Hangup>>,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let _slot = user_place(sh, uid)?;
    let m = Arc::clone(model);
    let ids = sh.cpu(move || token_lists(&m, inputs, truncate)).await?;
    let tokens = ids.iter().map(Vec::len).sum();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = RequestMeta { uid, priority: Priority::Interactive, submitted: std::time::Instant::now() };
    let cmd = Command::Embed(Embedding {
        id,
        meta,
        inputs: ids,
        reply: Box::new(move |r| {
            let _ = tx.send(r);
        }),
    });
    if !model.engine.send(cmd) {
        return Err(ApiError::new(503, "the engine stopped", None));
    }
    // Whatever ends this wait early (the client gone, the handler dropped) cancels the job.
    let cancel = CancelOnDrop { model, id, armed: true };
    let reply = match hangup {
        Some(h) => tokio::select! {
            r = rx => r,
            _ = h.wait() => return Err(ApiError::new(499, "the client went away", None)),
        },
        None => rx.await,
    };
    cancel.disarm();
    match reply {
        Ok(Ok(v)) => Ok((v, tokens)),
        Ok(Err(e)) => Err(ApiError::new(503, format!("embedding failed: {e}"), None)),
        Err(_) => Err(ApiError::new(503, "the engine stopped", None)),
    }
}

/// Cancels an embedding job in the engine unless disarmed (its answer came).
struct CancelOnDrop<'a> {
    model: &'a ModelHandle,
    id: RequestId,
    armed: bool,
}

impl CancelOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.model.engine.cancel(self.id);
        }
    }
}

/// Each input's tokens (texts tokenized), checked against the vocabulary and the context.
fn token_lists(model: &ModelHandle, inputs: Vec<Input>, truncate: bool) -> Result<Vec<Vec<u32>>, ApiError> {
    let (ctx, vocab) = (model.context_len(), model.model.config.vocab);
    let mut ids = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let mut t = match input {
            Input::Text(s) => {
                model.model.tokenizer.encode(&s, false).map_err(|e| ApiError::bad(e.to_string(), "input"))?
            }
            Input::Tokens(t) => t,
        };
        if t.is_empty() {
            return Err(ApiError::bad(format!("input {i} is empty"), "input"));
        }
        if let Some(bad) = t.iter().find(|&&x| x as usize >= vocab) {
            return Err(ApiError::bad(
                format!("input {i}: token id {bad} is outside the vocabulary of {vocab}"),
                "input",
            ));
        }
        if t.len() > ctx {
            if !truncate {
                return Err(ApiError::new(
                    413,
                    format!("input {i} has {} tokens; the context holds {ctx}", t.len()),
                    Some("input"),
                ));
            }
            t.truncate(ctx);
        }
        ids.push(t);
    }
    Ok(ids)
}

/// Little-endian f32 bytes in standard base64 (OpenAI's `encoding_format: "base64"`).
pub fn base64(v: &[f32]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                s.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// An embedding body's checks both APIs share: only the keys in `known`, and `dimensions`
/// (when given) only the model's own, `hidden`.
pub fn check_body(m: &Map<String, Value>, known: &[&str], hidden: usize) -> Result<(), ApiError> {
    if let Some(k) = m.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::bad(format!("{k} is not supported by inferd"), "body"));
    }
    match m.get("dimensions") {
        None | Some(Value::Null) => Ok(()),
        Some(d) if d.as_u64() == Some(hidden as u64) => Ok(()),
        Some(_) => Err(ApiError::bad(
            format!("dimensions must be {hidden}, this model's (it is not trained to be shortened)"),
            "dimensions",
        )),
    }
}

/// OpenAI's `/v1/embeddings` body checked: `model`, `input`, `encoding_format`, `dimensions`,
/// `user` (ignored). Returns the inputs and whether to answer base64.
pub fn openai_body(m: &Map<String, Value>, hidden: usize) -> Result<(Vec<Input>, bool), ApiError> {
    check_body(m, &["model", "input", "encoding_format", "dimensions", "user"], hidden)?;
    let b64 = match m.get("encoding_format").and_then(|v| if v.is_null() { None } else { Some(v) }) {
        None => false,
        Some(v) if v == "float" => false,
        Some(v) if v == "base64" => true,
        Some(_) => return Err(ApiError::bad("encoding_format must be float or base64", "encoding_format")),
    };
    Ok((inputs(m.get("input"))?, b64))
}

/// OpenAI's answer.
pub fn openai_reply(name: &str, vectors: &[Vec<f32>], tokens: usize, b64: bool) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let e = if b64 { json!(base64(v)) } else { json!(v) };
            json!({ "object": "embedding", "index": i, "embedding": e })
        })
        .collect();
    json!({ "object": "list", "data": data, "model": name, "usage": { "prompt_tokens": tokens, "total_tokens": tokens } })
}

/// The model a body names (or the first), for the embedding routes.
pub fn model_of(sh: &Shared, m: &Map<String, Value>) -> Result<Arc<ModelHandle>, ApiError> {
    let name = m.get("model").and_then(Value::as_str).map(|n| n.strip_suffix(":latest").unwrap_or(n));
    sh.model(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_standard_with_padding() {
        // Python: base64.b64encode(struct.pack('<2f', 1.0, -2.5)) == b'AACAPwAAIMA='
        assert_eq!(base64(&[1.0, -2.5]), "AACAPwAAIMA=");
        assert_eq!(base64(&[1.0]), "AACAPw==");
        assert_eq!(base64(&[]), "");
    }

    #[test]
    fn inputs_take_every_shape_openai_allows() {
        let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert_eq!(inputs(Some(&v(r#""hi""#))).unwrap(), vec![Input::Text("hi".into())]);
        assert_eq!(inputs(Some(&v(r#"["a", "b"]"#))).unwrap().len(), 2);
        assert_eq!(inputs(Some(&v("[1, 2]"))).unwrap(), vec![Input::Tokens(vec![1, 2])]);
        assert_eq!(inputs(Some(&v("[[1], [2, 3]]"))).unwrap(), vec![Input::Tokens(vec![1]), Input::Tokens(vec![2, 3])]);
        for bad in ["[]", "3", "[-1]", r#"[["a"]]"#, "{}"] {
            assert_eq!(inputs(Some(&v(bad))).unwrap_err().status, 400, "{bad}");
        }
        assert!(inputs(None).is_err());
    }
}
