//! An embedding pooled as its text runs: the final hidden states (after the output norm) of
//! each chunk of positions are taken as they come, so a text of any length needs one row of
//! state, and its chunks can run in whichever steps have room. The mean for a generative
//! model (as Ollama's `/api/embed` gives it), an embedding GGUF's CLS or last-token pooling,
//! then L2-normalized, as llama.cpp does; a reranker's last token through its head instead
//! ([`RankHead`]: the labels' probabilities, not normalized).

use crate::model::config::{LlamaConfig, Pooling};
use crate::model::rank::RankHead;
use std::sync::Arc;

/// One text's pooling in progress.
#[derive(Clone, Debug)]
pub struct Pooler {
    pooling: Pooling,
    /// The pooled rows so far, in f64 (a mean over thousands of rows).
    sum: Vec<f64>,
    /// Positions taken so far, and in all.
    seen: usize,
    total: usize,
    /// A reranker's head (rank pooling).
    rank: Option<Arc<RankHead>>,
}

impl Pooler {
    /// The pooling of a text of `total` tokens by a model of `cfg`, with its head `rank` when
    /// it is a reranker.
    pub fn new(cfg: &LlamaConfig, rank: Option<Arc<RankHead>>, total: usize) -> Self {
        Pooler { rank, ..Pooler::with(cfg.pooling, cfg.hidden, total) }
    }

    /// The `pooling` of a text of `total` tokens into `hidden` floats.
    pub fn with(pooling: Pooling, hidden: usize, total: usize) -> Self {
        Pooler { pooling, sum: vec![0.0; hidden], seen: 0, total, rank: None }
    }

    /// Takes the hidden-state rows of the next positions, in order (`hidden` floats a row).
    pub fn take(&mut self, rows: &[f32]) {
        let h = self.sum.len();
        for row in rows.chunks_exact(h) {
            let take = match self.pooling {
                Pooling::Mean => true,
                Pooling::Cls => self.seen == 0,
                Pooling::Last | Pooling::Rank => self.seen + 1 == self.total,
            };
            if take {
                self.sum.iter_mut().zip(row).for_each(|(s, &x)| *s += f64::from(x));
            }
            self.seen += 1;
        }
    }

    /// Positions not taken yet.
    pub fn remaining(&self) -> usize {
        self.total.saturating_sub(self.seen)
    }

    /// The embedding: pooled and L2-normalized; a reranker's labels' probabilities.
    pub fn finish(mut self) -> Vec<f32> {
        if let Some(head) = &self.rank {
            let h: Vec<f32> = self.sum.iter().map(|&x| x as f32).collect();
            return head.classify(&h);
        }
        if self.pooling == Pooling::Mean {
            let n = self.seen.max(1) as f64;
            self.sum.iter_mut().for_each(|x| *x /= n);
        }
        let norm = self.sum.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        self.sum.iter().map(|x| (x / norm) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_pool_as_one_whole() {
        let rows = [3.0, 0.0, 1.0, 2.0, -1.0, 4.0];
        for (pooling, want) in [
            (Pooling::Mean, [3.0f64 / 5.0, 6.0 / 5.0]),
            (Pooling::Cls, [1.0, 0.0]),
            (Pooling::Last, [-0.242_535_6, 0.970_142_5]),
        ] {
            let mut whole = Pooler::with(pooling, 2, 3);
            whole.take(&rows);
            let mut parts = Pooler::with(pooling, 2, 3);
            parts.take(&rows[..2]);
            assert_eq!(parts.remaining(), 2);
            parts.take(&rows[2..]);
            assert_eq!(parts.remaining(), 0);
            let (a, b) = (whole.finish(), parts.finish());
            assert_eq!(a, b, "{pooling:?}");
            let norm = (want[0] * want[0] + want[1] * want[1]).sqrt();
            for (x, w) in a.iter().zip(want) {
                assert!((f64::from(*x) - w / norm).abs() < 1e-6, "{pooling:?}: {a:?}");
            }
        }
    }
}
