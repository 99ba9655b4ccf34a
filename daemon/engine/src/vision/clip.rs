//! A vision projector file (`mmproj-*.gguf`, `general.architecture = clip`): its `clip.*`
//! hyperparameters and its `v.*` (the vision transformer) and `mm.*` (the projection into the
//! language model's embeddings) tensors, the names llama.cpp's converter writes. The matrices
//! stay in the file's mapping; the norms and biases are copied to f32 (and Qwen2.5-VL's two
//! patch kernels summed into one).

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
    /// Qwen2-VL's (`qwen2vl_merger`): Qwen2.5-VL's form with layer norms, a plain quick-GELU
    /// feed-forward and no windows.
    Qwen2Vl,
    /// Qwen2.5-VL's (`qwen2.5vl_merger`): a ViT over patches of any grid (dynamic resolution,
    /// 2-D rotary positions, RMS norms, a gated SiLU feed-forward, window attention in all
    /// but every `window_pattern`-th layer), its patches merged `merge x merge` by a GELU MLP
    /// (`mm.0`, `mm.2`); image tokens between `<|vision_start|>` and `<|vision_end|>`, causal,
    /// at 2-D positions of the language model's M-RoPE.
    Qwen25Vl,
    /// Qwen3-VL's (`qwen3vl_merger`): Qwen2.5-VL's form with a biased patch embedding, learned
    /// positions resized to the grid, layer norms, a plain GELU feed-forward and no windows;
    /// the merger's rows carry, after the main projection, one more per deepstack layer (the
    /// features of that ViT layer merged the same way), added by the language model after
    /// its first layers.
    Qwen3Vl,
}

impl Projector {
    /// Qwen's dynamic-resolution ViT and merger (either generation).
    pub fn is_qwen(self) -> bool {
        matches!(self, Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl)
    }
}

/// The hyperparameters of a vision encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipConfig {
    pub projector: Projector,
    /// The square input's side, in pixels (Gemma 3's; Qwen's inputs take any size), and a
    /// patch's.
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
    /// Patches pooled (Gemma 3) or merged (Qwen) into one image token along each axis.
    pub merge: usize,
    /// Every this many layers one attends over the whole image, the others within windows
    /// (Qwen2.5-VL's `n_wa_pattern`); 0: every layer over the whole image.
    pub window_pattern: usize,
    /// A plain feed-forward's activation is quick GELU (`x * sigmoid(1.702 x)`, Qwen2-VL's:
    /// neither `clip.use_gelu` nor `clip.use_silu`), not GELU.
    pub quick_gelu: bool,
    /// The language model's embedding width: an image token's size.
    pub out_width: usize,
}

/// Qwen's inputs: at least this many and at most this many image tokens an image (llama.cpp's
/// limits for the Qwen-VL family, from the models' preprocessor configurations).
pub const QWEN_MIN_TOKENS: usize = 8;
pub const QWEN_MAX_TOKENS: usize = 4096;

impl ClipConfig {
    /// Patches along each side of the (square) input.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch
    }

    /// The size, in pixels, an image of `width x height` is resized to as the encoder's input:
    /// Gemma 3's square, or for Qwen the nearest multiple of a merged patch each way, keeping
    /// the aspect, scaled into the image-token limits (transformers' `smart_resize`, as
    /// llama.cpp computes it, in f32).
    pub fn input_size(&self, width: usize, height: usize) -> (usize, usize) {
        match self.projector {
            Projector::Gemma3 => (self.image_size, self.image_size),
            Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl => {
                let unit = self.patch * self.merge;
                let f = unit as f32;
                let (w, h) = (width.max(1) as f32, height.max(1) as f32);
                let by = |x: f32, r: fn(f32) -> f32| (r(x / f) as usize * unit).max(unit);
                let (min, max) = ((QWEN_MIN_TOKENS * unit * unit) as f32, (QWEN_MAX_TOKENS * unit * unit) as f32);
                let (mut tw, mut th) = (by(w, f32::round), by(h, f32::round));
                if (tw * th) as f32 > max {
                    let beta = (h * w / max).sqrt();
                    (tw, th) = (by(w / beta, f32::floor), by(h / beta, f32::floor));
                } else if ((tw * th) as f32) < min {
                    let beta = (min / (h * w)).sqrt();
                    (tw, th) = (by(w * beta, f32::ceil), by(h * beta, f32::ceil));
                }
                (tw, th)
            }
        }
    }

    /// The image tokens of an image of `width x height` pixels: columns and rows of them.
    pub fn token_grid(&self, width: usize, height: usize) -> (usize, usize) {
        let (w, h) = self.input_size(width, height);
        let unit = self.patch * self.merge;
        (w / unit, h / unit)
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
    /// The feed-forward's gate (Qwen2.5-VL's SiLU-gated form); none for a plain GELU one.
    pub gate: Option<Linear>,
    pub up: Linear,
    pub down: Linear,
}

/// A vision encoder's weights.
#[derive(Clone, Debug)]
pub struct ClipWeights {
    /// The patch embedding as a product: `hidden` rows of `3 * patch * patch` (channel, row,
    /// column), its bias.
    pub patch: Linear,
    /// `grid² x hidden` learned positions (Gemma 3's; Qwen's rotate instead).
    pub positions: Vec<f32>,
    pub layers: Vec<ClipLayer>,
    /// The last norm (Qwen's: its merger's `ln_q`), RMS where the projector's layers are.
    pub post_ln: LayerNorm,
    pub head: Head,
}

/// How the encoded patches become image tokens.
#[derive(Clone, Debug)]
pub enum Head {
    /// Gemma 3's projector: the RMS norm's weight (its `1 +` already in the file) and the
    /// projection, transposed at load to `out_width` rows of `hidden` (the file stores it
    /// `hidden x out_width`, Hugging Face's parameter as it is), with no bias.
    Gemma3 { soft_norm: Vec<f32>, projection: Linear },
    /// Qwen's merger: each `merge x merge` group of patches as one row of their features,
    /// through `up` (`mm.0`), GELU, `down` (`mm.2`).
    Merger { up: Linear, down: Linear, deepstack: Vec<Deepstack> },
}

/// One of Qwen3-VL's deepstack mergers: the output of ViT layer `layer`, each `merge x merge`
/// group as one row, layer-normed, through `fc1`, GELU, `fc2`.
#[derive(Clone, Debug)]
pub struct Deepstack {
    pub layer: usize,
    pub norm: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Head {
    /// The language model's width the head writes.
    fn out_width(&self) -> usize {
        match self {
            Head::Gemma3 { projection, .. } => projection.w.rows,
            Head::Merger { down, deepstack, .. } => down.w.rows * (1 + deepstack.len()),
        }
    }
}

/// Reads and checks a projector file.
pub fn load(path: &Path) -> Result<(ClipConfig, ClipWeights), ModelError> {
    let io = |source| ModelError::Io { path: path.to_path_buf(), source };
    let g = Gguf::parse(Blob::map(path).map_err(io)?)?;
    let mut cfg = config(&g)?;
    let w = weights(&g, &cfg)?;
    cfg.out_width = w.head.out_width();
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
        "qwen2vl_merger" => Projector::Qwen2Vl,
        "qwen2.5vl_merger" => Projector::Qwen25Vl,
        "qwen3vl_merger" => Projector::Qwen3Vl,
        other => {
            return Err(ModelError::Unsupported(format!(
                "vision projector '{other}' (supported: gemma3, qwen2vl_merger, qwen2.5vl_merger, qwen3vl_merger)"
            )))
        }
    };
    let flag = |k: &str| g.get(k).and_then(Value::as_bool) == Some(true);
    match projector {
        Projector::Gemma3 | Projector::Qwen3Vl if !flag("clip.use_gelu") => {
            return Err(ModelError::Unsupported("a vision encoder without clip.use_gelu (quick GELU)".into()))
        }
        Projector::Qwen25Vl if !flag("clip.use_silu") => {
            return Err(ModelError::Unsupported("a Qwen2.5-VL encoder without clip.use_silu".into()))
        }
        Projector::Qwen2Vl if flag("clip.use_silu") => {
            return Err(ModelError::Unsupported("a Qwen2-VL encoder with clip.use_silu (a gated one)".into()))
        }
        _ => {}
    }
    let hidden = usize_key(g, "clip.vision.embedding_length")?;
    let heads = usize_key(g, "clip.vision.attention.head_count")?;
    let head_dim = match g.get("clip.vision.attention.head_dim") {
        Some(_) => usize_key(g, "clip.vision.attention.head_dim")?,
        None => hidden / heads,
    };
    let opt = |k: &str, default: usize| if g.get(k).is_some() { usize_key(g, k) } else { Ok(default) };
    let merge = match projector {
        Projector::Gemma3 => opt("clip.vision.projector.scale_factor", 4)?,
        Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl => opt("clip.vision.spatial_merge_size", 2)?,
    };
    let window_pattern = match projector {
        Projector::Gemma3 | Projector::Qwen3Vl => 0,
        Projector::Qwen2Vl => match g.get("clip.vision.n_wa_pattern") {
            Some(v) if v.as_u64() == Some(0) => 0,
            Some(_) => usize_key(g, "clip.vision.n_wa_pattern")?,
            None => 0,
        },
        Projector::Qwen25Vl => usize_key(g, "clip.vision.n_wa_pattern")?,
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
        window_pattern,
        quick_gelu: projector == Projector::Qwen2Vl && !flag("clip.use_gelu"),
        out_width: 0,
    };
    let grid = cfg.image_size / cfg.patch;
    // Qwen's 2-D rotation turns a quarter of each head with each coordinate, twice over.
    let qwen_heads = !projector.is_qwen() || head_dim.is_multiple_of(4);
    if head_dim * heads != hidden
        || !qwen_heads
        || (projector == Projector::Gemma3
            && (!cfg.image_size.is_multiple_of(cfg.patch) || !grid.is_multiple_of(merge)))
        || (projector.is_qwen() && merge != 2)
        || (projector == Projector::Qwen3Vl && !cfg.image_size.is_multiple_of(cfg.patch))
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
    // Q, K and V from one matrix of `3 * hidden` rows and its bias (Qwen3-VL's `attn_qkv`),
    // each a view of its rows.
    let split = |name: &str| -> Result<[Linear; 3], ModelError> {
        let (w, b) = (matrix(&format!("{name}.weight"), 3 * e, e)?, bias(&format!("{name}.bias"), 3 * e)?);
        let row = w.dtype.bytes_for(e).ok_or_else(|| ModelError::Shape(format!("'{name}' rows of {e}")))?;
        let t = info(&format!("{name}.weight"))?;
        let part = |i: usize| -> Result<Linear, ModelError> {
            let w = Tensor::new(&w.name, w.dtype, e, e, g.blob.clone(), t.offset + i * e * row)?;
            Ok(Linear { w, b: b[i * e..(i + 1) * e].to_vec() })
        };
        Ok([part(0)?, part(1)?, part(2)?])
    };
    let layers = (0..cfg.layers)
        .map(|i| {
            let b = format!("v.blk.{i}");
            let [q, k, v] = if g.tensor(&format!("{b}.attn_qkv.weight")).is_some() {
                split(&format!("{b}.attn_qkv"))?
            } else {
                [
                    linear(&format!("{b}.attn_q"), e, e)?,
                    linear(&format!("{b}.attn_k"), e, e)?,
                    linear(&format!("{b}.attn_v"), e, e)?,
                ]
            };
            Ok(ClipLayer {
                ln1: norm(&format!("{b}.ln1"))?,
                q,
                k,
                v,
                out: linear(&format!("{b}.attn_out"), e, e)?,
                ln2: norm(&format!("{b}.ln2"))?,
                gate: match cfg.projector {
                    Projector::Gemma3 | Projector::Qwen2Vl | Projector::Qwen3Vl => None,
                    Projector::Qwen25Vl => Some(linear(&format!("{b}.ffn_gate"), cfg.ffn, e)?),
                },
                up: linear(&format!("{b}.ffn_up"), cfg.ffn, e)?,
                down: linear(&format!("{b}.ffn_down"), e, cfg.ffn)?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let w = match cfg.projector {
        Projector::Gemma3 => {
            let out_width = info("mm.input_projection.weight")?.dims[0];
            ClipWeights {
                patch: linear("v.patch_embd", e, 3 * p * p)?,
                positions: matrix("v.position_embd.weight", cfg.grid() * cfg.grid(), e)?.to_f32(),
                layers,
                post_ln: norm("v.post_ln")?,
                head: Head::Gemma3 {
                    soft_norm: vector("mm.soft_emb_norm.weight", e)?,
                    projection: Linear {
                        w: transposed(&matrix("mm.input_projection.weight", e, out_width)?)?,
                        b: vec![0.0; out_width],
                    },
                },
            }
        }
        Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl => {
            // The temporal pair of kernels (a video's two frames); a still image is both
            // frames, so the two products are one with the kernels' sum.
            let (k0, k1) =
                (matrix("v.patch_embd.weight", e, 3 * p * p)?, matrix("v.patch_embd.weight.1", e, 3 * p * p)?);
            let sum: Vec<u8> = (k0.to_f32().iter().zip(k1.to_f32())).flat_map(|(a, b)| (a + b).to_le_bytes()).collect();
            let patch = Tensor::new("v.patch_embd.weight", DType::F32, e, 3 * p * p, Blob::from_vec(sum), 0)?;
            let (m, out_width) = (cfg.merge * cfg.merge * e, info("mm.2.weight")?.dims[1]);
            let qwen3 = cfg.projector == Projector::Qwen3Vl;
            let deepstack = (0..cfg.layers)
                .filter(|il| qwen3 && g.tensor(&format!("v.deepstack.{il}.fc1.weight")).is_some())
                .map(|il| {
                    let b = format!("v.deepstack.{il}");
                    Ok(Deepstack {
                        layer: il,
                        norm: LayerNorm {
                            w: vector(&format!("{b}.norm.weight"), m)?,
                            b: bias(&format!("{b}.norm.bias"), m)?,
                        },
                        fc1: linear(&format!("{b}.fc1"), m, m)?,
                        fc2: linear(&format!("{b}.fc2"), out_width, m)?,
                    })
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            ClipWeights {
                patch: Linear { w: patch, b: bias("v.patch_embd.bias", e)? },
                positions: match qwen3 {
                    true => matrix("v.position_embd.weight", cfg.grid() * cfg.grid(), e)?.to_f32(),
                    false => Vec::new(),
                },
                layers,
                post_ln: norm("v.post_ln")?,
                head: Head::Merger { up: linear("mm.0", m, m)?, down: linear("mm.2", out_width, m)?, deepstack },
            }
        }
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
