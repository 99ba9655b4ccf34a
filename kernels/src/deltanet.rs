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
//! key heads over the value heads, which its GGUF conversion of Qwen3.5 orders the heads for),
//! or `h / (v_heads / k_heads)` where the file keeps a key head's value heads together
//! (Qwen3-Next: [`DeltaShape::grouped`]).
//!
//! Two forms of the same recurrence: [`recurrent`] token by token (the reference), and [`step`],
//! the chunked form the backends run: positions in chunks of [`CHUNK`] from the sequence's
//! start, and with `Γ_t` a chunk's cumulative decay up to its row `t`, the state after the
//! chunk is `Γ_C S_0 + Σ_s (Γ_C / Γ_s) u_s k_sᵀ`, where the corrected values `u` solve the unit
//! lower triangular system `u_t + β_t Σ_{s<t} (Γ_t / Γ_s)(k_t·k_s) u_s = β_t (v_t - Γ_t S_0
//! k_t)`, and `o_t = Γ_t S_0 q_t + Σ_{s≤t} (Γ_t / Γ_s)(k_s·q_t) u_s`. A row needs only `S_0`
//! and the rows before it, so the state a sequence carries is `S_0` and its chunk's rows so
//! far, and a row is computed the same way whether its chunk arrives whole (a prompt) or a
//! token at a time (decode).
//!
//! The short causal convolution in front of it ([`conv`]) keeps the last inputs of every
//! channel as its state, a ring of rows by position.
//!
//! Both states can go back (a speculative step's rejected tokens): [`step`] keeps the rows and
//! `S_0` of two chunks, the current one and the one before, so a sequence that has run
//! positions below `high` can continue from any position `≥ high - CHUNK`, and [`conv`]'s ring
//! serves any position its rows beyond `width - 1` reach back to. Going back is then only
//! calling them with an earlier `start`: what the earlier positions left is still there.

use crate::pool::{SyncPtr, ThreadPool};

/// The shape of one DeltaNet layer's recurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// Query/key heads and value heads (a multiple of them).
    pub k_heads: usize,
    pub v_heads: usize,
    /// Key and value head sizes.
    pub dk: usize,
    pub dv: usize,
    /// A key head's value heads are consecutive (Qwen3-Next) instead of tiled (Qwen3.5).
    pub grouped: bool,
}

impl DeltaShape {
    /// The query/key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        if self.grouped {
            h / (self.v_heads / self.k_heads)
        } else {
            h % self.k_heads
        }
    }

    /// Floats of one sequence's state: `v_heads` matrices of `dv x dk`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.dv * self.dk
    }

    /// Floats of one sequence's state for [`step`]: two chunks' keys (even chunks' then odd
    /// chunks'), then per value head ([`DeltaShape::head_state_len`]) the same two halves of
    /// the state at a chunk's start and the chunk's corrected values and cumulative log decays.
    pub fn chunk_state_len(&self) -> usize {
        2 * self.key_rows_len() + self.v_heads * self.head_state_len()
    }

    /// One value head's part of [`DeltaShape::chunk_state_len`]: an even chunk's half, then
    /// an odd chunk's.
    pub fn head_state_len(&self) -> usize {
        2 * self.half_len()
    }

    /// A head's floats for one chunk: `S_0`, then the chunk's corrected values (`dv` a row)
    /// and cumulative log decays.
    fn half_len(&self) -> usize {
        self.dv * self.dk + CHUNK * (self.dv + 1)
    }

    /// One chunk's keys: `CHUNK` rows of `k_heads * dk`.
    fn key_rows_len(&self) -> usize {
        CHUNK * self.k_heads * self.dk
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

/// Positions a chunk of [`step`] takes together.
pub const CHUNK: usize = 64;

/// `x / max(|x|, eps)` for each piece of `n` floats of `x` (llama.cpp's `l2_norm`).
pub fn l2_norm_each(x: &mut [f32], n: usize, eps: f32) {
    for piece in x.chunks_exact_mut(n) {
        let sum: f64 = piece.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = 1.0 / (sum.sqrt() as f32).max(eps);
        piece.iter_mut().for_each(|v| *v *= scale);
    }
}

/// GGUF's convolution kernel (`ssm_conv1d`: `width` taps a channel, the oldest first, channel
/// after channel) as [`conv`] reads it: tap after tap, a row of `channels` each.
pub fn conv_taps(w: &[f32], width: usize) -> Vec<f32> {
    let channels = w.len() / width;
    (0..width * channels).map(|i| w[(i % channels) * width + i / channels]).collect()
}

/// The causal depthwise convolution of `channels` channels over `tokens` rows of `x` (row-major,
/// `channels` a row; positions `start..`) into `out`, kernel `w` in [`conv_taps`]'s layout.
/// `ring` is the state: rows of `channels` (at least `width - 1` of them), the input of
/// position `p` in row `p mod rows`; positions before 0 are zeros. The rows of `x` go in after,
/// so a later call may start again at any position whose `width - 1` inputs before it the ring
/// still holds (at most `rows - width + 1` positions back from the furthest run).
pub fn conv(w: &[f32], width: usize, channels: usize, ring: &mut [f32], start: usize, x: &[f32], out: &mut [f32]) {
    let rows = ring.len() / channels.max(1);
    let tokens = x.len() / channels;
    assert!(w.len() == width * channels && rows >= width - 1 && ring.len() == rows * channels, "conv shapes");
    assert!(x.len() == tokens * channels && out.len() == x.len(), "conv rows");
    for t in 0..tokens {
        let o = &mut out[t * channels..(t + 1) * channels];
        o.iter_mut().for_each(|v| *v = 0.0);
        for (tap, wt) in w.chunks_exact(channels).enumerate() {
            // The input `back` positions before this one: x's, the ring's, or none (zero).
            let back = width - 1 - tap;
            let input = if t >= back {
                &x[(t - back) * channels..][..channels]
            } else if let Some(p) = (start + t).checked_sub(back) {
                &ring[(p % rows) * channels..][..channels]
            } else {
                continue;
            };
            o.iter_mut().zip(input).zip(wt).for_each(|((o, &xi), &wi)| *o += xi * wi);
        }
    }
    for t in tokens.saturating_sub(rows)..tokens {
        let r = (start + t) % rows;
        ring[r * channels..(r + 1) * channels].copy_from_slice(&x[t * channels..(t + 1) * channels]);
    }
}

/// The recurrence token by token for one sequence's `x` into `out` (rows of `v_heads * dv`),
/// `state` (`v_heads` matrices of `dv` rows of `dk`) carried through.
pub fn recurrent(s: DeltaShape, state: &mut [f32], x: &Inputs<'_>, out: &mut [f32]) {
    let DeltaShape { k_heads, v_heads, dk, dv, .. } = s;
    let Inputs { q, k, v, g, beta } = *x;
    let tokens = g.len() / v_heads;
    check(s, state, x, out);
    let scale = 1.0 / (dk as f32).sqrt();
    for h in 0..v_heads {
        let st = &mut state[h * dv * dk..(h + 1) * dv * dk];
        let kh = s.key_head(h);
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

/// The recurrence over a sequence's next tokens (positions `start..`), in chunks of [`CHUNK`]
/// positions aligned to the sequence's start (module docs): `state` is the sequence's
/// [`DeltaShape::chunk_state_len`] floats, its chunks' keys so far, then per value head the
/// state `S_0` at a chunk's start and the chunk's rows so far (corrected values and cumulative
/// log decays), for the current chunk and the one before. Each new row's output is computed
/// from its chunk's `S_0` and the rows before it in its chunk; a row beginning a chunk first
/// computes that chunk's `S_0` from the chunk before (into the other half, so the one before
/// stays: `start` may go back up to [`CHUNK`] positions from the furthest run). Every row's
/// arithmetic is the same however a sequence's tokens are split across calls (and whichever
/// thread runs its head), so a token's result does not depend on how its prompt was cut into
/// steps or batched with others; and the state of a chunk's start is read twice a token (its
/// products with the token's key and query) and once a chunk to move on, where the
/// token-by-token form reads it three times a token. The value heads run as tasks of `pool`
/// where one is given.
pub fn step(
    pool: Option<&ThreadPool>,
    s: DeltaShape,
    state: &mut [f32],
    start: usize,
    x: &Inputs<'_>,
    out: &mut [f32],
) {
    let DeltaShape { k_heads, v_heads, dk, .. } = s;
    let Inputs { k, g, .. } = *x;
    let tokens = g.len() / v_heads;
    assert!(state.len() == s.chunk_state_len(), "state {} for {s:?}", state.len());
    check_inputs(s, x, out);
    let kr = s.key_rows_len();
    let (krows, heads) = state.split_at_mut(2 * kr);
    let (per_head, half) = (s.head_state_len(), s.half_len());
    let (heads_ptr, out_ptr) = (SyncPtr(heads.as_mut_ptr()), SyncPtr(out.as_mut_ptr()));
    let mut i = 0;
    while i < tokens {
        let p = start + i;
        let c0 = p % CHUNK;
        // The chunk's half of the state: even chunks the first, odd the second.
        let par = p / CHUNK % 2;
        let m = (CHUNK - c0).min(tokens - i);
        // A row beginning a chunk computes every head's S_0 for it from the chunk before (its
        // S_0 and rows, and its keys, in the other half), then this call's rows' keys go in.
        if c0 == 0 && p > 0 {
            let before = &krows[(1 - par) * kr..(2 - par) * kr];
            let task = |h: usize| {
                // SAFETY: task h touches only head h's `per_head` floats of `heads`, disjoint
                // from every other task's; `heads` outlives the dispatch.
                let hs = unsafe { std::slice::from_raw_parts_mut(heads_ptr.get().add(h * per_head), per_head) };
                let (even, odd) = hs.split_at_mut(half);
                let (from, to) = if par == 1 { (&*even, odd) } else { (&*odd, even) };
                wide::finish_chunk(s, h, from, &mut to[..s.dv * s.dk], before);
            };
            run_heads(pool, v_heads, &task);
        }
        let krows = &mut krows[par * kr..(par + 1) * kr];
        krows[c0 * k_heads * dk..(c0 + m) * k_heads * dk].copy_from_slice(&k[i * k_heads * dk..(i + m) * k_heads * dk]);
        let seg = Segment { s, krows, x, start: p, t0: i, m, out: out_ptr };
        let task = |h: usize| {
            // SAFETY: as above (the outputs `head_rows` writes through `out_ptr` are head h's
            // alone: see there).
            let hs = unsafe { std::slice::from_raw_parts_mut(heads_ptr.get().add(h * per_head + par * half), half) };
            wide::head_rows(&seg, h, hs);
        };
        run_heads(pool, v_heads, &task);
        i += m;
    }
}

/// Rows `t0..t0 + m` of a call's tokens (`x`), positions `start..start + m`, all in one chunk
/// (its keys so far in `krows`); their outputs go to `out`, the call's output buffer.
struct Segment<'a, 'b> {
    s: DeltaShape,
    krows: &'a [f32],
    x: &'a Inputs<'b>,
    start: usize,
    t0: usize,
    m: usize,
    out: SyncPtr<f32>,
}

/// A head's work compiled for AVX2 where the processor has it (the eight-lane dots one
/// register, the updates eight floats an instruction), the same code otherwise: the same
/// operations in the same order either way (no fused multiply-adds), so a row's result does
/// not depend on the machine's vector width.
mod wide {
    use super::{DeltaShape, Segment};

    /// How a head's work takes its dot products: [`super::dot`]'s eight lanes, in whichever
    /// instructions the type stands for.
    pub(super) trait Lanes {
        fn dot(&self, a: &[f32], b: &[f32]) -> f32;
    }

    /// The portable form.
    pub(super) struct Portable;

    impl Lanes for Portable {
        #[inline(always)]
        fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
            super::dot(a, b)
        }
    }

    /// AVX2's registers; a value exists only where the processor has AVX2 ([`avx2`]).
    #[cfg(target_arch = "x86_64")]
    pub(super) struct Avx2(());

    #[cfg(target_arch = "x86_64")]
    impl Lanes for Avx2 {
        #[inline(always)]
        fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
            // SAFETY: an `Avx2` exists only where the processor has AVX2.
            unsafe { dot_avx2(a, b) }
        }
    }

    /// [`super::dot`] in one register: the same products and sums in the same order.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let mut acc = _mm256_setzero_ps();
        for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
            // SAFETY: each chunk is eight floats, all an unaligned load reads.
            let (x, y) = unsafe { (_mm256_loadu_ps(ca.as_ptr()), _mm256_loadu_ps(cb.as_ptr())) };
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        // Lanes l and l + 4 first, then ((0 + 1) + (2 + 3)), as the portable form.
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        let mut p = [0.0f32; 4];
        // SAFETY: `p` holds the four floats stored.
        unsafe { _mm_storeu_ps(p.as_mut_ptr(), s) };
        let mut sum = (p[0] + p[1]) + (p[2] + p[3]);
        for i in n / 8 * 8..n {
            sum += a[i] * b[i];
        }
        sum
    }

    #[cfg(target_arch = "x86_64")]
    fn avx2() -> Option<Avx2> {
        std::arch::is_x86_feature_detected!("avx2").then_some(Avx2(()))
    }

    #[cfg(all(test, target_arch = "x86_64"))]
    pub(super) fn avx2_for_tests() -> Option<Avx2> {
        avx2()
    }

    #[cfg(all(test, not(target_arch = "x86_64")))]
    pub(super) fn avx2_for_tests() -> Option<Portable> {
        None
    }

    pub(super) fn head_rows(seg: &Segment<'_, '_>, h: usize, hs: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(l) = avx2() {
            #[target_feature(enable = "avx2")]
            fn run(l: &Avx2, seg: &Segment<'_, '_>, h: usize, hs: &mut [f32]) {
                super::head_rows(l, seg, h, hs)
            }
            // SAFETY: the processor has AVX2 (`l` says so), all `run` asks.
            return unsafe { run(&l, seg, h, hs) };
        }
        super::head_rows(&Portable, seg, h, hs)
    }

    pub(super) fn finish_chunk(s: DeltaShape, h: usize, from: &[f32], to: &mut [f32], krows: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2().is_some() {
            #[target_feature(enable = "avx2")]
            fn run(s: DeltaShape, h: usize, from: &[f32], to: &mut [f32], krows: &[f32]) {
                super::finish_chunk(s, h, from, to, krows)
            }
            // SAFETY: the processor has AVX2 (checked just above), all `run` asks.
            return unsafe { run(s, h, from, to, krows) };
        }
        super::finish_chunk(s, h, from, to, krows)
    }
}

/// `task(h)` for every value head, as tasks of `pool` or in order.
fn run_heads(pool: Option<&ThreadPool>, heads: usize, task: &(dyn Fn(usize) + Sync)) {
    match pool {
        Some(pool) if pool.threads() > 1 && heads > 1 => pool.run(heads, task),
        _ => (0..heads).for_each(task),
    }
}

/// Head `h`'s rows of a segment (`hs`: its half of the state for the segment's chunk): their
/// cumulative decays, corrected values and outputs (`v_heads * dv` floats a token).
#[inline(always)]
fn head_rows<L: wide::Lanes>(l: &L, seg: &Segment<'_, '_>, h: usize, hs: &mut [f32]) {
    let Segment { s, krows, x, out, .. } = *seg;
    let DeltaShape { k_heads, v_heads, dk, dv, .. } = s;
    let Inputs { q, v, g, beta, .. } = *x;
    let scale = 1.0 / (dk as f32).sqrt();
    let kh = s.key_head(h);
    let (st, rest) = hs.split_at_mut(dv * dk);
    let (urows, grows) = rest.split_at_mut(CHUNK * dv);
    let key = |r: usize| &krows[(r * k_heads + kh) * dk..][..dk];
    let c0 = seg.start % CHUNK;
    for j in 0..seg.m {
        let (c, t) = (c0 + j, seg.t0 + j);
        let before = if c == 0 { 0.0 } else { grows[c - 1] };
        grows[c] = before + g[t * v_heads + h];
        let qt = &q[(t * k_heads + kh) * dk..][..dk];
        let kt = key(c);
        let gc = grows[c];
        let (gam, b) = (gc.exp(), beta[t * v_heads + h]);
        // SAFETY: token t's output of head h, `dv` floats at `(t * v_heads + h) * dv` inside
        // the output buffer (`check_inputs` checked its length): no other head's task writes
        // them, and nothing reads them while the call runs.
        let ot = unsafe { std::slice::from_raw_parts_mut(out.get().add((t * v_heads + h) * dv), dv) };
        // u_c = β (v_c - Γ_c S_0 k_c - Σ_{r<c} (Γ_c / Γ_r)(k_c·k_r) u_r) and o_c's first term
        // Γ_c S_0 q_c, in one pass over S_0.
        let (done, cur) = urows.split_at_mut(c * dv);
        let uc = &mut cur[..dv];
        let vt = &v[(t * v_heads + h) * dv..][..dv];
        for (jj, ((u, o), row)) in uc.iter_mut().zip(ot.iter_mut()).zip(st.chunks_exact(dk)).enumerate() {
            *u = b * (vt[jj] - gam * l.dot(row, kt));
            *o = gam * l.dot(row, qt);
        }
        for r in 0..c {
            let f = b * (gc - grows[r]).exp() * l.dot(kt, key(r));
            uc.iter_mut().zip(&done[r * dv..(r + 1) * dv]).for_each(|(x, y)| *x -= f * y);
        }
        // o_c = Γ_c S_0 q_c + Σ_{r≤c} (Γ_c / Γ_r)(k_r·q_c) u_r.
        for r in 0..=c {
            let f = (gc - grows[r]).exp() * l.dot(key(r), qt);
            let ur = if r < c { &done[r * dv..(r + 1) * dv] } else { &cur[..dv] };
            ot.iter_mut().zip(ur).for_each(|(x, y)| *x += f * y);
        }
        ot.iter_mut().for_each(|x| *x *= scale);
    }
}

/// Head `h`'s `S_0` for the chunk after a whole one (`from`: its half of the state, `krows`
/// its keys) into `to`: `Γ_C S_0 + Σ_r (Γ_C / Γ_r) u_r k_rᵀ`, a row at a time (the row stays
/// in cache over the chunk's rows; each value gets the chunk's terms in order).
#[inline(always)]
fn finish_chunk(s: DeltaShape, h: usize, from: &[f32], to: &mut [f32], krows: &[f32]) {
    let DeltaShape { k_heads, dk, dv, .. } = s;
    let kh = s.key_head(h);
    let (s0, rest) = from.split_at(dv * dk);
    let (urows, grows) = rest.split_at(CHUNK * dv);
    let last = grows[CHUNK - 1];
    let decay = last.exp();
    let mut f = [0.0f32; CHUNK];
    f.iter_mut().zip(&grows[..CHUNK]).for_each(|(f, &g)| *f = (last - g).exp());
    for (j, (row, old)) in to.chunks_exact_mut(dk).zip(s0.chunks_exact(dk)).enumerate() {
        row.iter_mut().zip(old).for_each(|(x, &o)| *x = o * decay);
        for (r, &fr) in f.iter().enumerate() {
            let a = fr * urows[r * dv + j];
            let kr = &krows[(r * k_heads + kh) * dk..][..dk];
            row.iter_mut().zip(kr).for_each(|(x, y)| *x += a * y);
        }
    }
}

/// `a · b` in eight lanes (element `i` into lane `i mod 8`, the lanes summed pairwise, the
/// tail after), an order the compiler turns into vector instructions and every call keeps.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0.0f32; 8];
    for (ca, cb) in a[..n].chunks_exact(8).zip(b[..n].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in n / 8 * 8..n {
        sum += a[i] * b[i];
    }
    sum
}

fn check(s: DeltaShape, state: &[f32], x: &Inputs<'_>, out: &[f32]) {
    assert!(state.len() == s.state_len(), "state {} for {s:?}", state.len());
    check_inputs(s, x, out);
}

fn check_inputs(s: DeltaShape, x: &Inputs<'_>, out: &[f32]) {
    let DeltaShape { k_heads, v_heads, dk, dv, .. } = s;
    let Inputs { q, k, v, g, beta } = *x;
    let tokens = g.len() / v_heads.max(1);
    assert!(k_heads > 0 && v_heads.is_multiple_of(k_heads), "value heads are a multiple of key heads");
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
        let DeltaShape { k_heads, v_heads, dk, dv, .. } = s;
        let Inputs { q, k, v, g, beta } = *x;
        let tokens = g.len() / v_heads;
        let mut out = vec![0.0; tokens * v_heads * dv];
        for t in 0..tokens {
            for h in 0..v_heads {
                let kh = if s.grouped { h * k_heads / v_heads } else { h % k_heads };
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

    /// `x`'s rows `t0..t1`.
    fn rows<'a>(s: DeltaShape, c: &'a Case, t0: usize, t1: usize) -> Inputs<'a> {
        let (kq, kv, kg) = (s.k_heads * s.dk, s.v_heads * s.dv, s.v_heads);
        Inputs {
            q: &c.q[t0 * kq..t1 * kq],
            k: &c.k[t0 * kq..t1 * kq],
            v: &c.v[t0 * kv..t1 * kv],
            g: &c.g[t0 * kg..t1 * kg],
            beta: &c.beta[t0 * kg..t1 * kg],
        }
    }

    /// A chunk state starting from `s0` (every head's matrix) at position 0.
    fn chunk_state(s: DeltaShape, s0: &[f32]) -> Vec<f32> {
        let mut st = vec![0.0; s.chunk_state_len()];
        let base = 2 * s.key_rows_len();
        for (h, m) in s0.chunks_exact(s.dv * s.dk).enumerate() {
            let at = base + h * s.head_state_len();
            st[at..at + m.len()].copy_from_slice(m);
        }
        st
    }

    #[test]
    fn both_forms_follow_the_recurrence_in_float64() {
        // Head shapes: tiny, Qwen3.5's key heads tiled over twice as many value heads, uneven
        // key and value sizes, and Qwen3-Next's grouped heads; lengths below, at and across chunk boundaries.
        let shapes = [
            DeltaShape { k_heads: 1, v_heads: 1, dk: 8, dv: 8, grouped: false },
            DeltaShape { k_heads: 2, v_heads: 4, dk: 32, dv: 32, grouped: false },
            DeltaShape { k_heads: 2, v_heads: 2, dk: 16, dv: 24, grouped: false },
            DeltaShape { k_heads: 2, v_heads: 6, dk: 16, dv: 16, grouped: true },
        ];
        let worst = |a: &[f32], b: &[f64]| a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - y).abs()).fold(0.0, f64::max);
        for (i, s) in shapes.into_iter().enumerate() {
            for tokens in [1, 5, CHUNK, CHUNK + 1, 2 * CHUNK + 17] {
                let c = case(s, tokens, 10 * i as u32 + tokens as u32);
                let mut want_state: Vec<f64> = c.state.iter().map(|&x| f64::from(x)).collect();
                let want = reference(s, &mut want_state, &c.inputs());
                let mut state = c.state.clone();
                let mut out = vec![0.0; want.len()];
                recurrent(s, &mut state, &c.inputs(), &mut out);
                let (o, st) = (worst(&out, &want), worst(&state, &want_state));
                assert!(o < 2e-4 && st < 2e-4, "recurrent {s:?} {tokens} tokens: output {o}, state {st}");
                let mut state = chunk_state(s, &c.state);
                step(None, s, &mut state, 0, &c.inputs(), &mut out);
                let o = worst(&out, &want);
                assert!(o < 2e-4, "chunked {s:?} {tokens} tokens: output {o}");
            }
        }
    }

    #[test]
    fn a_token_does_not_depend_on_how_its_sequence_was_split() {
        // The same 200 tokens whole, in uneven steps (a prefill cut by a budget, then decode),
        // a token at a time and with the heads on threads: the same outputs and state, bit
        // for bit; the chunks' states follow the token-by-token form.
        let s = DeltaShape { k_heads: 2, v_heads: 4, dk: 16, dv: 16, grouped: false };
        let n = 200;
        let c = case(s, n, 7);
        let kv = s.v_heads * s.dv;
        let pool = ThreadPool::new(3);
        let run = |cuts: &[usize], pool: Option<&ThreadPool>| {
            let mut state = chunk_state(s, &c.state);
            let mut out = vec![0.0; n * kv];
            for w in cuts.windows(2) {
                step(pool, s, &mut state, w[0], &rows(s, &c, w[0], w[1]), &mut out[w[0] * kv..w[1] * kv]);
            }
            (out, state)
        };
        let whole = run(&[0, n], None);
        assert!(run(&[0, 37, 90, 91, 128, 129, n], None) == whole, "uneven steps");
        assert!(run(&(0..=n).collect::<Vec<_>>(), None) == whole, "a token at a time");
        assert!(run(&[0, 37, 90, 91, 128, 129, n], Some(&pool)) == whole, "heads on three threads");
        let mut state = c.state.clone();
        let mut out = vec![0.0; n * kv];
        recurrent(s, &mut state, &c.inputs(), &mut out);
        let worst = out.iter().zip(&whole.0).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst < 1e-4, "{worst}");
    }

    /// The direct convolution of `x` (positions from 0, zeros before).
    fn direct_conv(w: &[f32], width: usize, channels: usize, x: &[f32]) -> Vec<f32> {
        (0..x.len())
            .map(|i| {
                let (t, c) = (i / channels, i % channels);
                (0..width)
                    .filter(|&tap| t + tap >= width - 1)
                    .map(|tap| w[c * width + tap] * x[(t + tap - (width - 1)) * channels + c])
                    .sum()
            })
            .collect()
    }

    /// A case whose rows before `len` are `a`'s and the rest `b`'s.
    fn spliced(s: DeltaShape, a: &Case, b: &Case, len: usize) -> Case {
        let join = |x: &[f32], y: &[f32], per: usize| x[..len * per].iter().chain(&y[len * per..]).copied().collect();
        let (kq, kv, kg) = (s.k_heads * s.dk, s.v_heads * s.dv, s.v_heads);
        Case {
            q: join(&a.q, &b.q, kq),
            k: join(&a.k, &b.k, kq),
            v: join(&a.v, &b.v, kv),
            g: join(&a.g, &b.g, kg),
            beta: join(&a.beta, &b.beta, kg),
            state: a.state.clone(),
        }
    }

    #[test]
    fn a_state_goes_back_up_to_a_chunk() {
        // Run one sequence's tokens to `high` (a last step of several, as a speculative one),
        // go back to `len` and run other tokens from there: every output is the one of a
        // sequence that never went past `len`, bit for bit, within a chunk, at its edges and
        // across one.
        let s = DeltaShape { k_heads: 2, v_heads: 4, dk: 16, dv: 16, grouped: false };
        let n = 3 * CHUNK + 10;
        let (a, b) = (case(s, n, 21), case(s, n, 22));
        let kv = s.v_heads * s.dv;
        let c = CHUNK;
        let cases = [
            (c - 10, c - 20),
            (c, c - 1),
            (c, c),
            (c + 1, c),
            (c + 5, c - 3),
            (2 * c, c),
            (2 * c + 3, c + 3),
            (c + 1, 1),
        ];
        for (high, len) in cases {
            let mut state = chunk_state(s, &a.state);
            let mut out = vec![0.0; n * kv];
            let first = len.min(high.saturating_sub(5));
            step(None, s, &mut state, 0, &rows(s, &a, 0, first), &mut out[..first * kv]);
            step(None, s, &mut state, first, &rows(s, &a, first, high), &mut out[first * kv..high * kv]);
            step(None, s, &mut state, len, &rows(s, &b, len, n), &mut out[len * kv..]);
            let want_case = spliced(s, &a, &b, len);
            let mut want_state = chunk_state(s, &a.state);
            let mut want = vec![0.0; n * kv];
            step(None, s, &mut want_state, 0, &want_case.inputs(), &mut want);
            assert!(out == want, "ran to {high}, back to {len}");
        }
    }

    #[test]
    fn the_convolution_carries_its_window_across_calls() {
        let (width, channels) = (4, 6);
        let w = values(width * channels, 1);
        let x = values(11 * channels, 2);
        let want = direct_conv(&w, width, channels, &x);
        let mut ring = vec![0.0; (width - 1) * channels];
        let mut out = vec![0.0; x.len()];
        for (t0, t1) in [(0, 2), (2, 3), (3, 11)] {
            let (x, out) = (&x[t0 * channels..t1 * channels], &mut out[t0 * channels..t1 * channels]);
            conv(&conv_taps(&w, width), width, channels, &mut ring, t0, x, out);
        }
        let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst < 1e-6, "{worst}");
    }

    #[test]
    fn the_convolution_goes_back_as_far_as_its_ring_reaches() {
        // A ring of `width - 1 + back` rows: run to `high`, go back to `len` (up to `back`
        // positions), run other inputs: the same outputs, bit for bit, as never having gone
        // past `len`.
        let (width, channels, back) = (4, 5, 7);
        let w = conv_taps(&values(width * channels, 1), width);
        let (xa, xb) = (values(40 * channels, 2), values(40 * channels, 3));
        for (high, len) in [(9, 2), (20, 13), (20, 19), (2, 0), (31, 24)] {
            let mut ring = vec![0.0; (width - 1 + back) * channels];
            let mut out = vec![0.0; 40 * channels];
            conv(&w, width, channels, &mut ring, 0, &xa[..high * channels], &mut out[..high * channels]);
            conv(&w, width, channels, &mut ring, len, &xb[len * channels..], &mut out[len * channels..]);
            let x: Vec<f32> = xa[..len * channels].iter().chain(&xb[len * channels..]).copied().collect();
            let mut fresh = vec![0.0; (width - 1) * channels];
            let mut want = vec![0.0; 40 * channels];
            conv(&w, width, channels, &mut fresh, 0, &x, &mut want);
            assert!(out == want, "ran to {high}, back to {len}");
        }
    }

    #[test]
    fn the_avx2_dot_is_the_portable_dot_bit_for_bit() {
        use wide::Lanes;
        let Some(l) = wide::avx2_for_tests() else {
            eprintln!("skipped: no AVX2");
            return;
        };
        for n in [0, 3, 8, 13, 128, 131] {
            let (a, b) = (values(n, 5), values(n, 6));
            assert_eq!(l.dot(&a, &b).to_bits(), dot(&a, &b).to_bits(), "{n} values");
        }
    }

    #[test]
    fn l2_norm_makes_unit_rows_and_leaves_zero_rows_zero() {
        let mut x = [3.0, 4.0, 0.0, 0.0];
        l2_norm_each(&mut x, 2, 1e-6);
        assert_eq!(x, [0.6, 0.8, 0.0, 0.0]);
    }
}
