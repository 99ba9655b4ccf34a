//! `inferctl`: the command-line client of the inferd daemon, over its Unix socket (the binary
//! `src/main.rs` calls [`main`]); [`client`] is the blocking HTTP client under it.
//!
//! ```text
//! inferctl [--socket PATH] status | models | load NAME | unload NAME | pull REF | rm NAME
//!          | plugins | tokenize TEXT | generate PROMPT | chat
//! ```
//!
//! `generate` and `chat` stream text to the terminal as it comes; `chat` keeps the conversation
//! (one user message per input line; `/reset` starts over). Options mirror `inferd run`.

#![forbid(unsafe_code)]

pub mod client;
pub mod pull;

use clap::{Args, Parser, Subcommand};
use client::{default_socket, Client, ClientError};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "inferctl", version, about = "Talk to the inferd daemon")]
pub struct Cli {
    /// The daemon's socket (default: $INFERD_SOCKET, the user daemon's
    /// $XDG_RUNTIME_DIR/inferd/inferd.sock when it exists, else /run/inferd/inferd.sock).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The daemon's state: models, KV blocks, requests, uptime.
    Status {
        /// Print the raw JSON of /v1/status.
        #[arg(long)]
        json: bool,
    },
    /// The models the daemon serves (its model store's and the configured ones), loaded or not, and the
    /// remote ones its upstreams serve (state "remote").
    Models,
    /// Load model NAME now, with a progress bar (a request would load it on first use).
    Load {
        name: String,
        /// How long it stays loaded once idle ("10m", "0", "-1"; default: the configured one).
        #[arg(long, allow_hyphen_values = true)]
        keep_alive: Option<String>,
    },
    /// Unload model NAME as soon as no request uses it (the next request loads it again).
    Unload { name: String },
    /// Install a model into the daemon's model store: hf:ORG/REPO[:QUANT] (a GGUF file of a
    /// Hugging Face repository, checked against the hub's SHA-256) or an https:// URL. This
    /// client downloads and the daemon writes its store (model management: see `manage` in
    /// inferd.toml(5)). An interrupted pull resumes where it stopped. A repository's vision
    /// projector (mmproj, F16 preferred) comes along as NAME.mmproj.gguf.
    Pull {
        reference: String,
        /// The file's SHA-256 in hex, checked before it is installed (a hub's is checked anyway).
        #[arg(long)]
        sha256: Option<String>,
        /// Write into this directory instead of the daemon's store (default: the running
        /// daemon's store, else the user's own when no daemon runs).
        #[arg(long)]
        store: Option<PathBuf>,
    },
    /// Remove model NAME from the daemon's model store (unloaded first).
    Rm { name: String },
    /// The loaded decoding strategies and the plugin files that were refused.
    Plugins,
    /// Token ids of TEXT as a JSON array.
    Tokenize {
        #[arg(long)]
        model: Option<String>,
        /// Parse special-token text such as <|im_start|>.
        #[arg(long)]
        special: bool,
        text: String,
    },
    /// Generate text from PROMPT, streamed to stdout.
    Generate {
        #[command(flatten)]
        opts: GenOptions,
        /// Wrap the prompt as a user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        prompt: String,
    },
    /// An interactive chat: each input line is a user message; the answer streams back.
    Chat {
        #[command(flatten)]
        opts: GenOptions,
        /// A system message to start the conversation with.
        #[arg(long)]
        system: Option<String>,
        /// An image file (PNG, JPEG, WebP, GIF) sent with the first message, for a model with a
        /// vision projector; may be given several times.
        #[arg(long, value_name = "FILE")]
        image: Vec<std::path::PathBuf>,
    },
}

/// The options of `inferd run`, plus the common sampling fields.
#[derive(Args, Clone)]
struct GenOptions {
    /// A model's name (default: the daemon's default model, server.default_model).
    #[arg(long)]
    model: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Decoding strategy (a loaded plugin's strategy name; default: greedy).
    #[arg(long)]
    decoder: Option<String>,
    /// The strategy's parameters as a JSON object.
    #[arg(long)]
    params: Option<String>,
    /// Seed of the random draws.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Scheduling class: interactive (default) or background.
    #[arg(long)]
    priority: Option<String>,
}

impl GenOptions {
    fn body(&self) -> Result<serde_json::Map<String, Value>, String> {
        let mut m = serde_json::Map::new();
        m.insert("max_tokens".into(), json!(self.max_tokens));
        m.insert("stream".into(), json!(true));
        m.insert("decoder".into(), json!(self.decoder.as_deref().unwrap_or("greedy")));
        if let Some(p) = &self.params {
            let v: Value = serde_json::from_str(p).map_err(|e| format!("--params is not JSON: {e}"))?;
            m.insert("decoder_params".into(), v);
        }
        for (k, v) in [
            ("model", self.model.as_ref().map(|x| json!(x))),
            ("seed", self.seed.map(|x| json!(x))),
            ("priority", self.priority.as_ref().map(|x| json!(x))),
        ] {
            if let Some(v) = v {
                m.insert(k.into(), v);
            }
        }
        if !self.stop.is_empty() {
            m.insert("stop".into(), json!(self.stop));
        }
        Ok(m)
    }
}

/// `inferctl`'s entry point.
pub fn main() {
    let cli = Cli::parse();
    let socket = cli.socket.clone().unwrap_or_else(default_socket);
    let client = Client::new(&socket);
    if let Err(e) = run(&client, cli.cmd) {
        eprintln!("inferctl: {e}");
        std::process::exit(1);
    }
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{0}")]
    Usage(String),
    #[error("writing the output: {0}")]
    Io(#[from] std::io::Error),
}

fn run(client: &Client, cmd: Cmd) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    match cmd {
        Cmd::Status { json } => {
            let s = client.json("GET", "/v1/status", None)?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&s).unwrap_or_default())?;
                return Ok(());
            }
            writeln!(
                out,
                "inferd: {}, up {:.0} s",
                s["status"].as_str().unwrap_or("?"),
                s["uptime_seconds"].as_f64().unwrap_or(0.0)
            )?;
            for m in s["models"].as_array().into_iter().flatten() {
                if m["loaded"] == false {
                    writeln!(
                        out,
                        "model {}: not loaded (loads so far: {})",
                        m["name"].as_str().unwrap_or("?"),
                        m["loads"]
                    )?;
                    continue;
                }
                let (kv, rq, tk) = (&m["kv_blocks"], &m["requests"], &m["tokens"]);
                writeln!(out, "model {}: {} running, {} waiting; KV blocks {} used of {} ({} cached); {} tokens generated, {:.1} tok/s", m["name"].as_str().unwrap_or("?"), rq["running"], rq["waiting"], kv["used"], kv["total"], kv["cached"], tk["generated"], tk["per_second"].as_f64().unwrap_or(0.0))?;
                if let Some(b) = m["backend"].as_str() {
                    writeln!(out, "  on {b}")?;
                }
                let d = &m["device_memory"];
                if let (Some(w), Some(kv)) = (d["weights_bytes"].as_u64(), d["kv_bytes"].as_u64()) {
                    writeln!(out, "  GPU memory: weights {} MiB, KV pool {} MiB", w >> 20, kv >> 20)?;
                }
            }
            let names: Vec<&str> =
                s["strategies"].as_array().into_iter().flatten().filter_map(|x| x["name"].as_str()).collect();
            writeln!(out, "strategies: {}", names.join(", "))?;
        }
        Cmd::Models => {
            let v = client.json("GET", "/v1/models", None)?;
            writeln!(out, "NAME\tSTATE\tSIZE\tTYPE\tARCH\tCONTEXT\tROLES")?;
            for m in v["data"].as_array().into_iter().flatten() {
                let roles: Vec<&str> = m["roles"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                let state = match (m["remote"] == true, m["loaded"] == false) {
                    (true, _) => "remote",
                    (false, true) => "not-loaded",
                    (false, false) => "loaded",
                };
                let f = &m["inferd"];
                let size = f["size"].as_u64().map_or_else(|| "-".into(), |b| format!("{:.1}MiB", b as f64 / 1048576.0));
                let text = |k: &str| f[k].as_str().unwrap_or("-").to_string();
                let ctx = f["trained_context_length"].as_u64().map_or_else(|| "-".into(), |c| c.to_string());
                writeln!(
                    out,
                    "{}\t{state}\t{size}\t{}\t{}\t{ctx}\t{}",
                    m["id"].as_str().unwrap_or("?"),
                    text("file_type"),
                    text("architecture"),
                    roles.join(",")
                )?;
            }
        }
        Cmd::Load { name, keep_alive } => {
            let body = json!({ "keep_alive": keep_alive });
            let mut bar = pull::Progress::new(&name);
            let mut result = None;
            client.lines("POST", &format!("/v1/models/{name}/load"), &body, &mut |v| {
                if v["status"] == "loading" {
                    bar.update(v["completed"].as_u64().unwrap_or(0), v["total"].as_u64().unwrap_or(0));
                } else {
                    result = Some(v);
                }
            })?;
            bar.finish();
            match result {
                Some(v) if v["status"] == "success" => {
                    let how = if v["was_loaded"] == true { "already loaded" } else { "loaded" };
                    writeln!(out, "{name}: {how}")?;
                }
                Some(v) => return Err(Error::Usage(v["error"].as_str().unwrap_or("the load failed").to_string())),
                None => return Err(Error::Usage("the daemon ended the load without an answer".into())),
            }
        }
        Cmd::Pull { reference, sha256, store } => {
            // The daemon never downloads (the system daemon has no network): this client does,
            // and the daemon writes what it sends into its store.
            let mut bar = pull::Progress::new(&reference);
            let sha = sha256.as_deref();
            let pulled = match store {
                Some(dir) => pull::pull(&reference, pull::Target::Dir(&dir), sha, &mut |d, t| bar.update(d, t)),
                None => match client.json("GET", "/health", None) {
                    Err(ClientError::NotRunning(_)) | Err(ClientError::Refused(_)) => {
                        let dir = pull::user_store();
                        pull::pull(&reference, pull::Target::Dir(&dir), sha, &mut |d, t| bar.update(d, t))
                    }
                    _ => pull::pull(&reference, pull::Target::Daemon(client), sha, &mut |d, t| bar.update(d, t)),
                },
            };
            bar.finish();
            let p = pulled.map_err(|e| Error::Usage(e.to_string()))?;
            for line in p.report() {
                writeln!(out, "{line}")?;
            }
        }
        Cmd::Rm { name } => {
            let name = name.strip_suffix(":latest").unwrap_or(&name).to_string();
            client.json("DELETE", &format!("/v1/models/{name}"), None)?;
            writeln!(out, "{name}: removed")?;
        }
        Cmd::Unload { name } => {
            // Ollama's way: an empty generate request with keep_alive 0.
            let v = client.json("POST", "/api/generate", Some(&json!({ "model": name, "keep_alive": 0 })))?;
            writeln!(out, "{name}: {}", if v["done_reason"] == "unload" { "unloading once idle" } else { "?" })?;
        }
        Cmd::Plugins => {
            let s = client.json("GET", "/v1/status", None)?;
            for p in s["strategies"].as_array().into_iter().flatten() {
                let q = if p["quarantined"].as_bool() == Some(true) { " (quarantined)" } else { "" };
                writeln!(
                    out,
                    "{}\t{} {}\t{}{q}",
                    p["name"].as_str().unwrap_or("?"),
                    p["plugin"].as_str().unwrap_or("?"),
                    p["version"].as_str().unwrap_or("?"),
                    p["path"].as_str().unwrap_or("?")
                )?;
            }
            for r in s["plugins_refused"].as_array().into_iter().flatten() {
                writeln!(out, "refused: {}", r.as_str().unwrap_or("?"))?;
            }
        }
        Cmd::Tokenize { model, special, text } => {
            let v = client.json(
                "POST",
                "/tokenize",
                Some(&json!({ "model": model, "content": text, "parse_special": special })),
            )?;
            writeln!(out, "{}", v["tokens"])?;
        }
        Cmd::Generate { opts, chat, prompt } => {
            let mut body = opts.body().map_err(Error::Usage)?;
            let path = if chat {
                body.insert("messages".into(), json!([{ "role": "user", "content": prompt }]));
                "/v1/chat/completions"
            } else {
                body.insert("prompt".into(), json!(prompt));
                "/v1/completions"
            };
            stream_text(client, path, &Value::Object(body), &mut out)?;
            writeln!(out)?;
        }
        Cmd::Chat { opts, system, image } => {
            let body = opts.body().map_err(Error::Usage)?;
            let mut images = image.iter().map(|p| image_part(p)).collect::<Result<Vec<Value>, Error>>()?;
            let mut messages: Vec<Value> = system.iter().map(|s| json!({ "role": "system", "content": s })).collect();
            let first = messages.clone();
            let stdin = std::io::stdin();
            let interactive = std::io::IsTerminal::is_terminal(&stdin);
            loop {
                if interactive {
                    write!(out, "> ")?;
                    out.flush()?;
                }
                let mut line = String::new();
                if stdin.lock().read_line(&mut line)? == 0 {
                    break;
                }
                let line = line.trim();
                match line {
                    "" => continue,
                    "/reset" => {
                        messages = first.clone();
                        continue;
                    }
                    "/quit" | "/exit" => break,
                    _ => {}
                }
                if images.is_empty() {
                    messages.push(json!({ "role": "user", "content": line }));
                } else {
                    // The images go with the first message, before its text.
                    images.push(json!({ "type": "text", "text": line }));
                    messages.push(json!({ "role": "user", "content": std::mem::take(&mut images) }));
                }
                let mut b = body.clone();
                b.insert("messages".into(), Value::Array(messages.clone()));
                let answer = stream_text(client, "/v1/chat/completions", &Value::Object(b), &mut out)?;
                writeln!(out)?;
                messages.push(json!({ "role": "assistant", "content": answer }));
            }
        }
    }
    Ok(())
}

/// An image file as an OpenAI content part: a `data:` URL, its type read from its first bytes.
fn image_part(path: &std::path::Path) -> Result<Value, Error> {
    use base64::Engine as _;
    let bytes = std::fs::read(path).map_err(|e| Error::Usage(format!("reading {}: {e}", path.display())))?;
    let kind = match bytes.as_slice() {
        [0x89, b'P', b'N', b'G', ..] => "image/png",
        [0xff, 0xd8, ..] => "image/jpeg",
        [b'G', b'I', b'F', ..] => "image/gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "image/webp",
        _ => return Err(Error::Usage(format!("{} is not a PNG, JPEG, WebP or GIF image", path.display()))),
    };
    let url = format!("data:{kind};base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes));
    Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
}

/// Streams a completion's text (choice 0) to `out` as it arrives; returns the whole text.
fn stream_text(client: &Client, path: &str, body: &Value, out: &mut impl Write) -> Result<String, Error> {
    let mut text = String::new();
    let mut failed = None;
    let mut bar: Option<pull::Progress> = None;
    client.stream(path, body, &mut |ev| {
        // `loading NAME 42% (D of T bytes)`: the model loads before the first token.
        if let Some(c) = ev["comment"].as_str() {
            let words: Vec<&str> = c.split_whitespace().collect();
            if let ["loading", name, _, d, "of", t, ..] = words.as_slice() {
                let num = |x: &str| x.trim_start_matches('(').parse::<u64>().unwrap_or(0);
                bar.get_or_insert_with(|| pull::Progress::new(name)).update(num(d), num(t));
            }
            return;
        }
        if let Some(b) = bar.take() {
            b.finish();
        }
        let c = &ev["choices"][0];
        let piece = c["text"].as_str().or_else(|| c["delta"]["content"].as_str()).unwrap_or("");
        text.push_str(piece);
        if let Err(e) = out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
            failed.get_or_insert(e);
        }
    })?;
    match failed {
        Some(e) => Err(Error::Io(e)),
        None => Ok(text),
    }
}
