//! Qwen 2 / 2.5 and Qwen 3: Llama's block with a bias on the Q, K and V projections (Qwen 2) or
//! a per-head RMSNorm of Q and K before RoPE and a head size apart from the hidden size (Qwen 3),
//! rotating halves of each head. Qwen3 MoE (`qwen3moe`, Qwen3-30B-A3B): Qwen 3's attention and
//! a mixture of experts in every layer (a softmax router, `expert_used_count` experts a token,
//! their weights normalized to sum 1, SwiGLU experts of `expert_feed_forward_length`).

use super::{Architecture, GgufKeys, HfKeys, Moe, Mrope, RopeScaling};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};

/// Which generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qwen {
    Two,
    /// Qwen2-VL and Qwen2.5-VL's language model: Qwen 2 with M-RoPE.
    TwoVl,
    Three,
    /// Qwen3-VL's language model: Qwen 3 with interleaved M-RoPE and deepstack inputs.
    ThreeVl,
    ThreeMoe,
}

impl Qwen {
    fn name(self) -> &'static str {
        match self {
            Qwen::Two => "qwen2",
            Qwen::TwoVl => "qwen2vl",
            Qwen::Three => "qwen3",
            Qwen::ThreeVl => "qwen3vl",
            Qwen::ThreeMoe => "qwen3moe",
        }
    }

    fn describe(self, cfg: &LlamaConfig, scaling: RopeScaling, tied: bool) -> Architecture {
        let mut arch = Architecture::llama_like(self.name(), cfg, scaling, tied);
        arch.qkv_bias = matches!(self, Qwen::Two | Qwen::TwoVl);
        arch.qk_norm = !arch.qkv_bias;
        arch
    }
}

/// Qwen3 MoE's experts, from its keys (as llama.cpp reads them: the experts' width defaults to
/// `feed_forward_length / expert_used_count`).
pub(super) fn experts(keys: &GgufKeys<'_>, cfg: &LlamaConfig) -> Result<Moe, ModelError> {
    use inferd_kernels::moe::{Gate, Routing};
    let experts = keys.uint("expert_count")?;
    let used = keys.uint("expert_used_count")?;
    if experts == 0 || used == 0 || used > experts {
        return Err(ModelError::Config(format!("{used} of {experts} experts a token")));
    }
    let expert_ffn = keys.opt_uint("expert_feed_forward_length")?.unwrap_or(cfg.ffn / used);
    if expert_ffn == 0 {
        return Err(ModelError::Config("an expert of width zero".into()));
    }
    let scale = keys.opt_float("expert_weights_scale")?.filter(|s| *s != 0.0).unwrap_or(1.0);
    let routing = Routing { gate: Gate::Softmax, top_k: used, normalize: true, scale };
    Ok(Moe { experts, used, expert_ffn, routing, biased: false, shared_ffn: None, beside_dense: false })
}

pub fn from_gguf(g: &Gguf, q: Qwen) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, q.name());
    let config = keys.config(RopeStyle::Neox)?;
    let scaling = keys.rope_scaling(&config)?;
    let moe = if q == Qwen::ThreeMoe { Some(experts(&keys, &config)?) } else { None };
    let mrope = match q {
        Qwen::TwoVl => Some(Mrope { sections: sections(&keys, &config)?, interleaved: false }),
        Qwen::ThreeVl => Some(Mrope { sections: sections(&keys, &config)?, interleaved: true }),
        _ => None,
    };
    let deepstack = match q {
        Qwen::ThreeVl => keys.opt_uint("n_deepstack_layers")?.unwrap_or(0),
        _ => 0,
    };
    if deepstack >= config.n_layers.max(1) {
        return Err(ModelError::Config(format!("{deepstack} deepstack layers of {} layers", config.n_layers)));
    }
    keys.finish(&|k, v| matches!((k, v.as_u64()), ("expert_count" | "expert_used_count", Some(0))))?;
    let tied = g.tensor("output.weight").is_none();
    let mut arch = q.describe(&config, scaling, tied);
    arch.moe = moe;
    arch.mrope = mrope;
    arch.deepstack = deepstack;
    Ok((arch, config))
}

/// `rope.dimension_sections`: four counts of rotated pairs, at least one, at most the pairs a
/// head rotates.
fn sections(keys: &GgufKeys<'_>, cfg: &LlamaConfig) -> Result<[usize; 4], ModelError> {
    let bad = |v: &dyn std::fmt::Debug| {
        ModelError::Config(format!(
            "rope.dimension_sections = {v:?}: four counts of the head's {} pairs",
            cfg.rope_dim / 2
        ))
    };
    let v =
        keys.get("rope.dimension_sections").ok_or_else(|| ModelError::MissingKey("rope.dimension_sections".into()))?;
    let counts: Option<Vec<usize>> =
        v.as_array().and_then(|a| a.iter().map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok())).collect());
    match counts.as_deref() {
        Some(&[a, b, c, d])
            if [b, c, d]
                .iter()
                .try_fold(a, |s, &x| s.checked_add(x))
                .is_some_and(|s| (1..=cfg.rope_dim / 2).contains(&s)) =>
        {
            Ok([a, b, c, d])
        }
        _ => Err(bad(v)),
    }
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
