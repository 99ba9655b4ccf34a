//! Hugging Face model directories: `config.json`, `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), `tokenizer.json`, and the chat template from
//! `tokenizer_config.json`. Tensors are memory-mapped through the `safetensors` crate's parser.

use super::config::LlamaConfig;
use super::mmap::Blob;
use super::weights::{LlamaWeights, Naming, Tensor};
use super::{Model, ModelError};
use crate::tokenizer::Tokenizer;
use inferd_kernels::ops::RopeStyle;
use inferd_kernels::DType;
use serde::Deserialize;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    #[serde(default = "default_ctx")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10000.0
}
fn default_ctx() -> usize {
    2048
}

fn ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect(),
        Some(serde_json::Value::Array(a)) => {
            a.iter().filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect()
        }
        _ => Vec::new(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ModelError> {
    std::fs::read(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })
}

pub(super) fn load(dir: &Path, name: String) -> Result<Model, ModelError> {
    let cfg: HfConfig = serde_json::from_slice(&read(&dir.join("config.json"))?)
        .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
    let is_llama =
        cfg.model_type.as_deref() == Some("llama") || cfg.architectures.iter().any(|a| a == "LlamaForCausalLM");
    if !is_llama {
        return Err(ModelError::Unsupported(format!(
            "architecture {:?} / model_type {:?} (supported: llama)",
            cfg.architectures, cfg.model_type
        )));
    }
    if cfg.num_attention_heads == 0 {
        return Err(ModelError::Config("num_attention_heads is zero".into()));
    }
    let config = LlamaConfig {
        n_layers: cfg.num_hidden_layers,
        hidden: cfg.hidden_size,
        n_heads: cfg.num_attention_heads,
        n_kv_heads: cfg.num_key_value_heads.unwrap_or(cfg.num_attention_heads),
        head_dim: cfg.head_dim.unwrap_or(cfg.hidden_size / cfg.num_attention_heads),
        ffn: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        rope_base: cfg.rope_theta,
        rope_style: RopeStyle::Neox,
        rms_eps: cfg.rms_norm_eps,
        context_len: cfg.max_position_embeddings,
    };
    config.validate().map_err(ModelError::Config)?;

    // Which files hold the tensors: one file, or the shards named by the index.
    let index = dir.join("model.safetensors.index.json");
    let files: BTreeSet<String> = if index.exists() {
        #[derive(Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let idx: Index =
            serde_json::from_slice(&read(&index)?).map_err(|e| ModelError::Safetensors(format!("index: {e}")))?;
        idx.weight_map.into_values().collect()
    } else {
        ["model.safetensors".to_string()].into()
    };
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for file in files {
        if file.contains('/') || file.contains("..") {
            return Err(ModelError::Safetensors(format!("shard name '{file}' leaves the model directory")));
        }
        let path = dir.join(&file);
        let blob = Blob::map(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let st = safetensors::SafeTensors::deserialize(blob.bytes())
            .map_err(|e| ModelError::Safetensors(format!("{file}: {e}")))?;
        let base = blob.bytes().as_ptr() as usize;
        for (tname, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::BF16 => DType::BF16,
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "tensor '{tname}' has dtype {other:?} (supported: F32, F16, BF16)"
                    )))
                }
            };
            let (rows, cols) = match view.shape() {
                [n] => (1, *n),
                [r, c] => (*r, *c),
                s => return Err(ModelError::Shape(format!("tensor '{tname}' has shape {s:?}"))),
            };
            let offset = view.data().as_ptr() as usize - base;
            tensors.insert(tname.clone(), Tensor::new(&tname, dtype, rows, cols, blob.clone(), offset)?);
        }
    }
    let _ = cfg.tie_word_embeddings; // a missing lm_head means tied, whatever the flag says
    let weights = LlamaWeights::load(&config, Naming::HuggingFace, &|n| tensors.get(n).cloned())?;

    let tok_path = dir.join("tokenizer.json");
    let tok_config: Option<serde_json::Value> =
        std::fs::read(dir.join("tokenizer_config.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let flag = |k: &str| tok_config.as_ref().and_then(|c| c.get(k)).and_then(|v| v.as_bool());
    let tokenizer = Tokenizer::from_hf_file(
        &tok_path,
        ids(&cfg.bos_token_id).first().copied(),
        ids(&cfg.eos_token_id),
        flag("add_bos_token").unwrap_or(false),
    )?;
    let chat_template =
        tok_config.as_ref().and_then(|c| c.get("chat_template")).and_then(|v| v.as_str()).map(str::to_string);
    Ok(Model { name, path: dir.to_path_buf(), config, weights, tokenizer, chat_template })
}
