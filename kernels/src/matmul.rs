//! The matrix product driver: `y = x · Wᵀ` for a weight matrix in any [`DType`], threaded over
//! output rows.
//!
//! Weights are row-major as GGUF and safetensors store them: row `r` (one output feature) holds
//! `cols` input weights; or packed for the 16-row kernel ([`Layout::Packed16`], [`crate::pack`]).
//! Activations come as `tokens` rows of `cols` floats, and for quantized weights also
//! pre-quantized to [`BlockQ8`] (quantize once, reuse for Q/K/V or gate/up).
//! Each task owns a chunk of weight rows and runs every token against it, up to 16 tokens per
//! weight unpack, so a chunk is read from memory once per call whatever the batch size.

use crate::cpu::{Acts, Kernels, GEMV_TOKENS};
use crate::pack::Layout;
use crate::pool::{SyncPtr, ThreadPool};
use crate::quant::{BlockQ8, DType, FloatType, QuantType, WeightClass, QK};

/// A borrowed weight matrix.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// How the rows lie in `data`: as the file stores them, or packed for the 16-row kernel.
    pub layout: Layout,
}

impl Matrix<'_> {
    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.cols).unwrap_or(0)
    }

    /// The bytes of row `r`; of a packed matrix, only the rows past its last group of 16 (the
    /// others are interleaved, see [`crate::pack`]).
    pub fn row(&self, r: usize) -> &[u8] {
        debug_assert!(self.layout == Layout::Rows || r >= self.rows / 16 * 16, "row {r} is packed");
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// Activations for a product: `tokens` rows of `cols` floats, and their 8-bit blocks when the
/// weights are quantized (`q8.len() == tokens * cols / 32`, else empty).
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    pub f32: &'a [f32],
    pub q8: &'a [BlockQ8],
    pub tokens: usize,
}

/// Rows per task of a matrix in a dispatch whose products cost `total` (weight bytes times
/// tokens, summed): two tasks per thread over the whole dispatch, so a thread that falls
/// behind is balanced by the others, and each task streams a long run of rows (every task
/// start is a cold stream for the prefetchers and two claims on the shared counters); never
/// more than the matrix, at most 4096 rows, a multiple of 16 where the 16-row kernel runs.
/// Measured against 8 tasks per thread of at most 256 rows, same run: decode at batch 1
/// SmolLM2 Q4_1 165 -> 196 tok/s, Gemma 3 270M 67 -> 70 (its 262,144-row output projection
/// 9.4 -> 8.8 ms a token), batch 8 +7-9%, prefill unchanged. Cutting by the whole dispatch
/// rather than each matrix apart matters where it holds many small matrices (a mixture of
/// experts' chosen experts, BENCHMARKS.md).
fn chunk_rows(rows: usize, row_cost: usize, total: usize, threads: usize, align: usize) -> usize {
    let target = total.div_ceil(threads * 2);
    (target / row_cost.max(1)).clamp(4, 4096).min(rows).max(1).next_multiple_of(align)
}

/// `y[t * w.rows + r] = Σ_c w[r][c] * x[t][c]` for every token `t` and row `r`.
pub fn matmul(pool: &ThreadPool, k: &Kernels, w: &Matrix<'_>, x: &Input<'_>, y: &mut [f32]) {
    matmul_many(pool, k, &[*w], x, &mut [y]);
}

/// Several products of the same input in one parallel dispatch (Q, K and V; gate and up):
/// `ys[m] = x · ws[m]ᵀ`. One dispatch instead of several saves a thread wake-up and barrier
/// per matrix, which matters at batch size 1.
pub fn matmul_many(pool: &ThreadPool, k: &Kernels, ws: &[Matrix<'_>], x: &Input<'_>, ys: &mut [&mut [f32]]) {
    let products: Vec<(Matrix<'_>, usize)> = ws.iter().map(|w| (*w, 0)).collect();
    matmul_grouped(pool, k, &products, &[*x], ys);
}

/// Products of different inputs in one parallel dispatch: `ys[m] = xs[i] · wᵀ` for each
/// `(w, i)` of `products` (a mixture of experts' chosen experts, each with its own tokens).
/// A quantized matrix's input may leave `f32` empty: its products read only the 8-bit blocks.
pub fn matmul_grouped(
    pool: &ThreadPool,
    k: &Kernels,
    products: &[(Matrix<'_>, usize)],
    xs: &[Input<'_>],
    ys: &mut [&mut [f32]],
) {
    assert_eq!(products.len(), ys.len(), "one output per matrix");
    // The 16-row kernel, where the table has one, takes every batch of quantized weights (16
    // rows unpacked once per group of up to 16 tokens; packed matrices the kernel of their
    // layout); the dots the rest. Measured against the
    // 16-token kernel it replaced (GMAC/s, 2 threads, Sapphire Rapids): 8 tokens Q8_0 170 vs
    // 114, Q4_K 164 vs 50; 64 tokens Q8_0 206 vs 145, Q5_0 195 vs 121, Q4_K 202 vs 95, Q6_K
    // 152 vs 89.
    let gemv = |w: &Matrix<'_>| match (w.dtype.class(), w.layout) {
        (WeightClass::Quantized(_), Layout::Rows) => k.gemv16,
        (WeightClass::Quantized(_), Layout::Packed16) => k.gemv16_packed,
        (WeightClass::Float(_), _) => None,
    };
    let align = |w: &Matrix<'_>| if gemv(w).is_some() { 16 } else { 1 };
    let row_cost = |(w, i): &(Matrix<'_>, usize)| w.row_bytes() * xs[*i].tokens.max(1);
    let total: usize = products.iter().map(|p| p.0.rows * row_cost(p)).sum();
    let chunks: Vec<usize> =
        products.iter().map(|p| chunk_rows(p.0.rows, row_cost(p), total, pool.threads(), align(&p.0))).collect();
    let mut first_task = Vec::with_capacity(products.len() + 1);
    let mut tasks = 0;
    for (((w, i), y), &chunk) in products.iter().zip(ys.iter()).zip(&chunks) {
        let x = &xs[*i];
        assert_eq!(y.len(), w.rows * x.tokens, "output shape");
        assert!(w.data.len() >= w.rows * w.row_bytes(), "weight bytes");
        assert!(w.layout == Layout::Rows || k.packs(w.dtype), "{:?} has no kernel for packed {:?}", k.isa, w.dtype);
        if w.dtype.is_quantized() {
            assert_eq!(x.q8.len(), x.tokens * w.cols / QK, "quantized input shape");
        } else {
            assert_eq!(x.f32.len(), x.tokens * w.cols, "input shape");
        }
        first_task.push(tasks);
        tasks += w.rows.div_ceil(chunk);
    }
    first_task.push(tasks);
    // The 16-row kernel's tokens with their per-block activation sums, once per input for
    // every task.
    let halves: Vec<Vec<_>> = xs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let used = products.iter().any(|(w, j)| *j == i && gemv(w).is_some());
            if used {
                Acts::half_sums(x.q8)
            } else {
                Vec::new()
            }
        })
        .collect();
    let acts: Vec<Vec<Acts<'_>>> = xs
        .iter()
        .zip(&halves)
        .map(|(x, halves)| {
            // Activation blocks per token.
            let nb = x.q8.len() / x.tokens.max(1);
            if halves.is_empty() || nb == 0 {
                return Vec::new();
            }
            x.q8.chunks_exact(nb).zip(halves.chunks_exact(nb)).map(|(q8, halves)| Acts { q8, halves }).collect()
        })
        .collect();
    let outs: Vec<SyncPtr<f32>> = ys.iter_mut().map(|y| SyncPtr(y.as_mut_ptr())).collect();
    let task = |i: usize| {
        let m = first_task.partition_point(|&f| f <= i) - 1;
        let (w, xi) = &products[m];
        let (x, t) = (&xs[*xi], xs[*xi].tokens);
        let (n, chunk) = (w.rows, chunks[m]);
        let r0 = (i - first_task[m]) * chunk;
        let r1 = (r0 + chunk).min(n);
        let out = outs[m];
        // Each task writes only columns r0..r1 of every output row of matrix m: disjoint.
        let store = |tok: usize, r: usize, v: f32| {
            debug_assert!(tok < t && r < n);
            // SAFETY: `tok * n + r < ys[m].len()` (asserted shapes) and no other task writes
            // column `r` of output `m`; the outputs outlive `pool.run`.
            unsafe { *out.get().add(tok * n + r) = v };
        };
        // Columns `r .. r + v.len()` of output row `tok` at once (the 16-row kernel's results).
        let store_run = |tok: usize, r: usize, v: &[f32]| {
            assert!(tok < t && r + v.len() <= r1, "a run inside the task's columns");
            // SAFETY: as `store`, for each of the run's columns, all inside `r0..r1` (asserted).
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out.get().add(tok * n + r), v.len()) };
        };
        match (w.dtype.class(), gemv(w)) {
            (WeightClass::Quantized(q), Some(gemv)) => {
                rows_times_token(k, gemv, q, w, &acts[*xi], r0, r1, &store, &store_run)
            }
            (WeightClass::Quantized(q), None) => quantized_rows(k, q, w, x, r0, r1, &store),
            (WeightClass::Float(f), _) => float_rows(k, f, w, x, r0, r1, &store),
        }
    };
    pool.run(tasks, &task);
}

/// Rows `r0..r1` against every token, one token at a time, 16 rows per kernel call.
#[allow(clippy::too_many_arguments)]
fn rows_times_token(
    k: &Kernels,
    gemv: crate::cpu::Gemv16,
    q: QuantType,
    w: &Matrix<'_>,
    acts: &[Acts<'_>],
    r0: usize,
    r1: usize,
    store: &dyn Fn(usize, usize, f32),
    store_run: &dyn Fn(usize, usize, &[f32]),
) {
    let (one, _) = k.quant_dots(q);
    let rb = w.row_bytes();
    // Tokens in groups: each 16-row block is unpacked once per group.
    for (g, group) in acts.chunks(GEMV_TOKENS).enumerate() {
        let mut out = [[0f32; 16]; GEMV_TOKENS];
        let out = &mut out[..group.len()];
        let mut r = r0;
        while r + 16 <= r1 {
            gemv(q, &w.data[r * rb..(r + 16) * rb], rb, group, out);
            for (j, v) in out.iter().enumerate() {
                store_run(g * GEMV_TOKENS + j, r, v);
            }
            r += 16;
        }
        for r in r..r1 {
            for (j, act) in group.iter().enumerate() {
                store(g * GEMV_TOKENS + j, r, one(w.row(r), act.q8));
            }
        }
    }
}

/// Quantized rows `r0..r1` against every token, four tokens per weight unpack.
#[allow(clippy::too_many_arguments)]
fn quantized_rows(
    k: &Kernels,
    q: QuantType,
    w: &Matrix<'_>,
    x: &Input<'_>,
    r0: usize,
    r1: usize,
    store: &dyn Fn(usize, usize, f32),
) {
    let t = x.tokens;
    let (one, four) = k.quant_dots(q);
    let nb = w.cols / QK;
    let act = |tok: usize| &x.q8[tok * nb..(tok + 1) * nb];
    let mut tok = 0;
    while tok + 4 <= t {
        let a = [act(tok), act(tok + 1), act(tok + 2), act(tok + 3)];
        for r in r0..r1 {
            let v = four(w.row(r), a);
            for (j, vj) in v.into_iter().enumerate() {
                store(tok + j, r, vj);
            }
        }
        tok += 4;
    }
    for tok in tok..t {
        for r in r0..r1 {
            store(tok, r, one(w.row(r), act(tok)));
        }
    }
}

/// Float rows `r0..r1` against every token, four tokens per weight conversion where the type
/// has a kernel for it.
fn float_rows(
    k: &Kernels,
    f: FloatType,
    w: &Matrix<'_>,
    x: &Input<'_>,
    r0: usize,
    r1: usize,
    store: &dyn Fn(usize, usize, f32),
) {
    let t = x.tokens;
    let (dot, four) = k.float_dots(f);
    let xr = |tok: usize| &x.f32[tok * w.cols..(tok + 1) * w.cols];
    let mut tok = 0;
    if let Some(four) = four {
        while tok + 4 <= t {
            for r in r0..r1 {
                let v = four(w.row(r), [xr(tok), xr(tok + 1), xr(tok + 2), xr(tok + 3)]);
                for (j, vj) in v.into_iter().enumerate() {
                    store(tok + j, r, vj);
                }
            }
            tok += 4;
        }
    }
    for tok in tok..t {
        for r in r0..r1 {
            store(tok, r, dot(w.row(r), xr(tok)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_row};

    crate::cpu::test_every_isa!(a_tokens_result_does_not_depend_on_its_batch, matmul_matches_dequantized_float_product);

    fn a_tokens_result_does_not_depend_on_its_batch(kern: &Kernels) {
        // Alone and in batches of 2 to 24 tokens, every kernel table must give every token
        // bit-identical outputs. AVX-512 covers each path of the 16-row kernel: the row-order
        // layout alone and the weight-stationary one in batches, groups of 16 and a rest (21,
        // 24), and rows past the last 16 (19 rows); the reference (and AVX2 on rows as the file
        // stores them) the four-token dots and a rest. Where the table packs the type (AVX2
        // and AVX-512 pack every quantized type), the packed matrix must give the same bits as
        // the unpacked one alone, at every batch size (1 included).
        let pool = ThreadPool::new(2);
        let rows = 19;
        // Every type; rows of 96 weights, or 256 for the super-block formats.
        for dt in DType::ALL {
            let cols = if dt.block_len() > 96 { 256 } else { 96 };
            let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 113) as f32 / 56.0 - 1.0).collect();
            let x: Vec<f32> = (0..24 * cols).map(|i| ((i * 104729) % 97) as f32 / 48.0 - 1.0).collect();
            {
                let mut data = Vec::new();
                for r in 0..rows {
                    quantize_row(dt, &wf[r * cols..(r + 1) * cols], &mut data);
                }
                let w = Matrix { dtype: dt, rows, cols, data: &data, layout: Layout::Rows };
                let packed = kern.packs(dt).then(|| crate::pack::pack(&pool, dt, rows, cols, &data)).flatten();
                let packed = packed.as_ref().map(|p| Matrix { data: p, layout: Layout::Packed16, ..w });
                let run = |w: &Matrix<'_>, tokens: usize| {
                    let xs = &x[..tokens * cols];
                    let mut q8 = vec![BlockQ8::default(); tokens * cols / QK];
                    (kern.quantize_q8)(xs, &mut q8);
                    let mut y = vec![0.0; rows * tokens];
                    matmul(&pool, kern, w, &Input { f32: xs, q8: &q8, tokens }, &mut y);
                    y
                };
                let alone: Vec<Vec<f32>> = (0..24)
                    .map(|t| {
                        let xs = &x[t * cols..(t + 1) * cols];
                        let mut q8 = vec![BlockQ8::default(); cols / QK];
                        (kern.quantize_q8)(xs, &mut q8);
                        let mut y = vec![0.0; rows];
                        matmul(&pool, kern, &w, &Input { f32: xs, q8: &q8, tokens: 1 }, &mut y);
                        y
                    })
                    .collect();
                let batches = [(&w, 2), (&w, 3), (&w, 4), (&w, 5), (&w, 6), (&w, 8), (&w, 9), (&w, 21), (&w, 24)];
                let packed_batches = packed.iter().flat_map(|p| [1, 2, 5, 16, 21].map(|n| (p, n)));
                for (w, tokens) in batches.into_iter().chain(packed_batches) {
                    let y = run(w, tokens);
                    for t in 0..tokens {
                        assert_eq!(
                            &y[t * rows..(t + 1) * rows],
                            &alone[t][..],
                            "{:?} {dt:?} {:?}: token {t} of {tokens}",
                            kern.isa,
                            w.layout
                        );
                    }
                }
                if kern.isa != crate::Isa::Scalar && dt.is_quantized() {
                    assert!(packed.is_some(), "the {:?} table packs {dt:?}", kern.isa);
                }
            }
        }
    }

    fn matmul_matches_dequantized_float_product(kern: &Kernels) {
        let pool = ThreadPool::new(2);
        let (rows, tokens) = (37, 6);
        for dt in DType::ALL {
            let cols = if dt.block_len() > 64 { 256 } else { 64 };
            let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 113) as f32 / 56.0 - 1.0).collect();
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104729) % 97) as f32 / 48.0 - 1.0).collect();
            {
                let mut data = Vec::new();
                for r in 0..rows {
                    quantize_row(dt, &wf[r * cols..(r + 1) * cols], &mut data);
                }
                let w = Matrix { dtype: dt, rows, cols, data: &data, layout: Layout::Rows };
                let mut q8 = vec![BlockQ8::default(); tokens * cols / QK];
                (kern.quantize_q8)(&x, &mut q8);
                let mut y = vec![0.0; rows * tokens];
                matmul(&pool, kern, &w, &Input { f32: &x, q8: &q8, tokens }, &mut y);
                let mut wr = vec![0.0; cols];
                for r in 0..rows {
                    dequantize_row(dt, w.row(r), &mut wr);
                    for t in 0..tokens {
                        let want: f32 = wr.iter().zip(&x[t * cols..]).map(|(a, b)| a * b).sum();
                        let got = y[t * rows + r];
                        let tol = if dt.is_quantized() { 0.05 } else { 1e-3 };
                        assert!((want - got).abs() < tol * want.abs().max(1.0), "{dt:?} r{r} t{t}: {want} vs {got}");
                    }
                }
            }
        }
    }
}
