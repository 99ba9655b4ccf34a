//! AVX2 attention kernels over f16 K/V (the `attn_scores` and `attn_values` entries of the AVX2
//! table, and of the AVX-512 table for head sizes its own kernels skip): the design of
//! `avx512_attn.rs` at eight lanes, for any head size that is a multiple of 8.
//!
//! Scores: the query heads go in tiles of up to four; each key is converted from f16 eight
//! dimensions at a time and multiplied with every head of the tile, one 8-lane partial-sum
//! vector per (key, head) pair. Pairs are reduced 8 at a time by one transpose-and-add tree
//! ([`sum8`]) instead of a horizontal sum each.
//!
//! Values: the outputs stay in registers while the values stream past: a tile of up to 3 query
//! heads by 32 dimensions (12 accumulators; 8 dimensions at a head size's end), each value row
//! converted once per tile. Every output element gets `out + p₀v₀ + p₁v₁ + …` in key order, the
//! order of the other tables.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c")]`; the table entries that call
//! them exist only where the features were detected.

use half::f16;
use std::arch::x86_64::*;

/// `out[i] = Σ lanes of v[i]` for 8 vectors at once: pairs of vectors are interleaved and added
/// until each 128-bit lane holds four vectors' sums, then the two lanes are added. Every output
/// gets the same tree: `(e0 + e2) + (e1 + e3)` within each 128-bit lane, then `l0 + l1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum8(v: &[__m256; 8]) -> __m256 {
    let u: [__m256; 4] = std::array::from_fn(|i| {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
    });
    let t: [__m256; 2] = std::array::from_fn(|i| {
        let (x, y) = (_mm256_castps_pd(u[2 * i]), _mm256_castps_pd(u[2 * i + 1]));
        _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)))
    });
    // t[i], 128-bit lane k: vectors 4i..4i+4 summed over lane k.
    _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(t[0], t[1]), _mm256_permute2f128_ps::<0x31>(t[0], t[1]))
}

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

/// `out[i * g + j] = scale * k[i] · q[j]`; see [`crate::cpu::Kernels::attn_scores`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attn_scores(k: &[f16], q: &[f32], hd: usize, g: usize, scale: f32, out: &mut [f32]) {
    if !hd.is_multiple_of(8) {
        return super::scalar::attn_scores(k, q, hd, g, scale, out);
    }
    let n = k.len() / hd;
    assert!(q.len() >= g * hd && out.len() >= n * g, "scores: shapes");
    for j0 in (0..g).step_by(4) {
        match g - j0 {
            // SAFETY: the caller guarantees the features; shapes asserted above.
            1 => unsafe { scores_tile::<1>(k, q, (n, hd, g), j0, scale, out) },
            // SAFETY: as above.
            2 => unsafe { scores_tile::<2>(k, q, (n, hd, g), j0, scale, out) },
            // SAFETY: as above.
            3 => unsafe { scores_tile::<3>(k, q, (n, hd, g), j0, scale, out) },
            // SAFETY: as above.
            _ => unsafe { scores_tile::<4>(k, q, (n, hd, g), j0, scale, out) },
        }
    }
}

/// Heads `j0..j0 + J` of [`attn_scores`].
///
/// # Safety
/// As [`attn_scores`], with `n * hd <= k.len()`, `g * hd <= q.len()`, `n * g <= out.len()`,
/// `8 | hd` and `j0 + J <= g`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_tile<const J: usize>(
    k: &[f16],
    q: &[f32],
    (n, hd, g): (usize, usize, usize),
    j0: usize,
    scale: f32,
    out: &mut [f32],
) {
    // Up to 8 (key, head) partial sums waiting for the tree, and where each score goes.
    let (mut pend, mut dst, mut filled) = ([_mm256_setzero_ps(); 8], [0usize; 8], 0);
    let vscale = _mm256_set1_ps(scale);
    let mut flush = |pend: &mut [__m256; 8], dst: &[usize; 8], filled: usize| {
        pend[filled..].fill(_mm256_setzero_ps());
        let mut s = [0f32; 8];
        // SAFETY: 8 f32 into the local array.
        unsafe { _mm256_storeu_ps(s.as_mut_ptr(), _mm256_mul_ps(sum8(pend), vscale)) };
        for (&d, &v) in dst[..filled].iter().zip(&s) {
            out[d] = v;
        }
    };
    for i in 0..n {
        let mut acc = [_mm256_setzero_ps(); J];
        for c in (0..hd).step_by(8) {
            // SAFETY: dimensions c..c + 8 of key i lie inside `k` (n * hd <= k.len()).
            let kv = unsafe { load_f16(k.as_ptr().add(i * hd + c)) };
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: 8 f32 at (j0 + j) * hd + c, inside `q` (g * hd <= q.len()).
                *a = _mm256_fmadd_ps(kv, unsafe { _mm256_loadu_ps(q.as_ptr().add((j0 + j) * hd + c)) }, *a);
            }
        }
        for (j, a) in acc.into_iter().enumerate() {
            (pend[filled], dst[filled]) = (a, i * g + j0 + j);
            filled += 1;
            if filled == 8 {
                flush(&mut pend, &dst, 8);
                filled = 0;
            }
        }
    }
    if filled > 0 {
        flush(&mut pend, &dst, filled);
    }
}

/// `out[j] += Σ_i p[i * g + j] * v[i]`; see [`crate::cpu::Kernels::attn_values`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attn_values(v: &[f16], p: &[f32], hd: usize, g: usize, out: &mut [f32]) {
    if !hd.is_multiple_of(8) {
        return super::scalar::attn_values(v, p, hd, g, out);
    }
    let n = v.len() / hd;
    assert!(p.len() >= n * g && out.len() >= g * hd, "values: shapes");
    for j0 in (0..g).step_by(3) {
        let mut c0 = 0;
        while c0 < hd {
            let wide = c0 + 32 <= hd;
            let at = (j0, c0);
            match (g - j0, wide) {
                // SAFETY: the caller guarantees the features; shapes asserted above.
                (1, true) => unsafe { values_tile::<1, 4>(v, p, (n, hd, g), at, out) },
                // SAFETY: as above.
                (2, true) => unsafe { values_tile::<2, 4>(v, p, (n, hd, g), at, out) },
                // SAFETY: as above.
                (_, true) => unsafe { values_tile::<3, 4>(v, p, (n, hd, g), at, out) },
                // SAFETY: as above.
                (1, false) => unsafe { values_tile::<1, 1>(v, p, (n, hd, g), at, out) },
                // SAFETY: as above.
                (2, false) => unsafe { values_tile::<2, 1>(v, p, (n, hd, g), at, out) },
                // SAFETY: as above.
                (_, false) => unsafe { values_tile::<3, 1>(v, p, (n, hd, g), at, out) },
            }
            c0 += if wide { 32 } else { 8 };
        }
    }
}

/// Heads `j0..j0 + J` by dimensions `c0..c0 + 8 R` of [`attn_values`], in `J R` registers.
///
/// # Safety
/// As [`attn_values`], with `n * hd <= v.len()`, `n * g <= p.len()`, `g * hd <= out.len()`,
/// `j0 + J <= g` and `c0 + 8 R <= hd`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_tile<const J: usize, const R: usize>(
    v: &[f16],
    p: &[f32],
    (n, hd, g): (usize, usize, usize),
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
        let w: [__m256; J] = std::array::from_fn(|j| _mm256_set1_ps(p[i * g + j0 + j]));
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
