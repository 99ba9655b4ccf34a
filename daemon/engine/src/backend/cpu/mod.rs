//! The CPU backend: quantized weights straight from the memory map, f16 K/V blocks in host
//! memory, kernels from `inferd-kernels` (AVX2 when the processor has it), all cores.
//!
//! A forward pass runs the whole batch (every sequence's new tokens, prefill chunks and decode
//! tokens alike) through each layer together, so each weight matrix is read once per step
//! whatever the batch size. K/V of the new tokens is written into the paged cache before
//! attention, which then reads every position (old and new) through the block tables. A
//! mixture of experts routes each token and runs the step's tokens grouped by expert
//! ([`inferd_kernels::moe`]), each chosen expert read once per step.

mod ops;

use super::layer::{layer, Act};
use super::profile::{Laps, Phase, StepProfile};
use super::{validate_batch, Backend, BackendError, SeqBatch};
use crate::kv::{BlockCopy, KvGroups};
use crate::model::arch::{Activation, Architecture, LayerAttention, NormPlacement, RopeScaling};
use crate::model::{LlamaConfig, LlamaWeights, Tensor};
use half::f16;
use inferd_kernels::attention::QueryCtx;
use inferd_kernels::matmul::{matmul_many, Input};
use inferd_kernels::ops::{rms_norm, Rope};
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::quant::QK;
use inferd_kernels::{BlockQ8, Kernels};
use ops::{CpuOps, SeqSpan};
use std::sync::Arc;

/// Activation buffers, grown to the largest batch seen and reused.
#[derive(Default)]
struct Scratch {
    /// The layer's buffers ([`Act`]), each `(tokens, width)`.
    acts: [Vec<f32>; Act::COUNT],
    q8: Vec<BlockQ8>,
    logits: Vec<f32>, // (rows, vocab) logits of a batch that also returns hidden rows
    router: Vec<f32>, // (tokens, experts) a mixture of experts' router logits
    moe: inferd_kernels::moe::MoeScratch,
    /// A DeltaNet's convolved inputs, queries, keys, values, decays and write strengths of
    /// one sequence.
    delta: [Vec<f32>; 6],
    angles: Vec<Vec<(f32, f32)>>, // per rotation: (tokens, rope_dim / 2) RoPE (sin, cos)
    /// (tokens, layers * width) every layer's per-layer embedding input (Gemma 4).
    ple: Vec<f32>,
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
    /// Its compute threads, shared with a draft model's backend beside it
    /// ([`Backend::cpu_pool`]).
    pool: Arc<ThreadPool>,
    /// The distinct rotations of the layers (one, or a local and a global one) and which one
    /// each layer uses.
    ropes: Vec<Rope>,
    rope_of: Vec<usize>,
    block_size: usize,
    kv_blocks: usize,
    /// Floats of a token's K (or V) in a cache slot ([`Architecture::kv_width`]).
    kv_width: usize,
    /// The layers' KV groups: layer `l` keeps its K/V in slot `groups.layer_slot[l].1` of the
    /// blocks of its group's table.
    groups: KvGroups,
    /// Per slot: `kv_blocks` blocks of [`Architecture::kv_width`] `* block_size` f16, a layer's
    /// `(n_kv_heads, block_size, head_dim)` at the start of each.
    k_cache: Vec<Vec<f16>>,
    v_cache: Vec<Vec<f16>>,
    /// Per DeltaNet layer: `state_slots` states of [`crate::model::arch::DeltaNet::state_floats`]
    /// each (the convolution's window, then the recurrence's matrices).
    states: Vec<Vec<f32>>,
    state_slots: usize,
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
        moe: _,
        attn_output_gate: _,
        delta,
        value_norm: _,
        per_layer: _,
        final_softcap: _,
        ffn_widths,
        mrope: _,
        deepstack: _,
    } = arch;
    if ffn_widths.len() != layers.len() || ffn_widths.contains(&0) {
        return Err(BackendError::Unsupported(format!("{}: feed-forward widths {ffn_widths:?}", arch.name)));
    }

    match norm {
        NormPlacement::Pre | NormPlacement::PreAndPost => {}
    }
    match activation {
        Activation::SiluGated | Activation::GeluTanhGated | Activation::SwigluOai => {}
    }
    for l in layers {
        let LayerAttention {
            window,
            rope_base: _,
            rope_scaling,
            delta_net,
            head_dim: _,
            kv_heads: _,
            rope_dim: _,
            kv_from,
        } = l;
        if kv_from.is_some_and(|src| arch.layers.get(src).is_none_or(|s| s.kv_from.is_some() || s.window != *window)) {
            return Err(BackendError::Unsupported(format!(
                "{}: a layer reads K/V no layer of its kind keeps",
                arch.name
            )));
        }
        if *delta_net && delta.is_none() {
            return Err(BackendError::Unsupported(format!("{}: a DeltaNet layer without its shape", arch.name)));
        }
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

/// Bytes of K and V that `block_size` positions take in every layer of this model (of a
/// model without recurrent layers: [`kv_page_bytes`] is the general form).
pub fn kv_block_bytes(cfg: &LlamaConfig, block_size: usize) -> usize {
    cfg.n_layers * 2 * cfg.kv_dim() * block_size * std::mem::size_of::<f16>()
}

/// The KV groups of `arch`'s layers that keep K/V (one group when no layer has a window); a
/// layer's group and slot are at its index among those layers ([`Architecture::kv_layer`]).
pub fn kv_groups(arch: &Architecture) -> KvGroups {
    KvGroups::for_layers(&arch.kv_layers().iter().map(|&l| arch.layers[l].window).collect::<Vec<_>>())
}

/// Bytes of one page of the pool: K and V of `block_size` positions for the layers of one
/// group (each slot as wide as the widest layer's K/V: [`Architecture::kv_width`]).
pub fn kv_page_bytes(arch: &Architecture, block_size: usize) -> usize {
    2 * arch.kv_width() * block_size * std::mem::size_of::<f16>() * kv_groups(arch).slots
}

/// Bytes of one sequence's recurrent state, every DeltaNet layer's (none without them).
pub fn state_bytes(arch: &Architecture) -> usize {
    let layers = arch.layers.iter().filter(|l| l.delta_net).count();
    arch.delta.map_or(0, |d| layers * d.state_floats() * std::mem::size_of::<f32>())
}

/// The recurrent state slots a hybrid model gets from a cache budget of `budget` bytes: half of
/// it (only a quarter of such a model's layers keep K/V, and a state is large: what a chunk of
/// the recurrence and a speculative rollback need), at least one slot and at most
/// [`MAX_STATES`] (no batch is larger); none for a model without recurrent layers.
pub fn state_slots(arch: &Architecture, budget: usize) -> usize {
    match state_bytes(arch) {
        0 => 0,
        b => (budget / STATE_SHARE / b).clamp(1, MAX_STATES),
    }
}

/// A hybrid model's recurrent states get `1 / STATE_SHARE` of its cache budget.
pub const STATE_SHARE: usize = 2;

/// The most recurrent state slots a backend keeps.
pub const MAX_STATES: usize = 256;

/// `x = c * tanh(x / c)` on every logit where the model soft-caps them.
fn softcap(cap: Option<f32>, x: &mut [f32]) {
    if let Some(c) = cap {
        x.iter_mut().for_each(|v| *v = c * (*v / c).tanh());
    }
}

/// `n` zero halves as the allocator's zeroed memory (for a pool this size, a fresh anonymous
/// mapping): no page is touched here, so the pool becomes resident block by block as the cache
/// is first written, and an idle model costs about its weights. (`vec![f16::ZERO; n]` writes
/// every element, making the whole pool resident at load.)
fn zeroed(n: usize) -> Vec<f16> {
    use half::vec::HalfBitsVecExt;
    vec![0u16; n].reinterpret_into()
}

/// [`zeroed`] for floats.
fn zeroed_f32(n: usize) -> Vec<f32> {
    vec![0.0; n]
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
        for t in l.mixer_matrices_mut() {
            pack(t);
        }
        for t in l.shared_matrices_mut() {
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
    /// least) on `opts.pool`, or `opts.threads()` threads of its own; refused when the model's architecture asks for
    /// something this forward pass does not run ([`runs`]).
    pub fn for_model(model: &crate::model::Model, opts: &crate::engine::EngineOptions) -> Result<Self, BackendError> {
        runs(&model.arch)?;
        // A hybrid model's recurrent states come out of the same budget.
        let states = state_slots(&model.arch, opts.kv_budget_bytes);
        let kv_budget = opts.kv_budget_bytes.saturating_sub(states * state_bytes(&model.arch));
        let blocks = (kv_budget / kv_page_bytes(&model.arch, opts.block_size)).max(1);
        let mut b = CpuBackend::new(
            model.config.clone(),
            model.arch.clone(),
            model.weights.clone(),
            blocks,
            opts.block_size,
            opts.pool.clone().unwrap_or_else(|| Arc::new(ThreadPool::new(opts.threads().max(1)))),
        );
        b.set_state_slots(states);
        Ok(b)
    }

    /// A backend with `kv_blocks` cache blocks of `block_size` positions, on `pool`'s threads.
    pub fn new(
        cfg: LlamaConfig,
        arch: Architecture,
        w: LlamaWeights,
        kv_blocks: usize,
        block_size: usize,
        pool: Arc<ThreadPool>,
    ) -> Self {
        let kv_width = arch.kv_width();
        let per_slot = kv_blocks * kv_width * block_size;
        let groups = kv_groups(&arch);
        let (rotations, rope_of) = super::rotations(&cfg, &arch);
        let ropes = rotations
            .into_iter()
            .map(|(freq, scale)| Rope::with_frequencies(cfg.rope_style, freq).scaled(scale))
            .collect();
        let kernels = Kernels::detect();
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
            kv_width,
            states: Vec::new(),
            state_slots: 0,
            s: Scratch::default(),
            profile: None,
        }
    }

    /// Keeps `n` recurrent state slots for the DeltaNet layers (zeroed memory, resident as
    /// states are first written).
    pub fn set_state_slots(&mut self, n: usize) {
        let floats = self.arch.delta.map_or(0, |d| d.state_floats());
        let layers = self.arch.layers.iter().filter(|l| l.delta_net).count();
        self.states = (0..layers).map(|_| zeroed_f32(n * floats)).collect();
        self.state_slots = if layers > 0 { n } else { 0 };
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn isa(&self) -> inferd_kernels::Isa {
        self.kernels.isa
    }

    /// Every token's per-layer embedding inputs, `(tokens, layers * width)` into `out`: its
    /// row of the table times `sqrt(width)`, plus the projection of its (scaled) embedding `x`
    /// divided by `sqrt(hidden)` and RMS-normed a layer's piece at a time, the sum divided by
    /// `sqrt(2)`. The table is read a row per token from the file's mapping.
    #[allow(clippy::too_many_arguments)]
    fn per_layer_inputs(
        pool: &ThreadPool,
        k: &Kernels,
        laps: &mut Laps<'_>,
        p: &crate::model::weights::PerLayerEmbd,
        cfg: &LlamaConfig,
        tokens: &[u32],
        x: &[f32],
        q8: &mut Vec<BlockQ8>,
        mut out: Vec<f32>,
    ) -> Vec<f32> {
        let (n, row) = (tokens.len(), p.proj.rows);
        Self::project(pool, k, Phase::Between, laps, &[&p.proj], x, n, q8, &mut [&mut out]);
        let (to_unit, table_scale) = (1.0 / (cfg.hidden as f32).sqrt(), (p.width as f32).sqrt());
        let mut e = vec![0.0; row];
        for (t, &tok) in tokens.iter().enumerate() {
            let y = &mut out[t * row..(t + 1) * row];
            y.iter_mut().for_each(|v| *v *= to_unit);
            inferd_kernels::ops::rms_norm_each(y, &p.proj_norm, cfg.rms_eps);
            p.table.row_f32(tok as usize, &mut e);
            y.iter_mut().zip(&e).for_each(|(v, e)| *v = (*v + e * table_scale) * std::f32::consts::FRAC_1_SQRT_2);
        }
        out
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
            let (quantize, cols) = (k.quantize_q8, x.len() / tokens.max(1));
            pool.for_rows(q8, cols / QK, &|first, q8| quantize(&x[first * cols..][..q8.len() * QK], q8));
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

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> String {
        format!("{:?}", self.kernels.isa)
    }

    fn cpu_pool(&self) -> Option<Arc<ThreadPool>> {
        Some(Arc::clone(&self.pool))
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
        let n = self.kv_width * self.block_size;
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

    fn state_slots(&self) -> usize {
        self.state_slots
    }

    fn copy_states(&mut self, copies: &[(u32, u32)]) -> Result<(), BackendError> {
        super::validate_state_copies(self.state_slots, copies)?;
        let floats = self.arch.delta.map_or(0, |d| d.state_floats());
        for &(src, dst) in copies {
            let (src, dst) = (src as usize * floats, dst as usize * floats);
            for layer in &mut self.states {
                layer.copy_within(src..src + floats, dst);
            }
        }
        Ok(())
    }

    fn release_blocks(&mut self, blocks: &[crate::kv::BlockId]) {
        // Runs of adjacent blocks, so pages spanning two blocks of a run go back too.
        let n = self.kv_width * self.block_size;
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
        let (h, bs) = (cfg.hidden, self.block_size);
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
                            // Positions that see each other both ways see up to the last of
                            // them (and still not before their window).
                            ctx_len: (s.embeds.iter().filter(|e| e.both_ways))
                                .map(|e| e.positions(h))
                                .find(|r| r.contains(&p))
                                .map_or(p + 1, |r| r.end),
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

        let x = &mut s.acts[Act::X.index()];
        resize(x, n * h);
        let vocab = cfg.vocab;
        for (t, &tok) in tokens.iter().enumerate() {
            // Media ids (validated: only where input embeddings are given) are written below.
            if (tok as usize) < vocab {
                self.w.token_embd.row_f32(tok as usize, &mut x[t * h..(t + 1) * h]);
            }
        }
        if let Some(scale) = arch.embedding_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        if let Some(e) = batch.iter().flat_map(|sb| sb.embeds).find(|e| e.deepstack != arch.deepstack) {
            return Err(BackendError::Invalid(format!(
                "input rows with {} deepstack rows for {}, which takes {}",
                e.deepstack, arch.name, arch.deepstack
            )));
        }
        for (t, row) in embedded_rows(batch, h) {
            x[t * h..(t + 1) * h].copy_from_slice(&row[..h]);
        }
        if self.w.per_layer.is_some() && batch.iter().any(|sb| !sb.embeds.is_empty()) {
            return Err(BackendError::Unsupported("input embeddings for a model with per-layer embeddings".into()));
        }
        if let Some(p) = &self.w.per_layer {
            let ple = std::mem::take(&mut s.ple);
            s.ple =
                Self::per_layer_inputs(pool, k, &mut laps, p, cfg, &tokens, &s.acts[Act::X.index()], &mut s.q8, ple);
        }
        // (tokens, rope_dim / 2) rotations of each kind, shared by the layers of that kind.
        // M-RoPE's coordinates where a sequence gives them (its images'), else (p, p, p, 0);
        // gathered only where some sequence gives them.
        let coords: Vec<Option<[u32; 4]>> = match batch.iter().any(|sb| !sb.mrope.is_empty()) {
            true => batch.iter().flat_map(|sb| (0..sb.tokens.len()).map(|i| sb.mrope.get(i).copied())).collect(),
            false => Vec::new(),
        };
        if arch.mrope.is_none() && !coords.is_empty() {
            return Err(BackendError::Invalid(format!("M-RoPE coordinates for {}, which has no M-RoPE", arch.name)));
        }
        s.angles.resize_with(self.ropes.len(), Vec::new);
        for (rope, angles) in self.ropes.iter().zip(s.angles.iter_mut()) {
            let pairs = rope.pairs();
            angles.resize(n * pairs, (0.0, 0.0));
            for (t, &p) in pos_of.iter().enumerate() {
                let out = &mut angles[t * pairs..(t + 1) * pairs];
                match arch.mrope {
                    Some(m) => {
                        let p = p as u32;
                        let c = coords.get(t).copied().flatten().unwrap_or([p, p, p, 0]);
                        rope.angles_sections(c, m.sections, m.interleaved, out)
                    }
                    None => rope.angles(p, out),
                }
            }
        }
        // Each sequence's first token in the batch, its token count, its first position and its
        // recurrent state's slot.
        let mut seqs = Vec::with_capacity(batch.len());
        let mut t0 = 0;
        for sb in batch {
            seqs.push(SeqSpan {
                t0,
                n: sb.tokens.len(),
                start: sb.start_pos,
                state: sb.state,
                checkpoint: sb.checkpoint,
            });
            t0 += sb.tokens.len();
        }
        super::validate_states(self.state_slots, batch)?;
        let mut ops = CpuOps {
            pool,
            k,
            laps: &mut laps,
            cfg,
            arch,
            s,
            n,
            pos_of: &pos_of,
            ctxs: &ctxs,
            ropes: &self.ropes,
            rope_of: &self.rope_of,
            groups: &self.groups,
            k_cache: &mut self.k_cache,
            v_cache: &mut self.v_cache,
            block_size: bs,
            block_floats: self.kv_width * bs,
            seqs: &seqs,
            states: &mut self.states,
        };
        for (li, lw) in self.w.layers.iter().enumerate() {
            layer(&mut ops, arch, li, lw)?;
            if li < arch.deepstack {
                // Qwen3-VL's deepstack: image tokens' row `1 + li` joins their hidden state.
                let x = &mut ops.s.acts[Act::X.index()];
                for (t, row) in embedded_rows(batch, h) {
                    let add = &row[(1 + li) * h..(2 + li) * h];
                    x[t * h..(t + 1) * h].iter_mut().zip(add).for_each(|(x, a)| *x += a);
                }
            }
        }
        let [x, xb, .., o] = &mut s.acts;

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
        resize(xb, rows.len() * h);
        for (i, &t) in rows.iter().enumerate() {
            rms_norm(&x[t * h..(t + 1) * h], &self.w.output_norm, cfg.rms_eps, &mut xb[i * h..(i + 1) * h]);
        }
        out.clear();
        if logit_rows.len() == rows.len() && !rows.is_empty() {
            // Logits only (every decode step): projected straight into `out`.
            Self::project(pool, k, Phase::Logits, &mut laps, &[&self.w.output], xb, rows.len(), &mut s.q8, &mut [out]);
            softcap(arch.final_softcap, out);
            return Ok(());
        }
        if logit_rows.is_empty() {
            out.extend_from_slice(&xb[..rows.len() * h]);
            laps.lap(Phase::Between, &[]);
            return Ok(());
        }
        // Both: the logits rows projected together, then every row placed in batch order.
        resize(o, logit_rows.len() * h);
        for (j, &i) in logit_rows.iter().enumerate() {
            o[j * h..(j + 1) * h].copy_from_slice(&xb[i * h..(i + 1) * h]);
        }
        Self::project(
            pool,
            k,
            Phase::Logits,
            &mut laps,
            &[&self.w.output],
            &o[..logit_rows.len() * h],
            logit_rows.len(),
            &mut s.q8,
            &mut [&mut s.logits],
        );
        softcap(arch.final_softcap, &mut s.logits);
        let vocab = cfg.vocab;
        let mut next = logit_rows.iter().enumerate().peekable();
        for i in 0..rows.len() {
            match next.peek() {
                Some(&(j, &r)) if r == i => {
                    out.extend_from_slice(&s.logits[j * vocab..(j + 1) * vocab]);
                    next.next();
                }
                _ => out.extend_from_slice(&xb[i * h..(i + 1) * h]),
            }
        }
        Ok(())
    }
}

/// Each row of the batch's input embeddings (`Embedded::width` floats) and the index of its
/// token in the batch.
fn embedded_rows<'b>(batch: &'b [SeqBatch<'b>], h: usize) -> impl Iterator<Item = (usize, &'b [f32])> + 'b {
    let starts = batch.iter().scan(0, |t0, sb| {
        let at = *t0;
        *t0 += sb.tokens.len();
        Some(at)
    });
    batch.iter().zip(starts).flat_map(move |(sb, t0)| {
        sb.embeds.iter().flat_map(move |e| {
            let at = t0 + e.pos - sb.start_pos;
            e.rows.chunks_exact(e.width(h)).enumerate().map(move |(i, row)| (at + i, row))
        })
    })
}
