//! The CUDA backend, being built: today it finds the GPU (`inferd_kernels::cuda::device`) and
//! compiles the kernels for it with NVRTC into the kernel cache ([`crate::paths::cache_dir`]),
//! then refuses by name, since its forward pass (weights and the KV pool in VRAM, the kernels
//! of `kernels/cuda` launched per layer) is not written yet. Where there is no GPU, or no
//! driver, or no NVRTC, the error says which, and the daemon serves on the CPU unless
//! `backend = "cuda"` asked for the GPU.

use super::{Backend, BackendError};
use crate::engine::EngineOptions;
use crate::model::Model;
use inferd_kernels::cuda::{device, nvrtc};

/// What `backend = "cuda"` finds on this machine: the GPU and its compiled kernels, or why not.
pub fn open(model: &Model, _opts: &EngineOptions) -> Result<Box<dyn Backend>, BackendError> {
    let refuse = |why: String| BackendError::Unsupported(format!("backend \"cuda\" for {}: {why}", model.name));
    let dev = device::probe().map_err(|e| refuse(e.to_string()))?;
    let cubin = nvrtc::cached_cubin(&dev.arch, &crate::paths::cache_dir().join("cuda"))
        .map_err(|e| refuse(format!("{} ({}): {e}", dev.name, dev.arch)))?;
    Err(refuse(format!(
        "{} ({}, {} MiB, driver {}) found and its kernels compiled ({} bytes), but the CUDA forward pass \\
         is not written yet; use backend = \"cpu\" (or \"auto\")",
        dev.name,
        dev.arch,
        dev.memory_bytes >> 20,
        dev.driver_version,
        cubin.len()
    )))
}
