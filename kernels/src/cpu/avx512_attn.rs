//! AVX-512 attention kernels over f16 K/V (the `attn_scores` and `attn_values` entries of the
//! AVX-512 table), for head sizes 64, 128 and 256; other head sizes keep the AVX2 kernels.
//!
//! Scores: each key is converted from f16 once into `hd / 16` registers and multiplied with
//! every query head of the group, one 16-lane partial-sum vector per (key, head) pair. Pairs
//! are reduced 16 at a time by one transpose-and-add tree ([`sum16`]) into 16 contiguous
//! scores, instead of a horizontal sum each.
//!
//! Values: the outputs stay in registers while the keys stream past: a tile of up to 4 query
//! heads by 64 dimensions (16 accumulators), each value row converted once per tile. Every
//! output element gets `out + p₀v₀ + p₁v₁ + …` in key order, the order of the other tables.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]`;
//! the table entries that call them exist only where `avx512::kernels` detected the features.

use half::f16;
use std::arch::x86_64::*;

/// `out[i] = Σ lanes of v[i]`, for 16 vectors at once: pairs of vectors are interleaved and
/// added until each 128-bit lane holds four vectors' sums. Every output gets the same tree:
/// `((e0 + e2) + (e1 + e3))` within each 128-bit lane, then `(l0 + l1) + (l2 + l3)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn sum16(v: &[__m512; 16]) -> __m512 {
    let mut u = [_mm512_setzero_ps(); 8];
    for i in 0..8 {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    let mut t = [_mm512_setzero_ps(); 4];
    for i in 0..4 {
        let (x, y) = (_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
        t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // t[i], 128-bit lane k: vectors 4i..4i+4 summed over lane k.
    let (s0, s1) = (lane_pairs(t[0], t[1]), lane_pairs(t[2], t[3]));
    lane_pairs(s0, s1)
}

/// `[x.0 + x.1, x.2 + x.3, y.0 + y.1, y.2 + y.3]` over the 128-bit lanes of `x` and `y`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn lane_pairs(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y))
}

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

/// `out[i * g + j] = scale * k[i] · q[j]`; see [`crate::cpu::Kernels::attn_scores`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn attn_scores(k: &[f16], q: &[f32], hd: usize, g: usize, scale: f32, out: &mut [f32]) {
    match hd {
        // SAFETY: the caller guarantees the features.
        64 => unsafe { scores::<4>(k, q, g, scale, out) },
        // SAFETY: as above.
        128 => unsafe { scores::<8>(k, q, g, scale, out) },
        // SAFETY: as above.
        256 => unsafe { scores::<16>(k, q, g, scale, out) },
        // SAFETY: as above (the AVX2 kernel needs a subset of these features).
        _ => unsafe { super::avx2_attn::attn_scores(k, q, hd, g, scale, out) },
    }
}

/// [`attn_scores`] for `hd = 16 V`.
///
/// # Safety
/// As [`attn_scores`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn scores<const V: usize>(k: &[f16], q: &[f32], g: usize, scale: f32, out: &mut [f32]) {
    let hd = 16 * V;
    let n = k.len() / hd;
    assert!(q.len() >= g * hd && out.len() >= n * g, "scores: shapes");
    let mut pend = [_mm512_setzero_ps(); 16];
    let mut filled = 0;
    let mut at = 0;
    let vscale = _mm512_set1_ps(scale);
    let mut flush = |pend: &mut [__m512; 16], filled: usize, at: usize| {
        pend[filled..].fill(_mm512_setzero_ps());
        let s = _mm512_mul_ps(sum16(pend), vscale);
        // SAFETY: `at + filled <= n * g <= out.len()` (asserted); the mask writes `filled` lanes.
        unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(at), (1u32 << filled).wrapping_sub(1) as u16, s) };
    };
    for i in 0..n {
        // SAFETY: key i is hd f16 at i * hd, inside `k` (n = k.len() / hd).
        let kf: [__m512; V] = std::array::from_fn(|c| unsafe { load_f16(k.as_ptr().add(i * hd + 16 * c)) });
        for j in 0..g {
            let mut acc = _mm512_setzero_ps();
            for (c, kv) in kf.iter().enumerate() {
                // SAFETY: 16 f32 at j * hd + 16 c < g * hd <= q.len() (asserted).
                acc = _mm512_fmadd_ps(*kv, unsafe { _mm512_loadu_ps(q.as_ptr().add(j * hd + 16 * c)) }, acc);
            }
            pend[filled] = acc;
            filled += 1;
            if filled == 16 {
                flush(&mut pend, 16, at);
                at += 16;
                filled = 0;
            }
        }
    }
    if filled > 0 {
        flush(&mut pend, filled, at);
    }
}

/// `out[j] += Σ_i p[i * g + j] * v[i]`; see [`crate::cpu::Kernels::attn_values`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn attn_values(v: &[f16], p: &[f32], hd: usize, g: usize, out: &mut [f32]) {
    if !matches!(hd, 64 | 128 | 256) {
        // SAFETY: the AVX2 kernel needs a subset of the caller's features.
        return unsafe { super::avx2_attn::attn_values(v, p, hd, g, out) };
    }
    let n = v.len() / hd;
    assert!(p.len() >= n * g && out.len() >= g * hd, "values: shapes");
    for j0 in (0..g).step_by(4) {
        for c0 in (0..hd).step_by(64) {
            match g - j0 {
                // SAFETY: the caller guarantees the features; shapes asserted above.
                1 => unsafe { values_tile::<1>(v, p, n, hd, g, (j0, c0), out) },
                // SAFETY: as above.
                2 => unsafe { values_tile::<2>(v, p, n, hd, g, (j0, c0), out) },
                // SAFETY: as above.
                3 => unsafe { values_tile::<3>(v, p, n, hd, g, (j0, c0), out) },
                // SAFETY: as above.
                _ => unsafe { values_tile::<4>(v, p, n, hd, g, (j0, c0), out) },
            }
        }
    }
}

/// Heads `j0..j0 + J` by dimensions `c0..c0 + 64` of [`attn_values`], in 4 J registers.
///
/// # Safety
/// As [`attn_values`], with `n * hd <= v.len()`, `n * g <= p.len()`, `g * hd <= out.len()`,
/// `j0 + J <= g` and `c0 + 64 <= hd`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn values_tile<const J: usize>(
    v: &[f16],
    p: &[f32],
    n: usize,
    hd: usize,
    g: usize,
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
            let w = _mm512_set1_ps(p[i * g + j0 + j]);
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
