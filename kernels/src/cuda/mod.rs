//! The CUDA kernels' sources (`kernels/cuda/*.cu`) and their compilation by NVRTC, which is
//! loaded at run time: nothing here needs a GPU or a CUDA toolkit to build, and compiling needs
//! only NVRTC (`libnvrtc.so.13` or `.12`; NVIDIA's `nvidia-cuda-nvrtc` wheels carry it), not a
//! GPU. The compiled code (a cubin per GPU architecture) is cached on disk, keyed by the
//! sources, the architecture and the NVRTC version.
//!
//! The kernels are one translation unit: `common.cuh` (weight decoding, shared by every kernel
//! and tested on the host against the CPU dequantizer), then each `.cu` file.

pub mod calls;
pub mod device;
pub mod gpu;
pub mod host;
pub mod nvrtc;
pub mod stream;

/// The kernel sources, in the order they are compiled.
pub const SOURCES: [(&str, &str); 6] = [
    ("common.cuh", include_str!("../../cuda/common.cuh")),
    ("ops.cu", include_str!("../../cuda/ops.cu")),
    ("matvec.cu", include_str!("../../cuda/matvec.cu")),
    ("gemm.cu", include_str!("../../cuda/gemm.cu")),
    ("attention.cu", include_str!("../../cuda/attention.cu")),
    ("deltanet.cu", include_str!("../../cuda/deltanet.cu")),
];

/// Every kernel the sources define (`extern "C" __global__`), for the loader to look up.
pub const KERNELS: [&str; 27] = [
    "embed",
    "rms_norm",
    "rope",
    "gated_act",
    "add_in_place",
    "gather_rows",
    "scatter_add_rows",
    "split_pairs",
    "gate_by",
    "move_floats",
    "matvec",
    "quantize_q8",
    "matvec_q8",
    "add_bias",
    "dequantize_half",
    "to_half",
    "kv_store",
    "kv_copy_blocks",
    "attention",
    "attention_combine",
    "delta_finish",
    "delta_keys",
    "delta_rows",
    "delta_conv",
    "delta_ring",
    "delta_split",
    "delta_gates",
];

/// The GPU architectures the kernels are checked to compile for: Ampere (A100), Ada (RTX 40,
/// L40) and Hopper (H100, H200).
pub const CHECKED_ARCHES: [&str; 3] = ["sm_80", "sm_89", "sm_90"];

/// The GPU architectures on which `tests/gpu/run` has passed, each with the GPU and the date it
/// passed on: `backend = "auto"` takes a GPU of these kinds (one compute capability runs the
/// same compiled kernels), and keeps the CPU on any other until its checks have passed there.
pub const PASSED_ON: [(&str, &str); 1] = [("sm_90", "NVIDIA H200, 2026-12-04")];

/// Whether `tests/gpu/run` has passed on a GPU of architecture `arch` ([`PASSED_ON`]).
pub fn passed_on(arch: &str) -> bool {
    PASSED_ON.iter().any(|(a, _)| *a == arch)
}

/// The whole translation unit.
pub fn translation_unit() -> String {
    SOURCES.iter().map(|(name, src)| format!("// ---- {name}\n{src}\n")).collect()
}

#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
mod tests;
