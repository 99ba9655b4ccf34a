//! gpt-oss (`gpt-oss`, OpenAI's gpt-oss-20b and -120b): a mixture of experts in every layer
//! whose router and experts carry biases (the router's softmax taken over the chosen experts'
//! logits alone, gpt-oss's SwiGLU with its clamp), attention with biases on Q, K, V and the
//! output, a learned sink per query head, sliding-window and full layers alternating (even
//! layers slide, as llama.cpp's default pattern of 2), and YaRN RoPE on rotating halves.
//!
//! GGUF follows llama.cpp's reading of `gpt-oss.*`: the experts' width is
//! `expert_feed_forward_length`, the window `attention.sliding_window`, and the norm before
//! the feed-forward is stored as `post_attention_norm`. Its Hugging Face form (experts in
//! MXFP4 blocks beside their scales) is refused: convert it with llama.cpp's script.

use super::{Activation, Architecture, GgufKeys, LayerAttention, Moe, TensorLayout};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::moe::{Gate, Routing};
use inferd_kernels::ops::RopeStyle;

/// llama.cpp's default: one sliding-window layer, then one full.
const PATTERN: usize = 2;

pub fn from_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, "gpt-oss");
    let config = keys.config(RopeStyle::Neox)?;
    let scaling = keys.rope_scaling(&config)?;
    let experts = keys.uint("expert_count")?;
    let used = keys.uint("expert_used_count")?;
    let expert_ffn = keys.uint("expert_feed_forward_length")?;
    if experts == 0 || used == 0 || used > experts || expert_ffn == 0 {
        return Err(ModelError::Config(format!("{used} of {experts} experts of width {expert_ffn} a token")));
    }
    let scale = keys.opt_float("expert_weights_scale")?.filter(|s| *s != 0.0).unwrap_or(1.0);
    let window = keys.uint("attention.sliding_window")?;
    if window == 0 {
        return Err(ModelError::Config("gpt-oss.attention.sliding_window = 0".into()));
    }
    let sliding = keys.sliding_layers(config.n_layers, PATTERN)?;
    // The sliding layers' own RoPE base, where the file gives one (llama.cpp reads it).
    let local_base = keys.opt_float("rope.freq_base_swa")?.unwrap_or(config.rope_base);
    // The feed-forward length of the whole (unused: every layer is experts).
    keys.get("feed_forward_length");
    keys.finish(&|_, _| false)?;
    let mut arch = Architecture::llama_like("gpt-oss", &config, scaling.clone(), g.tensor("output.weight").is_none());
    arch.activation = Activation::SwigluOai;
    arch.qkv_bias = true;
    arch.attn_sinks = true;
    arch.attn_out_bias = true;
    let global = arch.layers[0].clone();
    arch.layers = sliding
        .iter()
        .map(|&s| LayerAttention {
            window: s.then_some(window),
            rope_base: if s { local_base } else { config.rope_base },
            ..global.clone()
        })
        .collect();
    arch.layout = TensorLayout { ffn_norm_is_post_attention: true, ..TensorLayout::default() };
    let routing = Routing { gate: Gate::SoftmaxOfChosen, top_k: used, normalize: false, scale };
    arch.moe = Some(Moe { experts, used, expert_ffn, routing, biased: true, shared_ffn: None, beside_dense: false });
    Ok((arch, config))
}
