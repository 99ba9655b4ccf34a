//! The super-block units of the packed 16-row AVX2 kernel (`avx2_packed.rs`): one super-block
//! of 256 weights of the 16 rows against every token, eight rows (a half) at a time, its fields
//! loaded by dword as `crate::pack` stores them. The AVX-512 units' (`avx512_super.rs`) steps
//! on half-width vectors, each lane the single-row dot's arithmetic (`lane.rs`): the group's
//! exact integer sum (per 16-weight half for Q6_K, Q3_K and Q2_K, times the half's scale),
//! then the float step of the group.

use super::avx2_packed::products;
use super::lane::{half_offset, run, IQ4XS, Q2K, Q3K, Q5K, Q6K};
use super::{prefetch, Acts, Ahead};
use crate::quant::BlockQ8;
use std::arch::x86_64::*;

/// Per token, per half of the 16 rows: the four block accumulators of the products and of the
/// offsets (the single-row dot's `acc[b % 4]`, `off[b % 4]`).
pub(super) type Sums = [[[__m256; 4]; 2]; 2];

/// The dword of the token's block `blk` at weights `4 m .. 4 m + 4`, broadcast.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn act(blk: &BlockQ8, m: usize) -> __m256i {
    let q = &blk.qs[4 * m..4 * m + 4];
    _mm256_set1_epi32(i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]))
}

/// `x` shifted right by `by` bits in each dword, masked to `mask` in each byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits(x: __m256i, by: usize, mask: i8) -> __m256i {
    _mm256_and_si256(_mm256_srl_epi32(x, _mm_cvtsi32_si128(by as i32)), _mm256_set1_epi8(mask))
}

/// The f16 in the low half of each dword, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_low(x: __m256i) -> __m256 {
    // Bytes 0, 1, 4, 5, 8, 9, 12, 13 of each 128-bit lane to its low 8, then the two lanes'
    // low quadwords together.
    let pick = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1,
        -1,
    );
    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(x, pick));
    _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
}

/// `-x` (the sign bit flipped, as the single-row dot negates `dmin`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn neg(x: __m256) -> __m256 {
    _mm256_xor_ps(x, _mm256_set1_ps(-0.0))
}

/// Q4_K's and Q5_K's factors of group `j` for 8 rows, from their d|dmin dwords (`sbd[0]`) and
/// scale bytes (`sbd[1..4]`): `d` times the 6-bit scale, `-dmin` times the 6-bit min, as the
/// single-row dot computes them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k_scales(sbd: &[__m256i; 4], j: usize) -> (__m256, __m256) {
    let byte = |x: __m256i, k: usize| {
        _mm256_and_si256(_mm256_srl_epi32(x, _mm_cvtsi32_si128(8 * k as i32)), _mm256_set1_epi32(0xff))
    };
    let low6 = _mm256_set1_epi32(63);
    let top2 = |x: __m256i| _mm256_slli_epi32::<4>(_mm256_srli_epi32::<6>(x));
    let (sc, mn) = if j < 4 {
        (_mm256_and_si256(byte(sbd[1], j), low6), _mm256_and_si256(byte(sbd[2], j), low6))
    } else {
        let hi = byte(sbd[3], j - 4);
        (
            _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0xf)), top2(byte(sbd[1], j - 4))),
            _mm256_or_si256(_mm256_srli_epi32::<4>(hi), top2(byte(sbd[2], j - 4))),
        )
    };
    let d = _mm256_mul_ps(f16_low(sbd[0]), _mm256_cvtepi32_ps(sc));
    let neg_dmin = neg(f16_low(_mm256_srli_epi32::<16>(sbd[0])));
    (d, _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(mn)))
}

/// IQ4_XS's weight scale of group `j` for 8 rows, from their d|scales_h dwords (`sbd[0]`) and
/// scales_l dwords (`sbd[1]`): `d` times the 6-bit scale less 32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4xs_scale(sbd: &[__m256i; 4], j: usize) -> __m256 {
    let low = _mm256_srl_epi32(sbd[1], _mm_cvtsi32_si128((8 * (j / 2) + 4 * (j % 2)) as i32));
    let high = _mm256_srl_epi32(sbd[0], _mm_cvtsi32_si128((16 + 2 * j) as i32));
    let ls = _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi32(0xf)),
        _mm256_slli_epi32::<4>(_mm256_and_si256(high, _mm256_set1_epi32(3))),
    );
    let sc = _mm256_sub_epi32(ls, _mm256_set1_epi32(32));
    _mm256_mul_ps(f16_low(sbd[0]), _mm256_cvtepi32_ps(sc))
}

/// One super-block of Q4_K, Q5_K or IQ4_XS: groups `b .. b + 8` of the 16 rows, starting at
/// `unit`, against every token. Q4_K's and Q5_K's groups `2p` and `2p + 1` are the low and
/// high nibbles of the same 32 quant bytes (Q5_K: their fifth bits bits `2p` and `2p + 1` of
/// the 32 `qh` bytes); IQ4_XS's group `j` is 16 bytes, its low nibbles the first 16 weights,
/// through the code book.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the super-block of the 16 rows must lie at
/// `unit` (`at`: where each field starts in it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn super_block<const KIND: u8>(
    unit: *const u8,
    at: &[[usize; 2]; 4],
    a: &[Acts<'_>],
    (b, ahead): (usize, &Ahead),
    sums: &mut [Sums],
) {
    let nib = _mm256_set1_epi8(0x0f);
    // The fields: Q4_K d|dmin, scales, qs; Q5_K d|dmin, scales, qh, qs; IQ4_XS d|scales_h,
    // scales_l, qs.
    let (quants, fifth) = if KIND == Q5K { (3, 2) } else { (2, 0) };
    // SAFETY: IQ4_VALUES is 16 bytes.
    let book = unsafe { _mm_loadu_si128(crate::quant::IQ4_VALUES.as_ptr().cast()) };
    let book = _mm256_set_m128i(book, book);
    // h, the half of the 16 rows, picks the loads and every token's sums alike.
    #[allow(clippy::needless_range_loop)]
    for h in 0..2 {
        let vector = |k: usize, m: usize| {
            // SAFETY: dword m of field k of the half's 8 rows, inside the super-block (`pack`).
            unsafe { _mm256_loadu_si256(unit.add(at[k][0] + 64 * m + 32 * h).cast()) }
        };
        let sbd = if KIND == IQ4XS {
            [vector(0, 0), vector(1, 0), _mm256_setzero_si256(), _mm256_setzero_si256()]
        } else {
            [vector(0, 0), vector(1, 0), vector(1, 1), vector(1, 2)]
        };
        for j in 0..8 {
            if h == 0 {
                prefetch(ahead, j, 8);
            }
            let (d, off) = if KIND == IQ4XS { (iq4xs_scale(&sbd, j), _mm256_setzero_ps()) } else { k_scales(&sbd, j) };
            // w[m]: weights 4 m .. 4 m + 4 of the group for every row.
            let w: [__m256i; 8] = std::array::from_fn(|m| {
                if KIND == IQ4XS {
                    // Dword m % 4 of the group's 16 bytes: low nibbles weights 4 m, high 16 more.
                    let v = vector(quants, 4 * j + m % 4);
                    let v = if m < 4 { v } else { _mm256_srli_epi16::<4>(v) };
                    return _mm256_shuffle_epi8(book, _mm256_and_si256(v, nib));
                }
                let v = vector(quants, 8 * (j / 2) + m);
                let v = _mm256_and_si256(if j % 2 == 0 { v } else { _mm256_srli_epi16::<4>(v) }, nib);
                if KIND == Q5K {
                    _mm256_or_si256(v, _mm256_slli_epi32::<4>(bits(vector(fifth, m), j, 1)))
                } else {
                    v
                }
            });
            let signs = w;
            let u = if KIND == IQ4XS { w.map(|x| _mm256_sign_epi8(x, x)) } else { w };
            for (t, at) in a.iter().enumerate() {
                let blk = &at.q8[b + j];
                let isum = products(run(KIND), &u, (KIND == IQ4XS).then_some(&signs), blk, 0..8);
                let [acc, offs] = &mut sums[t][h];
                let k = (b + j) % 4;
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(blk.d), d), acc[k]);
                if KIND != IQ4XS {
                    offs[k] = _mm256_fmadd_ps(off, _mm256_set1_ps(blk.s), offs[k]);
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
/// in 32 bits; Q2_K's mins a term of their own, as the single-row dot.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the unit of the 16 rows holding this
/// super-block as its block `c` must lie at `unit` (`at`: where each field of each of its
/// blocks starts in it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn super_block_16<const KIND: u8>(
    unit: *const u8,
    at: &[[usize; 2]; 4],
    c: usize,
    a: &[Acts<'_>],
    (b, ahead): (usize, &Ahead),
    sums: &mut [Sums],
) {
    let o = half_offset(KIND).unwrap_or(0);
    // h, the half of the 16 rows, picks the loads and every token's sums alike.
    #[allow(clippy::needless_range_loop)]
    for h in 0..2 {
        let vector = |k: usize, m: usize| {
            // SAFETY: dword m of field k of the half's 8 rows, inside the super-block (`pack`).
            unsafe { _mm256_loadu_si256(unit.add(at[k][c] + 64 * m + 32 * h).cast()) }
        };
        // d, and Q2_K's -dmin (its d|dmin dwords are field 2); Q6_K's and Q3_K's d is field 3.
        let (d, neg_dmin) = if KIND == Q2K {
            let dd = vector(2, 0);
            (f16_low(dd), neg(f16_low(_mm256_srli_epi32::<16>(dd))))
        } else {
            // SAFETY: the half's 8 f16 d of the 16 at field 3.
            (_mm256_cvtph_ps(unsafe { _mm_loadu_si128(unit.add(at[3][c] + 16 * h).cast()) }), _mm256_setzero_ps())
        };
        for j in 0..8 {
            if h == 0 {
                prefetch(ahead, j, 8);
            }
            let (hj, s) = (j / 4, j % 4);
            let w: [__m256i; 8] = std::array::from_fn(|m| match KIND {
                Q6K => {
                    let low = vector(0, 16 * hj + 8 * (s % 2) + m);
                    let low = if s < 2 { low } else { _mm256_srli_epi16::<4>(low) };
                    _mm256_or_si256(
                        _mm256_and_si256(low, _mm256_set1_epi8(0x0f)),
                        _mm256_slli_epi32::<4>(bits(vector(1, 8 * hj + m), 2 * s, 3)),
                    )
                }
                Q3K => _mm256_or_si256(
                    bits(vector(1, 8 * hj + m), 2 * s, 3),
                    _mm256_slli_epi32::<2>(bits(vector(0, m), j, 1)),
                ),
                _ => bits(vector(1, 8 * hj + m), 2 * s, 3),
            });
            // The integer scales of the group's halves (and Q2_K's mins, as floats: exact).
            let (scales, mins): ([__m256i; 2], [__m256; 2]) = match KIND {
                Q6K => {
                    // Signed bytes 2j and 2j + 1 of the 16.
                    let four = vector(2, j / 2);
                    let sc = |e: usize| {
                        let byte = 2 * (j % 2) + e;
                        _mm256_srai_epi32::<24>(_mm256_sll_epi32(four, _mm_cvtsi32_si128(24 - 8 * byte as i32)))
                    };
                    ([sc(0), sc(1)], [_mm256_setzero_ps(); 2])
                }
                Q3K => {
                    // Half i: low 4 bits from byte i % 8 (nibble i / 8), high 2 from byte
                    // 8 + i % 4 (bits 2 (i / 4)), less 32.
                    let sc = |e: usize| {
                        let i = 2 * j + e;
                        let low = bits(vector(2, usize::from(i % 8 >= 4)), 8 * (i % 4) + 4 * (i / 8), 0xf);
                        let high = bits(vector(2, 2), 8 * (i % 4) + 2 * (i / 4), 3);
                        let low = _mm256_and_si256(low, _mm256_set1_epi32(0xff));
                        let high = _mm256_and_si256(high, _mm256_set1_epi32(0xff));
                        _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32::<4>(high)), _mm256_set1_epi32(32))
                    };
                    ([sc(0), sc(1)], [_mm256_setzero_ps(); 2])
                }
                _ => {
                    // Byte 2j + e of the 16: the scale in its low nibble, the min in its high one.
                    let four = vector(0, j / 2);
                    let byte = |e: usize, by: usize| {
                        _mm256_and_si256(bits(four, 8 * (2 * (j % 2) + e) + by, 0xf), _mm256_set1_epi32(0xf))
                    };
                    ([byte(0, 0), byte(1, 0)], [_mm256_cvtepi32_ps(byte(0, 4)), _mm256_cvtepi32_ps(byte(1, 4))])
                }
            };
            for (t, at) in a.iter().enumerate() {
                let blk = &at.q8[b + j];
                let mut isum = _mm256_setzero_si256();
                for (e, sc) in scales.iter().enumerate() {
                    let mut half = products(run(KIND), &w, None, blk, 4 * e..4 * e + 4);
                    if o != 0 {
                        half = _mm256_sub_epi32(half, _mm256_set1_epi32(at.halves[b + j][e] * o));
                    }
                    isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(half, *sc));
                }
                let [acc, offs] = &mut sums[t][h];
                let k = (b + j) % 4;
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(blk.d), d), acc[k]);
                if KIND == Q2K {
                    // The mins' term: d_act * -dmin times Σ_h mins_h Σ_h a (exact as floats).
                    let [lo, hi] = at.halves[b + j];
                    let msum = _mm256_fmadd_ps(
                        mins[0],
                        _mm256_set1_ps(lo as f32),
                        _mm256_mul_ps(mins[1], _mm256_set1_ps(hi as f32)),
                    );
                    offs[k] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(blk.d), neg_dmin), msum, offs[k]);
                }
            }
        }
    }
}
