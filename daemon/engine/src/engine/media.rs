//! The engine's images: a prompt's images registered as media ids in its tokens
//! ([`crate::vision::media`]) and handed to the encoder's thread ([`crate::vision::worker`])
//! as the request arrives, unless their embeddings are kept from an earlier request or the
//! prefix cache holds their positions; the scheduler admits the request once they are back
//! ([`Engine::images_ready`]). At each forward pass, the input embeddings of the media
//! positions it runs (encoded in the step, on the backend's pool, only where they are neither
//! kept nor found in the cache any more). A span of positions whose tokens see each other both
//! ways (Gemma 3's image) is never cut between two forward passes ([`Engine::image_end`]).

use super::{Engine, EngineError};
use crate::backend::{BackendError, Embedded};
use crate::kv::SeqId;
use crate::vision::media::{PromptImage, MEDIA_BASE};
use crate::vision::worker::{EncodeFailure, EncodeWorker};
use crate::vision::VisionEncoder;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// The images being encoded on the encoder's thread.
#[derive(Debug, Default)]
pub(super) struct Encoding {
    /// Started with the first image to encode.
    worker: Option<EncodeWorker>,
    /// By pixel hash: the job and its stop flag.
    pending: HashMap<u128, (u64, Arc<AtomicBool>)>,
    /// By pixel hash, while some request holds the image: why the encoder failed on it.
    failed: HashMap<u128, String>,
}

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

    /// The prompt's images are no longer needed by its request. An image nobody holds any
    /// more stops encoding.
    pub fn release_images(&mut self, images: &[PromptImage]) {
        for m in images.iter().filter_map(|i| i.media.as_ref()) {
            self.media.release(m);
            if !self.media.holds(m.hash) {
                if let Some((_, stop)) = self.encoding.pending.remove(&m.hash) {
                    stop.store(true, Relaxed);
                }
                self.encoding.failed.remove(&m.hash);
            }
        }
    }

    /// Starts encoding, on the encoder's thread, each of a prompt's registered images whose
    /// embeddings are not kept and whose positions the prefix cache of `partition` does not
    /// hold now (what it still holds at admission is reused; what it has lost by then is
    /// encoded in the step). Nothing starts where the backend has no CPU pool (the CUDA
    /// backend refuses images at the step) or the thread cannot be started (the step encodes).
    pub fn start_encodes(&mut self, prompt: &[u32], images: &[PromptImage], partition: Option<u64>) {
        let (Some(enc), Some(pool)) = (self.vision.clone(), self.backend.cpu_pool()) else { return };
        if images.is_empty() {
            return;
        }
        let cached = self.kv.cached_prefix(partition, prompt);
        for img in images {
            let Some(m) = &img.media else { continue };
            if img.at + m.ids.len() <= cached
                || self.encoding.pending.contains_key(&m.hash)
                || self.media.embeddings(m.hash).is_some()
            {
                continue;
            }
            if self.encoding.worker.is_none() {
                self.encoding.worker = EncodeWorker::start(Arc::clone(&enc), pool.threads()).ok();
            }
            let Some(worker) = &mut self.encoding.worker else { return };
            let job = worker.submit(m.hash, Arc::clone(&m.image));
            self.encoding.pending.insert(m.hash, job);
        }
    }

    /// Whether a waiting request's images are ready: none is still being encoded. An error
    /// names the encoder's failure on one of them.
    pub fn images_ready(&mut self, images: &[PromptImage]) -> Result<bool, EngineError> {
        self.collect_encoded(None);
        let mut ready = true;
        for m in images.iter().filter_map(|i| i.media.as_ref()) {
            if let Some(why) = self.encoding.failed.get(&m.hash) {
                return Err(EngineError::Image(why.clone()));
            }
            ready &= !self.encoding.pending.contains_key(&m.hash);
        }
        Ok(ready)
    }

    /// Waits up to `timeout` for an image being encoded, where one is.
    pub fn wait_images(&mut self, timeout: Duration) {
        if !self.encoding.pending.is_empty() {
            self.collect_encoded(Some(timeout));
        }
    }

    /// Takes the encoder's finished jobs, waiting up to `wait` for the first: embeddings are
    /// kept (those of an image given up on too: they cost the same as any), failures noted
    /// while the image is held.
    fn collect_encoded(&mut self, wait: Option<Duration>) {
        let Some(worker) = &mut self.encoding.worker else { return };
        let mut first = wait.and_then(|t| worker.wait(t));
        while let Some(e) = first.take().or_else(|| worker.try_take()) {
            let current = self.encoding.pending.get(&e.hash).is_some_and(|&(id, _)| id == e.id);
            if current {
                self.encoding.pending.remove(&e.hash);
            }
            match e.rows {
                Ok(rows) => self.media.keep(e.hash, rows),
                Err(EncodeFailure::Failed(why)) if current => {
                    self.encoding.failed.insert(e.hash, why);
                }
                Err(_) => {}
            }
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
