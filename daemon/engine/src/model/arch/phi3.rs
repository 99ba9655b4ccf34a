//! Phi-3 / Phi-3.5 (the `phi3` family): Llama's block with Q, K and V stored as one matrix and
//! gate and up as one, rotating halves of each head (only the first part of each head where the
//! model has partial rotary embeddings, as Phi-4-mini, whose LongRoPE is still refused).
//!
//! Phi-3's sliding window is ignored, as llama.cpp ignores it (its configuration is known to be
//! wrong in the published files); LongRoPE (the 128k variants' `rope_factors_long/short`) is
//! refused.

use super::{Architecture, GgufKeys, HfKeys, RopeScaling, TensorLayout};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};

fn describe(cfg: &LlamaConfig, scaling: RopeScaling, tied: bool) -> Architecture {
    let mut arch = Architecture::llama_like("phi3", cfg, scaling, tied);
    arch.layout = TensorLayout { fused_qkv: true, fused_gate_up: true, ..TensorLayout::default() };
    arch
}

pub fn from_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, "phi3");
    let config = keys.config(RopeStyle::Neox)?;
    if g.tensor("rope_factors_long.weight").is_some() || g.tensor("blk.0.rope_factors_long.weight").is_some() {
        return Err(ModelError::Unsupported("LongRoPE (rope_factors_long/short: the 128k Phi-3 models)".into()));
    }
    keys.opt_uint("attention.sliding_window")?;
    let scaling = keys.rope_scaling()?;
    // LongRoPE's attention factor; without its factor tensors (refused above) it is unused.
    keys.finish(&|k, _| k == "rope.scaling.attn_factor")?;
    let tied = g.tensor("output.weight").is_none();
    Ok((describe(&config, scaling, tied), config))
}

pub fn from_hf(cfg: &Map<String, Value>) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = HfKeys::new(cfg);
    let config = keys.config()?;
    if let Some(v) = keys.get("rope_scaling") {
        return Err(ModelError::Unsupported(format!("config.json: rope_scaling = {v} (LongRoPE is not supported)")));
    }
    keys.expect_activation("phi3", "silu")?;
    keys.opt_uint("sliding_window")?;
    keys.opt_uint("original_max_position_embeddings")?;
    let tied = keys.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    keys.finish("phi3", &|k, v| {
        matches!(k, "resid_pdrop" | "embd_pdrop") || (k == "attention_bias" && v.as_bool() == Some(false))
    })?;
    Ok((describe(&config, RopeScaling::None, tied), config))
}
