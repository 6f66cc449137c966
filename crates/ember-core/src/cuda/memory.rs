//! The caching allocator's public face, as `torch.cuda.memory`: statistics, summaries,
//! snapshots, `empty_cache`, `mem_get_info`, and raw allocations.
//!
//! Statistics of a device that was never used (or of a machine without CUDA) are zero, as in
//! PyTorch before the first allocation. [`Tensor::record_stream`], the allocator's bookkeeping
//! for a tensor used on another stream, is written here too (a `Tensor` method that names the
//! CUDA backend's `Stream`, so it sits in this layer, above the ops).

use crate::cuda_backend::allocator::{
    memory_stats_map, memory_summary as summary_table, snapshot_json, snapshot_value,
};
use crate::cuda_backend::runtime::runtime;
use crate::cuda_backend::stream::current_raw;
use crate::cuda_backend::Stream;
use crate::{Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

pub use crate::cuda_backend::allocator::{MemoryStats, Stat, StatArray};

fn with_stats<R: Default>(device: usize, f: impl FnOnce(&MemoryStats) -> R) -> R {
    match runtime(device) {
        Ok(rt) => f(&rt.allocator.stats()),
        Err(_) => R::default(),
    }
}

/// Bytes currently held by tensors on `device` (`torch.cuda.memory_allocated`).
pub fn memory_allocated(device: usize) -> usize {
    with_stats(device, |s| s.allocated_bytes.all.current as usize)
}

/// Peak of [`memory_allocated`] since the last reset (`torch.cuda.max_memory_allocated`).
pub fn max_memory_allocated(device: usize) -> usize {
    with_stats(device, |s| s.allocated_bytes.all.peak as usize)
}

/// Bytes of device memory the caching allocator holds, in use or cached (`torch.cuda.memory_reserved`).
pub fn memory_reserved(device: usize) -> usize {
    with_stats(device, |s| s.reserved_bytes.all.current as usize)
}

/// Peak of [`memory_reserved`] since the last reset (`torch.cuda.max_memory_reserved`).
pub fn max_memory_reserved(device: usize) -> usize {
    with_stats(device, |s| s.reserved_bytes.all.peak as usize)
}

/// Every statistic under PyTorch's key names, e.g. `"allocated_bytes.all.peak"`
/// (`torch.cuda.memory_stats`).
pub fn memory_stats(device: usize) -> BTreeMap<String, i64> {
    match runtime(device) {
        Ok(rt) => memory_stats_map(&rt.allocator.stats()),
        Err(_) => memory_stats_map(&MemoryStats::default()),
    }
}

/// The statistics as a struct (`memory_stats` without string keys).
pub fn memory_stats_struct(device: usize) -> MemoryStats {
    with_stats(device, |s| s.clone())
}

/// A readable table of the statistics (`torch.cuda.memory_summary`).
pub fn memory_summary(device: usize) -> String {
    summary_table(&memory_stats_struct(device), device)
}

/// Sets every peak statistic to its current value (`torch.cuda.reset_peak_memory_stats`).
pub fn reset_peak_memory_stats(device: usize) {
    if let Ok(rt) = runtime(device) {
        rt.allocator.reset_peak_stats();
    }
}

/// Zeroes the cumulative counters (`torch.cuda.reset_accumulated_memory_stats`).
pub fn reset_accumulated_memory_stats(device: usize) {
    if let Ok(rt) = runtime(device) {
        rt.allocator.reset_accumulated_stats();
    }
}

/// Returns cached, unused memory of every initialized device to the driver
/// (`torch.cuda.empty_cache`), and unpins the cached pinned host buffers; memory held by
/// tensors, and the private pools of live CUDA graphs, stay.
///
/// An error, releasing nothing, while a CUDA graph capture is underway on a device: releasing
/// memory waits for the device (Note [Operations refused during capture]).
pub fn empty_cache() -> Result<()> {
    for device in 0..crate::cuda_backend::device_count() {
        crate::cuda_backend::capture::refuse_device_wide(device, "empty_cache")?;
    }
    crate::cuda_backend::pinned::empty_host_cache();
    for device in 0..crate::cuda_backend::device_count() {
        if let Ok(rt) = runtime(device) {
            rt.allocator.empty_cache();
        }
    }
    Ok(())
}

/// `(free, total)` bytes of `device` as the driver sees them (`torch.cuda.mem_get_info`).
pub fn mem_get_info(device: usize) -> Result<(usize, usize)> {
    runtime(device)?;
    cudarc::driver::result::mem_get_info().map_err(|e| Error::Cuda {
        op: "cuMemGetInfo",
        msg: format!("{e:?}"),
    })
}

/// Starts (or stops) recording allocation events on `device`, keeping the newest
/// `max_entries` (`torch.cuda.memory._record_memory_history`).
pub fn record_memory_history(device: usize, enabled: bool, max_entries: usize) -> Result<()> {
    runtime(device)?.allocator.record_history(enabled, max_entries);
    Ok(())
}

/// The allocator's segments and the recorded events as JSON, shaped like PyTorch's
/// `torch.cuda.memory._snapshot()` with fewer fields; [`dump_snapshot`] writes the full
/// structure in PyTorch's own format.
pub fn memory_snapshot(device: usize) -> Result<String> {
    let rt = runtime(device)?;
    Ok(snapshot_json(&rt.allocator.snapshot(), &rt.allocator.history()))
}

/// The allocator's segments and recorded events in PyTorch's snapshot structure
/// (`torch.cuda.memory._snapshot()`) as a pickle value: `device`'s segments, one trace list
/// per device with `device`'s events in its own. [`dump_snapshot`] writes it to a file.
pub fn snapshot(device: usize) -> Result<crate::pickle::Value> {
    let rt = runtime(device)?;
    let devices = crate::cuda_backend::device_count().max(device + 1);
    Ok(snapshot_value(
        device,
        devices,
        &rt.allocator.snapshot(),
        &rt.allocator.history(),
    ))
}

/// Writes [`snapshot`] to `path` as a Python pickle (`torch.cuda.memory._dump_snapshot`), so
/// PyTorch's memory visualizer (`torch.cuda._memory_viz`, pytorch.org/memory_viz) and
/// `ember memviz` read it. Record events first with [`record_memory_history`].
pub fn dump_snapshot(device: usize, path: impl AsRef<Path>) -> Result<()> {
    let value = snapshot(device)?;
    let path = path.as_ref();
    crate::pickle::dump(&value, path).map_err(|e| Error::Io {
        kind: e.kind(),
        msg: format!("writing the memory snapshot {}: {e}", path.display()),
    })
}

/// `bytes` of raw device memory from the caching allocator on the current stream
/// (`torch.cuda.caching_allocator_alloc`); release it with [`caching_allocator_delete`].
pub fn caching_allocator_alloc(device: usize, bytes: usize) -> Result<u64> {
    let rt = runtime(device)?;
    rt.allocator
        .malloc(bytes, current_raw(device))
        .map(|a| a.ptr)
        .map_err(|oom| {
            crate::memory::out_of_memory(
                crate::Device::Cuda(device),
                oom.requested,
                oom.total,
                oom.free,
                oom.allocated,
                oom.reserved,
            )
        })
}

/// Returns memory from [`caching_allocator_alloc`] (`torch.cuda.caching_allocator_delete`);
/// an error for an address the allocator did not hand out.
pub fn caching_allocator_delete(device: usize, ptr: u64) -> Result<()> {
    if runtime(device)?.allocator.free(ptr) {
        Ok(())
    } else {
        Err(Error::invalid(
            "caching_allocator_delete",
            format!("{ptr:#x} is not an allocation of cuda:{device}'s caching allocator"),
        ))
    }
}

impl Tensor {
    /// Marks the tensor's GPU memory as used by work queued on `stream`
    /// (`Tensor.record_stream`): when the tensor is freed, the caching allocator does not reuse
    /// the memory until that work has finished. Needed when a tensor allocated on one stream is
    /// used on another; a no-op for CPU tensors, as PyTorch ignores it there.
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        self.storage().read().record_stream(stream)
    }
}
