//! The `inferd` command line, run as a user would: generation, tokenization, clear errors.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

fn inferd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_inferd")).args(args).output().expect("running inferd")
}

fn model() -> String {
    let p = inferd::paths::default_model().expect("the default model is installed (run packaging/fetch-model)");
    p.display().to_string()
}

#[test]
fn run_generates_text_and_chat_answers() {
    let out = inferd(&["run", "--model", &model(), "--max-tokens", "3", "The capital of France is"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), " Paris.\n\n");
    let out = inferd(&["run", "--model", &model(), "--chat", "--max-tokens", "40", "What is the capital of France? Answer in one word."]);
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
    let junk = std::env::temp_dir().join(format!("inferd-cli-junk-{}.gguf", std::process::id()));
    std::fs::write(&junk, b"this is not a model").unwrap();
    let out = inferd(&["tokenize", "--model", junk.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a GGUF file"));
}
