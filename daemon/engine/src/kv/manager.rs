//! Sequences and their block tables over a [`BlockPool`]: the KV cache manager.
//!
//! A sequence is the list of tokens whose K/V it holds (or is about to hold) and the blocks they
//! live in. The engine drives it in two phases per step: [`KvCacheManager::append`] reserves slots
//! for the step's new tokens before the forward pass (returning any copy-on-write block copies
//! the backend must do first), and [`KvCacheManager::commit`] after it, which publishes newly
//! filled blocks to the prefix cache. Running out of blocks is a value ([`OutOfBlocks`]) the
//! scheduler handles, not an error.

use super::block_pool::{BlockHash, BlockId, BlockPool};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};

/// Handle of a sequence in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// Not enough free blocks for the request; nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: need {needed}, {free} free")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}

/// A block the backend must copy before the next forward pass (copy-on-write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// Cache occupancy, for status endpoints and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    pub total: usize,
    pub free: usize,
    /// Blocks registered in the prefix cache (in use or evictable).
    pub cached: usize,
    pub block_size: usize,
}

#[derive(Clone, Debug, Default)]
struct Sequence {
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    /// Positions whose K/V has been written by a forward pass.
    computed: usize,
    /// Chain hashes of the full blocks registered so far (`hashes[i]` covers block `i`).
    hashes: Vec<BlockHash>,
}

/// The KV cache manager; see the module docs.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    seqs: HashMap<SeqId, Sequence>,
    next_id: u32,
    hasher: RandomState,
    /// Prompt tokens served from the prefix cache since start (for metrics).
    pub prefix_hit_tokens: u64,
}

impl KvCacheManager {
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0);
        KvCacheManager {
            pool: BlockPool::new(n_blocks),
            block_size,
            seqs: HashMap::new(),
            next_id: 0,
            hasher: RandomState::new(),
            prefix_hit_tokens: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn stats(&self) -> KvStats {
        KvStats {
            total: self.pool.total(),
            free: self.pool.free(),
            cached: self.pool.cached(),
            block_size: self.block_size,
        }
    }

    /// A new empty sequence.
    pub fn create(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        self.seqs.insert(id, Sequence::default());
        id
    }

    fn seq(&self, id: SeqId) -> &Sequence {
        &self.seqs[&id]
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Tokens in the sequence (computed or reserved).
    pub fn len(&self, id: SeqId) -> usize {
        self.seq(id).tokens.len()
    }

    pub fn is_empty(&self, id: SeqId) -> bool {
        self.len(id) == 0
    }

    /// Positions whose K/V is already in the cache.
    pub fn computed(&self, id: SeqId) -> usize {
        self.seq(id).computed
    }

    pub fn tokens(&self, id: SeqId) -> &[u32] {
        &self.seq(id).tokens
    }

    pub fn block_table(&self, id: SeqId) -> &[BlockId] {
        &self.seq(id).blocks
    }

    /// Blocks held by the sequence.
    pub fn blocks_used(&self, id: SeqId) -> usize {
        self.seq(id).blocks.len()
    }

    fn chain_hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = self.hasher.build_hasher();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// For an empty sequence about to be filled with `prompt`: takes every cached full block that
    /// matches the start of the prompt and returns how many prompt tokens are already computed.
    /// At least one prompt token is always left to compute, so the step yields logits.
    pub fn match_prefix(&mut self, id: SeqId, prompt: &[u32]) -> usize {
        let bs = self.block_size;
        if !self.seq(id).tokens.is_empty() {
            return 0;
        }
        let max_blocks = prompt.len().saturating_sub(1) / bs;
        let mut parent = None;
        let mut hits = Vec::new();
        for chunk in prompt.chunks_exact(bs).take(max_blocks) {
            let h = self.chain_hash(parent, chunk);
            match self.pool.lookup(h, chunk) {
                Some(b) => hits.push((b, h)),
                None => break,
            }
            parent = Some(h);
        }
        let n = hits.len() * bs;
        for &(b, _) in &hits {
            self.pool.retain(b);
        }
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        s.blocks = hits.iter().map(|h| h.0).collect();
        s.hashes = hits.iter().map(|h| h.1).collect();
        s.tokens = prompt[..n].to_vec();
        s.computed = n;
        self.prefix_hit_tokens += n as u64;
        n
    }

    /// Blocks that appending `n` tokens to the sequence would take from the pool.
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> usize {
        let s = self.seq(id);
        let have = s.blocks.len();
        let need = (s.tokens.len() + n).div_ceil(self.block_size);
        let cow = usize::from(
            n > 0 && !s.tokens.len().is_multiple_of(self.block_size) && self.pool.refs(s.blocks[have - 1]) > 1,
        );
        need.saturating_sub(have) + cow
    }

    /// Blocks a whole step would take from the pool: `(sequence, tokens appended)` for every
    /// sequence the step writes to (each at most once). Exact, not an upper bound: it counts
    /// the new blocks each sequence grows into and the copy-on-write copies of shared partial
    /// last blocks, where the last of a block's holders to write in one step writes in place
    /// (the others have copied away by then). Changes nothing; [`KvCacheManager::append`] for
    /// every item then cannot fail when this is at most [`KvStats::free`].
    pub fn blocks_needed_for_step(&self, items: &[(SeqId, usize)]) -> usize {
        let bs = self.block_size;
        let mut needed = 0;
        // Shared partial last blocks written this step, with how many of their holders write.
        let mut writers: HashMap<BlockId, u32> = HashMap::new();
        for &(id, n) in items {
            let Some(s) = self.seqs.get(&id) else { continue };
            needed += (s.tokens.len() + n).div_ceil(bs).saturating_sub(s.blocks.len());
            if n > 0 && !s.tokens.len().is_multiple_of(bs) {
                if let Some(&last) = s.blocks.last() {
                    *writers.entry(last).or_default() += 1;
                }
            }
        }
        for (b, w) in writers {
            let refs = self.pool.refs(b);
            if refs > 1 {
                needed += if w >= refs { w as usize - 1 } else { w as usize };
            }
        }
        needed
    }

    /// Reserves cache slots for `new` tokens at the end of the sequence. Returns the block copies
    /// the backend must perform before the forward pass (copy-on-write of a shared last block).
    pub fn append(&mut self, id: SeqId, new: &[u32]) -> Result<Vec<BlockCopy>, OutOfBlocks> {
        let needed = self.blocks_needed(id, new.len());
        if needed > self.pool.free() {
            return Err(OutOfBlocks { needed, free: self.pool.free() });
        }
        let bs = self.block_size;
        let mut copies = Vec::new();
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        let pool = &mut self.pool;
        if !new.is_empty() && !s.tokens.len().is_multiple_of(bs) {
            let last = s.blocks.len() - 1;
            let old = s.blocks[last];
            if pool.refs(old) > 1 {
                let fresh = pool.allocate().expect("counted above");
                copies.push(BlockCopy { src: old, dst: fresh });
                pool.release(old);
                s.blocks[last] = fresh;
            } else {
                // About to write into it: a partial block must not stay in the prefix cache.
                pool.uncache(old);
            }
        }
        s.tokens.extend_from_slice(new);
        while s.blocks.len() * bs < s.tokens.len() {
            s.blocks.push(pool.allocate().expect("counted above"));
        }
        Ok(copies)
    }

    /// Marks the first `upto` positions computed (after a forward pass wrote them) and registers
    /// every newly completed block in the prefix cache.
    pub fn commit(&mut self, id: SeqId, upto: usize) {
        let bs = self.block_size;
        let (full, start) = {
            let s = self.seqs.get_mut(&id).expect("sequence exists");
            s.computed = upto.min(s.tokens.len());
            (s.computed / bs, s.hashes.len())
        };
        for i in start..full {
            let s = &self.seqs[&id];
            let parent = i.checked_sub(1).map(|p| s.hashes[p]);
            let chunk = s.tokens[i * bs..(i + 1) * bs].to_vec();
            let b = s.blocks[i];
            let h = self.chain_hash(parent, &chunk);
            self.pool.cache(b, h, &chunk);
            self.seqs.get_mut(&id).expect("sequence exists").hashes.push(h);
        }
    }

    /// A new sequence sharing every block of `id` (copy-on-write: nothing is copied until one of
    /// them writes into a shared partial block).
    pub fn fork(&mut self, id: SeqId) -> SeqId {
        let copy = self.seq(id).clone();
        for &b in &copy.blocks {
            self.pool.retain(b);
        }
        let new = SeqId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        self.seqs.insert(new, copy);
        new
    }

    /// Shortens the sequence to `len` tokens (speculative rollback), releasing whole blocks past it.
    pub fn truncate(&mut self, id: SeqId, len: usize) {
        let bs = self.block_size;
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        if len >= s.tokens.len() {
            return;
        }
        s.tokens.truncate(len);
        s.computed = s.computed.min(len);
        s.hashes.truncate(len / bs);
        let keep = len.div_ceil(bs);
        for b in s.blocks.drain(keep..) {
            self.pool.release(b);
        }
    }

    /// Frees the sequence; its full blocks stay in the prefix cache until evicted.
    pub fn free(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            for b in s.blocks {
                self.pool.release(b);
            }
        }
    }

    /// Number of live sequences.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }
}

#[cfg(test)]
mod tests;
