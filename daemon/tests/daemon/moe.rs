//! Mixtures of experts (Qwen3 MoE) against llama-server on the same files: tiny random-weight
//! models written by `tests/reference/tiny_models.py moe` (8 experts, 2 a token, their stacks in
//! Q8_0 or MXFP4), prompts of 3 to 40 tokens (so prefill groups many tokens by expert), each
//! continued 8 tokens a token at a time on llama.cpp's choice: the same token and its
//! log-probability wherever llama.cpp's choice is not a near-tie; and the same prompts sent at
//! once (batched, each step's tokens grouped by expert together) answer exactly as they do one
//! at a time.

use super::remote::{free_port, llama_server, spawn_llama_server, tcp_http};
use super::*;

/// How close the log-probabilities must be: twice the most they differ here (0.076, Intel Xeon
/// AVX-512; both sides' products of 8-bit activations round differently), and below what
/// leaving the chosen weights unnormalized moves them (0.24).
const TOL: f64 = 0.15;

fn tiny_moes(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    tiny_models("moe", dir);
    vec![(dir.join("tiny-qwen3moe-q8_0.gguf"), "q8"), (dir.join("tiny-qwen3moe-mxfp4.gguf"), "mxfp4")]
}

/// Token-id prompts (BOS first) of 3 to 40 tokens.
fn prompts() -> Vec<Vec<u32>> {
    (0..6)
        .map(|p: u32| {
            let len = [3, 7, 12, 20, 31, 40][p as usize];
            std::iter::once(0).chain((1..len).map(|i| 3 + (i * 37 + p * 101) % 261)).collect()
        })
        .collect()
}

fn body(model: &str, prompt: &[u32], tokens: usize) -> String {
    format!(r#"{{"model": "{model}", "prompt": {prompt:?}, "max_tokens": {tokens}, "temperature": 0, "logprobs": 2}}"#)
}

#[test]
fn mixtures_of_experts_answer_as_llama_cpp() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("moe");
    let models = tiny_moes(&dir);
    let cfg: String = models
        .iter()
        .map(|(path, name)| format!("[[model]]\nname = \"{name}\"\npath = \"{}\"\n", path.display()))
        .collect();
    let d = Daemon::start(&dir, &cfg, &[]);
    let port = free_port();
    let (mut compared, mut worst) = (0, 0f64);
    for (path, name) in &models {
        let server = spawn_llama_server(&bin, path.to_str().unwrap(), port, &dir, &["-np", "1"]);
        for prompt in prompts() {
            // A token at a time, both fed llama.cpp's choice (its ids are in its answer), so
            // a near-tie cannot send the two down different paths.
            let mut p = prompt.clone();
            for step in 0..8 {
                // llama-server's own endpoint gives the chosen id; it leaves out the
                // probabilities of a token that ends inside a UTF-8 character.
                let native = format!(
                    r#"{{"prompt": {p:?}, "n_predict": 1, "temperature": 0, "n_probs": 2, "return_tokens": true}}"#
                );
                let (st, theirs) = tcp_http(port, "POST", "/completion", &native);
                assert_eq!(st, 200, "{theirs}");
                let theirs = json(&theirs);
                let id = u32::try_from(theirs["tokens"][0].as_u64().unwrap()).unwrap();
                let (st, ours) = d.http("POST", "/v1/completions", &body(name, &p, 1));
                assert_eq!(st, 200, "{ours}");
                let lp = json(&ours)["choices"][0]["logprobs"].clone();
                let (token, logprob) = (&lp["tokens"][0], lp["token_logprobs"][0].as_f64().unwrap());
                if let Some(probs) = theirs["completion_probabilities"].get(0) {
                    let want = probs["logprob"].as_f64().unwrap();
                    let top = probs["top_logprobs"].as_array().unwrap();
                    let margin = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
                    // Past a near-tie of llama.cpp's, either choice is right; its token's
                    // log-probability is compared all the same where it is among ours.
                    // llama-server writes a special token as nothing; these are the tiny
                    // vocabulary's three (tiny_models.py).
                    let text = match (probs["token"].as_str().unwrap(), probs["id"].as_u64().unwrap()) {
                        ("", special @ 0..=2) => ["<s>", "</s>", "<unk>"][special as usize],
                        (text, _) => text,
                    };
                    assert!(
                        margin < 2.0 * TOL || token == text,
                        "{name} {p:?} step {step}: {token} vs llama.cpp's {text} (ahead by {margin})"
                    );
                    let got = if token == text { Some(logprob) } else { lp["top_logprobs"][0][text].as_f64() };
                    if let Some(got) = got {
                        assert!(
                            (got - want).abs() <= TOL,
                            "{name} {p:?} step {step}: {text} at {got} vs llama.cpp's {want}"
                        );
                        compared += 1;
                        worst = worst.max((got - want).abs());
                    }
                }
                p.push(id);
            }
        }
        // Each prompt alone, then all at once: batched, grouped by expert together, the same
        // answers.
        let alone: Vec<Value> = prompts()
            .iter()
            .map(|p| json(&d.http("POST", "/v1/completions", &body(name, p, 12)).1)["choices"][0]["text"].clone())
            .collect();
        drop(server);
        // The same prompts at once: batched, grouped by expert together, the same answers.
        let together: Vec<Value> = std::thread::scope(|s| {
            let jobs: Vec<_> = prompts()
                .into_iter()
                .map(|p| {
                    let d = &d;
                    s.spawn(move || json(&d.http("POST", "/v1/completions", &body(name, &p, 12)).1))
                })
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap()["choices"][0]["text"].clone()).collect()
        });
        assert_eq!(together, alone, "{name}: batched answers are each prompt's alone");
    }
    assert!(compared >= 60, "only {compared} of 96 steps compared");
    // Ollama's /api/show says what the mixture is; the listing counts every expert's bytes.
    let (st, show) = d.http("POST", "/api/show", r#"{"model": "q8"}"#);
    assert_eq!(st, 200, "{show}");
    let info = &json(&show)["model_info"];
    assert!(
        info["qwen3moe.expert_count"] == 8
            && info["qwen3moe.expert_used_count"] == 2
            && info["qwen3moe.expert_feed_forward_length"] == 32,
        "{info}"
    );
    let (_, tags) = d.http("GET", "/api/tags", "");
    let size =
        json(&tags)["models"].as_array().unwrap().iter().find(|m| m["name"] == "q8:latest").unwrap()["size"].clone();
    assert_eq!(size, std::fs::metadata(&models[0].0).unwrap().len(), "{tags}");
    eprintln!("moe: {compared} steps compared, log-probabilities at most {worst:.4} apart");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
