//! A hybrid model (Qwen3.5: Gated DeltaNet layers and a gated attention layer) against
//! llama-server on the same file: the tiny random-weight `tiny-qwen35` written by
//! `tests/reference/tiny_models.py hybrid`, its greedy tokens and log-probabilities a token at a
//! time, batched answers equal to each prompt's alone; then through chunked prefill, forks
//! (n = 2, a beam of 3) and preemption in a cache whose recurrent state slots run out before
//! its blocks, and sent again from the prefix cache's checkpoints of their states: every answer
//! the same as alone (a DeltaNet row is computed the same way however its sequence was cut into
//! steps).

use super::moe::{answer_as_llama_cpp, through_chunks_forks_and_preemption};
use super::remote::llama_server;
use super::*;

fn tiny_hybrid(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    tiny_models("hybrid", dir);
    vec![(dir.join("tiny-qwen35.gguf"), "qwen35")]
}

#[test]
fn a_hybrid_model_answers_as_llama_cpp() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("hybrid");
    let models = tiny_hybrid(&dir);
    let cfg = format!("[[model]]\nname = \"qwen35\"\npath = \"{}\"\n", models[0].0.display());
    let d = Daemon::start(&dir, &cfg, &[]);
    let (compared, worst) = answer_as_llama_cpp(&bin, &d, &models, &dir);
    assert!(compared >= 30, "only {compared} of 48 steps compared");
    eprintln!("qwen35: {compared} steps compared, log-probabilities at most {worst:.4} apart");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_hybrid_model_through_chunks_forks_and_preemption() {
    let dir = scratch("hybrid-paths");
    let models = tiny_hybrid(&dir);
    // 4 MiB: a quarter for recurrent states (94 KB a sequence: 10 of them) and room for about
    // 24,000 positions of the attention layer's K/V, so the states run out first; the prompts
    // sent again start from their checkpoints in the prefix cache.
    through_chunks_forks_and_preemption(&dir, &models, &|_| r#"{"1": -100}"#, 4, true);
    let _ = std::fs::remove_dir_all(dir);
}
