//! An architecture as data: one [`Architecture`] describes the transformer a file holds (norm
//! placement, activation, QKV bias, QK-norm, attention window and RoPE per layer, embedding
//! scale, tied output), and the backends run that description instead of a code path per
//! family. One small file per architecture maps a GGUF's metadata or a `config.json` onto it
//! (`llama.rs`; [`for_gguf`] and [`for_hf`] pick the file by name).
//!
//! Whatever a file says that its architecture's file does not understand is an error that
//! names it: an unknown metadata key or config field, a RoPE scaling type, a bias or a tensor
//! nobody reads. A model inferd cannot run exactly is refused, never run differently.

pub mod llama;

use super::config::LlamaConfig;
use super::gguf::Gguf;
use super::ModelError;

/// Where each block normalizes its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormPlacement {
    /// RMSNorm before attention and before the MLP, residual added after each (Llama).
    Pre,
}

/// The MLP's gated activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `down(silu(gate(x)) * up(x))` (SwiGLU).
    SiluGated,
}

/// How RoPE frequencies are scaled past the trained context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
}

/// One layer's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// Sliding window in positions; `None` attends to the whole context.
    pub window: Option<usize>,
    pub rope_base: f32,
    pub rope_scaling: RopeScaling,
}

/// A transformer as the backends run it; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct Architecture {
    /// The family's name as files spell it (`llama`).
    pub name: &'static str,
    pub norm: NormPlacement,
    pub activation: Activation,
    /// Q, K and V projections carry a bias.
    pub qkv_bias: bool,
    /// Q and K are RMS-normalized per head before RoPE.
    pub qk_norm: bool,
    pub layers: Vec<LayerAttention>,
    /// The token embeddings are multiplied by this before the first layer.
    pub embedding_scale: Option<f32>,
    /// The output projection is the embedding matrix.
    pub tied_output: bool,
}

/// The architecture and hyperparameters of a GGUF file, by its `general.architecture`.
pub fn for_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let arch = g
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
    match arch {
        "llama" => llama::from_gguf(g),
        other => Err(ModelError::Unsupported(format!("architecture '{other}' (supported: llama)"))),
    }
}

/// The architecture and hyperparameters of a `config.json`, by its `model_type`.
pub fn for_hf(cfg: &serde_json::Map<String, serde_json::Value>) -> Result<(Architecture, LlamaConfig), ModelError> {
    let model_type = cfg.get("model_type").and_then(|v| v.as_str());
    let architectures: Vec<&str> =
        cfg.get("architectures").and_then(|v| v.as_array()).into_iter().flatten().filter_map(|v| v.as_str()).collect();
    if model_type == Some("llama") || (model_type.is_none() && architectures.contains(&"LlamaForCausalLM")) {
        return llama::from_hf(cfg);
    }
    Err(ModelError::Unsupported(format!(
        "architecture {architectures:?} / model_type {model_type:?} (supported: llama)"
    )))
}

/// Refuses tensors the architecture does not read: a checkpoint with more weights than its
/// description is a different model. `ignorable` names ones that may be there unread
/// (for example an `lm_head` saved beside tied embeddings).
pub fn check_unused<'a>(
    all: impl IntoIterator<Item = &'a str>,
    used: &std::collections::HashSet<String>,
    ignorable: &dyn Fn(&str) -> bool,
) -> Result<(), ModelError> {
    let mut unused: Vec<&str> = all.into_iter().filter(|n| !used.contains(*n) && !ignorable(n)).collect();
    if unused.is_empty() {
        return Ok(());
    }
    unused.sort_unstable();
    let more = if unused.len() > 5 { format!(" and {} more", unused.len() - 5) } else { String::new() };
    Err(ModelError::Unsupported(format!(
        "tensor{} {}{more} not used by the architecture (inferd would run a different model)",
        if unused.len() == 1 { "" } else { "s" },
        unused.iter().take(5).map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
    )))
}
