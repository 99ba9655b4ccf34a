//! Where the CUDA kernels run: a [`Stream`] holds buffers of its own kind and launches a kernel
//! of `kernels/cuda` by name on a grid with an argument list. The GPU ([`super::gpu::Gpu`]) is
//! one; the host emulation ([`super::host::Host`], the sources compiled as C++ against
//! `host_shim.h`) is the other, so the typed launches ([`super::calls::KernelCalls`]) and the CUDA
//! backend's forward pass are one code, tested on any machine and run on the GPU.

use super::device::CudaUnavailable;
use super::nvrtc::CompileError;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

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
    #[error("host emulation of the kernels: {0}")]
    Host(String),
}

/// An element type of device buffers: the kernels' `uint8_t`, `uint16_t` (f16 bits), `int` and
/// `float`.
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + Unpin + 'static {
    /// Appends the little-endian bytes.
    fn put(self, out: &mut Vec<u8>);
    /// Reads one value from the front of `b` (at least `size_of::<Self>()` bytes).
    fn get(b: &[u8]) -> Self;
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..std::mem::size_of::<$t>()]);
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}
elem!(u8, u16, i32, f32);

/// One argument of a launch, in the kernel's parameter order: a buffer (read, or written
/// `Mut`) or a scalar (`int`, `long long`, `float`).
pub enum Arg<'a, S: Stream + ?Sized> {
    U8(&'a S::Buf<u8>),
    U8Mut(&'a mut S::Buf<u8>),
    I32(&'a S::Buf<i32>),
    I32Mut(&'a mut S::Buf<i32>),
    U16(&'a S::Buf<u16>),
    U16Mut(&'a mut S::Buf<u16>),
    F32(&'a S::Buf<f32>),
    F32Mut(&'a mut S::Buf<f32>),
    Int(i32),
    Long(i64),
    Float(f32),
}

/// A product of halves: `y[t * rows + r] = Σ_k w[r * cols + k] · x[t * cols + k]` for `tokens`
/// rows of `x`, the halves f16 (bf16 when `bf16`), accumulated in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub tokens: usize,
    pub rows: usize,
    pub cols: usize,
    pub bf16: bool,
}

/// One kernel's share of the launches timed ([`Stream::set_timing`]): how many ran and the
/// device's time between their start and end events, summed.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel's name, or `gemm` for the product of halves.
    pub name: &'static str,
    pub launches: usize,
    pub ms: f64,
}

/// A place the kernels run, in order of launch.
pub trait Stream {
    /// A buffer of `T`s in this stream's memory.
    type Buf<T: Elem>: Send;

    /// What runs the kernels, for reports.
    fn describe(&self) -> String;
    fn upload<T: Elem>(&self, data: &[T]) -> Result<Self::Buf<T>, GpuError>;
    /// `n` zeros (a buffer of at least one element, so that it has an address).
    fn zeros<T: Elem>(&self, n: usize) -> Result<Self::Buf<T>, GpuError>;
    /// A buffer of `n` elements whose contents are unspecified (any bits are a valid `T`), for
    /// a kernel's output that it writes whole before anything reads it: on a GPU, no clearing
    /// pass. The host emulation clears it anyway.
    fn alloc<T: Elem>(&self, n: usize) -> Result<Self::Buf<T>, GpuError> {
        self.zeros(n)
    }
    /// The buffer's contents, once every launch before has finished.
    fn download<T: Elem>(&self, buf: &Self::Buf<T>) -> Result<Vec<T>, GpuError>;
    fn len<T: Elem>(buf: &Self::Buf<T>) -> usize;
    /// Free and total bytes of the stream's memory, where it is a device's (not the host's).
    fn device_memory(&self) -> Result<Option<(usize, usize)>, GpuError>;

    /// Runs kernel `name` on `grid` blocks of `block` threads.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and every buffer
    /// must hold what the kernel reads and writes for this grid: on a GPU a mismatch reads or
    /// writes memory it does not own. The typed calls of [`super::calls::KernelCalls`] check
    /// this before they launch.
    unsafe fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32),
        block: (u32, u32),
        args: &mut [Arg<'_, Self>],
    ) -> Result<(), GpuError>;

    /// Starts timing every launch and product on the device (a fresh record), or stops; false
    /// where the stream has no device clock to time with (the host emulation).
    fn set_timing(&self, on: bool) -> bool {
        let _ = on;
        false
    }

    /// The launches timed since timing started or was last taken, per kernel in order of first
    /// launch, once they have finished; the record starts over. Empty when not timing.
    fn take_timings(&self) -> Result<Vec<KernelTime>, GpuError> {
        Ok(Vec::new())
    }

    /// Whether [`Stream::gemm_half`] runs here (on a GPU: cuBLAS was found).
    fn has_gemm(&self) -> bool;

    /// The product `shape` names, of `w` (`rows × cols` halves) and `x` (`tokens × cols`), into
    /// `y` (`tokens × rows`): cuBLAS on a GPU.
    ///
    /// # Safety
    /// Every buffer must hold what `shape` says it does: on a GPU a shorter one is read or
    /// written past its end. [`super::calls::KernelCalls::gemm`] checks this first.
    unsafe fn gemm_half(
        &self,
        w: &Self::Buf<u16>,
        x: &Self::Buf<u16>,
        shape: GemmShape,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), GpuError>;
}
