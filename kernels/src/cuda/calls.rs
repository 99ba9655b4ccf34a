//! One typed call per kernel of `kernels/cuda`, on any [`Stream`]: each checks its buffers'
//! lengths against the shape it is given, then launches with the argument list the kernel's
//! signature wants and the geometry the kernel is written for. The unsafe launches are confined
//! here, each beside the signature it must match.

use super::stream::{Arg, GemmShape, GpuError, Stream};
use crate::deltanet::{DeltaShape, CHUNK};

/// Blocks of 256 threads for `n` elements, capped (the kernels stride over the rest).
fn elementwise(n: usize) -> (u32, u32) {
    (n.div_ceil(256).clamp(1, 4096) as u32, 1)
}

fn int(kernel: &'static str, what: &str, v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| GpuError::Shape { kernel, message: format!("{what} = {v} does not fit an int") })
}

fn grid_dim(kernel: &'static str, what: &str, v: usize) -> Result<u32, GpuError> {
    match u32::try_from(v) {
        Ok(n) if n > 0 && (what == "x" || n < 65536) => Ok(n),
        _ => Err(GpuError::Shape { kernel, message: format!("a grid of {v} blocks in {what}") }),
    }
}

fn check(kernel: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::Shape { kernel, message: message() })
    }
}

/// A weight matrix in its file's encoding: `rows` rows of `cols` weights of GGML type
/// `ggml_type`, `row_bytes` bytes each.
#[derive(Clone, Copy, Debug)]
pub struct WeightShape {
    pub ggml_type: u32,
    pub row_bytes: usize,
    pub rows: usize,
    pub cols: usize,
}

/// How one `attention` launch covers a batch's queries: tiles of consecutive tokens of one
/// sequence (`tiles`: first token and count of each), `heads_per_block` of a KV head's query
/// heads per block (`chunks` blocks for all of them), and the positions of each tile in
/// `splits` runs of `split_len` (one when the grid is large enough without), merged after by
/// `attention_combine` from `part_o` and `part_ml` (each split's unnormalized output and
/// (max, sum) per row; allocated once for every layer that takes the plan, one element each
/// when unsplit).
pub struct AttentionPlan<S: Stream> {
    pub tiles: S::Buf<i32>,
    pub n_tiles: usize,
    pub heads_per_block: usize,
    pub chunks: usize,
    pub splits: usize,
    pub split_len: usize,
    pub part_o: S::Buf<f32>,
    pub part_ml: S::Buf<f32>,
}

/// A gated activation of `gated_act`, as the kernel numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gated {
    /// `silu(gate) * up`.
    Swiglu = 0,
    /// `gelu_tanh(gate) * up`.
    Geglu = 1,
    /// gpt-oss's clamped SwiGLU ([`crate::ops::swiglu_oai`]).
    SwigluOai = 2,
}

/// The (token, head) rows one attention block holds for a head size: the kernel's rows per
/// warp (by head size, attention.cu's dispatch) times its four warps.
pub fn attention_rows(head_dim: usize) -> usize {
    4 * match head_dim {
        0..=64 => 14,
        65..=128 => 7,
        _ => 3,
    }
}

/// Blocks below which `attention` splits each tile's positions, to fill a large GPU (two
/// blocks per multiprocessor of an H100 or H200).
const ATTENTION_FILL_BLOCKS: usize = 264;

/// The attention launch's shape: query and KV heads, head size, positions per block, sliding
/// window (none: every position) and score scale.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub window: Option<usize>,
    pub scale: f32,
}

/// Activations rounded to 8 bits for the quantized products ([`KernelCalls::quantize_q8`]):
/// `tokens` rows of `cols` values, per group of 32 the quants, the scale and each half's sum of
/// quants.
pub struct Q8Activations<S: Stream> {
    pub q: S::Buf<u8>,
    pub d: S::Buf<f32>,
    pub sums: S::Buf<i32>,
    pub tokens: usize,
    pub cols: usize,
}

/// Whether GGML type `ggml_type` is a quantized one (`matvec_q8` takes it), not F32, F16 or BF16.
pub fn is_quantized(ggml_type: u32) -> bool {
    crate::DType::from_ggml(ggml_type).is_some_and(|d| matches!(d.class(), crate::quant::WeightClass::Quantized(_)))
}

/// The typed kernel calls, for every [`Stream`].
pub trait KernelCalls: Stream + Sized {
    /// `out[t] = scale * row ids[t]` of `table`.
    fn embed(
        &self,
        table: &Self::Buf<u8>,
        w: WeightShape,
        ids: &Self::Buf<i32>,
        scale: f32,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let tokens = Self::len(ids);
        check("embed", Self::len(out) >= tokens * w.cols && Self::len(table) >= w.rows * w.row_bytes, || {
            format!("{} outputs for {tokens} x {}", Self::len(out), w.cols)
        })?;
        let mut a = [
            Arg::U8(table),
            Arg::Int(w.ggml_type as i32),
            Arg::Long(w.row_bytes as i64),
            Arg::I32(ids),
            Arg::Int(int("embed", "cols", w.cols)?),
            Arg::Float(scale),
            Arg::F32Mut(out),
        ];
        // SAFETY: embed's (uint8*, int, long long, int*, int, float, float*); every id must index a
        // row of `table` (the backend checks tokens against the vocabulary first); `out` holds
        // tokens * cols floats (checked above). One block per token.
        unsafe { self.launch("embed", (grid_dim("embed", "x", tokens)?, 1), (256, 1), &mut a) }
    }

    /// `y = x * w / rms(x)` for each piece of `w.len()` floats of `x`.
    fn rms_norm(
        &self,
        x: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        y: &mut Self::Buf<f32>,
        eps: f32,
    ) -> Result<(), GpuError> {
        let n = Self::len(w);
        let rows = Self::len(x) / n.max(1);
        check("rms_norm", n > 0 && Self::len(x) == rows * n && Self::len(y) >= rows * n, || {
            format!("x {} w {n} y {}", Self::len(x), Self::len(y))
        })?;
        let mut a = [Arg::F32(x), Arg::F32(w), Arg::F32Mut(y), Arg::Int(int("rms_norm", "n", n)?), Arg::Float(eps)];
        // A few long pieces (a decode step's hidden states): a block of 1024 threads each, every
        // value loaded at once; many (prefill, or QK-norm's heads): 256.
        let threads = if rows <= 16 { 1024 } else { 256 };
        // SAFETY: rms_norm's (float*, float*, float*, int, float); lengths checked above (the
        // pieces start every n floats; the kernel reads 4 at a time only where n is a multiple
        // of 4, so aligned); one block per piece, a multiple of 32 threads as block_sum wants.
        unsafe { self.launch("rms_norm", (grid_dim("rms_norm", "x", rows)?, 1), (threads, 1), &mut a) }
    }

    /// Rotates the first `2 inv_freq.len()` dimensions of every head of every token (token `t`
    /// at position `pos[t]`), both rotated values times `scale`; `neox` pairs `i` with
    /// `i + pairs`, else `2i` with `2i + 1`.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut Self::Buf<f32>,
        pos: &Self::Buf<i32>,
        inv_freq: &Self::Buf<f32>,
        heads: usize,
        head_dim: usize,
        neox: bool,
        scale: f32,
    ) -> Result<(), GpuError> {
        let (tokens, pairs) = (Self::len(pos), Self::len(inv_freq));
        check("rope", Self::len(x) == tokens * heads * head_dim && 2 * pairs <= head_dim, || {
            format!("x {} for {tokens} tokens of {heads} heads of {head_dim}, {pairs} pairs", Self::len(x))
        })?;
        let mut a = [
            Arg::F32Mut(x),
            Arg::I32(pos),
            Arg::F32(inv_freq),
            Arg::Int(int("rope", "heads", heads)?),
            Arg::Int(int("rope", "head_dim", head_dim)?),
            Arg::Int(pairs as i32),
            Arg::Int(i32::from(neox)),
            Arg::Float(scale),
        ];
        // SAFETY: rope's (float*, int*, float*, int, int, int, int, float); lengths checked above.
        unsafe { self.launch("rope", (grid_dim("rope", "x", tokens)?, 1), (128, 1), &mut a) }
    }

    /// `gate = act(gate, up)`, the gated activation `kind`.
    fn gated_act(&self, gate: &mut Self::Buf<f32>, up: &Self::Buf<f32>, kind: Gated) -> Result<(), GpuError> {
        let n = Self::len(gate);
        check("gated_act", Self::len(up) == n, || format!("gate {n} up {}", Self::len(up)))?;
        let mut a = [Arg::F32Mut(gate), Arg::F32(up), Arg::Long(n as i64), Arg::Int(kind as i32)];
        // SAFETY: gated_act's (float*, float*, long long, int); equal lengths checked above.
        unsafe { self.launch("gated_act", elementwise(n), (256, 1), &mut a) }
    }

    /// `x += y`.
    fn add_in_place(&self, x: &mut Self::Buf<f32>, y: &Self::Buf<f32>) -> Result<(), GpuError> {
        let n = Self::len(x);
        check("add_in_place", Self::len(y) == n, || format!("x {n} y {}", Self::len(y)))?;
        let mut a = [Arg::F32Mut(x), Arg::F32(y), Arg::Long(n as i64)];
        // SAFETY: add_in_place's (float*, float*, long long); equal lengths checked above.
        unsafe { self.launch("add_in_place", elementwise(n), (256, 1), &mut a) }
    }

    /// `y[t * rows + r] = Σ_k W[r][k] x[t * cols + k]` for the first `tokens` rows of `x`.
    fn matvec(
        &self,
        w: &Self::Buf<u8>,
        shape: WeightShape,
        x: &Self::Buf<f32>,
        tokens: usize,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let WeightShape { ggml_type, row_bytes, rows, cols } = shape;
        check(
            "matvec",
            tokens > 0
                && Self::len(x) >= tokens * cols
                && Self::len(w) >= rows * row_bytes
                && Self::len(y) >= rows * tokens,
            || format!("w {} x {} y {} for {rows} x {cols}, {tokens} tokens", Self::len(w), Self::len(x), Self::len(y)),
        )?;
        let g = (grid_dim("matvec", "x", rows.div_ceil(8))?, grid_dim("matvec", "y", tokens.div_ceil(8))?);
        let mut a = [
            Arg::U8(w),
            Arg::Int(ggml_type as i32),
            Arg::Long(row_bytes as i64),
            Arg::Int(int("matvec", "rows", rows)?),
            Arg::Int(int("matvec", "cols", cols)?),
            Arg::F32(x),
            Arg::Int(int("matvec", "tokens", tokens)?),
            Arg::F32Mut(y),
        ];
        // SAFETY: matvec's (uint8*, int, long long, int, int, float*, int, float*); lengths checked
        // above; blocks of 32 x 8 threads (a warp per row), a grid row per 8 tokens.
        unsafe { self.launch("matvec", g, (32, 8), &mut a) }
    }

    /// The first `tokens` rows of `x` (`cols` values each, a multiple of 32) rounded to 8 bits
    /// per group of 32, as the CPU backend rounds activations for its quantized products.
    fn quantize_q8(&self, x: &Self::Buf<f32>, tokens: usize, cols: usize) -> Result<Q8Activations<Self>, GpuError> {
        check("quantize_q8", tokens > 0 && cols.is_multiple_of(32) && Self::len(x) >= tokens * cols, || {
            format!("x {} for {tokens} x {cols}", Self::len(x))
        })?;
        let groups = tokens * cols / 32;
        let mut a = Q8Activations {
            q: self.alloc::<u8>(tokens * cols)?,
            d: self.alloc::<f32>(groups)?,
            sums: self.alloc::<i32>(2 * groups)?,
            tokens,
            cols,
        };
        let mut args = [
            Arg::F32(x),
            Arg::Long(groups as i64),
            Arg::U8Mut(&mut a.q),
            Arg::F32Mut(&mut a.d),
            Arg::I32Mut(&mut a.sums),
        ];
        // SAFETY: quantize_q8's (float*, long long, int8*, float*, int*); x holds groups * 32
        // floats and the outputs groups * 32 bytes, groups floats and 2 groups ints (above).
        // Blocks of 8 warps, a warp per group, striding over the rest.
        unsafe { self.launch("quantize_q8", (groups.div_ceil(8).min(65535) as u32, 1), (32, 8), &mut args)? };
        Ok(a)
    }

    /// [`KernelCalls::matvec`] for a quantized `w` against 8-bit activations: `y[t * rows + r]`
    /// = row `r` of `w` against token `t` of `a`, each group's term as the CPU's product computes
    /// it.
    fn matvec_q8(
        &self,
        w: &Self::Buf<u8>,
        shape: WeightShape,
        a: &Q8Activations<Self>,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let WeightShape { ggml_type, row_bytes, rows, cols } = shape;
        let tokens = a.tokens;
        check(
            "matvec_q8",
            is_quantized(ggml_type)
                && a.cols == cols
                && Self::len(&a.q) >= tokens * cols
                && Self::len(&a.d) >= tokens * cols / 32
                && Self::len(&a.sums) >= tokens * cols / 16
                && Self::len(w) >= rows * row_bytes
                && Self::len(y) >= rows * tokens,
            || {
                format!(
                    "type {ggml_type}, w {} y {} for {rows} x {cols}, {tokens} tokens of {}",
                    Self::len(w),
                    Self::len(y),
                    a.cols
                )
            },
        )?;
        let g = (grid_dim("matvec_q8", "x", rows.div_ceil(8))?, grid_dim("matvec_q8", "y", tokens.div_ceil(8))?);
        let mut args = [
            Arg::U8(w),
            Arg::Int(ggml_type as i32),
            Arg::Long(row_bytes as i64),
            Arg::Int(int("matvec_q8", "rows", rows)?),
            Arg::Int(int("matvec_q8", "cols", cols)?),
            Arg::U8(&a.q),
            Arg::F32(&a.d),
            Arg::I32(&a.sums),
            Arg::Int(int("matvec_q8", "tokens", tokens)?),
            Arg::F32Mut(y),
        ];
        // SAFETY: matvec_q8's (uint8*, int, long long, int, int, int8*, float*, int*, int,
        // float*); a quantized type (its groups decoded by group_ints) and every length checked
        // above; blocks of 32 x 8 threads (a warp per row, MVQ_ROWS), a grid row per 8 tokens.
        unsafe { self.launch("matvec_q8", g, (32, 8), &mut args) }
    }

    /// `out` = the matrix `w` decoded to halves (`rows × cols`; bf16 when `bf16`, else f16),
    /// each weight decoded as [`KernelCalls::matvec`] decodes it and rounded once.
    fn dequantize_half(
        &self,
        w: &Self::Buf<u8>,
        shape: WeightShape,
        bf16: bool,
        out: &mut Self::Buf<u16>,
    ) -> Result<(), GpuError> {
        let WeightShape { ggml_type, row_bytes, rows, cols } = shape;
        let n = rows * cols;
        check("dequantize_half", Self::len(w) >= rows * row_bytes && Self::len(out) >= n, || {
            format!("w {} out {} for {rows} x {cols}", Self::len(w), Self::len(out))
        })?;
        let mut a = [
            Arg::U8(w),
            Arg::Int(ggml_type as i32),
            Arg::Long(row_bytes as i64),
            Arg::Int(int("dequantize_half", "rows", rows)?),
            Arg::Int(int("dequantize_half", "cols", cols)?),
            Arg::Int(i32::from(bf16)),
            Arg::U16Mut(out),
        ];
        // SAFETY: dequantize_half's (uint8*, int, long long, int, int, int, uint16*); `w` holds the
        // rows and `out` rows * cols halves (checked above).
        unsafe { self.launch("dequantize_half", elementwise(n), (256, 1), &mut a) }
    }

    /// `out[i]` = `x[i]` as a half (bf16 when `bf16`, else f16), for `i < n`.
    fn to_half(&self, x: &Self::Buf<f32>, n: usize, bf16: bool, out: &mut Self::Buf<u16>) -> Result<(), GpuError> {
        check("to_half", Self::len(x) >= n && Self::len(out) >= n, || {
            format!("x {} out {} for {n}", Self::len(x), Self::len(out))
        })?;
        let mut a = [Arg::F32(x), Arg::Long(n as i64), Arg::Int(i32::from(bf16)), Arg::U16Mut(out)];
        // SAFETY: to_half's (float*, long long, int, uint16*); both hold n elements (checked above).
        unsafe { self.launch("to_half", elementwise(n), (256, 1), &mut a) }
    }

    /// `y[t * rows + r] = Σ_k w[r * cols + k] · x[t * cols + k]` over halves, accumulated in
    /// f32 ([`Stream::gemm_half`]: cuBLAS on a GPU).
    fn gemm(
        &self,
        w: &Self::Buf<u16>,
        x: &Self::Buf<u16>,
        shape: GemmShape,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let GemmShape { tokens, rows, cols, .. } = shape;
        check(
            "gemm",
            tokens > 0
                && rows > 0
                && cols > 0
                && Self::len(w) >= rows * cols
                && Self::len(x) >= tokens * cols
                && Self::len(y) >= tokens * rows,
            || format!("w {} x {} y {} for {shape:?}", Self::len(w), Self::len(x), Self::len(y)),
        )?;
        for (what, v) in [("rows", rows), ("cols", cols), ("tokens", tokens)] {
            int("gemm", what, v)?;
        }
        // SAFETY: every buffer holds what `shape` says (checked above), and each dimension fits
        // cuBLAS's int.
        unsafe { self.gemm_half(w, x, shape, y) }
    }

    /// `y[t * n + i] += bias[i]`.
    fn add_bias(&self, y: &mut Self::Buf<f32>, bias: &Self::Buf<f32>) -> Result<(), GpuError> {
        let (len, n) = (Self::len(y), Self::len(bias));
        check("add_bias", n > 0 && len.is_multiple_of(n), || format!("y {len} bias {n}"))?;
        let g = elementwise(len);
        let mut a = [
            Arg::F32Mut(y),
            Arg::F32(bias),
            Arg::Int(int("add_bias", "n", n)?),
            Arg::Int(int("add_bias", "tokens", len / n)?),
        ];
        // SAFETY: add_bias's (float*, float*, int, int); lengths checked above.
        unsafe { self.launch("add_bias", g, (256, 1), &mut a) }
    }

    /// Each row of `x` as pairs of pieces of `hd` floats: the first of each pair into `a`, the
    /// second into `b` (a gated attention's queries and gates).
    fn split_pairs(
        &self,
        x: &Self::Buf<f32>,
        hd: usize,
        a: &mut Self::Buf<f32>,
        b: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let n = Self::len(x);
        let pairs = n / (2 * hd.max(1));
        check("split_pairs", hd > 0 && n == pairs * 2 * hd && Self::len(a) >= n / 2 && Self::len(b) >= n / 2, || {
            format!("{n} floats in pairs of {hd}")
        })?;
        let mut args = [
            Arg::F32(x),
            Arg::Long(pairs as i64),
            Arg::Int(int("split_pairs", "hd", hd)?),
            Arg::F32Mut(a),
            Arg::F32Mut(b),
        ];
        // SAFETY: split_pairs's (float*, long long, int, float*, float*); half of x's floats each
        // into a and b (checked above).
        unsafe { self.launch("split_pairs", elementwise(n / 2), (256, 1), &mut args) }
    }

    /// `x *= f(g)` value by value, or each of `g`'s values gating its equal piece of `x`; `f`
    /// the sigmoid, or `g * sigmoid(g)` with `silu`.
    fn gate_by(&self, x: &mut Self::Buf<f32>, g: &Self::Buf<f32>, silu: bool) -> Result<(), GpuError> {
        let (n, gl) = (Self::len(x), Self::len(g));
        check("gate_by", gl > 0 && n >= gl && n.is_multiple_of(gl), || format!("{gl} gates for {n} values"))?;
        let mut a =
            [Arg::F32Mut(x), Arg::F32(g), Arg::Long(n as i64), Arg::Long((n / gl) as i64), Arg::Int(i32::from(silu))];
        // SAFETY: gate_by's (float*, float*, long long, long long, int); x's n values, g's n /
        // per (checked above).
        unsafe { self.launch("gate_by", elementwise(n), (256, 1), &mut a) }
    }

    /// `n` floats of `buf` from float `from` to float `to` (apart), or zeros at `to` where
    /// `from` is `None`.
    fn move_floats(&self, buf: &mut Self::Buf<f32>, from: Option<usize>, to: usize, n: usize) -> Result<(), GpuError> {
        let len = Self::len(buf);
        let apart = from.is_none_or(|f| f + n <= to || to + n <= f);
        check("move_floats", apart && to + n <= len && from.is_none_or(|f| f + n <= len), || {
            format!("{n} floats from {from:?} to {to} of {len}")
        })?;
        let mut a =
            [Arg::F32Mut(buf), Arg::Long(from.map_or(-1, |f| f as i64)), Arg::Long(to as i64), Arg::Long(n as i64)];
        // SAFETY: move_floats's (float*, long long, long long, long long); both regions inside
        // the buffer and apart (checked above).
        unsafe { self.launch("move_floats", elementwise(n), (256, 1), &mut a) }
    }

    /// `dst[i] = src[rows[i]]`, rows of `n` floats.
    fn gather_rows(
        &self,
        src: &Self::Buf<f32>,
        rows: &Self::Buf<i32>,
        n: usize,
        dst: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let count = Self::len(rows);
        check("gather_rows", Self::len(dst) >= count * n, || {
            format!("dst {} for {count} rows of {n}", Self::len(dst))
        })?;
        let mut a = [Arg::F32(src), Arg::I32(rows), Arg::Int(int("gather_rows", "n", n)?), Arg::F32Mut(dst)];
        // SAFETY: gather_rows's (float*, int*, int, float*); every row index must be a row of
        // `src` (the backend's own list of token rows); `dst` checked above.
        unsafe { self.launch("gather_rows", (grid_dim("gather_rows", "x", count)?, 1), (256, 1), &mut a) }
    }

    /// `dst[rows[i]] += weights[i] * src[i]`, rows of `n` floats; no row of `dst` twice.
    fn scatter_add_rows(
        &self,
        src: &Self::Buf<f32>,
        rows: &Self::Buf<i32>,
        weights: &Self::Buf<f32>,
        n: usize,
        dst: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let count = Self::len(rows);
        check("scatter_add_rows", Self::len(src) >= count * n && Self::len(weights) == count, || {
            format!("src {} weights {} for {count} rows of {n}", Self::len(src), Self::len(weights))
        })?;
        let mut a = [
            Arg::F32(src),
            Arg::I32(rows),
            Arg::F32(weights),
            Arg::Int(int("scatter_add_rows", "n", n)?),
            Arg::F32Mut(dst),
        ];
        // SAFETY: scatter_add_rows's (float*, int*, float*, int, float*); every row index must
        // be a row of `dst` (the backend's own list of token rows), each once; `src` and
        // `weights` checked above.
        unsafe { self.launch("scatter_add_rows", (grid_dim("scatter_add_rows", "x", count)?, 1), (256, 1), &mut a) }
    }

    /// The K and V rows of `slot.len()` tokens into their cache slots (f16 bits).
    fn kv_store(
        &self,
        k: &Self::Buf<f32>,
        v: &Self::Buf<f32>,
        caches: (&mut Self::Buf<u16>, &mut Self::Buf<u16>),
        slot: &Self::Buf<i32>,
        kv_dim: usize,
    ) -> Result<(), GpuError> {
        let n = Self::len(slot);
        check(
            "kv_store",
            Self::len(k) >= n * kv_dim && Self::len(v) >= n * kv_dim && Self::len(caches.0) == Self::len(caches.1),
            || format!("k {} v {} for {n} tokens of {kv_dim}", Self::len(k), Self::len(v)),
        )?;
        let mut a = [
            Arg::F32(k),
            Arg::F32(v),
            Arg::U16Mut(caches.0),
            Arg::U16Mut(caches.1),
            Arg::I32(slot),
            Arg::Int(int("kv_store", "kv_dim", kv_dim)?),
        ];
        // SAFETY: kv_store's (float*, float*, uint16*, uint16*, int*, int); every slot must lie
        // inside the pool (the engine's block tables are validated against it first).
        unsafe { self.launch("kv_store", (grid_dim("kv_store", "x", n)?, 1), (256, 1), &mut a) }
    }

    /// Copies whole blocks of `block_elems` halves, `pairs` = [src0, dst0, src1, dst1, ...].
    fn kv_copy_blocks(
        &self,
        caches: (&mut Self::Buf<u16>, &mut Self::Buf<u16>),
        pairs: &Self::Buf<i32>,
        block_elems: usize,
    ) -> Result<(), GpuError> {
        let copies = Self::len(pairs) / 2;
        if copies == 0 {
            return Ok(());
        }
        let g = ((block_elems.div_ceil(256).min(1024)) as u32, grid_dim("kv_copy_blocks", "y", copies)?);
        let mut a = [Arg::U16Mut(caches.0), Arg::U16Mut(caches.1), Arg::I32(pairs), Arg::Long(block_elems as i64)];
        // SAFETY: kv_copy_blocks's (uint16*, uint16*, int*, long long); the block ids must lie
        // inside the pool (the backend validates them first).
        unsafe { self.launch("kv_copy_blocks", g, (256, 1), &mut a) }
    }

    /// The plan of an `attention` launch for queries of sequences `table_of` at positions
    /// `q_pos` (host copies of the launch's arrays): runs of consecutive positions of one
    /// sequence cut into tiles of at most [`attention_rows`] rows, and each tile's positions
    /// split in runs of `split_len` (where `None`: split only to fill the GPU when the tiles
    /// are few and long).
    fn attention_plan(
        &self,
        table_of: &[i32],
        q_pos: &[i32],
        s: AttentionShape,
        split_len: Option<usize>,
    ) -> Result<AttentionPlan<Self>, GpuError> {
        check(
            "attention",
            table_of.len() == q_pos.len() && s.kv_heads > 0 && s.q_heads.is_multiple_of(s.kv_heads) && s.head_dim > 0,
            || format!("{} tables for {} queries", table_of.len(), q_pos.len()),
        )?;
        let rows = attention_rows(s.head_dim);
        let group = s.q_heads / s.kv_heads;
        let heads_per_block = group.min(rows);
        let chunks = group.div_ceil(heads_per_block);
        let per_tile = (rows / heads_per_block).max(1);
        let (mut tiles, mut longest) = (Vec::new(), 1usize);
        let mut t = 0;
        while t < q_pos.len() {
            let mut n = 1;
            while t + n < q_pos.len()
                && n < per_tile
                && table_of[t + n] == table_of[t]
                && q_pos[t + n] == q_pos[t + n - 1] + 1
            {
                n += 1;
            }
            let last = q_pos[t + n - 1].max(0) as usize;
            let first = s.window.map_or(0, |w| (q_pos[t].max(0) as usize + 1).saturating_sub(w));
            longest = longest.max(last + 1 - first.min(last));
            tiles.extend([int("attention", "a token", t)?, int("attention", "a tile", n)?]);
            t += n;
        }
        let n_tiles = tiles.len() / 2;
        let blocks = n_tiles * s.kv_heads * chunks;
        let (splits, split_len) = match split_len {
            Some(l) => (longest.div_ceil(l.max(1)), l.max(1)),
            None if blocks < ATTENTION_FILL_BLOCKS && longest > 128 => {
                let splits = longest.div_ceil(64).min(ATTENTION_FILL_BLOCKS.div_ceil(blocks)).clamp(1, 32);
                (splits, longest.div_ceil(splits).next_multiple_of(32))
            }
            None => (1, longest),
        };
        let tiles = if tiles.is_empty() { self.zeros::<i32>(2)? } else { self.upload(&tiles)? };
        // Every (split, row) is written by the block that covers it, empty splits included.
        let rows = if splits > 1 { q_pos.len() * s.q_heads } else { 0 };
        let (part_o, part_ml) = (self.alloc::<f32>(splits * rows * s.head_dim)?, self.alloc::<f32>(2 * splits * rows)?);
        Ok(AttentionPlan { tiles, n_tiles, heads_per_block, chunks, splits, split_len, part_o, part_ml })
    }

    /// Attention of every query over its sequence's blocks (see attention.cu), as `plan`
    /// covers them: query `t` sits at position `q_pos[t]` and reads table `table_of[t]` of
    /// `tables` (`table_len` entries each).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf<f32>,
        caches: (&Self::Buf<u16>, &Self::Buf<u16>),
        tables: &Self::Buf<i32>,
        table_of: &Self::Buf<i32>,
        table_len: usize,
        q_pos: &Self::Buf<i32>,
        plan: &mut AttentionPlan<Self>,
        s: AttentionShape,
        sinks: Option<&Self::Buf<f32>>,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let tokens = Self::len(q_pos);
        check(
            "attention",
            s.head_dim <= 256
                && s.head_dim.is_multiple_of(2)
                && s.kv_heads > 0
                && s.q_heads.is_multiple_of(s.kv_heads)
                && Self::len(q) == tokens * s.q_heads * s.head_dim
                && Self::len(out) >= Self::len(q)
                && Self::len(table_of) == tokens
                && plan.splits > 0
                && plan.heads_per_block > 0
                && plan.chunks == (s.q_heads / s.kv_heads).div_ceil(plan.heads_per_block)
                && Self::len(&plan.tiles) >= 2 * plan.n_tiles
                && sinks.is_none_or(|k| Self::len(k) == s.q_heads),
            || {
                format!(
                    "q {} out {} for {tokens} queries of {} heads of {}",
                    Self::len(q),
                    Self::len(out),
                    s.q_heads,
                    s.head_dim
                )
            },
        )?;
        if plan.n_tiles == 0 {
            return Ok(());
        }
        let rows = tokens * s.q_heads;
        let split = plan.splits > 1;
        check(
            "attention",
            !split
                || (Self::len(&plan.part_o) >= plan.splits * rows * s.head_dim
                    && Self::len(&plan.part_ml) >= 2 * plan.splits * rows),
            || format!("the plan's split outputs are for fewer than {rows} rows"),
        )?;
        let i = |what, v| int("attention", what, v);
        let mut a = [
            Arg::F32(q),
            Arg::U16(caches.0),
            Arg::U16(caches.1),
            Arg::I32(tables),
            Arg::I32(table_of),
            Arg::Int(i("table_len", table_len)?),
            Arg::I32(q_pos),
            Arg::I32(&plan.tiles),
            Arg::Int(i("heads_per_block", plan.heads_per_block)?),
            Arg::Int(i("splits", plan.splits)?),
            Arg::Int(i("split_len", plan.split_len)?),
            Arg::Int(i("tokens", tokens)?),
            Arg::Int(i("q_heads", s.q_heads)?),
            Arg::Int(i("kv_heads", s.kv_heads)?),
            Arg::Int(i("head_dim", s.head_dim)?),
            Arg::Int(i("block_size", s.block_size)?),
            Arg::Int(i("window", s.window.unwrap_or(0))?),
            Arg::Float(s.scale),
            // Without sinks the kernel reads none: any buffer stands in for the pointer.
            Arg::F32(sinks.unwrap_or(q)),
            Arg::Int(i32::from(sinks.is_some())),
            Arg::F32Mut(out),
            Arg::F32Mut(&mut plan.part_o),
            Arg::F32Mut(&mut plan.part_ml),
        ];
        let g = (
            grid_dim("attention", "x", plan.n_tiles)?,
            grid_dim("attention", "y", s.kv_heads * plan.chunks * plan.splits)?,
        );
        // SAFETY: attention's (float*, uint16*, uint16*, int*, int*, int, int*, int*, int, int,
        // int, int, int, int, int, int, int, float, float*, int, float*, float*, float*); the
        // sinks, where read, one per query head (checked above); head_dim <=
        // ATT_MAX_HEAD_DIM and even, the shapes and the plan checked above (its tiles cut by
        // attention_plan to at most attention_rows rows, the kernel's per block); the part
        // buffers hold splits x rows outputs where split; the tables must cover every query's
        // positions (validated by the engine first). Blocks of 4 warps.
        unsafe { self.launch("attention", g, (32, 4), &mut a)? };
        if !split {
            return Ok(());
        }
        let mut a = [
            Arg::F32(&plan.part_o),
            Arg::F32(&plan.part_ml),
            Arg::Int(i("splits", plan.splits)?),
            Arg::Int(i("rows", rows)?),
            Arg::Int(i("head_dim", s.head_dim)?),
            Arg::F32(sinks.unwrap_or(q)),
            Arg::Int(i32::from(sinks.is_some())),
            Arg::Int(i("q_heads", s.q_heads)?),
            Arg::F32Mut(out),
        ];
        // SAFETY: attention_combine's (float*, float*, int, int, int, float*, int, int, float*);
        // the sinks, where read, one per query head (checked above); the part buffers
        // hold splits x rows outputs and (max, sum) pairs, out rows x head_dim floats (checked
        // above). A warp per row, 8 rows a block.
        unsafe { self.launch("attention_combine", (grid_dim("attention", "x", rows.div_ceil(8))?, 1), (32, 8), &mut a) }
    }

    /// Gated DeltaNet's recurrence over one sequence's next `x.tokens` rows (positions
    /// `start..`, the inputs' rows from `x.t0`), carrying the sequence's state (the
    /// [`DeltaShape::chunk_state_len`] floats of `state` from float `off`, the CPU's layout) as
    /// [`crate::deltanet::step`] does, outputs into `out`'s rows from `x.t0` (`v_heads * dv`
    /// each). A launch per chunk's segment: the chunk's start state where a row begins one
    /// (`delta_finish`), the segment's keys (`delta_keys`), its rows (`delta_rows`).
    fn delta_step(
        &self,
        state: &mut Self::Buf<f32>,
        off: usize,
        shape: DeltaShape,
        start: usize,
        x: &DeltaRows<'_, Self>,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let DeltaShape { k_heads, v_heads, dk, dv, .. } = shape;
        let (kd, vd, floats) = (k_heads * dk, v_heads * dv, shape.chunk_state_len());
        let end = x.t0 + x.tokens;
        check(
            "delta_step",
            k_heads > 0
                && v_heads.is_multiple_of(k_heads)
                && Self::len(state) >= off + floats
                && Self::len(x.q) >= end * kd
                && Self::len(x.k) >= end * kd
                && Self::len(x.v) >= end * vd
                && Self::len(x.g) >= end * v_heads
                && Self::len(x.beta) >= end * v_heads
                && Self::len(out) >= end * vd,
            || format!("{shape:?}, state at {off} of {} floats, rows {}..{end}", Self::len(state), x.t0),
        )?;
        let i = |what, v| int("delta_step", what, v);
        let (off, grouped) = (off as i64, i32::from(shape.grouped));
        let (k_heads, v_heads, dk, dv) = (i("k_heads", k_heads)?, i("v_heads", v_heads)?, i("dk", dk)?, i("dv", dv)?);
        let heads = grid_dim("delta_step", "x", shape.v_heads)?;
        let threads = (shape.dv.div_ceil(32) * 32).clamp(32, 1024) as u32;
        let mut done = 0;
        while done < x.tokens {
            let p = start + done;
            let (c0, par) = (p % CHUNK, (p / CHUNK % 2) as i32);
            let m = (CHUNK - c0).min(x.tokens - done);
            if c0 == 0 && p > 0 {
                let mut a = [
                    Arg::F32Mut(&mut *state),
                    Arg::Long(off),
                    Arg::Int(par),
                    Arg::Int(k_heads),
                    Arg::Int(v_heads),
                    Arg::Int(dk),
                    Arg::Int(dv),
                    Arg::Int(grouped),
                ];
                // SAFETY: delta_finish's (float*, long long, int, int, int, int, int, int); the
                // slot's floats lie inside the state (checked above); a block per value head.
                unsafe { self.launch("delta_finish", (heads, 1), (256, 1), &mut a)? };
            }
            let t0 = (x.t0 + done) as i64;
            let mut a = [
                Arg::F32Mut(&mut *state),
                Arg::Long(off),
                Arg::Int(par),
                Arg::Int(c0 as i32),
                Arg::F32(x.k),
                Arg::Long(t0),
                Arg::Int(m as i32),
                Arg::Int(i("kdim", kd)?),
            ];
            // SAFETY: delta_keys's (float*, long long, int, int, float*, long long, int, int);
            // rows c0..c0 + m of a chunk (m <= CHUNK - c0) of the slot, and m rows of k from t0
            // (checked above).
            unsafe { self.launch("delta_keys", elementwise(m * kd), (256, 1), &mut a)? };
            let mut a = [
                Arg::F32Mut(&mut *state),
                Arg::Long(off),
                Arg::Int(par),
                Arg::Int(c0 as i32),
                Arg::Int(m as i32),
                Arg::F32(x.q),
                Arg::F32(x.v),
                Arg::F32(x.g),
                Arg::F32(x.beta),
                Arg::Long(t0),
                Arg::F32Mut(&mut *out),
                Arg::Int(k_heads),
                Arg::Int(v_heads),
                Arg::Int(dk),
                Arg::Int(dv),
                Arg::Int(grouped),
            ];
            // SAFETY: delta_rows's (float*, long long, int, int, int, float*, float*, float*,
            // float*, long long, float*, int, int, int, int, int); the segment's rows of every
            // input and of out, and the slot, checked above; a block per value head, its
            // threads over the value rows.
            unsafe { self.launch("delta_rows", (heads, 1), (threads, 1), &mut a)? };
            done += m;
        }
        Ok(())
    }

    /// Gated DeltaNet's convolution and SiLU over one sequence's rows `t0..t0 + n` of `x`
    /// (`channels` a row, positions `start..`) into the same rows of `out`, the inputs before
    /// them from the sequence's ring (`ring_rows` rows of `channels` from float `ring_off` of
    /// `ring`), which then takes these rows (as [`crate::deltanet::conv`]); `taps` in
    /// [`crate::deltanet::conv_taps`]' layout.
    #[allow(clippy::too_many_arguments)]
    fn delta_conv(
        &self,
        x: &Self::Buf<f32>,
        (ring, ring_off, ring_rows): (&mut Self::Buf<f32>, usize, usize),
        taps: &Self::Buf<f32>,
        channels: usize,
        (start, t0, n): (usize, usize, usize),
        out: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let width = Self::len(taps) / channels.max(1);
        check(
            "delta_conv",
            channels > 0
                && width >= 1
                && Self::len(taps) == width * channels
                && ring_rows + 1 >= width
                && Self::len(ring) >= ring_off + ring_rows * channels
                && Self::len(x) >= (t0 + n) * channels
                && Self::len(out) >= (t0 + n) * channels,
            || format!("{channels} channels, {width} taps, ring of {ring_rows} at {ring_off}, rows {t0}..{}", t0 + n),
        )?;
        let i = |what, v| int("delta_conv", what, v);
        let (off, rows, ch, n32) = (ring_off as i64, i("rows", ring_rows)?, i("channels", channels)?, i("n", n)?);
        let mut a = [
            Arg::F32(x),
            Arg::F32(&*ring),
            Arg::Long(off),
            Arg::Int(rows),
            Arg::F32(taps),
            Arg::Int(i("width", width)?),
            Arg::Int(ch),
            Arg::Long(start as i64),
            Arg::Int(n32),
            Arg::Long(t0 as i64),
            Arg::F32Mut(out),
        ];
        // SAFETY: delta_conv's (float*, float*, long long, int, float*, int, int, long long,
        // int, long long, float*); rows t0..t0 + n of x and out, the ring's rows and the taps
        // checked above.
        unsafe { self.launch("delta_conv", elementwise(n * channels), (256, 1), &mut a)? };
        let mut a = [
            Arg::F32(x),
            Arg::F32Mut(ring),
            Arg::Long(off),
            Arg::Int(rows),
            Arg::Int(ch),
            Arg::Long(start as i64),
            Arg::Int(n32),
            Arg::Long(t0 as i64),
        ];
        // SAFETY: delta_ring's (float*, float*, long long, int, int, long long, int, long long);
        // as above.
        unsafe { self.launch("delta_ring", elementwise(n.min(ring_rows) * channels), (256, 1), &mut a) }
    }

    /// The convolved rows `xc` (`tokens` rows: `k_heads * dk` queries, as many keys, `vd`
    /// values) into `q`, `k` and `v`, every query and key head L2-normalized
    /// ([`crate::deltanet::l2_norm_each`]).
    #[allow(clippy::too_many_arguments)]
    fn delta_split(
        &self,
        xc: &Self::Buf<f32>,
        (k_heads, dk, vd): (usize, usize, usize),
        tokens: usize,
        eps: f32,
        q: &mut Self::Buf<f32>,
        k: &mut Self::Buf<f32>,
        v: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let kd = k_heads * dk;
        check(
            "delta_split",
            Self::len(xc) >= tokens * (2 * kd + vd)
                && Self::len(q) >= tokens * kd
                && Self::len(k) >= tokens * kd
                && Self::len(v) >= tokens * vd,
            || format!("{tokens} rows of {k_heads} x {dk} and {vd} from {}", Self::len(xc)),
        )?;
        let i = |what, x| int("delta_split", what, x);
        let mut a = [
            Arg::F32(xc),
            Arg::Int(i("k_heads", k_heads)?),
            Arg::Int(i("dk", dk)?),
            Arg::Int(i("vd", vd)?),
            Arg::Float(eps),
            Arg::F32Mut(q),
            Arg::F32Mut(k),
            Arg::F32Mut(v),
        ];
        // SAFETY: delta_split's (float*, int, int, int, float, float*, float*, float*); the
        // rows checked above; a block of 128 threads (a power of two, as its sum wants) a row.
        unsafe { self.launch("delta_split", (grid_dim("delta_split", "x", tokens)?, 1), (128, 1), &mut a) }
    }

    /// The log decays `g = softplus(alpha + dt_bias) * a` and write strengths
    /// `beta = sigmoid(b)` of every token's heads (`dt_bias.len()` heads a token).
    #[allow(clippy::too_many_arguments)]
    fn delta_gates(
        &self,
        alpha: &Self::Buf<f32>,
        b: &Self::Buf<f32>,
        dt_bias: &Self::Buf<f32>,
        a_log: &Self::Buf<f32>,
        tokens: usize,
        g: &mut Self::Buf<f32>,
        beta: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let heads = Self::len(dt_bias);
        let n = tokens * heads;
        check(
            "delta_gates",
            heads > 0
                && Self::len(a_log) == heads
                && Self::len(alpha) >= n
                && Self::len(b) >= n
                && Self::len(g) >= n
                && Self::len(beta) >= n,
            || format!("{tokens} tokens of {heads} heads"),
        )?;
        let mut a = [
            Arg::F32(alpha),
            Arg::F32(b),
            Arg::F32(dt_bias),
            Arg::F32(a_log),
            Arg::Int(int("delta_gates", "heads", heads)?),
            Arg::Long(tokens as i64),
            Arg::F32Mut(g),
            Arg::F32Mut(beta),
        ];
        // SAFETY: delta_gates's (float*, float*, float*, float*, int, long long, float*,
        // float*); every buffer's length checked above.
        unsafe { self.launch("delta_gates", elementwise(n), (256, 1), &mut a) }
    }
}

/// One sequence's inputs to [`KernelCalls::delta_step`]: `tokens` rows from row `t0` of the
/// queries and keys (`k_heads * dk` a row), values (`v_heads * dv`), log decays and write
/// strengths (`v_heads`).
pub struct DeltaRows<'a, S: Stream> {
    pub q: &'a S::Buf<f32>,
    pub k: &'a S::Buf<f32>,
    pub v: &'a S::Buf<f32>,
    pub g: &'a S::Buf<f32>,
    pub beta: &'a S::Buf<f32>,
    pub t0: usize,
    pub tokens: usize,
}

impl<S: Stream> KernelCalls for S {}
