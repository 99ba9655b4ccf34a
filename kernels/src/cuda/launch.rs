//! The kernels on a GPU: [`Gpu`] holds the context, one stream and the loaded module, and has one
//! typed method per kernel that checks its buffers' lengths before the launch, so the unsafe
//! launches are confined here with the argument lists they must match (the kernels' signatures
//! in `kernels/cuda/*.cu`). Not yet run on a GPU (`tests/gpu/run` does that where one is).

use super::device::{probe, CudaDevice, CudaUnavailable};
use super::nvrtc::{cached_cubin, CompileError};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("{0}")]
    Unavailable(#[from] CudaUnavailable),
    #[error("{0}")]
    Compile(#[from] CompileError),
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("kernel {kernel}: {message}")]
    Shape { kernel: &'static str, message: String },
}

fn driver(e: cudarc::driver::DriverError) -> GpuError {
    GpuError::Driver(format!("{e:?}"))
}

/// The first GPU with the kernels loaded.
pub struct Gpu {
    pub device: CudaDevice,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
}

/// A kernel's launch geometry.
fn grid(blocks: (u32, u32), threads: (u32, u32)) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks.0, blocks.1, 1), block_dim: (threads.0, threads.1, 1), shared_mem_bytes: 0 }
}

/// Blocks of 256 threads for `n` elements, capped (the kernels stride over the rest).
fn elementwise(n: usize) -> LaunchConfig {
    grid((n.div_ceil(256).clamp(1, 4096) as u32, 1), (256, 1))
}

fn int(kernel: &'static str, what: &str, v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| GpuError::Shape { kernel, message: format!("{what} = {v} does not fit an int") })
}

fn check(kernel: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::Shape { kernel, message: message() })
    }
}

impl Gpu {
    /// Finds the GPU, compiles the kernels for it (or reads them from `cache_dir`) and loads them.
    pub fn open(cache_dir: &Path) -> Result<Gpu, GpuError> {
        let device = probe()?;
        let cubin = cached_cubin(&device.arch, cache_dir)?;
        let ctx = CudaContext::new(device.ordinal as usize).map_err(driver)?;
        let stream = ctx.default_stream();
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(driver)?;
        let mut funcs = HashMap::new();
        for name in super::KERNELS {
            funcs.insert(name, module.load_function(name).map_err(driver)?);
        }
        Ok(Gpu { device, stream, _module: module, funcs })
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, GpuError> {
        self.stream.clone_htod(data).map_err(driver)
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, GpuError> {
        self.stream.alloc_zeros(n.max(1)).map_err(driver)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, data: &CudaSlice<T>) -> Result<Vec<T>, GpuError> {
        self.stream.clone_dtoh(data).map_err(driver)
    }

    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver)
    }

    fn func(&self, name: &'static str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// `out[t] = scale * row ids[t]` of a `type` table of `row_bytes`-byte rows of `cols` weights.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        table: &CudaSlice<u8>,
        ggml_type: u32,
        row_bytes: usize,
        ids: &CudaSlice<i32>,
        cols: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let tokens = ids.len();
        check("embed", out.len() >= tokens * cols, || format!("{} outputs for {tokens} x {cols}", out.len()))?;
        let (ty, rb, cols_i) = (ggml_type as i32, row_bytes as i64, int("embed", "cols", cols)?);
        let mut b = self.stream.launch_builder(self.func("embed"));
        b.arg(table).arg(&ty).arg(&rb).arg(ids).arg(&cols_i).arg(&scale).arg(out);
        // SAFETY: the arguments are embed's (uint8*, int, long long, int*, int, float, float*);
        // every id must index a row of `table` (the caller's tokens are checked against the
        // vocabulary), `out` holds tokens * cols floats (checked above).
        unsafe { b.launch(grid((int("embed", "tokens", tokens)? as u32, 1), (256, 1))) }.map_err(driver)?;
        Ok(())
    }

    /// `y = x * w / rms(x)` for each of the `rows` pieces of `n` floats.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        n: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let rows = x.len() / n.max(1);
        check("rms_norm", w.len() == n && y.len() >= rows * n && x.len() == rows * n, || {
            format!("x {} w {} y {} for pieces of {n}", x.len(), w.len(), y.len())
        })?;
        let n_i = int("rms_norm", "n", n)?;
        let mut b = self.stream.launch_builder(self.func("rms_norm"));
        b.arg(x).arg(w).arg(y).arg(&n_i).arg(&eps);
        // SAFETY: rms_norm's (float*, float*, float*, int, float); lengths checked above; one
        // block per piece, 256 threads (a multiple of 32, as block_sum wants).
        unsafe { b.launch(grid((int("rms_norm", "rows", rows)? as u32, 1), (256, 1))) }.map_err(driver)?;
        Ok(())
    }

    /// Rotates the first `2 pairs` dimensions of every head of every token (see rope in ops.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        inv_freq: &CudaSlice<f32>,
        heads: usize,
        head_dim: usize,
        neox: bool,
        scale: f32,
    ) -> Result<(), GpuError> {
        let (tokens, pairs) = (pos.len(), inv_freq.len());
        check("rope", x.len() == tokens * heads * head_dim && 2 * pairs <= head_dim, || {
            format!("x {} for {tokens} tokens of {heads} heads of {head_dim}, {pairs} pairs", x.len())
        })?;
        let (h, hd, p, nx) =
            (int("rope", "heads", heads)?, int("rope", "head_dim", head_dim)?, pairs as i32, i32::from(neox));
        let mut b = self.stream.launch_builder(self.func("rope"));
        b.arg(x).arg(pos).arg(inv_freq).arg(&h).arg(&hd).arg(&p).arg(&nx).arg(&scale);
        // SAFETY: rope's (float*, int*, float*, int, int, int, int, float); lengths checked above.
        unsafe { b.launch(grid((int("rope", "tokens", tokens)? as u32, 1), (128, 1))) }.map_err(driver)?;
        Ok(())
    }

    /// `gate = act(gate) * up` (GeGLU when `gelu`, else SwiGLU).
    pub fn gated_act(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, gelu: bool) -> Result<(), GpuError> {
        let n = gate.len();
        check("gated_act", up.len() == n, || format!("gate {n} up {}", up.len()))?;
        let (n_l, g) = (n as i64, i32::from(gelu));
        let mut b = self.stream.launch_builder(self.func("gated_act"));
        b.arg(gate).arg(up).arg(&n_l).arg(&g);
        // SAFETY: gated_act's (float*, float*, long long, int); equal lengths checked above.
        unsafe { b.launch(elementwise(n)) }.map_err(driver)?;
        Ok(())
    }

    /// `x += y`.
    pub fn add_in_place(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), GpuError> {
        let n = x.len();
        check("add_in_place", y.len() == n, || format!("x {n} y {}", y.len()))?;
        let n_l = n as i64;
        let mut b = self.stream.launch_builder(self.func("add_in_place"));
        b.arg(x).arg(y).arg(&n_l);
        // SAFETY: add_in_place's (float*, float*, long long); equal lengths checked above.
        unsafe { b.launch(elementwise(n)) }.map_err(driver)?;
        Ok(())
    }

    /// `y[t * rows + r] = Σ_k W[r][k] x[t * cols + k]` for up to 8 tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        w: &CudaSlice<u8>,
        ggml_type: u32,
        row_bytes: usize,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let tokens = x.len() / cols.max(1);
        check(
            "matvec",
            (1..=8).contains(&tokens)
                && x.len() == tokens * cols
                && w.len() >= rows * row_bytes
                && y.len() >= rows * tokens,
            || format!("w {} x {} y {} for {rows} x {cols}, {tokens} tokens", w.len(), x.len(), y.len()),
        )?;
        let (ty, rb, r, c, t) = (
            ggml_type as i32,
            row_bytes as i64,
            int("matvec", "rows", rows)?,
            int("matvec", "cols", cols)?,
            tokens as i32,
        );
        let mut b = self.stream.launch_builder(self.func("matvec"));
        b.arg(w).arg(&ty).arg(&rb).arg(&r).arg(&c).arg(x).arg(&t).arg(y);
        // SAFETY: matvec's (uint8*, int, long long, int, int, float*, int, float*); lengths
        // checked above; blocks of 32 x 8 threads, a warp per row.
        unsafe { b.launch(grid((rows.div_ceil(8) as u32, 1), (32, 8))) }.map_err(driver)?;
        Ok(())
    }

    /// `y[t * n + i] += bias[i]`.
    pub fn add_bias(&self, y: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), GpuError> {
        let n = bias.len();
        check("add_bias", n > 0 && y.len().is_multiple_of(n), || format!("y {} bias {n}", y.len()))?;
        let (n_i, t) = (int("add_bias", "n", n)?, int("add_bias", "tokens", y.len() / n)?);
        let cfg = elementwise(y.len());
        let mut b = self.stream.launch_builder(self.func("add_bias"));
        b.arg(y).arg(bias).arg(&n_i).arg(&t);
        // SAFETY: add_bias's (float*, float*, int, int); lengths checked above.
        unsafe { b.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// The K and V rows of `slot.len()` tokens into their cache slots (f16 bits).
    pub fn kv_store(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        slot: &CudaSlice<i32>,
        kv_dim: usize,
    ) -> Result<(), GpuError> {
        let n = slot.len();
        check("kv_store", k.len() == n * kv_dim && v.len() == n * kv_dim && k_cache.len() == v_cache.len(), || {
            format!("k {} v {} for {n} tokens of {kv_dim}", k.len(), v.len())
        })?;
        let d = int("kv_store", "kv_dim", kv_dim)?;
        let mut b = self.stream.launch_builder(self.func("kv_store"));
        b.arg(k).arg(v).arg(k_cache).arg(v_cache).arg(slot).arg(&d);
        // SAFETY: kv_store's (float*, float*, uint16*, uint16*, int*, int); every slot must be
        // inside the pool (the engine's block tables are validated against it first).
        unsafe { b.launch(grid((int("kv_store", "tokens", n)? as u32, 1), (256, 1))) }.map_err(driver)?;
        Ok(())
    }

    /// Copies whole blocks of `block_elems` halves, `pairs` = [src0, dst0, src1, dst1, ...].
    pub fn kv_copy_blocks(
        &self,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        pairs: &CudaSlice<i32>,
        block_elems: usize,
    ) -> Result<(), GpuError> {
        let copies = pairs.len() / 2;
        if copies == 0 {
            return Ok(());
        }
        let e = block_elems as i64;
        let mut b = self.stream.launch_builder(self.func("kv_copy_blocks"));
        b.arg(k_cache).arg(v_cache).arg(pairs).arg(&e);
        // SAFETY: kv_copy_blocks's (uint16*, uint16*, int*, long long); the block ids must lie
        // inside the pool (the engine validates them first).
        unsafe { b.launch(grid((block_elems.div_ceil(256).min(1024) as u32, copies as u32), (256, 1))) }
            .map_err(driver)?;
        Ok(())
    }

    /// Attention of every query over its sequence's blocks (see attention.cu); `geometry` is
    /// ((query heads, KV heads), head_dim, block_size, window, scale).
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::type_complexity)]
    pub fn attention(
        &self,
        q: &CudaSlice<f32>,
        caches: (&CudaSlice<u16>, &CudaSlice<u16>),
        tables: &CudaSlice<i32>,
        table_of: &CudaSlice<i32>,
        table_len: usize,
        q_pos: &CudaSlice<i32>,
        geometry: ((usize, usize), usize, usize, Option<usize>, f32),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (heads, head_dim, block_size, window, scale) = geometry;
        let (tokens, (q_heads, kv_heads)) = (q_pos.len(), heads);
        check(
            "attention",
            head_dim <= 256
                && kv_heads > 0
                && q_heads.is_multiple_of(kv_heads)
                && q.len() == tokens * q_heads * head_dim
                && out.len() >= q.len()
                && table_of.len() == tokens,
            || format!("q {} out {} for {tokens} queries of {q_heads} heads of {head_dim}", q.len(), out.len()),
        )?;
        let a = [table_len, q_heads, kv_heads, head_dim, block_size, window.unwrap_or(0)]
            .map(|v| i32::try_from(v).unwrap_or(i32::MAX));
        let mut b = self.stream.launch_builder(self.func("attention"));
        b.arg(q).arg(caches.0).arg(caches.1).arg(tables).arg(table_of).arg(&a[0]).arg(q_pos);
        b.arg(&a[1]).arg(&a[2]).arg(&a[3]).arg(&a[4]).arg(&a[5]).arg(&scale).arg(out);
        // SAFETY: attention's (float*, uint16*, uint16*, int*, int*, int, int*, int, int, int,
        // int, int, float, float*); head_dim <= ATT_MAX_HEAD_DIM and the shapes checked above;
        // the tables must cover every query's positions (validated by the engine first). A
        // warp per (query, head), 4 heads per block.
        unsafe { b.launch(grid((tokens as u32, q_heads.div_ceil(4) as u32), (32, 4))) }.map_err(driver)?;
        Ok(())
    }
}
