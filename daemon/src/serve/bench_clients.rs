//! `inferd bench --serving`, the part measured through the daemon's socket: a real
//! `inferd serve` process and clients on threads, as applications would use it.
//!
//! - Serving overhead: 16 concurrent streaming clients (greedy, 128 tokens each, 16 different
//!   prompts) against the same 16 requests submitted straight to an in-process engine loop
//!   (the engine's own batch-16 throughput, sessions and plugins included, no HTTP). Run
//!   alternately, twice, so machine noise shows.
//! - Prefix caching: TTFT of a chat request whose 1,000-token system prompt is already cached
//!   (another user question after it) against the same request with a system prompt never seen;
//!   and four requests with the same new system prompt at once.

use inferctl::client::Client;
use inferd_engine::decode::store::EngineStore;
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::Registry;
use inferd_engine::sched::{engine_loop, Command, Event, LoopConfig, Submission};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const CLIENTS: usize = 16;
const TOKENS: u32 = 128;

fn prompts() -> Vec<String> {
    [
        "dragons",
        "the sea",
        "a lighthouse",
        "bread",
        "the moon",
        "a robot",
        "winter",
        "a library",
        "trains",
        "bees",
        "a volcano",
        "chess",
        "a garden",
        "the desert",
        "music",
        "a bridge",
    ]
    .iter()
    .map(|t| format!("Write a long story about {t}. Once upon a time,"))
    .collect()
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(0.0)
}

/// The 16 requests straight into an engine loop: tokens per second.
fn engine_only(model: &Model, reg: &Registry, threads: usize) -> anyhow::Result<Value> {
    let mut engine = Engine::cpu(model, &EngineOptions { threads, ..EngineOptions::default() })?;
    let greedy = reg.get("greedy")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let (dtx, drx) = std::sync::mpsc::channel::<(usize, f64)>();
    let eos = model.tokenizer.eos().to_vec();
    let start = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<Value> {
        let engine = &mut engine;
        s.spawn(move || {
            engine_loop(
                &mut EngineStore::new(engine),
                &rx,
                &LoopConfig {
                    token_budget: 512,
                    max_running: 64,
                    eos,
                    monitor: None,
                    vocabulary: None,
                    kv_release_after: None,
                    prefix_sharing: Default::default(),
                },
            )
        });
        for (i, p) in prompts().iter().enumerate() {
            let dtx = dtx.clone();
            let (mut n, mut first) = (0usize, None);
            let events = Box::new(move |e: Event| {
                match e {
                    Event::Token { .. } => {
                        n += 1;
                        first.get_or_insert(start.elapsed().as_secs_f64());
                    }
                    Event::Finished(_) | Event::Failed(_) => {
                        let _ = dtx.send((n, first.unwrap_or(0.0)));
                    }
                }
                true
            });
            let sub = Submission {
                id: i as u64,
                strategy: greedy.clone(),
                prompt: model.tokenizer.encode(p, false)?,
                params: "{}".into(),
                max_tokens: TOKENS,
                n: 1,
                seed: 0,
                logprobs: None,
                meta: Default::default(),
                events,
                grammar: None,
                images: Vec::new(),
            };
            tx.send(Command::Submit(sub)).map_err(|_| anyhow::anyhow!("the engine loop stopped"))?;
        }
        let mut tokens = 0;
        let mut ttft = Vec::new();
        for _ in 0..CLIENTS {
            let (n, t) = drx.recv()?;
            tokens += n;
            ttft.push(t);
        }
        let wall = start.elapsed().as_secs_f64();
        let _ = tx.send(Command::Shutdown);
        Ok(
            json!({ "tokens": tokens, "seconds": wall, "tok_s": tokens as f64 / wall, "ttft_p50_s": percentile(ttft.clone(), 0.5), "ttft_p99_s": percentile(ttft, 0.99) }),
        )
    })
}

/// A running `inferd serve` on a private socket, stopped when dropped.
struct Daemon {
    child: std::process::Child,
    client: Client,
    dir: std::path::PathBuf,
}

impl Daemon {
    fn start(model: &Path, threads: usize) -> anyhow::Result<Daemon> {
        let dir = std::env::temp_dir().join(format!("inferd-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("inferd.sock");
        let cfg = dir.join("inferd.toml");
        std::fs::write(&cfg, "[server]\ndbus = false\n")?;
        let child = std::process::Command::new(std::env::current_exe()?)
            .args(["serve", "--user", "--config"])
            .arg(&cfg)
            .arg("--model")
            .arg(model)
            .arg("--socket")
            .arg(&socket)
            .args(["--threads", &threads.to_string()])
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let client = Client::new(&socket);
        let t0 = Instant::now();
        while client.json("GET", "/health", None).is_err() {
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(60), "the daemon did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Daemon { child, client, dir })
    }

    fn generated(&self) -> anyhow::Result<u64> {
        let s = self.client.json("GET", "/v1/status", None)?;
        s["models"][0]["tokens"]["generated"].as_u64().ok_or_else(|| anyhow::anyhow!("no token count in /v1/status"))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Streams `body` to `path`; returns the seconds to the first piece of text.
fn ttft(client: &Client, path: &str, body: &Value) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut first = None;
    client.stream(path, body, &mut |ev| {
        let c = &ev["choices"][0];
        let text = c["text"].as_str().or_else(|| c["delta"]["content"].as_str()).unwrap_or("");
        if !text.is_empty() {
            first.get_or_insert(t0.elapsed().as_secs_f64());
        }
    })?;
    first.ok_or_else(|| anyhow::anyhow!("no text came back"))
}

/// The 16 streaming clients against a fresh daemon.
fn over_socket(model: &Path, threads: usize) -> anyhow::Result<Value> {
    let d = Daemon::start(model, threads)?;
    let before = d.generated()?;
    let start = Instant::now();
    let results: Vec<anyhow::Result<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts()
            .into_iter()
            .map(|p| {
                let client = &d.client;
                s.spawn(move || {
                    ttft(
                        client,
                        "/v1/completions",
                        &json!({ "prompt": p, "max_tokens": TOKENS, "temperature": 0, "stream": true }),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a client panicked")))).collect()
    });
    let wall = start.elapsed().as_secs_f64();
    let ttfts = results.into_iter().collect::<anyhow::Result<Vec<f64>>>()?;
    let tokens = d.generated()? - before;
    Ok(
        json!({ "tokens": tokens, "seconds": wall, "tok_s": tokens as f64 / wall, "ttft_p50_s": percentile(ttfts.clone(), 0.5), "ttft_p99_s": percentile(ttfts, 0.99) }),
    )
}

/// TTFT with a cached 1,000-token system prompt against a cold one.
fn prefix_cache(model_path: &Path, model: &Model, threads: usize) -> anyhow::Result<Value> {
    let d = Daemon::start(model_path, threads)?;
    let system = |topic: &str| {
        let mut s = format!("You are the assistant of a company that makes {topic}. Rules and facts follow. ");
        let mut i = 0;
        while model.tokenizer.encode(&s, false).map(|t| t.len()).unwrap_or(0) < 1000 {
            s.push_str(&format!("Rule {i}: answer questions about {topic} politely, briefly and in plain words. "));
            i += 1;
        }
        s
    };
    let ask = |sys: &str, q: &str| json!({ "messages": [{ "role": "system", "content": sys }, { "role": "user", "content": q }], "max_tokens": 1, "temperature": 0, "stream": true });
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    let mut prompt_tokens = 0;
    for topic in ["bicycles", "teapots", "umbrellas", "pianos", "lamps"] {
        let sys = system(topic);
        prompt_tokens = model.tokenizer.encode(&sys, false)?.len();
        cold.push(ttft(&d.client, "/v1/chat/completions", &ask(&sys, "What do you sell?"))?);
        warm.push(ttft(&d.client, "/v1/chat/completions", &ask(&sys, "Where is your shop?"))?);
        warm.push(ttft(&d.client, "/v1/chat/completions", &ask(&sys, "Do you ship abroad?"))?);
    }
    // Four apps send the same new system prompt at the same moment: it is prefilled once (the
    // others wait for it and hit the cache), so the last of them is answered about when one
    // cold request would be.
    let sys = system("kettles");
    let together: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = ["Do you ship?", "Are they steel?", "Any in red?", "How much?"]
            .iter()
            .map(|q| {
                let (client, body) = (&d.client, ask(&sys, q));
                s.spawn(move || ttft(client, "/v1/chat/completions", &body))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a client panicked"))))
            .collect::<anyhow::Result<Vec<f64>>>()
    })?;
    let s = d.client.json("GET", "/v1/status", None)?;
    let (c, w) = (percentile(cold.clone(), 0.5), percentile(warm.clone(), 0.5));
    Ok(json!({
        "system_prompt_tokens": prompt_tokens,
        "ttft_cold_s": cold, "ttft_cached_s": warm,
        "ttft_cold_p50_s": c, "ttft_cached_p50_s": w,
        "speedup": c / w,
        "four_at_once_ttft_s": together.clone(),
        "four_at_once_last_over_cold": together.iter().copied().fold(0.0, f64::max) / c,
        "prompt_tokens_cached": s["models"][0]["tokens"]["prompt_cached"],
        "prompt_tokens": s["models"][0]["tokens"]["prompt"],
    }))
}

pub fn run(model_path: &Path, model: &Model, reg: &Registry, threads: usize) -> anyhow::Result<Value> {
    let mut rounds = Vec::new();
    for _ in 0..2 {
        let engine = engine_only(model, reg, threads)?;
        let socket = over_socket(model_path, threads)?;
        let overhead = 1.0 - socket["tok_s"].as_f64().unwrap_or(0.0) / engine["tok_s"].as_f64().unwrap_or(1.0);
        rounds.push(json!({ "engine_loop": engine, "socket_16_streams": socket, "serving_overhead": overhead }));
    }
    Ok(json!({
        "serving_overhead": { "workload": "16 concurrent greedy requests, 128 tokens each, 16 different prompts", "rounds": rounds },
        "prefix_cache": prefix_cache(model_path, model, threads)?,
    }))
}
