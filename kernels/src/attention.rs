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
    pub fn offset(block_size: usize, n_kv_heads: usize, head_dim: usize, block: usize, kv_head: usize, slot: usize) -> usize {
        ((block * n_kv_heads + kv_head) * block_size + slot) * head_dim
    }
}

/// Causal attention of query head `q` (one `head_dim` vector, already rotated) sharing KV head
/// `kv_head`, over positions `0..ctx_len` of the sequence whose blocks are `table`.
/// `scores` is scratch of at least `ctx_len`; the result is written to `out` (`head_dim`).
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    ctx_len: usize,
    kv_head: usize,
    q: &[f32],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (bs, hd) = (kv.block_size, kv.head_dim);
    let scores = &mut scores[..ctx_len];
    for (pos, s) in scores.iter_mut().enumerate() {
        let blk = table[pos / bs] as usize;
        let o = PagedKv::offset(bs, kv.n_kv_heads, hd, blk, kv_head, pos % bs);
        *s = (k.dot_f16_f32)(&kv.k[o..o + hd], q) * scale;
    }
    crate::ops::softmax(scores);
    out.fill(0.0);
    for (pos, &p) in scores.iter().enumerate() {
        let blk = table[pos / bs] as usize;
        let o = PagedKv::offset(bs, kv.n_kv_heads, hd, blk, kv_head, pos % bs);
        (k.axpy_f16)(p, &kv.v[o..o + hd], out);
    }
}

/// Where one query token attends: its sequence's block table and how many positions it sees
/// (its own position + 1: causal).
#[derive(Clone, Copy, Debug)]
pub struct QueryCtx<'a> {
    pub table: &'a [u32],
    pub ctx_len: usize,
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention for a whole batch: `q` is `[tokens][n_heads * head_dim]`, `ctx[t]` says what token
/// `t` sees, `out` has the shape of `q`. Parallel over (token, head) pairs.
pub fn attend_batch(pool: &ThreadPool, k: &Kernels, kv: &PagedKv<'_>, n_heads: usize, q: &[f32], ctx: &[QueryCtx<'_>], out: &mut [f32]) {
    let hd = kv.head_dim;
    let qdim = n_heads * hd;
    let group = n_heads / kv.n_kv_heads;
    assert!(group > 0 && n_heads % kv.n_kv_heads == 0, "head grouping");
    assert_eq!(q.len(), ctx.len() * qdim, "query shape");
    assert_eq!(out.len(), q.len(), "output shape");
    for c in ctx {
        assert!(c.ctx_len > 0 && c.ctx_len <= c.table.len() * kv.block_size, "context exceeds block table");
        assert!(c.table.iter().all(|&b| (b as usize + 1) * kv.n_kv_heads * kv.block_size * hd <= kv.k.len().min(kv.v.len())), "block id outside the pool");
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let dst = SyncPtr(out.as_mut_ptr());
    let task = |i: usize| {
        let (t, h) = (i / n_heads, i % n_heads);
        let c = ctx[t];
        let off = t * qdim + h * hd;
        // SAFETY: task (t, h) is the only writer of out[off..off + hd], which lies inside `out`
        // (asserted shape), and `out` outlives `pool.run`.
        let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(off), hd) };
        SCORES.with_borrow_mut(|scores| {
            if scores.len() < c.ctx_len {
                scores.resize(c.ctx_len, 0.0);
            }
            attend_head(k, kv, c.table, c.ctx_len, h / group, &q[off..off + hd], scale, scores, o);
        });
    };
    pool.run(ctx.len() * n_heads, &task);
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
        let q: Vec<f32> = (0..hd).map(|i| i as f32 / 4.0 - 1.0).collect();
        let kv = PagedKv { k: &kp, v: &vp, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let mut scores = vec![0.0; ctx];
        let mut out = vec![0.0; hd];
        attend_head(&Kernels::detect(), &kv, &table, ctx, 0, &q, 0.5, &mut scores, &mut out);
        // Contiguous reference with the same f16-rounded values.
        let r = |x: f32| f16::from_f32(x).to_f32();
        let mut w: Vec<f32> = keys.iter().map(|kk| kk.iter().zip(&q).map(|(a, b)| r(*a) * b).sum::<f32>() * 0.5).collect();
        crate::ops::softmax(&mut w);
        for i in 0..hd {
            let want: f32 = (0..ctx).map(|p| w[p] * r(vals[p][i])).sum();
            assert!((want - out[i]).abs() < 1e-4, "{want} vs {}", out[i]);
        }
    }
}
