//! The 16-row AVX-512 VNNI kernel ([`gemv16`]): sixteen weight rows against one to
//! [`super::GEMV_TOKENS`] tokens, the batch-1 decode path. The lanes are rows where `gemm16`'s
//! lanes are tokens; every lane does exactly the float arithmetic of the single-token dot of
//! `avx512.rs` (its module docs), so the result equals that dot bit for bit.

use super::avx2_group::q6k_quants;
use super::avx512::{groups, has_offset, layout, row_bytes};
use super::avx512::{Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
use crate::quant::{BlockQ8, QuantType};
use std::arch::x86_64::*;

/// Sixteen consecutive weight rows (`w` holds them back to back, `rb` bytes each) against one
/// token: the weight-stationary counterpart of `gemm16` for a single token.
///
/// The lanes are the rows. Each row's quants of a block pair go through one `vpdpbusd`, a
/// transpose-and-add tree turns the 16 rows' partial sums into one vector of per-row integer
/// sums per block, and from there every lane does exactly the float arithmetic of a
/// `gemm16` lane (module docs of `avx512.rs`), so the result equals the single-token dot bit for bit.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv16(dt: QuantType, w: &[u8], rb: usize, a: &[&[BlockQ8]], out: &mut [[f32; 16]]) {
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
        q => panic!(
            "gemv16 takes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K, not {q:?} (see QuantType::has_gemv16)"
        ),
    }
}

/// [`gemv16_kind`] for as many tokens as `a` holds.
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemv16_tokens<const KIND: u8>(w: &[u8], rb: usize, a: &[&[BlockQ8]], out: &mut [[f32; 16]]) {
    assert_eq!(a.len(), out.len(), "one output per token");
    match *a {
        // SAFETY: same features as this function's caller guarantees.
        [t0] => out.copy_from_slice(&unsafe { gemv16_kind::<KIND, 1>(w, rb, [t0]) }),
        // SAFETY: as above.
        [t0, t1] => out.copy_from_slice(&unsafe { gemv16_kind::<KIND, 2>(w, rb, [t0, t1]) }),
        // SAFETY: as above.
        [t0, t1, t2] => out.copy_from_slice(&unsafe { gemv16_kind::<KIND, 3>(w, rb, [t0, t1, t2]) }),
        // SAFETY: as above.
        [t0, t1, t2, t3] => out.copy_from_slice(&unsafe { gemv16_kind::<KIND, 4>(w, rb, [t0, t1, t2, t3]) }),
        _ => panic!("gemv16 takes 1 to {} tokens, not {}", super::GEMV_TOKENS, a.len()),
    }
}

/// The quants of blocks `b` (lanes 0..8) and `b + 1` (lanes 8..16, zeros when `pair` is false)
/// of the row starting at `row`, as bytes in element order (`vpdpbusd`'s unsigned operand;
/// Q8_0 biased by +128; Q5_0's fifth bits from its 32-bit `qh`, byte `e` of the pair taking
/// bit `e` of `qh_b | qh_(b+1) << 32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn weight_pair<const KIND: u8>(row: *const u8, b: usize, pair: bool) -> __m512i {
    let (bb, q) = layout(KIND);
    if KIND == Q6K {
        let (blk, j) = (row.wrapping_add(b / 8 * bb), b % 8);
        // SAFETY: the caller guarantees the super-block (bb bytes) lies inside the row.
        let blk = unsafe { std::slice::from_raw_parts(blk, bb) };
        return _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q6k_quants(blk, j)), q6k_quants(blk, j + 1));
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
    let p0 = row.wrapping_add(b * bb + q);
    let p1 = p0.wrapping_add(bb);
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

/// Sixteen rows against `N` tokens: each block pair of the rows is loaded, unpacked and its
/// scales gathered once, then multiplied with every token; per token the arithmetic is exactly
/// the single-token one (module docs).
///
/// # Safety
/// The CPU must support the features of `avx512::kernels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemv16_kind<const KIND: u8, const N: usize>(w: &[u8], rb: usize, a: [&[BlockQ8]; N]) -> [[f32; 16]; N] {
    let (bb, _) = layout(KIND);
    let nb = a[0].len();
    assert!(
        a.iter().all(|t| t.len() == nb)
            && nb.is_multiple_of(groups(KIND))
            && row_bytes(KIND, nb) <= rb
            && w.len() >= 16 * rb
            && 16 * rb < i32::MAX as usize,
        "16 rows of {nb} blocks"
    );
    let row_at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(rb as i32),
    );
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let mut off = [[_mm512_setzero_ps(); 4]; N];
    // The dword at byte `at` of every row: one 32-bit gather.
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
        if KIND == Q6K {
            // d is the high half of the dword at 206 (the block's last 4 bytes).
            return (f16_at(_mm512_srli_epi32::<16>(sbd[0])), _mm512_setzero_ps());
        }
        if matches!(KIND, Q4K | Q5K) {
            let j = c % 8;
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
            return (d, _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(mn)));
        }
        // Q4_0/Q8_0: d and 2 quant bytes; Q4_1: d and m; Q5_0: d and half of qh.
        let g = gather(c * bb);
        let d = f16_at(g);
        let m = match KIND {
            Q4_1 | Q5_1 => f16_at(_mm512_srli_epi32::<16>(g)),
            // As `scales`: the quants' offset times d.
            Q5_0 => _mm512_mul_ps(_mm512_set1_ps(-16.0), d),
            Q8_0 => _mm512_setzero_ps(),
            _ => _mm512_mul_ps(_mm512_set1_ps(-8.0), d),
        };
        (d, m)
    };
    // Block `c`'s float step for the 16 rows and token activations `a`, as one gemm16 lane.
    let step =
        |a: &[BlockQ8], c: usize, (d, m): (__m512, __m512), mut isum: __m512i, acc: &mut __m512, off: &mut __m512| {
            if KIND == Q8_0 {
                let asum: i32 = a[c].qs.iter().map(|&q| i32::from(q)).sum();
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(asum << 7));
            }
            let sc = _mm512_mul_ps(_mm512_set1_ps(a[c].d), d);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, *acc);
            if has_offset(KIND) {
                *off = _mm512_fmadd_ps(m, _mm512_set1_ps(a[c].s), *off);
            }
        };
    // The next 16 rows are fetched while these are computed, a share per block pair.
    let (lines, steps) = (16 * rb / 64, nb.div_ceil(2));
    let next = w.as_ptr().wrapping_add(16 * rb);
    let mut b = 0;
    while b < nb {
        let pair = b + 1 < nb;
        let s = b / 2;
        for l in s * lines / steps..(s + 1) * lines / steps {
            // A prefetch never faults: the address may lie past `w`.
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(l * 64).cast());
        }
        // Scales first: the gathers' latency hides behind the integer work.
        if matches!(KIND, Q4K | Q5K) && b % 8 == 0 {
            sbd = std::array::from_fn(|i| gather(b / 8 * bb + 4 * i));
        }
        if KIND == Q6K && b % 8 == 0 {
            sbd[0] = gather(b / 8 * bb + 206);
        }
        let g0 = scales16(b, &sbd);
        let g1 = if pair { scales16(b + 1, &sbd) } else { (_mm512_setzero_ps(), _mm512_setzero_ps()) };
        let wq: [__m512i; 16] = std::array::from_fn(|i| {
            // SAFETY: row i's blocks b (and b + 1 when `pair`) lie inside `w`: b + 1 < nb,
            // nb * bb <= rb and 16 rows of rb bytes (asserted above).
            unsafe { weight_pair::<KIND>(w.as_ptr().add(i * rb), b, pair) }
        });
        // Q6_K: per row, the scales of the four halves of the pair in its dword lanes
        // ([sc0 x4, sc1 x4] of group b, then of b + 1), to scale each dword's sum exactly.
        let q6_scales: [__m512i; 16] = if KIND == Q6K {
            let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            std::array::from_fn(|i| {
                let at = i * rb + b / 8 * bb + 192 + 2 * (b % 8);
                // SAFETY: the 4 scale bytes at `at` lie in row i's super-block, inside `w`
                // (as the weight pair above).
                let four = unsafe { w.as_ptr().add(at).cast::<i32>().read_unaligned() };
                _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four))))
            })
        } else {
            [_mm512_setzero_si512(); 16]
        };
        // b is even: its accumulator is 0 or 2, b + 1's the next one.
        let k = b % 4;
        for t in 0..N {
            let at = a[t];
            // SAFETY: `qs` is 32 bytes.
            let lo = unsafe { _mm256_loadu_si256(at[b].qs.as_ptr().cast()) };
            let hi = if pair {
                // SAFETY: as above (block b + 1 exists when `pair`).
                unsafe { _mm256_loadu_si256(at[b + 1].qs.as_ptr().cast()) }
            } else {
                _mm256_setzero_si256()
            };
            let act = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let mut v: [__m512i; 16] = std::array::from_fn(|i| _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[i], act));
            if KIND == Q6K {
                // Per dword: (Σ q a - 32 Σ a) times its half's scale, as the single-token dot.
                let ones = _mm512_set1_epi8(1);
                let asum32 = _mm512_slli_epi32::<5>(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, act));
                for (x, sc) in v.iter_mut().zip(&q6_scales) {
                    *x = _mm512_mullo_epi32(_mm512_sub_epi32(*x, asum32), *sc);
                }
            }
            let (s0, s1) = reduce16(&v);
            let ((a0, a1), (o0, o1)) = (acc[t].split_at_mut(k + 1), off[t].split_at_mut(k + 1));
            step(at, b, g0, s0, &mut a0[k], &mut o0[k]);
            if pair {
                step(at, b + 1, g1, s1, &mut a1[0], &mut o1[0]);
            }
        }
        b += 2;
    }
    std::array::from_fn(|t| {
        let (acc, off) = (&acc[t], &off[t]);
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let o = _mm512_add_ps(_mm512_add_ps(off[0], off[1]), _mm512_add_ps(off[2], off[3]));
        let mut out = [0f32; 16];
        // SAFETY: 16 f32s.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(s, o)) };
        out
    })
}
