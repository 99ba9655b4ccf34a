//! Installing a model file into the store through the daemon, which alone writes the store:
//! `inferctl pull` downloads (the system daemon has no network) and sends the bytes here;
//! Ollama's `/api/pull` has the daemon fetch them itself where it can ([`pull`](super::pull)),
//! sharing the transfer slots ([`Uploads::claim`]). Model management (`server.manage`).
//!
//! - `GET /v1/store/{file}`: `{"store", "file", "received", "installed_size"}` (bytes of an
//!   interrupted transfer kept, and the size of the installed file, if any); with `?hash=1`
//!   also the installed file's `installed_sha256`.
//! - `PUT /v1/store/{file}` with `Content-Range: bytes START-END/TOTAL` (or none: the body is
//!   the whole file) and optionally `X-Inferd-Sha256`: appends the body at `START`, which must
//!   be what the daemon has (409 with `received` otherwise; 0 starts over). A transfer cut off
//!   keeps what arrived. When the file is whole it is checked (the SHA-256 given, a GGUF header
//!   within the reader's budgets) and renamed into place as `{file}`, replacing one of that
//!   name; a file that fails is deleted.
//!
//! Transfers are `.{file}.partial` in the store, created without following links (the store is
//! the daemon's own directory: nobody else can put anything there); one transfer per file at a
//! time; removed when the daemon starts ([`clean`]). `TOTAL` is at most `server.max_model_gib`.

use super::api::ApiError;
use super::conn::Peer;
use super::Shared;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_stream::StreamExt;

/// The transfers under way and the size bound.
#[derive(Debug)]
pub struct Uploads {
    busy: Mutex<HashSet<String>>,
    /// `server.max_model_gib` in bytes.
    pub max_bytes: AtomicU64,
}

impl Uploads {
    pub fn new(max_gib: u64) -> Uploads {
        Uploads { busy: Mutex::new(HashSet::new()), max_bytes: AtomicU64::new(max_gib.saturating_mul(1 << 30)) }
    }

    /// The transfer slot of `file`: a 409 while another transfer (a `PUT` or a pull) has it.
    pub fn claim(&self, file: &str) -> Result<Busy<'_>, ApiError> {
        let Ok(mut b) = self.busy.lock() else { return Err(ApiError::new(500, "poisoned", None)) };
        if !b.insert(file.to_string()) {
            return Err(ApiError::new(409, format!("{file} is being transferred already"), None));
        }
        Ok(Busy(self, file.to_string()))
    }
}

/// Holds a file's transfer slot while it lives.
pub struct Busy<'a>(&'a Uploads, String);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if let Ok(mut b) = self.0.busy.lock() {
            b.remove(&self.1);
        }
    }
}

pub fn routes() -> Router<Arc<Shared>> {
    Router::new().route("/v1/store/{file}", get(status).put(put))
}

/// Whether a request is a transfer's body, which [`super::conn::read_body`] leaves unread.
pub fn is_upload(method: &axum::http::Method, path: &str) -> bool {
    method == axum::http::Method::PUT && path.starts_with("/v1/store/")
}

/// The name of a transfer of `file`.
fn partial(file: &str) -> String {
    format!(".{file}.partial")
}

/// Removes transfers left by an earlier run (they are restarted by the next pull).
pub fn clean(store: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(store) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        if name.to_str().is_some_and(|n| n.ends_with(".partial")) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The store and the checked file name, for a manager.
pub fn target(sh: &Shared, peer: &Peer, file: &str, what: &str) -> Result<(PathBuf, String), ApiError> {
    sh.managers().check(peer.uid, what)?;
    let store = sh
        .models
        .store
        .clone()
        .ok_or_else(|| ApiError::new(409, "this daemon serves --model alone and has no model store", None))?;
    let stem = file.strip_suffix(".gguf").unwrap_or("");
    let ok = !stem.is_empty()
        && file.len() <= 255
        && !file.starts_with('.')
        && file.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b));
    if !ok {
        return Err(ApiError::bad(
            format!("{file:?} is not a model file name: NAME.gguf, NAME of letters, digits, '.', '_', '-', '+' not starting with '.'"),
            "file",
        ));
    }
    Ok((store, file.to_string()))
}

fn sha256_of(path: &std::path::Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

async fn status(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(file): Path<String>,
    uri: axum::http::Uri,
) -> Response {
    let hash = uri.query().is_some_and(|q| q.split('&').any(|kv| kv == "hash=1"));
    let (store, file) = match target(&sh, &peer, &file, &format!("installing {file}")) {
        Ok(t) => t,
        Err(e) => return super::openai::error(e),
    };
    let received = std::fs::symlink_metadata(store.join(partial(&file))).map_or(0, |m| m.len());
    let installed = store.join(&file);
    let size = std::fs::metadata(&installed).ok().filter(|m| m.is_file()).map(|m| m.len());
    let mut v = json!({ "store": store, "file": file, "received": received, "installed_size": size });
    if hash && size.is_some() {
        match tokio::task::spawn_blocking(move || sha256_of(&installed)).await {
            Ok(Ok(h)) => v["installed_sha256"] = json!(h),
            _ => return super::openai::error(ApiError::new(500, format!("reading the installed {}", v["file"]), None)),
        }
    }
    Json(v).into_response()
}

/// `Content-Range: bytes START-END/TOTAL` of a body of `len` bytes: (START, TOTAL).
fn range(headers: &HeaderMap, len: u64) -> Result<(u64, u64), ApiError> {
    let Some(r) = headers.get(axum::http::header::CONTENT_RANGE) else { return Ok((0, len)) };
    let bad = || {
        ApiError::bad(
            format!("Content-Range {r:?} is not bytes START-END/TOTAL of the body's {len} bytes"),
            "Content-Range",
        )
    };
    let text = r.to_str().map_err(|_| bad())?;
    let (span, total) = text.strip_prefix("bytes ").and_then(|t| t.split_once('/')).ok_or_else(bad)?;
    let total: u64 = total.parse().map_err(|_| bad())?;
    if span == "*" && len == 0 {
        return Ok((total, total)); // nothing more to send: check and install what is there
    }
    let (first, last) = span.split_once('-').ok_or_else(bad)?;
    let (first, last): (u64, u64) = (first.parse().map_err(|_| bad())?, last.parse().map_err(|_| bad())?);
    if last < first || last >= total || last - first + 1 != len {
        return Err(bad());
    }
    Ok((first, total))
}

async fn put(
    State(sh): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(file): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match receive(&sh, &peer, &file, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            let received = e.1;
            let mut r = super::openai::error(e.0);
            if let Some(n) = received {
                // What a client resumes from, beside the error.
                r.headers_mut().insert("X-Inferd-Received", n.into());
            }
            r
        }
    }
}

/// An error, and the bytes the daemon holds when the client should resume from them.
type Refusal = (ApiError, Option<u64>);

async fn receive(sh: &Arc<Shared>, peer: &Peer, file: &str, headers: &HeaderMap, body: Body) -> Result<Value, Refusal> {
    let (store, file) = target(sh, peer, file, &format!("installing {file}")).map_err(|e| (e, None))?;
    let len: u64 = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .ok_or_else(|| (ApiError::new(411, "a transfer needs a Content-Length", None), None))?;
    let (start, total) = range(headers, len).map_err(|e| (e, None))?;
    let max = sh.uploads.max_bytes.load(Ordering::Relaxed);
    if total > max {
        let msg = format!("{file} is {total} bytes, more than server.max_model_gib ({} GiB)", max >> 30);
        return Err((ApiError::new(413, msg, None), None));
    }
    let sha = headers.get("X-Inferd-Sha256").and_then(|v| v.to_str().ok()).map(str::to_ascii_lowercase);
    if sha.as_ref().is_some_and(|s| s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit())) {
        return Err((ApiError::bad("X-Inferd-Sha256 must be a SHA-256 in hex", "X-Inferd-Sha256"), None));
    }
    let busy = sh.uploads.claim(&file).map_err(|e| (e, None))?;
    let part = store.join(partial(&file));
    let opened = {
        let part = part.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<(std::fs::File, u64)> {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&part)?;
            let have = f.metadata()?.len();
            Ok((f, have))
        })
        .await
    };
    let io = |e: std::io::Error| (ApiError::new(507, format!("writing {}: {e}", part.display()), None), None);
    let (mut f, mut have) = match opened {
        Ok(r) => r.map_err(io)?,
        Err(e) => return Err((ApiError::new(500, e.to_string(), None), None)),
    };
    if start == 0 && have > 0 {
        f.set_len(0).map_err(io)?;
        have = 0;
    }
    if start != have {
        let msg = format!("the daemon holds {have} bytes of {file}: send from there");
        return Err((ApiError::new(409, msg, None), Some(have)));
    }
    // The body, appended in pieces of up to 8 MiB written off the async workers.
    let idle = Duration::from_secs(sh.limits().request_timeout_secs.max(1));
    let mut stream = body.into_data_stream();
    let mut pending: Vec<u8> = Vec::with_capacity(8 << 20);
    let mut cut = None;
    loop {
        let next = match tokio::time::timeout(idle, stream.next()).await {
            Ok(n) => n,
            Err(_) => {
                cut = Some(format!("no data for {} s", idle.as_secs()));
                None
            }
        };
        let chunk = match next {
            Some(Ok(c)) => Some(c),
            Some(Err(e)) => {
                cut = Some(e.to_string());
                None
            }
            None => None,
        };
        if let Some(c) = &chunk {
            if have + (pending.len() + c.len()) as u64 > total {
                cut = Some("more bytes than the Content-Range says".into());
            } else {
                pending.extend_from_slice(c);
            }
        }
        if pending.len() >= 8 << 20 || chunk.is_none() || cut.is_some() {
            let (buf, file_) = (std::mem::take(&mut pending), f);
            let written = tokio::task::spawn_blocking(move || {
                let mut file_ = file_;
                let r = file_.write_all(&buf);
                (file_, r, buf)
            })
            .await;
            let Ok((back, r, mut buf)) = written else {
                return Err((ApiError::new(500, "the write was lost", None), None));
            };
            f = back;
            if let Err(e) = r {
                // A full disk: what was kept stays for a resume once there is room.
                return Err((ApiError::new(507, format!("writing {file}: {e}"), None), Some(have)));
            }
            have += buf.len() as u64;
            buf.clear();
            pending = buf;
        }
        if chunk.is_none() || cut.is_some() {
            break;
        }
    }
    if let Some(why) = cut {
        let msg = format!("the transfer of {file} stopped at {have} of {total} bytes ({why}); kept for a resume");
        return Err((ApiError::new(400, msg, None), Some(have)));
    }
    if have < total {
        return Ok(json!({ "file": file, "received": have, "total": total, "installed": false }));
    }
    // Whole: checked, then installed.
    let (path, name) = (store.join(&file), file.strip_suffix(".gguf").unwrap_or(&file).to_string());
    let checked = {
        let (part, path) = (part.clone(), path.clone());
        tokio::task::spawn_blocking(move || -> Result<String, String> {
            f.sync_all().map_err(|e| e.to_string())?;
            drop(f);
            let sum = sha256_of(&part).map_err(|e| e.to_string())?;
            if let Some(want) = sha.filter(|w| *w != sum) {
                return Err(format!("its SHA-256 is {sum}, not {want}"));
            }
            super::store::readable(&part)?;
            std::fs::rename(&part, &path).map_err(|e| format!("installing it: {e}"))?;
            Ok(sum)
        })
        .await
    };
    let sum = match checked {
        Ok(Ok(s)) => s,
        Ok(Err(why)) => {
            let _ = std::fs::remove_file(&part);
            return Err((ApiError::new(422, format!("{file} was not installed: {why}"), None), None));
        }
        Err(e) => return Err((ApiError::new(500, e.to_string(), None), None)),
    };
    drop(busy);
    sh.rescan_store().await;
    eprintln!("inferd: installed {name} ({total} bytes, sha256 {sum}) for uid {}", peer.uid());
    Ok(json!({ "name": name, "file": file, "path": path, "size": total, "sha256": sum, "installed": true }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use super::*;

    #[test]
    fn content_ranges_are_read_strictly() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(axum::http::header::CONTENT_RANGE, v.parse().unwrap());
            m
        };
        assert_eq!(range(&HeaderMap::new(), 10).ok(), Some((0, 10)));
        assert_eq!(range(&h("bytes 5-9/10"), 5).ok(), Some((5, 10)));
        assert_eq!(range(&h("bytes */10"), 0).ok(), Some((10, 10)));
        for bad in ["bytes 5-9/9", "bytes 5-8/10", "bytes 9-5/10", "5-9/10", "bytes a-b/10"] {
            assert!(range(&h(bad), 5).is_err(), "{bad}");
        }
    }
}
