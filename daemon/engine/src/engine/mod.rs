//! The engine step: a batch of sequences, each appending a span of tokens (a prompt, a chunk of
//! one, a decode token, draft tokens to verify), run through a [`Backend`] over the paged KV
//! cache, returning logits for the positions that asked.
//!
//! One code path serves prefill, decode and everything between ([`Engine::step`]); `prefill`,
//! `decode` and `generate_greedy` are thin conveniences over it. A step checks before it
//! mutates, as vLLM's `allocate_slots` does: every item is validated and the blocks the whole
//! step needs (new blocks and copy-on-write copies) are counted against the free pool first
//! ([`Engine::check`]). Running out of blocks is therefore an answer that changed nothing, never
//! a half-applied step to roll back; the scheduler decides what to free and asks again.

mod media;
pub mod options;
pub mod pooling;

pub use options::EngineOptions;
pub use pooling::Pooler;

use crate::backend::{Backend, BackendError, BackendKind, SeqBatch};
use crate::kv::{KvCacheManager, OutOfBlocks, SeqId};
use crate::model::rank::RankHead;
use crate::model::Model;
use std::sync::Arc;

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
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    BadToken { token: u32, vocab: usize },
    /// An image the engine cannot take (no projector, a prompt with no room for it).
    #[error("{0}")]
    Image(String),
}

/// One sequence's part of a step: append `tokens`, return the logits of the last `n_logits`
/// of them (or, `hidden`, their final hidden states: an embedding's rows).
#[derive(Clone, Copy, Debug)]
pub struct RunItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub n_logits: usize,
    pub hidden: bool,
}

impl<'a> RunItem<'a> {
    /// An item whose last `n_logits` positions return logits.
    pub fn logits(seq: SeqId, tokens: &'a [u32], n_logits: usize) -> Self {
        RunItem { seq, tokens, n_logits, hidden: false }
    }
}

/// A backend, its KV cache bookkeeping and reusable logits storage.
pub struct Engine {
    pub backend: Box<dyn Backend>,
    pub kv: KvCacheManager,
    /// The last step's logits, item-major: `n_logits * vocab` floats per item, in item order.
    logits: Vec<f32>,
    /// One forward's logits rows (position order) when a step takes several, before they are
    /// placed in `logits`.
    rows: Vec<f32>,
    prefill_chunk: usize,
    /// A reranker's head, for its poolers ([`Engine::pooler`]).
    rank: Option<Arc<RankHead>>,
    /// A vision encoder, where the model takes images (`media.rs`).
    vision: Option<Arc<crate::vision::VisionEncoder>>,
    /// The images of live requests, as media ids, and recent images' embeddings.
    pub media: crate::vision::media::MediaTable,
    /// Images being encoded beside the steps (`media.rs`).
    encoding: media::Encoding,
    /// The model rotates by M-RoPE coordinates: an image's tokens take 2-D positions
    /// ([`Engine::mrope`]).
    mrope: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Engine({}, {:?})", self.backend.name(), self.kv.stats())
    }
}

/// The in-engine greedy choice: the greedy plugin's own argmax (first maximum on ties), so both
/// paths pick the same token.
pub use inferd_plugin_api::sampling::argmax;

impl Engine {
    /// An engine for `model` on the backend `kind` names, its KV pool sized from `opts`.
    pub fn open(model: &Model, kind: BackendKind, opts: &EngineOptions) -> Result<Self, EngineError> {
        Ok(Self::open_with_reason(model, kind, opts)?.0)
    }

    /// [`Engine::open`], and why its backend ([`crate::backend::open_with_reason`]).
    pub fn open_with_reason(
        model: &Model,
        kind: BackendKind,
        opts: &EngineOptions,
    ) -> Result<(Self, String), EngineError> {
        let (backend, why) = crate::backend::open_with_reason(kind, model, opts)?;
        let mut engine = Engine::new(backend, opts.prefill_chunk);
        engine.kv = engine.kv.with_turn_ends(model.tokenizer.eos());
        engine.rank = model.rank.clone();
        engine.vision = model.vision.clone();
        engine.mrope = model.arch.mrope.is_some();
        Ok((engine, why))
    }

    /// A CPU engine for `model` (the CPU backend exists everywhere; it refuses an architecture
    /// it does not run).
    pub fn cpu(model: &Model, opts: &EngineOptions) -> Result<Self, EngineError> {
        Self::open(model, BackendKind::Cpu, opts)
    }

    pub fn new(backend: Box<dyn Backend>, prefill_chunk: usize) -> Self {
        let kv =
            KvCacheManager::with_groups(backend.kv_blocks(), backend.block_size(), backend.kv_groups().windows.clone())
                .with_states(backend.state_slots());
        Engine {
            backend,
            kv,
            logits: Vec::new(),
            rows: Vec::new(),
            prefill_chunk: prefill_chunk.max(1),
            rank: None,
            vision: None,
            mrope: false,
            media: Default::default(),
            encoding: Default::default(),
        }
    }

    /// The pooling of a text of `total` tokens into its embedding (or a reranker's scores).
    pub fn pooler(&self, total: usize) -> Pooler {
        Pooler::new(self.backend.config(), self.rank.clone(), total)
    }

    pub fn vocab(&self) -> usize {
        self.backend.config().vocab
    }

    /// Whether [`Engine::step`] would run `items`: every sequence known and named once, every
    /// token in the vocabulary, every span within the context, and the blocks the whole step
    /// needs free. Changes nothing.
    pub fn check(&self, items: &[RunItem<'_>]) -> Result<(), EngineError> {
        let (ctx, vocab) = (self.backend.config().context_len, self.vocab());
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
            if let Some(&token) = it.tokens.iter().find(|&&t| !self.known(t)) {
                return Err(EngineError::BadToken { token, vocab });
            }
            let len = self.kv.len(it.seq) + it.tokens.len();
            if len > ctx {
                return Err(EngineError::PromptTooLong { len, ctx });
            }
        }
        let spans: Vec<(SeqId, usize)> = items.iter().map(|it| (it.seq, it.tokens.len())).collect();
        let needed = self.kv.blocks_needed_for_step(&spans);
        let free = self.kv.stats().free;
        if needed > free {
            return Err(OutOfBlocks { needed, free, states: false }.into());
        }
        let (needed, free) = (self.kv.states_needed_for_step(&spans), self.kv.state_slots().1);
        if needed > free {
            return Err(OutOfBlocks { needed, free, states: true }.into());
        }
        Ok(())
    }

    /// Whether `tokens` can start a sequence: not empty, within the context, every token in
    /// the vocabulary. (A text checked when it is queued, not at a step it shares with others.)
    pub fn check_prompt(&self, tokens: &[u32]) -> Result<(), EngineError> {
        let (ctx, vocab) = (self.backend.config().context_len, self.vocab());
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if tokens.len() > ctx {
            return Err(EngineError::PromptTooLong { len: tokens.len(), ctx });
        }
        match tokens.iter().find(|&&t| !self.known(t)) {
            Some(&token) => Err(EngineError::BadToken { token, vocab }),
            None => Ok(()),
        }
    }

    /// Runs one step: each item's tokens are appended to its sequence and the logits of its
    /// last `n_logits` positions returned (`n_logits * vocab` floats per item). Spans longer
    /// than the prefill chunk run in several forwards of at most `prefill_chunk` tokens across
    /// the batch. Checked first ([`Engine::check`]): an error there, running out of blocks
    /// included, leaves everything as it was.
    pub fn step(&mut self, items: &[RunItem<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let widths: Vec<usize> = items.iter().map(|it| it.n_logits * self.width(it)).collect();
        self.step_flat(items)?;
        let mut at = 0;
        Ok(widths
            .into_iter()
            .map(|n| {
                let rows = self.logits[at..at + n].to_vec();
                at += n;
                rows
            })
            .collect())
    }

    /// The width of the model and of an image's input row (its deepstack rows too), and
    /// whether an image's positions see each other both ways.
    fn embedding_form(&self) -> ((usize, usize), bool) {
        let hidden = self.backend.config().hidden;
        let width = self.vision.as_ref().map_or(hidden, |v| v.config.out_width);
        ((hidden, width), self.vision.as_ref().is_some_and(|v| v.bidirectional()))
    }

    /// Floats in one of `it`'s rows: the vocabulary's logits, or a hidden state.
    fn width(&self, it: &RunItem<'_>) -> usize {
        if it.hidden {
            self.backend.config().hidden
        } else {
            self.vocab()
        }
    }

    /// [`Engine::step`] into the engine's own buffer, item-major.
    fn step_flat(&mut self, items: &[RunItem<'_>]) -> Result<&[f32], EngineError> {
        self.check(items)?;
        let start: Vec<usize> = items.iter().map(|it| self.kv.len(it.seq)).collect();
        // Every slot of the step is reserved here, copy-on-write included; `check` counted them.
        let mut copies = Vec::new();
        for it in items {
            match self.kv.append(it.seq, it.tokens) {
                Ok(c) => copies.extend(c),
                Err(e) => {
                    // Unreachable while `check` and `append` agree; leave nothing behind.
                    self.backend.copy_blocks(&copies)?;
                    self.backend.copy_states(&self.kv.take_state_copies())?;
                    self.undo(items, &start);
                    return Err(e.into());
                }
            }
        }
        // Checkpoints of recurrent states for the prefix cache, from slots the step left.
        let spans: Vec<(SeqId, usize)> = items.iter().map(|it| (it.seq, it.tokens.len())).collect();
        self.kv.plan_checkpoints(&spans);
        let states = self.kv.take_state_copies();
        let result = (self.backend.copy_blocks(&copies))
            .and_then(|()| self.backend.copy_states(&states))
            .map_err(EngineError::from)
            .and_then(|()| self.forward_all(items, &start));
        if result.is_err() {
            // The backend validates every batch before computing; a failure here is a bug, and
            // the sequences go back to where they were.
            self.undo(items, &start);
        }
        result?;
        // Only now may the window groups let go of what the step moved past: an undo above
        // goes back to where the step started, which must still be there.
        for it in items {
            self.kv.slide(it.seq);
        }
        Ok(&self.logits)
    }

    fn undo(&mut self, items: &[RunItem<'_>], start: &[usize]) {
        for (it, &len) in items.iter().zip(start) {
            // Back to the step's start: nothing before it was released during the step
            // (`slide` runs after a step succeeds), so this is never refused.
            let _ = self.kv.truncate(it.seq, len);
        }
    }

    /// The forwards of a reserved step, in chunks under the prefill budget.
    fn forward_all(&mut self, items: &[RunItem<'_>], start: &[usize]) -> Result<(), EngineError> {
        if items.iter().map(|it| it.tokens.len()).sum::<usize>() <= self.prefill_chunk {
            // One forward (every decode step): its rows, sequence by sequence, already are the
            // item-major logits, written in place.
            let needs =
                (items.iter().zip(start)).map(|(it, &s)| self.needs(it.tokens, s)).collect::<Result<Vec<_>, _>>()?;
            let (hidden, both) = self.embedding_form();
            let embeds: Vec<_> = needs.iter().map(|n| media::embedded(n, hidden, both)).collect();
            let mrope = (items.iter().zip(start))
                .map(|(it, &s)| self.mrope(it.seq, s, s + it.tokens.len()))
                .collect::<Result<Vec<_>, _>>()?;
            let batch: Vec<SeqBatch<'_>> = items
                .iter()
                .zip(start)
                .zip(embeds.iter().zip(&mrope))
                .filter(|((it, _), _)| !it.tokens.is_empty())
                .map(|((it, &s), (e, m))| SeqBatch {
                    tokens: it.tokens,
                    start_pos: s,
                    block_tables: self.kv.block_tables(it.seq),
                    state: self.kv.state(it.seq),
                    checkpoint: self.kv.checkpoint(it.seq, s, s + it.tokens.len()),
                    logits: it.n_logits,
                    hidden: it.hidden,
                    embeds: e,
                    mrope: m,
                })
                .collect();
            self.logits.clear();
            if !batch.is_empty() {
                self.backend.forward(&batch, &mut self.logits)?;
            }
            for (it, &s) in items.iter().zip(start) {
                self.kv.commit(it.seq, s + it.tokens.len());
            }
            return Ok(());
        }
        // Where each item's rows go in `logits`, and how many it has received.
        let mut offset = Vec::with_capacity(items.len());
        let mut total = 0;
        let widths: Vec<usize> = items.iter().map(|it| self.width(it)).collect();
        for (it, w) in items.iter().zip(&widths) {
            offset.push(total);
            total += it.n_logits * w;
        }
        self.logits.clear();
        self.logits.resize(total, 0.0);
        let mut done = vec![0usize; items.len()];
        loop {
            let mut budget = self.prefill_chunk;
            let mut chunk: Vec<(usize, usize, usize)> = Vec::new(); // (item, start, end) within its tokens
            for (i, it) in items.iter().enumerate() {
                if done[i] < it.tokens.len() && budget > 0 {
                    let end = self.image_end(it.tokens, it.tokens.len().min(done[i] + budget));
                    budget = budget.saturating_sub(end - done[i]);
                    chunk.push((i, done[i], end));
                }
            }
            if chunk.is_empty() {
                return Ok(());
            }
            // Rows wanted from this chunk: its part of the last n_logits positions (a suffix).
            let rows =
                |i: usize, a: usize, b: usize| b.saturating_sub(a.max(items[i].tokens.len() - items[i].n_logits));
            let needs = (chunk.iter())
                .map(|&(i, a, b)| self.needs(&items[i].tokens[a..b], start[i] + a))
                .collect::<Result<Vec<_>, _>>()?;
            let (hidden, both) = self.embedding_form();
            let embeds: Vec<_> = needs.iter().map(|n| media::embedded(n, hidden, both)).collect();
            let mrope = (chunk.iter())
                .map(|&(i, a, b)| self.mrope(items[i].seq, start[i] + a, start[i] + b))
                .collect::<Result<Vec<_>, _>>()?;
            let batch: Vec<SeqBatch<'_>> = chunk
                .iter()
                .zip(embeds.iter().zip(&mrope))
                .map(|(&(i, a, b), (e, m))| SeqBatch {
                    tokens: &items[i].tokens[a..b],
                    start_pos: start[i] + a,
                    block_tables: self.kv.block_tables(items[i].seq),
                    state: self.kv.state(items[i].seq),
                    checkpoint: self.kv.checkpoint(items[i].seq, start[i] + a, start[i] + b),
                    logits: rows(i, a, b),
                    hidden: items[i].hidden,
                    embeds: e,
                    mrope: m,
                })
                .collect();
            self.backend.forward(&batch, &mut self.rows)?;
            let mut at = 0;
            for &(i, a, b) in &chunk {
                self.kv.commit(items[i].seq, start[i] + b);
                let (r, w) = (rows(i, a, b), widths[i]);
                // Rows this item already has: its wanted positions before `a`.
                let placed = a.saturating_sub(items[i].tokens.len() - items[i].n_logits);
                let dst = offset[i] + placed * w;
                self.logits[dst..dst + r * w].copy_from_slice(&self.rows[at..at + r * w]);
                at += r * w;
                done[i] = b;
            }
        }
    }

    /// Prefills every prompt as one step (reusing cached prefix blocks) and returns each new
    /// sequence with its last-position logits. On error every sequence created here is freed.
    pub fn prefill(&mut self, prompts: &[&[u32]]) -> Result<Vec<(SeqId, Vec<f32>)>, EngineError> {
        for p in prompts {
            self.check_prompt(p)?;
        }
        let seqs: Vec<SeqId> = prompts.iter().map(|_| self.kv.create()).collect();
        let cached: Vec<usize> = seqs.iter().zip(prompts).map(|(&s, p)| self.kv.match_prefix(s, p)).collect();
        let items: Vec<RunItem<'_>> =
            seqs.iter().zip(prompts).zip(&cached).map(|((&seq, p), &c)| RunItem::logits(seq, &p[c..], 1)).collect();
        match self.step(&items) {
            Ok(logits) => Ok(seqs.into_iter().zip(logits).collect()),
            Err(e) => {
                seqs.iter().for_each(|&s| self.kv.free(s));
                Err(e)
            }
        }
    }

    /// A text embedding of `tokens`: their final hidden states (after the output norm) pooled
    /// as the model says, L2-normalized ([`Pooler`]). Runs in prefill-sized steps on a
    /// sequence of its own (its full blocks join the prefix cache as a prompt's would), freed
    /// before it returns. The daemon does not call this: its embeddings run as work in the
    /// scheduler's steps, batched with everything else, through the same [`RunItem::hidden`].
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.check_prompt(tokens)?;
        let seq = self.kv.create();
        let mut pool = self.pooler(tokens.len());
        let mut run = || {
            for chunk in tokens.chunks(self.prefill_chunk) {
                let rows = self.step(&[RunItem { seq, tokens: chunk, n_logits: chunk.len(), hidden: true }])?;
                pool.take(&rows[0]);
            }
            Ok(())
        };
        let ran = run();
        self.kv.free(seq);
        ran.map(|()| pool.finish())
    }

    /// One decode step: appends `token` to each sequence and returns their next-token logits,
    /// `vocab` floats per sequence in the given order.
    pub fn decode(&mut self, step: &[(SeqId, u32)]) -> Result<&[f32], EngineError> {
        let toks: Vec<[u32; 1]> = step.iter().map(|&(_, t)| [t]).collect();
        let items: Vec<RunItem<'_>> = step.iter().zip(&toks).map(|(&(seq, _), t)| RunItem::logits(seq, t, 1)).collect();
        self.step_flat(&items)
    }

    pub fn release(&mut self, s: SeqId) {
        self.kv.free(s);
    }

    /// Greedy generation for a batch of prompts, decoded together; each stops after `max_new`
    /// tokens or at a `stop` token (included). `on_token(i, id)` sees tokens as they are chosen.
    pub fn generate_greedy(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop: &[u32],
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<Vec<u32>>, EngineError> {
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
