//! Installing a model into a model store: `inferctl pull REF` and `inferd pull REF`.
//!
//! `REF` is a GGUF file of a Hugging Face repository, `hf:ORG/REPO[:QUANT]` (the file whose
//! name carries `QUANT`, such as `Q4_K_M`; without it, the repository's `Q4_K_M` file or its
//! only GGUF file; Ollama's spelling `hf.co/ORG/REPO[:QUANT]` is the same, `:latest` naming no
//! quantization), or a plain `https://` URL. The hub is `$HF_ENDPOINT` (default
//! `https://huggingface.co`), with `$HF_TOKEN` for gated repositories; the file list and each
//! file's size and SHA-256 come from its API (`/api/models/ORG/REPO/tree/main`). A repository
//! that also holds a vision projector (`*mmproj*.gguf`, never taken for the model; of several,
//! the F16 one, else BF16, F32, Q8_0) brings it along, installed as `NAME.mmproj.gguf` beside
//! `NAME.gguf`, where the model store pairs the two.
//!
//! Sources are fetched over `https://` only (`http://` is taken for 127.0.0.1 and localhost
//! alone, where tests serve a hub), and a URL may carry the file's SHA-256 (`--sha256`).
//!
//! Where it goes ([`Target`]): a running daemon's store, through the daemon (`PUT
//! /v1/store/FILE`, model management): the daemon alone writes its store, so no user can plant
//! a file or a link there for another's pull to write through. The daemon keeps an interrupted
//! transfer (`.FILE.partial`, hidden) and says how much it has; the next pull asks the source
//! for the rest, checks the source's `Content-Range` says it starts there and is of the same
//! file size, and sends it on. With no daemon running, or for `inferd pull`, the file is
//! written into a directory of the caller's own, created without following links. Either way
//! the whole file is checked against the size (and the SHA-256, where the source gives one)
//! before it becomes a model. The daemon's own `/api/pull` ([`locate`] then [`fetch`] into its
//! store) adds its checks: a size bound, the GGUF header read before the file is renamed into
//! place, and cancellation when its client goes away.

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{0:?} is not a model reference: use hf:ORG/REPO[:QUANT] or an https:// URL")]
    BadRef(String),
    #[error("{0}")]
    Choice(String),
    #[error("{url}: {source}")]
    Http { url: String, source: reqwest::Error },
    #[error("cannot reach {url}: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("{name} is {size} bytes, more than the {max} this store takes")]
    TooLarge { name: String, size: u64, max: u64 },
    #[error("{url} answered {status}")]
    Status { url: String, status: u16 },
    #[error("the transfer of {name} stopped at {done} of {total} bytes ({why}); run the same pull again to resume")]
    Interrupted { name: String, done: u64, total: String, why: String },
    #[error("{name} is corrupt: {why} (the partial file was removed; pull again)")]
    Corrupt { name: String, why: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Daemon(#[from] crate::client::ClientError),
}

/// A model now in the store.
#[derive(Debug)]
pub struct Pulled {
    /// The name requests use (the file name without `.gguf`).
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    /// Hex SHA-256 of the file.
    pub sha256: String,
    /// Whether it was already there (nothing transferred).
    pub already: bool,
    /// The vision projector installed with it, where its source had one.
    pub projector: Option<Box<Pulled>>,
}

impl Pulled {
    /// What a pull says it did, a line per file: the model's, then its projector's.
    pub fn report(&self) -> Vec<String> {
        std::iter::once(self)
            .chain(self.projector.as_deref())
            .map(|p| {
                let how = if p.already { "already installed" } else { "installed" };
                format!("{}: {how} at {} ({} bytes, sha256 {})", p.name, p.path.display(), p.size, p.sha256)
            })
            .collect()
    }
}

/// Where a model comes from, resolved to one file.
#[derive(Clone, Debug, PartialEq)]
pub struct Source {
    pub url: String,
    /// The file name it is installed as (`NAME.gguf`).
    pub file: String,
    /// Its size, where the hub lists it.
    pub size: Option<u64>,
    /// Its hex SHA-256, where the hub lists it or the caller gave it.
    pub sha256: Option<String>,
    /// The vision projector its repository holds, to install beside it (as `NAME.mmproj.gguf`).
    pub projector: Option<Box<Source>>,
}

/// Reads a whole fetched file before it is installed: `Err(why)` refuses it.
pub type Verify<'a> = &'a dyn Fn(&Path) -> Result<(), String>;

/// What a fetch checks beyond size and hash, for a store that takes files from others.
#[derive(Default)]
pub struct Checks<'a> {
    /// The largest file taken.
    pub max_bytes: Option<u64>,
    /// Reads the whole file before it is renamed into place; an error removes it.
    pub verify: Option<Verify<'a>>,
    /// Set when the transfer should stop (what arrived is kept for a resume).
    pub cancel: Option<&'a AtomicBool>,
}

/// A transport error, told apart where no connection could be made (no network).
fn http_error(url: &str, source: reqwest::Error) -> PullError {
    if source.is_connect() {
        PullError::Unreachable { url: url.into(), source }
    } else {
        PullError::Http { url: url.into(), source }
    }
}

/// One file of a hub repository's tree listing.
#[derive(Debug, serde::Deserialize)]
struct Entry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    size: Option<u64>,
    lfs: Option<Lfs>,
}

#[derive(Debug, serde::Deserialize)]
struct Lfs {
    oid: String,
    size: u64,
}

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()).unwrap_or_else(|| "https://huggingface.co".into())
}

fn client() -> Result<reqwest::blocking::Client, PullError> {
    // The one TLS provider this build carries; a second install is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(t) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        if let Ok(v) = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")) {
            headers.insert(reqwest::header::AUTHORIZATION, v);
        }
    }
    reqwest::blocking::Client::builder()
        .user_agent(concat!("inferd/", env!("CARGO_PKG_VERSION")))
        .default_headers(headers)
        .connect_timeout(std::time::Duration::from_secs(30))
        .timeout(None)
        .build()
        .map_err(|source| http_error(&endpoint(), source))
}

/// Whether `name` carries quantization `quant` as a whole word (`Q4_K` is not `Q4_K_M`).
fn carries(name: &str, quant: &str) -> bool {
    let (n, q) = (name.to_ascii_uppercase(), quant.to_ascii_uppercase());
    n.match_indices(&q).any(|(i, _)| {
        let before = n[..i].chars().next_back().is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_');
        let after = n[i + q.len()..].chars().next().is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_');
        before && after
    })
}

/// Whether a file (a path's last part) is named as a vision projector: `mmproj` in its name,
/// as llama.cpp's converter and the hubs name them (the model store goes by it too).
pub fn is_projector(path: &str) -> bool {
    path.rsplit('/').next().unwrap_or(path).to_ascii_lowercase().contains("mmproj")
}

/// The vision projector of a repository's listing, if any: of several, the F16 one, else
/// BF16, F32, Q8_0, else the first by name.
fn choose_projector(entries: &[Entry]) -> Option<&Entry> {
    let mut found: Vec<&Entry> =
        entries.iter().filter(|e| e.kind == "file" && e.path.ends_with(".gguf") && is_projector(&e.path)).collect();
    found.sort_by(|a, b| a.path.cmp(&b.path));
    ["F16", "BF16", "F32", "Q8_0"]
        .iter()
        .find_map(|q| found.iter().copied().find(|e| carries(&e.path, q)))
        .or(found.first().copied())
}

/// The file of a repository's listing that `quant` asks for (projectors aside).
fn choose<'a>(repo: &str, entries: &'a [Entry], quant: Option<&str>) -> Result<&'a Entry, PullError> {
    let ggufs: Vec<&Entry> = entries
        .iter()
        .filter(|e| {
            e.kind == "file" && e.path.ends_with(".gguf") && !e.path.contains("-of-0") && !is_projector(&e.path)
        })
        .collect();
    let names = || ggufs.iter().map(|e| e.path.as_str()).collect::<Vec<_>>().join(", ");
    if ggufs.is_empty() {
        return Err(PullError::Choice(format!("hf:{repo} has no GGUF file (split GGUFs are not supported)")));
    }
    let pick = |q: &str| -> Vec<&'a Entry> { ggufs.iter().copied().filter(|e| carries(&e.path, q)).collect() };
    let found = match quant {
        Some(q) => pick(q),
        None if ggufs.len() == 1 => ggufs.clone(),
        None => pick("Q4_K_M"),
    };
    match found.as_slice() {
        [one] => Ok(one),
        [] => Err(PullError::Choice(match quant {
            Some(q) => format!("hf:{repo} has no {q} file; it has: {}", names()),
            None => format!("hf:{repo} has several GGUF files; name one with hf:{repo}:QUANT ({})", names()),
        })),
        many => Err(PullError::Choice(format!(
            "hf:{repo}: {} files match; name one exactly ({})",
            many.len(),
            many.iter().map(|e| e.path.as_str()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Resolves `reference` to one file.
fn resolve(http: &reqwest::blocking::Client, reference: &str) -> Result<Source, PullError> {
    let hub = ["hf:", "hf.co/", "huggingface.co/"].iter().find_map(|p| reference.strip_prefix(p));
    if let Some(rest) = hub {
        let (repo, quant) = match rest.split_once(':') {
            Some((r, q)) => (r, Some(q).filter(|q| !q.is_empty() && !q.eq_ignore_ascii_case("latest"))),
            None => (rest, None),
        };
        if repo.split('/').count() != 2 || repo.split('/').any(|p| p.is_empty() || p == "..") {
            return Err(PullError::BadRef(reference.into()));
        }
        secure(&endpoint())?;
        let url = format!("{}/api/models/{repo}/tree/main?recursive=true", endpoint());
        let resp = http.get(&url).send().map_err(|source| http_error(&url, source))?;
        if !resp.status().is_success() {
            return Err(PullError::Status { url, status: resp.status().as_u16() });
        }
        let entries: Vec<Entry> = serde_json::from_reader(resp)
            .map_err(|e| PullError::Choice(format!("{url} sent no file list this client understands: {e}")))?;
        let source = |e: &Entry, file: String, projector| Source {
            url: format!("{}/{repo}/resolve/main/{}", endpoint(), e.path),
            file,
            size: e.lfs.as_ref().map(|l| l.size).or(e.size),
            sha256: e.lfs.as_ref().map(|l| l.oid.to_ascii_lowercase()),
            projector,
        };
        let e = choose(repo, &entries, quant)?;
        let file = e.path.rsplit('/').next().unwrap_or(&e.path).to_string();
        let stem = file.strip_suffix(".gguf").unwrap_or(&file);
        let projector = choose_projector(&entries).map(|p| Box::new(source(p, format!("{stem}.mmproj.gguf"), None)));
        return Ok(source(e, file, projector));
    }
    if reference.starts_with("https://") || reference.starts_with("http://") {
        secure(reference)?;
        let path = reference.split(['?', '#']).next().unwrap_or(reference);
        let file = path.rsplit('/').next().unwrap_or_default().to_string();
        if !file.ends_with(".gguf") || file.starts_with('.') {
            return Err(PullError::Choice(format!("{reference} does not name a .gguf file (NAME.gguf)")));
        }
        return Ok(Source { url: reference.into(), file, size: None, sha256: None, projector: None });
    }
    Err(PullError::BadRef(reference.into()))
}

/// `Ok` for an `https://` URL, or an `http://` one to this machine's loopback names.
fn secure(url: &str) -> Result<(), PullError> {
    if url.starts_with("https://") {
        return Ok(());
    }
    let host = url.strip_prefix("http://").and_then(|r| r.split(['/', '?', '#']).next()).unwrap_or("");
    let host =
        host.rsplit_once(':').map_or(host, |(h, port)| if port.bytes().all(|b| b.is_ascii_digit()) { h } else { host });
    if ["127.0.0.1", "localhost", "[::1]"].contains(&host) {
        return Ok(());
    }
    Err(PullError::Choice(format!("{url}: models are fetched over https:// only (http:// for 127.0.0.1 alone)")))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hashes the first `len` bytes of `path` into `h`.
fn hash_prefix(path: &Path, len: u64, h: &mut Sha256) -> std::io::Result<()> {
    let mut f = std::fs::File::open(path)?.take(len);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        h.update(&buf[..n]);
    }
}

/// Where a pull installs its model.
#[derive(Clone, Copy)]
pub enum Target<'a> {
    /// A running daemon's store, through the daemon.
    Daemon(&'a crate::client::Client),
    /// A directory written here (no daemon runs, or `inferd pull`).
    Dir(&'a Path),
}

/// Fetches `reference` into `target`, checked against `sha256` (hex) when given, calling
/// `progress(done, total)` as bytes arrive.
pub fn pull(
    reference: &str,
    target: Target<'_>,
    sha256: Option<&str>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Pulled, PullError> {
    fetch_with_projector(&locate(reference, sha256)?, target, &Checks::default(), progress)
}

/// [`fetch`] of `src`, then of the vision projector its repository holds, if any.
pub fn fetch_with_projector(
    src: &Source,
    target: Target<'_>,
    checks: &Checks<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Pulled, PullError> {
    let mut pulled = fetch(src, target, checks, progress)?;
    if let Some(p) = &src.projector {
        pulled.projector = Some(Box::new(fetch(p, target, checks, progress)?));
    }
    Ok(pulled)
}

/// Resolves `reference` to one file, checked against `sha256` (hex) when given.
pub fn locate(reference: &str, sha256: Option<&str>) -> Result<Source, PullError> {
    let http = client()?;
    let mut src = resolve(&http, reference)?;
    if let Some(want) = sha256.map(str::to_ascii_lowercase) {
        if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(PullError::Choice(format!("--sha256 {want:?} is not a SHA-256 in hex")));
        }
        if src.sha256.as_ref().is_some_and(|s| *s != want) {
            return Err(PullError::Choice(format!(
                "the hub lists SHA-256 {} for {}, not {want}",
                src.sha256.unwrap_or_default(),
                src.file
            )));
        }
        src.sha256 = Some(want);
    }
    Ok(src)
}

/// Fetches `src` into `target` (the [`Checks`] apply to a directory written here), calling
/// `progress(done, total)` as bytes arrive.
pub fn fetch(
    src: &Source,
    target: Target<'_>,
    checks: &Checks<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Pulled, PullError> {
    let http = client()?;
    match target {
        Target::Daemon(c) => pull_through(&http, src, c, progress),
        Target::Dir(d) => pull_into(&http, src, d, checks, progress),
    }
}

/// The source's answer for its bytes from `have` on: the response, where it starts and the
/// whole file's size. A resumed transfer's `Content-Range` must start at `have` and be of the
/// file the hub lists (a server that ignores the range sends it all from 0).
fn open_at(
    http: &reqwest::blocking::Client,
    src: &Source,
    have: u64,
) -> Result<(Option<reqwest::blocking::Response>, u64, u64), PullError> {
    let mut req = http.get(&src.url);
    if have > 0 {
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let resp = req.send().map_err(|source| http_error(&src.url, source))?;
    // Nothing is written from such an answer: what was received so far stays.
    let corrupt = |why: String| PullError::Choice(format!("{}: {why}; nothing more was written", src.file));
    let (start, total) = match resp.status().as_u16() {
        206 => {
            let range = resp.headers().get(reqwest::header::CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("");
            let parsed = range.strip_prefix("bytes ").and_then(|r| {
                let (span, total) = r.split_once('/')?;
                let (first, last) = span.split_once('-')?;
                Some((first.parse::<u64>().ok()?, last.parse::<u64>().ok()?, total.parse::<u64>().ok()?))
            });
            let Some((first, last, total)) = parsed else {
                return Err(corrupt(format!("the source resumed with Content-Range {range:?}")));
            };
            if first != have || last + 1 != total || src.size.is_some_and(|s| s != total) {
                return Err(corrupt(format!(
                    "asked the source for bytes {have}- of {}, it sent {range:?}",
                    src.size.map_or_else(|| "?".into(), |s| s.to_string())
                )));
            }
            (first, total)
        }
        200 => {
            let total = src.size.or(resp.content_length()).ok_or_else(|| {
                PullError::Choice(format!("{} does not say how large the file is (no Content-Length)", src.url))
            })?;
            if resp.content_length().is_some_and(|n| n != total) {
                return Err(corrupt(format!(
                    "the source sends {:?} bytes where the hub lists {total}",
                    resp.content_length()
                )));
            }
            (0, total)
        }
        416 if Some(have) == src.size => return Ok((None, have, have)),
        status => return Err(PullError::Status { url: src.url.clone(), status }),
    };
    Ok((Some(resp), start, total))
}

/// Through the daemon: it says what it has, the rest is sent on to it.
fn pull_through(
    http: &reqwest::blocking::Client,
    src: &Source,
    daemon: &crate::client::Client,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Pulled, PullError> {
    let at = format!("/v1/store/{}", src.file);
    let there = daemon.json("GET", &at, None)?;
    let name = src.file.strip_suffix(".gguf").unwrap_or(&src.file).to_string();
    let store = PathBuf::from(there["store"].as_str().unwrap_or_default());
    let num = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    // Already installed: the same size, and hash when the source gives one.
    if src.size.is_some() && there["installed_size"].as_u64() == src.size {
        let h = daemon.json("GET", &format!("{at}?hash=1"), None)?;
        let sha = h["installed_sha256"].as_str().unwrap_or_default().to_string();
        if src.sha256.as_ref().is_none_or(|s| *s == sha) {
            return Ok(Pulled {
                name,
                path: store.join(&src.file),
                size: num(&h["installed_size"]),
                sha256: sha,
                already: true,
                projector: None,
            });
        }
    }
    let have = num(&there["received"]);
    let (resp, start, total) = open_at(http, src, have)?;
    let mut headers = vec![("Content-Range", format!("bytes {start}-{}/{total}", total.saturating_sub(1)))];
    if let Some(s) = &src.sha256 {
        headers.push(("X-Inferd-Sha256", s.clone()));
    }
    let mut done = start;
    progress(done, total);
    let mut empty = std::io::empty();
    let body: &mut dyn Read = match resp {
        Some(r) => &mut std::io::BufReader::with_capacity(1 << 20, r).take(total - start),
        None => &mut empty,
    };
    let answer = daemon.upload(&at, &headers, total - start, body, &mut |n| {
        done += n;
        progress(done, total);
    })?;
    match answer {
        Ok(v) => Ok(Pulled {
            name: v["name"].as_str().unwrap_or(&name).to_string(),
            path: PathBuf::from(v["path"].as_str().unwrap_or_default()),
            size: num(&v["size"]),
            sha256: v["sha256"].as_str().unwrap_or_default().to_string(),
            already: false,
            projector: None,
        }),
        Err(e) => Err(PullError::Interrupted { name, done, total: total.to_string(), why: e.to_string() }),
    }
}

/// Into a directory of the caller's own: `.FILE.partial` beside the model, opened without
/// following a link, renamed into place once whole and checked.
fn pull_into(
    http: &reqwest::blocking::Client,
    src: &Source,
    store: &Path,
    checks: &Checks<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Pulled, PullError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PullError::Io { path, source }
    };
    std::fs::create_dir_all(store).map_err(io(store))?;
    let path = store.join(&src.file);
    let name = src.file.strip_suffix(".gguf").unwrap_or(&src.file).to_string();
    // Already installed: the same size (and hash, when the hub gives one).
    if let (Ok(meta), Some(size)) = (std::fs::symlink_metadata(&path), src.size) {
        if meta.is_file() && meta.len() == size {
            let mut h = Sha256::new();
            hash_prefix(&path, size, &mut h).map_err(io(&path))?;
            let sha = hex(&h.finalize());
            if src.sha256.as_ref().is_none_or(|s| *s == sha) {
                return Ok(Pulled { name, path, size, sha256: sha, already: true, projector: None });
            }
        }
    }
    let part = store.join(format!(".{}.partial", src.file));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&part)
        .map_err(io(&part))?;
    let mut have = file.metadata().map_or(0, |m| m.len());
    if src.size.is_some_and(|s| have > s) {
        have = 0;
    }
    let (resp, start, total) = open_at(http, src, have)?;
    if let Some(max) = checks.max_bytes.filter(|m| total > *m) {
        return Err(PullError::TooLarge { name, size: total, max });
    }
    file.set_len(start).map_err(io(&part))?;
    let mut hasher = Sha256::new();
    hash_prefix(&part, start, &mut hasher).map_err(io(&part))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = start;
    progress(done, total);
    if let Some(mut resp) = resp {
        while done < total {
            if checks.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                let why = "cancelled; what arrived is kept".to_string();
                return Err(PullError::Interrupted { name, done, total: total.to_string(), why });
            }
            let n = match resp.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n.min(usize::try_from(total - done).unwrap_or(usize::MAX)),
                Err(e) => {
                    return Err(PullError::Interrupted { name, done, total: total.to_string(), why: e.to_string() });
                }
            };
            file.write_all(&buf[..n]).map_err(io(&part))?;
            hasher.update(&buf[..n]);
            done += n as u64;
            progress(done, total);
        }
    }
    file.sync_all().map_err(io(&part))?;
    drop(file);
    if done < total {
        let why = "the server ended the transfer early".to_string();
        return Err(PullError::Interrupted { name, done, total: total.to_string(), why });
    }
    let sha = hex(&hasher.finalize());
    if let Some(want) = src.sha256.as_ref().filter(|w| **w != sha) {
        let _ = std::fs::remove_file(&part);
        return Err(PullError::Corrupt { name, why: format!("SHA-256 {sha} where the source lists {want}") });
    }
    if let Some(Err(why)) = checks.verify.map(|v| v(&part)) {
        let _ = std::fs::remove_file(&part);
        return Err(PullError::Corrupt { name, why });
    }
    std::fs::rename(&part, &path).map_err(io(&path))?;
    Ok(Pulled { name, path, size: done, sha256: sha, already: false, projector: None })
}

/// A user's model store: `$XDG_DATA_HOME/inferd/models` (`~/.local/share/inferd/models`).
pub fn user_store() -> PathBuf {
    std::env::var_os("XDG_DATA_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from(".local/share"))
        .join("inferd/models")
}

/// A progress bar line: `name [#######.............]  35%  47.2 of 135.0 MiB`.
pub fn bar(what: &str, done: u64, total: u64) -> String {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    if total == 0 {
        return format!("{what} {:.1} MiB", mib(done));
    }
    let frac = (done as f64 / total as f64).clamp(0.0, 1.0);
    let filled = (frac * 30.0).round() as usize;
    format!(
        "{what} [{}{}] {:>3.0}%  {:.1} of {:.1} MiB",
        "#".repeat(filled),
        ".".repeat(30 - filled),
        frac * 100.0,
        mib(done),
        mib(total)
    )
}

/// Draws progress on standard error: one line redrawn on a terminal, else a line per tenth.
pub struct Progress {
    what: String,
    tty: bool,
    last: Option<u64>,
}

impl Progress {
    pub fn new(what: &str) -> Progress {
        Progress { what: what.into(), tty: std::io::IsTerminal::is_terminal(&std::io::stderr()), last: None }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        let step = (done * 10).checked_div(total).unwrap_or(done >> 26);
        if self.tty {
            eprint!("\r{}", bar(&self.what, done, total));
        } else if self.last != Some(step) {
            eprintln!("{}", bar(&self.what, done, total));
        }
        self.last = Some(step);
    }

    pub fn finish(&self) {
        if self.tty && self.last.is_some() {
            eprintln!();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use super::*;

    fn entry(path: &str) -> Entry {
        Entry { kind: "file".into(), path: path.into(), size: Some(1), lfs: None }
    }

    #[test]
    fn a_quantization_picks_its_file_and_nothing_else() {
        let e: Vec<Entry> =
            ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m.Q8_0.gguf", "README.md", "big-Q4_K_M-00001-of-00002.gguf"]
                .into_iter()
                .map(entry)
                .collect();
        assert_eq!(choose("o/r", &e, Some("q8_0")).unwrap().path, "m.Q8_0.gguf");
        assert_eq!(choose("o/r", &e, None).unwrap().path, "m-Q4_K_M.gguf");
        assert!(matches!(choose("o/r", &e, Some("Q4_K")), Err(PullError::Choice(m)) if m.contains("no Q4_K file")));
        assert!(matches!(choose("o/r", &e, Some("Q6_K")), Err(PullError::Choice(m)) if m.contains("m.Q8_0.gguf")));
        assert!(matches!(choose("o/r", &[entry("README.md")], None), Err(PullError::Choice(_))));
        assert_eq!(choose("o/r", &[entry("x-F16.gguf")], None).unwrap().path, "x-F16.gguf");
    }

    #[test]
    fn a_projector_is_never_the_model_and_f16_is_preferred() {
        let names =
            ["gemma-3-4b-it-Q8_0.gguf", "mmproj-gemma-3-4b-it-Q8_0.gguf", "mmproj-BF16.gguf", "mmproj-F16.gguf"];
        let e: Vec<Entry> = names.into_iter().map(entry).collect();
        // The only model file, though several GGUF files are listed.
        assert_eq!(choose("o/r", &e, None).unwrap().path, "gemma-3-4b-it-Q8_0.gguf");
        assert_eq!(choose("o/r", &e, Some("Q8_0")).unwrap().path, "gemma-3-4b-it-Q8_0.gguf");
        assert_eq!(choose_projector(&e).unwrap().path, "mmproj-F16.gguf");
        assert_eq!(choose_projector(&e[..3]).unwrap().path, "mmproj-BF16.gguf");
        assert_eq!(choose_projector(&e[..2]).unwrap().path, "mmproj-gemma-3-4b-it-Q8_0.gguf");
        assert!(choose_projector(&e[..1]).is_none());
    }

    #[test]
    fn references_are_hub_files_or_urls() {
        let http = client().unwrap();
        assert!(matches!(resolve(&http, "llama3"), Err(PullError::BadRef(_))));
        assert!(matches!(resolve(&http, "hf:only-org"), Err(PullError::BadRef(_))));
        assert!(matches!(resolve(&http, "hf:a/../b"), Err(PullError::BadRef(_))));
        let s = resolve(&http, "https://example.invalid/x/model.Q4_0.gguf?download=1").unwrap();
        assert_eq!(s.file, "model.Q4_0.gguf");
        assert!(matches!(resolve(&http, "https://example.invalid/x/page.html"), Err(PullError::Choice(_))));
        // Ollama's spelling of a hub file is a hub reference (checked before any request).
        assert!(matches!(resolve(&http, "hf.co/only-org:Q4_K_M"), Err(PullError::BadRef(_))));
        assert!(matches!(resolve(&http, "huggingface.co/a/../b"), Err(PullError::BadRef(_))));
        assert!(bar("m", 50, 100).contains(" 50%"), "{}", bar("m", 50, 100));
    }
}
