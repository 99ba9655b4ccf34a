//! The packed 16-row kernel alone: one quantized matrix product over the thread pool, timed
//! against random weights, as read bandwidth (GB/s of weights) and GMAC/s. Where a decode
//! step's time goes splits into this kernel and the rest; the kernel's own figure shows how
//! close it comes to the machine's bandwidth at a batch of 1 and how compute-bound it is at 8.
//!
//! ```text
//! cargo run --release -p inferd-kernels --example gemv -- [threads] [tokens] [rows] [cols] [type]
//! ```
//! Defaults: 2 threads, 1 token, 12,288 x 576 Q4_1 (SmolLM2-135M's stacked feed-forward
//! shape). Eight matrices in turn, so the weights come from memory, not the caches; the best
//! of five rounds.

use inferd_kernels::matmul::{matmul, Input, Matrix};
use inferd_kernels::pack::{pack, Layout};
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::quant::{DType, WeightClass};
use inferd_kernels::quantize::random_blocks;
use inferd_kernels::{BlockQ8, Kernels};
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gemv: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, default: usize| -> Result<usize, String> {
        args.get(i).map_or(Ok(default), |s| s.parse().map_err(|e| format!("argument {}: {e}", i + 1)))
    };
    let (threads, tokens, rows, cols) = (num(0, 2)?, num(1, 1)?, num(2, 12_288)?, num(3, 576)?);
    let name = args.get(4).map_or("Q4_1", String::as_str);
    let bare = |s: &str| s.replace('_', "").to_ascii_uppercase();
    let dt = DType::ALL.into_iter().find(|d| bare(&format!("{d:?}")) == bare(name)).ok_or(format!("no type {name}"))?;
    let WeightClass::Quantized(q) = dt.class() else { return Err(format!("{name} is not quantized")) };
    if threads == 0 || tokens == 0 || rows == 0 || !cols.is_multiple_of(q.block_len()) {
        return Err(format!("need threads, tokens and rows > 0 and cols a multiple of {}", q.block_len()));
    }
    let k = Kernels::detect();
    let pool = ThreadPool::new(threads);
    let mats = (0..8)
        .map(|seed| pack(&pool, dt, rows, cols, &random_blocks(q, rows * cols / q.block_len(), seed)))
        .collect::<Option<Vec<_>>>()
        .ok_or(format!("{name} has no packed layout"))?;
    let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 7) % 13) as f32 / 6.0 - 1.0).collect();
    let mut q8 = vec![BlockQ8::default(); tokens * cols / 32];
    (k.quantize_q8)(&x, &mut q8);
    let mut y = vec![0f32; tokens * rows];
    let input = Input { f32: &x, q8: &q8, tokens };
    let reps = (2_000_000_000 / (rows * cols * tokens)).clamp(1, 50);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..reps {
            for m in &mats {
                let w = Matrix { dtype: dt, rows, cols, data: m, layout: Layout::Packed16 };
                matmul(&pool, &k, &w, &input, &mut y);
            }
        }
        best = best.min(start.elapsed().as_secs_f64() / (reps * mats.len()) as f64);
    }
    Ok(format!(
        "{:?} {name} {rows}x{cols}, {threads} threads, {tokens} tokens: {:.1} us a product, {:.1} GB/s of weights, {:.1} GMAC/s",
        k.isa,
        best * 1e6,
        mats[0].len() as f64 / best / 1e9,
        (rows * cols * tokens) as f64 / best / 1e9
    ))
}
