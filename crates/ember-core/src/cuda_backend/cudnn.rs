//! Convolution on CUDA through cuDNN's convolution API (forward, backward data, backward
//! filter), and the switches PyTorch users know as `torch.backends.cudnn.{enabled, benchmark,
//! deterministic, allow_tf32}` (public as [`crate::backends::cudnn`]).
//!
//! cuDNN is loaded dynamically (`libcudnn.so.9`): where it is missing, [`is_available`] is false,
//! the CUDA backend's convolution answers `None` (its `ConvOps` below), and
//! `ops::conv::convolution` takes its composite im2col + GEMM path.
//! cudarc's bindings target cuDNN 9.2; the calls used here (`cudnnConvolutionForward`,
//! `cudnnConvolutionBackwardData/Filter`, `cudnnGet*Algorithm_v7`, `cudnnFind*AlgorithmEx`)
//! are cuDNN's legacy API, deprecated in cuDNN 9 but present and supported (libcudnn_cnn).
//! They only run the problems the graph API takes no engine for: a convolution runs through an
//! execution plan of the graph API, made once per problem (Note [cuDNN execution plans] in
//! `cudnn_graph.rs`), whose calls cost the host a quarter of the legacy ones.
//!
//! Note [cuDNN state]: as cuBLASLt's (Note [cuBLASLt state] in `blas.rs`), and for the same
//! reason: a handle must never be used by two threads at once. Each thread has its own handle
//! per device (from a per-device pool, returned to it when the thread exits), bound with
//! `cudnnSetStream` to the current stream before every call; its own plans (tensor, filter and
//! convolution descriptors plus the execution plan or algorithm chosen per direction, keyed
//! by everything the choice depends on: shapes, geometry, dtype, pointer alignment and the
//! switches), and its own workspace per (device, stream) from the caching allocator, grown to
//! the largest size asked for and kept until the thread exits.
//!
//! Note [cuDNN algorithm choice], for the legacy calls: with `benchmark` off,
//! `cudnnGet*Algorithm_v7` ranks the algorithms by heuristics; with it on,
//! `cudnnFind*AlgorithmEx` runs them all once on the call's own buffers (the output is
//! overwritten by the real call right after) and ranks them by time. Either way the first
//! candidate that succeeded, is deterministic when `deterministic` is set, does not use TF32
//! when float32 must be exact, and whose workspace can be allocated, is cached in the plan.
//! Math types follow PyTorch: tensor-op math for f16/bf16, FMA only for f32 without TF32
//! (`allow_tf32` off), otherwise cuDNN's default, then the chosen algorithm's own.

use super::cudnn_graph;
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use super::stream::current_raw;
use crate::backend::BackendStorage;
use crate::backend::ConvOps;
use crate::backend::ConvParams;
use crate::{DType, Error, Result};
use cudarc::cudnn::sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// Plans kept per thread before its cache is cleared (each holds four small descriptors).
const MAX_PLANS: usize = 1024;
/// The most workspace handed to `cudnnFind*AlgorithmEx` while benchmarking, in bytes (1 GiB).
const MAX_FIND_WORKSPACE: usize = 1 << 30;

// ---------------------------------------------------------------------------------------------
// Switches (`torch.backends.cudnn`).

static ENABLED: AtomicBool = AtomicBool::new(true);
static BENCHMARK: AtomicBool = AtomicBool::new(false);
static DETERMINISTIC: AtomicBool = AtomicBool::new(false);
static ALLOW_TF32: AtomicBool = AtomicBool::new(true);

/// Whether `libcudnn.so.9` (or another name cudarc tries) can be loaded.
pub fn is_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library file; its initializers have no preconditions.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// cuDNN's version as `cudnnGetVersion` reports it (e.g. 91400 for 9.14.0), or `None` when the
/// library cannot be loaded.
pub fn version() -> Option<usize> {
    // SAFETY: the library loads (checked first); cudnnGetVersion takes no arguments and needs no
    // device.
    is_available().then(|| unsafe { sys::cudnnGetVersion() })
}

/// Whether convolutions and pooling on CUDA may use cuDNN (default true).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}
/// Allows or forbids cuDNN for convolutions and pooling on CUDA
/// (`torch.backends.cudnn.enabled = ...`).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed)
}
/// Whether algorithms are chosen by timing them once per shape (default false).
pub fn benchmark() -> bool {
    BENCHMARK.load(Ordering::Relaxed)
}
/// Chooses algorithms by timing (`true`) or by cuDNN's heuristics (`false`).
pub fn set_benchmark(on: bool) {
    BENCHMARK.store(on, Ordering::Relaxed)
}
/// Whether only deterministic algorithms are used (default false).
pub fn deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}
/// Restricts cuDNN to deterministic algorithms (bitwise repeatable gradients) or lifts that.
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(on, Ordering::Relaxed)
}
/// Whether float32 convolutions may use TensorFloat-32 tensor cores (default true, as
/// PyTorch's `torch.backends.cudnn.allow_tf32`).
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}
/// Allows or forbids TensorFloat-32 in float32 convolutions.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Handles, plans and workspaces (Note [cuDNN state]).

struct Handle(sys::cudnnHandle_t);
// SAFETY: a handle moves between threads only through the pool, so one thread uses it at a
// time (Note [cuDNN state]); it is never destroyed.
unsafe impl Send for Handle {}

static POOLS: OnceLock<Mutex<HashMap<usize, Vec<Handle>>>> = OnceLock::new();

fn pools() -> &'static Mutex<HashMap<usize, Vec<Handle>>> {
    POOLS.get_or_init(Default::default)
}

#[derive(Default)]
struct ThreadDnn {
    handles: HashMap<usize, Handle>,
    plans: HashMap<(usize, ConvKey), Plan>,
    workspaces: HashMap<(usize, u64), CudaStorage>,
}

impl Drop for ThreadDnn {
    fn drop(&mut self) {
        // Plans destroy their descriptors (execution plans before their handle can pass to
        // another thread); workspaces go back to the caching allocator on their streams (which
        // orders reuse after the work queued there); handles go to the pool.
        self.plans.clear();
        let mut pools = pools().lock().unwrap_or_else(|e| e.into_inner());
        for (ordinal, handle) in self.handles.drain() {
            pools.entry(ordinal).or_default().push(handle);
        }
    }
}

thread_local! {
    static THREAD_DNN: RefCell<ThreadDnn> = RefCell::default();
}

fn check(what: &'static str, status: sys::cudnnStatus_t) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            op: "conv",
            msg: format!("cuDNN {what}: {status:?}"),
        })
    }
}

impl ThreadDnn {
    /// This thread's handle for `rt`'s device (whose context is current), bound to `stream`.
    fn handle(&mut self, rt: &DeviceRuntime, stream: u64) -> Result<sys::cudnnHandle_t> {
        let raw = match self.handles.get(&rt.ordinal) {
            Some(h) => h.0,
            None => {
                let pooled = pools()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_mut(&rt.ordinal)
                    .and_then(Vec::pop);
                let handle = match pooled {
                    Some(h) => h,
                    None => {
                        let mut h = std::ptr::null_mut();
                        // SAFETY: `h` is a valid out-pointer; the device's context is current.
                        check("cudnnCreate", unsafe { sys::cudnnCreate(&mut h) })?;
                        Handle(h)
                    }
                };
                let raw = handle.0;
                self.handles.insert(rt.ordinal, handle);
                raw
            }
        };
        // SAFETY: the handle is this thread's alone; `stream` is a live stream of its device.
        check("cudnnSetStream", unsafe {
            sys::cudnnSetStream(raw, stream as sys::cudaStream_t)
        })?;
        Ok(raw)
    }

    /// This thread's workspace on (device, stream), at least `bytes` long; `(0, 0)` for none.
    fn workspace(&mut self, rt: &DeviceRuntime, stream: u64, bytes: usize) -> Result<(u64, usize)> {
        if bytes == 0 {
            return Ok((0, 0));
        }
        let key = (rt.ordinal, stream);
        if let Some(w) = self.workspaces.get(&key).filter(|w| w.len() >= bytes) {
            return Ok((w.ptr_at(0), w.len()));
        }
        // Free the smaller one first so that the allocator can reuse its memory.
        self.workspaces.remove(&key);
        let w = super::library_buffer(rt, DType::U8, bytes)?;
        let out = (w.ptr_at(0), w.len());
        self.workspaces.insert(key, w);
        Ok(out)
    }
}

/// Runs `f` with this thread's handle for `rt`'s device (whose context is current), bound to
/// the current stream (Note [cuDNN state]); for the calls that need no plan or workspace
/// (pooling, `cudnn_pool.rs`). `f` must not call back into this module's state.
pub(super) fn with_handle<T>(
    op: &'static str,
    rt: &DeviceRuntime,
    f: impl FnOnce(sys::cudnnHandle_t) -> Result<T>,
) -> Result<T> {
    let stream = current_raw(rt.ordinal);
    // cuDNN compiles and loads kernels, copies and fills of its own (Note [CUPTI beside other
    // threads' CUDA work] in `cupti.rs`).
    let _gate = super::cupti::work_guard();
    let handle = THREAD_DNN
        .try_with(|t| t.borrow_mut().handle(rt, stream))
        .map_err(|_| Error::Cuda {
            op,
            msg: "called while the thread is exiting (its cuDNN state is gone)".into(),
        })??;
    f(handle)
}

// ---------------------------------------------------------------------------------------------
// Problems and plans.

/// Whether cuDNN can take the problem: a float dtype, no empty dims, and every count, tensor
/// size and geometry value within its 32-bit limits.
pub(crate) fn supported(p: &ConvParams) -> bool {
    let fits = |v: usize| v > 0 && v <= i32::MAX as usize;
    let Some(out) = p.output() else { return false };
    matches!(p.dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
        && [p.input, p.weight, out]
            .iter()
            .all(|t| t.iter().all(|&d| fits(d)) && fits(t.iter().product()))
        && p.stride.iter().chain(&p.dilation).all(|&v| fits(v))
        && p.padding.iter().all(|&v| v <= i32::MAX as usize)
        && fits(p.groups)
}

/// Everything a plan depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ConvKey {
    params: ConvParams,
    tf32: bool,
    deterministic: bool,
    benchmark: bool,
    /// Whether every data pointer of the call is 16-byte aligned (an execution plan is made
    /// for the alignment it will see, Note [cuDNN execution plans]).
    aligned: bool,
}

/// Which of the three convolution calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Forward,
    BackwardData,
    BackwardFilter,
}

#[derive(Debug, Clone, Copy)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    BackwardData(sys::cudnnConvolutionBwdDataAlgo_t),
    BackwardFilter(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// One ranked algorithm (the fields the three perf structs share).
#[derive(Debug, Clone, Copy)]
struct Choice {
    algo: Algo,
    math: sys::cudnnMathType_t,
    workspace: usize,
}

/// Where a direction of a problem runs (Note [cuDNN execution plans]).
enum Graph {
    /// Not tried yet.
    Untried,
    /// Through this execution plan.
    Ready(cudnn_graph::ExecPlan),
    /// Through the legacy calls: the graph API took no engine for it.
    Legacy,
}

/// Descriptors of one problem, and per direction its execution plan (or that the legacy calls
/// run it) and the legacy algorithm chosen.
struct Plan {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    chosen: [Option<Choice>; 3],
    graph: [Graph; 3],
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Plan::new` (or is null) and is destroyed only
        // here; destroying a null descriptor is a no-op in cuDNN.
        unsafe {
            let _ = sys::cudnnDestroyTensorDescriptor(self.x);
            let _ = sys::cudnnDestroyTensorDescriptor(self.y);
            let _ = sys::cudnnDestroyFilterDescriptor(self.w);
            let _ = sys::cudnnDestroyConvolutionDescriptor(self.conv);
        }
    }
}

pub(super) fn data_type(dtype: DType) -> sys::cudnnDataType_t {
    match dtype {
        DType::F64 => sys::cudnnDataType_t::CUDNN_DATA_DOUBLE,
        DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        _ => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    }
}

/// The math type set on the descriptor before choosing (Note [cuDNN algorithm choice]).
fn base_math(key: &ConvKey) -> sys::cudnnMathType_t {
    use sys::cudnnMathType_t as M;
    match key.params.dtype {
        DType::F16 | DType::BF16 => M::CUDNN_TENSOR_OP_MATH,
        DType::F32 if !key.tf32 => M::CUDNN_FMA_MATH,
        _ => M::CUDNN_DEFAULT_MATH,
    }
}

fn set_tensor(desc: sys::cudnnTensorDescriptor_t, dtype: DType, dims: [usize; 4]) -> Result<()> {
    let d = dims.map(|v| v as i32);
    let s = [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1];
    // SAFETY: `desc` is live; `d` and `s` hold 4 values each (sizes checked by `supported`).
    check("cudnnSetTensorNdDescriptor", unsafe {
        sys::cudnnSetTensorNdDescriptor(desc, data_type(dtype), 4, d.as_ptr(), s.as_ptr())
    })
}

impl Plan {
    fn new(key: &ConvKey) -> Result<Plan> {
        let p = &key.params;
        let mut plan = Plan {
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            chosen: [None; 3],
            graph: [Graph::Untried, Graph::Untried, Graph::Untried],
        };
        // SAFETY: out-pointers to this plan's fields; whatever was created is freed by Drop.
        unsafe {
            check(
                "cudnnCreateTensorDescriptor",
                sys::cudnnCreateTensorDescriptor(&mut plan.x),
            )?;
            check(
                "cudnnCreateTensorDescriptor",
                sys::cudnnCreateTensorDescriptor(&mut plan.y),
            )?;
            check(
                "cudnnCreateFilterDescriptor",
                sys::cudnnCreateFilterDescriptor(&mut plan.w),
            )?;
            check(
                "cudnnCreateConvolutionDescriptor",
                sys::cudnnCreateConvolutionDescriptor(&mut plan.conv),
            )?;
        }
        let out = p.output().expect("checked by supported()");
        set_tensor(plan.x, p.dtype, p.input)?;
        set_tensor(plan.y, p.dtype, out)?;
        let w = p.weight.map(|v| v as i32);
        let (pad, stride, dil) = (
            p.padding.map(|v| v as i32),
            p.stride.map(|v| v as i32),
            p.dilation.map(|v| v as i32),
        );
        let compute = if p.dtype == DType::F64 {
            sys::cudnnDataType_t::CUDNN_DATA_DOUBLE
        } else {
            sys::cudnnDataType_t::CUDNN_DATA_FLOAT
        };
        // SAFETY: the descriptors are live; each array holds the 4 (filter) or 2 (geometry)
        // values the calls read.
        unsafe {
            check(
                "cudnnSetFilterNdDescriptor",
                sys::cudnnSetFilterNdDescriptor(
                    plan.w,
                    data_type(p.dtype),
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
                    4,
                    w.as_ptr(),
                ),
            )?;
            check(
                "cudnnSetConvolutionNdDescriptor",
                sys::cudnnSetConvolutionNdDescriptor(
                    plan.conv,
                    2,
                    pad.as_ptr(),
                    stride.as_ptr(),
                    dil.as_ptr(),
                    sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    compute,
                ),
            )?;
            check(
                "cudnnSetConvolutionGroupCount",
                sys::cudnnSetConvolutionGroupCount(plan.conv, p.groups as i32),
            )?;
        }
        Ok(plan)
    }

    fn set_math(&self, math: sys::cudnnMathType_t) -> Result<()> {
        // SAFETY: the convolution descriptor is live and this thread's alone.
        check("cudnnSetConvolutionMathType", unsafe {
            sys::cudnnSetConvolutionMathType(self.conv, math)
        })
    }
}

/// The device buffers of one call: (a, b, out) as the direction's cuDNN call names them:
/// forward (x, w, y), backward data (w, dy, dx), backward filter (x, dy, dw).
#[derive(Clone, Copy)]
struct Buffers {
    a: u64,
    b: u64,
    out: u64,
}

/// A perf struct's shared fields, as a candidate.
macro_rules! candidate {
    ($perf:expr, $variant:ident) => {{
        let p = $perf;
        (
            Algo::$variant(p.algo),
            p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
            p.memory,
            p.determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
            p.mathType,
        )
    }};
}

type Candidate = (Algo, bool, usize, bool, sys::cudnnMathType_t);

/// Ranked candidates for `dir`: by heuristics, or by running them when `find` gives the
/// workspace (pointer, bytes) to run them with (Note [cuDNN algorithm choice]).
fn candidates(
    handle: sys::cudnnHandle_t,
    plan: &Plan,
    dir: Direction,
    bufs: Buffers,
    find: Option<(u64, usize)>,
) -> Result<Vec<Candidate>> {
    let mut n = 0i32;
    let (x, y, w, conv) = (plan.x, plan.y, plan.w, plan.conv);
    let (a, b, o) = (
        bufs.a as *const c_void,
        bufs.b as *const c_void,
        bufs.out as *mut c_void,
    );
    // SAFETY: the descriptors are live and describe the buffers, which are valid device memory
    // of those shapes on the handle's stream; each perf array holds the requested count, and
    // `n` reports how many were written. Find*Ex writes the output buffer, which the real call
    // overwrites afterwards, and uses at most `ws` bytes at `wp`.
    unsafe {
        match (dir, find) {
            (Direction::Forward, None) => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionFwdAlgoPerf_t>(); 8];
                check(
                    "cudnnGetConvolutionForwardAlgorithm_v7",
                    sys::cudnnGetConvolutionForwardAlgorithm_v7(
                        handle,
                        x,
                        w,
                        conv,
                        y,
                        8,
                        &mut n,
                        perf.as_mut_ptr(),
                    ),
                )?;
                Ok(perf[..n.clamp(0, 8) as usize]
                    .iter()
                    .map(|p| candidate!(p, Forward))
                    .collect())
            }
            (Direction::Forward, Some((wp, ws))) => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionFwdAlgoPerf_t>(); 8];
                check(
                    "cudnnFindConvolutionForwardAlgorithmEx",
                    sys::cudnnFindConvolutionForwardAlgorithmEx(
                        handle,
                        x,
                        a,
                        w,
                        b,
                        conv,
                        y,
                        o,
                        8,
                        &mut n,
                        perf.as_mut_ptr(),
                        wp as *mut c_void,
                        ws,
                    ),
                )?;
                Ok(perf[..n.clamp(0, 8) as usize]
                    .iter()
                    .map(|p| candidate!(p, Forward))
                    .collect())
            }
            (Direction::BackwardData, None) => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdDataAlgoPerf_t>(); 8];
                check(
                    "cudnnGetConvolutionBackwardDataAlgorithm_v7",
                    sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                        handle,
                        w,
                        y,
                        conv,
                        x,
                        8,
                        &mut n,
                        perf.as_mut_ptr(),
                    ),
                )?;
                Ok(perf[..n.clamp(0, 8) as usize]
                    .iter()
                    .map(|p| candidate!(p, BackwardData))
                    .collect())
            }
            (Direction::BackwardData, Some((wp, ws))) => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdDataAlgoPerf_t>(); 8];
                check(
                    "cudnnFindConvolutionBackwardDataAlgorithmEx",
                    sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        handle,
                        w,
                        a,
                        y,
                        b,
                        conv,
                        x,
                        o,
                        8,
                        &mut n,
                        perf.as_mut_ptr(),
                        wp as *mut c_void,
                        ws,
                    ),
                )?;
                Ok(perf[..n.clamp(0, 8) as usize]
                    .iter()
                    .map(|p| candidate!(p, BackwardData))
                    .collect())
            }
            (Direction::BackwardFilter, None) => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>(); 8];
                check(
                    "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
                    sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                        handle,
                        x,
                        y,
                        conv,
                        w,
                        8,
                        &mut n,
                        perf.as_mut_ptr(),
                    ),
                )?;
                Ok(perf[..n.clamp(0, 8) as usize]
                    .iter()
                    .map(|p| candidate!(p, BackwardFilter))
                    .collect())
            }
            (Direction::BackwardFilter, Some((wp, ws))) => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>(); 8];
                check(
                    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
                    sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        handle,
                        x,
                        a,
                        y,
                        b,
                        conv,
                        w,
                        o,
                        8,
                        &mut n,
                        perf.as_mut_ptr(),
                        wp as *mut c_void,
                        ws,
                    ),
                )?;
                Ok(perf[..n.clamp(0, 8) as usize]
                    .iter()
                    .map(|p| candidate!(p, BackwardFilter))
                    .collect())
            }
        }
    }
}

/// The workspace `algo` needs with the descriptor's current math type.
fn workspace_size(handle: sys::cudnnHandle_t, plan: &Plan, algo: Algo) -> Result<usize> {
    let mut bytes = 0usize;
    let (x, y, w, conv) = (plan.x, plan.y, plan.w, plan.conv);
    // SAFETY: live descriptors of one problem and a valid out-pointer.
    unsafe {
        match algo {
            Algo::Forward(a) => check(
                "cudnnGetConvolutionForwardWorkspaceSize",
                sys::cudnnGetConvolutionForwardWorkspaceSize(handle, x, w, conv, y, a, &mut bytes),
            )?,
            Algo::BackwardData(a) => check(
                "cudnnGetConvolutionBackwardDataWorkspaceSize",
                sys::cudnnGetConvolutionBackwardDataWorkspaceSize(handle, w, y, conv, x, a, &mut bytes),
            )?,
            Algo::BackwardFilter(a) => check(
                "cudnnGetConvolutionBackwardFilterWorkspaceSize",
                sys::cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, x, y, conv, w, a, &mut bytes),
            )?,
        }
    }
    Ok(bytes)
}

/// Whether a candidate may be used under the key's switches.
fn acceptable(key: &ConvKey, c: &Candidate) -> bool {
    let (_, ok, _, deterministic, math) = *c;
    let tensor_op = matches!(
        math,
        sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH
            | sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
    );
    // f32 without TF32 keeps FMA math whatever the candidate says (Note [cuDNN algorithm choice]).
    let exact_f32 = key.params.dtype == DType::F32 && !key.tf32;
    ok && (deterministic || !key.deterministic) && !(exact_f32 && tensor_op)
}

/// Runs one direction of `params` on (`a`, `b`) into `out` (Note [cuDNN state]).
fn run(rt: &DeviceRuntime, params: ConvParams, dir: Direction, bufs: Buffers) -> Result<()> {
    let key = ConvKey {
        params,
        tf32: allow_tf32(),
        deterministic: deterministic(),
        benchmark: benchmark(),
        aligned: [bufs.a, bufs.b, bufs.out].iter().all(|p| p % 16 == 0),
    };
    let stream = current_raw(rt.ordinal);
    let body = |t: &mut ThreadDnn| -> Result<()> {
        let handle = t.handle(rt, stream)?;
        if t.plans.len() >= MAX_PLANS && !t.plans.contains_key(&(rt.ordinal, key)) {
            t.plans.clear();
        }
        if !t.plans.contains_key(&(rt.ordinal, key)) {
            t.plans.insert((rt.ordinal, key), Plan::new(&key)?);
        }
        if run_graph(t, rt, stream, handle, &key, dir, bufs)? {
            return Ok(());
        }
        let slot = dir as usize;
        let chosen = t.plans[&(rt.ordinal, key)].chosen[slot];
        let choice = match chosen {
            Some(c) => c,
            None => {
                let c = choose(t, rt, stream, handle, &key, dir, bufs)?;
                if let Some(plan) = t.plans.get_mut(&(rt.ordinal, key)) {
                    plan.chosen[slot] = Some(c);
                }
                c
            }
        };
        let (wp, ws) = t.workspace(rt, stream, choice.workspace)?;
        super::kernel_timing::note_work(stream);
        let plan = &t.plans[&(rt.ordinal, key)];
        plan.set_math(choice.math)?;
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if params.dtype == DType::F64 {
            ((&one64 as *const f64).cast(), (&zero64 as *const f64).cast())
        } else {
            ((&one32 as *const f32).cast(), (&zero32 as *const f32).cast())
        };
        let (a, b, o) = (
            bufs.a as *const c_void,
            bufs.b as *const c_void,
            bufs.out as *mut c_void,
        );
        // SAFETY: the plan's descriptors describe exactly the contiguous buffers (the caller's
        // contract: `a`, `b` and `out` hold the direction's operand shapes of `params`); beta = 0
        // so `out` is only written. alpha/beta are host scalars of the scale type (double for
        // f64, float otherwise) that outlive the call. The workspace holds `ws >= choice.workspace`
        // bytes used only on `stream`, the handle's stream; handle and plan are this thread's
        // alone (Note [cuDNN state]).
        let status = unsafe {
            match choice.algo {
                Algo::Forward(algo) => sys::cudnnConvolutionForward(
                    handle,
                    alpha,
                    plan.x,
                    a,
                    plan.w,
                    b,
                    plan.conv,
                    algo,
                    wp as *mut c_void,
                    ws,
                    beta,
                    plan.y,
                    o,
                ),
                Algo::BackwardData(algo) => sys::cudnnConvolutionBackwardData(
                    handle,
                    alpha,
                    plan.w,
                    a,
                    plan.y,
                    b,
                    plan.conv,
                    algo,
                    wp as *mut c_void,
                    ws,
                    beta,
                    plan.x,
                    o,
                ),
                Algo::BackwardFilter(algo) => sys::cudnnConvolutionBackwardFilter(
                    handle,
                    alpha,
                    plan.x,
                    a,
                    plan.y,
                    b,
                    plan.conv,
                    algo,
                    wp as *mut c_void,
                    ws,
                    beta,
                    plan.w,
                    o,
                ),
            }
        };
        check(
            match dir {
                Direction::Forward => "cudnnConvolutionForward",
                Direction::BackwardData => "cudnnConvolutionBackwardData",
                Direction::BackwardFilter => "cudnnConvolutionBackwardFilter",
            },
            status,
        )
    };
    // As in `with_handle`.
    let _gate = super::cupti::work_guard();
    THREAD_DNN
        .try_with(|t| body(&mut t.borrow_mut()))
        .map_err(|_| Error::Cuda {
            op: "conv",
            msg: "called while the thread is exiting (its cuDNN state is gone)".into(),
        })?
}

/// Runs `dir` of the key's problem through its execution plan, made on first use (Note [cuDNN
/// execution plans]); false where the problem runs through the legacy calls instead.
fn run_graph(
    t: &mut ThreadDnn,
    rt: &DeviceRuntime,
    stream: u64,
    handle: sys::cudnnHandle_t,
    key: &ConvKey,
    dir: Direction,
    bufs: Buffers,
) -> Result<bool> {
    let (slot, at) = (dir as usize, (rt.ordinal, *key));
    if matches!(t.plans[&at].graph[slot], Graph::Untried) {
        let p = &key.params;
        let problem = cudnn_graph::Problem {
            conv: *p,
            alignment: if key.aligned {
                16
            } else {
                p.dtype.size_in_bytes() as i64
            },
            deterministic: key.deterministic,
            tf32: key.tf32,
        };
        let op = match dir {
            Direction::Forward => cudnn_graph::Op::Forward,
            Direction::BackwardData => cudnn_graph::Op::BackwardData,
            Direction::BackwardFilter => cudnn_graph::Op::BackwardFilter,
        };
        let limit = if key.benchmark {
            cudnn_graph::BENCHMARK_LIMIT
        } else {
            1
        };
        let built = cudnn_graph::plans(handle, op, &problem, limit, |bytes| {
            (!key.benchmark || bytes <= MAX_FIND_WORKSPACE) && t.workspace(rt, stream, bytes).is_ok()
        });
        let chosen = match built {
            Ok(plans) if key.benchmark => fastest(t, rt, stream, handle, plans, dir, bufs)?,
            Ok(plans) => plans.into_iter().next(),
            // The graph API refused the problem.
            Err(_) => None,
        };
        // Without a plan the legacy calls run the problem.
        let state = chosen.map_or(Graph::Legacy, Graph::Ready);
        if let Some(plan) = t.plans.get_mut(&at) {
            plan.graph[slot] = state;
        }
    }
    let bytes = match &t.plans[&at].graph[slot] {
        Graph::Ready(plan) => plan.workspace,
        _ => return Ok(false),
    };
    let (wp, _) = t.workspace(rt, stream, bytes)?;
    let Graph::Ready(plan) = &t.plans[&at].graph[slot] else {
        return Ok(false);
    };
    execute(handle, plan, stream, dir, bufs, wp)?;
    Ok(true)
}

/// Runs `plan` for `dir` on `bufs` with the workspace at `wp` (at least the plan's bytes, used
/// only on `stream`, the handle's stream).
fn execute(
    handle: sys::cudnnHandle_t,
    plan: &cudnn_graph::ExecPlan,
    stream: u64,
    dir: Direction,
    bufs: Buffers,
    wp: u64,
) -> Result<()> {
    // The three tensors by their role in the convolution: input, weight, output.
    let (x, w, y) = match dir {
        Direction::Forward => (bufs.a, bufs.b, bufs.out),
        Direction::BackwardData => (bufs.out, bufs.a, bufs.b),
        Direction::BackwardFilter => (bufs.a, bufs.out, bufs.b),
    };
    super::kernel_timing::note_work(stream);
    // SAFETY: the buffers hold the direction's operand shapes of the problem the plan was made
    // for, aligned as its key says (the callers' contract with `run`); the workspace is as the
    // caller says; handle and plan are this thread's alone (Note [cuDNN state]).
    unsafe { cudnn_graph::execute(handle, plan, x, w, y, wp) }.map_err(|e| Error::Cuda {
        op: "conv",
        msg: format!("cuDNN {e}"),
    })
}

/// The fastest of `plans` on the call's own buffers (Note [cuDNN execution plans]: each runs
/// once to warm up, then once between two timing events); None when none ran. The output is
/// overwritten by the real call right after. The workspace grown for the candidates is let go.
fn fastest(
    t: &mut ThreadDnn,
    rt: &DeviceRuntime,
    stream: u64,
    handle: sys::cudnnHandle_t,
    plans: Vec<cudnn_graph::ExecPlan>,
    dir: Direction,
    bufs: Buffers,
) -> Result<Option<cudnn_graph::ExecPlan>> {
    let on = super::stream::current_stream(rt.ordinal)?;
    let mut best: Option<(f32, cudnn_graph::ExecPlan)> = None;
    for plan in plans {
        let Ok((wp, _)) = t.workspace(rt, stream, plan.workspace) else {
            continue;
        };
        let (start, end) = (super::Event::new(true), super::Event::new(true));
        let timed = execute(handle, &plan, stream, dir, bufs, wp)
            .and_then(|()| start.record_on(&on))
            .and_then(|()| execute(handle, &plan, stream, dir, bufs, wp))
            .and_then(|()| end.record_on(&on))
            .and_then(|()| end.synchronize())
            .and_then(|()| start.elapsed_time(&end));
        if let Ok(ms) = timed {
            if best.as_ref().is_none_or(|(b, _)| ms < *b) {
                best = Some((ms, plan));
            }
        }
    }
    // Keep no more than the chosen plan needs (the allocator orders the reuse of this memory
    // after the timing runs queued on `stream`).
    t.workspaces.remove(&(rt.ordinal, stream));
    Ok(best.map(|(_, plan)| plan))
}

/// Picks the algorithm for `dir` (Note [cuDNN algorithm choice]).
fn choose(
    t: &mut ThreadDnn,
    rt: &DeviceRuntime,
    stream: u64,
    handle: sys::cudnnHandle_t,
    key: &ConvKey,
    dir: Direction,
    bufs: Buffers,
) -> Result<Choice> {
    let base = base_math(key);
    t.plans[&(rt.ordinal, *key)].set_math(base)?;
    let heuristic = candidates(handle, &t.plans[&(rt.ordinal, *key)], dir, bufs, None)?;
    let ranked = if key.benchmark {
        // Enough workspace for every algorithm the heuristics list, within MAX_FIND_WORKSPACE.
        let want = heuristic
            .iter()
            .filter(|c| c.1)
            .map(|c| c.2)
            .filter(|&m| m <= MAX_FIND_WORKSPACE)
            .max()
            .unwrap_or(0);
        let ws = t
            .workspace(rt, stream, want)
            .or_else(|_| t.workspace(rt, stream, 0))?;
        let found = candidates(handle, &t.plans[&(rt.ordinal, *key)], dir, bufs, Some(ws));
        // Keep no more than the chosen algorithm needs (the allocator orders the reuse of this
        // memory after the timing runs queued on `stream`).
        t.workspaces.remove(&(rt.ordinal, stream));
        found?
    } else {
        heuristic
    };
    for c in ranked.iter().filter(|c| acceptable(key, c)) {
        let math = if key.params.dtype == DType::F32 && !key.tf32 {
            base
        } else {
            c.4
        };
        let bytes = {
            let plan = &t.plans[&(rt.ordinal, *key)];
            plan.set_math(math)?;
            workspace_size(handle, plan, c.0)?.max(c.2)
        };
        // An algorithm whose workspace cannot be allocated gives way to the next one.
        match t.workspace(rt, stream, bytes) {
            Ok(_) => {
                return Ok(Choice {
                    algo: c.0,
                    math,
                    workspace: bytes,
                })
            }
            Err(Error::OutOfMemory { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Error::Cuda {
        op: "conv",
        msg: format!(
            "cuDNN offered no usable {dir:?} algorithm for {:?} (deterministic={}, allow_tf32={}); \
             turn cuDNN off with backends::cudnn::set_enabled(false) to use the im2col path",
            key.params, key.deterministic, key.tf32
        ),
    })
}

// ---------------------------------------------------------------------------------------------
// The convolution family on storages: forward, the two gradients and the bias.
//
// Convolution and pooling run through cuDNN and answer `None` (so that the op layer takes its
// composite path) where cuDNN cannot be loaded, is switched off
// (`crate::backends::cudnn::set_enabled`), or cannot take the problem (`supported`). The
// switch is read by the forward calls only: the backward of a problem cuDNN ran forward runs
// on cuDNN too, as in PyTorch.

fn check_operand(what: &str, s: &CudaStorage, dtype: DType, len: usize) {
    assert!(
        s.dtype() == dtype && s.len() >= len,
        "cudnn {what}: caller passes contiguous {dtype} storages of the problem's shapes"
    );
}

impl ConvOps for CudaStorage {
    /// `y = conv(x, w)` for contiguous `x` (`params.input`) and `w` (`params.weight`) starting at
    /// their first elements; a new contiguous `[N, O, OH, OW]` storage.
    fn conv_forward(&self, weight: &CudaStorage, params: &ConvParams) -> Result<Option<CudaStorage>> {
        if !cudnn_on() || !supported(params) {
            return Ok(None);
        }
        let (x, w) = (self, weight);
        let out = params.output().expect("checked by supported()");
        check_operand("forward", x, params.dtype, params.input.iter().product());
        check_operand("forward", w, params.dtype, params.weight.iter().product());
        let rt = x.runtime()?;
        let y = CudaStorage::alloc_on(rt, params.dtype, out.iter().product())?;
        let bufs = Buffers {
            a: x.ptr_at(0),
            b: w.ptr_at(0),
            out: y.ptr_at(0),
        };
        run(rt, *params, Direction::Forward, bufs)?;
        Ok(Some(y))
    }

    /// The input gradient from `w` and the output gradient `dy` (both contiguous).
    fn conv_backward_data(&self, grad_out: &CudaStorage, params: &ConvParams) -> Result<Option<CudaStorage>> {
        if !is_available() || !supported(params) {
            return Ok(None);
        }
        let (w, dy) = (self, grad_out);
        let out = params.output().expect("checked by supported()");
        check_operand("backward data", w, params.dtype, params.weight.iter().product());
        check_operand("backward data", dy, params.dtype, out.iter().product());
        let rt = w.runtime()?;
        let dx = CudaStorage::alloc_on(rt, params.dtype, params.input.iter().product())?;
        let bufs = Buffers {
            a: w.ptr_at(0),
            b: dy.ptr_at(0),
            out: dx.ptr_at(0),
        };
        run(rt, *params, Direction::BackwardData, bufs)?;
        Ok(Some(dx))
    }

    /// The weight gradient from `x` and the output gradient `dy` (both contiguous).
    fn conv_backward_filter(
        &self,
        grad_out: &CudaStorage,
        params: &ConvParams,
    ) -> Result<Option<CudaStorage>> {
        if !is_available() || !supported(params) {
            return Ok(None);
        }
        let (x, dy) = (self, grad_out);
        let out = params.output().expect("checked by supported()");
        check_operand("backward filter", x, params.dtype, params.input.iter().product());
        check_operand("backward filter", dy, params.dtype, out.iter().product());
        let rt = x.runtime()?;
        let dw = CudaStorage::alloc_on(rt, params.dtype, params.weight.iter().product())?;
        let bufs = Buffers {
            a: x.ptr_at(0),
            b: dy.ptr_at(0),
            out: dw.ptr_at(0),
        };
        run(rt, *params, Direction::BackwardFilter, bufs)?;
        Ok(Some(dw))
    }

    /// Adds the `[O]` `bias` to every channel of the convolution output `y` (`[N, O, OH, OW]` of
    /// `params`), in place (`cudnnAddTensor`). `Ok(false)` where this cuDNN does not take the dtype
    /// (`CUDNN_STATUS_NOT_SUPPORTED`); the caller adds the bias itself then. `y` must be the caller's
    /// alone (a fresh output).
    fn conv_bias_add(&self, bias: &CudaStorage, params: &ConvParams) -> Result<bool> {
        if !cudnn_on() || !supported(params) {
            return Ok(false);
        }
        let y = self;
        let out = params.output().expect("checked by supported()");
        check_operand("bias", y, params.dtype, out.iter().product());
        check_operand("bias", bias, params.dtype, out[1]);
        let rt = y.runtime()?;
        let (yd, bd) = (
            TensorDesc::new(params.dtype, out)?,
            TensorDesc::new(params.dtype, [1, out[1], 1, 1])?,
        );
        let mut scalars = Default::default();
        let (one, _) = one_and_zero(params.dtype, &mut scalars);
        super::kernel_timing::note_work(current_raw(rt.ordinal));
        let status = with_handle("convolution", rt, |handle| {
            // SAFETY: the descriptors describe exactly the contiguous buffers (checked above);
            // C = 1·bias + 1·C writes only `y`; the scalars outlive the call; the handle is this
            // thread's alone, bound to the current stream (Note [cuDNN state]).
            Ok(unsafe {
                sys::cudnnAddTensor(
                    handle,
                    one,
                    bd.0,
                    bias.ptr_at(0) as *const c_void,
                    one,
                    yd.0,
                    y.ptr_at(0) as *mut c_void,
                )
            })
        })?;
        if status == sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED {
            return Ok(false);
        }
        check("cudnnAddTensor", status)?;
        Ok(true)
    }
}

// ---------------------------------------------------------------------------------------------
// A convolution's bias and ReLU's backward (legacy cuDNN calls: one kernel each, no plan, no
// workspace).

/// A 4-d tensor descriptor made for one call and destroyed when dropped.
struct TensorDesc(sys::cudnnTensorDescriptor_t);

impl TensorDesc {
    fn new(dtype: DType, dims: [usize; 4]) -> Result<TensorDesc> {
        let mut d = TensorDesc(std::ptr::null_mut());
        // SAFETY: an out-pointer to the field; whatever was created is freed by Drop.
        check("cudnnCreateTensorDescriptor", unsafe {
            sys::cudnnCreateTensorDescriptor(&mut d.0)
        })?;
        set_tensor(d.0, dtype, dims)?;
        Ok(d)
    }
}

impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created by `TensorDesc::new` (or null: a no-op in cuDNN) and destroyed only here.
        unsafe {
            let _ = sys::cudnnDestroyTensorDescriptor(self.0);
        }
    }
}

/// Host scalars 1 and 0 of the scale type cuDNN reads for `dtype` (double for f64, float
/// otherwise), pointing into `scalars`.
fn one_and_zero(dtype: DType, scalars: &mut ([f32; 2], [f64; 2])) -> (*const c_void, *const c_void) {
    *scalars = ([1.0, 0.0], [1.0, 0.0]);
    if dtype == DType::F64 {
        (scalars.1.as_ptr().cast(), scalars.1[1..].as_ptr().cast())
    } else {
        (scalars.0.as_ptr().cast(), scalars.0[1..].as_ptr().cast())
    }
}

/// ReLU's input gradient from its output `y` and the output gradient `dy` (both contiguous
/// `len`-element storages of a float dtype): `dy` where `y > 0`, else 0, as PyTorch's
/// `threshold_backward`, in one kernel (`cudnnActivationBackward`); None where this cuDNN does
/// not take the problem.
pub(crate) fn relu_backward(y: &CudaStorage, dy: &CudaStorage, len: usize) -> Result<Option<CudaStorage>> {
    let dtype = y.dtype();
    if len == 0
        || len > i32::MAX as usize
        || !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    {
        return Ok(None);
    }
    check_operand("relu backward", y, dtype, len);
    check_operand("relu backward", dy, dtype, len);
    let rt = y.runtime()?;
    let dx = CudaStorage::alloc_on(rt, dtype, len)?;
    let desc = TensorDesc::new(dtype, [1, 1, 1, len])?;
    let act = ActivationDesc::relu()?;
    let mut scalars = Default::default();
    let (one, zero) = one_and_zero(dtype, &mut scalars);
    super::kernel_timing::note_work(current_raw(rt.ordinal));
    let (yp, dyp) = (y.ptr_at(0) as *const c_void, dy.ptr_at(0) as *const c_void);
    let status = with_handle("relu_backward", rt, |handle| {
        // SAFETY: one descriptor describes the three contiguous `len`-element buffers (checked
        // above; `dx` was allocated with `len`); y stands for x too (y > 0 exactly where x > 0);
        // beta = 0, so `dx` is only written; the scalars outlive the call; the handle is this
        // thread's alone, bound to the current stream (Note [cuDNN state]).
        Ok(unsafe {
            sys::cudnnActivationBackward(
                handle,
                act.0,
                one,
                desc.0,
                yp,
                desc.0,
                dyp,
                desc.0,
                yp,
                zero,
                desc.0,
                dx.ptr_at(0) as *mut c_void,
            )
        })
    })?;
    if status == sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED {
        return Ok(None);
    }
    check("cudnnActivationBackward", status)?;
    Ok(Some(dx))
}

/// A ReLU activation descriptor made for one call and destroyed when dropped.
struct ActivationDesc(sys::cudnnActivationDescriptor_t);

impl ActivationDesc {
    fn relu() -> Result<ActivationDesc> {
        let mut d = ActivationDesc(std::ptr::null_mut());
        // SAFETY: an out-pointer to the field; whatever was created is freed by Drop.
        check("cudnnCreateActivationDescriptor", unsafe {
            sys::cudnnCreateActivationDescriptor(&mut d.0)
        })?;
        // SAFETY: the descriptor is live; coef is unused by RELU.
        check("cudnnSetActivationDescriptor", unsafe {
            sys::cudnnSetActivationDescriptor(
                d.0,
                sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                sys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                0.0,
            )
        })?;
        Ok(d)
    }
}

impl Drop for ActivationDesc {
    fn drop(&mut self) {
        // SAFETY: created by `ActivationDesc::relu` (or null: a no-op) and destroyed only here.
        unsafe {
            let _ = sys::cudnnDestroyActivationDescriptor(self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(
        input: [usize; 4],
        weight: [usize; 4],
        stride: usize,
        padding: usize,
        dilation: usize,
    ) -> ConvParams {
        ConvParams {
            dtype: DType::F32,
            input,
            weight,
            stride: [stride; 2],
            padding: [padding; 2],
            dilation: [dilation; 2],
            groups: 1,
        }
    }

    #[test]
    fn supported_problems() {
        assert!(supported(&params([2, 3, 8, 8], [4, 3, 3, 3], 1, 0, 1)));
        assert!(!supported(&params([0, 3, 8, 8], [4, 3, 3, 3], 1, 0, 1)));
        let mut p = params([2, 3, 8, 8], [4, 3, 3, 3], 1, 0, 1);
        p.dtype = DType::I64;
        assert!(!supported(&p));
        assert!(!supported(&params(
            [1, 1, 1 << 16, 1 << 16],
            [1, 1, 1, 1],
            1,
            0,
            1
        )));
    }
}

/// Whether cuDNN may run convolutions and pooling now (loadable and switched on).
pub(super) fn cudnn_on() -> bool {
    self::enabled() && self::is_available()
}
