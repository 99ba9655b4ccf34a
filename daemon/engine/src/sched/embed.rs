//! Embedding requests as work of the scheduler's steps, not a call between them.
//!
//! Each text of a job becomes a sequence of the store whose tokens are all pending
//! ([`SeqStore::create_embedding`]); they run as prompt chunks under the step's token budget
//! (`budget.rs` decides them beside every prompt: a quarter of the budget while anyone
//! decodes), in the same forward as the other requests' decode and prefill, and their hidden
//! states are pooled as they run. A job starts texts only while the KV cache has room for them
//! beside the running requests' growth, a bounded number of pending tokens at a time (so a
//! short text is batched with the next, and two thousand long ones take no blocks before
//! their turn). It is cancelled like a request ([`super::Command::Cancel`]): its sequences
//! are freed at the next step and its client hears "cancelled".

use super::{EmbedReply, Embedding, RequestId, RequestMeta};
use crate::decode::store::{SeqStore, StoreSeq};
use std::collections::VecDeque;

/// One embedding request in progress.
pub(super) struct EmbedJob {
    pub id: RequestId,
    pub meta: RequestMeta,
    inputs: Vec<Vec<u32>>,
    /// Texts not started yet, in order.
    todo: VecDeque<usize>,
    /// Texts running: (index, sequence).
    pub flight: Vec<(usize, StoreSeq)>,
    /// Each text's vector once pooled.
    vectors: Vec<Option<Vec<f32>>>,
    reply: EmbedReply,
    /// Its client went away: it leaves at the next step.
    pub gone: bool,
    /// Running its texts failed: it leaves with this.
    pub failure: Option<String>,
}

/// Why starting a job's texts stopped.
pub(super) enum Started {
    /// Everything that may start has.
    Ok,
    /// The cache has no room now; later jobs wait too (first come, first served).
    Full,
    /// The job cannot go on: this is why.
    Failed(String),
}

impl EmbedJob {
    pub fn new(e: Embedding) -> Self {
        let n = e.inputs.len();
        EmbedJob {
            id: e.id,
            meta: e.meta,
            inputs: e.inputs,
            todo: (0..n).collect(),
            flight: Vec::new(),
            vectors: vec![None; n],
            reply: e.reply,
            gone: false,
            failure: None,
        }
    }

    /// KV blocks its running texts may still take (each one's pending tokens).
    pub fn reserved(&self, store: &dyn SeqStore, block_size: usize) -> usize {
        self.flight.iter().map(|&(_, s)| store.pending(s).div_ceil(block_size.max(1))).sum()
    }

    /// Starts texts while fewer than `budget` of its tokens are pending and the cache has
    /// room: `room` is the free blocks left after the running requests' growth and the other
    /// texts' reservations (`None`: an unbounded store), reduced by what starts here. `alone`:
    /// nothing else holds or reserves blocks, so a text that does not fit never will.
    pub fn start(
        &mut self,
        store: &mut dyn SeqStore,
        room: &mut Option<usize>,
        block_size: usize,
        budget: usize,
        alone: bool,
    ) -> Started {
        let mut pending: usize = self.flight.iter().map(|&(_, s)| store.pending(s)).sum();
        while pending < budget.max(1) {
            let Some(&i) = self.todo.front() else { return Started::Ok };
            let text = &self.inputs[i];
            let need = text.len().div_ceil(block_size.max(1));
            if let Some(r) = room {
                if need > *r {
                    if alone && self.flight.is_empty() {
                        return Started::Failed(format!(
                            "input {i} needs {need} KV blocks, more than the cache holds ({r} free)"
                        ));
                    }
                    return Started::Full;
                }
                *r -= need;
            }
            match store.create_embedding(text) {
                Ok(s) => self.flight.push((i, s)),
                Err(e) => return Started::Failed(format!("input {i}: {e}")),
            }
            self.todo.pop_front();
            pending += text.len();
        }
        Started::Ok
    }

    /// Texts whose tokens have all run give their vectors (and their sequences back).
    pub fn collect(&mut self, store: &mut dyn SeqStore) -> Result<(), String> {
        let mut err = None;
        self.flight.retain(|&(i, s)| {
            if store.pending(s) > 0 {
                return true;
            }
            match store.finish_embedding(s) {
                Ok(v) => self.vectors[i] = Some(v),
                Err(e) => err = err.take().or(Some(format!("input {i}: {e}"))),
            }
            false
        });
        err.map_or(Ok(()), Err)
    }

    /// Every text pooled.
    pub fn done(&self) -> bool {
        self.todo.is_empty() && self.flight.is_empty()
    }

    /// Its running texts give their blocks back and start over later (the cache ran out).
    pub fn restart(&mut self, store: &mut dyn SeqStore) {
        for (i, s) in self.flight.drain(..).rev() {
            store.free(s);
            self.todo.push_front(i);
        }
    }

    /// Frees what it holds and tells its client: the vectors in order, or why not.
    pub fn close(self, store: &mut dyn SeqStore, failure: Option<String>) {
        for &(_, s) in &self.flight {
            store.free(s);
        }
        let result = match failure {
            Some(why) => Err(why),
            None => self.vectors.into_iter().map(|v| v.ok_or_else(|| "an input was not run".to_string())).collect(),
        };
        (self.reply)(result);
    }
}
