//! Hostile and damaged model files: every one is an error with a message, never a panic.

use inferd_e2e::{temp_dir, write_tiny_gguf, TinySpec};
use inferd_engine::model::Model;
use inferd_kernels::DType;

fn load_bytes(dir: &std::path::Path, name: &str, bytes: &[u8]) -> Result<Model, String> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    Model::load(&p).map_err(|e| e.to_string())
}

#[test]
fn truncated_files_are_errors() {
    let dir = temp_dir("trunc");
    let good =
        std::fs::read(write_tiny_gguf(&dir.join("good.gguf"), &TinySpec::default(), DType::Q4_1, DType::Q8_0)).unwrap();
    assert!(load_bytes(&dir, "ok.gguf", &good).is_ok());
    let mut cuts: Vec<usize> = (0..200).collect();
    cuts.extend((200..good.len()).step_by(997));
    cuts.push(good.len() - 1);
    for cut in cuts {
        let err = load_bytes(&dir, "cut.gguf", &good[..cut]).err();
        assert!(err.is_some(), "a file cut at {cut} of {} bytes loaded", good.len());
    }
}

#[test]
fn corrupted_headers_never_panic() {
    let dir = temp_dir("flip");
    let good =
        std::fs::read(write_tiny_gguf(&dir.join("good.gguf"), &TinySpec::default(), DType::Q8_0, DType::Q8_0)).unwrap();
    let mut x = 12345u64;
    for _ in 0..300 {
        let mut bad = good.clone();
        for _ in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let at = (x as usize) % 4096.min(bad.len());
            bad[at] ^= (x >> 32) as u8 | 1;
        }
        // Either it loads (the flip hit a value that is still valid) or it is an error.
        let r = std::panic::catch_unwind(|| load_bytes(&dir, "bad.gguf", &bad));
        assert!(r.is_ok(), "loading a corrupted file panicked");
    }
}

#[test]
fn hostile_counts_and_unsupported_content_are_named() {
    let dir = temp_dir("hostile");
    // A header claiming 2^60 tensors and metadata entries.
    let mut h = b"GGUF".to_vec();
    h.extend(3u32.to_le_bytes());
    h.extend((1u64 << 60).to_le_bytes());
    h.extend((1u64 << 60).to_le_bytes());
    let e = load_bytes(&dir, "huge.gguf", &h).unwrap_err();
    assert!(e.contains("exceeds the file"), "{e}");
    assert!(load_bytes(&dir, "magic.gguf", b"NOPE and more bytes").unwrap_err().contains("magic"));
    let mut v = b"GGUF".to_vec();
    v.extend(99u32.to_le_bytes());
    assert!(load_bytes(&dir, "ver.gguf", &v).unwrap_err().contains("version 99"));

    // Another architecture is refused by name.
    let good =
        std::fs::read(write_tiny_gguf(&dir.join("g.gguf"), &TinySpec::default(), DType::F32, DType::F32)).unwrap();
    let pos = good.windows(5).position(|w| w == b"llama").unwrap();
    let mut other = good.clone();
    other[pos..pos + 5].copy_from_slice(b"gemma");
    let e = load_bytes(&dir, "arch.gguf", &other).unwrap_err();
    assert!(e.contains("gemma"), "{e}");

    // A tensor type without kernels (IQ2_XXS = 16) is named, with its tensor; so is a number
    // GGML has no type for.
    let name = b"blk.0.attn_q.weight";
    let at = good.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let ty = at + 4 + 2 * 8; // n_dims, two dims, then the type
    for (number, named) in [(16u32, "IQ2_XXS"), (77, "ggml type 77")] {
        let mut bad = good.clone();
        bad[ty..ty + 4].copy_from_slice(&number.to_le_bytes());
        let e = load_bytes(&dir, "type.gguf", &bad).unwrap_err();
        assert!(e.contains(named) && e.contains("blk.0.attn_q.weight") && e.contains("Q4_K"), "{e}");
    }

    // A missing directory and a directory without config.json are I/O errors naming the path.
    assert!(Model::load(&dir.join("nope")).unwrap_err().to_string().contains("nope"));
    std::fs::create_dir_all(dir.join("emptyhf")).unwrap();
    assert!(Model::load(&dir.join("emptyhf")).unwrap_err().to_string().contains("config.json"));
}
