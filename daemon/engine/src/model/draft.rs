//! A draft model's cheaper output projection. A draft model for speculative decoding reads
//! its whole output projection at every token it proposes (Qwen2.5-Coder 0.5B's 151,936 x 896
//! Q8_0 matrix is 145 MB, a third of its decode step), while a proposal only has to be likely:
//! the target verifies every token, so what comes out is the target's either way (at
//! temperature 0 token for token; sampled, the target's distribution, the draft's probabilities
//! being those of the copy it sampled from). A copy in Q4_0 reads about half the bytes.

use super::mmap::Blob;
use super::weights::Tensor;
use super::Model;
use inferd_kernels::pack::Layout;
use inferd_kernels::quant::DType;

/// The type a draft model's output projection is requantized to.
pub const DRAFT_OUTPUT: DType = DType::Q4_0;

impl Model {
    /// Requantizes the output projection to [`DRAFT_OUTPUT`] (on `threads` threads) where it
    /// is stored in at least a fifth more bytes; says whether it did. The embedding it may be
    /// tied to stays as it is.
    pub fn cheapen_output_for_drafting(&mut self, threads: usize) -> bool {
        let out = &self.weights.output;
        let (Some(now), Some(then)) = (out.dtype.bytes_for(out.cols), DRAFT_OUTPUT.bytes_for(out.cols)) else {
            return false;
        };
        if out.layout() != Layout::Rows || now * 5 < then * 6 {
            return false;
        }
        let pool = inferd_kernels::pool::ThreadPool::new(threads.max(1));
        let bytes =
            inferd_kernels::quantize::requantize(&pool, out.dtype, out.rows, out.cols, out.bytes(), DRAFT_OUTPUT);
        let Some(t) = bytes.and_then(|b| {
            let name = format!("{} (as {} for drafting)", out.name, DRAFT_OUTPUT.name());
            Tensor::new(&name, DRAFT_OUTPUT, out.rows, out.cols, Blob::from_vec(b), 0).ok()
        }) else {
            return false;
        };
        self.weights.output = t;
        true
    }
}
