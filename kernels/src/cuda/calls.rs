//! One typed call per kernel of `kernels/cuda`, on any [`Stream`]: each checks its buffers'
//! lengths against the shape it is given, then launches with the argument list the kernel's
//! signature wants and the geometry the kernel is written for. The unsafe launches are confined
//! here, each beside the signature it must match.

use super::stream::{Arg, GemmShape, GpuError, Stream};

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
        // SAFETY: rms_norm's (float*, float*, float*, int, float); lengths checked above; one
        // block per piece, 256 threads (a multiple of 32, as block_sum wants).
        unsafe { self.launch("rms_norm", (grid_dim("rms_norm", "x", rows)?, 1), (256, 1), &mut a) }
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

    /// `gate = act(gate) * up` (GeGLU when `gelu`, else SwiGLU).
    fn gated_act(&self, gate: &mut Self::Buf<f32>, up: &Self::Buf<f32>, gelu: bool) -> Result<(), GpuError> {
        let n = Self::len(gate);
        check("gated_act", Self::len(up) == n, || format!("gate {n} up {}", Self::len(up)))?;
        let mut a = [Arg::F32Mut(gate), Arg::F32(up), Arg::Long(n as i64), Arg::Int(i32::from(gelu))];
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

    /// Attention of every query over its sequence's blocks (see attention.cu): query `t` sits
    /// at position `q_pos[t]` and reads table `table_of[t]` of `tables` (`table_len` entries
    /// each).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf<f32>,
        caches: (&Self::Buf<u16>, &Self::Buf<u16>),
        tables: &Self::Buf<i32>,
        table_of: &Self::Buf<i32>,
        table_len: usize,
        q_pos: &Self::Buf<i32>,
        s: AttentionShape,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError> {
        let tokens = Self::len(q_pos);
        check(
            "attention",
            s.head_dim <= 256
                && s.kv_heads > 0
                && s.q_heads.is_multiple_of(s.kv_heads)
                && Self::len(q) == tokens * s.q_heads * s.head_dim
                && Self::len(out) >= Self::len(q)
                && Self::len(table_of) == tokens,
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
        let i = |what, v| int("attention", what, v);
        let mut a = [
            Arg::F32(q),
            Arg::U16(caches.0),
            Arg::U16(caches.1),
            Arg::I32(tables),
            Arg::I32(table_of),
            Arg::Int(i("table_len", table_len)?),
            Arg::I32(q_pos),
            Arg::Int(i("q_heads", s.q_heads)?),
            Arg::Int(i("kv_heads", s.kv_heads)?),
            Arg::Int(i("head_dim", s.head_dim)?),
            Arg::Int(i("block_size", s.block_size)?),
            Arg::Int(i("window", s.window.unwrap_or(0))?),
            Arg::Float(s.scale),
            Arg::F32Mut(out),
        ];
        let g = (grid_dim("attention", "x", tokens)?, grid_dim("attention", "y", s.q_heads.div_ceil(4))?);
        // SAFETY: attention's (float*, uint16*, uint16*, int*, int*, int, int*, int, int, int,
        // int, int, float, float*); head_dim <= ATT_MAX_HEAD_DIM and the shapes checked above;
        // the tables must cover every query's positions (validated by the engine first). A
        // warp per (query, head), 4 heads per block.
        unsafe { self.launch("attention", g, (32, 4), &mut a) }
    }
}

impl<S: Stream> KernelCalls for S {}
