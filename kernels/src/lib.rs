//! inferd compute kernels.
//!
//! Everything that touches weights or activations element by element lives here, so that `unsafe`
//! SIMD code stays in one crate. The layout follows candle's `quantized/` and llama.cpp's `ggml-cpu`:
//!
//! - [`quant`]: the on-disk block formats (GGUF's F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//!   the K-quants Q2_K to Q6_K, IQ4_NL, IQ4_XS and MXFP4) and the activation format
//!   [`quant::BlockQ8`] that quantized matrix products consume.
//! - [`group`]: any block format read as 32-weight groups of small integers, the common form of
//!   the dequantizer and the scalar dots.
//! - [`cpu`]: the kernels proper: a scalar reference (`cpu::scalar`, kept forever and the oracle of
//!   the property tests) and an AVX2+FMA path (`cpu::avx2`) chosen once at run time.
//! - [`matmul`]: the multi-threaded matrix product driver over a [`pool::ThreadPool`].
//! - [`gemm`]: products of many tokens (a vision encoder's patches) in bf16 register tiles,
//!   and their attention of every token to every token.
//! - [`ops`]: the small per-row operations of a transformer block (RMSNorm, RoPE, SwiGLU, softmax).
//! - [`attention`]: attention over a paged K/V cache.
//! - [`deltanet`]: Gated DeltaNet's recurrence (Qwen3.5's linear attention), token by token and
//!   in chunks of matrix products, and its causal convolution.
//! - [`pack`]: weights repacked at load time, 16 rows interleaved, for the AVX-512 VNNI kernel.
//!
//! No kernel allocates on the hot path; callers own every buffer.

#![cfg_attr(test, allow(clippy::unwrap_used))] // unit tests: a failed unwrap is a failed test

pub mod attention;
pub mod cpu;
pub mod cuda;
pub mod deltanet;
pub mod gemm;
pub mod group;
pub mod matmul;
pub mod moe;
pub mod ops;
pub mod pack;
pub mod pool;
pub mod quant;
pub mod quantize;

pub use cpu::{Isa, Kernels};
pub use quant::{BlockQ8, DType};
