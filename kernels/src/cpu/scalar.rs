//! Scalar reference kernels: the numerical definition every fast path is tested against.
//! Written for clarity, not speed; integer sums are exact so SIMD versions can match them closely.

use super::{Ahead, KeysT};
use crate::group;
use crate::quant::{read_bf16, read_f16, read_f32, BlockQ8, QuantType, QK};
use half::f16;

pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK);
    for (chunk, blk) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in blk.qs.iter_mut().zip(chunk) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        blk.d = d;
        blk.s = d * sum as f32;
    }
}

/// `Σ_j q4[j] * a[j]` over one block, with nibbles unpacked as the format says.
fn nibble_dot(qs: &[u8], a: &[i8; QK]) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += i32::from(qs[j] & 0xf) * i32::from(a[j]);
        s += i32::from(qs[j] >> 4) * i32::from(a[j + 16]);
    }
    s
}

pub fn dot_q4_0(w: &[u8], a: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (i, ab) in a.iter().enumerate() {
        let blk = &w[i * 18..i * 18 + 18];
        let d = read_f16(blk, 0);
        // weight = d * (q - 8): the offset folds into the activation block sum.
        acc += d * (ab.d * nibble_dot(&blk[2..18], &ab.qs) as f32) - 8.0 * d * ab.s;
    }
    acc
}

pub fn dot_q4_1(w: &[u8], a: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (i, ab) in a.iter().enumerate() {
        let blk = &w[i * 20..i * 20 + 20];
        let d = read_f16(blk, 0);
        let m = read_f16(blk, 2);
        acc += d * (ab.d * nibble_dot(&blk[4..20], &ab.qs) as f32) + m * ab.s;
    }
    acc
}

pub fn dot_q8_0(w: &[u8], a: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (i, ab) in a.iter().enumerate() {
        let blk = &w[i * 34..i * 34 + 34];
        let d = read_f16(blk, 0);
        let s: i32 = (0..QK).map(|j| i32::from(blk[2 + j] as i8) * i32::from(ab.qs[j])).sum();
        acc += d * (ab.d * s as f32);
    }
    acc
}

/// Any quantized type through its decoded groups ([`group::decode`]): per group the exact
/// integer sums `Σ sc q a` and `Σ m a`, then `(d_a d) Σ sc q a + (d_a dmin) Σ m a`.
pub fn dot_group(q: QuantType, w: &[u8], a: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (g, ab) in a.iter().enumerate() {
        let gr = group::decode(q, w, g);
        let (mut isum, mut msum) = (0i32, 0i32);
        for h in 0..2 {
            let range = 16 * h..16 * h + 16;
            let qa: i32 = range.clone().map(|i| i32::from(gr.q[i]) * i32::from(ab.qs[i])).sum();
            let sa: i32 = range.map(|i| i32::from(ab.qs[i])).sum();
            isum += gr.sc[h] * qa;
            msum += gr.m[h] * sa;
        }
        acc += (ab.d * gr.d) * isum as f32;
        if gr.has_min {
            acc += (ab.d * gr.dmin) * msum as f32;
        }
    }
    acc
}

/// The scalar products of `q`: the legacy formats' own, every other through [`dot_group`].
pub fn quant_dots(q: QuantType) -> super::QuantDots {
    macro_rules! grouped {
        ($q:expr) => {
            super::QuantDots { one: |w, a| dot_group($q, w, a), four: |w, a| a.map(|a| dot_group($q, w, a)) }
        };
    }
    match q {
        QuantType::Q4_0 => super::QuantDots { one: dot_q4_0, four: |w, a| a.map(|a| dot_q4_0(w, a)) },
        QuantType::Q4_1 => super::QuantDots { one: dot_q4_1, four: |w, a| a.map(|a| dot_q4_1(w, a)) },
        QuantType::Q8_0 => super::QuantDots { one: dot_q8_0, four: |w, a| a.map(|a| dot_q8_0(w, a)) },
        QuantType::Q5_0 => grouped!(QuantType::Q5_0),
        QuantType::Q5_1 => grouped!(QuantType::Q5_1),
        QuantType::Q2K => grouped!(QuantType::Q2K),
        QuantType::Q3K => grouped!(QuantType::Q3K),
        QuantType::Q4K => grouped!(QuantType::Q4K),
        QuantType::Q5K => grouped!(QuantType::Q5K),
        QuantType::Q6K => grouped!(QuantType::Q6K),
        QuantType::IQ4NL => grouped!(QuantType::IQ4NL),
        QuantType::IQ4XS => grouped!(QuantType::IQ4XS),
        QuantType::MXFP4 => grouped!(QuantType::MXFP4),
    }
}

pub fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    x.iter().enumerate().map(|(i, v)| read_f32(w, 4 * i) * v).sum()
}

pub fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    x.iter().enumerate().map(|(i, v)| read_f16(w, 2 * i) * v).sum()
}

pub fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    x.iter().enumerate().map(|(i, v)| read_bf16(w, 2 * i) * v).sum()
}

pub fn dot_f16_f32(k: &[f16], q: &[f32]) -> f32 {
    k.iter().zip(q).map(|(a, b)| a.to_f32() * b).sum()
}

pub fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi.to_f32();
    }
}

pub fn attn_scores(k: KeysT<'_>, qt: &[f32], g: usize, scale: f32, out: &mut [f32], stride: usize, _: &[Ahead]) {
    assert!(k.fit(qt, g, out, stride), "scores: shapes");
    for j in 0..g {
        for i in 0..k.n {
            out[j * stride + i] = scale * (0..k.hd).map(|d| k.k[d * k.bs + i].to_f32() * qt[d * g + j]).sum::<f32>();
        }
    }
}

pub fn attn_values(v: &[f16], p: &[f32], stride: usize, hd: usize, g: usize, out: &mut [f32]) {
    let n = v.len() / hd;
    for i in 0..n {
        for j in 0..g {
            axpy_f16(p[j * stride + i], &v[i * hd..(i + 1) * hd], &mut out[j * hd..(j + 1) * hd]);
        }
    }
}

pub fn exp(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = v.exp());
}

pub fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    x.iter_mut().fold(0.0, |s, v| {
        *v = (*v - shift).exp();
        s + *v
    })
}

/// The bf16 tile product; see [`super::Bf16Kernels::tile`]. Each output's pairs summed in
/// order in f32 (a bf16 product is exact in f32), then added to `c` where `t.add`.
pub fn tile(t: super::Tile<'_>, c: &mut [f32], ldc: usize) {
    assert!(t.fits(c.len(), ldc), "tile operands out of bounds");
    let half = |v: u32, h: usize| half::bf16::from_bits((v >> (16 * h)) as u16).to_f32();
    // Value h of token i's pair p, in either of the tokens' forms.
    let x = |i: usize, p: usize, h: usize| match t.words {
        1 => half(t.a[i * t.lda + p], h),
        _ => f32::from_bits(t.a[i * t.lda + 2 * p + h]),
    };
    for i in 0..t.rows {
        for j in 0..t.lanes {
            let mut sum = 0f32;
            for p in 0..t.kc {
                let w = t.b[p * super::PANEL + j];
                sum += x(i, p, 0) * half(w, 0) + x(i, p, 1) * half(w, 1);
            }
            let out = &mut c[i * ldc + j];
            *out = if t.add { *out + sum } else { sum };
        }
    }
}

/// `out[i] = bf16(x[2i]) | bf16(x[2i + 1]) << 16`, rounded to nearest even; an odd last
/// element's pair has a zero high half.
pub fn to_bf16(x: &[f32], out: &mut [u32]) {
    assert_eq!(out.len(), x.len().div_ceil(2), "one pair per two inputs");
    let b = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
    for (o, p) in out.iter_mut().zip(x.chunks(2)) {
        *o = b(p[0]) | p.get(1).map_or(0, |&v| b(v) << 16);
    }
}

/// The exponentials `exp(scale * (s - max))` of a row of scores as bf16 pairs, and their sum.
pub fn softmax_bf16(s: &[f32], scale: f32, out: &mut [u32]) -> f32 {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    softmax_tail(s, max, scale, out, 1)
}

/// [`softmax_bf16`] for a row whose maximum is known (`max`; the vector kernels' tail), into
/// `words` words a pair (see [`super::Bf16Kernels::words`]).
pub fn softmax_tail(s: &[f32], max: f32, scale: f32, out: &mut [u32], words: usize) -> f32 {
    let e: Vec<f32> = s.iter().map(|&v| ((v - max) * scale).exp()).collect();
    if words == 1 {
        to_bf16(&e, out)
    } else {
        to_bf16_words(&e, out)
    }
    e.iter().sum()
}

/// Each value rounded to bf16 (as [`to_bf16`]) and kept as an f32: `out[i] = bf16(x[i]) << 16`,
/// `out` of even length (an odd last value's partner zero): the tokens' form of a table whose
/// pairs are two words.
pub fn to_bf16_words(x: &[f32], out: &mut [u32]) {
    assert_eq!(out.len(), x.len().div_ceil(2) * 2, "two words per two inputs");
    let b = |v: f32| u32::from(half::bf16::from_f32(v).to_bits()) << 16;
    out.iter_mut().zip(x.iter().map(|&v| b(v)).chain([0])).for_each(|(o, v)| *o = v);
}
