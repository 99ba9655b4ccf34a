//! Mixture of experts: the router's choice of experts for each token, and the experts'
//! feed-forward products grouped by expert.
//!
//! [`route`] follows llama.cpp's `build_moe_ffn`: the gate's probabilities (a softmax over the
//! router's logits, or a sigmoid of each), a selection bias added for the choice alone
//! (DeepSeek-style load balancing), the `top_k` highest chosen (ties to the lower expert), their
//! probabilities as weights (gpt-oss instead takes the softmax of the chosen logits), normalized
//! to sum 1 where the family says so (Qwen3's `norm_topk_prob`), and scaled.
//!
//! [`experts_ffn`] runs a step's tokens grouped by the expert they chose: each chosen expert's
//! gate, up and down matrices are read once for all of its tokens (a batch of 8 tokens that
//! choose 8 of 128 experts each reads at most 64 experts, however the choices overlap, never
//! 8 x 8 matrices one token at a time), and every token's result is the weighted sum of its
//! experts' outputs in its own order of choice. The products follow the lane arithmetic (a
//! token's result does not depend on its batch: [`crate::matmul`]), so the whole is
//! batch-invariant too: each token gets, bit for bit, what it gets alone.

use crate::cpu::Kernels;
use crate::matmul::{matmul_grouped, Input, Matrix};
use crate::pack::Layout;
use crate::pool::ThreadPool;
use crate::quant::{BlockQ8, DType, QK};

/// How the router turns its logits into probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// A softmax over all experts (Qwen3 MoE, Mixtral).
    Softmax,
    /// A sigmoid of each logit (DeepSeek V3, GLM-4.5).
    Sigmoid,
    /// The chosen experts' logits, then a softmax over those alone (gpt-oss).
    SoftmaxOfChosen,
}

/// A family's routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    pub gate: Gate,
    /// Experts per token.
    pub top_k: usize,
    /// The chosen weights divided by their sum.
    pub normalize: bool,
    /// A factor on every chosen weight (1 for most families).
    pub scale: f32,
}

/// A token's `routing.top_k` experts and their weights, in order of choice (best first), from
/// the router's `logits` (one per expert); `selection_bias` (one per expert) moves the choice,
/// not the weights.
pub fn route(routing: &Routing, logits: &[f32], selection_bias: Option<&[f32]>) -> Vec<(u32, f32)> {
    let n = logits.len();
    let k = routing.top_k.min(n);
    let mut probs = logits.to_vec();
    match routing.gate {
        Gate::Softmax => {
            crate::ops::softmax(&mut probs);
        }
        Gate::Sigmoid => probs.iter_mut().for_each(|p| *p = 1.0 / (1.0 + (-*p).exp())),
        Gate::SoftmaxOfChosen => {}
    }
    let score = |e: usize| probs[e] + selection_bias.map_or(0.0, |b| b[e]);
    let mut order: Vec<usize> = (0..n).collect();
    // Highest score first; equal scores keep the lower expert first (a stable sort).
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
    order.truncate(k);
    let mut weights: Vec<f32> = order.iter().map(|&e| probs[e]).collect();
    if routing.gate == Gate::SoftmaxOfChosen {
        crate::ops::softmax(&mut weights);
    }
    if routing.normalize {
        // As llama.cpp: the sum clamped away from zero.
        let sum = weights.iter().sum::<f32>().max(6.103_515_6e-5);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= routing.scale);
    order.into_iter().map(|e| e as u32).zip(weights).collect()
}

/// A stack of expert matrices of one type and shape, as GGUF's 3-D expert tensors hold them:
/// expert `e`'s `rows` rows start at byte `e * rows * row_bytes` (packed for the 16-row kernel
/// as one matrix of `n * rows` rows, when `rows` is a multiple of 16).
#[derive(Clone, Copy, Debug)]
pub struct Experts<'a> {
    pub dtype: DType,
    pub n: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    pub layout: Layout,
}

impl<'a> Experts<'a> {
    /// Expert `e`'s matrix.
    pub fn matrix(&self, e: usize) -> Matrix<'a> {
        let size = self.rows * self.dtype.bytes_for(self.cols).unwrap_or(0);
        Matrix {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data[e * size..(e + 1) * size],
            layout: self.layout,
        }
    }
}

/// One expert feed-forward: `down · act(gate · x, up · x)`, each a stack of experts.
#[derive(Clone, Copy, Debug)]
pub struct ExpertFfn<'a> {
    pub gate: Experts<'a>,
    pub up: Experts<'a>,
    pub down: Experts<'a>,
    /// `gate = act(gate, up)` in place (SwiGLU, or gpt-oss's clamped one).
    pub act: fn(&mut [f32], &[f32]),
    /// Biases of the gate, up and down products (gpt-oss), each expert's `rows` after the one
    /// before's.
    pub biases: Option<[&'a [f32]; 3]>,
}

/// Adds expert `e`'s bias (of `rows` per expert in `bias`) to each of the `out` rows.
fn add_bias(out: &mut [f32], bias: &[f32], e: usize, rows: usize) {
    crate::ops::add_bias_rows(out, &bias[e * rows..(e + 1) * rows]);
}

/// The buffers of [`experts_ffn`], kept between calls (it runs in every layer of every step).
#[derive(Default)]
pub struct MoeScratch {
    /// Who chose each expert: (token, slot) in token order.
    by_expert: Vec<Vec<(usize, usize)>>,
    /// Every token's input rows as 8-bit blocks, quantized once for all its experts.
    q8_all: Vec<BlockQ8>,
    /// The chosen experts' tokens one expert after another: their inputs, 8-bit inputs,
    /// products, and the down products' 8-bit inputs.
    xs: Vec<f32>,
    q8: Vec<BlockQ8>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    q8_down: Vec<BlockQ8>,
    /// Each (token, slot)'s row in `down`.
    row_of: Vec<usize>,
}

/// `y[t] = Σ_j w_tj · ffn_{e_tj}(x[t])` for the `n` tokens of `x` (rows of `cols` floats) and
/// their choices (`chosen[t]`: `(expert, weight)` in order of choice), into `y` (`n` rows of
/// the down matrices' `rows`). The tokens are grouped by expert (module docs), and every
/// chosen expert's gate and up products run in one dispatch of the pool, its down products in
/// a second: two barriers a layer, however many experts ran. Returns how many experts ran.
pub fn experts_ffn(
    pool: &ThreadPool,
    k: &Kernels,
    ffn: &ExpertFfn<'_>,
    x: &[f32],
    chosen: &[Vec<(u32, f32)>],
    y: &mut [f32],
    s: &mut MoeScratch,
) -> usize {
    let (n, cols, hidden) = (chosen.len(), ffn.gate.cols, ffn.down.rows);
    let width = ffn.gate.rows;
    assert!(x.len() == n * cols && y.len() == n * hidden, "shapes");
    assert!(ffn.up.rows == width && ffn.down.cols == width && ffn.up.cols == cols, "an expert's matrices fit");
    if let Some([g, u, d]) = ffn.biases {
        let e = ffn.gate.n;
        assert!(g.len() == e * width && u.len() == e * width && d.len() == e * hidden, "a bias per expert row");
    }
    s.by_expert.iter_mut().for_each(Vec::clear);
    s.by_expert.resize_with(ffn.gate.n, Vec::new);
    for (t, c) in chosen.iter().enumerate() {
        for (j, &(e, _)) in c.iter().enumerate() {
            s.by_expert[e as usize].push((t, j));
        }
    }
    // A row's blocks are the same whichever rows it is quantized with: once for every expert.
    let quantized = ffn.gate.dtype.is_quantized() || ffn.up.dtype.is_quantized();
    let float = !ffn.gate.dtype.is_quantized() || !ffn.up.dtype.is_quantized();
    if quantized {
        s.q8_all.resize(x.len() / QK, BlockQ8::default());
        (k.quantize_q8)(x, &mut s.q8_all);
    }
    // The chosen experts, each with its first row in the gathered buffers and its tokens.
    let ran: Vec<(usize, usize, usize)> = {
        let mut at = 0;
        (s.by_expert.iter().enumerate())
            .filter(|(_, u)| !u.is_empty())
            .map(|(e, u)| {
                at += u.len();
                (e, at - u.len(), u.len())
            })
            .collect()
    };
    let rows: usize = ran.iter().map(|r| r.2).sum();
    let nb = cols / QK;
    s.xs.clear();
    s.q8.clear();
    for users in s.by_expert.iter() {
        for &(t, _) in users {
            if float {
                s.xs.extend_from_slice(&x[t * cols..(t + 1) * cols]);
            }
            if quantized {
                s.q8.extend_from_slice(&s.q8_all[t * nb..(t + 1) * nb]);
            }
        }
    }
    /// Rows `r0..r0 + m` of gathered inputs of `c` columns (either may be absent: empty).
    fn input<'a>(f32: &'a [f32], q8: &'a [BlockQ8], r0: usize, m: usize, c: usize) -> Input<'a> {
        Input {
            f32: if f32.is_empty() { f32 } else { &f32[r0 * c..(r0 + m) * c] },
            q8: if q8.is_empty() { q8 } else { &q8[r0 * c / QK..(r0 + m) * c / QK] },
            tokens: m,
        }
    }
    // Gate and up of every chosen expert, one dispatch.
    s.gate.resize(rows * width, 0.0);
    s.up.resize(rows * width, 0.0);
    {
        let inputs: Vec<Input<'_>> = ran.iter().map(|&(_, r0, m)| input(&s.xs, &s.q8, r0, m, cols)).collect();
        let mut products = Vec::with_capacity(2 * ran.len());
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(2 * ran.len());
        let (mut gate, mut up) = (s.gate.as_mut_slice(), s.up.as_mut_slice());
        for (i, &(e, _, m)) in ran.iter().enumerate() {
            products.push((ffn.gate.matrix(e), i));
            products.push((ffn.up.matrix(e), i));
            let (g, g_rest) = std::mem::take(&mut gate).split_at_mut(m * width);
            let (u, u_rest) = std::mem::take(&mut up).split_at_mut(m * width);
            (gate, up) = (g_rest, u_rest);
            outs.push(g);
            outs.push(u);
        }
        matmul_grouped(pool, k, &products, &inputs, &mut outs);
    }
    if let Some([gate_b, up_b, _]) = ffn.biases {
        for &(e, r0, m) in &ran {
            add_bias(&mut s.gate[r0 * width..(r0 + m) * width], gate_b, e, width);
            add_bias(&mut s.up[r0 * width..(r0 + m) * width], up_b, e, width);
        }
    }
    (ffn.act)(&mut s.gate, &s.up);
    // Down of every chosen expert, a second dispatch.
    s.q8_down.clear();
    let down_float = !ffn.down.dtype.is_quantized();
    if !down_float {
        s.q8_down.resize(s.gate.len() / QK, BlockQ8::default());
        (k.quantize_q8)(&s.gate, &mut s.q8_down);
    }
    s.down.resize(rows * hidden, 0.0);
    {
        let f32: &[f32] = if down_float { &s.gate } else { &[] };
        let inputs: Vec<Input<'_>> = ran.iter().map(|&(_, r0, m)| input(f32, &s.q8_down, r0, m, width)).collect();
        let products: Vec<_> = ran.iter().enumerate().map(|(i, &(e, _, _))| (ffn.down.matrix(e), i)).collect();
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(ran.len());
        let mut down = s.down.as_mut_slice();
        for &(_, _, m) in &ran {
            let (d, rest) = std::mem::take(&mut down).split_at_mut(m * hidden);
            down = rest;
            outs.push(d);
        }
        matmul_grouped(pool, k, &products, &inputs, &mut outs);
    }
    if let Some([_, _, down_b]) = ffn.biases {
        for &(e, r0, m) in &ran {
            add_bias(&mut s.down[r0 * hidden..(r0 + m) * hidden], down_b, e, hidden);
        }
    }
    // Each token's weighted sum in its own order of choice: where each (token, slot)'s row is.
    let slots = chosen.iter().map(Vec::len).max().unwrap_or(0);
    s.row_of.clear();
    s.row_of.resize(n * slots, 0);
    for &(e, r0, _) in &ran {
        for (i, &(t, j)) in s.by_expert[e].iter().enumerate() {
            s.row_of[t * slots + j] = r0 + i;
        }
    }
    for (t, c) in chosen.iter().enumerate() {
        let yt = &mut y[t * hidden..(t + 1) * hidden];
        yt.fill(0.0);
        for (j, &(_, w)) in c.iter().enumerate() {
            let r = s.row_of[t * slots + j];
            let o = &s.down[r * hidden..(r + 1) * hidden];
            yt.iter_mut().zip(o).for_each(|(y, o)| *y += w * o);
        }
    }
    ran.len()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn the_router_chooses_by_score_and_weighs_by_probability() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0];
        let softmax = Routing { gate: Gate::Softmax, top_k: 3, normalize: false, scale: 1.0 };
        let p: Vec<f32> = {
            let mut p = logits.to_vec();
            crate::ops::softmax(&mut p);
            p
        };
        let r = route(&softmax, &logits, None);
        // Ties go to the lower expert: 1 before 3.
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3, 2]);
        assert_eq!(r.iter().map(|c| c.1).collect::<Vec<_>>(), [p[1], p[3], p[2]]);
        // Normalized, scaled.
        let r = route(&Routing { normalize: true, scale: 2.0, ..softmax }, &logits, None);
        let sum = p[1] + p[3] + p[2];
        assert_eq!(r[0].1, p[1] / sum * 2.0);
        assert!((r.iter().map(|c| c.1).sum::<f32>() - 2.0).abs() < 1e-6);
        // A selection bias moves the choice, not the weights.
        let bias = [0.0, 0.0, 0.0, 0.0, 10.0];
        let sigmoid = Routing { gate: Gate::Sigmoid, top_k: 2, normalize: false, scale: 1.0 };
        let r = route(&sigmoid, &logits, Some(&bias));
        assert_eq!(r[0], (4, 1.0 / (1.0 + 1f32.exp())));
        assert_eq!(r[1].0, 1);
        // gpt-oss: the chosen logits' own softmax.
        let r = route(&Routing { gate: Gate::SoftmaxOfChosen, ..sigmoid }, &logits, None);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        assert_eq!((r[0].1, r[1].1), (0.5, 0.5));
    }

    /// The grouped products equal, bit for bit, each token alone; an expert chosen by many
    /// tokens runs once.
    fn grouped_products_equal_each_token_alone(k: &Kernels) {
        let pool = ThreadPool::new(2);
        let (n_exp, tokens) = (6, 7);
        for (dt, packed) in
            [(DType::Q4K, false), (DType::Q8_0, true), (DType::MXFP4, false), (DType::MXFP4, true), (DType::F16, false)]
        {
            let layout = if packed && k.packs(dt) { Layout::Packed16 } else { Layout::Rows };
            // Widths of whole blocks, rows of whole groups of 16 (for the packed layout).
            let (cols, width) = if dt.block_len() > 32 { (256, 256) } else { (64, 32) };
            // Each stack as the file holds it (for the reference) and as the kernels take it.
            let stack = |rows: usize, c: usize, seed: usize| -> (Vec<u8>, Vec<u8>) {
                let mut data = Vec::new();
                for r in 0..n_exp * rows {
                    let row: Vec<f32> =
                        (0..c).map(|i| (((r * 31 + i * 7 + seed) * 7919) % 113) as f32 / 56.0 - 1.0).collect();
                    quantize_row(dt, &row, &mut data);
                }
                if layout == Layout::Packed16 {
                    let packed = crate::pack::pack(&pool, dt, n_exp * rows, c, &data).unwrap().to_vec();
                    return (data, packed);
                }
                (data.clone(), data)
            };
            let ((gf, g), (uf, u), (df, d)) = (stack(width, cols, 1), stack(width, cols, 2), stack(cols, width, 3));
            let ex = |data, rows, c| Experts { dtype: dt, n: n_exp, rows, cols: c, data, layout };
            // gpt-oss's form with MXFP4: biases on every product, the clamped SwiGLU.
            let oai = dt == DType::MXFP4;
            let bias = |rows: usize, salt: usize| -> Vec<f32> {
                (0..n_exp * rows).map(|i| ((i * 37 + salt) % 29) as f32 / 14.0 - 1.0).collect()
            };
            let (gate_b, up_b, down_b) = (bias(width, 1), bias(width, 2), bias(cols, 3));
            let act: fn(&mut [f32], &[f32]) = if oai { crate::ops::swiglu_oai } else { k.swiglu };
            let ffn = ExpertFfn {
                gate: ex(g.as_slice(), width, cols),
                up: ex(u.as_slice(), width, cols),
                down: ex(d.as_slice(), cols, width),
                act,
                biases: oai.then_some([&gate_b[..], &up_b[..], &down_b[..]]),
            };
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104_729) % 97) as f32 / 48.0 - 1.0).collect();
            let routing = Routing { gate: Gate::Softmax, top_k: 2, normalize: true, scale: 1.0 };
            let chosen: Vec<Vec<(u32, f32)>> = (0..tokens)
                .map(|t| {
                    let logits: Vec<f32> = (0..n_exp).map(|e| ((t * 5 + e * 3) % 7) as f32 / 3.0).collect();
                    route(&routing, &logits, None)
                })
                .collect();
            let mut y = vec![0f32; tokens * cols];
            let ran = experts_ffn(&pool, k, &ffn, &x, &chosen, &mut y, &mut MoeScratch::default());
            let distinct: std::collections::BTreeSet<u32> = chosen.iter().flatten().map(|c| c.0).collect();
            assert_eq!(ran, distinct.len(), "{dt:?}: each chosen expert once");
            // Against the dequantized experts in f32, each token and expert apart.
            let deq = |data: &[u8], e: usize, rows: usize, c: usize| -> Vec<f32> {
                let rb = dt.bytes_for(c).unwrap();
                let mut out = vec![0f32; rows * c];
                for r in 0..rows {
                    let at = (e * rows + r) * rb;
                    crate::quant::dequantize_row(dt, &data[at..at + rb], &mut out[r * c..(r + 1) * c]);
                }
                out
            };
            let mv = |w: &[f32], x: &[f32]| -> Vec<f32> {
                w.chunks_exact(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
            };
            for (t, c) in chosen.iter().enumerate() {
                let xt = &x[t * cols..(t + 1) * cols];
                let mut want = vec![0f32; cols];
                for &(e, w) in c {
                    let e = e as usize;
                    let mut gate = mv(&deq(&gf, e, width, cols), xt);
                    let mut up = mv(&deq(&uf, e, width, cols), xt);
                    if oai {
                        gate.iter_mut().zip(&gate_b[e * width..]).for_each(|(v, b)| *v += b);
                        up.iter_mut().zip(&up_b[e * width..]).for_each(|(v, b)| *v += b);
                        crate::ops::swiglu_oai(&mut gate, &up);
                    } else {
                        crate::ops::swiglu(&mut gate, &up);
                    }
                    let mut down = mv(&deq(&df, e, cols, width), &gate);
                    if oai {
                        down.iter_mut().zip(&down_b[e * cols..]).for_each(|(v, b)| *v += b);
                    }
                    want.iter_mut().zip(&down).for_each(|(a, b)| *a += w * b);
                }
                let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                for (i, (a, b)) in want.iter().zip(&y[t * cols..(t + 1) * cols]).enumerate() {
                    assert!((a - b).abs() <= 0.05 * scale, "{dt:?} {layout:?} token {t} [{i}]: {b} vs {a}");
                }
            }
            // One scratch for the calls that follow: what a call leaves there changes nothing.
            let mut scratch = MoeScratch::default();
            for t in 0..tokens {
                let mut alone = vec![0f32; cols];
                experts_ffn(&pool, k, &ffn, &x[t * cols..(t + 1) * cols], &chosen[t..t + 1], &mut alone, &mut scratch);
                assert_eq!(alone, y[t * cols..(t + 1) * cols], "{dt:?} {layout:?}: token {t} alone");
            }
            // Everyone on one expert: it runs once, and each token's result is that expert's
            // output alone.
            let same: Vec<Vec<(u32, f32)>> = (0..tokens).map(|_| vec![(3, 1.0)]).collect();
            assert_eq!(experts_ffn(&pool, k, &ffn, &x, &same, &mut y, &mut scratch), 1);
        }
    }

    crate::cpu::test_every_isa!(grouped_products_equal_each_token_alone);
}
