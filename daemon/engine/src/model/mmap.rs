//! Read-only memory maps of model files: the one place the daemon maps files into memory.
//!
//! Weights are used straight from the page cache (no copy at load; several processes or engines
//! loading one file share its pages).

#![allow(unsafe_code)] // the one memory map; see the SAFETY comment in `Blob::map`

use std::fs::File;
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

/// Bytes a tensor lives in: a mapped file, or an owned buffer (models built in memory, tests).
#[derive(Clone)]
pub struct Blob(Arc<dyn Deref<Target = [u8]> + Send + Sync>);

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl Blob {
    /// Maps `path` read-only.
    pub fn map(path: &Path) -> std::io::Result<Blob> {
        let file = File::open(path)?;
        // SAFETY: the map is read-only and private. Another process truncating or rewriting the
        // file while it is mapped could change or fault the bytes under us; model files are
        // installed as whole files (package manager, fetch script renames into place), and every
        // length and offset read from them is checked before use, so the worst case is wrong
        // numbers or SIGBUS, the same contract every mmap-based loader (llama.cpp) has.
        let map = unsafe { memmap2::MmapOptions::new().map(&file)? };
        Ok(Blob(Arc::new(map)))
    }

    pub fn from_vec(v: Vec<u8>) -> Blob {
        Blob(Arc::new(v))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}
