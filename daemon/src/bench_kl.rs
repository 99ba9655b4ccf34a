//! `inferd bench --kl-divergence BASE`: how far a model's next-token distributions are from
//! full precision, on the tokens and reference log-probabilities `llama-perplexity
//! --kl-divergence-base BASE` wrote from an F32 copy of the same weights
//! ([`crate::kl_divergence`] reads the file). Each chunk of `n_ctx` tokens runs from an empty
//! sequence with logits at every position; the second half of each chunk is scored, as
//! llama-perplexity scores it, so the two programs' figures compare line for line.
//!
//! With `--versus OTHER` (a second file of the same tokens, from another implementation of the
//! same quantized model: `llama-perplexity -m Q.gguf --kl-divergence-base OTHER`), the other's
//! figures against the base as well, and the positions where the two quantized runs disagree
//! by more than [`GAP_NATS`] on the log-probability of either one's most likely token: at
//! each, which of the two is closer to full precision.

use crate::kl_divergence::{compare, log_softmax, LogProbFile, Record, Summary, TokenStats};
use inferd_engine::engine::{Engine, EngineOptions, RunItem};
use inferd_engine::model::Model;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// A disagreement between two runs of one quantized model worth a look, in nats.
pub const GAP_NATS: f64 = 0.3;

/// Where two quantized runs disagree by more than [`GAP_NATS`], and which is nearer the base.
#[derive(Debug, Default, serde::Serialize)]
pub struct Disagreements {
    pub gap_nats: f64,
    pub positions: usize,
    /// Positions where this model's KL divergence from the base is the smaller.
    pub model_closer: usize,
    pub other_closer: usize,
    /// The mean KL divergence from the base over those positions, each run's.
    pub model_kld_mean: f64,
    pub other_kld_mean: f64,
    /// The largest disagreement seen, in nats.
    pub max_gap: f64,
}

impl Disagreements {
    fn add(&mut self, gap: f64, model: &TokenStats, other: &TokenStats) {
        self.max_gap = self.max_gap.max(gap);
        if gap <= GAP_NATS {
            return;
        }
        self.positions += 1;
        if model.kld < other.kld {
            self.model_closer += 1;
        } else {
            self.other_closer += 1;
        }
        self.model_kld_mean += model.kld;
        self.other_kld_mean += other.kld;
    }

    fn finish(mut self) -> Self {
        self.gap_nats = GAP_NATS;
        if self.positions > 0 {
            self.model_kld_mean /= self.positions as f64;
            self.other_kld_mean /= self.positions as f64;
        }
        self
    }
}

/// The measurement over the first `chunks` chunks of `base` (all of them when `None`).
pub fn run(
    model: &Model,
    base_path: &Path,
    versus: Option<&Path>,
    threads: usize,
    chunks: Option<usize>,
) -> anyhow::Result<Value> {
    let mut base = LogProbFile::open(base_path)?;
    let vocab = model.config.vocab;
    anyhow::ensure!(
        base.n_vocab == vocab,
        "{} holds distributions over {} tokens, the model's vocabulary has {vocab}",
        base_path.display(),
        base.n_vocab
    );
    anyhow::ensure!(
        base.n_ctx <= model.config.context_len,
        "{} was computed with chunks of {} tokens, beyond the model's context of {}",
        base_path.display(),
        base.n_ctx,
        model.config.context_len
    );
    let mut other = versus.map(LogProbFile::open).transpose()?;
    if let Some(o) = &other {
        anyhow::ensure!(
            (o.n_ctx, o.n_vocab) == (base.n_ctx, base.n_vocab)
                && o.tokens[..] == base.tokens[..o.tokens.len().min(base.tokens.len())],
            "{} was not computed on the tokens of {}",
            versus.map(|p| p.display().to_string()).unwrap_or_default(),
            base_path.display()
        );
    }
    let n_chunk =
        chunks.unwrap_or(base.n_chunk).min(base.n_chunk).min(other.as_ref().map_or(usize::MAX, |o| o.n_chunk));
    let (n_ctx, first, scored, rec_len) = (base.n_ctx, base.first(), base.scored(), base.record_len());
    let opts = EngineOptions {
        threads,
        kv_budget_bytes: 2 * n_ctx * inferd_engine::backend::cpu::kv_block_bytes(&model.config, 16) / 16
            + inferd_engine::backend::cpu::STATE_SHARE * 2 * inferd_engine::backend::cpu::state_bytes(&model.arch),
        ..EngineOptions::default()
    };
    let mut engine = Engine::cpu(model, &opts)?;
    let bos = model.tokenizer.bos().filter(|_| model.tokenizer.adds_bos());
    let (mut values, mut other_values) = (Vec::new(), Vec::new());
    let (mut stats, mut other_stats) = (Vec::new(), Vec::new());
    let mut gaps = Disagreements::default();
    let mut forward_s = 0.0;
    let mut other_lp = vec![0f32; vocab];
    for c in 0..n_chunk {
        let mut tokens = base.chunk_tokens(c).to_vec();
        if let Some(b) = bos {
            tokens[0] = b;
        }
        let seq = engine.kv.create();
        let t = Instant::now();
        let rows = engine.step(&[RunItem::logits(seq, &tokens, n_ctx - first)]);
        forward_s += t.elapsed().as_secs_f64();
        engine.release(seq);
        let mut rows = rows?.swap_remove(0);
        base.next_chunk(&mut values)?;
        if let Some(o) = other.as_mut() {
            o.next_chunk(&mut other_values)?;
        }
        for r in 0..scored {
            let next = base.chunk_tokens(c)[first + r + 1] as usize;
            let lp = &mut rows[r * vocab..(r + 1) * vocab];
            let top = log_softmax(lp);
            let reference = Record::at(&values, r, rec_len, vocab);
            let mine = compare(lp, top, &reference, next);
            stats.push(mine);
            if other.is_some() {
                let theirs_rec = Record::at(&other_values, r, rec_len, vocab);
                other_lp.iter_mut().enumerate().for_each(|(i, l)| *l = theirs_rec.log_prob(i));
                let other_top = theirs_rec.argmax();
                let theirs = compare(&other_lp, other_top, &reference, next);
                let gap = [top, other_top].iter().map(|&t| f64::from((lp[t] - other_lp[t]).abs())).fold(0.0, f64::max);
                gaps.add(gap, &mine, &theirs);
                other_stats.push(theirs);
            }
        }
    }
    let evaluated = n_chunk * n_ctx;
    let mut report = json!({
        "model": model.name,
        "base": base_path.display().to_string(),
        "n_ctx": n_ctx,
        "chunks": n_chunk,
        "tokens_evaluated": evaluated,
        "forward_seconds": forward_s,
        "tokens_per_second": evaluated as f64 / forward_s.max(1e-9),
        "summary": Summary::of(&stats),
    });
    if let Some(path) = versus {
        report["versus"] = json!({
            "file": path.display().to_string(),
            "summary": Summary::of(&other_stats),
            "disagreements": gaps.finish(),
        });
    }
    Ok(report)
}
