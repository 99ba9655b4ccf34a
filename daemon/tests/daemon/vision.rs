//! Images in prompts, against llama.cpp's libmtmd on the same files: a tiny random-weight
//! Gemma 3 and its projector (`tests/reference/tiny_models.py vision`: SigLIP's form, 16 image
//! tokens), an image of the encoder's size and one resized and letterboxed. The image
//! embeddings equal `llama-mtmd-cli`'s (its `MTMD_DEBUG_EMBEDDINGS` dump) within a stated
//! tolerance.

use super::*;
use inferd_engine::vision::{self, ImageLimits, VisionEncoder};

/// llama.cpp's multimodal command line, built beside llama-server by tests/build-llama-server.
fn llama_mtmd_cli() -> Option<PathBuf> {
    let p = super::remote::llama_server()?.with_file_name("llama-mtmd-cli");
    p.exists().then_some(p)
}

fn tiny_vision(dir: &Path) -> (PathBuf, PathBuf) {
    tiny_models("vision", dir);
    (dir.join("tiny-gemma3-vision.gguf"), dir.join("tiny-gemma3-vision-mmproj.gguf"))
}

/// The image embeddings llama-mtmd-cli computes for `image` (rows of the model's width).
fn mtmd_embeddings(bin: &Path, model: &Path, mmproj: &Path, image: &Path, dir: &Path) -> (usize, usize, Vec<f32>) {
    let dump = dir.join("embeddings.bin");
    let out = Command::new(bin)
        .args(["-m", &model.display().to_string(), "--mmproj", &mmproj.display().to_string()])
        .args(["--image", &image.display().to_string(), "-p", "Describe.", "-n", "1", "--temp", "0", "-t", "2"])
        .env("MTMD_DEBUG_EMBEDDINGS", &dump)
        .output()
        .unwrap();
    assert!(out.status.success(), "llama-mtmd-cli: {}", String::from_utf8_lossy(&out.stderr));
    let b = std::fs::read(&dump).unwrap();
    let int = |i: usize| i32::from_le_bytes(b[i..i + 4].try_into().unwrap()) as usize;
    let (n, width) = (int(0), int(4));
    let v: Vec<f32> = b[8..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(v.len(), n * width);
    (n, width, v)
}

/// How far apart the embeddings may be, relative to their root mean square: four times the
/// most measured (0.0012 for square.png, 0.0009 for wide.png, AMD EPYC Zen 4), the two sides
/// rounding differently (llama.cpp's patch products in f16, its GELU from a table of f16
/// inputs). A pixel resampled differently, a position, norm or pooling out of order is
/// several times the rms.
const EMBEDDING_TOL: f32 = 0.005;

#[test]
fn image_embeddings_match_llama_cpps() {
    let Some(bin) = llama_mtmd_cli() else {
        eprintln!("skipped: no llama-mtmd-cli (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("vision-embeddings");
    let (model, mmproj) = tiny_vision(&dir);
    let enc = VisionEncoder::load(&mmproj).unwrap();
    let pool = inferd_kernels::pool::ThreadPool::new(2);
    let k = inferd_kernels::Kernels::detect();
    for name in ["square.png", "wide.png"] {
        let (n, width, want) = mtmd_embeddings(&bin, &model, &mmproj, &dir.join(name), &dir);
        assert_eq!((n, width), (enc.image_tokens(), enc.config.out_width), "{name}");
        let img = vision::decode(&std::fs::read(dir.join(name)).unwrap(), ImageLimits::default()).unwrap();
        let got = enc.encode(&pool, &k, &img);
        let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / rms;
        eprintln!("{name}: {n} image tokens of {width}, at most {worst:.5} of their rms ({rms:.3}) from llama.cpp's");
        assert!(worst < EMBEDDING_TOL, "{name}: {worst}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
