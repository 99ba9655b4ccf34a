//! Phi-3 / Phi-3.5 / Phi-4-mini (the `phi3` family): Llama's block with Q, K and V stored as
//! one matrix and gate and up as one, rotating halves of each head (only the first part of each
//! head where the model has partial rotary embeddings, as Phi-4-mini).
//!
//! The 128k models stretch their rotation with LongRoPE: GGUF files carry the two factor
//! tables as `rope_factors_short` / `rope_factors_long` tensors and the magnitude factor as
//! `rope.scaling.attn_factor`; `config.json` has them in `rope_scaling`. Phi-3's sliding window
//! is ignored, as llama.cpp ignores it (its configuration is known to be wrong in the published
//! files).

use super::{Architecture, GgufKeys, HfKeys, RopeScaling, TensorLayout};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};
use std::sync::Arc;

fn describe(cfg: &LlamaConfig, scaling: RopeScaling, tied: bool) -> Architecture {
    let mut arch = Architecture::llama_like("phi3", cfg, scaling, tied);
    arch.layout = TensorLayout { fused_qkv: true, fused_gate_up: true, ..TensorLayout::default() };
    arch
}

pub fn from_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, "phi3");
    let config = keys.config(RopeStyle::Neox)?;
    if g.tensor("blk.0.rope_factors_long.weight").is_some() {
        return Err(ModelError::Unsupported("LongRoPE factors per layer (blk.N.rope_factors_long)".into()));
    }
    keys.opt_uint("attention.sliding_window")?;
    let mut scaling = keys.rope_scaling(&config)?;
    if g.tensor("rope_factors_long.weight").is_some() || g.tensor("rope_factors_short.weight").is_some() {
        if scaling != RopeScaling::None {
            return Err(ModelError::Unsupported("both LongRoPE factors and a RoPE scaling type".into()));
        }
        let n = config.rope_dim / 2;
        scaling = RopeScaling::LongRope {
            short: Arc::from(keys.f32_tensor("rope_factors_short.weight", n)?),
            long: Arc::from(keys.f32_tensor("rope_factors_long.weight", n)?),
            // As llama.cpp: the trained context defaults to the context length.
            original: keys.opt_uint("rope.scaling.original_context_length")?.unwrap_or(config.context_len),
            attn_factor: keys.opt_float("rope.scaling.attn_factor")?.unwrap_or(1.0),
        };
    }
    // Without LongRoPE's tables (or YaRN, which reads it), `rope.scaling.attn_factor` is left
    // unread, so `finish` refuses it: llama.cpp would scale the rotation by it.
    keys.finish(&|_, _| false)?;
    let tied = g.tensor("output.weight").is_none();
    Ok((describe(&config, scaling, tied), config))
}

pub fn from_hf(cfg: &Map<String, Value>) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = HfKeys::new(cfg);
    let config = keys.config()?;
    let scaling = keys.rope_scaling(&config)?;
    keys.expect_activation("phi3", "silu")?;
    keys.opt_uint("sliding_window")?;
    keys.opt_uint("original_max_position_embeddings")?;
    let tied = keys.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    keys.finish("phi3", &|k, v| {
        matches!(k, "resid_pdrop" | "embd_pdrop") || (k == "attention_bias" && v.as_bool() == Some(false))
    })?;
    Ok((describe(&config, scaling, tied), config))
}
