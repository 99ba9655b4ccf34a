//! D-Bus calls for a remote model: `Generate` and `Complete` become OpenAI completion requests,
//! `Chat` a chat request (its messages and tools as the HTTP edge would send them), `Embed` an
//! embeddings request. The upstream's stream comes back as the same `Token`, `ToolCall`,
//! `Finished` and `Failed` signals as a local model's, from a request object whose `Cancel`
//! (or the caller leaving the bus) ends the forwarding and so the upstream's request. A remote
//! text has no token ids here: `Token` carries `u32::MAX`, and `logprobs` is refused.
//! Reasoning text, which the signals have no place for, is left out.

use super::{Opened, Remote};
use crate::serve::answer::Answers;
use crate::serve::api::ApiError;
use crate::serve::conn::{Hangup, Peer};
use crate::serve::dbus::{caller_uid, failed, Inference, Stop};
use crate::serve::dbus_options::{chat_body, option_field};
use crate::serve::fields::FIELDS;
use inferd_engine::sched::RequestId;
use serde_json::{Map, Value as Json};
use std::collections::HashMap;
use std::sync::Arc;
use zbus::fdo;
use zbus::message::Header;
use zbus::zvariant::{OwnedObjectPath, OwnedValue};
use zbus::Connection;

/// Where a call goes.
pub enum Routed {
    /// To this local model (the one named, or a remote model's fallback while it is down).
    Local(String),
    /// To the upstream, which answered.
    Remote(Forwarding),
}

/// A call the upstream is answering.
pub struct Forwarding {
    r: Arc<Remote>,
    opened: Opened,
    hangup: Arc<Hangup>,
    sender: String,
    id: RequestId,
}

/// A call's `a{sv}` options as OpenAI fields (tools belong to [`chat`]).
fn fields(options: &HashMap<String, OwnedValue>, out: &mut Map<String, Json>) -> Result<(), ApiError> {
    for (k, v) in options {
        if ["tools", "tool_choice", "parallel_tool_calls", "images"].contains(&k.as_str()) {
            continue;
        }
        if k == "logprobs" || k == "top_logprobs" {
            return Err(ApiError::bad(format!("{k} is not available for a remote model over D-Bus"), "logprobs"));
        }
        if !FIELDS.contains(&k.as_str()) {
            return Err(ApiError::bad(format!("unknown option {k:?}"), "options"));
        }
        out.insert(k.clone(), option_field(k, v)?.to_json());
    }
    out.insert("stream".into(), true.into());
    out.insert("stream_options".into(), serde_json::json!({ "include_usage": true }));
    Ok(())
}

/// `Generate` and `Complete` as an OpenAI completion request.
pub fn completion(
    prompt: &str,
    options: &HashMap<String, OwnedValue>,
) -> Result<(&'static str, Map<String, Json>), ApiError> {
    if let Some(k) = ["tools", "tool_choice", "parallel_tool_calls"].iter().find(|k| options.contains_key(**k)) {
        return Err(ApiError::bad(format!("{k} is an option of Chat"), "tools"));
    }
    let mut body = Map::new();
    body.insert("prompt".into(), prompt.into());
    fields(options, &mut body)?;
    Ok(("/completions", body))
}

/// `Chat` as an OpenAI chat request.
pub fn chat(
    messages: &[HashMap<String, String>],
    options: &HashMap<String, OwnedValue>,
) -> Result<(&'static str, Map<String, Json>), ApiError> {
    let mut body = chat_body(messages, options)?;
    fields(options, &mut body)?;
    Ok(("/chat/completions", body))
}

impl Inference {
    /// Where a call naming `model` goes: a local model, or the upstream of a remote one (with
    /// the request `ask` builds).
    pub async fn route(
        &self,
        conn: &Connection,
        hdr: &Header<'_>,
        model: &str,
        ask: impl FnOnce() -> Result<(&'static str, Map<String, Json>), ApiError>,
    ) -> fdo::Result<Routed> {
        let Some(r) = self.sh.remote_named(model) else { return Ok(Routed::Local(model.to_owned())) };
        let (route, body) = ask().map_err(|e| {
            r.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            failed(r.failed(e))
        })?;
        let sender = hdr.sender().ok_or_else(|| fdo::Error::Failed("a call without a sender".into()))?.to_owned();
        let uid = caller_uid(conn, &sender).await?;
        let hangup = Arc::new(Hangup::default());
        let peer = Peer { uid: Some(uid), owner: None, hangup: Arc::clone(&hangup) };
        let opened = match r.open(&self.sh, route, body, &peer).await {
            Ok(o) => o,
            Err(f) => return r.fallback_model(f).map(Routed::Local).map_err(failed),
        };
        if opened.resp.status().is_client_error() {
            return Err(failed(r.refusal(opened.resp).await));
        }
        let id = self.sh.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sender = sender.to_string();
        if let Ok(mut o) = self.owners.lock() {
            o.entry(sender.clone()).or_default().push(Stop::Upstream(id, Arc::clone(&hangup)));
        }
        Ok(Routed::Remote(Forwarding { r, opened, hangup, sender, id }))
    }

    /// A forwarded `Generate` or `Chat`: its request object, whose signals a task sends.
    pub async fn stream_remote(&self, conn: &Connection, fw: Forwarding) -> fdo::Result<OwnedObjectPath> {
        let stop = Stop::Upstream(fw.id, Arc::clone(&fw.hangup));
        let sender = fw.sender.clone();
        self.export(conn, stop, sender, move |conn, path| async move { signals(&conn, &path, fw).await }).await
    }

    /// A forwarded `Complete`: the whole text.
    pub async fn complete_remote(&self, fw: Forwarding) -> fdo::Result<String> {
        let Forwarding { r, opened, hangup, sender, id } = fw;
        let result = crate::serve::dbus::whole_text(Answers::remote(r, opened, hangup)).await;
        crate::serve::dbus::forget_id(&self.owners, &sender, id);
        result
    }
}

/// A forwarded `Embed`: the upstream's vectors, or (`Err`) the fallback model to ask while the
/// upstream is down.
pub async fn embed(
    sh: &Arc<crate::serve::Shared>,
    r: &Remote,
    uid: u32,
    inputs: Vec<String>,
) -> fdo::Result<Result<Vec<Vec<f64>>, String>> {
    let mut body = Map::new();
    body.insert("input".into(), inputs.into());
    let peer = Peer { uid: Some(uid), owner: None, hangup: Arc::new(Hangup::default()) };
    let opened = match r.open(sh, "/embeddings", body, &peer).await {
        Ok(o) => o,
        Err(f) => return r.fallback_model(f).map(Err).map_err(failed),
    };
    if opened.resp.status().is_client_error() {
        return Err(failed(r.refusal(opened.resp).await));
    }
    let bad =
        || failed(r.failed(ApiError::new(502, format!("upstream for {}: not an embeddings answer", r.name), None)));
    let bytes = opened.resp.bytes().await.map_err(|_| bad())?;
    let v: Json = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    let mut data = v["data"].as_array().ok_or_else(bad)?.clone();
    data.sort_by_key(|d| d["index"].as_u64().unwrap_or(0));
    data.iter()
        .map(|d| d["embedding"].as_array().and_then(|e| e.iter().map(Json::as_f64).collect::<Option<Vec<f64>>>()))
        .collect::<Option<Vec<_>>>()
        .map(Ok)
        .ok_or_else(bad)
}

/// The upstream's stream as the request object's signals, unicast to the caller.
async fn signals(conn: &Connection, path: &OwnedObjectPath, fw: Forwarding) {
    let Forwarding { r, opened, hangup, sender, .. } = fw;
    crate::serve::dbus::signals(conn, path, &sender, Answers::remote(r, opened, hangup), false).await;
}
