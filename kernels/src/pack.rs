//! Weights repacked at load time for the 16-row kernel: the layout in which the kernel reads a
//! group of 16 rows with plain vector loads, instead of unpacking and transposing every row's
//! blocks on every call (llama.cpp's CPU "repack" buffers follow the same idea).
//!
//! A packed matrix has the size of the original. Its rows are taken 16 at a time; each group
//! of 16 rows (`16 * rb` bytes, where it was) holds the same bytes rearranged so that one
//! 64-byte vector carries one dword of every row, row `i` in lane `i`. The rows past the last
//! whole group stay as they were, so [`crate::matmul::Matrix::row`] still finds them.
//!
//! Types with a packed layout ([`has_layout`]):
//! - Q8_0, for each pair of blocks `b`, `b + 1` of the group (at byte `544 b`): the 16 rows'
//!   f16 scales of block `b` (32 bytes), those of `b + 1` (32), then block `b`'s quants as 8
//!   vectors (vector `m`: bytes `4m..4m + 4` of every row, biased by +128 as `vpdpbusd`'s
//!   unsigned operand wants them), then block `b + 1`'s. A last block without a pair is its
//!   scales, then its 8 vectors.

use crate::quant::{DType, QuantType};
use std::ops::Deref;

/// Whether `dt` has a packed layout (module docs).
pub fn has_layout(dt: DType) -> bool {
    dt == QuantType::Q8_0.dtype()
}

/// How a matrix's rows lie in its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Layout {
    /// Row after row, as the file stores them.
    #[default]
    Rows,
    /// Groups of 16 rows rearranged for the 16-row kernel (module docs).
    Packed16,
}

/// The packed bytes of a matrix, starting on a 64-byte boundary (a cache line, and the
/// kernel's vector loads then never straddle two).
pub struct PackedBytes {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Deref for PackedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for PackedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedBytes({} bytes)", self.len)
    }
}

/// Where byte `j` of block `b` of row `i` of a Q8_0 group (`nb` blocks a row) lies in the
/// packed group, and whether it is a quant (stored biased by +128).
fn q8_0_place(nb: usize, i: usize, b: usize, j: usize) -> (usize, bool) {
    const BLOCK: usize = 34;
    let pair = 16 * BLOCK * (b & !1);
    let (scales, quants) =
        if (b | 1) < nb { (pair + 32 * (b % 2), pair + 64 + 512 * (b % 2)) } else { (pair, pair + 32) };
    if j < 2 {
        (scales + 2 * i + j, false)
    } else {
        let q = j - 2;
        (quants + 64 * (q / 4) + 4 * i + q % 4, true)
    }
}

/// `data` (`rows` rows of `cols` weights of type `dt`, row after row) in the packed layout, or
/// `None` when `dt` has none ([`has_layout`]) or the shape does not fit the type.
pub fn pack(dt: DType, rows: usize, cols: usize, data: &[u8]) -> Option<PackedBytes> {
    let rb = dt.bytes_for(cols)?;
    if !has_layout(dt) || data.len() < rows.checked_mul(rb)? {
        return None;
    }
    let len = rows * rb;
    let mut buf = vec![0u8; len + 63];
    let start = buf.as_ptr().align_offset(64).min(63);
    let out = &mut buf[start..start + len];
    let whole = rows / 16 * 16;
    let nb = rb / dt.block_bytes();
    for (group, dst) in data[..whole * rb].chunks_exact(16 * rb).zip(out.chunks_exact_mut(16 * rb)) {
        for i in 0..16 {
            for (b, block) in group[i * rb..(i + 1) * rb].chunks_exact(dt.block_bytes()).enumerate() {
                for (j, &v) in block.iter().enumerate() {
                    let (at, quant) = q8_0_place(nb, i, b, j);
                    dst[at] = if quant { v ^ 0x80 } else { v };
                }
            }
        }
    }
    out[whole * rb..].copy_from_slice(&data[whole * rb..len]);
    Some(PackedBytes { buf, start, len })
}

/// The bytes of row `r` of a packed matrix (`data`, rows of `rb` bytes of type `dt`) as the
/// file stored them, into `out` (`rb` bytes).
pub fn unpack_row(dt: DType, data: &[u8], rb: usize, r: usize, out: &mut [u8]) {
    assert!(has_layout(dt) && out.len() == rb, "a row of a packed type");
    let (group, i) = (r / 16, r % 16);
    let g = &data[group * 16 * rb..];
    if g.len() < 16 * rb {
        // A row past the last whole group is stored as it was.
        out.copy_from_slice(&g[i * rb..(i + 1) * rb]);
        return;
    }
    let nb = rb / dt.block_bytes();
    for (b, block) in out.chunks_exact_mut(dt.block_bytes()).enumerate() {
        for (j, v) in block.iter_mut().enumerate() {
            let (at, quant) = q8_0_place(nb, i, b, j);
            *v = if quant { g[at] ^ 0x80 } else { g[at] };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_unpacks_to_its_bytes_and_the_packing_moves_every_byte() {
        // Odd and even block counts, whole groups and a rest of rows: each row must come back
        // as it was, and the packing must be a permutation (no two bytes to one place).
        let dt = QuantType::Q8_0.dtype();
        for (rows, blocks) in [(16, 2), (16, 3), (35, 1), (48, 4), (7, 2)] {
            let rb = blocks * dt.block_bytes();
            let data: Vec<u8> = (0..rows * rb).map(|i| (i * 7919 % 251) as u8).collect();
            let packed = pack(dt, rows, blocks * 32, &data).unwrap();
            assert_eq!(packed.len(), data.len());
            assert_eq!(packed.as_ptr() as usize % 64, 0, "the packed bytes start on a cache line");
            let mut row = vec![0u8; rb];
            for r in 0..rows {
                unpack_row(dt, &packed, rb, r, &mut row);
                assert_eq!(row, data[r * rb..(r + 1) * rb], "{rows} rows of {blocks} blocks: row {r}");
            }
            let mut hit = vec![false; 16 * rb];
            for i in 0..16 {
                for b in 0..blocks {
                    for j in 0..dt.block_bytes() {
                        let (at, _) = q8_0_place(blocks, i, b, j);
                        assert!(!std::mem::replace(&mut hit[at], true), "byte {at} taken twice");
                    }
                }
            }
        }
    }

    #[test]
    fn types_without_a_layout_are_not_packed() {
        assert!(pack(QuantType::Q4K.dtype(), 16, 256, &[0; 16 * 144]).is_none());
        assert!(pack(QuantType::Q8_0.dtype(), 16, 32, &[0; 16 * 33]).is_none(), "too few bytes");
    }
}
