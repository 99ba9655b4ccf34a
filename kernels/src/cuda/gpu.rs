//! The kernels on a GPU: [`Gpu`] holds the context, one stream and the loaded module, and is a
//! [`Stream`] whose buffers are device memory. Not yet run on a GPU (`tests/gpu/run` does that
//! where one is).

use super::device::{probe, CudaDevice};
use super::nvrtc::cached_cubin;
use super::stream::{Arg, Elem, GpuError, Stream};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

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

    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver)
    }
}

impl Stream for Gpu {
    type Buf<T: Elem> = CudaSlice<T>;

    fn describe(&self) -> String {
        let d = &self.device;
        format!("{} ({}, {} MiB, driver {})", d.name, d.arch, d.memory_bytes >> 20, d.driver_version)
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
                Arg::I32(x) => b.arg(*x),
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
        // SAFETY: the caller guarantees that `args` are the kernel's parameters and that the
        // buffers cover what it touches on this grid (this function's contract).
        unsafe { b.launch(cfg) }.map_err(driver)?;
        Ok(())
    }
}
