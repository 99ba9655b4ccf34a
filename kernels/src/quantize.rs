//! Writing quantized blocks: test models and round trips, and a draft model's cheaper copy of
//! its output projection ([`requantize`]); never a served model's own weights.
//!
//! A block is first chosen as integers in the form of [`crate::group::Group`] (`q`, per-16 or
//! per-32 scales `sc` and mins `m`, block factors `d` and `dmin`), then packed into the format's
//! bytes, the inverse of [`crate::group::decode`].

use crate::quant::{e8m0_half, DType, FloatType, QuantType, WeightClass, IQ4_VALUES, MXFP4_VALUES, QK, QK_K};
use half::{bf16, f16};

/// Quantizes a row of floats into `dtype` (used to write test models): the legacy formats with
/// the nearest-value rounding of llama.cpp's reference quantizers, the others with [`block`]'s
/// plain max-based scales (a simpler search than llama.cpp's, so not its bytes).
pub fn quantize_row(dtype: DType, src: &[f32], out: &mut Vec<u8>) {
    match dtype.class() {
        WeightClass::Float(FloatType::F32) => src.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        WeightClass::Float(FloatType::F16) => {
            src.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes()))
        }
        WeightClass::Float(FloatType::BF16) => {
            src.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes()))
        }
        WeightClass::Quantized(QuantType::Q8_0) => {
            for chunk in src.chunks(QK) {
                let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(chunk.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        WeightClass::Quantized(QuantType::Q4_0) => {
            for chunk in src.chunks(QK) {
                let max = chunk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(chunk[j]) | (q(chunk[j + 16]) << 4)));
            }
        }
        WeightClass::Quantized(QuantType::Q4_1) => {
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
        WeightClass::Quantized(q) => {
            src.chunks(q.block_len()).for_each(|chunk| out.extend_from_slice(&block(q, chunk)))
        }
    }
}

/// `rows` rows of `cols` weights in `from` (`data`, rows back to back) requantized to `to`
/// ([`quantize_row`]'s rounding), row by row on `pool`'s threads: a draft model's output
/// projection in fewer bits, read in full at every drafted token.
pub fn requantize(
    pool: &crate::pool::ThreadPool,
    from: DType,
    rows: usize,
    cols: usize,
    data: &[u8],
    to: DType,
) -> Option<Vec<u8>> {
    let (rb, out_rb) = (from.bytes_for(cols)?, to.bytes_for(cols)?);
    if data.len() < rows.checked_mul(rb)? {
        return None;
    }
    let per_task = rows.div_ceil(4 * pool.threads()).max(1);
    let parts: Vec<std::sync::Mutex<Vec<u8>>> =
        (0..rows.div_ceil(per_task)).map(|_| std::sync::Mutex::new(Vec::new())).collect();
    pool.run(parts.len(), &|t| {
        let mut out = parts[t].lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (r0, r1) = (t * per_task, ((t + 1) * per_task).min(rows));
        out.reserve((r1 - r0) * out_rb);
        let mut row = vec![0.0; cols];
        for r in r0..r1 {
            crate::quant::dequantize_row(from, &data[r * rb..(r + 1) * rb], &mut row);
            quantize_row(to, &row, &mut out);
        }
    });
    let mut out = Vec::with_capacity(rows * out_rb);
    for p in parts {
        out.extend(p.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner));
    }
    Some(out)
}

/// The element of largest magnitude (its sign kept).
fn signed_max(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a })
}

fn inv(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// The code-book entry nearest `v`.
fn iq4_index(v: f32) -> u8 {
    let dist = |i: usize| (f32::from(IQ4_VALUES[i]) - v).abs();
    (0..16).min_by(|&a, &b| dist(a).total_cmp(&dist(b))).unwrap_or(0) as u8
}

/// Scales of the sub-blocks quantized to integers in `lo..=hi` against one block factor (a
/// K-quant's 6-, 4- or 8-bit sub-block scales): `(d, sc)` with `scale[j] ≈ d * sc[j]`.
fn quantize_scales(scales: &[f32], lo: i32, hi: i32) -> (f32, Vec<i32>) {
    let m = signed_max(scales);
    // Signed scales put the largest at the end of the range with the most room.
    let d = m / hi as f32;
    let id = inv(d);
    (d, scales.iter().map(|s| ((s * id).round() as i32).clamp(lo, hi)).collect())
}

/// One block of `x` (`q.block_len()` weights) in format `q`.
fn block(q: QuantType, x: &[f32]) -> Vec<u8> {
    let f16b = |v: f32| f16::from_f32(v).to_le_bytes();
    let mut out = Vec::with_capacity(q.block_bytes());
    // Nibbles of 32 weights: byte k holds weights k and k + 16.
    let nibbles = |v: &[u8]| (0..16).map(|k| (v[k] & 0xf) | (v[k + 16] << 4)).collect::<Vec<u8>>();
    match q {
        QuantType::Q5_0 => {
            let d = signed_max(x) / -16.0;
            let id = inv(d);
            let v: Vec<u8> = x.iter().map(|w| ((w * id + 16.5) as i32).clamp(0, 31) as u8).collect();
            let high = (0..32).fold(0u32, |h, i| h | (u32::from(v[i] >> 4) << i));
            out.extend(f16b(d));
            out.extend(high.to_le_bytes());
            out.extend(nibbles(&v));
        }
        QuantType::Q5_1 => {
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (max - min) / 31.0;
            let id = inv(d);
            let v: Vec<u8> = x.iter().map(|w| (((w - min) * id + 0.5) as i32).clamp(0, 31) as u8).collect();
            let high = (0..32).fold(0u32, |h, i| h | (u32::from(v[i] >> 4) << i));
            out.extend(f16b(d));
            out.extend(f16b(min));
            out.extend(high.to_le_bytes());
            out.extend(nibbles(&v));
        }
        QuantType::IQ4NL => {
            let d = signed_max(x) / -127.0;
            let id = inv(d);
            let v: Vec<u8> = x.iter().map(|w| iq4_index(w * id)).collect();
            out.extend(f16b(d));
            out.extend(nibbles(&v));
        }
        QuantType::MXFP4 => {
            // As GGML: the exponent puts the largest magnitude near the code book's top (6).
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let e = if amax > 0.0 { (amax.log2().floor() as i32 - 2 + 127).clamp(0, 255) as u8 } else { 0 };
            let id = inv(e8m0_half(e));
            let v: Vec<u8> = x
                .iter()
                .map(|w| {
                    let dist = |i: usize| (f32::from(MXFP4_VALUES[i]) - w * id).abs();
                    (0..16).min_by(|&a, &b| dist(a).total_cmp(&dist(b))).unwrap_or(0) as u8
                })
                .collect();
            out.push(e);
            out.extend(nibbles(&v));
        }
        QuantType::IQ4XS => {
            let scales: Vec<f32> = x.chunks(QK).map(|g| signed_max(g) / -127.0).collect();
            let (d, ls) = quantize_scales(&scales, -32, 31);
            let (dr, mut high, mut low) = (f16::from_f32(d).to_f32(), 0u16, [0u8; 4]);
            let mut qs = Vec::new();
            for (j, g) in x.chunks(QK).enumerate() {
                let u = (ls[j] + 32) as u8;
                low[j / 2] |= (u & 0xf) << (4 * (j % 2));
                high |= u16::from(u >> 4) << (2 * j);
                let id = inv(dr * ls[j] as f32);
                qs.extend(nibbles(&g.iter().map(|w| iq4_index(w * id)).collect::<Vec<_>>()));
            }
            out.extend(f16b(d));
            out.extend(high.to_le_bytes());
            out.extend(low);
            out.extend(qs);
        }
        QuantType::Q4K | QuantType::Q5K => {
            let top = if q == QuantType::Q4K { 15.0 } else { 31.0 };
            let mins: Vec<f32> = x.chunks(QK).map(|g| -g.iter().copied().fold(0f32, f32::min)).collect();
            let scales: Vec<f32> =
                x.chunks(QK).zip(&mins).map(|(g, m)| (g.iter().copied().fold(0f32, f32::max) + m) / top).collect();
            let (d, sc) = quantize_scales(&scales, 0, 63);
            let (dmin, m) = quantize_scales(&mins, 0, 63);
            let (dr, mr) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
            let v: Vec<u8> = x
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let j = i / QK;
                    (((w + mr * m[j] as f32) * inv(dr * sc[j] as f32)).round() as i32).clamp(0, top as i32) as u8
                })
                .collect();
            let mut packed = [0u8; 12];
            for j in 0..8 {
                let (s, n) = (sc[j] as u8, m[j] as u8);
                if j < 4 {
                    packed[j] = s;
                    packed[j + 4] = n;
                } else {
                    packed[j + 4] = (s & 0xf) | ((n & 0xf) << 4);
                    packed[j - 4] |= (s >> 4) << 6;
                    packed[j] |= (n >> 4) << 6;
                }
            }
            out.extend(f16b(d));
            out.extend(f16b(dmin));
            out.extend(packed);
            if q == QuantType::Q5K {
                out.extend((0..32).map(|l| (0..8).fold(0u8, |h, j| h | ((v[32 * j + l] >> 4) << j))));
            }
            // Weight 64 c + 32 h + l in nibble h of byte 32 c + l.
            out.extend((0..128).map(|k| {
                let (c, l) = (k / 32, k % 32);
                (v[64 * c + l] & 0xf) | ((v[64 * c + 32 + l] & 0xf) << 4)
            }));
        }
        QuantType::Q6K => {
            let scales: Vec<f32> = x.chunks(16).map(|g| signed_max(g) / -32.0).collect();
            let (d, sc) = quantize_scales(&scales, -128, 127);
            let dr = f16::from_f32(d).to_f32();
            let v: Vec<u8> = x
                .iter()
                .enumerate()
                .map(|(i, w)| ((w * inv(dr * sc[i / 16] as f32)).round() as i32 + 32).clamp(0, 63) as u8)
                .collect();
            // Weight 128 h + 32 s + l: low bits in nibble s / 2 of ql[64 h + 32 (s % 2) + l],
            // high bits at 2 s in qh[32 h + l].
            let mut ql = [0u8; QK_K / 2];
            let mut qh = [0u8; QK_K / 4];
            for (e, &u) in v.iter().enumerate() {
                let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
                ql[64 * h + 32 * (s % 2) + l] |= (u & 0xf) << (4 * (s / 2));
                qh[32 * h + l] |= (u >> 4) << (2 * s);
            }
            out.extend(ql);
            out.extend(qh);
            out.extend(sc.iter().map(|&s| s as i8 as u8));
            out.extend(f16b(d));
        }
        QuantType::Q3K => {
            let scales: Vec<f32> = x.chunks(16).map(|g| signed_max(g) / -4.0).collect();
            let (d, sc) = quantize_scales(&scales, -32, 31);
            let dr = f16::from_f32(d).to_f32();
            let mut hmask = [0u8; QK_K / 8];
            let mut qs = [0u8; QK_K / 4];
            for (e, w) in x.iter().enumerate() {
                let v = ((w * inv(dr * sc[e / 16] as f32)).round() as i32).clamp(-4, 3);
                let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
                let low = if v >= 0 {
                    hmask[l] |= 1 << (e / 32);
                    v
                } else {
                    v + 4
                };
                qs[32 * h + l] |= (low as u8) << (2 * s);
            }
            let mut packed = [0u8; 12];
            for (j, &s) in sc.iter().enumerate() {
                let u = (s + 32) as u8;
                packed[j % 8] |= (u & 0xf) << (4 * (j / 8));
                packed[8 + j % 4] |= (u >> 4) << (2 * (j / 4));
            }
            out.extend(hmask);
            out.extend(qs);
            out.extend(packed);
            out.extend(f16b(d));
        }
        QuantType::Q2K => {
            let mins: Vec<f32> = x.chunks(16).map(|g| -g.iter().copied().fold(0f32, f32::min)).collect();
            let scales: Vec<f32> =
                x.chunks(16).zip(&mins).map(|(g, m)| (g.iter().copied().fold(0f32, f32::max) + m) / 3.0).collect();
            let (d, sc) = quantize_scales(&scales, 0, 15);
            let (dmin, m) = quantize_scales(&mins, 0, 15);
            let (dr, mr) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
            let mut qs = [0u8; QK_K / 4];
            for (e, w) in x.iter().enumerate() {
                let j = e / 16;
                let v = (((w + mr * m[j] as f32) * inv(dr * sc[j] as f32)).round() as i32).clamp(0, 3) as u8;
                let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
                qs[32 * h + l] |= v << (2 * s);
            }
            out.extend((0..16).map(|j| (sc[j] as u8) | ((m[j] as u8) << 4)));
            out.extend(qs);
            out.extend(f16b(d));
            out.extend(f16b(dmin));
        }
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 => unreachable!("the legacy formats are quantized above"),
    }
    debug_assert_eq!(out.len(), q.block_bytes());
    out
}

/// `blocks` blocks of `q` with random bits and random finite scales in `[-1, 1]` (for tests of
/// the decoders and kernels: every bit pattern a file may hold, not only what a quantizer writes).
pub fn random_blocks(q: QuantType, blocks: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        // xorshift64*
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let bb = q.block_bytes();
    let mut out: Vec<u8> = (0..blocks * bb).map(|_| (next() >> 32) as u8).collect();
    // The f16 fields: d, and the min or dmin where the format has one.
    let halves: &[usize] = match q {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 | QuantType::IQ4NL | QuantType::IQ4XS => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => &[0, 2],
        QuantType::Q2K => &[80, 82],
        QuantType::Q3K => &[108],
        QuantType::Q6K => &[208],
        QuantType::MXFP4 => &[],
    };
    for b in 0..blocks {
        for &at in halves {
            let v = ((next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            out[b * bb + at..b * bb + at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        if q == QuantType::MXFP4 {
            // An exponent of 2^-10 .. 2^9 (the whole byte range would overflow the products).
            out[b * bb] = 118 + (next() >> 32) as u8 % 20;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;

    #[test]
    fn requantized_rows_are_each_row_requantized_in_order() {
        // 37 rows over 2 threads: tasks of uneven lengths, joined back in row order.
        let (rows, cols) = (37, 96);
        let from = DType::Q8_0;
        let data = random_blocks(QuantType::Q8_0, rows * cols / QK, 5);
        let to = DType::Q4_0;
        let got = requantize(&crate::pool::ThreadPool::new(2), from, rows, cols, &data, to).unwrap();
        let rb = from.bytes_for(cols).unwrap();
        let mut want = Vec::new();
        let mut row = vec![0.0; cols];
        for r in 0..rows {
            dequantize_row(from, &data[r * rb..(r + 1) * rb], &mut row);
            quantize_row(to, &row, &mut want);
        }
        assert_eq!(got.len(), rows * to.bytes_for(cols).unwrap());
        assert_eq!(got, want);
        // Within Q4_0's step of the original weights.
        let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
        let orb = to.bytes_for(cols).unwrap();
        for r in 0..rows {
            dequantize_row(from, &data[r * rb..(r + 1) * rb], &mut a);
            dequantize_row(to, &got[r * orb..(r + 1) * orb], &mut b);
            for (c, (x, y)) in a.chunks(QK).zip(b.chunks(QK)).enumerate() {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let worst = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(worst <= amax / 8.0 * 1.01, "row {r} block {c}: {worst} against {amax}");
            }
        }
        assert!(requantize(&crate::pool::ThreadPool::new(1), from, rows + 1, cols, &data, to).is_none());
    }
}
