//! The 16-row AVX-512 VNNI kernel on packed weights ([`crate::pack`]): the weight-stationary
//! product of `avx512_gemv.rs` with its unpacking and transposition done once at load time.
//! A block of the 16 rows is then a few vector loads (on whole cache lines wherever the rows
//! hold whole units, `crate::pack`), and a token one `vpdpbusd` per
//! weight dword with its activation dword broadcast. Lane `i` is row `i`, and every lane does
//! exactly the float arithmetic of the single-token dot (`avx512.rs`), so the result equals
//! that dot on the unpacked row bit for bit.

use super::avx512_super::{act, super_block, super_block_16};
use super::lane::{has_offset, signed, IQ4NL, IQ4XS, MXFP4, Q2K, Q3K, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
use super::{prefetch, Acts, Ahead, GEMV_TOKENS};
use crate::pack::{unit_blocks, unit_offsets};
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
        QuantType::Q8_0 => unsafe { packed_kind::<Q8_0>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q4_0 => unsafe { packed_kind::<Q4_0>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q4_1 => unsafe { packed_kind::<Q4_1>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q5_0 => unsafe { packed_kind::<Q5_0>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q5_1 => unsafe { packed_kind::<Q5_1>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::IQ4NL => unsafe { packed_kind::<IQ4NL>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q4K => unsafe { packed_kind::<Q4K>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q5K => unsafe { packed_kind::<Q5K>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q6K => unsafe { packed_kind::<Q6K>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q3K => unsafe { packed_kind::<Q3K>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::Q2K => unsafe { packed_kind::<Q2K>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::IQ4XS => unsafe { packed_kind::<IQ4XS>(dt, w, rb, a, out) },
        // SAFETY: as above.
        QuantType::MXFP4 => unsafe { packed_kind::<MXFP4>(dt, w, rb, a, out) },
    }
}

/// See [`gemv16_packed`] (`q` is `KIND`'s type): a unit at a time, a pair of 32-weight blocks
/// or a super-block.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
    // Per token, the four block accumulators of the products and of the offsets (the
    // single-token dot's `acc[b % 4]`, `off[b % 4]`); zeroed for the tokens of the call only.
    let mut sums = [const { MaybeUninit::<[[__m512; 4]; 2]>::uninit() }; GEMV_TOKENS];
    let sums = super::zeroed_sums(&mut sums, n, _mm512_setzero_ps());
    // Which field holds the quants, and Q5's fifth bits (the per-16 kinds name theirs in
    // `avx512_super`).
    let (quants, fifth) = match KIND {
        Q4_1 => (2, 0),
        Q5_0 => (2, 1),
        Q5_1 => (3, 2),
        Q4K => (2, 0),
        Q5K => (3, 2),
        IQ4XS => (2, 0),
        // The per-16 kinds read their fields by number (`avx512_super`).
        Q6K | Q3K | Q2K => (0, 0),
        _ => (1, 0),
    };
    // Where field k of a unit's block c starts, for a pair and for a lone last block.
    let (at2, at1) = (unit_offsets(q, 2), unit_offsets(q, 1));
    // The next group is fetched into L2 while this one is computed, a share per unit, spread
    // as the AVX2 kernel's is (`avx2_packed.rs`): a super-block's share over its groups, Q8_0's
    // over the pair's blocks; the other pairs' few lines go out at once.
    let per = if g == 1 { 2 } else { g };
    let (lines, steps) = (16 * rb / 64, nb.div_ceil(per));
    let next = w.as_ptr().wrapping_add(16 * rb);
    let mut b = 0;
    while b < nb {
        let pair = 1 + usize::from(b + 1 < nb);
        let s = b / per;
        let share = (next, s * lines / steps..(s + 1) * lines / steps);
        // SAFETY: the unit's blocks b .. b + pair of the 16 rows lie inside `w` (asserted
        // length; `pack` module docs), and the features are this function's.
        unsafe {
            if matches!(KIND, Q6K | Q3K | Q2K) {
                // Super-block `sb` is block c of its unit (Q6_K and Q3_K: pairs).
                let (sb, per) = (b / g, unit_blocks(q));
                let (u0, c) = (sb / per * per, sb % per);
                let at = if per.min(nb / g - u0) == 2 { at2 } else { at1 };
                super_block_16::<KIND>(w.as_ptr().add(16 * bb * u0), at, c, a, (b, &share), sums);
                b += g;
                continue;
            }
            let unit = w.as_ptr().add(16 * bb * (b / g));
            if g > 1 {
                super_block::<KIND>(unit, at1, (quants, fifth), a, (b, &share), sums);
                b += g;
                continue;
            }
            if pair == 2 {
                unit_of::<KIND, 2>(unit, at2, (quants, fifth), a, (b, &share), sums);
            } else {
                unit_of::<KIND, 1>(unit, at1, (quants, fifth), a, (b, &share), sums);
            }
        }
        b += pair;
    }
    for (out, [acc, off]) in out.iter_mut().zip(sums.iter()) {
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let o = _mm512_add_ps(_mm512_add_ps(off[0], off[1]), _mm512_add_ps(off[2], off[3]));
        // SAFETY: 16 f32s.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(s, o)) };
    }
}

/// One unit of [`packed_kind`]: blocks `b .. b + N` of the 16 rows (a pair, or a lone last
/// block), starting at `unit`, against every token, into the tokens' accumulators, fetching
/// the unit's share `ahead` of the next group.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`, and the unit's `N` blocks of the
/// 16 rows must lie at `unit` (`at`: where each field of each block starts in it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unit_of<const KIND: u8, const N: usize>(
    unit: *const u8,
    at: &[[usize; 2]; 4],
    (quants, fifth): (usize, usize),
    a: &[Acts<'_>],
    (b, ahead): (usize, &Ahead),
    sums: &mut [[[__m512; 4]; 2]],
) {
    let nib = _mm512_set1_epi8(0x0f);
    // Q8_0's share (17 lines a pair) in 2N parts, one with each block's loads and one with
    // its products for the first token; the other kinds' few lines go out at once.
    let parts = if KIND == Q8_0 { 2 * N } else { 1 };
    // Field k of block b + c for the 16 rows (`pack` module docs); every offset lies
    // inside the group (asserted length) by the layout's construction.
    let field = |k: usize, c: usize| unit.wrapping_add(at[k][c]);
    let f16s = |k: usize, c: usize| {
        // SAFETY: 16 f16s at field k (module docs of `pack`).
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(field(k, c).cast()) })
    };
    let vector = |k: usize, c: usize, m: usize| {
        // SAFETY: dword m of field k of the 16 rows, inside the group as above.
        unsafe { _mm512_loadu_si512(field(k, c).add(64 * m).cast()) }
    };
    // Per block of the pair: the weights' scale d and offset factor m (as `scales16` of
    // the unpacked kernel computes them), and the quants: wq[c][h][m] holds the bytes of
    // weights 16 h + 4 m .. 16 h + 4 m + 4 of every row.
    let mut d = [_mm512_setzero_ps(); N];
    let mut off = [_mm512_setzero_ps(); N];
    let mut wq = [[[_mm512_setzero_si512(); 4]; 2]; N];
    // Plain indexed loops: written with `array::from_fn` and closures this measured 40% slower
    // (a product of one token on Q4_1), the vectors going through memory.
    #[allow(clippy::needless_range_loop)]
    for c in 0..N {
        if c < parts {
            prefetch(ahead, c, parts);
        }
        d[c] = if KIND == MXFP4 {
            // SAFETY: the 16 rows' exponent bytes at field 0 (module docs of `pack`).
            let e = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(field(0, c).cast()) });
            super::avx512_gemv::e8m0_half16(e)
        } else {
            f16s(0, c)
        };
        off[c] = match KIND {
            Q4_1 | Q5_1 => f16s(1, c),
            Q5_0 => _mm512_mul_ps(_mm512_set1_ps(-16.0), d[c]),
            Q4_0 => _mm512_mul_ps(_mm512_set1_ps(-8.0), d[c]),
            _ => _mm512_setzero_ps(),
        };
        if KIND == Q8_0 {
            for m in 0..4 {
                wq[c][0][m] = vector(quants, c, m);
                wq[c][1][m] = vector(quants, c, 4 + m);
            }
            continue;
        }
        // Quant dword m of every row: weights 4 m .. 4 m + 4 in its low nibbles, 16 + 4 m ..
        // in its high ones.
        for m in 0..4 {
            let v = vector(quants, c, m);
            let mut lh = [_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib)];
            if matches!(KIND, Q5_0 | Q5_1) {
                // The fifth bits of these weights sit at bits 8 k + 2 m + h (`pack`).
                let qh = vector(fifth, c, 0);
                for (h, x) in lh.iter_mut().enumerate() {
                    let at = _mm512_srl_epi32(qh, _mm_cvtsi32_si128((2 * m + h) as i32));
                    let bit = _mm512_slli_epi32::<4>(_mm512_and_si512(at, _mm512_set1_epi8(1)));
                    *x = _mm512_or_si512(*x, bit);
                }
            }
            if matches!(KIND, IQ4NL | MXFP4) {
                // The code book's signed values, biased by +128 as Q8_0's quants.
                let values = if KIND == MXFP4 { &crate::quant::MXFP4_VALUES } else { &crate::quant::IQ4_VALUES };
                // SAFETY: the code books are 16 bytes.
                let book = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(values.as_ptr().cast()) });
                lh = lh.map(|x| _mm512_xor_si512(_mm512_shuffle_epi8(book, x), _mm512_set1_epi8(-128)));
            }
            wq[c][0][m] = lh[0];
            wq[c][1][m] = lh[1];
        }
    }
    for (t, at) in a.iter().enumerate() {
        for c in 0..N {
            if t == 0 && N + c < parts {
                prefetch(ahead, N + c, parts);
            }
            let blk = &at.q8[b + c];
            let mut isum = _mm512_setzero_si512();
            for (h, wh) in wq[c].iter().enumerate() {
                for (m, &wv) in wh.iter().enumerate() {
                    isum = _mm512_dpbusd_epi32(isum, wv, act(blk, 4 * h + m));
                }
            }
            if signed(KIND) {
                // The quants were biased by +128: 128 Σa comes back off.
                let [lo, hi] = at.halves[b + c];
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32((lo + hi) << 7));
            }
            let [acc, offs] = &mut sums[t];
            let k = (b + c) % 4;
            let sc = _mm512_mul_ps(_mm512_set1_ps(blk.d), d[c]);
            acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[k]);
            if has_offset(KIND) {
                offs[k] = _mm512_fmadd_ps(off[c], _mm512_set1_ps(blk.s), offs[k]);
            }
        }
    }
}
