//! The lane arithmetic: the one float arithmetic every quantized product of the fast tables
//! follows, and its single-row dot (AVX2, shared by the AVX2 and AVX-512 tables).
//!
//! Batch invariance: a token must get bit-identical results alone or in a batch, so every
//! product follows the single-token dot's arithmetic: per block the exact integer sum, then
//! `acc[b % 4] = fma(isum, d_act * d_w, acc[b % 4])` and `off[b % 4] = fma(m_w, s_act,
//! off[b % 4])`, finally `(acc0 + acc1) + (acc2 + acc3)` plus the same for `off`. Integer sums
//! are exact in any order; every float operation happens in the same order on the same values.
//! The 16-row kernels (`avx512_gemv.rs`, `avx512_packed.rs`, `avx2_packed.rs`) do it in vector
//! lanes, a row in each, so a row's result is the same whichever table or kernel computed it.
//!
//! This file also names the kernel kinds (one per quantized type, usable as const generics) and
//! the per-kind facts the kernels share.

use super::avx2::prefetch;
use super::avx2_group::{bits, fifth_bits, iq4, k_quants, load32, mxfp4, nibbles, q3k_quants, q6k_quants, q6k_scales};
use crate::quant::{BlockQ8, QuantType};
use std::arch::x86_64::*;

pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q8_0: u8 = 2;
pub(super) const Q5_0: u8 = 3;
pub(super) const Q4K: u8 = 4;
pub(super) const Q5K: u8 = 5;
pub(super) const Q6K: u8 = 6;
pub(super) const Q5_1: u8 = 7;
pub(super) const IQ4NL: u8 = 8;
pub(super) const IQ4XS: u8 = 9;
pub(super) const Q3K: u8 = 10;
pub(super) const Q2K: u8 = 11;
pub(super) const MXFP4: u8 = 12;

/// Evaluates `$body` with `$k` the kernel kind of the quantized type `$q` (a `const`, usable as
/// a const generic argument).
macro_rules! with_kind {
    ($q:expr, $k:ident => $body:expr) => {
        match $q {
            QuantType::Q4_0 => {
                const $k: u8 = $crate::cpu::lane::Q4_0;
                $body
            }
            QuantType::Q4_1 => {
                const $k: u8 = $crate::cpu::lane::Q4_1;
                $body
            }
            QuantType::Q8_0 => {
                const $k: u8 = $crate::cpu::lane::Q8_0;
                $body
            }
            QuantType::Q5_0 => {
                const $k: u8 = $crate::cpu::lane::Q5_0;
                $body
            }
            QuantType::Q4K => {
                const $k: u8 = $crate::cpu::lane::Q4K;
                $body
            }
            QuantType::Q5K => {
                const $k: u8 = $crate::cpu::lane::Q5K;
                $body
            }
            QuantType::Q6K => {
                const $k: u8 = $crate::cpu::lane::Q6K;
                $body
            }
            QuantType::Q5_1 => {
                const $k: u8 = $crate::cpu::lane::Q5_1;
                $body
            }
            QuantType::IQ4NL => {
                const $k: u8 = $crate::cpu::lane::IQ4NL;
                $body
            }
            QuantType::IQ4XS => {
                const $k: u8 = $crate::cpu::lane::IQ4XS;
                $body
            }
            QuantType::Q3K => {
                const $k: u8 = $crate::cpu::lane::Q3K;
                $body
            }
            QuantType::Q2K => {
                const $k: u8 = $crate::cpu::lane::Q2K;
                $body
            }
            QuantType::MXFP4 => {
                const $k: u8 = $crate::cpu::lane::MXFP4;
                $body
            }
        }
    };
}
pub(super) use with_kind;

/// The products of every quantized type, in the lane arithmetic (module docs).
pub(super) fn quant_dots(q: QuantType) -> super::QuantDots {
    with_kind!(q, K => lane_dots::<K>())
}

/// [`dot`] of `KIND` for one token and for four (batches go through the 16-row kernel, see
/// `matmul`; `four` only serves other callers).
fn lane_dots<const KIND: u8>() -> super::QuantDots {
    super::QuantDots {
        // SAFETY: the table that holds these exists only where the features were detected.
        one: |w, a| unsafe { dot::<KIND>(w, a) },
        // SAFETY: as above.
        four: |w, a| a.map(|a| unsafe { dot::<KIND>(w, a) }),
    }
}

/// Bytes per weight block and the offset of its quants (the `#[repr(C)]` block structs').
pub(super) const fn layout(kind: u8) -> (usize, usize) {
    use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0};
    use std::mem::{offset_of, size_of};
    match kind {
        Q4_0 => (size_of::<BlockQ4_0>(), offset_of!(BlockQ4_0, qs)),
        Q4_1 => (size_of::<BlockQ4_1>(), offset_of!(BlockQ4_1, qs)),
        Q8_0 => (size_of::<BlockQ8_0>(), offset_of!(BlockQ8_0, qs)),
        Q5_0 => (size_of::<crate::quant::BlockQ5_0>(), offset_of!(crate::quant::BlockQ5_0, qs)),
        Q4K => (size_of::<crate::quant::BlockQ4K>(), offset_of!(crate::quant::BlockQ4K, qs)),
        Q5K => (size_of::<crate::quant::BlockQ5K>(), offset_of!(crate::quant::BlockQ5K, qs)),
        Q6K => (size_of::<crate::quant::BlockQ6K>(), offset_of!(crate::quant::BlockQ6K, ql)),
        Q5_1 => (size_of::<crate::quant::BlockQ5_1>(), offset_of!(crate::quant::BlockQ5_1, qs)),
        IQ4NL => (size_of::<crate::quant::BlockIQ4NL>(), offset_of!(crate::quant::BlockIQ4NL, qs)),
        IQ4XS => (size_of::<crate::quant::BlockIQ4XS>(), offset_of!(crate::quant::BlockIQ4XS, qs)),
        Q3K => (size_of::<crate::quant::BlockQ3K>(), offset_of!(crate::quant::BlockQ3K, qs)),
        Q2K => (size_of::<crate::quant::BlockQ2K>(), offset_of!(crate::quant::BlockQ2K, qs)),
        MXFP4 => (size_of::<crate::quant::BlockMXFP4>(), offset_of!(crate::quant::BlockMXFP4, qs)),
        _ => panic!("not a kernel kind"),
    }
}

/// 32-weight groups per block: 8 for the K-quants' super-blocks, else 1.
pub(super) const fn groups(kind: u8) -> usize {
    if matches!(kind, Q4K | Q5K | Q6K | IQ4XS | Q3K | Q2K) {
        8
    } else {
        1
    }
}

/// True for the kinds with a float offset term `m` per 32 weights times the activations' sum
/// (Q4_0, Q5_0 as `-8 d`, `-16 d`; Q4_1, Q5_1, Q4_K, Q5_K). Q2_K's per-16 mins are an integer
/// sum of their own; the other kinds have none.
pub(super) const fn has_offset(kind: u8) -> bool {
    matches!(kind, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4K | Q5K)
}

/// True for the kinds whose quants are signed bytes (the products take `q + 128` and subtract
/// `128 Σa`, or move the sign onto the activations).
pub(super) const fn signed(kind: u8) -> bool {
    matches!(kind, Q8_0 | IQ4NL | IQ4XS | MXFP4)
}

/// The kinds with a scale per 16 weights: their stored quants are this much above the signed
/// weights (Q2_K's are not signed: 0; its mins are a separate term).
pub(super) const fn half_offset(kind: u8) -> Option<i32> {
    match kind {
        Q6K => Some(32),
        Q3K => Some(4),
        Q2K => Some(0),
        _ => None,
    }
}

/// How many `vpmaddubsw` results of a kind's unsigned operands (its quants, or their
/// magnitudes for the signed kinds) can be added in 16 bits before widening: each holds the
/// products of 2 weights with activations of at most 127, so `2 * RUN * max_q * 127` must stay
/// below 32768 (Q4: 15, Q5: 31, Q6_K: 63, Q3_K: 7, Q2_K: 3, the signed kinds up to 128).
pub(super) const fn run(kind: u8) -> usize {
    match kind {
        Q4_0 | Q4_1 | Q4K | Q3K | Q2K => 8,
        Q5_0 | Q5_1 | Q5K => 4,
        Q6K => 2,
        _ => 1,
    }
}

/// Bytes of a row of `nb` groups, and the offset of group `b`'s block.
pub(super) const fn row_bytes(kind: u8, nb: usize) -> usize {
    nb.div_ceil(groups(kind)) * layout(kind).0
}

const fn block_at(kind: u8, b: usize) -> usize {
    b / groups(kind) * layout(kind).0
}

/// Group `b` (weights `32 b .. 32 b + 32`) of a row, unpacked: the weights are
/// `d * sc[i / 16] * (q[i] - 32 [Q6_K]) + m` with `q` the unsigned bytes of `q` in element order
/// (Q8_0: its signed bytes as stored, `m = 0`). `sc` is Q6_K's pair of per-16 integer scales
/// (the stored quants being 32 above the signed weights), `(1, 1)` for every other kind. The
/// K-quants' `d` and `m` are the super-block's factors times the group's integer scale and min,
/// products exact in f32 (as in `group::decode`).
#[derive(Clone, Copy)]
struct Grp {
    d: f32,
    m: f32,
    sc: (i32, i32),
    /// Q2_K's per-16 integer mins (the weights are `d sc q + m mins`), else 0.
    mins: (i32, i32),
    q: __m256i,
}

/// Group `b` of the row `w` as a [`Grp`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn group<const KIND: u8>(w: &[u8], b: usize) -> Grp {
    let (bb, q) = layout(KIND);
    let at = block_at(KIND, b);
    let blk = &w[at..at + bb];
    match KIND {
        Q4K | Q5K => {
            let j = b % 8;
            let (sc, mn) = crate::group::k_scale_min(&blk[4..16], j);
            let d = crate::quant::read_f16(blk, 0) * f32::from(sc);
            let m = -crate::quant::read_f16(blk, 2) * f32::from(mn);
            Grp { d, m, sc: (1, 1), mins: (0, 0), q: k_quants(blk, j, KIND == Q5K) }
        }
        Q6K => {
            let j = b % 8;
            let d = crate::quant::read_f16(blk, std::mem::offset_of!(crate::quant::BlockQ6K, d));
            Grp { d, m: 0.0, sc: q6k_scales(blk, j), mins: (0, 0), q: q6k_quants(blk, j) }
        }
        IQ4XS => {
            let j = b % 8;
            let d = crate::quant::read_f16(blk, 0) * crate::group::iq4xs_scale(blk, j) as f32;
            Grp { d, m: 0.0, sc: (1, 1), mins: (0, 0), q: iq4(nibbles(&blk[q + 16 * j..])) }
        }
        Q3K => {
            let j = b % 8;
            let sc = &blk[96..108];
            let d = crate::quant::read_f16(blk, 108);
            Grp {
                d,
                m: 0.0,
                sc: (crate::group::q3k_scale(sc, 2 * j), crate::group::q3k_scale(sc, 2 * j + 1)),
                mins: (0, 0),
                q: q3k_quants(blk, j),
            }
        }
        MXFP4 => {
            let d = crate::quant::e8m0_half(blk[0]);
            Grp { d, m: 0.0, sc: (1, 1), mins: (0, 0), q: mxfp4(nibbles(&blk[q..])) }
        }
        Q2K => {
            // `m` is -dmin, `mins` the per-16 mins from the scale bytes' high nibbles.
            let (j, h, s) = (b % 8, b % 8 / 4, b % 4);
            let (a, c) = (blk[2 * j], blk[2 * j + 1]);
            Grp {
                d: crate::quant::read_f16(blk, 80),
                m: -crate::quant::read_f16(blk, 82),
                sc: (i32::from(a & 0xf), i32::from(c & 0xf)),
                mins: (i32::from(a >> 4), i32::from(c >> 4)),
                q: bits(load32(&blk[q + 32 * h..]), 2 * s, 3),
            }
        }
        _ => {
            let (d, m) = scales::<KIND>(blk);
            let quants = match KIND {
                Q8_0 => load32(&blk[q..]),
                Q5_0 | Q5_1 => {
                    let at = q - 4;
                    let high = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                    _mm256_or_si256(nibbles(&blk[q..]), fifth_bits(high))
                }
                IQ4NL => iq4(nibbles(&blk[q..])),
                _ => nibbles(&blk[q..]),
            };
            Grp { d, m, sc: (1, 1), mins: (0, 0), q: quants }
        }
    }
}

/// `(d, m)` of a Q4_0, Q4_1, Q5_0 or Q8_0 block: the scale and the per-weight offset (Q4_0
/// stores quants 0..15 for values -8..7, so its offset is `-8 d`, Q5_0's `-16 d`; Q8_0 has
/// none).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales<const KIND: u8>(blk: &[u8]) -> (f32, f32) {
    // F16C on the first 4 bytes: d, and for Q4_1 m (Q4_0/Q8_0: two quant bytes, unused).
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]])));
    let d = _mm_cvtss_f32(dm);
    match KIND {
        Q4_0 => (d, -8.0 * d),
        Q5_0 => (d, -16.0 * d),
        Q4_1 | Q5_1 => (d, _mm_cvtss_f32(_mm_movehdup_ps(dm))),
        _ => (d, 0.0),
    }
}

/// `Σ u[4i..4i+4] * s[4i..4i+4]` per dword, unsigned bytes times signed ones, exact: every
/// product pair `vpmaddubsw` adds stays below its 16-bit saturation (unsigned quants are below
/// 64, and the signed kinds' magnitudes at most 128, against activations of at most 127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dp(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// One weight row against one token, in the lane arithmetic (module docs).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<const KIND: u8>(w: &[u8], a: &[BlockQ8]) -> f32 {
    let nb = a.len();
    assert!(w.len() >= row_bytes(KIND, nb));
    let mut acc = _mm_setzero_ps();
    let mut off = _mm_setzero_ps();
    let zero = _mm256_setzero_si256();
    let mut b0 = 0;
    while b0 < nb {
        let n = (nb - b0).min(4);
        // Per block: exact integer sum (8 partial lanes), d_act * d_w, m_w, s_act; zeros past the end.
        let lane = |i: usize| {
            if i >= n {
                return (zero, 0.0, 0.0, 0.0);
            }
            let b = b0 + i;
            prefetch(w, block_at(KIND, b));
            let Grp { d, m, sc, mins, q: wq } = group::<KIND>(w, b);
            // SAFETY: `qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(a[b].qs.as_ptr().cast()) };
            let halves = |lo: i32, hi: i32| _mm256_set_m128i(_mm_set1_epi32(hi), _mm_set1_epi32(lo));
            let asum = || dp(_mm256_set1_epi8(1), aq);
            let isum = if signed(KIND) {
                // |w| as the unsigned operand, w's sign moved onto the activations.
                dp(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq))
            } else if let Some(o) = half_offset(KIND) {
                // Per dword: (Σ q a - o Σ a) times its half's scale, exact in 32 bits.
                let dp = dp(wq, aq);
                let dp =
                    if o == 0 { dp } else { _mm256_sub_epi32(dp, _mm256_mullo_epi32(asum(), _mm256_set1_epi32(o))) };
                _mm256_mullo_epi32(dp, halves(sc.0, sc.1))
            } else {
                dp(wq, aq)
            };
            if KIND == Q2K {
                // The mins' integer sum Σ_h mins_h Σ_h a, scaled by d_act * -dmin.
                let v = _mm256_mullo_epi32(asum(), halves(mins.0, mins.1));
                let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                let h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
                let h = _mm_add_epi32(h, _mm_shuffle_epi32::<1>(h));
                return (isum, a[b].d * d, a[b].d * m, _mm_cvtsi128_si32(h) as f32);
            }
            (isum, a[b].d * d, m, a[b].s)
        };
        let (l0, l1, l2, l3) = (lane(0), lane(1), lane(2), lane(3));
        // Horizontal sums of the four blocks: lanes [isum(b0), isum(b0+1), ...].
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(l0.0, l1.0), _mm256_hadd_epi32(l2.0, l3.0));
        let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_set_ps(l3.1, l2.1, l1.1, l0.1), acc);
        if has_offset(KIND) || KIND == Q2K {
            off = _mm_fmadd_ps(_mm_set_ps(l3.2, l2.2, l1.2, l0.2), _mm_set_ps(l3.3, l2.3, l1.3, l0.3), off);
        }
        b0 += 4;
    }
    let (mut l, mut o) = ([0f32; 4], [0f32; 4]);
    // SAFETY: 4 f32s each.
    unsafe {
        _mm_storeu_ps(l.as_mut_ptr(), acc);
        _mm_storeu_ps(o.as_mut_ptr(), off);
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((o[0] + o[1]) + (o[2] + o[3]))
}
