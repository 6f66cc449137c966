//! Device discovery and properties through the CUDA driver API.
//!
//! Note [Driver probing]: cudarc's dynamic loader panics if a function is called while
//! `libcuda` is missing, so [`driver`] first checks that the library loads
//! (`is_culib_present`) and then calls `cuInit` once; the outcome is cached for the process.
//! Every public function starts from [`driver`], so none can reach a cudarc call without a
//! loaded driver.

use crate::{Error, Result};
use cudarc::driver::{result, sys};
use std::sync::OnceLock;

/// Why CUDA cannot be used, or the number of devices when it can.
fn driver() -> std::result::Result<usize, &'static str> {
    static STATE: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let state = STATE.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to open the library; it calls no CUDA function.
        if !unsafe { sys::is_culib_present() } {
            return Err("the NVIDIA driver library (libcuda) was not found".into());
        }
        result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
        let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
        if n <= 0 {
            return Err("the driver reports no CUDA devices".into());
        }
        Ok(n as usize)
    });
    state.as_ref().map(|&n| n).map_err(|e| e.as_str())
}

fn unavailable(reason: &str) -> Error {
    Error::CudaUnavailable {
        reason: reason.to_string(),
    }
}

/// The driver's handle of device `ordinal`, or a typed error.
fn device(ordinal: usize) -> Result<sys::CUdevice> {
    let count = driver().map_err(unavailable)?;
    if ordinal >= count {
        return Err(Error::invalid(
            "cuda device",
            format!("device ordinal {ordinal} is out of range: {count} CUDA device(s) present"),
        ));
    }
    result::device::get(ordinal as i32)
        .map_err(|e| unavailable(&format!("cuDeviceGet({ordinal}) failed: {e:?}")))
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from `result::device::get` after a successful `cuInit`.
    unsafe { result::device::get_attribute(dev, attr) }
        .map_err(|e| unavailable(&format!("cuDeviceGetAttribute({attr:?}) failed: {e:?}")))
}

/// True when a CUDA driver is loaded and at least one device is present (`torch.cuda.is_available`).
pub fn is_available() -> bool {
    driver().is_ok()
}

/// Number of CUDA devices; 0 when CUDA is unavailable (`torch.cuda.device_count`).
pub fn device_count() -> usize {
    driver().unwrap_or(0)
}

/// The driver's CUDA version as `major * 1000 + minor * 10` (e.g. 13000), if a driver loads.
pub fn driver_version() -> Option<i32> {
    driver().ok()?;
    let mut v = 0;
    // SAFETY: the driver library is loaded and initialized (see `driver`); `v` is a valid out pointer.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result().ok()?;
    Some(v)
}

/// What `torch.cuda.get_device_properties` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProperties {
    pub name: String,
    pub major: u32,
    pub minor: u32,
    /// Bytes of device memory.
    pub total_memory: usize,
    pub multi_processor_count: u32,
    pub max_threads_per_multi_processor: u32,
    /// Bytes of L2 cache.
    pub l2_cache_size: u32,
    pub warp_size: u32,
}

/// Name of device `ordinal` (`torch.cuda.get_device_name`).
pub fn get_device_name(ordinal: usize) -> Result<String> {
    let dev = device(ordinal)?;
    result::device::get_name(dev).map_err(|e| unavailable(&format!("cuDeviceGetName failed: {e:?}")))
}

/// Compute capability `(major, minor)` of device `ordinal` (`torch.cuda.get_device_capability`).
pub fn get_device_capability(ordinal: usize) -> Result<(u32, u32)> {
    let dev = device(ordinal)?;
    use sys::CUdevice_attribute::*;
    let major = attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok((major as u32, minor as u32))
}

/// Properties of device `ordinal` (`torch.cuda.get_device_properties`).
pub fn get_device_properties(ordinal: usize) -> Result<DeviceProperties> {
    let dev = device(ordinal)?;
    use sys::CUdevice_attribute::*;
    let (major, minor) = get_device_capability(ordinal)?;
    // SAFETY: `dev` came from `result::device::get` after a successful `cuInit`.
    let total_memory = unsafe { result::device::total_mem(dev) }
        .map_err(|e| unavailable(&format!("cuDeviceTotalMem failed: {e:?}")))?;
    Ok(DeviceProperties {
        name: get_device_name(ordinal)?,
        major,
        minor,
        total_memory,
        multi_processor_count: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        max_threads_per_multi_processor: attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?
            as u32,
        l2_cache_size: attribute(dev, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u32,
        warp_size: attribute(dev, CU_DEVICE_ATTRIBUTE_WARP_SIZE)? as u32,
    })
}

/// The architectures kernels are compiled for: one `sm_XY` per present device, deduplicated
/// (`torch.cuda.get_arch_list`; ember compiles with NVRTC for the exact device, so this is the
/// list of devices' architectures rather than a fixed build list). Empty without CUDA.
pub fn get_arch_list() -> Vec<String> {
    let mut archs: Vec<String> = (0..device_count())
        .filter_map(|i| get_device_capability(i).ok())
        .map(|(major, minor)| format!("sm_{major}{minor}"))
        .collect();
    archs.sort();
    archs.dedup();
    archs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_without_a_device_are_typed_errors() {
        if is_available() {
            return; // the GPU tests cover this machine
        }
        assert_eq!(device_count(), 0);
        assert!(get_arch_list().is_empty());
        assert!(matches!(
            get_device_properties(0),
            Err(Error::CudaUnavailable { .. })
        ));
        assert!(matches!(get_device_name(0), Err(Error::CudaUnavailable { .. })));
    }
}
