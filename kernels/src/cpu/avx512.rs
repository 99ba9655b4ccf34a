//! AVX-512 VNNI kernels for quantized products (x86-64 with AVX512F/BW/VL and VNNI), on top of
//! the AVX2 table.
//!
//! [`gemm16`] computes one weight row against 16 tokens at once: the tokens are the lanes
//! ([`Packed16`]), each 4-byte group of the unpacked weight block is broadcast, and `vpdpbusd`
//! accumulates the exact integer dot product of every token with that block in 8 instructions.
//!
//! Batch invariance: a token must get bit-identical results alone or in a batch, so the
//! single-token dots of this table follow the same arithmetic as one `gemm16` lane: per block the
//! exact integer sum, then `acc[b % 4] = fma(isum, d_act * d_w, acc[b % 4])` and
//! `off[b % 4] = fma(m_w, s_act, off[b % 4])`, finally `(acc0 + acc1) + (acc2 + acc3)` plus the
//! same for `off`. Integer sums are exact in any order; every float operation happens in the same
//! order on the same values.

use super::avx2::{f16_at, prefetch};
use super::{Isa, Kernels};
use crate::packed::{Packed16, LANES};
use crate::quant::{BlockQ8, DType, QK};
use std::arch::x86_64::*;

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// The AVX-512 VNNI table, or `None` when the processor lacks any of the features.
pub fn kernels() -> Option<Kernels> {
    let has = |f: &str| match f {
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        _ => is_x86_feature_detected!("avx512vnni"),
    };
    if !["avx512f", "avx512bw", "avx512vl", "avx512vnni"].iter().all(|f| has(f)) {
        return None;
    }
    let base = super::avx2::kernels()?;
    // Each closure calls `#[target_feature]` functions of this file; the table only exists when
    // the features were detected above (and AVX2/FMA/F16C by `avx2::kernels`).
    Some(Kernels {
        isa: Isa::Avx512Vnni,
        // SAFETY: features detected above.
        dot_q4_0: |w, a| unsafe { dot::<Q4_0>(w, a) },
        // SAFETY: as above.
        dot_q4_1: |w, a| unsafe { dot::<Q4_1>(w, a) },
        // SAFETY: as above.
        dot_q8_0: |w, a| unsafe { dot::<Q8_0>(w, a) },
        // Four tokens go through `gemm16` (see `matmul`); these only serve other callers.
        // SAFETY: as above.
        dot_q4_0_x4: |w, a| a.map(|a| unsafe { dot::<Q4_0>(w, a) }),
        // SAFETY: as above.
        dot_q4_1_x4: |w, a| a.map(|a| unsafe { dot::<Q4_1>(w, a) }),
        // SAFETY: as above.
        dot_q8_0_x4: |w, a| a.map(|a| unsafe { dot::<Q8_0>(w, a) }),
        // SAFETY: as above.
        gemm16: Some(|dt, w, p| unsafe { gemm16(dt, w, p) }),
        ..base
    })
}

/// Bytes per weight block and the offset of its quants.
const fn layout(kind: u8) -> (usize, usize) {
    match kind {
        Q4_0 => (18, 2),
        Q4_1 => (20, 4),
        _ => (34, 2),
    }
}

/// `(d, m)` of a weight block: the scale and the per-weight offset (Q4_0 stores quants 0..15
/// for values -8..7, so its offset is `-8 d`; Q8_0 has none).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn scales<const KIND: u8>(blk: &[u8]) -> (f32, f32) {
    let d = f16_at(blk, 0);
    match KIND {
        Q4_0 => (d, -8.0 * d),
        Q4_1 => (d, f16_at(blk, 2)),
        _ => (d, 0.0),
    }
}

/// The 32 quants of a 4-bit block as unsigned bytes, in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn nibbles(qs: &[u8]) -> __m256i {
    assert!(qs.len() >= 16);
    // SAFETY: 16 bytes are there (asserted).
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let low = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), low), _mm_and_si128(q, low))
}

/// One weight row against one token, in the lane arithmetic of [`gemm16`] (module docs).
///
/// # Safety
/// The CPU must support the features of [`kernels`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot<const KIND: u8>(w: &[u8], a: &[BlockQ8]) -> f32 {
    let (bb, q) = layout(KIND);
    let nb = a.len();
    assert!(w.len() >= nb * bb);
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
            prefetch(w, b * bb);
            let blk = &w[b * bb..(b + 1) * bb];
            let (d, m) = scales::<KIND>(blk);
            // SAFETY: `qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(a[b].qs.as_ptr().cast()) };
            let isum = if KIND == Q8_0 {
                // SAFETY: 32 quant bytes follow the scale.
                let wq = unsafe { _mm256_loadu_si256(blk[2..].as_ptr().cast()) };
                // |w| as the unsigned operand, w's sign moved onto the activations.
                _mm256_dpbusd_epi32(zero, _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq))
            } else {
                _mm256_dpbusd_epi32(zero, nibbles(&blk[q..]), aq)
            };
            (isum, a[b].d * d, m, a[b].s)
        };
        let (l0, l1, l2, l3) = (lane(0), lane(1), lane(2), lane(3));
        // Horizontal sums of the four blocks: lanes [isum(b0), isum(b0+1), ...].
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(l0.0, l1.0), _mm256_hadd_epi32(l2.0, l3.0));
        let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_set_ps(l3.1, l2.1, l1.1, l0.1), acc);
        if KIND != Q8_0 {
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

/// One weight row against a packed group of 16 tokens.
///
/// # Safety
/// The CPU must support the features of [`kernels`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemm16(dt: DType, w: &[u8], p: &Packed16) -> [f32; 16] {
    // SAFETY (all arms): same features as this function's caller guarantees.
    match dt {
        // SAFETY: as above.
        DType::Q4_0 => unsafe { gemm16_kind::<Q4_0>(w, p) },
        // SAFETY: as above.
        DType::Q4_1 => unsafe { gemm16_kind::<Q4_1>(w, p) },
        // SAFETY: as above.
        DType::Q8_0 => unsafe { gemm16_kind::<Q8_0>(w, p) },
        other => panic!("gemm16 has no {other:?} kernel"),
    }
}

/// # Safety
/// The CPU must support the features of [`kernels`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemm16_kind<const KIND: u8>(w: &[u8], p: &Packed16) -> [f32; 16] {
    let (bb, q) = layout(KIND);
    let nb = p.blocks;
    assert!(w.len() >= nb * bb && p.qs.len() >= nb * QK * LANES && p.d.len() >= nb * LANES && p.s.len() >= nb * LANES && p.isum.len() >= nb * LANES);
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut off = [_mm512_setzero_ps(); 4];
    let mut wb = [0i32; 8];
    for b in 0..nb {
        prefetch(w, b * bb);
        let blk = &w[b * bb..(b + 1) * bb];
        let (d, m) = scales::<KIND>(blk);
        let wq = if KIND == Q8_0 {
            // SAFETY: 32 quant bytes follow the scale.
            // Signed quants + 128 are unsigned bytes; 128 * Σa is subtracted below.
            unsafe { _mm256_xor_si256(_mm256_loadu_si256(blk[2..].as_ptr().cast()), _mm256_set1_epi8(-128)) }
        } else {
            nibbles(&blk[q..])
        };
        // SAFETY: `wb` is 8 i32s = 32 bytes.
        unsafe { _mm256_storeu_si256(wb.as_mut_ptr().cast(), wq) };
        let mut isum = _mm512_setzero_si512();
        for (j, &four) in wb.iter().enumerate() {
            // SAFETY: 64 bytes at ((b * 8 + j) * 16) * 4 lie inside `qs` (asserted length).
            let act = unsafe { _mm512_loadu_si512(p.qs.as_ptr().add((b * 8 + j) * LANES * 4).cast()) };
            isum = _mm512_dpbusd_epi32(isum, _mm512_set1_epi32(four), act);
        }
        // SAFETY: 16 values at b * 16 in each per-lane array (asserted lengths).
        let (da, sa, asum) = unsafe {
            (
                _mm512_loadu_ps(p.d.as_ptr().add(b * LANES)),
                _mm512_loadu_ps(p.s.as_ptr().add(b * LANES)),
                _mm512_loadu_si512(p.isum.as_ptr().add(b * LANES).cast()),
            )
        };
        if KIND == Q8_0 {
            isum = _mm512_sub_epi32(isum, _mm512_slli_epi32::<7>(asum));
        }
        let sc = _mm512_mul_ps(da, _mm512_set1_ps(d));
        acc[b % 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[b % 4]);
        if KIND != Q8_0 {
            off[b % 4] = _mm512_fmadd_ps(_mm512_set1_ps(m), sa, off[b % 4]);
        }
    }
    let a = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    let o = _mm512_add_ps(_mm512_add_ps(off[0], off[1]), _mm512_add_ps(off[2], off[3]));
    let mut out = [0f32; 16];
    // SAFETY: 16 f32s.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(a, o)) };
    out
}
