//! AVX2 + FMA + F16C kernels (x86-64), selected at run time by [`kernels`].
//!
//! This file holds the float kernels (dots of f32/f16/bf16 rows, `exp`, GeGLU) and
//! the activations' 8-bit quantizer. The quantized products are the lane arithmetic's
//! single-row dots (`lane.rs`) and the 16-row kernel on packed weights (`avx2_packed.rs`);
//! attention is `avx2_attn.rs`; the bf16 products of many tokens `avx2_bf16.rs`.
//!
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`; the safe wrappers in the
//! table returned by [`kernels`] are only reachable after [`kernels`] has checked those features.

use super::{Isa, Kernels};
use crate::quant::{BlockQ8, QuantType, QK};
use half::f16;
use std::arch::x86_64::*;

/// The AVX2 table, or `None` when this processor lacks AVX2, FMA or F16C.
pub fn kernels() -> Option<Kernels> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
        return None;
    }
    // Each closure below calls a `#[target_feature]` function; they are only ever stored in this
    // table, which exists only when the features were detected above.
    Some(Kernels {
        isa: Isa::Avx2,
        // SAFETY: AVX2/FMA/F16C were detected above.
        quantize_q8: |x, out| unsafe { quantize_q8(x, out) },
        quant: QuantType::ALL.map(super::lane::quant_dots),
        // SAFETY: as above.
        dot_f32: |w, x| unsafe { dot_f32(w, x) },
        // SAFETY: as above.
        dot_f16: |w, x| unsafe { dot_f16(w, x) },
        // SAFETY: as above.
        dot_bf16: |w, x| unsafe { dot_bf16(w, x) },
        // SAFETY: as above.
        dot_f16_x4: |w, x| unsafe { dot_half_x4::<false>(w, x) },
        // SAFETY: as above.
        dot_bf16_x4: |w, x| unsafe { dot_half_x4::<true>(w, x) },
        // SAFETY: as above.
        dot_f16_f32: |k, q| unsafe { dot_f16_f32(k, q) },
        // SAFETY: as above.
        axpy_f16: |a, x, y| unsafe { axpy_f16(a, x, y) },
        // SAFETY: as above.
        attn_scores: |k, q, g, scale, out, stride, ahead| unsafe {
            super::avx2_attn::attn_scores(k, q, g, scale, out, stride, ahead)
        },
        // SAFETY: as above.
        attn_values: |v, p, stride, hd, g, out| unsafe { super::avx2_attn::attn_values(v, p, stride, hd, g, out) },
        // SAFETY: as above.
        exp: |x| unsafe { exp(x) },
        // SAFETY: as above.
        exp_sum: |x, shift| unsafe { exp_sum(x, shift) },
        // SAFETY: as above.
        geglu: |g, u| unsafe { geglu(g, u) },
        // SAFETY: as above.
        swiglu: |g, u| unsafe { swiglu(g, u) },
        gemv16: None,
        // SAFETY: as above.
        gemv16_packed: Some(|dt, w, rb, a, out| unsafe { super::avx2_packed::gemv16_packed(dt, w, rb, a, out) }),
        bf16: Some(super::Bf16Kernels {
            // SAFETY: as above.
            tile: |t, c, ldc| unsafe { super::avx2_bf16::tile(t, c, ldc) },
            // SAFETY: as above.
            to_bf16: |x, out| unsafe { super::avx2_bf16::to_bf16(x, out) },
            words: 2,
            // SAFETY: as above.
            to_tokens: |x, out| unsafe { super::avx2_bf16::to_tokens(x, out) },
            // SAFETY: as above.
            softmax: |s, scale, out| unsafe { super::avx2_bf16::softmax(s, scale, out) },
        }),
    })
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// How far ahead of the current weight block to prefetch. Weight rows are streamed once per
/// step from 4 KiB pages of a file mapping, where the hardware prefetcher restarts at every page
/// boundary; asking early keeps the memory system busy. Rows of a task are contiguous, so running
/// past the end of a row prefetches the next one.
const PREFETCH_BYTES: usize = 2048;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(w: &[u8], at: usize) {
    // A prefetch never faults, so an address past the end of `w` is harmless.
    _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(at + PREFETCH_BYTES).cast());
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK);
    let sign_mask = _mm256_set1_ps(-0.0);
    for (chunk, blk) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: `chunk` has 32 f32s, read as four unaligned 8-lane loads.
        let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(chunk.as_ptr().add(o))) };
        let mut m = _mm256_andnot_ps(sign_mask, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, *vi));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_shuffle_ps::<1>(m4, m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        // cvtps rounds to nearest even, as the scalar reference does.
        let q = v.map(|vi| _mm256_cvtps_epi32(_mm256_mul_ps(vi, id)));
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let p01 = _mm256_packs_epi32(q[0], q[1]);
        let p23 = _mm256_packs_epi32(q[2], q[3]);
        let p = _mm256_packs_epi16(p01, p23);
        // packs interleave 128-bit lanes: restore element order.
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `blk.qs` is 32 bytes.
        unsafe { _mm256_storeu_si256(blk.qs.as_mut_ptr().cast(), p) };
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        blk.d = d;
        blk.s = d * _mm_cvtsi128_si32(s4) as f32;
    }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    assert!(w.len() >= n * 4);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n elements remain in both rows.
        let (wv, xv) = unsafe { (_mm256_loadu_ps(w.as_ptr().add(4 * i).cast()), _mm256_loadu_ps(x.as_ptr().add(i))) };
        acc = _mm256_fmadd_ps(wv, xv, acc);
        i += 8;
    }
    hsum(acc) + super::scalar::dot_f32(&w[4 * i..], &x[i..])
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    // SAFETY: same features; the x4 kernel's per-token arithmetic is this dot's.
    unsafe { dot_half::<false>(w, x) }
}

/// One f16 (`BF = false`) or bf16 weight row against four activation rows, each with exactly
/// the arithmetic of [`dot_half`], so a token's result does not depend on its batch; the weights
/// are converted once for the four, and the eight chains run in parallel.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half_x4<const BF: bool>(w: &[u8], xs: [&[f32]; 4]) -> [f32; 4] {
    let n = xs[0].len();
    assert!(w.len() >= n * 2 && xs.iter().all(|x| x.len() == n));
    let mut c = [[_mm256_setzero_ps(); 2]; 4];
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n elements remain in the weight row.
        let (w0, w1) = unsafe { (half8::<BF>(w, i), half8::<BF>(w, i + 8)) };
        for (ct, x) in c.iter_mut().zip(xs) {
            // SAFETY: i + 16 <= n elements remain in every activation row (asserted lengths).
            unsafe {
                ct[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x.as_ptr().add(i)), ct[0]);
                ct[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.as_ptr().add(i + 8)), ct[1]);
            }
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: i + 8 <= n elements remain in the weight row.
        let w0 = unsafe { half8::<BF>(w, i) };
        for (ct, x) in c.iter_mut().zip(xs) {
            // SAFETY: as above, in every activation row.
            ct[0] = _mm256_fmadd_ps(w0, unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) }, ct[0]);
        }
        i += 8;
    }
    let tail = |x: &[f32]| {
        if BF {
            super::scalar::dot_bf16(&w[2 * i..], &x[i..])
        } else {
            super::scalar::dot_f16(&w[2 * i..], &x[i..])
        }
    };
    std::array::from_fn(|t| hsum(_mm256_add_ps(c[t][0], c[t][1])) + tail(xs[t]))
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    // SAFETY: as in `dot_f16`.
    unsafe { dot_half::<true>(w, x) }
}

/// Eight f16 (`BF = false`) or bf16 weights at element `i`, as f32.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds 8 weights at `i`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half8<const BF: bool>(w: &[u8], i: usize) -> __m256 {
    // SAFETY: the caller's contract.
    let wv = unsafe { _mm_loadu_si128(w.as_ptr().add(2 * i).cast()) };
    if BF {
        // bf16 is the high half of an f32: widen and shift into place.
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(wv)))
    } else {
        _mm256_cvtph_ps(wv)
    }
}

/// The f16/bf16 dot: two 8-lane chains over alternating groups of 8 (so the FMA latency is
/// half hidden), a last odd group into the first chain, `hsum(c0 + c1)`, then the scalar tail.
/// (`dot_half_x4` does exactly this per token.)
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half<const BF: bool>(w: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    assert!(w.len() >= n * 2);
    let (mut c0, mut c1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n elements remain in both rows.
        unsafe {
            c0 = _mm256_fmadd_ps(half8::<BF>(w, i), _mm256_loadu_ps(x.as_ptr().add(i)), c0);
            c1 = _mm256_fmadd_ps(half8::<BF>(w, i + 8), _mm256_loadu_ps(x.as_ptr().add(i + 8)), c1);
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: i + 8 <= n elements remain in both rows.
        c0 = unsafe { _mm256_fmadd_ps(half8::<BF>(w, i), _mm256_loadu_ps(x.as_ptr().add(i)), c0) };
        i += 8;
    }
    let c = [c0, c1];
    let tail =
        if BF { super::scalar::dot_bf16(&w[2 * i..], &x[i..]) } else { super::scalar::dot_f16(&w[2 * i..], &x[i..]) };
    hsum(_mm256_add_ps(c[0], c[1])) + tail
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_f32(k: &[f16], q: &[f32]) -> f32 {
    let n = k.len().min(q.len());
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n elements remain in both slices; f16 is 2 bytes, repr(transparent) u16.
        let (kv, qv) = unsafe { (_mm_loadu_si128(k.as_ptr().add(i).cast()), _mm256_loadu_ps(q.as_ptr().add(i))) };
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(kv), qv, acc);
        i += 8;
    }
    hsum(acc) + super::scalar::dot_f16_f32(&k[i..n], &q[i..n])
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n elements remain in both slices.
        unsafe {
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast()));
            let yp = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(yp)));
        }
        i += 8;
    }
    super::scalar::axpy_f16(a, &x[i..n], &mut y[i..n]);
}

/// `x[i] = exp(x[i] - shift)` through [`exp8`], returning their sum (8 running lanes, then
/// the lanes in order and the tail one at a time).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    let (vs, mut acc) = (_mm256_set1_ps(shift), _mm256_setzero_ps());
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` is 8 f32s.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), vs));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 f32 into the local array.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.iter().sum::<f32>() + super::scalar::exp_sum(chunks.into_remainder(), shift)
}

/// `exp` of 8 lanes: `2^n * e^r` with `n = round(x / ln 2)`, `|r| <= ln 2 / 2`, and a degree-6
/// polynomial for `e^r` (the classic Cephes `expf` coefficients).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.0e-1] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
}

/// `gate = gelu(gate) * up`: `0.5 x (1 + tanh y)` is `x / (1 + e^(-2y))` with
/// `y = sqrt(2 / π) (x + 0.044715 x³)`; [`exp8`]'s clamp keeps both tails finite (`x` or 0).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn geglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up have one shape");
    let n8 = gate.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: 8 f32s at i < n8 <= len in both slices.
        unsafe {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let x2 = _mm256_mul_ps(x, x);
            let inner = _mm256_fmadd_ps(x2, _mm256_set1_ps(0.044_715), _mm256_set1_ps(1.0));
            let minus_2y = _mm256_mul_ps(_mm256_mul_ps(x, inner), _mm256_set1_ps(-2.0 * 0.797_884_6));
            let gelu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), exp8(minus_2y)));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(gelu, _mm256_loadu_ps(up.as_ptr().add(i))));
        }
    }
    crate::ops::geglu(&mut gate[n8..], &up[n8..]);
}

/// `gate = silu(gate) * up`, `silu(x) = x / (1 + e^(-x))` through [`exp8`], whose clamp keeps
/// both tails finite (`x` far right; far left a value below 1e-36 in magnitude where the scalar
/// reference gives -0).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up have one shape");
    let n8 = gate.len() / 8 * 8;
    let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
    for i in (0..n8).step_by(8) {
        // SAFETY: 8 f32s at i < n8 <= len in both slices.
        unsafe {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(i))));
        }
    }
    crate::ops::swiglu(&mut gate[n8..], &up[n8..]);
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` is 8 f32s.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr()))) };
    }
    super::scalar::exp(chunks.into_remainder());
}
