//! Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a drafter proposes up to `k`
//! tokens, the target scores all of them in one forward, and exact rejection sampling keeps the
//! output distribution the target's.
//!
//! Drafters (`drafter`):
//! - `"prompt-lookup"` (default): the longest n-gram (`ngram_max` down to `ngram_min` tokens) at
//!   the end of the prompt and output so far that occurred earlier proposes the tokens that
//!   followed it. The proposal is deterministic (q is a point mass). Its length adapts: after a
//!   round that kept every proposed token the next may be twice as long plus one (never
//!   shorter than it was, up to `k`), after one that did not, one longer than what was kept.
//!   Copying text runs at `k` a round; new text, where matches rarely hold, costs a verify of
//!   a token or two instead of `k + 1` (a 16-token verify of a 1.5B model is about four decode
//!   steps' work on a CPU).
//! - `"model"`: the draft model bound to the request's model (`INFERD_ROLE_DRAFT`) samples up
//!   to `k` tokens from its own distribution, one plan round each. With `p_min`, a round's
//!   drafting stops early where the draft is unsure: at a position whose most likely token the
//!   draft gives less than `p_min` (its plain softmax, before the request's sampling
//!   transforms, so it means the same at any temperature), that position is left to the
//!   target. The decision reads only the draft's distribution before anything is drawn from
//!   it, so the output distribution stays the target's; it lets `k` be large where the draft
//!   is sure (code, boilerplate) without paying for long rejected drafts where it is not.
//!
//! Verification, for each proposed token x_i: accept with probability min(1, p_i(x_i) / q_i(x_i));
//! at the first rejection draw from max(0, p_i - q_i) normalized over the vocabulary, and stop;
//! when every token is accepted draw a bonus token from p_{m+1}. p and q are the target's and the
//! draft's logits through the same sampling transforms (`inferd_plugin_api::sampling`, with the
//! request's temperature, top-k, top-p, min-p, penalties and bias), so speculation never bypasses
//! the sampling parameters. With temperature 0 both are point masses and the output is exactly
//! greedy decoding's. Both sequences are truncated to the accepted length after each round.
//! Reported statistics: `draft_tokens`, `accepted_tokens`, `rounds`, and `unsure_stops` (rounds
//! whose drafting `p_min` ended early).

use inferd_plugin_api::abi;
use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampling::{draw, Accept, Sampling};
use inferd_plugin_api::sdk::{parse_params, Host, Logprobs, Plan, PlanItem, SessionInit, Strategy};
use std::ffi::CStr;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Drafter {
    PromptLookup,
    Model,
}

struct Config {
    drafter: Drafter,
    k: usize,
    ngram_max: usize,
    ngram_min: usize,
    /// Drafting stops at a position whose top draft probability is below this (0: off).
    p_min: f64,
    sampling: Sampling,
}

fn parse(p: &mut Params, init: &SessionInit) -> Result<Config, String> {
    let drafter = match p.get("drafter").map(|v| v.as_str().map(str::to_owned)) {
        None => Drafter::PromptLookup,
        Some(Some(s)) if s == "prompt-lookup" => Drafter::PromptLookup,
        Some(Some(s)) if s == "model" => Drafter::Model,
        Some(_) => return Err("drafter must be \"prompt-lookup\" or \"model\"".into()),
    };
    let k = p.u64("k", 1..=16, if drafter == Drafter::Model { 3 } else { 15 })? as usize;
    let p_min = p.f64("p_min", 0.0..=1.0, 0.0)?;
    let ngram_max = p.u64("ngram_max", 1..=8, 3)? as usize;
    let ngram_min = p.u64("ngram_min", 1..=8, 1)? as usize;
    if ngram_min > ngram_max {
        return Err("ngram_min must not exceed ngram_max".into());
    }
    let sampling = Sampling::from_params(p, init.vocab_size, Accept { top_k: true, top_p: true, min_p: true })?;
    if drafter == Drafter::Model && init.roles & (1 << abi::ROLE_DRAFT) == 0 {
        return Err("drafter \"model\" needs a draft model bound to this model".into());
    }
    if init.n > 1 {
        return Err("speculative decoding returns one choice (n = 1)".into());
    }
    Ok(Config { drafter, k, ngram_max, ngram_min, p_min, sampling })
}

/// Random streams: (kind + 4 * round) keeps every draw of every round independent.
const DRAFT: u64 = 1;
const ACCEPT: u64 = 2;
const RESIDUAL: u64 = 3;

enum Phase {
    /// Run the prompt (and the draft model's copy of it), take the first token.
    Start,
    /// Drafting with the draft model, one token per round.
    Drafting,
    /// The target scores `last` and the proposal.
    Verify,
    Done,
}

pub struct Speculative {
    cfg: Config,
    target: abi::Seq,
    draft: Option<abi::Seq>,
    prompt: Vec<u32>,
    eos: Vec<u32>,
    logprobs: Logprobs,
    max_tokens: usize,
    /// Generated tokens (emitted, or about to be), for penalties and prompt lookup.
    history: Vec<u32>,
    emitted: usize,
    /// The newest token: chosen, not yet in the target sequence.
    last: u32,
    /// Tokens the draft sequence still has to append before its next step.
    draft_pending: Vec<u32>,
    /// Proposed tokens the draft sequence holds: all but the last, or all of them when a
    /// round's drafting stopped early (`p_min`).
    draft_holds: usize,
    proposal: Vec<u32>,
    /// The prompt-lookup proposal's longest length this round (adapts, see the module docs).
    lookup_k: usize,
    /// The draft distribution of each proposed token (empty for prompt lookup: point masses).
    q: Vec<Vec<(u32, f32)>>,
    round: u64,
    phase: Phase,
}

impl Speculative {
    /// Tokens that followed the latest earlier occurrence of the longest matching suffix.
    fn lookup(&self, k: usize) -> Vec<u32> {
        let ctx: Vec<u32> = self.prompt.iter().chain(&self.history).copied().collect();
        for n in (self.cfg.ngram_min..=self.cfg.ngram_max).rev() {
            if ctx.len() <= n {
                continue;
            }
            let suffix = &ctx[ctx.len() - n..];
            for j in (0..ctx.len() - n).rev() {
                if &ctx[j..j + n] == suffix {
                    let follow = &ctx[j + n..(j + n + k).min(ctx.len())];
                    if !follow.is_empty() {
                        return follow.to_vec();
                    }
                }
            }
        }
        Vec::new()
    }

    /// Proposal tokens allowed this round: the verify adds one more token, and the output
    /// may not pass max_tokens.
    fn budget(&self) -> usize {
        self.cfg.k.min(self.max_tokens.saturating_sub(self.emitted + 1))
    }

    fn start_round(&mut self) {
        self.proposal.clear();
        self.q.clear();
        self.round += 1;
        let budget = self.budget();
        self.phase = match self.cfg.drafter {
            _ if budget == 0 => Phase::Verify,
            Drafter::PromptLookup => {
                self.proposal = self.lookup(budget.min(self.lookup_k));
                Phase::Verify
            }
            Drafter::Model => Phase::Drafting,
        };
    }

    /// Emits `t` (or finishes), chosen from the target's `row`; returns false when the
    /// request is over.
    fn take(&mut self, host: &Host, t: u32, row: &[f32]) -> Result<bool, String> {
        if self.eos.contains(&t) {
            host.finish(0, abi::FINISH_STOP)?;
            return Ok(false);
        }
        self.logprobs.emit(host, 0, t, row)?;
        self.emitted += 1;
        self.history.push(t);
        if self.emitted >= self.max_tokens {
            host.finish(0, abi::FINISH_LENGTH)?;
            return Ok(false);
        }
        Ok(true)
    }

    fn finish(&mut self, host: &Host) -> Result<(), String> {
        self.phase = Phase::Done;
        if let Some(d) = self.draft.take() {
            host.seq_free(d)?;
        }
        Ok(())
    }

    fn verify(&mut self, host: &Host, rows: &[f32], vocab: usize) -> Result<(), String> {
        let m = self.proposal.len();
        if rows.len() != (m + 1) * vocab {
            return Err(format!("expected {} rows of logits, got {} floats", m + 1, rows.len()));
        }
        let base = self.history.len() as u64;
        let mut hist = self.history.clone();
        let mut accepted = 0;
        let mut new = None;
        for i in 0..m {
            let p = self.cfg.sampling.distribution(&rows[i * vocab..(i + 1) * vocab], &hist);
            let x = self.proposal[i];
            let px = p.iter().find(|e| e.0 == x).map_or(0.0, |e| f64::from(e.1));
            let qx = self.q.get(i).map_or(1.0, |q| q.iter().find(|e| e.0 == x).map_or(0.0, |e| f64::from(e.1)));
            let u = host.uniform(ACCEPT + 4 * self.round, base + i as u64)?;
            if qx > 0.0 && u < (px / qx).min(1.0) {
                accepted += 1;
                hist.push(x);
                continue;
            }
            // Rejected: draw from the normalized residual max(0, p - q).
            let q = self.q.get(i);
            let qy = |y: u32| match q {
                Some(q) => q.iter().find(|e| e.0 == y).map_or(0.0, |e| e.1),
                None => f32::from(u8::from(y == x)),
            };
            let mut r: Vec<(u32, f32)> =
                p.iter().map(|&(y, py)| (y, (py - qy(y)).max(0.0))).filter(|e| e.1 > 0.0).collect();
            let total: f32 = r.iter().map(|e| e.1).sum();
            if total <= 0.0 {
                // p <= q everywhere only when p == q: the draft was right to the last bit.
                r = p.clone();
            } else {
                r.iter_mut().for_each(|e| e.1 /= total);
            }
            let u = host.uniform(RESIDUAL + 4 * self.round, base + i as u64)?;
            let (y, _) = draw(&r, u).ok_or("empty residual distribution")?;
            new = Some(y);
            break;
        }
        let new = match new {
            Some(n) => n,
            None => {
                let p = self.cfg.sampling.distribution(&rows[m * vocab..(m + 1) * vocab], &hist);
                let u = host.uniform(RESIDUAL + 4 * self.round, base + m as u64)?;
                draw(&p, u).ok_or("empty distribution")?.0
            }
        };
        if m > 0 {
            self.lookup_k = if accepted == m { (2 * m + 1).max(self.lookup_k) } else { accepted + 1 }.min(self.cfg.k);
        }
        host.report("draft_tokens", m as f64)?;
        host.report("accepted_tokens", accepted as f64)?;
        host.report("rounds", 1.0)?;
        // The target holds [.., last, x_1..x_m]: keep [.., last, x_1..x_a].
        let len = host.seq_len(self.target)?;
        host.seq_truncate(self.target, len - (m - accepted) as u32)?;
        // The draft holds [.., last, x_1..x_h] (h = draft_holds: m - 1, x_m never appended,
        // or m when drafting stopped early): keep what was accepted, append the rest.
        if let Some(d) = self.draft {
            let h = self.draft_holds;
            if m > 0 {
                let dlen = host.seq_len(d)?;
                host.seq_truncate(d, dlen - h.saturating_sub(accepted) as u32)?;
                self.draft_pending = self.proposal[h.min(accepted)..accepted].to_vec();
                self.draft_pending.push(new);
            } else {
                // No drafting this round: `last` is still waiting to be appended too.
                self.draft_pending.push(new);
            }
        }
        // Row i scored position i: the accepted drafts, then the new token.
        for i in 0..accepted {
            let t = self.proposal[i];
            if !self.take(host, t, &rows[i * vocab..(i + 1) * vocab])? {
                return self.finish(host);
            }
        }
        if !self.take(host, new, &rows[accepted * vocab..(accepted + 1) * vocab])? {
            return self.finish(host);
        }
        self.last = new;
        self.start_round();
        Ok(())
    }
}

impl Strategy for Speculative {
    const NAME: &'static CStr = c"speculative";
    const DESCRIPTION: &'static CStr =
        c"Speculative decoding with exact rejection sampling: prompt lookup or a draft model";
    const PARAMS_DOC: &'static CStr = c"{\"drafter\": \"prompt-lookup (default) or model\", \"k\": \"integer 1..16, draft tokens per round (default 15 for prompt lookup, 3 for a model)\", \"ngram_max\": \"integer 1..8, default 3\", \"ngram_min\": \"integer 1..8, default 1\", \"p_min\": \"number 0..1, default 0: with a model drafter, stop a round's drafting where the draft's top probability is below this\", \"temperature\": \"number 0..2, default 1; 0 is greedy\", \"top_k\": \"integer, 0 off\", \"top_p\": \"number 0..1\", \"min_p\": \"number 0..1\", \"frequency_penalty\": \"number -2..2\", \"presence_penalty\": \"number -2..2\", \"repeat_penalty\": \"number 0..10, 1 off\", \"repeat_last_n\": \"integer, default 64\", \"logit_bias\": \"object token id -> -100..100\"}";

    fn validate(_host: &Host, init: &SessionInit) -> Result<(), String> {
        parse_params(init, |p| parse(p, init)).map(drop)
    }

    fn create(host: &Host, init: &SessionInit) -> Result<Self, String> {
        let mut cfg = parse_params(init, |p| parse(p, init))?;
        let all = host.seq_tokens(init.seq)?;
        let pl = (init.prompt_len as usize).min(all.len());
        cfg.sampling.with_prompt(&all[..pl]);
        let draft = if cfg.drafter == Drafter::Model { Some(host.seq_create(abi::ROLE_DRAFT)?) } else { None };
        let cfg_k = cfg.k;
        Ok(Speculative {
            cfg,
            target: init.seq,
            draft,
            prompt: all[..pl].to_vec(),
            eos: init.eos.clone(),
            logprobs: Logprobs::of(init),
            max_tokens: init.max_tokens as usize,
            history: all[pl..].to_vec(),
            emitted: 0,
            last: 0,
            // The draft model starts with the whole context.
            draft_pending: all,
            draft_holds: 0,
            proposal: Vec::new(),
            lookup_k: cfg_k,
            q: Vec::new(),
            round: 0,
            phase: if init.max_tokens == 0 { Phase::Done } else { Phase::Start },
        })
    }

    fn plan(&mut self, _host: &Host) -> Result<Plan, String> {
        Ok(match self.phase {
            Phase::Done => Plan::Done,
            Phase::Start => {
                let mut items = vec![PlanItem { seq: self.target, tokens: Vec::new(), n_logits: 1 }];
                if let Some(d) = self.draft {
                    // Prefill the draft's copy of the context; its last token waits for drafting.
                    // (A plan changes nothing: the host may ask for it again before observe.)
                    let n = self.draft_pending.len().saturating_sub(1);
                    let toks: Vec<u32> = self.draft_pending[..n].to_vec();
                    if !toks.is_empty() {
                        items.push(PlanItem { seq: d, tokens: toks, n_logits: 0 });
                    }
                }
                Plan::Run(items)
            }
            Phase::Drafting => {
                let d = self.draft.ok_or("drafting without a draft sequence")?;
                Plan::Run(vec![PlanItem { seq: d, tokens: self.draft_pending.clone(), n_logits: 1 }])
            }
            Phase::Verify => {
                let mut tokens = vec![self.last];
                tokens.extend(&self.proposal);
                Plan::Run(vec![PlanItem { seq: self.target, tokens, n_logits: self.proposal.len() as u32 + 1 }])
            }
        })
    }

    fn observe(&mut self, host: &Host, rows: &[&[f32]]) -> Result<(), String> {
        let vocab = rows.first().map_or(0, |r| r.len());
        match self.phase {
            Phase::Done => Err("observe after the end".into()),
            Phase::Start => {
                let p = self.cfg.sampling.distribution(rows[0], &self.history);
                let u = host.uniform(RESIDUAL, self.history.len() as u64)?;
                let (t, _) = draw(&p, u).ok_or("empty distribution")?;
                if self.draft.is_some() {
                    // The context's last token, then the new one.
                    let last_ctx = *self.prompt.iter().chain(&self.history).last().ok_or("empty context")?;
                    self.draft_pending = vec![last_ctx, t];
                }
                if !self.take(host, t, rows[0])? {
                    return self.finish(host);
                }
                self.last = t;
                self.start_round();
                Ok(())
            }
            Phase::Drafting => {
                // The draft ran what it had pending.
                self.draft_pending.clear();
                if self.cfg.p_min > 0.0 && top_probability(rows[0]) < self.cfg.p_min {
                    // Unsure here: the draft now holds every proposed token (with none, the
                    // round is a plain step of the target).
                    host.report("unsure_stops", 1.0)?;
                    self.draft_holds = self.proposal.len();
                    self.phase = Phase::Verify;
                    return Ok(());
                }
                let mut hist = self.history.clone();
                hist.extend(&self.proposal);
                let q = self.cfg.sampling.distribution(rows[0], &hist);
                let u = host.uniform(DRAFT + 4 * self.round, (self.history.len() + self.proposal.len()) as u64)?;
                let (x, _) = draw(&q, u).ok_or("empty draft distribution")?;
                self.proposal.push(x);
                self.q.push(q);
                if self.proposal.len() >= self.budget() {
                    self.draft_holds = self.proposal.len() - 1;
                    self.phase = Phase::Verify;
                } else {
                    self.draft_pending = vec![x];
                }
                Ok(())
            }
            Phase::Verify => self.verify(host, rows[0], vocab / (self.proposal.len() + 1)),
        }
    }
}

/// The probability of the most likely token under the plain softmax of `logits`.
fn top_probability(logits: &[f32]) -> f64 {
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !top.is_finite() {
        return 0.0;
    }
    // Terms below e^-20 of the top's add less than 3e-4 over a 150,000-token vocabulary: a
    // comparison skips their `exp`, most of the row where the draft is sure.
    let sum: f32 = logits.iter().map(|&l| l - top).filter(|&d| d > -20.0).map(f32::exp).sum();
    1.0 / f64::from(sum)
}

inferd_plugin_api::export_plugin!(name: "inferd-speculative", version: env!("CARGO_PKG_VERSION"), strategies: [Speculative]);
