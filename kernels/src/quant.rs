//! Tensor element types and their block layouts, bit-compatible with GGUF/GGML.
//!
//! Quantized types store a row of `k` weights as `k / 32` blocks, each a `#[repr(C)]` struct
//! whose size and field offsets are asserted at compile time ([`BlockQ8_0`], [`BlockQ4_0`],
//! [`BlockQ4_1`]); the kernels read those bytes in place from the memory map. Activations are
//! quantized per 32-block to [`BlockQ8`] (8-bit, like llama.cpp's Q8_1: the block sum is kept
//! so the Q4_1 offset term costs one multiply per block).

use half::{bf16, f16};
use std::mem::{offset_of, size_of};

/// Number of elements in one quantization block.
pub const QK: usize = 32;

/// The element type of a weight tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

/// The block-quantized weight types: their products take [`BlockQ8`] activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q4_1,
}

/// The float weight types: their products take f32 activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FloatType {
    F32,
    F16,
    BF16,
}

/// What a weight type is to the kernels. Every dispatch from a [`DType`] to a kernel goes
/// through [`DType::class`] and matches its classes exhaustively: a new type without kernels
/// does not compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightClass {
    Quantized(QuantType),
    Float(FloatType),
}

/// GGML's Q8_0 block: 32 weights, `w = d * q`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// GGML's Q4_0 block: 32 weights, `w = d * (q - 8)`; byte `j` holds element `j` in its low
/// nibble and element `j + 16` in its high nibble.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// GGML's Q4_1 block: 32 weights, `w = d * q + m`; nibbles as in [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

// The layouts are GGUF's, byte for byte: a wrong size or offset would misread every file.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<BlockQ8_0>() == 34 && offset_of!(BlockQ8_0, qs) == 2);
    assert!(size_of::<BlockQ4_0>() == 18 && offset_of!(BlockQ4_0, qs) == 2);
    assert!(size_of::<BlockQ4_1>() == 20 && offset_of!(BlockQ4_1, m) == 2 && offset_of!(BlockQ4_1, qs) == 4);
    assert!(size_of::<BlockQ8>() == 40 && offset_of!(BlockQ8, qs) == 8);
};

impl QuantType {
    /// Bytes per block of 32 weights.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            QuantType::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            QuantType::Q4_1 => std::mem::size_of::<BlockQ4_1>(),
        }
    }

    pub const fn dtype(self) -> DType {
        match self {
            QuantType::Q8_0 => DType::Q8_0,
            QuantType::Q4_0 => DType::Q4_0,
            QuantType::Q4_1 => DType::Q4_1,
        }
    }
}

impl DType {
    /// The kernels' view of the type (see [`WeightClass`]).
    pub const fn class(self) -> WeightClass {
        match self {
            DType::F32 => WeightClass::Float(FloatType::F32),
            DType::F16 => WeightClass::Float(FloatType::F16),
            DType::BF16 => WeightClass::Float(FloatType::BF16),
            DType::Q8_0 => WeightClass::Quantized(QuantType::Q8_0),
            DType::Q4_0 => WeightClass::Quantized(QuantType::Q4_0),
            DType::Q4_1 => WeightClass::Quantized(QuantType::Q4_1),
        }
    }

    /// Elements per block (1 for the float types).
    pub const fn block_len(self) -> usize {
        match self.class() {
            WeightClass::Float(_) => 1,
            WeightClass::Quantized(_) => QK,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self.class() {
            WeightClass::Float(FloatType::F32) => 4,
            WeightClass::Float(FloatType::F16 | FloatType::BF16) => 2,
            WeightClass::Quantized(q) => q.block_bytes(),
        }
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// True for the block-quantized types whose products take [`BlockQ8`] activations.
    pub const fn is_quantized(self) -> bool {
        matches!(self.class(), WeightClass::Quantized(_))
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
        }
    }
}

/// One block of 32 quantized activations: `x[i] ≈ d * qs[i]`, `s = d * Σ qs[i]`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

#[inline]
pub(crate) fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
pub(crate) fn read_bf16(b: &[u8], at: usize) -> f32 {
    bf16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
pub(crate) fn read_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Dequantizes one row of `out.len()` elements stored as `dtype` in `src` (scalar; used for
/// embedding lookups and as the reference of the tests).
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert!(src.len() >= dtype.bytes_for(n).unwrap_or(usize::MAX), "row too short");
    match dtype {
        DType::F32 => out.iter_mut().enumerate().for_each(|(i, o)| *o = read_f32(src, 4 * i)),
        DType::F16 => out.iter_mut().enumerate().for_each(|(i, o)| *o = read_f16(src, 2 * i)),
        DType::BF16 => out.iter_mut().enumerate().for_each(|(i, o)| *o = read_bf16(src, 2 * i)),
        DType::Q8_0 => {
            for (b, chunk) in out.chunks_exact_mut(QK).enumerate() {
                const BYTES: usize = size_of::<BlockQ8_0>();
                const QS: usize = offset_of!(BlockQ8_0, qs);
                let blk = &src[b * BYTES..(b + 1) * BYTES];
                let d = read_f16(blk, offset_of!(BlockQ8_0, d));
                for (j, o) in chunk.iter_mut().enumerate() {
                    *o = d * f32::from(blk[QS + j] as i8);
                }
            }
        }
        DType::Q4_0 => {
            for (b, chunk) in out.chunks_exact_mut(QK).enumerate() {
                const BYTES: usize = size_of::<BlockQ4_0>();
                const QS: usize = offset_of!(BlockQ4_0, qs);
                let blk = &src[b * BYTES..(b + 1) * BYTES];
                let d = read_f16(blk, offset_of!(BlockQ4_0, d));
                for j in 0..16 {
                    chunk[j] = d * (f32::from(blk[QS + j] & 0xf) - 8.0);
                    chunk[j + 16] = d * (f32::from(blk[QS + j] >> 4) - 8.0);
                }
            }
        }
        DType::Q4_1 => {
            for (b, chunk) in out.chunks_exact_mut(QK).enumerate() {
                const BYTES: usize = size_of::<BlockQ4_1>();
                const QS: usize = offset_of!(BlockQ4_1, qs);
                let blk = &src[b * BYTES..(b + 1) * BYTES];
                let d = read_f16(blk, offset_of!(BlockQ4_1, d));
                let m = read_f16(blk, offset_of!(BlockQ4_1, m));
                for j in 0..16 {
                    chunk[j] = d * f32::from(blk[QS + j] & 0xf) + m;
                    chunk[j + 16] = d * f32::from(blk[QS + j] >> 4) + m;
                }
            }
        }
    }
}

/// Quantizes a row of floats into `dtype` (used to write test models; the nearest-value rounding
/// of llama.cpp's reference quantizers).
pub fn quantize_row(dtype: DType, src: &[f32], out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => src.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => src.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => src.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::Q8_0 => {
            for chunk in src.chunks(QK) {
                let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(chunk.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        DType::Q4_0 => {
            for chunk in src.chunks(QK) {
                let max = chunk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(chunk[j]) | (q(chunk[j + 16]) << 4)));
            }
        }
        DType::Q4_1 => {
            for chunk in src.chunks(QK) {
                let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(chunk[j]) | (q(chunk[j + 16]) << 4)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_dequantize_round_trip_is_close() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 32.0) / 7.0).collect();
        for (dt, tol) in [(DType::Q8_0, 0.03), (DType::Q4_0, 0.6), (DType::Q4_1, 0.3), (DType::F16, 0.01)] {
            let mut bytes = Vec::new();
            quantize_row(dt, &x, &mut bytes);
            assert_eq!(bytes.len(), dt.bytes_for(64).unwrap());
            let mut y = vec![0.0; 64];
            dequantize_row(dt, &bytes, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{dt:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn bytes_for_rejects_partial_blocks() {
        assert_eq!(DType::Q4_1.bytes_for(33), None);
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::F16.bytes_for(3), Some(6));
    }
}
