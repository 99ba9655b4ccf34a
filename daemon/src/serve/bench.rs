//! `inferd bench --serving`: continuous against static batching on the engine loop.
//!
//! 32 requests, 32-token prompts, output lengths fixed by `max_tokens` (end-of-sequence off):
//! 28 short ones of 16 to 64 tokens and 4 long ones of 512, all arriving at once. Static
//! batching runs them in groups of `batch` that each wait for their longest member; continuous
//! batching admits a waiting request as soon as one finishes. Same loop, same batch limit.

use inferd_engine::decode::store::EngineStore;
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::Registry;
use inferd_engine::sched::{engine_loop, Command, Event, LoopConfig, Submission};
use serde_json::{json, Value};
use std::sync::mpsc::channel;
use std::time::Instant;

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the workload; `groups`: static batching when true.
fn workload(model: &Model, reg: &Registry, threads: usize, batch: usize, groups: bool) -> anyhow::Result<Value> {
    let lens: Vec<u32> = (0..32u32).map(|i| if i % 8 == 3 { 512 } else { 16 + (i * 7) % 49 }).collect();
    let vocab = model.config.vocab as u32;
    let greedy = reg.get("greedy")?;
    let (tx, rx) = channel();
    let (done_tx, done_rx) = channel::<(usize, f64, usize)>();
    let start = Instant::now();
    let cfg = LoopConfig {
        token_budget: 512,
        max_running: batch,
        eos: Vec::new(),
        monitor: None,
        vocabulary: None,
        kv_release_after: None,
        prefix_sharing: Default::default(),
    };
    let mut engine = Engine::cpu(model, &EngineOptions { threads, ..EngineOptions::default() })?;
    std::thread::scope(|scope| -> anyhow::Result<Value> {
        scope.spawn(move || {
            let mut store = EngineStore::new(&mut engine);
            engine_loop(&mut store, &rx, &cfg)
        });
        let submit = |i: usize| {
            let done_tx = done_tx.clone();
            let mut tokens = 0usize;
            let sub = Submission {
                id: i as u64,
                strategy: greedy.clone(),
                prompt: (0..32).map(|k| 300 + ((i as u32 * 131 + k * 17) % (vocab - 300))).collect(),
                params: "{}".into(),
                max_tokens: lens[i],
                n: 1,
                seed: 0,
                logprobs: None,
                meta: Default::default(),
                events: Box::new(move |e| {
                    match e {
                        Event::Token { .. } => tokens += 1,
                        Event::Finished(_) | Event::Failed(_) => {
                            let _ = done_tx.send((i, start.elapsed().as_secs_f64(), tokens));
                        }
                    }
                    true
                }),
                grammar: None,
                images: Vec::new(),
            };
            tx.send(Command::Submit(sub)).is_ok()
        };
        let mut latency = vec![0.0; lens.len()];
        let mut generated = 0usize;
        let chunks: Vec<Vec<usize>> = if groups {
            (0..lens.len()).collect::<Vec<_>>().chunks(batch).map(<[usize]>::to_vec).collect()
        } else {
            vec![(0..lens.len()).collect()]
        };
        for chunk in chunks {
            for &i in &chunk {
                submit(i);
            }
            for _ in &chunk {
                let (i, t, n) = done_rx.recv()?;
                latency[i] = t;
                generated += n;
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let _ = tx.send(Command::Shutdown);
        Ok(json!({
            "seconds": wall,
            "tokens": generated,
            "throughput_tok_s": generated as f64 / wall,
            "latency_p50_s": percentile(latency.clone(), 0.5),
            "latency_p99_s": percentile(latency, 0.99),
        }))
    })
}

pub fn run(model: &Model, reg: &Registry, threads: usize, batch: usize) -> anyhow::Result<Value> {
    let stat = workload(model, reg, threads, batch, true)?;
    let cont = workload(model, reg, threads, batch, false)?;
    let ratio = cont["throughput_tok_s"].as_f64().unwrap_or(0.0) / stat["throughput_tok_s"].as_f64().unwrap_or(1.0);
    Ok(json!({
        "workload": "32 requests at once, 32-token prompts, 28 outputs of 16-64 tokens and 4 of 512, greedy",
        "max_batch": batch,
        "static": stat,
        "continuous": cont,
        "throughput_ratio": ratio,
    }))
}
