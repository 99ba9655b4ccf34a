//! What a model file says about itself without loading it: its format, architecture, type
//! (llama.cpp's file type: `Q4_K_M`), trained context, parameter count and size on disk. A model
//! store lists every model it holds with these, loaded or not, and the memory budget sizes a
//! model from them before it loads. Only the header is read (the GGUF metadata and tensor
//! directory, the safetensors headers and `config.json`); the weights are not touched.

use super::gguf::Gguf;
use super::mmap::Blob;
use super::ModelError;
use inferd_kernels::DType;
use std::path::Path;

/// A model file's description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// "gguf" or "safetensors" (a Hugging Face directory).
    pub format: &'static str,
    /// The architecture as the file names it (`llama`, `qwen2`, `gemma3`).
    pub architecture: String,
    /// llama.cpp's name of the file type (`Q4_K_M`, `F16`), else the type most weights have.
    pub file_type: String,
    /// The context length the model was trained for.
    pub context_len: u64,
    /// Weights, counted over every tensor.
    pub parameters: u64,
    /// Bytes on disk (every shard of a directory).
    pub size: u64,
}

impl Facts {
    /// Reads the facts of a GGUF file or a Hugging Face directory.
    pub fn read(path: &Path) -> Result<Facts, ModelError> {
        let io = |source| ModelError::Io { path: path.to_path_buf(), source };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.is_dir() {
            return directory(path);
        }
        let g = Gguf::parse_header(Blob::map(path).map_err(io)?)?;
        let architecture = g.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("unknown").to_string();
        let context_len = g.get(&format!("{architecture}.context_length")).and_then(|v| v.as_u64()).unwrap_or(0);
        let parameters = g.tensors.iter().map(|t| t.dims.iter().product::<usize>() as u64).sum();
        let file_type = g
            .get("general.file_type")
            .and_then(|v| v.as_u64())
            .and_then(file_type_name)
            .map(str::to_string)
            .unwrap_or_else(|| most_common(g.tensors.iter().map(|t| (t.dtype, t.dims.iter().product::<usize>()))));
        Ok(Facts { format: "gguf", architecture, file_type, context_len, parameters, size: meta.len() })
    }

    /// The size in MiB, rounded up.
    pub fn size_mib(&self) -> u64 {
        self.size.div_ceil(1 << 20)
    }
}

/// A Hugging Face directory: `config.json` and the headers of its `*.safetensors` files.
fn directory(dir: &Path) -> Result<Facts, ModelError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| ModelError::Io { path: p, source }
    };
    let cfg_path = dir.join("config.json");
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg_path).map_err(io(&cfg_path))?)
        .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
    let (mut size, mut parameters, mut types) = (0u64, 0u64, Vec::new());
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let blob = Blob::map(&path).map_err(io(&path))?;
        size += blob.bytes().len() as u64;
        let (_, meta) = safetensors::SafeTensors::read_metadata(blob.bytes())
            .map_err(|e| ModelError::Safetensors(format!("{}: {e}", path.display())))?;
        for (_, t) in meta.tensors() {
            let n: usize = t.shape.iter().product();
            parameters += n as u64;
            let dtype = match t.dtype {
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::BF16 => DType::BF16,
                _ => DType::F32,
            };
            types.push((dtype, n));
        }
    }
    let text = |k: &str| cfg.get(k).and_then(|v| v.as_str()).map(str::to_string);
    Ok(Facts {
        format: "safetensors",
        architecture: text("model_type").unwrap_or_else(|| "unknown".into()),
        file_type: text("torch_dtype").map(|t| t.to_uppercase()).unwrap_or_else(|| most_common(types.into_iter())),
        context_len: cfg.get("max_position_embeddings").and_then(|v| v.as_u64()).unwrap_or(0),
        parameters,
        size,
    })
}

/// The type holding the most weights.
fn most_common(types: impl Iterator<Item = (DType, usize)>) -> String {
    let mut count: Vec<(DType, usize)> = Vec::new();
    for (d, n) in types {
        match count.iter_mut().find(|(x, _)| *x == d) {
            Some((_, c)) => *c += n,
            None => count.push((d, n)),
        }
    }
    count.into_iter().max_by_key(|(_, n)| *n).map_or_else(|| "unknown".into(), |(d, _)| d.name().to_string())
}

/// llama.cpp's `llama_ftype` names (`general.file_type`), for the types it writes.
fn file_type_name(ft: u64) -> Option<&'static str> {
    Some(match ft {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        21 => "Q2_K_S",
        25 => "IQ4_NL",
        30 => "IQ4_XS",
        32 => "BF16",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_common_type_is_the_one_holding_the_most_weights() {
        let t = [(DType::F32, 10), (DType::Q4K, 300), (DType::Q6K, 200), (DType::F32, 5)];
        assert_eq!(most_common(t.into_iter()), "Q4_K");
        assert_eq!(most_common(std::iter::empty()), "unknown");
        assert_eq!(file_type_name(15), Some("Q4_K_M"));
        assert_eq!(file_type_name(4), None);
    }
}
