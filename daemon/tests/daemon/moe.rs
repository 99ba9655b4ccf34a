//! Mixtures of experts (Qwen3 MoE, gpt-oss) against llama-server on the same files: tiny
//! random-weight models written by `tests/reference/tiny_models.py moe` (8 experts, 2 a token,
//! their stacks in Q8_0 or MXFP4; gpt-oss with biases on the router, the experts and the
//! attention, attention sinks, sliding-window and full layers, YaRN), prompts of 3 to 40 tokens (so prefill groups many tokens by expert), each
//! continued 8 tokens a token at a time on llama.cpp's choice: the same token and its
//! log-probability wherever llama.cpp's choice is not a near-tie; and the same prompts sent at
//! once (batched, each step's tokens grouped by expert together) answer exactly as they do one
//! at a time.

use super::remote::{free_port, llama_server, spawn_llama_server, tcp_http};
use super::*;

/// How close the log-probabilities must be: twice the most they differ here (0.060 over 113
/// steps of the three models, Intel Xeon AVX-512; both sides' products of 8-bit activations
/// round differently; with the routers in Q8_0 rather than f32 as real files keep them, a
/// router's near-tie flipped a choice of experts once, to 0.156), and below what leaving the
/// chosen weights unnormalized moves them (0.24).
const TOL: f64 = 0.15;

fn tiny_moes(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    tiny_models("moe", dir);
    vec![
        (dir.join("tiny-qwen3moe-q8_0.gguf"), "q8"),
        (dir.join("tiny-qwen3moe-mxfp4.gguf"), "mxfp4"),
        (dir.join("tiny-gpt-oss-mxfp4.gguf"), "gpt-oss"),
    ]
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
    let (compared, worst) = answer_as_llama_cpp(&bin, &d, &models, &dir, TOL);
    assert!(compared >= 90, "only {compared} of 144 steps compared");
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

/// Each of `models` (served by `d` under its name) continued from every prompt a token at a
/// time against llama-server on the same file (both fed llama.cpp's choice): the same token
/// and its log-probability within `tol` wherever llama.cpp's choice is not a near-tie; then
/// the prompts each alone and all at once (batched) give the same answers. Returns the steps
/// compared and the largest difference.
pub(super) fn answer_as_llama_cpp(
    bin: &Path,
    d: &Daemon,
    models: &[(PathBuf, &str)],
    dir: &Path,
    tol: f64,
) -> (usize, f64) {
    let port = free_port();
    let (mut compared, mut worst) = (0, 0f64);
    for (path, name) in models {
        let server = spawn_llama_server(bin, path.to_str().unwrap(), port, dir, &["-np", "1"]);
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
                // An answer that ends at once chose the end of text (its log-probability is
                // not reported).
                let stopped = lp["tokens"].as_array().is_some_and(Vec::is_empty);
                let (token, logprob) = match stopped {
                    true => (&Value::from("</s>"), None),
                    false => (&lp["tokens"][0], Some(lp["token_logprobs"][0].as_f64().expect(&ours))),
                };
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
                        margin < 2.0 * tol || token == text,
                        "{name} {p:?} step {step}: {token} vs llama.cpp's {text} (ahead by {margin})"
                    );
                    let got = if token == text { logprob } else { lp["top_logprobs"][0][text].as_f64() };
                    if let Some(got) = got {
                        assert!(
                            (got - want).abs() <= tol,
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
                .map(|p| s.spawn(move || json(&d.http("POST", "/v1/completions", &body(name, &p, 12)).1)))
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap()["choices"][0]["text"].clone()).collect()
        });
        assert_eq!(together, alone, "{name}: batched answers are each prompt's alone");
    }
    (compared, worst)
}

/// The engine's paths with a mixture of experts: against each request run alone in a roomy
/// cache (whose greedy answers the test above holds to llama.cpp), the same requests all at
/// once in a cache too small for them (preempted and recomputed), with prompts prefilled in
/// chunks of 16 tokens, forks (n = 2, a beam search of width 3) and, sent again, prefixes from
/// the prefix cache: every answer the same.
#[test]
fn mixtures_of_experts_through_chunks_forks_preemption_and_the_prefix_cache() {
    let dir = scratch("moe-paths");
    let models = tiny_moes(&dir);
    // Long answers of many requests at once (the end of text biased away): about 17,000
    // positions for a 1 MiB cache's 2,048 (Qwen3 MoE: 512 bytes a position) or 8,192 (gpt-oss:
    // 128 a layer, and its sliding-window layer's blocks go back as the window passes them).
    // The end tokens biased away: `</s>`, and gpt-oss's `<|return|>` and `<|call|>`.
    let bias =
        |name: &str| if name == "gpt-oss" { r#"{"1": -100, "268": -100, "269": -100}"# } else { r#"{"1": -100}"# };
    through_chunks_forks_and_preemption(&dir, &models, &bias, (1, 900), true);
    let _ = std::fs::remove_dir_all(dir);
}

/// The engine's paths with `models`: against each request run alone in a roomy cache (whose
/// greedy answers [`answer_as_llama_cpp`] holds to llama.cpp), the same requests all at once
/// in a cache of `kv_mib` MiB too small for them (preempted and recomputed), with prompts
/// prefilled in chunks of 16 tokens, forks (n = 2, a beam search of width 3) and, sent again,
/// prefixes from the prefix cache (and one prompt sent twice with the cache quiet, the second
/// from the first's cached prefix where `prefix_hits`): every answer the same. `bias` names
/// each model's end tokens, biased away so that answers run long (`answer` tokens, within the
/// models' context).
pub(super) fn through_chunks_forks_and_preemption(
    dir: &Path,
    models: &[(PathBuf, &str)],
    bias: &dyn Fn(&str) -> &'static str,
    (kv_mib, answer): (usize, usize),
    prefix_hits: bool,
) {
    let model_cfg = |kv: &str| -> String {
        models
            .iter()
            .map(|(path, name)| format!("[[model]]\nname = \"{name}\"\npath = \"{}\"\n{kv}", path.display()))
            .collect()
    };
    let requests = |name: &str| -> Vec<(String, usize)> {
        let bias = bias(name);
        prompts()
        .iter()
        .flat_map(|p| {
            [
                (format!(r#""prompt": {p:?}, "max_tokens": {answer}, "temperature": 0, "logit_bias": {bias}"#), 1),
                (
                    format!(
                        r#""prompt": {p:?}, "max_tokens": {answer}, "temperature": 0, "n": 2, "logit_bias": {bias}"#
                    ),
                    2,
                ),
                (
                    format!(
                        r#""prompt": {p:?}, "max_tokens": 24, "decoder": "beam", "decoder_params": {{"beam_width": 3}}"#
                    ),
                    1,
                ),
            ]
        })
        .collect()
    };
    let texts =
        |v: &Value| -> Vec<Value> { v["choices"].as_array().unwrap().iter().map(|c| c["text"].clone()).collect() };
    let (roomy_dir, tight_dir) = (dir.join("roomy"), dir.join("tight"));
    std::fs::create_dir_all(&roomy_dir).unwrap();
    std::fs::create_dir_all(&tight_dir).unwrap();
    let roomy = Daemon::start(&roomy_dir, &model_cfg(""), &[]);
    let alone: Vec<Vec<Value>> = models
        .iter()
        .flat_map(|(_, name)| {
            let roomy = &roomy;
            requests(name).into_iter().map(move |(r, n)| {
                let (st, body) = roomy.http("POST", "/v1/completions", &format!(r#"{{"model": "{name}", {r}}}"#));
                assert_eq!(st, 200, "{body}");
                let t = texts(&json(&body));
                assert_eq!(t.len(), n, "{body}");
                t
            })
        })
        .collect();
    drop(roomy);
    let cfg = format!(
        "[scheduler]\ntoken_budget = 16\n\n[limits]\nmax_requests_per_user = 64\n\n{}",
        model_cfg(&format!("kv_cache_mib = {kv_mib}\n"))
    );
    let tight = Daemon::start(&tight_dir, &cfg, &[]);
    for round in 0..2 {
        let together: Vec<Vec<Value>> = std::thread::scope(|s| {
            let jobs: Vec<_> = models
                .iter()
                .flat_map(|(_, name)| {
                    requests(name).into_iter().map(move |(r, _)| format!(r#"{{"model": "{name}", {r}}}"#))
                })
                .map(|body| {
                    let tight = &tight;
                    s.spawn(move || {
                        let (st, answer) = tight.http("POST", "/v1/completions", &body);
                        assert_eq!(st, 200, "{answer}");
                        texts(&json(&answer))
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for (i, (got, want)) in together.iter().zip(&alone).enumerate() {
            assert_eq!(got, want, "round {round}, request {i} in the tight cache");
        }
    }
    // One prompt twice more with the cache quiet (under the rounds' load, a hybrid model's
    // state checkpoints may all have been evicted for running sequences): the second answer
    // starts from the first's cached prefix, and is the same.
    let longest = prompts().into_iter().max_by_key(Vec::len).unwrap_or_default();
    for (_, name) in models {
        let once = format!(r#"{{"model": "{name}", "prompt": {longest:?}, "max_tokens": 8, "temperature": 0}}"#);
        let (first, second) =
            (tight.http("POST", "/v1/completions", &once), tight.http("POST", "/v1/completions", &once));
        assert_eq!((first.0, second.0), (200, 200), "{}\n{}", first.1, second.1);
        assert_eq!(texts(&json(&first.1)), texts(&json(&second.1)), "{name}: from the prefix cache");
    }
    let (_, text) = tight.http("GET", "/metrics", "");
    let metric = |name: &str, model: &str| -> f64 {
        let key = format!("{name}{{model=\"{model}\"}}");
        let line = text.lines().find(|l| l.starts_with(&key));
        line.and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    for (_, name) in models {
        assert!(metric("inferd_requests_preempted_total", name) > 0.0, "{name} never preempted:\n{text}");
        let hits = metric("inferd_prompt_tokens_cached_total", name);
        assert!((hits > 0.0) == prefix_hits, "{name}: {hits} prompt tokens from the prefix cache:\n{text}");
    }
    drop(tight);
}

/// gpt-oss's chat format through the APIs: the tiny gpt-oss model has harmony's markers in its
/// vocabulary and a harmony chat template, and the C test plugin's `c-script` strategy makes it
/// answer given harmony text (through OpenAI's chat, which takes a `decoder`; the other APIs
/// read answers through the same reader). The `analysis` channel comes back as reasoning
/// (`reasoning_content`), `final` as the content, a `commentary` message to `functions.NAME` as
/// a tool call; `<|end|>` between messages does not end the answer, and `reasoning_effort`
/// reaches the template's system message.
#[test]
fn gpt_oss_answers_in_harmony_channels() {
    let dir = scratch("harmony");
    let models = tiny_moes(&dir);
    let lib_dir = dir.join("plugins");
    std::fs::create_dir_all(&lib_dir).unwrap();
    inferd_e2e::compile_c_plugin(&lib_dir, "cscript", &["SCRIPT"]);
    let cfg =
        format!("plugin_dirs = [{lib_dir:?}]\n\n[[model]]\nname = \"gpt-oss\"\npath = \"{}\"\n", models[2].0.display());
    let d = Daemon::start(&dir, &cfg, &[]);
    let ids = |text: &str| -> Value {
        let (st, t) =
            d.http("POST", "/tokenize", &serde_json::json!({"model": "gpt-oss", "content": text}).to_string());
        assert_eq!(st, 200, "{t}");
        json(&t)["tokens"].clone()
    };
    let answer = "<|channel|>analysis<|message|>The user greets.<|end|>\
                  <|start|>assistant<|channel|>final<|message|>Hello there!<|return|>";
    let user = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let chat = |script: &str, extra: Value| -> Value {
        let mut body = serde_json::json!({
            "model": "gpt-oss", "messages": user, "max_tokens": 200,
            "decoder": "c-script", "decoder_params": {"tokens": ids(script)},
        });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, a) = d.http("POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(st, 200, "{a}");
        json(&a)
    };
    let a = chat(answer, serde_json::json!({}));
    let m = &a["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("The user greets."), Some("Hello there!")),
        "{a}"
    );
    assert_eq!(a["choices"][0]["finish_reason"], "stop", "{a}");
    // A call, streamed: the analysis as reasoning deltas, the call as tool_calls.
    let call = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary \
                to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Paris\"}<|call|>";
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let body = serde_json::json!({
        "model": "gpt-oss", "messages": user, "max_tokens": 200, "stream": true, "tools": tools,
        "decoder": "c-script", "decoder_params": {"tokens": ids(call)},
    });
    let (st, sse) = d.http("POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(st, 200, "{sse}");
    let (mut reasoning, mut content, mut calls, mut finish) = (String::new(), String::new(), Vec::new(), None);
    for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|l| *l != "[DONE]") {
        let c = &json(line)["choices"][0];
        reasoning.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        calls.extend(c["delta"]["tool_calls"].as_array().into_iter().flatten().cloned());
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    assert_eq!((reasoning.as_str(), content.trim()), ("Need the weather.", ""), "{sse}");
    assert_eq!(calls.len(), 1, "{sse}");
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{sse}");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, serde_json::json!({"location": "Paris"}));
    assert_eq!(finish.as_deref(), Some("tool_calls"), "{sse}");
    // The effort is the system message's: "low" and "high" are one byte-level token apart,
    // the default ("medium") three after "low".
    let prompt = |effort: Option<&str>| -> u64 {
        let extra = effort.map_or(serde_json::json!({}), |e| serde_json::json!({"reasoning_effort": e}));
        chat(answer, extra)["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let low = prompt(Some("low"));
    assert_eq!((prompt(Some("high")), prompt(None)), (low + 1, low + 3));
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
