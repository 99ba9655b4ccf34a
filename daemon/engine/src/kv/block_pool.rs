//! A fixed pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache index.
//!
//! A block whose reference count drops to zero goes to the free queue but keeps its contents and
//! its prefix-cache entry: a later request with the same prefix can take it back (a cache hit)
//! until the pool needs it for something else, at which point the least recently freed cached
//! block is evicted. Blocks that hold nothing reusable are handed out before cached ones.

use std::collections::HashMap;

/// Index of a block in the pool (and in the backend's K/V storage).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Identity of a full block for prefix caching: the hash of its tokens chained with the hash of
/// every block before it. Hits are also checked against the stored tokens.
pub type BlockHash = u64;

#[derive(Clone, Debug)]
struct Meta {
    refs: u32,
    /// Set while the block is registered in the prefix cache.
    hash: Option<BlockHash>,
    /// The tokens of a cached block (verified on every hit).
    tokens: Vec<u32>,
    prev: u32,
    next: u32,
    in_free: bool,
    /// Handed out since the last [`BlockPool::take_dirty_free`]: its memory may be resident.
    dirty: bool,
}

/// The block pool. All operations are O(1) except hash-map work.
#[derive(Debug)]
pub struct BlockPool {
    meta: Vec<Meta>,
    head: u32,
    tail: u32,
    n_free: usize,
    cache: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    pub fn new(n_blocks: usize) -> Self {
        let n = u32::try_from(n_blocks).unwrap_or(u32::MAX - 1) as usize;
        let meta =
            vec![
                Meta { refs: 0, hash: None, tokens: Vec::new(), prev: NIL, next: NIL, in_free: false, dirty: false };
                n
            ];
        let mut p = BlockPool { meta, head: NIL, tail: NIL, n_free: 0, cache: HashMap::new() };
        for b in 0..n as u32 {
            p.push_back(b);
        }
        p
    }

    pub fn total(&self) -> usize {
        self.meta.len()
    }

    /// Blocks with no reference (fresh or evictable cached ones).
    pub fn free(&self) -> usize {
        self.n_free
    }

    /// Blocks registered in the prefix cache (in use or not).
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Cached blocks that nothing references (evictable).
    pub fn cached_free(&self) -> usize {
        self.cache.values().filter(|&&b| self.meta[b as usize].refs == 0).count()
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.meta[b as usize].refs
    }

    fn unlink(&mut self, b: BlockId) {
        let (prev, next) = (self.meta[b as usize].prev, self.meta[b as usize].next);
        if prev == NIL {
            self.head = next
        } else {
            self.meta[prev as usize].next = next
        }
        if next == NIL {
            self.tail = prev
        } else {
            self.meta[next as usize].prev = prev
        }
        let m = &mut self.meta[b as usize];
        m.prev = NIL;
        m.next = NIL;
        m.in_free = false;
        self.n_free -= 1;
    }

    fn push_back(&mut self, b: BlockId) {
        let tail = self.tail;
        let m = &mut self.meta[b as usize];
        m.prev = tail;
        m.next = NIL;
        m.in_free = true;
        if tail == NIL {
            self.head = b
        } else {
            self.meta[tail as usize].next = b
        }
        self.tail = b;
        self.n_free += 1;
    }

    fn push_front(&mut self, b: BlockId) {
        let head = self.head;
        let m = &mut self.meta[b as usize];
        m.prev = NIL;
        m.next = head;
        m.in_free = true;
        if head == NIL {
            self.tail = b
        } else {
            self.meta[head as usize].prev = b
        }
        self.head = b;
        self.n_free += 1;
    }

    /// Takes a block for new contents (evicting the least recently used cached block if need
    /// be); `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        self.uncache(b);
        self.meta[b as usize].refs = 1;
        self.meta[b as usize].dirty = true;
        Some(b)
    }

    /// Every free block written since it was last taken here, its prefix-cache entry dropped:
    /// the blocks whose memory the backend may hand back to the system (their contents are
    /// forgotten; a later hit on their prefix computes it again). Marks them clean.
    pub fn take_dirty_free(&mut self) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut b = self.head;
        while b != NIL {
            if self.meta[b as usize].dirty {
                self.uncache(b);
                self.meta[b as usize].dirty = false;
                out.push(b);
            }
            b = self.meta[b as usize].next;
        }
        out
    }

    /// Adds a reference to a block (fork, prefix hit).
    pub fn retain(&mut self, b: BlockId) {
        if self.meta[b as usize].in_free {
            self.unlink(b);
        }
        self.meta[b as usize].refs += 1;
    }

    /// Drops a reference; at zero the block becomes free (cached blocks stay findable).
    pub fn release(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        debug_assert!(m.refs > 0, "double free of block {b}");
        m.refs = m.refs.saturating_sub(1);
        if m.refs == 0 {
            if m.hash.is_some() {
                self.push_back(b)
            } else {
                self.push_front(b)
            }
        }
    }

    /// Registers a full block under `hash` (unless another block already holds that content).
    pub fn cache(&mut self, b: BlockId, hash: BlockHash, tokens: &[u32]) {
        if self.meta[b as usize].hash.is_some() || self.cache.contains_key(&hash) {
            return;
        }
        self.cache.insert(hash, b);
        let m = &mut self.meta[b as usize];
        m.hash = Some(hash);
        m.tokens = tokens.to_vec();
    }

    /// Removes a block from the prefix cache (its contents are about to change).
    pub fn uncache(&mut self, b: BlockId) {
        if let Some(h) = self.meta[b as usize].hash.take() {
            self.cache.remove(&h);
            self.meta[b as usize].tokens.clear();
        }
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.meta[b as usize].hash.is_some()
    }

    /// The cached block holding exactly `tokens` under `hash`, if any.
    pub fn lookup(&self, hash: BlockHash, tokens: &[u32]) -> Option<BlockId> {
        let b = *self.cache.get(&hash)?;
        (self.meta[b as usize].tokens == tokens).then_some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_free_blocks_are_taken_once_and_leave_the_prefix_cache() {
        let mut p = BlockPool::new(4);
        let (a, b, c) = (p.allocate().unwrap(), p.allocate().unwrap(), p.allocate().unwrap());
        p.cache(a, 7, &[1, 2]);
        p.release(a);
        p.release(b);
        // c is in use, the fourth block was never written.
        let mut taken = p.take_dirty_free();
        taken.sort();
        assert_eq!(taken, [a, b]);
        assert!(p.lookup(7, &[1, 2]).is_none(), "its contents are gone, so is its cache entry");
        assert!(p.take_dirty_free().is_empty(), "taken once");
        assert_eq!(p.free(), 3);
        p.release(c);
        assert_eq!(p.take_dirty_free(), [c]);
    }

    #[test]
    fn allocate_release_and_lru_eviction() {
        let mut p = BlockPool::new(3);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        let c = p.allocate().unwrap();
        assert_eq!(p.allocate(), None);
        p.cache(a, 1, &[1]);
        p.cache(b, 2, &[2]);
        p.release(a);
        p.release(b);
        p.release(c);
        assert_eq!(p.free(), 3);
        // The uncached block goes first, then the least recently freed cached one (a).
        assert_eq!(p.allocate(), Some(c));
        assert_eq!(p.allocate(), Some(a));
        assert_eq!(p.lookup(1, &[1]), None, "evicted");
        assert_eq!(p.lookup(2, &[2]), Some(b));
        assert_eq!(p.lookup(2, &[3]), None, "token mismatch is a miss");
        p.retain(b);
        assert_eq!(p.free(), 0);
        assert_eq!(p.refs(b), 1);
    }
}
