//! One 32-weight group of a quantized row, decoded to integers.
//!
//! Every block format, from Q4_0's 32 weights to a K-quant's 256, is read here as groups of 32
//! weights (the size of an activation block, [`crate::quant::BlockQ8`]) in one common form:
//!
//! ```text
//! w[i] = (d * sc[i / 16]) * q[i] + dmin * m[i / 16]
//! ```
//!
//! with small integers `q`, `sc` and `m` and two float factors per group. The scalar dequantizer
//! and the scalar dot products (the reference every SIMD kernel is tested against) both start
//! from [`decode`], so a format's bit layout is written down once. The float expression rounds
//! exactly as the `gguf` Python package's dequantizers do (every product but the last is exact),
//! which the end-to-end tests check bit for bit.

use crate::quant::{
    e8m0_half, read_f16, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    QuantType, IQ4_VALUES, MXFP4_VALUES, QK, QK_K,
};
use std::mem::offset_of;

/// A decoded group; see the module docs. `has_min` is false where the format has no offset
/// term (so that `-0.0` weights stay `-0.0`, as in the reference dequantizers).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Group {
    pub q: [i8; QK],
    pub sc: [i32; 2],
    pub m: [i32; 2],
    pub d: f32,
    pub dmin: f32,
    pub has_min: bool,
}

impl Group {
    /// The 32 weights as floats.
    pub fn dequantize(&self, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate().take(QK) {
            let h = i / 16;
            let w = (self.d * self.sc[h] as f32) * f32::from(self.q[i]);
            *o = if self.has_min { w + self.dmin * self.m[h] as f32 } else { w };
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block (12 packed bytes).
pub fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The 6-bit signed scale of sub-block `j` (of 16) of a Q3_K super-block (12 packed bytes).
pub fn q3k_scale(s: &[u8], j: usize) -> i32 {
    let low = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

/// The 6-bit signed scale of sub-block `j` (of 8) of an IQ4_XS super-block `blk`.
pub fn iq4xs_scale(blk: &[u8], j: usize) -> i32 {
    let low = (blk[offset_of!(BlockIQ4XS, scales_l) + j / 2] >> (4 * (j % 2))) & 0xf;
    let high = (u16::from_le_bytes([blk[2], blk[3]]) >> (2 * j)) & 3;
    i32::from(low | ((high as u8) << 4)) - 32
}

/// Group `g` (weights `32 g .. 32 g + 32`) of the row `row` stored as `q`.
pub fn decode(q: QuantType, row: &[u8], g: usize) -> Group {
    let per = q.block_len() / QK;
    let bb = q.block_bytes();
    let blk = &row[(g / per) * bb..(g / per + 1) * bb];
    let j = g % per;
    let mut out = Group { sc: [1, 1], ..Group::default() };
    // Nibble `i` of a 16-byte run where byte `k` holds weights `k` and `k + 16`.
    let nib = |qs: &[u8], i: usize| if i < 16 { qs[i] & 0xf } else { qs[i - 16] >> 4 };
    match q {
        QuantType::Q8_0 => {
            out.d = read_f16(blk, 0);
            out.q = std::array::from_fn(|i| blk[2 + i] as i8);
        }
        QuantType::Q4_0 => {
            out.d = read_f16(blk, 0);
            out.q = std::array::from_fn(|i| nib(&blk[2..], i) as i8 - 8);
        }
        QuantType::Q4_1 => {
            out.d = read_f16(blk, 0);
            (out.dmin, out.m, out.has_min) = (read_f16(blk, offset_of!(BlockQ4_1, m)), [1, 1], true);
            out.q = std::array::from_fn(|i| nib(&blk[4..], i) as i8);
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (qh, qs) = if q == QuantType::Q5_0 {
                (offset_of!(BlockQ5_0, qh), offset_of!(BlockQ5_0, qs))
            } else {
                (offset_of!(BlockQ5_1, qh), offset_of!(BlockQ5_1, qs))
            };
            let high = u32::from_le_bytes([blk[qh], blk[qh + 1], blk[qh + 2], blk[qh + 3]]);
            let five = |i: usize| nib(&blk[qs..], i) | ((((high >> i) & 1) as u8) << 4);
            out.d = read_f16(blk, 0);
            if q == QuantType::Q5_0 {
                out.q = std::array::from_fn(|i| five(i) as i8 - 16);
            } else {
                (out.dmin, out.m, out.has_min) = (read_f16(blk, offset_of!(BlockQ5_1, m)), [1, 1], true);
                out.q = std::array::from_fn(|i| five(i) as i8);
            }
        }
        QuantType::IQ4NL => {
            out.d = read_f16(blk, 0);
            out.q = std::array::from_fn(|i| IQ4_VALUES[usize::from(nib(&blk[2..], i))]);
        }
        QuantType::MXFP4 => {
            out.d = e8m0_half(blk[0]);
            out.q = std::array::from_fn(|i| MXFP4_VALUES[usize::from(nib(&blk[1..], i))]);
        }
        QuantType::Q2K => {
            // Weight e = 128 h + 32 s + l sits in bits 2s of byte 32 h + l.
            let (h, s) = (j / 4, j % 4);
            let (sc, qs) = (&blk[..16], &blk[offset_of!(BlockQ2K, qs)..]);
            out.d = read_f16(blk, offset_of!(BlockQ2K, d));
            out.dmin = -read_f16(blk, offset_of!(BlockQ2K, dmin));
            out.has_min = true;
            out.sc = [0, 1].map(|k| i32::from(sc[2 * j + k] & 0xf));
            out.m = [0, 1].map(|k| i32::from(sc[2 * j + k] >> 4));
            out.q = std::array::from_fn(|l| ((qs[32 * h + l] >> (2 * s)) & 3) as i8);
        }
        QuantType::Q3K => {
            let (h, s) = (j / 4, j % 4);
            let qs = &blk[offset_of!(BlockQ3K, qs)..];
            let scales = &blk[offset_of!(BlockQ3K, scales)..];
            out.d = read_f16(blk, offset_of!(BlockQ3K, d));
            out.sc = [0, 1].map(|k| q3k_scale(scales, 2 * j + k));
            // The high bit of weight 32 j + l is bit j of hmask[l]; a clear bit subtracts 4.
            out.q = std::array::from_fn(|l| {
                let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
                if (blk[l] >> j) & 1 == 1 {
                    low
                } else {
                    low - 4
                }
            });
        }
        QuantType::Q4K | QuantType::Q5K => {
            // Weight 64 c + 32 h + l sits in nibble h of byte 32 c + l.
            let (c, h) = (j / 2, j % 2);
            let (sc, m) = k_scale_min(&blk[4..16], j);
            out.d = read_f16(blk, 0);
            out.dmin = -read_f16(blk, 2);
            out.has_min = true;
            out.sc = [i32::from(sc); 2];
            out.m = [i32::from(m); 2];
            if q == QuantType::Q4K {
                let qs = &blk[offset_of!(BlockQ4K, qs)..];
                out.q = std::array::from_fn(|l| ((qs[32 * c + l] >> (4 * h)) & 0xf) as i8);
            } else {
                let (qh, qs) = (&blk[offset_of!(BlockQ5K, qh)..], &blk[offset_of!(BlockQ5K, qs)..]);
                out.q = std::array::from_fn(|l| {
                    let low = (qs[32 * c + l] >> (4 * h)) & 0xf;
                    (low | (((qh[l] >> j) & 1) << 4)) as i8
                });
            }
        }
        QuantType::Q6K => {
            // Weight e = 128 h + 32 s + l: low four bits in nibble s / 2 of ql[64 h + 32 (s % 2) + l],
            // high two in bits 2 s of qh[32 h + l].
            let (h, s) = (j / 4, j % 4);
            let (ql, qh) = (&blk[..QK_K / 2], &blk[offset_of!(BlockQ6K, qh)..]);
            let scales = &blk[offset_of!(BlockQ6K, scales)..];
            out.d = read_f16(blk, offset_of!(BlockQ6K, d));
            out.sc = [0, 1].map(|k| i32::from(scales[2 * j + k] as i8));
            out.q = std::array::from_fn(|l| {
                let low = (ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0xf;
                let high = (qh[32 * h + l] >> (2 * s)) & 3;
                (low | (high << 4)) as i8 - 32
            });
        }
        QuantType::IQ4XS => {
            out.d = read_f16(blk, 0);
            out.sc = [iq4xs_scale(blk, j); 2];
            let qs = &blk[offset_of!(BlockIQ4XS, qs) + 16 * j..];
            out.q = std::array::from_fn(|i| IQ4_VALUES[usize::from(nib(qs, i))]);
        }
    }
    out
}
