//! AVX-512 attention kernels over f16 K/V (the `attn_scores` and `attn_values` entries of the
//! AVX-512 table); values for head sizes 64, 128 and 256, other head sizes' values through the
//! AVX2 kernel.
//!
//! Scores: the K cache holds each block's keys transposed ([`KeysT`]), so one dimension of 16
//! keys is one vector: it is converted from f16 once and multiplied by that element of every
//! query head of a tile of up to 8, each head's accumulator holding its 16 keys' scores, with
//! no horizontal sums. The next block's keys and this block's values are fetched a part every
//! 8 dimensions, so the fetches spread over the products instead of queueing at once. Any head
//! size.
//!
//! Values: the outputs stay in registers while the values stream past: a tile of up to 6 query
//! heads (Qwen2.5's group) by 64 dimensions (24 accumulators), each value row converted once
//! per tile; 6 rather than 4 heads halves the passes over a block's values at Qwen2.5's group
//! (8,192 positions: 79-81 -> 70-71 ns a position, BENCHMARKS.md). Every output element gets
//! `out + p₀v₀ + p₁v₁ + …` in key order, the order of the other tables.
//!
//! Softmax rows: `exp_sum`, each row's exponentials and their sum in one pass, 16 lanes wide.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]`;
//! the table entries that call them exist only where `avx512::kernels` detected the features.

use super::{Ahead, Fetch, KeysT};
use half::f16;
use std::arch::x86_64::*;

/// Sixteen f16 at `p` as f32.
///
/// # Safety
/// 16 f16 must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn load_f16(p: *const f16) -> __m512 {
    // SAFETY: the caller guarantees 32 bytes at p.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// `out[j * stride + i] = scale * k(i) · q[j]`; see [`crate::cpu::Kernels::attn_scores`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn attn_scores(
    k: KeysT<'_>,
    qt: &[f32],
    g: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
    ahead: &[Ahead],
) {
    let (n, hd) = (k.n, k.hd);
    if n == 0 || g == 0 {
        return;
    }
    assert!(k.fit(qt, g, out, stride), "scores: shapes");
    // The fetches go out a part every 8 dimensions of the first head tile of each 16 keys.
    let fetch = Fetch::new(ahead, n.div_ceil(16) * hd.div_ceil(8));
    for i0 in (0..n).step_by(16) {
        let mask = (1u32 << (n - i0).min(16)).wrapping_sub(1) as u16;
        for j0 in (0..g).step_by(8) {
            let f = (j0 == 0).then_some((&fetch, (i0 / 16) * hd.div_ceil(8)));
            let at = (i0, mask, j0);
            match g - j0 {
                // SAFETY: the caller guarantees the features; shapes asserted above.
                1 => unsafe { scores_tile::<1>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                2 => unsafe { scores_tile::<2>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                3 => unsafe { scores_tile::<3>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                4 => unsafe { scores_tile::<4>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                5 => unsafe { scores_tile::<5>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                6 => unsafe { scores_tile::<6>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                7 => unsafe { scores_tile::<7>(k, qt, (g, scale), at, out, stride, f) },
                // SAFETY: as above.
                _ => unsafe { scores_tile::<8>(k, qt, (g, scale), at, out, stride, f) },
            }
        }
    }
}

/// Keys `i0..i0 + 16` (those in `mask`) by heads `j0..j0 + J` of [`attn_scores`]: each
/// dimension's 16 keys converted once and multiplied by every head's query element (`J`
/// consecutive floats of the transposed queries), J accumulators of 16 keys each; with
/// `fetch`, its step `from + d / 8` at every eighth dimension `d`.
///
/// # Safety
/// As [`attn_scores`], with its shapes asserted, `i0 < k.n`, `mask` the keys `i0..k.n` of the
/// 16 and `j0 + J <= g`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn scores_tile<const J: usize>(
    k: KeysT<'_>,
    qt: &[f32],
    (g, scale): (usize, f32),
    (i0, mask, j0): (usize, u16, usize),
    out: &mut [f32],
    stride: usize,
    fetch: Option<(&Fetch<'_>, usize)>,
) {
    let (hd, bs) = (k.hd, k.bs);
    let mut acc = [_mm512_setzero_ps(); J];
    for d8 in (0..hd).step_by(8) {
        if let Some((f, from)) = fetch {
            f.step(from + d8 / 8);
        }
        for d in d8..(d8 + 8).min(hd) {
            // SAFETY: keys i0.. of dimension d start at d * bs + i0 < (hd - 1) * bs + n <=
            // k.k.len() (fit()); the mask loads only the keys below n, inside the slice.
            let kv = _mm512_cvtph_ps(unsafe { _mm256_maskz_loadu_epi16(mask, k.k.as_ptr().add(d * bs + i0).cast()) });
            // SAFETY: d * g + j0 + J <= hd * g <= qt.len() (asserted by the caller).
            let qd = unsafe { qt.as_ptr().add(d * g + j0) };
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: as above, j < J.
                *a = _mm512_fmadd_ps(kv, _mm512_set1_ps(unsafe { *qd.add(j) }), *a);
            }
        }
    }
    let vscale = _mm512_set1_ps(scale);
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: (j0 + j) * stride + i0 + 16 lanes, of which the mask writes those below n:
        // (g - 1) * stride + n <= out.len() (asserted by the caller).
        unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add((j0 + j) * stride + i0), mask, _mm512_mul_ps(*a, vscale)) };
    }
}

/// `out[j] += Σ_i p[j * stride + i] * v[i]`; see [`crate::cpu::Kernels::attn_values`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn attn_values(v: &[f16], p: &[f32], stride: usize, hd: usize, g: usize, out: &mut [f32]) {
    if !matches!(hd, 64 | 128 | 256) {
        // SAFETY: the AVX2 kernel needs a subset of the caller's features.
        return unsafe { super::avx2_attn::attn_values(v, p, stride, hd, g, out) };
    }
    let n = v.len() / hd;
    if n == 0 || g == 0 {
        return;
    }
    assert!(p.len() >= (g - 1) * stride + n && stride >= n && out.len() >= g * hd, "values: shapes");
    for j0 in (0..g).step_by(6) {
        for c0 in (0..hd).step_by(64) {
            match g - j0 {
                // SAFETY: the caller guarantees the features; shapes asserted above.
                1 => unsafe { values_tile::<1>(v, p, (n, stride, hd), (j0, c0), out) },
                // SAFETY: as above.
                2 => unsafe { values_tile::<2>(v, p, (n, stride, hd), (j0, c0), out) },
                // SAFETY: as above.
                3 => unsafe { values_tile::<3>(v, p, (n, stride, hd), (j0, c0), out) },
                // SAFETY: as above.
                4 => unsafe { values_tile::<4>(v, p, (n, stride, hd), (j0, c0), out) },
                // SAFETY: as above.
                5 => unsafe { values_tile::<5>(v, p, (n, stride, hd), (j0, c0), out) },
                // SAFETY: as above.
                _ => unsafe { values_tile::<6>(v, p, (n, stride, hd), (j0, c0), out) },
            }
        }
    }
}

/// Heads `j0..j0 + J` by dimensions `c0..c0 + 64` of [`attn_values`], in 4 J registers.
///
/// # Safety
/// As [`attn_values`], with `n * hd <= v.len()`, `(g - 1) * stride + n <= p.len()`, `g * hd
/// <= out.len()`, `j0 + J <= g` and `c0 + 64 <= hd`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn values_tile<const J: usize>(
    v: &[f16],
    p: &[f32],
    (n, stride, hd): (usize, usize, usize),
    (j0, c0): (usize, usize),
    out: &mut [f32],
) {
    let o = out.as_mut_ptr();
    let mut acc: [[__m512; 4]; J] = std::array::from_fn(|j| {
        std::array::from_fn(|c| {
            // SAFETY: (j0 + j) * hd + c0 + 16 c + 16 <= g * hd <= out.len() (the caller's bounds).
            unsafe { _mm512_loadu_ps(o.add((j0 + j) * hd + c0 + 16 * c)) }
        })
    });
    for i in 0..n {
        // SAFETY: row i's dimensions c0..c0 + 64 lie inside `v` (n * hd <= v.len()).
        let vv: [__m512; 4] = std::array::from_fn(|c| unsafe { load_f16(v.as_ptr().add(i * hd + c0 + 16 * c)) });
        for (j, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(p[(j0 + j) * stride + i]);
            for (a, x) in a.iter_mut().zip(&vv) {
                *a = _mm512_fmadd_ps(w, *x, *a);
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        for (c, x) in a.iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe { _mm512_storeu_ps(o.add((j0 + j) * hd + c0 + 16 * c), *x) };
        }
    }
}

/// `x[i] = exp(x[i] - shift)`, returning their sum: 16 lanes at a time through [`exp16`], the
/// sums in 16 running lanes added in order at the end, the tail through the AVX2 kernel.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    let (vs, mut acc) = (_mm512_set1_ps(shift), _mm512_setzero_ps());
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        // SAFETY: `c` is 16 f32s.
        unsafe {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), vs));
            _mm512_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm512_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; 16];
    // SAFETY: 16 f32 into the local array.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.iter().sum::<f32>() + super::scalar::exp_sum(chunks.into_remainder(), shift)
}

/// `exp` of 16 lanes, the AVX2 table's `exp8` at twice the width: `2^n * e^r` with `n =
/// round(x / ln 2)`, `|r| <= ln 2 / 2`, and the same degree-6 polynomial for `e^r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3)), _mm512_set1_ps(88.3));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.0e-1] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
    _mm512_mul_ps(y, _mm512_castsi512_ps(scale))
}
