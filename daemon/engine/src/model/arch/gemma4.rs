//! Gemma 4 (`gemma4`: E2B, E4B, 31B): Gemma 3's blocks (norms before and after each sublayer,
//! GeGLU, Q and K RMS-normed per head, embeddings scaled by `sqrt(hidden)`) with
//! - sliding-window and global layers of different head sizes (`attention.key_length_swa` /
//!   `attention.key_length`) and K/V head counts (`attention.head_count_kv`, one per layer), each
//!   kind with its own RoPE: the sliding layers' base (`rope.freq_base_swa`) and rotated
//!   dimensions (`rope.dimension_count_swa`), the global layers' "proportional" rotation as the
//!   `rope_freqs` tensor's frequency divisors;
//! - V RMS-normed without a weight, attention unscaled (the norms fix the scores' size), and V
//!   taken from K's projection in a layer without `attn_v`;
//! - the last `attention.shared_kv_layers` layers computing no K/V: each attends over the last
//!   earlier layer of its kind that keeps them ([`super::LayerAttention::kv_from`]);
//! - per-layer embeddings (`embedding_length_per_layer_input`): a token's row of the
//!   `per_layer_token_embd` table and a projection of its embedding give each layer a small
//!   input, gated into the layer's output after the feed-forward
//!   ([`crate::model::weights::PerLayerEmbd`]);
//! - a learned scalar on each layer's output, soft-capped logits, and feed-forward widths that may
//!   be one per layer (`feed_forward_length` an array: the layers sharing K/V twice as wide);
//!
//! The mixture-of-experts variant (26B-A4B, `expert_count`) runs its experts beside each
//! layer's dense feed-forward ([`super::Moe::beside_dense`]): softmax routing over all experts,
//! the chosen ones' weights normalized, GeGLU experts, each expert's output scaled by its own
//! `ffn_down_exps.scale`. As llama.cpp reads `gemma4.*`.

use super::{Activation, Architecture, GgufKeys, LayerAttention, NormPlacement, RopeScaling};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use std::sync::Arc;

pub fn from_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, "gemma4");
    let config = keys.config(RopeStyle::Neox)?;
    let n = config.n_layers;
    let bad = |what: String| ModelError::Config(format!("gemma4: {what}"));
    // Gemma 4's router is a softmax (GGUF's gating function 1); another is refused.
    if let Some(f) = keys.opt_uint("expert_gating_func")?.filter(|&f| f != 1) {
        return Err(ModelError::Unsupported(format!("gemma4.expert_gating_func = {f} (Gemma 4 routes by softmax)")));
    }
    let moe = match keys.opt_uint("expert_count")? {
        Some(e) if e > 0 => Some(super::Moe { beside_dense: true, ..super::qwen::experts(&keys, &config)? }),
        _ => {
            keys.get("expert_used_count");
            keys.get("expert_feed_forward_length");
            None
        }
    };
    if !matches!(keys.rope_scaling(&config)?, RopeScaling::None) {
        return Err(ModelError::Unsupported("gemma4 with a RoPE scaling type".into()));
    }
    let window = keys.uint("attention.sliding_window")?;
    let sliding = match keys.get("attention.sliding_window_pattern").and_then(|v| v.as_array()) {
        Some(a) if a.len() == n && a.iter().all(|b| b.as_bool().is_some()) => {
            a.iter().map(|b| b.as_bool() == Some(true)).collect::<Vec<_>>()
        }
        _ => return Err(bad("attention.sliding_window_pattern is not one flag per layer".into())),
    };
    let kv_heads = keys.per_layer_uint("attention.head_count_kv", n)?.unwrap_or(vec![config.n_heads; n]);
    // One per layer where the layers sharing K/V have a wider feed-forward (the converter's
    // `use_double_wide_mlp`).
    let ffn_widths = keys.per_layer_uint("feed_forward_length", n)?.unwrap_or(vec![config.ffn; n]);
    if ffn_widths.contains(&0) {
        return Err(bad(format!("feed-forward widths {ffn_widths:?}")));
    }
    let swa_head = keys.opt_uint("attention.key_length_swa")?.unwrap_or(config.head_dim);
    if keys.opt_uint("attention.value_length_swa")?.is_some_and(|v| v != swa_head) {
        return Err(ModelError::Unsupported("gemma4: value heads apart from key heads".into()));
    }
    let swa_rope = keys.opt_uint("rope.dimension_count_swa")?.unwrap_or(config.rope_dim);
    let swa_base = keys.opt_float("rope.freq_base_swa")?.unwrap_or(config.rope_base);
    let shared = keys.opt_uint("attention.shared_kv_layers")?.unwrap_or(0);
    let per_layer = keys.opt_uint("embedding_length_per_layer_input")?.filter(|&p| p > 0);
    let softcap = keys.opt_float("final_logit_softcapping")?.filter(|&c| c != 0.0);
    keys.finish(&|_, _| false)?;
    if window == 0 || swa_head == 0 || !swa_head.is_multiple_of(2) || swa_rope > swa_head || !swa_rope.is_multiple_of(2)
    {
        return Err(bad(format!("sliding window {window}, head size {swa_head}, {swa_rope} rotated")));
    }
    // The global layers' rotation: the file's frequency divisors (huge ones leave dimensions
    // unrotated).
    let factors = if sliding.iter().all(|&s| s) {
        RopeScaling::None
    } else {
        RopeScaling::Factors(Arc::from(keys.f32_tensor("rope_freqs.weight", config.rope_dim / 2)?))
    };
    // Layers from `first_shared` read the K/V of the last earlier layer of their kind (as
    // llama.cpp: layer `first_shared - 2` for a sliding one, `first_shared - 1` for a global one).
    let first_shared = n
        .checked_sub(shared)
        .filter(|&f| shared == 0 || f >= 2)
        .ok_or_else(|| bad(format!("{shared} layers sharing K/V of {n}")))?;
    let mut layers = Vec::with_capacity(n);
    for (i, (&s, &kvh)) in sliding.iter().zip(&kv_heads).enumerate() {
        let head_dim = if s { swa_head } else { config.head_dim };
        if kvh == 0 || !config.n_heads.is_multiple_of(kvh) {
            return Err(bad(format!("layer {i}: {} heads over {kvh} K/V heads", config.n_heads)));
        }
        let kv_from = (i >= first_shared).then(|| first_shared - if s { 2 } else { 1 });
        if let Some(src) = kv_from {
            if sliding[src] != s || kv_heads[src] != kvh {
                return Err(bad(format!("layer {i} shares layer {src}'s K/V, of another kind")));
            }
        }
        layers.push(LayerAttention {
            window: s.then_some(window),
            rope_base: if s { swa_base } else { config.rope_base },
            rope_scaling: if s { RopeScaling::None } else { factors.clone() },
            delta_net: false,
            head_dim,
            kv_heads: kvh,
            rope_dim: if s { swa_rope } else { config.rope_dim },
            kv_from,
        });
    }
    let mut arch = Architecture::llama_like("gemma4", &config, RopeScaling::None, g.tensor("output.weight").is_none());
    arch.norm = NormPlacement::PreAndPost;
    arch.activation = Activation::GeluTanhGated;
    arch.qk_norm = true;
    arch.layers = layers;
    arch.embedding_scale = Some((config.hidden as f32).sqrt());
    arch.attention_scale = 1.0;
    arch.moe = moe;
    arch.value_norm = true;
    arch.per_layer = per_layer;
    arch.final_softcap = softcap;
    arch.ffn_widths = ffn_widths;
    Ok((arch, config))
}
