//! The 16-row AVX-512 VNNI kernel on packed weights ([`crate::pack`]): the weight-stationary
//! product of `avx512_gemv.rs` with its unpacking and transposition done once at load time.
//! A block of the 16 rows is then a few aligned vector loads, and a token one `vpdpbusd` per
//! weight dword with its activation dword broadcast. Lane `i` is row `i`, and every lane does
//! exactly the float arithmetic of the single-token dot (`avx512.rs`), so the result equals
//! that dot on the unpacked row bit for bit.

use super::avx512::Q8_0;
use super::{Acts, GEMV_TOKENS};
use crate::quant::QuantType;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Sixteen packed rows (one group, `16 * rb` bytes at `w`) against 1 to [`GEMV_TOKENS`] tokens:
/// `out[t][i]` is row `i` against token `t`.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv16_packed(dt: QuantType, w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    match dt {
        // SAFETY: same features as this function's caller guarantees.
        QuantType::Q8_0 => unsafe { packed_kind::<Q8_0>(w, rb, a, out) },
        _ => panic!("{dt:?} has no packed layout"),
    }
}

/// See [`gemv16_packed`].
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn packed_kind<const KIND: u8>(w: &[u8], rb: usize, a: &[Acts<'_>], out: &mut [[f32; 16]]) {
    const BLOCK: usize = 34;
    let n = a.len();
    assert!((1..=GEMV_TOKENS).contains(&n) && out.len() == n, "1 to {GEMV_TOKENS} tokens, one output each");
    let nb = a[0].q8.len();
    assert!(
        a.iter().all(|t| t.q8.len() == nb && t.halves.len() == nb) && rb == nb * BLOCK && w.len() >= 16 * rb,
        "16 packed rows of {nb} blocks"
    );
    // Per token, the four block accumulators (the single-token dot's `acc[b % 4]`); zeroed for
    // the tokens of the call only.
    let mut sums = [const { MaybeUninit::<[__m512; 4]>::uninit() }; GEMV_TOKENS];
    for s in &mut sums[..n] {
        s.write([_mm512_setzero_ps(); 4]);
    }
    // SAFETY: the first n elements were initialized just above, and MaybeUninit<T> has the
    // layout of T.
    let sums: &mut [[__m512; 4]] = unsafe { std::slice::from_raw_parts_mut(sums.as_mut_ptr().cast(), n) };
    // The next group is fetched into L2 while this one is computed, a share per block pair.
    let (lines, steps) = (16 * rb / 64, nb.div_ceil(2));
    let next = w.as_ptr().wrapping_add(16 * rb);
    let mut b = 0;
    while b < nb {
        let pair = b + 1 < nb;
        let s = b / 2;
        for l in s * lines / steps..(s + 1) * lines / steps {
            // A prefetch never faults: the address may lie past `w`.
            _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(l * 64).cast());
        }
        let at = 16 * BLOCK * b;
        // The 16 rows' scales of blocks b and b + 1, then their quants (`pack` module docs).
        let load_scales = |off: usize| {
            // SAFETY: 32 bytes of scales at `at + off`, inside the group (asserted length).
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(w.as_ptr().add(at + off).cast()) })
        };
        let (d, quants) = if pair {
            ([load_scales(0), load_scales(32)], [at + 64, at + 64 + 512])
        } else {
            ([load_scales(0), _mm512_setzero_ps()], [at + 32, at + 32])
        };
        let wq: [[__m512i; 8]; 2] = std::array::from_fn(|c| {
            std::array::from_fn(|m| {
                // SAFETY: 8 vectors of quants at `quants[c]`, inside the group (`pack` module
                // docs; asserted length). Block b's are loaded twice for a lone block.
                unsafe { _mm512_loadu_si512(w.as_ptr().add(quants[c] + 64 * m).cast()) }
            })
        });
        for (t, at) in a.iter().enumerate() {
            for c in 0..1 + usize::from(pair) {
                let blk = &at.q8[b + c];
                let q = blk.qs.as_ptr();
                let isum = (0..8).fold(_mm512_setzero_si512(), |sum, m| {
                    // SAFETY: `qs` is 32 bytes.
                    let four = unsafe { q.add(4 * m).cast::<i32>().read_unaligned() };
                    _mm512_dpbusd_epi32(sum, wq[c][m], _mm512_set1_epi32(four))
                });
                // The quants were biased by +128: 128 Σa comes back off.
                let [lo, hi] = at.halves[b + c];
                let isum = _mm512_sub_epi32(isum, _mm512_set1_epi32((lo + hi) << 7));
                let acc = &mut sums[t][(b + c) % 4];
                let sc = _mm512_mul_ps(_mm512_set1_ps(blk.d), d[c]);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, *acc);
            }
        }
        b += 2;
    }
    for (out, acc) in out.iter_mut().zip(sums.iter()) {
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        // The offsets' sum, zero for Q8_0, is added as the single-token dot adds it (so that a
        // -0.0 sum comes out +0.0 there too).
        // SAFETY: 16 f32s.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(s, _mm512_setzero_ps())) };
    }
}
