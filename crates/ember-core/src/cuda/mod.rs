//! The CUDA backend, as `torch.cuda`. Everything here goes through `cudarc` with dynamic
//! loading, so one binary runs on machines with and without a GPU: without a driver or a
//! device, [`is_available`] is false and every call that needs a GPU returns
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable), never a panic.
//!
//! This module holds the device runtime (discovery, properties, the libraries found); the
//! allocator, streams, kernels and BLAS come next, one file each.

mod device;
mod libraries;

pub use device::{
    device_count, driver_version, get_arch_list, get_device_capability, get_device_name,
    get_device_properties, is_available, DeviceProperties,
};
pub use libraries::{library_report, LibraryStatus};
