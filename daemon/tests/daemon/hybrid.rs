//! The hybrid models (Qwen3.5: Gated DeltaNet layers and a gated attention layer; Qwen3.5 MoE
//! and Qwen3-Next: the same with a mixture of experts and a shared expert) against llama-server
//! on the same files: the tiny random-weight ones written by `tests/reference/tiny_models.py
//! hybrid`, their greedy tokens and log-probabilities a token at a time, batched answers equal to each prompt's alone; then through chunked prefill, forks
//! (n = 2, a beam of 3) and preemption in a cache whose recurrent state slots run out before
//! its blocks, and sent again from the prefix cache's checkpoints of their states: every answer
//! the same as alone (a DeltaNet row is computed the same way however its sequence was cut into
//! steps).

use super::moe::{answer_as_llama_cpp, through_chunks_forks_and_preemption};
use super::remote::llama_server;
use super::*;

/// How close the log-probabilities must be: above the most they differ here (0.196 over 103
/// steps of the three models, Intel Xeon AVX-512; the median 0.016, as the dense models'). The
/// mixtures' strong experts amplify both sides' different rounding of 8-bit activations, more
/// so behind a DeltaNet's per-head output norm; with f32 weights the same models agree with
/// llama.cpp to 0.001 (tests/e2e/reference.rs, `hybrids_in_f32_match_llama_cpp`).
const HYBRID_TOL: f64 = 0.25;

fn tiny_hybrid(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    tiny_models("hybrid", dir);
    ["qwen35", "qwen35moe", "qwen3next"].into_iter().map(|m| (dir.join(format!("tiny-{m}.gguf")), m)).collect()
}

#[test]
fn hybrid_models_answer_as_llama_cpp() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("hybrid");
    let models = tiny_hybrid(&dir);
    let cfg: String = models
        .iter()
        .map(|(path, name)| format!("[[model]]\nname = \"{name}\"\npath = \"{}\"\n", path.display()))
        .collect();
    let d = Daemon::start(&dir, &cfg, &[]);
    let (compared, worst) = answer_as_llama_cpp(&bin, &d, &models, &dir, HYBRID_TOL);
    assert!(compared >= 90, "only {compared} of 144 steps compared");
    eprintln!("hybrids: {compared} steps compared, log-probabilities at most {worst:.4} apart");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn hybrid_models_through_chunks_forks_and_preemption() {
    let dir = scratch("hybrid-paths");
    let models = tiny_hybrid(&dir);
    // 4 MiB: a quarter for recurrent states (94 KB a sequence: 10 of them) and room for about
    // 24,000 positions of the attention layer's K/V, so the states run out first; the prompts
    // sent again start from their checkpoints in the prefix cache.
    through_chunks_forks_and_preemption(&dir, &models, &|_| r#"{"1": -100}"#, 4, true);
    let _ = std::fs::remove_dir_all(dir);
}
