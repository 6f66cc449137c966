//! Page-locked ("pinned") host memory, as `Tensor.pin_memory()`: copies from it to the GPU run
//! by DMA at full PCIe/NVLink speed and, with `non_blocking`, truly overlap with host work.
//!
//! Note [Pinned host memory]: a pinned CPU tensor is an ordinary CPU storage whose buffer is
//! registered with the driver (`cuMemHostRegister`, portable to every context); the
//! registration ([`HostPin`]) lives in the storage cell beside the buffer and is undone before
//! the buffer is freed. CPU ops write pinned buffers in place, never reallocate them, so the
//! registered range stays the buffer's. An asynchronous copy out of a pinned buffer keeps the
//! source storage alive until an event recorded after the copy has completed
//! ([`keep_alive_until_done`]); finished entries are dropped on later copies and on
//! [`synchronize`](super::synchronize).
//!
//! Note [Pinned host cache]: registering memory costs about as much as copying it, so, as
//! PyTorch's host allocator does, freed pinned buffers are kept: their capacity is a power of
//! two elements, the whole capacity is registered once, and a later `pin_memory` of the same
//! dtype and size class takes a cached buffer (refilled within its capacity, so it never
//! reallocates) instead of registering new memory. [`empty_cache`](super::empty_cache) releases
//! the cache.

use super::runtime::runtime;
use super::stream::{Event, Stream};
use crate::backend::host::{with_cpu_storage, CpuStorage};
use crate::backend::BackendStorage;
use crate::{DType, Error, Result};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A registration of a host buffer with the driver, undone on drop.
#[derive(Debug)]
pub struct HostPin {
    ptr: usize,
}

impl HostPin {
    /// Page-locks the `bytes` bytes at `ptr`, a host allocation that must stay allocated and in
    /// place until the pin drops.
    fn register(ptr: *const u8, bytes: usize) -> Result<HostPin> {
        runtime(0)?;
        if bytes == 0 {
            return Ok(HostPin { ptr: 0 });
        }
        // SAFETY: `ptr..ptr + bytes` is one live host allocation (a Vec's whole capacity); the
        // caller keeps it in place until this pin is dropped (Note [Pinned host memory]).
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr as *mut std::ffi::c_void,
                bytes,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| Error::Cuda {
            op: "pin_memory",
            msg: format!("cuMemHostRegister of {bytes} bytes failed: {e:?}"),
        })?;
        REGISTERED.fetch_add(1, Ordering::Relaxed);
        Ok(HostPin { ptr: ptr as usize })
    }
}

static REGISTERED: AtomicU64 = AtomicU64::new(0);
static UNREGISTERED: AtomicU64 = AtomicU64::new(0);

/// Freed pinned buffers kept for reuse (Note [Pinned host cache]).
static CACHE: Mutex<Vec<(CpuStorage, HostPin)>> = Mutex::new(Vec::new());

fn capacity(cpu: &CpuStorage) -> usize {
    with_cpu_storage!(cpu, v => v.capacity())
}

/// A pinned row-major copy of `src` (contiguous elements) from the cache or newly registered.
pub(crate) fn pinned_copy(src: &CpuStorage) -> Result<(CpuStorage, HostPin)> {
    fn refill<T: Clone>(dst: &mut Vec<T>, src: &[T]) {
        dst.clear();
        dst.extend_from_slice(src); // within capacity: no reallocation
    }
    fn fresh<T: Clone>(src: &[T], cap: usize) -> Vec<T> {
        let mut v = Vec::with_capacity(cap);
        v.extend_from_slice(src);
        v
    }
    let (dtype, n) = (src.dtype(), src.len());
    let class = n.next_power_of_two();
    let cached = {
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let hit = cache
            .iter()
            .position(|(c, _)| c.dtype() == dtype && capacity(c) == class);
        hit.map(|i| cache.swap_remove(i))
    };
    if let Some((mut buf, pin)) = cached {
        use CpuStorage::*;
        match (&mut buf, src) {
            (Bool(d), Bool(s)) => refill(d, s),
            (U8(d), U8(s)) => refill(d, s),
            (I32(d), I32(s)) => refill(d, s),
            (I64(d), I64(s)) => refill(d, s),
            (F16(d), F16(s)) => refill(d, s),
            (BF16(d), BF16(s)) => refill(d, s),
            (F32(d), F32(s)) => refill(d, s),
            (F64(d), F64(s)) => refill(d, s),
            _ => unreachable!("the cache entry was chosen by dtype"),
        }
        return Ok((buf, pin));
    }
    let buf = with_cpu_storage!(src, s => crate::backend::host::CpuElement::wrap(fresh(s, class)));
    let ptr = with_cpu_storage!(&buf, v => v.as_ptr() as *const u8);
    let pin = HostPin::register(ptr, class * dtype_size(dtype))?;
    Ok((buf, pin))
}

fn dtype_size(dtype: DType) -> usize {
    dtype.size_in_bytes()
}

/// Takes back the buffer of a pinned storage that was dropped.
pub(crate) fn recycle(buf: CpuStorage, pin: HostPin) {
    if pin.ptr == 0 {
        return;
    }
    CACHE.lock().unwrap_or_else(|e| e.into_inner()).push((buf, pin));
}

/// Unregisters and frees every cached pinned buffer.
pub(crate) fn empty_host_cache() {
    let cached = std::mem::take(&mut *CACHE.lock().unwrap_or_else(|e| e.into_inner()));
    for (buf, pin) in cached {
        drop(pin); // unregister before the buffer is freed
        drop(buf);
    }
}

/// Counters of the pinned host memory (`torch.cuda.host_memory_stats`, reduced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemoryStats {
    /// Buffers registered with the driver so far (`num_host_alloc`).
    pub num_host_alloc: u64,
    /// Buffers unregistered so far (`num_host_free`).
    pub num_host_free: u64,
    /// Freed pinned buffers kept for reuse, and their bytes.
    pub cached_buffers: usize,
    pub cached_bytes: usize,
}

/// The pinned host allocator's counters.
pub fn host_memory_stats() -> HostMemoryStats {
    let cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    HostMemoryStats {
        num_host_alloc: REGISTERED.load(Ordering::Relaxed),
        num_host_free: UNREGISTERED.load(Ordering::Relaxed),
        cached_buffers: cache.len(),
        cached_bytes: cache
            .iter()
            .map(|(c, _)| capacity(c) * c.dtype().size_in_bytes())
            .sum(),
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if self.ptr != 0 && runtime(0).is_ok() {
            // SAFETY: `ptr` was registered by `new` and its buffer is still allocated (the pin is
            // dropped before the buffer, see StorageCell).
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
            UNREGISTERED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What a copy still reads (a storage handle, which this backend file does not name), with the
/// event after the copy.
type Kept = (Event, Box<dyn std::any::Any + Send>);

static IN_FLIGHT: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// Keeps `storage` (a handle of the host storage a copy reads) alive until the work queued on
/// `stream` so far has finished.
pub(crate) fn keep_alive_until_done(stream: &Stream, storage: impl std::any::Any + Send) -> Result<()> {
    let event = Event::new(false);
    event.record_on(stream)?;
    let mut in_flight = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
    in_flight.retain(|(e, _)| !e.query().unwrap_or(true));
    in_flight.push((event, Box::new(storage)));
    Ok(())
}

/// Drops every kept-alive storage whose copy has finished.
pub(crate) fn release_finished() {
    let mut in_flight = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
    in_flight.retain(|(e, _)| !e.query().unwrap_or(true));
}
