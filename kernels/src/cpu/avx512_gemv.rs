//! The 16-row AVX-512 VNNI kernel ([`gemv16`]): sixteen weight rows against one to
//! [`super::GEMV_TOKENS`] tokens, the decode path. The rows are weight-stationary: each block
//! pair of the 16 rows is unpacked and rearranged once, then multiplied with every token. Every
//! lane does exactly the float arithmetic of the single-token dot of `avx512.rs` (its module
//! docs), so the result equals that dot bit for bit whatever the batch.
//!
//! Layout: the unpacked quants of a block pair (64 weights, 16 dwords of 4) of the 16 rows are
//! transposed so that vector `wq[c][m]` holds dword `4c + m` of every row, row `4g + L` in lane
//! `4L + g` (a fixed transposition the scales are gathered in and the result is put back
//! from). A token then costs one `vpdpbusd` per weight dword, its activation dword broadcast,
//! and the lanes end as the rows' exact integer sums of each block: no reduction across lanes.

use super::avx2_group::{bits, load32, q3k_quants, q6k_quants};
use super::lane::{groups, half_offset, has_offset, layout, row_bytes, signed};
use super::lane::{IQ4NL, IQ4XS, MXFP4, Q2K, Q3K, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
use super::{Acts, GEMV_TOKENS};
use crate::quant::QuantType;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Sixteen consecutive weight rows (`w` holds them back to back, `rb` bytes each) against 1 to
/// [`GEMV_TOKENS`] tokens (module docs): `out[t][i]` is row `i` against token `t`.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv16(dt: QuantType, w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    match dt {
        // SAFETY: same features as this function's caller guarantees.
        QuantType::Q4_0 => unsafe { gemv16_tokens::<Q4_0>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q4_1 => unsafe { gemv16_tokens::<Q4_1>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q8_0 => unsafe { gemv16_tokens::<Q8_0>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q5_0 => unsafe { gemv16_tokens::<Q5_0>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q4K => unsafe { gemv16_tokens::<Q4K>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q5K => unsafe { gemv16_tokens::<Q5K>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q6K => unsafe { gemv16_tokens::<Q6K>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q5_1 => unsafe { gemv16_tokens::<Q5_1>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::IQ4NL => unsafe { gemv16_tokens::<IQ4NL>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::IQ4XS => unsafe { gemv16_tokens::<IQ4XS>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q3K => unsafe { gemv16_tokens::<Q3K>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q2K => unsafe { gemv16_tokens::<Q2K>(w, rb, a, out) },
        // SAFETY: as above.
        QuantType::MXFP4 => unsafe { gemv16_tokens::<MXFP4>(w, rb, a, out) },
    }
}

/// MXFP4's scales of 16 rows from their exponent bytes (one per lane, 0..=255): `2^(e - 128)`,
/// bit for bit as [`crate::quant::e8m0_half`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn e8m0_half16(e: __m512i) -> __m512 {
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let denormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, denormal))
}

/// The quants of blocks `b` (lanes 0..8) and `b + 1` (lanes 8..16, zeros when `pair` is false)
/// of the row starting at `row`, as bytes in element order (`vpdpbusd`'s unsigned operand;
/// Q8_0 biased by +128; Q5_0's fifth bits from its 32-bit `qh`, byte `e` of the pair taking
/// bit `e` of `qh_b | qh_(b+1) << 32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn weight_pair<const KIND: u8>(row: *const u8, b: usize, pair: bool) -> __m512i {
    let (bb, q) = layout(KIND);
    if matches!(KIND, Q6K | Q3K | Q2K) {
        let (blk, j) = (row.wrapping_add(b / 8 * bb), b % 8);
        // SAFETY: the caller guarantees the super-block (bb bytes) lies inside the row.
        let blk = unsafe { std::slice::from_raw_parts(blk, bb) };
        let group = |j: usize| match KIND {
            Q6K => q6k_quants(blk, j),
            Q3K => q3k_quants(blk, j),
            // Q2_K: bits 2 (j % 4) of the 32 bytes at q + 32 (j / 4).
            _ => bits(load32(&blk[q + 32 * (j / 4)..]), 2 * (j % 4), 3),
        };
        return _mm512_inserti64x4::<1>(_mm512_castsi256_si512(group(j)), group(j + 1));
    }
    if matches!(KIND, Q4K | Q5K) {
        // Groups j and j + 1 (j even) of a super-block are the low and high nibbles of the
        // same 32 bytes; Q5_K's fifth bits are bits j and j + 1 of its 32 qh bytes.
        let (blk, j) = (row.wrapping_add(b / 8 * bb), b % 8);
        // SAFETY: the caller guarantees the super-block lies inside the row.
        let v = unsafe { _mm256_loadu_si256(blk.wrapping_add(q + 32 * (j / 2)).cast()) };
        let nib = _mm256_set1_epi8(0x0f);
        let low = _mm256_and_si256(v, nib);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
        let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
        if KIND == Q4K {
            return x;
        }
        // SAFETY: as above; qh is the 32 bytes at 16.
        let qh = _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(blk.wrapping_add(16).cast()) });
        let bit = _mm512_inserti64x4::<1>(_mm512_set1_epi8(1 << j), _mm256_set1_epi8(1 << (j + 1)));
        return _mm512_or_si512(x, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bit), _mm512_set1_epi8(0x10)));
    }
    // IQ4_XS: groups j and j + 1 (j even) are 16 bytes each, back to back in the super-block.
    let (p0, p1) = if KIND == IQ4XS {
        let p0 = row.wrapping_add(b / 8 * bb + q + 16 * (b % 8));
        (p0, p0.wrapping_add(16))
    } else {
        let p0 = row.wrapping_add(b * bb + q);
        (p0, p0.wrapping_add(bb))
    };
    if KIND == Q8_0 {
        // SAFETY: the caller guarantees 32 quant bytes at p0.
        let lo = unsafe { _mm256_loadu_si256(p0.cast()) };
        // SAFETY: and at p1 when `pair`.
        let hi = if pair { unsafe { _mm256_loadu_si256(p1.cast()) } } else { _mm256_setzero_si256() };
        let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_xor_si512(v, _mm512_set1_epi8(-128))
    } else {
        // 128-bit lanes [q_b, q_b, q_b1, q_b1], then low nibbles in lanes 0 and 2, high in 1 and 3.
        // SAFETY: the caller guarantees 16 quant bytes at p0.
        let v = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(p0.cast()) });
        // SAFETY: and at p1 when `pair`.
        let v = if pair { _mm512_mask_broadcast_i32x4(v, 0xff00, unsafe { _mm_loadu_si128(p1.cast()) }) } else { v };
        let low = _mm512_and_si512(_mm512_mask_srli_epi16::<4>(v, 0xff00_ff00, v), _mm512_set1_epi8(0x0f));
        if matches!(KIND, Q5_0 | Q5_1) {
            let qh = |p: *const u8| {
                // SAFETY: qh is the 4 bytes before the quants (Q5_0: 2..6 of the block, Q5_1:
                // 4..8), which the caller guarantees (the block lies inside the row).
                u64::from(unsafe { p.wrapping_sub(4).cast::<u32>().read_unaligned() })
            };
            let high = if pair { qh(p0) | (qh(p1) << 32) } else { qh(p0) };
            _mm512_or_si512(low, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)))
        } else if matches!(KIND, IQ4NL | IQ4XS | MXFP4) {
            // The code book's signed values, biased by +128 as Q8_0's quants.
            let values = if KIND == MXFP4 { &crate::quant::MXFP4_VALUES } else { &crate::quant::IQ4_VALUES };
            // SAFETY: the code books are 16 bytes.
            let book = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(values.as_ptr().cast()) });
            _mm512_xor_si512(_mm512_shuffle_epi8(book, low), _mm512_set1_epi8(-128))
        } else {
            low
        }
    }
}

/// Per-row integer sums of blocks `b` and `b + 1` from the 16 rows' `vpdpbusd` partials
/// (`v[i]`: row `i`, lanes 0..8 block `b`, 8..16 block `b + 1`): two vectors, lanes = rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn reduce16(v: &[__m512i; 16]) -> (__m512i, __m512i) {
    // Within each 128-bit lane: 4 partials of 16 rows -> 1 sum of 4 rows, in row order.
    let u: [__m512i; 8] = std::array::from_fn(|i| {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y))
    });
    let t: [__m512i; 4] = std::array::from_fn(|i| {
        let (x, y) = (u[2 * i], u[2 * i + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y))
    });
    // t[i], 128-bit lanes: rows 4i..4i+4 of [b low half, b high half, b+1 low, b+1 high].
    let halves = |x: __m512i, y: __m512i| {
        _mm512_add_epi32(_mm512_shuffle_i32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_i32x4::<0b11_01_11_01>(x, y))
    };
    // s0: [rows 0..4 of b, rows 0..4 of b+1, rows 4..8 of b, rows 4..8 of b+1]; s1: rows 8..16.
    let (s0, s1) = (halves(t[0], t[1]), halves(t[2], t[3]));
    (_mm512_shuffle_i32x4::<0b10_00_10_00>(s0, s1), _mm512_shuffle_i32x4::<0b11_01_11_01>(s0, s1))
}

/// Four rows' block pairs (`r[L]`: chunks `[b lo, b hi, b+1 lo, b+1 hi]`) transposed by 128-bit
/// chunks: vector `c` holds chunk `c` of the four rows, row `L` in chunk `L`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn transpose4(r: [__m512i; 4]) -> [__m512i; 4] {
    let x0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(r[0], r[1]);
    let x1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(r[0], r[1]);
    let x2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(r[2], r[3]);
    let x3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(r[2], r[3]);
    [
        _mm512_shuffle_i32x4::<0b10_00_10_00>(x0, x2),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(x0, x2),
        _mm512_shuffle_i32x4::<0b10_00_10_00>(x1, x3),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(x1, x3),
    ]
}

/// Four vectors of four rows' dwords (`x[g]`: chunk `L` holds four dwords of row `4g + L`)
/// transposed within each 128-bit chunk: vector `m` holds dword `m` of each row, row `4g + L`
/// in lane `4L + g`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn transpose_dwords(x: [__m512i; 4]) -> [__m512i; 4] {
    let (t0, t1) = (_mm512_unpacklo_epi32(x[0], x[1]), _mm512_unpackhi_epi32(x[0], x[1]));
    let (t2, t3) = (_mm512_unpacklo_epi32(x[2], x[3]), _mm512_unpackhi_epi32(x[2], x[3]));
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// Q4_K's and Q5_K's `(d, m)` of group `j` of a super-block for 16 rows, from its d|dmin
/// dwords (`sbd[0]`) and its 12 scale bytes as three dwords (`sbd[1..4]`), lane by lane: the
/// weights' scale `d sc_j` and the offset factor `-dmin mn_j`, as the single-token dot
/// computes them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn k_scales(sbd: &[__m512i; 4], j: usize) -> (__m512, __m512) {
    let f16_at = |x: __m512i| _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
    let byte = |x: __m512i, k: usize| {
        _mm512_and_si512(_mm512_srl_epi32(x, _mm_cvtsi32_si128(8 * k as i32)), _mm512_set1_epi32(0xff))
    };
    let low6 = _mm512_set1_epi32(63);
    let top2 = |x: __m512i| _mm512_slli_epi32::<4>(_mm512_srli_epi32::<6>(x));
    let (sc, mn) = if j < 4 {
        (_mm512_and_si512(byte(sbd[1], j), low6), _mm512_and_si512(byte(sbd[2], j), low6))
    } else {
        let hi = byte(sbd[3], j - 4);
        (
            _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0xf)), top2(byte(sbd[1], j - 4))),
            _mm512_or_si512(_mm512_srli_epi32::<4>(hi), top2(byte(sbd[2], j - 4))),
        )
    };
    let d = _mm512_mul_ps(f16_at(sbd[0]), _mm512_cvtepi32_ps(sc));
    let neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(f16_at(_mm512_srli_epi32::<16>(sbd[0]))),
        _mm512_set1_epi32(i32::MIN),
    ));
    (d, _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(mn)))
}

/// IQ4_XS's weight scale of group `j` of a super-block for 16 rows, from its d|scales_h
/// dwords (`sbd[0]`) and scales_l dwords (`sbd[1]`): `d` times the 6-bit scale less 32, as
/// the single-token dot computes it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn iq4xs_scale(sbd: &[__m512i; 4], j: usize) -> __m512 {
    let f16_at = |x: __m512i| _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
    let low = _mm512_srl_epi32(sbd[1], _mm_cvtsi32_si128((8 * (j / 2) + 4 * (j % 2)) as i32));
    let high = _mm512_srl_epi32(sbd[0], _mm_cvtsi32_si128((16 + 2 * j) as i32));
    let ls = _mm512_or_si512(
        _mm512_and_si512(low, _mm512_set1_epi32(0xf)),
        _mm512_slli_epi32::<4>(_mm512_and_si512(high, _mm512_set1_epi32(3))),
    );
    let sc = _mm512_sub_epi32(ls, _mm512_set1_epi32(32));
    _mm512_mul_ps(f16_at(sbd[0]), _mm512_cvtepi32_ps(sc))
}

/// [`gemv16_kind`] in the layout that is faster for `a`: weight-stationary (`WIDE`) for several
/// tokens and for the kinds with a scale per 16 weights (Q6_K, Q3_K, Q2_K), else one
/// `vpdpbusd` per row and block pair and a reduction across lanes (measured: 12% faster decode
/// at batch 1 on SmolLM2 Q4_1, where the transposition does not pay for itself).
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemv16_tokens<const KIND: u8>(w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    if a.len() > 1 || half_offset(KIND).is_some() {
        // SAFETY: same features as this function's caller guarantees.
        unsafe { gemv16_kind::<KIND, true>(w, rb, a, out) }
    } else {
        // SAFETY: as above.
        unsafe { gemv16_kind::<KIND, false>(w, rb, a, out) }
    }
}

/// Sixteen rows against the tokens `a`: each block pair of the rows is loaded, unpacked
/// (`WIDE`: and transposed) and its scales gathered once, then multiplied with every token;
/// per token the arithmetic is exactly the single-token one (module docs). Without `WIDE`
/// (one token, no per-16 scales) the lanes are the rows in order and each block pair's products are
/// summed across lanes.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemv16_kind<const KIND: u8, const WIDE: bool>(w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    let (bb, _) = layout(KIND);
    let n = a.len();
    assert!((1..=GEMV_TOKENS).contains(&n) && out.len() == n, "1 to {GEMV_TOKENS} tokens, one output each");
    assert!(WIDE || (n == 1 && half_offset(KIND).is_none()), "the row-order layout takes one token, no per-16 scales");
    let nb = a[0].q8.len();
    assert!(
        a.iter().all(|t| t.q8.len() == nb && t.halves.len() == nb)
            && nb.is_multiple_of(groups(KIND))
            && row_bytes(KIND, nb) <= rb
            && w.len() >= 16 * rb
            && 16 * rb < i32::MAX as usize,
        "16 rows of {nb} blocks"
    );
    // WIDE: lane 4L + g holds row 4g + L (the transposition is its own inverse), else row i lane i.
    let order = if WIDE {
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0)
    } else {
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
    };
    let row_at = _mm512_mullo_epi32(order, _mm512_set1_epi32(rb as i32));
    // Per token, the four block accumulators of the products and of the offsets. This runs
    // once per 16 rows: only the tokens' share is zeroed, not GEMV_TOKENS' (8 KB).
    let mut sums = [const { MaybeUninit::<[[__m512; 4]; 2]>::uninit() }; GEMV_TOKENS];
    let sums = super::zeroed_sums(&mut sums, n, _mm512_setzero_ps());
    // The dword at byte `at` of every row, in lane order: one 32-bit gather.
    let gather = |at: usize| {
        // SAFETY: offsets i * rb + at + 4 <= 16 * rb are inside `w` (`at` is inside a block of
        // the row, asserted above).
        unsafe {
            _mm512_i32gather_epi32::<1>(_mm512_add_epi32(row_at, _mm512_set1_epi32(at as i32)), w.as_ptr().cast())
        }
    };
    // K-quants: the current super-block's d|dmin and 12 scale bytes, gathered once per 8 groups.
    let mut sbd = [_mm512_setzero_si512(); 4];
    // (d, m) of every row's group c, the values `group` computes for it.
    let scales16 = |c: usize, sbd: &[__m512i; 4]| -> (__m512, __m512) {
        let f16_at = |x: __m512i| _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
        if matches!(KIND, Q6K | Q3K) {
            // d is the high half of the block's last 4 bytes (gathered into sbd[0]).
            return (f16_at(_mm512_srli_epi32::<16>(sbd[0])), _mm512_setzero_ps());
        }
        if KIND == Q2K {
            // d | dmin; the mins' factor is -dmin.
            let neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(f16_at(_mm512_srli_epi32::<16>(sbd[0]))),
                _mm512_set1_epi32(i32::MIN),
            ));
            return (f16_at(sbd[0]), neg_dmin);
        }
        if KIND == IQ4XS {
            return (iq4xs_scale(sbd, c % 8), _mm512_setzero_ps());
        }
        if matches!(KIND, Q4K | Q5K) {
            return k_scales(sbd, c % 8);
        }
        if KIND == MXFP4 {
            // The exponent byte, then 3 quant bytes.
            let e = _mm512_and_si512(gather(c * bb), _mm512_set1_epi32(0xff));
            return (e8m0_half16(e), _mm512_setzero_ps());
        }
        // Q4_0/Q8_0/IQ4_NL: d and 2 quant bytes; Q4_1: d and m; Q5_0: d and half of qh.
        let g = gather(c * bb);
        let d = f16_at(g);
        let m = match KIND {
            Q4_1 | Q5_1 => f16_at(_mm512_srli_epi32::<16>(g)),
            // As `scales`: the quants' offset times d.
            Q5_0 => _mm512_mul_ps(_mm512_set1_ps(-16.0), d),
            Q8_0 | IQ4NL => _mm512_setzero_ps(),
            _ => _mm512_mul_ps(_mm512_set1_ps(-8.0), d),
        };
        (d, m)
    };
    // Block `c`'s float step for the 16 rows and one token, as the single-token dot's.
    let step = |t: &Acts<'_>, c: usize, (d, m): (__m512, __m512), isum: __m512i, acc: &mut __m512, off: &mut __m512| {
        let sc = _mm512_mul_ps(_mm512_set1_ps(t.q8[c].d), d);
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, *acc);
        if has_offset(KIND) {
            *off = _mm512_fmadd_ps(m, _mm512_set1_ps(t.q8[c].s), *off);
        }
    };
    // 16 rows ahead are fetched while these are computed, a share per block pair: for several
    // tokens the next 16 into L1; one token is through its rows sooner, so the 16 after those
    // into L2 (measured, same run: batch-1 decode 4% faster that way, batch 8 3% slower).
    let (lines, steps) = (16 * rb / 64, nb.div_ceil(2));
    let next = w.as_ptr().wrapping_add(if WIDE { 16 * rb } else { 32 * rb });
    let mut b = 0;
    while b < nb {
        let pair = b + 1 < nb;
        let s = b / 2;
        for l in s * lines / steps..(s + 1) * lines / steps {
            // A prefetch never faults: the address may lie past `w`.
            let at = next.wrapping_add(l * 64).cast();
            if WIDE {
                _mm_prefetch::<_MM_HINT_T0>(at);
            } else {
                _mm_prefetch::<_MM_HINT_T1>(at);
            }
        }
        // Scales first: the gathers' latency hides behind the integer work.
        if matches!(KIND, Q4K | Q5K) && b % 8 == 0 {
            sbd = std::array::from_fn(|i| gather(b / 8 * bb + 4 * i));
        }
        if KIND == IQ4XS && b % 8 == 0 {
            (sbd[0], sbd[1]) = (gather(b / 8 * bb), gather(b / 8 * bb + 4));
        }
        if matches!(KIND, Q6K | Q3K) && b % 8 == 0 {
            sbd[0] = gather(b / 8 * bb + bb - 4);
        }
        if KIND == Q3K && b % 8 == 0 {
            // The 12 bytes of packed 6-bit scales.
            (sbd[1], sbd[2], sbd[3]) = (gather(b / 8 * bb + 96), gather(b / 8 * bb + 100), gather(b / 8 * bb + 104));
        }
        if KIND == Q2K && b % 8 == 0 {
            sbd[0] = gather(b / 8 * bb + 80);
        }
        let g0 = scales16(b, &sbd);
        let g1 = if pair { scales16(b + 1, &sbd) } else { (_mm512_setzero_ps(), _mm512_setzero_ps()) };
        // The per-16 kinds: each row's integer scales of the pair's four halves (half i of the
        // super-block is 2 (b % 8) + c), in lane order; Q2_K's mins too, as floats (exact).
        let shift = |x: __m512i, by: usize| _mm512_srl_epi32(x, _mm_cvtsi32_si128(by as i32));
        let mask = |x: __m512i, m: i32| _mm512_and_si512(x, _mm512_set1_epi32(m));
        let (half_scales, half_mins): ([__m512i; 4], [__m512; 4]) = match KIND {
            Q6K => {
                // Signed bytes at 192.
                let four = gather(b / 8 * bb + 192 + 2 * (b % 8));
                let sc =
                    |c: usize| _mm512_srai_epi32::<24>(_mm512_sll_epi32(four, _mm_cvtsi32_si128(24 - 8 * c as i32)));
                ([sc(0), sc(1), sc(2), sc(3)], [_mm512_setzero_ps(); 4])
            }
            Q3K => {
                // Low 4 bits from byte i % 8 (nibble i / 8), high 2 from byte 8 + i % 4, less 32.
                let sc = |c: usize| {
                    let i = 2 * (b % 8) + c;
                    let low = mask(shift(if i % 8 < 4 { sbd[1] } else { sbd[2] }, 8 * (i % 4) + 4 * (i / 8)), 0xf);
                    let high = mask(shift(sbd[3], 8 * (i % 4) + 2 * (i / 4)), 3);
                    _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32::<4>(high)), _mm512_set1_epi32(32))
                };
                ([sc(0), sc(1), sc(2), sc(3)], [_mm512_setzero_ps(); 4])
            }
            Q2K => {
                // Byte 2 (b % 8) + c: the scale in its low nibble, the min in its high one.
                let four = gather(b / 8 * bb + 2 * (b % 8));
                let sc = |c: usize| mask(shift(four, 8 * c), 0xf);
                let mn = |c: usize| _mm512_cvtepi32_ps(mask(shift(four, 8 * c + 4), 0xf));
                ([sc(0), sc(1), sc(2), sc(3)], [mn(0), mn(1), mn(2), mn(3)])
            }
            _ => ([_mm512_setzero_si512(); 4], [_mm512_setzero_ps(); 4]),
        };
        // Signed kinds: their quants were biased by +128, so 128 Σa of block c comes back off.
        let bias = |at: &Acts<'_>, c: usize| {
            let [lo, hi] = at.halves[c];
            _mm512_set1_epi32((lo + hi) << 7)
        };
        // b is even: its accumulator is 0 or 2, b + 1's the next one.
        let k = b % 4;
        if !WIDE {
            let at = &a[0];
            let wq: [__m512i; 16] = std::array::from_fn(|i| {
                // SAFETY: row i's blocks b (and b + 1 when `pair`) lie inside `w`: b + 1 < nb,
                // nb * bb <= rb and 16 rows of rb bytes (asserted above).
                unsafe { weight_pair::<KIND>(w.as_ptr().add(i * rb), b, pair) }
            });
            // SAFETY: `qs` is 32 bytes.
            let lo = unsafe { _mm256_loadu_si256(at.q8[b].qs.as_ptr().cast()) };
            let hi = if pair {
                // SAFETY: as above (block b + 1 exists when `pair`).
                unsafe { _mm256_loadu_si256(at.q8[b + 1].qs.as_ptr().cast()) }
            } else {
                _mm256_setzero_si256()
            };
            let act = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let (mut s0, mut s1) =
                reduce16(&std::array::from_fn(|i| _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[i], act)));
            if signed(KIND) {
                s0 = _mm512_sub_epi32(s0, bias(at, b));
                s1 = if pair { _mm512_sub_epi32(s1, bias(at, b + 1)) } else { s1 };
            }
            let [acc, off] = &mut sums[0];
            let ((a0, a1), (o0, o1)) = (acc.split_at_mut(k + 1), off.split_at_mut(k + 1));
            step(at, b, g0, s0, &mut a0[k], &mut o0[k]);
            if pair {
                step(at, b + 1, g1, s1, &mut a1[0], &mut o1[0]);
            }
            b += 2;
            continue;
        }
        // wq[c][m]: dword m of chunk c (weights 16c + 4m .. 16c + 4m + 4 of the pair) of every
        // row, in lane order (module docs).
        let chunks: [[__m512i; 4]; 4] = std::array::from_fn(|g| {
            transpose4(std::array::from_fn(|l| {
                // SAFETY: row 4g + l's blocks b (and b + 1 when `pair`) lie inside `w`: b + 1 < nb,
                // nb * bb <= rb and 16 rows of rb bytes (asserted above).
                unsafe { weight_pair::<KIND>(w.as_ptr().add((4 * g + l) * rb), b, pair) }
            }))
        });
        let wq: [[__m512i; 4]; 4] = std::array::from_fn(|c| transpose_dwords(std::array::from_fn(|g| chunks[g][c])));
        for (t, at) in a.iter().enumerate() {
            // The products of chunk c with the token's matching 16 activation bytes, one
            // broadcast dword per `vpdpbusd`.
            let chunk = |c: usize, sum: __m512i| {
                let q = at.q8[b + c / 2].qs.as_ptr().wrapping_add(16 * (c % 2));
                (0..4).fold(sum, |sum, m| {
                    // SAFETY: block b + c / 2 exists (c < 2, or `pair`); `qs` is 32 bytes.
                    let four = unsafe { q.add(4 * m).cast::<i32>().read_unaligned() };
                    _mm512_dpbusd_epi32(sum, wq[c][m], _mm512_set1_epi32(four))
                })
            };
            let zero = _mm512_setzero_si512();
            let (s0, s1) = if let Some(o) = half_offset(KIND) {
                // Per half: (Σ q a - o Σ a) times the half's scale, as the single-token dot.
                let half = |c: usize| {
                    let sum = chunk(c, zero);
                    let sum = if o == 0 {
                        sum
                    } else {
                        _mm512_sub_epi32(sum, _mm512_set1_epi32(at.halves[b + c / 2][c % 2] * o))
                    };
                    _mm512_mullo_epi32(sum, half_scales[c])
                };
                let s0 = _mm512_add_epi32(half(0), half(1));
                (s0, if pair { _mm512_add_epi32(half(2), half(3)) } else { zero })
            } else {
                let block = |c: usize| {
                    let sum = chunk(c + 1, chunk(c, zero));
                    if signed(KIND) {
                        _mm512_sub_epi32(sum, bias(at, b + c / 2))
                    } else {
                        sum
                    }
                };
                (block(0), if pair { block(2) } else { zero })
            };
            let [acc, off] = &mut sums[t];
            let ((a0, a1), (o0, o1)) = (acc.split_at_mut(k + 1), off.split_at_mut(k + 1));
            step(at, b, g0, s0, &mut a0[k], &mut o0[k]);
            if pair {
                step(at, b + 1, g1, s1, &mut a1[0], &mut o1[0]);
            }
            if KIND == Q2K {
                // The mins' term: d_act * -dmin times Σ_h mins_h Σ_h a (exact as floats).
                let mins = |c: usize, (_, m): (__m512, __m512), off: &mut __m512| {
                    let [lo, hi] = at.halves[b + c / 2];
                    let msum = _mm512_fmadd_ps(
                        half_mins[c],
                        _mm512_set1_ps(lo as f32),
                        _mm512_mul_ps(half_mins[c + 1], _mm512_set1_ps(hi as f32)),
                    );
                    *off = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(at.q8[b + c / 2].d), m), msum, *off);
                };
                mins(0, g0, &mut o0[k]);
                mins(2, g1, &mut o1[0]);
            }
        }
        b += 2;
    }
    for (t, out) in out.iter_mut().enumerate() {
        let [acc, off] = &sums[t];
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let o = _mm512_add_ps(_mm512_add_ps(off[0], off[1]), _mm512_add_ps(off[2], off[3]));
        // SAFETY: 16 f32s.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(order, _mm512_add_ps(s, o))) };
    }
}
