//! Llama and Mistral (and the families that are Llama in all but name: SmolLM2, TinyLlama,
//! Llama 2/3): pre-norm RMSNorm blocks, SwiGLU MLP, no biases, RoPE on every layer, tied or
//! separate output projection; Llama 3.1's RoPE scaling (GGUF's `rope_freqs` tensor, or
//! `rope_scaling.rope_type = "llama3"`), linear scaling, and Mistral's sliding window.
//!
//! Every GGUF key under `llama.` / `mistral.` and every `config.json` field is either
//! understood or refused by name: YaRN scaling, biases and mixture-of-experts layers are.

use super::{llama3_factors, Architecture, GgufKeys, HfKeys, RopeScaling};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};
use std::sync::Arc;

fn unsupported(what: String) -> ModelError {
    ModelError::Unsupported(what)
}

/// The f32 values of a small GGUF tensor (`rope_freqs.weight`).
fn f32_tensor(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = g.tensor(name).ok_or_else(|| ModelError::MissingTensor(name.into()))?;
    let bytes = t.dtype.bytes_for(len).filter(|_| t.dims.iter().product::<usize>() == len);
    let bytes = bytes.and_then(|n| g.blob.bytes().get(t.offset..t.offset + n));
    let Some(bytes) = bytes else {
        return Err(ModelError::Shape(format!("tensor '{name}' is not {len} values")));
    };
    let mut out = vec![0.0; len];
    inferd_kernels::quant::dequantize_row(t.dtype, bytes, &mut out);
    Ok(out)
}

pub fn from_gguf(g: &Gguf, name: &'static str) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, name);
    // GGUF's Llama converter permutes the Q/K rows for adjacent-pair rotation.
    let config = keys.config(RopeStyle::Interleaved)?;
    let kind = keys.get("rope.scaling.type").map(|v| v.as_str().unwrap_or("?"));
    let factor = keys.opt_float("rope.scaling.factor")?;
    let mut scaling = match (kind, factor) {
        (None | Some("none"), _) | (Some("linear"), None | Some(1.0)) => RopeScaling::None,
        (Some("linear"), Some(f)) if f > 0.0 => RopeScaling::Linear(f),
        (kind, factor) => {
            return Err(unsupported(format!(
                "GGUF key '{name}.rope.scaling.type' = {} with factor {factor:?} (supported: none, linear)",
                kind.unwrap_or("?")
            )))
        }
    };
    if g.tensor("rope_freqs.weight").is_some() {
        if scaling != RopeScaling::None {
            return Err(unsupported("both rope_freqs and a RoPE scaling type".into()));
        }
        scaling = RopeScaling::Factors(Arc::from(f32_tensor(g, "rope_freqs.weight", config.rope_dim / 2)?));
    }
    if keys.opt_uint("expert_count")?.unwrap_or(0) != 0 {
        return Err(unsupported(format!("mixture-of-experts layers ({name}.expert_count)")));
    }
    keys.opt_uint("expert_used_count")?;
    // Mistral's GGUF files may carry the window it was trained with; llama.cpp ignores it for
    // these families, and so does inferd, to compute what llama.cpp computes.
    keys.opt_uint("attention.sliding_window")?;
    keys.finish(&|k, _| k == "rope.scaling.original_context_length" && scaling == RopeScaling::None)?;
    let tied = g.tensor("output.weight").is_none();
    Ok((Architecture::llama_like(name, &config, scaling, tied), config))
}

/// A `config.json`'s `rope_scaling` object, for the Llama family (also Qwen's).
pub fn hf_rope_scaling(keys: &HfKeys<'_>, cfg: &LlamaConfig) -> Result<RopeScaling, ModelError> {
    let Some(v) = keys.get("rope_scaling") else { return Ok(RopeScaling::None) };
    let obj = v.as_object().ok_or_else(|| ModelError::Config("config.json: rope_scaling must be an object".into()))?;
    let num = |k: &str| obj.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str);
    match (kind, num("factor")) {
        (Some("default"), _) => Ok(RopeScaling::None),
        (Some("linear"), Some(f)) if f > 0.0 => Ok(RopeScaling::Linear(f)),
        (Some("llama3"), Some(f)) => {
            let (low, high) = (num("low_freq_factor").unwrap_or(1.0), num("high_freq_factor").unwrap_or(4.0));
            let original = num("original_max_position_embeddings").unwrap_or(8192.0);
            if !(f > 0.0 && low > 0.0 && high > low && original > 0.0) {
                return Err(ModelError::Config(format!("config.json: rope_scaling {v} is out of range")));
            }
            Ok(RopeScaling::Factors(Arc::from(llama3_factors(cfg.rope_dim, cfg.rope_base, f, low, high, original))))
        }
        _ => Err(unsupported(format!("config.json: rope_scaling = {v} (supported: linear, llama3)"))),
    }
}

pub fn from_hf(cfg: &Map<String, Value>, name: &'static str) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = HfKeys::new(cfg);
    let config = keys.config()?;
    let scaling = hf_rope_scaling(&keys, &config)?;
    let tied = keys.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    if let Some(act) = keys.opt_str("hidden_act")?.filter(|a| *a != "silu") {
        return Err(unsupported(format!("config.json: hidden_act = {act} (llama uses silu)")));
    }
    for k in ["attention_bias", "mlp_bias", "rope_interleaved"] {
        if keys.opt_bool(k)? == Some(true) {
            return Err(unsupported(format!("config.json: {k} = true (not supported for {name})")));
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
