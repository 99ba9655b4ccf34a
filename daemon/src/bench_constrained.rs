//! `inferd bench --decoders`, section `constrained`: what a response format costs per token.
//!
//! A chat prompt asks for a JSON record; greedy decoding runs it free and under a JSON schema
//! (interleaved repetitions, medians). The mask's own cost is what the session measured around
//! computing and applying each row's mask (`mask_ms` over `masked_rows`), reported against the
//! decode step of the free run; the end-to-end rates show what the rest of the path adds
//! (the per-choice check of every emitted token). Each strategy then runs under the schema,
//! and its output is checked to parse.

use crate::bench::median;
use inferd_engine::constraint::{ResponseFormat, Vocabulary};
use inferd_engine::decode::generate_with_stats;
use inferd_engine::decode::store::EngineStore;
use inferd_engine::engine::Engine;
use inferd_engine::model::Model;
use inferd_engine::plugin::{Registry, SessionRequest};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The schema of the benchmark: a record with a string, numbers, an enum and an array.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": { "type": "string" },
            "age": { "type": "integer", "minimum": 0 },
            "city": { "type": "string" },
            "role": { "enum": ["engineer", "teacher", "doctor", "artist"] },
            "languages": { "type": "array", "items": { "type": "string" }, "maxItems": 4 }
        },
        "required": ["name", "age", "city", "role", "languages"],
        "additionalProperties": false
    })
}

pub fn run(model: &Model, engine: &mut Engine, reg: &Registry, reps: usize) -> anyhow::Result<Value> {
    let chat = inferd_engine::chat::ChatTemplate::new(model.chat_template.as_deref(), String::new(), String::new())?;
    let ask = "Describe a fictional person as JSON with their name, age, city, role and the languages they speak.";
    let text = chat.render(&[inferd_engine::chat::ChatMessage::new("user", ask)], true)?;
    let prompt = model.tokenizer.encode(&text, true)?;
    let eos = model.tokenizer.eos().to_vec();
    let t = Instant::now();
    let vocabulary = Arc::new(Vocabulary::new(&model.tokenizer)?);
    let grammar = vocabulary.compile(&ResponseFormat::JsonSchema(schema()))?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    vocabulary.compile(&ResponseFormat::JsonSchema(schema()))?;
    let recompile_ms = t.elapsed().as_secs_f64() * 1e3;
    let req = |params, constrained: bool| SessionRequest {
        logprobs: None,
        prompt: &prompt,
        generated: &[],
        params,
        max_tokens: 128,
        n: 1,
        seed: 7,
        eos: &eos,
        vocabulary: Some(&vocabulary),
        grammar: constrained.then_some(&grammar),
    };
    let greedy = reg.get("greedy")?;
    let mut store = EngineStore::new(engine);
    let (mut free, mut held, mut mask_us) = (Vec::new(), Vec::new(), Vec::new());
    let mut out = String::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let g = generate_with_stats(&greedy, &mut store, &req("{}", false), &mut |_, _| {})?;
        free.push(g.choices[0].tokens.len() as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        let g = generate_with_stats(&greedy, &mut store, &req("{}", true), &mut |_, _| {})?;
        held.push(g.choices[0].tokens.len() as f64 / t.elapsed().as_secs_f64());
        let rows = g.stats.get("masked_rows").copied().unwrap_or(0.0).max(1.0);
        mask_us.push(g.stats.get("mask_ms").copied().unwrap_or(0.0) * 1e3 / rows);
        out = model.tokenizer.decode(&g.choices[0].tokens, true)?;
    }
    let (free, held, mask_us) = (median(free), median(held), median(mask_us));
    let step_us = 1e6 / free;
    let mut strategies = serde_json::Map::new();
    for (name, params) in [
        ("nucleus", r#"{"temperature": 0.8, "top_p": 0.95}"#),
        ("min-p", r#"{"temperature": 0.8, "min_p": 0.05}"#),
        ("beam", r#"{"beam_width": 4}"#),
        ("speculative", r#"{"temperature": 0}"#),
    ] {
        let s = reg.get(name)?;
        let t = Instant::now();
        let g = generate_with_stats(&s, &mut store, &req(params, true), &mut |_, _| {})?;
        let secs = t.elapsed().as_secs_f64();
        let text = model.tokenizer.decode(&g.choices[0].tokens, true)?;
        let parses = serde_json::from_str::<Value>(&text).is_ok();
        strategies.insert(
            name.into(),
            json!({ "params": params, "tokens": g.choices[0].tokens.len(), "tok_s": g.choices[0].tokens.len() as f64 / secs, "parses": parses, "output": text }),
        );
    }
    Ok(json!({
        "schema": schema(),
        "prompt_tokens": prompt.len(),
        "compile_ms_first": compile_ms,
        "compile_ms": recompile_ms,
        "greedy_tok_s_free": free,
        "greedy_tok_s_constrained": held,
        "mask_us_per_token": mask_us,
        "decode_step_us": step_us,
        "mask_pct_of_decode_step": mask_us / step_us * 100.0,
        "greedy_output": out,
        "greedy_output_parses": serde_json::from_str::<Value>(&out).is_ok(),
        "strategies": strategies,
    }))
}
