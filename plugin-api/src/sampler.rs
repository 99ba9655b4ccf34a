//! [`Sampler`]: the session logic shared by strategies that choose one token per step per
//! choice (greedy, nucleus, min-p). A strategy of that kind only says how to [`Pick`] a token.
//!
//! Session life: the first plan runs the prompt of the target sequence and asks for its last
//! logits; the first observe picks each choice's first token from them, forking the prompt
//! (copy-on-write) for choices 1..n. Afterwards every live choice appends its last token and asks
//! for one row of logits. A choice ends at an end-of-sequence token (not emitted) or after
//! `max_tokens` tokens; its sequence is freed at once. Tokens the target sequence holds past the
//! prompt count as already generated (a continued request): they feed the penalties.

use crate::abi;
use crate::params::Params;
use crate::sdk::{parse_params, Host, Logprobs, Plan, PlanItem, SessionInit, Strategy};
use std::ffi::CStr;

/// How a strategy chooses a token from one row of logits.
pub trait Pick: Sized + Send + 'static {
    const NAME: &'static CStr;
    const DESCRIPTION: &'static CStr;
    const PARAMS_DOC: &'static CStr = c"{}";

    /// Reads the strategy's parameters from `p` (every key must be read; see [`Params`]).
    fn parse(p: &mut Params, init: &SessionInit) -> Result<Self, String>;

    /// The request's prompt, before the first pick (a repetition penalty's window starts in it).
    fn prompt(&mut self, _prompt: &[u32]) {}

    /// The token for `choice` at generated position `position` (0-based); `history` holds the
    /// choice's generated tokens so far. The sampler reports its log-probability (see
    /// [`Logprobs`]).
    fn pick(&self, host: &Host, logits: &[f32], history: &[u32], choice: u32, position: u32) -> Result<u32, String>;
}

struct Choice {
    seq: abi::Seq,
    /// Tokens generated so far (for penalties), including any the request started with.
    history: Vec<u32>,
    /// Tokens emitted by this session.
    emitted: u32,
    /// The last token, to append at the next step.
    last: Option<u32>,
    done: bool,
}

/// A one-token-per-step session over any [`Pick`].
pub struct Sampler<P: Pick> {
    pick: P,
    root: abi::Seq,
    choices: Vec<Choice>,
    started: bool,
    max_tokens: u32,
    eos: Vec<u32>,
    vocab: usize,
    logprobs: Logprobs,
    /// Choices in the order of the last plan's items.
    planned: Vec<usize>,
}

impl<P: Pick> Sampler<P> {
    fn step(&mut self, host: &Host, c: usize, row: &[f32]) -> Result<(), String> {
        if row.len() != self.vocab {
            return Err(format!("expected {} logits, got {}", self.vocab, row.len()));
        }
        let ch = &self.choices[c];
        let tok = self.pick.pick(host, row, &ch.history, c as u32, ch.history.len() as u32)?;
        let ch = &mut self.choices[c];
        if self.eos.contains(&tok) {
            host.finish(c as u32, abi::FINISH_STOP)?;
        } else {
            self.logprobs.emit(host, c as u32, tok, row)?;
            ch.history.push(tok);
            ch.last = Some(tok);
            ch.emitted += 1;
            if ch.emitted < self.max_tokens {
                return Ok(());
            }
            host.finish(c as u32, abi::FINISH_LENGTH)?;
        }
        ch.done = true;
        host.seq_free(ch.seq)
    }
}

impl<P: Pick> Strategy for Sampler<P> {
    const NAME: &'static CStr = P::NAME;
    const DESCRIPTION: &'static CStr = P::DESCRIPTION;
    const PARAMS_DOC: &'static CStr = P::PARAMS_DOC;

    fn validate(_host: &Host, init: &SessionInit) -> Result<(), String> {
        parse_params(init, |p| P::parse(p, init)).map(drop)
    }

    fn create(host: &Host, init: &SessionInit) -> Result<Self, String> {
        let mut pick = parse_params(init, |p| P::parse(p, init))?;
        let n = init.n.max(1) as usize;
        // Tokens past the prompt were generated before this session (a continued request).
        let mut prompt = host.seq_tokens(init.seq)?;
        let history: Vec<u32> = prompt.split_off((init.prompt_len as usize).min(prompt.len()));
        pick.prompt(&prompt);
        let choices = (0..n)
            .map(|c| Choice {
                seq: if c == 0 { init.seq } else { 0 },
                history: history.clone(),
                emitted: 0,
                last: None,
                done: init.max_tokens == 0,
            })
            .collect();
        Ok(Sampler {
            pick,
            root: init.seq,
            choices,
            started: false,
            max_tokens: init.max_tokens,
            eos: init.eos.clone(),
            vocab: init.vocab_size as usize,
            logprobs: Logprobs::of(init),
            planned: Vec::new(),
        })
    }

    fn plan(&mut self, _host: &Host) -> Result<Plan, String> {
        if self.choices.iter().all(|c| c.done) {
            return Ok(Plan::Done);
        }
        if !self.started {
            self.planned = vec![0];
            return Ok(Plan::Run(vec![PlanItem { seq: self.root, tokens: Vec::new(), n_logits: 1 }]));
        }
        self.planned = (0..self.choices.len()).filter(|&c| !self.choices[c].done).collect();
        let items = self.planned.iter().map(|&c| {
            let ch = &self.choices[c];
            PlanItem { seq: ch.seq, tokens: ch.last.into_iter().collect(), n_logits: 1 }
        });
        Ok(Plan::Run(items.collect()))
    }

    fn observe(&mut self, host: &Host, rows: &[&[f32]]) -> Result<(), String> {
        if rows.len() != self.planned.len() {
            return Err(format!("expected logits for {} sequences, got {}", self.planned.len(), rows.len()));
        }
        if !self.started {
            self.started = true;
            // Fork every other choice from the prompt before the first choice's sequence moves on.
            for c in 1..self.choices.len() {
                self.choices[c].seq = host.seq_fork(self.root)?;
            }
            for c in 0..self.choices.len() {
                self.step(host, c, rows[0])?;
            }
            return Ok(());
        }
        for (i, c) in std::mem::take(&mut self.planned).into_iter().enumerate() {
            self.step(host, c, rows[i])?;
        }
        Ok(())
    }
}
