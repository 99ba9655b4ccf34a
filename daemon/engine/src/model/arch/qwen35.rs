//! Qwen3.5 / 3.6 (`qwen35`): a hybrid of Gated DeltaNet and gated full attention, three to one
//! (every `full_attention_interval`-th layer attends, the rest are DeltaNet; or the file's
//! `attention.recurrent_layers` flags). Its attention is Qwen 3's (Q/K norms, rotating halves
//! of the first `rope.dimension_count` dimensions of each head) with an output gate: Q's
//! projection gives each head's queries followed by its gate, and the attention's output is
//! multiplied by the gate's sigmoid before the output projection. Its DeltaNet layers
//! ([`inferd_kernels::deltanet`]) read `ssm.group_count` key heads and `ssm.time_step_rank`
//! value heads of `ssm.state_size`, through a causal convolution of `ssm.conv_kernel` taps.
//! The norm before the feed-forward is stored as `post_attention_norm`.
//!
//! Its M-RoPE sections (`rope.dimension_sections`) rotate text positions as plain RoPE: every
//! section of a text token's position is the same position.
//!
//! Two more families are the same layers with a mixture of experts and a shared expert for the
//! feed-forward ([`super::Moe::shared_ffn`]): Qwen3.5 / 3.6 MoE (`qwen35moe`, 35B-A3B) and
//! Qwen3-Next (`qwen3next`, 80B-A3B), whose DeltaNet keeps a key head's value heads together
//! ([`DeltaShape::grouped`]) and whose files may fuse its input projections per key head
//! (`ssm_in`, `ssm_ba`, split at load).

use super::{Architecture, DeltaNet, GgufKeys, TensorLayout};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::deltanet::DeltaShape;
use inferd_kernels::ops::RopeStyle;

/// llama.cpp's default: three DeltaNet layers, then one attention layer.
const INTERVAL: usize = 4;

/// The three hybrid families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hybrid {
    Qwen35,
    Qwen35Moe,
    Qwen3Next,
}

impl Hybrid {
    pub fn name(self) -> &'static str {
        match self {
            Hybrid::Qwen35 => "qwen35",
            Hybrid::Qwen35Moe => "qwen35moe",
            Hybrid::Qwen3Next => "qwen3next",
        }
    }
}

pub fn from_gguf(g: &Gguf, family: Hybrid) -> Result<(Architecture, LlamaConfig), ModelError> {
    let name = family.name();
    let keys = GgufKeys::new(g, name);
    let config = keys.config(RopeStyle::Neox)?;
    let scaling = keys.rope_scaling(&config)?;
    // Text positions: the same in every section (module docs).
    keys.get("rope.dimension_sections");
    let conv = keys.uint("ssm.conv_kernel")?;
    let dk = keys.uint("ssm.state_size")?;
    let v_heads = keys.uint("ssm.time_step_rank")?;
    let k_heads = keys.uint("ssm.group_count")?;
    let inner = keys.uint("ssm.inner_size")?;
    if conv < 2 || dk == 0 || k_heads == 0 || v_heads == 0 || !v_heads.is_multiple_of(k_heads) || inner % v_heads != 0 {
        return Err(ModelError::Config(format!(
            "Gated DeltaNet of {k_heads} key heads, {v_heads} value heads of {dk}, inner size {inner}, a convolution of {conv}"
        )));
    }
    let dv = inner / v_heads;
    let recurrent = match keys.get("attention.recurrent_layers") {
        Some(v) => match v.as_array() {
            Some(a) if a.len() == config.n_layers && a.iter().all(|b| b.as_bool().is_some()) => {
                a.iter().map(|b| b.as_bool() == Some(true)).collect()
            }
            _ => return Err(ModelError::Config(format!("{name}.attention.recurrent_layers = {v:?}"))),
        },
        None => {
            let interval = keys.opt_uint("full_attention_interval")?.unwrap_or(INTERVAL);
            if interval == 0 {
                return Err(ModelError::Config(format!("{name}.full_attention_interval = 0")));
            }
            (0..config.n_layers).map(|i| (i + 1) % interval != 0).collect::<Vec<bool>>()
        }
    };
    if recurrent.iter().all(|&r| r) {
        return Err(ModelError::Config(format!("{name}: no attention layer")));
    }
    let moe = match family {
        Hybrid::Qwen35 => None,
        Hybrid::Qwen35Moe | Hybrid::Qwen3Next => {
            let mut moe = super::qwen::experts(&keys, &config)?;
            // llama.cpp's default: the dense width.
            moe.shared_ffn = Some(keys.opt_uint("expert_shared_feed_forward_length")?.unwrap_or(config.ffn));
            Some(moe)
        }
    };
    keys.finish(&|_, _| false)?;
    let mut arch = Architecture::llama_like(name, &config, scaling, g.tensor("output.weight").is_none());
    arch.moe = moe;
    arch.qk_norm = true;
    arch.attn_output_gate = true;
    for (l, &r) in arch.layers.iter_mut().zip(&recurrent) {
        l.delta_net = r;
    }
    let grouped = family == Hybrid::Qwen3Next;
    arch.delta = Some(DeltaNet { shape: DeltaShape { k_heads, v_heads, dk, dv, grouped }, conv });
    arch.layout = TensorLayout { ffn_norm_is_post_attention: true, ..TensorLayout::default() };
    Ok((arch, config))
}
