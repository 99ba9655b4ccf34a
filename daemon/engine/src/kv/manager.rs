//! Sequences and their block tables over a [`BlockPool`]: the KV cache manager.
//!
//! A sequence is the list of tokens whose K/V it holds (or is about to hold) and the blocks they
//! live in. The engine drives it in two phases per step: [`KvCacheManager::append`] reserves slots
//! for the step's new tokens before the forward pass (returning any copy-on-write block copies
//! the backend must do first), and [`KvCacheManager::commit`] after it, which publishes newly
//! filled blocks to the prefix cache. Running out of blocks is a value ([`OutOfBlocks`]) the
//! scheduler handles, not an error.
//!
//! A sequence has one block table per KV group ([`super::groups`]): a model without sliding
//! windows has one, Gemma 3 one per group of its window and global layers. Every table covers
//! every position; in a window group's table, the blocks wholly behind the window (and
//! [`ROLLBACK`] positions more) are released by [`KvCacheManager::slide`] after each step and
//! their entries set to [`NO_BLOCK`].
//!
//! A hybrid model's sequences also hold a recurrent state (Gated DeltaNet's convolution window
//! and matrices, every such layer's): a slot of a [`StatePool`] beside the blocks, taken by a
//! sequence's first [`KvCacheManager::append`], shared by forks and copied by whichever of its
//! holders writes first (copy-on-write, as a shared partial block: the copies wait in
//! [`KvCacheManager::take_state_copies`] for the backend), counted by the same
//! reserve-before-mutate step ([`KvCacheManager::states_needed_for_step`]). A state goes back as
//! far as a window group does: a sequence truncated up to [`ROLLBACK`] positions behind the
//! furthest its state has run continues from there (the state keeps what those positions need:
//! [`inferd_kernels::deltanet`]), so a speculative step's rejected tokens cost nothing to undo;
//! further back is refused ([`RollbackError::Recurrent`]). For the prefix cache, a sequence's state at the last block
//! boundary of its prompt is kept as a checkpoint: a slot the backend writes when the forward
//! pass reaches that position ([`KvCacheManager::plan_checkpoints`], taken only from slots no
//! step needs), registered under that block's hash when committed; a later prompt matching
//! the blocks up to a checkpoint starts from it (shared, copied on its first write), so it runs
//! only its own tokens. Checkpoints are evicted oldest first when a sequence needs a slot.

use super::block_pool::{BlockHash, BlockId, BlockPool};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};

/// Handle of a sequence in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// The table entry of a block a window group released (no position there is read again).
pub const NO_BLOCK: BlockId = BlockId::MAX;

/// Positions a window group keeps beyond its window, so a sequence can be rolled back that far
/// (a speculative step's rejected tokens) after its window has moved on.
pub const ROLLBACK: usize = 32;

/// A truncation the cache cannot make; nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RollbackError {
    /// The next query would read window positions already released.
    #[error("cannot roll back to {len} tokens: the sliding-window layers have released positions before {kept} (at most {ROLLBACK} positions behind the window can be rolled back)")]
    WindowReleased { len: usize, kept: usize },
    /// The sequence's recurrent state has moved further past the length asked for than it
    /// keeps.
    #[error(
        "cannot roll back to {len} tokens: the recurrent state (Gated DeltaNet layers) goes back only to {kept} (at most {ROLLBACK} positions behind the furthest it has run)"
    )]
    Recurrent { len: usize, kept: usize },
}

/// Not enough free blocks (or, `states`, recurrent state slots) for the request; nothing was
/// changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of {}: need {needed}, {free} free", if *states { "recurrent state slots" } else { "KV blocks" })]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
    pub states: bool,
}

/// The recurrent state slots of a hybrid model's sequences, reference-counted (forks share
/// one until either writes).
#[derive(Clone, Debug, Default)]
pub struct StatePool {
    refs: Vec<u32>,
    free: Vec<u32>,
}

impl StatePool {
    pub fn new(n: usize) -> StatePool {
        StatePool { refs: vec![0; n], free: (0..n as u32).rev().collect() }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    fn allocate(&mut self) -> Option<u32> {
        let s = self.free.pop()?;
        self.refs[s as usize] = 1;
        Some(s)
    }

    fn retain(&mut self, s: u32) {
        self.refs[s as usize] += 1;
    }

    fn release(&mut self, s: u32) {
        let r = &mut self.refs[s as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(s);
        }
    }
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
    /// Per group: the block of every `block_size` positions ([`NO_BLOCK`] once released).
    tables: Vec<Vec<BlockId>>,
    /// Per group: the blocks before this index are released (0 for full-attention groups).
    floor: Vec<usize>,
    /// Positions whose K/V has been written by a forward pass.
    computed: usize,
    /// The furthest its recurrent state has run (positions from [`ROLLBACK`] behind it can be
    /// gone back to).
    high: usize,
    /// Chain hashes of the full blocks registered so far (`hashes[i]` covers block `i`).
    hashes: Vec<BlockHash>,
    /// The parent of its first block's hash: its prefix-cache partition (none: shared).
    salt: Option<BlockHash>,
    /// Its recurrent state's slot (a hybrid model's, once it has appended).
    state: Option<u32>,
    /// Where its state is to be kept as a prefix-cache checkpoint
    /// ([`KvCacheManager::match_prefix`] chooses), and the slot taken for it once a step
    /// reaches there.
    checkpoint_at: Option<usize>,
    checkpoint: Option<u32>,
}

/// The KV cache manager; see the module docs.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    /// Per group: its sliding window, `None` for full attention.
    windows: Vec<Option<usize>>,
    seqs: HashMap<SeqId, Sequence>,
    next_id: u32,
    hasher: RandomState,
    /// Prompt tokens served from the prefix cache since start (for metrics).
    pub prefix_hit_tokens: u64,
    /// Recurrent state slots (none for a model without recurrent layers).
    states: StatePool,
    /// `(src, dst)` state copies the backend must make before the next forward pass.
    state_copies: Vec<(u32, u32)>,
    /// Prefix-cache checkpoints of recurrent states: the hash of the block a state ends at,
    /// and its slot; oldest first.
    checkpoints: Vec<(BlockHash, u32)>,
    /// The tokens that end a chat turn (the model's end-of-turn and end-of-text tokens): where
    /// a prompt's conversation before its last message ends ([`KvCacheManager::match_prefix`]).
    turn_ends: Vec<u32>,
}

impl KvCacheManager {
    /// A cache of one full-attention group.
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        Self::with_groups(n_blocks, block_size, vec![None])
    }

    /// A cache whose sequences have one block table per group, `windows` giving each group's
    /// sliding window (`None`: full attention).
    pub fn with_groups(n_blocks: usize, block_size: usize, windows: Vec<Option<usize>>) -> Self {
        assert!(block_size > 0 && !windows.is_empty());
        assert!(windows.iter().all(|w| *w != Some(0)), "a window sees its own position");
        KvCacheManager {
            pool: BlockPool::new(n_blocks),
            block_size,
            windows,
            seqs: HashMap::new(),
            next_id: 0,
            hasher: RandomState::new(),
            prefix_hit_tokens: 0,
            states: StatePool::default(),
            state_copies: Vec::new(),
            checkpoints: Vec::new(),
            turn_ends: Vec::new(),
        }
    }

    /// The same cache knowing the tokens that end a chat turn, for where prompts' recurrent
    /// states are kept.
    pub fn with_turn_ends(mut self, ids: &[u32]) -> Self {
        self.turn_ends = ids.to_vec();
        self
    }

    /// The same cache with `n` recurrent state slots: a hybrid model's, whose every sequence
    /// takes one ([`StatePool`]).
    pub fn with_states(mut self, n: usize) -> Self {
        self.states = StatePool::new(n);
        self
    }

    /// Whether sequences hold a recurrent state.
    pub fn recurrent(&self) -> bool {
        self.states.total() > 0
    }

    /// Recurrent state slots: all, and free (checkpoints no sequence holds count as free:
    /// they are evicted when a slot is needed).
    pub fn state_slots(&self) -> (usize, usize) {
        (self.states.total(), self.states.free() + self.evictable_checkpoints())
    }

    /// Checkpoints held by the prefix cache alone.
    fn evictable_checkpoints(&self) -> usize {
        self.checkpoints.iter().filter(|&&(_, st)| self.states.refs[st as usize] == 1).count()
    }

    /// A free state slot, evicting the oldest checkpoint no sequence holds where none is free.
    fn take_state(&mut self) -> Option<u32> {
        take_state(&mut self.states, &mut self.checkpoints)
    }

    /// Prefix-cache checkpoints of recurrent states held now.
    pub fn checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// After a step's appends: a slot for the checkpoint of every sequence whose new tokens
    /// (`(sequence, tokens appended)`) reach the position it is to be kept at, from the slots
    /// no sequence needs (a checkpoint is never worth a failed step: without a free slot there
    /// is none).
    pub fn plan_checkpoints(&mut self, items: &[(SeqId, usize)]) {
        for &(id, n) in items {
            let Some(s) = self.seqs.get(&id) else { continue };
            let end = s.tokens.len();
            let want = s.checkpoint_at.filter(|&at| s.checkpoint.is_none() && at > end - n.min(end) && at <= end);
            if want.is_some() && self.states.free() + self.evictable_checkpoints() > 0 {
                let slot = self.take_state();
                self.seqs.get_mut(&id).expect("sequence exists").checkpoint = slot;
            }
        }
    }

    /// Where the backend is to copy the sequence's state, and at which position, when its
    /// tokens `start..end` reach there.
    pub fn checkpoint(&self, id: SeqId, start: usize, end: usize) -> Option<(usize, u32)> {
        let s = self.seq(id);
        s.checkpoint_at.zip(s.checkpoint).filter(|&(at, _)| at >= start && at <= end && at > 0)
    }

    /// The slot of the sequence's recurrent state, once it has one.
    pub fn state(&self, id: SeqId) -> Option<u32> {
        self.seq(id).state
    }

    /// The `(src, dst)` state copies (copy-on-write) made since the last call, for the backend
    /// to perform before the next forward pass.
    pub fn take_state_copies(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.state_copies)
    }

    /// State slots a whole step would take: a first state for a sequence without one, and a
    /// copy for each writer of a shared state but the last of its holders to write (as shared
    /// partial blocks). Exact; [`KvCacheManager::append`] cannot run out when this is at most
    /// the free slots.
    pub fn states_needed_for_step(&self, items: &[(SeqId, usize)]) -> usize {
        if !self.recurrent() {
            return 0;
        }
        let mut needed = 0;
        let mut writers: HashMap<u32, u32> = HashMap::new();
        for &(id, n) in items {
            let Some(s) = self.seqs.get(&id) else { continue };
            match s.state {
                None if n > 0 => needed += 1,
                Some(st) if n > 0 => *writers.entry(st).or_default() += 1,
                _ => {}
            }
        }
        for (st, w) in writers {
            let refs = self.states.refs[st as usize];
            if refs > 1 {
                needed += if w >= refs { w as usize - 1 } else { w as usize };
            }
        }
        needed
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

    /// A new empty sequence, in the shared part of the prefix cache.
    pub fn create(&mut self) -> SeqId {
        self.create_in(None)
    }

    /// A new empty sequence whose full blocks are cached in `partition` (a user's, say) and
    /// match only blocks cached there; `None` is the shared part. Each partition's blocks hash
    /// from their own root, so a prompt matches nothing another partition cached.
    pub fn create_in(&mut self, partition: Option<u64>) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        let groups = self.windows.len();
        let salt = self.partition_salt(partition);
        self.seqs.insert(
            id,
            Sequence { tables: vec![Vec::new(); groups], floor: vec![0; groups], salt, ..Sequence::default() },
        );
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

    /// The block table of the first group (the only one of a model without windows).
    pub fn block_table(&self, id: SeqId) -> &[BlockId] {
        &self.seq(id).tables[0]
    }

    /// Every group's block table.
    pub fn block_tables(&self, id: SeqId) -> &[Vec<BlockId>] {
        &self.seq(id).tables
    }

    /// Blocks held by the sequence, over every group.
    pub fn blocks_used(&self, id: SeqId) -> usize {
        self.seq(id).tables.iter().flatten().filter(|&&b| b != NO_BLOCK).count()
    }

    /// The key of block content `h` in group `g`'s part of the prefix cache.
    fn group_key(&self, h: BlockHash, g: usize) -> BlockHash {
        if g == 0 {
            return h;
        }
        self.hasher.hash_one((h, g))
    }

    /// The first block a query at position `pos` reads in group `g`.
    fn first_read(&self, g: usize, pos: usize) -> usize {
        self.windows[g].map_or(0, |w| (pos + 1).saturating_sub(w) / self.block_size)
    }

    fn chain_hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = self.hasher.build_hasher();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// How many of `prompt`'s tokens a sequence in `partition` would find in the prefix cache
    /// now ([`KvCacheManager::match_prefix`] without taking them; a hybrid model's may start
    /// at an earlier checkpoint).
    pub fn cached_prefix(&self, partition: Option<u64>, prompt: &[u32]) -> usize {
        self.cached_blocks(self.partition_salt(partition), prompt).1 * self.block_size
    }

    /// Where a partition's chains of block hashes start.
    fn partition_salt(&self, partition: Option<u64>) -> Option<BlockHash> {
        partition.map(|p| self.hasher.hash_one(("partition", p)))
    }

    /// The chain hashes of `prompt`'s full blocks but the one holding its last token (from
    /// `salt`), and how many of them the cache holds: the longest run of blocks every
    /// full-attention group has, then, for windowed models, the longest prefix of that whose
    /// window blocks every window group still has.
    fn cached_blocks(&self, salt: Option<BlockHash>, prompt: &[u32]) -> (Vec<BlockHash>, usize) {
        let bs = self.block_size;
        let max_blocks = prompt.len().saturating_sub(1) / bs;
        let chunks: Vec<&[u32]> = prompt.chunks_exact(bs).take(max_blocks).collect();
        let mut hashes = Vec::with_capacity(chunks.len());
        let mut parent = salt;
        for chunk in &chunks {
            let h = self.chain_hash(parent, chunk);
            hashes.push(h);
            parent = Some(h);
        }
        let find = |g: usize, i: usize| self.pool.lookup(self.group_key(hashes[i], g), chunks[i]);
        let groups = self.windows.len();
        let mut n = (0..hashes.len())
            .take_while(|&i| (0..groups).all(|g| self.windows[g].is_some() || find(g, i).is_some()))
            .count();
        while n > 0 && !(0..groups).all(|g| (self.first_read(g, n * bs)..n).all(|i| find(g, i).is_some())) {
            n -= 1;
        }
        (hashes, n)
    }

    /// For an empty sequence about to be filled with `prompt`: takes every cached full block that
    /// matches the start of the prompt and returns how many prompt tokens are already computed.
    /// At least one prompt token is always left to compute, so the step yields logits.
    ///
    /// A hybrid model's sequence starts from a checkpoint of its recurrent state, so only a
    /// prefix that ends at one counts; and it keeps one checkpoint itself, at the block boundary
    /// at or before the first of these past where it starts: the end of the conversation before
    /// its last message (just after its last turn-ending token but one: the system prompt, or
    /// the turns the next follow-up repeats); where the prefix cache's blocks of an earlier
    /// prompt leave this one (a prefix two prompts share, kept for the third); the prompt's last
    /// block boundary.
    pub fn match_prefix(&mut self, id: SeqId, prompt: &[u32]) -> usize {
        let bs = self.block_size;
        if !self.seq(id).tokens.is_empty() {
            return 0;
        }
        let (hashes, mut n) = self.cached_blocks(self.seq(id).salt, prompt);
        let chunks: Vec<&[u32]> = prompt.chunks_exact(bs).take(hashes.len()).collect();
        let find = |g: usize, i: usize| self.pool.lookup(self.group_key(hashes[i], g), chunks[i]);
        let groups = self.windows.len();
        // A recurrent sequence starts from a checkpoint: the longest run that ends at one.
        let (mut checkpoint, mut checkpoint_at) = (None, None);
        if self.recurrent() {
            let cached = n;
            while n > 0 && checkpoint.is_none() {
                checkpoint = self.checkpoints.iter().position(|&(h, _)| h == hashes[n - 1]);
                if checkpoint.is_none() {
                    n -= 1;
                }
            }
            let last = prompt.len().saturating_sub(1) / bs * bs;
            // Just after the last turn-ending token but one (the prompt's own last token aside).
            let before_last_turn = prompt[..prompt.len().saturating_sub(1)]
                .iter()
                .rposition(|t| self.turn_ends.contains(t))
                .and_then(|last| prompt[..last].iter().rposition(|t| self.turn_ends.contains(t)))
                .map(|i| (i + 1) / bs * bs);
            checkpoint_at = [before_last_turn, (cached > n).then_some(cached * bs), Some(last)]
                .into_iter()
                .flatten()
                .find(|&at| at > n * bs);
        }
        let mut tables = vec![Vec::new(); groups];
        let mut floor = vec![0; groups];
        for (g, table) in tables.iter_mut().enumerate() {
            floor[g] = self.first_read(g, n * bs).min(n);
            for i in 0..n {
                table.push(if i < floor[g] { NO_BLOCK } else { find(g, i).expect("checked above") });
            }
        }
        for &b in tables.iter().flatten().filter(|&&b| b != NO_BLOCK) {
            self.pool.retain(b);
        }
        let state = checkpoint.map(|i| {
            let entry = self.checkpoints.remove(i);
            self.checkpoints.push(entry); // the newest now
            self.states.retain(entry.1);
            entry.1
        });
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        s.tables = tables;
        s.floor = floor;
        s.state = state;
        s.checkpoint_at = checkpoint_at;
        s.hashes = hashes[..n].to_vec();
        s.tokens = prompt[..n * bs].to_vec();
        s.computed = n * bs;
        // What a checkpoint keeps of the positions before it is not this sequence's to go
        // back to.
        s.high = n * bs + ROLLBACK;
        self.prefix_hit_tokens += (n * bs) as u64;
        n * bs
    }

    /// Blocks that appending `n` tokens to the sequence would take from the pool.
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> usize {
        self.blocks_needed_for_step(&[(id, n)])
    }

    /// Blocks a whole step would take from the pool: `(sequence, tokens appended)` for every
    /// sequence the step writes to (each at most once). Exact, not an upper bound: it counts
    /// the new blocks each sequence grows into in every group and the copy-on-write copies of
    /// shared partial last blocks, where the last of a block's holders to write in one step
    /// writes in place (the others have copied away by then). Changes nothing;
    /// [`KvCacheManager::append`] for every item then cannot fail when this is at most
    /// [`KvStats::free`].
    pub fn blocks_needed_for_step(&self, items: &[(SeqId, usize)]) -> usize {
        let bs = self.block_size;
        let mut needed = 0;
        // Shared partial last blocks written this step, with how many of their holders write.
        let mut writers: HashMap<BlockId, u32> = HashMap::new();
        for &(id, n) in items {
            let Some(s) = self.seqs.get(&id) else { continue };
            for table in &s.tables {
                needed += (s.tokens.len() + n).div_ceil(bs).saturating_sub(table.len());
                if n > 0 && !s.tokens.len().is_multiple_of(bs) {
                    if let Some(&last) = table.last().filter(|&&b| b != NO_BLOCK) {
                        *writers.entry(last).or_default() += 1;
                    }
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

    /// Reserves cache slots for `new` tokens at the end of the sequence, in every group.
    /// Returns the block copies the backend must perform before the forward pass
    /// (copy-on-write of a shared last block).
    pub fn append(&mut self, id: SeqId, new: &[u32]) -> Result<Vec<BlockCopy>, OutOfBlocks> {
        let needed = self.blocks_needed(id, new.len());
        if needed > self.pool.free() {
            return Err(OutOfBlocks { needed, free: self.pool.free(), states: false });
        }
        let states = self.states_needed_for_step(&[(id, new.len())]);
        let free_states = self.state_slots().1;
        if states > free_states {
            return Err(OutOfBlocks { needed: states, free: free_states, states: true });
        }
        let bs = self.block_size;
        let mut copies = Vec::new();
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        if self.states.total() > 0 && !new.is_empty() {
            // A first state, or a copy of a shared one (counted above).
            match s.state {
                None => s.state = take_state(&mut self.states, &mut self.checkpoints),
                Some(old) if self.states.refs[old as usize] > 1 => {
                    let fresh = take_state(&mut self.states, &mut self.checkpoints).expect("counted above");
                    self.state_copies.push((old, fresh));
                    self.states.release(old);
                    s.state = Some(fresh);
                }
                Some(_) => {}
            }
        }
        let pool = &mut self.pool;
        let len = s.tokens.len() + new.len();
        for table in &mut s.tables {
            if !new.is_empty() && !s.tokens.len().is_multiple_of(bs) {
                let last = table.len() - 1;
                let old = table[last];
                if pool.refs(old) > 1 {
                    let fresh = pool.allocate().expect("counted above");
                    copies.push(BlockCopy { src: old, dst: fresh });
                    pool.release(old);
                    table[last] = fresh;
                } else {
                    // About to write into it: a partial block must not stay in the prefix cache.
                    pool.uncache(old);
                }
            }
            while table.len() * bs < len {
                table.push(pool.allocate().expect("counted above"));
            }
        }
        s.tokens.extend_from_slice(new);
        Ok(copies)
    }

    /// Marks the first `upto` positions computed (after a forward pass wrote them) and registers
    /// every newly completed block of every group in the prefix cache.
    pub fn commit(&mut self, id: SeqId, upto: usize) {
        let bs = self.block_size;
        let (full, start) = {
            let s = self.seqs.get_mut(&id).expect("sequence exists");
            s.computed = upto.min(s.tokens.len());
            s.high = s.high.max(s.computed);
            (s.computed / bs, s.hashes.len())
        };
        for i in start..full {
            let s = &self.seqs[&id];
            let parent = i.checked_sub(1).map(|p| s.hashes[p]).or(s.salt);
            let chunk = s.tokens[i * bs..(i + 1) * bs].to_vec();
            let h = self.chain_hash(parent, &chunk);
            let blocks: Vec<(usize, BlockId)> = s.tables.iter().map(|t| t[i]).enumerate().collect();
            for (g, b) in blocks {
                if b != NO_BLOCK {
                    let key = self.group_key(h, g);
                    self.pool.cache(b, key, &chunk);
                }
            }
            self.seqs.get_mut(&id).expect("sequence exists").hashes.push(h);
        }
        // A checkpoint the pass wrote joins the prefix cache under its block's hash.
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        if let (Some(at), Some(slot)) = (s.checkpoint_at, s.checkpoint) {
            if s.computed >= at {
                let h = s.hashes[at / bs - 1];
                (s.checkpoint_at, s.checkpoint) = (None, None);
                if self.checkpoints.iter().any(|&(c, _)| c == h) {
                    self.states.release(slot);
                } else {
                    self.checkpoints.push((h, slot));
                }
            }
        }
    }

    /// Releases the blocks of the window groups that no query at or after the sequence's
    /// length reads, less [`ROLLBACK`] positions (the engine calls it after every step). Their
    /// table entries become [`NO_BLOCK`]; full blocks stay in the prefix cache until evicted.
    pub fn slide(&mut self, id: SeqId) {
        let Some(s) = self.seqs.get(&id) else { return };
        let pos = s.tokens.len().saturating_sub(ROLLBACK);
        let limits: Vec<usize> = (0..self.windows.len()).map(|g| self.first_read(g, pos)).collect();
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        for ((table, floor), limit) in s.tables.iter_mut().zip(&mut s.floor).zip(limits) {
            let limit = limit.min(table.len());
            for b in table.iter_mut().take(limit).skip(*floor) {
                if *b != NO_BLOCK {
                    self.pool.release(*b);
                    *b = NO_BLOCK;
                }
            }
            *floor = (*floor).max(limit);
        }
    }

    /// A new sequence sharing every block of `id` (copy-on-write: nothing is copied until one of
    /// them writes into a shared partial block).
    pub fn fork(&mut self, id: SeqId) -> SeqId {
        let copy = self.seq(id).clone();
        for &b in copy.tables.iter().flatten().filter(|&&b| b != NO_BLOCK) {
            self.pool.retain(b);
        }
        if let Some(st) = copy.state {
            self.states.retain(st);
        }
        let copy = Sequence { checkpoint_at: None, checkpoint: None, ..copy };
        let new = SeqId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        self.seqs.insert(new, copy);
        new
    }

    /// Shortens the sequence to `len` tokens (speculative rollback), releasing whole blocks past
    /// it. Refused, changing nothing, when a window group has already released positions the
    /// next query would read ([`KvCacheManager::slide`] keeps [`ROLLBACK`] of them), or when a
    /// recurrent state has run more than [`ROLLBACK`] positions past `len`.
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<(), RollbackError> {
        let bs = self.block_size;
        let s = self.seq(id);
        if len >= s.tokens.len() {
            return Ok(());
        }
        if let Some(g) = (0..self.windows.len()).find(|&g| self.first_read(g, len) < s.floor[g]) {
            return Err(RollbackError::WindowReleased { len, kept: s.floor[g] * bs });
        }
        if s.state.is_some() && len < s.computed && len + ROLLBACK < s.high {
            return Err(RollbackError::Recurrent { len, kept: s.high - ROLLBACK });
        }
        let s = self.seqs.get_mut(&id).expect("sequence exists");
        if s.checkpoint_at.is_some_and(|at| at > len) {
            if let Some(st) = s.checkpoint.take() {
                self.states.release(st);
            }
        }
        s.tokens.truncate(len);
        s.computed = s.computed.min(len);
        s.hashes.truncate(len / bs);
        let keep = len.div_ceil(bs);
        for table in &mut s.tables {
            for b in table.drain(keep.min(table.len())..) {
                if b != NO_BLOCK {
                    self.pool.release(b);
                }
            }
        }
        Ok(())
    }

    /// Frees the sequence; its full blocks stay in the prefix cache until evicted.
    pub fn free(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            for b in s.tables.into_iter().flatten().filter(|&b| b != NO_BLOCK) {
                self.pool.release(b);
            }
            for st in s.state.into_iter().chain(s.checkpoint) {
                self.states.release(st);
            }
        }
    }

    /// Number of live sequences.
    /// The free blocks written since the last call (prefix-cache entries dropped), whose memory
    /// may go back to the system: [`BlockPool::take_dirty_free`].
    pub fn take_dirty_free(&mut self) -> Vec<BlockId> {
        self.pool.take_dirty_free()
    }

    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }
}

/// [`KvCacheManager::take_state`] over the manager's parts (while a sequence is borrowed).
fn take_state(states: &mut StatePool, checkpoints: &mut Vec<(BlockHash, u32)>) -> Option<u32> {
    if states.free() == 0 {
        let i = checkpoints.iter().position(|&(_, st)| states.refs[st as usize] == 1)?;
        let (_, st) = checkpoints.remove(i);
        states.release(st);
    }
    states.allocate()
}

#[cfg(test)]
mod tests;
