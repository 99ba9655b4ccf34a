//! One constrained session's view of its grammar: a parser state per sequence, the mask of each
//! logits row, and the check of every emitted token.
//!
//! A logits row of sequence `s` at position `p` predicts the token after `s[..=p]`; its mask is
//! the grammar's state after the output part of that prefix (`s[start..=p]`). Rather than trust
//! a strategy to report what it appended, forked or rolled back, the masker reads the
//! sequence's tokens and brings that sequence's parser to them: it rolls back to the common
//! prefix with what it consumed last and consumes the rest. A decode step costs one token and
//! one mask; a speculative step's rows walk the draft forward; a fork starts from a copy of its
//! parent's parser. Rows after a token the grammar forbids (a draft token about to be rejected)
//! are left unmasked: no strategy can use them, since that token had probability zero.

use super::Grammar;
use llguidance::Matcher;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A sequence's parser and the output tokens it has consumed.
struct Track {
    matcher: Matcher,
    consumed: Vec<u32>,
}

/// The grammar state of every constrained sequence and choice of one session.
pub struct Masker {
    /// Sequences by the session's handle.
    seqs: HashMap<u64, Track>,
    /// One parser per choice, fed what the strategy emits.
    choices: Vec<Matcher>,
    /// Where the output starts in a constrained sequence.
    start: usize,
    /// Tokens the grammar knows; a longer logits row's tail is always forbidden.
    vocab: usize,
    /// Time spent computing and applying masks, and rows masked.
    spent: Duration,
    rows: u64,
}

impl std::fmt::Debug for Masker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Masker").field("seqs", &self.seqs.len()).field("start", &self.start).finish_non_exhaustive()
    }
}

fn fresh(grammar: &Grammar) -> Matcher {
    Matcher::new(Ok(grammar.parser.deep_clone()))
}

impl Masker {
    /// A session whose output begins at position `start` of sequence `root`, `generated` of it
    /// already produced (a request resumed after preemption), with `n` choices.
    pub fn new(grammar: &Grammar, root: u64, start: usize, generated: &[u32], n: usize) -> Result<Masker, String> {
        let mut m = fresh(grammar);
        if let Some(e) = m.get_error() {
            return Err(format!("the response format's grammar failed to start: {e}"));
        }
        let taken = m.try_consume_tokens(generated).map_err(|e| format!("the response format: {e}"))?;
        if taken < generated.len() {
            return Err("the output generated before a preemption no longer fits its response format".into());
        }
        let choices = (0..n).map(|_| m.deep_clone()).collect();
        let mut seqs = HashMap::new();
        seqs.insert(root, Track { matcher: m, consumed: generated.to_vec() });
        Ok(Masker { seqs, choices, start, vocab: grammar.vocab, spent: Duration::ZERO, rows: 0 })
    }

    /// `child` was forked from `parent`: it starts from the parent's state.
    pub fn fork(&mut self, parent: u64, child: u64) {
        if let Some(t) = self.seqs.get(&parent) {
            let copy = Track { matcher: t.matcher.deep_clone(), consumed: t.consumed.clone() };
            self.seqs.insert(child, copy);
        }
    }

    pub fn free(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }

    /// Masks the `rows.len() / row_len` rows of sequence `seq`, which holds `tokens`; they are
    /// the logits of its last positions. A sequence the session did not constrain (a draft
    /// model's) is left alone.
    pub fn mask(&mut self, seq: u64, tokens: &[u32], rows: &mut [f32], row_len: usize) -> Result<(), String> {
        let Some(track) = self.seqs.get_mut(&seq) else { return Ok(()) };
        if row_len == 0 {
            return Ok(());
        }
        let t0 = Instant::now();
        let n = rows.len() / row_len;
        let Some(first) = tokens.len().checked_sub(n) else {
            return Err(format!("{n} logits rows for a sequence of {} positions", tokens.len()));
        };
        for (j, row) in rows.chunks_exact_mut(row_len).enumerate() {
            // This row predicts the token after tokens[..first + j + 1].
            let end = first + j + 1;
            if end < self.start {
                continue; // a prompt position: nothing to constrain yet
            }
            if !sync(track, &tokens[self.start..end])? {
                break; // the prefix holds a forbidden token; see the module docs
            }
            let allowed = track.matcher.compute_mask_or_eos().map_err(|e| format!("the response format: {e}"))?;
            apply(allowed.as_slice(), self.vocab, row);
            self.rows += 1;
        }
        self.spent += t0.elapsed();
        Ok(())
    }

    /// Strategy emitted `token` for `choice`: refused when the grammar forbids it.
    pub fn emit(&mut self, choice: u32, token: u32) -> Result<(), String> {
        let Some(m) = self.choices.get_mut(choice as usize) else { return Ok(()) };
        match m.try_consume_tokens(&[token]) {
            Ok(1) => Ok(()),
            Ok(_) => Err(format!("emitted token {token}, which the response format forbids here")),
            Err(e) => Err(format!("the response format: {e}")),
        }
    }

    /// `choice` ended at an end-of-sequence token: refused when its output is not a whole
    /// sentence of the grammar yet.
    pub fn finish(&mut self, choice: u32) -> Result<(), String> {
        let Some(m) = self.choices.get_mut(choice as usize) else { return Ok(()) };
        if m.is_stopped() || m.is_accepting().unwrap_or(false) {
            Ok(())
        } else {
            Err(format!("choice {choice} ended before its output completed the response format"))
        }
    }

    /// Time spent on masks so far, and rows masked.
    pub fn cost(&self) -> (Duration, u64) {
        (self.spent, self.rows)
    }
}

/// Brings `track` to output `want`; false when `want` holds a token the grammar forbids (the
/// track then stands at the longest allowed prefix).
fn sync(track: &mut Track, want: &[u32]) -> Result<bool, String> {
    let common = track.consumed.iter().zip(want).take_while(|(a, b)| a == b).count();
    if common < track.consumed.len() {
        track.matcher.rollback(track.consumed.len() - common).map_err(|e| format!("the response format: {e}"))?;
        track.consumed.truncate(common);
    }
    let rest = &want[common..];
    if rest.is_empty() {
        return Ok(true);
    }
    let taken = track.matcher.try_consume_tokens(rest).map_err(|e| format!("the response format: {e}"))?;
    track.consumed.extend_from_slice(&rest[..taken]);
    Ok(taken == rest.len())
}

/// Sets every logit the mask (bit `t` of word `t / 32`) forbids to minus infinity.
fn apply(allowed: &[u32], vocab: usize, row: &mut [f32]) {
    for (w, chunk) in row.chunks_mut(32).enumerate() {
        let bits = if w * 32 < vocab { allowed.get(w).copied().unwrap_or(0) } else { 0 };
        if bits == u32::MAX && (w + 1) * 32 <= vocab {
            continue;
        }
        for (i, v) in chunk.iter_mut().enumerate() {
            if bits & (1 << i) == 0 || w * 32 + i >= vocab {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}
