//! Generation on top of a [`Backend`] and the [`KvCacheManager`]: prefill (chunked, batched,
//! prefix-cached) and batched decode steps.
//!
//! This is the layer the daemon's scheduler will drive one step at a time; `inferd run` and
//! `inferd bench` use it directly. Decoding here is greedy (an in-engine argmax) until decoding
//! strategies move into plugins.

pub mod options;

pub use options::EngineOptions;

use crate::backend::cpu::{kv_block_bytes, CpuBackend};
use crate::backend::{Backend, BackendError, SeqBatch};
use crate::kv::{KvCacheManager, OutOfBlocks, SeqId};
use crate::model::Model;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    OutOfBlocks(#[from] OutOfBlocks),
    #[error("prompt of {len} tokens exceeds the context length {ctx}")]
    PromptTooLong { len: usize, ctx: usize },
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("sequence {0:?} is not in the KV cache")]
    UnknownSequence(SeqId),
    #[error("a step asked for {wanted} logits rows of a span of {tokens} tokens")]
    BadLogitsCount { wanted: usize, tokens: usize },
    #[error("sequence {0:?} appears twice in one step")]
    DuplicateSequence(SeqId),
}

/// One sequence's part of [`Engine::run`]: append `tokens`, return the logits of the last
/// `n_logits` of them.
#[derive(Clone, Copy, Debug)]
pub struct RunItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub n_logits: usize,
}

/// A backend, its KV cache bookkeeping and reusable logits storage.
pub struct Engine<B: Backend> {
    pub backend: B,
    pub kv: KvCacheManager,
    logits: Vec<f32>,
    prefill_chunk: usize,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Engine({}, {:?})", self.backend.name(), self.kv.stats())
    }
}

/// The in-engine greedy choice: the greedy plugin's own argmax (first maximum on ties), so both
/// paths pick the same token.
pub use inferd_plugin_api::sampling::argmax;

impl Engine<CpuBackend> {
    /// A CPU engine for `model`, its KV pool sized from `opts.kv_budget_bytes`.
    pub fn cpu(model: &Model, opts: &EngineOptions) -> Self {
        let blocks = (opts.kv_budget_bytes / kv_block_bytes(&model.config, opts.block_size)).max(1);
        let backend = CpuBackend::new(model.config.clone(), model.weights.clone(), blocks, opts.block_size, opts.threads());
        Engine::new(backend, opts.prefill_chunk)
    }
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, prefill_chunk: usize) -> Self {
        let kv = KvCacheManager::new(backend.kv_blocks(), backend.block_size());
        Engine { backend, kv, logits: Vec::new(), prefill_chunk: prefill_chunk.max(1) }
    }

    pub fn vocab(&self) -> usize {
        self.backend.config().vocab
    }

    /// Prefills every prompt (reusing cached prefix blocks, in chunks of at most `prefill_chunk`
    /// tokens per step across the batch) and returns each new sequence with its last-position
    /// logits. On error every sequence created here is freed again.
    pub fn prefill(&mut self, prompts: &[&[u32]]) -> Result<Vec<(SeqId, Vec<f32>)>, EngineError> {
        let ctx = self.backend.config().context_len;
        for p in prompts {
            if p.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if p.len() > ctx {
                return Err(EngineError::PromptTooLong { len: p.len(), ctx });
            }
        }
        let mut seqs: Vec<SeqId> = Vec::with_capacity(prompts.len());
        let result = self.prefill_inner(prompts, &mut seqs);
        if result.is_err() {
            seqs.iter().for_each(|&s| self.kv.free(s));
        }
        result
    }

    fn prefill_inner(&mut self, prompts: &[&[u32]], seqs: &mut Vec<SeqId>) -> Result<Vec<(SeqId, Vec<f32>)>, EngineError> {
        for p in prompts {
            let s = self.kv.create();
            seqs.push(s);
            self.kv.match_prefix(s, p);
        }
        let vocab = self.vocab();
        let mut out: Vec<Option<Vec<f32>>> = vec![None; prompts.len()];
        loop {
            // Gather this step's chunks under the token budget.
            let mut budget = self.prefill_chunk;
            let mut step: Vec<(usize, usize, usize)> = Vec::new(); // (prompt index, start, end)
            for (i, p) in prompts.iter().enumerate() {
                let done = self.kv.len(seqs[i]);
                if done < p.len() && budget > 0 {
                    let end = p.len().min(done + budget);
                    budget -= end - done;
                    step.push((i, done, end));
                }
            }
            if step.is_empty() {
                break;
            }
            let mut copies = Vec::new();
            for &(i, a, b) in &step {
                copies.extend(self.kv.append(seqs[i], &prompts[i][a..b])?);
            }
            self.backend.copy_blocks(&copies)?;
            let batch: Vec<SeqBatch<'_>> = step
                .iter()
                .map(|&(i, a, b)| SeqBatch { tokens: &prompts[i][a..b], start_pos: a, block_table: self.kv.block_table(seqs[i]), logits: usize::from(b == prompts[i].len()) })
                .collect();
            self.backend.forward(&batch, &mut self.logits)?;
            let mut row = 0;
            for &(i, _, b) in &step {
                self.kv.commit(seqs[i], b);
                if b == prompts[i].len() {
                    out[i] = Some(self.logits[row * vocab..(row + 1) * vocab].to_vec());
                    row += 1;
                }
            }
        }
        Ok(seqs.iter().zip(out).map(|(&s, l)| (s, l.unwrap_or_default())).collect())
    }

    /// One decode step: appends `token` to each sequence and returns their next-token logits,
    /// `vocab` floats per sequence in the given order.
    pub fn decode(&mut self, step: &[(SeqId, u32)]) -> Result<&[f32], EngineError> {
        let mut copies = Vec::new();
        let toks: Vec<[u32; 1]> = step.iter().map(|&(_, t)| [t]).collect();
        for (i, &(s, _)) in step.iter().enumerate() {
            match self.kv.append(s, &toks[i]) {
                Ok(c) => copies.extend(c),
                Err(e) => {
                    // Undo the slots reserved so far in this step. Copy-on-write already gave
                    // some of them a fresh last block: fill it, or the shortened sequence would
                    // keep a block whose earlier positions were never copied.
                    self.backend.copy_blocks(&copies)?;
                    for &(s2, _) in &step[..i] {
                        let len = self.kv.len(s2);
                        self.kv.truncate(s2, len - 1);
                    }
                    return Err(e.into());
                }
            }
        }
        self.backend.copy_blocks(&copies)?;
        let batch: Vec<SeqBatch<'_>> = step
            .iter()
            .zip(&toks)
            .map(|(&(s, _), t)| SeqBatch { tokens: t, start_pos: self.kv.len(s) - 1, block_table: self.kv.block_table(s), logits: 1 })
            .collect();
        if let Err(e) = self.backend.forward(&batch, &mut self.logits) {
            for &(s, _) in step {
                let len = self.kv.len(s);
                self.kv.truncate(s, len - 1);
            }
            return Err(e.into());
        }
        for &(s, _) in step {
            let len = self.kv.len(s);
            self.kv.commit(s, len);
        }
        Ok(&self.logits[..step.len() * self.vocab()])
    }

    /// Runs every item's tokens on its sequence and returns, per item, the logits of its last
    /// `n_logits` positions (`n_logits * vocab` floats). Long spans run in chunks of at most
    /// `prefill_chunk` tokens per step across the batch. On error every sequence is back at
    /// its length before the call.
    pub fn run(&mut self, items: &[RunItem<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let ctx = self.backend.config().context_len;
        for (i, it) in items.iter().enumerate() {
            if !self.kv.contains(it.seq) {
                return Err(EngineError::UnknownSequence(it.seq));
            }
            if items[..i].iter().any(|o| o.seq == it.seq) {
                return Err(EngineError::DuplicateSequence(it.seq));
            }
            if it.n_logits > it.tokens.len() {
                return Err(EngineError::BadLogitsCount { wanted: it.n_logits, tokens: it.tokens.len() });
            }
            let len = self.kv.len(it.seq) + it.tokens.len();
            if len > ctx {
                return Err(EngineError::PromptTooLong { len, ctx });
            }
        }
        let start: Vec<usize> = items.iter().map(|it| self.kv.len(it.seq)).collect();
        let result = self.run_inner(items, &start);
        if result.is_err() {
            for (it, &len) in items.iter().zip(&start) {
                self.kv.truncate(it.seq, len);
            }
        }
        result
    }

    fn run_inner(&mut self, items: &[RunItem<'_>], start: &[usize]) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.vocab();
        let mut out: Vec<Vec<f32>> = items.iter().map(|it| Vec::with_capacity(it.n_logits * vocab)).collect();
        let mut done = vec![0usize; items.len()];
        loop {
            let mut budget = self.prefill_chunk;
            let mut step: Vec<(usize, usize, usize)> = Vec::new(); // (item, start, end) within its tokens
            for (i, it) in items.iter().enumerate() {
                if done[i] < it.tokens.len() && budget > 0 {
                    let end = it.tokens.len().min(done[i] + budget);
                    budget -= end - done[i];
                    step.push((i, done[i], end));
                }
            }
            if step.is_empty() {
                return Ok(out);
            }
            let mut copies = Vec::new();
            for &(i, a, b) in &step {
                copies.extend(self.kv.append(items[i].seq, &items[i].tokens[a..b])?);
            }
            self.backend.copy_blocks(&copies)?;
            // Rows wanted from this chunk: its part of the last n_logits positions (a suffix).
            let rows = |i: usize, a: usize, b: usize| b.saturating_sub(a.max(items[i].tokens.len() - items[i].n_logits));
            let batch: Vec<SeqBatch<'_>> = step
                .iter()
                .map(|&(i, a, b)| SeqBatch { tokens: &items[i].tokens[a..b], start_pos: start[i] + a, block_table: self.kv.block_table(items[i].seq), logits: rows(i, a, b) })
                .collect();
            self.backend.forward(&batch, &mut self.logits)?;
            let mut row = 0;
            for &(i, a, b) in &step {
                self.kv.commit(items[i].seq, start[i] + b);
                let r = rows(i, a, b);
                out[i].extend_from_slice(&self.logits[row * vocab..(row + r) * vocab]);
                row += r;
                done[i] = b;
            }
        }
    }

    pub fn release(&mut self, s: SeqId) {
        self.kv.free(s);
    }

    /// Greedy generation for a batch of prompts, decoded together; each stops after `max_new`
    /// tokens or at a `stop` token (included). `on_token(i, id)` sees tokens as they are chosen.
    pub fn generate_greedy(&mut self, prompts: &[&[u32]], max_new: usize, stop: &[u32], on_token: &mut dyn FnMut(usize, u32)) -> Result<Vec<Vec<u32>>, EngineError> {
        let started = self.prefill(prompts)?;
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut live: Vec<(usize, SeqId, u32)> = Vec::new();
        for (i, (s, logits)) in started.into_iter().enumerate() {
            if max_new == 0 {
                self.kv.free(s);
                continue;
            }
            let t = argmax(&logits);
            out[i].push(t);
            on_token(i, t);
            if stop.contains(&t) || max_new == 1 {
                self.kv.free(s);
            } else {
                live.push((i, s, t));
            }
        }
        let vocab = self.vocab();
        let result = (|| {
            while !live.is_empty() {
                let step: Vec<(SeqId, u32)> = live.iter().map(|&(_, s, t)| (s, t)).collect();
                let logits = self.decode(&step)?;
                let next: Vec<u32> = (0..live.len()).map(|j| argmax(&logits[j * vocab..(j + 1) * vocab])).collect();
                let mut keep = Vec::with_capacity(live.len());
                for (&(i, s, _), t) in live.iter().zip(next) {
                    out[i].push(t);
                    on_token(i, t);
                    if stop.contains(&t) || out[i].len() >= max_new {
                        self.kv.free(s);
                    } else {
                        keep.push((i, s, t));
                    }
                }
                live = keep;
            }
            Ok(())
        })();
        if result.is_err() {
            live.iter().for_each(|&(_, s, _)| self.kv.free(s));
        }
        result.map(|()| out)
    }
}
