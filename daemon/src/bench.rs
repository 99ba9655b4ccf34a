//! `inferd bench`: prefill and decode throughput, time to first token and peak memory, as JSON,
//! optionally side by side with llama.cpp's own tools on the same file and thread count.
//!
//! The workload mirrors llama.cpp's: `llama-bench` pp512/tg128 and `llama-batched-bench` with
//! 128-token prompts and 128 generated tokens per sequence. Prompts are pseudo-random ordinary
//! tokens, each distinct so the prefix cache never shortcuts a measurement.

use inferd_engine::backend::profile::{Phase, StepProfile};
use inferd_engine::backend::{BackendKind, KernelProfile, KernelTime};
use inferd_engine::engine::{argmax, Engine, EngineOptions, RunItem};
use inferd_engine::kv::SeqId;
use inferd_engine::model::Model;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct BenchArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The backend to measure: "cpu", "cuda" or "auto" (as in inferd.toml).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// Context the prefill measurement's prompt continues: a sequence of this many tokens is
    /// prefilled first, untimed (llama-bench's `-d`, passed on to it with --llama-cpp).
    #[arg(long, default_value_t = 0)]
    pub prefill_depth: usize,
    /// Most prompt tokens one forward pass takes (a longer prompt is prefilled in chunks).
    #[arg(long, default_value_t = EngineOptions::default().prefill_chunk)]
    pub prefill_chunk: usize,
    /// Prompt length per sequence in the decode measurements.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per sequence in the decode measurements.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Batch sizes of the decode measurements.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub batches: Vec<usize>,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Also run llama.cpp's llama-bench and llama-batched-bench from this directory
    /// (see tests/bench/build-llama-cpp) and report the ratios.
    #[arg(long)]
    pub llama_cpp: Option<PathBuf>,
    /// Measure decoding strategies instead: plugin ABI overhead, speculative decoding speed-up
    /// and acceptance, beam search KV blocks.
    #[arg(long)]
    pub decoders: bool,
    /// With --decoders: also measure speculative decoding with this draft model; with
    /// --speculative: the draft model measured.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// Measure speculative decoding on code completion instead: greedy against prompt lookup
    /// and the draft model (--draft-model) at several draft lengths, on code prefixes and
    /// fill-in-the-middle gaps.
    #[arg(long)]
    pub speculative: bool,
    /// Measure an editor's completion loop instead: fill-in-the-middle requests as an editor
    /// plugin sends them while a line is typed in a 2,000-token file (time to first token and
    /// to the whole completion, prefix cache reuse), greedy and with --draft-model.
    #[arg(long)]
    pub editor: bool,
    /// Measure accuracy instead: the KL divergence of the model's next-token distributions from
    /// the reference log-probabilities in this file, written by llama.cpp's `llama-perplexity
    /// -m F32.gguf -f TEXT --kl-divergence-base FILE` (tests/bench/kl-divergence runs it all).
    #[arg(long, value_name = "FILE")]
    pub kl_divergence: Option<PathBuf>,
    /// With --kl-divergence: another run's log-probabilities of the same tokens (llama.cpp's
    /// of the same quantized model): its figures too, and where the two disagree, which is
    /// closer to the reference.
    #[arg(long, value_name = "FILE", requires = "kl_divergence")]
    pub versus: Option<PathBuf>,
    /// With --kl-divergence: only the first N chunks of the file.
    #[arg(long, requires = "kl_divergence")]
    pub chunks: Option<usize>,
    /// Measure the engine loop instead: continuous against static batching (max batch 8).
    #[arg(long)]
    pub serving: bool,
    /// With --decoders or --serving: plugin directories (default: as `inferd run`).
    #[arg(long = "plugin-dir")]
    pub plugin_dirs: Vec<PathBuf>,
}

/// Deterministic ordinary (non-special) token ids.
pub(crate) fn prompt(len: usize, salt: u64, vocab: usize, skip: usize) -> Vec<u32> {
    let mut x = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (skip + (x as usize) % (vocab - skip)) as u32
        })
        .collect()
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Peak resident memory of this process, in MiB (Linux `VmHWM`).
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Prefills `p` as one new sequence, or, after `depth` tokens of context (untimed, and any
/// profile they left dropped), as their continuation; returns the sequence and the time `p`
/// took.
fn prefill_after(engine: &mut Engine, depth: &[u32], p: &[u32]) -> anyhow::Result<(SeqId, Duration)> {
    if depth.is_empty() {
        let t = Instant::now();
        let (s, _) = engine.prefill(&[p])?.remove(0);
        return Ok((s, t.elapsed()));
    }
    let (s, _) = engine.prefill(&[depth])?.remove(0);
    engine.backend.take_profile();
    engine.backend.take_kernel_profile()?;
    let t = Instant::now();
    if let Err(e) = engine.step(&[RunItem::logits(s, p, 1)]) {
        engine.release(s);
        return Err(e.into());
    }
    Ok((s, t.elapsed()))
}

pub fn run(model: &Model, args: &BenchArgs) -> anyhow::Result<Value> {
    let vocab = model.config.vocab;
    let skip = model.tokenizer.vocab_size().min(vocab).min(256);
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let kv_tokens =
        (max_batch * (args.prompt_tokens + args.gen_tokens)).max(args.prefill_depth + args.prefill_tokens) * 2;
    let opts = EngineOptions {
        threads: args.threads,
        // And a hybrid model's recurrent states for every sequence of the largest batch (the
        // backend gives states their share of the budget).
        kv_budget_bytes: kv_tokens * inferd_engine::backend::cpu::kv_block_bytes(&model.config, 16) / 16
            + inferd_engine::backend::cpu::STATE_SHARE
                * (max_batch + 1)
                * inferd_engine::backend::cpu::state_bytes(&model.arch),
        prefill_chunk: args.prefill_chunk.max(1),
        ..EngineOptions::default()
    };
    let kind = BackendKind::parse(&args.backend)
        .ok_or_else(|| anyhow::anyhow!("--backend must be \"auto\", \"cpu\" or \"cuda\", not {:?}", args.backend))?;
    let mut engine = Engine::open(model, kind, &opts)?;
    let threads = opts.threads();
    let reps = args.repeat.max(1);
    let mut salt = 1u64;
    let mut next = || {
        salt += 1;
        salt
    };

    // Warm-up: touch every weight page once.
    let (s, _) = engine.prefill(&[&prompt(16, next(), vocab, skip)])?.remove(0);
    engine.release(s);

    let mut pp = Vec::new();
    for _ in 0..reps {
        let depth = prompt(args.prefill_depth, next(), vocab, skip);
        let (s, took) = prefill_after(&mut engine, &depth, &prompt(args.prefill_tokens, next(), vocab, skip))?;
        pp.push(args.prefill_tokens as f64 / took.as_secs_f64());
        engine.release(s);
    }
    let mut ttft = Vec::new();
    for _ in 0..reps {
        let p = prompt(args.prompt_tokens, next(), vocab, skip);
        let t = Instant::now();
        let (s, logits) = engine.prefill(&[&p])?.remove(0);
        std::hint::black_box(argmax(&logits));
        ttft.push(t.elapsed().as_secs_f64() * 1000.0);
        engine.release(s);
    }
    let mut decode = serde_json::Map::new();
    let mut host_issue_b1 = None;
    for &b in &args.batches {
        let mut rates = Vec::new();
        for _ in 0..reps {
            let prompts: Vec<Vec<u32>> = (0..b).map(|_| prompt(args.prompt_tokens, next(), vocab, skip)).collect();
            let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let started = engine.prefill(&refs)?;
            engine.backend.take_kernel_profile()?;
            let mut step: Vec<_> = started.iter().map(|(s, l)| (*s, argmax(l))).collect();
            let t = Instant::now();
            for _ in 1..args.gen_tokens {
                let logits = engine.decode(&step)?;
                for (j, st) in step.iter_mut().enumerate() {
                    st.1 = argmax(&logits[j * vocab..(j + 1) * vocab]);
                }
            }
            rates.push((b * (args.gen_tokens - 1)) as f64 / t.elapsed().as_secs_f64());
            if let (1, Some(p)) = (b, engine.backend.take_kernel_profile()?) {
                host_issue_b1 = Some(p.host_issue.as_secs_f64() * 1e3 / (args.gen_tokens - 1) as f64);
            }
            started.iter().for_each(|(s, _)| engine.release(*s));
        }
        decode.insert(b.to_string(), json!(median(rates)));
    }
    // Where a batch-1 decode step goes, in a run of its own so the clocks cost the figures above
    // nothing; on a GPU, the device's time per kernel (events around each launch) for one
    // prefill and for those steps.
    let mut profile = None;
    let mut prefill_profile = None;
    let mut kernels = serde_json::Map::new();
    if engine.backend.set_profiling(true) {
        let depth = prompt(args.prefill_depth, next(), vocab, skip);
        let (s, took) = prefill_after(&mut engine, &depth, &prompt(args.prefill_tokens, next(), vocab, skip))?;
        prefill_profile = engine.backend.take_profile();
        if let Some(p) = engine.backend.take_kernel_profile()? {
            let passes = args.prefill_tokens.div_ceil(opts.prefill_chunk);
            kernels.insert("prefill".into(), kernel_report(&p, passes, took));
        }
        engine.release(s);
        let (s, l) = engine.prefill(&[&prompt(args.prompt_tokens, next(), vocab, skip)])?.remove(0);
        engine.backend.take_profile();
        engine.backend.take_kernel_profile()?;
        let mut tok = argmax(&l);
        let t = Instant::now();
        for _ in 1..args.gen_tokens {
            tok = argmax(engine.decode(&[(s, tok)])?);
        }
        let wall = t.elapsed();
        profile = engine.backend.take_profile();
        if let Some(p) = engine.backend.take_kernel_profile()? {
            kernels.insert("decode_batch1".into(), kernel_report(&p, args.gen_tokens - 1, wall));
        }
        engine.backend.set_profiling(false);
        engine.release(s);
    }
    let mut report = json!({
        "model": model.path.display().to_string(),
        "backend": engine.backend.name(),
        "device": engine.backend.device(),
        "threads": threads,
        "prefill_tokens": args.prefill_tokens,
        "prefill_depth": args.prefill_depth,
        "prefill_tok_s": median(pp),
        "ttft_ms": { "prompt_tokens": args.prompt_tokens, "median": median(ttft) },
        "decode_tok_s": { "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "by_batch": decode },
        "peak_rss_mib": peak_rss_mib(),
    });
    // Batch-1 decode reads every weight once per token: the share of the machine's read
    // bandwidth that reaches. On a GPU: the bandwidth and matmul rate reached, for comparison
    // with the card's ceilings.
    let bytes = crate::bandwidth::weight_bytes_per_token(model);
    if let Some(d) = engine.backend.device_memory() {
        let b1 = report["decode_tok_s"]["by_batch"]["1"].as_f64();
        let flop_per_token = 2.0 * matmul_params(model) as f64;
        report["gpu"] = json!({
            "weights_bytes": d.weights_bytes,
            "kv_bytes": d.kv_bytes,
            "decode_batch1_weights_gb_s": b1.map(|r| r * bytes as f64 / 1e9),
            "prefill_tflop_s": report["prefill_tok_s"].as_f64().map(|r| r * flop_per_token / 1e12),
            "decode_batch1_host_issue_ms": host_issue_b1,
            "kernels": kernels,
        });
        return Ok(report);
    }
    let gbs = crate::bandwidth::read_gb_s(threads);
    report["memory"] = json!({ "read_gb_s": gbs, "weights_read_per_token_mb": bytes as f64 / 1e6 });
    if let Some(b1) = report["decode_tok_s"]["by_batch"]["1"].as_f64() {
        report["memory"]["decode_batch1_share_of_read_bandwidth"] = json!(b1 * bytes as f64 / 1e9 / gbs);
    }
    if let Some(p) = profile.filter(|p| p.passes > 0) {
        report["decode_batch1_step"] = step_report(&p, gbs);
    }
    if let Some(p) = prefill_profile.filter(|p| p.passes > 0) {
        report["prefill_step"] = prefill_report(&p);
    }
    if let Some(dir) = &args.llama_cpp {
        report["llama_cpp"] = compare(dir, model, args, threads, &report)?;
    }
    Ok(report)
}

/// A batch-1 decode step's phases per pass: time and share of the step, the pool's dispatches
/// and the caller's wait for its workers, and for the products the weights read and at what
/// rate, against the machine's read bandwidth `gbs`.
fn step_report(p: &StepProfile, gbs: f64) -> Value {
    let passes = p.passes as f64;
    let products = [Phase::QkvProjection, Phase::OutputProjection, Phase::FfnGateUp, Phase::FfnDown, Phase::Logits];
    let products_time: std::time::Duration = products.iter().map(|&ph| p.phase(ph).time).sum();
    let products_gb_s = gb_s(p.weight_bytes(), products_time);
    let pool = p.pool();
    json!({
        "passes": p.passes,
        "ms": p.time().as_secs_f64() * 1e3 / passes,
        "dispatches": pool.dispatches as f64 / passes,
        "wait_ms": pool.wait.as_secs_f64() * 1e3 / passes,
        "phases": phases(p, true),
        "products_weights_gb_s": products_gb_s,
        "products_share_of_read_bandwidth": products_gb_s / gbs,
        "step_share_of_read_bandwidth": gb_s(p.weight_bytes(), p.time()) / gbs,
    })
}

/// GB/s of `bytes` read in `d`.
fn gb_s(bytes: u64, d: std::time::Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-12) / 1e9
}

/// Each phase of a profile: its time per pass and share of the whole, its pool dispatches
/// and wait per pass, and with `weights` for the products the weights read per pass and at
/// what rate.
fn phases(p: &StepProfile, weights: bool) -> serde_json::Map<String, Value> {
    let (passes, whole) = (p.passes as f64, p.time().as_secs_f64());
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / passes;
    let mut phases = serde_json::Map::new();
    for ph in Phase::ALL {
        let t = p.phase(ph);
        let mut v = json!({
            "ms": ms(t.time),
            "share": t.time.as_secs_f64() / whole,
            "dispatches": t.pool.dispatches as f64 / passes,
            "wait_ms": ms(t.pool.wait),
        });
        if weights && t.weight_bytes > 0 {
            v["weights_mb"] = json!(t.weight_bytes as f64 / passes / 1e6);
            v["weights_gb_s"] = json!(gb_s(t.weight_bytes, t.time));
        }
        phases.insert(ph.name().into(), v);
    }
    phases
}

/// Where the profiled prefill's passes went: each phase's time per pass and share, and its
/// dispatches; weight bandwidth says nothing here (a pass reads each weight once for hundreds
/// of tokens), so the products' figure is tokens a second through the phase.
fn prefill_report(p: &StepProfile) -> Value {
    let step = p.time().as_secs_f64();
    json!({
        "passes": p.passes,
        "tokens": p.tokens,
        "ms": step * 1e3 / p.passes as f64,
        "tok_s": p.tokens as f64 / step.max(1e-12),
        "phases": phases(p, false),
    })
}

/// Where a device's passes went, per pass: the wall time (the host's launches included, and
/// the events' own cost), the host's time issuing the pass, the kernels' device time, and each
/// kernel's launches and time, slowest first.
fn kernel_report(p: &KernelProfile, passes: usize, wall: std::time::Duration) -> Value {
    let times = &p.kernels;
    let passes = passes.max(1) as f64;
    let total: f64 = times.iter().map(|k| k.ms).sum();
    let mut by: Vec<&KernelTime> = times.iter().collect();
    by.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    let by: Vec<Value> = by
        .iter()
        .map(|k| {
            json!({
                "kernel": k.name,
                "launches": k.launches as f64 / passes,
                "ms": k.ms / passes,
                "share": k.ms / total.max(1e-12),
            })
        })
        .collect();
    json!({
        "passes": passes,
        "wall_ms": wall.as_secs_f64() * 1e3 / passes,
        "host_issue_ms": p.host_issue.as_secs_f64() * 1e3 / passes,
        "kernels_ms": total / passes,
        "by_kernel": by,
    })
}

/// Weights of the matrix products one token goes through (each a multiply-add per token).
fn matmul_params(model: &Model) -> usize {
    let w = &model.weights;
    let mats = w.layers.iter().flat_map(|l| l.matrices());
    mats.chain([&w.output]).map(|t| t.rows * t.cols).sum()
}

/// Runs llama.cpp's tools on the same model and threads and returns their figures and our ratios.
fn compare(
    dir: &std::path::Path,
    model: &Model,
    args: &BenchArgs,
    threads: usize,
    ours: &Value,
) -> anyhow::Result<Value> {
    let m = model.path.display().to_string();
    let t = threads.to_string();
    let out = Command::new(dir.join("llama-bench"))
        .args([
            "-m",
            &m,
            "-t",
            &t,
            "-p",
            &args.prefill_tokens.to_string(),
            "-n",
            &args.gen_tokens.to_string(),
            "-r",
            &args.repeat.max(1).to_string(),
            "-d",
            &args.prefill_depth.to_string(),
            "-o",
            "json",
        ])
        .output()?;
    anyhow::ensure!(out.status.success(), "llama-bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let rows: Value = serde_json::from_slice(&out.stdout)?;
    let pick = |key: &str| {
        rows.as_array()
            .and_then(|a| a.iter().find(|r| r[key].as_u64().unwrap_or(0) > 0))
            .and_then(|r| r["avg_ts"].as_f64())
    };
    let (pp, tg) = (pick("n_prompt"), pick("n_gen"));
    let npl: Vec<String> = args.batches.iter().map(|b| b.to_string()).collect();
    let ctx = (args.batches.iter().max().unwrap_or(&1) * (args.prompt_tokens + args.gen_tokens) + 64).to_string();
    let out = Command::new(dir.join("llama-batched-bench"))
        .args([
            "-m",
            &m,
            "-t",
            &t,
            "-c",
            &ctx,
            "-npp",
            &args.prompt_tokens.to_string(),
            "-ntg",
            &args.gen_tokens.to_string(),
            "-npl",
            &npl.join(","),
            "--output-format",
            "jsonl",
        ])
        .output()?;
    anyhow::ensure!(out.status.success(), "llama-batched-bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut batched = serde_json::Map::new();
    for line in String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with('{')) {
        let r: Value = serde_json::from_str(line)?;
        if let (Some(b), Some(s)) = (r["pl"].as_u64(), r["speed_tg"].as_f64()) {
            batched.insert(b.to_string(), json!(s));
        }
    }
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!((a / b * 100.0).round() / 100.0),
        _ => Value::Null,
    };
    let mut ratios = serde_json::Map::new();
    ratios.insert("prefill".into(), ratio(ours["prefill_tok_s"].as_f64(), pp));
    ratios.insert("decode_batch1_vs_tg".into(), ratio(ours["decode_tok_s"]["by_batch"]["1"].as_f64(), tg));
    for b in &args.batches {
        let k = b.to_string();
        ratios.insert(
            format!("decode_batch{k}"),
            ratio(ours["decode_tok_s"]["by_batch"][&k].as_f64(), batched.get(&k).and_then(Value::as_f64)),
        );
    }
    Ok(json!({ "pp_tok_s": pp, "tg_tok_s": tg, "batched_decode_tok_s": batched, "ratios": ratios }))
}
