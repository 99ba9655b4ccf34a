//! The per-row operations of a transformer block: RMSNorm, rotary embeddings, the gated MLP
//! activations (SwiGLU, GeGLU), softmax.
//! These are a small share of a step's time; they are written plainly so the compiler vectorizes.

/// `1 / rms(x)`, with `rms(x) = sqrt(mean(x²) + eps)`.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ss + eps).sqrt()
}

/// `out = x / rms(x) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * inv * wi;
    }
}

/// [`rms_norm`] in place, for each `w.len()`-long piece of `x` (per-head QK-norm, post-norms).
pub fn rms_norm_each(x: &mut [f32], w: &[f32], eps: f32) {
    for piece in x.chunks_exact_mut(w.len()) {
        let inv = inv_rms(piece, eps);
        piece.iter_mut().zip(w).for_each(|(xi, wi)| *xi = *xi * inv * wi);
    }
}

/// How a model pairs the dimensions of a head for rotary embeddings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: GGUF Llama files (their Q/K rows are permuted for this).
    Interleaved,
    /// Halves `(x[i], x[i + d/2])`: Hugging Face Llama checkpoints ("rotate_half").
    Neox,
}

/// Precomputed inverse frequencies `base^(-2i/d)` for one head dimension, and the factor the
/// rotated dimensions are multiplied by (1 but for LongRoPE's and YaRN's magnitude scaling).
#[derive(Clone, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    inv_freq: Vec<f32>,
    scale: f32,
}

impl Rope {
    pub fn new(style: RopeStyle, head_dim: usize, base: f32) -> Self {
        Rope { style, inv_freq: Self::frequencies(head_dim, base), scale: 1.0 }
    }

    /// The unscaled inverse frequencies `base^(-2i/d)`, `head_dim / 2` of them.
    pub fn frequencies(head_dim: usize, base: f32) -> Vec<f32> {
        (0..head_dim / 2).map(|i| base.powf(-2.0 * i as f32 / head_dim as f32)).collect()
    }

    /// A rotation with the given inverse frequencies (scaled ones: linear, Llama 3's).
    pub fn with_frequencies(style: RopeStyle, inv_freq: Vec<f32>) -> Self {
        Rope { style, inv_freq, scale: 1.0 }
    }

    /// The same rotation with the rotated dimensions multiplied by `scale` (as llama.cpp
    /// multiplies its sines and cosines; dimensions past a partial rotation keep their value).
    pub fn scaled(self, scale: f32) -> Self {
        Rope { scale, ..self }
    }

    /// How many frequencies: half the rotated dimensions.
    pub fn pairs(&self) -> usize {
        self.inv_freq.len()
    }

    /// The rotation of position `pos`: `(sin, cos)` of each frequency times the scale,
    /// [`Rope::pairs`] of them. Computed once per token and reused for every head of every layer.
    pub fn angles(&self, pos: usize, out: &mut [(f32, f32)]) {
        for (o, f) in out.iter_mut().zip(&self.inv_freq) {
            let (sin, cos) = (pos as f32 * f).sin_cos();
            *o = (sin * self.scale, cos * self.scale);
        }
    }

    /// [`Rope::angles`] for M-RoPE coordinates (time, row, column, fourth): pair `j` turns by
    /// one coordinate, chosen by its sector `s = j % sum(sections)`. Consecutive (Qwen2-VL):
    /// the coordinate whose section holds `s`, `sections` counting pairs in order.
    /// Interleaved (Qwen3-VL): row where `s % 3 == 1` and `s < 3 * sections[1]`, column where
    /// `s % 3 == 2` and `s < 3 * sections[2]`, time where `s % 3 == 0` and `s < 3 *
    /// sections[0]`, else the fourth (llama.cpp's reading, which leaves a pair or two past
    /// the sections to it). Coordinates all equal to `pos` give `angles(pos)` where no pair
    /// falls to the fourth.
    pub fn angles_sections(&self, coords: [u32; 4], sections: [usize; 4], interleaved: bool, out: &mut [(f32, f32)]) {
        let total = sections.iter().sum::<usize>().max(1);
        for (j, (o, f)) in out.iter_mut().zip(&self.inv_freq).enumerate() {
            let (mut sector, mut c) = (j % total, 0);
            if interleaved {
                c = match sector % 3 {
                    1 if sector < 3 * sections[1] => 1,
                    2 if sector < 3 * sections[2] => 2,
                    0 if sector < 3 * sections[0] => 0,
                    _ => 3,
                };
            } else {
                while c < 3 && sector >= sections[c] {
                    sector -= sections[c];
                    c += 1;
                }
            }
            let (sin, cos) = (coords[c] as f32 * f).sin_cos();
            *o = (sin * self.scale, cos * self.scale);
        }
    }

    /// Rotates every head in `x` (`heads * head_dim` floats) to position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let mut angles = vec![(0.0, 0.0); self.inv_freq.len()];
        self.angles(pos, &mut angles);
        self.apply_angles(x, head_dim, &angles);
    }

    /// Rotates every head in `x` by precomputed [`Rope::angles`]. A rotation with fewer
    /// frequencies than `head_dim / 2` turns only the first `2 * angles.len()` dimensions of
    /// each head (partial rotary embeddings, as Phi-4-mini's).
    pub fn apply_angles(&self, x: &mut [f32], head_dim: usize, angles: &[(f32, f32)]) {
        let half = angles.len().min(head_dim / 2);
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(sin, cos)) in angles.iter().enumerate().take(half) {
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

/// `gate = silu(gate) * up`, in place. Uses the exact `exp`: the vector polynomial one moved
/// the default model's logits past the golden tolerance (BENCHMARKS.md), as this model amplifies
/// small activation changes through the 8-bit quantization that follows.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Adds `bias` to every row of `rows` (rows of `bias.len()` values): a projection's bias.
pub fn add_bias_rows(rows: &mut [f32], bias: &[f32]) {
    rows.chunks_exact_mut(bias.len()).for_each(|row| row.iter_mut().zip(bias).for_each(|(x, b)| *x += b));
}

/// gpt-oss's clamped SwiGLU, in place: `gate = x σ(1.702 x) (y + 1)` with the gate clamped
/// from above, `x = min(gate, 7)`, and the linear part both ways, `y = clamp(up, -7, 7)` (as
/// its reference and llama.cpp's `swiglu_oai`).
pub fn swiglu_oai(gate: &mut [f32], up: &[f32]) {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = g.min(LIMIT);
        let y = u.clamp(-LIMIT, LIMIT);
        *g = x / (1.0 + (-ALPHA * x).exp()) * (y + 1.0);
    }
}

/// `gate = gelu(gate) * up`, in place, with GELU's tanh approximation (Gemma's
/// `gelu_pytorch_tanh`): `0.5 x (1 + tanh y)`, `y = sqrt(2 / π) (x + 0.044715 x³)`, computed
/// as the equal `x / (1 + e^(-2y))`, which has no cancellation where `tanh y` nears -1.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = x / (1.0 + (-2.0 * SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).exp()) * u;
    }
}

/// Softmax in place; returns the log of the normalizer (log-sum-exp).
pub fn softmax(x: &mut [f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_swiglu_clamps_the_gate_from_above_and_the_linear_part_both_ways() {
        // Values from the formula in f64 (its reference implementation's): a gate past the
        // limit, a linear part past it either way, and one inside both.
        let mut gate = [10.0, -3.0, 0.5];
        swiglu_oai(&mut gate, &[20.0, -9.0, 0.25]);
        for (got, want) in gate.iter().zip([55.999_625_f32, 0.108_427_86, 0.437_985_55]) {
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{got} vs {want}");
        }
    }

    #[test]
    fn rope_styles_agree_up_to_permutation() {
        let d = 8;
        let x: Vec<f32> = (0..d).map(|i| i as f32 + 1.0).collect();
        // The Neox layout of x is the interleaved layout with dims regrouped.
        let perm: Vec<usize> = (0..d / 2).flat_map(|i| [i, i + d / 2]).collect();
        let xi: Vec<f32> = perm.iter().map(|&p| x[p]).collect();
        let mut a = x.clone();
        let mut b = xi.clone();
        Rope::new(RopeStyle::Neox, d, 10000.0).apply(&mut a, d, 7);
        Rope::new(RopeStyle::Interleaved, d, 10000.0).apply(&mut b, d, 7);
        for (k, &p) in perm.iter().enumerate() {
            assert!((a[p] - b[k]).abs() < 1e-5);
        }
        // Position 0 is the identity; rotation keeps the norm.
        let mut c = x.clone();
        Rope::new(RopeStyle::Neox, d, 10000.0).apply(&mut c, d, 0);
        assert_eq!(c, x);
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((n(&a) - n(&x)).abs() < 1e-3);
    }

    #[test]
    fn mrope_sections_pick_each_pairs_coordinate() {
        // 6 pairs in sections 1, 2, 2, 1: pair 0 by time, 1-2 by row, 3-4 by column, 5 by the
        // fourth coordinate; equal coordinates are the plain rotation.
        let rope = Rope::new(RopeStyle::Neox, 12, 10000.0);
        let (mut a, mut b) = (vec![(0.0, 0.0); 6], vec![(0.0, 0.0); 6]);
        rope.angles_sections([9; 4], [1, 2, 2, 1], false, &mut a);
        rope.angles(9, &mut b);
        assert_eq!(a, b);
        rope.angles_sections([2, 3, 5, 7], [1, 2, 2, 1], false, &mut a);
        for (j, c) in [2, 3, 3, 5, 5, 7].into_iter().enumerate() {
            let (s, co) = (c as f32 * rope.inv_freq[j]).sin_cos();
            assert_eq!(a[j], (s, co), "pair {j}");
        }
        // Sections summing to fewer pairs repeat: 1, 1, 1, 0 over 6 pairs is t h w t h w.
        rope.angles_sections([2, 3, 5, 7], [1, 1, 1, 0], false, &mut a);
        for (j, c) in [2, 3, 5, 2, 3, 5].into_iter().enumerate() {
            assert_eq!(a[j], (c as f32 * rope.inv_freq[j]).sin_cos(), "pair {j}");
        }
        // Interleaved, sections 3, 1, 1 (5 sectors) over 6 pairs: t h w t, then sector 4 (a
        // row's turn, but past 3 * 1) falls to the fourth, and pair 5 is sector 0 again.
        rope.angles_sections([2, 3, 5, 7], [3, 1, 1, 0], true, &mut a);
        for (j, c) in [2, 3, 5, 2, 7, 2].into_iter().enumerate() {
            assert_eq!(a[j], (c as f32 * rope.inv_freq[j]).sin_cos(), "pair {j}");
        }
    }

    #[test]
    fn geglu_is_the_tanh_gelu() {
        // Values of PyTorch's gelu(approximate="tanh") at a few points.
        let mut g = vec![-3.0, -1.0, 0.0, 0.5, 2.0];
        geglu(&mut g, &[1.0, 1.0, 1.0, 1.0, 2.0]);
        let want = [-0.003_637_392, -0.158_808, 0.0, 0.345_714, 2.0 * 1.954_597_7];
        for (a, b) in g.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn softmax_normalizes_and_returns_lse() {
        let mut x = vec![1.0, 2.0, 3.0];
        let lse = softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((lse - (1f32.exp() + 2f32.exp() + 3f32.exp()).ln()).abs() < 1e-5);
    }

    #[test]
    fn rms_norm_unit_weights_gives_unit_rms() {
        let x = vec![3.0, -4.0, 0.0, 1.0];
        let mut o = vec![0.0; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut o);
        let rms = (o.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-5);
    }
}
