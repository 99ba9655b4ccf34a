//! `inferd bench --editor`: an editor's completion loop on a code file, as an editor plugin
//! written for llama-server's `/infill` sends it (llama.vim, llama.vscode): the lines above
//! the cursor as `input_prefix`, the current line up to the cursor as `prompt`, the rest of
//! the file as `input_suffix`, a request every few keystrokes, each completion at most
//! [`COMPLETION_TOKENS`] tokens. The user retypes two lines of the file in the middle of it,
//! a request every [`KEYSTROKES`] characters; the prompt each request makes is
//! [`fim::infill`]'s, what the daemon's `/infill` runs. Measured per request: time to the
//! first token and to the whole completion, and how many prompt tokens the prefix cache
//! already held; greedy, and the speculative plugin with prompt lookup and with the draft
//! model (`--draft-model`, its output projection cheapened as the daemon's). The same
//! requests also run with the typed text after the middle token (`PRE prefix SUF suffix MID
//! typed`: the layout llama-server's own comment describes; it keeps everything before the
//! typed text unchanged while the cursor stays on a line).

use crate::bench::median;
use crate::serve::fim::{self, Infill};
use inferd_engine::decode::generate_with_stats;
use inferd_engine::decode::store::EngineStore;
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::{Registry, SessionRequest};
use serde_json::{json, Value};
use std::time::Instant;

/// Tokens a completion may run to (it ends earlier at an end-of-text token).
pub const COMPLETION_TOKENS: u32 = 40;

/// Characters typed between two requests.
pub const KEYSTROKES: usize = 6;

/// The file edited: a real source file of about 2,000 tokens (this project's KV block pool).
const FILE: &str = include_str!("../engine/src/kv/block_pool.rs");

/// One request of the loop: what the editor sends.
struct Edit {
    prefix: String,
    typed: String,
    suffix: String,
    /// Whether the cursor moved to another line since the last request.
    new_line: bool,
}

/// The editor's requests while the user retypes lines `at` and `at + 1` of `file`.
fn edits(file: &str, at: usize) -> Vec<Edit> {
    let lines: Vec<&str> = file.split_inclusive('\n').collect();
    let mut out = Vec::new();
    for l in at..at + 2 {
        let line = lines[l].trim_end_matches('\n');
        let prefix: String = lines[..l].concat();
        let suffix: String = std::iter::once("\n").chain(lines[l + 1..].iter().copied()).collect();
        let cuts: Vec<usize> = (1..=line.len()).filter(|&c| line.is_char_boundary(c) && c % KEYSTROKES == 0).collect();
        for (i, &c) in cuts.iter().enumerate() {
            out.push(Edit {
                prefix: prefix.clone(),
                typed: line[..c].to_owned(),
                suffix: suffix.clone(),
                new_line: i == 0,
            });
        }
    }
    out
}

/// The first line at or after the middle of `file` long enough to type a few requests into.
fn middle_line(file: &str) -> usize {
    let lines: Vec<&str> = file.lines().collect();
    (lines.len() / 2..lines.len() - 2).find(|&l| lines[l].trim().len() >= 30).unwrap_or(lines.len() / 2)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

pub fn run(model: &Model, draft: Option<&Model>, reg: &Registry, threads: usize) -> anyhow::Result<Value> {
    let tok = &model.tokenizer;
    let fim_tokens =
        tok.fim().fim().map_err(|why| anyhow::anyhow!("{} cannot fill in the middle: {why}", model.name))?;
    let opts = EngineOptions { threads, ..EngineOptions::default() };
    let cheaper = draft.map(|d| crate::bench_speculative::daemon_draft(d, threads)).transpose()?;
    let eos = tok.eos().to_vec();
    let at = middle_line(FILE);
    let edits = edits(FILE, at);
    let file_tokens = tok.encode_bare(FILE, false)?.len();
    let mut strategies = vec![
        ("greedy", reg.get("greedy")?, "{}".to_string()),
        ("speculative, prompt lookup", reg.get("speculative")?, r#"{"temperature": 0}"#.to_string()),
    ];
    if draft.is_some() {
        strategies.push((
            "speculative, draft model",
            reg.get("speculative")?,
            r#"{"temperature": 0, "drafter": "model", "k": 3}"#.to_string(),
        ));
    }
    let mut results = Vec::new();
    for layout in [fim::Layout::LlamaServer, fim::Layout::TypedAfterMiddle] {
        for (name, strategy, params) in &strategies {
            // Each configuration starts from a cold cache; the draft on the target's threads.
            let mut target = Engine::cpu(model, &opts)?;
            let draft_opts = EngineOptions { pool: target.backend.cpu_pool(), ..opts.clone() };
            let mut draft_engine = cheaper.as_ref().map(|d| Engine::cpu(d, &draft_opts)).transpose()?;
            let mut seen: Vec<Vec<u32>> = Vec::new();
            let mut rows = Vec::new();
            let (mut drafted, mut accepted) = (0.0, 0.0);
            for e in &edits {
                let enc = |s: &str| tok.encode_bare(s, false);
                let i = Infill {
                    prefix: enc(&e.prefix)?,
                    suffix: enc(&e.suffix)?,
                    extra: Vec::new(),
                    prompt: enc(&e.typed)?,
                };
                let ids =
                    fim::infill(tok, fim_tokens, &i, layout, model.config.context_len, COMPLETION_TOKENS as usize)
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                // The longest prefix shared with an earlier request (the cache holds whole blocks of it).
                let shared = seen.iter().map(|s| common_prefix(s, &ids)).max().unwrap_or(0);
                let mut store = match draft_engine.as_mut() {
                    Some(d) if name.ends_with("draft model") => EngineStore::with_draft(&mut target, d),
                    _ => EngineStore::new(&mut target),
                };
                let req = SessionRequest {
                    logprobs: None,
                    prompt: &ids,
                    generated: &[],
                    params,
                    max_tokens: COMPLETION_TOKENS,
                    n: 1,
                    seed: 0,
                    eos: &eos,
                    vocabulary: None,
                    grammar: None,
                };
                let t = Instant::now();
                let mut first = None;
                let out = generate_with_stats(strategy, &mut store, &req, &mut |_, _| {
                    first.get_or_insert_with(|| t.elapsed().as_secs_f64());
                })?;
                let total = t.elapsed().as_secs_f64();
                let stat = |k: &str| out.stats.get(k).copied().unwrap_or(0.0);
                (drafted, accepted) = (drafted + stat("draft_tokens"), accepted + stat("accepted_tokens"));
                let n = out.choices[0].tokens.len();
                rows.push((e.new_line, ids.len(), shared, first.unwrap_or(total), total, n));
                seen.push(ids);
            }
            // The first request found nothing of this file cached (cold); the rest, typing.
            let summary = |pick: &dyn Fn(bool) -> bool| {
                let r: Vec<_> = rows.iter().skip(1).filter(|r| pick(r.0)).collect();
                if r.is_empty() {
                    return Value::Null;
                }
                json!({
                    "requests": r.len(),
                    "prompt_tokens_median": median(r.iter().map(|r| r.1 as f64).collect()),
                    "shared_prefix_tokens_median": median(r.iter().map(|r| r.2 as f64).collect()),
                    "ttft_ms_median": 1e3 * median(r.iter().map(|r| r.3).collect()),
                    "ttft_ms_max": 1e3 * r.iter().map(|r| r.3).fold(0.0, f64::max),
                    "total_ms_median": 1e3 * median(r.iter().map(|r| r.4).collect()),
                    "total_ms_max": 1e3 * r.iter().map(|r| r.4).fold(0.0, f64::max),
                    "tokens_median": median(r.iter().map(|r| r.5 as f64).collect()),
                })
            };
            results.push(json!({
                "layout": layout.name(),
                "strategy": name,
                "cold": { "prompt_tokens": rows[0].1, "ttft_ms": 1e3 * rows[0].3, "total_ms": 1e3 * rows[0].4 },
                "same_line": summary(&|new_line| !new_line),
                "next_line": summary(&|new_line| new_line),
                "acceptance_rate": if drafted > 0.0 { accepted / drafted } else { 0.0 },
            }));
        }
    }
    Ok(json!({
        "file_tokens": file_tokens,
        "typed_lines": [at + 1, at + 2],
        "requests": edits.len(),
        "completion_tokens": COMPLETION_TOKENS,
        "results": results,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_request_is_the_file_with_the_rest_of_the_typed_line_missing() {
        let at = middle_line(FILE);
        let lines: Vec<&str> = FILE.split_inclusive('\n').collect();
        let edits = edits(FILE, at);
        assert!(edits.len() >= 8, "{} requests", edits.len());
        assert!(edits[0].new_line && !edits[1].new_line);
        for e in &edits {
            let l = e.prefix.matches('\n').count();
            assert!(l == at || l == at + 1);
            assert!(lines[l].starts_with(&e.typed) && e.typed.len() % KEYSTROKES == 0);
            let rest = &lines[l][e.typed.len()..];
            assert_eq!(format!("{}{}{}{}", e.prefix, e.typed, rest.trim_end_matches('\n'), e.suffix), FILE);
        }
    }
}
