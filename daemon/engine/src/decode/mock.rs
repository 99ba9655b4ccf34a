//! Sequences as plain token lists over logits functions, a [`SeqStore`] without a model: tests
//! of strategies and of the scheduler, and `inferd plugin probe`.

use super::store::{SeqStore, StoreError, StoreRun, StoreSeq};
use crate::engine::EngineError;
use crate::vision::media::{pixel_hash, PromptImage};
use inferd_plugin_api::abi;
use std::collections::HashMap;

/// The next token's logits after a prefix.
pub type LogitsFn = Box<dyn Fn(&[u32]) -> Vec<f32>>;

/// Sequences as plain token lists over logits functions: the target's, and optionally a
/// draft's (for speculative decoding tests).
///
/// With [`MockStore::with_blocks`] it also plays a bounded KV cache for scheduler tests: a
/// fresh prompt stays pending until it runs (whole or in chunks), a sequence holds a block per
/// `block_size` tokens run (forks copy, they do not share), and a run that would take more
/// blocks than are free is refused with `OutOfBlocks` before anything changes.
pub struct MockStore {
    vocab: usize,
    target: LogitsFn,
    draft: Option<LogitsFn>,
    /// Per sequence: its role, its tokens, and how many of the last ones are pending.
    seqs: HashMap<StoreSeq, (u32, Vec<u32>, usize)>,
    next: StoreSeq,
    /// Total blocks and tokens per block, when the store plays a bounded cache.
    blocks: Option<(usize, usize)>,
    /// Positions run so far, target and draft (tests measure work with it).
    pub positions_run: [usize; 2],
    /// Sequences created for an embedding.
    embeddings: std::collections::HashSet<StoreSeq>,
    /// Images (by pixel hash) still encoding (`Ok`) or failed (`Err`): the mock takes any
    /// image, ready unless listed here.
    pub encoding: HashMap<u128, Result<(), String>>,
    /// Images registered and not yet released, by pixel hash (tests check that none leaks).
    pub images_held: HashMap<u128, usize>,
}

impl MockStore {
    pub fn new(vocab: usize, target: LogitsFn) -> Self {
        MockStore {
            vocab,
            target,
            draft: None,
            seqs: HashMap::new(),
            next: 1,
            blocks: None,
            positions_run: [0; 2],
            embeddings: Default::default(),
            encoding: HashMap::new(),
            images_held: HashMap::new(),
        }
    }

    pub fn with_draft(mut self, draft: LogitsFn) -> Self {
        self.draft = Some(draft);
        self
    }

    /// A bounded cache of `total` blocks of `block_size` tokens (see the type's docs).
    pub fn with_blocks(mut self, total: usize, block_size: usize) -> Self {
        self.blocks = Some((total, block_size.max(1)));
        self
    }

    /// Sequences still alive (tests check that nothing leaks).
    pub fn live(&self) -> usize {
        self.seqs.len()
    }

    /// Blocks held by run tokens, when the store plays a bounded cache.
    pub fn blocks_used(&self) -> usize {
        let bs = self.blocks.map_or(1, |b| b.1);
        self.seqs.values().map(|(_, t, p)| (t.len() - p).div_ceil(bs)).sum()
    }

    /// Runs `items` and the first `k` pending tokens of each `(seq, k)` chunk.
    fn run_mock(&mut self, items: &[StoreRun], chunks: &[(StoreSeq, usize)]) -> Result<Vec<Vec<f32>>, StoreError> {
        // Positions each touched sequence will have run afterwards, checked against the pool.
        let mut after: HashMap<StoreSeq, usize> = HashMap::new();
        for it in items {
            let (_, t, _) = self.seqs.get(&it.seq).ok_or(StoreError::UnknownSequence(it.seq))?;
            after.insert(it.seq, t.len() + it.tokens.len());
        }
        for &(s, k) in chunks {
            if let Some((_, t, p)) = self.seqs.get(&s) {
                after.entry(s).or_insert(t.len() - p + k.min(*p));
            }
        }
        if let Some((total, bs)) = self.blocks {
            let grow: usize = after
                .iter()
                .map(|(s, &n)| {
                    let (_, t, p) = &self.seqs[s];
                    n.div_ceil(bs).saturating_sub((t.len() - p).div_ceil(bs))
                })
                .sum();
            let free = total.saturating_sub(self.blocks_used());
            if grow > free {
                return Err(StoreError::Engine(EngineError::OutOfBlocks(crate::kv::OutOfBlocks {
                    needed: grow,
                    free,
                    states: false,
                })));
            }
        }
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            let (role, mut toks, _) = self.seqs.get(&it.seq).cloned().unwrap_or_default();
            toks.extend_from_slice(&it.tokens);
            if it.n_logits > toks.len() {
                return Err(StoreError::BadLogitsCount { wanted: it.n_logits, tokens: toks.len() });
            }
            let f = if role == abi::ROLE_DRAFT { self.draft.as_ref().unwrap_or(&self.target) } else { &self.target };
            let mut rows = Vec::with_capacity(it.n_logits * self.vocab);
            for p in toks.len() - it.n_logits..toks.len() {
                rows.extend(f(&toks[..=p]));
            }
            out.push(rows);
        }
        for it in items {
            if let Some((role, t, p)) = self.seqs.get_mut(&it.seq) {
                t.extend_from_slice(&it.tokens);
                self.positions_run[usize::from(*role == abi::ROLE_DRAFT)] += it.tokens.len() + *p;
                *p = 0;
            }
        }
        for &(s, k) in chunks {
            if let Some((role, _, p)) = self.seqs.get_mut(&s) {
                let k = k.min(*p);
                self.positions_run[usize::from(*role == abi::ROLE_DRAFT)] += k;
                *p -= k;
            }
        }
        Ok(out)
    }
}

impl SeqStore for MockStore {
    fn vocab(&self) -> usize {
        self.vocab
    }

    fn roles(&self) -> u32 {
        1 << abi::ROLE_TARGET | if self.draft.is_some() { 1 << abi::ROLE_DRAFT } else { 0 }
    }

    fn create(&mut self, role: u32, prompt: &[u32]) -> Result<StoreSeq, StoreError> {
        match role {
            abi::ROLE_TARGET => {}
            abi::ROLE_DRAFT if self.draft.is_some() => {}
            abi::ROLE_DRAFT => return Err(StoreError::NoDraftModel),
            r => return Err(StoreError::UnknownRole(r)),
        }
        let s = self.next;
        self.next += 1;
        let pending = if self.blocks.is_some() { prompt.len() } else { 0 };
        self.seqs.insert(s, (role, prompt.to_vec(), pending));
        Ok(s)
    }

    fn fork(&mut self, s: StoreSeq) -> Result<StoreSeq, StoreError> {
        let copy = self.seqs.get(&s).cloned().ok_or(StoreError::UnknownSequence(s))?;
        let n = self.next;
        self.next += 1;
        self.seqs.insert(n, copy);
        Ok(n)
    }

    fn truncate(&mut self, s: StoreSeq, len: usize) -> Result<(), StoreError> {
        if let Some((_, t, p)) = self.seqs.get_mut(&s) {
            let run = t.len() - *p;
            t.truncate(len);
            *p = t.len().saturating_sub(run);
        }
        Ok(())
    }

    fn free(&mut self, s: StoreSeq) {
        self.seqs.remove(&s);
        self.embeddings.remove(&s);
    }

    /// Every token pending until it runs, bounded cache or not.
    fn create_embedding(&mut self, tokens: &[u32]) -> Result<StoreSeq, StoreError> {
        let s = self.next;
        self.next += 1;
        self.seqs.insert(s, (abi::ROLE_TARGET, tokens.to_vec(), tokens.len()));
        self.embeddings.insert(s);
        Ok(s)
    }

    /// The mock's embedding of a text: its length and the sum of its tokens.
    fn finish_embedding(&mut self, s: StoreSeq) -> Result<Vec<f32>, StoreError> {
        let seq = self.seqs.get(&s).cloned().filter(|_| self.embeddings.contains(&s));
        self.free(s);
        match seq {
            Some((_, t, 0)) => Ok(vec![t.len() as f32, t.iter().sum::<u32>() as f32]),
            Some((_, _, left)) => Err(StoreError::EmbeddingNotRun { seq: s, left }),
            None => Err(StoreError::UnknownSequence(s)),
        }
    }

    fn tokens(&self, s: StoreSeq) -> Vec<u32> {
        self.seqs.get(&s).map(|x| x.1.clone()).unwrap_or_default()
    }

    /// Takes any image (its positions keep their tokens).
    fn attach_images(&mut self, _prompt: &mut [u32], images: &mut [PromptImage]) -> Result<(), StoreError> {
        for img in images.iter() {
            *self.images_held.entry(pixel_hash(&img.image)).or_default() += 1;
        }
        Ok(())
    }

    fn release_images(&mut self, images: &[PromptImage]) {
        for img in images {
            let h = pixel_hash(&img.image);
            if let Some(n) = self.images_held.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    self.images_held.remove(&h);
                }
            }
        }
    }

    fn images_ready(&mut self, images: &[PromptImage]) -> Result<bool, StoreError> {
        let mut ready = true;
        for img in images {
            match self.encoding.get(&pixel_hash(&img.image)) {
                Some(Err(why)) => return Err(StoreError::Engine(EngineError::Image(why.clone()))),
                Some(Ok(())) => ready = false,
                None => {}
            }
        }
        Ok(ready)
    }

    fn run(&mut self, items: &[StoreRun]) -> Result<Vec<Vec<f32>>, StoreError> {
        self.run_mock(items, &[])
    }

    fn capacity(&self) -> Option<(usize, usize)> {
        self.blocks.map(|(total, bs)| (total.saturating_sub(self.blocks_used()), bs))
    }

    fn pending(&self, s: StoreSeq) -> usize {
        self.seqs.get(&s).map_or(0, |x| x.2)
    }

    fn run_with_prefill(
        &mut self,
        items: &[StoreRun],
        prefill: &[(StoreSeq, usize)],
    ) -> Result<Vec<Vec<f32>>, StoreError> {
        let chunks: Vec<(StoreSeq, usize)> =
            prefill.iter().filter(|(s, _)| !items.iter().any(|it| it.seq == *s)).copied().collect();
        self.run_mock(items, &chunks)
    }
}
