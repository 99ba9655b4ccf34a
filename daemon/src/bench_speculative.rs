//! `inferd bench --speculative`: speculative decoding of a code model on code completion, the
//! work an editor asks of it. Over a set of code prompts (plain prefixes a completion continues
//! and fill-in-the-middle gaps, when the vocabulary has the FIM tokens), greedy decoding against
//! the speculative plugin at temperature 0 with prompt lookup and, with `--draft-model` (same
//! vocabulary), the draft model at several draft lengths `k` and `p_min`, as the file has it and
//! with its output projection in Q4_0 as the daemon loads a draft
//! ([`Model::cheapen_output_for_drafting`]). Reported per configuration: tokens a second over
//! all prompts, the speed-up over greedy (time against time, repetitions interleaved, medians),
//! the acceptance rate, and whether every output equals greedy's.

use crate::bench::median;
use inferd_engine::decode::store::EngineStore;
use inferd_engine::decode::{generate, generate_with_stats};
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::{Registry, SessionRequest};
use serde_json::{json, Value};
use std::time::Instant;

/// Tokens generated per prompt at most (a completion ends earlier at an end-of-text token).
const MAX_TOKENS: u32 = 128;

/// The draft model's settings measured: draft length `k`, `p_min` (0: off), and whether its
/// output projection is the cheaper copy.
const DRAFT_SETTINGS: [(usize, f64, bool); 4] = [(3, 0.0, false), (3, 0.0, true), (8, 0.75, false), (8, 0.75, true)];

/// Code before the cursor, continued by a plain completion.
const PREFIXES: [&str; 4] = [
    r#"import csv
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    quantity: int
    price: float

    def total(self) -> float:
        return self.quantity * self.price


def load_items(path: str) -> list[Item]:
    """Reads the inventory file: one item a row, columns name, quantity, price."""
    items = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
"#,
    r#"use std::collections::HashMap;

/// A word-frequency table over whitespace-separated words, case-folded.
pub struct WordCounts {
    counts: HashMap<String, usize>,
    total: usize,
}

impl WordCounts {
    pub fn new() -> Self {
        WordCounts { counts: HashMap::new(), total: 0 }
    }

    /// Counts every word of `text`.
    pub fn add(&mut self, text: &str) {
        for word in text.split_whitespace() {
"#,
    r#"// A small in-memory store of users with lookup by id and by email.
class UserStore {
  constructor() {
    this.byId = new Map();
    this.byEmail = new Map();
    this.nextId = 1;
  }

  add(name, email) {
    if (this.byEmail.has(email)) {
      throw new Error(`email already registered: ${email}`);
    }
    const user = { id: this.nextId++, name, email };
    this.byId.set(user.id, user);
    this.byEmail.set(email, user);
    return user;
  }

  remove(id) {
"#,
    r#"#include <stdlib.h>

struct node {
    int value;
    struct node *next;
};

/* Pushes value at the head of the list; returns the new head, or NULL when out of memory. */
struct node *push(struct node *head, int value) {
    struct node *n = malloc(sizeof *n);
    if (n == NULL) {
        return NULL;
    }
    n->value = value;
    n->next = head;
    return n;
}

/* Reverses the list in place and returns its new head. */
struct node *reverse(struct node *head) {
"#,
];

/// Code before and after the cursor as (prefix, suffix): a gap the model fills.
const FIM_GAPS: [(&str, &str); 2] = [
    (
        r#"def binary_search(values: list[int], target: int) -> int:
    """Index of target in the sorted list values, or -1 when it is absent."""
    lo, hi = 0, len(values) - 1
    while lo <= hi:
"#,
        r#"    return -1


def test_binary_search():
    assert binary_search([1, 3, 5, 7], 5) == 2
    assert binary_search([1, 3, 5, 7], 4) == -1
"#,
    ),
    (
        r#"/// The mean and the population standard deviation of `xs`, or `None` when it is empty.
pub fn mean_std(xs: &[f64]) -> Option<(f64, f64)> {
    if xs.is_empty() {
        return None;
    }
"#,
        r#"    Some((mean, var.sqrt()))
}
"#,
    ),
];

/// The prompts as token ids: the plain prefixes (with the model's BOS when it adds one), then
/// the gaps in FIM form when the vocabulary has the tokens.
fn prompts(model: &Model) -> anyhow::Result<Vec<Vec<u32>>> {
    let tok = &model.tokenizer;
    let mut out = Vec::new();
    for p in PREFIXES {
        out.push(tok.encode(p, true)?);
    }
    if let Ok(fim) = tok.fim().fim() {
        for (prefix, suffix) in FIM_GAPS {
            out.push(crate::serve::fim::gap(tok, fim, prefix, suffix).map_err(|e| anyhow::anyhow!("{e:?}"))?);
        }
    }
    Ok(out)
}

/// A second copy of `draft` as the daemon loads a draft model: its output projection cheapened
/// ([`Model::cheapen_output_for_drafting`]).
pub(crate) fn daemon_draft(draft: &Model, threads: usize) -> anyhow::Result<Model> {
    let mut m = Model::load(&draft.path)?;
    m.cheapen_output_for_drafting(threads);
    Ok(m)
}

pub fn run(
    model: &Model,
    draft: Option<&Model>,
    reg: &Registry,
    threads: usize,
    repeat: usize,
) -> anyhow::Result<Value> {
    let opts = EngineOptions { threads, ..EngineOptions::default() };
    let mut target = Engine::cpu(model, &opts)?;
    // The draft on the target's threads, as the daemon runs it: as the file has it, and with
    // the output projection the daemon gives a draft.
    let draft_opts = EngineOptions { pool: target.backend.cpu_pool(), ..opts };
    let cheaper = draft.map(|d| daemon_draft(d, threads)).transpose()?;
    let mut plain = draft.map(|d| Engine::cpu(d, &draft_opts)).transpose()?;
    let mut cheap = cheaper.as_ref().map(|d| Engine::cpu(d, &draft_opts)).transpose()?;
    let eos = model.tokenizer.eos().to_vec();
    let prompts = prompts(model)?;
    let (greedy, spec) = (reg.get("greedy")?, reg.get("speculative")?);
    let mut configs = vec![(r#"{"temperature": 0}"#.to_string(), false)];
    if draft.is_some() {
        configs.extend(
            DRAFT_SETTINGS
                .map(|(k, p, c)| (format!(r#"{{"temperature": 0, "drafter": "model", "k": {k}, "p_min": {p}}}"#), c)),
        );
    }
    // Per configuration and repetition: seconds over all prompts, greedy's and speculation's.
    let mut times = vec![(Vec::new(), Vec::new()); configs.len()];
    let (mut same, mut drafted, mut accepted) =
        (vec![true; configs.len()], vec![0.0; configs.len()], vec![0.0; configs.len()]);
    let mut tokens = 0usize;
    for r in 0..repeat.max(1) {
        for (c, (params, cheaper)) in configs.iter().enumerate() {
            let (mut base, mut fast) = (0.0, 0.0);
            for p in &prompts {
                let d = if *cheaper { cheap.as_mut() } else { plain.as_mut() };
                let mut store = match d {
                    Some(d) => EngineStore::with_draft(&mut target, d),
                    None => EngineStore::new(&mut target),
                };
                let req = |params| SessionRequest {
                    logprobs: None,
                    prompt: p,
                    generated: &[],
                    params,
                    max_tokens: MAX_TOKENS,
                    n: 1,
                    seed: 0,
                    eos: &eos,
                    vocabulary: None,
                    grammar: None,
                };
                let t = Instant::now();
                let want = generate(&greedy, &mut store, &req("{}"), &mut |_, _| {})?;
                base += t.elapsed().as_secs_f64();
                let t = Instant::now();
                let got = generate_with_stats(&spec, &mut store, &req(params), &mut |_, _| {})?;
                fast += t.elapsed().as_secs_f64();
                same[c] &= got.choices[0].tokens == want[0].tokens;
                if r == 0 {
                    drafted[c] += got.stats.get("draft_tokens").copied().unwrap_or(0.0);
                    accepted[c] += got.stats.get("accepted_tokens").copied().unwrap_or(0.0);
                    if c == 0 {
                        tokens += want[0].tokens.len();
                    }
                }
            }
            times[c].0.push(base);
            times[c].1.push(fast);
        }
    }
    let results: Vec<Value> = configs
        .iter()
        .zip(times)
        .enumerate()
        .map(|(c, ((params, cheaper), (base, fast)))| {
            let (b, f) = (median(base), median(fast));
            json!({
                "params": params,
                "draft_output": if *cheaper { "q4_0" } else { "as in the file" },
                "greedy_tok_s": tokens as f64 / b,
                "speculative_tok_s": tokens as f64 / f,
                "speedup": b / f,
                "acceptance_rate": if drafted[c] > 0.0 { accepted[c] / drafted[c] } else { 0.0 },
                "identical_output": same[c],
            })
        })
        .collect();
    Ok(json!({
        "prompts": prompts.len(),
        "tokens": tokens,
        "max_tokens": MAX_TOKENS,
        "draft": draft.map(|m| m.path.display().to_string()),
        "results": results,
    }))
}
