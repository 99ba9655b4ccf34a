//! Reading an architecture's metadata (GGUF keys under `{arch}.`, or `config.json` fields) while
//! remembering what was read, so that [`GgufKeys::finish`] and [`HfKeys::finish`] can refuse
//! by name whatever no one understood. The hyperparameters every family shares are read here.

use super::rope::{llama3_factors, longrope_attention_factor, yarn_attention_factor};
use super::RopeScaling;
use crate::model::config::{LlamaConfig, Pooling};
use crate::model::gguf::{Gguf, Value};
use crate::model::ModelError;
use inferd_kernels::ops::RopeStyle;
use serde_json::{Map, Value as Json};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::Arc;

/// The `{arch}.*` keys of a GGUF file.
pub struct GgufKeys<'a> {
    g: &'a Gguf,
    arch: &'a str,
    read: RefCell<BTreeSet<String>>,
}

impl<'a> GgufKeys<'a> {
    pub fn new(g: &'a Gguf, arch: &'a str) -> Self {
        GgufKeys { g, arch, read: RefCell::default() }
    }

    fn full(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// The value of `{arch}.{k}`, now counted as understood.
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.read.borrow_mut().insert(k.to_string());
        self.g.get(&self.full(k))
    }

    pub fn opt_uint(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| ModelError::Config(format!("{} is not an unsigned integer", self.full(k)))),
        }
    }

    pub fn uint(&self, k: &str) -> Result<usize, ModelError> {
        self.opt_uint(k)?.ok_or_else(|| ModelError::MissingKey(self.full(k)))
    }

    /// `{arch}.{k}` of each of `n` layers: one number for all of them, or an array of one per
    /// layer (Gemma 4's `attention.head_count_kv`).
    pub fn per_layer_uint(&self, k: &str, n: usize) -> Result<Option<Vec<usize>>, ModelError> {
        let Some(v) = self.get(k) else { return Ok(None) };
        let bad = || ModelError::Config(format!("{} = {v:?} is not a count, or one per layer", self.full(k)));
        if let Some(x) = v.as_u64() {
            return Ok(Some(vec![usize::try_from(x).map_err(|_| bad())?; n]));
        }
        let a = v.as_array().filter(|a| a.len() == n).ok_or_else(bad)?;
        a.iter()
            .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(bad))
            .collect::<Result<_, _>>()
            .map(Some)
    }

    pub fn opt_float(&self, k: &str) -> Result<Option<f32>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            // Finite as an f32: an `inf` or NaN hyperparameter (a YaRN factor, an epsilon)
            // would load and then compute nothing but NaN.
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| ModelError::Config(format!("{} is not a finite number", self.full(k)))),
        }
    }

    /// The hyperparameters every family writes the same way.
    pub fn config(&self, rope_style: RopeStyle) -> Result<LlamaConfig, ModelError> {
        let hidden = self.uint("embedding_length")?;
        let n_heads = self.uint("attention.head_count")?;
        if n_heads == 0 {
            return Err(ModelError::Config(format!("{} is zero", self.full("attention.head_count"))));
        }
        let head_dim = self.opt_uint("attention.key_length")?.unwrap_or(hidden / n_heads);
        if let Some(v) = self.opt_uint("attention.value_length")?.filter(|&v| v != head_dim) {
            return Err(ModelError::Unsupported(format!("value head size {v} apart from key head size {head_dim}")));
        }
        let vocab = match self.opt_uint("vocab_size")? {
            Some(v) => v,
            None => self.g.tensor("token_embd.weight").and_then(|t| t.dims.get(1).copied()).unwrap_or(0),
        };
        let n_layers = self.uint("block_count")?;
        // K/V heads and feed-forward widths may be one per layer (Gemma 4): the most of them
        // here, each layer's in its family's description (a family that reads one for all
        // layers meets a layer's narrower tensors as a shape error).
        let kv_heads = self.per_layer_uint("attention.head_count_kv", n_layers)?;
        let config = LlamaConfig {
            n_layers,
            hidden,
            n_heads,
            n_kv_heads: kv_heads.and_then(|h| h.into_iter().max()).unwrap_or(n_heads),
            head_dim,
            rope_dim: self.opt_uint("rope.dimension_count")?.unwrap_or(head_dim),
            ffn: match self.per_layer_uint("feed_forward_length", n_layers)? {
                Some(f) => f.into_iter().max().unwrap_or(0),
                None => return Err(ModelError::MissingKey(self.full("feed_forward_length"))),
            },
            vocab,
            rope_base: self.opt_float("rope.freq_base")?.unwrap_or(10000.0),
            rope_style,
            rms_eps: self.opt_float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            context_len: self.opt_uint("context_length")?.unwrap_or(2048),
            pooling: self.pooling()?,
        };
        config.validate().map_err(ModelError::Config)?;
        Ok(config)
    }

    /// An embedding model's `pooling_type`, and `attention.causal` (an embedder that attends
    /// both ways is refused by name: the engine's attention is causal).
    fn pooling(&self) -> Result<Pooling, ModelError> {
        if self.get("attention.causal").is_some_and(|v| v.as_bool() == Some(false)) {
            let key = self.full("attention.causal");
            return Err(ModelError::Unsupported(format!("bidirectional attention ({key} = false)")));
        }
        match self.opt_uint("pooling_type")? {
            None | Some(0 | 1) => Ok(Pooling::Mean),
            Some(2) => Ok(Pooling::Cls),
            Some(3) => Ok(Pooling::Last),
            // A reranker: llama.cpp gives causal models a head for Qwen3's alone.
            Some(4) if self.arch == "qwen3" => {
                self.get("classifier.output_labels"); // read with the head (`model::rank`)
                Ok(Pooling::Rank)
            }
            Some(4) => Err(ModelError::Unsupported(format!(
                "rank pooling for {} (a reranker's head is read for qwen3's rerankers alone)",
                self.arch
            ))),
            Some(p) => Err(ModelError::Unsupported(format!("{} = {p}", self.full("pooling_type")))),
        }
    }

    /// `{arch}.rope.scaling.type` with its factor: none, linear or YaRN (with its original
    /// context length, `yarn_beta_fast` / `yarn_beta_slow` and `attn_factor`, as llama.cpp reads
    /// them; its other YaRN variants are refused by name).
    pub fn rope_scaling(&self, cfg: &LlamaConfig) -> Result<RopeScaling, ModelError> {
        let kind = self.get("rope.scaling.type").map(|v| v.as_str().unwrap_or("?"));
        let factor = self.opt_float("rope.scaling.factor")?;
        let original = self.opt_uint("rope.scaling.original_context_length")?;
        match (kind, factor) {
            (None | Some("none"), _) | (Some("linear"), None | Some(1.0)) => Ok(RopeScaling::None),
            (Some("linear"), Some(f)) if f > 0.0 => Ok(RopeScaling::Linear(f)),
            (Some("yarn"), Some(f)) if f >= 1.0 => {
                for (k, neutral) in [("rope.scaling.yarn_log_multiplier", 0.0), ("rope.scaling.yarn_ext_factor", 1.0)] {
                    if let Some(v) = self.opt_float(k)?.filter(|&v| v != neutral) {
                        return Err(ModelError::Unsupported(format!("GGUF key '{}' = {v}", self.full(k))));
                    }
                }
                let beta_fast = self.opt_float("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0);
                let beta_slow = self.opt_float("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0);
                let attn = self.opt_float("rope.scaling.attn_factor")?.unwrap_or(1.0);
                let original = original.unwrap_or(cfg.context_len);
                if !(beta_fast > beta_slow && beta_slow > 0.0 && attn > 0.0 && original > 0) {
                    return Err(ModelError::Config(format!("{}: YaRN parameters out of range", self.arch)));
                }
                let attn_factor = yarn_attention_factor(f) * attn;
                Ok(RopeScaling::Yarn { factor: f, original, beta_fast, beta_slow, attn_factor })
            }
            (kind, factor) => Err(ModelError::Unsupported(format!(
                "GGUF key '{}' = {} with factor {factor:?} (supported: none, linear, yarn)",
                self.full("rope.scaling.type"),
                kind.unwrap_or("?")
            ))),
        }
    }

    /// Which of `n_layers` layers attend through the sliding window, as llama.cpp reads
    /// `attention.sliding_window_pattern`: an array of flags, or a period whose last layer
    /// alone attends globally (`default` when the file is silent).
    pub fn sliding_layers(&self, n_layers: usize, default: usize) -> Result<Vec<bool>, ModelError> {
        Ok(match self.get("attention.sliding_window_pattern") {
            None => super::sliding_pattern(n_layers, default),
            Some(v) => match (v.as_u64(), v.as_array()) {
                (Some(n), _) => super::sliding_pattern(n_layers, n as usize),
                (None, Some(a)) if a.len() == n_layers && a.iter().all(|b| b.as_bool().is_some()) => {
                    a.iter().map(|b| b.as_bool() == Some(true)).collect()
                }
                _ => {
                    let key = self.full("attention.sliding_window_pattern");
                    return Err(ModelError::Config(format!("{key} = {v:?}")));
                }
            },
        })
    }

    /// The f32 values of a small GGUF tensor (`rope_freqs.weight`, LongRoPE's factors).
    pub fn f32_tensor(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let g = self.g;
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

    /// Refuses every `{arch}.*` key that was not read, unless `harmless` says it changes
    /// nothing (a default value, a count of experts that is zero).
    pub fn finish(&self, harmless: &dyn Fn(&str, &Value) -> bool) -> Result<(), ModelError> {
        let prefix = format!("{}.", self.arch);
        let read = self.read.borrow();
        for (k, v) in self.g.metadata.iter().filter_map(|(k, v)| k.strip_prefix(&prefix).map(|s| (s, v))) {
            if !read.contains(k) && !harmless(k, v) {
                return Err(ModelError::Unsupported(format!(
                    "GGUF key '{prefix}{k}' = {v:?} (not understood for {})",
                    self.arch
                )));
            }
        }
        Ok(())
    }
}

/// `config.json` fields that never change the computation at inference.
const HF_HARMLESS: [&str; 15] = [
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "_name_or_path",
    "attention_dropout",
    "pretraining_tp",
    "is_llama_config",
    "embd_pdrop",
];

/// The fields of a `config.json`.
pub struct HfKeys<'a> {
    cfg: &'a Map<String, Json>,
    read: RefCell<BTreeSet<String>>,
}

impl<'a> HfKeys<'a> {
    pub fn new(cfg: &'a Map<String, Json>) -> Self {
        HfKeys { cfg, read: RefCell::default() }
    }

    /// The field `k`, now counted as understood; JSON `null` reads as absent.
    pub fn get(&self, k: &str) -> Option<&'a Json> {
        self.read.borrow_mut().insert(k.to_string());
        self.cfg.get(k).filter(|v| !v.is_null())
    }

    fn bad(k: &str, want: &str) -> ModelError {
        ModelError::Config(format!("config.json: {k} must be {want}"))
    }

    pub fn opt_uint(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => {
                v.as_u64().and_then(|x| usize::try_from(x).ok()).map(Some).ok_or_else(|| Self::bad(k, "an integer"))
            }
        }
    }

    pub fn uint(&self, k: &str) -> Result<usize, ModelError> {
        self.opt_uint(k)?.ok_or_else(|| ModelError::MissingKey(format!("config.json: {k}")))
    }

    pub fn opt_float(&self, k: &str) -> Result<Option<f32>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| Self::bad(k, "a finite number")),
        }
    }

    pub fn opt_bool(&self, k: &str) -> Result<Option<bool>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| Self::bad(k, "true or false")),
        }
    }

    pub fn opt_str(&self, k: &str) -> Result<Option<&'a str>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| Self::bad(k, "a string")),
        }
    }

    /// The hyperparameters every family names the same way (Hugging Face checkpoints rotate
    /// halves: [`RopeStyle::Neox`]).
    pub fn config(&self) -> Result<LlamaConfig, ModelError> {
        let (hidden, n_heads) = (self.uint("hidden_size")?, self.uint("num_attention_heads")?);
        if n_heads == 0 {
            return Err(ModelError::Config("num_attention_heads is zero".into()));
        }
        let head_dim = self.opt_uint("head_dim")?.unwrap_or(hidden / n_heads);
        let rotary = self.opt_float("partial_rotary_factor")?.unwrap_or(1.0);
        let config = LlamaConfig {
            n_layers: self.uint("num_hidden_layers")?,
            hidden,
            n_heads,
            n_kv_heads: self.opt_uint("num_key_value_heads")?.unwrap_or(n_heads),
            head_dim,
            rope_dim: (head_dim as f32 * rotary) as usize,
            ffn: self.uint("intermediate_size")?,
            vocab: self.uint("vocab_size")?,
            rope_base: self.opt_float("rope_theta")?.unwrap_or(10000.0),
            rope_style: RopeStyle::Neox,
            rms_eps: self.opt_float("rms_norm_eps")?.unwrap_or(1e-6),
            context_len: self.opt_uint("max_position_embeddings")?.unwrap_or(2048),
            pooling: Pooling::Mean,
        };
        config.validate().map_err(ModelError::Config)?;
        Ok(config)
    }

    /// `rope_scaling`: absent, `default`, `linear`, Llama 3's (turned into per-frequency
    /// factors for `cfg`'s rotation), YaRN, or LongRoPE (`longrope`, Phi-3's older `su`).
    /// A field of it that would change the computation and is not read here is refused.
    pub fn rope_scaling(&self, cfg: &LlamaConfig) -> Result<RopeScaling, ModelError> {
        let Some(v) = self.get("rope_scaling") else { return Ok(RopeScaling::None) };
        let obj = v.as_object().ok_or_else(|| Self::bad("rope_scaling", "an object"))?;
        let num = |k: &str| obj.get(k).and_then(Json::as_f64).map(|x| x as f32);
        let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Json::as_str);
        let only = |known: &[&str]| match obj.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(ModelError::Unsupported(format!("config.json: rope_scaling.{k} (in {v})"))),
            None => Ok(()),
        };
        let out_of_range = || ModelError::Config(format!("config.json: rope_scaling {v} is out of range"));
        // The trained context of YaRN and LongRoPE: in `rope_scaling` or, as Phi-3 has it,
        // beside it.
        let original = || -> Result<usize, ModelError> {
            let beside = self.opt_uint("original_max_position_embeddings")?;
            Ok(num("original_max_position_embeddings").map(|x| x as usize).or(beside).unwrap_or(cfg.context_len))
        };
        match (kind, num("factor")) {
            (Some("default"), _) => Ok(RopeScaling::None),
            (Some("linear"), Some(f)) if f > 0.0 => Ok(RopeScaling::Linear(f)),
            (Some("llama3"), Some(f)) => {
                let (low, high) = (num("low_freq_factor").unwrap_or(1.0), num("high_freq_factor").unwrap_or(4.0));
                let original = num("original_max_position_embeddings").unwrap_or(8192.0);
                if !(f > 0.0 && low > 0.0 && high > low && original > 0.0) {
                    return Err(out_of_range());
                }
                let factors = llama3_factors(cfg.rope_dim, cfg.rope_base, f, low, high, original);
                Ok(RopeScaling::Factors(Arc::from(factors)))
            }
            (Some("yarn"), Some(f)) if f >= 1.0 => {
                only(&[
                    "rope_type",
                    "type",
                    "factor",
                    "original_max_position_embeddings",
                    "beta_fast",
                    "beta_slow",
                    "attention_factor",
                ])?;
                let original = original()?;
                let (beta_fast, beta_slow) = (num("beta_fast").unwrap_or(32.0), num("beta_slow").unwrap_or(1.0));
                let attn_factor = num("attention_factor").unwrap_or_else(|| yarn_attention_factor(f));
                if !(beta_fast > beta_slow && beta_slow > 0.0 && attn_factor > 0.0 && original > 0) {
                    return Err(out_of_range());
                }
                Ok(RopeScaling::Yarn { factor: f, original, beta_fast, beta_slow, attn_factor })
            }
            (Some("longrope" | "su"), _) => {
                only(&[
                    "rope_type",
                    "type",
                    "long_factor",
                    "short_factor",
                    "original_max_position_embeddings",
                    "attention_factor",
                    "factor",
                ])?;
                let factors = |k: &str| -> Result<Arc<[f32]>, ModelError> {
                    let a = obj
                        .get(k)
                        .and_then(Json::as_array)
                        .ok_or_else(|| Self::bad(&format!("rope_scaling.{k}"), "a list"))?;
                    let f: Option<Vec<f32>> = a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
                    match f {
                        Some(f) if f.len() == cfg.rope_dim / 2 && f.iter().all(|&x| x > 0.0) => Ok(Arc::from(f)),
                        _ => Err(ModelError::Config(format!(
                            "config.json: rope_scaling.{k} must be {} positive numbers",
                            cfg.rope_dim / 2
                        ))),
                    }
                };
                let original = original()?;
                // Stretched by `factor`, or by the context over the trained one.
                let stretch = num("factor").unwrap_or(cfg.context_len as f32 / original.max(1) as f32);
                let attn_factor =
                    num("attention_factor").unwrap_or_else(|| longrope_attention_factor(stretch, original.max(1)));
                if !(attn_factor > 0.0 && original > 0) {
                    return Err(out_of_range());
                }
                Ok(RopeScaling::LongRope {
                    short: factors("short_factor")?,
                    long: factors("long_factor")?,
                    original,
                    attn_factor,
                })
            }
            _ => Err(ModelError::Unsupported(format!(
                "config.json: rope_scaling = {v} (supported: linear, llama3, yarn, longrope)"
            ))),
        }
    }

    /// Refuses an MLP activation other than `want` (read from `hidden_act`, or Gemma's
    /// `hidden_activation`), absent meaning `want`.
    pub fn expect_activation(&self, family: &str, want: &str) -> Result<(), ModelError> {
        for k in ["hidden_act", "hidden_activation"] {
            if let Some(act) = self.opt_str(k)?.filter(|a| *a != want) {
                return Err(ModelError::Unsupported(format!("config.json: {k} = {act} ({family} uses {want})")));
            }
        }
        Ok(())
    }

    /// Refuses every field that was not read and is not harmless (the common ones, or what
    /// `harmless` of the family allows), naming it.
    pub fn finish(&self, family: &str, harmless: &dyn Fn(&str, &Json) -> bool) -> Result<(), ModelError> {
        let read = self.read.borrow();
        for (k, v) in self.cfg {
            // Newer transformers write the attention kind of every layer; all global is the
            // default of every family without a window.
            let all_global = k == "layer_types"
                && v.as_array().is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
            if !read.contains(k) && !HF_HARMLESS.contains(&k.as_str()) && !all_global && !harmless(k, v) {
                return Err(ModelError::Unsupported(format!("config.json: {k} = {v} (not understood for {family})")));
            }
        }
        Ok(())
    }
}
