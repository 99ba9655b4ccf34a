//! Llama (and the families that are Llama in all but name: SmolLM2, TinyLlama, Llama 2/3 with
//! plain RoPE): pre-norm RMSNorm blocks, SwiGLU MLP, no biases, RoPE on every layer, tied or
//! separate output projection.
//!
//! GGUF keys under `llama.` and `config.json` fields are read here, each either understood or
//! refused by name. RoPE scaling (Llama 3.1's `rope_freqs` factors, linear or YaRN) is not run
//! yet and is refused, as are biases and mixture-of-experts layers.

use super::{Activation, Architecture, LayerAttention, NormPlacement, RopeScaling};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};

fn unsupported(what: String) -> ModelError {
    ModelError::Unsupported(what)
}

fn describe(n_layers: usize, rope_base: f32, tied_output: bool) -> Architecture {
    Architecture {
        name: "llama",
        norm: NormPlacement::Pre,
        activation: Activation::SiluGated,
        qkv_bias: false,
        qk_norm: false,
        layers: vec![LayerAttention { window: None, rope_base, rope_scaling: RopeScaling::None }; n_layers],
        embedding_scale: None,
        tied_output,
    }
}

/// `llama.*` metadata keys this file reads.
const GGUF_KEYS: [&str; 10] = [
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_count",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "vocab_size",
];

pub fn from_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let key = |k: &str| format!("llama.{k}");
    let uint = |k: &str| -> Result<usize, ModelError> {
        let v = g.get(&key(k)).ok_or_else(|| ModelError::MissingKey(key(k)))?;
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| ModelError::Config(format!("{} is not an unsigned integer", key(k))))
    };
    let float = |k: &str, default: f64| g.get(&key(k)).and_then(|v| v.as_f64()).unwrap_or(default) as f32;
    let hidden = uint("embedding_length")?;
    let n_heads = uint("attention.head_count")?;
    if n_heads == 0 {
        return Err(ModelError::Config("attention.head_count is zero".into()));
    }
    let token_embd =
        g.tensor("token_embd.weight").ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
    let vocab = match uint("vocab_size") {
        Ok(v) => v,
        Err(_) => token_embd.dims.get(1).copied().unwrap_or(0),
    };
    let config = LlamaConfig {
        n_layers: uint("block_count")?,
        hidden,
        n_heads,
        n_kv_heads: uint("attention.head_count_kv").unwrap_or(n_heads),
        head_dim: uint("rope.dimension_count").unwrap_or(hidden / n_heads),
        ffn: uint("feed_forward_length")?,
        vocab,
        rope_base: float("rope.freq_base", 10000.0),
        rope_style: RopeStyle::Interleaved,
        rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
        context_len: uint("context_length").unwrap_or(2048),
    };
    config.validate().map_err(ModelError::Config)?;
    if config.head_dim * config.n_heads != config.hidden {
        return Err(unsupported(format!(
            "rope dimension {} differs from head size {}",
            config.head_dim,
            config.hidden / config.n_heads
        )));
    }
    // Every other key of the architecture: understood when it changes nothing, else refused.
    for (k, v) in g.metadata.iter().filter_map(|(k, v)| k.strip_prefix("llama.").map(|s| (s, v))) {
        let ok = match k {
            k if GGUF_KEYS.contains(&k) => true,
            "rope.scaling.type" => v.as_str() == Some("none"),
            "rope.scaling.factor" => v.as_f64() == Some(1.0),
            "attention.key_length" | "attention.value_length" => v.as_u64() == Some(config.head_dim as u64),
            "expert_count" | "expert_used_count" => v.as_u64() == Some(0),
            _ => false,
        };
        if !ok {
            return Err(unsupported(format!("GGUF key 'llama.{k}' = {v:?} (not understood for llama)")));
        }
    }
    if g.tensor("rope_freqs.weight").is_some() {
        return Err(unsupported("tensor 'rope_freqs.weight': Llama 3.1 RoPE scaling is not supported yet".into()));
    }
    let tied = g.tensor("output.weight").is_none();
    Ok((describe(config.n_layers, config.rope_base, tied), config))
}

/// `config.json` fields that do not change the computation at inference.
const HF_HARMLESS: [&str; 12] = [
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    "_name_or_path",
    "attention_dropout",
    "pretraining_tp",
    "is_llama_config",
];

pub fn from_hf(cfg: &Map<String, Value>) -> Result<(Architecture, LlamaConfig), ModelError> {
    let bad = |k: &str, want: &str| ModelError::Config(format!("config.json: {k} must be {want}"));
    let uint = |k: &str| -> Result<Option<usize>, ModelError> {
        match cfg.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().and_then(|x| usize::try_from(x).ok()).map(Some).ok_or_else(|| bad(k, "an integer")),
        }
    };
    let need = |k: &str| uint(k)?.ok_or_else(|| ModelError::MissingKey(format!("config.json: {k}")));
    let float = |k: &str, default: f32| -> Result<f32, ModelError> {
        match cfg.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| bad(k, "a number")),
        }
    };
    let (hidden, n_heads) = (need("hidden_size")?, need("num_attention_heads")?);
    if n_heads == 0 {
        return Err(ModelError::Config("num_attention_heads is zero".into()));
    }
    let config = LlamaConfig {
        n_layers: need("num_hidden_layers")?,
        hidden,
        n_heads,
        n_kv_heads: uint("num_key_value_heads")?.unwrap_or(n_heads),
        head_dim: uint("head_dim")?.unwrap_or(hidden / n_heads),
        ffn: need("intermediate_size")?,
        vocab: need("vocab_size")?,
        rope_base: float("rope_theta", 10000.0)?,
        rope_style: RopeStyle::Neox,
        rms_eps: float("rms_norm_eps", 1e-6)?,
        context_len: uint("max_position_embeddings")?.unwrap_or(2048),
    };
    config.validate().map_err(ModelError::Config)?;
    let mut tied = false;
    for (k, v) in cfg {
        let ok = match k.as_str() {
            "hidden_size"
            | "num_attention_heads"
            | "num_hidden_layers"
            | "num_key_value_heads"
            | "head_dim"
            | "intermediate_size"
            | "vocab_size"
            | "rope_theta"
            | "rms_norm_eps"
            | "max_position_embeddings"
            | "bos_token_id"
            | "eos_token_id" => true,
            k if HF_HARMLESS.contains(&k) => true,
            "tie_word_embeddings" => {
                tied = v.as_bool().unwrap_or(false);
                v.is_boolean()
            }
            "hidden_act" => v.as_str() == Some("silu"),
            "rope_scaling" => v.is_null(),
            "attention_bias" | "mlp_bias" | "rope_interleaved" => v.as_bool() == Some(false),
            _ => false,
        };
        if !ok {
            let what = match k.as_str() {
                "rope_scaling" => "RoPE scaling is not supported yet".to_string(),
                "attention_bias" | "mlp_bias" => "biases are not supported for llama".to_string(),
                _ => "not understood for llama".to_string(),
            };
            return Err(unsupported(format!("config.json: {k} = {v} ({what})")));
        }
    }
    Ok((describe(config.n_layers, config.rope_base, tied), config))
}
