//! The vision transformer of SigLIP (Gemma 3's image encoder) and Gemma 3's projector, over
//! one image's patches at once, on the language model's kernels and thread pool.
//!
//! Patches (`patch x patch` pixels of each channel) are embedded by one product (the
//! convolution of stride `patch` written as a matrix over the patches), learned positions are
//! added, then pre-norm layers: layer norm, attention of every patch to every patch (no mask),
//! layer norm, a GELU feed-forward; a last layer norm. Gemma 3's projector averages the
//! patches `merge x merge` on their grid, RMS-norms them and projects them to the language
//! model's width: one row per image token, row-major over the pooled grid.

use super::clip::{ClipConfig, ClipWeights, LayerNorm, Linear};
use half::f16;
use inferd_kernels::gemm;
use inferd_kernels::matmul::{matmul_many, Input, Matrix};
use inferd_kernels::pack::Layout;
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::quant::{BlockQ8, DType, QK};
use inferd_kernels::Kernels;

/// The image tokens of `planes` (the normalized input, three `image_size²` planes):
/// `(grid / merge)²` rows of `cfg.out_width` floats.
/// `soft_norm` and `projection` are Gemma 3's projector ([`super::clip::Head::Gemma3`]).
/// `None` where `stop` said so before a layer.
pub fn encode(
    pool: &ThreadPool,
    k: &Kernels,
    cfg: &ClipConfig,
    w: &ClipWeights,
    (soft_norm, projection): (&[f32], &Linear),
    planes: &[f32],
    stop: &dyn Fn() -> bool,
) -> Option<Vec<f32>> {
    let (g, e) = (cfg.grid(), cfg.hidden);
    let n = g * g;
    let side = cfg.image_size;
    let patches = patch_rows(pool, planes, (side, side), cfg.patch, n, &|i| (i / g, i % g));
    let mut x = linear(pool, k, &w.patch, &patches, n);
    x.iter_mut().zip(w.positions.iter()).for_each(|(x, p)| *x += p);
    let mut h = vec![0.0; n * e];
    for l in &w.layers {
        if stop() {
            return None;
        }
        layer_norm(pool, &x, &l.ln1, cfg.eps, &mut h);
        let [q, kk, v] = products(pool, k, [&l.q, &l.k, &l.v], &h, n);
        let a = attention(pool, k, cfg, &q, &kk, &v, n);
        let o = linear(pool, k, &l.out, &a, n);
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        layer_norm(pool, &x, &l.ln2, cfg.eps, &mut h);
        let mut u = linear(pool, k, &l.up, &h, n);
        gelu(pool, k, &mut u, cfg.ffn);
        let d = linear(pool, k, &l.down, &u, n);
        x.iter_mut().zip(&d).for_each(|(x, d)| *x += d);
    }
    layer_norm(pool, &x, &w.post_ln, cfg.eps, &mut h);
    // Gemma 3's projector: average pooling on the grid, RMS norm, projection.
    let (m, pg) = (cfg.merge, g / cfg.merge);
    let mut pooled = vec![0.0; pg * pg * e];
    let inv = 1.0 / (m * m) as f32;
    for (t, out) in pooled.chunks_exact_mut(e).enumerate() {
        let (oy, ox) = (t / pg, t % pg);
        for dy in 0..m {
            for dx in 0..m {
                let src = &h[((oy * m + dy) * g + ox * m + dx) * e..][..e];
                out.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            }
        }
        out.iter_mut().for_each(|o| *o *= inv);
        rms_norm_in_place(out, soft_norm, cfg.eps);
    }
    Some(linear(pool, k, projection, &pooled, pg * pg))
}

/// `n` patches of `planes` (three planes of `width x height`) as rows of (channel, row, column),
/// the patch convolution's weight order: row `i` is the patch at (row, column) `at(i)` of the
/// grid of `patch`-pixel squares.
pub(super) fn patch_rows(
    pool: &ThreadPool,
    planes: &[f32],
    (width, height): (usize, usize),
    patch: usize,
    n: usize,
    at: &(dyn Fn(usize) -> (usize, usize) + Sync),
) -> Vec<f32> {
    let p = patch;
    let mut patches = vec![0.0; n * 3 * p * p];
    pool.for_rows(&mut patches, 3 * p * p, &|first, rows| {
        for (i, row) in rows.chunks_exact_mut(3 * p * p).enumerate() {
            let (py, px) = at(first + i);
            for c in 0..3 {
                for ky in 0..p {
                    let src = &planes[c * width * height + (py * p + ky) * width + px * p..][..p];
                    row[(c * p + ky) * p..][..p].copy_from_slice(src);
                }
            }
        }
    });
    patches
}

/// GELU (tanh's approximation) of each value: the gated kernel with ones as its other factor.
pub(super) fn gelu(pool: &ThreadPool, k: &Kernels, x: &mut [f32], width: usize) {
    let ones = vec![1.0; width];
    pool.for_rows(x, width, &|_, rows| rows.chunks_exact_mut(width).for_each(|r| (k.geglu)(r, &ones)));
}

/// `x / sqrt(mean(x²) + eps) * w`, the mean of squares summed in f64.
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / ((ms as f32) + eps).sqrt();
    x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * inv * w);
}

/// Each row of `x` layer-normed into `out`: `(x - mean) / sqrt(var + eps) * w + b`.
pub(super) fn layer_norm(pool: &ThreadPool, x: &[f32], ln: &LayerNorm, eps: f32, out: &mut [f32]) {
    let e = ln.w.len();
    pool.for_rows(out, e, &|r, rows| {
        for (i, o) in rows.chunks_exact_mut(e).enumerate() {
            let src = &x[(r + i) * e..][..e];
            let mean = src.iter().map(|&v| f64::from(v)).sum::<f64>() / e as f64;
            let var = src.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / e as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            for (((o, &v), w), b) in o.iter_mut().zip(src).zip(&ln.w).zip(&ln.b) {
                *o = ((f64::from(v) - mean) * inv) as f32 * w + b;
            }
        }
    });
}

/// `x · Wᵀ + b` for `tokens` rows of `x`.
pub(super) fn linear(pool: &ThreadPool, k: &Kernels, l: &Linear, x: &[f32], tokens: usize) -> Vec<f32> {
    let [y] = products(pool, k, [l], x, tokens);
    y
}

/// Several products of one input, each with its bias: in bf16 tiles ([`gemm`]) where the
/// kernel table has them (the input rounded once for all of them), else in one dispatch
/// of the decode driver, the input quantized to 8-bit blocks where a matrix is quantized.
pub(super) fn products<const M: usize>(
    pool: &ThreadPool,
    k: &Kernels,
    ls: [&Linear; M],
    x: &[f32],
    tokens: usize,
) -> [Vec<f32>; M] {
    let mut ys: [Vec<f32>; M] = std::array::from_fn(|i| vec![0.0; tokens * ls[i].w.rows]);
    let cols = x.len() / tokens.max(1);
    if let Some(bk) = &k.bf16 {
        let rounded = gemm::to_tokens(pool, bk, x, cols, tokens);
        for (y, l) in ys.iter_mut().zip(ls) {
            let w = gemm::pack(pool, bk, &gemm::Source::Matrix(l.w.matrix()));
            gemm::product(pool, bk, &w, &rounded, tokens, y);
        }
    } else {
        let mut q8 = Vec::new();
        if ls.iter().any(|l| l.w.dtype.is_quantized()) {
            q8 = vec![BlockQ8::default(); x.len() / QK];
            pool.for_rows(&mut q8, cols / QK, &|first, q8| (k.quantize_q8)(&x[first * cols..][..q8.len() * QK], q8));
        }
        let mats: Vec<Matrix<'_>> = ls.iter().map(|l| l.w.matrix()).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        matmul_many(pool, k, &mats, &Input { f32: x, q8: &q8, tokens }, &mut outs);
    }
    for (y, l) in ys.iter_mut().zip(ls) {
        y.chunks_exact_mut(l.b.len()).for_each(|row| row.iter_mut().zip(&l.b).for_each(|(v, b)| *v += b));
    }
    ys
}

/// Every patch attending to every patch, head by head: the scores `K_h · q` as one product
/// (the head's keys, rounded to f16, as the matrix), a softmax per row, then the values the
/// same way (the head's values transposed, in f16, as the matrix).
pub(super) fn attention(
    pool: &ThreadPool,
    k: &Kernels,
    cfg: &ClipConfig,
    q: &[f32],
    kk: &[f32],
    v: &[f32],
    n: usize,
) -> Vec<f32> {
    let (e, hd) = (cfg.hidden, cfg.head_dim);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0; n * e];
    if let Some(bk) = &k.bf16 {
        gemm::attention(pool, bk, [q, kk, v], n, cfg.heads, hd, scale, &mut out);
        return out;
    }
    let mut qh = vec![0.0; n * hd];
    let mut scores = vec![0.0; n * n];
    let mut oh = vec![0.0; n * hd];
    for h in 0..cfg.heads {
        let col = h * hd;
        let mut keys = Vec::with_capacity(n * hd * 2);
        let mut values_t = Vec::with_capacity(n * hd * 2);
        for t in 0..n {
            qh[t * hd..][..hd].copy_from_slice(&q[t * e + col..][..hd]);
            kk[t * e + col..][..hd].iter().for_each(|&x| keys.extend_from_slice(&f16::from_f32(x).to_le_bytes()));
        }
        for d in 0..hd {
            (0..n).for_each(|t| values_t.extend_from_slice(&f16::from_f32(v[t * e + col + d]).to_le_bytes()));
        }
        let km = Matrix { dtype: DType::F16, rows: n, cols: hd, data: &keys, layout: Layout::Rows };
        matmul_many(pool, k, &[km], &Input { f32: &qh, q8: &[], tokens: n }, &mut [&mut scores]);
        pool.for_rows(&mut scores, n, &|_, rows| {
            for row in rows.chunks_exact_mut(n) {
                row.iter_mut().for_each(|s| *s *= scale);
                inferd_kernels::ops::softmax(row);
            }
        });
        let vm = Matrix { dtype: DType::F16, rows: hd, cols: n, data: &values_t, layout: Layout::Rows };
        matmul_many(pool, k, &[vm], &Input { f32: &scores, q8: &[], tokens: n }, &mut [&mut oh]);
        for t in 0..n {
            out[t * e + col..][..hd].copy_from_slice(&oh[t * hd..][..hd]);
        }
    }
    out
}
