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
use crate::model::weights::{AttnWeights, DeltaWeights, LayerWeights, Mixer};

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
    /// A projection of two things at once: a gated attention's queries and gates (each head's
    /// after the other), or a DeltaNet's queries, keys and values before its convolution.
    Mix,
    /// The gate of the mixer's output (a gated attention's, a DeltaNet's `z`).
    MixGate,
    /// A DeltaNet's write strength and decay inputs (`v_heads` a row).
    Beta,
    Alpha,
    /// A mixture's shared expert's output (`hidden` a row) and its gate's logit (one a row).
    Shared,
    SharedGate,
    /// A layer's per-layer embedding input and its gate (Gemma 4, the embedding's width a row).
    Ple,
    PleGate,
    /// The router's input where it has a norm of its own (Gemma 4's experts, `hidden` a row).
    RouterIn,
}

/// How a gate applies to the values it gates ([`LayerOps::gate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateFn {
    /// `x * sigmoid(g)`.
    Sigmoid,
    /// `x * silu(g)`.
    Silu,
}

impl Act {
    pub const COUNT: usize = 18;

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
    /// Rotates the queries and keys (where the layer computes its own) of layer `layer` by
    /// each token's position (the layer's own rotation: its base, scaling, magnitude and
    /// rotated dimensions).
    fn rope(&mut self, layer: usize, q: Act, k: Option<Act>) -> Result<(), BackendError>;
    /// Writes the keys and values into layer `layer`'s slots of the paged cache (unless the
    /// layer reads another's: [`crate::model::arch::LayerAttention::kv_from`]), then attends
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
    /// Each row of `from` is pairs of pieces of `head_dim` floats (one pair a query head), the
    /// first of a pair going to `a` and the second to `b`.
    fn split_heads(&mut self, from: Act, a: Act, b: Act) -> Result<(), BackendError>;
    /// `x = x * f(g)`, value by value; where `g` has fewer values than `x`, each of them
    /// gates its equal piece of `x` (one a row gates the whole row).
    fn gate(&mut self, x: Act, g: Act, f: GateFn) -> Result<(), BackendError>;
    /// Layer `layer`'s Gated DeltaNet over each sequence's tokens, from its input projections
    /// (`mix`: queries, keys and values before the convolution; `beta`, `alpha`) into `to`
    /// (rows of `v_heads * dv`): the convolution with the sequence's last inputs, SiLU, the
    /// L2 norms of queries and keys, the decay and write strength, the recurrence carrying the
    /// sequence's state (a sequence starting at position 0 starts from zeros).
    fn delta_net(
        &mut self,
        layer: usize,
        w: &DeltaWeights<Self::Matrix, Self::Vector>,
        inputs: [Act; 3],
        to: Act,
    ) -> Result<(), BackendError>;
    /// `x += y`.
    fn add(&mut self, x: Act, y: Act) -> Result<(), BackendError>;
    /// `to = from`.
    fn copy(&mut self, from: Act, to: Act) -> Result<(), BackendError>;
    /// `x *= s[0]` (a layer's output scalar).
    fn scale(&mut self, x: Act, s: &Self::Vector) -> Result<(), BackendError>;
    /// `to` = each token's per-layer embedding input for layer `layer` (the pass computes them
    /// for every layer before the first: [`crate::model::weights::PerLayerEmbd`]).
    fn per_layer_input(&mut self, layer: usize, to: Act) -> Result<(), BackendError>;
    /// A mixture of experts' feed-forward of `from` into `to`: the router's logits (of
    /// `router_from`, and bias), each token's choice of experts, the chosen experts' gated
    /// products and their weighted sum (each expert's weight times its own scale where the
    /// layer has them: [`crate::model::weights::BesideDense`]), each chosen expert's weights
    /// read once for all the tokens that chose it.
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &mut self,
        w: &LayerWeights<Self::Matrix, Self::Vector>,
        router: &Self::Matrix,
        moe: &Moe,
        act: Activation,
        from: Act,
        router_from: Act,
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
    match &w.mixer {
        Mixer::Attention(a) => attention(o, arch, li, a)?,
        Mixer::DeltaNet(d) => delta_net(o, li, d)?,
    }
    residual(o, w.attn_post_norm.as_ref())?;

    o.norm(X, &w.ffn_norm, Normed)?;
    match (&w.router, &arch.moe, &w.shared, &w.beside_dense) {
        (Some(router), Some(moe), Some(dense), Some(b)) => {
            // The dense feed-forward, then the experts beside it, each branch normed before
            // and after (Gemma 4's 26B-A4B).
            o.project(Phase::FfnGateUp, Normed, &[(&dense.gate, Gate), (&dense.up, Up)])?;
            o.gated(arch.activation, Gate, Up)?;
            o.project(Phase::FfnDown, Gate, &[(&dense.down, Shared)])?;
            o.norm(Shared, &b.dense_post_norm, Shared)?;
            o.norm(X, &b.pre_norm, Normed)?;
            o.norm(X, &b.router_norm, RouterIn)?;
            o.experts(w, router, moe, arch.activation, Normed, RouterIn, Out)?;
            o.norm(Out, &b.experts_post_norm, Out)?;
            o.add(Out, Shared)?;
        }
        (Some(router), Some(moe), shared, _) => {
            o.experts(w, router, moe, arch.activation, Normed, Normed, Out)?;
            if let Some(s) = shared {
                let gate_inp = s
                    .gate_inp
                    .as_ref()
                    .ok_or_else(|| BackendError::Invalid("a shared expert without its gate".into()))?;
                o.project(Phase::FfnGateUp, Normed, &[(&s.gate, Gate), (&s.up, Up), (gate_inp, SharedGate)])?;
                o.gated(arch.activation, Gate, Up)?;
                o.project(Phase::FfnDown, Gate, &[(&s.down, Shared)])?;
                o.gate(Shared, SharedGate, GateFn::Sigmoid)?;
                o.add(Out, Shared)?;
            }
        }
        _ => {
            o.project(Phase::FfnGateUp, Normed, &[(&w.w_gate, Gate), (&w.w_up, Up)])?;
            o.gated(arch.activation, Gate, Up)?;
            o.project(Phase::FfnDown, Gate, &[(&w.w_down, Out)])?;
        }
    }
    residual(o, w.ffn_post_norm.as_ref())?;

    if let Some(p) = &w.ple {
        o.project(Phase::FfnGateUp, X, &[(&p.gate, PleGate)])?;
        o.per_layer_input(li, Ple)?;
        o.gated(Activation::GeluTanhGated, PleGate, Ple)?;
        o.project(Phase::FfnDown, PleGate, &[(&p.proj, Out)])?;
        residual(o, Some(&p.post_norm))?;
    }
    if let Some(s) = &w.out_scale {
        o.scale(X, s)?;
    }
    Ok(())
}

/// Attention over the KV cache from [`Act::Normed`] into [`Act::Out`].
fn attention<O: LayerOps>(
    o: &mut O,
    arch: &Architecture,
    li: usize,
    w: &AttnWeights<O::Matrix, O::Vector>,
) -> Result<(), BackendError> {
    use Act::*;
    // Q's projection of a gated attention gives each head's queries, then its output gate.
    let q = (&w.wq, if arch.attn_output_gate { Mix } else { Q });
    match (&w.wk, &w.wv) {
        (Some(k), Some(v)) => o.project(Phase::QkvProjection, Normed, &[q, (k, K), (v, V)])?,
        (Some(k), None) => o.project(Phase::QkvProjection, Normed, &[q, (k, K)])?,
        _ => o.project(Phase::QkvProjection, Normed, &[q])?,
    }
    if arch.attn_output_gate {
        o.split_heads(Mix, Q, MixGate)?;
    }
    // Without V's projection, V is K's (before K's norm and rotation).
    let own_kv = w.wk.is_some();
    if own_kv && w.wv.is_none() {
        o.copy(K, V)?;
    }
    if let Some([bq, bk, bv]) = &w.qkv_bias {
        o.add_bias(Q, bq)?;
        o.add_bias(K, bk)?;
        o.add_bias(V, bv)?;
    }
    if let Some(qn) = &w.q_norm {
        o.norm(Q, qn, Q)?;
    }
    if let Some(kn) = w.k_norm.as_ref().filter(|_| own_kv) {
        o.norm(K, kn, K)?;
    }
    if let Some(vn) = w.v_norm.as_ref().filter(|_| own_kv) {
        o.norm(V, vn, V)?;
    }
    o.rope(li, Q, own_kv.then_some(K))?;
    o.attend(li, [Q, K, V], w.sinks.as_ref(), Attn)?;
    if arch.attn_output_gate {
        o.gate(Attn, MixGate, GateFn::Sigmoid)?;
    }
    o.project(Phase::OutputProjection, Attn, &[(&w.wo, Out)])?;
    if let Some(b) = &w.wo_bias {
        o.add_bias(Out, b)?;
    }
    Ok(())
}

/// Gated DeltaNet from [`Act::Normed`] into [`Act::Out`]: its input projections, the
/// recurrence, the per-head norm gated by SiLU of `z`, the output projection.
fn delta_net<O: LayerOps>(o: &mut O, li: usize, w: &DeltaWeights<O::Matrix, O::Vector>) -> Result<(), BackendError> {
    use Act::*;
    o.project(Phase::QkvProjection, Normed, &[(&w.qkv, Mix), (&w.z, MixGate), (&w.beta, Beta), (&w.alpha, Alpha)])?;
    o.delta_net(li, w, [Mix, Beta, Alpha], Attn)?;
    o.norm(Attn, &w.norm, Attn)?;
    o.gate(Attn, MixGate, GateFn::Silu)?;
    o.project(Phase::OutputProjection, Attn, &[(&w.out, Out)])
}

/// `X += post_norm(Out)`, or `X += Out` without a post-norm.
fn residual<O: LayerOps>(o: &mut O, post_norm: Option<&O::Vector>) -> Result<(), BackendError> {
    if let Some(p) = post_norm {
        o.norm(Act::Out, p, Act::Out)?;
    }
    o.add(Act::X, Act::Out)
}
