//! Beam search: `beam_width` hypotheses as forked sequences (copy-on-write: they share their
//! prefix blocks), each step extended by the best continuations of all of them, ranked by total
//! log-probability divided by `length^length_penalty`. A hypothesis that ends with an
//! end-of-sequence token among the best `beam_width` candidates is set aside as finished (its
//! length counts the end token). With `early_stopping` the search ends once `beam_width`
//! hypotheses are finished; without, when no live beam can still beat the worst of them. At
//! `max_tokens` the live beams finish too. The request's `n` best are returned as its choices.

use inferd_plugin_api::abi;
use inferd_plugin_api::sampling::LogSoftmax;
use inferd_plugin_api::sdk::{parse_params, Host, Logprobs, Plan, PlanItem, Scored, SessionInit, Strategy};
use std::ffi::CStr;

struct Config {
    k: usize,
    alpha: f64,
    early_stopping: bool,
}

fn config(init: &SessionInit) -> Result<Config, String> {
    let c = parse_params(init, |p| {
        Ok(Config {
            k: p.u64("beam_width", 1..=32, 4)? as usize,
            alpha: p.f64("length_penalty", 0.0..=4.0, 1.0)?,
            early_stopping: p.bool("early_stopping", true)?,
        })
    })?;
    if init.n as usize > c.k {
        return Err(format!("n ({}) must not exceed beam_width ({})", init.n, c.k));
    }
    Ok(c)
}

/// A token's log-probability and the alternatives the client wants (see [`Logprobs`]).
#[derive(Clone)]
struct Beam {
    seq: abi::Seq,
    tokens: Vec<u32>,
    scored: Vec<Scored>,
    total: f64,
}

struct Hyp {
    tokens: Vec<u32>,
    scored: Vec<Scored>,
    score: f64,
    ended: bool,
}

pub struct BeamSearch {
    cfg: Config,
    n: usize,
    max_tokens: usize,
    eos: Vec<u32>,
    logprobs: Logprobs,
    root: abi::Seq,
    started: bool,
    beams: Vec<Beam>,
    finished: Vec<Hyp>,
    done: bool,
}

impl BeamSearch {
    fn score(&self, total: f64, len: usize) -> f64 {
        total / (len.max(1) as f64).powf(self.cfg.alpha)
    }

    /// One step: the best continuations of `parents` (rows[i] for parent i) become the beams.
    fn expand(&mut self, host: &Host, parents: Vec<Beam>, rows: &[&[f32]]) -> Result<(), String> {
        let k = self.cfg.k;
        // (total, parent, token, logprob) of the 2k best tokens of every parent; a token of
        // probability zero (a response format's mask) is no hypothesis.
        // Each parent's alternatives, when the client wants them, from the same normalizer.
        let mut cands: Vec<(f64, usize, u32, f32)> = Vec::new();
        let mut alternatives: Vec<Vec<(u32, f32)>> = Vec::with_capacity(parents.len());
        for (i, (p, row)) in parents.iter().zip(rows).enumerate() {
            let ls = LogSoftmax::of(row);
            cands.extend(ls.top(2 * k).into_iter().map(|(t, lp)| (p.total + ls.at_f64(t as usize), i, t, lp)));
            alternatives.push(ls.top(self.logprobs.top as usize));
        }
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut chosen: Vec<(f64, usize, u32, f32)> = Vec::new();
        for (rank, &c) in cands.iter().enumerate() {
            if chosen.len() == k {
                break;
            }
            if self.eos.contains(&c.2) {
                if rank < k {
                    let p = &parents[c.1];
                    let score = self.score(c.0, p.tokens.len() + 1);
                    self.finished.push(Hyp { tokens: p.tokens.clone(), scored: p.scored.clone(), score, ended: true });
                }
            } else {
                chosen.push(c);
            }
        }
        // Sequences: a parent's first child takes its sequence, the others fork it; parents
        // without children are freed.
        let mut used = vec![false; parents.len()];
        let mut beams = Vec::with_capacity(chosen.len());
        for &(total, i, t, lp) in &chosen {
            let p = &parents[i];
            let seq = if used[i] { host.seq_fork(p.seq)? } else { p.seq };
            used[i] = true;
            let mut b = Beam { seq, tokens: p.tokens.clone(), scored: p.scored.clone(), total };
            b.tokens.push(t);
            b.scored.push((lp, alternatives[i].clone()));
            beams.push(b);
        }
        for (p, u) in parents.iter().zip(used) {
            if !u {
                host.seq_free(p.seq)?;
            }
        }
        self.beams = beams;
        self.check_done(host)
    }

    fn check_done(&mut self, host: &Host) -> Result<(), String> {
        let k = self.cfg.k;
        let at_length = self.beams.first().is_some_and(|b| b.tokens.len() >= self.max_tokens);
        let mut done = at_length || self.beams.is_empty();
        if !done && self.finished.len() >= k {
            if self.cfg.early_stopping {
                done = true;
            } else {
                let mut s: Vec<f64> = self.finished.iter().map(|h| h.score).collect();
                s.sort_by(|a, b| b.total_cmp(a));
                let worst_kept = s[k - 1];
                let best_live =
                    self.beams.iter().map(|b| self.score(b.total, b.tokens.len())).fold(f64::NEG_INFINITY, f64::max);
                done = best_live <= worst_kept;
            }
        }
        if !done {
            return Ok(());
        }
        for b in std::mem::take(&mut self.beams) {
            if at_length {
                let score = self.score(b.total, b.tokens.len());
                self.finished.push(Hyp { tokens: b.tokens, scored: b.scored, score, ended: false });
            }
            host.seq_free(b.seq)?;
        }
        self.done = true;
        self.finished.sort_by(|a, b| b.score.total_cmp(&a.score));
        for (c, h) in self.finished.iter().take(self.n).enumerate() {
            for (&t, s) in h.tokens.iter().zip(&h.scored) {
                self.logprobs.send(host, c as u32, t, s)?;
            }
            host.finish(c as u32, if h.ended { abi::FINISH_STOP } else { abi::FINISH_LENGTH })?;
        }
        Ok(())
    }
}

impl Strategy for BeamSearch {
    const NAME: &'static CStr = c"beam";
    const DESCRIPTION: &'static CStr = c"Beam search over copy-on-write forked sequences, length-normalized";
    const PARAMS_DOC: &'static CStr = c"{\"beam_width\": \"integer 1..32, default 4 (n <= beam_width)\", \"length_penalty\": \"number 0..4, default 1: score = total logprob / length^length_penalty\", \"early_stopping\": \"bool, default true: stop once beam_width hypotheses ended\"}";

    fn validate(_host: &Host, init: &SessionInit) -> Result<(), String> {
        config(init).map(drop)
    }

    fn create(_host: &Host, init: &SessionInit) -> Result<Self, String> {
        Ok(BeamSearch {
            cfg: config(init)?,
            n: init.n.max(1) as usize,
            max_tokens: init.max_tokens as usize,
            eos: init.eos.clone(),
            logprobs: Logprobs::of(init),
            root: init.seq,
            started: false,
            beams: Vec::new(),
            finished: Vec::new(),
            done: init.max_tokens == 0,
        })
    }

    fn plan(&mut self, _host: &Host) -> Result<Plan, String> {
        if self.done {
            return Ok(Plan::Done);
        }
        if !self.started {
            return Ok(Plan::Run(vec![PlanItem { seq: self.root, tokens: Vec::new(), n_logits: 1 }]));
        }
        Ok(Plan::Run(
            self.beams
                .iter()
                .map(|b| PlanItem { seq: b.seq, tokens: b.tokens.last().copied().into_iter().collect(), n_logits: 1 })
                .collect(),
        ))
    }

    fn observe(&mut self, host: &Host, rows: &[&[f32]]) -> Result<(), String> {
        let parents = if self.started {
            std::mem::take(&mut self.beams)
        } else {
            self.started = true;
            vec![Beam { seq: self.root, tokens: Vec::new(), scored: Vec::new(), total: 0.0 }]
        };
        if rows.len() != parents.len() {
            return Err(format!("expected logits for {} beams, got {}", parents.len(), rows.len()));
        }
        self.expand(host, parents, rows)
    }
}

inferd_plugin_api::export_plugin!(name: "inferd-beam", version: env!("CARGO_PKG_VERSION"), strategies: [BeamSearch]);
