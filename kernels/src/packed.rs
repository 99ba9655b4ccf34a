//! Activations repacked for the AVX-512 VNNI matrix kernel: 16 tokens side by side.
//!
//! `vpdpbusd` multiplies 4 unsigned bytes by 4 signed bytes in each of 16 lanes. Making the
//! lanes tokens (the weight bytes broadcast, the activation bytes of 16 tokens in the lanes)
//! computes one weight row against 16 tokens with 8 instructions per 32-weight block. The layout
//! per block `b`: `qs[((b * 8 + j) * 16 + lane) * 4 + e]` holds element `4j + e` of token `lane`;
//! `d`, `s` and `isum` hold the block's scale, scaled sum and integer sum per lane, `isum_lo`
//! the integer sum of its first 16 elements (for formats with a scale per 16 weights). Lanes
//! past the group's tokens are zero.

use crate::quant::{BlockQ8, QK};

/// Tokens per group.
pub const LANES: usize = 16;

/// One group of up to [`LANES`] tokens' quantized activations; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct Packed16 {
    pub blocks: usize,
    pub tokens: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub isum: Vec<i32>,
    pub isum_lo: Vec<i32>,
}

impl Packed16 {
    /// Packs up to 16 rows of `blocks` activation blocks each.
    pub fn pack(rows: &[&[BlockQ8]]) -> Packed16 {
        assert!(!rows.is_empty() && rows.len() <= LANES, "1..=16 tokens per group");
        let blocks = rows[0].len();
        let mut p = Packed16 {
            blocks,
            tokens: rows.len(),
            qs: vec![0; blocks * QK * LANES],
            d: vec![0.0; blocks * LANES],
            s: vec![0.0; blocks * LANES],
            isum: vec![0; blocks * LANES],
            isum_lo: vec![0; blocks * LANES],
        };
        for (lane, row) in rows.iter().enumerate() {
            assert_eq!(row.len(), blocks, "every row has the same length");
            for (b, blk) in row.iter().enumerate() {
                for (j, four) in blk.qs.chunks_exact(4).enumerate() {
                    let at = ((b * 8 + j) * LANES + lane) * 4;
                    p.qs[at..at + 4].copy_from_slice(four);
                }
                p.d[b * LANES + lane] = blk.d;
                p.s[b * LANES + lane] = blk.s;
                p.isum[b * LANES + lane] = blk.qs.iter().map(|&q| i32::from(q)).sum();
                p.isum_lo[b * LANES + lane] = blk.qs[..QK / 2].iter().map(|&q| i32::from(q)).sum();
            }
        }
        p
    }
}
