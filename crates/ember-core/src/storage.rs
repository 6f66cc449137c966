//! [`Storage`]: the backend boundary. A tensor's elements live in one `Storage`, which is an
//! enum over backends; every op family adds an `impl Storage` block (in `ops/`) that matches
//! on the backend and calls its kernel, so adding the CUDA backend means adding one arm per
//! family, not changing any caller.
//!
//! Storage is shared between views through [`StorageRef`], which also carries the version
//! counter that autograd checks for in-place modification (see `autograd::SavedTensor`).

use crate::cpu::CpuStorage;
use crate::cuda::CudaStorage;
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Elements of one tensor storage on one backend.
#[derive(Debug, Clone)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => s.device(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        }
    }

    /// Number of elements held.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            Storage::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Shared handle to a storage and its version counter: all views of a tensor hold the same one.
#[derive(Debug, Clone)]
pub struct StorageRef(Arc<StorageCell>);

#[derive(Debug)]
struct StorageCell {
    /// The page-lock registration of a pinned host buffer; declared before `data` so it is
    /// undone before the buffer is freed (Note [Pinned host memory] in `cuda/pinned.rs`).
    pin: Option<crate::cuda::HostPin>,
    data: RwLock<Storage>,
    /// Bumped by every in-place write; autograd compares it with the version saved at record time.
    version: AtomicU64,
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        // A pinned buffer goes back to the pinned host cache, registration and all
        // (Note [Pinned host cache] in `cuda/pinned.rs`).
        if let Some(pin) = self.pin.take() {
            let empty = Storage::Cpu(CpuStorage::Bool(Vec::new()));
            let data = std::mem::replace(self.data.get_mut().unwrap_or_else(|e| e.into_inner()), empty);
            match data {
                Storage::Cpu(cpu) => crate::cuda::recycle_pinned(cpu, pin),
                other => {
                    drop(pin);
                    drop(other);
                }
            }
        }
    }
}

impl StorageRef {
    pub fn new(storage: Storage) -> StorageRef {
        StorageRef(Arc::new(StorageCell {
            pin: None,
            data: RwLock::new(storage),
            version: AtomicU64::new(0),
        }))
    }

    /// A host storage whose buffer `pin` has page-locked.
    pub(crate) fn new_pinned(storage: Storage, pin: crate::cuda::HostPin) -> StorageRef {
        StorageRef(Arc::new(StorageCell {
            pin: Some(pin),
            data: RwLock::new(storage),
            version: AtomicU64::new(0),
        }))
    }

    /// True for page-locked host storage.
    pub fn is_pinned(&self) -> bool {
        self.0.pin.is_some()
    }

    /// Read access. Poisoning cannot leave a storage half-written in a way readers could
    /// observe differently from a completed write, so a poisoned lock is still read.
    pub fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.0.data.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Write access for in-place ops; bumps the version counter.
    pub fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.0.version.fetch_add(1, Ordering::Relaxed);
        self.0.data.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn version(&self) -> u64 {
        self.0.version.load(Ordering::Relaxed)
    }

    /// Bumps the version counter without writing (for `mark_dirty`-like uses).
    pub fn bump_version(&self) {
        self.0.version.fetch_add(1, Ordering::Relaxed);
    }

    /// True when no other tensor or view holds this storage.
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }

    /// An identity of the shared storage (equal for two handles exactly when
    /// [`StorageRef::same_storage`]), for sorting and hashing.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    pub fn same_storage(&self, other: &StorageRef) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Storage {
    /// Moves host elements onto `device`.
    pub fn from_cpu(cpu: CpuStorage, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(cpu)),
            Device::Cuda(i) => Ok(Storage::Cuda(CudaStorage::from_cpu(&cpu, i)?)),
        }
    }

    /// `n` elements of `dtype`, all `value`, on `device`.
    pub fn full(device: Device, dtype: DType, n: usize, value: f64) -> Result<Storage> {
        match device {
            Device::Cpu => CpuStorage::full(dtype, n, value).map(Storage::Cpu).ok_or_else(|| {
                Error::invalid(
                    "allocate",
                    format!(
                        "cannot allocate {n} elements of {dtype} ({} bytes) in host memory; use a smaller shape",
                        n.saturating_mul(dtype.size_in_bytes())
                    ),
                )
            }),
            Device::Cuda(i) => Ok(Storage::Cuda(CudaStorage::full(i, dtype, n, value)?)),
        }
    }

    /// The elements of `layout` in a new row-major storage of `dtype` on the same device.
    pub fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.to_dtype(layout, dtype))),
            Storage::Cuda(s) => Ok(Storage::Cuda(s.to_dtype(layout, dtype)?)),
        }
    }

    /// The elements of `layout` copied to host memory, row-major.
    pub fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s.contiguous(layout)),
            Storage::Cuda(s) => s.to_cpu(layout),
        }
    }

    /// Writes `src` viewed through `src_layout` into `self` at `dst_layout` (same shapes),
    /// converting dtype; copies across devices when they differ.
    pub fn copy_strided_from(
        &mut self,
        dst_layout: &Layout,
        src: &Storage,
        src_layout: &Layout,
    ) -> Result<()> {
        match (self, src) {
            (Storage::Cpu(d), Storage::Cpu(s)) => {
                d.copy_strided_from(dst_layout, s, src_layout);
                Ok(())
            }
            (Storage::Cuda(d), src) => d.copy_strided_from(dst_layout, src, src_layout),
            (Storage::Cpu(d), Storage::Cuda(s)) => {
                let host = s.to_cpu(src_layout)?;
                d.copy_strided_from(dst_layout, &host, &Layout::contiguous(src_layout.shape().clone()));
                Ok(())
            }
        }
    }

    /// The elements of `layout` as a row-major storage on `device` (any pair of devices).
    pub fn to_device(&self, layout: &Layout, device: Device) -> Result<Storage> {
        match (self, device) {
            (Storage::Cuda(s), Device::Cuda(i)) => Ok(Storage::Cuda(s.to_device(layout, i)?)),
            (s, device) => Storage::from_cpu(s.to_cpu(layout)?, device),
        }
    }
}
