//! The CUDA backend: weights and the paged KV pool in the memory of a [`Stream`], the kernels
//! of `kernels/cuda` launched layer by layer through their typed calls
//! ([`KernelCalls`]). On a GPU the stream is [`Gpu`] (found by `inferd_kernels::cuda::device`,
//! its kernels compiled by NVRTC into the kernel cache, [`crate::paths::cache_dir`]); the tests
//! run the same forward pass on the host emulation of the kernels (`inferd_kernels::cuda::host`),
//! so every line here runs on machines without a GPU too. Where there is no GPU, no driver or no
//! NVRTC, [`open`] says which and the daemon serves on the CPU unless `backend = "cuda"` asked
//! for the GPU.
//!
//! A forward pass runs the whole batch through each layer together, as the CPU backend does.
//! Products of up to [`GEMM_TOKENS`] tokens (decode, small batches) read the weights in their
//! own encoding: a quantized matrix against the activations rounded to 8 bits as the CPU
//! backend rounds them (`matvec_q8`, each group's term the CPU's to the bit), a float one
//! against f32 activations (`matvec`); larger products (prefill) decode the matrix to halves
//! and multiply on cuBLAS, where it is installed. Attention covers the batch's queries in tiles
//! of one sequence's consecutive tokens, and splits long ones' positions when the tiles are too
//! few to fill the GPU (`attention_plan`, per KV group, once a pass). Logits come back to the
//! host for the decoding plugins, only for the positions asked for.

use super::layer::{layer, Act, LayerOps};
use super::profile::Phase;
use super::{validate_batch, Backend, BackendError, DeviceMemory, KernelProfile, SeqBatch};
use crate::engine::EngineOptions;
use crate::kv::{BlockCopy, KvGroups};
use crate::model::arch::{Activation, Architecture};
use crate::model::weights::LayerWeights;
use crate::model::{LlamaConfig, Model, Tensor};
use inferd_kernels::cuda::calls::{
    is_quantized, AttentionPlan, AttentionShape, DeltaRows, Gated, KernelCalls, Q8Activations, WeightShape,
};
use inferd_kernels::cuda::gpu::Gpu;
use inferd_kernels::cuda::stream::{GemmShape, GpuError, Stream};
use inferd_kernels::ops::RopeStyle;

/// What `backend = "cuda"` finds on this machine: the GPU with the model on it, or why not.
pub fn open(model: &Model, opts: &EngineOptions) -> Result<Box<dyn Backend>, BackendError> {
    let refuse = |why: String| BackendError::Unsupported(format!("backend \"cuda\" for {}: {why}", model.name));
    // Its rotation is plain RoPE by position: Qwen2-VL's sections equal that for text, but
    // Qwen3-VL's interleaved ones leave some pairs to the fourth coordinate (0 for text).
    if model.arch.mrope.is_some_and(|m| m.interleaved) {
        return Err(refuse("interleaved M-RoPE (Qwen3-VL) runs on the CPU backend".into()));
    }
    let gpu = Gpu::open(&crate::paths::cache_dir().join("cuda")).map_err(|e| refuse(e.to_string()))?;
    Ok(Box::new(CudaBackend::new(gpu, model, opts).map_err(|e| refuse(e.to_string()))?))
}

/// Products of more tokens than this go to the stream's product of halves (cuBLAS), the matrix
/// decoded to halves first; up to it `matvec` reads the weights as they are, a pass per 8
/// tokens, fewer bytes than decoding them.
pub const GEMM_TOKENS: usize = 32;

/// A product's input: the activations, and their 8-bit rounding where a quantized matrix's
/// `matvec_q8` takes them.
struct Input<'a, S: Stream> {
    x: &'a S::Buf<f32>,
    q8: Option<Q8Activations<S>>,
    tokens: usize,
}

/// A weight matrix in the stream's memory, still in its file's encoding.
struct Weight<S: Stream> {
    data: S::Buf<u8>,
    shape: WeightShape,
}

impl<S: Stream> Weight<S> {
    fn upload(s: &S, t: &Tensor) -> Result<Self, GpuError> {
        // The model's own weights, never a CPU backend's packed copy: the kernels read rows.
        debug_assert_eq!(t.layout(), inferd_kernels::pack::Layout::Rows, "{} is packed", t.name);
        let row_bytes = t.dtype.bytes_for(t.cols).unwrap_or(0);
        let shape = WeightShape { ggml_type: t.dtype.ggml_type(), row_bytes, rows: t.rows, cols: t.cols };
        Ok(Weight { data: s.upload(t.bytes())?, shape })
    }
}

/// A layer's matrix in the stream's memory: one, or a mixture's stack of experts.
enum Matrix<S: Stream> {
    One(Weight<S>),
    /// Each expert's matrix, and its bias where the family has them.
    Experts {
        parts: Vec<Weight<S>>,
        biases: Vec<S::Buf<f32>>,
    },
}

impl<S: Stream> Matrix<S> {
    /// The `experts` matrices stacked in `t`, each uploaded alone, with its rows of `biases`.
    fn experts(s: &S, t: &Tensor, experts: usize, biases: Option<&[f32]>) -> Result<Self, GpuError> {
        let rows = t.rows / experts;
        let parts =
            (0..experts).map(|e| Weight::upload(s, &t.rows_of(e * rows, (e + 1) * rows))).collect::<Result<_, _>>()?;
        let biases = biases
            .map(|b| b.chunks_exact(rows).map(|b| s.upload(b)).collect::<Result<Vec<_>, _>>())
            .transpose()?
            .unwrap_or_default();
        Ok(Matrix::Experts { parts, biases })
    }

    /// The matrix of a product.
    fn one(&self) -> Result<&Weight<S>, BackendError> {
        match self {
            Matrix::One(w) => Ok(w),
            Matrix::Experts { .. } => Err(BackendError::Device("a product of a whole stack of experts".into())),
        }
    }

    /// Expert `e`'s matrix and bias.
    fn expert(&self, e: usize) -> Result<Expert<'_, S>, BackendError> {
        match self {
            Matrix::Experts { parts, biases } if e < parts.len() => Ok((&parts[e], biases.get(e))),
            _ => Err(BackendError::Device(format!("expert {e} of a matrix that has no such expert"))),
        }
    }
}

/// An expert's matrix and its bias.
type Expert<'a, S> = (&'a Weight<S>, Option<&'a <S as Stream>::Buf<f32>>);

/// A layer's weights in the stream's memory: matrices in their file's encoding, vectors f32.
type Layer<S> = LayerWeights<Matrix<S>, <S as Stream>::Buf<f32>>;

/// The CUDA implementation of [`Backend`], on stream `S`.
pub struct CudaBackend<S: Stream> {
    s: S,
    cfg: LlamaConfig,
    arch: Architecture,
    token_embd: Weight<S>,
    /// The output projection; `None` when the model ties it to the embedding.
    output: Option<Weight<S>>,
    output_norm: S::Buf<f32>,
    layers: Vec<Layer<S>>,
    /// The distinct rotations (inverse frequencies, magnitude factor) and each layer's.
    ropes: Vec<(S::Buf<f32>, f32)>,
    rope_of: Vec<usize>,
    groups: KvGroups,
    block_size: usize,
    kv_blocks: usize,
    /// Per slot: `(kv_blocks, block_size, n_kv_heads, head_dim)` f16 bits.
    k_cache: Vec<S::Buf<u16>>,
    v_cache: Vec<S::Buf<u16>>,
    /// Per DeltaNet layer: `state_slots` recurrent states of
    /// [`crate::model::arch::DeltaNet::state_floats`] each, the CPU's layout (the convolution's
    /// ring, then the recurrence's chunk state).
    states: Vec<S::Buf<f32>>,
    state_slots: usize,
    memory: DeviceMemory,
    /// The host's time issuing passes, up to the wait for their logits, since it was last
    /// taken ([`Backend::take_kernel_profile`]).
    host_issue: std::time::Duration,
}

impl<S: Stream> CudaBackend<S> {
    /// Uploads `model`'s weights to `s` and allocates a KV pool sized from
    /// `opts.kv_budget_bytes` (one block at least); refused when the architecture asks for
    /// something the forward pass does not run (the CPU backend's [`super::cpu::runs`]: both
    /// run the same set).
    pub fn new(s: S, model: &Model, opts: &EngineOptions) -> Result<Self, BackendError> {
        super::cpu::runs(&model.arch)?;
        let a = &model.arch;
        if a.per_layer.is_some()
            || a.value_norm
            || a.final_softcap.is_some()
            || !a.uniform_layers(&model.config)
            || a.layers.iter().any(|l| l.kv_from.is_some())
        {
            let why = format!(
                "{}: per-layer embeddings, K/V shared across layers and mixed head sizes run on the CPU backend alone for now",
                a.name
            );
            return Err(BackendError::Unsupported(why));
        }
        let (cfg, w) = (&model.config, &model.weights);
        let bs = opts.block_size;
        // A hybrid model's recurrent states come out of the same budget, as on the CPU.
        let state_slots = super::cpu::state_slots(&model.arch, opts.kv_budget_bytes);
        let state_bytes = state_slots * super::cpu::state_bytes(&model.arch);
        let kv_budget = opts.kv_budget_bytes.saturating_sub(state_bytes);
        let kv_blocks = (kv_budget / super::cpu::kv_page_bytes(&model.arch, bs)).max(1);
        let groups = super::cpu::kv_groups(&model.arch);
        let tied = w.output.bytes().as_ptr() == w.token_embd.bytes().as_ptr() && w.output.dtype == w.token_embd.dtype;
        let memory = DeviceMemory {
            weights_bytes: w.layers.iter().map(layer_bytes).sum::<usize>()
                + w.token_embd.bytes().len()
                + if tied { 0 } else { w.output.bytes().len() },
            kv_bytes: 2 * groups.slots * kv_blocks * bs * cfg.kv_dim() * 2 + state_bytes,
        };
        // Prefill's work space: the largest matrix (of a mixture, an expert's) as halves, a
        // chunk's activations as halves.
        let experts = |l: &crate::model::weights::LayerWeights| l.router.as_ref().map_or(1, |r| r.rows);
        let matrices = w.layers.iter().flat_map(|l| l.matrices().into_iter().map(move |t| (t, experts(l))));
        let (largest, widest) = (matrices.chain([(&w.output, 1)]))
            .fold((0, 0), |(n, c), (t, e)| (n.max(t.rows / e * t.cols), c.max(t.cols)));
        let scratch = if s.has_gemm() { 2 * (largest + opts.prefill_chunk * widest) } else { 0 };
        if let Some((free, total)) = s.device_memory()? {
            fits(memory, scratch, free, total).map_err(BackendError::Unsupported)?;
        }
        let up = |t: &Tensor| Weight::upload(&s, t);
        let vec = |v: &[f32]| s.upload(v);
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            // A mixture's expert stacks go up an expert at a time, each with its biases.
            let experts = l.router.as_ref().map_or(0, |r| r.rows);
            let stacks = [&l.w_gate, &l.w_up, &l.w_down];
            let matrix = |t: &Tensor| match stacks.iter().position(|x| std::ptr::eq(*x, t)) {
                Some(i) if experts > 0 => Matrix::experts(&s, t, experts, l.expert_biases.as_ref().map(|b| &b[i][..])),
                _ => Ok(Matrix::One(up(t)?)),
            };
            layers.push(l.try_map(matrix, |v| vec(v))?);
        }
        let (rotations, rope_of) = super::rotations(cfg, &model.arch);
        let ropes = rotations.iter().map(|(f, scale)| Ok((vec(f)?, *scale))).collect::<Result<_, GpuError>>()?;
        let per_slot = kv_blocks * bs * cfg.kv_dim();
        let caches = |n| (0..n).map(|_| s.zeros::<u16>(per_slot)).collect::<Result<Vec<_>, _>>();
        let (k_cache, v_cache) = (caches(groups.slots)?, caches(groups.slots)?);
        let floats = model.arch.delta.map_or(0, |d| d.state_floats());
        let delta_layers = model.arch.layers.iter().filter(|l| l.delta_net).count();
        let states = (0..delta_layers).map(|_| s.zeros::<f32>(state_slots * floats)).collect::<Result<Vec<_>, _>>()?;
        let b = CudaBackend {
            token_embd: up(&w.token_embd)?,
            output: if tied { None } else { Some(up(&w.output)?) },
            output_norm: vec(&w.output_norm)?,
            layers,
            ropes,
            rope_of,
            groups,
            block_size: bs,
            kv_blocks,
            k_cache,
            v_cache,
            states,
            state_slots: if delta_layers > 0 { state_slots } else { 0 },
            memory,
            host_issue: std::time::Duration::ZERO,
            cfg: cfg.clone(),
            arch: model.arch.clone(),
            s,
        };
        Ok(b)
    }

    pub fn stream(&self) -> &S {
        &self.s
    }
}

/// Memory the desktop keeps on a GPU the daemon shares with it: 512 MiB, or a twentieth of a
/// larger card.
pub fn headroom(total: usize) -> usize {
    (512 << 20).max(total / 20)
}

/// Whether a model's weights, KV pool and prefill's work space (`scratch` bytes) fit the GPU's
/// free memory, leaving [`headroom`]; the error says by how much they miss and what to change.
pub fn fits(need: DeviceMemory, scratch: usize, free: usize, total: usize) -> Result<(), String> {
    let mib = |b: usize| b >> 20;
    let want = need.weights_bytes + need.kv_bytes + scratch + headroom(total);
    if want <= free {
        return Ok(());
    }
    Err(format!(
        "the GPU has {} MiB free of {} MiB; the weights take {} MiB, the KV pool {} MiB and prefill's work space \
         {} MiB, and {} MiB stay free for the desktop: lower kv_cache_mib, or choose a smaller model or backend = \"cpu\"",
        mib(free),
        mib(total),
        mib(need.weights_bytes),
        mib(need.kv_bytes),
        mib(scratch),
        mib(headroom(total))
    ))
}

fn layer_bytes(l: &crate::model::weights::LayerWeights) -> usize {
    l.matrices().iter().map(|t| t.bytes().len()).sum()
}

/// The host-side index arrays of one batch: token ids, positions, which tokens want logits,
/// and per KV group the cache slot of every token and the flattened block tables.
struct BatchIndex {
    ids: Vec<i32>,
    pos: Vec<i32>,
    seq_of: Vec<i32>,
    logit_rows: Vec<i32>,
    /// Per group: (slots, tables flattened at `table_len` entries per sequence, table_len).
    groups: Vec<(Vec<i32>, Vec<i32>, usize)>,
}

fn index(batch: &[SeqBatch<'_>], groups: &KvGroups, bs: usize) -> Result<BatchIndex, BackendError> {
    let too_big = |what: &str| BackendError::Invalid(format!("{what} does not fit a 32-bit index"));
    let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| too_big(what));
    let mut ix =
        BatchIndex { ids: Vec::new(), pos: Vec::new(), seq_of: Vec::new(), logit_rows: Vec::new(), groups: Vec::new() };
    for (si, s) in batch.iter().enumerate() {
        let first = ix.ids.len();
        for (i, &t) in s.tokens.iter().enumerate() {
            ix.ids.push(int(t as usize, "a token id")?);
            ix.pos.push(int(s.start_pos + i, "a position")?);
            ix.seq_of.push(int(si, "a sequence")?);
        }
        let end = ix.ids.len();
        for t in end - s.logits..end {
            ix.logit_rows.push(int(t, "a token row")?);
        }
        debug_assert!(first + s.tokens.len() == end);
    }
    for g in 0..groups.len() {
        let table_len = batch.iter().map(|s| s.block_tables[g].len()).max().unwrap_or(0).max(1);
        let mut tables = vec![-1i32; table_len * batch.len()];
        let mut slots = Vec::with_capacity(ix.ids.len());
        for (si, s) in batch.iter().enumerate() {
            let table = &s.block_tables[g];
            for (j, &b) in table.iter().enumerate() {
                // Released window blocks (NO_BLOCK) stay -1: attention never reads them.
                tables[si * table_len + j] = i32::try_from(b).unwrap_or(-1);
            }
            for p in s.start_pos..s.start_pos + s.tokens.len() {
                slots.push(int(table[p / bs] as usize * bs + p % bs, "a cache slot")?);
            }
        }
        ix.groups.push((slots, tables, table_len));
    }
    Ok(ix)
}

/// `x` as the input of `weights`' products: with its 8-bit rounding where one of them is
/// quantized and the products are `matvec`'s (up to [`GEMM_TOKENS`] tokens, or no GEMM).
fn input<'a, S: Stream>(
    s: &S,
    x: &'a S::Buf<f32>,
    tokens: usize,
    weights: &[&Weight<S>],
) -> Result<Input<'a, S>, GpuError> {
    let cols = weights.first().map_or(0, |w| w.shape.cols);
    let small = tokens <= GEMM_TOKENS || !s.has_gemm();
    let q8 = if small && cols.is_multiple_of(32) && weights.iter().any(|w| is_quantized(w.shape.ggml_type)) {
        Some(s.quantize_q8(x, tokens, cols)?)
    } else {
        None
    };
    Ok(Input { x, q8, tokens })
}

/// `y = x · Wᵀ` for the input's tokens, into a new buffer: over halves on the stream's GEMM
/// beyond [`GEMM_TOKENS`] tokens, else `matvec_q8` on the 8-bit activations for a quantized
/// matrix and `matvec` for a float one.
fn project<S: Stream>(s: &S, w: &Weight<S>, input: &Input<'_, S>) -> Result<S::Buf<f32>, GpuError> {
    let (x, tokens) = (input.x, input.tokens);
    let WeightShape { rows, cols, ggml_type, .. } = w.shape;
    let mut y = s.alloc::<f32>(tokens * rows)?;
    if tokens <= GEMM_TOKENS || !s.has_gemm() {
        match &input.q8 {
            Some(a) if is_quantized(ggml_type) => s.matvec_q8(&w.data, w.shape, a, &mut y)?,
            _ => s.matvec(&w.data, w.shape, x, tokens, &mut y)?,
        }
        return Ok(y);
    }
    // BF16 weights stay bf16 (f16 lacks their range); every other type becomes f16.
    let bf16 = ggml_type == inferd_kernels::DType::BF16.ggml_type();
    let (mut w16, mut x16) = (s.alloc::<u16>(rows * cols)?, s.alloc::<u16>(tokens * cols)?);
    s.dequantize_half(&w.data, w.shape, bf16, &mut w16)?;
    s.to_half(x, tokens * cols, bf16, &mut x16)?;
    s.gemm(&w16, &x16, GemmShape { tokens, rows, cols, bf16 }, &mut y)?;
    Ok(y)
}

/// RMSNorm of each piece of `x` with weights `w`, into a new buffer.
fn norm<S: Stream>(s: &S, x: &S::Buf<f32>, w: &S::Buf<f32>, eps: f32) -> Result<S::Buf<f32>, GpuError> {
    let mut y = s.alloc::<f32>(S::len(x))?;
    s.rms_norm(x, w, &mut y, eps)?;
    Ok(y)
}

impl<S: Stream + Send> CudaBackend<S> {
    /// The attention launch's shape for the layers of KV group `group`.
    fn attention_shape(&self, group: usize) -> AttentionShape {
        AttentionShape {
            q_heads: self.cfg.n_heads,
            kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            block_size: self.block_size,
            window: self.groups.windows[group],
            scale: self.arch.attention_scale,
        }
    }

    fn run(&mut self, batch: &[SeqBatch<'_>], ix: &BatchIndex, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let issued = std::time::Instant::now();
        let s = &self.s;
        let (cfg, arch) = (&self.cfg, &self.arch);
        let n = ix.ids.len();
        let h = cfg.hidden;
        let (ids, pos, seq_of) = (s.upload(&ix.ids)?, s.upload(&ix.pos)?, s.upload(&ix.seq_of)?);
        let groups = ix
            .groups
            .iter()
            .map(|(slots, tables, len)| Ok((s.upload(slots)?, s.upload(tables)?, *len)))
            .collect::<Result<Vec<_>, GpuError>>()?;
        // Each KV group's attention plan (its window decides how far back the queries see).
        let mut plans = (0..self.groups.len())
            .map(|g| {
                let shape = self.attention_shape(g);
                Ok((s.attention_plan(&ix.seq_of, &ix.pos, shape, None)?, shape))
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        // Each sequence's rows, first position, recurrent state slot and checkpoint.
        let mut seqs = Vec::with_capacity(batch.len());
        let mut t0 = 0;
        for b in batch {
            seqs.push(Span { t0, n: b.tokens.len(), start: b.start_pos, state: b.state, checkpoint: b.checkpoint });
            t0 += b.tokens.len();
        }
        let mut x = s.alloc::<f32>(n * h)?;
        s.embed(&self.token_embd.data, self.token_embd.shape, &ids, arch.embedding_scale.unwrap_or(1.0), &mut x)?;
        let mut ops = CudaOps {
            s,
            cfg,
            acts: Default::default(),
            n,
            pos: &pos,
            seq_of: &seq_of,
            groups: &groups,
            plans: &mut plans,
            ropes: &self.ropes,
            rope_of: &self.rope_of,
            layer_slot: &self.groups.layer_slot,
            kv_layer: (0..arch.layers.len()).map(|l| arch.kv_layer(l)).collect(),
            k_cache: &mut self.k_cache,
            v_cache: &mut self.v_cache,
            arch,
            states: &mut self.states,
            seqs: &seqs,
        };
        ops.acts[Act::X.index()] = Some(x);
        for (li, l) in self.layers.iter().enumerate() {
            layer(&mut ops, arch, li, l)?;
        }
        let x = ops.get(Act::X)?;
        let rows = ix.logit_rows.len();
        logits.clear();
        if rows == 0 {
            return Ok(());
        }
        let mut picked = s.alloc::<f32>(rows * h)?;
        s.gather_rows(x, &s.upload(&ix.logit_rows)?, h, &mut picked)?;
        let xn = norm(s, &picked, &self.output_norm, cfg.rms_eps)?;
        let output = self.output.as_ref().unwrap_or(&self.token_embd);
        let out = project(s, output, &input(s, &xn, rows, &[output])?)?;
        let issue = issued.elapsed();
        logits.extend_from_slice(&s.download(&out)?[..rows * cfg.vocab]);
        self.host_issue += issue;
        debug_assert_eq!(batch.iter().map(|b| b.logits).sum::<usize>(), rows);
        Ok(())
    }
}

/// A KV group's index arrays of a pass: each token's cache slot, the flattened block tables,
/// their length.
type GroupIndex<S> = (<S as Stream>::Buf<i32>, <S as Stream>::Buf<i32>, usize);

/// The CUDA backend's [`LayerOps`] for one forward pass: each activation buffer as the last
/// kernel that wrote it left it, the pass's index arrays and attention plans, the cache.
struct CudaOps<'a, S: Stream> {
    s: &'a S,
    cfg: &'a LlamaConfig,
    acts: [Option<S::Buf<f32>>; Act::COUNT],
    n: usize,
    pos: &'a S::Buf<i32>,
    seq_of: &'a S::Buf<i32>,
    groups: &'a [GroupIndex<S>],
    plans: &'a mut [(AttentionPlan<S>, AttentionShape)],
    ropes: &'a [(S::Buf<f32>, f32)],
    rope_of: &'a [usize],
    layer_slot: &'a [(usize, usize)],
    /// Each layer's index among the layers that keep K/V.
    kv_layer: Vec<Option<usize>>,
    k_cache: &'a mut [S::Buf<u16>],
    v_cache: &'a mut [S::Buf<u16>],
    arch: &'a Architecture,
    /// Per DeltaNet layer, every slot's recurrent state.
    states: &'a mut [S::Buf<f32>],
    seqs: &'a [Span],
}

/// One sequence's part of a pass: its first row, its rows, its first position, its recurrent
/// state's slot, and where to copy the state to at which position.
struct Span {
    t0: usize,
    n: usize,
    start: usize,
    state: Option<u32>,
    checkpoint: Option<(usize, u32)>,
}

impl<S: Stream> CudaOps<'_, S> {
    /// Buffer `a`, which an earlier operation of the pass wrote.
    fn get(&self, a: Act) -> Result<&S::Buf<f32>, BackendError> {
        x_of(&self.acts, a)
    }

    fn take(&mut self, a: Act) -> Result<S::Buf<f32>, BackendError> {
        self.acts[a.index()].take().ok_or_else(|| BackendError::Device(format!("{a:?} read before it was written")))
    }
}

impl<S: Stream> LayerOps for CudaOps<'_, S> {
    type Matrix = Matrix<S>;
    type Vector = S::Buf<f32>;

    fn norm(&mut self, from: Act, w: &S::Buf<f32>, to: Act) -> Result<(), BackendError> {
        let y = norm(self.s, self.get(from)?, w, self.cfg.rms_eps)?;
        self.acts[to.index()] = Some(y);
        Ok(())
    }

    fn project(&mut self, _phase: Phase, from: Act, products: &[(&Matrix<S>, Act)]) -> Result<(), BackendError> {
        let ws = products.iter().map(|p| p.0.one()).collect::<Result<Vec<_>, _>>()?;
        let x = self.get(from)?;
        let inp = input(self.s, x, self.n, &ws)?;
        let ys = ws.iter().map(|w| project(self.s, w, &inp)).collect::<Result<Vec<_>, GpuError>>()?;
        drop(inp);
        for ((_, to), y) in products.iter().zip(ys) {
            self.acts[to.index()] = Some(y);
        }
        Ok(())
    }

    fn add_bias(&mut self, a: Act, b: &S::Buf<f32>) -> Result<(), BackendError> {
        let mut y = self.take(a)?;
        self.s.add_bias(&mut y, b)?;
        self.acts[a.index()] = Some(y);
        Ok(())
    }

    fn rope(&mut self, layer: usize, q: Act, k: Option<Act>) -> Result<(), BackendError> {
        let cfg = self.cfg;
        let neox = cfg.rope_style == RopeStyle::Neox;
        let (freq, scale) = &self.ropes[self.rope_of[layer]];
        let k = k.ok_or_else(|| BackendError::Unsupported("K/V shared across layers on the cuda backend".into()))?;
        for (a, heads) in [(q, cfg.n_heads), (k, cfg.n_kv_heads)] {
            let mut y = self.take(a)?;
            self.s.rope(&mut y, self.pos, freq, heads, cfg.head_dim, neox, *scale)?;
            self.acts[a.index()] = Some(y);
        }
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        qkv: [Act; 3],
        sinks: Option<&S::Buf<f32>>,
        to: Act,
    ) -> Result<(), BackendError> {
        let kv_layer =
            self.kv_layer[layer].ok_or_else(|| BackendError::Invalid(format!("layer {layer} keeps no K/V")))?;
        let (group, slot) = self.layer_slot[kv_layer];
        let (slots, tables, table_len) = &self.groups[group];
        let (kc, vc) = (&mut self.k_cache[slot], &mut self.v_cache[slot]);
        let [q, k, v] = qkv.map(|a| self.acts[a.index()].as_ref());
        let (Some(q), Some(k), Some(v)) = (q, k, v) else {
            return Err(BackendError::Device("attention before its queries, keys and values".into()));
        };
        self.s.kv_store(k, v, (kc, vc), slots, self.cfg.kv_dim())?;
        let mut att = self.s.alloc::<f32>(self.n * self.cfg.q_dim())?;
        let (plan, shape) = &mut self.plans[group];
        self.s.attention(q, (kc, vc), tables, self.seq_of, *table_len, self.pos, plan, *shape, sinks, &mut att)?;
        self.acts[to.index()] = Some(att);
        Ok(())
    }

    fn gated(&mut self, act: Activation, gate: Act, up: Act) -> Result<(), BackendError> {
        let mut g = self.take(gate)?;
        self.s.gated_act(&mut g, self.get(up)?, gated(act))?;
        self.acts[gate.index()] = Some(g);
        Ok(())
    }

    fn add(&mut self, x: Act, y: Act) -> Result<(), BackendError> {
        let mut xb = self.take(x)?;
        self.s.add_in_place(&mut xb, self.get(y)?)?;
        self.acts[x.index()] = Some(xb);
        Ok(())
    }

    fn copy(&mut self, _from: Act, _to: Act) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("values from the keys' projection on the cuda backend".into()))
    }

    fn scale(&mut self, _x: Act, _s: &S::Buf<f32>) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("layer output scalars on the cuda backend".into()))
    }

    fn per_layer_input(&mut self, _layer: usize, _to: Act) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("per-layer embeddings on the cuda backend".into()))
    }

    fn split_heads(&mut self, from: Act, a: Act, b: Act) -> Result<(), BackendError> {
        let x = self.get(from)?;
        let half = S::len(x) / 2;
        let (mut ya, mut yb) = (self.s.alloc::<f32>(half)?, self.s.alloc::<f32>(half)?);
        self.s.split_pairs(x, self.cfg.head_dim, &mut ya, &mut yb)?;
        self.acts[a.index()] = Some(ya);
        self.acts[b.index()] = Some(yb);
        Ok(())
    }

    fn gate(&mut self, x: Act, g: Act, f: super::layer::GateFn) -> Result<(), BackendError> {
        let mut xb = self.take(x)?;
        let r = self.s.gate_by(&mut xb, self.get(g)?, f == super::layer::GateFn::Silu);
        self.acts[x.index()] = Some(xb);
        Ok(r?)
    }

    fn delta_net(
        &mut self,
        layer: usize,
        w: &crate::model::weights::DeltaWeights<Matrix<S>, S::Buf<f32>>,
        [mix, beta, alpha]: [Act; 3],
        to: Act,
    ) -> Result<(), BackendError> {
        let s = self.s;
        let d = self.arch.delta.ok_or_else(|| BackendError::Invalid("a DeltaNet layer without its shape".into()))?;
        let di = self.arch.layers[..layer].iter().filter(|l| l.delta_net).count();
        let (ch, sh, n) = (d.channels(), d.shape, self.n);
        let (kd, vd, heads) = (sh.k_heads * sh.dk, sh.v_heads * sh.dv, sh.v_heads);
        let (floats, conv_len, ring_rows) = (d.state_floats(), d.conv_rows() * ch, d.conv_rows());
        let state = self.states.get_mut(di).ok_or_else(|| BackendError::Invalid(format!("DeltaNet layer {di}")))?;
        let slot_of = |sq: &Span| {
            sq.state
                .map(|st| st as usize)
                .ok_or_else(|| BackendError::Invalid("a sequence without a recurrent state".into()))
        };
        // Each sequence's convolution (in two parts where a checkpoint falls inside: the ring
        // after the first is copied out with the rest of the state, below).
        let xm = x_of(&self.acts, mix)?;
        let mut xc = s.alloc::<f32>(n * ch)?;
        for sq in self.seqs {
            let slot = slot_of(sq)?;
            if sq.start == 0 {
                s.move_floats(state, None, slot * floats, floats)?;
            }
            let cut = sq.checkpoint.map_or(sq.n, |(at, _)| at - sq.start);
            for (a, b) in [(0, cut), (cut, sq.n)] {
                if a == cut {
                    if let Some((_, ck)) = sq.checkpoint {
                        s.move_floats(state, Some(slot * floats), ck as usize * floats, conv_len)?;
                    }
                }
                if a < b {
                    s.delta_conv(
                        xm,
                        (state, slot * floats, ring_rows),
                        &w.conv,
                        ch,
                        (sq.start + a, sq.t0 + a, b - a),
                        &mut xc,
                    )?;
                }
            }
        }
        let (mut q, mut k, mut v) = (s.alloc::<f32>(n * kd)?, s.alloc::<f32>(n * kd)?, s.alloc::<f32>(n * vd)?);
        s.delta_split(&xc, (sh.k_heads, sh.dk, vd), n, self.cfg.rms_eps, &mut q, &mut k, &mut v)?;
        let (mut g, mut wb) = (s.alloc::<f32>(n * heads)?, s.alloc::<f32>(n * heads)?);
        let (xa, xb) = (x_of(&self.acts, alpha)?, x_of(&self.acts, beta)?);
        s.delta_gates(xa, xb, &w.dt_bias, &w.a, n, &mut g, &mut wb)?;
        // Each sequence's recurrence, the state after a checkpoint's part copied out.
        let mut out = s.alloc::<f32>(n * vd)?;
        for sq in self.seqs {
            let slot = slot_of(sq)?;
            let cut = sq.checkpoint.map_or(sq.n, |(at, _)| at - sq.start);
            for (a, b) in [(0, cut), (cut, sq.n)] {
                if a == cut {
                    if let Some((_, ck)) = sq.checkpoint {
                        let from = slot * floats + conv_len;
                        s.move_floats(state, Some(from), ck as usize * floats + conv_len, floats - conv_len)?;
                    }
                }
                if a < b {
                    let rows = DeltaRows { q: &q, k: &k, v: &v, g: &g, beta: &wb, t0: sq.t0 + a, tokens: b - a };
                    s.delta_step(state, slot * floats + conv_len, sh, sq.start + a, &rows, &mut out)?;
                }
            }
        }
        self.acts[to.index()] = Some(out);
        Ok(())
    }

    fn experts(
        &mut self,
        w: &Layer<S>,
        router: &Matrix<S>,
        moe: &crate::model::arch::Moe,
        act: Activation,
        from: Act,
        router_from: Act,
        to: Act,
    ) -> Result<(), BackendError> {
        if router_from != from || w.beside_dense.is_some() {
            return Err(BackendError::Unsupported("experts beside a dense feed-forward on the cuda backend".into()));
        }
        let (s, n, h, e) = (self.s, self.n, self.cfg.hidden, moe.experts);
        let router = router.one()?;
        let x = self.get(from)?;
        let mut logits = project(s, router, &input(s, x, n, &[router])?)?;
        if let Some(b) = &w.router_bias {
            s.add_bias(&mut logits, b)?;
        }
        // Each token's choice on the host, as the CPU backend makes it (one wait a layer for
        // the router's logits), then the tokens grouped by expert.
        let logits = s.download(&logits)?;
        let mut users: Vec<(Vec<i32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
        for (t, l) in logits.chunks_exact(e).take(n).enumerate() {
            for (x, weight) in inferd_kernels::moe::route(&moe.routing, l, None) {
                let u = users.get_mut(x as usize).ok_or_else(|| BackendError::Device(format!("expert {x} of {e}")))?;
                u.0.push(t as i32);
                u.1.push(weight);
            }
        }
        // Each chosen expert once, for all its tokens: their rows gathered, its gated products,
        // the results weighted into their rows of the output.
        let mut out = s.zeros::<f32>(n * h)?;
        for (x, (rows, weights)) in users.iter().enumerate().filter(|(_, u)| !u.0.is_empty()) {
            let (m, idx) = (rows.len(), s.upload(rows)?);
            let mut xe = s.alloc::<f32>(m * h)?;
            s.gather_rows(x_of(&self.acts, from)?, &idx, h, &mut xe)?;
            let ((gw, gb), (uw, ub), (dw, db)) = (w.w_gate.expert(x)?, w.w_up.expert(x)?, w.w_down.expert(x)?);
            let inp = input(s, &xe, m, &[gw, uw])?;
            let (mut g, mut u) = (project(s, gw, &inp)?, project(s, uw, &inp)?);
            for (y, b) in [(&mut g, gb), (&mut u, ub)] {
                if let Some(b) = b {
                    s.add_bias(y, b)?;
                }
            }
            s.gated_act(&mut g, &u, gated(act))?;
            let mut d = project(s, dw, &input(s, &g, m, &[dw])?)?;
            if let Some(b) = db {
                s.add_bias(&mut d, b)?;
            }
            s.scatter_add_rows(&d, &idx, &s.upload(weights)?, h, &mut out)?;
        }
        self.acts[to.index()] = Some(out);
        Ok(())
    }
}

/// Buffer `a` of `acts`, written earlier in the pass.
fn x_of<B>(acts: &[Option<B>], a: Act) -> Result<&B, BackendError> {
    acts[a.index()].as_ref().ok_or_else(|| BackendError::Device(format!("{a:?} read before it was written")))
}

/// The kernel's gated activation for the architecture's.
fn gated(a: Activation) -> Gated {
    match a {
        Activation::SiluGated => Gated::Swiglu,
        Activation::GeluTanhGated => Gated::Geglu,
        Activation::SwigluOai => Gated::SwigluOai,
    }
}

impl<S: Stream + Send> Backend for CudaBackend<S> {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> String {
        self.s.describe()
    }

    fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }

    fn kv_groups(&self) -> &KvGroups {
        &self.groups
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn device_memory(&self) -> Option<DeviceMemory> {
        Some(self.memory)
    }

    fn set_profiling(&mut self, on: bool) -> bool {
        self.s.set_timing(on)
    }

    fn take_kernel_profile(&mut self) -> Result<Option<KernelProfile>, BackendError> {
        let host_issue = std::mem::take(&mut self.host_issue);
        Ok(Some(KernelProfile { kernels: self.s.take_timings()?, host_issue }))
    }

    fn state_slots(&self) -> usize {
        self.state_slots
    }

    fn copy_states(&mut self, copies: &[(u32, u32)]) -> Result<(), BackendError> {
        super::validate_state_copies(self.state_slots, copies)?;
        let floats = self.arch.delta.map_or(0, |d| d.state_floats());
        for &(src, dst) in copies {
            if src == dst {
                continue;
            }
            for layer in &mut self.states {
                self.s.move_floats(layer, Some(src as usize * floats), dst as usize * floats, floats)?;
            }
        }
        Ok(())
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), BackendError> {
        let mut pairs = Vec::with_capacity(2 * copies.len());
        for c in copies {
            for b in [c.src, c.dst] {
                if b as usize >= self.kv_blocks {
                    return Err(BackendError::BadBlock(b));
                }
                pairs.push(b as i32);
            }
        }
        if pairs.is_empty() {
            return Ok(());
        }
        let pairs = self.s.upload(&pairs)?;
        let block_elems = self.block_size * self.cfg.kv_dim();
        for (kc, vc) in self.k_cache.iter_mut().zip(self.v_cache.iter_mut()) {
            self.s.kv_copy_blocks((kc, vc), &pairs, block_elems)?;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &[SeqBatch<'_>], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        validate_batch(&self.cfg, &self.groups, self.kv_blocks, self.block_size, batch)?;
        super::validate_states(self.state_slots, batch)?;
        if batch.iter().any(|b| b.hidden && b.logits > 0) {
            return Err(BackendError::Unsupported("the cuda backend does not compute embeddings yet".into()));
        }
        if batch.iter().any(|b| !b.embeds.is_empty() || !b.mrope.is_empty()) {
            return Err(BackendError::Unsupported("the cuda backend does not take images yet".into()));
        }
        let ix = index(batch, &self.groups, self.block_size)?;
        self.run(batch, &ix, logits)
    }
}

#[cfg(test)]
mod tests {
    use super::{fits, headroom, DeviceMemory};

    #[test]
    fn a_model_fits_the_gpu_only_with_the_desktops_headroom_left() {
        let gib = 1usize << 30;
        let need = DeviceMemory { weights_bytes: 5 * gib, kv_bytes: 2 * gib };
        assert_eq!(headroom(8 * gib), 512 << 20);
        assert_eq!(headroom(141 * gib), 141 * gib / 20);
        assert!(fits(need, 0, 8 * gib, 8 * gib).is_ok());
        assert!(fits(need, gib / 4, 8 * gib, 8 * gib).is_ok());
        assert!(fits(need, gib, 8 * gib, 8 * gib).is_err(), "prefill's work space counts");
        let e = fits(need, gib, 7 * gib, 8 * gib).unwrap_err();
        assert!(
            e.contains("7168 MiB free of 8192")
                && e.contains("KV pool 2048 MiB")
                && e.contains("work space 1024 MiB")
                && e.contains("kv_cache_mib"),
            "{e}"
        );
    }
}
