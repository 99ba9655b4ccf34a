//! AVX-512 BF16 kernels for products of many tokens ([`crate::gemm`]): the register tile
//! (`vdpbf16ps`, 32 multiply-adds of bf16 pairs into 16 f32 lanes per instruction, twice the
//! f32 FMA's), rows of f32 rounded to bf16 pairs, and a softmax row's exponentials rounded the
//! same way.
//!
//! The tile keeps `R <= 12` tokens by 32 outputs in 24 accumulators: each step loads one pair
//! of the 32 outputs' weights (two vectors) and broadcasts each token's pair of inputs, so a
//! step is `2R` instructions on three loads. Every output gets `c + Σ_p (a₂ₚ·b₂ₚ + a₂ₚ₊₁·b₂ₚ₊₁)`
//! in pair order whatever the tile's token count, so a token's result does not depend on
//! where it sits in the batch.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]`;
//! the table entries that call them exist only where `avx512::kernels` detected the features.

use super::avx512_attn::exp16;
use super::Tile;
use std::arch::x86_64::*;

/// The tile product of [`crate::cpu::Bf16Kernels::tile`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL and BF16 (and AVX2, FMA, F16C).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn tile(t: Tile<'_>, c: &mut [f32], ldc: usize) {
    assert!(t.fits(c.len(), ldc) && t.words == 1, "tile operands out of bounds");
    // SAFETY: `fits` checked every read of `t.a`, `t.b` and write of `c` the tile makes; the
    // features are the caller's guarantee.
    unsafe {
        match t.rows {
            1 => tile_n::<1>(&t, c.as_mut_ptr(), ldc),
            2 => tile_n::<2>(&t, c.as_mut_ptr(), ldc),
            3 => tile_n::<3>(&t, c.as_mut_ptr(), ldc),
            4 => tile_n::<4>(&t, c.as_mut_ptr(), ldc),
            5 => tile_n::<5>(&t, c.as_mut_ptr(), ldc),
            6 => tile_n::<6>(&t, c.as_mut_ptr(), ldc),
            7 => tile_n::<7>(&t, c.as_mut_ptr(), ldc),
            8 => tile_n::<8>(&t, c.as_mut_ptr(), ldc),
            9 => tile_n::<9>(&t, c.as_mut_ptr(), ldc),
            10 => tile_n::<10>(&t, c.as_mut_ptr(), ldc),
            11 => tile_n::<11>(&t, c.as_mut_ptr(), ldc),
            _ => tile_n::<12>(&t, c.as_mut_ptr(), ldc),
        }
    }
}

/// [`tile`] for `R` tokens.
///
/// # Safety
/// As [`tile`], with `t.fits(.., ldc)` for the `c` behind the pointer and `t.rows == R`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn tile_n<const R: usize>(t: &Tile<'_>, c: *mut f32, ldc: usize) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let (a, b) = (t.a.as_ptr(), t.b.as_ptr());
    for p in 0..t.kc {
        // SAFETY: pair p of the 32 outputs lies in `t.b` (kc * 32 pairs) and pair p of token i
        // in `t.a` ((rows - 1) * lda + kc pairs), as `fits` checked; bf16 pairs and the
        // 32-bit lanes they fill have one layout.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * 32).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * 32 + 16).cast()));
            for (i, acc) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(a.add(i * t.lda + p).read() as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
            }
        }
    }
    let lanes = |n: usize| if n >= 16 { 0xffff } else { (1u16 << n) - 1 };
    let masks = [lanes(t.lanes), lanes(t.lanes.saturating_sub(16))];
    for (i, acc) in acc.iter().enumerate() {
        for (h, (&v, &m)) in acc.iter().zip(&masks).enumerate() {
            // SAFETY: output i's lanes `h * 16 + j` for the mask's j lie below `t.lanes`, within
            // `(rows - 1) * ldc + lanes` of `c` (`fits`); masked lanes are neither read nor
            // written.
            unsafe {
                let at = c.add(i * ldc + h * 16);
                let v = if t.add { _mm512_add_ps(_mm512_maskz_loadu_ps(m, at), v) } else { v };
                _mm512_mask_storeu_ps(at, m, v);
            }
        }
    }
}

/// `out[i] = bf16(x[2i]) | bf16(x[2i + 1]) << 16`, rounded to nearest even; an odd last
/// element's pair has a zero high half.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn to_bf16(x: &[f32], out: &mut [u32]) {
    assert_eq!(out.len(), x.len().div_ceil(2), "one pair per two inputs");
    let mut i = 0;
    while i + 32 <= x.len() {
        // SAFETY: 32 inputs from i and their 16 pairs from i / 2 are in bounds.
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(i));
            let hi = _mm512_loadu_ps(x.as_ptr().add(i + 16));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().add(i / 2).cast(), v);
        }
        i += 32;
    }
    super::scalar::to_bf16(&x[i..], &mut out[i / 2..]);
}

/// The exponentials `exp(scale * (s - max))` of a row of scores as bf16 pairs, returning
/// their sum (of the f32 values); see [`crate::cpu::Bf16Kernels::softmax`].
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn softmax(s: &[f32], scale: f32, out: &mut [u32]) -> f32 {
    assert_eq!(out.len(), s.len().div_ceil(2), "one pair per two scores");
    let n = s.len() / 32 * 32;
    let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in s[..n].chunks_exact(16) {
        // SAFETY: 16 scores.
        vmax = _mm512_max_ps(vmax, unsafe { _mm512_loadu_ps(c.as_ptr()) });
    }
    let max = s[n..].iter().fold(_mm512_reduce_max_ps(vmax), |m, &v| m.max(v));
    let (vm, vs) = (_mm512_set1_ps(max), _mm512_set1_ps(scale));
    let mut acc = _mm512_setzero_ps();
    for (i, c) in s[..n].chunks_exact(32).enumerate() {
        // SAFETY: 32 scores in, 16 pairs out at i * 16 (< out.len()).
        unsafe {
            let lo = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), vm), vs));
            let hi = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr().add(16)), vm), vs));
            acc = _mm512_add_ps(acc, _mm512_add_ps(lo, hi));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().add(i * 16).cast(), v);
        }
    }
    _mm512_reduce_add_ps(acc) + super::scalar::softmax_tail(&s[n..], max, scale, &mut out[n / 2..], 1)
}
