//! Writes a loaded model as a Hugging Face directory (`config.json`, `model.safetensors` in
//! F32, F16 or BF16, `tokenizer.json`, `tokenizer_config.json`): the same weights dequantized,
//! e.g. a full-precision target for a quantized draft model.
//!
//! GGUF files from llama.cpp's converter store Q and K rows of each head with RoPE pairs
//! interleaved; Hugging Face checkpoints rotate halves. Rows are reordered back on export, so
//! the directory loads as the same model (`RopeStyle::Neox`).

use super::{Model, ModelError};
use crate::model::arch::RopeScaling;
use half::{bf16, f16};
use inferd_kernels::ops::RopeStyle;
use std::path::Path;

/// The element type of the exported tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    F32,
    F16,
    BF16,
}

/// Interleaved-pair rows (GGUF) back to rotate-half rows (Hugging Face), per head.
fn unpermute(v: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0.0; v.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for k in 0..2 {
                let src = h * hd + 2 * i + k;
                let dst = h * hd + k * hd / 2 + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn encode(v: &[f32], dtype: ExportDtype) -> Vec<u8> {
    match dtype {
        ExportDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ExportDtype::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        ExportDtype::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
    }
}

pub fn export_hf(model: &Model, dir: &Path, dtype: ExportDtype) -> Result<(), ModelError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    // The writer below speaks plain Llama's config.json; anything else (another family, RoPE
    // scaling, windows) would be lost.
    let plain =
        crate::model::Architecture::llama_like("llama", &model.config, RopeScaling::None, model.arch.tied_output);
    if model.arch != plain {
        return Err(ModelError::Unsupported(format!(
            "exporting {} (only plain Llama models without RoPE scaling are exported)",
            model.arch.name
        )));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let cfg = &model.config;
    let w = &model.weights;
    let interleaved = cfg.rope_style == RopeStyle::Interleaved;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut put = |name: String, rows: usize, cols: usize, v: Vec<f32>| {
        let shape = if rows == 1 { vec![cols] } else { vec![rows, cols] };
        tensors.push((name, shape, encode(&v, dtype)));
    };
    put("model.embed_tokens.weight".into(), w.token_embd.rows, w.token_embd.cols, w.token_embd.to_f32());
    for (i, l) in w.layers.iter().enumerate() {
        let (Some(a), Some(wk), Some(wv)) =
            (l.attention(), l.attention().and_then(|a| a.wk.as_ref()), l.attention().and_then(|a| a.wv.as_ref()))
        else {
            return Err(ModelError::Unsupported("exporting a layer without attention and its own K/V".into()));
        };
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        let qk = |t: &crate::model::weights::Tensor, heads: usize| {
            if interleaved {
                unpermute(&t.to_f32(), t.rows, t.cols, heads)
            } else {
                t.to_f32()
            }
        };
        put(p("input_layernorm"), 1, l.attn_norm.len(), l.attn_norm.clone());
        put(p("self_attn.q_proj"), a.wq.rows, a.wq.cols, qk(&a.wq, cfg.n_heads));
        put(p("self_attn.k_proj"), wk.rows, wk.cols, qk(wk, cfg.n_kv_heads));
        put(p("self_attn.v_proj"), wv.rows, wv.cols, wv.to_f32());
        put(p("self_attn.o_proj"), a.wo.rows, a.wo.cols, a.wo.to_f32());
        put(p("post_attention_layernorm"), 1, l.ffn_norm.len(), l.ffn_norm.clone());
        put(p("mlp.gate_proj"), l.w_gate.rows, l.w_gate.cols, l.w_gate.to_f32());
        put(p("mlp.up_proj"), l.w_up.rows, l.w_up.cols, l.w_up.to_f32());
        put(p("mlp.down_proj"), l.w_down.rows, l.w_down.cols, l.w_down.to_f32());
    }
    put("model.norm.weight".into(), 1, w.output_norm.len(), w.output_norm.clone());
    let tied = w.output.name == w.token_embd.name;
    if !tied {
        put("lm_head.weight".into(), w.output.rows, w.output.cols, w.output.to_f32());
    }
    let st = match dtype {
        ExportDtype::F32 => safetensors::Dtype::F32,
        ExportDtype::F16 => safetensors::Dtype::F16,
        ExportDtype::BF16 => safetensors::Dtype::BF16,
    };
    let views = tensors
        .iter()
        .map(|(n, shape, data)| safetensors::tensor::TensorView::new(st, shape.clone(), data).map(|v| (n.clone(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Safetensors(e.to_string()))?;
    let file = dir.join("model.safetensors");
    safetensors::tensor::serialize_to_file(views, None, &file)
        .map_err(|e| ModelError::Safetensors(format!("writing {}: {e}", file.display())))?;
    let tok = &model.tokenizer;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_base,
        "max_position_embeddings": cfg.context_len, "tie_word_embeddings": tied,
        "bos_token_id": tok.bos(), "eos_token_id": tok.eos(),
        "torch_dtype": match dtype { ExportDtype::F32 => "float32", ExportDtype::F16 => "float16", ExportDtype::BF16 => "bfloat16" },
    });
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap_or_default()).map_err(io(&path))?;
    let path = dir.join("tokenizer.json");
    tok.save_hf(&path)?;
    let tok_config = serde_json::json!({ "add_bos_token": tok.adds_bos(), "chat_template": model.chat_template });
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&tok_config).unwrap_or_default()).map_err(io(&path))?;
    Ok(())
}
