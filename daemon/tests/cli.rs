//! The `inferd` command line, run as a user would: generation, tokenization, clear errors.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

fn inferd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_inferd")).args(args).output().expect("running inferd")
}

fn model() -> String {
    let p = inferd_engine::paths::default_model().expect("the default model is installed (run packaging/fetch-model)");
    p.display().to_string()
}

#[test]
fn run_generates_text_and_chat_answers() {
    let out = inferd(&["run", "--model", &model(), "--max-tokens", "3", "The capital of France is"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), " Paris.\n\n");
    let out = inferd(&[
        "run",
        "--model",
        &model(),
        "--chat",
        "--max-tokens",
        "40",
        "What is the capital of France? Answer in one word.",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "{text}");
    assert!(!text.contains("<|im_end|>"), "generation stops at the end-of-turn token: {text}");
}

#[test]
fn tokenize_prints_json_ids() {
    let out = inferd(&["tokenize", "--model", &model(), "Hello 12 world"]);
    assert!(out.status.success());
    let ids: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids, vec![19556, 216, 33, 34, 905]);
    let out = inferd(&["tokenize", "--model", &model(), "--special", "<|im_start|>user"]);
    let ids: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids, vec![1, 4093]);
}

#[test]
fn bad_model_paths_fail_with_a_message() {
    let out = inferd(&["run", "--model", "/nonexistent/model.gguf", "hi"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
    let junk = inferd_e2e::temp_dir("cli-junk-model").join("junk.gguf");
    std::fs::write(&junk, b"this is not a model").unwrap();
    let out = inferd(&["tokenize", "--model", junk.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a GGUF file"));
}

/// A built-in plugin next to the binary (`cargo build --release` puts them there).
fn plugin(name: &str) -> String {
    let dir = std::path::Path::new(env!("CARGO_BIN_EXE_inferd")).parent().unwrap();
    dir.join(format!("libinferd_{name}.so")).display().to_string()
}

#[test]
fn plugin_check_reports_declarations_and_refusals() {
    let out = inferd(&["plugin", "check", &plugin("nucleus")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["abi"], "1.2", "the SDK builds plugins for the current minor version");
    assert_eq!(v["strategies"][0]["name"], "nucleus");
    assert!(v["strategies"][0]["params"]["top_p"].is_string());
    // (Not directly in /tmp: a directory everyone may write to is refused.)
    let dir = inferd_e2e::temp_dir("cli-junk-plugin");
    let junk = dir.join("libjunk.so");
    std::fs::write(&junk, b"junk").unwrap();
    let out = inferd(&["plugin", "check", junk.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(junk.to_str().unwrap()) && err.contains("cannot load"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn plugin_probe_prints_the_empirical_distribution() {
    let out = inferd(&[
        "plugin",
        "probe",
        "nucleus",
        "--logits",
        "[1.0, 1.0, -30.0]",
        "--params",
        r#"{"top_k": 2}"#,
        "--draws",
        "4000",
        "--seed",
        "9",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d: std::collections::BTreeMap<String, f64> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d.keys().collect::<Vec<_>>(), vec!["0", "1"]);
    assert!((d["0"] - 0.5).abs() < 0.05, "{d:?}");
    // The history feeds the penalties: a large presence penalty on token 0 leaves token 1.
    let out = inferd(&[
        "plugin",
        "probe",
        "nucleus",
        "--logits",
        "[1.0, 1.0, -30.0]",
        "--history",
        "[0]",
        "--params",
        r#"{"presence_penalty": 2, "temperature": 0}"#,
        "--draws",
        "10",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), r#"{"1":1.0}"#);
    let out = inferd(&["plugin", "probe", "nucleus", "--logits", "[1.0]", "--params", r#"{"top_q": 1}"#]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown parameter top_q"));
    let out = inferd(&["plugin", "probe", "nope", "--logits", "[1.0]"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown decoding strategy \"nope\""));
}

#[test]
fn run_uses_any_strategy_and_seeds_repeat() {
    let args = |seed: &'static str| {
        [
            "run",
            "--model",
            "",
            "--decoder",
            "nucleus",
            "--params",
            r#"{"temperature": 1.0, "top_p": 0.95}"#,
            "--seed",
            seed,
            "--max-tokens",
            "12",
            "Once upon a time",
        ]
    };
    let m = model();
    let go = |seed| {
        let mut a = args(seed);
        a[2] = &m;
        let out = inferd(&a);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let a = go("5");
    assert_eq!(a, go("5"));
    assert_ne!(a, go("6"));
    // Speculative decoding with the model as its own draft: greedy output, acceptance on stderr.
    let greedy = inferd(&["run", "--model", &m, "--max-tokens", "16", "Once upon a time"]);
    let spec = inferd(&[
        "run",
        "--model",
        &m,
        "--draft-model",
        &m,
        "--decoder",
        "speculative",
        "--params",
        r#"{"drafter": "model", "temperature": 0}"#,
        "--max-tokens",
        "16",
        "Once upon a time",
    ]);
    assert!(spec.status.success(), "{}", String::from_utf8_lossy(&spec.stderr));
    assert_eq!(spec.stdout, greedy.stdout);
    let err = String::from_utf8_lossy(&spec.stderr);
    assert!(err.contains("accepted_tokens=") && err.contains("draft_tokens="), "{err}");
    let out = inferd(&["run", "--model", &m, "--decoder", "min-p", "--params", r#"{"min_p": 1.5}"#, "hi"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("min_p must be between 0 and 1"));
}

#[test]
fn the_packaged_man_pages_match_the_command_line() {
    let dir = inferd_e2e::temp_dir("man");
    let out = inferd(&["man", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Every page but the two written by hand.
    let packaged = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/man"));
    let names = |d: &std::path::Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !["inferd.toml.5", "inferd-fetch-model.8"].contains(&n.as_str()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&dir), names(packaged), "regenerate with `target/release/inferd man packaging/man`");
    for n in names(&dir) {
        assert_eq!(
            std::fs::read_to_string(dir.join(&n)).unwrap(),
            std::fs::read_to_string(packaged.join(&n)).unwrap(),
            "{n} is stale: regenerate with `target/release/inferd man packaging/man`"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `inferd bench` reports where a batch-1 decode step goes: its phases add up to the step, every
/// product dispatches once per layer, and the products read every weight the step reads.
#[test]
fn bench_reports_where_a_decode_step_goes() {
    let out = inferd(&[
        "bench",
        "--model",
        &model(),
        "--threads",
        "2",
        "--repeat",
        "1",
        "--batches",
        "1",
        "--prefill-tokens",
        "16",
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "9",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let step = &r["decode_batch1_step"];
    assert_eq!(step["passes"], 8, "{step}");
    let phases = step["phases"].as_object().unwrap();
    let sum = |key: &str| phases.values().map(|p| p[key].as_f64().unwrap_or(0.0)).sum::<f64>();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    assert!(close(sum("ms"), step["ms"].as_f64().unwrap()) && close(sum("share"), 1.0), "{step}");
    assert!(close(sum("dispatches"), step["dispatches"].as_f64().unwrap()), "{step}");
    let layers = phases["qkv_projection"]["dispatches"].as_f64().unwrap();
    assert!(layers >= 1.0);
    for p in ["attention_output_projection", "ffn_gate_up", "ffn_down"] {
        assert_eq!(phases[p]["dispatches"].as_f64(), Some(layers), "{p}: {step}");
    }
    assert_eq!(phases["logits"]["dispatches"].as_f64(), Some(1.0));
    assert_eq!(phases["between_dispatches"]["dispatches"].as_f64(), Some(0.0));
    assert!(close(sum("weights_mb"), r["memory"]["weights_read_per_token_mb"].as_f64().unwrap()), "{r}");
    assert!(step["products_share_of_read_bandwidth"].as_f64().unwrap() > 0.0);
}

/// `inferd bench --prefill-depth`: the measured prompt continues a sequence prefilled first,
/// and the profile of the prefill covers the prompt's pass alone (the depth's two passes
/// dropped).
#[test]
fn bench_prefills_after_a_depth_of_context() {
    let out = inferd(&[
        "bench",
        "--model",
        &model(),
        "--threads",
        "2",
        "--repeat",
        "1",
        "--batches",
        "1",
        "--prefill-tokens",
        "16",
        "--prefill-depth",
        "600",
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "2",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["prefill_depth"], 600, "{r}");
    let step = &r["prefill_step"];
    assert_eq!((step["passes"].as_u64(), step["tokens"].as_u64()), (Some(1), Some(16)), "{step}");
    assert!(r["prefill_tok_s"].as_f64().unwrap() > 0.0, "{r}");
}
