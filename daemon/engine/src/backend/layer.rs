//! The transformer layer of every architecture, written once over the operations a backend
//! provides ([`LayerOps`]), as llama.cpp's model files build graphs over ggml's operations. The
//! CPU backend and the CUDA backend (and the CUDA kernels' host emulation in the tests) run
//! this one description; what differs between families is data ([`Architecture`]: where the
//! norms sit, which activation, biases, sinks, experts) read here, so a new family is its
//! `model/arch` file and loader keys, and a new kind of layer is written here once.
//!
//! The operations name the pass's activation buffers ([`Act`]) instead of passing values, so
//! a backend keeps one buffer of each kind for the whole pass (no allocation per layer on the
//! CPU) and decides itself how to lay them out.

use super::profile::Phase;
use super::BackendError;
use crate::model::arch::{Activation, Architecture, Moe};
use crate::model::weights::LayerWeights;

/// An activation buffer of a forward pass: a row per token of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// The residual stream (`hidden` a row): the embeddings in, the last layer's output out.
    X,
    /// A norm of the residual stream, the input of a block's products.
    Normed,
    /// Queries, keys and values (`n_heads` / `n_kv_heads` heads of `head_dim`).
    Q,
    K,
    V,
    /// Attention's output, a row of `n_heads * head_dim`.
    Attn,
    /// The feed-forward's gate and up products (`ffn` a row); the gate becomes the activation.
    Gate,
    Up,
    /// A block's output before the residual add (`hidden` a row).
    Out,
}

impl Act {
    pub const COUNT: usize = 9;

    /// The buffer's index in a backend's array of them.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What a backend does for the layer's description. Matrices and vectors are the backend's
/// own copies of the weights (`M`, `V` of [`LayerWeights`]); every operation works on all the
/// batch's tokens at once.
pub trait LayerOps {
    type Matrix;
    type Vector;

    /// `to = rms_norm(from)` for each piece of `w`'s length (a token's hidden state, or one
    /// head's values for QK-norm); in place where `from == to`.
    fn norm(&mut self, from: Act, w: &Self::Vector, to: Act) -> Result<(), BackendError>;
    /// `to_i = from · m_iᵀ` for each `(m_i, to_i)`, the products of one input together (one
    /// dispatch where the backend can); `phase` names them for the step profile.
    fn project(&mut self, phase: Phase, from: Act, products: &[(&Self::Matrix, Act)]) -> Result<(), BackendError>;
    /// `a += b` on every row.
    fn add_bias(&mut self, a: Act, b: &Self::Vector) -> Result<(), BackendError>;
    /// Rotates the queries and keys of layer `layer` by each token's position (the layer's own
    /// rotation: its base, scaling and magnitude).
    fn rope(&mut self, layer: usize, q: Act, k: Act) -> Result<(), BackendError>;
    /// Writes the keys and values into layer `layer`'s slots of the paged cache, then attends
    /// every query over its sequence's positions (its layer's window of them), with a sink
    /// logit per query head where `sinks` has them, into `to`.
    fn attend(
        &mut self,
        layer: usize,
        qkv: [Act; 3],
        sinks: Option<&Self::Vector>,
        to: Act,
    ) -> Result<(), BackendError>;
    /// `gate = act(gate, up)`.
    fn gated(&mut self, act: Activation, gate: Act, up: Act) -> Result<(), BackendError>;
    /// `x += y`.
    fn add(&mut self, x: Act, y: Act) -> Result<(), BackendError>;
    /// A mixture of experts' feed-forward of `from` into `to`: the router's logits (and bias),
    /// each token's choice of experts, the chosen experts' gated products and their weighted
    /// sum, each chosen expert's weights read once for all the tokens that chose it.
    fn experts(
        &mut self,
        w: &LayerWeights<Self::Matrix, Self::Vector>,
        router: &Self::Matrix,
        moe: &Moe,
        act: Activation,
        from: Act,
        to: Act,
    ) -> Result<(), BackendError>;
}

/// Layer `li` of `arch` over the residual stream [`Act::X`]: attention, then the feed-forward
/// (dense or a mixture of experts), each a pre-norm block with an optional post-norm before
/// its residual add.
pub fn layer<O: LayerOps>(
    o: &mut O,
    arch: &Architecture,
    li: usize,
    w: &LayerWeights<O::Matrix, O::Vector>,
) -> Result<(), BackendError> {
    use Act::*;
    o.norm(X, &w.attn_norm, Normed)?;
    o.project(Phase::QkvProjection, Normed, &[(&w.wq, Q), (&w.wk, K), (&w.wv, V)])?;
    if let Some([bq, bk, bv]) = &w.qkv_bias {
        o.add_bias(Q, bq)?;
        o.add_bias(K, bk)?;
        o.add_bias(V, bv)?;
    }
    if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
        o.norm(Q, qn, Q)?;
        o.norm(K, kn, K)?;
    }
    o.rope(li, Q, K)?;
    o.attend(li, [Q, K, V], w.attn_sinks.as_ref(), Attn)?;
    o.project(Phase::OutputProjection, Attn, &[(&w.wo, Out)])?;
    if let Some(b) = &w.wo_bias {
        o.add_bias(Out, b)?;
    }
    residual(o, w.attn_post_norm.as_ref())?;

    o.norm(X, &w.ffn_norm, Normed)?;
    match (&w.router, &arch.moe) {
        (Some(router), Some(moe)) => o.experts(w, router, moe, arch.activation, Normed, Out)?,
        _ => {
            o.project(Phase::FfnGateUp, Normed, &[(&w.w_gate, Gate), (&w.w_up, Up)])?;
            o.gated(arch.activation, Gate, Up)?;
            o.project(Phase::FfnDown, Gate, &[(&w.w_down, Out)])?;
        }
    }
    residual(o, w.ffn_post_norm.as_ref())
}

/// `X += post_norm(Out)`, or `X += Out` without a post-norm.
fn residual<O: LayerOps>(o: &mut O, post_norm: Option<&O::Vector>) -> Result<(), BackendError> {
    if let Some(p) = post_norm {
        o.norm(Act::Out, p, Act::Out)?;
    }
    o.add(Act::X, Act::Out)
}
