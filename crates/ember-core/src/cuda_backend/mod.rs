//! The CUDA backend: devices, the caching allocator, streams and events, kernels (NVRTC, the
//! typed launchers), cuBLASLt, cuDNN and one file per op family implementing its family's
//! backend trait (`crate::backend`) for [`CudaStorage`]. Everything goes through `cudarc` with
//! dynamic loading, so one binary runs on machines with and without a GPU: without a driver or
//! a device, [`is_available`] is false and every call that needs a GPU returns
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable), never a panic.
//!
//! This layer imports only the backend vocabulary (`crate::backend`) and the base modules
//! (dtype, shape, layout, error, memory, pickle); the `torch.cuda` user API built on it (graphs,
//! graphed callables, comm, memory statistics, NVTX) is [`crate::cuda`], above the ops.
//!
//! One file per concept: `device` (discovery, properties), `runtime` (per-device context and
//! loaded kernels), `allocator` (the caching allocator and its statistics),
//! `pinned` (page-locked host memory and its cache), `device_errors` (errors kernels find,
//! reported at the next synchronizing call), `stream` (streams, events, current device and
//! stream), `capture` (the captures underway and the operations refused during them), `nvrtc`
//! (kernel compilation and its disk cache), `kernel_units` (which compile unit each kernel is
//! in), `cubins` (the compiled units of the process and their background compiles), `kernels`
//! (kernel sources and launching), `launch` (every kernel's parameter list and its typed
//! launcher), `storage` (device tensors and copies), `blas` (matrix products through cuBLASLt,
//! the TF32 switch), `row_blocks` (weight gradients computed in row blocks, for DataParallel to
//! copy the first rows back early), `cupti` and `cupti_records` (CUPTI's activity API loaded at
//! run time, and its record layouts: the profiler's kernel timing), `kernel_timing` (the
//! profiler's CUDA-events fallback), `cudnn` (convolution through cuDNN and the state behind
//! `backends::cudnn`), `cudnn_graph` (its execution plans through cuDNN's graph API),
//! `cudnn_pool` (pooling through cuDNN), `optim` (fused optimizer steps), `amp` (GradScaler's
//! inf check, unscale and scale update), `rnn` (the fused LSTM step), and the op families
//! (`elementwise`, `unary`, `reduce`, `index`, `softmax`, `loss`, `random`, `norm`); `storage`
//! implements the base trait and [`CudaDevice`].

pub(crate) mod allocator;
pub(crate) mod amp;
mod blas;
pub(crate) mod capture;
mod cubins;
pub(crate) mod cudnn;
mod cudnn_graph;
pub(crate) mod cudnn_pool;
mod cudnn_sdpa;
pub(crate) mod cupti;
pub(crate) mod cupti_records;
pub(crate) mod device;
mod device_errors;
mod elementwise;
mod index;
pub(crate) mod kernel_timing;
mod kernel_units;
mod kernels;
mod launch;
mod libraries;
mod loss;
pub(crate) mod multi_copy;
mod norm;
mod nvrtc;
pub(crate) mod optim;
pub(crate) mod pinned;
mod random;
mod reduce;
mod rnn;
pub(crate) mod row_blocks;
pub(crate) mod runtime;
mod softmax;
mod sort;
pub(crate) mod storage;
pub(crate) mod stream;
mod unary;

pub use allocator::MempoolId;
pub use blas::{
    allow_tf32, get_float32_matmul_precision, set_allow_tf32, set_float32_matmul_precision, tunable,
};
pub use capture::is_current_stream_capturing;
pub use cupti::{cupti_version, register_collectives, CollectivesRegistration};
pub use device::{
    device_count, driver_version, get_arch_list, get_device_capability, get_device_name,
    get_device_properties, is_available, DeviceProperties,
};
pub use kernel_units::Unit;
pub use kernels::Module;
pub use libraries::{library_report, nccl_candidates, LibraryStatus};
pub use nvrtc::{compile as nvrtc_compile, compile_units, nvrtc_version};
pub use pinned::{host_memory_stats, HostMemoryStats, HostPin};
pub(crate) use pinned::{keep_alive_until_done, pinned_copy, recycle as recycle_pinned};
pub use row_blocks::{row_block_ranges, RowBlockEvent};
pub(crate) use storage::host_bytes;
pub use storage::CudaDevice;
pub use storage::CudaStorage;
pub use stream::{
    current_device, current_stream, default_stream, host_sync_count, set_device, set_stream, stream,
    synchronize, DeviceGuard, Event, Stream, StreamGuard,
};
pub(crate) use stream::{current_streams, use_streams};

/// Whether NVIDIA's compute-sanitizer is attached to this process: it sets
/// `NV_SANITIZER_INJECTION_PORT_BASE` in the process it checks (2025.3; seen in session 50).
/// The profiler keeps off CUPTI there (Note [CUPTI under compute-sanitizer] in `cupti.rs`) and
/// the libraries' outputs are zeroed first (Note [Library outputs under initcheck]).
pub(crate) fn under_compute_sanitizer() -> bool {
    std::env::var_os("NV_SANITIZER_INJECTION_PORT_BASE").is_some()
}

// Note [Library outputs under initcheck]: compute-sanitizer's initcheck does not see the
// stores of Hopper's cuBLASLt kernels (TMA), so every later read of a product's output looked
// uninitialized: 544,456 reports over the GPU tests in session 50 (docs/benchmarks.md, run 2),
// every printed one in an ember kernel or a copy reading a product (`unary_gelu_tanh_bf16`,
// `non_finite_check_and_unscale_f32`, `cast_contig_f16_f32`, `adam_f32`, ...), and
// `scripts/initcheck-probe.sh` showed a product's output filled first reported nothing. So
// under the tool a product that only writes its output (beta = 0) first zeroes exactly the
// output's elements (`blas.rs`: a 2D memset of its rows), which the tool does see; with that,
// the same tests gave 544 reports (run 3). 512 of those were `cast_contig_f16_f32` reading
// 2,048 f16 elements in the mixed-precision conformance run, the size of its fp16 attention
// case's dK and dV, which cuDNN's flash-attention backward writes (its dQ goes through cuDNN's
// own conversion kernel): so cuDNN's attention outputs are zeroed first under the tool too
// (`cudnn_sdpa.rs`; session 51 run 1: the fp16 attention case then gave 0 reports).
// The libraries' workspaces too: `ember train`'s CNN (batch 128) gave 802,816 reports in
// cuDNN's `nhwcToNchwKernel` after its data-gradient convolution (fp32) and 372,736 in
// cuBLASLt's `splitKreduce_kernel` (fp16), vendor kernels reading the partial results their
// own kernels had stored in the workspace (session 52 run 1). So a workspace is zeroed when it
// is allocated under the tool ([`library_buffer`]): the tool counts bytes initialized from
// their first seen write on, so one memset covers every later use of the workspace. The same
// four runs then gave 0 reports (run 3).
// `EMBER_SANITIZER_PREFILL=0` turns all of this off, and the kernel copies of Note [Graph
// copies under initcheck] too (`scripts/initcheck-probe.sh` sets it, to show the tool's own
// view). Nothing changes without the tool.
//
// Note [Graph copies under initcheck]: initcheck checks a graph's memcpy nodes at the graph's
// launch (the reports' host backtraces end in `cuGraphLaunch`), so a device copy captured after
// a kernel of the same graph that writes its source is reported at the first replay, once per
// 32 bytes copied, though the kernel runs first: 1,250 reports for a captured in-place draw's
// 40,000 bytes (`cuda_capture::a_captured_draw_draws_new_numbers_at_every_replay`), 2,562 for a
// captured step's 81,980 bytes of parameter copies (session 51 run 1), 32 for a dropout mask's
// 1,024 (session 50 run 3; dropout draws its mask without a copy since). Every replay equals
// eager execution bit for bit. So under the tool a same-dtype contiguous copy made while a
// capture is underway on its GPU is the copy kernel (`cast_contig` of one dtype), whose reads
// the tool checks when they happen.

/// Whether ember works around what compute-sanitizer cannot see (Note [Library outputs under
/// initcheck], Note [Graph copies under initcheck]): under the tool, unless
/// `EMBER_SANITIZER_PREFILL=0`. Read once per process.
pub(crate) fn sanitizer_workarounds() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        under_compute_sanitizer() && std::env::var("EMBER_SANITIZER_PREFILL").as_deref() != Ok("0")
    })
}

/// `len` elements of `dtype` for a library (cuBLASLt, cuDNN) to write, as an output or a
/// workspace: zeroed first under compute-sanitizer (Note [Library outputs under initcheck]),
/// else as the caching allocator gives them.
pub(crate) fn library_buffer(
    rt: &runtime::DeviceRuntime,
    dtype: crate::DType,
    len: usize,
) -> crate::Result<storage::CudaStorage> {
    if sanitizer_workarounds() {
        storage::CudaStorage::full(rt.ordinal, dtype, len, 0.0)
    } else {
        storage::CudaStorage::alloc_on(rt, dtype, len)
    }
}

/// Compiles every kernel source with NVRTC for `arch` (e.g. `"sm_90"`), every unit of each
/// file at once (`-DEMBER_ALL_UNITS`, Note [Kernel units]), without a GPU: what CI runs so that
/// a kernel that does not compile fails the build, not a user.
pub fn compile_all_kernels(arch: &str) -> crate::Result<Vec<(&'static str, Vec<u8>)>> {
    let all = ["-DEMBER_ALL_UNITS".to_string()];
    Module::ALL
        .iter()
        .map(|m| nvrtc::compile_with(m.name(), m.source(), arch, &all).map(|cubin| (m.name(), cubin)))
        .collect()
}
