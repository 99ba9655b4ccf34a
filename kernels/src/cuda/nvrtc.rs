//! NVRTC through `cudarc`'s run-time loading: whether the library is there, and the kernels
//! compiled to a cubin for one GPU architecture, cached on disk.

use cudarc::nvrtc::{result, sys};
use std::ffi::CString;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("NVRTC (libnvrtc.so.13 or .12) is not installed: it compiles the CUDA kernels (CUDA 13 or 12 runtime libraries, e.g. Debian: libnvrtc12; or the lib directory of the nvidia-cuda-nvrtc wheel on LD_LIBRARY_PATH)")]
    Missing,
    #[error("not a GPU architecture: {0:?} (want sm_XY)")]
    BadArch(String),
    #[error("NVRTC failed for {arch}: {log}")]
    Failed { arch: String, log: String },
    #[error("kernel cache {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
}

/// True when `libnvrtc` can be loaded (cudarc would panic on its first call otherwise).
pub fn available() -> bool {
    // SAFETY: only tries to open the library by its names (libloading), calls nothing in it.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32), CompileError> {
    if !available() {
        return Err(CompileError::Missing);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); two valid out-pointers.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| CompileError::Failed { arch: String::new(), log: format!("nvrtcVersion: {e:?}") })?;
    Ok((major, minor))
}

/// Compiles `src` to a cubin (device code) for `arch` (`sm_80`, `sm_90`, ...). Register and
/// shared-memory limits are checked at this stage too, not only the syntax.
pub fn compile_cubin(src: &str, arch: &str) -> Result<Vec<u8>, CompileError> {
    if !(arch.starts_with("sm_") && arch.len() > 3 && arch[3..].chars().all(|c| c.is_ascii_digit())) {
        return Err(CompileError::BadArch(arch.into()));
    }
    if !available() {
        return Err(CompileError::Missing);
    }
    let failed = |log: String| CompileError::Failed { arch: arch.into(), log };
    let src = CString::new(src).map_err(|_| failed("a NUL byte in the sources".into()))?;
    let prog = result::create_program(&src, None).map_err(|e| failed(format!("{e:?}")))?;
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    // SAFETY: `prog` is a live program (created above, destroyed below on every path).
    let compiled = unsafe { result::compile_program(prog, &options) };
    let out = match compiled {
        Ok(()) => cubin(prog).map_err(failed),
        Err(e) => {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog) }.map(|l| c_text(&l)).unwrap_or_default();
            Err(failed(format!("{e:?}: {log}")))
        }
    };
    // SAFETY: as above; nothing uses `prog` after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

fn c_text(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `prog` was compiled successfully; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok(buf)
}

/// FNV-1a, for cache keys that stay the same across builds and Rust versions.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in *part {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The kernels' cubin for `arch`, from `cache_dir` when an earlier run compiled the same
/// sources with the same NVRTC, else compiled and stored there.
pub fn cached_cubin(arch: &str, cache_dir: &Path) -> Result<Vec<u8>, CompileError> {
    let src = super::translation_unit();
    let (major, minor) = version()?;
    let key = fnv1a(&[src.as_bytes(), arch.as_bytes(), &major.to_le_bytes(), &minor.to_le_bytes()]);
    let path = cache_dir.join(format!("inferd-kernels-{arch}-{key:016x}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let cubin = compile_cubin(&src, arch)?;
    let cache = |source| CompileError::Cache { path: path.clone(), source };
    std::fs::create_dir_all(cache_dir).map_err(cache)?;
    // Written aside and renamed: a concurrent reader never sees half a file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &cubin).map_err(cache)?;
    std::fs::rename(&tmp, &path).map_err(cache)?;
    Ok(cubin)
}
