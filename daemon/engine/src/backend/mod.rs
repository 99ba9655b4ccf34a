//! The forward pass behind one trait, so the engine never knows which device runs it.
//!
//! A [`Backend`] owns the device-resident state: the weights in the form its kernels want and the
//! K/V storage of the paged cache (`kv_blocks` blocks of `block_size` positions). The engine owns
//! the block tables ([`crate::kv::KvCacheManager`]) and hands them in with every batch. The CPU
//! backend ([`cpu::CpuBackend`]) is the default and the numerical reference; the CUDA backend
//! ([`cuda::CudaBackend`]) runs the same forward pass on a GPU's kernels (or their host
//! emulation, in the tests).

pub mod cpu;
pub mod cuda;
pub mod layer;
pub mod profile;

use crate::engine::EngineOptions;
use crate::kv::{BlockCopy, BlockId, KvGroups, NO_BLOCK};
use crate::model::arch::{Architecture, RopeScaling};
use crate::model::{LlamaConfig, Model};
pub use inferd_kernels::cuda::stream::KernelTime;

/// Where a device backend's passes went ([`Backend::take_kernel_profile`]): each kernel's
/// device time, and the host's time issuing the passes (up to the wait for their logits), which
/// bounds the pass from below where the host is the slower side.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelProfile {
    pub kernels: Vec<KernelTime>,
    pub host_issue: std::time::Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackendError {
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("position {pos} exceeds the block table ({slots} slots)")]
    NoSlot { pos: usize, slots: usize },
    #[error("position {pos} exceeds the model's context length {ctx}")]
    ContextOverflow { pos: usize, ctx: usize },
    #[error("block {0} is outside the KV pool")]
    BadBlock(BlockId),
    #[error("invalid batch: {0}")]
    Invalid(String),
    #[error("{0}")]
    Unsupported(String),
    /// The device failed: a CUDA error, or the host emulation's.
    #[error("{0}")]
    Device(String),
}

impl From<inferd_kernels::cuda::stream::GpuError> for BackendError {
    fn from(e: inferd_kernels::cuda::stream::GpuError) -> Self {
        BackendError::Device(e.to_string())
    }
}

/// Which backend to run a model on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// The best backend this machine runs: the CPU until the CUDA backend has run on a GPU
    /// (`tests/gpu/run`).
    #[default]
    Auto,
    Cpu,
    /// An NVIDIA GPU; an error that says why where there is none.
    Cuda,
}

impl BackendKind {
    pub fn parse(s: &str) -> Option<BackendKind> {
        match s {
            "auto" => Some(BackendKind::Auto),
            "cpu" => Some(BackendKind::Cpu),
            "cuda" => Some(BackendKind::Cuda),
            _ => None,
        }
    }
}

/// The backend `kind` resolves to on this machine, and why: `auto` takes the GPU where the
/// CUDA backend has passed its checks on that kind of GPU
/// ([`inferd_kernels::cuda::PASSED_ON`]), else the CPU, saying whether a GPU was found.
pub fn choose(kind: BackendKind) -> (BackendKind, String) {
    match kind {
        BackendKind::Auto => match inferd_kernels::cuda::device::probe() {
            Err(e) => (BackendKind::Cpu, format!("auto: no usable GPU ({e})")),
            Ok(d) if inferd_kernels::cuda::passed_on(&d.arch) => {
                (BackendKind::Cuda, format!("auto: {} ({}), a kind of GPU the CUDA backend has passed its checks on", d.name, d.arch))
            }
            Ok(d) => (
                BackendKind::Cpu,
                format!(
                    "auto: {} found, but the CUDA backend has not yet been checked on a {} GPU (backend = \"cuda\" takes it)",
                    d.name, d.arch
                ),
            ),
        },
        BackendKind::Cpu | BackendKind::Cuda => (kind, "configured".into()),
    }
}

/// Builds the backend `kind` names for `model`, its KV pool sized from `opts`. Engines built
/// this way may differ in backend (a draft model on one, its target on another): the engine
/// holds a `Box<dyn Backend>`.
pub fn open(kind: BackendKind, model: &Model, opts: &EngineOptions) -> Result<Box<dyn Backend>, BackendError> {
    open_with_reason(kind, model, opts).map(|(b, _)| b)
}

/// [`open`], and why that backend ([`choose`]'s reason): where `auto` chose the GPU but the
/// model cannot run there (NVRTC missing, too little free GPU memory), it runs on the CPU and
/// the reason says why.
pub fn open_with_reason(
    kind: BackendKind,
    model: &Model,
    opts: &EngineOptions,
) -> Result<(Box<dyn Backend>, String), BackendError> {
    let (chosen, why) = choose(kind);
    let cpu = || -> Result<Box<dyn Backend>, BackendError> { Ok(Box::new(cpu::CpuBackend::for_model(model, opts)?)) };
    match chosen {
        BackendKind::Auto | BackendKind::Cpu => Ok((cpu()?, why)),
        // The Gated DeltaNet kernels are checked on the host emulation only: `auto` keeps a
        // hybrid model on the CPU until they have run on a GPU.
        BackendKind::Cuda if kind == BackendKind::Auto && model.arch.delta.is_some() => Ok((
            cpu()?,
            format!("{why}, but its Gated DeltaNet kernels have not yet run on a GPU (backend = \"cuda\" takes it)"),
        )),
        BackendKind::Cuda => match cuda::open(model, opts) {
            Ok(b) => Ok((b, why)),
            Err(e) if kind == BackendKind::Auto => Ok((cpu()?, format!("{why}, but: {e}"))),
            Err(e) => Err(e),
        },
    }
}

/// Bytes of a device's memory a model holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub weights_bytes: usize,
    pub kv_bytes: usize,
}

/// One sequence's share of a batch: new tokens at positions `start_pos..start_pos + tokens.len()`.
#[derive(Clone, Copy, Debug)]
pub struct SeqBatch<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// One block table per KV group ([`Backend::kv_groups`]); a window group's entries
    /// before its window are [`NO_BLOCK`].
    pub block_tables: &'a [Vec<BlockId>],
    /// The slot of its recurrent state (a hybrid model's; [`Backend::state_slots`]). A
    /// sequence whose tokens start at position 0 starts from a zero state.
    pub state: Option<u32>,
    /// Where to keep a copy of its recurrent state for the prefix cache: the state once the
    /// tokens before this position have run (a position within `start_pos..=start_pos + len`),
    /// and the slot to copy it to.
    pub checkpoint: Option<(usize, u32)>,
    /// How many of the last positions want logits (1 for decode and the last prefill chunk,
    /// 0 for an earlier prefill chunk, more for speculative verification).
    pub logits: usize,
    /// Those positions' rows are their final hidden states (after the output norm, `hidden`
    /// floats a row) instead of logits: what an embedding pools. A batch may mix both.
    pub hidden: bool,
    /// Input embeddings that take the place of the token lookup at some of these positions
    /// (an image's); the tokens there are media ids, outside the vocabulary.
    pub embeds: &'a [Embedded<'a>],
    /// Each token's M-RoPE coordinates (time, row, column, fourth) where the model rotates
    /// by them ([`crate::model::Architecture::mrope`]) and they are not all its position (a
    /// sequence with images); empty: every coordinate of a token is its position.
    pub mrope: &'a [[u32; 4]],
}

/// Rows of input embeddings (the model's `hidden` floats each, used as they are, not scaled
/// as looked-up tokens are) for the positions from `pos` on.
#[derive(Clone, Copy, Debug)]
pub struct Embedded<'a> {
    pub pos: usize,
    pub rows: &'a [f32],
    /// These positions see each other both ways (Gemma 3's image tokens): each attends up to
    /// the last of them, not only up to itself.
    pub both_ways: bool,
    /// Each position's row carries this many more rows of the model's width after its input
    /// (Qwen3-VL's deepstack, [`crate::model::Architecture::deepstack`]): a position takes
    /// `hidden * (1 + deepstack)` floats.
    pub deepstack: usize,
}

impl Embedded<'_> {
    /// Floats of one position's row, given the model's width.
    pub fn width(&self, hidden: usize) -> usize {
        hidden * (1 + self.deepstack)
    }

    /// The positions these rows fill, given the model's width.
    pub fn positions(&self, hidden: usize) -> std::ops::Range<usize> {
        self.pos..self.pos + self.rows.len() / self.width(hidden).max(1)
    }
}

/// A compute backend for Llama models over a paged KV cache.
pub trait Backend: Send {
    fn name(&self) -> &'static str;
    /// What it computes on, for reports (the CPU backend: its kernel table, e.g. `Avx512Vnni`).
    fn device(&self) -> String;
    fn config(&self) -> &LlamaConfig;
    /// Blocks in the K/V storage and positions per block. A block (a page) holds
    /// [`KvGroups::slots`] layers' K/V, for whichever group's table it is in.
    fn kv_blocks(&self) -> usize;
    /// How the layers are grouped into block tables.
    fn kv_groups(&self) -> &KvGroups;
    fn block_size(&self) -> usize;
    /// Copies whole blocks (all layers, K and V): copy-on-write for forked sequences.
    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), BackendError>;
    /// Recurrent state slots the backend keeps (a hybrid model's sequences take one each;
    /// none for a model without recurrent layers).
    fn state_slots(&self) -> usize {
        0
    }
    /// Copies `(src, dst)` recurrent states, every layer's: copy-on-write for forks.
    fn copy_states(&mut self, copies: &[(u32, u32)]) -> Result<(), BackendError> {
        match copies.first() {
            None => Ok(()),
            Some(_) => Err(BackendError::Invalid("this backend keeps no recurrent states".into())),
        }
    }
    /// Gives the memory of `blocks` (free; their contents no longer needed) back to the system
    /// where the backend can (the CPU's pool pages); a later write takes it again.
    fn release_blocks(&mut self, _blocks: &[BlockId]) {}
    /// Device memory the weights and the KV pool take, where the backend keeps them apart from
    /// the host's memory (a GPU's).
    /// The CPU threads it computes on, for a draft model's engine to share
    /// ([`crate::engine::EngineOptions::pool`]); none on a GPU.
    fn cpu_pool(&self) -> Option<std::sync::Arc<inferd_kernels::pool::ThreadPool>> {
        None
    }

    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }
    /// Starts (a fresh profile) or stops timing forward passes by phase; false where the
    /// backend cannot.
    fn set_profiling(&mut self, on: bool) -> bool {
        let _ = on;
        false
    }
    /// The passes timed since profiling started ([`profile::StepProfile`]), and starts over;
    /// `None` when not profiling.
    fn take_profile(&mut self) -> Option<profile::StepProfile> {
        None
    }
    /// The host's time issuing passes since this was last called, and while profiling the
    /// device's own time per kernel, once they have finished (a GPU's, timed by events around
    /// each launch); starts over. `None` where the backend has no kernels of its own.
    fn take_kernel_profile(&mut self) -> Result<Option<KernelProfile>, BackendError> {
        Ok(None)
    }
    /// Runs the batch: writes every new token's K/V into its slot and returns, in `rows`, a
    /// row for each requested position, sequence by sequence, in position order: `vocab`
    /// logits, or `hidden` floats of final hidden state where the sequence asks for those
    /// ([`SeqBatch::hidden`]).
    fn forward(&mut self, batch: &[SeqBatch<'_>], rows: &mut Vec<f32>) -> Result<(), BackendError>;
}

/// The distinct rotations of `arch`'s layers (one, or a local and a global one), each as its
/// RoPE frequencies and magnitude factor, and which one each layer uses.
pub fn rotations(cfg: &LlamaConfig, arch: &Architecture) -> (Vec<(Vec<f32>, f32)>, Vec<usize>) {
    let mut kinds: Vec<(f32, &RopeScaling, usize)> = Vec::new();
    let rope_of = arch
        .layers
        .iter()
        .map(|l| {
            let kind = (l.rope_base, &l.rope_scaling, l.rope_dim);
            kinds.iter().position(|k| *k == kind).unwrap_or_else(|| {
                kinds.push(kind);
                kinds.len() - 1
            })
        })
        .collect();
    let rotations = kinds
        .iter()
        .map(|(base, scaling, dims)| (scaling.frequencies(*dims, *base, cfg.context_len), scaling.attention_factor()))
        .collect();
    (rotations, rope_of)
}

/// Checks that every `(src, dst)` state copy names slots a backend keeping `slots` has.
pub fn validate_state_copies(slots: usize, copies: &[(u32, u32)]) -> Result<(), BackendError> {
    match copies.iter().map(|&(a, b)| a.max(b)).find(|&s| s as usize >= slots) {
        Some(s) => Err(BackendError::Invalid(format!("state slot {s} of {slots}"))),
        None => Ok(()),
    }
}

/// Checks each sequence's recurrent state slot and checkpoint against a backend keeping
/// `slots` of them (none to check where it keeps none).
pub fn validate_states(slots: usize, batch: &[SeqBatch<'_>]) -> Result<(), BackendError> {
    if slots == 0 {
        return Ok(());
    }
    let bad = |sb: &&SeqBatch<'_>| {
        sb.state.is_none_or(|st| st as usize >= slots)
            || sb.checkpoint.is_some_and(|(at, st)| {
                st as usize >= slots || Some(st) == sb.state || at < sb.start_pos || at > sb.start_pos + sb.tokens.len()
            })
    };
    match batch.iter().find(bad) {
        Some(sb) => Err(BackendError::Invalid(format!(
            "a sequence's recurrent state slot {:?} or checkpoint {:?} (the backend keeps {slots} slots)",
            sb.state, sb.checkpoint
        ))),
        None => Ok(()),
    }
}

/// Checks a batch against the model and the KV pool before any compute touches it.
pub fn validate_batch(
    cfg: &LlamaConfig,
    groups: &KvGroups,
    kv_blocks: usize,
    block_size: usize,
    batch: &[SeqBatch<'_>],
) -> Result<(), BackendError> {
    for s in batch {
        if s.tokens.is_empty() {
            return Err(BackendError::Invalid("a sequence has no new tokens".into()));
        }
        if s.logits > s.tokens.len() {
            return Err(BackendError::Invalid(format!("{} logits asked for {} tokens", s.logits, s.tokens.len())));
        }
        let end = s.start_pos + s.tokens.len();
        let mut covered = s.start_pos;
        for e in s.embeds {
            let r = e.positions(cfg.hidden);
            if e.rows.is_empty() || e.rows.len() % e.width(cfg.hidden) != 0 || r.start < covered || r.end > end {
                return Err(BackendError::Invalid(format!(
                    "input embeddings of {} floats at position {} (width {}, positions {}..{end} of which {covered}.. are free)",
                    e.rows.len(),
                    e.pos,
                    e.width(cfg.hidden),
                    s.start_pos
                )));
            }
            covered = r.end;
        }
        let looked_up = |i: usize| !s.embeds.iter().any(|e| e.positions(cfg.hidden).contains(&(s.start_pos + i)));
        if let Some((_, &t)) = s.tokens.iter().enumerate().find(|&(i, &t)| t as usize >= cfg.vocab && looked_up(i)) {
            return Err(BackendError::BadToken(t));
        }
        if end > cfg.context_len {
            return Err(BackendError::ContextOverflow { pos: end - 1, ctx: cfg.context_len });
        }
        if !s.mrope.is_empty() && s.mrope.len() != s.tokens.len() {
            return Err(BackendError::Invalid(format!(
                "M-RoPE coordinates for {} of {} tokens",
                s.mrope.len(),
                s.tokens.len()
            )));
        }
        if s.block_tables.len() != groups.len() {
            return Err(BackendError::Invalid(format!(
                "{} block tables for {} KV groups",
                s.block_tables.len(),
                groups.len()
            )));
        }
        for (table, window) in s.block_tables.iter().zip(&groups.windows) {
            if end > table.len() * block_size {
                return Err(BackendError::NoSlot { pos: end - 1, slots: table.len() * block_size });
            }
            // The blocks the new tokens read: from the first one's window on.
            let first = window.map_or(0, |w| (s.start_pos + 1).saturating_sub(w) / block_size);
            if let Some(&b) = table[first..end.div_ceil(block_size)].iter().find(|&&b| b as usize >= kv_blocks) {
                return Err(if b == NO_BLOCK {
                    BackendError::Invalid(format!("position {} reads a released block", first * block_size))
                } else {
                    BackendError::BadBlock(b)
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferd_kernels::ops::RopeStyle;

    #[test]
    fn input_embeddings_must_fill_whole_rows_within_their_span() {
        let cfg = LlamaConfig {
            n_layers: 1,
            hidden: 4,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 4,
            rope_dim: 4,
            ffn: 8,
            vocab: 10,
            rope_base: 10000.0,
            rope_style: RopeStyle::Neox,
            rms_eps: 1e-6,
            context_len: 64,
            pooling: Default::default(),
        };
        let groups = KvGroups::full(1);
        let tables = vec![vec![0, 1]];
        let rows = [0.5f32; 8];
        let check = |tokens: &[u32], embeds: &[Embedded<'_>]| {
            let sb = SeqBatch {
                tokens,
                start_pos: 4,
                block_tables: &tables,
                state: None,
                checkpoint: None,
                logits: 1,
                hidden: false,
                embeds,
                mrope: &[],
            };
            validate_batch(&cfg, &groups, 2, 16, &[sb])
        };
        let media = [1, 2, 1 << 31, (1 << 31) + 7, 3];
        let at = |pos: usize, n: usize| Embedded { pos, rows: &rows[..n * 4], both_ways: true, deepstack: 0 };
        assert_eq!(check(&media, &[at(6, 2)]), Ok(()));
        // A media id where no row is given, rows outside the span, rows not a whole width.
        assert_eq!(check(&media, &[at(6, 1)]), Err(BackendError::BadToken((1 << 31) + 7)));
        assert_eq!(check(&media, &[]), Err(BackendError::BadToken(1 << 31)));
        assert!(matches!(check(&media, &[at(8, 2)]), Err(BackendError::Invalid(_))));
        assert!(matches!(check(&media, &[at(3, 1)]), Err(BackendError::Invalid(_))));
        let ragged = Embedded { pos: 6, rows: &rows[..6], both_ways: true, deepstack: 0 };
        assert!(matches!(check(&media, &[ragged]), Err(BackendError::Invalid(_))));
        // Overlapping runs.
        assert!(matches!(check(&media, &[at(6, 2), at(7, 1)]), Err(BackendError::Invalid(_))));
    }
}
