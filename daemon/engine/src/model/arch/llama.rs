//! Llama and Mistral (and the families that are Llama in all but name: SmolLM2, TinyLlama,
//! Llama 2/3): pre-norm RMSNorm blocks, SwiGLU MLP, no biases, RoPE on every layer, tied or
//! separate output projection; Llama 3.1's RoPE scaling (GGUF's `rope_freqs` tensor, or
//! `rope_scaling.rope_type = "llama3"`), linear and YaRN scaling, and Mistral's sliding window.
//!
//! Every GGUF key under `llama.` / `mistral.` and every `config.json` field is either
//! understood or refused by name: biases and mixture-of-experts layers are.

use super::{Architecture, GgufKeys, HfKeys, RopeScaling};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};
use std::sync::Arc;

pub fn from_gguf(g: &Gguf, name: &'static str) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, name);
    // GGUF's Llama converter permutes the Q/K rows for adjacent-pair rotation.
    let config = keys.config(RopeStyle::Interleaved)?;
    let mut scaling = keys.rope_scaling(&config)?;
    if g.tensor("rope_freqs.weight").is_some() {
        if scaling != RopeScaling::None {
            return Err(ModelError::Unsupported("both rope_freqs and a RoPE scaling type".into()));
        }
        scaling = RopeScaling::Factors(Arc::from(keys.f32_tensor("rope_freqs.weight", config.rope_dim / 2)?));
    }
    if keys.opt_uint("expert_count")?.unwrap_or(0) != 0 {
        return Err(ModelError::Unsupported(format!("mixture-of-experts layers ({name}.expert_count)")));
    }
    keys.opt_uint("expert_used_count")?;
    // Mistral's GGUF files may carry the window it was trained with; llama.cpp ignores it for
    // these families, and so does inferd, to compute what llama.cpp computes.
    keys.opt_uint("attention.sliding_window")?;
    keys.finish(&|_, _| false)?;
    let tied = g.tensor("output.weight").is_none();
    Ok((Architecture::llama_like(name, &config, scaling, tied), config))
}

pub fn from_hf(cfg: &Map<String, Value>, name: &'static str) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = HfKeys::new(cfg);
    let config = keys.config()?;
    let scaling = keys.rope_scaling(&config)?;
    let tied = keys.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    keys.expect_activation(name, "silu")?;
    for k in ["attention_bias", "mlp_bias", "rope_interleaved"] {
        if keys.opt_bool(k)? == Some(true) {
            return Err(ModelError::Unsupported(format!("config.json: {k} = true (not supported for {name})")));
        }
    }
    let mut arch = Architecture::llama_like(name, &config, scaling, tied);
    // Mistral 7B v0.1 attends within 4096 positions; later versions set null.
    if name == "mistral" {
        if let Some(w) = keys.opt_uint("sliding_window")?.filter(|&w| w < config.context_len) {
            arch.layers.iter_mut().for_each(|l| l.window = Some(w));
        }
    }
    keys.finish(name, &|_, _| false)?;
    Ok((arch, config))
}
