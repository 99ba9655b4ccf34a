//! The super-block units of the packed 16-row kernel (`avx512_packed.rs`): one super-block of
//! 256 weights of the 16 rows against every token, its fields loaded by dword as
//! `crate::pack` stores them. Each lane does exactly the single-token dot's arithmetic
//! (`avx512.rs`): the group's exact integer sum (per 16-weight half for Q6_K, Q3_K and Q2_K,
//! times the half's scale), then the float step of the group.

use super::avx512_gemv::{iq4xs_scale, k_scales};
use super::lane::{half_offset, IQ4XS, Q2K, Q3K, Q5K, Q6K};
use super::{prefetch, Acts, Ahead};
use std::arch::x86_64::*;

/// `x` shifted right by `by` bits in each dword, masked to `mask` in each byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn bits(x: __m512i, by: usize, mask: i8) -> __m512i {
    _mm512_and_si512(_mm512_srl_epi32(x, _mm_cvtsi32_si128(by as i32)), _mm512_set1_epi8(mask))
}

/// The dword of the token's block `blk` at weights `4 m .. 4 m + 4`, broadcast.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn act(blk: &crate::quant::BlockQ8, m: usize) -> __m512i {
    let q = &blk.qs[4 * m..4 * m + 4];
    _mm512_set1_epi32(i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]))
}

/// One super-block of Q4_K, Q5_K or IQ4_XS: groups `b .. b + 8` of the 16 rows, starting at
/// `unit`, against every token. Q4_K's and Q5_K's groups `2p` and `2p + 1` are the low and
/// high nibbles of the same 32 quant bytes (Q5_K: their fifth bits bits `2p` and `2p + 1` of
/// the 32 `qh` bytes); IQ4_XS's group `j` is 16 bytes, its low nibbles the first 16 weights,
/// through the code book and biased by +128. Scales as the single-token dot decodes them.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`, and the super-block of the 16
/// rows must lie at `unit` (`at`: where each field starts in it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn super_block<const KIND: u8>(
    unit: *const u8,
    at: &[[usize; 2]; 4],
    (quants, fifth): (usize, usize),
    a: &[Acts<'_>],
    (b, ahead): (usize, &Ahead),
    sums: &mut [[[__m512; 4]; 2]],
) {
    let nib = _mm512_set1_epi8(0x0f);
    let vector = |k: usize, m: usize| {
        // SAFETY: dword m of field k of the 16 rows, inside the super-block (`pack`).
        unsafe { _mm512_loadu_si512(unit.add(at[k][0] + 64 * m).cast()) }
    };
    // Q4_K, Q5_K: d|dmin and the 12 scale bytes as three dwords; IQ4_XS: d|scales_h and
    // scales_l.
    let sbd = if KIND == IQ4XS {
        [vector(0, 0), vector(1, 0), _mm512_setzero_si512(), _mm512_setzero_si512()]
    } else {
        [vector(0, 0), vector(1, 0), vector(1, 1), vector(1, 2)]
    };
    // SAFETY: IQ4_VALUES is 16 bytes.
    let book = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(crate::quant::IQ4_VALUES.as_ptr().cast()) });
    for p in 0..4 {
        prefetch(ahead, p, 4);
        let scales = if KIND == IQ4XS {
            [(iq4xs_scale(&sbd, 2 * p), _mm512_setzero_ps()), (iq4xs_scale(&sbd, 2 * p + 1), _mm512_setzero_ps())]
        } else {
            [k_scales(&sbd, 2 * p), k_scales(&sbd, 2 * p + 1)]
        };
        let mut wq = [[_mm512_setzero_si512(); 8]; 2];
        // Indexed loops: the iterator form measured slower here (`avx512_packed::unit_of`).
        #[allow(clippy::needless_range_loop)]
        for m in 0..8 {
            if KIND == IQ4XS {
                // Dword m % 4 of group 2p + m / 4: low nibbles weights 4 (m % 4), high 16 more.
                let v = vector(quants, 4 * (2 * p + m / 4) + m % 4);
                let lh = [_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib)]
                    .map(|x| _mm512_xor_si512(_mm512_shuffle_epi8(book, x), _mm512_set1_epi8(-128)));
                wq[m / 4][m % 4] = lh[0];
                wq[m / 4][4 + m % 4] = lh[1];
                continue;
            }
            let v = vector(quants, 8 * p + m);
            let mut lh = [_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib)];
            if KIND == Q5K {
                let qh = vector(fifth, m);
                for (h, x) in lh.iter_mut().enumerate() {
                    *x = _mm512_or_si512(*x, _mm512_slli_epi32::<4>(bits(qh, 2 * p + h, 1)));
                }
            }
            wq[0][m] = lh[0];
            wq[1][m] = lh[1];
        }
        for (t, at) in a.iter().enumerate() {
            for (c, (wc, (d, off))) in wq.iter().zip(scales).enumerate() {
                let blk = &at.q8[b + 2 * p + c];
                let mut isum = _mm512_setzero_si512();
                for (m, &wv) in wc.iter().enumerate() {
                    isum = _mm512_dpbusd_epi32(isum, wv, act(blk, m));
                }
                if KIND == IQ4XS {
                    // The quants were biased by +128: 128 Σa comes back off.
                    let [lo, hi] = at.halves[b + 2 * p + c];
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32((lo + hi) << 7));
                }
                let [acc, offs] = &mut sums[t];
                let k = (b + 2 * p + c) % 4;
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(blk.d), d), acc[k]);
                if KIND != IQ4XS {
                    offs[k] = _mm512_fmadd_ps(off, _mm512_set1_ps(blk.s), offs[k]);
                }
            }
        }
    }
}

/// One super-block of a kind with a scale per 16 weights (Q6_K, Q3_K, Q2_K): groups
/// `b .. b + 8` of the 16 rows, starting at `unit`, against every token. Group `j`'s quants:
/// - Q6_K (`j = 4 h + s`): nibble `s / 2` of the 32 low-bit bytes at `64 h + 32 (s % 2)` and
///   bits `2 s` of the 32 high-bit bytes at `32 h`;
/// - Q3_K: bits `2 (j % 4)` of the 32 bytes at `32 (j / 4)` of `qs`, plus 4 where bit `j` of
///   the `hmask` byte is set;
/// - Q2_K: bits `2 (j % 4)` of the 32 bytes at `32 (j / 4)` of `qs`.
///
/// Per 16-weight half `(Σ q a - o Σ a)` times the half's scale (`o` the kind's offset), exact
/// in 32 bits; Q2_K's mins a term of their own, as the single-token dot.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`, and the unit of the 16 rows
/// holding this super-block as its block `c` must lie at `unit` (`at`: where each field of
/// each of its blocks starts in it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn super_block_16<const KIND: u8>(
    unit: *const u8,
    at: &[[usize; 2]; 4],
    c: usize,
    a: &[Acts<'_>],
    (b, ahead): (usize, &Ahead),
    sums: &mut [[[__m512; 4]; 2]],
) {
    let o = half_offset(KIND).unwrap_or(0);
    let vector = |k: usize, m: usize| {
        // SAFETY: dword m of field k of the 16 rows, inside the super-block (`pack`).
        unsafe { _mm512_loadu_si512(unit.add(at[k][c] + 64 * m).cast()) }
    };
    let f16_at = |x: __m512i| _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
    // d, and Q2_K's -dmin (its d|dmin dwords are field 2); Q6_K's and Q3_K's d is field 3.
    let (d, neg_dmin) = if KIND == Q2K {
        let dd = vector(2, 0);
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(f16_at(_mm512_srli_epi32::<16>(dd))),
            _mm512_set1_epi32(i32::MIN),
        ));
        (f16_at(dd), neg)
    } else {
        // SAFETY: the 16 rows' f16 d, 32 bytes at field 3.
        (_mm512_cvtph_ps(unsafe { _mm256_loadu_si256(unit.add(at[3][c]).cast()) }), _mm512_setzero_ps())
    };
    // The quant vectors a group shares with others, loaded once: Q6_K's low bits (groups s
    // and s + 2) and high bits (the 4 groups of a half), Q3_K's and Q2_K's 2-bit quants (4
    // groups). The groups go in an order that meets each load first; every accumulator still
    // takes its groups (j and j + 4) in order, so the sums are those of the single-token dot.
    let (mut low, mut high) = ([_mm512_setzero_si512(); 8], [_mm512_setzero_si512(); 8]);
    for (i, j) in [0, 2, 1, 3, 4, 6, 5, 7].into_iter().enumerate() {
        prefetch(ahead, i, 8);
        let (h, s) = (j / 4, j % 4);
        if KIND == Q6K && s < 2 {
            low = std::array::from_fn(|m| vector(0, 16 * h + 8 * s + m));
        }
        if s == 0 {
            high = std::array::from_fn(|m| vector(1, 8 * h + m));
        }
        let wq: [__m512i; 8] = std::array::from_fn(|m| match KIND {
            Q6K => {
                let low = if s < 2 { low[m] } else { _mm512_srli_epi16::<4>(low[m]) };
                _mm512_or_si512(
                    _mm512_and_si512(low, _mm512_set1_epi8(0x0f)),
                    _mm512_slli_epi32::<4>(bits(high[m], 2 * s, 3)),
                )
            }
            Q3K => _mm512_or_si512(bits(high[m], 2 * s, 3), _mm512_slli_epi32::<2>(bits(vector(0, m), j, 1))),
            _ => bits(high[m], 2 * s, 3),
        });
        // The integer scales of the group's halves (and Q2_K's mins, as floats: exact).
        let (scales, mins): ([__m512i; 2], [__m512; 2]) = match KIND {
            Q6K => {
                // Signed bytes 2j and 2j + 1 of the 16.
                let four = vector(2, j / 2);
                let sc = |c: usize| {
                    let byte = 2 * (j % 2) + c;
                    _mm512_srai_epi32::<24>(_mm512_sll_epi32(four, _mm_cvtsi32_si128(24 - 8 * byte as i32)))
                };
                ([sc(0), sc(1)], [_mm512_setzero_ps(); 2])
            }
            Q3K => {
                // Half i: low 4 bits from byte i % 8 (nibble i / 8), high 2 from byte
                // 8 + i % 4 (bits 2 (i / 4)), less 32.
                let sc = |c: usize| {
                    let i = 2 * j + c;
                    let low = bits(vector(2, usize::from(i % 8 >= 4)), 8 * (i % 4) + 4 * (i / 8), 0xf);
                    let high = bits(vector(2, 2), 8 * (i % 4) + 2 * (i / 4), 3);
                    let low = _mm512_and_si512(low, _mm512_set1_epi32(0xff));
                    let high = _mm512_and_si512(high, _mm512_set1_epi32(0xff));
                    _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32::<4>(high)), _mm512_set1_epi32(32))
                };
                ([sc(0), sc(1)], [_mm512_setzero_ps(); 2])
            }
            _ => {
                // Byte 2j + c of the 16: the scale in its low nibble, the min in its high one.
                let four = vector(0, j / 2);
                let byte = |c: usize, by: usize| {
                    _mm512_and_si512(bits(four, 8 * (2 * (j % 2) + c) + by, 0xf), _mm512_set1_epi32(0xf))
                };
                ([byte(0, 0), byte(1, 0)], [_mm512_cvtepi32_ps(byte(0, 4)), _mm512_cvtepi32_ps(byte(1, 4))])
            }
        };
        for (t, at) in a.iter().enumerate() {
            let blk = &at.q8[b + j];
            let mut isum = _mm512_setzero_si512();
            for (c, sc) in scales.iter().enumerate() {
                let mut half = _mm512_setzero_si512();
                for (m, &wv) in wq.iter().enumerate().skip(4 * c).take(4) {
                    half = _mm512_dpbusd_epi32(half, wv, act(blk, m));
                }
                if o != 0 {
                    half = _mm512_sub_epi32(half, _mm512_set1_epi32(at.halves[b + j][c] * o));
                }
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(half, *sc));
            }
            let [acc, offs] = &mut sums[t];
            let k = (b + j) % 4;
            acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(blk.d), d), acc[k]);
            if KIND == Q2K {
                // The mins' term: d_act * -dmin times Σ_h mins_h Σ_h a (exact as floats).
                let [lo, hi] = at.halves[b + j];
                let msum = _mm512_fmadd_ps(
                    mins[0],
                    _mm512_set1_ps(lo as f32),
                    _mm512_mul_ps(mins[1], _mm512_set1_ps(hi as f32)),
                );
                offs[k] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(blk.d), neg_dmin), msum, offs[k]);
            }
        }
    }
}
