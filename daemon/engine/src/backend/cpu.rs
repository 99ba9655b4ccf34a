//! The CPU backend: quantized weights straight from the memory map, f16 K/V blocks in host
//! memory, kernels from `inferd-kernels` (AVX2 when the processor has it), all cores.
//!
//! A forward pass runs the whole batch (every sequence's new tokens, prefill chunks and decode
//! tokens alike) through each layer together, so each weight matrix is read once per step
//! whatever the batch size. K/V of the new tokens is written into the paged cache before
//! attention, which then reads every position (old and new) through the block tables. A
//! mixture of experts routes each token and runs the step's tokens grouped by expert
//! ([`inferd_kernels::moe`]), each chosen expert read once per step.

use super::profile::{Laps, Phase, StepProfile};
use super::{validate_batch, Backend, BackendError, SeqBatch};
use crate::kv::{BlockCopy, KvGroups};
use crate::model::arch::{Activation, Architecture, LayerAttention, NormPlacement, RopeScaling};
use crate::model::{LlamaConfig, LlamaWeights, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;
use inferd_kernels::attention::{attend_batch, PagedKv, QueryCtx};
use inferd_kernels::matmul::{matmul_many, Input};
use inferd_kernels::ops::rms_norm_each;
use inferd_kernels::ops::{rms_norm, Rope};
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::quant::QK;
use inferd_kernels::{BlockQ8, Kernels};

/// Activation buffers, grown to the largest batch seen and reused.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,  // (tokens, hidden) residual stream
    xb: Vec<f32>, // (tokens, hidden) normed input
    q8: Vec<BlockQ8>,
    q: Vec<f32>,      // (tokens, n_heads * head_dim)
    k: Vec<f32>,      // (tokens, n_kv_heads * head_dim)
    v: Vec<f32>,      // (tokens, n_kv_heads * head_dim)
    att: Vec<f32>,    // (tokens, n_heads * head_dim)
    gate: Vec<f32>,   // (tokens, ffn)
    up: Vec<f32>,     // (tokens, ffn)
    out: Vec<f32>,    // (tokens, hidden) projection output
    logits: Vec<f32>, // (rows, vocab) logits of a batch that also returns hidden rows
    router: Vec<f32>, // (tokens, experts) a mixture of experts' router logits
    moe: inferd_kernels::moe::MoeScratch,
    angles: Vec<Vec<(f32, f32)>>, // per rotation: (tokens, rope_dim / 2) RoPE (sin, cos)
}

fn resize(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

/// The CPU implementation of [`Backend`].
pub struct CpuBackend {
    cfg: LlamaConfig,
    arch: Architecture,
    w: LlamaWeights,
    kernels: Kernels,
    pool: ThreadPool,
    /// The distinct rotations of the layers (one, or a local and a global one) and which one
    /// each layer uses.
    ropes: Vec<Rope>,
    rope_of: Vec<usize>,
    block_size: usize,
    kv_blocks: usize,
    /// The layers' KV groups: layer `l` keeps its K/V in slot `groups.layer_slot[l].1` of the
    /// blocks of its group's table.
    groups: KvGroups,
    /// Per slot: `(kv_blocks, n_kv_heads, block_size, head_dim)` f16.
    k_cache: Vec<Vec<f16>>,
    v_cache: Vec<Vec<f16>>,
    s: Scratch,
    /// The passes timed while profiling.
    profile: Option<StepProfile>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBackend({:?}, {} threads, {} KV blocks)", self.kernels.isa, self.pool.threads(), self.kv_blocks)
    }
}

/// Checks that this forward pass runs `arch` exactly. Every field is named (no `..`), so a new
/// one does not compile until the CPU backend says what it does with it.
pub fn runs(arch: &Architecture) -> Result<(), BackendError> {
    let Architecture {
        name: _,
        norm,
        activation,
        qkv_bias: _,
        qk_norm: _,
        attn_sinks: _,
        attn_out_bias: _,
        layers,
        embedding_scale: _,
        attention_scale: _,
        tied_output: _,
        layout: _,
        moe,
    } = arch;
    if moe.is_some() && *activation == Activation::GeluTanhGated {
        return Err(BackendError::Unsupported(format!("{}: experts with GeGLU", arch.name)));
    }
    match norm {
        NormPlacement::Pre | NormPlacement::PreAndPost => {}
    }
    match activation {
        Activation::SiluGated | Activation::GeluTanhGated | Activation::SwigluOai => {}
    }
    for l in layers {
        let LayerAttention { window, rope_base: _, rope_scaling } = l;
        match rope_scaling {
            RopeScaling::None
            | RopeScaling::Linear(_)
            | RopeScaling::Factors(_)
            | RopeScaling::LongRope { .. }
            | RopeScaling::Yarn { .. } => {}
        }
        if *window == Some(0) {
            return Err(BackendError::Unsupported(format!("{}: a sliding window of zero positions", arch.name)));
        }
    }
    Ok(())
}

/// `gate = act(gate, up)` in place for the architecture's activation, from the kernel table.
fn activation_fn(k: &Kernels, a: Activation) -> fn(&mut [f32], &[f32]) {
    match a {
        Activation::SiluGated => k.swiglu,
        Activation::GeluTanhGated => k.geglu,
        Activation::SwigluOai => inferd_kernels::ops::swiglu_oai,
    }
}

/// Bytes of K and V that `block_size` positions take in every layer of this model.
pub fn kv_block_bytes(cfg: &LlamaConfig, block_size: usize) -> usize {
    cfg.n_layers * 2 * cfg.kv_dim() * block_size * std::mem::size_of::<f16>()
}

/// The KV groups of `arch`'s layers (one group when no layer has a window).
pub fn kv_groups(arch: &Architecture) -> KvGroups {
    KvGroups::for_layers(&arch.layers.iter().map(|l| l.window).collect::<Vec<_>>())
}

/// Bytes of one page of the pool: K and V of `block_size` positions for the layers of one
/// group.
pub fn kv_page_bytes(cfg: &LlamaConfig, arch: &Architecture, block_size: usize) -> usize {
    kv_block_bytes(cfg, block_size) / cfg.n_layers * kv_groups(arch).slots
}

/// `n` zero halves as the allocator's zeroed memory (for a pool this size, a fresh anonymous
/// mapping): no page is touched here, so the pool becomes resident block by block as the cache
/// is first written, and an idle model costs about its weights. (`vec![f16::ZERO; n]` writes
/// every element, making the whole pool resident at load.)
fn zeroed(n: usize) -> Vec<f16> {
    use half::vec::HalfBitsVecExt;
    vec![0u16; n].reinterpret_into()
}

/// `w` with every matrix whose type the kernels read faster packed ([`Kernels::packs`]) in
/// the packed layout, in memory of the backend's own; the embedding stays as the file has it
/// (a lookup reads single rows), even where the output projection is the same tensor. The
/// file's pages of what was packed are let go, so the process holds the weights once (a tied
/// embedding's pages come back row by row as lookups read them).
fn pack_weights(mut w: LlamaWeights, k: &Kernels, pool: &ThreadPool) -> LlamaWeights {
    let pack = |t: &mut Tensor| {
        if let Some(p) = k.packs(t.dtype).then(|| t.packed(pool)).flatten() {
            t.release();
            *t = p;
        }
    };
    for l in &mut w.layers {
        for t in [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo] {
            pack(t);
        }
        // Expert stacks pack whole where each expert's rows are whole groups of 16 (no group
        // then spans two experts, and each expert's view stays a packed matrix of its own).
        let experts = l.router.as_ref().map_or(1, |r| r.rows);
        for t in [&mut l.w_gate, &mut l.w_up, &mut l.w_down] {
            if (t.rows / experts).is_multiple_of(16) || experts == 1 {
                pack(t);
            }
        }
    }
    pack(&mut w.output);
    w
}

impl CpuBackend {
    /// A backend for `model` with its KV pool sized from `opts.kv_budget_bytes` (one block at
    /// least) on `opts.threads()` threads; refused when the model's architecture asks for
    /// something this forward pass does not run ([`runs`]).
    pub fn for_model(model: &crate::model::Model, opts: &crate::engine::EngineOptions) -> Result<Self, BackendError> {
        runs(&model.arch)?;
        let blocks = (opts.kv_budget_bytes / kv_page_bytes(&model.config, &model.arch, opts.block_size)).max(1);
        Ok(CpuBackend::new(
            model.config.clone(),
            model.arch.clone(),
            model.weights.clone(),
            blocks,
            opts.block_size,
            opts.threads(),
        ))
    }

    /// A backend with `kv_blocks` cache blocks of `block_size` positions, on `threads` threads.
    pub fn new(
        cfg: LlamaConfig,
        arch: Architecture,
        w: LlamaWeights,
        kv_blocks: usize,
        block_size: usize,
        threads: usize,
    ) -> Self {
        let per_slot = kv_blocks * cfg.kv_dim() * block_size;
        let groups = kv_groups(&arch);
        let (rotations, rope_of) = super::rotations(&cfg, &arch);
        let ropes = rotations
            .into_iter()
            .map(|(freq, scale)| Rope::with_frequencies(cfg.rope_style, freq).scaled(scale))
            .collect();
        let kernels = Kernels::detect();
        let pool = ThreadPool::new(threads.max(1));
        let w = pack_weights(w, &kernels, &pool);
        CpuBackend {
            k_cache: (0..groups.slots).map(|_| zeroed(per_slot)).collect(),
            v_cache: (0..groups.slots).map(|_| zeroed(per_slot)).collect(),
            groups,
            cfg,
            arch,
            w,
            kernels,
            pool,
            ropes,
            rope_of,
            block_size,
            kv_blocks,
            s: Scratch::default(),
            profile: None,
        }
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn isa(&self) -> inferd_kernels::Isa {
        self.kernels.isa
    }

    /// `outs[m] = x · ws[m]ᵀ` for `tokens` rows of `x`, in one parallel dispatch, the phase
    /// `phase`; quantizes `x` to 8-bit blocks first when any of the weights is quantized.
    #[allow(clippy::too_many_arguments)]
    fn project(
        pool: &ThreadPool,
        k: &Kernels,
        phase: Phase,
        laps: &mut Laps<'_>,
        ws: &[&Tensor],
        x: &[f32],
        tokens: usize,
        q8: &mut Vec<BlockQ8>,
        outs: &mut [&mut Vec<f32>],
    ) {
        if ws.iter().any(|w| w.dtype.is_quantized()) {
            q8.resize(x.len() / QK, BlockQ8::default());
            (k.quantize_q8)(x, q8);
        }
        laps.lap(Phase::Between, &[]);
        let mats: Vec<_> = ws.iter().map(|w| w.matrix()).collect();
        let mut ys: Vec<&mut [f32]> = Vec::with_capacity(outs.len());
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            resize(out, tokens * w.rows);
            ys.push(out.as_mut_slice());
        }
        matmul_many(pool, k, &mats, &Input { f32: x, q8, tokens }, &mut ys);
        laps.lap(phase, ws);
    }
}

impl CpuBackend {
    /// A mixture of experts' feed-forward of the `n` normed rows in `s.xb` into `s.out`: the
    /// router's logits, each token's choice, the experts' products grouped by expert.
    #[allow(clippy::too_many_arguments)]
    fn experts(
        pool: &ThreadPool,
        k: &Kernels,
        laps: &mut Laps<'_>,
        lw: &crate::model::weights::LayerWeights,
        router: &Tensor,
        moe: &crate::model::arch::Moe,
        activation: Activation,
        s: &mut Scratch,
        n: usize,
        h: usize,
    ) {
        use inferd_kernels::moe::{experts_ffn, route, ExpertFfn, Experts};
        Self::project(pool, k, Phase::FfnGateUp, laps, &[router], &s.xb[..n * h], n, &mut s.q8, &mut [&mut s.router]);
        let e = moe.experts;
        if let Some(b) = &lw.router_bias {
            inferd_kernels::ops::add_bias_rows(&mut s.router[..n * e], b);
        }
        let chosen: Vec<Vec<(u32, f32)>> =
            s.router.chunks_exact(e).take(n).map(|logits| route(&moe.routing, logits, None)).collect();
        fn stack(t: &Tensor, e: usize) -> Experts<'_> {
            Experts { dtype: t.dtype, n: e, rows: t.rows / e, cols: t.cols, data: t.bytes(), layout: t.layout() }
        }
        let ffn = ExpertFfn {
            gate: stack(&lw.w_gate, e),
            up: stack(&lw.w_up, e),
            down: stack(&lw.w_down, e),
            act: activation_fn(k, activation),
            biases: lw.expert_biases.as_ref().map(|[g, u, d]| [&g[..], &u[..], &d[..]]),
        };
        resize(&mut s.out, n * h);
        let ran = experts_ffn(pool, k, &ffn, &s.xb[..n * h], &chosen, &mut s.out[..n * h], &mut s.moe);
        // The chosen experts' bytes: what the step read of the stacks.
        let per_expert = [&lw.w_gate, &lw.w_up, &lw.w_down].iter().map(|t| t.bytes().len() / e).sum::<usize>();
        laps.lap_bytes(Phase::FfnDown, (ran * per_expert) as u64);
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> String {
        format!("{:?}", self.kernels.isa)
    }

    fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn kv_groups(&self) -> &KvGroups {
        &self.groups
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), BackendError> {
        let n = self.cfg.kv_dim() * self.block_size;
        for c in copies {
            for b in [c.src, c.dst] {
                if b as usize >= self.kv_blocks {
                    return Err(BackendError::BadBlock(b));
                }
            }
            let (src, dst) = (c.src as usize * n, c.dst as usize * n);
            for cache in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
                cache.copy_within(src..src + n, dst);
            }
        }
        Ok(())
    }

    fn release_blocks(&mut self, blocks: &[crate::kv::BlockId]) {
        // Runs of adjacent blocks, so pages spanning two blocks of a run go back too.
        let n = self.cfg.kv_dim() * self.block_size;
        let mut ids: Vec<usize> = blocks.iter().map(|&b| b as usize).filter(|&b| b < self.kv_blocks).collect();
        ids.sort_unstable();
        let mut i = 0;
        while i < ids.len() {
            let mut j = i + 1;
            while j < ids.len() && ids[j] == ids[j - 1] + 1 {
                j += 1;
            }
            let (from, to) = (ids[i] * n, (ids[j - 1] + 1) * n);
            for cache in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
                crate::model::mmap::release_pages(&mut cache[from..to]);
            }
            i = j;
        }
    }

    fn set_profiling(&mut self, on: bool) -> bool {
        self.profile = on.then(StepProfile::default);
        self.pool.set_timing(on);
        true
    }

    fn take_profile(&mut self) -> Option<StepProfile> {
        self.profile.as_mut().map(std::mem::take)
    }

    fn forward(&mut self, batch: &[SeqBatch<'_>], rows: &mut Vec<f32>) -> Result<(), BackendError> {
        self.run(batch, rows)
    }
}

impl CpuBackend {
    /// The forward pass: the asked-for rows into `out`, logits or (for a sequence that asks
    /// for them) normed hidden states.
    fn run(&mut self, batch: &[SeqBatch<'_>], out: &mut Vec<f32>) -> Result<(), BackendError> {
        validate_batch(&self.cfg, &self.groups, self.kv_blocks, self.block_size, batch)?;
        let cfg = &self.cfg;
        let (h, hd, nkv, bs) = (cfg.hidden, cfg.head_dim, cfg.n_kv_heads, self.block_size);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        // Flatten: token t of the batch belongs to sequence seq_of[t] at position pos_of[t].
        let tokens: Vec<u32> = batch.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let pos_of: Vec<usize> = batch.iter().flat_map(|s| s.start_pos..s.start_pos + s.tokens.len()).collect();
        // What each token sees in each KV group: that group's table, from its window's start.
        let ctxs: Vec<Vec<QueryCtx<'_>>> = (self.groups.windows.iter().enumerate())
            .map(|(g, window)| {
                batch
                    .iter()
                    .flat_map(|s| {
                        (s.start_pos..s.start_pos + s.tokens.len()).map(move |p| QueryCtx {
                            table: &s.block_tables[g],
                            ctx_len: p + 1,
                            start: window.map_or(0, |w| (p + 1).saturating_sub(w)),
                        })
                    })
                    .collect()
            })
            .collect();
        let n = tokens.len();
        let s = &mut self.s;
        let (pool, k, arch) = (&self.pool, &self.kernels, &self.arch);
        let mut laps = Laps::start(self.profile.as_mut(), pool, n);
        let eps = cfg.rms_eps;

        resize(&mut s.x, n * h);
        for (t, &tok) in tokens.iter().enumerate() {
            self.w.token_embd.row_f32(tok as usize, &mut s.x[t * h..(t + 1) * h]);
        }
        if let Some(scale) = arch.embedding_scale {
            s.x.iter_mut().for_each(|v| *v *= scale);
        }
        resize(&mut s.xb, n * h);
        resize(&mut s.att, n * qd);
        // (tokens, rope_dim / 2) rotations of each kind, shared by the layers of that kind.
        s.angles.resize_with(self.ropes.len(), Vec::new);
        for (rope, angles) in self.ropes.iter().zip(s.angles.iter_mut()) {
            let pairs = rope.pairs();
            angles.resize(n * pairs, (0.0, 0.0));
            for (t, &p) in pos_of.iter().enumerate() {
                rope.angles(p, &mut angles[t * pairs..(t + 1) * pairs]);
            }
        }
        for (li, lw) in self.w.layers.iter().enumerate() {
            let la = &arch.layers[li];
            // Attention block.
            for t in 0..n {
                rms_norm(&s.x[t * h..(t + 1) * h], &lw.attn_norm, eps, &mut s.xb[t * h..(t + 1) * h]);
            }
            Self::project(
                pool,
                k,
                Phase::QkvProjection,
                &mut laps,
                &[&lw.wq, &lw.wk, &lw.wv],
                &s.xb,
                n,
                &mut s.q8,
                &mut [&mut s.q, &mut s.k, &mut s.v],
            );
            if let Some([bq, bk, bv]) = &lw.qkv_bias {
                for (out, b) in [(&mut s.q, bq), (&mut s.k, bk), (&mut s.v, bv)] {
                    inferd_kernels::ops::add_bias_rows(out, b);
                }
            }
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                rms_norm_each(&mut s.q, qn, eps);
                rms_norm_each(&mut s.k, kn, eps);
            }
            let (rope, angles) = (&self.ropes[self.rope_of[li]], &s.angles[self.rope_of[li]]);
            for (t, angles) in angles.chunks_exact(rope.pairs()).enumerate() {
                rope.apply_angles(&mut s.q[t * qd..(t + 1) * qd], hd, angles);
                rope.apply_angles(&mut s.k[t * kvd..(t + 1) * kvd], hd, angles);
            }
            let (group, slot) = self.groups.layer_slot[li];
            let ctx = &ctxs[group];
            let (kc, vc) = (&mut self.k_cache[slot], &mut self.v_cache[slot]);
            for t in 0..n {
                let p = pos_of[t];
                let blk = ctx[t].table[p / bs] as usize;
                for g in 0..nkv {
                    let o = PagedKv::offset(bs, nkv, hd, blk, g, p % bs);
                    let src = t * kvd + g * hd;
                    // The half crate converts slices 4 or 8 at a time where the CPU has F16C.
                    kc[o..o + hd].convert_from_f32_slice(&s.k[src..src + hd]);
                    vc[o..o + hd].convert_from_f32_slice(&s.v[src..src + hd]);
                }
            }
            let kv = PagedKv { k: kc, v: vc, block_size: bs, n_kv_heads: nkv, head_dim: hd };
            debug_assert_eq!(la.window, self.groups.windows[group], "a layer's group has its window");
            laps.lap(Phase::Between, &[]);
            let sinks = lw.attn_sinks.as_deref();
            attend_batch(pool, k, &kv, cfg.n_heads, arch.attention_scale, sinks, &s.q, ctx, &mut s.att);
            laps.lap(Phase::Attention, &[]);
            Self::project(
                pool,
                k,
                Phase::OutputProjection,
                &mut laps,
                &[&lw.wo],
                &s.att,
                n,
                &mut s.q8,
                &mut [&mut s.out],
            );
            if let Some(b) = &lw.wo_bias {
                inferd_kernels::ops::add_bias_rows(&mut s.out, b);
            }
            if let Some(post) = &lw.attn_post_norm {
                rms_norm_each(&mut s.out, post, eps);
            }
            s.x.iter_mut().zip(&s.out).for_each(|(x, o)| *x += o);

            // Feed-forward block (gated).
            for t in 0..n {
                rms_norm(&s.x[t * h..(t + 1) * h], &lw.ffn_norm, eps, &mut s.xb[t * h..(t + 1) * h]);
            }
            if let (Some(router), Some(moe)) = (&lw.router, &arch.moe) {
                Self::experts(pool, k, &mut laps, lw, router, moe, arch.activation, s, n, h);
                s.x.iter_mut().zip(&s.out).for_each(|(x, o)| *x += o);
                continue;
            }
            Self::project(
                pool,
                k,
                Phase::FfnGateUp,
                &mut laps,
                &[&lw.w_gate, &lw.w_up],
                &s.xb,
                n,
                &mut s.q8,
                &mut [&mut s.gate, &mut s.up],
            );
            activation_fn(k, arch.activation)(&mut s.gate, &s.up);
            Self::project(pool, k, Phase::FfnDown, &mut laps, &[&lw.w_down], &s.gate, n, &mut s.q8, &mut [&mut s.out]);
            if let Some(post) = &lw.ffn_post_norm {
                rms_norm_each(&mut s.out, post, eps);
            }
            s.x.iter_mut().zip(&s.out).for_each(|(x, o)| *x += o);
        }

        // Rows only for the positions asked for; logits only for the sequences that want them.
        let (mut rows, mut logit_rows) = (Vec::new(), Vec::new());
        let mut t0 = 0;
        for sb in batch {
            let len = sb.tokens.len();
            if !sb.hidden {
                logit_rows.extend(rows.len()..rows.len() + sb.logits);
            }
            rows.extend(t0 + len - sb.logits..t0 + len);
            t0 += len;
        }
        resize(&mut s.xb, rows.len() * h);
        for (i, &t) in rows.iter().enumerate() {
            rms_norm(&s.x[t * h..(t + 1) * h], &self.w.output_norm, cfg.rms_eps, &mut s.xb[i * h..(i + 1) * h]);
        }
        out.clear();
        if logit_rows.len() == rows.len() && !rows.is_empty() {
            // Logits only (every decode step): projected straight into `out`.
            Self::project(
                pool,
                k,
                Phase::Logits,
                &mut laps,
                &[&self.w.output],
                &s.xb,
                rows.len(),
                &mut s.q8,
                &mut [out],
            );
            return Ok(());
        }
        if logit_rows.is_empty() {
            out.extend_from_slice(&s.xb[..rows.len() * h]);
            laps.lap(Phase::Between, &[]);
            return Ok(());
        }
        // Both: the logits rows projected together, then every row placed in batch order.
        resize(&mut s.out, logit_rows.len() * h);
        for (j, &i) in logit_rows.iter().enumerate() {
            s.out[j * h..(j + 1) * h].copy_from_slice(&s.xb[i * h..(i + 1) * h]);
        }
        Self::project(
            pool,
            k,
            Phase::Logits,
            &mut laps,
            &[&self.w.output],
            &s.out[..logit_rows.len() * h],
            logit_rows.len(),
            &mut s.q8,
            &mut [&mut s.logits],
        );
        let vocab = cfg.vocab;
        let mut next = logit_rows.iter().enumerate().peekable();
        for i in 0..rows.len() {
            match next.peek() {
                Some(&(j, &r)) if r == i => {
                    out.extend_from_slice(&s.logits[j * vocab..(j + 1) * vocab]);
                    next.next();
                }
                _ => out.extend_from_slice(&s.xb[i * h..(i + 1) * h]),
            }
        }
        Ok(())
    }
}
