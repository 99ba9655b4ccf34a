//! Engine sizing: KV budget, block size, prefill chunk, threads.

use inferd_kernels::pool::ThreadPool;
use std::sync::Arc;

/// How an engine is sized. The defaults suit the default model on a small machine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Memory for K/V blocks, in bytes.
    pub kv_budget_bytes: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Most prompt tokens one forward pass takes (across all sequences being prefilled).
    pub prefill_chunk: usize,
    /// Compute threads; 0 means one per available core.
    pub threads: usize,
    /// Compute threads shared with another engine driven from the same thread (a draft model
    /// beside its target: [`crate::backend::Backend::cpu_pool`]), in place of `threads` of its
    /// own, so the two never have workers spinning against each other. CPU backend only.
    pub pool: Option<Arc<ThreadPool>>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { kv_budget_bytes: 512 << 20, block_size: 16, prefill_chunk: 512, threads: 0, pool: None }
    }
}

impl EngineOptions {
    pub fn threads(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        }
    }
}
