//! Reranking: scoring documents against a query with a reranker model (a GGUF with rank
//! pooling, [`inferd_engine::model::rank`]). `POST /v1/rerank`, and llama-server's other
//! spellings `/rerank`, `/reranking`, `/v1/reranking`, in the shapes llama-server, Jina and
//! Cohere share:
//!
//! - `{"model", "query", "documents": [text or {"text": text}], "top_n", "return_documents"}`
//!   answers `{"id", "model", "object": "list", "usage", "results": [{"index",
//!   "relevance_score", "document": {"text"}}]}`, best first, `top_n` of them (all by default),
//!   each document only when `return_documents` is true;
//! - Hugging Face TEI's `{"query", "texts", "return_text"}` answers its array of `{"index",
//!   "score", "text"}`.
//!
//! Each document is one prompt (the query and the document, [`RankHead::prompt`]) run as an
//! embedding job in the engine's steps beside everyone's requests ([`super::embed::pooled`]);
//! the score is the model's probability of its first label ("yes"). A model that is no
//! reranker is a 400 that says so; a remote model's request goes to its upstream.
//!
//! [`RankHead::prompt`]: inferd_engine::model::rank::RankHead::prompt

use super::api::{object, ApiError};
use super::conn::Peer;
use super::embed::{Input, MAX_INPUTS};
use super::Shared;
use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/rerank", post(rerank))
        .route("/rerank", post(rerank))
        .route("/v1/reranking", post(rerank))
        .route("/reranking", post(rerank))
}

/// The fields a rerank takes (`user`, and Cohere's `max_chunks_per_doc` at its default, change
/// nothing).
const KEYS: &[&str] = &["model", "query", "documents", "texts", "top_n", "return_documents", "return_text", "user"];

/// What a rerank asks.
struct Ask {
    query: String,
    documents: Vec<String>,
    top_n: usize,
    /// Hugging Face TEI's shape (`texts`).
    tei: bool,
    /// Each result carries its document's text.
    with_text: bool,
}

fn ask(m: &Map<String, Value>) -> Result<Ask, ApiError> {
    if let Some(k) = m.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(ApiError::bad(format!("{k} is not supported by inferd's rerank"), "body"));
    }
    let query = match m.get("query") {
        Some(Value::String(q)) => q.clone(),
        Some(Value::Object(o)) if o.get("text").is_some_and(Value::is_string) => {
            o["text"].as_str().unwrap_or_default().to_string()
        }
        _ => return Err(ApiError::bad("query must be a string", "query")),
    };
    let tei = m.contains_key("texts") && !m.contains_key("documents");
    let key = if tei { "texts" } else { "documents" };
    let bad = || ApiError::bad(format!("{key} must be a non-empty array of texts (or {{\"text\": ...}} objects)"), key);
    let documents: Vec<String> = match m.get(key) {
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|d| match d {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("text").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    if documents.len() > MAX_INPUTS {
        return Err(ApiError::bad(format!("{} documents; at most {MAX_INPUTS}", documents.len()), key));
    }
    let top_n = match m.get("top_n") {
        None | Some(Value::Null) => documents.len(),
        Some(v) => {
            let n = v
                .as_u64()
                .filter(|&n| n >= 1)
                .ok_or_else(|| ApiError::bad("top_n must be a positive integer", "top_n"))?;
            usize::try_from(n).unwrap_or(usize::MAX).min(documents.len())
        }
    };
    let flag = |k: &'static str| -> Result<bool, ApiError> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::bad(format!("{k} must be true or false"), k)),
        }
    };
    let with_text = if tei { flag("return_text")? } else { flag("return_documents")? };
    Ok(Ask { query, documents, top_n, tei, with_text })
}

async fn rerank(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let body = match super::http::remote(&sh, "/rerank", body, &peer).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    if let Err(e) = sh.warm(&body, false, None).await {
        return super::openai::error(e);
    }
    match run(&sh, &body, &peer).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => super::openai::error(e),
    }
}

async fn run(sh: &Arc<Shared>, body: &[u8], peer: &Peer) -> Result<Value, ApiError> {
    let m = object(body)?;
    let a = ask(&m)?;
    let model = super::embed::model_of(sh, &m)?;
    let head = model.model.rank.clone().ok_or_else(|| {
        let msg = format!(
            "{} is not a reranker (its GGUF has no rank pooling): rerank with a reranker model, such as Qwen3-Reranker",
            model.name
        );
        ApiError::bad(msg, "model")
    })?;
    let prompts = {
        let (model, query, docs) = (Arc::clone(&model), a.query.clone(), a.documents.clone());
        sh.cpu(move || {
            let ctx = model.context_len();
            let mut prompts = Vec::with_capacity(docs.len());
            for (i, d) in docs.iter().enumerate() {
                let ids = head
                    .prompt(&model.model.tokenizer, &query, d)
                    .map_err(|e| ApiError::bad(e.to_string(), "documents"))?;
                if ids.len() > ctx {
                    let msg = format!("document {i} with the query is {} tokens; the context holds {ctx}", ids.len());
                    return Err(ApiError::new(413, msg, Some("documents")));
                }
                prompts.push(Input::Tokens(ids));
            }
            Ok(prompts)
        })
        .await?
    };
    let (scores, tokens) =
        super::embed::pooled(sh, &model, prompts, false, peer.uid(), Some(Arc::clone(&peer.hangup))).await?;
    let mut ranked: Vec<(usize, f32)> =
        scores.iter().map(|s| s.first().copied().unwrap_or(f32::NAN)).enumerate().collect();
    // Best first; equal scores keep the documents' order.
    ranked.sort_by(|x, y| y.1.total_cmp(&x.1));
    ranked.truncate(a.top_n);
    let text = |i: usize| a.documents[i].clone();
    if a.tei {
        let results: Vec<Value> = ranked
            .iter()
            .map(|&(i, s)| {
                let mut r = json!({ "index": i, "score": s });
                if a.with_text {
                    r["text"] = json!(text(i));
                }
                r
            })
            .collect();
        return Ok(Value::Array(results));
    }
    let results: Vec<Value> = ranked
        .iter()
        .map(|&(i, s)| {
            let mut r = json!({ "index": i, "relevance_score": s });
            if a.with_text {
                r["document"] = json!({ "text": text(i) });
            }
            r
        })
        .collect();
    let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
    Ok(json!({
        "id": format!("rerank-{id}"),
        "model": model.name,
        "object": "list",
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
        "results": results,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> Map<String, Value> {
        serde_json::from_str(s).unwrap_or_default()
    }

    #[test]
    fn every_shape_is_read_and_bad_ones_named() {
        let a = ask(&body(r#"{"query": "q", "documents": ["a", {"text": "b"}], "top_n": 5}"#))
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((a.documents.len(), a.top_n, a.tei, a.with_text), (2, 2, false, false));
        let a =
            ask(&body(r#"{"query": "q", "texts": ["a"], "return_text": true}"#)).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(a.tei && a.with_text);
        for (bad, names) in [
            (r#"{"documents": ["a"]}"#, "query"),
            (r#"{"query": "q", "documents": []}"#, "documents"),
            (r#"{"query": "q", "documents": [1]}"#, "documents"),
            (r#"{"query": "q", "documents": ["a"], "top_n": 0}"#, "top_n"),
            (r#"{"query": "q", "documents": ["a"], "return_documents": "yes"}"#, "return_documents"),
            (r#"{"query": "q", "documents": ["a"], "rank_fields": ["x"]}"#, "rank_fields"),
        ] {
            let e = ask(&body(bad)).err().map(|e| e.message).unwrap_or_default();
            assert!(e.contains(names), "{bad}: {e}");
        }
    }
}
