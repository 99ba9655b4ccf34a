//! The paged KV cache's bookkeeping (vLLM's block manager design).
//!
//! The K/V tensors themselves live in the backend (host memory for the CPU backend, device memory
//! for a GPU one); this module decides which block holds which positions of which sequence:
//!
//! - [`block_pool::BlockPool`]: a fixed set of blocks with reference counts, a free queue in LRU
//!   order, and the prefix-cache index from block-content hash to block.
//! - [`manager::KvCacheManager`]: sequences and their block tables; append, copy-on-write fork,
//!   truncate, free, and automatic prefix caching of full blocks.
//! - [`groups::KvGroups`]: layers grouped by sliding window, one block table per group, so
//!   window layers give their blocks back while full-attention layers keep theirs.

pub mod block_pool;
pub mod groups;
pub mod manager;

pub use block_pool::BlockId;
pub use groups::KvGroups;
pub use manager::{
    BlockCopy, KvCacheManager, KvStats, OutOfBlocks, RollbackError, SeqId, StatePool, NO_BLOCK, ROLLBACK,
};
