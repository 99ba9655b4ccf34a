//! Finding an NVIDIA GPU through the driver API, loaded at run time: on a machine without the
//! driver (`libcuda.so.1`) or without a GPU the answer is an error that says which, never a
//! panic (cudarc panics on its first call into a library that is missing, so its presence is
//! checked first).

use cudarc::driver::{result, sys};

/// The first GPU, as the backend and the status reports describe it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: i32,
    pub name: String,
    /// Compute capability as NVRTC's architecture name (`sm_90` for an H100 or H200).
    pub arch: String,
    pub memory_bytes: usize,
    /// The driver's CUDA version, e.g. 12040 for 12.4.
    pub driver_version: i32,
}

/// Why no GPU can be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CudaUnavailable {
    #[error("the NVIDIA driver library (libcuda.so.1) is not installed")]
    NoDriver,
    #[error("the NVIDIA driver did not start: {0}")]
    Init(String),
    #[error("the NVIDIA driver sees no GPU")]
    NoDevice,
    #[error("querying the GPU failed: {0}")]
    Query(String),
}

/// True when `libcuda` can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its names (libloading), calls nothing in it.
    unsafe { sys::is_culib_present() }
}

/// The first GPU, or why there is none.
pub fn probe() -> Result<CudaDevice, CudaUnavailable> {
    if !driver_present() {
        return Err(CudaUnavailable::NoDriver);
    }
    result::init().map_err(|e| CudaUnavailable::Init(format!("{e:?}")))?;
    let query = |e: cudarc::driver::DriverError| CudaUnavailable::Query(format!("{e:?}"));
    if result::device::get_count().map_err(query)? == 0 {
        return Err(CudaUnavailable::NoDevice);
    }
    let dev = result::device::get(0).map_err(query)?;
    let attr = |a| {
        // SAFETY: `dev` is a device handle the driver returned; `a` a valid attribute.
        unsafe { result::device::get_attribute(dev, a) }.map_err(query)
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // SAFETY: as above.
    let memory_bytes = unsafe { result::device::total_mem(dev) }.map_err(query)?;
    let mut driver_version = 0;
    // SAFETY: the library is loaded and initialized; a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result().map_err(query)?;
    Ok(CudaDevice {
        ordinal: 0,
        name: result::device::get_name(dev).map_err(query)?,
        arch: format!("sm_{major}{minor}"),
        memory_bytes,
        driver_version,
    })
}
