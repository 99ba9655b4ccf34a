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

/// Causal attention of the `g` query heads that share KV head `kv_head` (GQA), over positions
/// `start..ctx_len` of the sequence whose blocks are `table` (`start > 0` for a sliding
/// window). `q` holds the `g` rotated query vectors back to back (`g × head_dim`); the results go
/// to `out` in the same layout. `scores` is scratch of at least `(ctx_len - start) * g`. Each key
/// and value is converted from f16 once per group.
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
    let (bs, hd) = (kv.block_size, kv.head_dim);
    assert!((1..=64).contains(&g), "at most 64 query heads per KV head");
    assert!(start < ctx_len, "a query sees at least its own position");
    let scores = &mut scores[..(ctx_len - start) * g];
    // Block b's positions in the range: (pool offset, index in `scores`, count).
    let span = |b: usize| {
        let (lo, hi) = ((b * bs).max(start), ((b + 1) * bs).min(ctx_len));
        let o = PagedKv::offset(bs, kv.n_kv_heads, hd, table[b] as usize, kv_head, lo - b * bs);
        (o, lo - start, hi - lo)
    };
    let blocks = start / bs..ctx_len.div_ceil(bs);
    for b in blocks.clone() {
        let (o, at, n) = span(b);
        (k.attn_scores)(&kv.k[o..o + n * hd], q, hd, g, scale, &mut scores[at * g..(at + n) * g]);
    }
    // Softmax of each head's column (stride g): shift by the column max, one vector exp over
    // everything, normalize.
    let mut max = [f32::NEG_INFINITY; 64];
    let g_max = &mut max[..g];
    for row in scores.chunks_exact(g) {
        g_max.iter_mut().zip(row).for_each(|(m, &v)| *m = m.max(v));
    }
    for row in scores.chunks_exact_mut(g) {
        row.iter_mut().zip(g_max.iter()).for_each(|(v, m)| *v -= m);
    }
    (k.exp)(scores);
    let mut sum = [0f32; 64];
    for row in scores.chunks_exact(g) {
        sum[..g].iter_mut().zip(row).for_each(|(s, &v)| *s += v);
    }
    for row in scores.chunks_exact_mut(g) {
        row.iter_mut().zip(&sum[..g]).for_each(|(v, s)| *v /= s);
    }
    out.fill(0.0);
    for b in blocks {
        let (o, at, n) = span(b);
        (k.attn_values)(&kv.v[o..o + n * hd], &scores[at * g..(at + n) * g], hd, g, out);
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
}

/// Attention for a whole batch: `q` is `[tokens][n_heads * head_dim]`, `ctx[t]` says what token
/// `t` sees, `out` has the shape of `q`; scores are `scale * q · k`. Parallel over (token,
/// KV head) pairs.
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
    let dst = SyncPtr(out.as_mut_ptr());
    let nkv = kv.n_kv_heads;
    let task = |i: usize| {
        let (t, g) = (i / nkv, i % nkv);
        let c = ctx[t];
        let off = t * qdim + g * group * hd;
        let len = group * hd;
        // SAFETY: task (t, g) is the only writer of out[off..off + len] (the query heads of KV
        // head g for token t), which lies inside `out` (asserted shape); `out` outlives `pool.run`.
        let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(off), len) };
        SCORES.with_borrow_mut(|scores| {
            if scores.len() < (c.ctx_len - c.start) * group {
                scores.resize((c.ctx_len - c.start) * group, 0.0);
            }
            attend_group(k, kv, c.table, (c.start, c.ctx_len), g, &q[off..off + len], group, scale, scores, o);
        });
    };
    pool.run(ctx.len() * nkv, &task);
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
}
