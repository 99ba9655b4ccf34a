//! Images in prompts: a vision encoder loaded from a projector file (`mmproj-*.gguf`) turns an
//! image into rows of the language model's input embeddings, which take the place of tokens in
//! the prompt between the model's image markers.
//!
//! - [`decode`]: image files (PNG, JPEG, WebP, GIF) into pixels, within limits.
//! - [`media`]: images as tokens of a sequence (media ids from their pixels).
//! - [`preprocess`]: pixels resized and normalized as the encoder takes them.
//! - [`clip`]: the projector file's hyperparameters and weights.
//! - [`siglip`]: the encoder's forward pass (Gemma 3's SigLIP and projector).

pub mod clip;
pub mod decode;
pub mod media;
pub mod preprocess;
pub mod siglip;

pub use clip::{ClipConfig, Projector};
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

    /// Tokens an image takes in the prompt (between the markers).
    pub fn image_tokens(&self) -> usize {
        self.config.image_tokens()
    }

    /// The text before and after an image's tokens in the prompt.
    pub fn markers(&self) -> (&'static str, &'static str) {
        match self.config.projector {
            Projector::Gemma3 => ("<start_of_image>", "<end_of_image>"),
        }
    }

    /// Whether an image's tokens attend to each other both ways in the language model.
    pub fn bidirectional(&self) -> bool {
        match self.config.projector {
            Projector::Gemma3 => true,
        }
    }

    /// The pixels as the encoder takes them: letterboxed to its input's size, normalized.
    pub fn preprocess(&self, img: &RgbImage) -> Vec<f32> {
        let c = &self.config;
        img.letterboxed(c.image_size, Filter::Bilinear).planes(c.mean, c.std)
    }

    /// An image's embeddings: [`VisionEncoder::image_tokens`] rows of the language model's
    /// embedding width.
    pub fn encode(&self, pool: &ThreadPool, k: &Kernels, img: &RgbImage) -> Vec<f32> {
        let planes = self.preprocess(img);
        match self.config.projector {
            Projector::Gemma3 => siglip::encode(pool, k, &self.config, &self.weights, &planes),
        }
    }
}
