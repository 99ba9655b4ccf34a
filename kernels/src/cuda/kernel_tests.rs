//! Every CUDA kernel against the CPU backend's operation or a float64 reference, through a
//! `Runner`: on the host everywhere (`host_shim.h` runs each kernel's blocks as fibers that wait
//! for each other at `__syncthreads` and the warp shuffles), and on the GPU through the same typed calls
//! (`super::gpu::Gpu`) where there is one (elsewhere that test is ignored with the reason;
//! `tests/gpu/run` runs it). The host run checks the kernels' logic; the GPU run adds the
//! device's own math, memory and launch geometry.

use super::calls::{AttentionShape, DeltaRows, Gated, KernelCalls, WeightShape};
use super::host::Host;
use super::stream::{GemmShape, Stream};
use crate::deltanet::{DeltaShape, Inputs};
use crate::ops::{Rope, RopeStyle};
use crate::quant::{dequantize_row, DType, QuantType};
use crate::quantize::random_blocks;
use std::sync::OnceLock;

/// The host emulation, its harness compiled once per test process.
fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| Host::new(&super::tests::scratch("cuda-host")).unwrap_or_else(|e| panic!("{e}")))
}

/// The kernels as the checks call them: inputs in, output out.
trait Runner {
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Vec<f32>;
    #[allow(clippy::too_many_arguments)]
    fn rope(&self, x: &[f32], pos: &[i32], freq: &[f32], heads: usize, hd: usize, neox: bool, scale: f32) -> Vec<f32>;
    fn gated_act(&self, gate: &[f32], up: &[f32], kind: Gated) -> Vec<f32>;
    /// `dst` with `src`'s rows times `weights` added to its rows `rows`.
    fn scatter_add_rows(&self, src: &[f32], rows: &[i32], weights: &[f32], n: usize, dst: &[f32]) -> Vec<f32>;
    fn matvec(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32>;
    /// `x` rounded to 8 bits (quants, scales, half sums), and a quantized `w`'s product with it.
    fn matvec_q8(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> (Q8Host, Vec<f32>);
    fn embed(&self, dtype: DType, table: &[u8], ids: &[i32], cols: usize, scale: f32) -> Vec<f32>;
    fn kv_attention(&self, a: &AttentionCase) -> Vec<f32>;
    fn dequantize_half(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, bf16: bool) -> Vec<u16>;
    fn to_half(&self, x: &[f32], bf16: bool) -> Vec<u16>;
    /// `None` where the stream has no product of halves (a GPU without cuBLAS).
    fn gemm(&self, w: &[u16], x: &[u16], shape: GemmShape) -> Option<Vec<f32>>;
    /// Gated DeltaNet's recurrence from `state` (slot 1 of two) over `x`'s rows at positions
    /// `start..`: the state after and the outputs.
    fn delta_step(&self, shape: DeltaShape, state: &[f32], start: usize, x: &Inputs<'_>) -> (Vec<f32>, Vec<f32>);
    /// The convolution and SiLU of `x`'s rows at positions `start..` with `ring` (at float 3 of
    /// its buffer): the ring after and the outputs.
    fn delta_conv(&self, x: &[f32], ring: &[f32], taps: &[f32], channels: usize, start: usize) -> (Vec<f32>, Vec<f32>);
    /// `xc`'s rows split into L2-normed queries and keys, and values.
    fn delta_split(&self, xc: &[f32], shape: (usize, usize, usize), eps: f32) -> [Vec<f32>; 3];
    /// The log decays and write strengths.
    fn delta_gates(&self, alpha: &[f32], b: &[f32], dt_bias: &[f32], a: &[f32]) -> [Vec<f32>; 2];
    fn split_pairs(&self, x: &[f32], hd: usize) -> [Vec<f32>; 2];
    fn gate_by(&self, x: &[f32], g: &[f32], silu: bool) -> Vec<f32>;
    /// `buf` after `n` floats moved from `from` (zeros for `None`) to `to`.
    fn move_floats(&self, buf: &[f32], from: Option<usize>, to: usize, n: usize) -> Vec<f32>;
}

/// `quantize_q8`'s output, downloaded: quants, scales, half sums.
type Q8Host = (Vec<u8>, Vec<f32>, Vec<i32>);

/// Tokens' K/V stored into a pool of `blocks` blocks, then queries attending over their
/// sequences' block tables (`table_len` entries each).
struct AttentionCase {
    k: Vec<f32>,
    v: Vec<f32>,
    slots: Vec<i32>,
    q: Vec<f32>,
    tables: Vec<i32>,
    table_len: usize,
    table_of: Vec<i32>,
    q_pos: Vec<i32>,
    heads: (usize, usize),
    hd: usize,
    bs: usize,
    blocks: usize,
    window: usize,
    scale: f32,
    /// Positions per split of the launch's plan; `None`: the plan's own choice.
    split_len: Option<usize>,
    /// A sink logit per query head (gpt-oss), or none.
    sinks: Option<Vec<f32>>,
}

/// Every stream runs the checks through the same typed calls.
impl<S: Stream> Runner for S {
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let (dx, dw, mut dy) = (self.upload(x).unwrap(), self.upload(w).unwrap(), self.zeros::<f32>(x.len()).unwrap());
        KernelCalls::rms_norm(self, &dx, &dw, &mut dy, eps).unwrap();
        self.download(&dy).unwrap()
    }
    fn rope(&self, x: &[f32], pos: &[i32], freq: &[f32], heads: usize, hd: usize, neox: bool, scale: f32) -> Vec<f32> {
        let mut dx = self.upload(x).unwrap();
        let (dp, df) = (self.upload(pos).unwrap(), self.upload(freq).unwrap());
        KernelCalls::rope(self, &mut dx, &dp, &df, heads, hd, neox, scale).unwrap();
        self.download(&dx).unwrap()
    }
    fn gated_act(&self, gate: &[f32], up: &[f32], kind: Gated) -> Vec<f32> {
        let mut dg = self.upload(gate).unwrap();
        KernelCalls::gated_act(self, &mut dg, &self.upload(up).unwrap(), kind).unwrap();
        self.download(&dg).unwrap()
    }
    fn scatter_add_rows(&self, src: &[f32], rows: &[i32], weights: &[f32], n: usize, dst: &[f32]) -> Vec<f32> {
        let mut dd = self.upload(dst).unwrap();
        let (ds, dr, dw) = (self.upload(src).unwrap(), self.upload(rows).unwrap(), self.upload(weights).unwrap());
        KernelCalls::scatter_add_rows(self, &ds, &dr, &dw, n, &mut dd).unwrap();
        self.download(&dd).unwrap()
    }
    fn matvec(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        let tokens = x.len() / cols;
        let mut dy = self.zeros::<f32>(rows * tokens).unwrap();
        let (dw, dx) = (self.upload(w).unwrap(), self.upload(x).unwrap());
        let shape = WeightShape { ggml_type: dtype.ggml_type(), row_bytes: dtype.bytes_for(cols).unwrap(), rows, cols };
        KernelCalls::matvec(self, &dw, shape, &dx, tokens, &mut dy).unwrap();
        self.download(&dy).unwrap()
    }
    fn matvec_q8(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> (Q8Host, Vec<f32>) {
        let tokens = x.len() / cols;
        let a = KernelCalls::quantize_q8(self, &self.upload(x).unwrap(), tokens, cols).unwrap();
        let mut dy = self.zeros::<f32>(rows * tokens).unwrap();
        let shape = WeightShape { ggml_type: dtype.ggml_type(), row_bytes: dtype.bytes_for(cols).unwrap(), rows, cols };
        KernelCalls::matvec_q8(self, &self.upload(w).unwrap(), shape, &a, &mut dy).unwrap();
        let q8 = (self.download(&a.q).unwrap(), self.download(&a.d).unwrap(), self.download(&a.sums).unwrap());
        (q8, self.download(&dy).unwrap())
    }
    fn embed(&self, dtype: DType, table: &[u8], ids: &[i32], cols: usize, scale: f32) -> Vec<f32> {
        let mut dy = self.zeros::<f32>(ids.len() * cols).unwrap();
        let (dt, di) = (self.upload(table).unwrap(), self.upload(ids).unwrap());
        let row_bytes = dtype.bytes_for(cols).unwrap();
        let shape = WeightShape { ggml_type: dtype.ggml_type(), row_bytes, rows: table.len() / row_bytes, cols };
        KernelCalls::embed(self, &dt, shape, &di, scale, &mut dy).unwrap();
        self.download(&dy).unwrap()
    }
    fn kv_attention(&self, a: &AttentionCase) -> Vec<f32> {
        let pool = a.blocks * a.bs * a.heads.1 * a.hd;
        let (mut kc, mut vc) = (self.zeros::<u16>(pool).unwrap(), self.zeros::<u16>(pool).unwrap());
        let (dk, dv, ds) = (self.upload(&a.k).unwrap(), self.upload(&a.v).unwrap(), self.upload(&a.slots).unwrap());
        KernelCalls::kv_store(self, &dk, &dv, (&mut kc, &mut vc), &ds, a.heads.1 * a.hd).unwrap();
        let mut out = self.zeros::<f32>(a.q.len()).unwrap();
        let (dq, tables) = (self.upload(&a.q).unwrap(), self.upload(&a.tables).unwrap());
        let (table_of, q_pos) = (self.upload(&a.table_of).unwrap(), self.upload(&a.q_pos).unwrap());
        let sinks = a.sinks.as_ref().map(|s| self.upload(s).unwrap());
        let shape = AttentionShape {
            q_heads: a.heads.0,
            kv_heads: a.heads.1,
            head_dim: a.hd,
            block_size: a.bs,
            window: (a.window > 0).then_some(a.window),
            scale: a.scale,
        };
        let mut plan = KernelCalls::attention_plan(self, &a.table_of, &a.q_pos, shape, a.split_len).unwrap();
        if let Some(l) = a.split_len {
            assert_eq!(plan.split_len, l);
        }
        KernelCalls::attention(
            self,
            &dq,
            (&kc, &vc),
            &tables,
            &table_of,
            a.table_len,
            &q_pos,
            &mut plan,
            shape,
            sinks.as_ref(),
            &mut out,
        )
        .unwrap();
        self.download(&out).unwrap()
    }
    fn dequantize_half(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, bf16: bool) -> Vec<u16> {
        let mut out = self.zeros::<u16>(rows * cols).unwrap();
        let shape = WeightShape { ggml_type: dtype.ggml_type(), row_bytes: dtype.bytes_for(cols).unwrap(), rows, cols };
        KernelCalls::dequantize_half(self, &self.upload(w).unwrap(), shape, bf16, &mut out).unwrap();
        self.download(&out).unwrap()
    }
    fn to_half(&self, x: &[f32], bf16: bool) -> Vec<u16> {
        let mut out = self.zeros::<u16>(x.len()).unwrap();
        KernelCalls::to_half(self, &self.upload(x).unwrap(), x.len(), bf16, &mut out).unwrap();
        self.download(&out).unwrap()
    }
    fn delta_step(&self, shape: DeltaShape, state: &[f32], start: usize, x: &Inputs<'_>) -> (Vec<f32>, Vec<f32>) {
        let floats = shape.chunk_state_len();
        // The sequence's state in slot 1 of two, the other slot's floats a pattern that must
        // stay as it is.
        let mut both = values(floats, 99);
        both.extend_from_slice(state);
        let mut dstate = self.upload(&both).unwrap();
        let up = |v: &[f32]| self.upload(v).unwrap();
        let (q, k, v, g, beta) = (up(x.q), up(x.k), up(x.v), up(x.g), up(x.beta));
        let tokens = x.g.len() / shape.v_heads;
        let rows = DeltaRows { q: &q, k: &k, v: &v, g: &g, beta: &beta, t0: 0, tokens };
        let mut out = self.zeros::<f32>(tokens * shape.v_heads * shape.dv).unwrap();
        KernelCalls::delta_step(self, &mut dstate, floats, shape, start, &rows, &mut out).unwrap();
        let after = self.download(&dstate).unwrap();
        assert!(after[..floats] == values(floats, 99)[..], "the other slot changed");
        (after[floats..].to_vec(), self.download(&out).unwrap())
    }
    fn delta_conv(&self, x: &[f32], ring: &[f32], taps: &[f32], channels: usize, start: usize) -> (Vec<f32>, Vec<f32>) {
        let mut padded = vec![7.0f32; 3];
        padded.extend_from_slice(ring);
        let (dx, dt) = (self.upload(x).unwrap(), self.upload(taps).unwrap());
        let mut dring = self.upload(&padded).unwrap();
        let mut out = self.zeros::<f32>(x.len()).unwrap();
        let rows = ring.len() / channels;
        KernelCalls::delta_conv(
            self,
            &dx,
            (&mut dring, 3, rows),
            &dt,
            channels,
            (start, 0, x.len() / channels),
            &mut out,
        )
        .unwrap();
        let after = self.download(&dring).unwrap();
        assert_eq!(after[..3], [7.0; 3], "floats before the ring");
        (after[3..].to_vec(), self.download(&out).unwrap())
    }
    fn delta_split(&self, xc: &[f32], (k_heads, dk, vd): (usize, usize, usize), eps: f32) -> [Vec<f32>; 3] {
        let tokens = xc.len() / (2 * k_heads * dk + vd);
        let dx = self.upload(xc).unwrap();
        let (mut q, mut k) =
            (self.zeros::<f32>(tokens * k_heads * dk).unwrap(), self.zeros::<f32>(tokens * k_heads * dk).unwrap());
        let mut v = self.zeros::<f32>(tokens * vd).unwrap();
        KernelCalls::delta_split(self, &dx, (k_heads, dk, vd), tokens, eps, &mut q, &mut k, &mut v).unwrap();
        [self.download(&q).unwrap(), self.download(&k).unwrap(), self.download(&v).unwrap()]
    }
    fn delta_gates(&self, alpha: &[f32], b: &[f32], dt_bias: &[f32], a: &[f32]) -> [Vec<f32>; 2] {
        let up = |v: &[f32]| self.upload(v).unwrap();
        let (da, db, dd, dl) = (up(alpha), up(b), up(dt_bias), up(a));
        let (mut g, mut beta) = (self.zeros::<f32>(alpha.len()).unwrap(), self.zeros::<f32>(alpha.len()).unwrap());
        KernelCalls::delta_gates(self, &da, &db, &dd, &dl, alpha.len() / dt_bias.len(), &mut g, &mut beta).unwrap();
        [self.download(&g).unwrap(), self.download(&beta).unwrap()]
    }
    fn split_pairs(&self, x: &[f32], hd: usize) -> [Vec<f32>; 2] {
        let dx = self.upload(x).unwrap();
        let (mut a, mut b) = (self.zeros::<f32>(x.len() / 2).unwrap(), self.zeros::<f32>(x.len() / 2).unwrap());
        KernelCalls::split_pairs(self, &dx, hd, &mut a, &mut b).unwrap();
        [self.download(&a).unwrap(), self.download(&b).unwrap()]
    }
    fn gate_by(&self, x: &[f32], g: &[f32], silu: bool) -> Vec<f32> {
        let (mut dx, dg) = (self.upload(x).unwrap(), self.upload(g).unwrap());
        KernelCalls::gate_by(self, &mut dx, &dg, silu).unwrap();
        self.download(&dx).unwrap()
    }
    fn move_floats(&self, buf: &[f32], from: Option<usize>, to: usize, n: usize) -> Vec<f32> {
        let mut d = self.upload(buf).unwrap();
        KernelCalls::move_floats(self, &mut d, from, to, n).unwrap();
        self.download(&d).unwrap()
    }
    fn gemm(&self, w: &[u16], x: &[u16], shape: GemmShape) -> Option<Vec<f32>> {
        if !self.has_gemm() {
            return None;
        }
        let mut y = self.zeros::<f32>(shape.tokens * shape.rows).unwrap();
        KernelCalls::gemm(self, &self.upload(w).unwrap(), &self.upload(x).unwrap(), shape, &mut y).unwrap();
        Some(self.download(&y).unwrap())
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what} [{i}]: {g} vs {w}");
    }
}

fn check_norm_rope_activations(on: &dyn Runner) {
    // Pieces of a multiple of 4 (read 4 at a time), one of more values than a block keeps in
    // registers, and one of an odd size; few rows and many (the launch's two block sizes).
    for (rows, n) in [(3, 96), (2, 90), (1, 20000), (40, 64)] {
        let (x, w) = (values(rows * n, 1), values(n, 2));
        let got = on.rms_norm(&x, &w, 1e-6);
        let mut want = vec![0f32; rows * n];
        for r in 0..rows {
            crate::ops::rms_norm(&x[r * n..(r + 1) * n], &w, 1e-6, &mut want[r * n..(r + 1) * n]);
        }
        close(&got, &want, 1e-5, &format!("rms_norm {rows} x {n}"));
    }

    // Partial rotation (12 of 16 dimensions), both pairings, LongRoPE-style magnitude.
    let (tokens, heads, hd, pairs, scale) = (3, 4, 16, 6, 1.118f32);
    let freq = Rope::frequencies(2 * pairs, 10000.0);
    let pos = [0, 7, 300];
    for (style, neox) in [(RopeStyle::Neox, true), (RopeStyle::Interleaved, false)] {
        let x = values(tokens * heads * hd, 3);
        let got = on.rope(&x, &pos, &freq, heads, hd, neox, scale);
        let rope = Rope::with_frequencies(style, freq.clone()).scaled(scale);
        let mut want = x.clone();
        for (t, &p) in pos.iter().enumerate() {
            rope.apply(&mut want[t * heads * hd..(t + 1) * heads * hd], hd, p as usize);
        }
        close(&got, &want, 2e-5, &format!("rope {style:?}"));
    }

    let n = 200;
    let (g, u) = (values(n, 4).iter().map(|v| v * 6.0).collect::<Vec<_>>(), values(n, 5));
    // The clamped SwiGLU's inputs also past its clamps (7 and -7).
    let (g2, u2): (Vec<f32>, Vec<f32>) = (g.iter().map(|v| v * 2.0).collect(), u.iter().map(|v| v * 12.0).collect());
    type Case<'a> = (Gated, &'a [f32], &'a [f32], fn(&mut [f32], &[f32]));
    let cases: [Case<'_>; 3] = [
        (Gated::Swiglu, &g, &u, crate::ops::swiglu),
        (Gated::Geglu, &g, &u, crate::ops::geglu),
        (Gated::SwigluOai, &g2, &u2, crate::ops::swiglu_oai),
    ];
    for (kind, g, u, cpu) in cases {
        let got = on.gated_act(g, u, kind);
        let mut want = g.to_vec();
        cpu(&mut want, u);
        close(&got, &want, 1e-5, &format!("{kind:?}"));
    }
    // A mixture of experts' weighted rows added to the rows of the tokens that chose them.
    let (n, dst, src) = (40, values(5 * 40, 6), values(3 * 40, 7));
    let (rows, weights) = ([4, 0, 2], [0.5f32, -1.25, 2.0]);
    let got = on.scatter_add_rows(&src, &rows, &weights, n, &dst);
    let mut want = dst.clone();
    for (i, (&r, &w)) in rows.iter().zip(&weights).enumerate() {
        for k in 0..n {
            want[r as usize * n + k] += w * src[i * n + k];
        }
    }
    close(&got, &want, 1e-6, "scatter_add_rows");
}

fn check_matvec_embed(on: &dyn Runner) {
    let (rows, cols) = (37, 512);
    let types: Vec<DType> =
        QuantType::ALL.iter().map(|q| q.dtype()).chain([DType::F16, DType::BF16, DType::F32]).collect();
    for dtype in types {
        let row_bytes = dtype.bytes_for(cols).unwrap();
        let w: Vec<u8> = match dtype.class() {
            crate::quant::WeightClass::Quantized(q) => {
                random_blocks(q, rows * cols / q.block_len(), 11 + u64::from(dtype.ggml_type()))
            }
            crate::quant::WeightClass::Float(_) => {
                let v = values(rows * cols, 12);
                match dtype {
                    DType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
                    DType::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                    _ => f32s(&v),
                }
            }
        };
        let mut dense = vec![0f32; rows * cols];
        for r in 0..rows {
            dequantize_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], &mut dense[r * cols..(r + 1) * cols]);
        }
        for tokens in [1usize, 3, 8, 11] {
            let x = values(tokens * cols, 13 + tokens as u64);
            if let crate::quant::WeightClass::Quantized(q) = dtype.class() {
                check_matvec_q8(on, q, &w, rows, cols, &x);
                continue;
            }
            let got = on.matvec(dtype, &w, rows, cols, &x);
            assert_eq!(got.len(), rows * tokens);
            for t in 0..tokens {
                for r in 0..rows {
                    let (wr, xt) = (&dense[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let want: f64 = wr.iter().zip(xt).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                    let mag: f64 = wr.iter().zip(xt).map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs()).sum();
                    let g = f64::from(got[t * rows + r]);
                    assert!((g - want).abs() <= 1e-5 * mag + 1e-6, "{dtype:?} token {t} row {r}: {g} vs {want}");
                }
            }
        }
        // Rows longer than the kernel's chunk of staged activations (128 groups), the last
        // chunk partial, and more tokens than one grid row takes.
        if matches!(dtype, DType::Q4K | DType::Q6K | DType::Q8_0) {
            let (rows, cols) = (5, 9728);
            let crate::quant::WeightClass::Quantized(q) = dtype.class() else { unreachable!() };
            let w = random_blocks(q, rows * cols / q.block_len(), 41);
            for tokens in [1usize, 9] {
                check_matvec_q8(on, q, &w, rows, cols, &values(tokens * cols, 42 + tokens as u64));
            }
        }
        // The embedding lookup of the same table: the dequantized rows, scaled.
        let ids = [3, 0, 36];
        let got = on.embed(dtype, &w, &ids, cols, 2.5);
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| dense[i as usize * cols..(i as usize + 1) * cols].iter().map(|v| v * 2.5))
            .collect();
        assert_eq!(got, want, "{dtype:?} embedding");
    }
}

/// A quantized matrix against 8-bit activations: the activations rounded as the CPU's
/// `quantize_q8` rounds them, bit for bit (quants, scales, each half's sum), and each product
/// equal to the CPU's scalar product of the same operands but for the order of its groups' sum
/// (every group's term is the same float).
fn check_matvec_q8(on: &dyn Runner, q: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32]) {
    use crate::cpu::scalar;
    use crate::quant::{BlockQ8, QK};
    let tokens = x.len() / cols;
    let ((aq, ad, asums), got) = on.matvec_q8(q.dtype(), w, rows, cols, x);
    assert_eq!(got.len(), rows * tokens);
    let row_bytes = q.dtype().bytes_for(cols).unwrap();
    let dot = scalar::quant_dots(q).one;
    for t in 0..tokens {
        let mut a = vec![BlockQ8::default(); cols / QK];
        scalar::quantize_q8(&x[t * cols..(t + 1) * cols], &mut a);
        for (gi, b) in a.iter().enumerate() {
            let g = t * cols / QK + gi;
            let quants: Vec<u8> = b.qs.iter().map(|&v| v as u8).collect();
            assert_eq!(&aq[g * QK..(g + 1) * QK], &quants[..], "{q:?} token {t} group {gi}: quants");
            assert_eq!(ad[g].to_bits(), b.d.to_bits(), "{q:?} token {t} group {gi}: scale");
            for h in 0..2 {
                assert_eq!(asums[2 * g + h], b_sum(b, h), "{q:?} token {t} group {gi}: sum of half {h}");
            }
        }
        for r in 0..rows {
            // Each group's term as the CPU's scalar::dot_group computes it; the GPU sums the same
            // floats in another order, so the bound is f32 rounding of their magnitudes' sum.
            let terms: Vec<f32> = a
                .iter()
                .enumerate()
                .map(|(g, ab)| {
                    let gr = crate::group::decode(q, &w[r * row_bytes..(r + 1) * row_bytes], g);
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for h in 0..2 {
                        let qa: i32 = (16 * h..16 * h + 16).map(|i| i32::from(gr.q[i]) * i32::from(ab.qs[i])).sum();
                        isum += gr.sc[h] * qa;
                        msum += gr.m[h] * b_sum(ab, h);
                    }
                    let term = (ab.d * gr.d) * isum as f32;
                    if gr.has_min {
                        term + (ab.d * gr.dmin) * msum as f32
                    } else {
                        term
                    }
                })
                .collect();
            let want: f64 = terms.iter().map(|&v| f64::from(v)).sum();
            let mag: f64 = terms.iter().map(|&v| f64::from(v).abs()).sum();
            let g = f64::from(got[t * rows + r]);
            assert!((g - want).abs() <= 4e-6 * mag + 1e-7, "{q:?} token {t} row {r}: {g} vs the CPU's {want}");
            // And the CPU backend's own product of the row (Q4_0, Q4_1 and Q8_0 fold their
            // offsets differently, so within rounding).
            let cpu = f64::from(dot(&w[r * row_bytes..(r + 1) * row_bytes], &a));
            assert!((g - cpu).abs() <= 1e-5 * mag + 1e-6, "{q:?} token {t} row {r}: {g} vs the CPU's product {cpu}");
        }
    }
}

/// The sum of half `h` of an activation block's quants.
fn b_sum(b: &crate::quant::BlockQ8, h: usize) -> i32 {
    b.qs[16 * h..16 * h + 16].iter().map(|&v| i32::from(v)).sum()
}

/// Prefill's operands as halves and their product: every weight type decoded to f16 and bf16
/// bit for bit as the CPU's dequantizer then one rounding (the `half` crate's), activations the
/// same (infinities, NaNs, subnormals and ties included), and the product of halves against a
/// float64 product of the same halves (within 1e-4 of the sum of magnitudes). Returns whether
/// the product ran.
fn check_halves_and_gemm(on: &dyn Runner) -> bool {
    let to_bits = |v: &[f32], bf16: bool| -> Vec<u16> {
        v.iter()
            .map(|&x| if bf16 { half::bf16::from_f32(x).to_bits() } else { half::f16::from_f32(x).to_bits() })
            .collect()
    };
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        65520.0,
        1e-8,
        -3e-5,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        3.0e38,
        1.0 + 1.0 / 256.0,
    ];
    let x: Vec<f32> = specials.iter().copied().chain(values(500, 21).iter().map(|v| v * 300.0)).collect();
    for bf16 in [false, true] {
        let (got, want) = (on.to_half(&x, bf16), to_bits(&x, bf16));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let nan = |h: u16| if bf16 { half::bf16::from_bits(h).is_nan() } else { half::f16::from_bits(h).is_nan() };
            assert!(g == w || (nan(*g) && nan(*w)), "to_half bf16={bf16} [{i}] {}: {g:#06x} vs {w:#06x}", x[i]);
        }
    }
    let (rows, cols, tokens) = (37, 512, 40);
    let types: Vec<DType> =
        QuantType::ALL.iter().map(|q| q.dtype()).chain([DType::F16, DType::BF16, DType::F32]).collect();
    let mut ran = true;
    for dtype in types {
        let row_bytes = dtype.bytes_for(cols).unwrap();
        let w: Vec<u8> = match dtype.class() {
            crate::quant::WeightClass::Quantized(q) => {
                random_blocks(q, rows * cols / q.block_len(), 31 + u64::from(dtype.ggml_type()))
            }
            crate::quant::WeightClass::Float(_) => f32s(&values(rows * cols, 32))
                .chunks_exact(4)
                .flat_map(|b| {
                    let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    match dtype {
                        DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                        DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                        _ => v.to_le_bytes().to_vec(),
                    }
                })
                .collect(),
        };
        let mut dense = vec![0f32; rows * cols];
        for r in 0..rows {
            dequantize_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], &mut dense[r * cols..(r + 1) * cols]);
        }
        let bf16 = dtype == DType::BF16;
        let w16 = on.dequantize_half(dtype, &w, rows, cols, bf16);
        assert!(w16 == to_bits(&dense, bf16), "{dtype:?}: decoded to halves");
        let x16 = to_bits(&values(tokens * cols, 33), bf16);
        let Some(got) = on.gemm(&w16, &x16, GemmShape { tokens, rows, cols, bf16 }) else {
            ran = false;
            continue;
        };
        let f =
            |h: u16| f64::from(if bf16 { half::bf16::from_bits(h).to_f32() } else { half::f16::from_bits(h).to_f32() });
        for t in 0..tokens {
            for r in 0..rows {
                let pairs = w16[r * cols..(r + 1) * cols].iter().zip(&x16[t * cols..(t + 1) * cols]);
                let (want, mag) =
                    pairs.fold((0f64, 0f64), |(s, m), (&a, &b)| (s + f(a) * f(b), m + (f(a) * f(b)).abs()));
                let g = f64::from(got[t * rows + r]);
                // Loose enough for tensor cores' f32 accumulation, tight against any layout slip.
                assert!((g - want).abs() <= 1e-4 * mag + 1e-6, "{dtype:?} gemm token {t} row {r}: {g} vs {want}");
            }
        }
    }
    ran
}

fn check_attention(on: &dyn Runner) {
    // Two sequences of 4 query heads on 2 KV heads in a pool of 9 blocks of 4 positions, their
    // blocks scattered: sequence 0 has 11 positions and queries its last 3 (a prefill chunk),
    // sequence 1 has 6 and queries its last (decode).
    let short = |hd, window| AttentionCase {
        heads: (4, 2),
        hd,
        bs: 4,
        blocks: 9,
        window,
        ..attention_case(&[vec![7, 2, 5], vec![0, 8, 1]], &[11, 6], &[(0, 8), (0, 9), (0, 10), (1, 5)], (4, 2), hd, 4)
    };
    check_attention_case(on, &short(64, 0));
    check_attention_case(on, &short(40, 5));
    // gpt-oss's sinks: a logit per query head, large and small, unsplit and split.
    let sinks = |q_heads: usize| Some((0..q_heads).map(|h| [0.5, -1.0, 2.5, 0.0][h % 4]).collect::<Vec<f32>>());
    check_attention_case(on, &AttentionCase { sinks: sinks(4), ..short(64, 0) });
    // Longer sequences, over several tiles of positions and of queries and split in runs of
    // positions: Llama 3 8B's head (128, 4 query heads a KV head), Gemma's (256, one KV head
    // for 4), a tiny model's (16), each with and without a window; a prefill chunk of 20
    // queries of sequence 0 (more than a block's rows) and a decode query of sequence 1.
    let tables =
        [(0..12).map(|b| (b * 7 + 3) % 23).collect::<Vec<i32>>(), (0..11).map(|b| (b * 5 + 1) % 23 + 23).collect()];
    let queries: Vec<(usize, usize)> = (70..90).map(|p| (0, p)).chain([(1, 83)]).collect();
    for (heads, hd) in [((8, 2), 128), ((4, 1), 256), ((6, 3), 16)] {
        for window in [0, 37] {
            for split_len in [None, Some(32), Some(64)] {
                let mut c = attention_case(&tables, &[90, 84], &queries, heads, hd, 8);
                (c.window, c.split_len) = (window, split_len);
                check_attention_case(on, &c);
                if hd == 128 {
                    c.sinks = sinks(heads.0);
                    check_attention_case(on, &c);
                }
            }
        }
    }
}

/// A case of random K, V and queries: sequences of `lens` positions in blocks `tables` (of
/// `bs` positions) querying `queries` (sequence, position).
fn attention_case(
    tables: &[Vec<i32>],
    lens: &[usize],
    queries: &[(usize, usize)],
    heads: (usize, usize),
    hd: usize,
    bs: usize,
) -> AttentionCase {
    let kv_dim = heads.1 * hd;
    let table_len = tables.iter().map(Vec::len).max().unwrap();
    let mut slots = Vec::new();
    for (s, &len) in lens.iter().enumerate() {
        for p in 0..len {
            slots.push(tables[s][p / bs] * bs as i32 + (p % bs) as i32);
        }
    }
    let flat: Vec<i32> =
        tables.iter().flat_map(|t| t.iter().copied().chain(std::iter::repeat(-1)).take(table_len)).collect();
    AttentionCase {
        k: values(slots.len() * kv_dim, 21),
        v: values(slots.len() * kv_dim, 22),
        slots,
        q: values(queries.len() * heads.0 * hd, 23),
        tables: flat,
        table_len,
        table_of: queries.iter().map(|&(s, _)| s as i32).collect(),
        q_pos: queries.iter().map(|&(_, p)| p as i32).collect(),
        heads,
        hd,
        bs,
        blocks: tables.iter().flatten().copied().max().unwrap() as usize + 1,
        window: 0,
        scale: 1.0 / (hd as f32).sqrt(),
        split_len: None,
        sinks: None,
    }
}

/// `case` on `on` against a float64 softmax over the f16-rounded K and V.
fn check_attention_case(on: &dyn Runner, a: &AttentionCase) {
    let got = on.kv_attention(a);
    let (qh, kvh, hd) = (a.heads.0, a.heads.1, a.hd);
    let kv_dim = kvh * hd;
    let round = |x: f32| f64::from(half::f16::from_f32(x).to_f32());
    // The stored row of (sequence, position): slots were written sequence by sequence.
    let lens: Vec<usize> = (0..a.tables.len() / a.table_len)
        .map(|s| {
            a.slots
                .iter()
                .filter(|&&slot| a.tables[s * a.table_len..(s + 1) * a.table_len].contains(&(slot / a.bs as i32)))
                .count()
        })
        .collect();
    let row_of = |s: usize, p: usize| lens[..s].iter().sum::<usize>() + p;
    let what =
        format!("hd {hd} heads {qh}/{kvh} window {} split {:?} sinks {}", a.window, a.split_len, a.sinks.is_some());
    for (i, (&s, &p)) in a.table_of.iter().zip(&a.q_pos).enumerate() {
        let (s, p) = (s as usize, p as usize);
        let first = if a.window > 0 { (p + 1).saturating_sub(a.window) } else { 0 };
        for h in 0..qh {
            let g = h / (qh / kvh);
            let qv = &a.q[(i * qh + h) * hd..(i * qh + h + 1) * hd];
            let rows: Vec<usize> = (first..=p).map(|pp| row_of(s, pp)).collect();
            let scores: Vec<f64> = rows
                .iter()
                .map(|&r| {
                    let kr = &a.k[r * kv_dim + g * hd..r * kv_dim + (g + 1) * hd];
                    qv.iter().zip(kr).map(|(x, y)| f64::from(*x) * round(*y)).sum::<f64>() * f64::from(a.scale)
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            // A sink's logit joins the denominator, and nothing the values.
            let sink = a.sinks.as_ref().map_or(0.0, |k| (f64::from(k[h]) - m).exp());
            let z: f64 = e.iter().sum::<f64>() + sink;
            for d in 0..hd {
                let want: f64 =
                    rows.iter().zip(&e).map(|(&r, w)| w * round(a.v[r * kv_dim + g * hd + d])).sum::<f64>() / z;
                let gv = f64::from(got[(i * qh + h) * hd + d]);
                assert!((gv - want).abs() <= 1e-5, "{what}: query {i} head {h} dim {d}: {gv} vs {want}");
            }
        }
    }
}

#[test]
fn on_the_host_rms_norm_rope_and_the_activations_compute_what_the_cpu_does() {
    check_norm_rope_activations(host());
}

#[test]
fn on_the_host_matvec_and_embed_compute_every_weight_type_as_the_dequantized_product() {
    check_matvec_embed(host());
}

#[test]
fn on_the_host_prefills_operands_as_halves_and_their_product_are_exact() {
    let before = host().gemms();
    assert!(check_halves_and_gemm(host()));
    assert!(host().gemms() > before);
}

/// Gated DeltaNet's recurrence against the CPU's `deltanet::step` on its own state layout: both
/// shapes of key heads (tiled, grouped), a sequence fed in pieces of 70, 1, 1, 50 and 40 rows
/// across three chunks of 64 (a piece beginning a chunk, a piece ending one, single decode
/// rows), then sent back 40 positions, over a chunk boundary (a speculative step's rejected
/// rows), and run again: the outputs and the state as the CPU's, within `tol` (the host
/// emulation computes the CPU's floats exactly: the same operations in the same order, libm's
/// `expf`; a GPU's `expf` differs in the last bits).
fn check_delta_step(on: &dyn Runner, tol: f32) {
    for grouped in [false, true] {
        let shape = DeltaShape { k_heads: 2, v_heads: 4, dk: 16, dv: 12, grouped };
        let mut cpu_state = vec![0f32; shape.chunk_state_len()];
        let mut dev_state = cpu_state.clone();
        let mut start = 0;
        for (piece, n) in [70usize, 1, 1, 50, 40, 30].into_iter().enumerate() {
            if piece == 5 {
                start -= 40;
            }
            let seed = 10 * piece as u64 + u64::from(grouped);
            let (q, mut k) = (values(n * 2 * 16, seed), values(n * 2 * 16, seed + 1));
            let v = values(n * 4 * 12, seed + 2);
            // Unit queries and keys, decays below one, write strengths in (0, 1): as the layer
            // feeds it.
            let mut q = q;
            crate::deltanet::l2_norm_each(&mut q, 16, 1e-6);
            crate::deltanet::l2_norm_each(&mut k, 16, 1e-6);
            let g: Vec<f32> = values(n * 4, seed + 3).iter().map(|x| -0.05 - 0.3 * x.abs()).collect();
            let beta: Vec<f32> = values(n * 4, seed + 4).iter().map(|x| 0.5 + 0.45 * x).collect();
            let x = Inputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            let mut want = vec![0f32; n * 4 * 12];
            crate::deltanet::step(None, shape, &mut cpu_state, start, &x, &mut want);
            let (state, got) = on.delta_step(shape, &dev_state, start, &x);
            let what = format!("delta_step grouped {grouped}, piece {piece} at {start}");
            close(&got, &want, tol, &what);
            close(&state, &cpu_state, tol, &format!("{what}: state"));
            dev_state = state;
            start += n;
        }
    }
}

/// The rest of a DeltaNet layer's work before its recurrence against the CPU's: the
/// convolution (4 taps, a ring of 3 + 8 rows) over a prompt, decode rows, a run longer than
/// the ring, and a step back, then SiLU; the split into L2-normed query and key heads and the
/// values; the decays (across softplus's linear part) and write strengths.
fn check_delta_inputs(on: &dyn Runner, tol: f32) {
    let (ch, width, rows) = (24, 4, 11);
    let taps = crate::deltanet::conv_taps(&values(ch * width, 70), width);
    let (mut ring, mut dev_ring) = (vec![0f32; rows * ch], vec![0f32; rows * ch]);
    let mut start = 0;
    for (piece, n) in [5usize, 1, 1, 30, 2].into_iter().enumerate() {
        if piece == 4 {
            start -= 6;
        }
        let x = values(n * ch, 71 + piece as u64);
        let mut want = vec![0f32; n * ch];
        crate::deltanet::conv(&taps, width, ch, &mut ring, start, &x, &mut want);
        want.iter_mut().for_each(|o| *o /= 1.0 + (-*o).exp());
        let (r, got) = on.delta_conv(&x, &dev_ring, &taps, ch, start);
        close(&got, &want, tol, &format!("delta_conv piece {piece} at {start}"));
        close(&r, &ring, 0.0, &format!("delta_conv piece {piece}: the ring"));
        dev_ring = r;
        start += n;
    }
    // Queries and keys of 2 heads of 8 (one all zeros: eps holds), values of 12, 3 tokens.
    let (kh, dk, vd) = (2, 8, 12);
    let mut xc = values(3 * (2 * kh * dk + vd), 80);
    xc[8..16].iter_mut().for_each(|x| *x = 0.0);
    let [q, k, v] = on.delta_split(&xc, (kh, dk, vd), 1e-6);
    let (mut wq, mut wk, mut wv) = (Vec::new(), Vec::new(), Vec::new());
    for row in xc.chunks_exact(2 * kh * dk + vd) {
        wq.extend_from_slice(&row[..kh * dk]);
        wk.extend_from_slice(&row[kh * dk..2 * kh * dk]);
        wv.extend_from_slice(&row[2 * kh * dk..]);
    }
    crate::deltanet::l2_norm_each(&mut wq, dk, 1e-6);
    crate::deltanet::l2_norm_each(&mut wk, dk, 1e-6);
    close(&q, &wq, tol, "delta_split: queries");
    close(&k, &wk, tol, "delta_split: keys");
    close(&v, &wv, 0.0, "delta_split: values");
    let heads = 4;
    let alpha: Vec<f32> = values(5 * heads, 90).iter().map(|x| 30.0 * x).collect();
    let b = values(5 * heads, 91);
    let (dt_bias, a) = (values(heads, 92), values(heads, 93).iter().map(|x| -0.1 - x.abs()).collect::<Vec<_>>());
    let [g, beta] = on.delta_gates(&alpha, &b, &dt_bias, &a);
    let (mut wg, mut wb) = (Vec::new(), Vec::new());
    for (e, (&al, &bb)) in alpha.iter().zip(&b).enumerate() {
        let x = al + dt_bias[e % heads];
        let sp = if x > 20.0 { x } else { (1.0 + x.exp()).ln() };
        wg.push(sp * a[e % heads]);
        wb.push(1.0 / (1.0 + (-bb).exp()));
    }
    close(&g, &wg, tol, "delta_gates: decays");
    close(&beta, &wb, tol, "delta_gates: write strengths");
}

/// A gated attention's split of queries and gates and its sigmoid gate per head, a DeltaNet's
/// SiLU gate value by value, and a recurrent state's copy and clearing, against the CPU
/// backend's forms.
fn check_gates_and_state_moves(on: &dyn Runner, tol: f32) {
    let (hd, heads, tokens) = (8, 3, 2);
    let x = values(tokens * heads * 2 * hd, 60);
    let [a, b] = on.split_pairs(&x, hd);
    let (wa, wb): (Vec<f32>, Vec<f32>) =
        x.chunks_exact(2 * hd).flat_map(|p| (0..hd).map(move |k| (p[k], p[hd + k]))).unzip();
    close(&a, &wa, 0.0, "split_pairs: first of each pair");
    close(&b, &wb, 0.0, "split_pairs: second");
    let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
    let g = values(tokens * heads, 61);
    let got = on.gate_by(&a, &g, false);
    let want: Vec<f32> = a.iter().enumerate().map(|(i, x)| x * sigmoid(g[i / hd])).collect();
    close(&got, &want, tol, "gate_by: a sigmoid per head");
    let got = on.gate_by(&a, &b, true);
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, g)| x * (g * sigmoid(*g))).collect();
    close(&got, &want, tol, "gate_by: SiLU value by value");
    let buf = values(100, 62);
    let mut want = buf.clone();
    want.copy_within(10..30, 60);
    close(&on.move_floats(&buf, Some(10), 60, 20), &want, 0.0, "move_floats: a copy");
    let mut want = buf.clone();
    want[40..55].iter_mut().for_each(|x| *x = 0.0);
    close(&on.move_floats(&buf, None, 40, 15), &want, 0.0, "move_floats: zeros");
}

#[test]
fn on_the_host_gates_and_state_moves_are_the_cpu_s() {
    check_gates_and_state_moves(host(), 1e-6);
}

#[test]
fn on_the_host_the_delta_net_inputs_are_the_cpu_s() {
    check_delta_inputs(host(), 1e-6);
}

#[test]
fn on_the_host_the_delta_net_recurrence_computes_what_the_cpu_does() {
    check_delta_step(host(), 0.0);
}

#[test]
fn on_the_host_paged_attention_over_scattered_blocks_matches_a_float64_reference() {
    check_attention(host());
}

#[test]
#[cfg_attr(not(host_cuda), ignore = "no NVIDIA GPU on this machine (tests/gpu/run runs it where there is one)")]
fn on_the_gpu_every_kernel_computes_what_the_cpu_does() {
    let gpu = super::gpu::Gpu::open(&super::tests::scratch("cuda-gpu-cache")).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("GPU: {}", gpu.describe());
    check_norm_rope_activations(&gpu);
    check_matvec_embed(&gpu);
    check_attention(&gpu);
    check_delta_step(&gpu, 1e-4);
    check_delta_inputs(&gpu, 1e-5);
    check_gates_and_state_moves(&gpu, 1e-5);
    // cuBLAS comes with NVIDIA's CUDA libraries, not with the driver: said, not failed, where
    // it is missing (the CUDA backend's prefill then takes matvec).
    if !check_halves_and_gemm(&gpu) {
        eprintln!("cuBLAS (libcublas.so.12) not found: the product of halves was not checked");
    }
}
