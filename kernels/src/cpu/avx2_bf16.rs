//! AVX2 + FMA kernels for products of many tokens ([`crate::gemm`]) on processors without
//! AVX-512 BF16: the same bf16 values as the AVX-512 table, multiplied in f32 with FMA, so the
//! packing, the rounding and the results' accuracy are those of every other bf16 table.
//!
//! The weights stay bf16 pairs in their panels and are widened to f32 in registers (a shift
//! for a pair's low half, a mask for its high: bf16 is the top half of an f32); the tokens'
//! rows hold each value rounded to bf16 as an f32 (two words a pair,
//! [`crate::cpu::Bf16Kernels::words`]), written once for every matrix they meet, so the
//! inner step broadcasts a token's value straight from memory. The tile runs micro-tiles of
//! `R <= 6` tokens by 16 outputs in 12 accumulators: a step of one pair widens the 16
//! outputs' weights (two vectors, twice) and runs `4R` FMAs. Every output gets
//! `c + Σ_p (a₂ₚ·b₂ₚ + a₂ₚ₊₁·b₂ₚ₊₁)` as two fused multiply-adds per pair, in pair order,
//! whatever the tile's token count: a token's result does not depend on where it sits in the
//! batch.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c")]`; the table entries that
//! call them exist only where `avx2::kernels` detected the features.

use super::avx2::exp8;
use super::Tile;
use std::arch::x86_64::*;

/// Tokens per micro-tile: 6 tokens by 2 vectors of outputs fill 12 of the 16 registers.
const MR: usize = 6;

/// The tile product of [`crate::cpu::Bf16Kernels::tile`], on tokens of two words a pair.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(t: Tile<'_>, c: &mut [f32], ldc: usize) {
    assert!(t.fits(c.len(), ldc) && t.words == 2, "tile operands out of bounds");
    for i0 in (0..t.rows).step_by(MR) {
        for h in (0..t.lanes).step_by(16) {
            let m = Micro {
                a: &t.a[i0 * t.lda..],
                lda: t.lda,
                b: &t.b[h..],
                kc: t.kc,
                lanes: 16.min(t.lanes - h),
                add: t.add,
            };
            let c = &mut c[i0 * ldc + h..];
            // SAFETY: the features are the caller's guarantee; `micro` checks its operands.
            unsafe {
                match MR.min(t.rows - i0) {
                    1 => micro::<1>(&m, c, ldc),
                    2 => micro::<2>(&m, c, ldc),
                    3 => micro::<3>(&m, c, ldc),
                    4 => micro::<4>(&m, c, ldc),
                    5 => micro::<5>(&m, c, ldc),
                    _ => micro::<6>(&m, c, ldc),
                }
            }
        }
    }
}

/// One micro-tile: tokens' rows (`lda` words apart, two words a pair) against 16 outputs of a
/// panel (`b` from the first of them, [`super::PANEL`] apart per pair), `lanes` of them stored.
struct Micro<'a> {
    a: &'a [u32],
    lda: usize,
    b: &'a [u32],
    kc: usize,
    lanes: usize,
    add: bool,
}

/// [`Micro`] for `R` tokens, into `c` (token i's outputs from `i * ldc`).
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro<const R: usize>(m: &Micro<'_>, c: &mut [f32], ldc: usize) {
    let b_fits = m.kc == 0 || m.b.len() >= (m.kc - 1) * super::PANEL + 16;
    let a_fits = m.lda >= 2 * m.kc && m.a.len() >= (R - 1) * m.lda + 2 * m.kc;
    assert!(a_fits && b_fits && c.len() >= (R - 1) * ldc + m.lanes, "micro-tile operands");
    let mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let (b, a) = (m.b.as_ptr(), m.a.as_ptr().cast::<f32>());
    for p in 0..m.kc {
        // SAFETY: the 16 words of pair p lie in `m.b`, and pair p of token i (words
        // `i * lda + 2p` and the next) in `m.a` (the assertion); a token's words are f32 bits.
        unsafe {
            let w = b.add(p * super::PANEL).cast::<__m256i>();
            let l0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_loadu_si256(w)));
            let l1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_loadu_si256(w.add(1))));
            for (i, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(i * m.lda + 2 * p));
                acc[0] = _mm256_fmadd_ps(x, l0, acc[0]);
                acc[1] = _mm256_fmadd_ps(x, l1, acc[1]);
            }
            // Loaded again rather than kept: 12 accumulators, two weights and a broadcast
            // leave no register to hold them (kept, the compiler spills them).
            let w = std::hint::black_box(w);
            let h0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w), mask));
            let h1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w.add(1)), mask));
            for (i, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(i * m.lda + 2 * p + 1));
                acc[0] = _mm256_fmadd_ps(x, h0, acc[0]);
                acc[1] = _mm256_fmadd_ps(x, h1, acc[1]);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        let out = &mut c[i * ldc..][..m.lanes];
        if m.lanes == 16 {
            for (v, o) in acc.iter().zip(out.chunks_exact_mut(8)) {
                // SAFETY: `o` is 8 floats.
                unsafe {
                    let v = if m.add { _mm256_add_ps(_mm256_loadu_ps(o.as_ptr()), *v) } else { *v };
                    _mm256_storeu_ps(o.as_mut_ptr(), v);
                }
            }
        } else {
            let mut lanes = [0f32; 16];
            // SAFETY: 16 floats into the local array.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
            }
            for (o, v) in out.iter_mut().zip(lanes) {
                *o = if m.add { *o + v } else { v };
            }
        }
    }
}

/// 8 floats rounded to bf16 (nearest even; a NaN stays a quiet NaN, as `half` rounds), each in
/// the low 16 bits of its lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round8(x: __m256) -> __m256i {
    let v = _mm256_castps_si256(x);
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(v), _mm256_set1_epi32(1));
    let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(v, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(v), _mm256_set1_epi32(0x40));
    _mm256_blendv_epi8(r, quiet, nan)
}

/// 16 floats as 8 bf16 pairs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pairs16(lo: __m256, hi: __m256) -> __m256i {
    // Packing works within 128-bit halves: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] back in order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(round8(lo), round8(hi)))
}

/// `out[i] = bf16(x[2i]) | bf16(x[2i + 1]) << 16`, rounded to nearest even; an odd last
/// element's pair has a zero high half.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn to_bf16(x: &[f32], out: &mut [u32]) {
    assert_eq!(out.len(), x.len().div_ceil(2), "one pair per two inputs");
    let n = x.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        // SAFETY: 16 inputs from i and their 8 pairs from i / 2 are in bounds.
        unsafe {
            let v = pairs16(_mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(x.as_ptr().add(i + 8)));
            _mm256_storeu_si256(out.as_mut_ptr().add(i / 2).cast(), v);
        }
    }
    super::scalar::to_bf16(&x[n..], &mut out[n / 2..]);
}

/// Each value rounded to bf16 and kept as an f32 (the tokens' form, see
/// [`crate::cpu::scalar::to_bf16_words`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn to_tokens(x: &[f32], out: &mut [u32]) {
    assert_eq!(out.len(), x.len().div_ceil(2) * 2, "two words per two inputs");
    let n = x.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        // SAFETY: 8 inputs and 8 words from i are in bounds.
        unsafe {
            let v = _mm256_slli_epi32::<16>(round8(_mm256_loadu_ps(x.as_ptr().add(i))));
            _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), v);
        }
    }
    super::scalar::to_bf16_words(&x[n..], &mut out[n..]);
}

/// The exponentials `exp(scale * (s - max))` of a row of scores in the tokens' form, returning
/// their sum (of the f32 values); see [`crate::cpu::Bf16Kernels::softmax`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn softmax(s: &[f32], scale: f32, out: &mut [u32]) -> f32 {
    assert_eq!(out.len(), s.len().div_ceil(2) * 2, "two words per two scores");
    let n = s.len() / 8 * 8;
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in s[..n].chunks_exact(8) {
        // SAFETY: 8 scores.
        vmax = _mm256_max_ps(vmax, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats into the local array.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), vmax) };
    let max = lanes.iter().chain(&s[n..]).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let (vm, vs) = (_mm256_set1_ps(max * scale), _mm256_set1_ps(scale));
    // Exponentials are finite and positive: rounding to nearest is adding half a bf16 step
    // and cutting (ties away from zero, within a step of `to_bf16`'s even ties).
    let (half, mask) = (_mm256_set1_epi32(0x8000), _mm256_set1_epi32(0xffff_0000u32 as i32));
    let mut acc = _mm256_setzero_ps();
    for (i, c) in s[..n].chunks_exact(8).enumerate() {
        // SAFETY: 8 scores in, 8 words out at i * 8 (< out.len()).
        unsafe {
            let e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(c.as_ptr()), vs, vm));
            acc = _mm256_add_ps(acc, e);
            let r = _mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(e), half), mask);
            _mm256_storeu_si256(out.as_mut_ptr().add(i * 8).cast(), r);
        }
    }
    super::avx2::hsum(acc) + super::scalar::softmax_tail(&s[n..], max, scale, &mut out[n..], 2)
}
