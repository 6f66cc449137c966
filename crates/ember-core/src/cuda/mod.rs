//! `torch.cuda`: the user API of the CUDA backend. Everything here goes through `cudarc` with
//! dynamic loading, so one binary runs on machines with and without a GPU: without a driver or
//! a device, [`is_available`] is false and every call that needs a GPU returns
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable), never a panic.
//!
//! Two layers (Note [Two layers for CUDA] in `crate::architecture`): the backend (devices, the
//! allocator, streams and events, kernels, cuBLASLt, cuDNN, device storage) lies below the ops
//! and imports none of them; this module lies above the ops and holds what is built from
//! tensors, autograd and the generators: `graph` (CUDA graphs: capture and replay), `graphed`
//! (`make_graphed_callables`), `comm` (`torch.cuda.comm`'s broadcast, scatter, gather), `memory`
//! (the allocator's statistics and snapshots under PyTorch's names) and `nvtx`. The backend's
//! user-facing items (devices, streams, events, the TF32 switch, pinned memory, the row-block
//! hooks of DataParallel) are re-exported here, so `ember_core::cuda` is the one path users need.

pub mod comm;
mod graph;
mod graphed;
mod memory;
pub mod nvtx;
mod row_blocks;

pub use crate::cuda_backend::{
    allow_tf32, compile_all_kernels, compile_units, cupti_version, current_device, current_stream,
    default_stream, device_count, driver_version, get_arch_list, get_device_capability, get_device_name,
    get_device_properties, get_float32_matmul_precision, host_memory_stats, host_sync_count, is_available,
    is_current_stream_capturing, library_report, nccl_candidates, nvrtc_compile, nvrtc_version,
    register_collectives, row_block_ranges, set_allow_tf32, set_device, set_float32_matmul_precision,
    set_stream, stream, synchronize, tunable, CollectivesRegistration, CudaDevice, CudaStorage, DeviceGuard,
    DeviceProperties, Event, HostMemoryStats, HostPin, LibraryStatus, MempoolId, Module, RowBlockEvent,
    Stream, StreamGuard, Unit,
};
pub use graph::{
    graph, graph_pool_handle, graph_with, CUDAGraph, CaptureErrorMode, GraphCapture, GraphOptions,
};
pub use graphed::{make_graphed_callables, Callable, GraphedCallable, GraphedOptions};
pub use memory::{
    caching_allocator_alloc, caching_allocator_delete, dump_snapshot, empty_cache, max_memory_allocated,
    max_memory_reserved, mem_get_info, memory_allocated, memory_reserved, memory_snapshot, memory_stats,
    memory_stats_struct, memory_summary, record_memory_history, reset_accumulated_memory_stats,
    reset_peak_memory_stats, snapshot, MemoryStats, Stat, StatArray,
};
pub use row_blocks::{arriving_in_row_blocks, set_gradient_row_blocks, take_gradient_row_events};
