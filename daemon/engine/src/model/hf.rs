//! Hugging Face model directories: `config.json`, `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), `tokenizer.json`, and the chat template from
//! `tokenizer_config.json`. Tensors are memory-mapped through the `safetensors` crate's parser.

use super::mmap::Blob;
use super::weights::{LlamaWeights, Naming, Tensor};
use super::{Model, ModelError};
use crate::tokenizer::Tokenizer;
use inferd_kernels::DType;
use serde::Deserialize;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

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
    let cfg: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&read(&dir.join("config.json"))?)
        .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
    let (arch, config) = super::arch::for_hf(&cfg)?;

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
    let used = std::cell::RefCell::new(std::collections::HashSet::new());
    let weights = LlamaWeights::load(&config, &arch, Naming::HuggingFace, &|n| {
        used.borrow_mut().insert(n.to_string());
        tensors.get(n).cloned()
    })?;
    // An lm_head saved beside tied embeddings is a copy of them; old checkpoints keep RoPE's
    // inverse frequencies, which are recomputed from rope_theta.
    let ignorable = |n: &str| (arch.tied_output && n == "lm_head.weight") || n.ends_with("rotary_emb.inv_freq");
    super::arch::check_unused(tensors.keys().map(String::as_str), &used.borrow(), &ignorable)?;

    let tok_path = dir.join("tokenizer.json");
    let tok_config: Option<serde_json::Value> =
        std::fs::read(dir.join("tokenizer_config.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let flag = |k: &str| tok_config.as_ref().and_then(|c| c.get(k)).and_then(|v| v.as_bool());
    let tokenizer = Tokenizer::from_hf_file(
        &tok_path,
        ids(&cfg.get("bos_token_id").cloned()).first().copied(),
        ids(&cfg.get("eos_token_id").cloned()),
        flag("add_bos_token").unwrap_or(false),
    )?;
    let chat_template =
        tok_config.as_ref().and_then(|c| c.get("chat_template")).and_then(|v| v.as_str()).map(str::to_string);
    Ok(Model {
        name,
        path: dir.to_path_buf(),
        arch,
        config,
        weights,
        tokenizer,
        chat_template,
        rank: None,
        vision: None,
    })
}
