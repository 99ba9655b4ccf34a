//! The engine's images: a prompt's images registered as media ids in its tokens
//! ([`crate::vision::media`]), and, at each forward pass, the input embeddings of the media
//! positions it runs, encoded here (on the backend's thread pool) unless kept from an earlier
//! request. A span of positions whose tokens see each other both ways (Gemma 3's image) is
//! never cut between two forward passes ([`Engine::image_end`]).

use super::{Engine, EngineError};
use crate::backend::{BackendError, Embedded};
use crate::kv::SeqId;
use crate::vision::media::{PromptImage, MEDIA_BASE};
use crate::vision::VisionEncoder;
use std::sync::Arc;

/// Rows of one image's embeddings a forward pass takes: rows `first..first + count`, at
/// positions from `pos`.
pub(super) struct Need {
    pos: usize,
    rows: Arc<[f32]>,
    first: usize,
    count: usize,
}

impl Engine {
    /// Gives the engine a vision encoder: prompts may then hold images.
    pub fn set_vision(&mut self, enc: Arc<VisionEncoder>) {
        self.vision = Some(enc);
    }

    pub fn vision(&self) -> Option<&Arc<VisionEncoder>> {
        self.vision.as_ref()
    }

    /// Registers a prompt's images: each takes as many positions from its `at` as the encoder
    /// makes tokens of it, which get its media ids. On error nothing stays registered.
    pub fn attach_images(&mut self, prompt: &mut [u32], images: &mut [PromptImage]) -> Result<(), EngineError> {
        if images.is_empty() {
            return Ok(());
        }
        let Some(enc) = &self.vision else {
            return Err(EngineError::Image(
                "this model takes no images (it has no projector: [[model]] mmproj)".into(),
            ));
        };
        let grids: Vec<(usize, usize)> = images.iter().map(|img| enc.token_grid(&img.image)).collect();
        let mut end = 0;
        for (img, &(w, h)) in images.iter().zip(&grids) {
            let n = w * h;
            if img.at < end || img.at + n > prompt.len() {
                return Err(EngineError::Image(format!(
                    "an image at position {} of a prompt of {} tokens (the image takes {n})",
                    img.at,
                    prompt.len()
                )));
            }
            end = img.at + n;
        }
        for (img, grid) in images.iter_mut().zip(grids) {
            let m = self.media.register(Arc::clone(&img.image), grid);
            prompt[img.at..img.at + m.ids.len()].copy_from_slice(&m.ids);
            img.media = Some(m);
        }
        Ok(())
    }

    /// The prompt's images are no longer needed by its request.
    pub fn release_images(&mut self, images: &[PromptImage]) {
        for m in images.iter().filter_map(|i| i.media.as_ref()) {
            self.media.release(m);
        }
    }

    /// Whether `t` is a token this engine runs: one of the vocabulary's or a registered image's.
    pub(super) fn known(&self, t: u32) -> bool {
        (t as usize) < self.vocab() || self.media.lookup(t).is_some()
    }

    /// `end` (a cut of `tokens` before index `end`), moved past the rest of an image whose
    /// positions see each other both ways where the cut falls inside one: such an image's
    /// positions all run in one forward pass.
    pub fn image_end(&self, tokens: &[u32], end: usize) -> usize {
        if end == 0 || end >= tokens.len() || !self.vision.as_ref().is_some_and(|v| v.bidirectional()) {
            return end;
        }
        match self.media.lookup(tokens[end - 1]) {
            Some((m, row))
                if row + 1 < m.ids.len() && self.media.lookup(tokens[end]).is_some_and(|(n, _)| n.hash == m.hash) =>
            {
                (end + m.ids.len() - 1 - row).min(tokens.len())
            }
            _ => end,
        }
    }

    /// The M-RoPE coordinates of `seq`'s positions `a..b` (its tokens through `b` are in the
    /// cache's bookkeeping already), where the model rotates by them and an image comes before
    /// `b`; else none (every coordinate of a token is its position). An image of `w x h`
    /// tokens whose first is at rotary position `p` puts its token (row `r`, column `c`) at
    /// (`p`, `p + r`, `p + c`, 0) and moves the positions after it to `p + max(w, h)` on
    /// (llama.cpp's libmtmd's layout, Qwen2-VL's): a text token's four coordinates are its
    /// index less what the images before it saved.
    pub(super) fn mrope(&self, seq: SeqId, a: usize, b: usize) -> Result<Vec<[u32; 4]>, EngineError> {
        let tokens = &self.kv.tokens(seq)[..b];
        if !self.mrope || !tokens.iter().any(|&t| t >= MEDIA_BASE) {
            return Ok(Vec::new());
        }
        let (mut out, mut saved) = (Vec::with_capacity(b - a), 0usize);
        let coord = |x: usize| u32::try_from(x).map_err(|_| EngineError::Image(format!("position {x}")));
        for (i, &t) in tokens.iter().enumerate() {
            let image = if t >= MEDIA_BASE { self.media.lookup(t) } else { None };
            let at = match image {
                Some((m, row)) => {
                    let (w, h) = m.grid;
                    let p = i.checked_sub(row + saved).ok_or_else(|| {
                        EngineError::Image(format!("an image's token {row} at position {i} without its first"))
                    })?;
                    if row + 1 == m.ids.len() {
                        saved += m.ids.len() - w.max(h);
                    }
                    [coord(p)?, coord(p + row / w)?, coord(p + row % w)?, 0]
                }
                None => {
                    let p = coord(i - saved)?;
                    [p, p, p, 0]
                }
            };
            if i >= a {
                out.push(at);
            }
        }
        Ok(out)
    }

    /// The embeddings the media positions among `tokens` (at positions from `start`) need,
    /// each image encoded unless its embeddings are kept.
    pub(super) fn needs(&mut self, tokens: &[u32], start: usize) -> Result<Vec<Need>, EngineError> {
        let mut out: Vec<Need> = Vec::new();
        let mut i = 0;
        while i < tokens.len() {
            let Some((m, row)) = self.media.lookup(tokens[i]) else {
                i += 1;
                continue;
            };
            let m = Arc::clone(m);
            let mut count = 1;
            while i + count < tokens.len()
                && self.media.lookup(tokens[i + count]).is_some_and(|(n, r)| Arc::ptr_eq(n, &m) && r == row + count)
            {
                count += 1;
            }
            let rows = match self.media.embeddings(m.hash) {
                Some(rows) => rows,
                None => {
                    let enc = self.vision.as_ref().ok_or_else(|| EngineError::Image("no vision encoder".into()))?;
                    let pool = self.backend.cpu_pool().ok_or_else(|| {
                        BackendError::Unsupported(format!("images on the {} backend", self.backend.name()))
                    })?;
                    let rows: Arc<[f32]> = enc.encode(&pool, &inferd_kernels::Kernels::detect(), &m.image).into();
                    self.media.keep(m.hash, Arc::clone(&rows));
                    rows
                }
            };
            out.push(Need { pos: start + i, rows, first: row, count });
            i += count;
        }
        Ok(out)
    }
}

/// The backend's view of `needs`: rows of `width` floats, the model's `hidden` and its
/// deepstack rows.
pub(super) fn embedded(needs: &[Need], (hidden, width): (usize, usize), both_ways: bool) -> Vec<Embedded<'_>> {
    needs
        .iter()
        .map(|n| Embedded {
            pos: n.pos,
            rows: &n.rows[n.first * width..(n.first + n.count) * width],
            both_ways,
            deepstack: (width / hidden.max(1)).saturating_sub(1),
        })
        .collect()
}
