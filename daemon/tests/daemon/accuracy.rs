//! Accuracy against full precision, measured as llama.cpp measures it: `inferd bench
//! --kl-divergence` on the reference log-probabilities `llama-perplexity` writes from an F32
//! copy of the default model's weights, against llama.cpp's own figures on the same tokens.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// llama.cpp's tools beside the llama-server tests/build-llama-server builds.
fn llama_tool(name: &str) -> Option<PathBuf> {
    let p = super::remote::llama_server()?.with_file_name(name);
    p.exists().then_some(p)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?}: {text}");
    text
}

/// The number after `label` on its line of llama-perplexity's report.
fn figure(report: &str, label: &str) -> f64 {
    let line = report.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label:?} in {report}"));
    line[label.len()..].trim_start_matches([' ', ':']).split_whitespace().next().unwrap().parse().unwrap()
}

fn inferd_kl(model: &str, base: &Path, versus: Option<&Path>) -> Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inferd"));
    cmd.args(["bench", "--threads", "2", "--model", model, "--kl-divergence"]).arg(base);
    if let Some(v) = versus {
        cmd.arg("--versus").arg(v);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "inferd bench --kl-divergence: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The default model (Q4_1) and its F32 copy by llama-quantize; the text is this repository's
/// ARCHITECTURE.md in chunks of 256 tokens. What this holds: inferd reads llama.cpp's file and
/// computes its statistics the way llama-perplexity does (llama.cpp's own log-probabilities
/// give back the figures of its report), inferd's quantized run is as close to full precision
/// as llama.cpp's, and inferd's full-precision run is far closer to llama.cpp's than any
/// quantization is. A wrong forward (a RoPE layout, a BOS, an attention mask) or a misread
/// file moves these by orders of magnitude.
#[test]
fn kl_divergence_from_full_precision_as_llama_cpp_measures_it() {
    let (Some(quantize), Some(perplexity)) = (llama_tool("llama-quantize"), llama_tool("llama-perplexity")) else {
        eprintln!("skipped: no llama-quantize or llama-perplexity (tests/build-llama-server builds them)");
        return;
    };
    let dir = super::scratch("accuracy");
    let model = super::model();
    let f32 = dir.join("f32.gguf");
    run(Command::new(&quantize).arg("--allow-requantize").arg(&model).arg(&f32).arg("F32"));
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/../ARCHITECTURE.md");
    let ppl = |m: &Path| {
        let mut c = Command::new(&perplexity);
        c.args(["-t", "2", "-c", "256", "--chunks", "6", "-m"]).arg(m);
        c
    };
    let (base, theirs) = (dir.join("base.kld"), dir.join("llama.kld"));
    run(ppl(&f32).args(["-f", text, "--kl-divergence-base"]).arg(&base));
    run(ppl(Path::new(&model)).args(["-f", text, "--kl-divergence-base"]).arg(&theirs));
    let report = run(ppl(Path::new(&model)).arg("--kl-divergence-base").arg(&base).arg("--kl-divergence"));
    let (l_ppl, l_kld, l_p99, l_top) = (
        figure(&report, "Mean PPL(Q)"),
        figure(&report, "Mean    KLD"),
        figure(&report, "99.0%   KLD"),
        figure(&report, "Same top p"),
    );

    let q = inferd_kl(&model, &base, Some(&theirs));
    let (mine, other) = (&q["summary"], &q["versus"]["summary"]);
    eprintln!("llama.cpp: mean KLD {l_kld}, 99% {l_p99}, same top {l_top}%\ninferd: {mine}\nllama.cpp's file: {other}");
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("no {k} in {v}"));
    assert_eq!(q["chunks"], 6);
    assert_eq!(mine["tokens"], 6 * 127, "{q}");
    // llama.cpp's log-probabilities, scored here, give back its report (its file keeps them to
    // 2.4e-4 nats; the report prints six decimals).
    assert!((f(other, "ppl") / l_ppl - 1.0).abs() < 1e-3, "PPL {} against llama.cpp's {l_ppl}", f(other, "ppl"));
    assert!((f(other, "kld_mean") - l_kld).abs() < 0.02 * l_kld + 2e-6, "KLD {} against {l_kld}", other["kld_mean"]);
    assert!((f(other, "kld_p99") - l_p99).abs() < 0.02 * l_p99 + 2e-6, "99% {} against {l_p99}", other["kld_p99"]);
    assert!(
        (f(other, "same_top_percent") - l_top).abs() < 0.01,
        "same top {} against {l_top}",
        other["same_top_percent"]
    );
    // inferd's quantized run against full precision: as close as llama.cpp's (the benchmark
    // on real text over 20k tokens says which is closer; here, the same order).
    let (kld, top) = (f(mine, "kld_mean"), f(mine, "same_top_percent"));
    assert!(kld > 0.0 && kld < 1.5 * l_kld, "inferd's mean KLD {kld}, llama.cpp's {l_kld}");
    assert!(top > l_top - 3.0, "inferd's top token agrees {top}%, llama.cpp's {l_top}%");
    assert!(f(mine, "kld_p99") < 2.0 * l_p99, "{mine}");
    // The two programs' full-precision runs: far closer than quantization moves either.
    let full = inferd_kl(&f32.display().to_string(), &base, None);
    let full_kld = f(&full["summary"], "kld_mean");
    eprintln!("inferd's F32 run: {}", full["summary"]);
    assert!(full_kld < 0.05 * l_kld, "inferd's F32 run is {full_kld} from llama.cpp's; Q4_1 is {l_kld}");
    assert!(f(&full["summary"], "same_top_percent") > 99.0, "{full}");
}
