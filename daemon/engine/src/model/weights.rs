//! Weight tensors of a model, borrowed from the file they were loaded from, found by the names of
//! their file format and split where the file fuses them.
//!
//! A [`Tensor`] is a dtype, a 2-D shape and a window into a [`Blob`] (usually the memory map):
//! quantized weights stay quantized and in place. Only the small norm vectors are copied to f32.

use super::config::LlamaConfig;
use super::mmap::Blob;
use super::ModelError;
use inferd_kernels::deltanet::DeltaShape;
use inferd_kernels::matmul::Matrix;
use inferd_kernels::pack::Layout;
use inferd_kernels::quant::dequantize_row;
use inferd_kernels::DType;

/// A 2-D weight: `rows` output features of `cols` inputs each, row-major as the file has it,
/// or packed by the CPU backend ([`Tensor::layout`]).
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    blob: Blob,
    offset: usize,
    /// How the rows lie in the bytes: as the file stores them, or packed by the CPU backend.
    layout: Layout,
}

impl Tensor {
    /// A tensor over `blob[offset..]`; fails unless the bytes are there and the row length fits
    /// the dtype's block size.
    pub fn new(
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
        blob: Blob,
        offset: usize,
    ) -> Result<Tensor, ModelError> {
        let bad =
            || ModelError::Shape(format!("tensor '{name}': {rows}x{cols} {} does not fit its data", dtype.name()));
        let row_bytes = dtype.bytes_for(cols).ok_or_else(bad)?;
        let len = row_bytes.checked_mul(rows).ok_or_else(bad)?;
        if offset.checked_add(len).is_none_or(|end| end > blob.bytes().len()) {
            return Err(bad());
        }
        Ok(Tensor { name: name.to_string(), dtype, rows, cols, blob, offset, layout: Layout::Rows })
    }

    /// How the rows lie in [`Tensor::bytes`].
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The tensor's bytes, in its [`Tensor::layout`].
    pub fn bytes(&self) -> &[u8] {
        let len = self.dtype.bytes_for(self.cols).unwrap_or(0) * self.rows;
        &self.blob.bytes()[self.offset..self.offset + len]
    }

    pub fn matrix(&self) -> Matrix<'_> {
        Matrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: self.bytes(), layout: self.layout }
    }

    /// This tensor in the layout the 16-row kernel reads fastest, in memory of its own
    /// ([`inferd_kernels::pack`], on `pool`'s threads); `None` when its type has no packed
    /// layout or it is packed already.
    pub fn packed(&self, pool: &inferd_kernels::pool::ThreadPool) -> Option<Tensor> {
        if self.layout != Layout::Rows {
            return None;
        }
        let bytes = inferd_kernels::pack::pack(pool, self.dtype, self.rows, self.cols, self.bytes())?;
        let blob = Blob::from_bytes(bytes);
        let (name, dtype, rows, cols) = (self.name.clone(), self.dtype, self.rows, self.cols);
        Some(Tensor { name, dtype, rows, cols, blob, offset: 0, layout: Layout::Packed16 })
    }

    /// Says this tensor's bytes in the file will not be read for a while ([`Blob::release`]):
    /// after it was packed, for instance.
    pub fn release(&self) {
        self.blob.release(self.offset, self.bytes().len());
    }

    /// Dequantizes row `r` into `out` (`cols` floats): embedding lookups.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let m = self.matrix();
        if self.layout == Layout::Packed16 {
            let mut row = vec![0; m.row_bytes()];
            inferd_kernels::pack::unpack_row(self.dtype, m.data, m.row_bytes(), r, &mut row);
            dequantize_row(self.dtype, &row, out);
        } else {
            dequantize_row(self.dtype, m.row(r), out);
        }
    }

    /// The whole tensor as f32 (for small vectors such as norm weights).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        for (r, out) in v.chunks_exact_mut(self.cols).enumerate() {
            self.row_f32(r, out);
        }
        v
    }

    /// Rows `r0..r1` of this tensor (one part of a fused matrix), still in place; of a tensor
    /// in the file's layout (fused matrices are split at load, before any packing).
    pub fn rows_of(&self, r0: usize, r1: usize) -> Tensor {
        assert_eq!(self.layout, Layout::Rows, "rows of a packed tensor");
        let rb = self.dtype.bytes_for(self.cols).unwrap_or(0);
        let (r0, r1) = (r0.min(self.rows), r1.min(self.rows).max(r0.min(self.rows)));
        Tensor {
            name: format!("{}[{r0}..{r1}]", self.name),
            dtype: self.dtype,
            rows: r1 - r0,
            cols: self.cols,
            blob: self.blob.clone(),
            offset: self.offset + r0 * rb,
            layout: Layout::Rows,
        }
    }

    /// The row ranges `ranges` of this tensor one after the other, in memory of its own (a
    /// fused matrix whose parts interleave, split at load); of a tensor in the file's layout.
    pub fn gather(&self, ranges: &[(usize, usize)]) -> Tensor {
        let rb = self.dtype.bytes_for(self.cols).unwrap_or(0);
        let mut bytes = Vec::new();
        let mut rows = 0;
        for &(r0, r1) in ranges {
            let t = self.rows_of(r0, r1);
            bytes.extend_from_slice(t.bytes());
            rows += t.rows;
        }
        debug_assert_eq!(bytes.len(), rows * rb);
        let (name, dtype, cols) = (format!("{}[gathered]", self.name), self.dtype, self.cols);
        Tensor { name, dtype, rows, cols, blob: Blob::from_vec(bytes), offset: 0, layout: Layout::Rows }
    }

    fn expect(self, rows: usize, cols: usize) -> Result<Tensor, ModelError> {
        if (self.rows, self.cols) != (rows, cols) {
            return Err(ModelError::Shape(format!(
                "tensor '{}' is {}x{}, expected {rows}x{cols}",
                self.name, self.rows, self.cols
            )));
        }
        if !cols.is_multiple_of(self.dtype.block_len()) {
            return Err(ModelError::Shape(format!(
                "tensor '{}' rows of {cols} are not whole quantization blocks",
                self.name
            )));
        }
        Ok(self)
    }
}

/// A layer's attention over the KV cache.
#[derive(Clone, Debug)]
pub struct AttnWeights<M = Tensor, V = Vec<f32>> {
    /// Q (of a gated attention, each head's queries followed by its output gate), K, V and
    /// the output projection. A layer without V's projection takes K's as its values (Gemma
    /// 4); one without K's either computes no K/V and reads another layer's
    /// ([`crate::model::arch::LayerAttention::kv_from`]).
    pub wq: M,
    pub wk: Option<M>,
    pub wv: Option<M>,
    pub wo: M,
    /// Biases of Q, K and V (Qwen 2, gpt-oss).
    pub qkv_bias: Option<[V; 3]>,
    /// The attention output projection's bias (gpt-oss).
    pub wo_bias: Option<V>,
    /// Each query head's sink logit (gpt-oss).
    pub sinks: Option<V>,
    /// Per-head RMSNorm weights of Q and K (`head_dim` each).
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    /// V's per-head RMSNorm, of weights all one ([`crate::model::Architecture::value_norm`]).
    pub v_norm: Option<V>,
}

/// A layer's part of the per-layer embeddings ([`PerLayerEmbd`]): after the feed-forward's
/// residual add, `x += post_norm(proj(gelu(gate · x) * e))` with `e` the token's per-layer input
/// for this layer.
#[derive(Clone, Debug)]
pub struct LayerPle<M = Tensor, V = Vec<f32>> {
    /// `width` rows of `hidden`, and `hidden` rows of `width`.
    pub gate: M,
    pub proj: M,
    pub post_norm: V,
}

/// Gemma 4's per-layer embeddings: a token's input to layer `l` is
/// `(table[token][l] * sqrt(width) + rms_norm(proj(x_emb)[l] / sqrt(hidden))) / sqrt(2)`, with
/// `x_emb` its scaled embedding. The table (`vocab` rows of `layers * width`) is as large as the
/// embedding matrix or larger and is read a row per token: it stays in the file's mapping, out
/// of the set of weights every step reads.
#[derive(Clone, Debug)]
pub struct PerLayerEmbd {
    pub width: usize,
    pub table: Tensor,
    /// `layers * width` rows of `hidden`, and the norm of each layer's piece (`width`).
    pub proj: Tensor,
    pub proj_norm: Vec<f32>,
}

/// A layer's Gated DeltaNet ([`inferd_kernels::deltanet`]): its input projections, the
/// convolution in front of the recurrence, the decay and write strength, the gated output norm.
#[derive(Clone, Debug)]
pub struct DeltaWeights<M = Tensor, V = Vec<f32>> {
    /// Queries, keys and values before the convolution (`2 k_heads dk + v_heads dv` rows, in
    /// that order).
    pub qkv: M,
    /// The output gate `z` (`v_heads dv` rows).
    pub z: M,
    /// The write strength's and the decay's projections (`v_heads` rows each).
    pub beta: M,
    pub alpha: M,
    /// The convolution's taps, the oldest first, a row of every channel's each
    /// ([`inferd_kernels::deltanet::conv_taps`]).
    pub conv: V,
    /// The decay's bias and scale: `g = softplus(alpha + dt_bias) * a`, `a < 0`.
    pub dt_bias: V,
    pub a: V,
    /// The per-head RMSNorm of the output (`dv`), before the gate.
    pub norm: V,
    /// The output projection (`hidden` rows of `v_heads dv`).
    pub out: M,
}

/// A mixture's shared expert ([`crate::model::arch::Moe::shared_ffn`]): its gate, up and
/// down, and the one row of `hidden` whose product with the token is its gate's logit; or,
/// ungated, the dense feed-forward beside the experts ([`BesideDense`]).
#[derive(Clone, Debug)]
pub struct SharedExpert<M = Tensor> {
    pub gate: M,
    pub up: M,
    pub down: M,
    pub gate_inp: Option<M>,
}

/// The norms of a layer whose experts run beside its dense feed-forward (Gemma 4's 26B-A4B;
/// the dense one is the layer's [`SharedExpert`], ungated): `ffn_norm` before the dense
/// branch and `dense_post_norm` after it, `pre_norm` before the experts and
/// `experts_post_norm` after them, the router reading `rms_norm(x) * router_norm` (the file's
/// per-channel scale over `sqrt(hidden)`), and each expert's output scaled by its
/// `expert_scale`.
#[derive(Clone, Debug)]
pub struct BesideDense<V = Vec<f32>> {
    pub pre_norm: V,
    pub dense_post_norm: V,
    pub experts_post_norm: V,
    pub router_norm: V,
    pub expert_scale: V,
}

/// What mixes a layer's tokens.
#[derive(Clone, Debug)]
pub enum Mixer<M = Tensor, V = Vec<f32>> {
    Attention(AttnWeights<M, V>),
    DeltaNet(DeltaWeights<M, V>),
}

/// The weights of one transformer block; the optional ones are there exactly when the
/// architecture asks for them (QKV bias, QK-norm, post-norms). Generic over where they live: the
/// model's own are [`Tensor`]s and `Vec<f32>`s borrowed from the file; a device backend holds a
/// copy in its own memory ([`LayerWeights::try_map`]) and the layer's description
/// ([`crate::backend::layer`]) reads either.
#[derive(Clone, Debug)]
pub struct LayerWeights<M = Tensor, V = Vec<f32>> {
    pub attn_norm: V,
    pub mixer: Mixer<M, V>,
    /// RMSNorm of the attention output before the residual add (Gemma).
    pub attn_post_norm: Option<V>,
    pub ffn_norm: V,
    /// The feed-forward's matrices; of a mixture of experts, every expert's stacked as GGUF's
    /// 3-D tensors hold them (`experts * expert_ffn` rows of gate and up, `experts * hidden`
    /// of down: [`inferd_kernels::moe::Experts`]).
    pub w_gate: M,
    pub w_up: M,
    pub w_down: M,
    /// A mixture of experts' router (`experts` rows of `hidden`).
    pub router: Option<M>,
    /// The router's bias (one per expert) and the experts' gate, up and down biases (each
    /// expert's rows after the one before's), where the family has them (gpt-oss).
    pub router_bias: Option<V>,
    pub expert_biases: Option<[V; 3]>,
    /// The mixture's shared expert, where the family has one.
    pub shared: Option<SharedExpert<M>>,
    /// RMSNorm of the MLP output before the residual add (Gemma).
    pub ffn_post_norm: Option<V>,
    /// The layer's part of the per-layer embeddings (Gemma 4).
    pub ple: Option<LayerPle<M, V>>,
    /// A scalar (one value) the layer's output is multiplied by (Gemma 4).
    pub out_scale: Option<V>,
    /// The norms and scales of experts beside a dense feed-forward (Gemma 4's 26B-A4B).
    pub beside_dense: Option<BesideDense<V>>,
}

impl<M, V> LayerWeights<M, V> {
    /// The layer's attention, where it has one.
    pub fn attention(&self) -> Option<&AttnWeights<M, V>> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }
}

impl LayerWeights {
    /// The layer's matrices (its matrix products, each read once per forward pass; a mixture
    /// of experts' stacks whole, though a step reads only the experts its tokens chose): the
    /// mixer's, then gate, up and down.
    pub fn matrices(&self) -> Vec<&Tensor> {
        let mut m = self.mixer_matrices();
        m.extend([&self.w_gate, &self.w_up, &self.w_down]);
        m.extend(
            self.shared.iter().flat_map(|s| [Some(&s.gate), Some(&s.up), Some(&s.down), s.gate_inp.as_ref()]).flatten(),
        );
        m.extend(self.ple.iter().flat_map(|p| [&p.gate, &p.proj]));
        m
    }

    /// The mixer's matrices: Q, K, V and the output projection, or a DeltaNet's input
    /// projections and its output projection.
    pub fn mixer_matrices(&self) -> Vec<&Tensor> {
        match &self.mixer {
            Mixer::Attention(a) => {
                [Some(&a.wq), a.wk.as_ref(), a.wv.as_ref(), Some(&a.wo)].into_iter().flatten().collect()
            }
            Mixer::DeltaNet(d) => vec![&d.qkv, &d.z, &d.beta, &d.alpha, &d.out],
        }
    }

    /// The shared expert's and the per-layer embedding's matrices, to be replaced (the CPU
    /// backend's packing).
    pub fn shared_matrices_mut(&mut self) -> Vec<&mut Tensor> {
        let mut m: Vec<&mut Tensor> = self
            .shared
            .iter_mut()
            .flat_map(|s| [Some(&mut s.gate), Some(&mut s.up), Some(&mut s.down), s.gate_inp.as_mut()])
            .flatten()
            .collect();
        m.extend(self.ple.iter_mut().flat_map(|p| [&mut p.gate, &mut p.proj]));
        m
    }

    /// The mixer's matrices, to be replaced (the CPU backend's packing).
    pub fn mixer_matrices_mut(&mut self) -> Vec<&mut Tensor> {
        match &mut self.mixer {
            Mixer::Attention(a) => {
                [Some(&mut a.wq), a.wk.as_mut(), a.wv.as_mut(), Some(&mut a.wo)].into_iter().flatten().collect()
            }
            Mixer::DeltaNet(d) => vec![&mut d.qkv, &mut d.z, &mut d.beta, &mut d.alpha, &mut d.out],
        }
    }
}

impl<M, V> LayerWeights<M, V> {
    /// The same layer with every matrix through `m` and every vector through `v` (a device
    /// backend's upload); the first error stops it.
    pub fn try_map<M2, V2, E>(
        &self,
        mut m: impl FnMut(&M) -> Result<M2, E>,
        mut v: impl FnMut(&V) -> Result<V2, E>,
    ) -> Result<LayerWeights<M2, V2>, E> {
        let mixer = match &self.mixer {
            Mixer::Attention(a) => {
                let mut opt = |x: &Option<V>| x.as_ref().map(&mut v).transpose();
                let (wo_bias, sinks, q_norm, k_norm, v_norm) =
                    (opt(&a.wo_bias)?, opt(&a.sinks)?, opt(&a.q_norm)?, opt(&a.k_norm)?, opt(&a.v_norm)?);
                let qkv_bias = match &a.qkv_bias {
                    Some([x, y, z]) => Some([v(x)?, v(y)?, v(z)?]),
                    None => None,
                };
                Mixer::Attention(AttnWeights {
                    wq: m(&a.wq)?,
                    wk: a.wk.as_ref().map(&mut m).transpose()?,
                    wv: a.wv.as_ref().map(&mut m).transpose()?,
                    wo: m(&a.wo)?,
                    qkv_bias,
                    wo_bias,
                    sinks,
                    q_norm,
                    k_norm,
                    v_norm,
                })
            }
            Mixer::DeltaNet(d) => Mixer::DeltaNet(DeltaWeights {
                qkv: m(&d.qkv)?,
                z: m(&d.z)?,
                beta: m(&d.beta)?,
                alpha: m(&d.alpha)?,
                conv: v(&d.conv)?,
                dt_bias: v(&d.dt_bias)?,
                a: v(&d.a)?,
                norm: v(&d.norm)?,
                out: m(&d.out)?,
            }),
        };
        let mut opt = |x: &Option<V>| x.as_ref().map(&mut v).transpose();
        let (attn_post_norm, router_bias, ffn_post_norm, out_scale) =
            (opt(&self.attn_post_norm)?, opt(&self.router_bias)?, opt(&self.ffn_post_norm)?, opt(&self.out_scale)?);
        let ple = match &self.ple {
            Some(p) => Some(LayerPle { gate: m(&p.gate)?, proj: m(&p.proj)?, post_norm: v(&p.post_norm)? }),
            None => None,
        };
        let beside_dense = match &self.beside_dense {
            Some(b) => Some(BesideDense {
                pre_norm: v(&b.pre_norm)?,
                dense_post_norm: v(&b.dense_post_norm)?,
                experts_post_norm: v(&b.experts_post_norm)?,
                router_norm: v(&b.router_norm)?,
                expert_scale: v(&b.expert_scale)?,
            }),
            None => None,
        };
        let expert_biases = match &self.expert_biases {
            Some([a, b, c]) => Some([v(a)?, v(b)?, v(c)?]),
            None => None,
        };
        Ok(LayerWeights {
            attn_norm: v(&self.attn_norm)?,
            mixer,
            attn_post_norm,
            ffn_norm: v(&self.ffn_norm)?,
            w_gate: m(&self.w_gate)?,
            w_up: m(&self.w_up)?,
            w_down: m(&self.w_down)?,
            router: self.router.as_ref().map(&mut m).transpose()?,
            router_bias,
            expert_biases,
            shared: match &self.shared {
                Some(s) => Some(SharedExpert {
                    gate: m(&s.gate)?,
                    up: m(&s.up)?,
                    down: m(&s.down)?,
                    gate_inp: s.gate_inp.as_ref().map(&mut m).transpose()?,
                }),
                None => None,
            },
            ffn_post_norm,
            ple,
            out_scale,
            beside_dense,
        })
    }
}

/// All weights of a model.
#[derive(Clone, Debug)]
pub struct LlamaWeights {
    pub token_embd: Tensor,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output projection; the embedding matrix itself when the model ties them (the CPU
    /// backend packs a copy of its own, the embedding stays as it is).
    pub output: Tensor,
    /// Per-layer embeddings (Gemma 4).
    pub per_layer: Option<PerLayerEmbd>,
}

/// The tensor names of one file format.
#[derive(Clone, Copy, Debug)]
pub enum Naming {
    Gguf,
    HuggingFace,
}

/// What a tensor is to the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    AttnNorm,
    Q,
    K,
    V,
    Qkv,
    O,
    QNorm,
    KNorm,
    AttnPostNorm,
    FfnNorm,
    FfnPostNorm,
    Gate,
    Up,
    GateUp,
    Down,
}

impl Naming {
    /// The name of a layer's tensor: GGUF's (llama.cpp's names, the same for every family) or
    /// Hugging Face's (where Gemma names its norms apart from Llama).
    fn layer(self, role: Role, i: usize, gemma: bool, suffix: &str) -> String {
        let what = match (self, role) {
            (Naming::Gguf, Role::AttnNorm) => "attn_norm",
            (Naming::Gguf, Role::Q) => "attn_q",
            (Naming::Gguf, Role::K) => "attn_k",
            (Naming::Gguf, Role::V) => "attn_v",
            (Naming::Gguf, Role::Qkv) => "attn_qkv",
            (Naming::Gguf, Role::O) => "attn_output",
            (Naming::Gguf, Role::QNorm) => "attn_q_norm",
            (Naming::Gguf, Role::KNorm) => "attn_k_norm",
            (Naming::Gguf, Role::AttnPostNorm) => "post_attention_norm",
            (Naming::Gguf, Role::FfnNorm) => "ffn_norm",
            (Naming::Gguf, Role::FfnPostNorm) => "post_ffw_norm",
            (Naming::Gguf, Role::Gate) => "ffn_gate",
            (Naming::Gguf, Role::Up | Role::GateUp) => "ffn_up",
            (Naming::Gguf, Role::Down) => "ffn_down",
            (Naming::HuggingFace, Role::AttnNorm) => "input_layernorm",
            (Naming::HuggingFace, Role::Q) => "self_attn.q_proj",
            (Naming::HuggingFace, Role::K) => "self_attn.k_proj",
            (Naming::HuggingFace, Role::V) => "self_attn.v_proj",
            (Naming::HuggingFace, Role::Qkv) => "self_attn.qkv_proj",
            (Naming::HuggingFace, Role::O) => "self_attn.o_proj",
            (Naming::HuggingFace, Role::QNorm) => "self_attn.q_norm",
            (Naming::HuggingFace, Role::KNorm) => "self_attn.k_norm",
            (Naming::HuggingFace, Role::AttnPostNorm) => "post_attention_layernorm",
            (Naming::HuggingFace, Role::FfnNorm) if gemma => "pre_feedforward_layernorm",
            (Naming::HuggingFace, Role::FfnNorm) => "post_attention_layernorm",
            (Naming::HuggingFace, Role::FfnPostNorm) => "post_feedforward_layernorm",
            (Naming::HuggingFace, Role::Gate) => "mlp.gate_proj",
            (Naming::HuggingFace, Role::Up) => "mlp.up_proj",
            (Naming::HuggingFace, Role::GateUp) => "mlp.gate_up_proj",
            (Naming::HuggingFace, Role::Down) => "mlp.down_proj",
        };
        match self {
            Naming::Gguf => format!("blk.{i}.{what}.{suffix}"),
            Naming::HuggingFace => format!("model.layers.{i}.{what}.{suffix}"),
        }
    }

    fn global(self, what: &str) -> String {
        match (self, what) {
            (Naming::Gguf, _) => format!("{what}.weight"),
            (Naming::HuggingFace, "lm_head") => "lm_head.weight".into(),
            (Naming::HuggingFace, _) => format!("model.{what}.weight"),
        }
    }
}

impl LlamaWeights {
    /// Collects and shape-checks every tensor the architecture reads through `get`
    /// (name -> tensor), splitting fused matrices by rows.
    pub fn load(
        cfg: &LlamaConfig,
        arch: &super::Architecture,
        naming: Naming,
        get: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<LlamaWeights, ModelError> {
        let hf = matches!(naming, Naming::HuggingFace);
        let layout = arch.layout;
        let fetch = |name: String| get(&name).ok_or(ModelError::MissingTensor(name));
        let vector = |name: String, n: usize| -> Result<Vec<f32>, ModelError> {
            let t = fetch(name)?;
            if t.rows * t.cols != n {
                return Err(ModelError::Shape(format!(
                    "tensor '{}' has {} elements, expected {n}",
                    t.name,
                    t.rows * t.cols
                )));
            }
            Ok(t.to_f32())
        };
        let norm = |name: String, n: usize| -> Result<Vec<f32>, ModelError> {
            let mut w = vector(name, n)?;
            w.iter_mut().for_each(|x| *x += layout.norm_offset);
            Ok(w)
        };
        let h = cfg.hidden;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let f = arch.ffn_widths[i];
            let la = &arch.layers[i];
            let (q, kv, hd) = (la.q_dim(cfg.n_heads), la.kv_dim(), la.head_dim);
            let name = |role: Role| naming.layer(role, i, layout.gemma_names, "weight");
            let delta = arch.delta.filter(|_| arch.layers[i].delta_net);
            let moe = arch.moe.filter(|_| !hf);
            if arch.moe.is_some() && hf {
                return Err(ModelError::Unsupported("a mixture of experts from Hugging Face files".into()));
            }
            let (w_gate, w_up) = if let Some(m) = moe {
                let stack = |what: &str| fetch(format!("blk.{i}.{what}.weight"))?.expect(m.experts * m.expert_ffn, h);
                match get(&format!("blk.{i}.ffn_gate_up_exps.weight")).filter(|_| m.beside_dense) {
                    // Each expert's gate rows, then its up rows: split into two stacks.
                    Some(t) => {
                        let (e, f) = (m.experts, m.expert_ffn);
                        let t = t.expect(e * 2 * f, h)?;
                        let part = |at: usize| (0..e).map(|x| (x * 2 * f + at, x * 2 * f + at + f)).collect::<Vec<_>>();
                        let (g, u) = (t.gather(&part(0)), t.gather(&part(f)));
                        t.release();
                        (g, u)
                    }
                    None => (stack("ffn_gate_exps")?, stack("ffn_up_exps")?),
                }
            } else if layout.fused_gate_up {
                let gu = fetch(name(Role::GateUp))?.expect(2 * f, h)?;
                (gu.rows_of(0, f), gu.rows_of(f, 2 * f))
            } else {
                (fetch(name(Role::Gate))?.expect(f, h)?, fetch(name(Role::Up))?.expect(f, h)?)
            };
            let bias = |role: Role, n: usize| vector(naming.layer(role, i, layout.gemma_names, "bias"), n);
            let post = arch.norm == super::arch::NormPlacement::PreAndPost;
            let ffn_norm = if layout.ffn_norm_is_post_attention { Role::AttnPostNorm } else { Role::FfnNorm };
            let biased = moe.filter(|m| m.biased);
            let gguf_bias = |what: &str, n: usize| vector(format!("blk.{i}.{what}.bias"), n);
            let mixer = match delta {
                Some(d) => {
                    let gguf = |what: &str| format!("blk.{i}.{what}.weight");
                    let (kd, vd) = (d.shape.k_heads * d.shape.dk, d.shape.v_heads * d.shape.dv);
                    let heads = d.shape.v_heads;
                    let (qkv, z) = match get(&gguf("ssm_in")) {
                        Some(t) => fused_qkvz(t, d.shape, h)?,
                        None => {
                            (fetch(gguf("attn_qkv"))?.expect(2 * kd + vd, h)?, fetch(gguf("attn_gate"))?.expect(vd, h)?)
                        }
                    };
                    let (beta, alpha) = match get(&gguf("ssm_ba")) {
                        Some(t) => fused_beta_alpha(t, d.shape, h)?,
                        None => {
                            (fetch(gguf("ssm_beta"))?.expect(heads, h)?, fetch(gguf("ssm_alpha"))?.expect(heads, h)?)
                        }
                    };
                    Mixer::DeltaNet(DeltaWeights {
                        qkv,
                        z,
                        beta,
                        alpha,
                        conv: inferd_kernels::deltanet::conv_taps(
                            &vector(gguf("ssm_conv1d"), (2 * kd + vd) * d.conv)?,
                            d.conv,
                        ),
                        dt_bias: vector(format!("blk.{i}.ssm_dt.bias"), heads)?,
                        a: vector(format!("blk.{i}.ssm_a"), heads)?,
                        norm: vector(gguf("ssm_norm"), d.shape.dv)?,
                        out: fetch(gguf("ssm_out"))?.expect(h, vd)?,
                    })
                }
                None => {
                    let own_kv = la.kv_from.is_none();
                    let (wq, wk, wv) = if layout.fused_qkv {
                        let qkv = fetch(name(Role::Qkv))?.expect(q + 2 * kv, h)?;
                        (qkv.rows_of(0, q), Some(qkv.rows_of(q, q + kv)), Some(qkv.rows_of(q + kv, q + 2 * kv)))
                    } else {
                        // A gated attention's Q projection also gives each head's output gate.
                        let q_rows = if arch.attn_output_gate { 2 * q } else { q };
                        // Gemma 4's layers may take V from K's projection.
                        let wv = match get(&name(Role::V)) {
                            None if arch.value_norm => None,
                            _ => Some(fetch(name(Role::V))?.expect(kv, h)?),
                        };
                        (
                            fetch(name(Role::Q))?.expect(q_rows, h)?,
                            own_kv.then(|| fetch(name(Role::K))?.expect(kv, h)).transpose()?,
                            wv.filter(|_| own_kv),
                        )
                    };
                    if !own_kv && (get(&name(Role::K)).is_some() || get(&name(Role::V)).is_some()) {
                        return Err(ModelError::Unsupported(format!(
                            "layer {i} reads another layer's K/V and has K or V projections of its own"
                        )));
                    }
                    Mixer::Attention(AttnWeights {
                        wq,
                        wk,
                        wv,
                        wo: fetch(name(Role::O))?.expect(h, q)?,
                        qkv_bias: if arch.qkv_bias {
                            Some([bias(Role::Q, q)?, bias(Role::K, kv)?, bias(Role::V, kv)?])
                        } else {
                            None
                        },
                        wo_bias: arch.attn_out_bias.then(|| bias(Role::O, h)).transpose()?,
                        sinks: arch
                            .attn_sinks
                            .then(|| vector(format!("blk.{i}.attn_sinks.weight"), cfg.n_heads))
                            .transpose()?,
                        q_norm: arch.qk_norm.then(|| norm(name(Role::QNorm), hd)).transpose()?,
                        k_norm: (arch.qk_norm && own_kv).then(|| norm(name(Role::KNorm), hd)).transpose()?,
                        v_norm: (arch.value_norm && own_kv).then(|| vec![1.0; hd]),
                    })
                }
            };
            layers.push(LayerWeights {
                attn_norm: norm(name(Role::AttnNorm), h)?,
                mixer,
                attn_post_norm: post.then(|| norm(name(Role::AttnPostNorm), h)).transpose()?,
                ffn_norm: norm(name(ffn_norm), h)?,
                w_gate,
                w_up,
                w_down: match moe {
                    Some(m) => fetch(format!("blk.{i}.ffn_down_exps.weight"))?.expect(m.experts * h, m.expert_ffn)?,
                    None => fetch(name(Role::Down))?.expect(h, f)?,
                },
                router: moe.map(|m| fetch(format!("blk.{i}.ffn_gate_inp.weight"))?.expect(m.experts, h)).transpose()?,
                router_bias: biased.map(|m| gguf_bias("ffn_gate_inp", m.experts)).transpose()?,
                expert_biases: biased
                    .map(|m| -> Result<[Vec<f32>; 3], ModelError> {
                        let width = m.experts * m.expert_ffn;
                        Ok([
                            gguf_bias("ffn_gate_exps", width)?,
                            gguf_bias("ffn_up_exps", width)?,
                            gguf_bias("ffn_down_exps", m.experts * h)?,
                        ])
                    })
                    .transpose()?,
                shared: match moe {
                    // The dense feed-forward beside the experts: ungated.
                    Some(m) if m.beside_dense => Some(SharedExpert {
                        gate: fetch(name(Role::Gate))?.expect(f, h)?,
                        up: fetch(name(Role::Up))?.expect(f, h)?,
                        down: fetch(name(Role::Down))?.expect(h, f)?,
                        gate_inp: None,
                    }),
                    _ => moe
                        .and_then(|m| m.shared_ffn)
                        .map(|sf| -> Result<SharedExpert, ModelError> {
                            let t = |what: &str| fetch(format!("blk.{i}.{what}.weight"));
                            Ok(SharedExpert {
                                gate: t("ffn_gate_shexp")?.expect(sf, h)?,
                                up: t("ffn_up_shexp")?.expect(sf, h)?,
                                down: t("ffn_down_shexp")?.expect(h, sf)?,
                                gate_inp: Some(t("ffn_gate_inp_shexp")?.expect(1, h)?),
                            })
                        })
                        .transpose()?,
                },
                beside_dense: moe
                    .filter(|m| m.beside_dense)
                    .map(|m| -> Result<BesideDense, ModelError> {
                        let t = |what: &str, n: usize| norm(format!("blk.{i}.{what}.weight"), n);
                        let mut router_norm = vector(format!("blk.{i}.ffn_gate_inp.scale"), h)?;
                        let to_unit = 1.0 / (h as f32).sqrt();
                        router_norm.iter_mut().for_each(|x| *x *= to_unit);
                        let scale = format!("blk.{i}.ffn_down_exps.scale");
                        Ok(BesideDense {
                            pre_norm: t("pre_ffw_norm_2", h)?,
                            dense_post_norm: t("post_ffw_norm_1", h)?,
                            experts_post_norm: t("post_ffw_norm_2", h)?,
                            router_norm,
                            expert_scale: match get(&scale) {
                                Some(_) => vector(scale, m.experts)?,
                                None => vec![1.0; m.experts],
                            },
                        })
                    })
                    .transpose()?,
                ffn_post_norm: post.then(|| norm(name(Role::FfnPostNorm), h)).transpose()?,
                ple: arch
                    .per_layer
                    .map(|p| -> Result<LayerPle, ModelError> {
                        let t = |what: &str| fetch(format!("blk.{i}.{what}.weight"));
                        Ok(LayerPle {
                            gate: t("inp_gate")?.expect(p, h)?,
                            proj: t("proj")?.expect(h, p)?,
                            post_norm: norm(format!("blk.{i}.post_norm.weight"), h)?,
                        })
                    })
                    .transpose()?,
                // Gemma 4's files may leave it out (one).
                out_scale: match get(&format!("blk.{i}.layer_output_scale.weight")) {
                    Some(_) if arch.per_layer.is_some() || arch.value_norm => {
                        Some(vector(format!("blk.{i}.layer_output_scale.weight"), 1)?)
                    }
                    _ => None,
                },
            });
        }
        let per_layer = arch
            .per_layer
            .map(|p| -> Result<PerLayerEmbd, ModelError> {
                let n = cfg.n_layers * p;
                Ok(PerLayerEmbd {
                    width: p,
                    table: fetch("per_layer_token_embd.weight".into())?.expect(cfg.vocab, n)?,
                    proj: fetch("per_layer_model_proj.weight".into())?.expect(n, h)?,
                    proj_norm: norm("per_layer_proj_norm.weight".into(), p)?,
                })
            })
            .transpose()?;
        let token_embd = fetch(naming.global(if hf { "embed_tokens" } else { "token_embd" }))?.expect(cfg.vocab, h)?;
        let output = if arch.tied_output {
            token_embd.clone()
        } else {
            fetch(naming.global(if hf { "lm_head" } else { "output" }))?.expect(cfg.vocab, h)?
        };
        let output_norm = norm(naming.global(if hf { "norm" } else { "output_norm" }), h)?;
        Ok(LlamaWeights { token_embd, layers, output_norm, output, per_layer })
    }
}

/// Qwen3-Next's older fused input projection (`ssm_in`): per key head its query, key, value
/// heads and gates, split into the queries, keys and values of every head (in that order) and
/// the gates.
fn fused_qkvz(t: Tensor, s: DeltaShape, h: usize) -> Result<(Tensor, Tensor), ModelError> {
    let (dk, per_v) = (s.dk, s.v_heads / s.k_heads * s.dv);
    let group = 2 * dk + 2 * per_v;
    let t = t.expect(s.k_heads * group, h)?;
    let parts =
        |at: usize, len: usize| (0..s.k_heads).map(|g| (g * group + at, g * group + at + len)).collect::<Vec<_>>();
    let mut qkv = parts(0, dk);
    qkv.extend(parts(dk, dk));
    qkv.extend(parts(2 * dk, per_v));
    let (qkv, z) = (t.gather(&qkv), t.gather(&parts(2 * dk + per_v, per_v)));
    t.release();
    Ok((qkv, z))
}

/// Qwen3-Next's fused write strength and decay projection (`ssm_ba`): per key head its value
/// heads' `beta` rows, then their `alpha` rows.
fn fused_beta_alpha(t: Tensor, s: DeltaShape, h: usize) -> Result<(Tensor, Tensor), ModelError> {
    let per = s.v_heads / s.k_heads;
    let t = t.expect(2 * s.v_heads, h)?;
    let part = |at: usize| (0..s.k_heads).map(|g| (2 * per * g + at, 2 * per * g + at + per)).collect::<Vec<_>>();
    Ok((t.gather(&part(0)), t.gather(&part(per))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_tensor_keeps_its_rows() {
        // 35 rows: two packed groups of 16 and three rows as they were.
        let (rows, cols) = (35, 64);
        let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 113) as f32 / 56.0 - 1.0).collect();
        let mut data = Vec::new();
        for r in wf.chunks_exact(cols) {
            inferd_kernels::quant::quantize_row(DType::Q8_0, r, &mut data);
        }
        let t = Tensor::new("w", DType::Q8_0, rows, cols, Blob::from_vec(data), 0).unwrap();
        let pool = inferd_kernels::pool::ThreadPool::new(2);
        let p = t.packed(&pool).unwrap();
        assert_eq!((p.matrix().layout, p.bytes().len()), (Layout::Packed16, t.bytes().len()));
        assert_ne!(p.bytes(), t.bytes(), "the rows are rearranged");
        assert!(p.packed(&pool).is_none(), "a packed tensor is not packed again");
        assert_eq!(p.to_f32(), t.to_f32());
        let f16 = Tensor::new("f", DType::F16, 16, 8, Blob::from_vec(vec![0; 256]), 0).unwrap();
        assert!(f16.packed(&pool).is_none(), "float weights are not packed");
    }
}
