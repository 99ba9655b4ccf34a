//! Gemma 4 (per-layer embeddings, K/V shared across layers, sliding and global layers of two
//! head sizes; and with experts beside the dense feed-forward, as 26B-A4B) against
//! llama-server on the same files: the tiny random-weight models written by
//! `tests/reference/tiny_models.py gemma4`, its greedy tokens and log-probabilities a token at a
//! time and batched answers equal to each prompt's alone; then through chunked prefill, forks
//! (n = 2, a beam of 3), preemption and the prefix cache: every answer the same as alone; and
//! speculative decoding (drafts rolled back out of the sliding and global layers' tables) is
//! greedy decoding.

use super::hybrid::speculative_is_greedy;
use super::moe::{answer_as_llama_cpp, through_chunks_forks_and_preemption};
use super::remote::llama_server;
use super::*;

/// How close the log-probabilities must be, on the f32 file: above the most they differ here
/// (0.0021 over 67 steps of the two models, Intel Xeon AVX-512; tests/e2e/reference.rs
/// `tiny_gemma4_matches_llama_cpp` says where the difference comes from: llama.cpp's GELU table
/// and its f16 queries in attention, which Gemma 4's unscaled attention sharpens).
const GEMMA4_TOL: f64 = 0.1;

/// The tiny Gemma 4 files: Q8_0 and f32, and their twins with experts (as 26B-A4B).
fn tiny_gemma4(dir: &Path) -> (PathBuf, PathBuf) {
    tiny_models("gemma4", dir);
    (dir.join("tiny-gemma4.gguf"), dir.join("tiny-gemma4-f32.gguf"))
}

fn with_experts(path: &Path) -> PathBuf {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    path.with_file_name(name.replacen("tiny-gemma4", "tiny-gemma4-moe", 1))
}

#[test]
fn gemma4_answers_as_llama_cpp() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("gemma4");
    let (_, f32_file) = tiny_gemma4(&dir);
    let models = [(with_experts(&f32_file), "gemma4-moe"), (f32_file, "gemma4")];
    let cfg: String =
        models.iter().map(|(p, n)| format!("[[model]]\nname = \"{n}\"\npath = \"{}\"\n", p.display())).collect();
    let d = Daemon::start(&dir, &cfg, &[]);
    let (compared, worst) = answer_as_llama_cpp(&bin, &d, &models, &dir, GEMMA4_TOL);
    // Steps whose token llama-server reports no probability for (a piece of a UTF-8
    // character) or that ours does not rank second after a near-tie are not compared.
    assert!(compared >= 40, "only {compared} of 96 steps compared");
    eprintln!("gemma4: {compared} steps compared, log-probabilities at most {worst:.4} apart");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn gemma4_through_chunks_forks_preemption_and_the_prefix_cache() {
    let dir = scratch("gemma4-paths");
    let (q8, _) = tiny_gemma4(&dir);
    let models = [(with_experts(&q8), "gemma4-moe"), (q8, "gemma4")];
    // 512 bytes a position in the four layers that keep K/V (the two that share them take
    // none), the two sliding ones over 8 positions only: a 1 MiB cache holds about 4,000
    // positions of the global layers for about 36 sequences of up to 256 (the model's context).
    through_chunks_forks_and_preemption(&dir, &models, &|_| r#"{"1": -100}"#, (1, 216), true);
    let _ = std::fs::remove_dir_all(dir);
}

/// Speculative decoding of Gemma 4 at temperature 0: drafts from prompt lookup and from draft
/// models (the f32 weights drafting for the Q8_0 ones, mostly kept; a tiny Qwen3.5 of the same
/// vocabulary drafting for the f32 ones, mostly rolled back out of both layer kinds' tables):
/// the same tokens and log-probabilities as greedy decoding.
#[test]
fn speculative_decoding_on_gemma4_is_greedy() {
    let dir = scratch("gemma4-speculative");
    let (q8, f32_file) = tiny_gemma4(&dir);
    tiny_models("hybrid", &dir);
    let model = |name: &str, path: &Path, draft: &Path| {
        format!("[[model]]\nname = \"{name}\"\npath = \"{}\"\ndraft = \"{}\"\n", path.display(), draft.display())
    };
    let cfg = model("gemma4", &q8, &f32_file) + &model("gemma4-f32", &f32_file, &dir.join("tiny-qwen35.gguf"));
    let d = Daemon::start(&dir, &cfg, &[]);
    let runs = [("gemma4", "model"), ("gemma4-f32", "model"), ("gemma4", "prompt-lookup")];
    let (drafted, accepted) = speculative_is_greedy(&d, &runs);
    assert!(accepted > 0.0 && drafted > accepted, "drafts both kept and rolled back: {accepted} of {drafted}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
