//! `inferd bench --decoders`: what decoding through plugins costs and gains.
//!
//! - `abi_overhead`: greedy decoding through the greedy plugin against the engine's in-process
//!   argmax, end to end at batch 1 (interleaved repetitions), and the plugin round trip alone
//!   per token (plan + observe + argmax on a mock model with the real vocabulary) against the
//!   argmax alone, as a share of a decode step; and the same library in a helper process (how
//!   third-party libraries run in the daemon), end to end and per round trip.
//! - `speculative`: speed-up over greedy decoding at batch 1 on an input-grounded task (rewrite a
//!   paragraph with one word changed), acceptance rate, and whether the output is identical;
//!   with prompt lookup, and with a draft model when one is given.
//! - `beam_kv`: the KV blocks beam search k=4 holds at its peak over a 256-token continuation,
//!   against one sequence of the same length (from the cache accounting).
//! - `constrained`: the response-format mask per token against a decode step
//!   (`bench_constrained.rs`).

use crate::bench::median;
use inferd_engine::decode::store::{EngineStore, MockStore, SeqStore, StoreError, StoreRun, StoreSeq};
use inferd_engine::decode::{generate, generate_with_stats};
use inferd_engine::engine::{argmax, Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::{Isolate, Isolation, Registry, SessionRequest, TrustPolicy};
use serde_json::{json, Value};
use std::time::Instant;

/// A store that records the most KV blocks in use after any run.
struct Peak<'e> {
    inner: EngineStore<'e>,
    peak: usize,
}

impl SeqStore for Peak<'_> {
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn roles(&self) -> u32 {
        self.inner.roles()
    }
    fn create(&mut self, role: u32, prompt: &[u32]) -> Result<StoreSeq, StoreError> {
        self.inner.create(role, prompt)
    }
    fn fork(&mut self, s: StoreSeq) -> Result<StoreSeq, StoreError> {
        self.inner.fork(s)
    }
    fn truncate(&mut self, s: StoreSeq, len: usize) -> Result<(), StoreError> {
        self.inner.truncate(s, len)
    }
    fn free(&mut self, s: StoreSeq) {
        self.inner.free(s)
    }
    fn tokens(&self, s: StoreSeq) -> Vec<u32> {
        self.inner.tokens(s)
    }
    fn run(&mut self, items: &[StoreRun]) -> Result<Vec<Vec<f32>>, StoreError> {
        let out = self.inner.run(items)?;
        let st = self.inner.engine.kv.stats();
        self.peak = self.peak.max(st.total - st.free);
        Ok(out)
    }
}

/// Deterministic ordinary token ids (past the first 256, where the special tokens are).
fn tokens(len: usize, salt: u64, vocab: usize) -> Vec<u32> {
    crate::bench::prompt(len, salt, vocab, 256)
}

const PARAGRAPH: &str = "The old lighthouse stood at the edge of the quick, cold sea for more than a hundred years. \
Every night its keeper climbed the narrow stairs, cleaned the great lens and lit the lamp, so that the fishing boats \
could find their way home through fog and storm. The villagers said the light had never failed, not even on the night \
of the great winter gale, when the waves rose higher than the rooftops and the wind tore the bells from the church tower.";

pub fn run(
    model: &Model,
    draft: Option<&Model>,
    reg: &Registry,
    threads: usize,
    repeat: usize,
) -> anyhow::Result<Value> {
    let opts = EngineOptions { threads, ..EngineOptions::default() };
    let mut engine = Engine::cpu(model, &opts)?;
    let vocab = model.config.vocab;
    let eos = model.tokenizer.eos().to_vec();
    let reps = repeat.max(1);
    let greedy = reg.get("greedy")?;
    // The same library in a helper process, the way third-party libraries run in the daemon.
    let mut apart = Registry::isolating(
        Isolate::All,
        Isolation {
            exe: std::env::current_exe()?,
            call_timeout: std::time::Duration::from_secs(10),
            memory_mib: 1024,
            quarantine: None,
        },
    );
    apart.load_file(&greedy.path, TrustPolicy::User)?;
    let isolated = apart.get("greedy")?;

    // ABI overhead, end to end: 128 tokens after a 128-token prompt, interleaved.
    let (mut inproc, mut plugin, mut helper) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps {
        let p = tokens(128, 100 + r as u64, vocab);
        let t = Instant::now();
        engine.generate_greedy(&[&p], 128, &[], &mut |_, _| {})?;
        inproc.push(127.0 / t.elapsed().as_secs_f64());
        let p = tokens(128, 200 + r as u64, vocab);
        let req = SessionRequest {
            logprobs: None,
            prompt: &p,
            generated: &[],
            params: "{}",
            max_tokens: 128,
            n: 1,
            seed: 0,
            eos: &[],
            vocabulary: None,
            grammar: None,
        };
        let t = Instant::now();
        generate(&greedy, &mut EngineStore::new(&mut engine), &req, &mut |_, _| {})?;
        plugin.push(127.0 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        generate(&isolated, &mut EngineStore::new(&mut engine), &req, &mut |_, _| {})?;
        helper.push(127.0 / t.elapsed().as_secs_f64());
    }
    let (inproc, plugin, helper) = (median(inproc), median(plugin), median(helper));
    // The plugin round trip alone: a mock model returning a real-sized row of logits.
    let row: Vec<f32> = (0..vocab).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
    // Alternating runs of 500 tokens each, medians (the machine is noisy).
    let n = 500u32;
    let fixed = row.clone();
    let mut mock = MockStore::new(vocab, Box::new(move |_| fixed.clone()));
    let req = SessionRequest {
        logprobs: None,
        prompt: &[1],
        generated: &[],
        params: "{}",
        max_tokens: n,
        n: 1,
        seed: 0,
        eos: &[],
        vocabulary: None,
        grammar: None,
    };
    let (mut via_plugin, mut via_helper, mut argmax_only) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        generate(&greedy, &mut mock, &req, &mut |_, _| {})?;
        via_plugin.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
        let t = Instant::now();
        generate(&isolated, &mut mock, &req, &mut |_, _| {})?;
        via_helper.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(argmax(std::hint::black_box(&row)));
        }
        argmax_only.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
    }
    let (per_token_plugin_us, per_token_argmax_us) = (median(via_plugin), median(argmax_only));
    let per_token_helper_us = median(via_helper);
    let step_us = 1e6 / inproc;
    let abi = json!({
        "decode_tok_s_in_engine_argmax": inproc,
        "decode_tok_s_greedy_plugin": plugin,
        "end_to_end_overhead_pct": (inproc / plugin - 1.0) * 100.0,
        "plugin_round_trip_us_per_token": per_token_plugin_us,
        "in_engine_argmax_us_per_token": per_token_argmax_us,
        "abi_overhead_pct_of_decode_step": (per_token_plugin_us - per_token_argmax_us) / step_us * 100.0,
        "decode_tok_s_isolated_greedy": helper,
        "isolated_end_to_end_overhead_pct": (inproc / helper - 1.0) * 100.0,
        "isolated_round_trip_us_per_token": per_token_helper_us,
        "isolation_overhead_pct_of_decode_step": (per_token_helper_us - per_token_argmax_us) / step_us * 100.0,
    });

    // Speculative decoding on an input-grounded task.
    let chat = inferd_engine::chat::ChatTemplate::new(model.chat_template.as_deref(), String::new(), String::new())?;
    let text = chat.render(&[inferd_engine::chat::ChatMessage::new("user", &format!("Rewrite the following paragraph, changing only the word \"quick\" to \"rough\". Keep everything else exactly the same.\n\n{PARAGRAPH}"))], true)?;
    let prompt = model.tokenizer.encode(&text, true)?;
    let spec = reg.get("speculative")?;
    // The draft on its target's threads, as the daemon runs it.
    let mut target = draft.map(|_| Engine::cpu(model, &opts)).transpose()?;
    let draft_opts = EngineOptions { pool: target.as_ref().and_then(|t| t.backend.cpu_pool()), ..opts.clone() };
    let mut draft_engine = draft.map(|d| Engine::cpu(d, &draft_opts)).transpose()?;
    let measure = |params: &str, engine: &mut Engine, draft: Option<&mut Engine>| -> anyhow::Result<Value> {
        let mut store = match draft {
            Some(d) => EngineStore::with_draft(engine, d),
            None => EngineStore::new(engine),
        };
        let req = |params| SessionRequest {
            logprobs: None,
            prompt: &prompt,
            generated: &[],
            params,
            max_tokens: 200,
            n: 1,
            seed: 0,
            eos: &eos,
            vocabulary: None,
            grammar: None,
        };
        let (mut base, mut fast, mut same, mut drafted, mut accepted, mut n_tok) =
            (Vec::new(), Vec::new(), true, 0.0, 0.0, 0);
        for _ in 0..reps {
            let t = Instant::now();
            let want = generate(&greedy, &mut store, &req("{}"), &mut |_, _| {})?;
            base.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let got = generate_with_stats(&spec, &mut store, &req(params), &mut |_, _| {})?;
            fast.push(t.elapsed().as_secs_f64());
            same &= got.choices[0].tokens == want[0].tokens;
            drafted += got.stats.get("draft_tokens").copied().unwrap_or(0.0);
            accepted += got.stats.get("accepted_tokens").copied().unwrap_or(0.0);
            n_tok = want[0].tokens.len();
        }
        let (b, f) = (median(base), median(fast));
        Ok(json!({
            "params": params,
            "tokens": n_tok,
            "greedy_tok_s": n_tok as f64 / b,
            "speculative_tok_s": n_tok as f64 / f,
            "speedup": b / f,
            "acceptance_rate": if drafted > 0.0 { accepted / drafted } else { 0.0 },
            "identical_output": same,
        }))
    };
    let mut speculative =
        json!({ "prompt_tokens": prompt.len(), "prompt_lookup": measure(r#"{"temperature": 0}"#, &mut engine, None)? });
    if let (Some(d), Some(target)) = (draft_engine.as_mut(), target.as_mut()) {
        speculative["draft_model"] = measure(r#"{"temperature": 0, "drafter": "model"}"#, target, Some(d))?;
        speculative["draft_model"]["draft"] = json!(draft.map(|m| m.path.display().to_string()));
    }

    // Beam search KV blocks: k = 4 over 256 new tokens after a 128-token prompt.
    let beam = reg.get("beam")?;
    let bs = engine.kv.block_size();
    let p = tokens(128, 300, vocab);
    let mut peak = Peak { inner: EngineStore::new(&mut engine), peak: 0 };
    let req = SessionRequest {
        logprobs: None,
        prompt: &p,
        generated: &[],
        params: r#"{"beam_width": 4}"#,
        max_tokens: 256,
        n: 1,
        seed: 0,
        eos: &[],
        vocabulary: None,
        grammar: None,
    };
    let t = Instant::now();
    generate(&beam, &mut peak, &req, &mut |_, _| {})?;
    let beam_s = t.elapsed().as_secs_f64();
    let one = (128 + 256usize).div_ceil(bs);
    let beam_kv = json!({
        "beam_width": 4,
        "prompt_tokens": 128,
        "new_tokens": 256,
        "peak_blocks": peak.peak,
        "one_sequence_blocks": one,
        "ratio": peak.peak as f64 / one as f64,
        "seconds": beam_s,
    });
    let constrained = crate::bench_constrained::run(model, &mut engine, reg, reps)?;
    Ok(json!({ "abi_overhead": abi, "speculative": speculative, "beam_kv": beam_kv, "constrained": constrained }))
}
