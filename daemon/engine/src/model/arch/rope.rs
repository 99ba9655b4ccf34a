//! How a model stretches its rotary embeddings past the context it was trained on, as a table
//! of inverse frequencies plus one magnitude factor: position interpolation (linear), Llama
//! 3.1's per-frequency divisors, Phi-3's LongRoPE and YaRN (Qwen 2.5 / 3's long-context
//! setting). Every scheme here rotates position `p` by `p * freq[i]` with `freq` fixed at load,
//! so the backends run them all through one rotation table
//! ([`inferd_kernels::ops::Rope`]).

use std::sync::Arc;

/// How RoPE frequencies are scaled past the trained context.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by the factor (position interpolation).
    Linear(f32),
    /// Frequency `i` divided by `factors[i]` (Llama 3.1's scaling, as GGUF's `rope_freqs`
    /// tensor stores it).
    Factors(Arc<[f32]>),
    /// LongRoPE (Phi-3's 128k models, Phi-3.5, Phi-4-mini): frequency `i` divided by `short[i]`
    /// when the context served is at most `original` positions, else by `long[i]` (chosen once
    /// per loaded model, as llama.cpp chooses by its context size), and the rotated dimensions
    /// multiplied by `attn_factor`.
    LongRope {
        short: Arc<[f32]>,
        long: Arc<[f32]>,
        original: usize,
        attn_factor: f32,
    },
    /// YaRN: frequencies whose wavelength fits `original / beta_fast` times in the trained
    /// context keep their value, those fitting fewer than `original / beta_slow` times are
    /// divided by `factor`, a linear ramp over the dimensions between; the rotated dimensions
    /// multiplied by `attn_factor` (by default `1 + 0.1 ln factor`).
    Yarn {
        factor: f32,
        original: usize,
        beta_fast: f32,
        beta_slow: f32,
        attn_factor: f32,
    },
}

impl RopeScaling {
    /// The inverse frequencies of `base` for `dims` rotated dimensions, scaled for a model
    /// served with a context of `context` positions.
    pub fn frequencies(&self, dims: usize, base: f32, context: usize) -> Vec<f32> {
        let f = inferd_kernels::ops::Rope::frequencies(dims, base);
        let divide = |d: &[f32]| f.iter().zip(d).map(|(x, d)| x / d).collect();
        match self {
            RopeScaling::None => f,
            RopeScaling::Linear(s) => f.iter().map(|x| x / s).collect(),
            RopeScaling::Factors(d) => divide(d),
            RopeScaling::LongRope { short, long, original, .. } => {
                divide(if context > *original { long } else { short })
            }
            RopeScaling::Yarn { factor, original, beta_fast, beta_slow, .. } => {
                // The dimension whose wavelength fits `r` times into the trained context.
                let dim = |r: f32| {
                    dims as f32 * (*original as f32 / (r * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
                };
                let low = dim(*beta_fast).floor().max(0.0);
                let high = dim(*beta_slow).ceil().min(dims as f32 - 1.0);
                f.iter()
                    .enumerate()
                    .map(|(i, x)| {
                        // 1 keeps the frequency (extrapolation), 0 divides it by the factor.
                        let keep = 1.0 - ((i as f32 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
                        x / factor * (1.0 - keep) + x * keep
                    })
                    .collect()
            }
        }
    }

    /// What the rotated dimensions of Q and K are multiplied by (1 but for LongRoPE and YaRN).
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::LongRope { attn_factor, .. } | RopeScaling::Yarn { attn_factor, .. } => *attn_factor,
            RopeScaling::None | RopeScaling::Linear(_) | RopeScaling::Factors(_) => 1.0,
        }
    }
}

/// YaRN's default magnitude factor for a context stretched `factor` times.
pub fn yarn_attention_factor(factor: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        1.0 + 0.1 * factor.ln()
    }
}

/// LongRoPE's default magnitude factor for a model trained on `original` positions and
/// stretched `factor` times.
pub fn longrope_attention_factor(factor: f32, original: usize) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f32).ln()).sqrt()
    }
}

/// Llama 3's frequency divisors (`rope_scaling.rope_type = "llama3"`): wavelengths shorter than
/// `original / high` keep their frequency, longer than `original / low` are divided by
/// `factor`, and those between are interpolated.
pub fn llama3_factors(dims: usize, base: f32, factor: f32, low: f32, high: f32, original: f32) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    inferd_kernels::ops::Rope::frequencies(dims, base)
        .into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                // The frequency becomes (1 - smooth) f / factor + smooth f.
                let smooth = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_keeps_the_fast_frequencies_and_divides_the_slow_ones() {
        // 64 dimensions, base 10000, 4096 trained positions: the correction dimensions are
        // floor(dim(32)) = floor(10.47) = 10 and ceil(dim(1)) = ceil(22.51) = 23, with
        // dim(r) = 64 ln(4096 / (2 pi r)) / (2 ln 10000) (YaRN's formula, worked by hand).
        let y = RopeScaling::Yarn { factor: 4.0, original: 4096, beta_fast: 32.0, beta_slow: 1.0, attn_factor: 1.0 };
        let f = inferd_kernels::ops::Rope::frequencies(64, 10000.0);
        let g = y.frequencies(64, 10000.0, 16384);
        for i in 0..=10 {
            assert_eq!(g[i], f[i], "dimension {i} keeps its frequency");
        }
        for i in 23..32 {
            assert!((g[i] - f[i] / 4.0).abs() <= f[i] * 1e-6, "dimension {i} is interpolated");
        }
        // Between them the share kept falls linearly: 1 - (17 - 10) / 13 = 6/13 at dimension 17.
        let keep = 6.0 / 13.0;
        assert!((g[17] - (f[17] / 4.0 * (1.0 - keep) + f[17] * keep)).abs() <= f[17] * 1e-6);
        assert!((yarn_attention_factor(4.0) - 1.138_629_4).abs() < 1e-6);
    }

    #[test]
    fn longrope_picks_its_factors_by_the_context_served() {
        let l = RopeScaling::LongRope {
            short: Arc::from(vec![1.0, 2.0]),
            long: Arc::from(vec![4.0, 8.0]),
            original: 4096,
            attn_factor: 1.19,
        };
        let f = inferd_kernels::ops::Rope::frequencies(4, 10000.0);
        assert_eq!(l.frequencies(4, 10000.0, 4096), vec![f[0], f[1] / 2.0]);
        assert_eq!(l.frequencies(4, 10000.0, 4097), vec![f[0] / 4.0, f[1] / 8.0]);
        assert_eq!(l.attention_factor(), 1.19);
        // Phi-3.5-mini's: 131072 positions from 4096.
        assert!((longrope_attention_factor(32.0, 4096) - 1.190_238).abs() < 1e-5);
        assert_eq!(longrope_attention_factor(1.0, 4096), 1.0);
    }
}
