//! The AVX2 unpacking of a 32-weight group of each format (see [`crate::group`]) into one
//! register of quants, bytes in element order: the single-row dots (`lane.rs`) and the 16-row
//! kernel on rows as the file stores them (`avx512_gemv.rs`) share them.
//!
//! Every function is `#[target_feature(enable = "avx2,fma,f16c")]`; the table entries that call
//! them exist only where `avx2::kernels` detected the features.

use crate::quant::IQ4_VALUES;
use std::arch::x86_64::*;

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

/// MXFP4's code book (doubled E2M1 values) applied to 32 nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn mxfp4(n: __m256i) -> __m256i {
    // SAFETY: MXFP4_VALUES is 16 bytes.
    let book = unsafe { _mm_loadu_si128(crate::quant::MXFP4_VALUES.as_ptr().cast()) };
    _mm256_shuffle_epi8(_mm256_set_m128i(book, book), n)
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
