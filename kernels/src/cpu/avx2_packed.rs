//! The 16-row AVX2 kernel on packed weights ([`crate::pack`]): the layout and lane arithmetic
//! of the AVX-512 kernel (`avx512_packed.rs`), eight rows to a 256-bit vector. Each 64-byte
//! vector of the layout is two halves, rows 0..8 and 8..16, and each unit is computed a half
//! at a time (the second half from the cache lines the first brought in).
//!
//! Without `vpdpbusd`, a dword's four products come from `vpmaddubsw` (unsigned quants times
//! signed activations, pairs summed to 16 bits) and `vpmaddwd` (to 32 bits). The 16-bit sums
//! of several dwords are added before widening as far as the kind's quants allow without
//! saturating ([`super::lane::run`]); the signed kinds (Q8_0, IQ4_NL, IQ4_XS) take their
//! magnitudes and move their signs onto the activations, so Q8_0's +128 bias is undone at load.
//! The integer sums are exact, and every lane does the single-row dot's float arithmetic
//! (`lane.rs`), so each result equals that dot's bit for bit.

use super::avx2_super::{act, super_block, super_block_16, Sums};
use super::lane::{has_offset, run, signed, with_kind, IQ4NL, MXFP4, Q2K, Q3K, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0};
use super::{prefetch, Acts, Ahead, GEMV_TOKENS};
use crate::pack::{unit_blocks, unit_offsets};
use crate::quant::{BlockQ8, QuantType};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Sixteen packed rows (one group, `16 * rb` bytes at `w`) against 1 to [`GEMV_TOKENS`] tokens:
/// `out[t][i]` is row `i` against token `t`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv16_packed(dt: QuantType, w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    // SAFETY: same features as this function's caller guarantees.
    with_kind!(dt, K => unsafe { packed_kind::<K>(dt, w, rb, a, out) })
}

/// `Σ u[m] · act(m)` per lane over the weight dwords `m` in `ms`: `u` the unsigned operands,
/// and for the signed kinds `signs` the signed weights whose signs go onto the activations.
/// `run` results are added in 16 bits before each widening (`lane::run`; a constant once
/// inlined).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn products(
    run: usize,
    u: &[__m256i; 8],
    signs: Option<&[__m256i; 8]>,
    blk: &BlockQ8,
    ms: std::ops::Range<usize>,
) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let (mut total, mut part, mut n) = (_mm256_setzero_si256(), _mm256_setzero_si256(), 0);
    for m in ms {
        let a = act(blk, m);
        let a = match signs {
            Some(s) => _mm256_sign_epi8(a, s[m]),
            None => a,
        };
        part = _mm256_add_epi16(part, _mm256_maddubs_epi16(u[m], a));
        n += 1;
        if n == run {
            total = _mm256_add_epi32(total, _mm256_madd_epi16(part, ones));
            (part, n) = (_mm256_setzero_si256(), 0);
        }
    }
    if n > 0 {
        total = _mm256_add_epi32(total, _mm256_madd_epi16(part, ones));
    }
    total
}

/// MXFP4's scales of 8 rows from their exponent bytes (one per lane, 0..=255): `2^(e - 128)`,
/// bit for bit as [`crate::quant::e8m0_half`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn e8m0_half8(e: __m256i) -> __m256 {
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, small))
}

/// See [`gemv16_packed`] (`q` is `KIND`'s type): a unit at a time, a pair of 32-weight blocks
/// or a super-block, the same walk as the AVX-512 kernel's.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn packed_kind<const KIND: u8>(q: QuantType, w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    // A file block is `g` blocks of 32 weights (8 for a super-block).
    let (bb, g) = (q.block_bytes(), q.block_len() / 32);
    let n = a.len();
    assert!((1..=GEMV_TOKENS).contains(&n) && out.len() == n, "1 to {GEMV_TOKENS} tokens, one output each");
    let nb = a[0].q8.len();
    assert!(
        a.iter().all(|t| t.q8.len() == nb && t.halves.len() == nb)
            && nb.is_multiple_of(g)
            && rb == nb / g * bb
            && w.len() >= 16 * rb,
        "16 packed rows of {nb} blocks"
    );
    let mut sums = [const { MaybeUninit::<Sums>::uninit() }; GEMV_TOKENS];
    let sums = super::zeroed_sums(&mut sums, n, _mm256_setzero_ps());
    // Which field holds the quants, and Q5's fifth bits (the super-block units name theirs).
    let (quants, fifth) = match KIND {
        Q4_1 | Q5_0 => (2, 1),
        Q5_1 => (3, 2),
        _ => (1, 0),
    };
    let (at2, at1) = (unit_offsets(q, 2), unit_offsets(q, 1));
    // The next group is fetched into L2 while this one is computed, a share per unit (a
    // super-block spreads its share over its groups: issued at once, the 30-odd lines of a
    // K-quant super-block's share made its products 11-13% slower than none at all on Zen 1;
    // Q8_0 spreads its 17 lines over the unit's four halves, 15-20% faster there, while the
    // other pairs' 9-12 lines go out at once, as fast either way).
    let per = if g == 1 { 2 } else { g };
    let (lines, steps) = (16 * rb / 64, nb.div_ceil(per));
    let next = w.as_ptr().wrapping_add(16 * rb);
    let mut b = 0;
    while b < nb {
        let s = b / per;
        let share = (next, s * lines / steps..(s + 1) * lines / steps);
        // SAFETY: the unit's blocks of the 16 rows lie inside `w` (asserted length; `pack`
        // module docs), and the features are this function's.
        unsafe {
            if g > 1 {
                // Super-block `sb` is block c of its unit (Q6_K and Q3_K: pairs).
                let (sb, per) = (b / g, unit_blocks(q));
                let (u0, c) = (sb / per * per, sb % per);
                let at = if per.min(nb / g - u0) == 2 { at2 } else { at1 };
                let unit = w.as_ptr().add(16 * bb * u0);
                if matches!(KIND, Q6K | Q3K | Q2K) {
                    super_block_16::<KIND>(unit, at, c, a, (b, &share), sums);
                } else {
                    super_block::<KIND>(unit, at, a, (b, &share), sums);
                }
                b += g;
                continue;
            }
            let unit = w.as_ptr().add(16 * bb * b);
            if b + 1 < nb {
                unit_of::<KIND, 2>(unit, at2, (quants, fifth), a, (b, &share), sums);
                b += 2;
            } else {
                unit_of::<KIND, 1>(unit, at1, (quants, fifth), a, (b, &share), sums);
                b += 1;
            }
        }
    }
    for (out, s) in out.iter_mut().zip(sums.iter()) {
        for (h, [acc, off]) in s.iter().enumerate() {
            let p = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let o = _mm256_add_ps(_mm256_add_ps(off[0], off[1]), _mm256_add_ps(off[2], off[3]));
            // SAFETY: 8 f32s at lanes 8 h .. 8 h + 8 of the 16.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * h), _mm256_add_ps(p, o)) };
        }
    }
}

/// One unit of [`packed_kind`]: blocks `b .. b + N` of the 16 rows (a pair, or a lone last
/// block), starting at `unit`, against every token, into the tokens' accumulators, fetching
/// the unit's share `ahead` of the next group.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the unit's `N` blocks of the 16 rows must lie
/// at `unit` (`at`: where each field of each block starts in it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unit_of<const KIND: u8, const N: usize>(
    unit: *const u8,
    at: &[[usize; 2]; 4],
    (quants, fifth): (usize, usize),
    a: &[Acts<'_>],
    (b, ahead): (usize, &Ahead),
    sums: &mut [Sums],
) {
    let nib = _mm256_set1_epi8(0x0f);
    for c in 0..N {
        // h, the half of the 16 rows, picks the loads and every token's sums alike.
        #[allow(clippy::needless_range_loop)]
        for h in 0..2 {
            let parts = if KIND == Q8_0 { 2 * N } else { 1 };
            if 2 * c + h < parts {
                prefetch(ahead, 2 * c + h, parts);
            }
            // Field k of block b + c, half h of the 16 rows (`pack` module docs); every offset
            // lies inside the group (asserted length) by the layout's construction.
            let field = |k: usize| unit.wrapping_add(at[k][c]);
            let f16s = |k: usize| {
                // SAFETY: 8 f16s of the 16 at field k.
                _mm256_cvtph_ps(unsafe { _mm_loadu_si128(field(k).add(16 * h).cast()) })
            };
            let vector = |k: usize, m: usize| {
                // SAFETY: dword m of field k of the half's 8 rows, inside the group as above.
                unsafe { _mm256_loadu_si256(field(k).add(64 * m + 32 * h).cast()) }
            };
            // The weights' scale and offset factor (as the single-row dot's `scales`), and
            // the quants: w[4 hn + m] holds weights 16 hn + 4 m .. + 4 of every row.
            let d = if KIND == MXFP4 {
                // SAFETY: the half's 8 exponent bytes of the 16 at field 0.
                e8m0_half8(_mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(field(0).add(8 * h).cast()) }))
            } else {
                f16s(0)
            };
            let off = match KIND {
                Q4_1 | Q5_1 => f16s(1),
                Q5_0 => _mm256_mul_ps(_mm256_set1_ps(-16.0), d),
                Q4_0 => _mm256_mul_ps(_mm256_set1_ps(-8.0), d),
                _ => _mm256_setzero_ps(),
            };
            let mut w = [_mm256_setzero_si256(); 8];
            // Indexed loops: the iterator forms measured slower in these kernels.
            #[allow(clippy::needless_range_loop)]
            for m in 0..4 {
                if KIND == Q8_0 {
                    // The packed quants are biased by +128: back to signed bytes.
                    w[m] = _mm256_xor_si256(vector(quants, m), _mm256_set1_epi8(-128));
                    w[4 + m] = _mm256_xor_si256(vector(quants, 4 + m), _mm256_set1_epi8(-128));
                    continue;
                }
                let v = vector(quants, m);
                let mut lh = [_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib)];
                if matches!(KIND, Q5_0 | Q5_1) {
                    // The fifth bits of these weights sit at bits 8 k + 2 m + hn (`pack`).
                    let qh = vector(fifth, 0);
                    for (hn, x) in lh.iter_mut().enumerate() {
                        let at = _mm256_srl_epi32(qh, _mm_cvtsi32_si128((2 * m + hn) as i32));
                        *x = _mm256_or_si256(*x, _mm256_slli_epi32::<4>(_mm256_and_si256(at, _mm256_set1_epi8(1))));
                    }
                }
                if matches!(KIND, IQ4NL | MXFP4) {
                    let values = if KIND == MXFP4 { &crate::quant::MXFP4_VALUES } else { &crate::quant::IQ4_VALUES };
                    // SAFETY: the code books are 16 bytes.
                    let book = unsafe { _mm_loadu_si128(values.as_ptr().cast()) };
                    lh = lh.map(|x| _mm256_shuffle_epi8(_mm256_set_m128i(book, book), x));
                }
                w[m] = lh[0];
                w[4 + m] = lh[1];
            }
            let signs = w;
            if signed(KIND) {
                w = w.map(|x| _mm256_sign_epi8(x, x));
            }
            for (t, at) in a.iter().enumerate() {
                let blk = &at.q8[b + c];
                let isum = products(run(KIND), &w, signed(KIND).then_some(&signs), blk, 0..8);
                let [acc, offs] = &mut sums[t][h];
                let k = (b + c) % 4;
                let sc = _mm256_mul_ps(_mm256_set1_ps(blk.d), d);
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[k]);
                if has_offset(KIND) {
                    offs[k] = _mm256_fmadd_ps(off, _mm256_set1_ps(blk.s), offs[k]);
                }
            }
        }
    }
}
