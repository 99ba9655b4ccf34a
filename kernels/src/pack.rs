//! Weights repacked at load time for the 16-row kernel: the layout in which the kernel reads a
//! group of 16 rows with plain vector loads, instead of unpacking and transposing every row's
//! blocks on every call (llama.cpp's CPU "repack" buffers follow the same idea).
//!
//! A packed matrix has the size of the original. Its rows are taken 16 at a time; each group
//! of 16 rows (`16 * rb` bytes, where it was) holds the same bytes rearranged so that one
//! 64-byte vector carries one dword of every row, row `i` in lane `i`. The rows past the last
//! whole group stay as they were, so [`crate::matmul::Matrix::row`] still finds them.
//!
//! The layout, per type: a block is a list of fields ([`fields`]). The blocks go in units of
//! [`unit_blocks`]: pairs `b`, `b + 1` of the blocks of 32 weights (the kernel's step) and of
//! the super-blocks whose 16 rows are not whole cache lines (Q6_K's 3,360 bytes, Q3_K's 1,760),
//! so that every unit starts on a cache line; the other super-blocks alone. A unit starts at
//! byte `16 * block_bytes * b` of the group and holds its blocks field by field: field `k` of
//! its first block for the 16 rows, of its second, then field `k + 1`. Inside, a 1- or 2-byte field (an
//! f16 scale, MXFP4's exponent byte) is the 16 rows side by side (one load), a longer one is stored by
//! dword: vector `m` holds dword `m` of the field of every row. Two fields are stored in the
//! form the kernel wants rather than the file's: Q8_0's quants biased by +128 (`vpdpbusd`'s
//! unsigned operand; the AVX2 kernel, eight rows to a half vector, takes them back), and Q5_0's and Q5_1's fifth bits reordered so that one shift brings
//! those of four consecutive weights to the four bytes of a dword ([`fifth_bit_at`]).

use crate::pool::ThreadPool;
use crate::quant::{DType, QuantType, WeightClass};
use std::ops::Deref;
use std::sync::{Mutex, PoisonError};

/// The fields of a block of `q` in file order, in bytes.
const fn fields(q: QuantType) -> &'static [usize] {
    match q {
        QuantType::Q8_0 => &[2, 32],
        QuantType::Q4_0 | QuantType::IQ4NL => &[2, 16],
        QuantType::Q4_1 => &[2, 2, 16],
        QuantType::Q5_0 => &[2, 4, 16],
        QuantType::Q5_1 => &[2, 2, 4, 16],
        QuantType::Q4K => &[4, 12, 128],
        QuantType::Q5K => &[4, 12, 32, 128],
        QuantType::Q6K => &[128, 64, 16, 2],
        QuantType::Q3K => &[32, 64, 12, 2],
        QuantType::Q2K => &[16, 64, 4],
        QuantType::IQ4XS => &[4, 4, 128],
        QuantType::MXFP4 => &[1, 16],
    }
}

/// Whether `dt` has a packed layout (module docs): every quantized type.
pub fn has_layout(dt: DType) -> bool {
    matches!(dt.class(), WeightClass::Quantized(_))
}

/// How many of `q`'s blocks a unit holds (module docs).
pub(crate) const fn unit_blocks(q: QuantType) -> usize {
    if q.block_len() == 32 || !(16 * q.block_bytes()).is_multiple_of(64) {
        2
    } else {
        1
    }
}

/// The byte of the unit starting at block `b0` (`n` blocks: 1 or 2) where field `k` of its
/// block `b0 + c` starts for the 16 rows (module docs).
const fn field_at(q: QuantType, n: usize, k: usize, c: usize) -> usize {
    let f = fields(q);
    let (mut before, mut i) = (0, 0);
    while i < k {
        before += f[i];
        i += 1;
    }
    16 * (n * before + c * f[k])
}

/// Where each field `k` of a unit of `n` blocks (1 or 2) starts for its block `c`: `[k][c]`,
/// zero past the type's fields and the unit's blocks (every type has at most four fields).
/// A table built at compile time: the kernels look it up on every call.
pub(crate) fn unit_offsets(q: QuantType, n: usize) -> &'static [[usize; 2]; 4] {
    &UNIT_OFFSETS[q.index()][n - 1]
}

/// [`unit_offsets`] of every type, for units of 1 and of 2 blocks.
static UNIT_OFFSETS: [[[[usize; 2]; 4]; 2]; QuantType::COUNT] = {
    let mut t = [[[[0; 2]; 4]; 2]; QuantType::COUNT];
    let mut i = 0;
    while i < QuantType::COUNT {
        let q = QuantType::ALL[i];
        let mut n = 1;
        while n <= 2 {
            let mut k = 0;
            while k < fields(q).len() {
                let mut c = 0;
                while c < n {
                    t[q.index()][n - 1][k][c] = field_at(q, n, k, c);
                    c += 1;
                }
                k += 1;
            }
            n += 1;
        }
        i += 1;
    }
    t
};

/// Where Q5_0's and Q5_1's fifth bit of weight `e` (bit `e` of the file's `qh`) is kept: bit
/// `8 k + 2 m + h` for weight `16 h + 4 m + k`, so that a shift by `2 m + h` brings the bits of
/// the four weights of quant dword `m`'s low (`h = 0`) or high (`h = 1`) nibbles to bit 0 of
/// the dword's four bytes.
pub(crate) const fn fifth_bit_at(e: usize) -> usize {
    8 * (e % 4) + 2 * (e % 16 / 4) + e / 16
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

/// The packed bytes of a matrix, starting on a 64-byte boundary (a cache line: the kernel's
/// vector loads then never straddle two, as long as each group of 16 rows holds whole units;
/// a row of an odd number of 32-weight blocks, or of Q6_K or Q3_K super-blocks, leaves the
/// next group half a line off).
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

/// Where byte `j` of block `b` of row `i` lies in its packed group (`nb` blocks a row).
fn place(q: QuantType, nb: usize, i: usize, b: usize, j: usize) -> usize {
    let per = unit_blocks(q);
    let b0 = b / per * per;
    let n = per.min(nb - b0);
    let f = fields(q);
    let (mut k, mut start) = (0, 0);
    while j >= start + f[k] {
        start += f[k];
        k += 1;
    }
    let at = 16 * q.block_bytes() * b0 + field_at(q, n, k, b - b0);
    let o = j - start;
    at + if f[k] <= 2 { f[k] * i + o } else { 64 * (o / 4) + 4 * i + o % 4 }
}

/// A block of `q` between the file's form and the kernel's (module docs), in place; `to_kernel`
/// picks the direction.
fn convert(q: QuantType, block: &mut [u8], to_kernel: bool) {
    match q {
        QuantType::Q8_0 => block[2..].iter_mut().for_each(|v| *v ^= 0x80),
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let at = if q == QuantType::Q5_0 { 2 } else { 4 };
            let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            let moved = (0..32).fold(0u32, |v, e| {
                let (from, to) = if to_kernel { (e, fifth_bit_at(e)) } else { (fifth_bit_at(e), e) };
                v | ((qh >> from) & 1) << to
            });
            block[at..at + 4].copy_from_slice(&moved.to_le_bytes());
        }
        _ => {}
    }
}

/// `data` (`rows` rows of `cols` weights of type `dt`, row after row) in the packed layout, or
/// `None` when `dt` has none ([`has_layout`]) or the shape does not fit the type. The groups
/// are packed on `pool`'s threads (a model's matrices are packed at load, where an 8B model's
/// 5 GB would take seconds on one thread).
pub fn pack(pool: &ThreadPool, dt: DType, rows: usize, cols: usize, data: &[u8]) -> Option<PackedBytes> {
    let WeightClass::Quantized(q) = dt.class() else { return None };
    let rb = dt.bytes_for(cols)?;
    if !has_layout(dt) || data.len() < rows.checked_mul(rb)? {
        return None;
    }
    let len = rows * rb;
    let mut buf = vec![0u8; len + 63];
    let start = buf.as_ptr().align_offset(64).min(63);
    let out = &mut buf[start..start + len];
    let whole = rows / 16 * 16;
    out[whole * rb..].copy_from_slice(&data[whole * rb..len]);
    // Tasks of a run of groups each, a few per thread; each packs into its own part of `out`.
    let groups_per_task = (whole / 16).div_ceil(4 * pool.threads()).max(1);
    let parts: Vec<Mutex<&mut [u8]>> =
        out[..whole * rb].chunks_mut(groups_per_task * 16 * rb).map(Mutex::new).collect();
    pool.run(parts.len(), &|t| {
        let mut part = parts[t].lock().unwrap_or_else(PoisonError::into_inner);
        let from = t * groups_per_task * 16 * rb;
        pack_groups(q, rb, &data[from..from + part.len()], &mut part);
    });
    drop(parts);
    Some(PackedBytes { buf, start, len })
}

/// Whole groups of 16 rows of `rb` bytes from `src` into `dst` in the packed layout.
fn pack_groups(q: QuantType, rb: usize, src: &[u8], dst: &mut [u8]) {
    let (bb, nb) = (q.block_bytes(), rb / q.block_bytes());
    let per = unit_blocks(q);
    let f = fields(q);
    // Where each field of a unit's block c starts, for a whole unit and a lone last block
    // (`place`, a field at a time: the same places, tested as its inverse).
    let (whole_unit, lone) = (unit_offsets(q, per), unit_offsets(q, 1));
    let mut block = vec![0u8; bb];
    for (group, dst) in src.chunks_exact(16 * rb).zip(dst.chunks_exact_mut(16 * rb)) {
        for i in 0..16 {
            for (b, row_block) in group[i * rb..(i + 1) * rb].chunks_exact(bb).enumerate() {
                block.copy_from_slice(row_block);
                convert(q, &mut block, true);
                let b0 = b / per * per;
                let at = if per.min(nb - b0) == per { whole_unit } else { lone };
                let mut from = 0;
                for (k, &size) in f.iter().enumerate() {
                    let to = 16 * bb * b0 + at[k][b - b0];
                    let field = &block[from..from + size];
                    if size <= 2 {
                        dst[to + size * i..to + size * (i + 1)].copy_from_slice(field);
                    } else {
                        for (o, four) in field.chunks_exact(4).enumerate() {
                            dst[to + 64 * o + 4 * i..to + 64 * o + 4 * i + 4].copy_from_slice(four);
                        }
                    }
                    from += size;
                }
            }
        }
    }
}

/// The bytes of row `r` of a packed matrix (`data`, rows of `rb` bytes of type `dt`) as the
/// file stored them, into `out` (`rb` bytes).
pub fn unpack_row(dt: DType, data: &[u8], rb: usize, r: usize, out: &mut [u8]) {
    let WeightClass::Quantized(q) = dt.class() else { panic!("{dt:?} is not packed") };
    assert!(has_layout(dt) && out.len() == rb, "a row of a packed type");
    let (group, i) = (r / 16, r % 16);
    let g = &data[group * 16 * rb..];
    if g.len() < 16 * rb {
        // A row past the last whole group is stored as it was.
        out.copy_from_slice(&g[i * rb..(i + 1) * rb]);
        return;
    }
    let nb = rb / q.block_bytes();
    for (b, block) in out.chunks_exact_mut(q.block_bytes()).enumerate() {
        for (j, v) in block.iter_mut().enumerate() {
            *v = g[place(q, nb, i, b, j)];
        }
        convert(q, block, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_unpacks_to_its_bytes_and_the_packing_moves_every_byte() {
        // Odd and even block counts, whole groups and a rest of rows: each row must come back
        // as it was, and the packing must be a permutation (no two bytes to one place).
        for q in QuantType::ALL.into_iter().filter(|q| has_layout(q.dtype())) {
            let dt = q.dtype();
            for (rows, blocks) in [(16, 2), (16, 3), (35, 1), (48, 4), (7, 2)] {
                let rb = blocks * dt.block_bytes();
                let data: Vec<u8> = (0..rows * rb).map(|i| (i * 7919 % 251) as u8).collect();
                let packed = pack(&ThreadPool::new(2), dt, rows, blocks * dt.block_len(), &data).unwrap();
                assert_eq!(packed.len(), data.len());
                assert_eq!(packed.as_ptr() as usize % 64, 0, "the packed bytes start on a cache line");
                let mut row = vec![0u8; rb];
                for r in 0..rows {
                    unpack_row(dt, &packed, rb, r, &mut row);
                    assert_eq!(row, data[r * rb..(r + 1) * rb], "{q:?}: {rows} rows of {blocks} blocks: row {r}");
                }
                let mut hit = vec![false; 16 * rb];
                for i in 0..16 {
                    for b in 0..blocks {
                        for j in 0..dt.block_bytes() {
                            let at = place(q, blocks, i, b, j);
                            assert!(!std::mem::replace(&mut hit[at], true), "{q:?}: byte {at} taken twice");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_fifth_bits_are_a_permutation() {
        let mut seen = 0u32;
        for e in 0..32 {
            seen |= 1 << fifth_bit_at(e);
        }
        assert_eq!(seen, u32::MAX);
    }

    #[test]
    fn float_weights_and_short_data_are_not_packed() {
        let pool = ThreadPool::new(1);
        assert!(pack(&pool, DType::F16, 16, 32, &[0; 1024]).is_none());
        assert!(pack(&pool, QuantType::Q8_0.dtype(), 16, 32, &[0; 16 * 33]).is_none(), "too few bytes");
    }
}
