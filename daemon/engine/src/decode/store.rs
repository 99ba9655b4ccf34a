//! Sequences as decoding strategies see them: token lists that can be created, forked,
//! truncated and freed, and run in batches that return logits. [`EngineStore`] backs them with
//! the engine and its paged KV cache; `mock.rs`'s [`MockStore`](super::mock::MockStore) with a
//! function from a token prefix to the next token's logits, for tests and `inferd plugin probe`.

pub use super::mock::{LogitsFn, MockStore};
use crate::engine::{Engine, EngineError, Pooler, RunItem};
use crate::kv::SeqId;
use crate::vision::media::PromptImage;
use inferd_plugin_api::abi;
use std::collections::HashMap;

/// A sequence in a [`SeqStore`].
pub type StoreSeq = u32;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no draft model is bound to this model")]
    NoDraftModel,
    #[error("unknown sequence role {0}")]
    UnknownRole(u32),
    #[error("sequence {0} is not in the store")]
    UnknownSequence(StoreSeq),
    #[error("asked for {wanted} logits rows but only {tokens} tokens run")]
    BadLogitsCount { wanted: usize, tokens: usize },
    #[error(transparent)]
    Rollback(#[from] crate::kv::RollbackError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("this store computes no embeddings")]
    NoEmbeddings,
    #[error("embedding sequence {seq} has {left} tokens not run yet")]
    EmbeddingNotRun { seq: StoreSeq, left: usize },
}

impl StoreError {
    /// The ABI status for a callback that failed with this error.
    pub fn status(&self) -> i32 {
        match self {
            StoreError::Engine(EngineError::OutOfBlocks(_)) => abi::ERR_NO_MEMORY,
            StoreError::Engine(_) => abi::ERR,
            _ => abi::ERR_INVALID,
        }
    }
}

/// One sequence's part of a [`SeqStore::run`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRun {
    pub seq: StoreSeq,
    pub tokens: Vec<u32>,
    pub n_logits: usize,
}

pub trait SeqStore {
    fn vocab(&self) -> usize;
    /// Bit `1 << abi::ROLE_*` for each role [`SeqStore::create`] accepts.
    fn roles(&self) -> u32;
    /// A new sequence of `role` (`abi::ROLE_*`) holding `prompt`, not yet run.
    fn create(&mut self, role: u32, prompt: &[u32]) -> Result<StoreSeq, StoreError>;
    /// A copy-on-write copy of `s`.
    fn fork(&mut self, s: StoreSeq) -> Result<StoreSeq, StoreError>;
    /// Keeps the first `len` tokens; refused, changing nothing, where a sliding-window model
    /// has already released what the next token would attend to.
    fn truncate(&mut self, s: StoreSeq, len: usize) -> Result<(), StoreError>;
    fn free(&mut self, s: StoreSeq);
    fn tokens(&self, s: StoreSeq) -> Vec<u32>;
    /// Appends each item's tokens, runs everything not run yet and returns the logits of each
    /// item's last `n_logits` positions. On error nothing changed.
    fn run(&mut self, items: &[StoreRun]) -> Result<Vec<Vec<f32>>, StoreError>;
    /// Target-model KV blocks free (evictable cached ones included) and tokens per block, when
    /// the store has a bounded cache (admission control).
    fn capacity(&self) -> Option<(usize, usize)> {
        None
    }
    /// Tokens of `s` appended but not run yet (a fresh prompt after its cached prefix).
    fn pending(&self, _s: StoreSeq) -> usize {
        0
    }
    /// Gives the memory of free KV blocks back to the system (an idle engine's; their cached
    /// prefixes are forgotten). Returns the blocks released.
    fn release_free(&mut self) -> usize {
        0
    }
    /// The prefix-cache partition the sequences created from now on are cached in and match
    /// against (`None`: the shared one); the scheduler sets it to the request whose session
    /// it calls.
    fn set_partition(&mut self, _partition: Option<u64>) {}
    /// [`SeqStore::run`], and in the same forward pass the first `k` pending tokens of each
    /// `(seq, k)` in `prefill` (chunked prefill: no logits; the rest stays pending; an
    /// embedding's chunk is pooled). A store without pending tokens runs `items` alone.
    fn run_with_prefill(
        &mut self,
        items: &[StoreRun],
        prefill: &[(StoreSeq, usize)],
    ) -> Result<Vec<Vec<f32>>, StoreError> {
        let _ = prefill;
        self.run(items)
    }
    /// A target sequence whose tokens are pooled into an embedding as they run: all of them
    /// pending (no cached prefix is reused, since each position's hidden state is pooled), run
    /// in chunks given to [`SeqStore::run_with_prefill`] beside everything else.
    fn create_embedding(&mut self, tokens: &[u32]) -> Result<StoreSeq, StoreError> {
        let _ = tokens;
        Err(StoreError::NoEmbeddings)
    }
    /// The embedding of `s` once all its tokens have run ([`crate::engine::Pooler`]); `s` is
    /// freed either way.
    fn finish_embedding(&mut self, s: StoreSeq) -> Result<Vec<f32>, StoreError> {
        self.free(s);
        Err(StoreError::NoEmbeddings)
    }
    /// Target-model KV cache occupancy and prefix-cache counters, when the store has a cache.
    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }
    /// Registers a prompt's images with the target model: their media ids fill their positions
    /// in `prompt` ([`crate::engine::Engine::attach_images`]). Held until
    /// [`SeqStore::release_images`].
    fn attach_images(&mut self, prompt: &mut [u32], images: &mut [PromptImage]) -> Result<(), StoreError> {
        let _ = prompt;
        match images.is_empty() {
            true => Ok(()),
            false => Err(StoreError::Engine(EngineError::Image("this store takes no images".into()))),
        }
    }
    fn release_images(&mut self, images: &[PromptImage]) {
        let _ = images;
    }
    /// Whether a waiting request's images are ready to run (none still being encoded); an
    /// error names the encoder's failure on one ([`crate::engine::Engine::images_ready`]).
    fn images_ready(&mut self, images: &[PromptImage]) -> Result<bool, StoreError> {
        let _ = images;
        Ok(true)
    }
    /// Waits up to `timeout` for an image being encoded, where one is.
    fn wait_images(&mut self, timeout: std::time::Duration) {
        let _ = timeout;
    }
}

/// What [`SeqStore::cache_stats`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub kv: crate::kv::KvStats,
    /// Target prompt tokens given to [`SeqStore::create`] so far.
    pub prompt_tokens: u64,
    /// Of those, the tokens whose K/V came from the prefix cache.
    pub cached_prompt_tokens: u64,
    /// Tokens of sequences created empty and filled by their first run (a draft model's copy
    /// of the context) whose K/V came from the prefix cache.
    pub cached_run_tokens: u64,
}

/// Sequences in the engine's KV cache, and in a draft model's engine when one is bound
/// (speculative decoding); draft sequences are numbered with [`DRAFT_BIT`] set. Tokens appended
/// but not yet run (a fresh prompt after its cached prefix) wait here until the next
/// [`SeqStore::run`].
pub struct EngineStore<'e> {
    pub engine: &'e mut Engine,
    pub draft: Option<&'e mut Engine>,
    pending: HashMap<StoreSeq, Vec<u32>>,
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
    cached_run_tokens: u64,
    /// Where new sequences go in the prefix cache ([`SeqStore::set_partition`]).
    partition: Option<u64>,
    /// The embeddings being pooled, by sequence ([`SeqStore::create_embedding`]).
    pools: HashMap<StoreSeq, Pooler>,
}

/// Marks a draft-model sequence in a [`StoreSeq`].
pub const DRAFT_BIT: StoreSeq = 1 << 31;

impl<'e> EngineStore<'e> {
    pub fn new(engine: &'e mut Engine) -> Self {
        EngineStore {
            engine,
            draft: None,
            pending: HashMap::new(),
            prompt_tokens: 0,
            cached_prompt_tokens: 0,
            cached_run_tokens: 0,
            partition: None,
            pools: HashMap::new(),
        }
    }

    /// With a draft model (same vocabulary) for `abi::ROLE_DRAFT` sequences.
    pub fn with_draft(engine: &'e mut Engine, draft: &'e mut Engine) -> Self {
        EngineStore {
            engine,
            draft: Some(draft),
            pending: HashMap::new(),
            prompt_tokens: 0,
            cached_prompt_tokens: 0,
            cached_run_tokens: 0,
            partition: None,
            pools: HashMap::new(),
        }
    }

    /// The first run of a sequence created empty (a draft model's copy of the context, which a
    /// plugin creates empty and fills with a run) takes what the prefix cache holds of its
    /// tokens, as a prompt given to `create` does: the tokens of each such item already cached,
    /// now part of its sequence. The positions an item asks logits of are always run.
    fn reuse_cached(&mut self, items: &[StoreRun]) -> HashMap<StoreSeq, usize> {
        let mut skip = HashMap::new();
        for it in items {
            let keep = it.n_logits.max(1);
            if self.pending(it.seq) > 0 || skip.contains_key(&it.seq) || it.tokens.len() < keep {
                continue;
            }
            if it.seq & DRAFT_BIT != 0 && self.draft.is_none() {
                continue;
            }
            let (engine, id) = self.split(it.seq);
            if !engine.kv.contains(id) || !engine.kv.is_empty(id) {
                continue;
            }
            // At most all but the last `keep` tokens (the cache keeps one of what it is given).
            let cached = engine.kv.match_prefix(id, &it.tokens[..it.tokens.len() - keep + 1]);
            if cached > 0 {
                skip.insert(it.seq, cached);
                self.cached_run_tokens += cached as u64;
            }
        }
        skip
    }

    /// The engine holding `s`, and its id there.
    fn split(&mut self, s: StoreSeq) -> (&mut Engine, SeqId) {
        match (&mut self.draft, s & DRAFT_BIT != 0) {
            (Some(d), true) => (&mut **d, SeqId(s & !DRAFT_BIT)),
            _ => (&mut *self.engine, SeqId(s & !DRAFT_BIT)),
        }
    }

    fn engine_of(&self, s: StoreSeq) -> &Engine {
        match (&self.draft, s & DRAFT_BIT != 0) {
            (Some(d), true) => d,
            _ => self.engine,
        }
    }

    /// The spans `items` (their pending tokens first) and the `prefill` chunks of pending
    /// tokens append (an embedding's chunk asks for every position's hidden state).
    fn spans(&self, items: &[&StoreRun], prefill: &[(StoreSeq, usize)], skip: &HashMap<StoreSeq, usize>) -> Vec<Span> {
        let pending = |s: &StoreSeq| self.pending.get(s).into_iter().flatten();
        let whole = items.iter().map(|it| Span {
            seq: SeqId(it.seq & !DRAFT_BIT),
            tokens: pending(&it.seq).chain(&it.tokens[skip.get(&it.seq).copied().unwrap_or(0)..]).copied().collect(),
            rows: it.n_logits,
            hidden: false,
        });
        let chunks = prefill.iter().map(|(s, k)| {
            let hidden = self.pools.contains_key(s);
            Span {
                seq: SeqId(s & !DRAFT_BIT),
                tokens: pending(s).take(*k).copied().collect(),
                rows: if hidden { *k } else { 0 },
                hidden,
            }
        });
        whole.chain(chunks).collect()
    }
}

/// A sequence's part of an engine step: its tokens, how many of the last positions return a
/// row, and whether those rows are hidden states (an embedding's) rather than logits.
struct Span {
    seq: SeqId,
    tokens: Vec<u32>,
    rows: usize,
    hidden: bool,
}

fn run_items(spans: &[Span]) -> Vec<RunItem<'_>> {
    spans.iter().map(|s| RunItem { seq: s.seq, tokens: &s.tokens, n_logits: s.rows, hidden: s.hidden }).collect()
}

impl SeqStore for EngineStore<'_> {
    fn vocab(&self) -> usize {
        self.engine.vocab()
    }

    fn roles(&self) -> u32 {
        1 << abi::ROLE_TARGET | if self.draft.is_some() { 1 << abi::ROLE_DRAFT } else { 0 }
    }

    fn capacity(&self) -> Option<(usize, usize)> {
        Some((self.engine.kv.stats().free, self.engine.kv.block_size()))
    }

    fn set_partition(&mut self, partition: Option<u64>) {
        self.partition = partition;
    }

    fn release_free(&mut self) -> usize {
        let mut n = 0;
        for e in std::iter::once(&mut *self.engine).chain(self.draft.as_deref_mut()) {
            let blocks = e.kv.take_dirty_free();
            e.backend.release_blocks(&blocks);
            n += blocks.len();
        }
        n
    }

    /// Registers the images and starts encoding those the partition's prefix cache does not
    /// hold.
    fn attach_images(&mut self, prompt: &mut [u32], images: &mut [PromptImage]) -> Result<(), StoreError> {
        self.engine.attach_images(prompt, images)?;
        self.engine.start_encodes(prompt, images, self.partition);
        Ok(())
    }

    fn release_images(&mut self, images: &[PromptImage]) {
        self.engine.release_images(images);
    }

    fn images_ready(&mut self, images: &[PromptImage]) -> Result<bool, StoreError> {
        Ok(self.engine.images_ready(images)?)
    }

    fn wait_images(&mut self, timeout: std::time::Duration) {
        self.engine.wait_images(timeout);
    }

    fn create_embedding(&mut self, tokens: &[u32]) -> Result<StoreSeq, StoreError> {
        // Checked here, not at its chunks' step, where one bad text would fail everyone's.
        self.engine.check_prompt(tokens)?;
        let s = self.engine.kv.create_in(self.partition).0;
        self.pending.insert(s, tokens.to_vec());
        self.pools.insert(s, self.engine.pooler(tokens.len()));
        Ok(s)
    }

    fn finish_embedding(&mut self, s: StoreSeq) -> Result<Vec<f32>, StoreError> {
        let pool = self.pools.remove(&s);
        self.free(s);
        match pool {
            Some(p) if p.remaining() == 0 => Ok(p.finish()),
            Some(p) => Err(StoreError::EmbeddingNotRun { seq: s, left: p.remaining() }),
            None => Err(StoreError::UnknownSequence(s)),
        }
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        Some(CacheStats {
            kv: self.engine.kv.stats(),
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
            cached_run_tokens: self.cached_run_tokens,
        })
    }

    fn create(&mut self, role: u32, prompt: &[u32]) -> Result<StoreSeq, StoreError> {
        let (engine, bit) = match role {
            abi::ROLE_TARGET => (&mut *self.engine, 0),
            abi::ROLE_DRAFT => (self.draft.as_deref_mut().ok_or(StoreError::NoDraftModel)?, DRAFT_BIT),
            r => return Err(StoreError::UnknownRole(r)),
        };
        let s = engine.kv.create_in(self.partition);
        let cached = engine.kv.match_prefix(s, prompt);
        if bit == 0 {
            self.prompt_tokens += prompt.len() as u64;
            self.cached_prompt_tokens += cached as u64;
        }
        self.pending.insert(s.0 | bit, prompt[cached..].to_vec());
        Ok(s.0 | bit)
    }

    fn fork(&mut self, s: StoreSeq) -> Result<StoreSeq, StoreError> {
        let (engine, id) = self.split(s);
        let new = engine.kv.fork(id).0 | (s & DRAFT_BIT);
        let p = self.pending.get(&s).cloned().unwrap_or_default();
        self.pending.insert(new, p);
        Ok(new)
    }

    fn truncate(&mut self, s: StoreSeq, len: usize) -> Result<(), StoreError> {
        let (engine, id) = self.split(s);
        let run = engine.kv.len(id);
        if len <= run {
            engine.kv.truncate(id, len)?;
            self.pending.entry(s).or_default().clear();
        } else {
            self.pending.entry(s).or_default().truncate(len - run);
        }
        Ok(())
    }

    fn free(&mut self, s: StoreSeq) {
        let (engine, id) = self.split(s);
        engine.kv.free(id);
        self.pending.remove(&s);
        self.pools.remove(&s);
    }

    fn tokens(&self, s: StoreSeq) -> Vec<u32> {
        let mut t = self.engine_of(s).kv.tokens(SeqId(s & !DRAFT_BIT)).to_vec();
        t.extend(self.pending.get(&s).into_iter().flatten());
        t
    }

    fn run(&mut self, items: &[StoreRun]) -> Result<Vec<Vec<f32>>, StoreError> {
        self.run_with_prefill(items, &[])
    }

    fn pending(&self, s: StoreSeq) -> usize {
        self.pending.get(&s).map_or(0, Vec::len)
    }

    fn run_with_prefill(
        &mut self,
        items: &[StoreRun],
        prefill: &[(StoreSeq, usize)],
    ) -> Result<Vec<Vec<f32>>, StoreError> {
        let skip = self.reuse_cached(items);
        let ran = self.run_spans(items, prefill, &skip);
        if ran.is_err() {
            // The sequences go back to empty, as the caller left them.
            for &s in skip.keys() {
                let (engine, id) = self.split(s);
                let _ = engine.kv.truncate(id, 0);
            }
        }
        ran
    }
}

impl EngineStore<'_> {
    /// [`SeqStore::run_with_prefill`] once cached prefixes are taken (`skip`).
    fn run_spans(
        &mut self,
        items: &[StoreRun],
        prefill: &[(StoreSeq, usize)],
        skip: &HashMap<StoreSeq, usize>,
    ) -> Result<Vec<Vec<f32>>, StoreError> {
        type Indexed<'a> = Vec<(usize, &'a StoreRun)>;
        // Chunks of target sequences that are not also run whole, at most what is pending.
        let prefill: Vec<(StoreSeq, usize)> = prefill
            .iter()
            .filter(|(s, _)| s & DRAFT_BIT == 0 && !items.iter().any(|it| it.seq == *s))
            .map(|&(s, k)| (s, k.min(self.pending(s))))
            // Never inside an image whose positions see each other both ways.
            .map(|(s, k)| (s, self.engine.image_end(self.pending.get(&s).map_or(&[][..], Vec::as_slice), k)))
            .filter(|&(_, k)| k > 0)
            .collect();
        let (draft, target): (Indexed<'_>, Indexed<'_>) =
            items.iter().enumerate().partition(|(_, it)| it.seq & DRAFT_BIT != 0);
        let t_items: Vec<&StoreRun> = target.iter().map(|x| x.1).collect();
        let d_items: Vec<&StoreRun> = draft.iter().map(|x| x.1).collect();
        let t_spans = self.spans(&t_items, &prefill, skip);
        let d_spans = self.spans(&d_items, &[], skip);
        // When both engines run, both halves are checked before either does, so a step that
        // does not fit changes nothing (`Engine::step` checks its own half in any case).
        if !d_spans.is_empty() {
            let d = self.draft.as_deref().ok_or(StoreError::NoDraftModel)?;
            if !t_spans.is_empty() {
                self.engine.check(&run_items(&t_spans))?;
                d.check(&run_items(&d_spans))?;
            }
        }
        let before: Vec<usize> = t_spans.iter().map(|s| self.engine.kv.len(s.seq)).collect();
        let mut t_out = if t_spans.is_empty() { Vec::new() } else { self.engine.step(&run_items(&t_spans))? };
        let d_out = match self.draft.as_deref_mut() {
            Some(d) if !d_spans.is_empty() => match d.step(&run_items(&d_spans)) {
                Ok(o) => o,
                Err(e) => {
                    // Only a backend fault gets here (both halves were checked): undo the target.
                    for (s, &len) in t_spans.iter().zip(&before) {
                        // Refused only where the target's step moved its window past `len`;
                        // the sequence then stays run, and the error below still says why.
                        let _ = self.engine.kv.truncate(s.seq, len);
                    }
                    return Err(e.into());
                }
            },
            _ => Vec::new(),
        };
        // Rows past the items' are the chunks': an embedding's are pooled.
        for ((s, _), rows) in prefill.iter().zip(t_out.drain(t_items.len()..)) {
            if let Some(p) = self.pools.get_mut(s) {
                p.take(&rows);
            }
        }
        for it in items {
            self.pending.remove(&it.seq);
        }
        for &(s, k) in &prefill {
            if let Some(p) = self.pending.get_mut(&s) {
                p.drain(..k);
            }
        }
        let mut out = vec![Vec::new(); items.len()];
        for ((i, _), o) in target.into_iter().zip(t_out).chain(draft.into_iter().zip(d_out)) {
            out[i] = o;
        }
        Ok(out)
    }
}
