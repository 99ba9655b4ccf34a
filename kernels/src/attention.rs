//! Attention of one query head over a paged K/V cache (the PagedAttention layout of vLLM).
//!
//! One layer's cache is a pool of blocks, each `[n_kv_heads][block_size][head_dim]` f16 for K and
//! the same for V, so the keys of one head within a block are contiguous. A sequence reaches its
//! positions through its block table: position `p` lives in block `table[p / block_size]`, slot
//! `p % block_size`.

use crate::cpu::Kernels;
use crate::pool::{SyncPtr, ThreadPool};
use half::f16;
use std::cell::RefCell;

/// One layer's K and V block pools.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv<'_> {
    /// Offset of `(block, kv_head, slot)` in a pool.
    #[inline]
    pub fn offset(
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        block: usize,
        kv_head: usize,
        slot: usize,
    ) -> usize {
        ((block * n_kv_heads + kv_head) * block_size + slot) * head_dim
    }
}

/// Positions per piece: a query attends to its context a piece of at least this many positions
/// at a time (at most [`MAX_PIECES`] pieces of equal length), each piece a task of its own, and
/// the pieces are merged in order (split-K attention, as FlashDecoding and vLLM's PagedAttention
/// v2 do). A batch of one token then keeps every thread busy even with fewer KV heads than
/// threads (SmolLM2 has 3, Gemma 3 270M one), and a long context is spread over all of them.
/// How a range is split depends on the range alone, never on the batch, so a token's result is
/// the same in any batch, bit for bit.
pub const PIECE: usize = 64;

/// The most pieces one query's range is split into.
pub const MAX_PIECES: usize = 16;

/// Most floats of piece slots one dispatch fills (4 MiB): a larger batch is attended in waves
/// of tokens, so a long prompt's pieces never take more memory than this.
const WAVE_FLOATS: usize = 1 << 20;

/// How the range `start..ctx_len` is split: the number of pieces and the length of each (the
/// last may be shorter).
fn pieces(c: &QueryCtx<'_>) -> (usize, usize) {
    let range = c.ctx_len - c.start;
    let n = range.div_ceil(PIECE).min(MAX_PIECES);
    (n, range.div_ceil(n))
}

/// The block runs of positions `lo..hi` of KV head `kv_head`: (pool offset, index from `lo`,
/// count) for each block the range touches.
fn spans<'t>(
    kv: &PagedKv<'_>,
    table: &'t [u32],
    (lo, hi): (usize, usize),
    kv_head: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + 't {
    let (bs, hd, nkv) = (kv.block_size, kv.head_dim, kv.n_kv_heads);
    (lo / bs..hi.div_ceil(bs)).map(move |b| {
        let (from, to) = ((b * bs).max(lo), ((b + 1) * bs).min(hi));
        (PagedKv::offset(bs, nkv, hd, table[b] as usize, kv_head, from - b * bs), from - lo, to - from)
    })
}

/// The `g` heads' scores over positions `lo..hi` (`scores`, `[position][head]`), shifted by
/// each head's maximum and exponentiated; returns each head's maximum and sum of exponentials.
#[allow(clippy::too_many_arguments)]
fn weights(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    range: (usize, usize),
    kv_head: usize,
    q: &[f32],
    g: usize,
    scale: f32,
    scores: &mut [f32],
) -> ([f32; 64], [f32; 64]) {
    let hd = kv.head_dim;
    for (o, at, n) in spans(kv, table, range, kv_head) {
        (k.attn_scores)(&kv.k[o..o + n * hd], q, hd, g, scale, &mut scores[at * g..(at + n) * g]);
    }
    // Each head's column (stride g): shift by the column max, one vector exp over everything.
    let mut max = [f32::NEG_INFINITY; 64];
    for row in scores.chunks_exact(g) {
        max[..g].iter_mut().zip(row).for_each(|(m, &v)| *m = m.max(v));
    }
    for row in scores.chunks_exact_mut(g) {
        row.iter_mut().zip(&max[..g]).for_each(|(v, m)| *v -= m);
    }
    (k.exp)(scores);
    let mut sum = [0f32; 64];
    for row in scores.chunks_exact(g) {
        sum[..g].iter_mut().zip(row).for_each(|(s, &v)| *s += v);
    }
    (max, sum)
}

/// `out` (`g × head_dim`, zeroed first) = the values of positions `lo..hi` weighted by `p`.
#[allow(clippy::too_many_arguments)]
fn weighted_values(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    range: (usize, usize),
    kv_head: usize,
    p: &[f32],
    g: usize,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    out.fill(0.0);
    for (o, at, n) in spans(kv, table, range, kv_head) {
        (k.attn_values)(&kv.v[o..o + n * hd], &p[at * g..(at + n) * g], hd, g, out);
    }
}

/// Causal attention of the `g` query heads that share KV head `kv_head` (GQA), over positions
/// `start..ctx_len` of the sequence whose blocks are `table` (`start > 0` for a sliding
/// window), in one piece. `q` holds the `g` rotated query vectors back to back (`g × head_dim`);
/// the results go to `out` in the same layout. `scores` is scratch of at least `(ctx_len -
/// start) * g`. Each key and value is converted from f16 once per group.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    (start, ctx_len): (usize, usize),
    kv_head: usize,
    q: &[f32],
    g: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!((1..=64).contains(&g), "at most 64 query heads per KV head");
    assert!(start < ctx_len, "a query sees at least its own position");
    let scores = &mut scores[..(ctx_len - start) * g];
    let (_, sum) = weights(k, kv, table, (start, ctx_len), kv_head, q, g, scale, scores);
    for row in scores.chunks_exact_mut(g) {
        row.iter_mut().zip(&sum[..g]).for_each(|(v, s)| *v /= s);
    }
    weighted_values(k, kv, table, (start, ctx_len), kv_head, scores, g, out);
}

/// One piece of a split query (see [`PIECE`]): `out` gets the `g` heads' values over `lo..hi`
/// weighted by unnormalized exponentials, then each head's maximum and sum of exponentials.
#[allow(clippy::too_many_arguments)]
fn attend_piece(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    (lo, hi): (usize, usize),
    kv_head: usize,
    q: &[f32],
    g: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let scores = &mut scores[..(hi - lo) * g];
    let (max, sum) = weights(k, kv, table, (lo, hi), kv_head, q, g, scale, scores);
    let (values, stats) = out.split_at_mut(g * hd);
    weighted_values(k, kv, table, (lo, hi), kv_head, scores, g, values);
    stats[..g].copy_from_slice(&max[..g]);
    stats[g..2 * g].copy_from_slice(&sum[..g]);
}

/// Merges the pieces of one query's `g` heads in order (each `g × head_dim` values, `g` maxima,
/// `g` sums, as [`attend_piece`] wrote them): every piece is rescaled to the overall maximum.
fn merge_pieces(pieces: &[f32], g: usize, hd: usize, out: &mut [f32]) {
    let slot = g * hd + 2 * g;
    for j in 0..g {
        let max = pieces.chunks_exact(slot).map(|p| p[g * hd + j]).fold(f32::NEG_INFINITY, f32::max);
        let o = &mut out[j * hd..(j + 1) * hd];
        o.fill(0.0);
        let mut sum = 0.0;
        for p in pieces.chunks_exact(slot) {
            let f = (p[g * hd + j] - max).exp();
            sum += f * p[g * hd + g + j];
            o.iter_mut().zip(&p[j * hd..(j + 1) * hd]).for_each(|(o, &v)| *o += f * v);
        }
        o.iter_mut().for_each(|v| *v /= sum);
    }
}

/// Where one query token attends: its sequence's block table and the causal range of positions
/// it sees.
#[derive(Clone, Copy, Debug)]
pub struct QueryCtx<'a> {
    pub table: &'a [u32],
    /// The query's position plus one: it sees positions `start..ctx_len`.
    pub ctx_len: usize,
    /// The first position it sees: 0, or where a sliding window begins.
    pub start: usize,
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's slots for the pieces of split queries, kept between calls.
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention for a whole batch: `q` is `[tokens][n_heads * head_dim]`, `ctx[t]` says what token
/// `t` sees, `out` has the shape of `q`; scores are `scale * q · k`. Parallel over (token, KV
/// head, piece) triples ([`PIECE`]), then over the split pairs' merges, in waves of tokens
/// whose pieces fit a bounded scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend_batch(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    n_heads: usize,
    scale: f32,
    q: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let qdim = n_heads * hd;
    let group = n_heads / kv.n_kv_heads;
    assert!(group > 0 && group <= 64 && n_heads.is_multiple_of(kv.n_kv_heads), "head grouping");
    assert_eq!(q.len(), ctx.len() * qdim, "query shape");
    assert_eq!(out.len(), q.len(), "output shape");
    for c in ctx {
        assert!(c.start < c.ctx_len && c.ctx_len <= c.table.len() * kv.block_size, "context exceeds block table");
        // The blocks the query reads (a window's earlier entries may be released).
        assert!(
            c.table[c.start / kv.block_size..c.ctx_len.div_ceil(kv.block_size)].iter().all(|&b| (b as usize + 1)
                * kv.n_kv_heads
                * kv.block_size
                * hd
                <= kv.k.len().min(kv.v.len())),
            "block id outside the pool"
        );
    }
    attend_in_waves(pool, k, kv, (n_heads, scale), q, ctx, out, WAVE_FLOATS);
}

/// [`attend_batch`] (its checks done) in waves of tokens whose piece slots fit `wave_floats`
/// (at least one token each).
#[allow(clippy::too_many_arguments)]
fn attend_in_waves(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    (n_heads, scale): (usize, f32),
    q: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
    wave_floats: usize,
) {
    let (hd, group) = (kv.head_dim, n_heads / kv.n_kv_heads);
    let (qdim, slot) = (n_heads * hd, group * hd + 2 * group);
    let mut t0 = 0;
    while t0 < ctx.len() {
        let (mut t1, mut floats) = (t0, 0);
        while t1 < ctx.len() {
            let need = kv.n_kv_heads * pieces(&ctx[t1]).0 * slot;
            if t1 > t0 && floats + need > wave_floats {
                break;
            }
            (t1, floats) = (t1 + 1, floats + need);
        }
        let (q, out) = (&q[t0 * qdim..t1 * qdim], &mut out[t0 * qdim..t1 * qdim]);
        attend_wave(pool, k, kv, (n_heads, scale), q, &ctx[t0..t1], out);
        t0 = t1;
    }
}

/// One wave of [`attend_batch`]: a task per (token, KV head, piece), then the merges.
fn attend_wave(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    (n_heads, scale): (usize, f32),
    q: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
) {
    let (hd, nkv) = (kv.head_dim, kv.n_kv_heads);
    let (qdim, group) = (n_heads * hd, n_heads / nkv);
    // Tasks: for each token, for each KV head, for each piece of its range. `first[t]` is token
    // t's first task.
    let mut first = Vec::with_capacity(ctx.len() + 1);
    let mut tasks = 0;
    for c in ctx {
        first.push(tasks);
        tasks += nkv * pieces(c).0;
    }
    first.push(tasks);
    let split = tasks > ctx.len() * nkv;
    // A split query's pieces each fill a slot of `partial` (indexed by task).
    let slot = group * hd + 2 * group;
    PARTIALS.with_borrow_mut(|partial| {
        if split && partial.len() < tasks * slot {
            partial.resize(tasks * slot, 0.0);
        }
        let (dst, pieces_at) = (SyncPtr(out.as_mut_ptr()), SyncPtr(partial.as_mut_ptr()));
        let task = |i: usize| {
            let t = first.partition_point(|&f| f <= i) - 1;
            let (c, (n, len)) = (ctx[t], pieces(&ctx[t]));
            let (g, piece) = ((i - first[t]) / n, (i - first[t]) % n);
            let off = t * qdim + g * group * hd;
            let q = &q[off..off + group * hd];
            SCORES.with_borrow_mut(|scores| {
                if scores.len() < len * group {
                    scores.resize(len * group, 0.0);
                }
                if n == 1 {
                    // SAFETY: task (t, g) is the only writer of out[off..off + group * hd] (the
                    // query heads of KV head g for token t), which lies inside `out` (asserted
                    // shape); `out` outlives `pool.run`.
                    let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(off), group * hd) };
                    attend_group(k, kv, c.table, (c.start, c.ctx_len), g, q, group, scale, scores, o);
                } else {
                    // SAFETY: task i is the only writer of slot i, which lies inside `partial`
                    // (sized to `tasks` slots above when any query is split); `partial` outlives
                    // `pool.run`.
                    let o = unsafe { std::slice::from_raw_parts_mut(pieces_at.get().add(i * slot), slot) };
                    let lo = c.start + piece * len;
                    attend_piece(k, kv, c.table, (lo, (lo + len).min(c.ctx_len)), g, q, group, scale, scores, o);
                }
            });
        };
        pool.run(tasks, &task);
        if !split {
            return;
        }
        // Merge each split (token, KV head) pair's pieces, in order.
        let partial = &*partial;
        let merge = |i: usize| {
            let (t, g) = (i / nkv, i % nkv);
            let n = pieces(&ctx[t]).0;
            if n > 1 {
                let off = t * qdim + g * group * hd;
                // SAFETY: pair (t, g) is the only writer of out[off..off + group * hd] (as
                // above), and the pieces are no longer written.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(off), group * hd) };
                let at = first[t] + g * n;
                merge_pieces(&partial[at * slot..(at + n) * slot], group, hd, o);
            }
        };
        pool.run(ctx.len() * nkv, &merge);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paged_attention_equals_contiguous_attention() {
        // Two blocks of 4 slots, stored out of order in a pool of 3, one KV head of dim 8.
        let (bs, hd, nkv, ctx) = (4, 8, 1, 6);
        let keys: Vec<Vec<f32>> = (0..ctx).map(|p| (0..hd).map(|i| ((p * 3 + i) % 5) as f32 / 5.0).collect()).collect();
        let vals: Vec<Vec<f32>> = (0..ctx).map(|p| (0..hd).map(|i| ((p + i * 2) % 7) as f32).collect()).collect();
        let table = [2u32, 0];
        let mut kp = vec![f16::ZERO; 3 * bs * hd];
        let mut vp = kp.clone();
        for p in 0..ctx {
            let o = PagedKv::offset(bs, nkv, hd, table[p / bs] as usize, 0, p % bs);
            for i in 0..hd {
                kp[o + i] = f16::from_f32(keys[p][i]);
                vp[o + i] = f16::from_f32(vals[p][i]);
            }
        }
        // Two query heads share the KV head.
        let g = 2;
        let q: Vec<f32> = (0..g * hd).map(|i| (i % 11) as f32 / 4.0 - 1.0).collect();
        let kv = PagedKv { k: &kp, v: &vp, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        // Whole context, and sliding windows starting inside the first block, at a block
        // boundary and at the last position.
        for (start, kern) in [0, 1, 3, 4, 5].into_iter().flat_map(|s| [(s, Kernels::scalar()), (s, Kernels::detect())])
        {
            let mut scores = vec![0.0; ctx * g];
            let mut out = vec![0.0; g * hd];
            attend_group(&kern, &kv, &table, (start, ctx), 0, &q, g, 0.5, &mut scores, &mut out);
            // Contiguous reference with the same f16-rounded values, one head at a time.
            let r = |x: f32| f16::from_f32(x).to_f32();
            for j in 0..g {
                let qj = &q[j * hd..(j + 1) * hd];
                let mut w: Vec<f32> = keys[start..]
                    .iter()
                    .map(|kk| kk.iter().zip(qj).map(|(a, b)| r(*a) * b).sum::<f32>() * 0.5)
                    .collect();
                crate::ops::softmax(&mut w);
                for i in 0..hd {
                    let want: f32 = (start..ctx).map(|p| w[p - start] * r(vals[p][i])).sum();
                    assert!((want - out[j * hd + i]).abs() < 1e-4, "start {start}: {want} vs {}", out[j * hd + i]);
                }
            }
        }
    }

    #[test]
    fn split_queries_match_the_reference_in_any_batch() {
        // One sequence of 1,300 positions, two KV heads of dim 8 with two query heads each, its
        // 82 blocks of 16 stored in shuffled order. Queries see ranges of one piece, exactly
        // one, just over one, several, and more than `MAX_PIECES` of `PIECE` (longer pieces),
        // from 0 and from inside a window.
        let (bs, hd, nkv, n_heads, len): (usize, usize, usize, usize, usize) = (16, 8, 2, 4, 1300);
        let nblocks = len.div_ceil(bs);
        let table: Vec<u32> = (0..nblocks as u32).map(|b| (b * 7 + 3) % nblocks as u32).collect();
        let val =
            |p: usize, h: usize, i: usize, salt: usize| ((p * 31 + h * 17 + i * 7 + salt) % 23) as f32 / 11.0 - 1.0;
        let mut kp = vec![f16::ZERO; nblocks * nkv * bs * hd];
        let mut vp = kp.clone();
        for p in 0..len {
            for h in 0..nkv {
                let o = PagedKv::offset(bs, nkv, hd, table[p / bs] as usize, h, p % bs);
                for i in 0..hd {
                    kp[o + i] = f16::from_f32(val(p, h, i, 0));
                    vp[o + i] = f16::from_f32(val(p, h, i, 5));
                }
            }
        }
        let kv = PagedKv { k: &kp, v: &vp, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let ranges = [
            (0, 1),
            (0, PIECE),
            (0, PIECE + 1),
            (0, 130),
            (0, len),
            (37, 230),
            (PIECE, 2 * PIECE + 3),
            (100, 100 + MAX_PIECES * PIECE + 1),
        ];
        let ctx: Vec<QueryCtx<'_>> =
            ranges.iter().map(|&(start, ctx_len)| QueryCtx { table: &table, ctx_len, start }).collect();
        let qdim = n_heads * hd;
        let q: Vec<f32> = (0..ranges.len() * qdim).map(|i| ((i * 13) % 17) as f32 / 8.0 - 1.0).collect();
        let pool = ThreadPool::new(2);
        for kern in [Kernels::scalar(), Kernels::detect()] {
            let mut all = vec![0.0; q.len()];
            attend_batch(&pool, &kern, &kv, n_heads, 0.3, &q, &ctx, &mut all);
            // In waves of a token or two, the same bits.
            let mut waves = vec![0.0; q.len()];
            attend_in_waves(
                &pool,
                &kern,
                &kv,
                (n_heads, 0.3),
                &q,
                &ctx,
                &mut waves,
                2 * nkv * MAX_PIECES * (2 * hd + 4),
            );
            assert!(all.iter().zip(&waves).all(|(a, b)| a.to_bits() == b.to_bits()), "waves differ");
            for (t, &(start, ctx_len)) in ranges.iter().enumerate() {
                // Alone, the token's result is the batch's, bit for bit.
                let mut alone = vec![0.0; qdim];
                attend_batch(&pool, &kern, &kv, n_heads, 0.3, &q[t * qdim..(t + 1) * qdim], &ctx[t..t + 1], &mut alone);
                let got = &all[t * qdim..(t + 1) * qdim];
                assert!(alone.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t} alone differs");
                // Against softmax attention in f64 over the f16-rounded keys and values.
                for h in 0..n_heads {
                    let (kvh, qh) = (h / (n_heads / nkv), &q[t * qdim + h * hd..t * qdim + (h + 1) * hd]);
                    let r = |x: f32| f64::from(f16::from_f32(x).to_f32());
                    let s: Vec<f64> = (start..ctx_len)
                        .map(|p| 0.3 * (0..hd).map(|i| r(val(p, kvh, i, 0)) * f64::from(qh[i])).sum::<f64>())
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for i in 0..hd {
                        let want: f64 = (start..ctx_len).map(|p| e[p - start] / z * r(val(p, kvh, i, 5))).sum();
                        let g = got[h * hd + i];
                        assert!(
                            (want - f64::from(g)).abs() < 1e-5,
                            "{:?} {start}..{ctx_len} head {h}: {want} vs {g}",
                            kern.isa
                        );
                    }
                }
            }
        }
    }
}
