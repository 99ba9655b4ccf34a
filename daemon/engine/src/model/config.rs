//! The hyperparameters of a transformer (every family here shares them), from GGUF metadata or a Hugging Face
//! `config.json`, validated once so the forward pass can trust them.

use inferd_kernels::ops::RopeStyle;

/// A transformer's hyperparameters; the per-layer and per-family differences are the
/// [`crate::model::Architecture`]'s.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (all of them but for partial rotary
    /// embeddings).
    pub rope_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    /// The context length the model was trained for.
    pub context_len: usize,
    /// How a text's final hidden states become its embedding.
    pub pooling: Pooling,
}

/// How the final hidden states of a text's tokens (after the output norm) become one embedding,
/// as an embedding GGUF says in `{arch}.pooling_type` (llama.cpp's numbering: 1 mean, 2 CLS,
/// 3 last, 4 rank); a generative model's texts are mean-pooled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pooling {
    #[default]
    Mean,
    /// The first token's state (BERT's `[CLS]`; here the BOS token's).
    Cls,
    /// The last token's state (Qwen3-Embedding and other decoder embedders, whose tokenizer
    /// appends an end token).
    Last,
    /// A reranker's (4): the last token's state through the classification head
    /// ([`crate::model::rank::RankHead`]), giving the labels' probabilities, not a vector.
    Rank,
}

impl LlamaConfig {
    /// Checks the relations the forward pass relies on.
    pub fn validate(&self) -> Result<(), String> {
        let nonzero = [
            self.n_layers,
            self.hidden,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.rope_dim,
            self.ffn,
            self.vocab,
            self.context_len,
        ];
        if nonzero.contains(&0) {
            return Err(format!("a model dimension is zero: {self:?}"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!("{} query heads are not a multiple of {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if self.n_heads / self.n_kv_heads > 64 {
            return Err(format!("{} query heads per KV head (at most 64 supported)", self.n_heads / self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head dimension {} is odd", self.head_dim));
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim == 0 || self.rope_dim > self.head_dim {
            return Err(format!("RoPE dimension {} does not fit head dimension {}", self.rope_dim, self.head_dim));
        }
        if self.n_layers > 1024
            || self.hidden > 1 << 16
            || self.vocab > 1 << 22
            || self.ffn > 1 << 18
            || self.n_heads > 1024
        {
            return Err(format!("model dimensions out of range: {self:?}"));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0 && self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err("rope base or RMS epsilon is not a positive finite number".into());
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
