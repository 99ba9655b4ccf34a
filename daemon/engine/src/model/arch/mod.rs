//! An architecture as data: one [`Architecture`] describes the transformer a file holds (norm
//! placement, activation, QKV bias, QK-norm, attention window and RoPE per layer, embedding
//! scale, tied output), and the backends run that description instead of a code path per
//! family. One small file per architecture maps a GGUF's metadata or a `config.json` onto it
//! (`llama.rs` for Llama and Mistral, `qwen.rs`, `qwen35.rs`, `gpt_oss.rs`, `gemma3.rs`, `gemma4.rs`,
//! `phi3.rs`;
//! [`for_gguf`] and [`for_hf`] pick the file by name; `keys.rs` reads metadata and remembers
//! what was read).
//!
//! Whatever a file says that its architecture's file does not understand is an error that
//! names it: an unknown metadata key or config field, a RoPE scaling type, a bias or a tensor
//! nobody reads. A model inferd cannot run exactly is refused, never run differently.

pub mod gemma3;
pub mod gemma4;
pub mod gpt_oss;
mod keys;
pub mod llama;
pub mod phi3;
pub mod qwen;
pub mod qwen35;
mod rope;

pub use keys::{GgufKeys, HfKeys};
pub use rope::{llama3_factors, RopeScaling};

use super::config::LlamaConfig;
use super::gguf::Gguf;
use super::ModelError;

/// Where each block normalizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormPlacement {
    /// RMSNorm before attention and before the MLP, residual added after each (Llama).
    Pre,
    /// RMSNorm before each sublayer and on its output before the residual add (Gemma 2/3).
    PreAndPost,
}

/// The MLP's gated activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `down(silu(gate(x)) * up(x))` (SwiGLU).
    SiluGated,
    /// `down(gelu_tanh(gate(x)) * up(x))` (GeGLU with GELU's tanh approximation).
    GeluTanhGated,
    /// gpt-oss's SwiGLU: the gate clamped from above, the linear part both ways, `σ(1.702 x)`,
    /// and one added to the linear part ([`inferd_kernels::ops::swiglu_oai`]).
    SwigluOai,
}

/// A mixture-of-experts feed-forward (every layer's, in the families here): a router picks
/// `used` of `experts` experts per token, each a gated MLP of width `expert_ffn` with the
/// architecture's activation ([`inferd_kernels::moe`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moe {
    pub experts: usize,
    pub used: usize,
    pub expert_ffn: usize,
    pub routing: inferd_kernels::moe::Routing,
    /// The router's logits and every expert's gate, up and down products carry a bias
    /// (gpt-oss).
    pub biased: bool,
    /// The width of a shared expert every token runs beside its chosen ones, its output
    /// scaled by the sigmoid of its own gate's logit (Qwen3.5 MoE, Qwen3-Next).
    pub shared_ffn: Option<usize>,
    /// The experts run beside the layer's dense feed-forward, each branch with its own norms,
    /// and the router reads the residual stream through a norm of its own (Gemma 4's 26B-A4B:
    /// [`crate::model::weights::BesideDense`]).
    pub beside_dense: bool,
}

/// One layer's attention.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerAttention {
    /// Sliding window in positions (a query at `p` sees `p - window + 1 ..= p`); `None`
    /// attends to the whole context.
    pub window: Option<usize>,
    pub rope_base: f32,
    pub rope_scaling: RopeScaling,
    /// The layer mixes its tokens with Gated DeltaNet ([`Architecture::delta`]) instead of
    /// attention: it has no K/V in the cache but a recurrent state per sequence.
    pub delta_net: bool,
    /// Its heads' size, its K/V heads, and how many of a head's dimensions RoPE rotates (the
    /// model's own in every family but Gemma 4, whose sliding-window and global layers differ).
    pub head_dim: usize,
    pub kv_heads: usize,
    pub rope_dim: usize,
    /// The layer computes no K/V of its own and attends over those of this earlier layer
    /// (Gemma 4's last layers): it takes no place in the cache.
    pub kv_from: Option<usize>,
}

impl LayerAttention {
    /// Floats of a token's queries (`n_heads` heads of the layer's size).
    pub fn q_dim(&self, n_heads: usize) -> usize {
        n_heads * self.head_dim
    }

    /// Floats of a token's keys (or values).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The Gated DeltaNet layers of a hybrid model (Qwen3.5): the recurrence's heads and sizes,
/// and the width of the convolution in front of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNet {
    pub shape: inferd_kernels::deltanet::DeltaShape,
    pub conv: usize,
}

impl DeltaNet {
    /// Channels through the convolution: queries, keys and values.
    pub fn channels(&self) -> usize {
        2 * self.shape.k_heads * self.shape.dk + self.shape.v_heads * self.shape.dv
    }

    /// Rows of the convolution's ring ([`inferd_kernels::deltanet::conv`]): the `conv - 1`
    /// inputs before a position and [`crate::kv::ROLLBACK`] more, so a sequence can go back
    /// that far (a speculative step's rejected tokens).
    pub fn conv_rows(&self) -> usize {
        self.conv - 1 + crate::kv::ROLLBACK
    }

    /// Floats of one sequence's state in one layer: the convolution's ring and the
    /// recurrence's chunk state ([`inferd_kernels::deltanet::step`], which can go back a whole
    /// chunk, more than [`crate::kv::ROLLBACK`]).
    pub fn state_floats(&self) -> usize {
        self.conv_rows() * self.channels() + self.shape.chunk_state_len()
    }
}

const _: () =
    assert!(crate::kv::ROLLBACK <= inferd_kernels::deltanet::CHUNK, "a DeltaNet state goes back a chunk at most");

/// How a file stores the tensors: the loader's concern, not the backends'.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct TensorLayout {
    /// Q, K and V are one matrix (`attn_qkv` / `qkv_proj`), rows in that order.
    pub fused_qkv: bool,
    /// Gate and up are one matrix (`ffn_up` of twice the width / `gate_up_proj`), gate first.
    pub fused_gate_up: bool,
    /// Added to every RMSNorm weight on load (Gemma's checkpoints store `w - 1`; its GGUF
    /// conversion has already added it).
    pub norm_offset: f32,
    /// Hugging Face names the norms as Gemma does (`pre_feedforward_layernorm`, ...).
    pub gemma_names: bool,
    /// The norm before the feed-forward is GGUF's `post_attention_norm` (gpt-oss's name).
    pub ffn_norm_is_post_attention: bool,
}

/// A transformer as the backends run it; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct Architecture {
    /// The family's name as files spell it (`llama`, `qwen2`, `gemma3`, ...).
    pub name: &'static str,
    pub norm: NormPlacement,
    pub activation: Activation,
    /// Q, K and V projections carry a bias.
    pub qkv_bias: bool,
    /// Q and K are RMS-normalized per head before RoPE.
    pub qk_norm: bool,
    /// Each query head has a learned sink: a logit that joins its softmax's denominator and
    /// adds nothing to its output (gpt-oss).
    pub attn_sinks: bool,
    /// The attention output projection carries a bias (gpt-oss).
    pub attn_out_bias: bool,
    pub layers: Vec<LayerAttention>,
    /// The token embeddings are multiplied by this before the first layer.
    pub embedding_scale: Option<f32>,
    /// Attention scores are `scale * q · k` (usually `1 / sqrt(head_dim)`).
    pub attention_scale: f32,
    /// The output projection is the embedding matrix.
    pub tied_output: bool,
    pub layout: TensorLayout,
    /// The feed-forward is a mixture of experts.
    pub moe: Option<Moe>,
    /// Attention's output is gated per head by a sigmoid of a second half of Q's projection
    /// (Qwen3.5's full-attention layers).
    pub attn_output_gate: bool,
    /// The shape of the layers that are Gated DeltaNet ([`LayerAttention::delta_net`]).
    pub delta: Option<DeltaNet>,
    /// V is RMS-normalized per head without a weight, as Q and K are with theirs (Gemma 4).
    pub value_norm: bool,
    /// Per-layer embeddings of this width (Gemma 4): every token has a row of them per layer,
    /// from a table of their own and a projection of its embedding, gated into each layer's
    /// output ([`crate::model::weights::PerLayerEmbd`]).
    pub per_layer: Option<usize>,
    /// The logits are soft-capped: `c * tanh(logit / c)` (Gemma 4).
    pub final_softcap: Option<f32>,
    /// Each layer's feed-forward width (the model's in every family but Gemma 4, whose layers
    /// that share K/V may have twice the width).
    pub ffn_widths: Vec<usize>,
    /// M-RoPE (Qwen2-VL's and Qwen3-VL's multimodal rotation, [`Mrope`]). A text token's
    /// coordinates are its position three times and 0; an image token's are its image's first
    /// position plus its row and column ([`crate::backend::SeqBatch::mrope`]).
    pub mrope: Option<Mrope>,
    /// Image tokens' input rows carry this many more rows of the model's width (Qwen3-VL's
    /// deepstack), the `i`-th added to the token's hidden state after layer `i`.
    pub deepstack: usize,
}

/// Which of a position's four coordinates (time, row, column, fourth) turns each rotated
/// pair of a head ([`inferd_kernels::ops::Rope::angles_sections`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mrope {
    /// How many pairs each coordinate turns.
    pub sections: [usize; 4],
    /// Qwen3-VL's interleaved form (the pairs take time, row, column in turn) instead of
    /// Qwen2-VL's consecutive sections.
    pub interleaved: bool,
}

impl Architecture {
    /// A Llama-shaped transformer (pre-norm, SwiGLU, global attention, no biases), the
    /// starting point of every family's description.
    pub fn llama_like(name: &'static str, cfg: &LlamaConfig, scaling: RopeScaling, tied_output: bool) -> Architecture {
        Architecture {
            name,
            norm: NormPlacement::Pre,
            activation: Activation::SiluGated,
            qkv_bias: false,
            qk_norm: false,
            attn_sinks: false,
            attn_out_bias: false,
            layers: vec![
                LayerAttention {
                    window: None,
                    rope_base: cfg.rope_base,
                    rope_scaling: scaling,
                    delta_net: false,
                    head_dim: cfg.head_dim,
                    kv_heads: cfg.n_kv_heads,
                    rope_dim: cfg.rope_dim,
                    kv_from: None,
                };
                cfg.n_layers
            ],
            embedding_scale: None,
            attention_scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            tied_output,
            layout: TensorLayout::default(),
            moe: None,
            attn_output_gate: false,
            delta: None,
            value_norm: false,
            per_layer: None,
            final_softcap: None,
            ffn_widths: vec![cfg.ffn; cfg.n_layers],
            mrope: None,
            deepstack: 0,
        }
    }
}

impl Architecture {
    /// The layers that keep K/V in the cache (every layer but the DeltaNet ones and those
    /// that read another layer's), in order.
    pub fn kv_layers(&self) -> Vec<usize> {
        (0..self.layers.len()).filter(|&l| self.keeps_kv(l)).collect()
    }

    fn keeps_kv(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(|l| !l.delta_net && l.kv_from.is_none())
    }

    /// The index among the layers that keep K/V of the layer whose K/V layer `layer` attends
    /// over (its own, or the one it reads: [`LayerAttention::kv_from`]); `None` for a DeltaNet
    /// layer.
    pub fn kv_layer(&self, layer: usize) -> Option<usize> {
        let own = self.layers.get(layer).filter(|l| !l.delta_net)?.kv_from.unwrap_or(layer);
        self.keeps_kv(own).then(|| (0..own).filter(|&l| self.keeps_kv(l)).count())
    }

    /// Floats of a token's K (or V) in one layer's slot of a cache page: the widest layer's,
    /// so any page can serve any group.
    pub fn kv_width(&self) -> usize {
        self.kv_layers().iter().map(|&l| self.layers[l].kv_dim()).max().unwrap_or(0)
    }

    /// Every layer's heads and feed-forward are the model's size (no mixed head sizes, K/V
    /// head counts or widths).
    pub fn uniform_layers(&self, cfg: &LlamaConfig) -> bool {
        self.layers
            .iter()
            .all(|l| l.head_dim == cfg.head_dim && l.kv_heads == cfg.n_kv_heads && l.rope_dim == cfg.rope_dim)
            && self.ffn_widths.iter().all(|&f| f == cfg.ffn)
    }
}

/// Layer `i` slides unless it closes a period of `pattern` layers (every layer slides when
/// `pattern` is 0), as llama.cpp's `set_swa_pattern`.
pub fn sliding_pattern(n_layers: usize, pattern: usize) -> Vec<bool> {
    (0..n_layers).map(|i| pattern == 0 || i % pattern < pattern - 1).collect()
}

/// The families [`for_gguf`] and [`for_hf`] know, for their refusals.
const KNOWN: &str =
    "llama, mistral, qwen2, qwen2vl, qwen3, qwen3vl, qwen3moe, qwen35, qwen35moe, qwen3next, gpt-oss, gemma3, gemma4, phi3";

/// The architecture and hyperparameters of a GGUF file, by its `general.architecture`.
pub fn for_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let arch = g
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
    match arch {
        "llama" => llama::from_gguf(g, "llama"),
        "mistral" => llama::from_gguf(g, "mistral"),
        "qwen2" => qwen::from_gguf(g, qwen::Qwen::Two),
        "qwen2vl" => qwen::from_gguf(g, qwen::Qwen::TwoVl),
        "qwen3vl" => qwen::from_gguf(g, qwen::Qwen::ThreeVl),
        "qwen3" => qwen::from_gguf(g, qwen::Qwen::Three),
        "qwen3moe" => qwen::from_gguf(g, qwen::Qwen::ThreeMoe),
        "qwen35" => qwen35::from_gguf(g, qwen35::Hybrid::Qwen35),
        "qwen35moe" => qwen35::from_gguf(g, qwen35::Hybrid::Qwen35Moe),
        "qwen3next" => qwen35::from_gguf(g, qwen35::Hybrid::Qwen3Next),
        "gpt-oss" => gpt_oss::from_gguf(g),
        "gemma3" => gemma3::from_gguf(g),
        "gemma4" => gemma4::from_gguf(g),
        "phi3" => phi3::from_gguf(g),
        other => Err(ModelError::Unsupported(format!("architecture '{other}' (supported: {KNOWN})"))),
    }
}

/// The architecture and hyperparameters of a `config.json`, by its `model_type`.
pub fn for_hf(cfg: &serde_json::Map<String, serde_json::Value>) -> Result<(Architecture, LlamaConfig), ModelError> {
    let model_type = cfg.get("model_type").and_then(|v| v.as_str());
    let architectures: Vec<&str> =
        cfg.get("architectures").and_then(|v| v.as_array()).into_iter().flatten().filter_map(|v| v.as_str()).collect();
    let is = |t: &str, class: &str| model_type == Some(t) || (model_type.is_none() && architectures.contains(&class));
    if is("llama", "LlamaForCausalLM") {
        return llama::from_hf(cfg, "llama");
    }
    if is("mistral", "MistralForCausalLM") {
        return llama::from_hf(cfg, "mistral");
    }
    if is("qwen2", "Qwen2ForCausalLM") {
        return qwen::from_hf(cfg, qwen::Qwen::Two);
    }
    if is("qwen3", "Qwen3ForCausalLM") {
        return qwen::from_hf(cfg, qwen::Qwen::Three);
    }
    if is("gemma3_text", "Gemma3ForCausalLM") {
        return gemma3::from_hf(cfg);
    }
    if is("phi3", "Phi3ForCausalLM") {
        return phi3::from_hf(cfg);
    }
    Err(ModelError::Unsupported(format!(
        "architecture {architectures:?} / model_type {model_type:?} (supported: {KNOWN})"
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
