//! Products of many tokens in bf16 register tiles: a vision encoder's thousands of patches
//! against its matrices, and their attention of every patch to every patch.
//!
//! The decode driver ([`crate::matmul`]) streams each weight row past at most 16 tokens, which
//! is right when the weights are the traffic; with 4,096 tokens the traffic is the tokens and
//! the work is arithmetic. Here weights are repacked per product into panels of 32 outputs
//! ([`Panels`]: pair `p` of the panel's 32 rows side by side), the tokens rounded to bf16
//! once for every matrix they meet (in the form the table's tile reads,
//! [`crate::cpu::Bf16Kernels::words`]), and a register tile of 12 tokens by 32 outputs
//! ([`crate::cpu::Tile`]) runs along `KC` pairs at a time. Per block of `MC` tokens (in L2),
//! each panel in turn passes all its stretches: a stretch (16 KiB) stays in L1 while the
//! block's tiles pass it, and the block's outputs of one panel (12 KiB) stay in cache while
//! they are summed across stretches, never a round trip to memory per stretch. Threads take
//! blocks of tokens as each finishes its last, each block its own outputs.
//!
//! Weights and tokens are rounded to bf16 (8 significant bits; the products are exact in f32
//! and summed in f32), so a product is within about 2⁻⁸ of its operands' magnitudes relative
//! to the f16 path's 2⁻¹¹: the encoder's embeddings stay within the tolerance its test states
//! against llama.cpp's (f16) ones. Packing per product rather than at load keeps the weights
//! mapped, not copied; it costs one pass over them per product, which a few thousand tokens
//! repay many times over.
//!
//! Every token's result is the same whatever its place among the tokens or the thread that
//! ran it: each output sums its stretches, and each stretch its pairs, in one order.

use crate::cpu::{Bf16Kernels, Tile, PANEL, TILE_TOKENS};
use crate::matmul::Matrix;
use crate::pool::ThreadPool;
use crate::quant::dequantize_row;

/// Pairs of a panel's stretch held in L1 per tile pass (16 KiB of weights).
const KC: usize = 128;
/// Tokens per block, whose rows stay in L2 while every panel passes them (a stretch of 96
/// tokens: 48 KiB in one-word pairs, 96 KiB in two).
const MC: usize = 96;
/// Queries per block of [`attention`]: their scores (one f32 row of `n` per query) and
/// exponentials (bf16) stay in L2 at 4,096 keys.
const MQ: usize = 24;

/// A matrix's rows packed for the tile: panels of [`PANEL`] rows (the last padded with zero
/// rows), each `pairs` long, pair `p` of the panel's row `j` at `p * PANEL + j` in the panel.
#[derive(Clone, Debug)]
pub struct Panels {
    pub rows: usize,
    pub pairs: usize,
    data: Vec<u32>,
}

impl Panels {
    /// The stretch `from..from + len` of pairs of panel `i`.
    fn stretch(&self, i: usize, from: usize, len: usize) -> &[u32] {
        &self.data[(i * self.pairs + from) * PANEL..][..len * PANEL]
    }

    fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }
}

/// Where a product's matrix comes from.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// Weights as the file stores them, any type (quantized rows dequantized first).
    Matrix(Matrix<'a>),
    /// Floats in memory: element `(r, c)` at `data[offset + r * row + c * col]`, `rows × cols`
    /// (a head's keys, its values transposed).
    Strided { data: &'a [f32], offset: usize, row: usize, col: usize, rows: usize, cols: usize },
}

impl Source<'_> {
    fn shape(&self) -> (usize, usize) {
        match *self {
            Source::Matrix(m) => (m.rows, m.cols),
            Source::Strided { rows, cols, .. } => (rows, cols),
        }
    }

    /// Row `r` into `out` (`cols` floats).
    fn row_into(&self, r: usize, out: &mut [f32]) {
        match *self {
            Source::Matrix(m) => dequantize_row(m.dtype, m.row(r), out),
            Source::Strided { data, offset, row, col, .. } => {
                out.iter_mut().enumerate().for_each(|(c, o)| *o = data[offset + r * row + c * col]);
            }
        }
    }
}

/// `src` packed into panels, a panel per task across the pool.
///
/// # Panics
/// Where a [`Source::Matrix`] is packed ([`crate::pack`]) rather than stored as the file
/// stores it, or a [`Source::Strided`] reaches past its data.
pub fn pack(pool: &ThreadPool, bk: &Bf16Kernels, src: &Source<'_>) -> Panels {
    let (rows, cols) = src.shape();
    let pairs = cols.div_ceil(2);
    let mut data = vec![0u32; rows.div_ceil(PANEL) * pairs * PANEL];
    pool.for_rows(&mut data, pairs * PANEL, &|first, panels| {
        let (mut row, mut packed) = (vec![0f32; cols], vec![0u32; pairs]);
        for (i, panel) in panels.chunks_exact_mut(pairs * PANEL).enumerate() {
            let base = (first + i) * PANEL;
            for j in 0..PANEL.min(rows - base) {
                src.row_into(base + j, &mut row);
                (bk.to_bf16)(&row, &mut packed);
                packed.iter().enumerate().for_each(|(p, &v)| panel[p * PANEL + j] = v);
            }
        }
    });
    Panels { rows, pairs, data }
}

/// `tokens` rows of `cols` floats rounded to bf16 in the tile's form (rows of
/// `cols.div_ceil(2) * bk.words` words), across the pool.
pub fn to_tokens(pool: &ThreadPool, bk: &Bf16Kernels, x: &[f32], cols: usize, tokens: usize) -> Vec<u32> {
    let row = cols.div_ceil(2) * bk.words;
    let mut a = vec![0u32; tokens * row];
    pool.for_rows(&mut a, row, &|first, rows| {
        for (i, out) in rows.chunks_exact_mut(row).enumerate() {
            (bk.to_tokens)(&x[(first + i) * cols..][..cols], out);
        }
    });
    a
}

/// `y = x · Wᵀ`: `tokens` rows of `x` rounded ([`to_tokens`]; one rounding serves every
/// matrix the input meets) against the packed `w`, into `tokens` rows of `w.rows` outputs,
/// threads taking runs of tokens.
pub fn product(pool: &ThreadPool, bk: &Bf16Kernels, w: &Panels, a: &[u32], tokens: usize, y: &mut [f32]) {
    let row = w.pairs * bk.words;
    assert!(a.len() == tokens * row && y.len() == tokens * w.rows, "product shapes disagree");
    pool.for_runs(y, w.rows, MC, &|first, ys| {
        gemm(bk, &a[first * row..], row, ys.len() / w.rows, w, ys, w.rows);
    });
}

/// `c[i * ldc + r] = Σ_p a(i, p) · w(r, p)` for `tokens` rows of rounded tokens `a` in the
/// tile's form (`lda` words apart) and every row `r` of `w`, on the calling thread.
///
/// # Panics
/// Where `a` or `c` is shorter than the shapes say.
pub fn gemm(bk: &Bf16Kernels, a: &[u32], lda: usize, tokens: usize, w: &Panels, c: &mut [f32], ldc: usize) {
    for t0 in (0..tokens).step_by(MC) {
        let block = MC.min(tokens - t0);
        for panel in 0..w.panels() {
            for k0 in (0..w.pairs).step_by(KC) {
                let kc = KC.min(w.pairs - k0);
                let (b, lanes) = (w.stretch(panel, k0, kc), PANEL.min(w.rows - panel * PANEL));
                for i in (t0..t0 + block).step_by(TILE_TOKENS) {
                    let rows = TILE_TOKENS.min(t0 + block - i);
                    let a = &a[i * lda + k0 * bk.words..];
                    let t = Tile { a, lda, words: bk.words, rows, b, kc, lanes, add: k0 > 0 };
                    (bk.tile)(t, &mut c[i * ldc + panel * PANEL..], ldc);
                }
            }
        }
    }
}

/// Attention of each of `n` tokens to all `n` (no mask), `heads` heads of `hd`: `q`, `k`, `v`
/// and `out` hold `n` rows of `heads * hd`. Per head, the keys and the values (transposed)
/// are packed once; threads take runs of queries, and per block of [`MQ`] queries the scores
/// are one product, each row's exponentials (bf16, unnormalized) another's input, and the
/// outputs divided by the rows' sums.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    bk: &Bf16Kernels,
    [q, k, v]: [&[f32]; 3],
    n: usize,
    heads: usize,
    hd: usize,
    scale: f32,
    out: &mut [f32],
) {
    let e = heads * hd;
    assert!(q.len() == n * e && k.len() == n * e && v.len() == n * e && out.len() == n * e, "attention shapes");
    let keys: Vec<Panels> = (0..heads)
        .map(|h| pack(pool, bk, &Source::Strided { data: k, offset: h * hd, row: e, col: 1, rows: n, cols: hd }))
        .collect();
    let values: Vec<Panels> = (0..heads)
        .map(|h| pack(pool, bk, &Source::Strided { data: v, offset: h * hd, row: 1, col: e, rows: hd, cols: n }))
        .collect();
    // Rows of queries and of exponentials in the tile's form.
    let (qp, kp) = (hd.div_ceil(2) * bk.words, n.div_ceil(2) * bk.words);
    // Queries head-major: head h's query t at row h * n + t.
    let mut qs = vec![0u32; heads * n * qp];
    pool.for_rows(&mut qs, qp, &|first, rows| {
        for (i, out) in rows.chunks_exact_mut(qp).enumerate() {
            let (h, t) = ((first + i) / n, (first + i) % n);
            (bk.to_tokens)(&q[t * e + h * hd..][..hd], out);
        }
    });
    pool.for_runs(out, e, MQ * 4, &|first, rows| {
        let m = rows.len() / e;
        let (mut s, mut p, mut sums) = (vec![0f32; MQ * n], vec![0u32; MQ * kp], [0f32; MQ]);
        for h in 0..heads {
            for q0 in (0..m).step_by(MQ) {
                let qn = MQ.min(m - q0);
                gemm(bk, &qs[(h * n + first + q0) * qp..], qp, qn, &keys[h], &mut s, n);
                for (i, sum) in sums[..qn].iter_mut().enumerate() {
                    *sum = (bk.softmax)(&s[i * n..][..n], scale, &mut p[i * kp..][..kp]);
                }
                let o = &mut rows[q0 * e + h * hd..];
                gemm(bk, &p, kp, qn, &values[h], o, e);
                for (i, sum) in sums[..qn].iter().enumerate() {
                    o[i * e..][..hd].iter_mut().for_each(|x| *x /= sum);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{scalar, Kernels};

    /// The scalar references as a bf16 table, for machines without the instructions.
    fn reference() -> Bf16Kernels {
        Bf16Kernels {
            tile: scalar::tile,
            to_bf16: scalar::to_bf16,
            words: 1,
            to_tokens: scalar::to_bf16,
            softmax: scalar::softmax_bf16,
        }
    }

    /// The scalar references with tokens of two words a pair (AVX2's form).
    fn reference_words() -> Bf16Kernels {
        Bf16Kernels {
            words: 2,
            to_tokens: scalar::to_bf16_words,
            softmax: |s, scale, out| {
                let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                scalar::softmax_tail(s, max, scale, out, 2)
            },
            ..reference()
        }
    }

    /// Every bf16 table this processor has: the references in both forms, AVX2's and
    /// AVX-512's where present.
    fn tables() -> Vec<Bf16Kernels> {
        [reference(), reference_words()].into_iter().chain(Kernels::all().iter().filter_map(|k| k.bf16)).collect()
    }

    #[test]
    #[cfg_attr(not(host_avx2), ignore = "this processor lacks AVX2")]
    fn the_tests_cover_the_avx2_bf16_kernels() {
        assert!(crate::cpu::table(crate::cpu::Isa::Avx2).bf16.is_some(), "the AVX2 table has no bf16 kernels");
    }

    #[test]
    #[cfg_attr(not(host_avx512bf16), ignore = "this processor lacks AVX-512 BF16")]
    fn the_tests_cover_the_avx512_bf16_kernels() {
        assert!(crate::cpu::table(crate::cpu::Isa::Avx512Vnni).bf16.is_some(), "the AVX-512 table has no bf16 kernels");
    }

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn bf16(x: f32) -> f64 {
        f64::from(half::bf16::from_f32(x).to_f32())
    }

    /// `Σ |terms|` and `Σ terms` of one output of a product of bf16-rounded operands, in f64.
    fn exact(x: &[f32], w: &[f32]) -> (f64, f64) {
        x.iter().zip(w).fold((0.0, 0.0), |(m, s), (&a, &b)| (m + (bf16(a) * bf16(b)).abs(), s + bf16(a) * bf16(b)))
    }

    #[test]
    fn products_match_exact_sums_of_rounded_operands_at_awkward_shapes() {
        let pool = ThreadPool::new(2);
        for bk in tables() {
            // Odd columns (a half pair), rows not a whole panel, tokens not a whole tile, and
            // more pairs than one stretch.
            for (tokens, rows, cols) in [(1, 1, 1), (13, 33, 7), (11, 50, 40), (100, 70, 301), (25, 32, 2 * KC + 2)] {
                let (x, wf) = (noise(tokens * cols, 1), noise(rows * cols, 2));
                let src = Source::Strided { data: &wf, offset: 0, row: cols, col: 1, rows, cols };
                let w = pack(&pool, &bk, &src);
                let mut y = vec![f32::NAN; tokens * rows];
                product(&pool, &bk, &w, &to_tokens(&pool, &bk, &x, cols, tokens), tokens, &mut y);
                for t in 0..tokens {
                    for r in 0..rows {
                        let (mag, want) = exact(&x[t * cols..][..cols], &wf[r * cols..][..cols]);
                        let got = f64::from(y[t * rows + r]);
                        assert!(
                            (got - want).abs() <= mag * (cols + 4) as f64 * 2f64.powi(-24),
                            "{tokens}x{rows}x{cols} ({t},{r}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_tokens_outputs_do_not_depend_on_its_neighbours() {
        let pool = ThreadPool::new(2);
        for bk in tables() {
            let (cols, rows) = (300, 40);
            let w = noise(rows * cols, 3);
            let w = pack(&pool, &bk, &Source::Strided { data: &w, offset: 0, row: cols, col: 1, rows, cols });
            let x = noise(150 * cols, 4);
            let mut all = vec![0.0; 150 * rows];
            product(&pool, &bk, &w, &to_tokens(&pool, &bk, &x, cols, 150), 150, &mut all);
            for t in [0, 11, 12, 97, 149] {
                let mut one = vec![0.0; rows];
                product(&pool, &bk, &w, &to_tokens(&pool, &bk, &x[t * cols..][..cols], cols, 1), 1, &mut one);
                assert_eq!(one, all[t * rows..][..rows], "token {t}");
            }
        }
    }

    #[test]
    fn tables_agree_with_the_reference_on_conversions_and_exponentials() {
        // The bf16 values of a row in the tokens' form of `bk`, two a pair.
        let values = |bk: &Bf16Kernels, w: &[u32]| -> Vec<u16> {
            match bk.words {
                1 => w.iter().flat_map(|&v| [v as u16, (v >> 16) as u16]).collect(),
                _ => w.iter().map(|&v| (v >> 16) as u16).collect(),
            }
        };
        for bk in tables() {
            let mut x = noise(75, 5);
            x[..6].copy_from_slice(&[f32::NAN, f32::INFINITY, -0.0, f32::MAX, 1e-40, -3.0e38]);
            let (mut a, mut b) = (vec![0; 38], vec![0; 38]);
            (bk.to_bf16)(&x, &mut a);
            scalar::to_bf16(&x, &mut b);
            assert_eq!(a, b, "rounding to bf16 pairs");
            let mut t = vec![0; 38 * bk.words];
            (bk.to_tokens)(&x, &mut t);
            assert_eq!(values(&bk, &t), values(&reference(), &b), "rounding the tokens");
            let s: Vec<f32> = noise(75, 6).iter().map(|v| v * 30.0).collect();
            let (got, want) = ((bk.softmax)(&s, 0.3, &mut t), scalar::softmax_bf16(&s, 0.3, &mut b));
            assert!((got - want).abs() <= want * 1e-5, "sum {got} vs {want}");
            for (x, y) in values(&bk, &t).iter().zip(values(&reference(), &b)) {
                let (x, y) = (i32::from(*x), i32::from(y));
                assert!((x - y).abs() <= 1, "exponentials differ past one bf16 step: {x:#x} vs {y:#x}");
            }
        }
    }

    #[test]
    fn attention_matches_an_f64_softmax_of_rounded_operands() {
        let pool = ThreadPool::new(2);
        for bk in tables() {
            let (n, heads, hd) = (53, 3, 10);
            let e = heads * hd;
            let (q, k, v) = (noise(n * e, 7), noise(n * e, 8), noise(n * e, 9));
            let q: Vec<f32> = q.iter().map(|x| x * 4.0).collect();
            let mut out = vec![0.0; n * e];
            attention(&pool, &bk, [&q, &k, &v], n, heads, hd, 0.5, &mut out);
            for h in 0..heads {
                for t in 0..n {
                    let qt = &q[t * e + h * hd..][..hd];
                    let s: Vec<f64> = (0..n).map(|j| exact(qt, &k[j * e + h * hd..][..hd]).1 * 0.5).collect();
                    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let p: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = p.iter().sum();
                    for d in 0..hd {
                        let want = (0..n).map(|j| p[j] * bf16(v[j * e + h * hd + d])).sum::<f64>() / sum;
                        let got = f64::from(out[t * e + h * hd + d]);
                        // Each weight rounded to bf16: within 2⁻⁸ of the weighted mean's scale.
                        assert!((got - want).abs() <= 4e-3, "head {h} query {t} dim {d}: {got} vs {want}");
                    }
                }
            }
        }
    }
}
