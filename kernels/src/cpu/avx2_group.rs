//! AVX2 products of the formats read as decoded groups (Q5_0, Q5_1, the K-quants, IQ4_NL and
//! IQ4_XS): every type but the three with kernels of their own in [`super::avx2`].
//!
//! A 32-weight group (see [`crate::group`]) is decoded into one register of quants `q` (bytes,
//! in element order), the per-16 integer scales as 16-bit lanes and the group's float factors.
//! The products then follow llama.cpp's ggml-cpu scheme: `vpmaddubsw` multiplies the unsigned
//! quants (or `|q|`, the sign moved onto the activations) with the 8-bit activations, `vpmaddwd`
//! multiplies the pair sums with the scales, exact in 32 bits, and one FMA per group scales them
//! by `d_a * d`. The offset terms use the activation block's sum (`m` per 32 weights) or, for
//! Q2_K's per-16 mins, a second `vpmaddwd` with the mins.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c")]`; the table entries that call
//! them exist only where `avx2::kernels` detected the features.

use super::avx2::{hsum, prefetch};
use super::QuantDots;
use crate::group::{iq4xs_scale, k_scale_min, q3k_scale};
use crate::quant::{read_f16, BlockQ8, QuantType, IQ4_VALUES, QK};
use std::arch::x86_64::*;

/// The offset term of a decoded group.
#[derive(Clone, Copy)]
enum Min {
    None,
    /// `m` times the activation block's sum (`BlockQ8::s`).
    Sum(f32),
    /// Per-16 integer mins as 16-bit lanes (like the scales) and their float factor.
    Halves(__m256i, f32),
}

/// A group in registers: `w[i] = d * sc[i / 16] * q[i] + min`.
#[derive(Clone, Copy)]
struct GroupV {
    q: __m256i,
    sc: __m256i,
    d: f32,
    min: Min,
}

/// True for the types whose decoded quants are signed (the products take `|q|`).
const fn signed(q: QuantType) -> bool {
    matches!(q, QuantType::Q5_0 | QuantType::Q3K | QuantType::Q6K | QuantType::IQ4NL | QuantType::IQ4XS)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load32(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: 32 bytes are there (asserted).
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// Sixteen bytes holding weights `k` (low nibble) and `k + 16` (high) as 32 bytes in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn nibbles(b: &[u8]) -> __m256i {
    assert!(b.len() >= 16);
    // SAFETY: 16 bytes are there (asserted).
    let q = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
    let low = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), low), _mm_and_si128(q, low))
}

/// Bits `shift .. shift + width` of each of 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bits(v: __m256i, shift: usize, mask: i8) -> __m256i {
    let s = _mm_cvtsi32_si128(shift as i32);
    _mm256_and_si256(_mm256_srl_epi16(v, s), _mm256_set1_epi8(mask))
}

/// Bit `i` of `h` as byte `i`: 0x10 where set, 0 where clear (the fifth bit of Q5_0/Q5_1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn fifth_bits(h: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(h as i32),
        _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10))
}

/// The IQ4 code book applied to 32 nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4(n: __m256i) -> __m256i {
    // SAFETY: IQ4_VALUES is 16 bytes.
    let book = unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) };
    _mm256_shuffle_epi8(_mm256_set_m128i(book, book), n)
}

/// Per-16 scales as 16-bit lanes: lanes 0..8 (weights 0..16) `lo`, 8..16 `hi`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// The quants of group `j` of a Q4_K (`five` false) or Q5_K super-block `blk`, as unsigned bytes
/// in element order: weight `64 c + 32 h + l` in nibble `h` of byte `32 c + l`, Q5_K's fifth bit
/// in bit `j` of `qh[l]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn k_quants(blk: &[u8], j: usize, five: bool) -> __m256i {
    use crate::quant::{BlockQ4K, BlockQ5K};
    use std::mem::offset_of;
    let qs = if five { offset_of!(BlockQ5K, qs) } else { offset_of!(BlockQ4K, qs) };
    let low = bits(load32(&blk[qs + 32 * (j / 2)..]), 4 * (j % 2), 0x0f);
    if five {
        _mm256_or_si256(low, _mm256_slli_epi16::<4>(bits(load32(&blk[offset_of!(BlockQ5K, qh)..]), j, 1)))
    } else {
        low
    }
}

/// The quants of group `j` of a Q6_K super-block `blk` as unsigned bytes 0..64 in element order
/// (the stored value, 32 above the signed weight): weight `128 h + 32 s + l` has its low four
/// bits in nibble `s / 2` of `ql[64 h + 32 (s % 2) + l]`, its high two in bits `2 s` of
/// `qh[32 h + l]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6k_quants(blk: &[u8], j: usize) -> __m256i {
    let (h, s) = (j / 4, j % 4);
    let low = bits(load32(&blk[64 * h + 32 * (s % 2)..]), 4 * (s / 2), 0x0f);
    _mm256_or_si256(low, _mm256_slli_epi16::<4>(bits(load32(&blk[128 + 32 * h..]), 2 * s, 3)))
}

/// The quants of group `j` of a Q3_K super-block `blk` as unsigned bytes 0..8 in element order,
/// 4 above the signed weights: the 2 low bits (bits `2 s` of `qs[32 h + l]`, `j = 4 h + s`)
/// plus 4 where the high bit (bit `j` of `hmask[l]`) is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q3k_quants(blk: &[u8], j: usize) -> __m256i {
    let low = bits(load32(&blk[32 + 32 * (j / 4)..]), 2 * (j % 4), 3);
    _mm256_add_epi8(low, _mm256_slli_epi16::<2>(bits(load32(blk), j, 1)))
}

/// The signed 8-bit scales of the two 16-weight halves of group `j` of a Q6_K super-block.
#[inline]
pub(super) fn q6k_scales(blk: &[u8], j: usize) -> (i32, i32) {
    (i32::from(blk[192 + 2 * j] as i8), i32::from(blk[193 + 2 * j] as i8))
}

/// Group `g` of the row `w` stored as `Q` (the bit layouts of [`crate::group::decode`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode<const Q: u8>(w: &[u8], g: usize) -> GroupV {
    let qt = QuantType::ALL[Q as usize];
    let (per, bb) = (qt.block_len() / QK, qt.block_bytes());
    let blk = &w[(g / per) * bb..(g / per + 1) * bb];
    let j = g % per;
    let (h, s) = (j / 4, j % 4);
    let one = _mm256_set1_epi16(1);
    match qt {
        QuantType::Q5_0 => {
            let high = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let q = _mm256_sub_epi8(_mm256_or_si256(nibbles(&blk[6..]), fifth_bits(high)), _mm256_set1_epi8(16));
            GroupV { q, sc: one, d: read_f16(blk, 0), min: Min::None }
        }
        QuantType::Q5_1 => {
            let high = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
            let q = _mm256_or_si256(nibbles(&blk[8..]), fifth_bits(high));
            GroupV { q, sc: one, d: read_f16(blk, 0), min: Min::Sum(read_f16(blk, 2)) }
        }
        QuantType::IQ4NL => GroupV { q: iq4(nibbles(&blk[2..])), sc: one, d: read_f16(blk, 0), min: Min::None },
        QuantType::Q2K => {
            let q = bits(load32(&blk[16 + 32 * h..]), 2 * s, 3);
            let (a, b) = (blk[2 * j], blk[2 * j + 1]);
            let sc = halves(i32::from(a & 0xf), i32::from(b & 0xf));
            let m = halves(i32::from(a >> 4), i32::from(b >> 4));
            GroupV { q, sc, d: read_f16(blk, 80), min: Min::Halves(m, -read_f16(blk, 82)) }
        }
        QuantType::Q3K => {
            // A set high bit keeps the value; a clear one subtracts 4.
            let q = _mm256_sub_epi8(q3k_quants(blk, j), _mm256_set1_epi8(4));
            let sc = halves(q3k_scale(&blk[96..108], 2 * j), q3k_scale(&blk[96..108], 2 * j + 1));
            GroupV { q, sc, d: read_f16(blk, 108), min: Min::None }
        }
        QuantType::Q4K | QuantType::Q5K => {
            let (sc, m) = k_scale_min(&blk[4..16], j);
            let q = k_quants(blk, j, qt == QuantType::Q5K);
            let d = read_f16(blk, 0);
            let sc = _mm256_set1_epi16(i16::from(sc));
            GroupV { q, sc, d, min: Min::Sum(-read_f16(blk, 2) * f32::from(m)) }
        }
        QuantType::Q6K => {
            let q = _mm256_sub_epi8(q6k_quants(blk, j), _mm256_set1_epi8(32));
            let (sc0, sc1) = q6k_scales(blk, j);
            let sc = halves(sc0, sc1);
            GroupV { q, sc, d: read_f16(blk, 208), min: Min::None }
        }
        QuantType::IQ4XS => GroupV {
            q: iq4(nibbles(&blk[8 + 16 * j..])),
            sc: _mm256_set1_epi16(iq4xs_scale(blk, j) as i16),
            d: read_f16(blk, 0),
            min: Min::None,
        },
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 => {
            unreachable!("Q4_0, Q4_1 and Q8_0 have kernels of their own")
        }
    }
}

/// One row stored as `Q` against `N` (of up to four) activation rows, each group decoded once.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // g indexes the weight groups and every token's blocks alike
unsafe fn dot_x4<const Q: u8, const N: usize>(w: &[u8], a: [&[BlockQ8]; 4]) -> [f32; 4] {
    let qt = QuantType::ALL[Q as usize];
    let nb = a[0].len();
    let (per, bb) = (qt.block_len() / QK, qt.block_bytes());
    assert!(nb.is_multiple_of(per) && w.len() >= nb / per * bb && a[..N].iter().all(|r| r.len() == nb));
    let ones = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut accm = [_mm256_setzero_ps(); 4];
    let mut off = [0f32; 4];
    for g in 0..nb {
        if g % per == 0 {
            prefetch(w, g / per * bb);
        }
        let v = decode::<Q>(w, g);
        let uq = if signed(qt) { _mm256_sign_epi8(v.q, v.q) } else { v.q };
        for r in 0..N {
            let ab = &a[r][g];
            // SAFETY: `qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(ab.qs.as_ptr().cast()) };
            let sa = if signed(qt) { _mm256_sign_epi8(aq, v.q) } else { aq };
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(uq, sa), v.sc);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ab.d * v.d), _mm256_cvtepi32_ps(p), acc[r]);
            match v.min {
                Min::None => {}
                Min::Sum(m) => off[r] += m * ab.s,
                Min::Halves(m, dmin) => {
                    let pm = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, aq), m);
                    accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(ab.d * dmin), _mm256_cvtepi32_ps(pm), accm[r]);
                }
            }
        }
    }
    let mut out = [0f32; 4];
    for r in 0..N {
        out[r] = hsum(acc[r]) + hsum(accm[r]) + off[r];
    }
    out
}

/// The AVX2 products of the type `Q` (a [`QuantType`] as `u8`; not Q4_0, Q4_1 or Q8_0).
pub(super) fn dots<const Q: u8>() -> QuantDots {
    QuantDots {
        // SAFETY: the table that holds these exists only where AVX2/FMA/F16C were detected.
        one: |w, a| unsafe { dot_x4::<Q, 1>(w, [a, a, a, a])[0] },
        // SAFETY: as above.
        four: |w, a| unsafe { dot_x4::<Q, 4>(w, a) },
    }
}
