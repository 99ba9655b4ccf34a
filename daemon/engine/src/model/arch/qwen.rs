//! Qwen 2 / 2.5 and Qwen 3: Llama's block with a bias on the Q, K and V projections (Qwen 2) or
//! a per-head RMSNorm of Q and K before RoPE and a head size apart from the hidden size (Qwen 3),
//! rotating halves of each head.

use super::{Architecture, GgufKeys, HfKeys, RopeScaling};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};

/// Which generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qwen {
    Two,
    Three,
}

impl Qwen {
    fn name(self) -> &'static str {
        match self {
            Qwen::Two => "qwen2",
            Qwen::Three => "qwen3",
        }
    }

    fn describe(self, cfg: &LlamaConfig, scaling: RopeScaling, tied: bool) -> Architecture {
        let mut arch = Architecture::llama_like(self.name(), cfg, scaling, tied);
        arch.qkv_bias = self == Qwen::Two;
        arch.qk_norm = self == Qwen::Three;
        arch
    }
}

pub fn from_gguf(g: &Gguf, q: Qwen) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, q.name());
    let config = keys.config(RopeStyle::Neox)?;
    let scaling = keys.rope_scaling(&config)?;
    keys.finish(&|k, v| matches!((k, v.as_u64()), ("expert_count" | "expert_used_count", Some(0))))?;
    let tied = g.tensor("output.weight").is_none();
    Ok((q.describe(&config, scaling, tied), config))
}

pub fn from_hf(cfg: &Map<String, Value>, q: Qwen) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = HfKeys::new(cfg);
    let config = keys.config()?;
    let scaling = keys.rope_scaling(&config)?;
    let tied = keys.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    keys.expect_activation(q.name(), "silu")?;
    if keys.opt_bool("use_sliding_window")? == Some(true) {
        return Err(ModelError::Unsupported("config.json: use_sliding_window = true".into()));
    }
    // Only read when use_sliding_window is true.
    keys.get("sliding_window");
    keys.get("max_window_layers");
    if q == Qwen::Three && keys.opt_bool("attention_bias")? == Some(true) {
        return Err(ModelError::Unsupported("config.json: attention_bias = true (qwen3 has none)".into()));
    }
    keys.finish(q.name(), &|_, _| false)?;
    Ok((q.describe(&config, scaling, tied), config))
}
