//! Tensor element types and their block layouts, bit-compatible with GGUF/GGML.
//!
//! Quantized types store a row of `k` weights as `k / 32` blocks, each a `#[repr(C)]` struct
//! whose size and field offsets are asserted at compile time ([`BlockQ8_0`], [`BlockQ4_0`],
//! [`BlockQ4_1`]); the kernels read those bytes in place from the memory map. Activations are
//! quantized per 32-block to [`BlockQ8`] (8-bit, like llama.cpp's Q8_1: the block sum is kept
//! so the Q4_1 offset term costs one multiply per block).

use half::slice::HalfFloatSliceExt;
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
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
    MXFP4,
}

/// The block-quantized weight types: their products take [`BlockQ8`] activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
    MXFP4,
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

/// GGML's Q5_0 block: 32 weights, `w = d * (q - 16)`; the low four bits as in [`BlockQ4_0`],
/// bit `j` of the little-endian `qh` the fifth bit of element `j`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// GGML's Q5_1 block: 32 weights, `w = d * q + m`; bits as in [`BlockQ5_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Weights per K-quant super-block.
pub const QK_K: usize = 256;

/// GGML's Q2_K super-block: 16 sub-blocks of 16, `w = d * sc * q - dmin * m` with 2-bit `q` and
/// 4-bit `sc` (low nibble of `scales[j]`) and `m` (high nibble).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// GGML's Q3_K super-block: 16 sub-blocks of 16, `w = d * (sc - 32) * (q - 4 * !h)` with 2-bit
/// `q`, the high bit `h` in `hmask` and 6-bit scales packed in 12 bytes.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// GGML's Q4_K super-block: 8 sub-blocks of 32, `w = d * sc * q - dmin * m` with 4-bit `q` and
/// 6-bit `sc` and `m` packed in 12 bytes.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// GGML's Q5_K super-block: [`BlockQ4K`] with a fifth bit per weight in `qh`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// GGML's Q6_K super-block: 16 sub-blocks of 16, `w = d * sc * (q - 32)` with 6-bit `q` (low
/// four bits in `ql`, high two in `qh`) and 8-bit signed `sc`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// GGML's IQ4_NL block: 32 weights, `w = d * IQ4_VALUES[q]`; nibbles as in [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockIQ4NL {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// GGML's IQ4_XS super-block: 8 sub-blocks of 32, `w = d * (ls - 32) * IQ4_VALUES[q]` with 6-bit
/// `ls` (low four bits in `scales_l`, high two in the little-endian `scales_h`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockIQ4XS {
    pub d: f16,
    pub scales_h: [u8; 2],
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}

/// GGML's MXFP4 block (OCP microscaling FP4, gpt-oss's experts): 32 weights, `w =
/// 2^(e - 128) * MXFP4_VALUES[q]`, an E8M0 exponent `e` and E2M1 values (stored doubled as
/// integers, hence the halved scale); nibbles as in [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockMXFP4 {
    pub e: u8,
    pub qs: [u8; QK / 2],
}

/// Twice the E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), as GGML stores them.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the value of an E8M0 exponent byte: `2^(e - 128)`, exact in f32 (denormal for e < 2),
/// as GGML's `ggml_e8m0_to_fp32_half`.
#[inline]
pub const fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

/// The non-linear 4-bit code book of IQ4_NL and IQ4_XS.
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

// The layouts are GGUF's, byte for byte: a wrong size or offset would misread every file.
const _: () = {
    assert!(size_of::<BlockQ8_0>() == 34 && offset_of!(BlockQ8_0, qs) == 2);
    assert!(size_of::<BlockQ4_0>() == 18 && offset_of!(BlockQ4_0, qs) == 2);
    assert!(size_of::<BlockQ4_1>() == 20 && offset_of!(BlockQ4_1, m) == 2 && offset_of!(BlockQ4_1, qs) == 4);
    assert!(size_of::<BlockQ5_0>() == 22 && offset_of!(BlockQ5_0, qh) == 2 && offset_of!(BlockQ5_0, qs) == 6);
    assert!(size_of::<BlockQ5_1>() == 24 && offset_of!(BlockQ5_1, qh) == 4 && offset_of!(BlockQ5_1, qs) == 8);
    assert!(size_of::<BlockQ2K>() == 84 && offset_of!(BlockQ2K, qs) == 16 && offset_of!(BlockQ2K, d) == 80);
    assert!(size_of::<BlockQ3K>() == 110 && offset_of!(BlockQ3K, qs) == 32 && offset_of!(BlockQ3K, scales) == 96);
    assert!(offset_of!(BlockQ3K, d) == 108);
    assert!(size_of::<BlockQ4K>() == 144 && offset_of!(BlockQ4K, scales) == 4 && offset_of!(BlockQ4K, qs) == 16);
    assert!(size_of::<BlockQ5K>() == 176 && offset_of!(BlockQ5K, qh) == 16 && offset_of!(BlockQ5K, qs) == 48);
    assert!(size_of::<BlockQ6K>() == 210 && offset_of!(BlockQ6K, qh) == 128 && offset_of!(BlockQ6K, scales) == 192);
    assert!(offset_of!(BlockQ6K, d) == 208);
    assert!(size_of::<BlockIQ4NL>() == 18 && offset_of!(BlockIQ4NL, qs) == 2);
    assert!(size_of::<BlockIQ4XS>() == 136 && offset_of!(BlockIQ4XS, scales_l) == 4 && offset_of!(BlockIQ4XS, qs) == 8);
    assert!(size_of::<BlockMXFP4>() == 17 && offset_of!(BlockMXFP4, qs) == 1);
    assert!(size_of::<BlockQ8>() == 40 && offset_of!(BlockQ8, qs) == 8);
};

impl QuantType {
    /// Every quantized type, in declaration order: `ALL[q.index()] == q`.
    pub const ALL: [QuantType; QuantType::COUNT] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q2K,
        QuantType::Q3K,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
        QuantType::IQ4NL,
        QuantType::IQ4XS,
        QuantType::MXFP4,
    ];

    /// How many quantized types there are.
    pub const COUNT: usize = 13;

    /// The type's position in [`QuantType::ALL`] (tables of kernels are indexed by it).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Weights per block: 32, or 256 for the super-block formats.
    pub const fn block_len(self) -> usize {
        match self {
            QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 => QK,
            QuantType::IQ4NL | QuantType::MXFP4 => QK,
            QuantType::Q2K | QuantType::Q3K | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => QK_K,
            QuantType::IQ4XS => QK_K,
        }
    }

    /// Bytes per block of [`QuantType::block_len`] weights.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => size_of::<BlockQ8_0>(),
            QuantType::Q4_0 => size_of::<BlockQ4_0>(),
            QuantType::Q4_1 => size_of::<BlockQ4_1>(),
            QuantType::Q5_0 => size_of::<BlockQ5_0>(),
            QuantType::Q5_1 => size_of::<BlockQ5_1>(),
            QuantType::Q2K => size_of::<BlockQ2K>(),
            QuantType::Q3K => size_of::<BlockQ3K>(),
            QuantType::Q4K => size_of::<BlockQ4K>(),
            QuantType::Q5K => size_of::<BlockQ5K>(),
            QuantType::Q6K => size_of::<BlockQ6K>(),
            QuantType::IQ4NL => size_of::<BlockIQ4NL>(),
            QuantType::IQ4XS => size_of::<BlockIQ4XS>(),
            QuantType::MXFP4 => size_of::<BlockMXFP4>(),
        }
    }

    pub const fn dtype(self) -> DType {
        match self {
            QuantType::Q8_0 => DType::Q8_0,
            QuantType::Q4_0 => DType::Q4_0,
            QuantType::Q4_1 => DType::Q4_1,
            QuantType::Q5_0 => DType::Q5_0,
            QuantType::Q5_1 => DType::Q5_1,
            QuantType::Q2K => DType::Q2K,
            QuantType::Q3K => DType::Q3K,
            QuantType::Q4K => DType::Q4K,
            QuantType::Q5K => DType::Q5K,
            QuantType::Q6K => DType::Q6K,
            QuantType::IQ4NL => DType::IQ4NL,
            QuantType::IQ4XS => DType::IQ4XS,
            QuantType::MXFP4 => DType::MXFP4,
        }
    }
}

impl DType {
    /// Every type a weight may have.
    pub const ALL: [DType; 16] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::IQ4NL,
        DType::IQ4XS,
        DType::MXFP4,
    ];

    /// The kernels' view of the type (see [`WeightClass`]).
    pub const fn class(self) -> WeightClass {
        match self {
            DType::F32 => WeightClass::Float(FloatType::F32),
            DType::F16 => WeightClass::Float(FloatType::F16),
            DType::BF16 => WeightClass::Float(FloatType::BF16),
            DType::Q8_0 => WeightClass::Quantized(QuantType::Q8_0),
            DType::Q4_0 => WeightClass::Quantized(QuantType::Q4_0),
            DType::Q4_1 => WeightClass::Quantized(QuantType::Q4_1),
            DType::Q5_0 => WeightClass::Quantized(QuantType::Q5_0),
            DType::Q5_1 => WeightClass::Quantized(QuantType::Q5_1),
            DType::Q2K => WeightClass::Quantized(QuantType::Q2K),
            DType::Q3K => WeightClass::Quantized(QuantType::Q3K),
            DType::Q4K => WeightClass::Quantized(QuantType::Q4K),
            DType::Q5K => WeightClass::Quantized(QuantType::Q5K),
            DType::Q6K => WeightClass::Quantized(QuantType::Q6K),
            DType::IQ4NL => WeightClass::Quantized(QuantType::IQ4NL),
            DType::IQ4XS => WeightClass::Quantized(QuantType::IQ4XS),
            DType::MXFP4 => WeightClass::Quantized(QuantType::MXFP4),
        }
    }

    /// Elements per block (1 for the float types).
    pub const fn block_len(self) -> usize {
        match self.class() {
            WeightClass::Float(_) => 1,
            WeightClass::Quantized(q) => q.block_len(),
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

    /// GGML's name of the type, as GGUF tools print it.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q2K => "Q2_K",
            DType::Q3K => "Q3_K",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
            DType::IQ4NL => "IQ4_NL",
            DType::IQ4XS => "IQ4_XS",
            DType::MXFP4 => "MXFP4",
        }
    }

    /// GGML's number for the type (the `type` field of a GGUF tensor).
    pub const fn ggml_type(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2K => 10,
            DType::Q3K => 11,
            DType::Q4K => 12,
            DType::Q5K => 13,
            DType::Q6K => 14,
            DType::IQ4NL => 20,
            DType::IQ4XS => 23,
            DType::BF16 => 30,
            DType::MXFP4 => 39,
        }
    }

    /// The type of GGML's number `ty`, if it is one of [`DType::ALL`].
    pub fn from_ggml(ty: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_type() == ty)
    }
}

/// GGML's name of a type number, for the types that are not a [`DType`] (refused by name).
pub fn ggml_type_name(ty: u32) -> Option<&'static str> {
    const OTHERS: [(u32, &str); 18] = [
        (4, "Q4_2"),
        (5, "Q4_3"),
        (9, "Q8_1"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
    ];
    DType::from_ggml(ty).map(DType::name).or_else(|| OTHERS.iter().find(|(t, _)| *t == ty).map(|(_, n)| *n))
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
/// embedding lookups and as the reference of the tests). Quantized types go through
/// [`crate::group::decode`], whose `(d * sc) * q + dmin * m` rounds exactly as the `gguf` Python
/// package's dequantizers do.
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert!(src.len() >= dtype.bytes_for(n).unwrap_or(usize::MAX), "row too short");
    match dtype.class() {
        WeightClass::Float(FloatType::F32) => out.iter_mut().enumerate().for_each(|(i, o)| *o = read_f32(src, 4 * i)),
        WeightClass::Float(FloatType::F16) => {
            // A run of halves at a time: the half crate converts a slice with F16C, 8 a time.
            let mut halves = [f16::ZERO; 64];
            for (c, run) in out.chunks_mut(64).enumerate() {
                let hs = &mut halves[..run.len()];
                hs.iter_mut()
                    .enumerate()
                    .for_each(|(i, h)| *h = f16::from_le_bytes([src[128 * c + 2 * i], src[128 * c + 2 * i + 1]]));
                hs.convert_to_f32_slice(run);
            }
        }
        WeightClass::Float(FloatType::BF16) => out.iter_mut().enumerate().for_each(|(i, o)| *o = read_bf16(src, 2 * i)),
        WeightClass::Quantized(q) => {
            for (g, chunk) in out.chunks_exact_mut(QK).enumerate() {
                crate::group::decode(q, src, g).dequantize(chunk);
            }
        }
    }
}

pub use crate::quantize::quantize_row;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rows_dequantize_as_each_half_converts() {
        // Every 16-bit pattern in one row, not a whole number of 64-value runs; a NaN only
        // as a NaN (its payload may differ).
        let all: Vec<u16> = (0..=u16::MAX).skip(3).collect();
        let bytes: Vec<u8> = all.iter().flat_map(|h| h.to_le_bytes()).collect();
        let mut out = vec![0f32; all.len()];
        dequantize_row(DType::F16, &bytes, &mut out);
        for (&h, &o) in all.iter().zip(&out) {
            let want = f16::from_bits(h).to_f32();
            assert!(o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()), "{h:#x}: {o} vs {want}");
        }
    }

    #[test]
    fn quantize_dequantize_round_trip_is_close() {
        // Values in [-4.6, 4.4]; the tolerances are about a step of each format.
        let x: Vec<f32> = (0..512).map(|i| ((i * 37 % 64) as f32 - 32.0) / 7.0).collect();
        for (dt, tol) in [
            (DType::Q8_0, 0.03),
            (DType::Q4_0, 0.6),
            (DType::Q4_1, 0.3),
            (DType::Q5_0, 0.3),
            (DType::Q5_1, 0.15),
            (DType::Q2K, 2.0),
            (DType::Q3K, 1.3),
            (DType::Q4K, 0.35),
            (DType::Q5K, 0.2),
            (DType::Q6K, 0.1),
            (DType::IQ4NL, 0.5),
            (DType::IQ4XS, 0.5),
            (DType::MXFP4, 0.6),
            (DType::F16, 0.01),
        ] {
            let mut bytes = Vec::new();
            quantize_row(dt, &x, &mut bytes);
            assert_eq!(bytes.len(), dt.bytes_for(512).unwrap());
            let mut y = vec![0.0; 512];
            dequantize_row(dt, &bytes, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{dt:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn type_tables_agree() {
        for (i, q) in QuantType::ALL.into_iter().enumerate() {
            assert_eq!(q.index(), i);
            assert_eq!(q.dtype().class(), WeightClass::Quantized(q));
            assert_eq!(DType::from_ggml(q.dtype().ggml_type()), Some(q.dtype()));
        }
        for d in DType::ALL {
            assert_eq!(ggml_type_name(d.ggml_type()), Some(d.name()));
        }
        assert_eq!(ggml_type_name(16), Some("IQ2_XXS"));
        assert_eq!(DType::from_ggml(16), None);
    }

    #[test]
    fn bytes_for_rejects_partial_blocks() {
        assert_eq!(DType::Q4_1.bytes_for(33), None);
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::F16.bytes_for(3), Some(6));
    }
}
