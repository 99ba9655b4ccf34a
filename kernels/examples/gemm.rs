//! The many-token products alone ([`inferd_kernels::gemm`], a vision encoder's): one product
//! or one attention of every token to every token over the thread pool, timed, in GFLOPS,
//! against the processor's peak (a core's FMA ports times their width, times the clock): how
//! much of an encode's time is its kernel, and how close that kernel comes to the arithmetic.
//!
//! ```text
//! cargo run --release -p inferd-kernels --example gemm -- [threads] [tokens rows cols]
//! cargo run --release -p inferd-kernels --example gemm -- [threads] [tokens]
//! ```
//! The first: `y = x · Wᵀ`, defaults 2 threads, 4,096 tokens, 4,304 x 1,152 (SigLIP's
//! feed-forward at Gemma 3's 896 pixels). The second: attention of `tokens` tokens in 16 heads
//! of 72 (SigLIP's). The best of five rounds (three for attention), with the kernel table
//! [`Kernels::detect`] picks.

use inferd_kernels::gemm;
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::Kernels;
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    let args: Vec<usize> = match std::env::args().skip(1).map(|s| s.parse()).collect() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("usage: gemm [threads] [tokens [rows cols]]: {e}");
            return ExitCode::FAILURE;
        }
    };
    let k = Kernels::detect();
    let Some(bk) = k.bf16 else {
        eprintln!("the {:?} table has no many-token products", k.isa);
        return ExitCode::FAILURE;
    };
    let pool = ThreadPool::new(args.first().copied().unwrap_or(2).max(1));
    let noise =
        |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| ((i * seed) % 1000) as f32 / 1000.0 - 0.5).collect() };
    let (flops, rounds, what): (f64, usize, String);
    let mut run: Box<dyn FnMut()> = if let [_, n] = args[..] {
        let (heads, hd) = (16, 72);
        let q = noise(n * heads * hd, 7919);
        let mut out = vec![0f32; q.len()];
        (flops, rounds, what) =
            (4.0 * (n * n * heads * hd) as f64, 3, format!("attention of {n} tokens, {heads} heads of {hd}"));
        Box::new(move || gemm::attention(&pool, &bk, [&q, &q, &q], n, heads, hd, 0.1, &mut out))
    } else {
        let (tokens, rows, cols) = match args[..] {
            [_, t, r, c] => (t, r, c),
            _ => (4096, 4304, 1152),
        };
        let w = noise(rows * cols, 7919);
        let src = gemm::Source::Strided { data: &w, offset: 0, row: cols, col: 1, rows, cols };
        let panels = gemm::pack(&pool, &bk, &src);
        let a = gemm::to_tokens(&pool, &bk, &noise(tokens * cols, 104_729), cols, tokens);
        let mut y = vec![0f32; tokens * rows];
        (flops, rounds, what) = (2.0 * (tokens * rows * cols) as f64, 5, format!("{tokens} tokens x {rows} x {cols}"));
        Box::new(move || gemm::product(&pool, &bk, &panels, &a, tokens, &mut y))
    };
    let best = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min);
    println!("{what} ({:?}): {:.1} ms, {:.1} GFLOPS", k.isa, best * 1e3, flops / best / 1e9);
    ExitCode::SUCCESS
}
