//! CUPTI 13's activity records as they lie in an activity buffer, and their decoding into
//! what the profiler keeps: one [`Record`] per kernel, memcpy, memset or external
//! correlation. No FFI calls here (the loading and the buffers are `cupti.rs`), so all of it
//! is tested without a GPU on buffers built from the same layouts.
//!
//! Layouts: the structs of `cupti_activity.h` of CUDA 13.0 (PyPI `nvidia-cuda-cupti`
//! 13.0.85, `CUPTI_API_VERSION` 130001) for the record versions CUPTI 13 emits:
//! `CUpti_ActivityKernel10` (`CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL`),
//! `CUpti_ActivityMemcpy6`, `CUpti_ActivityMemcpyPtoP4` (`CUPTI_ACTIVITY_KIND_MEMCPY2`: copies
//! between GPUs), `CUpti_ActivityMemset4`, `CUpti_ActivityExternalCorrelation` and
//! `CUpti_ActivityAPI` (`CUPTI_ACTIVITY_KIND_DRIVER` and `_RUNTIME`).
//! The header declares them `__attribute__((packed, aligned(8)))`: no padding between
//! fields, the size a multiple of 8. The mirrors below are `#[repr(C, packed)]` (align 1:
//! read from any address with `read_unaligned`), with their sizes and field offsets asserted
//! at compile time against what gcc printed for the header (`sizeof`/`offsetof`). Later CUPTI
//! 13 releases append fields (13.5's `CUpti_ActivityKernel13`, 248 bytes, keeps every offset
//! below), so a record is decoded from its 13.0 prefix and may be longer.

use std::ffi::c_char;
use std::mem::{offset_of, size_of};

/// `CUpti_ActivityKind` values the profiler enables or reads.
pub(crate) const KIND_MEMCPY: u32 = 1;
pub(crate) const KIND_MEMSET: u32 = 2;
pub(crate) const KIND_DRIVER: u32 = 4;
pub(crate) const KIND_RUNTIME: u32 = 5;
pub(crate) const KIND_CONCURRENT_KERNEL: u32 = 10;
pub(crate) const KIND_MEMCPY2: u32 = 22;
pub(crate) const KIND_EXTERNAL_CORRELATION: u32 = 39;

/// `CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0`: the kind ember pushes op ids under (Kineto
/// pushes PyTorch's op ids under the same kind).
pub(crate) const EXTERNAL_KIND_CUSTOM0: u32 = 3;

/// `CUpti_ActivityKernel10`, 216 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub(crate) struct ActivityKernel10 {
    pub kind: u32,
    pub cache_config: u8,
    pub shared_memory_config: u8,
    pub registers_per_thread: u16,
    pub partitioned_global_cache_requested: i32,
    pub partitioned_global_cache_executed: i32,
    pub start: u64,
    pub end: u64,
    pub completed: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub grid_x: i32,
    pub grid_y: i32,
    pub grid_z: i32,
    pub block_x: i32,
    pub block_y: i32,
    pub block_z: i32,
    pub static_shared_memory: i32,
    pub dynamic_shared_memory: i32,
    pub local_memory_per_thread: u32,
    pub local_memory_total: u32,
    pub correlation_id: u32,
    pub grid_id: i64,
    pub name: *const c_char,
    pub reserved0: *mut u8,
    pub queued: u64,
    pub submitted: u64,
    pub launch_type: u8,
    pub is_shared_memory_carveout_requested: u8,
    pub shared_memory_carveout_requested: u8,
    pub padding: u8,
    pub shared_memory_executed: u32,
    pub graph_node_id: u64,
    pub shmem_limit_config: i32,
    pub graph_id: u32,
    pub p_access_policy_window: *mut u8,
    pub channel_id: u32,
    pub channel_type: i32,
    pub cluster_x: u32,
    pub cluster_y: u32,
    pub cluster_z: u32,
    pub cluster_scheduling_policy: u32,
    pub local_memory_total_v2: u64,
    pub max_potential_cluster_size: u32,
    pub max_active_clusters: u32,
    pub is_device_launched: u8,
    pub padding3: [u8; 7],
}

/// `CUpti_ActivityMemcpy6`, 96 bytes (`CUPTILP64`: the `pad` before `reserved0` is there).
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub(crate) struct ActivityMemcpy6 {
    pub kind: u32,
    pub copy_kind: u8,
    pub src_kind: u8,
    pub dst_kind: u8,
    pub flags: u8,
    pub bytes: u64,
    pub start: u64,
    pub end: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub runtime_correlation_id: u32,
    pub pad: u32,
    pub reserved0: *mut u8,
    pub graph_node_id: u64,
    pub graph_id: u32,
    pub channel_id: u32,
    pub channel_type: i32,
    pub is_device_launched: u8,
    pub pad2: [u8; 3],
    pub copy_count: u64,
}

/// `CUpti_ActivityMemcpyPtoP4`, 96 bytes: a copy between two devices (`cuMemcpyPeerAsync`),
/// which CUPTI reports under `CUPTI_ACTIVITY_KIND_MEMCPY2`, not `_MEMCPY`.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub(crate) struct ActivityMemcpyPtoP4 {
    pub kind: u32,
    pub copy_kind: u8,
    pub src_kind: u8,
    pub dst_kind: u8,
    pub flags: u8,
    pub bytes: u64,
    pub start: u64,
    pub end: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub src_device_id: u32,
    pub src_context_id: u32,
    pub dst_device_id: u32,
    pub dst_context_id: u32,
    pub correlation_id: u32,
    pub reserved0: *mut u8,
    pub graph_node_id: u64,
    pub graph_id: u32,
    pub channel_id: u32,
    pub channel_type: i32,
    pub pad: u32,
}

/// `CUpti_ActivityMemset4`, 88 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub(crate) struct ActivityMemset4 {
    pub kind: u32,
    pub value: u32,
    pub bytes: u64,
    pub start: u64,
    pub end: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub flags: u16,
    pub memory_kind: u16,
    pub pad: u32,
    pub reserved0: *mut u8,
    pub graph_node_id: u64,
    pub graph_id: u32,
    pub channel_id: u32,
    pub channel_type: i32,
    pub is_device_launched: u8,
    pub pad2: [u8; 3],
}

/// `CUpti_ActivityExternalCorrelation`, 24 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub(crate) struct ActivityExternalCorrelation {
    pub kind: u32,
    pub external_kind: u32,
    pub external_id: u64,
    pub correlation_id: u32,
    pub reserved: u32,
}

/// `CUpti_ActivityAPI`, 40 bytes: one CUDA driver or runtime call.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub(crate) struct ActivityApi {
    pub kind: u32,
    pub cbid: u32,
    pub start: u64,
    pub end: u64,
    pub process_id: u32,
    pub thread_id: u32,
    pub correlation_id: u32,
    pub return_value: u32,
}

// The numbers gcc printed for CUDA 13.0's header (`sizeof`, `offsetof`).
const _: () = {
    assert!(size_of::<ActivityApi>() == 40);
    assert!(offset_of!(ActivityApi, cbid) == 4);
    assert!(offset_of!(ActivityApi, start) == 8);
    assert!(offset_of!(ActivityApi, end) == 16);
    assert!(offset_of!(ActivityApi, thread_id) == 28);
    assert!(offset_of!(ActivityApi, correlation_id) == 32);

    assert!(size_of::<ActivityKernel10>() == 216);
    assert!(offset_of!(ActivityKernel10, registers_per_thread) == 6);
    assert!(offset_of!(ActivityKernel10, start) == 16);
    assert!(offset_of!(ActivityKernel10, end) == 24);
    assert!(offset_of!(ActivityKernel10, completed) == 32);
    assert!(offset_of!(ActivityKernel10, device_id) == 40);
    assert!(offset_of!(ActivityKernel10, context_id) == 44);
    assert!(offset_of!(ActivityKernel10, stream_id) == 48);
    assert!(offset_of!(ActivityKernel10, grid_x) == 52);
    assert!(offset_of!(ActivityKernel10, block_x) == 64);
    assert!(offset_of!(ActivityKernel10, block_z) == 72);
    assert!(offset_of!(ActivityKernel10, static_shared_memory) == 76);
    assert!(offset_of!(ActivityKernel10, dynamic_shared_memory) == 80);
    assert!(offset_of!(ActivityKernel10, correlation_id) == 92);
    assert!(offset_of!(ActivityKernel10, grid_id) == 96);
    assert!(offset_of!(ActivityKernel10, name) == 104);
    assert!(offset_of!(ActivityKernel10, graph_node_id) == 144);
    assert!(offset_of!(ActivityKernel10, graph_id) == 156);

    assert!(size_of::<ActivityMemcpy6>() == 96);
    assert!(offset_of!(ActivityMemcpy6, copy_kind) == 4);
    assert!(offset_of!(ActivityMemcpy6, src_kind) == 5);
    assert!(offset_of!(ActivityMemcpy6, dst_kind) == 6);
    assert!(offset_of!(ActivityMemcpy6, bytes) == 8);
    assert!(offset_of!(ActivityMemcpy6, start) == 16);
    assert!(offset_of!(ActivityMemcpy6, end) == 24);
    assert!(offset_of!(ActivityMemcpy6, device_id) == 32);
    assert!(offset_of!(ActivityMemcpy6, context_id) == 36);
    assert!(offset_of!(ActivityMemcpy6, stream_id) == 40);
    assert!(offset_of!(ActivityMemcpy6, correlation_id) == 44);
    assert!(offset_of!(ActivityMemcpy6, graph_node_id) == 64);
    assert!(offset_of!(ActivityMemcpy6, copy_count) == 88);

    assert!(size_of::<ActivityMemcpyPtoP4>() == 96);
    assert!(offset_of!(ActivityMemcpyPtoP4, copy_kind) == 4);
    assert!(offset_of!(ActivityMemcpyPtoP4, bytes) == 8);
    assert!(offset_of!(ActivityMemcpyPtoP4, start) == 16);
    assert!(offset_of!(ActivityMemcpyPtoP4, end) == 24);
    assert!(offset_of!(ActivityMemcpyPtoP4, device_id) == 32);
    assert!(offset_of!(ActivityMemcpyPtoP4, context_id) == 36);
    assert!(offset_of!(ActivityMemcpyPtoP4, stream_id) == 40);
    assert!(offset_of!(ActivityMemcpyPtoP4, src_device_id) == 44);
    assert!(offset_of!(ActivityMemcpyPtoP4, dst_device_id) == 52);
    assert!(offset_of!(ActivityMemcpyPtoP4, correlation_id) == 60);
    assert!(offset_of!(ActivityMemcpyPtoP4, graph_node_id) == 72);
    assert!(offset_of!(ActivityMemcpyPtoP4, graph_id) == 80);
    assert!(offset_of!(ActivityMemcpyPtoP4, channel_type) == 88);

    assert!(size_of::<ActivityMemset4>() == 88);
    assert!(offset_of!(ActivityMemset4, value) == 4);
    assert!(offset_of!(ActivityMemset4, bytes) == 8);
    assert!(offset_of!(ActivityMemset4, start) == 16);
    assert!(offset_of!(ActivityMemset4, end) == 24);
    assert!(offset_of!(ActivityMemset4, device_id) == 32);
    assert!(offset_of!(ActivityMemset4, context_id) == 36);
    assert!(offset_of!(ActivityMemset4, stream_id) == 40);
    assert!(offset_of!(ActivityMemset4, correlation_id) == 44);
    assert!(offset_of!(ActivityMemset4, flags) == 48);
    assert!(offset_of!(ActivityMemset4, memory_kind) == 50);

    assert!(size_of::<ActivityExternalCorrelation>() == 24);
    assert!(offset_of!(ActivityExternalCorrelation, external_kind) == 4);
    assert!(offset_of!(ActivityExternalCorrelation, external_id) == 8);
    assert!(offset_of!(ActivityExternalCorrelation, correlation_id) == 16);
};

/// A record struct above: plain integers and raw pointers, every bit pattern valid, align 1.
///
/// # Safety
/// Implementors are `#[repr(C, packed)]` structs of integers, integer arrays and raw pointers.
pub(crate) unsafe trait Plain: Copy {}
// SAFETY: each is a packed struct of integers, integer arrays and raw pointers.
unsafe impl Plain for ActivityKernel10 {}
// SAFETY: as above.
unsafe impl Plain for ActivityMemcpy6 {}
// SAFETY: as above.
unsafe impl Plain for ActivityMemset4 {}
// SAFETY: as above.
unsafe impl Plain for ActivityMemcpyPtoP4 {}
// SAFETY: as above.
unsafe impl Plain for ActivityExternalCorrelation {}
// SAFETY: as above.
unsafe impl Plain for ActivityApi {}

/// The `T` at the start of `bytes`, None when `bytes` is shorter than `T`.
fn read<T: Plain>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: `bytes` holds at least `size_of::<T>()` initialized bytes, `T` is `Plain` (any
    // bit pattern is a valid value) and `read_unaligned` needs no alignment.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// What a device activity is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuActivityKind {
    /// A kernel (`cat: "kernel"` in traces).
    Kernel,
    /// A memory copy (`gpu_memcpy`).
    Memcpy,
    /// A memory fill (`gpu_memset`).
    Memset,
}

impl GpuActivityKind {
    /// The trace category Kineto gives it.
    pub fn category(self) -> &'static str {
        match self {
            GpuActivityKind::Kernel => "kernel",
            GpuActivityKind::Memcpy => "gpu_memcpy",
            GpuActivityKind::Memset => "gpu_memset",
        }
    }
}

/// One kernel, memcpy or memset as CUPTI reported it (times on CUPTI's clock, in ns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawActivity {
    pub kind: GpuActivityKind,
    pub start: u64,
    pub end: u64,
    pub device: u32,
    pub context: u32,
    pub stream: u32,
    pub correlation: u32,
    /// The kernel's name pointer (`const char *name`, shared by CUPTI across records of one
    /// kernel); null for copies and fills.
    pub name_ptr: usize,
    pub grid: [i32; 3],
    pub block: [i32; 3],
    pub registers_per_thread: u16,
    /// Static plus dynamic shared memory of a kernel, bytes.
    pub shared_memory: i32,
    /// Bytes copied or filled.
    pub bytes: u64,
    /// Memcpy: (copy kind, source memory kind, destination memory kind); memset: (0, memory
    /// kind, 0).
    pub memory: (u8, u8, u8),
}

/// One decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    Activity(RawActivity),
    /// The CUDA API call `correlation` ran while `external_id` of `external_kind` was pushed.
    ExternalCorrelation {
        correlation: u32,
        external_kind: u32,
        external_id: u64,
    },
    /// A CUDA driver or runtime call.
    Api(RawApi),
    /// A kind the profiler does not read.
    Other(u32),
}

/// A CUDA driver or runtime call as CUPTI reported it (times on CUPTI's clock, in ns). The
/// work it launched carries the same correlation id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawApi {
    /// A driver call (`CUPTI_CB_DOMAIN_DRIVER_API`), else a runtime call (cuBLAS and cuDNN
    /// launch through the runtime).
    pub driver: bool,
    /// The call's id in its callback domain (`cuptiGetCallbackName` names it).
    pub cbid: u32,
    pub start: u64,
    pub end: u64,
    pub correlation: u32,
}

/// Decodes the record at the start of `bytes` (which runs to the end of the buffer's valid
/// bytes). None when `bytes` is too short for the record its kind names.
pub(crate) fn decode(bytes: &[u8]) -> Option<Record> {
    let kind = u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?);
    Some(match kind {
        KIND_CONCURRENT_KERNEL => {
            let k: ActivityKernel10 = read(bytes)?;
            Record::Activity(RawActivity {
                kind: GpuActivityKind::Kernel,
                start: k.start,
                end: k.end,
                device: k.device_id,
                context: k.context_id,
                stream: k.stream_id,
                correlation: k.correlation_id,
                name_ptr: k.name as usize,
                grid: [k.grid_x, k.grid_y, k.grid_z],
                block: [k.block_x, k.block_y, k.block_z],
                registers_per_thread: k.registers_per_thread,
                shared_memory: k.static_shared_memory.saturating_add(k.dynamic_shared_memory),
                bytes: 0,
                memory: (0, 0, 0),
            })
        }
        KIND_MEMCPY => {
            let m: ActivityMemcpy6 = read(bytes)?;
            Record::Activity(RawActivity {
                kind: GpuActivityKind::Memcpy,
                start: m.start,
                end: m.end,
                device: m.device_id,
                context: m.context_id,
                stream: m.stream_id,
                correlation: m.correlation_id,
                name_ptr: 0,
                grid: [0; 3],
                block: [0; 3],
                registers_per_thread: 0,
                shared_memory: 0,
                bytes: m.bytes,
                memory: (m.copy_kind, m.src_kind, m.dst_kind),
            })
        }
        KIND_MEMCPY2 => {
            let m: ActivityMemcpyPtoP4 = read(bytes)?;
            Record::Activity(RawActivity {
                kind: GpuActivityKind::Memcpy,
                start: m.start,
                end: m.end,
                device: m.device_id,
                context: m.context_id,
                stream: m.stream_id,
                correlation: m.correlation_id,
                name_ptr: 0,
                grid: [0; 3],
                block: [0; 3],
                registers_per_thread: 0,
                shared_memory: 0,
                bytes: m.bytes,
                memory: (m.copy_kind, m.src_kind, m.dst_kind),
            })
        }
        KIND_MEMSET => {
            let m: ActivityMemset4 = read(bytes)?;
            Record::Activity(RawActivity {
                kind: GpuActivityKind::Memset,
                start: m.start,
                end: m.end,
                device: m.device_id,
                context: m.context_id,
                stream: m.stream_id,
                correlation: m.correlation_id,
                name_ptr: 0,
                grid: [0; 3],
                block: [0; 3],
                registers_per_thread: 0,
                shared_memory: 0,
                bytes: m.bytes,
                memory: (0, m.memory_kind.min(255) as u8, 0),
            })
        }
        KIND_EXTERNAL_CORRELATION => {
            let e: ActivityExternalCorrelation = read(bytes)?;
            Record::ExternalCorrelation {
                correlation: e.correlation_id,
                external_kind: e.external_kind,
                external_id: e.external_id,
            }
        }
        KIND_DRIVER | KIND_RUNTIME => {
            let a: ActivityApi = read(bytes)?;
            Record::Api(RawApi {
                driver: kind == KIND_DRIVER,
                cbid: a.cbid,
                start: a.start,
                end: a.end,
                correlation: a.correlation_id,
            })
        }
        other => Record::Other(other),
    })
}

/// `CUpti_ActivityMemoryKind` as Kineto names it in memcpy and memset names.
fn memory_kind_name(kind: u8) -> &'static str {
    match kind {
        1 => "Pageable",
        2 => "Pinned",
        3 => "Device",
        4 => "Array",
        5 => "Managed",
        6 => "Device Static",
        7 => "Managed Static",
        _ => "Unknown",
    }
}

/// `CUpti_ActivityMemcpyKind` as Kineto names it.
fn copy_kind_name(kind: u8) -> &'static str {
    match kind {
        1 => "HtoD",
        2 => "DtoH",
        3 => "HtoA",
        4 => "AtoH",
        5 => "AtoA",
        6 => "AtoD",
        7 => "DtoA",
        8 => "DtoD",
        9 => "HtoH",
        10 => "PtoP",
        _ => "Unknown",
    }
}

impl RawActivity {
    /// The name Kineto gives a copy or fill (`Memcpy HtoD (Pinned -> Device)`,
    /// `Memset (Device)`); None for kernels, whose name is their symbol.
    pub(crate) fn transfer_name(&self) -> Option<String> {
        let (copy, src, dst) = self.memory;
        match self.kind {
            GpuActivityKind::Kernel => None,
            GpuActivityKind::Memcpy => Some(format!(
                "Memcpy {} ({} -> {})",
                copy_kind_name(copy),
                memory_kind_name(src),
                memory_kind_name(dst)
            )),
            GpuActivityKind::Memset => Some(format!("Memset ({})", memory_kind_name(src))),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The bytes of a record, as CUPTI lays it in a buffer.
    pub(crate) fn bytes_of<T: Plain>(record: &T) -> Vec<u8> {
        // SAFETY: `T` is a packed plain struct: `size_of::<T>()` initialized bytes, no padding.
        unsafe { std::slice::from_raw_parts((record as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    pub(crate) fn kernel(
        correlation: u32,
        start: u64,
        end: u64,
        stream: u32,
        name: *const c_char,
    ) -> ActivityKernel10 {
        // SAFETY: every field is an integer, an integer array or a raw pointer: zero is valid.
        let mut k: ActivityKernel10 = unsafe { std::mem::zeroed() };
        k.kind = KIND_CONCURRENT_KERNEL;
        k.start = start;
        k.end = end;
        k.completed = end;
        k.device_id = 0;
        k.context_id = 1;
        k.stream_id = stream;
        (k.grid_x, k.grid_y, k.grid_z) = (4, 2, 1);
        (k.block_x, k.block_y, k.block_z) = (128, 1, 1);
        k.registers_per_thread = 32;
        k.static_shared_memory = 1024;
        k.dynamic_shared_memory = 512;
        k.correlation_id = correlation;
        k.name = name;
        k
    }

    pub(crate) fn memcpy(correlation: u32, start: u64, end: u64, bytes: u64) -> ActivityMemcpy6 {
        // SAFETY: as in `kernel`.
        let mut m: ActivityMemcpy6 = unsafe { std::mem::zeroed() };
        m.kind = KIND_MEMCPY;
        (m.copy_kind, m.src_kind, m.dst_kind) = (1, 2, 3);
        m.bytes = bytes;
        m.start = start;
        m.end = end;
        m.stream_id = 7;
        m.correlation_id = correlation;
        m.copy_count = 1;
        m
    }

    pub(crate) fn memcpy_peer(correlation: u32, bytes: u64) -> ActivityMemcpyPtoP4 {
        // SAFETY: as in `kernel`.
        let mut m: ActivityMemcpyPtoP4 = unsafe { std::mem::zeroed() };
        m.kind = KIND_MEMCPY2;
        (m.copy_kind, m.src_kind, m.dst_kind) = (10, 3, 3);
        m.bytes = bytes;
        (m.start, m.end) = (100, 200);
        (m.device_id, m.src_device_id, m.dst_device_id) = (0, 0, 1);
        m.stream_id = 9;
        m.correlation_id = correlation;
        m
    }

    pub(crate) fn memset(correlation: u32, start: u64, end: u64) -> ActivityMemset4 {
        // SAFETY: as in `kernel`.
        let mut m: ActivityMemset4 = unsafe { std::mem::zeroed() };
        m.kind = KIND_MEMSET;
        m.bytes = 256;
        m.start = start;
        m.end = end;
        m.stream_id = 7;
        m.correlation_id = correlation;
        m.memory_kind = 3;
        m
    }

    pub(crate) fn external(correlation: u32, external_id: u64) -> ActivityExternalCorrelation {
        ActivityExternalCorrelation {
            kind: KIND_EXTERNAL_CORRELATION,
            external_kind: EXTERNAL_KIND_CUSTOM0,
            external_id,
            correlation_id: correlation,
            reserved: 0,
        }
    }

    pub(crate) fn api(correlation: u32, start: u64, end: u64) -> ActivityApi {
        ActivityApi {
            kind: KIND_DRIVER,
            cbid: 307,
            start,
            end,
            process_id: 1,
            thread_id: 2,
            correlation_id: correlation,
            return_value: 0,
        }
    }

    #[test]
    fn layouts_match_cuda_13_headers() {
        // The compile-time asserts above hold the offsets; these check the byte positions a
        // decoder sees in a buffer.
        let k = kernel(0x1122_3344, 0x0102_0304_0506_0708, 9, 13, std::ptr::null());
        let b = bytes_of(&k);
        assert_eq!(b.len(), 216);
        assert_eq!(u32::from_ne_bytes(b[0..4].try_into().unwrap()), 10);
        assert_eq!(
            u64::from_ne_bytes(b[16..24].try_into().unwrap()),
            0x0102_0304_0506_0708
        );
        assert_eq!(u32::from_ne_bytes(b[48..52].try_into().unwrap()), 13);
        assert_eq!(u32::from_ne_bytes(b[92..96].try_into().unwrap()), 0x1122_3344);
        let e = bytes_of(&external(5, 0xabcdef));
        assert_eq!(e.len(), 24);
        assert_eq!(u64::from_ne_bytes(e[8..16].try_into().unwrap()), 0xabcdef);
        assert_eq!(u32::from_ne_bytes(e[16..20].try_into().unwrap()), 5);
        assert_eq!(bytes_of(&memcpy(1, 2, 3, 4)).len(), 96);
        assert_eq!(bytes_of(&memset(1, 2, 3)).len(), 88);
        let a = bytes_of(&api(0x55, 0x0a0b, 0x0c0d));
        assert_eq!(a.len(), 40);
        assert_eq!(u32::from_ne_bytes(a[4..8].try_into().unwrap()), 307);
        assert_eq!(u64::from_ne_bytes(a[8..16].try_into().unwrap()), 0x0a0b);
        assert_eq!(u32::from_ne_bytes(a[32..36].try_into().unwrap()), 0x55);
    }

    #[test]
    fn records_decode_from_their_bytes() {
        let name = c"ampere_sgemm_128x64_nn";
        let k = decode(&bytes_of(&kernel(42, 1000, 3000, 7, name.as_ptr()))).unwrap();
        let Record::Activity(k) = k else { panic!("{k:?}") };
        assert_eq!(
            (k.kind, k.start, k.end, k.stream, k.correlation),
            (GpuActivityKind::Kernel, 1000, 3000, 7, 42)
        );
        assert_eq!((k.grid, k.block, k.shared_memory), ([4, 2, 1], [128, 1, 1], 1536));
        assert_eq!(k.name_ptr, name.as_ptr() as usize);

        let Some(Record::Activity(m)) = decode(&bytes_of(&memcpy(43, 10, 20, 4096))) else {
            panic!()
        };
        assert_eq!((m.kind, m.bytes), (GpuActivityKind::Memcpy, 4096));
        assert_eq!(m.transfer_name().unwrap(), "Memcpy HtoD (Pinned -> Device)");
        let peer = bytes_of(&memcpy_peer(47, 1280));
        assert_eq!(peer.len(), 96);
        assert_eq!(u32::from_ne_bytes(peer[60..64].try_into().unwrap()), 47);
        let Some(Record::Activity(p)) = decode(&peer) else {
            panic!()
        };
        assert_eq!(
            (p.kind, p.bytes, p.correlation, p.stream, p.start, p.end),
            (GpuActivityKind::Memcpy, 1280, 47, 9, 100, 200)
        );
        assert_eq!(p.transfer_name().unwrap(), "Memcpy PtoP (Device -> Device)");
        let Some(Record::Activity(s)) = decode(&bytes_of(&memset(44, 10, 20))) else {
            panic!()
        };
        assert_eq!(s.transfer_name().unwrap(), "Memset (Device)");
        assert_eq!(
            decode(&bytes_of(&external(43, 77))),
            Some(Record::ExternalCorrelation {
                correlation: 43,
                external_kind: EXTERNAL_KIND_CUSTOM0,
                external_id: 77
            })
        );
        // A later CUPTI's longer record decodes from its prefix; a cut one does not.
        let mut longer = bytes_of(&kernel(1, 2, 3, 7, std::ptr::null()));
        longer.extend([0u8; 32]);
        assert!(matches!(decode(&longer), Some(Record::Activity(_))));
        assert_eq!(decode(&longer[..100]), None);
        assert_eq!(
            decode(&bytes_of(&api(45, 5, 9))),
            Some(Record::Api(RawApi {
                driver: true,
                cbid: 307,
                start: 5,
                end: 9,
                correlation: 45
            }))
        );
        let mut runtime = bytes_of(&api(46, 5, 9));
        runtime[0] = KIND_RUNTIME as u8;
        assert!(matches!(
            decode(&runtime),
            Some(Record::Api(RawApi { driver: false, .. }))
        ));
        assert_eq!(decode(&runtime[..39]), None);
        assert_eq!(decode(&[37, 0, 0, 0, 1, 2]), Some(Record::Other(37)));
        assert_eq!(decode(&[1, 2]), None);
    }
}
