//! Loading a model: GGUF files and Hugging Face directories into one [`Model`].
//!
//! A model is its [`LlamaConfig`], its [`LlamaWeights`] (memory-mapped), its [`Tokenizer`] and its
//! chat template. Both formats go through the same shape checks; anything unsupported (another
//! architecture, a tensor type we have no kernel for) is a [`ModelError`] that names it.

pub mod config;
pub mod export;
pub mod gguf;
pub mod gguf_writer;
mod hf;
pub mod mmap;
pub mod weights;

pub use config::LlamaConfig;
pub use weights::{LlamaWeights, Tensor};

use crate::tokenizer::{Tokenizer, TokenizerError};
use gguf::{Gguf, GgufError};
use inferd_kernels::ops::RopeStyle;
use mmap::Blob;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("safetensors: {0}")]
    Safetensors(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error("bad tensor shape: {0}")]
    Shape(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
}

/// A loaded model, ready for a backend.
#[derive(Debug)]
pub struct Model {
    /// A short name (the file stem), used in listings and the OpenAI `model` field.
    pub name: String,
    pub path: PathBuf,
    pub config: LlamaConfig,
    pub weights: LlamaWeights,
    pub tokenizer: Tokenizer,
    /// The model's own Jinja chat template, when it ships one.
    pub chat_template: Option<String>,
}

impl Model {
    /// Loads a GGUF file or a Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        let io = |source| ModelError::Io { path: path.to_path_buf(), source };
        let meta = std::fs::metadata(path).map_err(io)?;
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model").trim_end_matches(".gguf").to_string();
        if meta.is_dir() {
            return hf::load(path, name);
        }
        let gguf = Gguf::parse(Blob::map(path).map_err(io)?)?;
        load_gguf(&gguf, path, name)
    }
}

fn load_gguf(g: &Gguf, path: &Path, name: String) -> Result<Model, ModelError> {
    let arch = g
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
    if arch != "llama" {
        return Err(ModelError::Unsupported(format!("architecture '{arch}' (supported: llama)")));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let uint = |k: &str| -> Result<usize, ModelError> {
        let v = g.get(&key(k)).ok_or_else(|| ModelError::MissingKey(key(k)))?;
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| ModelError::Config(format!("{} is not an unsigned integer", key(k))))
    };
    let float = |k: &str, default: f64| g.get(&key(k)).and_then(|v| v.as_f64()).unwrap_or(default) as f32;
    let hidden = uint("embedding_length")?;
    let n_heads = uint("attention.head_count")?;
    let token_embd =
        g.tensor("token_embd.weight").ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
    let vocab = match uint("vocab_size") {
        Ok(v) => v,
        Err(_) => token_embd.dims.get(1).copied().unwrap_or(0),
    };
    if n_heads == 0 {
        return Err(ModelError::Config("attention.head_count is zero".into()));
    }
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
        return Err(ModelError::Unsupported(format!(
            "rope dimension {} differs from head size {}",
            config.head_dim,
            config.hidden / config.n_heads
        )));
    }
    let get = |name: &str| -> Option<Tensor> {
        let t = g.tensor(name)?;
        let cols = t.dims[0];
        let rows = t.dims[1..].iter().product();
        Tensor::new(name, t.dtype, rows, cols, g.blob.clone(), t.offset).ok()
    };
    let weights = LlamaWeights::load(&config, weights::Naming::Gguf, &get)?;
    let tokenizer = Tokenizer::from_gguf(g)?;
    if tokenizer.vocab_size() > config.vocab {
        return Err(ModelError::Config(format!(
            "tokenizer has {} tokens but the model only {}",
            tokenizer.vocab_size(),
            config.vocab
        )));
    }
    let chat_template = g.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string);
    Ok(Model { name, path: path.to_path_buf(), config, weights, tokenizer, chat_template })
}
