//! CPU kernels, chosen once per process by instruction set.
//!
//! [`Kernels::detect`] returns a table of function pointers: the AVX2+FMA+F16C versions when the
//! processor has them, the scalar reference otherwise. The scalar versions in [`scalar`] are the
//! numerical reference: every fast path is property-tested against them (see `tests` below).
//! `INFERD_ISA=scalar` forces the reference (useful to bisect a numerical difference),
//! `INFERD_ISA=avx2` the AVX2 table on an AVX-512 machine.

use crate::quant::{BlockQ8, FloatType, QuantType, QK};

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_attn;
#[cfg(target_arch = "x86_64")]
mod avx2_bf16;
#[cfg(target_arch = "x86_64")]
mod avx2_group;
#[cfg(target_arch = "x86_64")]
mod avx2_packed;
#[cfg(target_arch = "x86_64")]
mod avx2_super;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_attn;
#[cfg(target_arch = "x86_64")]
mod avx512_bf16;
#[cfg(target_arch = "x86_64")]
mod avx512_gemv;
#[cfg(target_arch = "x86_64")]
mod avx512_packed;
#[cfg(target_arch = "x86_64")]
mod avx512_super;
#[cfg(target_arch = "x86_64")]
mod lane;
pub mod scalar;

/// The instruction set a kernel table was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    /// AVX-512 (F, BW, VL) with VNNI, on top of AVX2.
    Avx512Vnni,
}

/// Quantized-weight dot product: one weight row (raw block bytes) against one activation row.
pub type DotQ8 = fn(&[u8], &[BlockQ8]) -> f32;
/// The same against four activation rows at once (weights unpacked once, used four times).
pub type DotQ8x4 = fn(&[u8], [&[BlockQ8]; 4]) -> [f32; 4];
/// Float-weight dot product: one weight row (raw little-endian bytes) against f32 activations.
pub type DotF = fn(&[u8], &[f32]) -> f32;
/// The same against four activation rows.
pub type DotFx4 = fn(&[u8], [&[f32]; 4]) -> [f32; 4];

/// The products of one quantized weight type.
#[derive(Clone, Copy)]
pub struct QuantDots {
    /// One weight row against one token.
    pub one: DotQ8,
    /// One weight row against four tokens, each result equal to [`QuantDots::one`]'s bit for bit.
    pub four: DotQ8x4,
}

/// The kernel table for one instruction set.
#[derive(Clone, Copy)]
pub struct Kernels {
    pub isa: Isa,
    /// Quantizes f32 activations (`x.len() == 32 * out.len()`) to 8-bit blocks.
    pub quantize_q8: fn(&[f32], &mut [BlockQ8]),
    /// The products of each quantized type, indexed by [`QuantType::index`].
    pub quant: [QuantDots; QuantType::COUNT],
    pub dot_f32: DotF,
    pub dot_f16: DotF,
    pub dot_bf16: DotF,
    /// One f16 / bf16 weight row against four activation rows, each token's result equal to
    /// the single-token dot bit for bit (weights converted once for the four).
    pub dot_f16_x4: DotFx4,
    pub dot_bf16_x4: DotFx4,
    /// `Σ k[i] * q[i]` with `k` stored as f16 (attention scores against the K cache).
    pub dot_f16_f32: fn(&[half::f16], &[f32]) -> f32,
    /// `y += a * x` with `x` stored as f16 (attention-weighted sum of the V cache).
    pub axpy_f16: fn(f32, &[half::f16], &mut [f32]),
    /// Attention scores of `g` query heads against the keys of one KV head in one block,
    /// stored transposed ([`KeysT`]): `out[j * stride + i] = scale * k(i) · q[j]`, the queries
    /// given transposed too (`qt[d * g + j]` is element `d` of head `j`'s), while the lines of
    /// `ahead` (the next block's keys, this block's values) are fetched a part at a time
    /// between the products.
    pub attn_scores: AttnScores,
    /// Attention-weighted values: `out[j] += Σ_i p[j * stride + i] * v[i]` (`v`: `n × hd`
    /// f16, `out`: `g × hd`), in key order.
    pub attn_values: AttnValues,
    /// `x[i] = exp(x[i])` (softmax and SiLU; the AVX2 version is a polynomial within 2e-7
    /// relative error of `f32::exp`).
    pub exp: fn(&mut [f32]),
    /// `x[i] = exp(x[i] - shift)`, returning their sum: a softmax row's exponentials and
    /// denominator in one pass (attention's weights, `shift` the row's maximum).
    pub exp_sum: fn(&mut [f32], f32) -> f32,
    /// `gate = gelu(gate) * up` with GELU's tanh approximation, in place (Gemma's feed-forward;
    /// the reference is [`crate::ops::geglu`], the AVX2 version `x · σ(2y)` through the vector
    /// `exp`).
    pub geglu: fn(&mut [f32], &[f32]),
    /// `gate = silu(gate) * up`, in place (Llama's, Qwen's, Phi's and Mistral's feed-forward;
    /// the reference is [`crate::ops::swiglu`], the AVX2 version through the vector `exp`).
    pub swiglu: fn(&mut [f32], &[f32]),
    /// Sixteen consecutive quantized weight rows (`rb` bytes each) against 1 to
    /// [`GEMV_TOKENS`] tokens, each row's blocks unpacked once for all of them, when the ISA has
    /// a kernel for it; `out[t][i]` equals the single-token dot of row `i` with token `t` bit
    /// for bit.
    pub gemv16: Option<Gemv16>,
    /// [`Kernels::gemv16`] on a group of 16 rows in the packed layout ([`crate::pack`]), for
    /// every quantized type; the same results bit for bit.
    pub gemv16_packed: Option<Gemv16>,
    /// Products of many tokens in bf16 ([`crate::gemm`]): AVX-512 BF16's pair products, or
    /// AVX2's FMA on the pairs widened to f32; the references are in [`scalar`].
    pub bf16: Option<Bf16Kernels>,
}

/// The kernels of [`crate::gemm`]'s bf16 products.
#[derive(Clone, Copy)]
pub struct Bf16Kernels {
    /// `c[i * ldc + j] (+)= Σ_p a(i, p) · b(p, j)` for the tile's tokens `i` and its first
    /// `lanes` outputs `j`, over bf16 pairs `p` (see [`Tile`]); other outputs untouched.
    pub tile: fn(Tile<'_>, &mut [f32], usize),
    /// f32 rounded to bf16 pairs, the weights' form in their panels: `out[i] = bf16(x[2i]) |
    /// bf16(x[2i + 1]) << 16` (round to nearest even; an odd last element's pair has a zero
    /// high half).
    pub to_bf16: fn(&[f32], &mut [u32]),
    /// Words per pair in the tokens' rows the tile reads: 1 where a pair is one word (as
    /// `to_bf16` writes it: a bf16 product takes it whole), 2 where each of its values is
    /// rounded to bf16 and kept as an f32 (the tile broadcasts it to FMA without unpacking).
    pub words: usize,
    /// A token's row of f32 in that form: `x.len().div_ceil(2) * words` words, an odd last
    /// element's partner zero. The values are those of `to_bf16`.
    pub to_tokens: fn(&[f32], &mut [u32]),
    /// A row of attention scores `s` to its unnormalized softmax: `exp(scale * (s - max))`
    /// rounded to bf16 in the tokens' form into `out` (as `to_tokens`), returning the sum of
    /// the f32 exponentials.
    pub softmax: fn(&[f32], f32, &mut [u32]) -> f32,
}

/// Outputs per panel of packed weights, the width of a [`Tile`].
pub const PANEL: usize = 32;
/// The most tokens one [`Tile`] holds.
pub const TILE_TOKENS: usize = 12;

/// One register tile of a bf16 product: `rows` tokens' pairs in their table's form (token
/// `i`'s pair `p` at `a[i * lda + p * words..][..words]`, see [`Bf16Kernels::words`]) against
/// one panel of weights (`b[p * PANEL + j]`: pair `p` of output `j`), `kc` pairs long; `lanes`
/// of the panel's outputs are stored; `add`: added to the outputs rather than written over
/// them.
#[derive(Clone, Copy, Debug)]
pub struct Tile<'a> {
    pub a: &'a [u32],
    pub lda: usize,
    pub words: usize,
    pub rows: usize,
    pub b: &'a [u32],
    pub kc: usize,
    pub lanes: usize,
    pub add: bool,
}

impl Tile<'_> {
    /// Whether every read and write of the tile lies in its operands, with outputs `c_len`
    /// long at `ldc` apart.
    pub fn fits(&self, c_len: usize, ldc: usize) -> bool {
        let shape = (1..=TILE_TOKENS).contains(&self.rows) && (1..=PANEL).contains(&self.lanes);
        let row = self.kc * self.words;
        shape
            && matches!(self.words, 1 | 2)
            && self.lda >= row
            && self.a.len() >= (self.rows - 1) * self.lda + row
            && self.b.len() >= self.kc * PANEL
            && ldc >= self.lanes
            && c_len >= (self.rows - 1) * ldc + self.lanes
    }
}

/// See [`Kernels::gemv16`]: `(type, rows, rb, tokens' activations, out)`, one output per token.
pub type Gemv16 = fn(QuantType, &[u8], usize, &[Acts<'_>], &mut [[f32; 16]]);

/// The most tokens one [`Kernels::gemv16`] call takes.
pub const GEMV_TOKENS: usize = 16;

/// Lines (of 64 bytes, from a pointer) to fetch into L2 ahead of their use.
pub type Ahead = (*const u8, std::ops::Range<usize>);

/// The keys `0..n` of one KV head in one block of the K cache, which stores each block's keys
/// transposed (dimension-major, see [`crate::attention`]): dimension `d` of key `i` is
/// `k[d * bs + i]`, for `d < hd`. Sixteen keys' dimension `d` are then one vector, so a
/// kernel scores 16 keys in 16 lanes with no horizontal sums.
#[derive(Clone, Copy, Debug)]
pub struct KeysT<'a> {
    pub k: &'a [half::f16],
    /// Halves from one dimension's keys to the next's: the block size.
    pub bs: usize,
    pub n: usize,
    pub hd: usize,
}

impl KeysT<'_> {
    /// Whether a score kernel's operands fit these keys ([`Kernels::attn_scores`]): `k` holds
    /// every element the keys name (no more keys than a block has), `qt` `g` transposed
    /// queries of `hd`, and `out` `g` rows of `stride >= n` scores.
    pub fn fit(&self, qt: &[f32], g: usize, out: &[f32], stride: usize) -> bool {
        let keys = self.n == 0 || self.hd == 0 || (self.hd - 1) * self.bs + self.n <= self.k.len();
        let rows = g.checked_sub(1).map_or(0, |r| r * stride + self.n);
        self.n <= self.bs && keys && qt.len() >= g * self.hd && stride >= self.n && out.len() >= rows
    }
}

/// Part `i` of `parts` of the lines of `ahead`, fetched into L2 (`parts` 1: all of them): the
/// packed kernels' next group of rows, attention's next K/V block. Does nothing off x86-64.
#[inline]
pub(crate) fn prefetch((from, lines): &Ahead, i: usize, parts: usize) {
    let n = lines.len();
    #[cfg(target_arch = "x86_64")]
    for l in lines.start + i * n / parts..lines.start + (i + 1) * n / parts {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: SSE, the intrinsic's feature, is part of every x86-64 processor; a prefetch
        // only hints the caches and never faults, so the address may lie anywhere.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(from.wrapping_add(l * 64).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (from, n, i, parts);
}

/// Line ranges ([`Ahead`]) fetched a step at a time over a kernel's work: step `i` of `steps`
/// fetches the `i`-th run of each range's lines, the runs as long as `steps` of them cover
/// the range (no division per step).
pub(crate) struct Fetch<'a> {
    ahead: &'a [Ahead],
    per: [usize; 4],
}

impl<'a> Fetch<'a> {
    /// `ahead` (at most four ranges; the rest are not fetched) in `steps` steps.
    pub(crate) fn new(ahead: &'a [Ahead], steps: usize) -> Self {
        let ahead = &ahead[..ahead.len().min(4)];
        let mut per = [0; 4];
        per.iter_mut().zip(ahead).for_each(|(p, a)| *p = a.1.len().div_ceil(steps.max(1)));
        Fetch { ahead, per }
    }

    /// Fetches step `i`'s run of each range into L2 (nothing past a range's end).
    #[inline]
    pub(crate) fn step(&self, i: usize) {
        for ((from, lines), &per) in self.ahead.iter().zip(&self.per) {
            let first = lines.start + i * per;
            prefetch(&(*from, first..(first + per).min(lines.end)), 0, 1);
        }
    }
}

/// The first `n` of a [`Kernels::gemv16`] kernel's per-token accumulators `T`, arrays of the
/// vector `V`, set to zeros (`zero`) by one vector store each. Written as constant zeros they
/// compiled to a `memset` call on every kernel call (2-4% of a batch-1 decode step's samples on
/// an AMD Zen 1), and as copies of a whole opaque zero `T` to a `memcpy` of it per token (1.5%;
/// BENCHMARKS.md); an opaque zero vector stored `n * size_of::<T>() / size_of::<V>()` times is
/// neither.
#[inline(always)]
pub(crate) fn zeroed_sums<T: Copy, V: Copy>(
    sums: &mut [std::mem::MaybeUninit<T>; GEMV_TOKENS],
    n: usize,
    zero: V,
) -> &mut [T] {
    const { assert!(size_of::<T>().is_multiple_of(size_of::<V>()) && align_of::<T>() == align_of::<V>()) };
    assert!(n <= GEMV_TOKENS, "at most {GEMV_TOKENS} tokens");
    let zero = std::hint::black_box(zero);
    let at = sums.as_mut_ptr().cast::<V>();
    for i in 0..n * (size_of::<T>() / size_of::<V>()) {
        // SAFETY: the first n elements of `sums` span `n * size_of::<T>()` bytes, whole `V`s at
        // `V`'s alignment (the assertions above), so element i lies inside them.
        unsafe { at.add(i).write(zero) };
    }
    // SAFETY: the first n elements were written above, as `V`s, which is all a `T` holds (the
    // callers' `T` are arrays of `V`), and MaybeUninit<T> has the layout of T.
    unsafe { std::slice::from_raw_parts_mut(sums.as_mut_ptr().cast(), n) }
}

/// One token's activations for [`Kernels::gemv16`]: its 8-bit blocks and each block's integer
/// sums of its two halves (the kernel takes them from the products where a format's quants are
/// offset; computed once per product, not per 16 rows).
#[derive(Clone, Copy, Debug)]
pub struct Acts<'a> {
    pub q8: &'a [BlockQ8],
    pub halves: &'a [[i32; 2]],
}

impl Acts<'_> {
    /// The integer sums of the halves of each block of `q8`.
    pub fn half_sums(q8: &[BlockQ8]) -> Vec<[i32; 2]> {
        let sum = |q: &[i8]| q.iter().map(|&v| i32::from(v)).sum();
        q8.iter().map(|b| [sum(&b.qs[..QK / 2]), sum(&b.qs[QK / 2..])]).collect()
    }
}

/// See [`Kernels::attn_scores`]: `(keys, qt, g, scale, out, stride, ahead)`.
pub type AttnScores = fn(KeysT<'_>, &[f32], usize, f32, &mut [f32], usize, &[Ahead]);
/// See [`Kernels::attn_values`]: `(v, p, stride, hd, g, out)`.
pub type AttnValues = fn(&[half::f16], &[f32], usize, usize, usize, &mut [f32]);

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("isa", &self.isa).finish_non_exhaustive()
    }
}

impl Kernels {
    /// The products of a quantized weight type: one token, four tokens.
    pub fn quant_dots(&self, q: QuantType) -> (DotQ8, DotQ8x4) {
        let d = self.quant[q.index()];
        (d.one, d.four)
    }

    /// The products of a float weight type: one token, and four tokens where there is a
    /// kernel for it.
    pub fn float_dots(&self, f: FloatType) -> (DotF, Option<DotFx4>) {
        match f {
            FloatType::F32 => (self.dot_f32, None),
            FloatType::F16 => (self.dot_f16, Some(self.dot_f16_x4)),
            FloatType::BF16 => (self.dot_bf16, Some(self.dot_bf16_x4)),
        }
    }

    /// Whether matrices of `dt` are worth packing for this table: it has the packed kernel and
    /// the type a packed layout ([`crate::pack::pack`]).
    pub fn packs(&self, dt: crate::quant::DType) -> bool {
        self.gemv16_packed.is_some() && crate::pack::has_layout(dt)
    }

    /// The scalar reference table.
    pub fn scalar() -> Self {
        Kernels {
            isa: Isa::Scalar,
            quantize_q8: scalar::quantize_q8,
            quant: QuantType::ALL.map(scalar::quant_dots),
            dot_f32: scalar::dot_f32,
            dot_f16: scalar::dot_f16,
            dot_bf16: scalar::dot_bf16,
            dot_f16_x4: |w, x| x.map(|x| scalar::dot_f16(w, x)),
            dot_bf16_x4: |w, x| x.map(|x| scalar::dot_bf16(w, x)),
            dot_f16_f32: scalar::dot_f16_f32,
            axpy_f16: scalar::axpy_f16,
            attn_scores: scalar::attn_scores,
            attn_values: scalar::attn_values,
            exp: scalar::exp,
            exp_sum: scalar::exp_sum,
            geglu: crate::ops::geglu,
            swiglu: crate::ops::swiglu,
            gemv16: None,
            gemv16_packed: None,
            bf16: None,
        }
    }

    /// The fastest table this processor supports (honouring `INFERD_ISA=scalar`).
    pub fn detect() -> Self {
        if std::env::var("INFERD_ISA").is_ok_and(|v| v == "scalar") {
            return Self::scalar();
        }
        let avx2_only = std::env::var("INFERD_ISA").is_ok_and(|v| v == "avx2");
        #[cfg(target_arch = "x86_64")]
        if let Some(k) = avx512::kernels().filter(|_| !avx2_only).or_else(avx2::kernels) {
            return k;
        }
        Self::scalar()
    }

    /// Every table this processor supports, the reference first (for tests and benchmarks).
    pub fn all() -> Vec<Self> {
        let mut v = vec![Self::scalar()];
        #[cfg(target_arch = "x86_64")]
        v.extend(avx2::kernels().into_iter().chain(avx512::kernels()));
        v
    }
}

/// The table of `isa`, for a test of it. The test itself is `ignore`d, with the reason, when
/// the build machine lacks the instruction set (`build.rs`); finding it missing here means the
/// tests run on another processor than the one they were built on.
#[cfg(test)]
pub(crate) fn table(isa: Isa) -> Kernels {
    Kernels::all()
        .into_iter()
        .find(|k| k.isa == isa)
        .unwrap_or_else(|| panic!("this processor lacks {isa:?}, though the one that built the tests had it"))
}

/// One `#[test]` per kernel table for each named `fn(&Kernels)`: `NAME::scalar`, `NAME::avx2`
/// and `NAME::avx512`, the last two ignored (and so counted as skipped, not passed) on a
/// processor without the instruction set.
#[cfg(test)]
macro_rules! test_every_isa {
    ($($check:ident),* $(,)?) => { $(
        mod $check {
            #[test]
            fn scalar() {
                super::$check(&$crate::cpu::Kernels::scalar())
            }
            #[test]
            #[cfg_attr(not(host_avx2), ignore = "this processor lacks AVX2, FMA or F16C")]
            fn avx2() {
                super::$check(&$crate::cpu::table($crate::cpu::Isa::Avx2))
            }
            #[test]
            #[cfg_attr(not(host_avx512vnni), ignore = "this processor lacks AVX-512 VNNI")]
            fn avx512() {
                super::$check(&$crate::cpu::table($crate::cpu::Isa::Avx512Vnni))
            }
        }
    )* };
}
#[cfg(test)]
pub(crate) use test_every_isa;

#[cfg(test)]
mod tests;
