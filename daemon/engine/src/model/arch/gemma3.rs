//! Gemma 3 (text): RMSNorm before and after each sublayer, GeGLU with GELU's tanh
//! approximation, per-head RMSNorm of Q and K, embeddings scaled by `sqrt(hidden)`, and a
//! pattern of sliding-window layers (five of every six by default) whose RoPE base is their
//! own (10000) while the global layers use the model's (and its linear scaling, if any).
//!
//! GGUF follows llama.cpp's reading of `gemma3.*` (the pattern, the local base and the 27B's
//! attention scale are defaults there when the file is silent); `config.json` follows
//! transformers' `Gemma3TextConfig`, whose norms store `w - 1`.

use super::{Activation, Architecture, GgufKeys, HfKeys, LayerAttention, NormPlacement, RopeScaling, TensorLayout};
use crate::model::config::LlamaConfig;
use crate::model::gguf::Gguf;
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value};

/// The default pattern: every sixth layer attends globally.
const PATTERN: usize = 6;
/// The default RoPE base of the sliding-window layers.
const LOCAL_BASE: f32 = 10000.0;

/// The description, given which layers slide.
fn describe(
    cfg: &LlamaConfig,
    sliding: &[bool],
    window: Option<usize>,
    (local_base, global_scaling): (f32, RopeScaling),
    attention_scale: f32,
    tied: bool,
    layout: TensorLayout,
) -> Architecture {
    let global = Architecture::llama_like("gemma3", cfg, global_scaling, tied).layers[0].clone();
    let layers = sliding
        .iter()
        .map(|&s| match (s, window) {
            (true, Some(w)) => LayerAttention {
                window: Some(w),
                rope_base: local_base,
                rope_scaling: RopeScaling::None,
                ..global.clone()
            },
            _ => global.clone(),
        })
        .collect();
    Architecture {
        name: "gemma3",
        norm: NormPlacement::PreAndPost,
        activation: Activation::GeluTanhGated,
        qkv_bias: false,
        qk_norm: true,
        attn_sinks: false,
        attn_out_bias: false,
        layers,
        embedding_scale: Some((cfg.hidden as f32).sqrt()),
        attention_scale,
        tied_output: tied,
        layout,
        moe: None,
        attn_output_gate: false,
        delta: None,
        value_norm: false,
        per_layer: None,
        final_softcap: None,
        ffn_widths: vec![cfg.ffn; cfg.n_layers],
        mrope: None,
        deepstack: 0,
    }
}

pub fn from_gguf(g: &Gguf) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = GgufKeys::new(g, "gemma3");
    let config = keys.config(RopeStyle::Neox)?;
    let window = keys.opt_uint("attention.sliding_window")?.filter(|&w| w > 0);
    let sliding = keys.sliding_layers(config.n_layers, PATTERN)?;
    let local_base = keys.opt_float("rope.freq_base_swa")?.unwrap_or(LOCAL_BASE);
    let scaling = keys.rope_scaling(&config)?;
    if keys.opt_float("final_logit_softcapping")?.is_some_and(|c| c != 0.0) {
        return Err(ModelError::Unsupported("final logit soft-capping (Gemma 2's, not Gemma 3's)".into()));
    }
    // llama.cpp's reading: the 27B model scales by its hidden size per head, the others by
    // their head size.
    let scale = if config.n_layers == 62 { config.hidden / config.n_heads } else { config.head_dim };
    keys.finish(&|_, _| false)?;
    let tied = g.tensor("output.weight").is_none();
    let arch = describe(
        &config,
        &sliding,
        window,
        (local_base, scaling),
        1.0 / (scale as f32).sqrt(),
        tied,
        TensorLayout::default(),
    );
    Ok((arch, config))
}

pub fn from_hf(cfg: &Map<String, Value>) -> Result<(Architecture, LlamaConfig), ModelError> {
    let keys = HfKeys::new(cfg);
    let config = keys.config()?;
    keys.expect_activation("gemma3", "gelu_pytorch_tanh")?;
    let window = keys.opt_uint("sliding_window")?;
    let sliding = match keys.get("layer_types").and_then(Value::as_array) {
        Some(types) if types.len() == config.n_layers => types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(ModelError::Config(format!("config.json: layer type {t}"))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ModelError::Config("config.json: layer_types is not one per layer".into())),
        None => {
            let p = keys.opt_uint("sliding_window_pattern")?.or(keys.opt_uint("_sliding_window_pattern")?);
            super::sliding_pattern(config.n_layers, p.unwrap_or(PATTERN))
        }
    };
    // Read by transformers only to build `layer_types` when it is missing.
    keys.get("sliding_window_pattern");
    keys.get("_sliding_window_pattern");
    let local_base = keys.opt_float("rope_local_base_freq")?.unwrap_or(LOCAL_BASE);
    let scaling = keys.rope_scaling(&config)?;
    let scalar = keys.opt_float("query_pre_attn_scalar")?.unwrap_or(config.head_dim as f32);
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if keys.opt_float(k)?.is_some() {
            return Err(ModelError::Unsupported(format!("config.json: {k} (soft-capping is Gemma 2's)")));
        }
    }
    for k in ["attention_bias", "use_bidirectional_attention"] {
        if keys.opt_bool(k)? == Some(true) {
            return Err(ModelError::Unsupported(format!("config.json: {k} = true (not supported for gemma3)")));
        }
    }
    let tied = keys.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    keys.finish("gemma3", &|k, _| k == "cache_implementation")?;
    let layout = TensorLayout { norm_offset: 1.0, gemma_names: true, ..TensorLayout::default() };
    let arch = describe(&config, &sliding, window, (local_base, scaling), 1.0 / scalar.sqrt(), tied, layout);
    Ok((arch, config))
}
