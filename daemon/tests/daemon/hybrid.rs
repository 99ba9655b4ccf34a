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

/// A daemon configuration serving each model under its name.
fn config(models: &[(PathBuf, &str)]) -> String {
    models.iter().map(|(path, name)| format!("[[model]]\nname = \"{name}\"\npath = \"{}\"\n", path.display())).collect()
}

#[test]
fn hybrid_models_answer_as_llama_cpp() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("hybrid");
    let models = tiny_hybrid(&dir);
    let cfg = config(&models);
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
    // 4 MiB: half for recurrent states (232 KB a sequence: 9 of them) and room for about
    // 16,000 positions of the attention layer's K/V, so the states run out first; the prompts
    // sent again start from their checkpoints in the prefix cache.
    through_chunks_forks_and_preemption(&dir, &models, &|_| r#"{"1": -100}"#, (4, 900), true);
    let _ = std::fs::remove_dir_all(dir);
}

/// Chat requests to a hybrid model with one system prompt and different questions (token
/// arrays; `</s>`, the tiny vocabulary's end of text, ends each turn): the first keeps its
/// recurrent state at the system prompt's end, so the others start there (the prefix cache
/// serves the system prompt's blocks and its state), and answer as a daemon that never saw it.
#[test]
fn a_shared_system_prompt_of_a_hybrid_model_comes_from_the_prefix_cache() {
    let dir = scratch("hybrid-system");
    let models = tiny_hybrid(&dir);
    let cfg = format!("[[model]]\nname = \"qwen35\"\npath = \"{}\"\n", models[0].0.display());
    let system: Vec<u32> = (0..100).map(|i| 3 + (i * 7) % 250).chain([1]).collect();
    // Questions of 24 tokens: the prompt's last block boundary is past the system prompt's.
    let chat = |q: u32| -> Vec<u32> { [system.clone(), (q..q + 24).collect(), vec![1, 40, 41]].concat() };
    let ask = |d: &Daemon, q: u32| {
        let body = format!(r#"{{"model": "qwen35", "prompt": {:?}, "max_tokens": 6, "temperature": 0}}"#, chat(q));
        let (st, answer) = d.http("POST", "/v1/completions", &body);
        assert_eq!(st, 200, "{answer}");
        json(&answer)["choices"][0]["text"].clone()
    };
    let cached = |d: &Daemon| -> f64 {
        let (_, text) = d.http("GET", "/metrics", "");
        let line = text.lines().find(|l| l.starts_with("inferd_prompt_tokens_cached_total{model=\"qwen35\"}"));
        line.and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    let (warm_dir, cold_dir) = (dir.join("warm"), dir.join("cold"));
    std::fs::create_dir_all(&warm_dir).unwrap();
    std::fs::create_dir_all(&cold_dir).unwrap();
    let warm = Daemon::start(&warm_dir, &cfg, &[]);
    let mut answers = Vec::new();
    for (i, q) in [10, 50, 90].into_iter().enumerate() {
        answers.push(ask(&warm, q));
        // The system prompt's 101 tokens: its blocks of 16 up to 96 and the state there.
        assert_eq!(cached(&warm), (96 * i) as f64, "request {i}");
    }
    drop(warm);
    for (q, want) in [50, 90].into_iter().zip(&answers[1..]) {
        let cold = Daemon::start(&cold_dir, &cfg, &[]);
        assert_eq!(&ask(&cold, q), want, "question {q}: cached as cold");
        drop(cold);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Speculative decoding on the hybrids at temperature 0: drafts from prompt lookup and from a
/// draft model that is itself a hybrid (Qwen3.5 MoE drafting for Qwen3.5), the rejected ones
/// rolled back out of the recurrent states of both, across the recurrence's chunks of 64
/// positions: the same tokens as greedy decoding.
#[test]
fn speculative_decoding_on_hybrid_models_is_greedy() {
    let dir = scratch("hybrid-speculative");
    let models = tiny_hybrid(&dir);
    let mut cfg = config(&models);
    cfg = cfg.replacen("\n[[model]]", &format!("\ndraft = \"{}\"\n[[model]]", models[1].0.display()), 1);
    let d = Daemon::start(&dir, &cfg, &[]);
    let mut runs = vec![(models[0].1, "model"), (models[0].1, "prompt-lookup")];
    runs.extend(models[1..].iter().map(|(_, name)| (*name, "prompt-lookup")));
    let (drafted, accepted) = speculative_is_greedy(&d, &runs);
    assert!(accepted > 0.0 && drafted > accepted, "drafts both kept and rolled back: {accepted} of {drafted}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// Each `(model, drafter)` of `runs` on `d`: a prompt, its greedy answer and the prompt again
/// (prompt lookup drafts the answer, which the model now partly repeats: drafts kept and drafts
/// rolled back), decoded greedily and speculatively at temperature 0: the same tokens and
/// log-probabilities. Returns the drafts made and those accepted.
pub(super) fn speculative_is_greedy(d: &Daemon, runs: &[(&str, &str)]) -> (f64, f64) {
    let complete = |model: &str, prompt: &[u32], decoder: &str| {
        let body = format!(
            r#"{{"model": "{model}", "prompt": {prompt:?}, "max_tokens": 40, "temperature": 0, "logprobs": 1{decoder}}}"#
        );
        let (st, b) = d.http("POST", "/v1/completions", &body);
        assert_eq!(st, 200, "{model} {decoder}: {b}");
        json(&b)
    };
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_owned();
    let tokens = |model: &str, text: &str| -> Vec<u32> {
        let (st, b) = d.http("POST", "/tokenize", &serde_json::json!({"model": model, "content": text}).to_string());
        assert_eq!(st, 200, "{b}");
        json(&b)["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let (mut drafted, mut accepted) = (0.0, 0.0);
    for &(model, drafter) in runs {
        let first: Vec<u32> = (0..30).map(|i| 3 + (i * 13) % 240).collect();
        let answer = tokens(model, &text(&complete(model, &first, "")));
        let prompt = [first.clone(), answer, first].concat();
        let greedy = complete(model, &prompt, "");
        let spec = complete(
            model,
            &prompt,
            &format!(r#", "decoder": "speculative", "decoder_params": {{"drafter": "{drafter}"}}"#),
        );
        assert_eq!(text(&spec), text(&greedy), "{model}, {drafter} drafts");
        assert_eq!(spec["choices"][0]["logprobs"], greedy["choices"][0]["logprobs"], "{model}, {drafter} drafts");
        let stats = &spec["inferd"]["stats"];
        eprintln!("{model}, {drafter}: {stats}");
        drafted += stats["draft_tokens"].as_f64().unwrap_or(0.0);
        accepted += stats["accepted_tokens"].as_f64().unwrap_or(0.0);
    }
    (drafted, accepted)
}
