//! A vision projector file (`mmproj-*.gguf`, `general.architecture = clip`): its `clip.*`
//! hyperparameters and its `v.*` (the vision transformer) and `mm.*` (the projection into the
//! language model's embeddings) tensors, the names llama.cpp's converter writes. The matrices
//! stay in the file's mapping; the norms and biases are copied to f32.

use crate::model::gguf::{Gguf, Value};
use crate::model::mmap::Blob;
use crate::model::{ModelError, Tensor};
use inferd_kernels::DType;
use std::path::Path;

/// How a projector turns the vision transformer's patches into the language model's
/// embeddings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projector {
    /// Gemma 3's: SigLIP's patches average-pooled `merge x merge` on their grid, RMS-normed
    /// and projected (`mm.soft_emb_norm`, `mm.input_projection`); its image tokens see each
    /// other in the language model (non-causal), between `<start_of_image>` and
    /// `<end_of_image>`.
    Gemma3,
}

/// The hyperparameters of a vision encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipConfig {
    pub projector: Projector,
    /// The square input's side, in pixels, and a patch's.
    pub image_size: usize,
    pub patch: usize,
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub layers: usize,
    /// The layer norms' epsilon (also the projector's RMS norm's).
    pub eps: f32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    /// Patches pooled into one image token along each axis.
    pub merge: usize,
    /// The language model's embedding width: an image token's size.
    pub out_width: usize,
}

impl ClipConfig {
    /// Patches along each side of the input.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch
    }

    /// Tokens one image becomes in the language model's prompt.
    pub fn image_tokens(&self) -> usize {
        (self.grid() / self.merge).pow(2)
    }
}

/// A layer norm's scale and shift.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
}

/// A product's matrix and its bias (zeros where the file has none).
#[derive(Clone, Debug)]
pub struct Linear {
    pub w: Tensor,
    pub b: Vec<f32>,
}

/// One pre-norm transformer layer of the vision encoder.
#[derive(Clone, Debug)]
pub struct ClipLayer {
    pub ln1: LayerNorm,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub out: Linear,
    pub ln2: LayerNorm,
    pub up: Linear,
    pub down: Linear,
}

/// A vision encoder's weights.
#[derive(Clone, Debug)]
pub struct ClipWeights {
    /// The patch embedding as a product: `hidden` rows of `3 * patch * patch` (channel, row,
    /// column), its bias.
    pub patch: Linear,
    /// `grid² x hidden` learned positions.
    pub positions: Vec<f32>,
    pub layers: Vec<ClipLayer>,
    pub post_ln: LayerNorm,
    /// Gemma 3's projector: the RMS norm's weight (its `1 +` already in the file) and the
    /// projection, transposed at load to `out_width` rows of `hidden` (the file stores it
    /// `hidden x out_width`, Hugging Face's parameter as it is), with no bias.
    pub soft_norm: Vec<f32>,
    pub projection: Linear,
}

/// Reads and checks a projector file.
pub fn load(path: &Path) -> Result<(ClipConfig, ClipWeights), ModelError> {
    let io = |source| ModelError::Io { path: path.to_path_buf(), source };
    let g = Gguf::parse(Blob::map(path).map_err(io)?)?;
    let mut cfg = config(&g)?;
    let w = weights(&g, &cfg)?;
    cfg.out_width = w.projection.w.rows;
    Ok((cfg, w))
}

fn key<'a>(g: &'a Gguf, k: &str) -> Result<&'a Value, ModelError> {
    g.get(k).ok_or_else(|| ModelError::MissingKey(k.into()))
}

fn usize_key(g: &Gguf, k: &str) -> Result<usize, ModelError> {
    let v = key(g, k)?.as_u64().ok_or_else(|| ModelError::Config(format!("'{k}' is not an integer")))?;
    match usize::try_from(v) {
        Ok(v) if v > 0 && v <= 1 << 20 => Ok(v),
        _ => Err(ModelError::Config(format!("'{k}' = {v} is out of range"))),
    }
}

fn triple(g: &Gguf, k: &str) -> Result<[f32; 3], ModelError> {
    let bad = || ModelError::Config(format!("'{k}' is not three numbers"));
    let a = key(g, k)?.as_array().ok_or_else(bad)?;
    match a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>().as_deref() {
        Some(&[r, gr, b]) => Ok([r as f32, gr as f32, b as f32]),
        _ => Err(bad()),
    }
}

fn config(g: &Gguf) -> Result<ClipConfig, ModelError> {
    let arch = key(g, "general.architecture")?.as_str().unwrap_or("");
    if arch != "clip" {
        return Err(ModelError::Unsupported(format!("a projector file's architecture is 'clip', not '{arch}'")));
    }
    if g.get("clip.has_vision_encoder").and_then(Value::as_bool) != Some(true) {
        return Err(ModelError::Unsupported("the projector has no vision encoder (clip.has_vision_encoder)".into()));
    }
    let kind = g
        .get("clip.vision.projector_type")
        .or_else(|| g.get("clip.projector_type"))
        .and_then(Value::as_str)
        .ok_or_else(|| ModelError::MissingKey("clip.projector_type".into()))?;
    let projector = match kind {
        "gemma3" => Projector::Gemma3,
        other => return Err(ModelError::Unsupported(format!("vision projector '{other}' (supported: gemma3)"))),
    };
    if g.get("clip.use_gelu").and_then(Value::as_bool) != Some(true) {
        return Err(ModelError::Unsupported("a vision encoder without clip.use_gelu (quick GELU)".into()));
    }
    let hidden = usize_key(g, "clip.vision.embedding_length")?;
    let heads = usize_key(g, "clip.vision.attention.head_count")?;
    let head_dim = match g.get("clip.vision.attention.head_dim") {
        Some(_) => usize_key(g, "clip.vision.attention.head_dim")?,
        None => hidden / heads,
    };
    let merge = match g.get("clip.vision.projector.scale_factor") {
        Some(_) => usize_key(g, "clip.vision.projector.scale_factor")?,
        None => 4,
    };
    let eps = key(g, "clip.vision.attention.layer_norm_epsilon")?
        .as_f64()
        .ok_or_else(|| ModelError::Config("clip.vision.attention.layer_norm_epsilon".into()))? as f32;
    let cfg = ClipConfig {
        projector,
        image_size: usize_key(g, "clip.vision.image_size")?,
        patch: usize_key(g, "clip.vision.patch_size")?,
        hidden,
        heads,
        head_dim,
        ffn: usize_key(g, "clip.vision.feed_forward_length")?,
        layers: usize_key(g, "clip.vision.block_count")?,
        eps,
        mean: triple(g, "clip.vision.image_mean")?,
        std: triple(g, "clip.vision.image_std")?,
        merge,
        out_width: 0,
    };
    let grid = cfg.image_size / cfg.patch;
    if head_dim * heads != hidden
        || !cfg.image_size.is_multiple_of(cfg.patch)
        || !grid.is_multiple_of(merge)
        || eps.is_nan()
        || eps <= 0.0
        || cfg.std.contains(&0.0)
    {
        return Err(ModelError::Config(format!(
            "vision encoder: {heads} heads of {head_dim} for width {hidden}, {}-pixel images in {}-pixel \
             patches pooled by {merge}, epsilon {eps}, std {:?}",
            cfg.image_size, cfg.patch, cfg.std
        )));
    }
    Ok(cfg)
}

fn weights(g: &Gguf, cfg: &ClipConfig) -> Result<ClipWeights, ModelError> {
    let (e, p) = (cfg.hidden, cfg.patch);
    let used = std::cell::RefCell::new(std::collections::HashSet::new());
    let info = |name: &str| {
        used.borrow_mut().insert(name.to_string());
        g.tensor(name).ok_or_else(|| ModelError::MissingTensor(name.into()))
    };
    // A tensor as `rows` of `cols` (the patch embedding's kernel, `[p, p, 3, hidden]`, as
    // rows of `3 * p * p`).
    let matrix = |name: &str, rows: usize, cols: usize| -> Result<Tensor, ModelError> {
        let t = info(name)?;
        let kernel = t.dims == [p, p, 3, e] && cols == 3 * p * p;
        if t.dims.iter().product::<usize>() != rows * cols || (t.dims[0] != cols && !kernel) {
            return Err(ModelError::Shape(format!("'{name}' is {:?}, not {cols} x {rows}", t.dims)));
        }
        Tensor::new(name, t.dtype, rows, cols, g.blob.clone(), t.offset)
    };
    let vector = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> { Ok(matrix(name, 1, n)?.to_f32()) };
    let bias = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
        if g.tensor(name).is_some() {
            vector(name, n)
        } else {
            Ok(vec![0.0; n])
        }
    };
    let linear = |name: &str, rows: usize, cols: usize| -> Result<Linear, ModelError> {
        Ok(Linear { w: matrix(&format!("{name}.weight"), rows, cols)?, b: bias(&format!("{name}.bias"), rows)? })
    };
    let norm = |name: &str| -> Result<LayerNorm, ModelError> {
        Ok(LayerNorm { w: vector(&format!("{name}.weight"), e)?, b: bias(&format!("{name}.bias"), e)? })
    };
    let layers = (0..cfg.layers)
        .map(|i| {
            let b = format!("v.blk.{i}");
            Ok(ClipLayer {
                ln1: norm(&format!("{b}.ln1"))?,
                q: linear(&format!("{b}.attn_q"), e, e)?,
                k: linear(&format!("{b}.attn_k"), e, e)?,
                v: linear(&format!("{b}.attn_v"), e, e)?,
                out: linear(&format!("{b}.attn_out"), e, e)?,
                ln2: norm(&format!("{b}.ln2"))?,
                up: linear(&format!("{b}.ffn_up"), cfg.ffn, e)?,
                down: linear(&format!("{b}.ffn_down"), e, cfg.ffn)?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let out_width = info("mm.input_projection.weight")?.dims[0];
    let w = ClipWeights {
        patch: linear("v.patch_embd", e, 3 * p * p)?,
        positions: matrix("v.position_embd.weight", cfg.grid() * cfg.grid(), e)?.to_f32(),
        layers,
        post_ln: norm("v.post_ln")?,
        soft_norm: vector("mm.soft_emb_norm.weight", e)?,
        projection: Linear {
            w: transposed(&matrix("mm.input_projection.weight", e, out_width)?)?,
            b: vec![0.0; out_width],
        },
    };
    crate::model::arch::check_unused(g.tensors.iter().map(|t| t.name.as_str()), &used.borrow(), &|_| false)?;
    Ok(w)
}

/// `t` transposed, in f16 memory of its own: a `hidden x width` matrix stored as the product
/// reads it, `width` rows of `hidden`.
fn transposed(t: &Tensor) -> Result<Tensor, ModelError> {
    let m = t.to_f32();
    let mut bytes = Vec::with_capacity(m.len() * 2);
    for c in 0..t.cols {
        for r in 0..t.rows {
            bytes.extend_from_slice(&half::f16::from_f32(m[r * t.cols + c]).to_le_bytes());
        }
    }
    Tensor::new(&t.name, DType::F16, t.cols, t.rows, Blob::from_vec(bytes), 0)
}
