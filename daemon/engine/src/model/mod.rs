//! Loading a model: GGUF files and Hugging Face directories into one [`Model`].
//!
//! A model is its [`Architecture`] (the transformer as data, `arch/`), its [`LlamaConfig`]
//! (dimensions), its [`LlamaWeights`] (memory-mapped), its [`Tokenizer`] and its chat template.
//! Both formats go through the same shape checks; anything unsupported or not understood (an
//! architecture, a metadata key, a tensor type without a kernel, a tensor nobody reads) is a
//! [`ModelError`] that names it.

pub mod arch;
pub mod config;
mod draft;
pub mod export;
pub mod facts;
pub mod gguf;
pub mod gguf_writer;
mod hf;
pub mod mmap;
pub mod rank;
pub mod weights;

pub use arch::Architecture;
pub use config::LlamaConfig;
pub use weights::{LlamaWeights, Tensor};

use crate::tokenizer::{Tokenizer, TokenizerError};
use gguf::{Gguf, GgufError};
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
    /// The transformer the file holds, as the backends run it.
    pub arch: Architecture,
    pub config: LlamaConfig,
    pub weights: LlamaWeights,
    pub tokenizer: Tokenizer,
    /// The model's own Jinja chat template, when it ships one.
    pub chat_template: Option<String>,
    /// A reranker's head and prompt (rank pooling).
    pub rank: Option<std::sync::Arc<rank::RankHead>>,
    /// Its vision encoder, where a projector file is paired with it ([`Model::pair_projector`]).
    pub vision: Option<std::sync::Arc<crate::vision::VisionEncoder>>,
}

impl Model {
    /// Serves at most `n` positions (a configured context length; 0 or more than the model's
    /// own changes nothing): the engine refuses longer sequences, and a LongRoPE model takes
    /// the factors of this context (its short ones when `n` is within the trained context).
    pub fn limit_context(&mut self, n: usize) {
        if n > 0 {
            self.config.context_len = self.config.context_len.min(n);
        }
    }

    /// Loads the projector file `path` (`mmproj-*.gguf`) as this model's vision encoder: its
    /// embeddings must be this model's width, and the image markers it writes must be tokens
    /// of this model's vocabulary.
    pub fn pair_projector(&mut self, path: &Path) -> Result<(), ModelError> {
        let enc = crate::vision::VisionEncoder::load(path)?;
        enc.check_pairing(self.config.hidden * (1 + self.arch.deepstack))?;
        let (begin, end) = enc.markers();
        for m in [begin, end] {
            if self.tokenizer.encode_bare(m, true)?.len() != 1 {
                return Err(ModelError::Config(format!("the image marker {m} is not a token of {}", self.name)));
            }
        }
        self.vision = Some(std::sync::Arc::new(enc));
        Ok(())
    }

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
    let (arch, config) = arch::for_gguf(g)?;
    let get = |name: &str| -> Option<Tensor> {
        let t = g.tensor(name)?;
        let cols = t.dims[0];
        let rows = t.dims[1..].iter().product();
        Tensor::new(name, t.dtype, rows, cols, g.blob.clone(), t.offset).ok()
    };
    let used = std::cell::RefCell::new(std::collections::HashSet::new());
    let read = |n: &str| {
        used.borrow_mut().insert(n.to_string());
        get(n)
    };
    let weights = LlamaWeights::load(&config, &arch, weights::Naming::Gguf, &read)?;
    let rank = match config.pooling {
        config::Pooling::Rank => {
            Some(std::sync::Arc::new(rank::RankHead::from_gguf(g, arch.name, config.hidden, &read)?))
        }
        _ => None,
    };
    // Llama 3.1's frequency factors and LongRoPE's are read into the architecture itself.
    let scaled = |f: fn(&arch::RopeScaling) -> bool| arch.layers.iter().any(|l| f(&l.rope_scaling));
    let factors = scaled(|s| matches!(s, arch::RopeScaling::Factors(_)));
    let longrope = scaled(|s| matches!(s, arch::RopeScaling::LongRope { .. }));
    let read_by_arch = |n: &str| {
        (factors && n == "rope_freqs.weight")
            || (longrope && matches!(n, "rope_factors_long.weight" | "rope_factors_short.weight"))
    };
    arch::check_unused(g.tensors.iter().map(|t| t.name.as_str()), &used.borrow(), &read_by_arch)?;
    let tokenizer = Tokenizer::from_gguf(g)?;
    // A GGUF file's vocabulary lists every row of the embedding (padding rows as `[PAD]`
    // tokens), as llama.cpp requires: rows without a token would be logits the model can pick
    // and no text can stand for.
    if tokenizer.vocab_size() != config.vocab {
        return Err(ModelError::Config(format!(
            "the vocabulary has {} tokens but the embedding {} rows",
            tokenizer.vocab_size(),
            config.vocab
        )));
    }
    let chat_template = g.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string);
    Ok(Model { name, path: path.to_path_buf(), arch, config, weights, tokenizer, chat_template, rank, vision: None })
}
