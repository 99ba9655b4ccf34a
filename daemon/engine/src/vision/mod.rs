//! Images in prompts: a vision encoder loaded from a projector file (`mmproj-*.gguf`) turns an
//! image into rows of the language model's input embeddings, which take the place of tokens in
//! the prompt between the model's image markers.
//!
//! - [`decode`]: image files (PNG, JPEG, WebP, GIF) into pixels, within limits.
//! - [`media`]: images as tokens of a sequence (media ids from their pixels).
//! - [`preprocess`]: pixels resized and normalized as the encoder takes them.
//! - [`clip`]: the projector file's hyperparameters and weights.
//! - [`siglip`]: Gemma 3's encoder (SigLIP and its projector).
//! - [`qwenvl`]: Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's encoder (a ViT over any size,
//!   windows, the patch merger, deepstack).
//! - [`worker`]: the encoder's own thread, so that encoding an image holds up no step.

pub mod clip;
pub mod decode;
pub mod media;
pub mod preprocess;
pub mod qwenvl;
pub mod siglip;
pub mod worker;

pub use clip::{ClipConfig, Head, Projector};
pub use decode::{decode, ImageError, ImageLimits};
pub use preprocess::{Filter, RgbImage};

use crate::model::ModelError;
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::Kernels;
use std::path::Path;

/// A loaded vision encoder and projector.
#[derive(Debug)]
pub struct VisionEncoder {
    pub config: ClipConfig,
    weights: clip::ClipWeights,
}

impl VisionEncoder {
    /// Loads a projector file; its matrices stay mapped.
    pub fn load(path: &Path) -> Result<VisionEncoder, ModelError> {
        let (config, weights) = clip::load(path)?;
        Ok(VisionEncoder { config, weights })
    }

    /// Fails unless this projector feeds a language model of embedding width `hidden`.
    pub fn check_pairing(&self, hidden: usize) -> Result<(), ModelError> {
        if self.config.out_width != hidden {
            return Err(ModelError::Config(format!(
                "the projector makes embeddings of {} values, the model takes {hidden}",
                self.config.out_width
            )));
        }
        Ok(())
    }

    /// The image tokens `img` becomes (between the markers): columns and rows of them.
    pub fn token_grid(&self, img: &RgbImage) -> (usize, usize) {
        self.config.token_grid(img.width, img.height)
    }

    /// Tokens `img` takes in the prompt (between the markers).
    pub fn image_tokens(&self, img: &RgbImage) -> usize {
        let (w, h) = self.token_grid(img);
        w * h
    }

    /// The text before and after an image's tokens in the prompt.
    pub fn markers(&self) -> (&'static str, &'static str) {
        match self.config.projector {
            Projector::Gemma3 => ("<start_of_image>", "<end_of_image>"),
            Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl => ("<|vision_start|>", "<|vision_end|>"),
        }
    }

    /// Whether an image's tokens attend to each other both ways in the language model.
    pub fn bidirectional(&self) -> bool {
        match self.config.projector {
            Projector::Gemma3 => true,
            Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl => false,
        }
    }

    /// The pixels as the encoder takes them, and their size: resized to its input
    /// ([`ClipConfig::input_size`], letterboxed where the aspect differs), normalized.
    pub fn preprocess(&self, img: &RgbImage) -> (Vec<f32>, (usize, usize)) {
        let c = &self.config;
        let (w, h) = c.input_size(img.width, img.height);
        let filter = match c.projector {
            Projector::Gemma3 => Filter::Bilinear,
            Projector::Qwen2Vl | Projector::Qwen25Vl | Projector::Qwen3Vl => Filter::Bicubic,
        };
        (img.fitted(w, h, filter).planes(c.mean, c.std), (w, h))
    }

    /// An image's embeddings: [`VisionEncoder::image_tokens`] rows of the language model's
    /// embedding width, row-major over [`VisionEncoder::token_grid`].
    pub fn encode(&self, pool: &ThreadPool, k: &Kernels, img: &RgbImage) -> Vec<f32> {
        // Never stopped, so always `Some`.
        self.encode_until(pool, k, img, &|| false).unwrap_or_default()
    }

    /// [`VisionEncoder::encode`], given up (`None`) where `stop` says so before one of the
    /// encoder's layers: an image nobody waits for any more ([`worker`]).
    pub fn encode_until(
        &self,
        pool: &ThreadPool,
        k: &Kernels,
        img: &RgbImage,
        stop: &dyn Fn() -> bool,
    ) -> Option<Vec<f32>> {
        let (planes, size) = self.preprocess(img);
        let (c, w) = (&self.config, &self.weights);
        match &w.head {
            Head::Gemma3 { soft_norm, projection } => {
                siglip::encode(pool, k, c, w, (soft_norm, projection), &planes, stop)
            }
            Head::Merger { up, down, deepstack } => {
                qwenvl::encode(pool, k, c, w, (up, down, deepstack), (&planes, size), stop)
            }
        }
    }
}
