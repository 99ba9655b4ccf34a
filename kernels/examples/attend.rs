//! Paged attention alone: decode queries over a paged f16 K/V cache, as a decode step runs it
//! layer after layer, timed as microseconds a layer and GB/s of keys and values read. Where a
//! decode step's attention time goes at a context length, apart from the products.
//!
//! ```text
//! cargo run --release -p inferd-kernels --example attend -- [threads] [context] [heads] [kv_heads] [head_dim] [tokens] [layers]
//! ```
//! Defaults: 2 threads, 1,024 positions, SmolLM2-135M's 9 query heads over 3 KV heads of 64,
//! 1 token (a query per token, each its own sequence), 30 layers, each with its own pool of
//! 16-position blocks in shuffled order, so the layers' K/V together come from memory as in a
//! step; the best of fifteen rounds.

use half::f16;
use inferd_kernels::attention::{attend_batch, PagedKv, QueryCtx};
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::Kernels;
use std::process::ExitCode;
use std::time::Instant;

const BLOCK: usize = 16;

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("attend: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, default: usize| -> Result<usize, String> {
        args.get(i).map_or(Ok(default), |s| s.parse().map_err(|e| format!("argument {}: {e}", i + 1)))
    };
    let (threads, ctx, heads, nkv, hd) = (num(0, 2)?, num(1, 1024)?, num(2, 9)?, num(3, 3)?, num(4, 64)?);
    let (tokens, layers) = (num(5, 1)?, num(6, 30)?);
    if [threads, ctx, heads, nkv, hd, tokens, layers].contains(&0) || !heads.is_multiple_of(nkv) {
        return Err("every figure above zero, and the query heads a multiple of the KV heads".into());
    }
    let k = Kernels::detect();
    let pool = ThreadPool::new(threads);
    // Each token's sequence has its own blocks, numbered in a shuffled order.
    let per_seq = ctx.div_ceil(BLOCK);
    let blocks = tokens * per_seq;
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let tables: Vec<&[u32]> = order.chunks(per_seq).collect();
    let queries: Vec<QueryCtx<'_>> = tables.iter().map(|t| QueryCtx { table: t, ctx_len: ctx, start: 0 }).collect();
    let floats = blocks * nkv * BLOCK * hd;
    let fill = |seed: usize| -> Vec<f16> {
        (0..floats).map(|i| f16::from_f32((((i + seed) * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)).collect()
    };
    let pools: Vec<(Vec<f16>, Vec<f16>)> = (0..layers).map(|l| (fill(2 * l), fill(2 * l + 1))).collect();
    let q: Vec<f32> = (0..tokens * heads * hd).map(|i| ((i * 7) % 13) as f32 / 6.0 - 1.0).collect();
    let mut out = vec![0f32; tokens * heads * hd];
    let scale = 1.0 / (hd as f32).sqrt();
    let reps = (400_000_000 / (ctx * heads * hd * tokens * layers)).clamp(1, 50);
    let mut best = f64::MAX;
    for _ in 0..15 {
        let start = Instant::now();
        for _ in 0..reps {
            for (kc, vc) in &pools {
                let kv = PagedKv {
                    k: kc,
                    v: vc,
                    block_size: BLOCK,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    block_floats: nkv * BLOCK * hd,
                };
                attend_batch(&pool, &k, &kv, heads, scale, None, &q, &queries, &mut out);
            }
        }
        best = best.min(start.elapsed().as_secs_f64() / (reps * layers) as f64);
    }
    let bytes = (2 * tokens * ctx * nkv * hd * std::mem::size_of::<f16>()) as f64;
    Ok(format!(
        "{:?} {tokens} x {ctx} positions, {heads}/{nkv} heads of {hd}, {threads} threads: {:.1} us a layer, {:.1} GB/s of K/V, {:.1} ns a position",
        k.isa,
        best * 1e6,
        bytes / best / 1e9,
        best * 1e9 / (tokens * ctx) as f64
    ))
}
