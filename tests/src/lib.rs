//! Support for the end-to-end tests: tiny random-weight Llama models written to disk in both
//! supported formats, and the location of the real default model.

pub mod fuzz;

use inferd_engine::model::gguf_writer::{GgufWriter, MetaValue};
use inferd_kernels::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Shape of a tiny test model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub seed: u64,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec { layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn: 96, seed: 7 }
    }
}

/// Number of special tokens in the tiny vocabulary (ids 0..SPECIALS).
pub const SPECIALS: usize = 3;
pub const SPECIAL_NAMES: [&str; SPECIALS] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The tiny byte-level vocabulary: 3 specials, the 256 byte characters, then a few merges.
pub fn tiny_vocab() -> (Vec<String>, Vec<(String, String)>) {
    let map = inferd_engine::tokenizer::byte_to_char();
    let mut tokens: Vec<String> = SPECIAL_NAMES.iter().map(|s| s.to_string()).collect();
    tokens.extend(map.iter().map(|c| c.to_string()));
    let merges: Vec<(String, String)> = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("o", "n")]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    for (a, b) in &merges {
        tokens.push(format!("{a}{b}"));
    }
    (tokens, merges)
}

/// Deterministic pseudo-random weights in [-scale, scale].
fn weights(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The tensors of a tiny model in Hugging Face layout: name -> (rows, cols, values).
pub fn tiny_tensors(spec: &TinySpec) -> BTreeMap<String, (usize, usize, Vec<f32>)> {
    let (h, hd) = (spec.hidden, spec.hidden / spec.heads);
    let vocab = tiny_vocab().0.len();
    let mut t = BTreeMap::new();
    let mut seed = spec.seed;
    let mut add = |name: String, rows: usize, cols: usize, scale: f32| {
        seed += 1;
        t.insert(name, (rows, cols, weights(rows * cols, seed, scale)));
    };
    add("model.embed_tokens.weight".into(), vocab, h, 1.0);
    add("lm_head.weight".into(), vocab, h, 0.3);
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}.");
        add(format!("{p}self_attn.q_proj.weight"), spec.heads * hd, h, 0.3);
        add(format!("{p}self_attn.k_proj.weight"), spec.kv_heads * hd, h, 0.3);
        add(format!("{p}self_attn.v_proj.weight"), spec.kv_heads * hd, h, 0.3);
        add(format!("{p}self_attn.o_proj.weight"), h, spec.heads * hd, 0.3);
        add(format!("{p}mlp.gate_proj.weight"), spec.ffn, h, 0.3);
        add(format!("{p}mlp.up_proj.weight"), spec.ffn, h, 0.3);
        add(format!("{p}mlp.down_proj.weight"), h, spec.ffn, 0.3);
    }
    // Norm weights near 1 (as trained models have them).
    let norms: Vec<String> = (0..spec.layers)
        .flat_map(|i| {
            [
                format!("model.layers.{i}.input_layernorm.weight"),
                format!("model.layers.{i}.post_attention_layernorm.weight"),
            ]
        })
        .chain(["model.norm.weight".to_string()])
        .collect();
    for (j, n) in norms.into_iter().enumerate() {
        let v = weights(h, spec.seed + 1000 + j as u64, 0.2).into_iter().map(|x| 1.0 + x).collect();
        t.insert(n, (1, h, v));
    }
    t
}

/// Reorders Q/K rows from Hugging Face's rotate-half layout to GGUF's interleaved pairs (what
/// llama.cpp's converter does), so both files describe the same model.
fn permute_rows(rows: usize, cols: usize, v: &[f32], heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0.0; v.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for (k, src) in [i, i + hd / 2].into_iter().enumerate() {
                let dst_row = h * hd + 2 * i + k;
                let src_row = h * hd + src;
                out[dst_row * cols..(dst_row + 1) * cols].copy_from_slice(&v[src_row * cols..(src_row + 1) * cols]);
            }
        }
    }
    let _ = rows;
    out
}

/// Writes the tiny model as GGUF with matrices in `dtype` (norms F32, embeddings `emb_dtype`).
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec, dtype: DType, emb_dtype: DType) -> PathBuf {
    write_tiny_gguf_with(path, spec, dtype, emb_dtype, |_| {})
}

/// [`write_tiny_gguf`], with `extra` adding metadata or tensors before the file is written.
pub fn write_tiny_gguf_with(
    path: &Path,
    spec: &TinySpec,
    dtype: DType,
    emb_dtype: DType,
    extra: impl FnOnce(&mut GgufWriter),
) -> PathBuf {
    let (tokens, merges) = tiny_vocab();
    let t = tiny_tensors(spec);
    let mut w = GgufWriter::default();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .meta("llama.block_count", MetaValue::U32(spec.layers as u32))
        .meta("llama.embedding_length", MetaValue::U32(spec.hidden as u32))
        .meta("llama.attention.head_count", MetaValue::U32(spec.heads as u32))
        .meta("llama.attention.head_count_kv", MetaValue::U32(spec.kv_heads as u32))
        .meta("llama.feed_forward_length", MetaValue::U32(spec.ffn as u32))
        .meta("llama.context_length", MetaValue::U32(256))
        .meta("llama.rope.freq_base", MetaValue::F32(10000.0))
        .meta("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5))
        .meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::Str("smollm".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::StrArray(tokens.clone()))
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::I32Array((0..tokens.len()).map(|i| if i < SPECIALS { 3 } else { 1 }).collect()),
        )
        .meta("tokenizer.ggml.merges", MetaValue::StrArray(merges.iter().map(|(a, b)| format!("{a} {b}")).collect()))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    let gguf_name = |hf: &str| -> String {
        let hf = hf.strip_suffix(".weight").unwrap_or(hf);
        let map = [("model.embed_tokens", "token_embd"), ("lm_head", "output"), ("model.norm", "output_norm")];
        if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
            return format!("{g}.weight");
        }
        let rest = hf.strip_prefix("model.layers.").unwrap_or(hf);
        let (i, part) = rest.split_once('.').unwrap_or((rest, ""));
        let g = match part {
            "input_layernorm" => "attn_norm",
            "post_attention_layernorm" => "ffn_norm",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.o_proj" => "attn_output",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            _ => "ffn_down",
        };
        format!("blk.{i}.{g}.weight")
    };
    for (name, (rows, cols, v)) in &t {
        let gname = gguf_name(name);
        let v = if name.ends_with("q_proj.weight") {
            permute_rows(*rows, *cols, v, spec.heads)
        } else if name.ends_with("k_proj.weight") {
            permute_rows(*rows, *cols, v, spec.kv_heads)
        } else {
            v.clone()
        };
        let dt = if *rows == 1 {
            DType::F32
        } else if name.contains("embed") || name.contains("lm_head") {
            emb_dtype
        } else {
            dtype
        };
        let dims: Vec<usize> = if *rows == 1 { vec![*cols] } else { vec![*cols, *rows] };
        w.tensor(&gname, dt, &dims, &v);
    }
    extra(&mut w);
    std::fs::write(path, w.to_bytes()).expect("writing the tiny GGUF");
    path.to_path_buf()
}

/// Writes the tiny model as a Hugging Face directory (F32 or F16/BF16 safetensors).
pub fn write_tiny_hf(dir: &Path, spec: &TinySpec, dtype: safetensors::Dtype) -> PathBuf {
    std::fs::create_dir_all(dir).expect("creating the model directory");
    let t = tiny_tensors(spec);
    let (tokens, merges) = tiny_vocab();
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = t
        .iter()
        .map(|(name, (rows, cols, v))| {
            let data: Vec<u8> = match dtype {
                safetensors::Dtype::F16 => v.iter().flat_map(|x| half_bits(*x, false)).collect(),
                safetensors::Dtype::BF16 => v.iter().flat_map(|x| half_bits(*x, true)).collect(),
                _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            let shape = if *rows == 1 { vec![*cols] } else { vec![*rows, *cols] };
            (name.clone(), data, shape)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, d, s)| (n.clone(), safetensors::tensor::TensorView::new(dtype, s.clone(), d).expect("tensor view")))
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("writing safetensors");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": spec.hidden, "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "vocab_size": tokens.len(),
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    let vocab: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), serde_json::json!(i))).collect();
    let added: Vec<serde_json::Value> = SPECIAL_NAMES
        .iter()
        .enumerate()
        .map(|(i, s)| serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer.json");
    dir.to_path_buf()
}

fn half_bits(x: f32, bf: bool) -> [u8; 2] {
    let mut out = Vec::new();
    inferd_kernels::quant::quantize_row(if bf { DType::BF16 } else { DType::F16 }, &[x], &mut out);
    [out[0], out[1]]
}

/// A fresh temporary directory for one test.
pub fn temp_dir(tag: &str) -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let root = ROOT.get_or_init(|| {
        sweep_temp_dirs();
        std::env::temp_dir().join(format!("inferd-test-{}", std::process::id()))
    });
    let d = root.join(tag);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creating a temp dir");
    d
}

/// Removes the temporary directories of test processes that no longer run: every test
/// process keeps its own under `inferd-test-<pid>` (the older `inferd-test-<tag>-<pid>` too),
/// and tests have no hook to remove them when the process ends.
fn sweep_temp_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid =
            name.strip_prefix("inferd-test-").and_then(|s| s.rsplit('-').next()).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// The default model; tests that need it fail with a clear message when it is missing
/// (`.ci/run` fetches it first).
pub fn default_model() -> PathBuf {
    inferd_engine::paths::default_model().unwrap_or_else(|| {
        panic!(
            "the default model is not installed in {:?}: run packaging/fetch-model",
            inferd_engine::paths::model_dirs()
        )
    })
}

/// Runs `script` (a path under `tests/`) with python3 over the packages tests/run installs (the
/// gguf package and numpy, in `$INFERD_TEST_PYTHONPATH`); panics with its stderr if it fails.
pub fn run_python(script: &str, args: &[&std::ffi::OsStr]) {
    let pylib = std::env::var("INFERD_TEST_PYTHONPATH")
        .unwrap_or_else(|_| format!("{}/.cache/inferd/python", std::env::var("HOME").unwrap_or_default()));
    let script = tests_dir().join(script);
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args(args)
        .env("PYTHONPATH", &pylib)
        .output()
        .unwrap_or_else(|e| panic!("running python3 {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed (tests/run installs its packages into {pylib}):\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The repository's `tests/` directory: where this binary was built, or `$INFERD_TESTS_DIR`
/// when it runs on another machine (`tests/gpu/pack` builds the GPU checks for one without a
/// Rust toolchain).
pub fn tests_dir() -> PathBuf {
    std::env::var_os("INFERD_TESTS_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The golden reference directory of the repository.
pub fn golden_dir() -> PathBuf {
    tests_dir().join("golden")
}

/// Compiles the C test plugin (tests/plugins/greedy.c) into `dir/lib<name>.so` with the C
/// preprocessor `defines` (its FAULT_* variants), with the system C compiler (`$CC`, else `cc`).
pub fn compile_c_plugin(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    let root = tests_dir().parent().expect("repository root").to_path_buf();
    let out = dir.join(format!("lib{name}.so"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-std=c99", "-Wall", "-Werror", "-O2", "-I"])
        .arg(root.join("plugin-api/include"))
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg(root.join("tests/plugins/greedy.c"))
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e} (install gcc)"));
    assert!(st.success(), "compiling the C plugin with {defines:?}");
    out
}
