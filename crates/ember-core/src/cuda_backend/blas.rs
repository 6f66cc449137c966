//! Matrix products on CUDA: f32, f64, f16 and bf16 through cuBLASLt, integers through the tiled
//! kernel of `kernels/matmul.cu`; and the float32 precision switch PyTorch users know as
//! `torch.backends.cuda.matmul.allow_tf32` and `torch.set_float32_matmul_precision`.
//!
//! Note [Row-major GEMM through cuBLASLt]: cuBLASLt is column-major. A row-major `C = A B`
//! (`[m, k] x [k, n]`) is the column-major `Cᵀ = Bᵀ Aᵀ`, so cuBLASLt's (A, B, D) are our (B, A,
//! C) with its (m, n, k) = our (n, m, k). A row-major matrix `X[r, c]` with strides `(rs, cs)`
//! is, read column-major, either `Xᵀ` with leading dimension `rs` (when `cs == 1`: op N) or `X`
//! with leading dimension `cs` (when `rs == 1`: op T, so cuBLASLt transposes it back). Views of
//! either kind (contiguous or transposed) are read in place; any other matrix strides, and batch
//! dims that do not collapse to one stride, are copied to row-major first. Batches are strided
//! batches (stride 0 for broadcast batch dims).
//!
//! Note [cuBLASLt state]: each thread has its own cuBLASLt handle per device (taken from a
//! per-device pool, and returned to it when the thread exits), its own cache of plans (matmul
//! descriptor, matrix layouts and the algorithm the heuristic chose, keyed by everything the
//! choice depends on, so a repeated shape makes no heuristic query) and its own 32 MiB
//! workspace per stream (from the caching allocator, kept until the thread exits), as PyTorch
//! keeps one workspace per (handle, stream). One workspace per stream shared by all threads is
//! not enough: on an H100, 12 threads multiplying small bf16 matrices on the default stream
//! got hundreds of wrong products in 3,600 (each another thread's result; the inputs on the
//! device were right and redoing the product alone was right), even when every thread
//! synchronized after each product, so cuBLASLt's use of a workspace is not ordered by the
//! stream it is given alone. With a workspace per thread, or none, no product was wrong.
//!
//! Note [Bias epilogue]: `linear` with a bias vector is PyTorch's `addmm`: the bias joins the
//! product's f32 (f64 for f64) accumulator and the sum rounds once to the output dtype, where
//! matmul then add would round twice (in f16/bf16 that flips results near zero, and with them ReLU
//! masks). The bias is per column j of our row-major C, so per row of cuBLASLt's column-major D
//! (Note [Row-major GEMM through cuBLASLt]), which is what `CUBLASLT_EPILOGUE_BIAS` adds, broadcast
//! over D's columns; the bias data type is left at its default, D's type, as PyTorch does. The
//! pointer is an attribute of the (cached) descriptor, set before each call (the call reads it when
//! queued). The epilogue is used for one product (no batch, as `linear` makes; PyTorch's path is
//! 2-D too) whose bias is packed (stride 1) and 16-byte aligned (llm.c checks 16 as a cuBLASLt
//! requirement; Marian saw 8 fail on an A100). Elsewhere, and where the heuristic has no algorithm
//! with the epilogue (remembered per thread), D starts as the bias repeated over its columns and
//! the product is added to it (C = D, beta = 1), as PyTorch's fallback does. Seen on an H100
//! (CUDA 13.0), with inputs whose f32 sums are exact: the epilogue rounded once in every f16 case
//! and in small bf16 ones, but for bf16 [64, 255] x [255, 256] it missed the single rounding on
//! 3864 of 16384 results; on inputs of the same kind matmul then add missed on 3891 and PyTorch's
//! `F.linear` (the same epilogue) on 7493: there cuBLASLt, not ember, decides. Where n = 1 the
//! beta = 1 path missed on 3 to 6 of 16 results (PyTorch's fallback, which it takes where
//! k or n is 1, on 3 or 4) and the epilogue on none, so ember takes the epilogue there too.
//!
//! Note [Timed GEMM algorithms]: cuBLASLt's heuristic ranks algorithms by a model, and its first
//! choice is not always the fastest: for GPT-2's MLP products on an H200 ([8192, 768] x [768,
//! 3072] in bf16, with the bias epilogue and without), the first of its eight candidates took
//! 58.6 and 57.0 µs and the seventh 53.1 and 52.3 (docs/benchmarks.md, session 46). With
//! [`tunable::enable`] (PyTorch's `torch.cuda.tunable`, off by default as there), a plan asks for
//! up to `TIMED_CANDIDATES` algorithms and its first product times each on the call's own
//! operands (one warm-up run, then `TIMED_RUNS` between two events; waiting for the stream, so
//! once per shape, as cuDNN's benchmark mode), keeping the fastest for the plan's life. A product
//! that adds to D (beta = 1) cannot be run twice, and none may wait while a CUDA graph is being
//! captured, so those take the heuristic's first choice and leave the timing to the plan's next
//! product. Which algorithm wins may change from run to run, and with it the last bits of the
//! results; leave tuning off where runs must repeat bit for bit. GPT-2's step took 18.25 ms
//! with the heuristic's choices and 18.10 with timed ones (0.9%; docs/benchmarks.md, session 46).

use super::kernels::{Grid, KernelShape};
use super::launch;
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use super::stream::current_raw;
use crate::backend::BackendStorage;
use crate::backend::{CopyOps, MatmulOps};
use crate::layout::Layout;
use crate::{DType, Error, Result, Shape};
use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

/// Workspace handed to cuBLASLt per (device, stream), in bytes (what PyTorch uses on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Plans kept per thread before its cache is cleared (each holds four small descriptors).
const MAX_PLANS: usize = 4096;
/// How many of the heuristic's algorithms are timed against each other per plan, and how many
/// runs each (Note [Timed GEMM algorithms]).
const TIMED_CANDIDATES: usize = 8;
const TIMED_RUNS: usize = 3;
/// Alignment in bytes of a bias pointer that the bias epilogue takes (Note [Bias epilogue]).
const BIAS_ALIGNMENT: u32 = 16;

// ---------------------------------------------------------------------------------------------
// Float32 precision switch.

/// 0 "highest" (true f32), 1 "high" (TF32 allowed), 2 "medium" (bf16 allowed).
static PRECISION: AtomicU8 = AtomicU8::new(0);

/// Sets how float32 matrix products may compute, as `torch.set_float32_matmul_precision`:
/// `"highest"` (the default: full f32), `"high"` (TensorFloat-32 tensor cores allowed) or
/// `"medium"` (bf16-based reduced precision allowed where cuBLASLt offers it).
pub fn set_float32_matmul_precision(precision: &str) -> Result<()> {
    let p = match precision {
        "highest" => 0,
        "high" => 1,
        "medium" => 2,
        other => {
            return Err(Error::invalid(
                "set_float32_matmul_precision",
                format!("expected \"highest\", \"high\" or \"medium\", got {other:?}"),
            ))
        }
    };
    PRECISION.store(p, Ordering::Relaxed);
    Ok(())
}

/// The current float32 matmul precision: `"highest"`, `"high"` or `"medium"`.
pub fn get_float32_matmul_precision() -> &'static str {
    match PRECISION.load(Ordering::Relaxed) {
        0 => "highest",
        1 => "high",
        _ => "medium",
    }
}

/// Allows (or forbids) TensorFloat-32 in float32 matrix products, as
/// `torch.backends.cuda.matmul.allow_tf32 = ...`: `true` sets the precision to `"high"`,
/// `false` to `"highest"`.
pub fn set_allow_tf32(allow: bool) {
    PRECISION.store(u8::from(allow), Ordering::Relaxed);
}

/// Whether float32 matrix products may use reduced precision (TF32 or lower).
pub fn allow_tf32() -> bool {
    PRECISION.load(Ordering::Relaxed) != 0
}

/// Choosing GEMM algorithms by timing, as `torch.cuda.tunable` (PyTorch's TunableOp) does
/// (Note [Timed GEMM algorithms]).
pub mod tunable {
    use std::sync::atomic::{AtomicBool, Ordering};

    static ENABLED: AtomicBool = AtomicBool::new(false);

    /// Turns timing of cuBLASLt's candidate algorithms on or off (`torch.cuda.tunable.enable`).
    /// Off by default, as in PyTorch: each shape then takes the heuristic's first algorithm,
    /// and the same program gives the same bits run after run.
    pub fn enable(on: bool) {
        ENABLED.store(on, Ordering::Relaxed)
    }

    /// Whether GEMM algorithms are chosen by timing (`torch.cuda.tunable.is_enabled`).
    pub fn is_enabled() -> bool {
        ENABLED.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------------------------------------
// Per-device cuBLASLt state (Note [cuBLASLt state]).

struct Handle(sys::cublasLtHandle_t);
// SAFETY: a handle moves between threads only through the pool, so one thread uses it at a
// time (Note [cuBLASLt state]); it is never destroyed.
unsafe impl Send for Handle {}

/// The handles of a device that no thread holds.
#[derive(Default)]
struct DeviceBlas {
    idle_handles: Mutex<Vec<Handle>>,
}

/// What one thread holds (Note [cuBLASLt state]).
#[derive(Default)]
struct ThreadBlas {
    /// Handle per device ordinal.
    handles: HashMap<usize, Handle>,
    plans: HashMap<(usize, PlanKey), Plan>,
    /// Bias-epilogue keys the heuristic found no algorithm for (Note [Bias epilogue]).
    unplanned: HashSet<(usize, PlanKey)>,
    /// Workspace per (device ordinal, raw stream), or None where allocating it failed.
    workspaces: HashMap<(usize, u64), Option<CudaStorage>>,
}

impl Drop for ThreadBlas {
    fn drop(&mut self) {
        // Plans drop (destroying their descriptors) and workspaces go back to the caching
        // allocator on their streams, which orders their reuse after the products queued there;
        // handles go back to their device's pool.
        for (ordinal, handle) in self.handles.drain() {
            if let Some(Ok(device)) = DEVICES.get().and_then(|d| d.get(ordinal)).and_then(OnceLock::get) {
                device
                    .idle_handles
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(handle);
            }
        }
    }
}

thread_local! {
    static THREAD_BLAS: RefCell<ThreadBlas> = RefCell::default();
}

static DEVICES: OnceLock<Vec<OnceLock<std::result::Result<DeviceBlas, Error>>>> = OnceLock::new();

fn blas_error(what: &'static str) -> impl Fn(CublasError) -> Error {
    move |e| Error::Cuda {
        op: "matmul",
        msg: format!("cuBLASLt {what}: {e:?}"),
    }
}

/// The cuBLASLt state of `rt`'s device; `CudaUnavailable` when the library is missing.
fn device_blas(rt: &DeviceRuntime) -> Result<&'static DeviceBlas> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library file (see `is_culib_present`).
    if !*PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        return Err(Error::CudaUnavailable {
            reason: "cuBLASLt (libcublasLt.so.13) could not be loaded, and float matrix products on \
                     CUDA need it; install the CUDA 13 cuBLAS libraries (e.g. the nvidia-cublas pip \
                     package) and put them on LD_LIBRARY_PATH"
                .into(),
        });
    }
    let slots = DEVICES.get_or_init(|| (0..super::device_count()).map(|_| OnceLock::new()).collect());
    let slot = slots
        .get(rt.ordinal)
        .ok_or_else(|| Error::invalid("matmul", format!("device ordinal {} is out of range", rt.ordinal)))?;
    slot.get_or_init(|| Ok(DeviceBlas::default()))
        .as_ref()
        .map_err(Clone::clone)
}

impl ThreadBlas {
    /// This thread's handle for `rt`'s device: its own, a pooled one, or a new one.
    fn handle(&mut self, rt: &DeviceRuntime, device: &DeviceBlas) -> Result<sys::cublasLtHandle_t> {
        if let Some(h) = self.handles.get(&rt.ordinal) {
            return Ok(h.0);
        }
        let pooled = device
            .idle_handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let handle = match pooled {
            Some(h) => h,
            // The device's context is current (runtime() bound it).
            None => Handle(lt::create_handle().map_err(blas_error("cublasLtCreate"))?),
        };
        let raw = handle.0;
        self.handles.insert(rt.ordinal, handle);
        Ok(raw)
    }
}

/// Everything the algorithm choice depends on (cuBLASLt's view: column-major, A/B swapped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    /// D's dtype: `dtype`, or float32 for a widened product of half operands.
    out: DType,
    precision: u8,
    trans_a: bool,
    trans_b: bool,
    /// cuBLASLt's m, n, k.
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldd: i64,
    batch: i32,
    stride_a: i64,
    stride_b: i64,
    stride_d: i64,
    /// Alignment in bytes (a power of two, at most 256) of the A, B and D pointers.
    align: [u32; 3],
    workspace: usize,
    epilogue: Epilogue,
    /// Whether the algorithm is chosen by timing (Note [Timed GEMM algorithms]).
    tuned: bool,
}

/// What cuBLASLt does to the accumulator before rounding it into D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Epilogue {
    /// Nothing: D = alpha·A·B + beta·C.
    Default,
    /// Adds a bias vector, one element per row of D (Note [Bias epilogue]).
    Bias,
    /// Multiplies by the tanh-GELU's derivative at an aux matrix laid out as D (Note
    /// [Activation epilogues] in `autograd/engine.rs`).
    DGelu,
}

/// A matmul descriptor, the layouts of A, B and D (C = D: beta is 0, or 1 to add the product to
/// a bias already in D) and the chosen algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's other candidates, still to be timed against `algo` (Note [Timed GEMM
    /// algorithms]); empty once chosen.
    untimed: Vec<sys::cublasLtMatmulAlgo_t>,
}
impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Plan::new` and is destroyed only here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::F64 => sys::cudaDataType::CUDA_R_64F,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        _ => unreachable!("integer products use matmul.cu"),
    }
}

/// Sets one attribute of a descriptor from a plain value.
fn attr<T>(value: &T) -> (*const c_void, usize) {
    ((value as *const T).cast(), std::mem::size_of::<T>())
}

/// Points the bias epilogue of `desc` at the device address `bias` (Note [Bias epilogue]).
fn set_bias_pointer(desc: sys::cublasLtMatmulDesc_t, bias: u64) -> Result<()> {
    let value = bias as *const c_void;
    let (ptr, size) = attr(&value);
    // SAFETY: `desc` is live (its plan owns it); BIAS_POINTER takes a `const void*` device
    // address, which cuBLASLt only stores here and reads when a product is queued.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            ptr,
            size,
        )
    }
    .map_err(blas_error("cublasLtMatmulDescSetAttribute"))
}

/// Points the aux matrix of an epilogue (DGELU's GELU input) of `desc` at the device address
/// `aux` (Note [Activation epilogues] in `autograd/engine.rs`).
fn set_aux_pointer(desc: sys::cublasLtMatmulDesc_t, aux: u64) -> Result<()> {
    let value = aux as *const c_void;
    let (ptr, size) = attr(&value);
    // SAFETY: `desc` is live (its plan owns it); EPILOGUE_AUX_POINTER takes a `const void*`
    // device address, which cuBLASLt only stores here and reads when a product is queued.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            ptr,
            size,
        )
    }
    .map_err(blas_error("cublasLtMatmulDescSetAttribute"))
}

impl Plan {
    /// `bias` is the bias pointer of the call the plan is made for (with [`Epilogue::Bias`]),
    /// set before the heuristic query as cuBLASLt's samples do; every call sets its own.
    fn new(handle: sys::cublasLtHandle_t, key: &PlanKey, bias: Option<u64>) -> Result<Plan> {
        use sys::cublasComputeType_t as C;
        let (compute, scale) = match (key.dtype, key.precision) {
            (DType::F64, _) => (C::CUBLAS_COMPUTE_64F, sys::cudaDataType::CUDA_R_64F),
            (DType::F32, 1) => (C::CUBLAS_COMPUTE_32F_FAST_TF32, sys::cudaDataType::CUDA_R_32F),
            (DType::F32, 2) => (C::CUBLAS_COMPUTE_32F_FAST_16BF, sys::cudaDataType::CUDA_R_32F),
            _ => (C::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F),
        };
        let (ty, out_ty) = (data_type(key.dtype), data_type(key.out));
        // Build the plan step by step so that `Drop` frees whatever was created if a step fails.
        let mut plan = Plan {
            desc: lt::create_matmul_desc(compute, scale).map_err(blas_error("cublasLtMatmulDescCreate"))?,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            untimed: Vec::new(),
        };
        let op = |t: bool| {
            if t {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        for (which, trans) in [
            (D::CUBLASLT_MATMUL_DESC_TRANSA, op(key.trans_a)),
            (D::CUBLASLT_MATMUL_DESC_TRANSB, op(key.trans_b)),
        ] {
            let value = trans as i32;
            let (ptr, size) = attr(&value);
            // SAFETY: `plan.desc` is live; TRANSA/TRANSB take an int32 (cublasOperation_t).
            unsafe { lt::set_matmul_desc_attribute(plan.desc, which, ptr, size) }
                .map_err(blas_error("cublasLtMatmulDescSetAttribute"))?;
        }
        if key.epilogue == Epilogue::Bias {
            let value = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
            let (ptr, size) = attr(&value);
            // SAFETY: `plan.desc` is live; EPILOGUE takes a uint32 (cublasLtEpilogue_t).
            unsafe { lt::set_matmul_desc_attribute(plan.desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, ptr, size) }
                .map_err(blas_error("cublasLtMatmulDescSetAttribute"))?;
            set_bias_pointer(plan.desc, bias.unwrap_or(0))?;
        }
        if key.epilogue == Epilogue::DGelu {
            let value = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU as u32;
            let ld = key.ldd;
            for (which, (ptr, size)) in [
                (D::CUBLASLT_MATMUL_DESC_EPILOGUE, attr(&value)),
                (D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, attr(&ld)),
            ] {
                // SAFETY: `plan.desc` is live; EPILOGUE takes a uint32 (cublasLtEpilogue_t),
                // EPILOGUE_AUX_LD an int64.
                unsafe { lt::set_matmul_desc_attribute(plan.desc, which, ptr, size) }
                    .map_err(blas_error("cublasLtMatmulDescSetAttribute"))?;
            }
            set_aux_pointer(plan.desc, bias.unwrap_or(0))?;
        }
        // Stored (column-major) shapes: op(A) is m x k, op(B) is k x n, D is m x n.
        let (a_rows, a_cols) = if key.trans_a {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let (b_rows, b_cols) = if key.trans_b {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        let shapes = [
            (a_rows, a_cols, key.lda, key.stride_a),
            (b_rows, b_cols, key.ldb, key.stride_b),
            (key.m, key.n, key.ldd, key.stride_d),
        ];
        for (slot, (rows, cols, ld, stride)) in shapes.into_iter().enumerate() {
            let ty = if slot == 2 { out_ty } else { ty };
            plan.layouts[slot] = lt::create_matrix_layout(ty, rows, cols, ld)
                .map_err(blas_error("cublasLtMatrixLayoutCreate"))?;
            if key.batch > 1 {
                use sys::cublasLtMatrixLayoutAttribute_t as L;
                let (count, offset) = (key.batch, stride);
                for (which, (ptr, size)) in [
                    (L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, attr(&count)),
                    (L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, attr(&offset)),
                ] {
                    // SAFETY: the layout is live; BATCH_COUNT takes an int32, STRIDED_BATCH_OFFSET
                    // an int64, the types of `count` and `offset`.
                    unsafe { lt::set_matrix_layout_attribute(plan.layouts[slot], which, ptr, size) }
                        .map_err(blas_error("cublasLtMatrixLayoutSetAttribute"))?;
                }
            }
        }
        let pref = lt::create_matmul_pref().map_err(blas_error("cublasLtMatmulPreferenceCreate"))?;
        let chosen = (|| {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let workspace = key.workspace as u64;
            let mut prefs = vec![(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, attr(&workspace))];
            // The heuristic assumes 256-byte aligned pointers unless told otherwise; views at an
            // offset may be less aligned.
            for (which, align) in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ]
            .into_iter()
            .zip([&key.align[0], &key.align[1], &key.align[2], &key.align[2]])
            {
                prefs.push((which, attr(align)));
            }
            for (which, (ptr, size)) in prefs {
                // SAFETY: `pref` is live; MAX_WORKSPACE_BYTES takes a uint64, the alignments uint32.
                unsafe { lt::set_matmul_pref_attribute(pref, which, ptr, size) }
                    .map_err(blas_error("cublasLtMatmulPreferenceSetAttribute"))?;
            }
            let [a, b, d] = plan.layouts;
            let wanted = if key.tuned { TIMED_CANDIDATES } else { 1 };
            // SAFETY: the results are plain C structs, for which all-zero bytes are valid.
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
                (0..wanted).map(|_| unsafe { std::mem::zeroed() }).collect();
            let mut found = 0;
            // SAFETY: all descriptors are live and describe this problem; C uses D's layout;
            // `results` holds `wanted` entries and `found` receives how many were written.
            unsafe {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    plan.desc,
                    a,
                    b,
                    d,
                    d,
                    pref,
                    wanted as i32,
                    results.as_mut_ptr(),
                    &mut found,
                )
            }
            .result()
            .map_err(blas_error("cublasLtMatmulAlgoGetHeuristic"))?;
            results.truncate(found.max(0) as usize);
            results.retain(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
            if results.is_empty() {
                return Err(blas_error(
                    "no algorithm for this product (cublasLtMatmulAlgoGetHeuristic)",
                )(CublasError(
                    sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                )));
            }
            Ok(results)
        })();
        // SAFETY: `pref` was created above and is not used after this.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let mut chosen = chosen?.into_iter().filter(|r| r.workspaceSize <= key.workspace);
        let Some(first) = chosen.next() else {
            return Err(Error::Cuda {
                op: "matmul",
                msg: format!(
                    "cuBLASLt has no algorithm for this product within the {} bytes of workspace offered",
                    key.workspace
                ),
            });
        };
        plan.algo = first.algo;
        plan.untimed = chosen.map(|r| r.algo).collect();
        Ok(plan)
    }
}

// ---------------------------------------------------------------------------------------------
// Operands.

/// One operand as cuBLASLt reads it: device address, transpose flag, leading dimension and
/// batch stride (Note [Row-major GEMM through cuBLASLt]). Owns the row-major copy if one was made.
struct Operand {
    ptr: u64,
    trans: bool,
    ld: i64,
    batch_stride: i64,
    _copy: Option<CudaStorage>,
}

/// The one stride that walks the (flattened, row-major) batch dims, if there is one: size-1
/// dims are ignored, each other dim's stride must be the next inner one's stride times its size
/// (all 0 for a broadcast batch).
fn batch_stride(dims: &[usize], strides: &[usize]) -> Option<i64> {
    let mut stride = None;
    let mut expected = None;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d == 1 {
            continue;
        }
        if expected.is_some_and(|e| e != s) {
            return None;
        }
        stride.get_or_insert(s);
        expected = Some(s * d);
    }
    Some(stride.unwrap_or(0) as i64)
}

/// How cuBLASLt reads the row-major `X[r, c]` with strides `(rs, cs)` as `Xᵀ` in column-major:
/// `(transpose, leading dimension)`, or None when neither form fits. The stride of a size-1 dim
/// is free, so it is chosen to satisfy cuBLASLt's `ld >= max(1, rows)`.
fn matrix_form(r: usize, c: usize, rs: usize, cs: usize) -> Option<(bool, i64)> {
    // N: stored column-major c x r (= Xᵀ), element (j, i) at i*rs + j.
    if cs == 1 || c == 1 {
        let ld = if r == 1 { c.max(1) } else { rs };
        if ld >= c.max(1) {
            return Some((false, ld as i64));
        }
    }
    // T: stored column-major r x c (= X), element (i, j) at i + j*cs.
    if rs == 1 || r == 1 {
        let ld = if c == 1 { r.max(1) } else { cs };
        if ld >= r.max(1) {
            return Some((true, ld as i64));
        }
    }
    None
}

impl Operand {
    /// The matrix operand `x` at `l` (`[B.., r, c]`), copied to row-major when cuBLASLt cannot
    /// read it in place.
    fn new(x: &CudaStorage, l: &Layout) -> Result<Operand> {
        let rank = l.dims().len();
        let (r, c) = (l.dims()[rank - 2], l.dims()[rank - 1]);
        let (rs, cs) = (l.strides()[rank - 2], l.strides()[rank - 1]);
        let batch = batch_stride(&l.dims()[..rank - 2], &l.strides()[..rank - 2]);
        if let (Some(batch_stride), Some((trans, ld))) = (batch, matrix_form(r, c, rs, cs)) {
            return Ok(Operand {
                ptr: x.ptr(l),
                trans,
                ld,
                batch_stride,
                _copy: None,
            });
        }
        let copy = x.to_dtype(l, x.dtype())?;
        Ok(Operand {
            ptr: copy.ptr_at(0),
            trans: false,
            ld: c.max(1) as i64,
            batch_stride: (r * c) as i64,
            _copy: Some(copy),
        })
    }
}

/// `f` with this thread's cuBLASLt state (Note [cuBLASLt state]), all of it under the CUPTI
/// gate: cuBLASLt loads kernels on their first use and may fill (Note [CUPTI beside other
/// threads' CUDA work] in `cupti.rs`).
fn with_thread_blas<T>(f: impl FnOnce(&mut ThreadBlas) -> Result<T>) -> Result<T> {
    let _gate = super::cupti::work_guard();
    THREAD_BLAS
        .try_with(|thread| f(&mut thread.borrow_mut()))
        .map_err(|_| Error::Cuda {
            op: "matmul",
            msg: "called while the thread is exiting (its cuBLASLt state is gone)".into(),
        })?
}

/// The largest power of two (at most 256) dividing `ptr`: the alignment cuBLASLt may assume.
fn alignment(ptr: u64) -> u32 {
    (1u32 << ptr.trailing_zeros().min(8)).min(256)
}

/// One cuBLASLt product into `d` on `stream` (Note [Row-major GEMM through cuBLASLt]): our
/// `[m, k]` lhs (`b`, cuBLASLt's B, given per call so that row blocks of it can be multiplied
/// one by one) times the `[k, n]` rhs (`a`, cuBLASLt's A), written `ldd` elements apart per
/// row of `d` (`n` for a whole product, more for a block of its columns).
struct Gemm<'a> {
    rt: &'a DeviceRuntime,
    blas: &'static DeviceBlas,
    dtype: DType,
    /// D's dtype (PlanKey::out).
    out: DType,
    stream: u64,
    a: &'a Operand,
    k: usize,
    n: usize,
    ldd: usize,
    batch: i32,
}

impl<'a> Gemm<'a> {
    /// The products of `batch` whole `[.., k, n]` right operands `a` on the current stream:
    /// D `n` elements a row, in `dtypes.1` from operands of `dtypes.0`.
    fn new(
        rt: &'a DeviceRuntime,
        blas: &'static DeviceBlas,
        dtypes: (DType, DType),
        a: &'a Operand,
        k: usize,
        n: usize,
        batch: i32,
    ) -> Gemm<'a> {
        Gemm {
            rt,
            blas,
            dtype: dtypes.0,
            out: dtypes.1,
            stream: current_raw(rt.ordinal),
            a,
            k,
            n,
            ldd: n,
            batch,
        }
    }

    /// The product of the `m` rows at `b`, with the bias epilogue reading the bias at `fused`
    /// (or with [`Epilogue::DGelu`] as `epilogue`, the DGELU epilogue reading its aux matrix
    /// there), or added to `d`'s contents (beta = 1) with `add_to_d`. Ok(false): the heuristic
    /// has no algorithm with the epilogue.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        thread: &mut ThreadBlas,
        b: &Operand,
        m: usize,
        d: u64,
        fused: Option<u64>,
        add_to_d: bool,
    ) -> Result<bool> {
        self.run_with(thread, b, m, d, fused.map(|p| (Epilogue::Bias, p)), add_to_d)
    }

    /// [`Gemm::run`] with the epilogue and its pointer (bias vector or aux matrix) given.
    fn run_with(
        &self,
        thread: &mut ThreadBlas,
        b: &Operand,
        m: usize,
        d: u64,
        epilogue: Option<(Epilogue, u64)>,
        add_to_d: bool,
    ) -> Result<bool> {
        let fused = epilogue.map(|(_, p)| p);
        let Gemm {
            rt,
            dtype,
            out,
            stream,
            a,
            k,
            n,
            ldd,
            batch,
            ..
        } = *self;
        let handle = thread.handle(rt, self.blas)?;
        let (workspace_ptr, workspace) = thread
            .workspaces
            .entry((rt.ordinal, stream))
            .or_insert_with(|| super::library_buffer(rt, DType::U8, WORKSPACE_BYTES).ok())
            .as_ref()
            .map_or((0, 0), |w| (w.ptr_at(0), w.len()));
        let key = PlanKey {
            dtype,
            out,
            precision: if dtype == DType::F32 {
                PRECISION.load(Ordering::Relaxed)
            } else {
                0
            },
            trans_a: a.trans,
            trans_b: b.trans,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            lda: a.ld,
            ldb: b.ld,
            ldd: ldd as i64,
            batch,
            stride_a: a.batch_stride,
            stride_b: b.batch_stride,
            stride_d: (m * ldd) as i64,
            align: [alignment(a.ptr), alignment(b.ptr), alignment(d)],
            workspace,
            epilogue: epilogue.map_or(Epilogue::Default, |(e, _)| e),
            tuned: tunable::is_enabled(),
        };
        if thread.unplanned.contains(&(rt.ordinal, key)) {
            return Ok(false);
        }
        let plans = &mut thread.plans;
        if plans.len() >= MAX_PLANS && !plans.contains_key(&(rt.ordinal, key)) {
            plans.clear();
            thread.unplanned.clear();
        }
        let plan = match plans.entry((rt.ordinal, key)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => match Plan::new(handle, &key, fused) {
                Ok(plan) => e.insert(plan),
                Err(_) if key.epilogue != Epilogue::Default => {
                    thread.unplanned.insert((rt.ordinal, key));
                    return Ok(false);
                }
                Err(err) => return Err(err),
            },
        };
        match (key.epilogue, fused) {
            (Epilogue::Bias, Some(ptr)) => set_bias_pointer(plan.desc, ptr)?,
            (Epilogue::DGelu, Some(ptr)) => set_aux_pointer(plan.desc, ptr)?,
            _ => {}
        }
        let beta = if add_to_d { 1.0 } else { 0.0 };
        let (alpha32, beta32, alpha64, beta64) = (1.0f32, beta as f32, 1.0f64, beta);
        let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
            ((&alpha64 as *const f64).cast(), (&beta64 as *const f64).cast())
        } else {
            ((&alpha32 as *const f32).cast(), (&beta32 as *const f32).cast())
        };
        let (desc, [la, lb, ld]) = (plan.desc, plan.layouts);
        let call = |algo: &sys::cublasLtMatmulAlgo_t| {
            super::kernel_timing::note_work(stream);
            // SAFETY: the plan's layouts describe exactly the memory read and written: A from
            // `a.ptr` (`lda`, `stride_a` as derived from rhs's valid layout, or its row-major
            // copy, kept alive in `a` until the call is queued and then released to the
            // allocator on this stream, which orders its reuse after the product), B likewise
            // from lhs (for a row block, its `m` rows from `b.ptr`, inside the lhs), and D = C
            // the `batch * m` rows of `n` elements, `ldd` apart, at `d` (the caller's output, or
            // its rows or columns of a block, inside it), read (beta = 1) only where they hold
            // the bias written on this stream. The bias epilogue reads cuBLASLt's m (our n)
            // packed elements of D's type at the pointer set above (the caller's bias, 16-byte
            // aligned, alive until the call is queued and then ordered by the allocator as A and
            // B are). alpha/beta point to host scalars of the scale type (f64 for 64F compute,
            // f32 otherwise) that live across the call (host pointer mode reads them before it
            // returns). `algo` is one the heuristic returned for this plan's descriptors, within
            // the workspace, which holds `workspace` bytes and is used only on `stream`, the
            // stream of every other op here. The handle and the plan are this thread's alone
            // (Note [cuBLASLt state]).
            unsafe {
                lt::matmul(
                    handle,
                    desc,
                    alpha,
                    beta,
                    a.ptr as *const c_void,
                    la,
                    b.ptr as *const c_void,
                    lb,
                    d as *const c_void,
                    ld,
                    d as *mut c_void,
                    ld,
                    algo,
                    workspace_ptr as *mut c_void,
                    workspace,
                    stream as sys::cudaStream_t,
                )
            }
            .map_err(blas_error("cublasLtMatmul"))
        };
        if !add_to_d && super::sanitizer_workarounds() {
            // Note [Library outputs under initcheck] in `mod.rs`: D's `batch * m` rows of `n`
            // elements, `ldd` apart, zeroed on the product's stream.
            let elem = out.size_in_bytes();
            // SAFETY: the rows lie inside the caller's output at `d` (the product writes exactly
            // them), on `stream`, the product's own stream.
            unsafe {
                cudarc::driver::sys::cuMemsetD2D8Async(
                    d,
                    ldd * elem,
                    0,
                    n * elem,
                    batch as usize * m,
                    stream as cudarc::driver::sys::CUstream,
                )
            }
            .result()
            .map_err(super::storage::cuda_error("cuMemsetD2D8Async"))?;
        }
        // Note [Timed GEMM algorithms]: D is only written (beta = 0), so trial runs are harmless;
        // no capture may be underway, since timing waits for the stream.
        if !plan.untimed.is_empty() && !add_to_d && !super::capture::any_underway() {
            let on = super::stream::current_stream(rt.ordinal)?;
            let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
            for algo in std::iter::once(plan.algo).chain(std::mem::take(&mut plan.untimed)) {
                let (start, end) = (super::Event::new(true), super::Event::new(true));
                let timed = call(&algo)
                    .and_then(|()| start.record_on(&on))
                    .and_then(|()| (0..TIMED_RUNS).try_for_each(|_| call(&algo)))
                    .and_then(|()| end.record_on(&on))
                    .and_then(|()| end.synchronize())
                    .and_then(|()| start.elapsed_time(&end));
                if let Ok(ms) = timed {
                    if best.is_none_or(|(b, _)| ms < b) {
                        best = Some((ms, algo));
                    }
                }
            }
            if let Some((_, algo)) = best {
                plan.algo = algo;
            }
        }
        call(&plan.algo)?;
        Ok(true)
    }
}

// ---------------------------------------------------------------------------------------------
// The product.

impl CudaStorage {
    /// The product, and with `bias` the bias added (floats only), through cuBLASLt, written in
    /// `out_dtype` (the operands' dtype, or float32 for half operands without a bias); integer
    /// products go to `int_matmul`.
    fn lt_matmul(
        &self,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        bias: Option<(&CudaStorage, &Layout)>,
        out_dtype: DType,
    ) -> Result<CudaStorage> {
        let dtype = self.dtype();
        debug_assert!(
            out_dtype == dtype || (bias.is_none() && out_dtype == DType::F32 && dtype.is_floating_point())
        );
        if dtype != rhs.dtype() {
            return Err(Error::DTypeMismatch {
                op: "matmul",
                expected: dtype,
                found: rhs.dtype(),
            });
        }
        if dtype == DType::Bool {
            return Err(Error::UnsupportedDType {
                op: "matmul",
                dtype,
                hint: "convert to an integer or float dtype first",
            });
        }
        if self.ordinal() != rhs.ordinal() {
            return Err(Error::DeviceMismatch {
                op: "matmul",
                lhs: self.device(),
                rhs: rhs.device(),
            });
        }
        let rank = al.dims().len();
        assert!(
            rank >= 2 && bl.dims().len() == rank,
            "matmul layouts must share rank >= 2"
        );
        let (m, k, n) = (al.dims()[rank - 2], al.dims()[rank - 1], bl.dims()[rank - 1]);
        assert_eq!(bl.dims()[rank - 2], k, "inner dims checked by the caller");
        assert_eq!(
            al.dims()[..rank - 2],
            bl.dims()[..rank - 2],
            "batch dims broadcast by the caller"
        );
        let batch: usize = al.dims()[..rank - 2].iter().product();
        let rt = self.runtime()?;
        let out_len = batch * m * n;
        if !dtype.is_floating_point() {
            return self.int_matmul(rt, al, rhs, bl, (batch, m, k, n));
        }
        // Checked before the empty cases so that a missing library shows up on any product.
        let blas = device_blas(rt)?;
        if out_len == 0 {
            return CudaStorage::alloc_on(rt, out_dtype, 0);
        }
        // The bias repeated over every row of every product, as a new row-major storage.
        let bias_rows = |(c, cl): (&CudaStorage, &Layout)| {
            let rows = Layout::new(
                Shape::from([out_len / n, n]),
                vec![0, cl.strides()[0]],
                cl.offset(),
            );
            c.to_dtype(&rows, dtype)
        };
        if k == 0 {
            return match bias {
                Some(c) => bias_rows(c), // an empty sum is 0
                None => CudaStorage::full(rt.ordinal, out_dtype, out_len, 0.0),
            };
        }
        let batch = i32::try_from(batch).map_err(|_| {
            Error::invalid(
                "matmul",
                format!("{batch} matrices in one batched product exceed cuBLASLt's limit of 2^31 - 1"),
            )
        })?;
        // The bias pointer where the epilogue can take it; elsewhere the product is added to the
        // bias repeated over the rows of `out` (Note [Bias epilogue]).
        let epilogue_bias = bias
            .map(|(c, cl)| (c.ptr(cl), cl.strides()[0]))
            .filter(|&(ptr, stride)| batch == 1 && stride == 1 && alignment(ptr) >= BIAS_ALIGNMENT)
            .map(|(ptr, _)| ptr);
        let mut out = match bias {
            Some(c) if epilogue_bias.is_none() => bias_rows(c)?,
            _ => CudaStorage::alloc_on(rt, out_dtype, out_len)?,
        };
        // cuBLASLt's A is our rhs, its B our lhs (Note [Row-major GEMM through cuBLASLt]).
        let (a, b) = (Operand::new(rhs, bl)?, Operand::new(self, al)?);
        let gemm = Gemm::new(rt, blas, (dtype, out_dtype), &a, k, n, batch);
        let product = |t: &mut ThreadBlas, d: u64, fused: Option<u64>, add_to_d: bool| {
            gemm.run(t, &b, m, d, fused, add_to_d)
        };
        let add_to_d = bias.is_some() && epilogue_bias.is_none();
        if !with_thread_blas(|t| product(t, out.ptr_at(0), epilogue_bias, add_to_d))? {
            // No algorithm takes the bias epilogue here: add the product to the bias instead.
            out = bias_rows(bias.expect("only the bias epilogue can find no algorithm"))?;
            with_thread_blas(|t| product(t, out.ptr_at(0), None, true))?;
        }
        Ok(out)
    }

    /// The float product of `[m, k]` (`al`) and `[k, n]` (`bl`) as a new row-major `[m, n]`
    /// storage, computed in the row blocks of `row_block_ranges(m, blocks)`, each product
    /// followed by an event recorded on the current stream: the event of rows `r` completes
    /// once those rows are written (Note [Gradients in row blocks] in `storage/row_blocks.rs`).
    pub(crate) fn matmul_row_blocks(
        &self,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        blocks: usize,
    ) -> Result<(CudaStorage, Vec<super::RowBlockEvent>)> {
        let dtype = self.dtype();
        let (&[m, k], &[_, n]) = (al.dims(), bl.dims()) else {
            return Ok((self.lt_matmul(al, rhs, bl, None, dtype)?, Vec::new()));
        };
        let plain = dtype.is_floating_point() && dtype == rhs.dtype() && self.ordinal() == rhs.ordinal();
        if !plain || m == 0 || k == 0 || n == 0 {
            return Ok((self.lt_matmul(al, rhs, bl, None, dtype)?, Vec::new()));
        }
        let rt = self.runtime()?;
        let blas = device_blas(rt)?;
        let out = CudaStorage::alloc_on(rt, dtype, m * n)?;
        let (a, b) = (Operand::new(rhs, bl)?, Operand::new(self, al)?);
        let gemm = Gemm::new(rt, blas, (dtype, dtype), &a, k, n, 1);
        let current = super::stream::current_stream(rt.ordinal)?;
        let ranges = super::row_blocks::row_block_ranges(m, blocks);
        let mut events = Vec::with_capacity(ranges.len());
        for std::ops::Range { start: r0, end: r1 } in ranges {
            // Row r0 of the lhs: at r0 * ld read as op N (rows are ld apart), at r0 as op T
            // (rows are adjacent, columns ld apart).
            let skip = if b.trans { r0 } else { r0 * b.ld as usize };
            let part = Operand {
                ptr: b.ptr + (skip * dtype.size_in_bytes()) as u64,
                _copy: None,
                ..b
            };
            with_thread_blas(|t| gemm.run(t, &part, r1 - r0, out.ptr_at(r0 * n), None, false))?;
            events.push(super::RowBlockEvent {
                rows: r0..r1,
                event: current.record_event()?,
            });
        }
        Ok((out, events))
    }

    /// [`MatmulOps::matmul_bias`] of `[m, k]` (`al`) and the column-major `[k, n]` (`bl`, a
    /// transposed `[n, k]` weight, as in `linear`) whose weight rows are still arriving:
    /// `arrivals` are the events of its row blocks, which are blocks of columns of the
    /// product. Each block of columns is computed on the current stream once its rows have
    /// arrived (Note [Copies in row blocks] in `storage/row_blocks.rs`); where the blocks cannot be
    /// multiplied one by one, the stream waits for all of them and the product is one.
    pub(crate) fn matmul_bias_in_column_blocks(
        &self,
        al: &Layout,
        (rhs, bl): (&CudaStorage, &Layout),
        (bias, bias_l): (&CudaStorage, &Layout),
        arrivals: &[super::RowBlockEvent],
    ) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let current = super::stream::current_stream(rt.ordinal)?;
        let dtype = self.dtype();
        let plain = dtype.is_floating_point()
            && dtype == rhs.dtype()
            && dtype == bias.dtype()
            && self.ordinal() == rhs.ordinal()
            && self.ordinal() == bias.ordinal();
        let whole = || -> Result<CudaStorage> {
            for block in arrivals {
                current.wait_event(&block.event)?;
            }
            self.matmul_bias(al, rhs, bl, bias, bias_l)
        };
        let (&[m, k], &[_, n]) = (al.dims(), bl.dims()) else {
            return whole();
        };
        let packed_bias = bias_l.strides() == [1] && alignment(bias.ptr(bias_l)) >= BIAS_ALIGNMENT;
        let tiled = arrivals.last().is_some_and(|b| b.rows.end == n)
            && arrivals.first().is_some_and(|b| b.rows.start == 0)
            && arrivals.windows(2).all(|w| w[0].rows.end == w[1].rows.start);
        if !plain || m == 0 || k == 0 || !packed_bias || !tiled {
            return whole();
        }
        let blas = device_blas(rt)?;
        let (a, b) = (Operand::new(rhs, bl)?, Operand::new(self, al)?);
        if !a.trans {
            return whole();
        }
        let out = CudaStorage::alloc_on(rt, dtype, m * n)?;
        let size = dtype.size_in_bytes() as u64;
        for (i, block) in arrivals.iter().enumerate() {
            let (c0, c1) = (block.rows.start, block.rows.end);
            current.wait_event(&block.event)?;
            // Columns c0..c1 of our product are rows c0..c1 of cuBLASLt's D (our weight's rows,
            // cuBLASLt's op(A) = Aᵀ rows, `ld` apart in the stored A).
            let part = Operand {
                ptr: a.ptr + c0 as u64 * a.ld as u64 * size,
                _copy: None,
                ..a
            };
            let gemm = Gemm {
                rt,
                blas,
                dtype,
                out: dtype,
                stream: current.as_raw(),
                a: &part,
                k,
                n: c1 - c0,
                ldd: n,
                batch: 1,
            };
            let bias_at = bias.ptr(bias_l) + c0 as u64 * size;
            let d = out.ptr_at(0) + c0 as u64 * size;
            if !with_thread_blas(|t| gemm.run(t, &b, m, d, Some(bias_at), false))? {
                if i == 0 {
                    return whole(); // no algorithm takes the bias epilogue here
                }
                return Err(Error::Cuda {
                    op: "linear",
                    msg: "cuBLASLt took the bias epilogue for one block of columns and not for the next"
                        .into(),
                });
            }
        }
        Ok(out)
    }

    /// Integer products with `matmul.cu`'s tiled kernel (wrapping, as the CPU).
    fn int_matmul(
        &self,
        rt: &DeviceRuntime,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        (batch, m, k, n): (usize, usize, usize, usize),
    ) -> Result<CudaStorage> {
        let out = CudaStorage::alloc_on(rt, self.dtype(), batch * m * n)?;
        if out.is_empty() {
            return Ok(out);
        }
        let rank = al.dims().len();
        let shape = KernelShape::new(
            "matmul",
            &al.dims()[..rank - 2],
            &[&al.strides()[..rank - 2], &bl.strides()[..rank - 2]],
        )?;
        const TILE: usize = 16;
        const MAX_GRID_YZ: usize = 65535;
        let grid = Grid {
            grid: (
                n.div_ceil(TILE).min(i32::MAX as usize) as u32,
                m.div_ceil(TILE).min(MAX_GRID_YZ) as u32,
                batch.min(MAX_GRID_YZ) as u32,
            ),
            block: (TILE as u32, TILE as u32, 1),
            shared_bytes: 0,
        };
        let (a, b, o) = (self.dev_ptr(al), rhs.dev_ptr(bl), out.dev_ptr_mut_at(0));
        let (batch, m, k, n) = (batch as i64, m as i64, k as i64, n as i64);
        let s = |l: &Layout, d: usize| l.strides()[d] as i64;
        let (ars, acs, brs, bcs) = (s(al, rank - 2), s(al, rank - 1), s(bl, rank - 2), s(bl, rank - 1));
        // `a` and `b` are read only at offsets their valid layouts reach (batch offsets through
        // `shape`, matrix elements through their strides, indices bounded by m, k, n), `out`
        // holds `batch * m * n` elements. Block (16, 16, 1) as the kernel requires.
        let dtypes = [self.dtype()];
        launch::matmul(
            rt, &dtypes, grid, a, b, o, &shape, batch, m, k, n, ars, acs, brs, bcs,
        )?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_strides_collapse_only_when_linear() {
        assert_eq!(batch_stride(&[], &[]), Some(0));
        assert_eq!(batch_stride(&[2, 3], &[60, 20]), Some(20));
        assert_eq!(batch_stride(&[2, 3], &[0, 0]), Some(0));
        assert_eq!(batch_stride(&[2, 1, 3], &[60, 7, 20]), Some(20));
        assert_eq!(batch_stride(&[2, 3], &[0, 20]), None);
        assert_eq!(batch_stride(&[2, 3], &[20, 60]), None);
        assert_eq!(batch_stride(&[4], &[0]), Some(0));
    }

    #[test]
    fn matrix_forms() {
        // Contiguous [3, 5]: op N, ld 5. Its transpose view [5, 3] strides (1, 5): op T, ld 5.
        assert_eq!(matrix_form(3, 5, 5, 1), Some((false, 5)));
        assert_eq!(matrix_form(5, 3, 1, 5), Some((true, 5)));
        // A row of a wider matrix (narrowed columns): ld is the parent's row length.
        assert_eq!(matrix_form(3, 4, 10, 1), Some((false, 10)));
        // Size-1 dims with arbitrary strides.
        assert_eq!(matrix_form(1, 7, 1, 1), Some((false, 7)));
        assert_eq!(matrix_form(7, 1, 1, 1), Some((false, 1)));
        assert_eq!(matrix_form(7, 1, 3, 9), Some((false, 3)));
        // Broadcast rows (stride 0) or both strides > 1: copied.
        assert_eq!(matrix_form(4, 6, 0, 1), None);
        assert_eq!(matrix_form(4, 6, 12, 2), None);
    }

    #[test]
    fn alignments() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1004), 4);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1080), 128);
    }
}

/// cuBLASLt's products (`lt_matmul`) and its epilogues.
impl MatmulOps for CudaStorage {
    /// The batched product of `[B.., m, k]` (`al`) and `[B.., k, n]` (`bl`), two layouts with the
    /// same batch dims (broadcast ones have stride 0), as a new row-major `[B.., m, n]` storage.
    fn matmul(&self, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
        self.lt_matmul(al, rhs, bl, None, self.dtype())
    }

    /// [`MatmulOps::matmul`] of two float16 or bfloat16 operands written in float32: the
    /// float32 accumulator stored as it is, not rounded to the operands' dtype (Note [Widened
    /// gradients] in `ops/matmul.rs`).
    fn matmul_widened(&self, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<Option<CudaStorage>> {
        if !matches!(self.dtype(), DType::BF16 | DType::F16) {
            return Ok(None);
        }
        self.lt_matmul(al, rhs, bl, None, DType::F32).map(Some)
    }

    /// The 2-D product with cuBLASLt's DGELU epilogue reading
    /// `aux`, or None where it does not apply (other dtypes, an aux not laid out as the
    /// product, n not a multiple of 8, or no algorithm with the epilogue).
    fn matmul_dgelu(
        &self,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        (aux, xl): (&CudaStorage, &Layout),
    ) -> Result<Option<CudaStorage>> {
        let dtype = self.dtype();
        let (&[m, k], &[k2, n]) = (al.dims(), bl.dims()) else {
            return Ok(None);
        };
        // Half dtypes only: in f32 the epilogue's GELU derivative was 1.7e-5 (relative) from the
        // f64-evaluated one of GELU's backward kernel (Note [Activation epilogues]).
        let plain = matches!(dtype, DType::BF16 | DType::F16)
            && rhs.dtype() == dtype
            && aux.dtype() == dtype
            && k == k2
            && m > 0
            && n > 0
            && k > 0
            && n % 8 == 0
            && xl.dims() == [m, n]
            && xl.strides() == [n, 1]
            && self.ordinal() == rhs.ordinal()
            && self.ordinal() == aux.ordinal();
        // The heuristic reads the aux pointer's alignment when the plan is made, which the key
        // does not hold: only fully aligned matrices (every fresh allocation) take the epilogue.
        if !plain || alignment(aux.ptr(xl)) < 256 {
            return Ok(None);
        }
        let rt = self.runtime()?;
        let blas = device_blas(rt)?;
        let out = CudaStorage::alloc_on(rt, dtype, m * n)?;
        let (a, b) = (Operand::new(rhs, bl)?, Operand::new(self, al)?);
        let gemm = Gemm::new(rt, blas, (dtype, dtype), &a, k, n, 1);
        let epilogue = Some((Epilogue::DGelu, aux.ptr(xl)));
        if !with_thread_blas(|t| gemm.run_with(t, &b, m, out.ptr_at(0), epilogue, false))? {
            return Ok(None);
        }
        Ok(Some(out))
    }

    /// [`MatmulOps::matmul`] plus `bias` (`[n]` at `bias_l`, any stride) added to every row of
    /// each product before the one rounding to the output dtype (Note [Bias epilogue]): `out[..,
    /// i, j] = Σ_k a[.., i, k]·b[.., k, j] + bias[j]`. Floats only.
    fn matmul_bias(
        &self,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        bias: &CudaStorage,
        bias_l: &Layout,
    ) -> Result<CudaStorage> {
        let dtype = self.dtype();
        if bias.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                op: "linear",
                expected: dtype,
                found: bias.dtype(),
            });
        }
        if !dtype.is_floating_point() {
            return Err(Error::UnsupportedDType {
                op: "matmul with a bias",
                dtype,
                hint: "only float products take a fused bias; use matmul then add",
            });
        }
        if bias.ordinal() != self.ordinal() {
            return Err(Error::DeviceMismatch {
                op: "linear",
                lhs: self.device(),
                rhs: bias.device(),
            });
        }
        let n = bl.dims()[bl.dims().len() - 1];
        assert_eq!(bias_l.dims(), [n], "bias of [n] checked by the caller");
        self.lt_matmul(al, rhs, bl, Some((bias, bias_l)), dtype)
    }
}
