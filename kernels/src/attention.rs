//! Attention of one query head over a paged K/V cache (the PagedAttention layout of vLLM).
//!
//! One layer's cache is a pool of blocks, each holding, for each KV head in turn, a tile of
//! `block_size × head_dim` f16 for K and the same for V. A V tile is position-major (`[slot]
//! [head_dim]`, a value row contiguous); a K tile is stored transposed, dimension-major
//! (`[head_dim][slot]`), so the same dimension of a block's keys is contiguous and a kernel
//! scores 16 keys in the 16 lanes of a vector with no horizontal sums ([`KeysT`]). A sequence
//! reaches its positions through its block table: position `p` lives in block `table[p /
//! block_size]`, slot `p % block_size`.

use crate::cpu::{Ahead, Kernels, KeysT};
use crate::pool::{SyncPtr, ThreadPool};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One layer's K and V block pools.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Values from one block's start to the next's: at least `n_kv_heads * block_size *
    /// head_dim`, more where the pool's pages are sized for a wider layer (Gemma 4's layers of
    /// two head sizes share one pool).
    pub block_floats: usize,
}

impl PagedKv<'_> {
    /// Where the K and V tiles of `(block, kv_head)` start in a pool whose blocks are
    /// `n_kv_heads * block_size * head_dim` apart.
    #[inline]
    pub fn tile(block_size: usize, n_kv_heads: usize, head_dim: usize, block: usize, kv_head: usize) -> usize {
        (block * n_kv_heads + kv_head) * block_size * head_dim
    }

    /// Writes one position's key and value (`head_dim` floats each, as f16) into slot `slot` of
    /// the tiles starting at `tile` ([`PagedKv::tile`]) of pools `k` and `v`: the value as a
    /// row, the key down its tile's column.
    pub fn store(
        k: &mut [f16],
        v: &mut [f16],
        (tile, block_size, slot): (usize, usize, usize),
        key: &[f32],
        value: &[f32],
    ) {
        let hd = key.len();
        assert!(slot < block_size && value.len() == hd, "a slot of the block, a value per key");
        // The half crate converts slices 4 or 8 at a time where the CPU has F16C.
        v[tile + slot * hd..tile + (slot + 1) * hd].convert_from_f32_slice(value);
        let mut halves = [f16::ZERO; 64];
        for (c, part) in key.chunks(64).enumerate() {
            halves[..part.len()].convert_from_f32_slice(part);
            for (d, &h) in (64 * c..).zip(&halves[..part.len()]) {
                k[tile + d * block_size + slot] = h;
            }
        }
    }
}

/// Positions per piece: a query attends to its context a piece at a time, piece `c` being the
/// positions `c * PIECE .. (c + 1) * PIECE` its range touches (clipped to the range), and the
/// pieces are folded in order (split-K attention, as FlashDecoding and vLLM's PagedAttention v2
/// do). Pieces lie at fixed positions, so the same piece of every query of a sequence reads the
/// same keys: a small batch makes each piece a task of its own, which keeps every thread busy
/// even with fewer KV heads than threads (SmolLM2 has 3, Gemma 3 270M one); a large batch (a
/// prompt) runs a tile of tokens a task, piece by piece, so the tile's tokens read each piece's
/// keys and values while they are in the cache. Either way a token gets the same pieces, folded
/// by the same function in the same order: its result is the same in any batch, bit for bit.
/// 128 positions (eight blocks of 16) rather than 64: each piece starts its block stream cold
/// and is folded once, and at 8,192 positions of Qwen2.5-1.5B's shape twice the length took
/// a decode step's attention from 64-68 to 60-63 ns a position on two Zen 4 cores (256: 58-60,
/// at half the tasks for many-core machines; BENCHMARKS.md).
pub const PIECE: usize = 128;

/// Tokens per task where a batch is attended in tiles ([`PIECE`]).
const TILE: usize = 16;

/// Most floats of piece slots one dispatch fills (4 MiB): a small batch whose pieces are
/// tasks is attended in waves of tokens, so its pieces never take more memory than this.
const WAVE_FLOATS: usize = 1 << 20;

/// The pieces query `c` is split into: the indices of the [`PIECE`]-long runs its range touches.
fn pieces(c: &QueryCtx<'_>) -> std::ops::Range<usize> {
    c.start / PIECE..c.ctx_len.div_ceil(PIECE)
}

/// The positions of piece `p` that query `c` sees.
fn piece_range(c: &QueryCtx<'_>, p: usize) -> (usize, usize) {
    ((p * PIECE).max(c.start), ((p + 1) * PIECE).min(c.ctx_len))
}

/// Floats of one piece's slot for `g` heads: `g × head_dim` values, `g` maxima, `g` sums.
fn slot(g: usize, hd: usize) -> usize {
    g * hd + 2 * g
}

/// One block's run of a range of positions of one KV head.
#[derive(Clone, Copy, Debug)]
struct Span {
    /// Where the block's tiles of the KV head start in the pools.
    tile: usize,
    /// The run's first slot in the block.
    slot: usize,
    /// The run's first position, counted from the range's start.
    at: usize,
    n: usize,
}

/// The block runs of positions `lo..hi` of KV head `kv_head`, one for each block the range
/// touches.
fn spans<'t>(
    kv: &PagedKv<'_>,
    table: &'t [u32],
    (lo, hi): (usize, usize),
    kv_head: usize,
) -> impl Iterator<Item = Span> + 't {
    let (bs, hd, nkv, stride) = (kv.block_size, kv.head_dim, kv.n_kv_heads, kv.block_floats);
    (lo / bs..hi.div_ceil(bs)).map(move |b| {
        let (from, to) = ((b * bs).max(lo), ((b + 1) * bs).min(hi));
        let tile = table[b] as usize * stride + PagedKv::tile(bs, nkv, hd, 0, kv_head);
        Span { tile, slot: from - b * bs, at: from - lo, n: to - from }
    })
}

/// The 64-byte lines of `len` halves at `o` of `pool`.
fn lines(pool: &[f16], o: usize, len: usize) -> Ahead {
    (pool.as_ptr().wrapping_add(o).cast(), 0..(2 * len).div_ceil(64))
}

/// The `g` heads' scores over positions `lo..hi` (`scores`, `[head][position]`, a row of `hi -
/// lo` a head), shifted by each head's maximum and exponentiated; returns each head's maximum
/// and sum of exponentials.
#[allow(clippy::too_many_arguments)]
fn weights(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    range: (usize, usize),
    kv_head: usize,
    qt: &[f32],
    g: usize,
    scale: f32,
    scores: &mut [f32],
) -> ([f32; 64], [f32; 64]) {
    let (hd, bs, len) = (kv.head_dim, kv.block_size, range.1 - range.0);
    // While a block's keys are scored, the kernel fetches the next block's keys and this
    // block's values (used after the softmax), a part at a time between its products.
    let mut blocks = spans(kv, table, range, kv_head).peekable();
    while let Some(s) = blocks.next() {
        let next = blocks.peek().map_or((kv.k.as_ptr().cast(), 0..0), |n| lines(kv.k, n.tile, hd * bs));
        let keys = KeysT { k: &kv.k[s.tile + s.slot..s.tile + hd * bs], bs, n: s.n, hd };
        let ahead = [next, lines(kv.v, s.tile + s.slot * hd, s.n * hd)];
        (k.attn_scores)(keys, qt, g, scale, &mut scores[s.at..], len, &ahead);
    }
    // Each head's row: its maximum (in 16 running lanes, so the pass runs in vectors), then
    // its exponentials shifted by it and their sum in one pass of the kernel.
    let mut max = [f32::NEG_INFINITY; 64];
    let mut sum = [0f32; 64];
    for ((row, m), s) in scores.chunks_exact_mut(len).zip(&mut max).zip(&mut sum) {
        let mut lanes = [f32::NEG_INFINITY; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            lanes.iter_mut().zip(c).for_each(|(a, &v)| *a = a.max(v));
        }
        lanes.iter_mut().zip(chunks.remainder()).for_each(|(a, &v)| *a = a.max(v));
        *m = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
        *s = (k.exp_sum)(row, *m);
    }
    (max, sum)
}

/// `out` (`g × head_dim`, zeroed first) = the values of positions `lo..hi` weighted by `p`
/// (`[head][position]`, rows of `hi - lo`).
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
    let (hd, len) = (kv.head_dim, range.1 - range.0);
    out.fill(0.0);
    for s in spans(kv, table, range, kv_head) {
        let o = s.tile + s.slot * hd;
        (k.attn_values)(&kv.v[o..o + s.n * hd], &p[s.at..], len, hd, g, out);
    }
}

/// Causal attention of the `g` query heads that share KV head `kv_head` (GQA), over positions
/// `start..ctx_len` of the sequence whose blocks are `table` (`start > 0` for a sliding
/// window), in one piece. `qt` holds the `g` rotated query vectors transposed (`head_dim × g`,
/// [`transpose_groups`]); the results go to `out` as `g × head_dim`. `scores` is scratch of at
/// least `(ctx_len - start) * g`. Each key and value is converted from f16 once per group.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    k: &Kernels,
    kv: &PagedKv<'_>,
    table: &[u32],
    (start, ctx_len): (usize, usize),
    kv_head: usize,
    qt: &[f32],
    g: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!((1..=64).contains(&g), "at most 64 query heads per KV head");
    assert!(start < ctx_len, "a query sees at least its own position");
    let len = ctx_len - start;
    let scores = &mut scores[..len * g];
    let (max, mut sum) = weights(k, kv, table, (start, ctx_len), kv_head, qt, g, scale, scores);
    if let Some(sinks) = sinks {
        (0..g).for_each(|j| sum[j] += (sinks[j] - max[j]).exp());
    }
    for (row, s) in scores.chunks_exact_mut(len).zip(&sum[..g]) {
        row.iter_mut().for_each(|v| *v /= s);
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
    qt: &[f32],
    g: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let scores = &mut scores[..(hi - lo) * g];
    let (max, sum) = weights(k, kv, table, (lo, hi), kv_head, qt, g, scale, scores);
    let (values, stats) = out.split_at_mut(g * hd);
    weighted_values(k, kv, table, (lo, hi), kv_head, scores, g, values);
    stats[..g].copy_from_slice(&max[..g]);
    stats[g..2 * g].copy_from_slice(&sum[..g]);
}

/// Folds one more piece (a slot as [`attend_piece`] wrote it) into a query's running slot
/// `acc`, which holds the pieces before it: both are rescaled to the larger maximum and added.
/// The first piece is `acc` itself. Pieces are folded in position order, so a token's result
/// does not depend on which task folds them.
fn fold_piece(acc: &mut [f32], piece: &[f32], g: usize, hd: usize) {
    let (values, stats) = acc.split_at_mut(g * hd);
    let (pv, ps) = piece.split_at(g * hd);
    for j in 0..g {
        let max = stats[j].max(ps[j]);
        let (a, b) = ((stats[j] - max).exp(), (ps[j] - max).exp());
        stats[g + j] = stats[g + j] * a + ps[g + j] * b;
        stats[j] = max;
        let o = &mut values[j * hd..(j + 1) * hd];
        o.iter_mut().zip(&pv[j * hd..(j + 1) * hd]).for_each(|(o, &v)| *o = *o * a + v * b);
    }
}

/// A query's output from its folded slot: each head's values over its sum (and its sink's
/// share, where the heads have sinks).
fn finish(acc: &[f32], g: usize, hd: usize, sinks: Option<&[f32]>, out: &mut [f32]) {
    let (values, stats) = acc.split_at(g * hd);
    for j in 0..g {
        let s = stats[g + j] + sinks.map_or(0.0, |sk| (sk[j] - stats[j]).exp());
        out[j * hd..(j + 1) * hd].iter_mut().zip(&values[j * hd..(j + 1) * hd]).for_each(|(o, &v)| *o = v / s);
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
    /// The calling thread's queries of one [`attend_batch`] call, transposed ([`transpose_groups`]).
    static QT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's slots for the pieces of split queries, kept between calls.
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A tile task's running slot for each token of its tile, then one for the current piece.
    static TILE_SLOTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How a batch's tasks are cut ([`PIECE`]); both give every token the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Schedule {
    /// A task per (token, KV head, piece), then a task per (token, KV head) that folds them.
    Pieces,
    /// A task per (tile of [`TILE`] tokens, KV head) that runs its tokens piece by piece.
    Tiles,
}

impl Schedule {
    /// Tiles once they make enough tasks to keep every thread busy (four a thread).
    fn for_batch(pool: &ThreadPool, tokens: usize, n_kv_heads: usize) -> Self {
        if tokens.div_ceil(TILE) * n_kv_heads >= 4 * pool.threads() {
            Schedule::Tiles
        } else {
            Schedule::Pieces
        }
    }
}

/// Attention for a whole batch: `q` is `[tokens][n_heads * head_dim]`, `ctx[t]` says what token
/// `t` sees, `out` has the shape of `q`; scores are `scale * q · k`. A small batch runs a task
/// per (token, KV head, piece) and then the folds, in waves of tokens whose pieces fit a
/// bounded scratch; a large one a task per (tile of tokens, KV head) ([`PIECE`]).
#[allow(clippy::too_many_arguments)]
pub fn attend_batch(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    n_heads: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    q: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    assert!(sinks.is_none_or(|s| s.len() == n_heads), "a sink per query head");
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
    QT.with_borrow_mut(|qt| {
        transpose_groups(q, group, hd, qt);
        match Schedule::for_batch(pool, ctx.len(), kv.n_kv_heads) {
            Schedule::Tiles => attend_tiles(pool, k, kv, (n_heads, scale, sinks), qt, ctx, out),
            Schedule::Pieces => attend_in_waves(pool, k, kv, (n_heads, scale, sinks), qt, ctx, out, WAVE_FLOATS),
        }
    });
}

/// `q` (`[token][KV head][g][hd]`) with each KV head's `g × hd` group transposed to `[hd][g]`
/// into `qt`: the form the score kernels take ([`Kernels::attn_scores`]), made once a call
/// rather than once a piece.
fn transpose_groups(q: &[f32], g: usize, hd: usize, qt: &mut Vec<f32>) {
    qt.resize(q.len(), 0.0);
    for (src, dst) in q.chunks_exact(g * hd).zip(qt.chunks_exact_mut(g * hd)) {
        for (j, qj) in src.chunks_exact(hd).enumerate() {
            dst.iter_mut().skip(j).step_by(g).zip(qj).for_each(|(t, &x)| *t = x);
        }
    }
}

/// [`attend_batch`] (its checks done) a task per (token, KV head, piece), in waves of tokens
/// whose piece slots fit `wave_floats` (at least one token each).
#[allow(clippy::too_many_arguments)]
fn attend_in_waves(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    (n_heads, scale, sinks): (usize, f32, Option<&[f32]>),
    qt: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
    wave_floats: usize,
) {
    let (hd, group) = (kv.head_dim, n_heads / kv.n_kv_heads);
    let (qdim, slot) = (n_heads * hd, slot(group, hd));
    let mut t0 = 0;
    while t0 < ctx.len() {
        let (mut t1, mut floats) = (t0, 0);
        while t1 < ctx.len() {
            let need = kv.n_kv_heads * pieces(&ctx[t1]).len() * slot;
            if t1 > t0 && floats + need > wave_floats {
                break;
            }
            (t1, floats) = (t1 + 1, floats + need);
        }
        let (qt, out) = (&qt[t0 * qdim..t1 * qdim], &mut out[t0 * qdim..t1 * qdim]);
        attend_wave(pool, k, kv, (n_heads, scale, sinks), qt, &ctx[t0..t1], out);
        t0 = t1;
    }
}

/// One wave of [`attend_in_waves`]: a task per (token, KV head, piece), then the folds.
fn attend_wave(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    (n_heads, scale, sinks): (usize, f32, Option<&[f32]>),
    qt: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
) {
    let (hd, nkv) = (kv.head_dim, kv.n_kv_heads);
    let (qdim, group) = (n_heads * hd, n_heads / nkv);
    // The sinks of KV head g's query heads.
    let sinks_of = |g: usize| sinks.map(|s| &s[g * group..(g + 1) * group]);
    // Tasks: for each token, for each KV head, for each piece of its range. `first[t]` is token
    // t's first task.
    let mut first = Vec::with_capacity(ctx.len() + 1);
    let mut tasks = 0;
    for c in ctx {
        first.push(tasks);
        tasks += nkv * pieces(c).len();
    }
    first.push(tasks);
    let split = tasks > ctx.len() * nkv;
    // A split query's pieces each fill a slot of `partial` (indexed by task); the piece that
    // finishes last of its (token, KV head) pair folds the pair's slots, in order, in the same
    // dispatch (a count of pieces left per pair).
    let slot = slot(group, hd);
    let left: Vec<AtomicUsize> = if split {
        (0..ctx.len() * nkv).map(|i| AtomicUsize::new(pieces(&ctx[i / nkv]).len())).collect()
    } else {
        Vec::new()
    };
    PARTIALS.with_borrow_mut(|partial| {
        if split && partial.len() < tasks * slot {
            partial.resize(tasks * slot, 0.0);
        }
        let (dst, pieces_at) = (SyncPtr(out.as_mut_ptr()), SyncPtr(partial.as_mut_ptr()));
        let task = |i: usize| {
            let t = first.partition_point(|&f| f <= i) - 1;
            let (c, ps) = (ctx[t], pieces(&ctx[t]));
            let (g, piece) = ((i - first[t]) / ps.len(), (i - first[t]) % ps.len());
            let off = t * qdim + g * group * hd;
            let qt = &qt[off..off + group * hd];
            SCORES.with_borrow_mut(|scores| {
                if scores.len() < PIECE * group {
                    scores.resize(PIECE * group, 0.0);
                }
                if ps.len() == 1 {
                    // SAFETY: task (t, g) is the only writer of out[off..off + group * hd] (the
                    // query heads of KV head g for token t), which lies inside `out` (asserted
                    // shape); `out` outlives `pool.run`.
                    let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(off), group * hd) };
                    attend_group(k, kv, c.table, (c.start, c.ctx_len), g, qt, group, scale, sinks_of(g), scores, o);
                    return;
                }
                // SAFETY: task i is the only writer of slot i, which lies inside `partial`
                // (sized to `tasks` slots above when any query is split); `partial` outlives
                // `pool.run`.
                let o = unsafe { std::slice::from_raw_parts_mut(pieces_at.get().add(i * slot), slot) };
                let range = piece_range(&c, ps.start + piece);
                attend_piece(k, kv, c.table, range, g, qt, group, scale, scores, o);
            });
            if ps.len() > 1 && left[t * nkv + g].fetch_sub(1, Ordering::AcqRel) == 1 {
                let n = ps.len();
                // SAFETY: this task took the pair's count to zero, so it alone folds (t, g): it
                // is the only writer of out[off..off + group * hd] (as above), and every piece
                // of the pair has written its slot (their decrements released those writes,
                // this one acquired them) and no longer touches it; all lie inside `out` and
                // `partial`.
                let (o, slots) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(dst.get().add(off), group * hd),
                        std::slice::from_raw_parts_mut(pieces_at.get().add((first[t] + g * n) * slot), n * slot),
                    )
                };
                let (acc, rest) = slots.split_at_mut(slot);
                rest.chunks_exact(slot).for_each(|p| fold_piece(acc, p, group, hd));
                finish(acc, group, hd, sinks_of(g), o);
            }
        };
        pool.run(tasks, &task);
    });
}

/// [`attend_batch`] (its checks done) a task per (tile of [`TILE`] tokens, KV head): the task
/// runs its tokens piece by piece, folding each token's pieces as [`attend_wave`] does.
fn attend_tiles(
    pool: &ThreadPool,
    k: &Kernels,
    kv: &PagedKv<'_>,
    (n_heads, scale, sinks): (usize, f32, Option<&[f32]>),
    qt: &[f32],
    ctx: &[QueryCtx<'_>],
    out: &mut [f32],
) {
    let (hd, nkv) = (kv.head_dim, kv.n_kv_heads);
    let (qdim, group) = (n_heads * hd, n_heads / nkv);
    // The sinks of KV head g's query heads.
    let sinks_of = |g: usize| sinks.map(|s| &s[g * group..(g + 1) * group]);
    let slot = slot(group, hd);
    let dst = SyncPtr(out.as_mut_ptr());
    let task = |i: usize| {
        let (tile, g) = (i / nkv, i % nkv);
        let tokens = tile * TILE..((tile + 1) * TILE).min(ctx.len());
        // SAFETY: task (tile, g) is the only writer of the query heads of KV head g of its
        // tile's tokens, out[t * qdim + g * group * hd..][..group * hd], inside `out` (asserted
        // shape); `out` outlives `pool.run`.
        let out_of =
            |t: usize| unsafe { std::slice::from_raw_parts_mut(dst.get().add(t * qdim + g * group * hd), group * hd) };
        let q_of = |t: usize| &qt[t * qdim + g * group * hd..][..group * hd];
        SCORES.with_borrow_mut(|scores| {
            TILE_SLOTS.with_borrow_mut(|slots| {
                if scores.len() < PIECE * group {
                    scores.resize(PIECE * group, 0.0);
                }
                if slots.len() < (TILE + 1) * slot {
                    slots.resize((TILE + 1) * slot, 0.0);
                }
                let (acc, cur) = slots.split_at_mut(TILE * slot);
                let cur = &mut cur[..slot];
                let first = tokens.clone().map(|t| pieces(&ctx[t]).start).min().unwrap_or(0);
                let end = tokens.clone().map(|t| pieces(&ctx[t]).end).max().unwrap_or(0);
                // Piece-major: the tile's tokens read piece p's keys one after another.
                for p in first..end {
                    for t in tokens.clone() {
                        let (c, ps) = (ctx[t], pieces(&ctx[t]));
                        if !ps.contains(&p) {
                            continue;
                        }
                        if ps.len() == 1 {
                            let range = (c.start, c.ctx_len);
                            attend_group(
                                k,
                                kv,
                                c.table,
                                range,
                                g,
                                q_of(t),
                                group,
                                scale,
                                sinks_of(g),
                                scores,
                                out_of(t),
                            );
                            continue;
                        }
                        let a = &mut acc[(t - tokens.start) * slot..][..slot];
                        let range = piece_range(&c, p);
                        if p == ps.start {
                            attend_piece(k, kv, c.table, range, g, q_of(t), group, scale, scores, a);
                        } else {
                            attend_piece(k, kv, c.table, range, g, q_of(t), group, scale, scores, cur);
                            fold_piece(a, cur, group, hd);
                        }
                    }
                }
                for t in tokens.clone() {
                    if pieces(&ctx[t]).len() > 1 {
                        finish(&acc[(t - tokens.start) * slot..][..slot], group, hd, sinks_of(g), out_of(t));
                    }
                }
            })
        });
    };
    pool.run(ctx.len().div_ceil(TILE) * nkv, &task);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paged_attention_equals_contiguous_attention() {
        // Blocks as wide as the layer's K/V, and wider (a pool whose pages are sized for a
        // wider layer: Gemma 4's two head sizes).
        for pad in [0, 40] {
            paged_attention_with_block_padding(pad);
        }
    }

    fn paged_attention_with_block_padding(pad: usize) {
        // Two blocks of 4 slots, stored out of order in a pool of 3, one KV head of dim 8.
        let (bs, hd, nkv, ctx) = (4, 8, 1, 6);
        let stride = nkv * bs * hd + pad;
        let keys: Vec<Vec<f32>> = (0..ctx).map(|p| (0..hd).map(|i| ((p * 3 + i) % 5) as f32 / 5.0).collect()).collect();
        let vals: Vec<Vec<f32>> = (0..ctx).map(|p| (0..hd).map(|i| ((p + i * 2) % 7) as f32).collect()).collect();
        let table = [2u32, 0];
        let mut kp = vec![f16::ZERO; 3 * stride];
        let mut vp = kp.clone();
        // The layout written out: a value row at its slot, a key down its slot's column.
        for p in 0..ctx {
            let (tile, slot) = (table[p / bs] as usize * stride, p % bs);
            for i in 0..hd {
                kp[tile + i * bs + slot] = f16::from_f32(keys[p][i]);
                vp[tile + slot * hd + i] = f16::from_f32(vals[p][i]);
            }
        }
        // Two query heads share the KV head.
        let g = 2;
        let q: Vec<f32> = (0..g * hd).map(|i| (i % 11) as f32 / 4.0 - 1.0).collect();
        let kv = PagedKv { k: &kp, v: &vp, block_size: bs, n_kv_heads: nkv, head_dim: hd, block_floats: stride };
        // Whole context, and sliding windows starting inside the first block, at a block
        // boundary and at the last position.
        for (start, kern) in [0, 1, 3, 4, 5].into_iter().flat_map(|s| [(s, Kernels::scalar()), (s, Kernels::detect())])
        {
            let mut scores = vec![0.0; ctx * g];
            let mut out = vec![0.0; g * hd];
            let mut qt = Vec::new();
            transpose_groups(&q, g, hd, &mut qt);
            attend_group(&kern, &kv, &table, (start, ctx), 0, &qt, g, 0.5, None, &mut scores, &mut out);
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
                    assert!(
                        (want - out[j * hd + i]).abs() < 1e-4,
                        "pad {pad} start {start}: {want} vs {}",
                        out[j * hd + i]
                    );
                }
            }
        }
    }

    /// One sequence of `len` positions in shuffled blocks of `bs`: its block table and K and V
    /// pools, holding `val(p, h, i, 0)` as element `i` of KV head `h`'s key at `p` and
    /// `val(p, h, i, 5)` as the value's.
    fn paged(
        bs: usize,
        hd: usize,
        nkv: usize,
        len: usize,
        val: &impl Fn(usize, usize, usize, usize) -> f32,
    ) -> (Vec<u32>, Vec<f16>, Vec<f16>) {
        let nblocks = len.div_ceil(bs);
        let table: Vec<u32> = (0..nblocks as u32).map(|b| (b * 7 + 3) % nblocks as u32).collect();
        let mut kp = vec![f16::ZERO; nblocks * nkv * bs * hd];
        let mut vp = kp.clone();
        for p in 0..len {
            for h in 0..nkv {
                let tile = PagedKv::tile(bs, nkv, hd, table[p / bs] as usize, h);
                let key: Vec<f32> = (0..hd).map(|i| val(p, h, i, 0)).collect();
                let value: Vec<f32> = (0..hd).map(|i| val(p, h, i, 5)).collect();
                PagedKv::store(&mut kp, &mut vp, (tile, bs, p % bs), &key, &value);
            }
        }
        (table, kp, vp)
    }

    /// Softmax attention in f64 of query `qh` over positions `start..ctx_len` of KV head `kvh`
    /// of [`paged`]'s sequence, its keys and values rounded to f16 as the pools hold them.
    fn reference(
        val: &impl Fn(usize, usize, usize, usize) -> f32,
        (start, ctx_len): (usize, usize),
        kvh: usize,
        qh: &[f32],
        scale: f64,
        sink: Option<f32>,
    ) -> Vec<f64> {
        let r = |x: f32| f64::from(f16::from_f32(x).to_f32());
        let s: Vec<f64> = (start..ctx_len)
            .map(|p| scale * qh.iter().enumerate().map(|(i, &q)| r(val(p, kvh, i, 0)) * f64::from(q)).sum::<f64>())
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        // A sink's logit joins the denominator, and nothing the values.
        let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (f64::from(s) - m).exp());
        (0..qh.len()).map(|i| (start..ctx_len).map(|p| e[p - start] / z * r(val(p, kvh, i, 5))).sum()).collect()
    }

    /// Values of [`paged`]'s sequences: small, mixed in sign, varying with position, head and
    /// element.
    fn val(p: usize, h: usize, i: usize, salt: usize) -> f32 {
        ((p * 31 + h * 17 + i * 7 + salt) % 23) as f32 / 11.0 - 1.0
    }

    #[test]
    fn split_queries_match_the_reference_in_any_batch() {
        // Two shapes: two KV heads of dim 8 with two query heads each at scale 0.3 over 1,300
        // positions, and Gemma 3 270M's four query heads on one KV head of dim 256 at its 1/16
        // over 400; blocks of 16 stored in shuffled order. Queries see ranges inside one piece,
        // of exactly one, just over one, several and many, from 0 and from inside a window,
        // across piece boundaries or not; in one batch, in waves, in tiles and alone.
        for (hd, nkv, n_heads, len, scale) in [(8, 2, 4, 1300, 0.3), (256, 1, 4, 400, 0.0625)] {
            let (table, kp, vp) = paged(16, hd, nkv, len, &val);
            let kv =
                PagedKv { k: &kp, v: &vp, block_size: 16, n_kv_heads: nkv, head_dim: hd, block_floats: nkv * 16 * hd };
            let ranges: Vec<(usize, usize)> = [
                (0, 1),
                (0, 7),
                (60, 70),
                (0, PIECE),
                (0, PIECE + 1),
                (0, 130),
                (0, len),
                (37, 230),
                (10, 327),
                (PIECE, 2 * PIECE + 3),
                (100, 100 + 16 * PIECE + 1),
                (70, 120),
            ]
            .into_iter()
            .filter(|&(_, ctx_len)| ctx_len <= len)
            .collect();
            let ctx: Vec<QueryCtx<'_>> =
                ranges.iter().map(|&(start, ctx_len)| QueryCtx { table: &table, ctx_len, start }).collect();
            let (qdim, amp) = (n_heads * hd, (8.0 / hd as f32).sqrt());
            let q: Vec<f32> = (0..ranges.len() * qdim).map(|i| (((i * 13) % 17) as f32 / 8.0 - 1.0) * amp).collect();
            let pool = ThreadPool::new(2);
            // gpt-oss's attention sinks: a logit per query head, large and small.
            let sink_logits: Vec<f32> = (0..n_heads).map(|h| [0.5, -1.0, 2.5, 0.0][h % 4]).collect();
            let kernels = [Kernels::scalar(), Kernels::detect()];
            // The internal schedules take the queries as attend_batch hands them on.
            let mut qt = Vec::new();
            transpose_groups(&q, n_heads / nkv, hd, &mut qt);
            for (kern, sinks) in kernels.into_iter().flat_map(|k| [(k, None), (k, Some(&sink_logits[..]))]) {
                let mut all = vec![0.0; q.len()];
                attend_batch(&pool, &kern, &kv, n_heads, scale, sinks, &q, &ctx, &mut all);
                // In waves of a token or two, the same bits.
                let mut waves = vec![0.0; q.len()];
                let wave = 2 * nkv * 3 * slot(n_heads / nkv, hd);
                attend_in_waves(&pool, &kern, &kv, (n_heads, scale, sinks), &qt, &ctx, &mut waves, wave);
                assert!(all.iter().zip(&waves).all(|(a, b)| a.to_bits() == b.to_bits()), "waves differ");
                // In tiles, the same bits.
                let mut tiles = vec![0.0; q.len()];
                attend_tiles(&pool, &kern, &kv, (n_heads, scale, sinks), &qt, &ctx, &mut tiles);
                assert!(all.iter().zip(&tiles).all(|(a, b)| a.to_bits() == b.to_bits()), "tiles differ");
                for (t, &range) in ranges.iter().enumerate() {
                    // Alone, the token's result is the batch's, bit for bit.
                    let mut alone = vec![0.0; qdim];
                    attend_batch(
                        &pool,
                        &kern,
                        &kv,
                        n_heads,
                        scale,
                        sinks,
                        &q[t * qdim..][..qdim],
                        &ctx[t..t + 1],
                        &mut alone,
                    );
                    let got = &all[t * qdim..][..qdim];
                    assert!(alone.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t} alone differs");
                    // Against softmax attention in f64 over the f16-rounded keys and values.
                    for h in 0..n_heads {
                        let (kvh, qh) = (h / (n_heads / nkv), &q[t * qdim + h * hd..][..hd]);
                        let want = reference(&val, range, kvh, qh, f64::from(scale), sinks.map(|s| s[h]));
                        for (i, (want, &g)) in want.iter().zip(&got[h * hd..][..hd]).enumerate() {
                            assert!(
                                (want - f64::from(g)).abs() < 1e-5,
                                "{:?} dim {hd} {range:?} head {h} {i}: {want} vs {g}",
                                kern.isa
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn prompt_tiles_equal_pieces_and_single_tokens() {
        let (hd, nkv, n_heads) = (8, 2, 4);
        let (table, kp, vp) = paged(16, hd, nkv, 1300, &val);
        let kv = PagedKv { k: &kp, v: &vp, block_size: 16, n_kv_heads: nkv, head_dim: hd, block_floats: nkv * 16 * hd };
        let (qdim, pool) = (n_heads * hd, ThreadPool::new(2));
        // A prompt of 40 tokens at 980..1020 (every other one in a 300-position window) and
        // three decode tokens: tiled, in pieces and alone, the same bits.
        let mut ctx: Vec<QueryCtx<'_>> = (980..1020)
            .map(|p| QueryCtx { table: &table, ctx_len: p + 1, start: if p % 2 == 0 { 0 } else { p + 1 - 300 } })
            .collect();
        ctx.extend([5, 640, 1299].map(|p| QueryCtx { table: &table, ctx_len: p + 1, start: 0 }));
        let q: Vec<f32> = (0..ctx.len() * qdim).map(|i| ((i * 7) % 19) as f32 / 9.0 - 1.0).collect();
        assert_eq!(Schedule::for_batch(&ThreadPool::new(1), ctx.len(), nkv), Schedule::Tiles);
        assert_eq!(Schedule::for_batch(&pool, ctx.len(), nkv), Schedule::Pieces);
        let mut qt = Vec::new();
        transpose_groups(&q, n_heads / nkv, hd, &mut qt);
        for kern in [Kernels::scalar(), Kernels::detect()] {
            let mut tiles = vec![0.0; q.len()];
            attend_tiles(&pool, &kern, &kv, (n_heads, 0.3, None), &qt, &ctx, &mut tiles);
            let mut waves = vec![0.0; q.len()];
            attend_in_waves(&pool, &kern, &kv, (n_heads, 0.3, None), &qt, &ctx, &mut waves, WAVE_FLOATS);
            assert!(tiles.iter().zip(&waves).all(|(a, b)| a.to_bits() == b.to_bits()), "tiles and pieces differ");
            for t in [0, 1, 15, 16, 17, 39, 40, 42] {
                let mut alone = vec![0.0; qdim];
                attend_batch(&pool, &kern, &kv, n_heads, 0.3, None, &q[t * qdim..][..qdim], &ctx[t..t + 1], &mut alone);
                let got = &tiles[t * qdim..][..qdim];
                assert!(alone.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t} alone differs");
            }
        }
    }
}
