//! Weight tensors of a Llama model, borrowed from the file they were loaded from.
//!
//! A [`Tensor`] is a dtype, a 2-D shape and a window into a [`Blob`] (usually the memory map):
//! quantized weights stay quantized and in place. Only the small norm vectors are copied to f32.

use super::config::LlamaConfig;
use super::mmap::Blob;
use super::ModelError;
use inferd_kernels::matmul::Matrix;
use inferd_kernels::quant::dequantize_row;
use inferd_kernels::DType;

/// A 2-D weight: `rows` output features of `cols` inputs each, row-major.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    blob: Blob,
    offset: usize,
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
        Ok(Tensor { name: name.to_string(), dtype, rows, cols, blob, offset })
    }

    pub fn bytes(&self) -> &[u8] {
        let len = self.dtype.bytes_for(self.cols).unwrap_or(0) * self.rows;
        &self.blob.bytes()[self.offset..self.offset + len]
    }

    pub fn matrix(&self) -> Matrix<'_> {
        Matrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: self.bytes() }
    }

    /// Dequantizes row `r` into `out` (`cols` floats): embedding lookups.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.dtype, self.matrix().row(r), out);
    }

    /// The whole tensor as f32 (for small vectors such as norm weights).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        for (r, out) in v.chunks_exact_mut(self.cols).enumerate() {
            self.row_f32(r, out);
        }
        v
    }

    fn expect(self, rows: usize, cols: usize) -> Result<Tensor, ModelError> {
        if (self.rows, self.cols) != (rows, cols) {
            return Err(ModelError::Shape(format!(
                "tensor '{}' is {}x{}, expected {rows}x{cols}",
                self.name, self.rows, self.cols
            )));
        }
        if self.dtype.is_quantized() && !cols.is_multiple_of(inferd_kernels::quant::QK) {
            return Err(ModelError::Shape(format!(
                "tensor '{}' rows of {cols} are not whole quantization blocks",
                self.name
            )));
        }
        Ok(self)
    }
}

/// The weights of one transformer block.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
}

/// All weights of a Llama model.
#[derive(Clone, Debug)]
pub struct LlamaWeights {
    pub token_embd: Tensor,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output projection; the embedding matrix itself when the model ties them.
    pub output: Tensor,
}

/// The tensor names of one file format.
#[derive(Clone, Copy, Debug)]
pub enum Naming {
    Gguf,
    HuggingFace,
}

impl Naming {
    fn name(self, what: &str, layer: Option<usize>) -> String {
        match (self, layer) {
            (Naming::Gguf, Some(i)) => format!("blk.{i}.{what}.weight"),
            (Naming::Gguf, None) => format!("{what}.weight"),
            (Naming::HuggingFace, Some(i)) => format!("model.layers.{i}.{what}.weight"),
            (Naming::HuggingFace, None) if what == "lm_head" => "lm_head.weight".into(),
            (Naming::HuggingFace, None) => format!("model.{what}.weight"),
        }
    }
}

impl LlamaWeights {
    /// Collects and shape-checks every tensor through `get` (name -> tensor).
    pub fn load(
        cfg: &LlamaConfig,
        arch: &super::Architecture,
        naming: Naming,
        get: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<LlamaWeights, ModelError> {
        let hf = matches!(naming, Naming::HuggingFace);
        let fetch = |what: &str, layer: Option<usize>| {
            let name = naming.name(what, layer);
            get(&name).ok_or(ModelError::MissingTensor(name))
        };
        let vector = |what: &str, layer: Option<usize>, n: usize| -> Result<Vec<f32>, ModelError> {
            let t = fetch(what, layer)?;
            if t.rows * t.cols != n {
                return Err(ModelError::Shape(format!(
                    "tensor '{}' has {} elements, expected {n}",
                    t.name,
                    t.rows * t.cols
                )));
            }
            Ok(t.to_f32())
        };
        let (h, q, kv, f) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let l = Some(i);
            let n = |g: &str, hf_name: &str| if hf { hf_name.to_string() } else { g.to_string() };
            layers.push(LayerWeights {
                attn_norm: vector(&n("attn_norm", "input_layernorm"), l, h)?,
                wq: fetch(&n("attn_q", "self_attn.q_proj"), l)?.expect(q, h)?,
                wk: fetch(&n("attn_k", "self_attn.k_proj"), l)?.expect(kv, h)?,
                wv: fetch(&n("attn_v", "self_attn.v_proj"), l)?.expect(kv, h)?,
                wo: fetch(&n("attn_output", "self_attn.o_proj"), l)?.expect(h, q)?,
                ffn_norm: vector(&n("ffn_norm", "post_attention_layernorm"), l, h)?,
                w_gate: fetch(&n("ffn_gate", "mlp.gate_proj"), l)?.expect(f, h)?,
                w_up: fetch(&n("ffn_up", "mlp.up_proj"), l)?.expect(f, h)?,
                w_down: fetch(&n("ffn_down", "mlp.down_proj"), l)?.expect(h, f)?,
            });
        }
        let token_embd = fetch(if hf { "embed_tokens" } else { "token_embd" }, None)?.expect(cfg.vocab, h)?;
        let output = if arch.tied_output {
            token_embd.clone()
        } else {
            fetch(if hf { "lm_head" } else { "output" }, None)?.expect(cfg.vocab, h)?
        };
        let output_norm = vector(if hf { "norm" } else { "output_norm" }, None, h)?;
        Ok(LlamaWeights { token_embd, layers, output_norm, output })
    }
}
