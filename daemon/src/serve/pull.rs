//! Ollama's `POST /api/pull`: the daemon fetches a model into its store itself, with the
//! pull code `inferctl pull` uses ([`inferctl::pull`]), and reports progress as Ollama does
//! (NDJSON `{"status", "digest", "total", "completed"}` lines ending in `{"status":
//! "success"}`, or one object with `"stream": false`). Model management (`server.manage`).
//!
//! `model` is a hub file (`hf.co/ORG/REPO[:QUANT]`, `hf:ORG/REPO[:QUANT]`) or an `https://`
//! URL; Ollama's own registry names (`llama3.2`) are refused by name. The model is then named
//! by its file (`NAME.gguf` serves as `NAME`), which the last line gives as `model`.
//!
//! The fetch shares the store's transfer slot and `.NAME.gguf.partial` with `PUT /v1/store`, so
//! an interrupted pull resumes from either; it is bounded by `server.max_model_gib`, the file is
//! read as a model before it is renamed into place, and a client that goes away stops the
//! transfer (what arrived is kept). The system service has no network (`PrivateNetwork=yes`
//! unless remote models are configured): there a pull fails with an error that names
//! `inferctl pull`, which downloads as its user and sends the file through the daemon.

use super::api::ApiError;
use super::conn::Peer;
use super::Shared;
use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use inferctl::pull::{Checks, PullError, Pulled, Source, Target};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// Sets `cancel` when dropped: the response (or the stream of it) is gone with its client.
struct Cancel(Arc<AtomicBool>);

impl Drop for Cancel {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The keys of Ollama's pull request (`name` is its older spelling of `model`; `insecure`,
/// `username` and `password` are for its registry and change nothing here).
const KEYS: &[&str] = &["model", "name", "stream", "insecure", "username", "password"];

pub async fn pull(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: axum::body::Bytes,
) -> Response {
    let asked = (|| -> Result<(String, bool), ApiError> {
        let m = super::api::object(&body)?;
        if let Some(k) = m.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(ApiError::bad(format!("{k} is not a field of a pull"), "body"));
        }
        let reference = ["model", "name"]
            .iter()
            .find_map(|k| m.get(*k).and_then(Value::as_str).filter(|s| !s.is_empty()))
            .ok_or_else(|| ApiError::bad("a pull names its model: {\"model\": \"hf.co/ORG/REPO:QUANT\"}", "model"))?;
        let stream = m.get("stream").and_then(Value::as_bool) != Some(false);
        Ok((reference.to_string(), stream))
    })();
    let (reference, stream) = match asked {
        Ok(a) => a,
        Err(e) => return super::ollama::error(e),
    };
    if let Err(e) = sh.managers().check(peer.uid, &format!("pulling {reference}")) {
        return super::ollama::error(e);
    }
    if sh.models.store.is_none() {
        return super::ollama::error(ApiError::new(
            409,
            "this daemon serves --model alone and has no model store",
            None,
        ));
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Cancel(Arc::new(AtomicBool::new(false)));
    tokio::spawn(run(sh, peer, reference, tx, cancel.0.clone()));
    if stream {
        let lines = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), move |v| {
            let _held = &cancel;
            let v = v.unwrap_or_else(|e: ApiError| json!({ "error": e.message }));
            Ok::<_, std::convert::Infallible>(format!("{v}\n"))
        });
        return ([(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], axum::body::Body::from_stream(lines))
            .into_response();
    }
    let mut last = None;
    while let Some(line) = rx.recv().await {
        last = Some(line);
    }
    drop(cancel);
    match last {
        Some(Ok(v)) => Json(v).into_response(),
        Some(Err(e)) => super::ollama::error(e),
        None => super::ollama::error(ApiError::new(500, "the pull ended without an answer", None)),
    }
}

/// The pull itself: progress lines into `tx`, then `success` or the error.
async fn run(
    sh: Arc<Shared>,
    peer: Peer,
    reference: String,
    tx: UnboundedSender<Result<Value, ApiError>>,
    cancel: Arc<AtomicBool>,
) {
    let _ = tx.send(Ok(json!({ "status": "pulling manifest" })));
    let answer = fetch(&sh, &peer, &reference, &tx, cancel).await;
    let _ = tx.send(answer.map(|p| {
        let how = if p.already { "already installed" } else { "installed" };
        eprintln!(
            "inferd: {how} {} ({} bytes, sha256 {}) for uid {} by /api/pull",
            p.name,
            p.size,
            p.sha256,
            peer.uid()
        );
        json!({ "status": "success", "model": p.name })
    }));
}

async fn fetch(
    sh: &Arc<Shared>,
    peer: &Peer,
    reference: &str,
    tx: &UnboundedSender<Result<Value, ApiError>>,
    cancel: Arc<AtomicBool>,
) -> Result<Pulled, ApiError> {
    let src = {
        let r = reference.to_string();
        tokio::task::spawn_blocking(move || inferctl::pull::locate(&r, None))
            .await
            .map_err(|e| ApiError::new(500, e.to_string(), None))?
            .map_err(|e| refusal(reference, e))?
    };
    let mut pulled = one(sh, peer, reference, &src, tx, &cancel).await?;
    if let Some(p) = &src.projector {
        pulled.projector = Some(Box::new(one(sh, peer, reference, p, tx, &cancel).await?));
    }
    if !pulled.already || pulled.projector.as_ref().is_some_and(|p| !p.already) {
        sh.rescan_store().await;
    }
    Ok(pulled)
}

/// One file of a pull (the model, or the projector beside it) into the store.
async fn one(
    sh: &Arc<Shared>,
    peer: &Peer,
    reference: &str,
    src: &Source,
    tx: &UnboundedSender<Result<Value, ApiError>>,
    cancel: &Arc<AtomicBool>,
) -> Result<Pulled, ApiError> {
    let (store, file) = super::upload::target(sh, peer, &src.file, &format!("installing {}", src.file))?;
    let _busy = sh.uploads.claim(&file)?;
    let max = sh.uploads.max_bytes.load(Ordering::Relaxed);
    let (tx, cancel, src) = (tx.clone(), Arc::clone(cancel), src.clone());
    tokio::task::spawn_blocking(move || {
        let checks = Checks { max_bytes: Some(max), verify: Some(&super::store::readable), cancel: Some(&cancel) };
        let mut report = progress(&src, &tx, &cancel);
        inferctl::pull::fetch(&src, Target::Dir(&store), &checks, &mut report)
    })
    .await
    .map_err(|e| ApiError::new(500, e.to_string(), None))?
    .map_err(|e| refusal(reference, e))
}

/// Ollama's progress lines for `src`: one per percent (and the first and last), then
/// `verifying sha256 digest` once the bytes are all there. A closed channel (the client is
/// gone) cancels the transfer.
fn progress<'a>(
    src: &'a Source,
    tx: &'a UnboundedSender<Result<Value, ApiError>>,
    cancel: &'a AtomicBool,
) -> impl FnMut(u64, u64) + 'a {
    let status = format!("pulling {}", src.file);
    let digest = src.sha256.as_ref().map(|s| format!("sha256:{s}"));
    let mut last = None;
    move |done, total| {
        let step = (done * 100).checked_div(total).unwrap_or(0);
        if last == Some(step) && done != total {
            return;
        }
        last = Some(step);
        let mut v = json!({ "status": status, "total": total, "completed": done });
        if let Some(d) = &digest {
            v["digest"] = json!(d);
        }
        let mut sent = tx.send(Ok(v)).is_ok();
        if done == total {
            sent &= tx.send(Ok(json!({ "status": "verifying sha256 digest" }))).is_ok();
        }
        if !sent {
            cancel.store(true, Ordering::Relaxed);
        }
    }
}

/// A pull's error as the API says it.
fn refusal(reference: &str, e: PullError) -> ApiError {
    let status = match &e {
        PullError::BadRef(_) => {
            let msg = format!(
                "{reference:?} is not a model this daemon can pull: inferd pulls GGUF files from a Hugging Face hub \
                 (hf.co/ORG/REPO[:QUANT]) or an https:// URL, not from Ollama's registry"
            );
            return ApiError::bad(msg, "model");
        }
        PullError::Unreachable { .. } => {
            let msg = format!(
                "{e}. The daemon may have no network (the system service runs without one unless remote models are \
                 configured): `inferctl pull {reference}` downloads as you and installs through the daemon"
            );
            return ApiError::new(502, msg, None);
        }
        PullError::Choice(_) => 400,
        PullError::Status { status: 404, .. } => 404,
        PullError::Status { .. } | PullError::Http { .. } | PullError::Interrupted { .. } => 502,
        PullError::TooLarge { .. } => 413,
        PullError::Corrupt { .. } => 422,
        PullError::Io { .. } => 507,
        PullError::Daemon(_) => 500,
    };
    ApiError::new(status, e.to_string(), None)
}
