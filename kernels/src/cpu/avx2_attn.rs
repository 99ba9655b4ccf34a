//! AVX2 attention kernels over f16 K/V (the `attn_scores` and `attn_values` entries of the AVX2
//! table, and the AVX-512 table's values for head sizes its own kernel skips): the design of
//! `avx512_attn.rs` at eight lanes.
//!
//! Scores, any head size: over the transposed keys ([`KeysT`]), one dimension of 8 keys is
//! one vector, converted once and multiplied by that element of each query head of a tile of
//! up to six, each head's accumulator holding its 8 keys' scores (no horizontal sums); the
//! fetches of `ahead` spread over the products.
//!
//! Values, head sizes that are multiples of 8: the outputs stay in registers while the values stream past: a tile of up to 3 query
//! heads by 32 dimensions (12 accumulators; 8 dimensions at a head size's end), each value row
//! converted once per tile. Every output element gets `out + p₀v₀ + p₁v₁ + …` in key order, the
//! order of the other tables.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c")]`; the table entries that call
//! them exist only where the features were detected.

use super::{Ahead, Fetch, KeysT};
use half::f16;
use std::arch::x86_64::*;

/// Eight f16 at `p` as f32.
///
/// # Safety
/// 8 f16 must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16(p: *const f16) -> __m256 {
    // SAFETY: the caller guarantees 16 bytes at p.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// `out[j * stride + i] = scale * k(i) · q[j]`; see [`crate::cpu::Kernels::attn_scores`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
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
    let fetch = Fetch::new(ahead, n.div_ceil(8) * hd.div_ceil(8));
    for i0 in (0..n).step_by(8) {
        for j0 in (0..g).step_by(6) {
            let f = (j0 == 0).then_some((&fetch, (i0 / 8) * hd.div_ceil(8)));
            match g - j0 {
                // SAFETY: the caller guarantees the features; shapes asserted above.
                1 => unsafe { scores_tile::<1>(k, qt, (g, scale), (i0, j0), out, stride, f) },
                // SAFETY: as above.
                2 => unsafe { scores_tile::<2>(k, qt, (g, scale), (i0, j0), out, stride, f) },
                // SAFETY: as above.
                3 => unsafe { scores_tile::<3>(k, qt, (g, scale), (i0, j0), out, stride, f) },
                // SAFETY: as above.
                4 => unsafe { scores_tile::<4>(k, qt, (g, scale), (i0, j0), out, stride, f) },
                // SAFETY: as above.
                5 => unsafe { scores_tile::<5>(k, qt, (g, scale), (i0, j0), out, stride, f) },
                // SAFETY: as above.
                _ => unsafe { scores_tile::<6>(k, qt, (g, scale), (i0, j0), out, stride, f) },
            }
        }
    }
}

/// Keys `i0..i0 + 8` (fewer at the end) by heads `j0..j0 + J` of [`attn_scores`], each
/// dimension's keys converted once for the J heads; with `fetch`, its step `from + d / 8` at
/// every eighth dimension `d`.
///
/// # Safety
/// As [`attn_scores`], with its shapes asserted, `i0 < k.n` and `j0 + J <= g`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_tile<const J: usize>(
    k: KeysT<'_>,
    qt: &[f32],
    (g, scale): (usize, f32),
    (i0, j0): (usize, usize),
    out: &mut [f32],
    stride: usize,
    fetch: Option<(&Fetch<'_>, usize)>,
) {
    let (hd, bs, m) = (k.hd, k.bs, (k.n - i0).min(8));
    let mut acc = [_mm256_setzero_ps(); J];
    let mut part = [f16::ZERO; 8];
    for d8 in (0..hd).step_by(8) {
        if let Some((f, from)) = fetch {
            f.step(from + d8 / 8);
        }
        for d in d8..(d8 + 8).min(hd) {
            let at = d * bs + i0;
            let kv = if m == 8 {
                // SAFETY: 8 keys of dimension d at d * bs + i0, inside the slice ((hd - 1) * bs
                // + n <= k.k.len(), i0 + 8 <= n).
                unsafe { load_f16(k.k.as_ptr().add(at)) }
            } else {
                // The last keys of a partial run: through a zeroed copy.
                part[..m].copy_from_slice(&k.k[at..at + m]);
                // SAFETY: 8 f16 in the local array.
                unsafe { load_f16(part.as_ptr()) }
            };
            // SAFETY: d * g + j0 + J <= hd * g <= qt.len() (asserted by the caller).
            let qd = unsafe { qt.as_ptr().add(d * g + j0) };
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: as above, j < J.
                *a = _mm256_fmadd_ps(kv, _mm256_set1_ps(unsafe { *qd.add(j) }), *a);
            }
        }
    }
    let vscale = _mm256_set1_ps(scale);
    for (j, a) in acc.iter().enumerate() {
        let mut s = [0f32; 8];
        // SAFETY: 8 f32 into the local array.
        unsafe { _mm256_storeu_ps(s.as_mut_ptr(), _mm256_mul_ps(*a, vscale)) };
        out[(j0 + j) * stride + i0..][..m].copy_from_slice(&s[..m]);
    }
}

/// `out[j] += Σ_i p[j * stride + i] * v[i]`; see [`crate::cpu::Kernels::attn_values`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attn_values(v: &[f16], p: &[f32], stride: usize, hd: usize, g: usize, out: &mut [f32]) {
    if !hd.is_multiple_of(8) {
        return super::scalar::attn_values(v, p, stride, hd, g, out);
    }
    let n = v.len() / hd;
    if n == 0 || g == 0 {
        return;
    }
    assert!(p.len() >= (g - 1) * stride + n && stride >= n && out.len() >= g * hd, "values: shapes");
    for j0 in (0..g).step_by(3) {
        let mut c0 = 0;
        while c0 < hd {
            let wide = c0 + 32 <= hd;
            let at = (j0, c0);
            match (g - j0, wide) {
                // SAFETY: the caller guarantees the features; shapes asserted above.
                (1, true) => unsafe { values_tile::<1, 4>(v, p, (n, stride, hd), at, out) },
                // SAFETY: as above.
                (2, true) => unsafe { values_tile::<2, 4>(v, p, (n, stride, hd), at, out) },
                // SAFETY: as above.
                (_, true) => unsafe { values_tile::<3, 4>(v, p, (n, stride, hd), at, out) },
                // SAFETY: as above.
                (1, false) => unsafe { values_tile::<1, 1>(v, p, (n, stride, hd), at, out) },
                // SAFETY: as above.
                (2, false) => unsafe { values_tile::<2, 1>(v, p, (n, stride, hd), at, out) },
                // SAFETY: as above.
                (_, false) => unsafe { values_tile::<3, 1>(v, p, (n, stride, hd), at, out) },
            }
            c0 += if wide { 32 } else { 8 };
        }
    }
}

/// Heads `j0..j0 + J` by dimensions `c0..c0 + 8 R` of [`attn_values`], in `J R` registers.
///
/// # Safety
/// As [`attn_values`], with `n * hd <= v.len()`, `(g - 1) * stride + n <= p.len()`, `g * hd
/// <= out.len()`, `j0 + J <= g` and `c0 + 8 R <= hd`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_tile<const J: usize, const R: usize>(
    v: &[f16],
    p: &[f32],
    (n, stride, hd): (usize, usize, usize),
    (j0, c0): (usize, usize),
    out: &mut [f32],
) {
    let o = out.as_mut_ptr();
    let mut acc: [[__m256; R]; J] = std::array::from_fn(|j| {
        std::array::from_fn(|c| {
            // SAFETY: (j0 + j) * hd + c0 + 8 c + 8 <= g * hd <= out.len() (the caller's bounds).
            unsafe { _mm256_loadu_ps(o.add((j0 + j) * hd + c0 + 8 * c)) }
        })
    });
    for i in 0..n {
        // The J weights first, then each 8 dimensions of the row converted and used at once:
        // J R accumulators, J weights and one row vector fit the 16 registers.
        let w: [__m256; J] = std::array::from_fn(|j| _mm256_set1_ps(p[(j0 + j) * stride + i]));
        for c in 0..R {
            // SAFETY: row i's dimensions c0 + 8 c .. + 8 lie inside `v` (n * hd <= v.len()).
            let x = unsafe { load_f16(v.as_ptr().add(i * hd + c0 + 8 * c)) };
            for (a, w) in acc.iter_mut().zip(&w) {
                a[c] = _mm256_fmadd_ps(*w, x, a[c]);
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        for (c, x) in a.iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe { _mm256_storeu_ps(o.add((j0 + j) * hd + c0 + 8 * c), *x) };
        }
    }
}
