//! Gated DeltaNet, the linear-attention recurrence of Qwen3.5 / 3.6 and Qwen3-Next: per value
//! head a matrix state `S` (`dv` rows of `dk`), decayed and corrected by the delta rule at
//! each token,
//!
//! ```text
//! S_t = a_t S_{t-1} + β_t (v_t - a_t S_{t-1} k_t) k_tᵀ,   o_t = S_t q_t / √dk,   a_t = exp(g_t)
//! ```
//!
//! with `q` and `k` L2-normalized, `g ≤ 0` the head's log decay and `β ∈ (0, 1)` its write
//! strength. Value head `h` reads query and key head `h mod k_heads` (llama.cpp's tiling of the
//! key heads over the value heads, which its GGUF conversion orders the heads for).
//!
//! Two forms of the same recurrence: [`recurrent`] token by token (decode, and the reference),
//! and [`chunked`] for prefill, which takes a chunk's tokens together in matrix products: with
//! `Γ_t` the chunk's cumulative decay up to `t`, the state after the chunk is
//! `Γ_C S_0 + Σ_s (Γ_C / Γ_s) u_s k_sᵀ`, where the corrected values `u` solve the unit lower
//! triangular system `u_t + β_t Σ_{s<t} (Γ_t / Γ_s)(k_t·k_s) u_s = β_t (v_t - Γ_t S_0 k_t)`,
//! and `o_t = Γ_t S_0 q_t + Σ_{s≤t} (Γ_t / Γ_s)(k_s·q_t) u_s`. The state is then read once a
//! chunk instead of three times a token.
//!
//! The short causal convolution in front of it ([`conv`]) keeps the last `width - 1` inputs of
//! every channel as its state.

/// The shape of one DeltaNet layer's recurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// Query/key heads and value heads (a multiple of them).
    pub k_heads: usize,
    pub v_heads: usize,
    /// Key and value head sizes.
    pub dk: usize,
    pub dv: usize,
}

impl DeltaShape {
    /// Floats of one sequence's state: `v_heads` matrices of `dv x dk`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.dv * self.dk
    }
}

/// One sequence's inputs to the recurrence for `tokens` tokens: `q` and `k` rows of
/// `k_heads * dk`, `v` rows of `v_heads * dv`, the log decay `g` (`≤ 0`) and write strength
/// `beta` rows of `v_heads`.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Tokens a chunk of [`chunked`] takes together.
pub const CHUNK: usize = 64;

/// `x / max(|x|, eps)` for each piece of `n` floats of `x` (llama.cpp's `l2_norm`).
pub fn l2_norm_each(x: &mut [f32], n: usize, eps: f32) {
    for piece in x.chunks_exact_mut(n) {
        let sum: f64 = piece.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = 1.0 / (sum.sqrt() as f32).max(eps);
        piece.iter_mut().for_each(|v| *v *= scale);
    }
}

/// The causal depthwise convolution of `channels` channels over `tokens` rows of `x` (row-major,
/// `channels` a row) into `out`, kernel `w` (`width` taps a channel, the oldest first, as GGUF's
/// `ssm_conv1d` holds them); `state` holds the `width - 1` rows before `x` (oldest first) and
/// becomes the last `width - 1` rows of the state followed by `x`.
pub fn conv(w: &[f32], width: usize, channels: usize, state: &mut [f32], x: &[f32], out: &mut [f32]) {
    let keep = width - 1;
    let tokens = x.len() / channels;
    assert!(w.len() == width * channels && state.len() == keep * channels, "conv shapes");
    assert!(x.len() == tokens * channels && out.len() == x.len(), "conv rows");
    // Row r of the state followed by x.
    let row = |r: usize| if r < keep { &state[r * channels..(r + 1) * channels] } else { &x[(r - keep) * channels..] };
    for t in 0..tokens {
        let o = &mut out[t * channels..(t + 1) * channels];
        o.iter_mut().for_each(|v| *v = 0.0);
        for tap in 0..width {
            let input = row(t + tap);
            for (c, (o, &xi)) in o.iter_mut().zip(input).enumerate() {
                *o += xi * w[c * width + tap];
            }
        }
    }
    // The new state: the last `keep` rows of state ++ x.
    let mut next = vec![0.0; keep * channels];
    for r in 0..keep {
        next[r * channels..(r + 1) * channels].copy_from_slice(&row(tokens + r)[..channels]);
    }
    state.copy_from_slice(&next);
}

/// The recurrence token by token for one sequence's `x` into `out` (rows of `v_heads * dv`),
/// `state` (`v_heads` matrices of `dv` rows of `dk`) carried through.
pub fn recurrent(s: DeltaShape, state: &mut [f32], x: &Inputs<'_>, out: &mut [f32]) {
    let DeltaShape { k_heads, v_heads, dk, dv } = s;
    let Inputs { q, k, v, g, beta } = *x;
    let tokens = g.len() / v_heads;
    check(s, state, x, out);
    let scale = 1.0 / (dk as f32).sqrt();
    for h in 0..v_heads {
        let st = &mut state[h * dv * dk..(h + 1) * dv * dk];
        let kh = h % k_heads;
        for t in 0..tokens {
            let qt = &q[(t * k_heads + kh) * dk..][..dk];
            let kt = &k[(t * k_heads + kh) * dk..][..dk];
            let vt = &v[(t * v_heads + h) * dv..][..dv];
            let (a, b) = (g[t * v_heads + h].exp(), beta[t * v_heads + h]);
            let ot = &mut out[(t * v_heads + h) * dv..][..dv];
            for (j, row) in st.chunks_exact_mut(dk).enumerate() {
                row.iter_mut().for_each(|x| *x *= a);
                let sk: f32 = row.iter().zip(kt).map(|(x, y)| x * y).sum();
                let d = (vt[j] - sk) * b;
                row.iter_mut().zip(kt).for_each(|(x, y)| *x += d * y);
                ot[j] = row.iter().zip(qt).map(|(x, y)| x * y).sum::<f32>() * scale;
            }
        }
    }
}

/// [`recurrent`]'s result in chunks of [`CHUNK`] tokens, each in matrix products (module docs).
pub fn chunked(s: DeltaShape, state: &mut [f32], x: &Inputs<'_>, out: &mut [f32]) {
    let DeltaShape { k_heads, v_heads, dk, dv } = s;
    let Inputs { q, k, v, g, beta } = *x;
    let tokens = g.len() / v_heads;
    check(s, state, x, out);
    let scale = 1.0 / (dk as f32).sqrt();
    let mut w = ChunkScratch::default();
    for h in 0..v_heads {
        let st = &mut state[h * dv * dk..(h + 1) * dv * dk];
        let kh = h % k_heads;
        for t0 in (0..tokens).step_by(CHUNK) {
            let c = CHUNK.min(tokens - t0);
            // Token t of the chunk's piece of head hh, in rows of `heads` pieces of `d`.
            let at = |heads: usize, hh: usize, d: usize, t: usize| {
                ((t0 + t) * heads + hh) * d..((t0 + t) * heads + hh + 1) * d
            };
            // Cumulative log decay within the chunk.
            w.gcum.clear();
            let mut acc = 0.0f32;
            for t in 0..c {
                acc += g[(t0 + t) * v_heads + h];
                w.gcum.push(acc);
            }
            // Dots of keys with keys and with queries (C x C, lower triangle).
            w.kk.resize(c * c, 0.0);
            w.qk.resize(c * c, 0.0);
            for t in 0..c {
                let (kt, qt) = (&k[at(k_heads, kh, dk, t)], &q[at(k_heads, kh, dk, t)]);
                for u in 0..=t {
                    let ku = &k[at(k_heads, kh, dk, u)];
                    w.kk[t * c + u] = dot(kt, ku);
                    w.qk[t * c + u] = dot(qt, ku);
                }
            }
            // Right side: β_t (v_t - Γ_t S_0 k_t), then forward substitution for u.
            w.u.resize(c * dv, 0.0);
            for t in 0..c {
                let kt = &k[at(k_heads, kh, dk, t)];
                let vt = &v[at(v_heads, h, dv, t)];
                let (gam, b) = (w.gcum[t].exp(), beta[(t0 + t) * v_heads + h]);
                for (j, row) in st.chunks_exact(dk).enumerate() {
                    w.u[t * dv + j] = b * (vt[j] - gam * dot(row, kt));
                }
                for r in 0..t {
                    let f = b * (w.gcum[t] - w.gcum[r]).exp() * w.kk[t * c + r];
                    let (done, rest) = w.u.split_at_mut(t * dv);
                    rest[..dv].iter_mut().zip(&done[r * dv..(r + 1) * dv]).for_each(|(x, y)| *x -= f * y);
                }
            }
            // Outputs: Γ_t S_0 q_t + Σ_{s≤t} (Γ_t / Γ_s)(k_s·q_t) u_s.
            for t in 0..c {
                let qt = &q[at(k_heads, kh, dk, t)];
                let ot = &mut out[at(v_heads, h, dv, t)];
                let gam = w.gcum[t].exp();
                for (j, row) in st.chunks_exact(dk).enumerate() {
                    ot[j] = gam * dot(row, qt);
                }
                for r in 0..=t {
                    let f = (w.gcum[t] - w.gcum[r]).exp() * w.qk[t * c + r];
                    ot.iter_mut().zip(&w.u[r * dv..(r + 1) * dv]).for_each(|(x, y)| *x += f * y);
                }
                ot.iter_mut().for_each(|x| *x *= scale);
            }
            // The state after the chunk: Γ_C S_0 + Σ_s (Γ_C / Γ_s) u_s k_sᵀ.
            let last = w.gcum[c - 1];
            let decay = last.exp();
            st.iter_mut().for_each(|x| *x *= decay);
            for r in 0..c {
                let kr = &k[at(k_heads, kh, dk, r)];
                let f = (last - w.gcum[r]).exp();
                for (j, row) in st.chunks_exact_mut(dk).enumerate() {
                    let uj = f * w.u[r * dv + j];
                    row.iter_mut().zip(kr).for_each(|(x, y)| *x += uj * y);
                }
            }
        }
    }
}

/// Work space of one chunk.
#[derive(Default)]
struct ChunkScratch {
    gcum: Vec<f32>,
    kk: Vec<f32>,
    qk: Vec<f32>,
    u: Vec<f32>,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn check(s: DeltaShape, state: &[f32], x: &Inputs<'_>, out: &[f32]) {
    let DeltaShape { k_heads, v_heads, dk, dv } = s;
    let Inputs { q, k, v, g, beta } = *x;
    let tokens = g.len() / v_heads.max(1);
    assert!(k_heads > 0 && v_heads.is_multiple_of(k_heads), "value heads are a multiple of key heads");
    assert!(state.len() == s.state_len(), "state {} for {s:?}", state.len());
    assert!(q.len() == tokens * k_heads * dk && k.len() == q.len(), "q/k rows");
    assert!(v.len() == tokens * v_heads * dv && out.len() == v.len(), "v/out rows");
    assert!(g.len() == tokens * v_heads && beta.len() == g.len(), "g/beta rows");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 20001) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    /// The recurrence in float64, straight from its definition.
    fn reference(s: DeltaShape, state: &mut [f64], x: &Inputs<'_>) -> Vec<f64> {
        let DeltaShape { k_heads, v_heads, dk, dv } = s;
        let Inputs { q, k, v, g, beta } = *x;
        let tokens = g.len() / v_heads;
        let mut out = vec![0.0; tokens * v_heads * dv];
        for t in 0..tokens {
            for h in 0..v_heads {
                let kh = h % k_heads;
                let st = &mut state[h * dv * dk..(h + 1) * dv * dk];
                let a = f64::from(g[t * v_heads + h]).exp();
                let b = f64::from(beta[t * v_heads + h]);
                let kt: Vec<f64> = k[(t * k_heads + kh) * dk..][..dk].iter().map(|&x| f64::from(x)).collect();
                let qt: Vec<f64> = q[(t * k_heads + kh) * dk..][..dk].iter().map(|&x| f64::from(x)).collect();
                for j in 0..dv {
                    let row = &mut st[j * dk..(j + 1) * dk];
                    row.iter_mut().for_each(|x| *x *= a);
                    let sk: f64 = row.iter().zip(&kt).map(|(x, y)| x * y).sum();
                    let d = (f64::from(v[(t * v_heads + h) * dv + j]) - sk) * b;
                    row.iter_mut().zip(&kt).for_each(|(x, y)| *x += d * y);
                    out[(t * v_heads + h) * dv + j] =
                        row.iter().zip(&qt).map(|(x, y)| x * y).sum::<f64>() / (dk as f64).sqrt();
                }
            }
        }
        out
    }

    struct Case {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        state: Vec<f32>,
    }

    impl Case {
        fn inputs(&self) -> Inputs<'_> {
            Inputs { q: &self.q, k: &self.k, v: &self.v, g: &self.g, beta: &self.beta }
        }
    }

    fn case(s: DeltaShape, tokens: usize, seed: u32) -> Case {
        let mut q = values(tokens * s.k_heads * s.dk, seed);
        let mut k = values(tokens * s.k_heads * s.dk, seed + 1);
        l2_norm_each(&mut q, s.dk, 1e-6);
        l2_norm_each(&mut k, s.dk, 1e-6);
        // Decays from nearly none to strong (g in [-3, 0]), write strengths in (0, 1).
        let g = values(tokens * s.v_heads, seed + 2).iter().map(|x| -1.5 * (x + 1.0)).collect();
        let beta = values(tokens * s.v_heads, seed + 3).iter().map(|x| 1.0 / (1.0 + (-3.0 * x).exp())).collect();
        Case { q, k, v: values(tokens * s.v_heads * s.dv, seed + 4), g, beta, state: values(s.state_len(), seed + 5) }
    }

    #[test]
    fn both_forms_follow_the_recurrence_in_float64() {
        // Head shapes: tiny, Qwen3.5's key heads tiled over twice as many value heads, and
        // uneven key and value sizes; lengths below, at and across chunk boundaries.
        let shapes = [
            DeltaShape { k_heads: 1, v_heads: 1, dk: 8, dv: 8 },
            DeltaShape { k_heads: 2, v_heads: 4, dk: 32, dv: 32 },
            DeltaShape { k_heads: 2, v_heads: 2, dk: 16, dv: 24 },
        ];
        for (i, s) in shapes.into_iter().enumerate() {
            for tokens in [1, 5, CHUNK, CHUNK + 1, 2 * CHUNK + 17] {
                let c = case(s, tokens, 10 * i as u32 + tokens as u32);
                let mut want_state: Vec<f64> = c.state.iter().map(|&x| f64::from(x)).collect();
                let want = reference(s, &mut want_state, &c.inputs());
                type Form = fn(DeltaShape, &mut [f32], &Inputs<'_>, &mut [f32]);
                for (name, form) in [("recurrent", recurrent as Form), ("chunked", chunked as Form)] {
                    let mut state = c.state.clone();
                    let mut out = vec![0.0; want.len()];
                    form(s, &mut state, &c.inputs(), &mut out);
                    let worst = |a: &[f32], b: &[f64]| {
                        a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - y).abs()).fold(0.0, f64::max)
                    };
                    let (o, st) = (worst(&out, &want), worst(&state, &want_state));
                    assert!(o < 2e-4 && st < 2e-4, "{name} {s:?} {tokens} tokens: output {o}, state {st}");
                }
            }
        }
    }

    #[test]
    fn a_sequence_in_pieces_is_the_sequence_whole() {
        // Prefill in chunks then decode: the state carries everything between calls.
        let s = DeltaShape { k_heads: 2, v_heads: 4, dk: 16, dv: 16 };
        let c = case(s, 100, 7);
        let (mut whole_state, mut whole) = (c.state.clone(), vec![0.0; c.v.len()]);
        recurrent(s, &mut whole_state, &c.inputs(), &mut whole);
        let mut state = c.state.clone();
        let mut out = vec![0.0; c.v.len()];
        for (t0, t1) in [(0, 37), (37, 90), (90, 91), (91, 100)] {
            let (kq, kv, kg) = (s.k_heads * s.dk, s.v_heads * s.dv, s.v_heads);
            let form = if t1 - t0 > 1 { chunked } else { recurrent };
            let x = Inputs {
                q: &c.q[t0 * kq..t1 * kq],
                k: &c.k[t0 * kq..t1 * kq],
                v: &c.v[t0 * kv..t1 * kv],
                g: &c.g[t0 * kg..t1 * kg],
                beta: &c.beta[t0 * kg..t1 * kg],
            };
            form(s, &mut state, &x, &mut out[t0 * kv..t1 * kv]);
        }
        let worst = out.iter().zip(&whole).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst < 1e-4, "{worst}");
    }

    #[test]
    fn the_convolution_carries_its_window_across_calls() {
        let (width, channels) = (4, 6);
        let w = values(width * channels, 1);
        let x = values(11 * channels, 2);
        let init = values((width - 1) * channels, 3);
        // Direct: out[t][c] = Σ_tap w[c][tap] * input[t + tap][c], input = init ++ x.
        let input: Vec<f32> = init.iter().chain(&x).copied().collect();
        let want: Vec<f32> = (0..11 * channels)
            .map(|i| {
                let (t, c) = (i / channels, i % channels);
                (0..width).map(|tap| w[c * width + tap] * input[(t + tap) * channels + c]).sum()
            })
            .collect();
        let mut state = init.clone();
        let mut out = vec![0.0; x.len()];
        for (t0, t1) in [(0, 2), (2, 3), (3, 11)] {
            conv(
                &w,
                width,
                channels,
                &mut state,
                &x[t0 * channels..t1 * channels],
                &mut out[t0 * channels..t1 * channels],
            );
        }
        let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst < 1e-6, "{worst}");
        assert_eq!(state, input[input.len() - (width - 1) * channels..], "the state is the last inputs");
    }

    #[test]
    fn l2_norm_makes_unit_rows_and_leaves_zero_rows_zero() {
        let mut x = [3.0, 4.0, 0.0, 0.0];
        l2_norm_each(&mut x, 2, 1e-6);
        assert_eq!(x, [0.6, 0.8, 0.0, 0.0]);
    }
}
