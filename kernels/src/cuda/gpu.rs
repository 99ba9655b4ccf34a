//! The kernels on a GPU: [`Gpu`] holds the context, one stream, the loaded module and, where
//! `libcublas` is installed, a cuBLAS handle on the stream (prefill's large products), and is a
//! [`Stream`] whose buffers are device memory. Not yet run on a GPU (`tests/gpu/run` does that
//! where one is).

use super::device::{probe, CudaDevice};
use super::nvrtc::cached_cubin;
use super::stream::{Arg, Elem, GemmShape, GpuError, KernelTime, Stream};
use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::{
    sys::CUevent_flags, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

fn driver(e: cudarc::driver::DriverError) -> GpuError {
    GpuError::Driver(format!("{e:?}"))
}

/// The first GPU with the kernels loaded.
pub struct Gpu {
    pub device: CudaDevice,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    /// cuBLAS on `stream`; `None` without `libcublas` (the products then take `matvec`).
    blas: Option<CudaBlas>,
    /// While timing ([`Stream::set_timing`]): each launch's name and its start and end events.
    timed: Mutex<Option<Vec<TimedLaunch>>>,
}

/// A launch's name and the events recorded before and after it.
type TimedLaunch = (&'static str, CudaEvent, CudaEvent);

impl Gpu {
    /// Finds the GPU, compiles the kernels for it (or reads them from `cache_dir`) and loads them.
    pub fn open(cache_dir: &Path) -> Result<Gpu, GpuError> {
        let device = probe()?;
        let cubin = cached_cubin(&device.arch, cache_dir)?;
        let ctx = CudaContext::new(device.ordinal as usize).map_err(driver)?;
        // SAFETY: turns off cudarc's per-buffer events, which order a buffer's uses across
        // streams: every buffer, launch, copy and cuBLAS call here is on the one stream below,
        // so its uses are ordered by the stream itself (and each buffer skips two event
        // creations and destructions).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(driver)?;
        let mut funcs = HashMap::new();
        for name in super::KERNELS {
            funcs.insert(name, module.load_function(name).map_err(driver)?);
        }
        // SAFETY: only looks for the library (loading it if present); cudarc panics on the
        // first cuBLAS call without it, so no call is made unless it is there.
        let blas = if unsafe { blas::is_culib_present() } {
            Some(CudaBlas::new(stream.clone()).map_err(|e| GpuError::Driver(format!("cuBLAS: {e:?}")))?)
        } else {
            None
        };
        Ok(Gpu { device, stream, _module: module, funcs, blas, timed: Mutex::new(None) })
    }

    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver)
    }

    /// Runs `work` (one launch or product, named `name`) between two recorded events when
    /// timing, else just runs it.
    fn timed(&self, name: &'static str, work: impl FnOnce() -> Result<(), GpuError>) -> Result<(), GpuError> {
        let mut timed = self.timed.lock().map_err(|_| GpuError::Driver("the timing record is poisoned".into()))?;
        let Some(record) = timed.as_mut() else {
            drop(timed);
            return work();
        };
        let event = || {
            let e = self.stream.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver)?;
            e.record(&self.stream).map_err(driver)?;
            Ok::<_, GpuError>(e)
        };
        let start = event()?;
        work()?;
        record.push((name, start, event()?));
        Ok(())
    }
}

impl Stream for Gpu {
    type Buf<T: Elem> = CudaSlice<T>;

    fn describe(&self) -> String {
        let d = &self.device;
        let blas = if self.blas.is_some() { "cuBLAS" } else { "no cuBLAS" };
        format!("{} ({}, {} MiB, driver {}, {blas})", d.name, d.arch, d.memory_bytes >> 20, d.driver_version)
    }

    fn upload<T: Elem>(&self, data: &[T]) -> Result<CudaSlice<T>, GpuError> {
        if data.is_empty() {
            return self.zeros(0);
        }
        self.stream.clone_htod(data).map_err(driver)
    }

    fn zeros<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>, GpuError> {
        self.stream.alloc_zeros(n.max(1)).map_err(driver)
    }

    fn alloc<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>, GpuError> {
        // SAFETY: device memory of n elements, stream-ordered; `Elem` types are valid for any
        // bits, and the callers' kernels write it whole before it is read (this method's
        // contract), so nothing observes the unspecified contents as anything but numbers.
        unsafe { self.stream.alloc(n.max(1)) }.map_err(driver)
    }

    fn download<T: Elem>(&self, buf: &CudaSlice<T>) -> Result<Vec<T>, GpuError> {
        let v = self.stream.clone_dtoh(buf).map_err(driver)?;
        self.synchronize()?;
        Ok(v)
    }

    fn len<T: Elem>(buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>, GpuError> {
        self.stream.context().bind_to_thread().map_err(driver)?;
        Ok(Some(cudarc::driver::result::mem_get_info().map_err(driver)?))
    }

    unsafe fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32),
        block: (u32, u32),
        args: &mut [Arg<'_, Self>],
    ) -> Result<(), GpuError> {
        let f = self.funcs.get(name).ok_or_else(|| GpuError::Driver(format!("no kernel named {name}")))?;
        let mut b = self.stream.launch_builder(f);
        for a in args.iter_mut() {
            match a {
                Arg::U8(x) => b.arg(*x),
                Arg::U8Mut(x) => b.arg(&mut **x),
                Arg::I32(x) => b.arg(*x),
                Arg::I32Mut(x) => b.arg(&mut **x),
                Arg::U16(x) => b.arg(*x),
                Arg::U16Mut(x) => b.arg(&mut **x),
                Arg::F32(x) => b.arg(*x),
                Arg::F32Mut(x) => b.arg(&mut **x),
                Arg::Int(v) => b.arg(&*v),
                Arg::Long(v) => b.arg(&*v),
                Arg::Float(v) => b.arg(&*v),
            };
        }
        let cfg = LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (block.0, block.1, 1), shared_mem_bytes: 0 };
        self.timed(name, || {
            // SAFETY: the caller guarantees that `args` are the kernel's parameters and that the
            // buffers cover what it touches on this grid (this function's contract).
            unsafe { b.launch(cfg) }.map(drop).map_err(driver)
        })
    }

    fn set_timing(&self, on: bool) -> bool {
        if let Ok(mut t) = self.timed.lock() {
            *t = on.then(Vec::new);
        }
        true
    }

    fn take_timings(&self) -> Result<Vec<KernelTime>, GpuError> {
        let mut timed = self.timed.lock().map_err(|_| GpuError::Driver("the timing record is poisoned".into()))?;
        let Some(record) = timed.as_mut() else { return Ok(Vec::new()) };
        let mut out: Vec<KernelTime> = Vec::new();
        for (name, start, end) in record.drain(..) {
            // Waits for the end event: the launch has finished.
            let ms = f64::from(start.elapsed_ms(&end).map_err(driver)?);
            match out.iter_mut().find(|k| k.name == name) {
                Some(k) => {
                    k.launches += 1;
                    k.ms += ms;
                }
                None => out.push(KernelTime { name, launches: 1, ms }),
            }
        }
        Ok(out)
    }

    fn has_gemm(&self) -> bool {
        self.blas.is_some()
    }

    unsafe fn gemm_half(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        shape: GemmShape,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let blas_handle = self.blas.as_ref().ok_or_else(|| GpuError::Driver("cuBLAS is not installed".into()))?;
        let GemmShape { tokens, rows, cols, bf16 } = shape;
        let dim = |v: usize| i32::try_from(v).map_err(|_| GpuError::Driver(format!("gemm: {v} does not fit an int")));
        let (m, n, k) = (dim(rows)?, dim(tokens)?, dim(cols)?);
        let half = if bf16 { blas::cudaDataType::CUDA_R_16BF } else { blas::cudaDataType::CUDA_R_16F };
        let (alpha, beta) = (1f32, 0f32);
        // cuBLAS runs in the calling thread's current context: the engine thread's may be none.
        self.stream.context().bind_to_thread().map_err(driver)?;
        let (wp, _w) = w.device_ptr(&self.stream);
        let (xp, _x) = x.device_ptr(&self.stream);
        let (yp, _y) = y.device_ptr_mut(&self.stream);
        // Column-major, as cuBLAS sees row-major buffers: y (tokens x rows) is yᵀ, rows x tokens
        // with leading dimension rows; w (rows x cols) is wᵀ, cols x rows, taken transposed; x
        // (tokens x cols) is xᵀ, cols x tokens. So yᵀ = w · xᵀ: m = rows, n = tokens, k = cols.
        self.timed("gemm", || {
            // SAFETY: the pointers are the buffers' device memory, alive for the call (their guards
            // above); the caller guarantees they hold rows x cols, tokens x cols and tokens x rows
            // elements (this function's contract), which these dimensions read and write; alpha and
            // beta are host f32s, as CUBLAS_COMPUTE_32F wants.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas_handle.handle(),
                    blas::cublasOperation_t::CUBLAS_OP_T,
                    blas::cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast(),
                    wp as *const std::ffi::c_void,
                    half,
                    k,
                    xp as *const std::ffi::c_void,
                    half,
                    k,
                    (&beta as *const f32).cast(),
                    yp as *mut std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_32F,
                    m,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| GpuError::Driver(format!("cuBLAS gemm: {e:?}")))
        })
    }
}
